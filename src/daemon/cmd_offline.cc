// `egressd check` and `egressd render`: no kernel, no privileges.
#include <iostream>
#include <map>

#include "daemon/audit_log.h"
#include "daemon/commands.h"
#include "egressd/policy.h"
#include "egressd/policy_input.h"
#include "daemon/sandbox.h"
#include "dns/proxy.h"
#include "nft/compile.h"

namespace egressd::daemon {

int report(const Error& err) {
  const int code = err.kind == ErrorKind::invalid ? 2 : 1;
  // `run` / `agent` with --log-format json: every line on stderr is JSON, a
  // start-up error too (a collector parsing the log would drop a plain one).
  if (logging_json()) {
    audit_event("startup_failed", {{"error", err.message}, {"exit", code}}, spdlog::level::err);
    return code;
  }
  std::cerr << "error: " << err.message << "\n";
  return code;
}

namespace {

std::string summary(const Phase& ph) {
  std::string s = "phase " + ph.name + ": " + std::string(to_string(ph.mode));
  if (ph.mode != Mode::allowlist) return s;
  if (ph.entries.empty()) return s + ", no entries (denies all egress)";
  s += ", " + std::to_string(ph.entries.size()) + (ph.entries.size() == 1 ? " entry (" : " entries (");
  bool first = true;
  for (EntryKind k : {EntryKind::hostname, EntryKind::wildcard, EntryKind::ipv4, EntryKind::ipv6,
                      EntryKind::ipv4_cidr, EntryKind::ipv6_cidr}) {
    const std::size_t n = ph.count(k);
    if (n == 0) continue;
    s += (first ? "" : ", ") + std::to_string(n) + " " + std::string(to_string(k));
    first = false;
  }
  return s + ")";
}

// The plan of a harness's file, for the people who must check that egressd reads it as
// their harness does: the format, then per phase its mode, where it came from and every
// entry (AgentCompass tells its users to verify exactly this).
void print_plan(const PolicyDocument& doc, std::vector<std::string>& lines) {
  lines.push_back("format: " + std::string(to_string(doc.format)));
  for (std::size_t i = 0; i < doc.policy.phases.size(); ++i) {
    const Phase& ph = doc.policy.phases[i];
    lines.push_back(summary(ph) + "  <- " + doc.origins[i]);
    for (const Entry& e : ph.entries) lines.push_back("    " + e.text);
  }
}

}  // namespace

int cmd_check(const CheckArgs& args) {
  if (args.config.empty() && args.allow.empty()) {
    return report(Error::invalid("nothing to check: give --config FILE and/or --allow ENTRY"));
  }
  std::vector<std::string> lines;
  if (!args.allow.empty()) {
    auto entries = parse_entries(args.allow);
    if (!entries) return report(entries.error());
    for (const auto& e : *entries) lines.push_back(e.text);
  }
  if (!args.config.empty()) {
    auto doc = load_policy_document(args.config);
    if (!doc) return report(doc.error());
    if (doc->format == PolicyFormat::egressd) {
      for (const auto& ph : doc->policy.phases) lines.push_back(summary(ph));
    } else {
      print_plan(*doc, lines);
    }
    lines.push_back("initial phase: " + doc->policy.initial_phase);
  }
  for (const auto& l : lines) std::cout << l << "\n";
  return 0;
}

int cmd_render(const RenderArgs& args) {
  auto policy = load_policy_file(args.config);
  if (!policy) return report(policy.error());
  const Phase* ph = policy->find(args.phase);
  if (ph == nullptr) {
    std::string names;
    for (const auto& p : policy->phases) names += (names.empty() ? "" : ", ") + p.name;
    return report(Error::invalid("unknown phase \"" + args.phase + "\" in " + args.config + " (phases: " + names + ")"));
  }
  const nft::ActiveState st = nft::make_state(*policy, *ph, 1, false);
  // The same upstream exemptions as `run` (the secrets are the defaults: the
  // daemon draws its own per table), and an egress chain for each
  // --interface (`run` makes one per interface of its namespace).
  nft::CompileOptions opts = compile_options(dns::expand_upstreams(policy->dns, read_resolv_conf()), args.dns_port);
  opts.interfaces = args.interfaces;
  std::cout << render_script(*policy, st, opts);
  return 0;
}

}  // namespace egressd::daemon
