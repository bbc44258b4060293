// Hostname pinning's view of the sandbox (docs/pinning.md): what names
// egressd learned for an address, what the phase in force allows, and the
// `denied` records of flows the reader reset.
#include "daemon/sandbox.h"

namespace egressd::daemon {

std::vector<std::string> Sandbox::learned_names_for(const IpPrefix& addr) const {
  // A walk over the remembered (name, address) pairs (at most max_learned):
  // one per inspected flow, not per packet.
  std::vector<std::string> out;
  const auto now = Clock::now();
  for (const auto& [name, addrs] : learned_) {
    for (const auto& a : addrs) {
      if (a.addr == addr && a.expires > now) {
        out.push_back(name);
        break;
      }
    }
  }
  return out;
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
