// Hostname pinning's view of the sandbox (docs/pinning.md): what names
// egressd learned for an address, what the phase in force allows, and the
// `denied` records of flows the reader reset.
#include "daemon/sandbox.h"

#include <algorithm>

namespace egressd::daemon {

std::vector<std::string> Sandbox::learned_names_for(const IpPrefix& addr) const {
  // From the store's address index: one lookup per inspected flow.
  return learned_.names_for(addr);
}

const Entry* Sandbox::allowed_name(std::string_view name) const {
  if (state_.mode != Mode::allowlist) return nullptr;
  return active_facts_->matcher->match(name);
}

bool Sandbox::allowed_by_address_entry(const IpPrefix& dst) const {
  for (const auto& e : active_phase().entries) {
    if (!e.is_name() && e.ip.family == dst.family && e.ip.contains(dst)) return true;
  }
  return false;
}

bool Sandbox::pin_keeps(const std::string& name, const IpPrefix& dst) const {
  if (inline_unknown_) return false;  // entries unknown here: fail closed
  const Phase& phase = active_phase();
  switch (phase.mode) {
    case Mode::public_: return true;
    case Mode::no_network: return false;
    case Mode::allowlist: break;
  }
  if (allowed_by_address_entry(dst)) return true;
  if (allowed_name(name) == nullptr) return false;
  const auto names = learned_.names_for(dst);
  return std::find(names.begin(), names.end(), name) != names.end();
}

void Sandbox::pin_reset(const IpPrefix& dst, std::uint16_t port, const std::string& reason) {
  const bool fresh = denied_.add_pin_reset(dst, port, reason, state_.phase, [&] { return names_.names_for(dst); });
  if (fresh) wake_denied_waiters();
}

}  // namespace egressd::daemon
