// Policy -> ruleset compiler. Pure: builds model objects (model.h) that
// render.cc prints and netlink.cc sends.
//
// Two tables, see rules/README.md for the annotated version:
//
// table inet egressd
//   chain output   base chain, hook output, policy drop. In order:
//                  egressd's own upstream DNS traffic (its secret SO_MARK, on a
//                  flow egressd itself created, to the upstream sets' port 53);
//                  nobody else reaches a loopback upstream (Docker's 127.0.0.11,
//                  any port); loopback, only on `lo` (or DNATed/redirected there)
//                  and only from a local source; IPv6 DAD; every other packet
//                  whose source is not the namespace's own is denied; replies
//                  on flows that really arrived from outside (ct mark INBOUND);
//                  neighbour discovery to link-local, multicast and on-link
//                  destinations; then `jump active`.
//   chain pass     every packet accepted for a non-loopback device leaves through
//                  here: it is signed with the pass mark and priority (secrets),
//                  which the netdev egress chains check and clear.
//   chain active   rewritten by every switch (a constant-size batch): outside
//                  `public` the source-route and routing-header guards, then
//                  `ct mark <M> counter goto pass comment "<state>"` — the fast
//                  path — then (outside `public`) broadcast and multicast
//                  destinations denied, then `goto <phase chain>`.
//   ph_<name>      one chain per named phase, staged ahead of time with its sets
//                  (ph_<name>_a4/_n4/_a6/_n6 for addresses/CIDRs, _d4/_d6 for
//                  DNS-learned addresses with timeouts). Allowed flows get
//                  `ct mark set <M>` and go to `pass`.
//   il<gen>        an inline policy's chain and sets, created by its switch and
//                  deleted by the next one.
//   deny           log (optional), then reject (TCP reset / icmpx
//                  admin-prohibited) or drop.
//   input          base chain, hook input: clears the secrets from anything
//                  delivered locally, drops frames injected on `lo` with a
//                  foreign source, keeps egressd's upstream sockets for replies,
//                  and marks flows that arrive from outside INBOUND (TCP only
//                  on a SYN without ACK: not a connection taken up mid-stream).
//   dns_redirect   nat output, priority -101 (before Docker's DNAT for
//                  127.0.0.11 at -100): udp/tcp dport 53 to any address -> the
//                  DNS proxy, except egressd's own marked upstream traffic.
//
// table netdev egressd (kernels with the egress hook, >= 5.16)
//   egress_check   rewritten in the same batch as `active`: signed packets have
//                  their signature cleared and leave; outside `public` so does
//                  ARP, and nothing else (raw AF_PACKET frames never passed the
//                  inet chains, so they carry no signature).
//   eg_<ifname>    one base chain per non-loopback interface, hook egress,
//                  policy drop: `jump egress_check`.
//
// Why a ct mark per phase and not `ct state established accept`: accepting
// established flows is the classic bypass; with the mark, a flow decided under
// phase A is re-decided on its next packet once phase B is in force, so a
// switch cuts every flow B does not allow. The marks derive from a per-table
// salt, drawn anew whenever the staged config changes, so a restart with
// reordered phases cannot hand a cut flow another phase's mark.
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

// ---- secrets ----------------------------------------------------------------
// The daemon draws every secret at random when it creates its table and keeps
// them in the inet table's comment, so a restart adopts them. Nothing in the
// sandbox can read them: the ruleset needs CAP_NET_ADMIN (nfnetlink), marks of
// egressd's sockets need CAP_NET_ADMIN (sock_diag), and no packet carrying one
// is ever seen by a local socket or a packet tap (the chains clear them before
// a packet reaches `lo` or leaves a device). A sandbox with CAP_NET_RAW (Docker's
// default) may set SO_MARK and SO_PRIORITY on any socket, AF_PACKET included,
// so it has to guess: 32 bits for the own mark, 64 for the pass signature.
// `render` prints the fixed defaults below so goldens stay readable.
//
// SO_MARK of egressd's own upstream DNS sockets.
inline constexpr std::uint32_t kOwnTrafficMark = 0x65677264;  // "egrd"
// The pass signature (skb mark + skb priority): set on every packet the inet
// chains accept for a non-loopback device, checked and cleared by the netdev
// egress chains.
inline constexpr std::uint32_t kPassMark = 0x70617373;      // "pass"
inline constexpr std::uint32_t kPassPriority = 0x65677264;  // prints as 6567:7264
// SO_MARK of the DNS proxy's own sockets: what the proxy sends from its
// loopback address and port must carry it (a raw socket could write the
// proxy's answer on a redirected flow). Chain output turns it into the pass
// signature, or clears it, before any tap on `lo` sees it. (Not SO_PRIORITY:
// an accepted TCP socket does not take its listener's priority, and the
// kernel's FIN or ACK of a socket the proxy has not configured yet would lack
// it; it takes the listener's mark.)
inline constexpr std::uint32_t kProxyMark = 0x70727879;  // "prxy"
// The skb mark of what hostname pinning's reader lets go (see pin_admit_mark).
inline constexpr std::uint32_t kPinMark = 0x70696e21;  // "pin!"
// ... and its skb priority, which the reader's verdict sets too
// (NFQA_PRIORITY, Linux >= 5.18): the pin rules ask for both, so a sandbox
// that found the mark (the reader's reset tells a right guess of the mark
// alone from a wrong one) still has 32 bits to guess, and no answer tells a
// right guess of one half from a wrong one. 0: the mark alone (a kernel
// that cannot set it, or a table from before it).
inline constexpr std::uint32_t kPinPriority = 0x70726921;  // "pri!"
// ct marks: named phase i gets 1 + (salt + i) mod kPhaseMarkSpan, in
// [1, 0x7ffffffb]; inline policies get kInlineMarkBit | (generation + salt -
// kDefaultMarkSalt). With the default salt these are 0x45470001... and
// 0x80000000 | generation.
inline constexpr std::uint32_t kDefaultMarkSalt = 0x45470000;
inline constexpr std::uint32_t kPhaseMarkSpan = 0x7ffffffb;  // the marks above it are kPinFollowMark...
inline constexpr std::uint32_t kInlineMarkBit = 0x80000000;
// Flows that arrived from outside the namespace (input, iif != lo, ct state
// new, and for TCP a SYN without ACK: a connection conntrack took up
// mid-stream may be the sandbox's own): the only ones whose reply direction
// output accepts as such.
inline constexpr std::uint32_t kInboundMark = 0x7fffffff;
// egressd's own upstream flows. To a loopback upstream: their replies
// (Docker's resolver answering) pass the block on loopback upstreams. To any
// upstream: reject's resets related to the flow do not pass `lo`, so a
// sandbox process cannot make the deny reset egressd's TCP socket with a
// packet it forged on the flow.
inline constexpr std::uint32_t kOwnFlowMark = 0x7ffffffe;
// A flow hostname pinning admitted for a name that the phase switched to does
// not allow (docs/pinning.md "Switches"): the daemon gives it this ct mark
// (ctnetlink) and chain active sends every later packet of it to deny.
inline constexpr std::uint32_t kPinCutMark = 0x7ffffffd;
// The four marks above kPhaseMarkSpan differ from each other in their last two
// bits only: `ct mark & kSpecialMarkMask == kSpecialMarks` tells them from
// every phase's and inline policy's mark (output's fast path).
inline constexpr std::uint32_t kSpecialMarkMask = 0xfffffffc;
inline constexpr std::uint32_t kSpecialMarks = 0x7ffffffc;

// Hostname pinning (docs/pinning.md). With CompileOptions::pin and the
// policy's enforce.pin_names, in allowlist phases a TCP flow, or a UDP flow
// to port 443 (QUIC), whose address is in a learned set only (no IP/CIDR
// entry) and whose ct mark is still 0 goes to chain `pin`: the TCP handshake
// passes unmarked, every later packet goes to nfnetlink_queue kPinQueueNum,
// every QUIC datagram to kPinUdpQueueNum (no bypass: no reader, no traffic). The
// reader's verdict re-runs the hook (NF_REPEAT) with an skb mark: the admit
// mark (admitted: the phase chain sets the flow's ct mark to the phase's, and
// the fast path takes every later packet), kPinResetMark (refused: chain pin
// answers with a TCP reset, or ICMP admin-prohibited for QUIC), or, for a
// payload-less packet of an undecided TCP flow, the pass mark (passes, flow
// stays undecided). The verdict sets no ct
// mark itself: NFQA_CT needs CONFIG_NETFILTER_NETLINK_GLUE_CT, which some
// kernels lack (and then ignore it silently).
inline constexpr const char* kPinChain = "pin";
inline constexpr std::uint16_t kPinQueueNum = 16;
// UDP's own queue, bound without NFQA_CFG_F_GSO: the kernel splits a GSO
// batch (UDP_SEGMENT) before queueing it, so the reader judges each datagram
// on its own (the TCP queue keeps GSO packets whole: it needs their checksum
// state, and a byte stream has no boundaries to lose).
inline constexpr std::uint16_t kPinUdpQueueNum = 17;
// The mark chain pin gives a datagram of a UDP flow whose ct mark is already
// set (the kernel passed it: the reader admitted it, or an earlier phase did)
// in place of its conntrack id: an Initial on such a flow is never judged
// afresh by a reader that no longer holds the flow's assembler (the server
// may hold part of that connection's stream). A flow whose conntrack id is
// this value by chance is taken for one (fail closed: its Initials refused).
inline constexpr std::uint32_t kPinUdpPassedMark = 0x71756963;  // "quic"
// A UDP 443 packet longer than this may be a GSO batch, whose datagrams after
// the first the long-header match cannot see: it leaves the fast path of a
// decided QUIC flow for the reader. A QUIC client sends no datagram longer
// than its path's MTU (1500 on Ethernet; it sets DF and never fragments), and
// a batch hiding an Initial a server accepts (RFC 9000 §14.1: in a datagram of
// at least 1200 bytes) behind a first datagram at least as long is at least
// 2 × 1200 bytes plus headers.
inline constexpr std::uint32_t kQuicOneDatagramMax = 1500;
// Cleartext HTTP: every request on a keep-alive connection names its own
// host, so a flow the reader admitted for an HTTP request is not given the
// phase's mark (and the fast path) but kPinFollowMark: chain pin sends its
// packets to queue kPinFollowQueueNum, where the reader judges each later
// request head (docs/pinning.md "Later requests"). The reader's verdict
// `follow` re-runs the hook with pin_follow_mark, which the phase chain turns
// into the ct mark. A packet from that queue the reader does not follow (it
// restarted, or forgot the connection) is refused: the flow is never
// admitted unread. A TLS flow the reader admits is followed too, through its
// handshake: every later ClientHello is judged (a HelloRetryRequest asks for
// one), and a retransmission of bytes read, from pages the sender may have
// rewritten, is sent with the bytes judged. Then the reader's admit mark gives
// the flow the phase's mark.
inline constexpr std::uint32_t kPinFollowMark = 0x7ffffffc;
static_assert((kInboundMark & kSpecialMarkMask) == kSpecialMarks && (kOwnFlowMark & kSpecialMarkMask) == kSpecialMarks &&
              (kPinCutMark & kSpecialMarkMask) == kSpecialMarks && (kPinFollowMark & kSpecialMarkMask) == kSpecialMarks &&
              (kPhaseMarkSpan & kSpecialMarkMask) != kSpecialMarks && kPhaseMarkSpan + 1 == kSpecialMarks &&
              (kInlineMarkBit & kSpecialMarkMask) != kSpecialMarks);
inline constexpr std::uint16_t kPinFollowQueueNum = 18;
// A TCP flow to a learned-only address that carries another phase's mark
// (opened under an earlier phase, passed there by an address entry or a
// public phase, or admitted by name there): chain pin sends its packets to
// this queue, where the reader admits it again (the phase's mark) only if it
// admitted the connection by name and the switch kept it, and refuses it
// otherwise. (Queue 19 is the namespace claim, daemon/netns_claim.h.)
inline constexpr std::uint16_t kPinForeignQueueNum = 20;
// A followed connection's packets, from chain pin: only those with bytes
// (and any with the urgent flag) go to queue kPinFollowQueueNum; one that is
// its headers alone (an ACK, a FIN, a reset) carries nothing to judge and
// passes in the kernel, so a download's ACKs never leave it.
inline constexpr const char* kPinFollowChain = "pin_follow";
// A TCP packet to a learned-only address that conntrack gave no entry (it
// calls it invalid: out of its window, or an ACK on an entry a sandbox with
// NET_RAW closed and reopened with forged RST and SYN segments the server
// dropped): one without bytes passes (a closing reset or ACK), one with
// bytes or the urgent flag is dropped. Never let through unread.
inline constexpr const char* kPinUntrackedChain = "pin_untracked";
// An skb mark only the reader's verdict sets on purpose; a sandbox that
// sets it with SO_MARK only gets its own undecided flows reset.
inline constexpr std::uint32_t kPinResetMark = 0x72737421;  // "rst!"
// The skb mark a socket's SYN gets in place of its conntrack id when it
// meets an entry on its addresses and ports that the server's side started
// (a late packet of the server's after conntrack forgot the connection, or
// after egressd deleted a refused flow's entry): conntrack calls the SYN
// invalid (chain pin_untracked), or, in the states where a SYN may come from
// either end, takes it in the entry's reply direction (chain pin). Let
// through, the handshake's ACK would be in the reply direction of that entry
// (reset by chain pin) and the server left with a half-open connection that
// refuses the next SYN. The reader has the entry deleted and drops the SYN;
// the socket's retry a second later starts an entry of its own.
inline constexpr std::uint32_t kPinStraySynMark = 0x72657673;  // "revs"
// The skb marks of the reader's verdicts: let go (the pin mark itself),
// admitted, followed. Derived from the pin mark, a secret of their own: a
// sandbox that guesses one skips only the name check, never the address
// check before it, and learns nothing of the pass signature (until
// 2026-12-06 they derived from the pass mark, and chain pin's pass on the
// mark alone told a guess of it apart: found by an attack review).
constexpr std::uint32_t pin_admit_mark(std::uint32_t pin_mark) { return ~pin_mark; }
constexpr std::uint32_t pin_follow_mark(std::uint32_t pin_mark) { return ~pin_mark ^ 1u; }

// The port egressd's DNS proxy listens on (127.0.0.1 and ::1 in the sandbox).
inline constexpr std::uint16_t kDefaultDnsPort = 53;

// Set names of the own-traffic exemption: upstreams (and relay targets) off
// the namespace, and loopback ones (Docker's 127.0.0.11), per family.
inline constexpr const char* kUpstreamSet4 = "upstream4";
inline constexpr const char* kUpstreamSet6 = "upstream6";
inline constexpr const char* kLoUpstreamSet4 = "lo_upstream4";
inline constexpr const char* kLoUpstreamSet6 = "lo_upstream6";
// Docker's embedded resolver, a fixed address in every container on a
// user-defined network. It is always in lo_upstream4, whatever egressd's own
// upstream: where the host's resolver is on the host's loopback it forwards
// from the host's namespace, so a query to its real port (behind its DNAT
// of :53, listed in /proc/net/udp) would pass every phase past the proxy
// (found by an attack review: the agent and a sidecar with dns.upstream).
inline constexpr const char* kDockerResolver4 = "127.0.0.11";
// Global IPv6 prefixes on-link on a non-loopback interface (routes without a
// gateway): neighbour discovery may address them.
inline constexpr const char* kOnlinkSet6 = "onlink6";
// The netdev chain every egress base chain jumps to.
inline constexpr const char* kEgressCheckChain = "egress_check";
// Marks flows of other protocols than TCP that arrive from outside as
// inbound, outside public (rewritten by a switch to or from public).
inline constexpr const char* kInboundNewChain = "inbound_new";
// With pinning: a base chain on output at priority raw (-300), ahead of
// conntrack, that drops a TCP packet a socket writes from an address that is
// not the namespace's own (compile.cc, spoof_chain).
inline constexpr const char* kPinSpoofChain = "pin_spoof";
// ... and one on prerouting, also at priority raw: a TCP packet that comes in
// on `lo` from an address that is not the namespace's own (an AF_PACKET
// socket on `lo` writes frames that come back in as if from the wire).
inline constexpr const char* kPinSpoofInChain = "pin_spoof_in";
// The netdev egress chain of `lo`, there only with a loopback upstream:
// frames from a loopback upstream's address leave `lo` only when chain output
// signed them as replies on egressd's own flows (an AF_PACKET frame written
// to `lo` never meets chain output).
inline constexpr const char* kLoRepliesChain = "lo_replies";
// Chain inet lo_answers, there only with the resolver's cgroup known
// (CompileOptions::lo_resolver): the answers on egressd's own flows to a
// loopback upstream return from it only when their socket is in exactly
// that cgroup, at any of the first kResolverLevels levels of the cgroup v2
// hierarchy; every other full socket's packet is dropped.
inline constexpr const char* kLoAnswersChain = "lo_answers";
inline constexpr std::uint32_t kResolverLevels = 16;
// Chain inet own_sockets, there only with egressd's own cgroup known
// (CompileOptions::own_cgroup): chain output jumps to it with every packet
// that carries the own or the proxy mark, chain dns_redirect with the own
// mark; the packet keeps its mark only when its socket is in exactly
// egressd's cgroup (the same ladder as lo_answers); from any other it goes
// on without it, as if the sandbox had guessed wrong (a drop would tell a
// right guess from a wrong one: found by an attack review).
inline constexpr const char* kOwnSocketsChain = "own_sockets";
// Chain inet own_input (with own_sockets): chain input's drops of new
// flows and untracked packets to a socket with the own mark hold only for
// egressd's own sockets, so a sandbox socket with a guessed mark is told
// nothing by what it receives.
inline constexpr const char* kOwnInputChain = "own_input";
// Where own_sockets sends what is not egressd's: the own and the proxy mark
// come off, any other mark stays. Every packet with a mark (any) goes
// through the ladder, so the work does not tell a secret mark from another.
inline constexpr const char* kOwnForeignChain = "own_foreign";
// Where own_input sends egressd's own sockets: the own mark's drop. Every
// socket with a mark (any) goes through the ladder, for the same reason.
inline constexpr const char* kOwnInputOwnChain = "own_input_own";
// Chain inet own_nat (with own_sockets), jumped to from dns_redirect with
// every marked packet: egressd's own sockets go to own_nat_own, whose own
// mark is not redirected (accept); every other returns with its mark as it
// was, and is redirected like any packet.
inline constexpr const char* kOwnNatChain = "own_nat";
inline constexpr const char* kOwnNatOwnChain = "own_nat_own";
// Comments of the count-only `meta nfproto ipv4 counter` rules that split
// status's traffic counters by family (IPv6 = the rest: every packet in an
// inet chain is one or the other). In chain output, around the forged-source
// deny (its packets: at - past) and before `counter jump active`; in chain
// deny, ahead of its verdicts. They never end a packet's way through a chain.
inline constexpr const char* kCountV4Fast = "ipv4 fast path";
inline constexpr const char* kCountV4AtSaddrCheck = "ipv4 at saddr check";
inline constexpr const char* kCountV4PastSaddrCheck = "ipv4 past saddr check";
inline constexpr const char* kCountV4Decided = "ipv4 decided";
inline constexpr const char* kCountV4Denied = "ipv4 denied";
// Comments of the two class-4 denies (a loopback upstream), one per family.
inline constexpr const char* kLoUpstreamDeny4 = "ipv4 to loopback upstream";
inline constexpr const char* kLoUpstreamDeny6 = "ipv6 to loopback upstream";

struct CompileOptions {
  // Port of the DNS proxy on loopback; 0 = no proxy, no DNS redirect, no
  // own-traffic rules.
  std::uint16_t dns_port = kDefaultDnsPort;
  // The upstream DNS servers (port 53): egressd's own marked traffic may reach
  // these and nothing else.
  std::vector<IpPrefix> upstreams;
  // Secrets (see above).
  std::uint32_t own_mark = kOwnTrafficMark;
  std::uint32_t pass_mark = kPassMark;
  std::uint32_t pass_priority = kPassPriority;
  std::uint32_t proxy_mark = kProxyMark;
  std::uint32_t pin_mark = kPinMark;
  std::uint32_t pin_priority = kPinPriority;  // 0: the pin rules ask for the mark alone
  std::uint32_t mark_salt = kDefaultMarkSalt;
  // The kernel has the netdev egress hook: build table netdev egressd.
  bool netdev = true;
  // The daemon runs the pinning queue reader: allowlist phases get the pin
  // rules when the policy's enforce.pin_names is on.
  bool pin = false;

  // What the namespace looks like now (not part of the staged digest):
  // non-loopback interface names (one egress chain each), on-link global
  // IPv6 prefixes, and upstreams added at run time (relay targets).
  std::vector<std::string> interfaces;
  std::vector<IpPrefix> onlink6;
  std::vector<IpPrefix> extra_upstreams;
  // The cgroup (v2) of the sockets a loopback upstream listens on (Docker's
  // resolver: dockerd's), by id; its level in the hierarchy need not be
  // known (egressd in a cgroup namespace of its own cannot see it): chain
  // lo_answers tries every level. Replies on egressd's own flows to a
  // loopback upstream are dropped unless their socket is in exactly that
  // cgroup: a sandbox process with NET_RAW that sniffed egressd's query could
  // otherwise answer it from the resolver's address and port. Unknown: no
  // such rule (egressd says so).
  struct ResolverCgroup {
    std::uint64_t id = 0;
    bool operator==(const ResolverCgroup&) const = default;
  };
  std::optional<ResolverCgroup> lo_resolver;
  // The cgroup (v2) id of egressd's own sockets (the upstream sockets' own
  // mark, the proxy's proxy mark): a packet with either mark from a socket
  // in any other cgroup is dropped, so the marks are no secrets a sandbox
  // process could use once guessed. It tells egressd from the sandbox where
  // they run in different cgroups (a sidecar container, the agent). Unknown:
  // the marks alone (egressd says so).
  std::optional<std::uint64_t> own_cgroup;
};

// The secrets of a table, as its comment carries them.
struct Secrets {
  std::uint32_t own_mark = 0, pass_mark = 0, pass_priority = 0, mark_salt = 0;
  std::uint32_t proxy_mark = 0;  // 0: a table from before the proxy had one
  std::uint32_t pin_mark = 0;    // 0: a table from before the pin mark (its pin marks derive from the pass mark)
  std::uint32_t pin_priority = 0;  // 0: none (the mark alone: a table from before it, or a kernel without it)
};
// Parses "mark=0x... pass=0x...:0x... salt=0x... proxy=0x..." out of an
// egressd table comment; nullopt unless the first four are there (an older
// egressd's table has only the mark: see mark_from_table_comment).
std::optional<Secrets> secrets_from_table_comment(const std::string& comment);

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

// The ct mark for the named phase `name` of `policy` under `salt`; 0 if it has
// no such phase.
std::uint32_t phase_mark(const Policy& policy, std::string_view name, std::uint32_t salt = kDefaultMarkSalt);
std::uint32_t inline_mark(std::uint64_t generation, std::uint32_t salt = kDefaultMarkSalt);

// The state for `phase` in force at `generation`: a named phase of `policy`
// (its staged mark), or, when `is_inline`, an inline policy (phase "inline").
ActiveState make_state(const Policy& policy, const Phase& phase, std::uint64_t generation, bool is_inline,
                       std::uint32_t salt = kDefaultMarkSalt);

// Chain name for a named phase / an inline policy applied at `generation`.
std::string phase_chain(std::string_view phase);
std::string inline_chain(std::uint64_t generation);

// The whole inet table: every named phase of `policy` staged, plus
// `inline_phase` (when set: the inline policy in force, compiled at
// state.generation), with chain `active` pointing at state.phase. The table
// comment carries a digest of the staged part, so a restart can tell whether
// the config changed, and the secrets.
Table build_table(const Policy& policy, const Phase* inline_phase, const ActiveState& state,
                  const CompileOptions& opts);
// Table netdev egressd for `state`'s mode and opts.interfaces (empty when
// !opts.netdev: nothing to build).
// The cgroup ladders of the options (lo_answers, own_sockets), each with its
// rules: a table has them; an adopted one gets them re-filled, since the
// cgroups may be others now (a restarted container, a restarted dockerd).
std::vector<Chain> cgroup_chains(const CompileOptions& opts);
// The fixed chains behind own_sockets and own_input (own_foreign,
// own_input_own): they name the secrets, not the cgroup, so a restart keeps
// them.
std::vector<Chain> own_mark_chains(const CompileOptions& opts);
std::optional<Table> build_netdev_table(const ActiveState& state, const CompileOptions& opts);
// The egress base chain for interface `ifname` and its chain name.
Chain egress_chain(const std::string& ifname);
std::string egress_chain_name(const std::string& ifname);

// Digest (16 hex digits) of what build_table stages for `policy` independent
// of the active state, the secrets and the namespace's interfaces.
std::string staged_digest(const Policy& policy, const CompileOptions& opts);
// The digest stored in a table comment ("egressd v1 digest=... mark=..."), or "".
std::string digest_from_table_comment(const std::string& comment);
// The own-traffic mark stored in a table comment, or 0.
std::uint32_t mark_from_table_comment(const std::string& comment);

// The switch batch: rewrite chain `active` for `next` (and the netdev chain
// egress_check, in the same batch); when `next` is inline, first add
// `target`'s sets and chain; when `prev` was inline, delete its chain and sets
// after `active` no longer uses them. `target` is the phase being switched to
// (named, or the inline one).
Change build_switch(const Policy& policy, const Phase& target, const ActiveState& next,
                    const ActiveState& prev, const CompileOptions& opts);

// The learned-address sets of the chain for a phase: {v4 set, v6 set} names.
std::pair<std::string, std::string> learned_sets(const std::string& chain);

}  // namespace egressd::nft
