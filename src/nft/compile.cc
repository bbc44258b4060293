#include "nft/compile.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <sstream>

namespace egressd::nft {

namespace {

constexpr std::uint8_t kTcp = 6;
constexpr std::uint8_t kUdp = 17;
// ICMPv6 neighbour discovery types that must leave for IPv6 to work at all.
// With hop limit 255 they cannot be routed beyond the link.
constexpr std::uint8_t kNdRouterSolicit = 133;
constexpr std::uint8_t kNdNeighborSolicit = 135;
constexpr std::uint8_t kNdNeighborAdvert = 136;
// MLD listener reports and dones: the kernel sends them by itself whenever an
// interface joins a multicast group (the solicited-node group of every IPv6
// address, so on every interface that comes up). They carry nothing a process
// chose and cannot leave the link (hop limit 1).
constexpr std::uint8_t kMldListenerReport = 131;
constexpr std::uint8_t kMldListenerDone = 132;
constexpr std::uint8_t kMld2ListenerReport = 143;

StmtVerdict accept() { return {VerdictKind::accept, ""}; }

struct PhaseSets {
  std::string a4, n4, a6, n6, d4, d6;
};

PhaseSets sets_for(const std::string& chain) {
  return {chain + "_a4", chain + "_n4", chain + "_a6", chain + "_n6", chain + "_d4", chain + "_d6"};
}

// Sets of an allowlist phase: static addresses (hash), CIDRs (interval), and
// DNS-learned addresses (timeout), per family. All six always exist so the
// layout does not depend on the entries (a switch away from an inline policy
// deletes them by name).
std::vector<Set> phase_sets(const std::string& chain, const Phase& phase) {
  std::vector<IpPrefix> a4, n4, a6, n6;
  for (const auto& e : phase.entries) {
    switch (e.kind) {
      case EntryKind::ipv4: a4.push_back(e.ip); break;
      case EntryKind::ipv6: a6.push_back(e.ip); break;
      case EntryKind::ipv4_cidr: n4.push_back(e.ip); break;
      case EntryKind::ipv6_cidr: n6.push_back(e.ip); break;
      case EntryKind::hostname:
      case EntryKind::wildcard: break;
    }
  }
  const PhaseSets s = sets_for(chain);
  // Static address sets never change after creation: sizing them up front
  // spares the kernel rehashing through a 10k-element batch (~2x faster).
  auto sized = [](Set set) {
    set.size = static_cast<std::uint32_t>(std::max<std::size_t>(set.elems.size(), 1));
    return set;
  };
  std::vector<Set> out;
  out.push_back(sized({s.a4, SetType::ipv4_addr, false, false, make_addr_elems(a4)}));
  out.push_back({s.n4, SetType::ipv4_addr, true, false, make_interval_elems(n4)});
  out.push_back(sized({s.a6, SetType::ipv6_addr, false, false, make_addr_elems(a6)}));
  out.push_back({s.n6, SetType::ipv6_addr, true, false, make_interval_elems(n6)});
  out.push_back({s.d4, SetType::ipv4_addr, false, true, {}});
  out.push_back({s.d6, SetType::ipv6_addr, false, true, {}});
  return out;
}

Chain phase_chain_def(const std::string& chain, const Phase& phase, std::uint32_t mark) {
  Chain c{chain, std::nullopt, {}};
  switch (phase.mode) {
    case Mode::public_:
      c.rules.push_back({{StmtCounter{}, StmtCtMarkSet{mark}, accept()}, ""});
      break;
    case Mode::no_network:
      c.rules.push_back({{StmtVerdict{VerdictKind::goto_, "deny"}}, ""});
      break;
    case Mode::allowlist: {
      const PhaseSets s = sets_for(chain);
      for (const auto* set : {&s.a4, &s.n4, &s.d4}) {
        c.rules.push_back({{MatchDaddrSet{*set, SetType::ipv4_addr}, StmtCounter{}, StmtCtMarkSet{mark}, accept()}, ""});
      }
      for (const auto* set : {&s.a6, &s.n6, &s.d6}) {
        c.rules.push_back({{MatchDaddrSet{*set, SetType::ipv6_addr}, StmtCounter{}, StmtCtMarkSet{mark}, accept()}, ""});
      }
      c.rules.push_back({{StmtVerdict{VerdictKind::goto_, "deny"}}, ""});
      break;
    }
  }
  return c;
}

std::vector<Rule> active_rules(const ActiveState& st) {
  const std::string target = st.is_inline ? inline_chain(st.generation) : phase_chain(st.phase);
  return {
      {{MatchCtMark{st.mark}, StmtCounter{}, accept()}, st.to_comment()},
      {{StmtVerdict{VerdictKind::goto_, target}}, ""},
  };
}

Chain output_chain(const Policy& policy, const CompileOptions& opts) {
  Chain c{"output", BaseChain{HookType::filter, 0, true}, {}};
  c.rules.push_back({{MatchOifLoopback{}, accept()}, ""});
  // Loopback destinations after NAT: `oif` keeps the device of the original
  // route, so a query redirected to the proxy (or DNATed by Docker to
  // 127.0.0.11) still shows eth0. Such addresses cannot leave the namespace.
  IpPrefix lo4 = *parse_ip("127.0.0.0");
  lo4.prefix_len = 8;
  c.rules.push_back({{MatchDaddr{lo4}, accept()}, ""});
  c.rules.push_back({{MatchDaddr{*parse_ip("::1")}, accept()}, ""});
  if (opts.dns_port != 0) {
    // egressd's own upstream queries (SO_MARK), and only to the configured
    // servers' DNS port: even a sandbox that guessed the mark reaches nothing
    // else.
    for (const IpPrefix& up : opts.upstreams) {
      for (std::uint8_t proto : {kUdp, kTcp}) {
        c.rules.push_back({{MatchMetaMark{opts.own_mark}, MatchDaddr{up}, MatchDport{proto, 53}, accept()}, ""});
      }
    }
  }
  if (policy.enforce.inbound_replies) {
    c.rules.push_back({{MatchCtDirectionReply{}, accept()}, ""});
  }
  for (std::uint8_t t : {kNdRouterSolicit, kNdNeighborSolicit, kNdNeighborAdvert}) {
    c.rules.push_back({{MatchLinkIcmpv6{t, 255}, accept()}, ""});
  }
  // Every packet the policy decides passes here once and is then either
  // accepted or sent to `deny`: allowed = this counter - deny's counters.
  // Both chains outlive switches (only `active` and inline chains are
  // rewritten), so status counts across switches at no cost to a switch.
  c.rules.push_back({{StmtCounter{}, StmtVerdict{VerdictKind::jump, "active"}}, ""});
  return c;
}

Chain deny_chain(const Policy& policy) {
  Chain c{"deny", std::nullopt, {}};
  // The kernel's own MLD reports are denied like everything else, but not
  // logged: a record nobody caused and nobody can act on would only bury the
  // ones that matter (every interface coming up sends a few).
  for (std::uint8_t t : {kMldListenerReport, kMldListenerDone, kMld2ListenerReport}) {
    c.rules.push_back({{MatchLinkIcmpv6{t, 1}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  }
  // Rate-limited in the kernel: a flood of denied packets costs egressd at
  // most kLogRate messages a second (the rest are still denied, unlogged).
  if (policy.enforce.log_group != 0) {
    c.rules.push_back({{StmtLimit{kLogRate, kLogBurst}, StmtLog{policy.enforce.log_group}}, ""});
  }
  if (policy.enforce.deny == DenyAction::drop) {
    c.rules.push_back({{StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  } else {
    c.rules.push_back({{MatchL4Proto{kTcp}, StmtCounter{}, StmtRejectTcpReset{}}, ""});
    c.rules.push_back({{StmtCounter{}, StmtRejectAdminProhibited{}}, ""});
  }
  return c;
}

Chain redirect_chain(const CompileOptions& opts) {
  // -101: ahead of Docker's DNAT of 127.0.0.11:53 (iptables-nft, -100), so
  // queries to the embedded resolver are intercepted too.
  Chain c{"dns_redirect", BaseChain{HookType::nat, -101, false}, {}};
  for (std::uint8_t proto : {kUdp, kTcp}) {
    c.rules.push_back({{MatchMetaMark{opts.own_mark, true}, MatchDport{proto, 53}, StmtRedirect{opts.dns_port}}, ""});
  }
  return c;
}

// Everything of the table except chain `active`, in declaration order.
Table staged_table(const Policy& policy, const CompileOptions& opts) {
  Table t;
  t.name = kTableName;
  for (const auto& ph : policy.phases) {
    if (ph.mode == Mode::allowlist) {
      for (auto& s : phase_sets(phase_chain(ph.name), ph)) t.sets.push_back(std::move(s));
    }
  }
  t.chains.push_back(output_chain(policy, opts));
  t.chains.push_back(Chain{"active", std::nullopt, {}});
  t.chains.push_back(deny_chain(policy));
  for (const auto& ph : policy.phases) {
    t.chains.push_back(phase_chain_def(phase_chain(ph.name), ph, phase_mark(policy, ph.name)));
  }
  if (opts.dns_port != 0) t.chains.push_back(redirect_chain(opts));
  return t;
}

std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::string ActiveState::to_comment() const {
  char mark_buf[16];
  std::snprintf(mark_buf, sizeof mark_buf, "0x%08" PRIx32, mark);
  std::string s = "egressd gen=" + std::to_string(generation) + " phase=" + phase +
                  " mode=" + std::string(to_string(mode)) + " mark=" + mark_buf;
  if (is_inline) s += " inline";
  return s;
}

Result<ActiveState> ActiveState::parse_comment(const std::string& comment) {
  std::istringstream in(comment);
  std::string word;
  if (!(in >> word) || word != "egressd") {
    return Error::invalid("state comment \"" + comment + "\": not written by egressd");
  }
  ActiveState st;
  bool have_gen = false, have_phase = false, have_mode = false, have_mark = false;
  while (in >> word) {
    const auto eq = word.find('=');
    const std::string key = word.substr(0, eq);
    const std::string val = eq == std::string::npos ? "" : word.substr(eq + 1);
    try {
      if (key == "gen") {
        st.generation = std::stoull(val);
        have_gen = true;
      } else if (key == "phase") {
        st.phase = val;
        have_phase = !val.empty();
      } else if (key == "mode") {
        auto m = parse_mode(val);
        if (!m) break;
        st.mode = *m;
        have_mode = true;
      } else if (key == "mark") {
        st.mark = static_cast<std::uint32_t>(std::stoul(val, nullptr, 16));
        have_mark = true;
      } else if (key == "inline") {
        st.is_inline = true;
      }
    } catch (const std::exception&) {
      return Error::invalid("state comment \"" + comment + "\": bad value for " + key);
    }
  }
  if (!have_gen || !have_phase || !have_mode || !have_mark) {
    return Error::invalid("state comment \"" + comment + "\": missing gen, phase, mode or mark");
  }
  return st;
}

std::uint32_t phase_mark(const Policy& policy, std::string_view name) {
  for (std::size_t i = 0; i < policy.phases.size(); ++i) {
    if (policy.phases[i].name == name) return kPhaseMarkBase + static_cast<std::uint32_t>(i) + 1;
  }
  return 0;
}

std::uint32_t inline_mark(std::uint64_t generation) {
  return kInlineMarkBit | static_cast<std::uint32_t>(generation & 0x7fffffffu);
}

ActiveState make_state(const Policy& policy, const Phase& phase, std::uint64_t generation, bool is_inline) {
  ActiveState st;
  st.generation = generation;
  st.is_inline = is_inline;
  st.phase = is_inline ? "inline" : phase.name;
  st.mode = phase.mode;
  st.mark = is_inline ? inline_mark(generation) : phase_mark(policy, phase.name);
  return st;
}

std::string phase_chain(std::string_view phase) { return "ph_" + std::string(phase); }
std::string inline_chain(std::uint64_t generation) { return "il" + std::to_string(generation); }

std::pair<std::string, std::string> learned_sets(const std::string& chain) {
  const PhaseSets s = sets_for(chain);
  return {s.d4, s.d6};
}

std::string staged_digest(const Policy& policy, const CompileOptions& opts) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, fnv1a(render_table(staged_table(policy, opts))));
  return buf;
}

std::uint32_t mark_from_table_comment(const std::string& comment) {
  const std::string key = " mark=0x";
  const auto pos = comment.find(key);
  if (comment.rfind("egressd ", 0) != 0 || pos == std::string::npos) return 0;
  try {
    return static_cast<std::uint32_t>(std::stoul(comment.substr(pos + key.size(), 8), nullptr, 16));
  } catch (const std::exception&) {
    return 0;
  }
}

std::string digest_from_table_comment(const std::string& comment) {
  const std::string key = "digest=";
  const auto pos = comment.find(key);
  if (comment.rfind("egressd ", 0) != 0 || pos == std::string::npos) return "";
  return comment.substr(pos + key.size(), 16);
}

Table build_table(const Policy& policy, const Phase* inline_phase, const ActiveState& state,
                  const CompileOptions& opts) {
  Table t = staged_table(policy, opts);
  char mark[16];
  std::snprintf(mark, sizeof mark, "0x%08" PRIx32, opts.own_mark);
  t.comment = "egressd v1 digest=" + staged_digest(policy, opts) + " mark=" + mark;
  if (inline_phase != nullptr) {
    const std::string chain = inline_chain(state.generation);
    if (inline_phase->mode == Mode::allowlist) {
      for (auto& s : phase_sets(chain, *inline_phase)) t.sets.push_back(std::move(s));
    }
    t.chains.push_back(phase_chain_def(chain, *inline_phase, state.mark));
  }
  for (auto& c : t.chains) {
    if (c.name == "active") c.rules = active_rules(state);
  }
  return t;
}

Change build_switch(const Policy& /*policy*/, const Phase& target, const ActiveState& next,
                    const ActiveState& prev) {
  Change ch;
  ch.table = kTableName;
  if (next.is_inline) {
    const std::string chain = inline_chain(next.generation);
    if (target.mode == Mode::allowlist) {
      for (auto& s : phase_sets(chain, target)) ch.ops.push_back(OpAddSet{std::move(s)});
    }
    ch.ops.push_back(OpAddChain{phase_chain_def(chain, target, next.mark)});
  }
  ch.ops.push_back(OpFlushChain{"active"});
  for (auto& r : active_rules(next)) ch.ops.push_back(OpAddRule{"active", std::move(r)});
  if (prev.is_inline && !(next.is_inline && next.generation == prev.generation)) {
    const std::string chain = inline_chain(prev.generation);
    ch.ops.push_back(OpFlushChain{chain});
    ch.ops.push_back(OpDeleteChain{chain});
    if (prev.mode == Mode::allowlist) {
      const PhaseSets s = sets_for(chain);
      for (const auto* name : {&s.a4, &s.n4, &s.a6, &s.n6, &s.d4, &s.d6}) ch.ops.push_back(OpDeleteSet{*name});
    }
  }
  return ch;
}

}  // namespace egressd::nft
