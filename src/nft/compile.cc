// The ruleset egressd programs, built from a policy (DESIGN §1, §4).
//
// Over 500 lines on purpose: every chain of the inet and netdev tables
// (output, input, pass, deny, active, dns_redirect, the per-phase chains and
// the egress checks) and the table comment's secrets are built here, next to
// each other, so a reviewer reads the whole ruleset's logic in one place and
// rules/*.nft (the goldens) change together with it. The pieces are small
// functions, one per chain.
#include "nft/compile.h"

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <sstream>

namespace egressd::nft {

namespace {

constexpr std::uint8_t kTcp = 6;
constexpr std::uint8_t kUdp = 17;
constexpr std::uint8_t kIcmp = 1;
constexpr std::uint8_t kIcmpv6 = 58;
constexpr std::uint16_t kQuicPort = 443;
constexpr std::uint8_t kTcpOptFastOpen = 34, kTcpOptFastOpenExp = 254;
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
// A rule that only counts IPv4 packets: no verdict, every packet goes on to
// the next rule.
Rule count_v4(const char* comment) { return {{MatchMetaNfproto{4}, StmtCounter{}}, comment}; }
StmtVerdict to_pass() { return {VerdictKind::goto_, "pass"}; }
StmtVerdict to_deny() { return {VerdictKind::goto_, "deny"}; }

IpPrefix prefix(const char* addr, int len) {
  IpPrefix p = *parse_ip(addr);
  p.prefix_len = static_cast<std::uint8_t>(len);
  return p;
}

// Hostname pinning is on for the table: the policy asks for it and the
// daemon runs the queue reader.
bool pinning(const Policy& policy, const CompileOptions& opts) { return opts.pin && policy.enforce.pin_names; }

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

// Chains lo_answers, own_sockets and own_input (see compile.h): a ladder over
// the cgroup levels. The socket's cgroup at level L is `id` (`socket
// cgroupv2 level L ID`) for exactly one L, the level of that cgroup,
// whichever it is: a socket there is the cgroup's, one in a cgroup below it
// (it has a level L+1) is not. A full socket anywhere else has a root cgroup
// (level 0, id != 0) and meets the last rule. A packet without a full socket
// (a SYN-ACK of a request socket, a time-wait socket's ACK) matches no
// `socket cgroupv2` and returns: no process writes those.
enum class Ladder {
  drop_others,  // lo_answers: the cgroup's return, the others are dropped
  // own_sockets: the others go to chain own_foreign (it takes the own and
  // proxy marks off), the cgroup's return
  unmark_others,
  // own_input: the cgroup's go to chain own_input_own (it drops what the own
  // mark's socket receives), the others return
  drop_own,
  // own_nat: the cgroup's go to chain own_nat_own (the own mark: no
  // redirect), the others return, their mark untouched
  nat_own,
};

Chain cgroup_ladder_chain(const char* name, std::uint64_t id, Ladder how) {
  Chain c{name, std::nullopt, {}};
  const auto others = [how]() -> std::vector<Stmt> {
    if (how == Ladder::drop_others) return {StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}};
    if (how == Ladder::unmark_others) return {StmtVerdict{VerdictKind::goto_, kOwnForeignChain}};
    return {StmtVerdict{VerdictKind::return_, ""}};
  };
  for (std::uint32_t level = 0; level < kResolverLevels; ++level) {
    Rule below{{MatchSocketCgroupv2{level, id, false}, MatchSocketCgroupv2{level + 1, 0, true}}, ""};
    for (auto& st : others()) below.stmts.push_back(std::move(st));
    c.rules.push_back(std::move(below));
    if (how == Ladder::drop_own || how == Ladder::nat_own) {
      const char* own = how == Ladder::drop_own ? kOwnInputOwnChain : kOwnNatOwnChain;
      c.rules.push_back({{MatchSocketCgroupv2{level, id, false}, StmtVerdict{VerdictKind::goto_, own}}, ""});
    } else {
      c.rules.push_back({{MatchSocketCgroupv2{level, id, false}, StmtVerdict{VerdictKind::return_, ""}}, ""});
    }
  }
  if (how == Ladder::drop_others || how == Ladder::unmark_others) {
    Rule rest{{MatchSocketCgroupv2{0, 0, true}}, ""};
    for (auto& st : others()) rest.stmts.push_back(std::move(st));
    c.rules.push_back(std::move(rest));
  }
  return c;
}

// A rule that asks for one of the reader's verdict marks asks for the pin
// priority too, right after it, when the table has one (compile.h
// kPinPriority).
Rule with_pin_priority(Rule r, std::uint32_t pin_priority) {
  if (pin_priority == 0) return r;
  for (auto it = r.stmts.begin(); it != r.stmts.end(); ++it) {
    if (std::holds_alternative<MatchMetaMark>(*it)) {
      r.stmts.insert(it + 1, MatchMetaPriority{pin_priority});
      break;
    }
  }
  return r;
}

// Chain `pin` (see compile.h): TCP packets of undecided flows to addresses
// allowed only through learned names.
Chain pin_chain(const CompileOptions& opts) {
  Chain c{kPinChain, std::nullopt, {}};
  // The reader let a payload-less packet (an ACK, a FIN) go: it re-enters
  // the hook (NF_REPEAT) carrying the pin mark and the pin priority,
  // secrets the sandbox cannot set on its own packets other than by guessing
  // them, 64 bits together with no answer for either half alone (which would
  // buy it the name check only).
  c.rules.push_back(with_pin_priority({{MatchMetaMark{opts.pin_mark}, to_pass()}, ""}, opts.pin_priority));
  // The reader refused the flow: the client gets a TCP reset at once.
  c.rules.push_back({{MatchMetaMark{kPinResetMark}, MatchL4Proto{kTcp}, StmtCounter{}, StmtRejectTcpReset{}}, ""});
  // ... or a QUIC flow (UDP 443): ICMP administratively prohibited, so the
  // client falls back to TCP at once instead of waiting out its handshake.
  c.rules.push_back({{MatchMetaMark{kPinResetMark}, MatchL4Proto{kUdp}, StmtCounter{}, StmtRejectAdminProhibited{}}, ""});
  // TCP Fast Open would put the first bytes in the SYN, which passes
  // uninspected: a SYN with the option (34, or the experimental 254) is
  // dropped, and the client's retransmitted SYN carries neither option nor
  // data (Linux leaves them out of SYN retries), so its bytes follow the
  // handshake and are judged.
  c.rules.push_back({{MatchTcpOption{kTcpOptFastOpen}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  c.rules.push_back({{MatchTcpOption{kTcpOptFastOpenExp}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  // The handshake passes as without pinning; the flow stays undecided (no ct mark).
  c.rules.push_back({{MatchTcpFlagSyn{}, MatchCtStateNew{}, to_pass()}, ""});
  // Any other TCP packet that starts an entry is one conntrack took up from
  // the middle of a connection (nf_conntrack_tcp_loose): its entry was
  // forgotten (a raw in-window RST closes it, 10 s later it is gone) and the
  // server may hold bytes sent before (an incomplete head let through), which
  // the next ones, judged as a new flow's start, would complete. Refused.
  c.rules.push_back({{MatchL4Proto{kTcp}, MatchCtStateNew{}, StmtCounter{}, StmtRejectTcpReset{}}, ""});
  // A SYN in the reply direction of an entry the server's side started
  // (compile.h kPinStraySynMark): to the reader, which has it deleted.
  c.rules.push_back({{MatchTcpSynOnly{}, MatchCtDirectionReply{}, StmtMetaMarkSet{kPinStraySynMark}, StmtCounter{},
                      StmtQueue{kPinQueueNum}},
                     ""});
  // Any other sandbox packet in the reply direction of an entry is reset: the
  // entry was started by the server's side (its zero-window probe, say, when
  // it came first after conntrack forgot the connection), so the sandbox's
  // connection is one conntrack took up mid-stream all the same (CI's
  // sanitizer lab got host=same-ip.test so). Inbound flows carry their own
  // mark and never get here.
  c.rules.push_back({{MatchL4Proto{kTcp}, MatchCtDirectionReply{}, StmtCounter{}, StmtRejectTcpReset{}}, ""});
  // A SYN on an entry that has seen replies opens a new connection on the
  // addresses and ports of an old one (output_chain zeroed its mark): it goes
  // to the reader below, which forgets what it holds for the old connection,
  // so the new one's bytes are judged on their own.
  // Everything else goes to the reader, carrying the flow's conntrack id as
  // its mark: a decision the reader remembers for a flow's stragglers must
  // never answer a new connection on the same addresses and ports (a socket
  // can bind the port of a flow admitted a moment ago). No bypass: with no
  // reader the kernel drops it (fail closed). QUIC has a queue of its own,
  // where the kernel splits GSO batches into their datagrams.
  c.rules.push_back(
      {{MatchL4Proto{kUdp}, MatchCtMark{0}, StmtMetaMarkSetCtId{}, StmtCounter{}, StmtQueue{kPinUdpQueueNum}}, ""});
  c.rules.push_back(
      {{MatchL4Proto{kUdp}, StmtMetaMarkSet{kPinUdpPassedMark}, StmtCounter{}, StmtQueue{kPinUdpQueueNum}}, ""});
  // A followed HTTP connection (its later requests are judged too).
  c.rules.push_back({{MatchCtMark{kPinFollowMark}, StmtVerdict{VerdictKind::goto_, kPinFollowChain}}, ""});
  // A TCP flow that carries a phase's mark: another phase's (or urgent data
  // on this phase's own): kPinForeignQueueNum.
  c.rules.push_back({{MatchCtMarkNot{~std::uint32_t{0}, 0}, StmtMetaMarkSetCtId{}, StmtCounter{},
                      StmtQueue{kPinForeignQueueNum}},
                     ""});
  c.rules.push_back({{StmtMetaMarkSetCtId{}, StmtCounter{}, StmtQueue{kPinQueueNum}}, ""});
  return c;
}

// Chain `pin_follow` (see compile.h): a followed HTTP connection's packets.
// The reader needs its bytes; a packet without any passes here (one rule per
// TCP header length: nft cannot subtract one header field from another).
// Urgent data goes to the reader whatever it carries: an urgent pointer on a
// bare ACK takes a later byte out of the server's stream.
// One rule per family and TCP header length passing a packet that is its
// headers alone (IPv4 without options, IPv6 without extension headers).
void push_header_only_passes(Chain& c) {
  for (const std::uint8_t family : {4, 6}) {
    for (std::uint8_t doff = 5; doff <= 15; ++doff) {
      c.rules.push_back({{MatchTcpHeaderOnly{family, doff}, to_pass()}, ""});
    }
  }
}

Chain pin_follow_chain() {
  Chain c{kPinFollowChain, std::nullopt, {}};
  const Rule to_reader{{StmtMetaMarkSetCtId{}, StmtCounter{}, StmtQueue{kPinFollowQueueNum}}, ""};
  Rule urgent = to_reader;
  urgent.stmts.insert(urgent.stmts.begin(), MatchTcpFlagUrg{});
  c.rules.push_back(urgent);
  push_header_only_passes(c);
  c.rules.push_back(to_reader);
  return c;
}

// Chain `pin_untracked` (see compile.h): a TCP packet to a learned-only
// address without a conntrack entry. The header-only rules of pin_follow
// pass one without bytes; urgent data and bytes are dropped.
// Chain `pin_spoof` (compile.h): conntrack (priority -200) takes every
// packet the sandbox writes before any rule of chain output can drop it, so a
// raw socket (NET_RAW) could write the server's side of a TCP handshake (a
// SYN-ACK from the server's address to the sandbox's own) on a connection whose
// entry a raw RST and SYN had traded for a new one: conntrack would take the
// new entry up as established, mark 0, and the connection's next bytes would
// reach the reader as a new flow's, while the server holds an incomplete head
// of the old one they would end. A TCP packet a socket writes from an address
// that is not the namespace's own is dropped here, before conntrack sees it.
// (Resets netfilter writes for reject have no socket.)
Chain pin_spoof_chain() {
  Chain c{kPinSpoofChain, BaseChain{HookType::filter, -300, false}, {}};
  c.rules.push_back({{MatchL4Proto{kTcp}, MatchMetaHasSocket{}, MatchFibAddrType{false, AddrType::local, true},
                      StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}},
                     ""});
  return c;
}

// Chain `pin_spoof_in` (compile.h): the same forged SYN-ACK written as a frame
// with an AF_PACKET socket on `lo` (NET_RAW) never crosses output: `lo` takes
// it back in, and conntrack sees it in prerouting (an attack review got
// host=same-ip.test so, past pin_spoof). What the stack sends itself over `lo`
// crossed output, and comes back in with its conntrack entry attached (the
// deny's resets from the server's address too: ct state related); a frame
// written on `lo` comes in with none (ct state invalid here, ahead of
// conntrack), and one from an address that is not the namespace's own is
// dropped.
Chain pin_spoof_in_chain() {
  Chain c{kPinSpoofInChain, BaseChain{HookType::filter, -300, false, Hook::prerouting}, {}};
  c.rules.push_back({{MatchIifLoopback{}, MatchL4Proto{kTcp}, MatchCtStateInvalid{},
                      MatchFibAddrType{false, AddrType::local, true}, StmtCounter{},
                      StmtVerdict{VerdictKind::drop, ""}},
                     ""});
  return c;
}

Chain pin_untracked_chain() {
  Chain c{kPinUntrackedChain, std::nullopt, {}};
  c.rules.push_back({{MatchTcpFlagUrg{}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  // A SYN conntrack calls invalid meets an entry the server's side started
  // (compile.h kPinStraySynMark): to the reader, which has it deleted.
  c.rules.push_back({{MatchTcpSynOnly{}, StmtMetaMarkSet{kPinStraySynMark}, StmtCounter{}, StmtQueue{kPinQueueNum}}, ""});
  push_header_only_passes(c);
  c.rules.push_back({{StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  return c;
}

Chain phase_chain_def(const std::string& chain, const Phase& phase, std::uint32_t mark, bool pin = false,
                      std::uint32_t pin_mark = kPinMark, std::uint32_t pin_priority = kPinPriority) {
  Chain c{chain, std::nullopt, {}};
  switch (phase.mode) {
    case Mode::public_:
      c.rules.push_back({{StmtCounter{}, StmtCtMarkSet{mark}, to_pass()}, ""});
      break;
    case Mode::no_network:
      c.rules.push_back({{StmtVerdict{VerdictKind::goto_, "deny"}}, ""});
      break;
    case Mode::allowlist: {
      const PhaseSets s = sets_for(chain);
      // With pinning, a TCP flow that reaches a learned set (so no IP/CIDR
      // entry allows its address) and is not yet decided (ct mark 0: every
      // decided flow carries a phase's mark) goes to chain pin.
      // The reader admits a flow by re-running the hook with the skb mark
      // pin_admit_mark (the verdict cannot set the ct mark on kernels
      // without CONFIG_NETFILTER_NETLINK_GLUE_CT): this rule gives the flow
      // the phase's mark, so every later packet takes the fast path.
      // QUIC (UDP 443) is judged the same way, by its Initial's ClientHello;
      // other UDP ports are decided by the address.
      auto pinned = [&](const std::string& set, SetType type) {
        if (!pin) return;
        // Whatever the flow's ct mark: an undecided flow (0), a followed TLS
        // flow that settled (its server answered after the handshake, so no
        // retransmission of judged bytes can reach it any more), or a flow
        // admitted by name under an earlier phase and kept by the switch.
        c.rules.push_back(with_pin_priority({{MatchDaddrSet{set, type}, MatchL4Proto{kTcp},
                                               MatchMetaMark{pin_admit_mark(pin_mark)}, StmtCounter{},
                                               StmtCtMarkSet{mark}, to_pass()},
                                              ""},
                                             pin_priority));
        // An HTTP flow the reader admitted stays followed: its own ct mark,
        // and every later packet back to chain pin (compile.h kPinFollowMark).
        c.rules.push_back(with_pin_priority({{MatchDaddrSet{set, type}, MatchL4Proto{kTcp}, MatchCtMark{0},
                                               MatchMetaMark{pin_follow_mark(pin_mark)}, StmtCounter{},
                                               StmtCtMarkSet{kPinFollowMark}, to_pass()},
                                              ""},
                                             pin_priority));
        // Every other TCP packet of a tracked flow to such an address goes to
        // chain pin: an undecided flow's (ct mark 0), a followed one's
        // (kPinFollowMark), urgent data on this phase's own (chain active
        // keeps it off the fast path: the server's stack takes the urgent
        // byte out of the stream, so what the reader judged is not what the
        // server reads), and a flow that carries another phase's mark: this
        // phase never judged it by name (compile.h kPinForeignQueueNum). Only
        // this phase's own flows take the fast path, in chain active.
        c.rules.push_back({{MatchDaddrSet{set, type}, MatchL4Proto{kTcp}, MatchCtMark{0},
                            StmtVerdict{VerdictKind::goto_, kPinChain}},
                           ""});
        c.rules.push_back({{MatchDaddrSet{set, type}, MatchL4Proto{kTcp}, MatchCtMarkNot{~std::uint32_t{0}, 0},
                            StmtVerdict{VerdictKind::goto_, kPinChain}},
                           ""});
        // A TCP packet conntrack gave no entry (no ct mark, so neither rule
        // above matched it): only one without bytes passes (compile.h
        // kPinUntrackedChain). It used to fall to the learned set's rule and
        // pass by its address, unread.
        c.rules.push_back({{MatchDaddrSet{set, type}, MatchL4Proto{kTcp},
                            StmtVerdict{VerdictKind::goto_, kPinUntrackedChain}},
                           ""});
        // A QUIC flow's long-header packets (its handshake) come here even
        // once it is decided (chain active keeps them off the fast path), so
        // the reader sees every Initial: a second connection on the same
        // four-tuple, or an Initial resent after one the server never got,
        // is judged too. The reader's admit re-runs them with the admit mark,
        // whatever the flow's ct mark.
        c.rules.push_back(with_pin_priority({{MatchDaddrSet{set, type}, MatchDport{kUdp, kQuicPort},
                                               MatchMetaMark{pin_admit_mark(pin_mark)}, StmtCounter{},
                                               StmtCtMarkSet{mark}, to_pass()},
                                              ""},
                                             pin_priority));
        // Every other UDP 443 packet to such an address goes to chain pin:
        // an undecided flow's, a decided one's long-header packets and those
        // longer than one datagram (chain active sends both here: a GSO batch
        // whose first datagram is a short-header packet can carry an Initial
        // after it, and the reader's queue gets the batch split), a flow that
        // carries another phase's mark (never judged by name here), and one
        // conntrack gave no entry (chain pin queues it as passed: the reader
        // refuses it, holding no assembler for it).
        c.rules.push_back({{MatchDaddrSet{set, type}, MatchDport{kUdp, kQuicPort},
                            StmtVerdict{VerdictKind::goto_, kPinChain}},
                           ""});
      };
      for (const auto* set : {&s.a4, &s.n4, &s.d4}) {
        if (set == &s.d4) pinned(*set, SetType::ipv4_addr);
        c.rules.push_back({{MatchDaddrSet{*set, SetType::ipv4_addr}, StmtCounter{}, StmtCtMarkSet{mark}, to_pass()}, ""});
      }
      for (const auto* set : {&s.a6, &s.n6, &s.d6}) {
        if (set == &s.d6) pinned(*set, SetType::ipv6_addr);
        c.rules.push_back({{MatchDaddrSet{*set, SetType::ipv6_addr}, StmtCounter{}, StmtCtMarkSet{mark}, to_pass()}, ""});
      }
      c.rules.push_back({{StmtVerdict{VerdictKind::goto_, "deny"}}, ""});
      break;
    }
  }
  return c;
}

// `learned_sets`: the target phase chain's sets exist in the table (an inline
// phase's only when it is an allowlist).
std::vector<Rule> active_rules(const ActiveState& st, bool pin, bool inbound, bool learned_sets) {
  const std::string target = st.is_inline ? inline_chain(st.generation) : phase_chain(st.phase);
  const bool guarded = st.mode != Mode::public_;
  std::vector<Rule> r;
  // A flow pinning admitted for a name this phase does not allow: the daemon
  // marked it at the switch; the address would let it on, the name must not.
  if (pin) r.push_back({{MatchCtMark{kPinCutMark}, StmtCounter{}, to_deny()}, ""});
  if (guarded) {
    // Per packet, ahead of the fast path: a flow to an allowed first hop may
    // carry a denied final destination in a routing header (segment routing
    // needs no capability) or an IPv4 source route. Any IPv4 option at all:
    // nft's option lookup misses a source route whose pointer or length a
    // router still takes (found by an attack review), and nothing a sandbox
    // needs carries options.
    r.push_back({{MatchIpv6RoutingHeader{}, to_deny()}, ""});
    r.push_back({{MatchIpv4Options{}, to_deny()}, ""});
  }
  // Replies on flows that arrived from outside, after the guards (chain
  // output sends them here): a reply may carry a routing header too, whose
  // first hop is the peer (found by an attack review).
  //
  // Not QUIC's handshake packets to an address a learned name allows (ahead
  // of that rule): conntrack forgets a quiet UDP flow after 30 s, and when the
  // server's datagram comes first after that, chain input takes the entry for
  // an inbound one; the sandbox's Initials on it, for any name, then passed
  // here unread (an attack review, 2026-12-07). They walk the phase chain
  // instead, where pinning's reader refuses an Initial on a flow the kernel
  // passed before (compile.h kPinUdpPassedMark).
  if (inbound && pin && st.mode == Mode::allowlist && learned_sets) {
    const PhaseSets s = sets_for(target);
    for (const auto& [set, type] : {std::pair{s.d4, SetType::ipv4_addr}, std::pair{s.d6, SetType::ipv6_addr}}) {
      r.push_back({{MatchCtDirectionReply{}, MatchCtMark{kInboundMark}, MatchDaddrSet{set, type},
                    MatchDport{kUdp, kQuicPort}, MatchUdpLongHeader{}, StmtVerdict{VerdictKind::goto_, target}},
                   ""});
      r.push_back({{MatchCtDirectionReply{}, MatchCtMark{kInboundMark}, MatchDaddrSet{set, type},
                    MatchDport{kUdp, kQuicPort}, MatchMetaLengthOver{kQuicOneDatagramMax},
                    StmtVerdict{VerdictKind::goto_, target}},
                   ""});
    }
  }
  if (inbound) r.push_back({{MatchCtDirectionReply{}, MatchCtMark{kInboundMark}, to_pass()}, ""});
  // QUIC's long-header packets (a handshake's) to UDP 443, and packets
  // longer than one datagram (a GSO batch, which can hide one after a short
  // header), walk the phase chain even on a decided flow, where pinning sees
  // them (phase chain).
  // So do TCP segments with urgent data (pinning refuses them).
  if (pin && st.mode == Mode::allowlist) {
    r.push_back({{MatchDport{kUdp, kQuicPort}, MatchUdpLongHeader{}, StmtVerdict{VerdictKind::goto_, target}}, ""});
    r.push_back({{MatchDport{kUdp, kQuicPort}, MatchMetaLengthOver{kQuicOneDatagramMax},
                  StmtVerdict{VerdictKind::goto_, target}},
                 ""});
    r.push_back({{MatchTcpFlagUrg{}, StmtVerdict{VerdictKind::goto_, target}}, ""});
  }
  r.push_back({{MatchCtMark{st.mark}, StmtCounter{}, to_pass()}, st.to_comment()});
  if (guarded) {
    // Per flow, after the fast path (a flow's destination never changes, so
    // one that passed these under this phase passes them again): broadcast
    // and multicast reach every host of a segment, whatever entry (a /24, a
    // learned address) seems to allow them. fib knows the subnet broadcasts
    // of the namespace's own addresses; 255.255.255.255 is always broadcast.
    r.push_back({{MatchFibAddrType{true, AddrType::broadcast}, to_deny()}, ""});
    r.push_back({{MatchFibAddrType{true, AddrType::multicast}, to_deny()}, ""});
  }
  r.push_back({{StmtVerdict{VerdictKind::goto_, target}}, ""});
  return r;
}

// reject's TCP reset for a packet of a confirmed flow, which conntrack
// relates to that flow, on `lo` (`dev`: oif in chain output, iif in input);
// never on egressd's own upstream flows (see chain output).
Rule related_reset_on_lo(Stmt dev) {
  return {{std::move(dev), MatchCtStateRelated{}, MatchCtMarkNot{~std::uint32_t{0}, kOwnFlowMark}, MatchTcpFlagRst{},
           accept()},
          ""};
}

// ICMP errors at egressd's upstream sockets, on `lo` (`dev`: oif in chain
// output, iif in input): dropped. Any of them at such a socket fails the query
// it carries at once (SERVFAIL). egressd's own packets never meet the deny,
// so what conntrack relates to one of egressd's own flows (ct mark
// kOwnFlowMark) there is a forgery's doing: the deny's answer to a packet a
// sandbox process forged on the flow (its addresses and ports are on eth0 or
// lo for AF_PACKET to see; NET_RAW writes it), an ICMP error or reject's TCP
// reset, or an ICMP error a raw socket writes quoting the flow. An ICMP error
// conntrack relates to no flow at all (ct state invalid) is one quoting a
// packet no flow sent: on a flow Docker's resolver DNATs, the quoted header
// as the socket knows it (to 127.0.0.11:53), which the kernel still delivers
// to that socket. Genuine errors for an upstream outside the namespace
// arrive on its interface; for a loopback upstream (Docker's 127.0.0.11)
// that is down, egressd now waits out the try's timeout.
std::vector<Rule> upstream_errors_on_lo(const Stmt& dev) {
  const auto drop = [] { return StmtVerdict{VerdictKind::drop, ""}; };
  return {
      {{dev, MatchCtStateRelated{}, MatchCtMark{kOwnFlowMark}, StmtCounter{}, drop()}, ""},
      {{dev, MatchL4Proto{kIcmp}, MatchCtStateInvalid{}, StmtCounter{}, drop()}, ""},
      {{dev, MatchL4Proto{kIcmpv6}, MatchCtStateInvalid{}, StmtCounter{}, drop()}, ""},
  };
}

// What leaves from the DNS proxy's address and port is the proxy's own: its
// sockets carry the secret proxy mark (SO_MARK; accepted TCP sockets take
// the listener's). Without this a
// sandbox process with NET_RAW that sniffed a query redirected to the proxy —
// Docker's resolver relaying egressd's own query to its upstream, over `lo` —
// could write the proxy's answer itself from a raw socket: conntrack takes it
// as the reply of the redirected flow and undoes the redirect, the resolver
// hands it to egressd as its upstream's answer, and egressd learns the
// sandbox's address for an allowed name. The mark is then swapped for the
// pass signature, which chain lo_replies checks (a frame written to `lo`
// with AF_PACKET never meets this chain) and clears before any tap on `lo`
// sees it (SO_RCVMARK would show it); without a netdev table it is cleared
// here.
std::vector<Rule> proxy_source_rules(const CompileOptions& opts) {
  std::vector<Rule> out;
  const auto drop = [] { return StmtVerdict{VerdictKind::drop, ""}; };
  for (const char* host : {"127.0.0.1", "::1"}) {
    for (std::uint8_t proto : {kUdp, kTcp}) {
      out.push_back({{MatchOifLoopback{}, MatchSaddr{*parse_ip(host)}, MatchSport{proto, opts.dns_port},
                      MatchMetaMark{opts.proxy_mark, true}, StmtCounter{}, drop()},
                     ""});
    }
  }
  if (opts.netdev) {
    out.push_back({{MatchOifLoopback{}, MatchMetaMark{opts.proxy_mark}, StmtMetaMarkSet{opts.pass_mark},
                    StmtMetaPrioritySet{opts.pass_priority}},
                   ""});
  } else {
    out.push_back({{MatchOifLoopback{}, MatchMetaMark{opts.proxy_mark}, StmtMetaMarkSet{0}}, ""});
  }
  return out;
}

// The loopback upstreams, single addresses (chain lo_replies matches each).
std::vector<IpPrefix> loopback_upstreams(const CompileOptions& opts) {
  std::vector<IpPrefix> out;
  if (opts.dns_port == 0) return out;
  for (const auto* list : {&opts.upstreams, &opts.extra_upstreams}) {
    for (const IpPrefix& u : *list) {
      if (is_loopback(u) && u.prefix_len == u.size() * 8 && std::find(out.begin(), out.end(), u) == out.end()) {
        out.push_back(u);
      }
    }
  }
  return out;
}

Chain output_chain(const Policy& policy, const CompileOptions& opts) {
  Chain c{"output", BaseChain{HookType::filter, 0, true}, {}};
  // The fast path: a packet in the original direction of a flow a phase
  // decided (its ct mark is a phase's or an inline policy's, never 0 nor one
  // of the special marks) goes straight to chain active, which checks what
  // can differ from packet to packet of a flow (routing headers, source
  // routes, urgent data, QUIC handshakes) and passes the flow if it carries
  // the current phase's mark, or judges it by the phase otherwise. What it
  // skips holds for the whole flow since its first packet: that packet came
  // through every rule below (a phase's mark is set only by a phase chain,
  // reached only past them), and every later packet of the flow in the
  // original direction has the same addresses and ports (conntrack's tuple).
  // So the source check (class 1) needs no repeat: a packet with another
  // source is another flow, or a reply-direction one, and neither takes this
  // path. Nor does a packet conntrack only relates to the flow (ct state
  // related): an ICMP error quoting the flow's reply is related to it in its
  // original direction whatever its outer source (a raw socket can write one
  // from any address), so only new and established packets, the flow's own.
  // Only the sandbox's flows get a phase's mark (egressd's own upstream flows
  // and inbound ones carry special marks), and only a holder of
  // CAP_NET_ADMIN sets ct marks. Counted like `counter jump active` below
  // (status adds them up); the IPv4 rule first, for the family split.
  if (pinning(policy, opts)) {
    // A SYN in the original direction of a flow that has a mark starts a new
    // connection on an old one's addresses and ports. Conntrack keeps an entry
    // whose ends are gone without it seeing the client close (a server's reset
    // passes it in the reply direction only; reject's reset of a cut or refused
    // flow reaches the client only), the client's port is handed out
    // again, and conntrack takes the new SYN up in the old entry, mark and id
    // included: the new connection would be refused for good on a cut mark,
    // or admitted unread on an admitted one's. The reader takes such a SYN
    // (its conntrack id in the mark, as chain pin sends packets) and, if the
    // connection's socket wrote it, forgets the old connection and gives the
    // entry mark 0 with its verdict, so the new connection is judged as the
    // new flow it is; a SYN a raw socket wrote is dropped and changes nothing.
    // (The rule used to set the mark to 0 itself: a raw SYN with a wrong
    // checksum, which the server drops, then took a live connection's mark
    // off, and once the reader no longer knew the connection, after a restart
    // or pushed out of the followed ones, its next bytes came as a new flow's;
    // an attack review.) No reader: dropped, as everything chain pin queues.
    // Never egressd's own flows' mark nor an inbound flow's (0x7ffffffe and
    // 0x7fffffff, the one mask): neither is pinning's, and a SYN a sandbox
    // process forged on egressd's upstream flow must not reach the reader.
    c.rules.push_back({{MatchTcpFlagSyn{}, MatchCtDirectionOriginal{}, MatchCtMarkNot{~0u, 0},
                        MatchCtMarkNot{~(kOwnFlowMark ^ kInboundMark), kOwnFlowMark}, StmtMetaMarkSetCtId{},
                        StmtCounter{}, StmtQueue{kPinQueueNum}},
                       ""});
  }
  for (std::uint8_t family : {4, 6}) {
    c.rules.push_back({{MatchMetaNfproto{family}, MatchCtDirectionOriginal{}, MatchCtStateNewOrEstablished{},
                        MatchCtMarkNot{~0u, 0},
                        MatchCtMarkNot{kSpecialMarkMask, kSpecialMarks}, StmtCounter{},
                        StmtVerdict{VerdictKind::goto_, "active"}},
                       family == 4 ? kCountV4Fast : ""});
  }
  const IpPrefix lo4 = prefix("127.0.0.0", 8), lo6 = *parse_ip("::1");
  const IpPrefix any6 = *parse_ip("::"), ll6 = prefix("fe80::", 10), mc6 = prefix("ff02::", 16);
  if (opts.dns_port != 0) {
    // A packet that carries the own or the proxy mark keeps it only when it
    // comes from one of egressd's own sockets, told by its cgroup (chain
    // own_sockets): from any other socket it goes on without it, as a wrong
    // guess does, so a sandbox process that guessed either mark (NET_RAW sets
    // any SO_MARK) gets nothing for it, nor an answer that tells it so.
    // Every packet with a mark goes there, whichever: the work must not
    // depend on whether the mark is a secret (a review timed send(): the
    // ladder's 300 ns told a right guess from a wrong one).
    if (opts.own_cgroup) {
      c.rules.push_back({{MatchMetaMark{0, true}, StmtVerdict{VerdictKind::jump, kOwnSocketsChain}}, ""});
    }
    // Ahead of every accept on `lo`: no forged error may reach egressd's
    // upstream sockets (see upstream_errors_on_lo).
    for (auto& r : upstream_errors_on_lo(MatchOifLoopback{})) c.rules.push_back(std::move(r));
    for (auto& r : proxy_source_rules(opts)) c.rules.push_back(std::move(r));
    // egressd's own upstream queries (SO_MARK), only on a flow egressd itself
    // created (class 3: a sandbox that made the flow first, e.g. from
    // 127.0.0.11:53 to egressd's port, would otherwise receive egressd's
    // query as its reply), and only to the upstream sets' DNS port: even a
    // sandbox that guessed the mark reaches nothing else. The flow is marked
    // egressd's own: reject's reset for a packet forged on it does not pass
    // `lo` (see the related resets below), so a sandbox process that sniffed
    // egressd's TCP exchange (AF_PACKET) cannot aim one at its socket.
    for (const auto& [set, type] : {std::pair{kUpstreamSet4, SetType::ipv4_addr}, {kUpstreamSet6, SetType::ipv6_addr}}) {
      for (std::uint8_t proto : {kUdp, kTcp}) {
        c.rules.push_back({{MatchMetaMark{opts.own_mark}, MatchCtDirectionOriginal{}, MatchDaddrSet{set, type},
                            MatchDport{proto, 53}, StmtCtMarkSet{kOwnFlowMark}, to_pass()},
                           ""});
      }
    }
    // A loopback upstream (Docker's embedded resolver on 127.0.0.11, DNATed
    // to a random port): any port, the flow remembered as egressd's own, and
    // the mark cleared so no socket or tap on `lo` ever sees it.
    const std::pair<const char*, SetType> lo_sets[] = {{kLoUpstreamSet4, SetType::ipv4_addr},
                                                       {kLoUpstreamSet6, SetType::ipv6_addr}};
    for (const auto& [set, type] : lo_sets) {
      c.rules.push_back({{MatchMetaMark{opts.own_mark}, MatchCtDirectionOriginal{}, MatchDaddrSet{set, type},
                          StmtCtMarkSet{kOwnFlowMark}, StmtMetaMarkSet{0}, accept()},
                         ""});
    }
    // Nothing else goes out on egressd's own flows: a packet a raw socket
    // writes from the port of one of egressd's upstream sockets (listed in
    // /proc/net/udp) carries no own mark, belongs to egressd's flow (so the
    // redirect never sees it) and would pass to an upstream the phase
    // allows by address, a query past the proxy (found by an attack review).
    c.rules.push_back({{MatchCtDirectionOriginal{}, MatchCtMark{kOwnFlowMark}, StmtCounter{}, to_deny()}, ""});
    for (const auto& [set, type] : lo_sets) {
      c.rules.push_back({{MatchDaddrSet{set, type}, MatchCtDirectionReply{}, MatchCtMark{kOwnFlowMark}, accept()}, ""});
    }
    // The answers on those flows: from the resolver's own sockets only (its
    // cgroup, when egressd found it: a raw socket of the sandbox's sends from
    // the same address and port). Chain lo_answers judges them.
    if (opts.lo_resolver) {
      for (const auto& [set, type] : lo_sets) {
        c.rules.push_back({{MatchSaddrSet{set, type}, MatchCtDirectionReply{}, MatchCtMark{kOwnFlowMark},
                            StmtVerdict{VerdictKind::jump, kLoAnswersChain}},
                           ""});
      }
    }
    // Every reply that leaves `lo` from a loopback upstream's address (the
    // resolver's answers to egressd, the proxy's answers to the sandbox's
    // queries to it, reject's resets) is signed here and checked, and
    // cleared, by chain lo_replies of the netdev table, which drops what is
    // not signed: frames written to `lo` with AF_PACKET never meet this
    // chain. No verdict: the rules below decide as before.
    if (opts.netdev && !loopback_upstreams(opts).empty()) {
      for (const auto& [set, type] : lo_sets) {
        c.rules.push_back({{MatchCtDirectionReply{}, MatchCtOriginalDaddrSet{set, type},
                            StmtMetaMarkSet{opts.pass_mark}, StmtMetaPrioritySet{opts.pass_priority}},
                           ""});
      }
    }
    // Class 4: nobody else reaches a loopback upstream, on any port, in any
    // phase: Docker's resolver forwards from the host when the host's own
    // resolver is on loopback, where egressd cannot see it.
    for (const auto& [set, type] : lo_sets) {
      c.rules.push_back({{MatchDaddrSet{set, type}, StmtCounter{}, to_deny()},
                         type == SetType::ipv4_addr ? kLoUpstreamDeny4 : kLoUpstreamDeny6});
    }
    // egressd's own queries never go to its own proxy. A sandbox process can
    // leave conntrack entries behind whose redirect a later query of
    // egressd's from the same port follows (nat is consulted for new
    // entries only): it would come back to the proxy, which would forward it
    // again, in a loop (found by an attack review). Dropped, the query fails.
    for (const char* host : {"127.0.0.1", "::1"}) {
      for (std::uint8_t proto : {kUdp, kTcp}) {
        c.rules.push_back({{MatchMetaMark{opts.own_mark}, MatchDaddr{*parse_ip(host)}, MatchDport{proto, opts.dns_port},
                            StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}},
                           ""});
      }
    }
  }
  // Loopback, only where it is loopback: the device is `lo` (SO_BINDTODEVICE
  // eth0 to 127.0.0.1 routes out of eth0) and the source is the namespace's
  // own (a FREEBIND/transparent socket sending a target's address to itself
  // would otherwise create a flow whose "reply" direction reaches the target).
  c.rules.push_back({{MatchOifLoopback{}, MatchFibAddrType{false, AddrType::local}, accept()}, ""});
  // Redirected or DNATed to loopback (the DNS proxy; Docker's 127.0.0.11):
  // `oif` still names the device of the route before NAT.
  c.rules.push_back({{MatchDaddr{lo4}, MatchCtStatus{CtStatusBit::dnat}, MatchFibAddrType{false, AddrType::local}, accept()}, ""});
  c.rules.push_back({{MatchDaddr{lo6}, MatchCtStatus{CtStatusBit::dnat}, MatchFibAddrType{false, AddrType::local}, accept()}, ""});
  // The TCP reset `reject` sends back for a denied connection comes from the
  // denied address over `lo`, in the reply direction of a flow that was never
  // confirmed (its first packet was refused). Nothing a process sends looks
  // like that: its packets start flows (original direction) or belong to
  // confirmed ones.
  c.rules.push_back({{MatchOifLoopback{}, MatchCtDirectionReply{}, MatchCtStatus{CtStatusBit::confirmed, true},
                      accept()},
                     ""});
  // The reset `reject` sends for a packet of a confirmed flow — one a switch
  // cut (its next packet meets a phase that denies it) or pinning's cut mark
  // sends to deny — comes from the remote address over `lo` too, and
  // netfilter ties it to that flow's entry: conntrack calls it related.
  // Without this rule the source check below dropped it, and a cut client
  // retransmitted into the rejects until its own timeout. A TCP packet is
  // related only when netfilter made it so (no helper is ever attached, so
  // no expectation exists): what a process sends, raw sockets included,
  // starts a flow or belongs to one, and is judged by the rules below. But
  // a process can make the deny answer a packet it forged on one of
  // egressd's own upstream flows (their addresses and sequence numbers are
  // on eth0 for AF_PACKET to see), and so aim reject's reset at egressd's
  // socket: those flows' resets stay dropped.
  c.rules.push_back(related_reset_on_lo(MatchOifLoopback{}));
  // IPv6 duplicate address detection: a neighbour solicitation from the
  // unspecified address, before the address is the namespace's own.
  // ICMPv6 right after the IPv6 header, here and below: with a routing
  // header the first hop would send the message on (found by an attack
  // review); such a packet goes on to chain active, which denies it.
  c.rules.push_back(
      {{MatchSaddr{any6}, MatchLinkIcmpv6{kNdNeighborSolicit, 255, true}, MatchDaddr{mc6}, to_pass()}, ""});
  // Class 1: nothing leaves with a source address that is not the namespace's.
  // The IPv4 packets it denies are the difference of the two counters around
  // it (it has one lookup for both families; status splits its count).
  c.rules.push_back(count_v4(kCountV4AtSaddrCheck));
  c.rules.push_back({{MatchFibAddrType{false, AddrType::local, true}, StmtCounter{}, to_deny()}, ""});
  c.rules.push_back(count_v4(kCountV4PastSaddrCheck));
  if (policy.enforce.inbound_replies) {
    // Replies on flows that arrived from outside (chain input marks them):
    // conntrack state the sandbox made itself never counts as inbound, nor
    // does a TCP flow conntrack took up mid-stream (no SYN from outside: it
    // may be the sandbox's own outbound connection, its entry forgotten on a
    // forged RST and SYN). Those replies go on to the phase's rules below.
    // Accepted in chain active, after its per-packet guards.
    c.rules.push_back({{MatchCtDirectionReply{}, MatchCtMark{kInboundMark}, StmtVerdict{VerdictKind::goto_, "active"}},
                       ""});
  }
  // Neighbour discovery (hop limit 255: never routed, so never more than the
  // link) to link-local and multicast destinations, and solicitations and
  // advertisements to on-link global addresses (NUD probes to a gateway with
  // a global address, answers to a neighbour that solicited from one). Not
  // to anything else: a router forwards an NS/NA to an off-link address like
  // any packet, options and all.
  for (std::uint8_t t : {kNdRouterSolicit, kNdNeighborSolicit, kNdNeighborAdvert}) {
    c.rules.push_back({{MatchLinkIcmpv6{t, 255, true}, MatchDaddr{ll6}, to_pass()}, ""});
    c.rules.push_back({{MatchLinkIcmpv6{t, 255, true}, MatchDaddr{mc6}, to_pass()}, ""});
  }
  for (std::uint8_t t : {kNdNeighborSolicit, kNdNeighborAdvert}) {
    c.rules.push_back(
        {{MatchLinkIcmpv6{t, 255, true}, MatchDaddrSet{kOnlinkSet6, SetType::ipv6_addr}, to_pass()}, ""});
  }
  // Every packet the policy decides passes here once and is then either
  // accepted or sent to `deny`: allowed = the counters of this chain - deny's
  // counters (the early denies above count here and in deny). Both chains
  // outlive switches (only `active` and inline chains are rewritten), so
  // status counts across switches at no cost to a switch. The IPv4 ones are
  // counted apart, just before.
  c.rules.push_back(count_v4(kCountV4Decided));
  c.rules.push_back({{StmtCounter{}, StmtVerdict{VerdictKind::jump, "active"}}, ""});
  return c;
}

Chain pass_chain(const CompileOptions& opts) {
  Chain c{"pass", std::nullopt, {}};
  // Own traffic to an upstream that is a local address routes over `lo`:
  // taps there must not see the signature.
  c.rules.push_back({{MatchOifLoopback{}, StmtMetaMarkSet{0}, accept()}, ""});
  c.rules.push_back({{StmtMetaMarkSet{opts.pass_mark}, StmtMetaPrioritySet{opts.pass_priority}, accept()}, ""});
  return c;
}

// Nothing that arrived on `lo` is forwarded. A frame a process writes to
// `lo` with AF_PACKET arrives there without its socket; a namespace that
// forwards (a Docker container inherits the host's ip_forward) would route
// one for another address out of eth0 as a forwarded packet, which public's
// egress chains let out and conntrack never saw leave as the sandbox's: a
// spoofed source there opened an inbound flow through the gateway's DNAT
// (found by an attack review). The stack never forwards what it sent on
// `lo` itself.
Chain forward_chain() {
  Chain c{"forward", BaseChain{HookType::filter, 0, false, Hook::forward, ""}, {}};
  c.rules.push_back({{MatchIifLoopback{}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  return c;
}

Chain input_chain(const Policy& policy, const CompileOptions& opts) {
  Chain c{"input", BaseChain{HookType::filter, 0, false, Hook::input, ""}, {}};
  // Nothing delivered locally carries a mark or a priority, secret or not
  // (SO_RCVMARK and SO_RCVPRIORITY report them for every packet a socket
  // receives, without any capability). Cleared whatever they are: a clear of
  // the secret values only would tell a process which of its own marks was
  // a secret (found by an attack review).
  c.rules.push_back({{StmtMetaMarkSet{0}, StmtMetaPrioritySet{0}}, ""});
  // Frames written to `lo` with AF_PACKET (CAP_NET_RAW), and datagrams from
  // FREEBIND/transparent sockets that take a remote host's address (a forged
  // DNS answer to egressd), enter here with a foreign source: dropped. The
  // stack itself sends nothing over `lo` from a foreign source but reject's
  // TCP resets (see chain output) and replies on flows DNATed to a local
  // socket (the DNS proxy's answer to a query for 192.0.2.1:53 comes from
  // 192.0.2.1 once conntrack has undone the redirect), let through first.
  // egressd's own upstream flows are never DNATed by egressd, so a forged
  // "answer" from an upstream's address is still dropped. Errors aimed at
  // egressd's upstream sockets go first (chain output drops them already; on
  // a DNATed flow, Docker's resolver's, they would pass the accepts below).
  if (opts.dns_port != 0) {
    for (auto& r : upstream_errors_on_lo(MatchIifLoopback{})) c.rules.push_back(std::move(r));
  }
  c.rules.push_back({{MatchIifLoopback{}, MatchCtDirectionReply{}, MatchCtStatus{CtStatusBit::confirmed, true},
                      accept()},
                     ""});
  c.rules.push_back({{MatchIifLoopback{}, MatchCtDirectionReply{}, MatchCtStatus{CtStatusBit::dnat}, accept()}, ""});
  // reject's reset for a packet of a confirmed flow, not one of egressd's
  // own (see chain output).
  c.rules.push_back(related_reset_on_lo(MatchIifLoopback{}));
  c.rules.push_back({{MatchIifLoopback{}, MatchFibAddrType{false, AddrType::local, true},
                      StmtVerdict{VerdictKind::drop, ""}},
                     ""});
  if (opts.dns_port != 0) {
    // egressd's upstream sockets take replies only: a datagram that starts a
    // flow to one (a forged "answer" from a sandbox process) never arrives.
    // The direction first: most packets that come in are replies, and the
    // socket lookup is the expensive part.
    // With egressd's cgroup known, only when the socket is egressd's (chain
    // own_input): a sandbox socket that carries a guessed own mark is then
    // treated as any other, so what it receives tells it nothing.
    if (opts.own_cgroup) {
      c.rules.push_back({{MatchCtDirectionOriginal{}, MatchSocketMark{0, true},
                          StmtVerdict{VerdictKind::jump, kOwnInputChain}},
                         ""});
    } else {
      c.rules.push_back({{MatchCtDirectionOriginal{}, MatchSocketMark{opts.own_mark},
                          StmtVerdict{VerdictKind::drop, ""}},
                         ""});
    }
    // Nor anything conntrack knows nothing of (ct state invalid): a TCP reset
    // or an ICMP error for a flow it does not track, such as one naming
    // egressd's flow to Docker's resolver by the address and port egressd's
    // socket knows (127.0.0.11:53), not the ones it went out to after the
    // DNAT. The kernel would deliver it to the socket it names, and it would
    // kill the query. (The socket lookup reads an ICMP error's quoted header.)
    // With the netdev egress hook, chain lo_replies drops such a packet from
    // a loopback upstream's address first (unsigned: no flow); this holds
    // where that hook is missing, and for any other source.
    if (opts.own_cgroup) {
      c.rules.push_back({{MatchCtStateInvalid{}, MatchSocketMark{0, true},
                          StmtVerdict{VerdictKind::jump, kOwnInputChain}},
                         ""});
    } else {
      c.rules.push_back({{MatchCtStateInvalid{}, MatchSocketMark{opts.own_mark}, StmtCounter{},
                          StmtVerdict{VerdictKind::drop, ""}},
                         ""});
    }
    // Nor does anything start a flow from an upstream's DNS port to any
    // other port: an upstream's late or repeated answer, after egressd has
    // given up its socket and forgotten the flow, would start a new one here,
    // marked inbound below, and a sandbox process that took the port (one
    // datagram from each port finds it) could then send the upstream any
    // query as a reply on that flow, past the proxy (found by an attack
    // review). A resolver never opens a flow from its port 53.
    for (const auto& [set, type] : {std::pair{kUpstreamSet4, SetType::ipv4_addr}, {kUpstreamSet6, SetType::ipv6_addr}}) {
      for (std::uint8_t proto : {kUdp, kTcp}) {
        c.rules.push_back({{MatchCtStateNew{}, MatchSaddrSet{set, type}, MatchSport{proto, 53}, StmtCounter{},
                            StmtVerdict{VerdictKind::drop, ""}},
                           ""});
      }
    }
  }
  if (policy.enforce.inbound_replies) {
    // A TCP flow is inbound only if it began with a SYN from outside. With
    // nf_conntrack_tcp_loose (the default) conntrack also takes up a segment
    // from the middle of a connection it has no entry for as `ct state new`,
    // and a sandbox process can make it forget one of its own outbound flows:
    // a forged in-window RST and then a SYN on the flow's tuple (raw socket,
    // CAP_NET_RAW) are denied by chain output, but conntrack (priority -200)
    // has already closed the entry and dropped it. The server's next segment
    // would then start a fresh flow here, marked inbound, and the sandbox's
    // packets on the old connection would leave as replies in any phase. A
    // flow taken up mid-stream stays unmarked: its replies are judged by the
    // phase like any other packet. Other protocols have no handshake to tell.
    // The raw segments still reach conntrack: a rule ahead of it (priority
    // -300) would have to know the phase and tell a raw socket's packet from
    // the stack's, and nftables sees neither there.
    c.rules.push_back(
        {{MatchIifLoopback{true}, MatchTcpSynOnly{}, MatchCtStateNew{}, StmtCtMarkSet{kInboundMark}}, ""});
    // Other protocols: chain inbound_new, rewritten with the phase, marks
    // them outside public only.
    c.rules.push_back({{MatchIifLoopback{true}, MatchL4Proto{kTcp, true}, MatchCtStateNew{},
                        StmtVerdict{VerdictKind::jump, kInboundNewChain}},
                       ""});
  }
  return c;
}

// Chain inbound_new: a flow of another protocol than TCP that arrives from
// outside is inbound, outside public. In public it stays unmarked: its
// replies pass as everything does and take public's mark, which no later
// phase accepts. Otherwise a datagram the sandbox sent in public to a
// broadcast or multicast address (which any host on the segment answers from
// its own address, a flow conntrack has not seen), to a first hop with a
// route on to another host, or to a peer that answers from another port,
// opened an inbound flow that a later phase still let the sandbox use
// (found by an attack review; no capability needed).
std::vector<Rule> inbound_new_rules(const ActiveState& st) {
  if (st.mode == Mode::public_) return {};
  return {{{StmtCtMarkSet{kInboundMark}}, ""}};
}

std::vector<Rule> egress_check_rules(const ActiveState& st, const CompileOptions& opts) {
  std::vector<Rule> r;
  const bool open = st.mode == Mode::public_;
  // ARP is not IP: the kernel's own requests and replies never meet the
  // inet chains. Outside public it is the one unsigned thing that leaves.
  // ARP by the frame's own Ethernet type as well: an AF_PACKET socket bound
  // to ETH_P_ARP sets skb->protocol to ARP whatever frame it writes, and the
  // receiver reads the frame (an IP datagram labelled ARP left unsigned).
  r.push_back({{MatchMetaProtocolArp{}, MatchFrameBytes{12, {0x08, 0x06}}, accept()}, ""});
  r.push_back({{MatchMetaMark{opts.pass_mark}, MatchMetaPriority{opts.pass_priority}, StmtMetaMarkSet{0},
                StmtMetaPrioritySet{0}, accept()},
               ""});
  if (open) {
    // In public too, no frame a process wrote with AF_PACKET leaves (the
    // stack's own packets are signed; what the namespace forwards has no
    // socket and leaves). Conntrack never sees such a frame: the answer to
    // one (to a spoofed source that the gateway sent back, or simply the
    // peer's reply) would come in as a new flow from outside, be marked
    // inbound, and after a switch the sandbox's packets on it would pass as
    // replies in any phase.
    r.push_back({{MatchMetaHasSocket{}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
    r.push_back({{accept()}, ""});
  } else {
    // Counted, then back to the base chain and its policy: drop.
    r.push_back({{StmtCounter{}}, ""});
  }
  return r;
}

Chain deny_chain(const Policy& policy) {
  Chain c{"deny", std::nullopt, {}};
  // The kernel's own MLD reports are denied like everything else, but not
  // logged: a record nobody caused and nobody can act on would only bury the
  // ones that matter (every interface coming up sends a few).
  for (std::uint8_t t : {kMldListenerReport, kMldListenerDone, kMld2ListenerReport}) {
    c.rules.push_back({{MatchLinkIcmpv6{t, 1}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  }
  // Every IPv4 packet that reaches deny passes here (the MLD rules above
  // match IPv6 only).
  c.rules.push_back(count_v4(kCountV4Denied));
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
  // The own mark exempts only egressd's own sockets from the redirect: chain
  // own_sockets takes it off any other socket's packet, which is redirected
  // like a wrong guess (an answer from the proxy, not the upstream).
  // With egressd's cgroup known, chain own_nat lets egressd's own queries
  // go unredirected (accept) and returns for every other marked packet with
  // its mark untouched (the work of chain output's ladder must not depend on
  // what happened here: a review timed a right guess 400 ns faster when this
  // chain had taken the mark off).
  if (opts.own_cgroup) {
    c.rules.push_back({{MatchMetaMark{0, true}, StmtVerdict{VerdictKind::jump, kOwnNatChain}}, ""});
  }
  for (std::uint8_t proto : {kUdp, kTcp}) {
    if (opts.own_cgroup) {
      c.rules.push_back({{MatchDport{proto, 53}, StmtRedirect{opts.dns_port}}, ""});
    } else {
      c.rules.push_back({{MatchMetaMark{opts.own_mark, true}, MatchDport{proto, 53}, StmtRedirect{opts.dns_port}}, ""});
    }
  }
  return c;
}

// The own-traffic exemption sets: configured upstreams and run-time ones,
// loopback ones apart (see output_chain).
std::vector<Set> upstream_sets(const CompileOptions& opts) {
  std::vector<IpPrefix> by[2][2];  // [loopback][v6]
  for (const auto* list : {&opts.upstreams, &opts.extra_upstreams}) {
    for (const IpPrefix& u : *list) by[is_loopback(u)][u.family == 6].push_back(u);
  }
  // Nobody but egressd reaches Docker's resolver, used by egressd or not.
  if (const IpPrefix docker = *parse_ip(kDockerResolver4);
      std::find(by[1][0].begin(), by[1][0].end(), docker) == by[1][0].end()) {
    by[1][0].push_back(docker);
  }
  return {
      {kUpstreamSet4, SetType::ipv4_addr, false, false, make_addr_elems(by[0][0])},
      {kUpstreamSet6, SetType::ipv6_addr, false, false, make_addr_elems(by[0][1])},
      {kLoUpstreamSet4, SetType::ipv4_addr, false, false, make_addr_elems(by[1][0])},
      {kLoUpstreamSet6, SetType::ipv6_addr, false, false, make_addr_elems(by[1][1])},
      {kOnlinkSet6, SetType::ipv6_addr, true, false, make_interval_elems(opts.onlink6)},
  };
}

// Everything of the table except chain `active`'s rules, in declaration order.
Table staged_table(const Policy& policy, const CompileOptions& opts) {
  Table t;
  t.name = kTableName;
  t.sets = upstream_sets(opts);
  for (const auto& ph : policy.phases) {
    if (ph.mode == Mode::allowlist) {
      for (auto& s : phase_sets(phase_chain(ph.name), ph)) t.sets.push_back(std::move(s));
    }
  }
  t.chains.push_back(output_chain(policy, opts));
  t.chains.push_back(pass_chain(opts));
  t.chains.push_back(Chain{"active", std::nullopt, {}});
  if (policy.enforce.inbound_replies) t.chains.push_back(Chain{kInboundNewChain, std::nullopt, {}});
  t.chains.push_back(deny_chain(policy));
  const bool pin = pinning(policy, opts);
  if (pin) {
    t.chains.push_back(pin_chain(opts));
    t.chains.push_back(pin_follow_chain());
    t.chains.push_back(pin_untracked_chain());
    t.chains.push_back(pin_spoof_chain());
    t.chains.push_back(pin_spoof_in_chain());
  }
  for (const auto& ph : policy.phases) {
    t.chains.push_back(phase_chain_def(phase_chain(ph.name), ph, phase_mark(policy, ph.name, opts.mark_salt), pin,
                                      opts.pin_mark, opts.pin_priority));
  }
  t.chains.push_back(input_chain(policy, opts));
  t.chains.push_back(forward_chain());
  if (opts.dns_port != 0) t.chains.push_back(redirect_chain(opts));
  for (auto& chain : cgroup_chains(opts)) t.chains.push_back(std::move(chain));
  for (auto& chain : own_mark_chains(opts)) t.chains.push_back(std::move(chain));
  return t;
}

std::string hex8(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIx32, v);
  return buf;
}

// The value after `key` ("mark=0x") in an egressd table comment, or nullopt.
std::optional<std::uint32_t> comment_hex(const std::string& comment, const std::string& key) {
  const auto pos = comment.find(" " + key);
  if (comment.rfind("egressd ", 0) != 0 || pos == std::string::npos) return std::nullopt;
  const std::string v = comment.substr(pos + 1 + key.size(), 8);
  if (v.size() != 8 || v.find_first_not_of("0123456789abcdef") != std::string::npos) return std::nullopt;
  return static_cast<std::uint32_t>(std::stoul(v, nullptr, 16));
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

std::uint32_t phase_mark(const Policy& policy, std::string_view name, std::uint32_t salt) {
  for (std::size_t i = 0; i < policy.phases.size(); ++i) {
    if (policy.phases[i].name == name) {
      const std::uint64_t v = (std::uint64_t{salt} + i) % kPhaseMarkSpan;
      return static_cast<std::uint32_t>(v) + 1;
    }
  }
  return 0;
}

std::uint32_t inline_mark(std::uint64_t generation, std::uint32_t salt) {
  const std::uint64_t v = generation + salt - kDefaultMarkSalt;
  return kInlineMarkBit | static_cast<std::uint32_t>(v & 0x7fffffffu);
}

ActiveState make_state(const Policy& policy, const Phase& phase, std::uint64_t generation, bool is_inline,
                       std::uint32_t salt) {
  ActiveState st;
  st.generation = generation;
  st.is_inline = is_inline;
  st.phase = is_inline ? "inline" : phase.name;
  st.mode = phase.mode;
  st.mark = is_inline ? inline_mark(generation, salt) : phase_mark(policy, phase.name, salt);
  return st;
}

std::vector<Chain> cgroup_chains(const CompileOptions& opts) {
  std::vector<Chain> out;
  if (opts.dns_port == 0) return out;
  if (opts.lo_resolver) out.push_back(cgroup_ladder_chain(kLoAnswersChain, opts.lo_resolver->id, Ladder::drop_others));
  if (opts.own_cgroup) {
    out.push_back(cgroup_ladder_chain(kOwnSocketsChain, *opts.own_cgroup, Ladder::unmark_others));
    out.push_back(cgroup_ladder_chain(kOwnInputChain, *opts.own_cgroup, Ladder::drop_own));
    out.push_back(cgroup_ladder_chain(kOwnNatChain, *opts.own_cgroup, Ladder::nat_own));
  }
  return out;
}

std::vector<Chain> own_mark_chains(const CompileOptions& opts) {
  std::vector<Chain> out;
  if (opts.dns_port == 0 || !opts.own_cgroup) return out;
  // What is not egressd's loses the own and the proxy mark, and nothing
  // else (pinning's verdict marks ride on the sandbox's own packets).
  // The same work for any mark but one store (no counter of its own: a
  // review timed the difference).
  Chain foreign{kOwnForeignChain, std::nullopt, {}};
  foreign.rules.push_back({{StmtCounter{}}, ""});
  for (std::uint32_t mark : {opts.own_mark, opts.proxy_mark}) {
    foreign.rules.push_back({{MatchMetaMark{mark}, StmtMetaMarkSet{0}}, ""});
  }
  out.push_back(std::move(foreign));
  // egressd's own queries are not redirected.
  Chain nat_own{kOwnNatOwnChain, std::nullopt, {}};
  nat_own.rules.push_back({{MatchMetaMark{opts.own_mark}, StmtVerdict{VerdictKind::accept, ""}}, ""});
  out.push_back(std::move(nat_own));
  // What egressd's own upstream sockets receive: replies only.
  Chain own{kOwnInputOwnChain, std::nullopt, {}};
  own.rules.push_back({{MatchSocketMark{opts.own_mark}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""});
  out.push_back(std::move(own));
  return out;
}

std::string phase_chain(std::string_view phase) { return "ph_" + std::string(phase); }
std::string inline_chain(std::uint64_t generation) { return "il" + std::to_string(generation); }

std::pair<std::string, std::string> learned_sets(const std::string& chain) {
  const PhaseSets s = sets_for(chain);
  return {s.d4, s.d6};
}

std::string staged_digest(const Policy& policy, const CompileOptions& opts) {
  // The config, not the secrets (a restart compares digests before it knows
  // whether to adopt them) nor what the namespace holds right now.
  CompileOptions o = opts;
  o.own_mark = kOwnTrafficMark;
  o.pass_mark = kPassMark;
  o.pass_priority = kPassPriority;
  o.proxy_mark = kProxyMark;
  o.pin_mark = kPinMark;
  o.pin_priority = o.pin_priority != 0 ? kPinPriority : 0;  // whether the rules ask for it is the table's shape
  o.mark_salt = kDefaultMarkSalt;
  o.interfaces.clear();
  o.onlink6.clear();
  o.extra_upstreams.clear();
  // Whether each cgroup chain is there, not the cgroup: a restart re-fills
  // them (cgroup_chains) for the cgroups of now.
  if (o.lo_resolver) o.lo_resolver->id = 0;
  if (o.own_cgroup) o.own_cgroup = 0;
  std::string text = render_table(staged_table(policy, o));
  if (o.netdev) text += "netdev";
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, fnv1a(text));
  return buf;
}

std::uint32_t mark_from_table_comment(const std::string& comment) {
  return comment_hex(comment, "mark=0x").value_or(0);
}

std::optional<Secrets> secrets_from_table_comment(const std::string& comment) {
  const auto own = comment_hex(comment, "mark=0x"), pass = comment_hex(comment, "pass=0x"),
             salt = comment_hex(comment, "salt=0x");
  if (!own || !pass || !salt) return std::nullopt;
  // "pass=0xMMMMMMMM:0xPPPPPPPP": the priority follows the mark.
  const auto pos = comment.find(" pass=0x");
  const std::string p = comment.substr(pos + 8 + 8, 11);
  if (p.size() != 11 || p.compare(0, 3, ":0x") != 0 || p.find_first_not_of("0123456789abcdef", 3) != std::string::npos) {
    return std::nullopt;
  }
  return Secrets{*own, *pass, static_cast<std::uint32_t>(std::stoul(p.substr(3), nullptr, 16)), *salt,
                 comment_hex(comment, "proxy=0x").value_or(0), comment_hex(comment, "pin=0x").value_or(0)};
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
  // 125 bytes of the 127 a comment may have.
  t.comment = "egressd v1 digest=" + staged_digest(policy, opts) + " mark=" + hex8(opts.own_mark) +
              " pass=" + hex8(opts.pass_mark) + ":" + hex8(opts.pass_priority) + " salt=" + hex8(opts.mark_salt) +
              " proxy=" + hex8(opts.proxy_mark) + " pin=" + hex8(opts.pin_mark);
  if (inline_phase != nullptr) {
    const std::string chain = inline_chain(state.generation);
    if (inline_phase->mode == Mode::allowlist) {
      for (auto& s : phase_sets(chain, *inline_phase)) t.sets.push_back(std::move(s));
    }
    t.chains.push_back(
        phase_chain_def(chain, *inline_phase, state.mark, pinning(policy, opts), opts.pin_mark, opts.pin_priority));
  }
  for (auto& c : t.chains) {
    if (c.name == "active") {
      const bool sets = !state.is_inline || (inline_phase != nullptr && inline_phase->mode == Mode::allowlist);
      c.rules = active_rules(state, pinning(policy, opts), policy.enforce.inbound_replies, sets);
    }
    if (c.name == kInboundNewChain) c.rules = inbound_new_rules(state);
  }
  return t;
}

std::string egress_chain_name(const std::string& ifname) {
  // nft(8) identifiers are [A-Za-z0-9_./-]; interface names may hold more.
  const bool plain = !ifname.empty() && std::all_of(ifname.begin(), ifname.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' || ch == '.';
  });
  if (plain) return "eg_" + ifname;
  std::string hex = "eg_x";
  for (unsigned char ch : ifname) {
    char b[3];
    std::snprintf(b, sizeof b, "%02x", ch);
    hex += b;
  }
  return hex;
}

Chain egress_chain(const std::string& ifname) {
  // Policy drop: should egress_check ever be empty (flushed by someone),
  // nothing leaves the device.
  return {egress_chain_name(ifname), BaseChain{HookType::filter, 0, true, Hook::egress, ifname},
          {{{StmtVerdict{VerdictKind::jump, kEgressCheckChain}}, ""}}};
}

std::optional<Table> build_netdev_table(const ActiveState& state, const CompileOptions& opts) {
  if (!opts.netdev) return std::nullopt;
  Table t;
  t.name = kTableName;
  t.family = Family::netdev;
  t.comment = "egressd v1";
  t.chains.push_back({kEgressCheckChain, std::nullopt, egress_check_rules(state, opts)});
  std::vector<std::string> names = opts.interfaces;
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  for (const auto& n : names) t.chains.push_back(egress_chain(n));
  if (opts.dns_port != 0) {
    // Every frame leaving `lo`. Signed: a reply chain output vouched for (a
    // loopback upstream's answer to egressd, the DNS proxy's answer); the
    // signature goes before any tap sees it. Unsigned, from a loopback
    // upstream's address, or from the proxy's address and port: written
    // with AF_PACKET, dropped. The proxy's port is read at fixed offsets, so
    // an unsigned frame from its address with IPv4 options or IPv6
    // extension headers (which would move the port) is dropped too, and so
    // is any frame that is neither IPv4 nor IPv6 (an 802.1Q tag with VLAN
    // id 0 is stripped on receipt and the frame taken as the IP it carries).
    Chain c{kLoRepliesChain, BaseChain{HookType::filter, 0, false, Hook::egress, "lo"}, {}};
    const auto drop = [] { return StmtVerdict{VerdictKind::drop, ""}; };
    c.rules.push_back({{MatchMetaMark{opts.pass_mark}, MatchMetaPriority{opts.pass_priority}, StmtMetaMarkSet{0},
                        StmtMetaPrioritySet{0}, accept()},
                       ""});
    c.rules.push_back({{MatchFrameBytes{12, {0x08, 0x00}, true}, MatchFrameBytes{12, {0x86, 0xdd}, true},
                        StmtCounter{}, drop()},
                       ""});
    for (const auto& a : loopback_upstreams(opts)) {
      c.rules.push_back({{MatchFrameSaddr{a}, StmtCounter{}, drop()}, ""});
    }
    const std::vector<std::uint8_t> port{static_cast<std::uint8_t>(opts.dns_port >> 8),
                                         static_cast<std::uint8_t>(opts.dns_port & 0xff)};
    const IpPrefix host4 = *parse_ip("127.0.0.1"), host6 = *parse_ip("::1");
    c.rules.push_back({{MatchFrameSaddr{host4}, MatchFrameBytes{14, {0x45}, true}, StmtCounter{}, drop()}, ""});
    c.rules.push_back({{MatchFrameSaddr{host6}, MatchFrameBytes{20, {kTcp}, true}, MatchFrameBytes{20, {kUdp}, true},
                        MatchFrameBytes{20, {58}, true}, StmtCounter{}, drop()},
                       ""});
    for (std::uint8_t proto : {kUdp, kTcp}) {
      c.rules.push_back({{MatchFrameSaddr{host4}, MatchFrameBytes{23, {proto}}, MatchFrameBytes{34, port},
                          StmtCounter{}, drop()},
                         ""});
      c.rules.push_back({{MatchFrameSaddr{host6}, MatchFrameBytes{20, {proto}}, MatchFrameBytes{54, port},
                          StmtCounter{}, drop()},
                         ""});
    }
    // Whatever leaves `lo` leaves without a mark or a priority, before any
    // tap sees it: an AF_PACKET socket on `lo` reads each frame's mark
    // (SO_RCVMARK), and chain own_sockets takes the own and proxy marks off
    // a sandbox's packet but no other, so a right guess showed as 0 (found
    // by an attack review: 170k guesses a second).
    c.rules.push_back({{StmtMetaMarkSet{0}, StmtMetaPrioritySet{0}}, ""});
    t.chains.push_back(std::move(c));
  }
  return t;
}

Change build_switch(const Policy& policy, const Phase& target, const ActiveState& next,
                    const ActiveState& prev, const CompileOptions& opts) {
  Change ch;
  ch.table = kTableName;
  if (next.is_inline) {
    const std::string chain = inline_chain(next.generation);
    if (target.mode == Mode::allowlist) {
      for (auto& s : phase_sets(chain, target)) ch.ops.push_back(OpAddSet{std::move(s)});
    }
    ch.ops.push_back(
        OpAddChain{phase_chain_def(chain, target, next.mark, pinning(policy, opts), opts.pin_mark, opts.pin_priority)});
  }
  ch.ops.push_back(OpFlushChain{"active"});
  const bool sets = !next.is_inline || target.mode == Mode::allowlist;
  for (auto& r : active_rules(next, pinning(policy, opts), policy.enforce.inbound_replies, sets)) {
    ch.ops.push_back(OpAddRule{"active", std::move(r)});
  }
  if (policy.enforce.inbound_replies && inbound_new_rules(next).size() != inbound_new_rules(prev).size()) {
    // To or from public only, in the same batch.
    ch.ops.push_back(OpFlushChain{kInboundNewChain});
    for (auto& r : inbound_new_rules(next)) ch.ops.push_back(OpAddRule{kInboundNewChain, std::move(r)});
  }
  if (opts.netdev) {
    // Same batch: raw frames are blocked exactly when the inet policy says
    // so (class 5), never a moment apart. Between two phases for which the
    // chain says the same (any two but public: an agent's allowlist and the
    // verifier's no-network) it stays as it is: rewriting it was a quarter of
    // a switch's rules, each deleted, added and announced to every listener.
    auto rules = egress_check_rules(next, opts);
    const auto before = egress_check_rules(prev, opts);
    const bool same = std::equal(rules.begin(), rules.end(), before.begin(), before.end(),
                                 [](const Rule& a, const Rule& b) { return render_rule(a) == render_rule(b); });
    if (!same) {
      ch.ops.push_back(OpFlushChain{kEgressCheckChain, Family::netdev});
      for (auto& r : rules) ch.ops.push_back(OpAddRule{kEgressCheckChain, std::move(r), Family::netdev});
    }
  }
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
