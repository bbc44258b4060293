// Policy -> ruleset compiler. Pure: builds model objects (model.h) that
// render.cc prints and netlink.cc sends.
//
// Table layout (inet egressd), see rules/README.md for the annotated version:
//   chain output   base chain, hook output, policy drop: loopback, egressd's own
//                  DNS upstream traffic (by meta mark), replies to inbound
//                  connections, IPv6 neighbour discovery, then `jump active`.
//   chain active   two rules, rewritten by every switch (a constant-size batch):
//                  `ct mark <M> accept comment "<state>"` — the fast path: a flow
//                  decided under the phase in force passes with one ct lookup —
//                  and `goto <phase chain>`.
//   ph_<name>      one chain per named phase, staged ahead of time with its sets
//                  (ph_<name>_a4/_n4/_a6/_n6 for addresses/CIDRs, _d4/_d6 for
//                  DNS-learned addresses with timeouts). Allowed flows get
//                  `ct mark set <M>` so later packets take the fast path.
//   il<gen>        an inline policy's chain and sets, created by its switch and
//                  deleted by the next one.
//   deny           log (optional), then reject (TCP reset / icmpx
//                  admin-prohibited) or drop.
//   dns_redirect   nat output, priority -101 (before Docker's DNAT for
//                  127.0.0.11 at -100): udp/tcp dport 53 to any address -> the
//                  DNS proxy, except egressd's own marked upstream traffic.
//
// Why a ct mark per phase and not `ct state established accept`: accepting
// established flows is the classic bypass; with the mark, a flow decided under
// phase A is re-decided on its next packet once phase B is in force, so a
// switch cuts every flow B does not allow.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "egressd/policy.h"
#include "egressd/result.h"
#include "nft/model.h"

namespace egressd::nft {

inline constexpr const char* kTableName = "egressd";
// Denied packets logged per second (and burst) at most; the rest are denied unlogged.
inline constexpr std::uint32_t kLogRate = 100, kLogBurst = 50;
// The default meta mark (SO_MARK) of egressd's own upstream DNS sockets, used
// by `render`. The daemon draws a random mark when it creates the table and
// keeps it in the table comment: a sandbox process with CAP_NET_RAW (Docker's
// default) may set SO_MARK, but cannot read the ruleset (nfnetlink needs
// CAP_NET_ADMIN), nor the mark of egressd's sockets, so it has to guess 32 bits,
// one rejected packet per guess.
inline constexpr std::uint32_t kOwnTrafficMark = 0x65677264;  // "egrd"
// ct marks: named phase i gets kPhaseMarkBase + i + 1; inline policies get
// kInlineMarkBit | (generation & 0x7fffffff).
inline constexpr std::uint32_t kPhaseMarkBase = 0x45470000;
inline constexpr std::uint32_t kInlineMarkBit = 0x80000000;

// The port egressd's DNS proxy listens on (127.0.0.1 and ::1 in the sandbox).
inline constexpr std::uint16_t kDefaultDnsPort = 53;

struct CompileOptions {
  // Port of the DNS proxy on loopback; 0 = no proxy, no DNS redirect.
  std::uint16_t dns_port = kDefaultDnsPort;
  // The upstream DNS servers (port 53): egressd's own marked traffic may reach
  // these and nothing else.
  std::vector<IpPrefix> upstreams;
  std::uint32_t own_mark = kOwnTrafficMark;
};


// What is in force: stored in the comment of the first rule of chain `active`
// so that a restarted egressd adopts it from the kernel alone.
struct ActiveState {
  std::uint64_t generation = 0;
  std::string phase;    // named phase, or "inline"
  bool is_inline = false;
  Mode mode = Mode::no_network;
  std::uint32_t mark = 0;

  // "egressd gen=7 phase=agent mode=allowlist mark=0x45470002" (+ " inline")
  std::string to_comment() const;
  // Parses to_comment() output; invalid error on anything else.
  static Result<ActiveState> parse_comment(const std::string& comment);
};

// The ct mark for the named phase `name` of `policy`; 0 if it has no such phase.
std::uint32_t phase_mark(const Policy& policy, std::string_view name);
std::uint32_t inline_mark(std::uint64_t generation);

// The state for `phase` in force at `generation`: a named phase of `policy`
// (its staged mark), or, when `is_inline`, an inline policy (phase "inline").
ActiveState make_state(const Policy& policy, const Phase& phase, std::uint64_t generation, bool is_inline);

// Chain name for a named phase / an inline policy applied at `generation`.
std::string phase_chain(std::string_view phase);
std::string inline_chain(std::uint64_t generation);

// The whole table: every named phase of `policy` staged, plus `inline_phase`
// (when set: the inline policy in force, compiled at state.generation), with
// chain `active` pointing at state.phase. The table comment carries a digest
// of the staged part so a restart can tell whether the config changed.
Table build_table(const Policy& policy, const Phase* inline_phase, const ActiveState& state,
                  const CompileOptions& opts);

// Digest (16 hex digits) of what build_table stages for `policy` independent
// of the active state.
std::string staged_digest(const Policy& policy, const CompileOptions& opts);
// The digest stored in a table comment ("egressd v1 digest=... mark=..."), or "".
std::string digest_from_table_comment(const std::string& comment);
// The own-traffic mark stored in a table comment, or 0.
std::uint32_t mark_from_table_comment(const std::string& comment);

// The switch batch: rewrite chain `active` for `next`; when `next` is inline,
// first add `target`'s sets and chain; when `prev` was inline, delete its
// chain and sets after `active` no longer uses them. `target` is the phase
// being switched to (named, or the inline one).
Change build_switch(const Policy& policy, const Phase& target, const ActiveState& next,
                    const ActiveState& prev);

// The learned-address sets of the chain for a phase: {v4 set, v6 set} names.
std::pair<std::string, std::string> learned_sets(const std::string& chain);

}  // namespace egressd::nft
