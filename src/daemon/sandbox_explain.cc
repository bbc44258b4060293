// Sandbox's `explain` command: gathers what this sandbox knows (the phase,
// its learned addresses, the names behind an address) and hands it to the
// pure audit::explain, which makes the decision.
#include "audit/explain.h"
#include "control/protocol.h"
#include "daemon/sandbox.h"

#include <algorithm>

namespace egressd::daemon {

nlohmann::json Sandbox::explain_reply(const control::ExplainRequest& req) const {
  using control::error_reply;
  // Checked when the request was decoded; parsed again here into what is explained.
  auto target = audit::parse_target(req.target);
  if (!target) return error_reply(target.error(), "invalid_request");

  const Phase* phase = nullptr;
  if (req.phase) {
    phase = opts_.policy.find(*req.phase);
    if (phase == nullptr) return unknown_phase_reply(*req.phase);
  } else {
    // Answering from a guess would be worse than not answering: the kernel
    // enforces entries this process cannot see.
    if (inline_unknown_) {
      return error_reply("unavailable",
                         "the inline policy in force was adopted without its state file, so its entries are unknown "
                         "here; ask about a named phase with \"phase\", or apply the policy again");
    }
    phase = &active_phase();
  }

  const auto now = learned_.now();
  audit::LearnedView live;
  for (const auto& [name, addrs] : learned_.by_name()) {
    for (const auto& a : addrs) {
      if (a.expires > now) live[name].push_back(a.addr);
    }
  }
  // Every name remembered for the address, expired answers included: they
  // still say where the address came from.
  const audit::NamesFor names_for = [this](const IpPrefix& addr) {
    std::vector<std::string> names = learned_.names_for(addr, true);
    // Names observed in any phase (public included) and refused names the
    // index tied to this address, most recent first, without repeats.
    for (auto& n : names_.names_for(addr)) {
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(std::move(n));
    }
    return names;
  };
  // egressd's loopback upstreams (Docker's 127.0.0.11), which chain output
  // keeps from everybody else when the DNS proxy runs.
  std::vector<IpPrefix> lo_upstreams;
  if (opts_.compile.dns_port != 0) {
    for (const auto* list : {&opts_.compile.upstreams, &opts_.compile.extra_upstreams}) {
      for (const auto& u : *list) {
        const std::string set = upstream_set(u);
        if (set == nft::kLoUpstreamSet4 || set == nft::kLoUpstreamSet6) lo_upstreams.push_back(u);
      }
    }
  }
  return control::ok_reply(
      audit::explain(*phase, *target, live, names_for, lo_upstreams, opts_.policy.dns.private_answers,
                     opts_.compile.pin && opts_.policy.enforce.pin_names)
          .to_json());
}

}  // namespace egressd::daemon
