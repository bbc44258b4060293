// Hostname pinning's view of the sandbox (docs/pinning.md): what names
// egressd learned for an address, what the phase in force allows, and the
// `denied` records of flows the reader reset.
#include "daemon/sandbox.h"

namespace egressd::daemon {

std::vector<std::string> Sandbox::learned_names_for(const IpPrefix& addr) const {
  // From the store's address index: one lookup per inspected flow.
  return learned_.names_for(addr);
}

const Entry* Sandbox::allowed_name(std::string_view name) const {
  if (state_.mode != Mode::allowlist) return nullptr;
  return active_facts_->matcher->match(name);
}

void Sandbox::pin_reset(const IpPrefix& dst, std::uint16_t port, const std::string& reason) {
  const bool fresh = denied_.add_pin_reset(dst, port, reason, state_.phase, [&] { return names_.names_for(dst); });
  if (fresh) wake_denied_waiters();
}

}  // namespace egressd::daemon
