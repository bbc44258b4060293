// The nftables ruleset model: one description of tables, sets, chains and
// rules that is rendered two ways — as nft(8) text (render.cc, for
// `egressd render`, the goldens in rules/, and hand debugging) and as libnftnl
// netlink objects (netlink.cc, what the daemon sends). Both renderers consume
// exactly these types, so the text and the kernel can never disagree.
//
// The statement vocabulary is closed on purpose: each Stmt alternative maps to
// the exact expression list nft(8) 1.0.6 generates for the same text (see
// `nft --debug=netlink`), so `nft list ruleset` after loading the render and
// after applying over netlink print the same thing.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "egressd/policy.h"

namespace egressd::nft {

// b + 1 within its first n bytes (big-endian: an address); false on
// overflow (they were all ones).
bool increment(std::array<std::uint8_t, 16>& b, std::size_t n);

// ---- sets ----------------------------------------------------------------

enum class SetType { ipv4_addr, ipv6_addr };

// One element. For interval sets an element is the closed range [from, to]
// (a CIDR or a merged range); for other sets from == to. timeout_ms > 0 only
// in timeout sets.
struct SetElem {
  // Constructors rather than an aggregate: `{from, to, timeout}` stays the
  // short form, and the fields added later need no initializer everywhere.
  SetElem() = default;
  SetElem(IpPrefix from_, IpPrefix to_, std::uint64_t timeout_ms_ = 0, std::string comment_ = {},
          std::uint64_t expires_ms_ = 0)
      : from(from_), to(to_), timeout_ms(timeout_ms_), comment(std::move(comment_)), expires_ms(expires_ms_) {}
  IpPrefix from;  // prefix_len ignored; address only
  IpPrefix to;
  std::uint64_t timeout_ms = 0;
  // The element's userdata comment (`comment "..."`), "" for none; at most
  // kElemCommentMax bytes. Learned sets keep the names an address was
  // learned for here, so a restarted egressd can pin them again.
  std::string comment;
  // Read back only (read_set_elems): the time left before the kernel drops
  // the element, in ms; 0 when it has no timeout. Never sent.
  std::uint64_t expires_ms = 0;
  friend bool operator==(const SetElem&, const SetElem&) = default;
};

// nft(8) refuses longer element comments (NFT_USERDATA_MAXLEN is larger,
// but `nft -f` of egressctl rules must load); the NUL terminator is extra.
inline constexpr std::size_t kElemCommentMax = 127;

struct Set {
  std::string name;
  SetType type = SetType::ipv4_addr;
  bool interval = false;  // "flags interval": rbtree, elements are ranges
  bool timeout = false;   // "flags timeout": elements may carry a timeout
  // Interval elements are sorted and non-overlapping (see make_interval_elems).
  std::vector<SetElem> elems;
  // "size N": the kernel sizes the set for N elements up front (no rehashing
  // while a big batch inserts them) and refuses more than N. 0 = unbounded;
  // only for sets that never grow after creation.
  std::uint32_t size = 0;
};

// Builds interval elements from prefixes of one family: sorted, overlapping or
// adjacent ranges merged (the kernel rejects overlaps).
std::vector<SetElem> make_interval_elems(const std::vector<IpPrefix>& prefixes);
// One element per address (prefix_len must be full), sorted, deduplicated.
std::vector<SetElem> make_addr_elems(const std::vector<IpPrefix>& addrs);

// ---- statements ----------------------------------------------------------

// oif "lo" (the loopback ifindex is 1 in every namespace).
struct MatchOifLoopback {};
// iif "lo" / iif != "lo"
struct MatchIifLoopback { bool negate = false; };
// meta mark [!=] value
struct MatchMetaMark { std::uint32_t value; bool negate = false; };
// meta priority [!=] value (a tc handle; nft prints major:minor in hex, 0 as
// "none", 0xffffffff as "root").
struct MatchMetaPriority { std::uint32_t value; bool negate = false; };
// The packet comes from a process's socket (meta skuid loads, and no uid is
// (uid_t)-1): "meta skuid != 4294967295". In a netdev egress chain an
// unsigned packet with a socket is a frame written with AF_PACKET (what the
// stack sends met the inet chains and is signed; what it forwards has none).
struct MatchMetaHasSocket {};
// meta protocol arp (skb->protocol; netdev chains). Not the frame's own
// Ethernet type: an AF_PACKET sender chooses it apart from the frame (pair it
// with MatchFrameBytes at offset 12).
struct MatchMetaProtocolArp {};
// meta nfproto ipv4|ipv6 (family 4 or 6): the packet's family in an inet
// chain; every packet there is one or the other.
struct MatchMetaNfproto { std::uint8_t family; };
// ct direction reply
struct MatchCtDirectionReply {};
// ct direction original
struct MatchCtDirectionOriginal {};
// ct state new
struct MatchCtStateNew {};
// ct state established,new: the packet belongs to the flow itself (its
// tuple), not one conntrack only relates to it (an ICMP error).
struct MatchCtStateNewOrEstablished {};
// ct state related: conntrack ties the packet to a flow without being of it:
// an ICMP error about the flow, or a packet netfilter made for a packet of it
// and attached to its entry (reject's TCP reset). No helper is ever attached,
// so there are no expectations, the third source.
struct MatchCtStateRelated {};
// ct state invalid: conntrack has no entry for the packet, nor one it relates
// the packet to (here: an ICMP error whose quoted packet is of no flow).
struct MatchCtStateInvalid {};
// ct status dnat / ct status ! confirmed: one conntrack status bit set (or,
// negated, clear). dnat: the flow's destination was rewritten (DNAT,
// redirect). confirmed: the flow is in the conntrack table; a packet on an
// unconfirmed flow in its reply direction is one the kernel made for a packet
// it refused (reject's TCP reset).
enum class CtStatusBit : std::uint32_t { confirmed = 0x8, dnat = 0x20 };
struct MatchCtStatus { CtStatusBit bit; bool negate = false; };
// ct mark value
struct MatchCtMark { std::uint32_t value; };
// ct mark & mask != value (`ct mark != value` when the mask is all ones).
struct MatchCtMarkNot { std::uint32_t mask; std::uint32_t value; };
// tcp flags syn: the SYN bit is set (emits meta l4proto tcp + the flags
// byte, masked, compared with zero).
struct MatchTcpFlagSyn {};
// `tcp flags urg` (loads the protocol itself).
struct MatchTcpFlagUrg {};
// `tcp flags rst` (loads the protocol itself).
struct MatchTcpFlagRst {};
// `tcp flags syn / syn,ack`: SYN set and ACK clear, the first packet of a
// connection (a SYN-ACK or a segment from mid-stream is not). Loads the
// protocol itself.
struct MatchTcpSynOnly {};
// meta l4proto <proto> (6 tcp, 17 udp); negated: `meta l4proto != <proto>`.
struct MatchL4Proto { std::uint8_t proto; bool negate = false; };
// {tcp|udp} dport <port>  (emits meta l4proto + transport payload)
struct MatchDport { std::uint8_t proto; std::uint16_t port; };
// {tcp|udp} sport <port>  (emits meta l4proto + transport payload)
struct MatchSport { std::uint8_t proto; std::uint16_t port; };
// icmpv6 type <type> ip6 hoplimit <hoplimit>: link-local ICMPv6, which the
// kernel sends for IPv6 to work at all and which is never routed off the link
// (neighbour discovery with hop limit 255, MLD reports with hop limit 1).
// `bare`: ICMPv6 follows the IPv6 header directly (no extension header: a
// routing header would carry the message past the link), as nft lists it,
// "ip6 nexthdr ipv6-icmp ip6 hoplimit H icmpv6 type T" (one 2-byte load).
struct MatchLinkIcmpv6 { std::uint8_t type; std::uint8_t hoplimit; bool bare = false; };
// ip daddr @set / ip6 daddr @set (family from the set type)
struct MatchDaddrSet { std::string set; SetType type; };
// ip daddr <addr> / ip6 daddr <addr>: a single address or a prefix
// (127.0.0.0/8, fe80::/10); prefix_len must not be 0.
struct MatchDaddr { IpPrefix addr; };
// ip saddr <addr> / ip6 saddr <addr>, like MatchDaddr.
struct MatchSaddr { IpPrefix addr; };
// fib saddr|daddr type [!=] <type>: the kind of address the routing tables
// say the packet's source/destination is. Values are RTN_* (rtnetlink.h).
enum class AddrType : std::uint8_t { unicast = 1, local = 2, broadcast = 3, anycast = 4, multicast = 5 };
struct MatchFibAddrType { bool daddr; AddrType type; bool negate = false; };
// socket mark value: the SO_MARK of the local socket a packet is for (input).
struct MatchSocketMark { std::uint32_t value; bool negate = false; };
// socket cgroupv2 level N [!=] ID: the cgroup v2 id of the sending socket's
// ancestor at `level` (output). With `any`, the id is compared with 0 by !=,
// so the rule matches whenever the socket's cgroup is at least that deep.
// Breaks (no match) when the socket is not a full socket (a TCP request
// socket's SYN-ACK) or its cgroup is shallower than `level`.
struct MatchSocketCgroupv2 { std::uint32_t level; std::uint64_t id = 0; bool negate = false; };
// ip saddr @set / ip6 saddr @set (family from the set type)
struct MatchSaddrSet { std::string set; SetType type; };
// ct original ip daddr @set / ct original ip6 daddr @set: where the flow was
// first addressed, before any DNAT or redirect (the kernel's key is per
// family: a flow of the other family does not match).
struct MatchCtOriginalDaddrSet { std::string set; SetType type; };
// In a netdev chain, from the frame itself (the link-layer header, which the
// device's egress hook always has): the Ethernet type is IPv4/IPv6 and the IP
// source is `addr` (a single address). skb->protocol is not trusted: an
// AF_PACKET sender chooses it apart from the frame.
struct MatchFrameSaddr { IpPrefix addr; };
// In a netdev chain: the frame's bytes at `offset` (from the start of the
// link-layer header) are [not] `value` (1 to 16 bytes). nft lists it as a raw
// payload match, @ll,BITS,BITS.
struct MatchFrameBytes { std::uint32_t offset; std::vector<std::uint8_t> value; bool negate = false; };
// exthdr rt exists: an IPv6 routing header (source routing, SRv6).
struct MatchIpv6RoutingHeader {};
// An IPv4 header with options: "ip hdrlength != 5". (nft's `ip option lsrr
// exists` parses the options without the packet and misses a source route
// whose pointer or length a router still takes.)
struct MatchIpv4Options {};
// `tcp option fastopen exists` (kind 34) / `tcp option 254 exists` (the
// experimental TCP Fast Open option).
struct MatchTcpOption { std::uint8_t kind; };
// `@th,64,8 & 0x80 == 0x80`: the first byte after a UDP header has its top
// bit set, a QUIC long header (Initial, 0-RTT, Handshake: a handshake's
// packets). Put it after MatchDport{udp, ...}, which loads the protocol.
struct MatchUdpLongHeader {};
// `meta length > N`: the packet's length (IP header included, at the inet hooks).
struct MatchMetaLengthOver { std::uint32_t bytes; };
// A TCP packet that is its headers alone, no payload, with a TCP header of
// `doff` 32-bit words: `ip hdrlength 5 ip length 20+4*doff tcp doff doff`
// (IPv4 without options) or `ip6 length 4*doff ip6 nexthdr tcp tcp doff
// doff` (IPv6 without extension headers). Any other packet does not match.
struct MatchTcpHeaderOnly { std::uint8_t family; std::uint8_t doff; };
// counter (anonymous; packets/bytes read back for status). `listed`: the
// values were read from the kernel (`egressctl rules`), and the text shows
// them as `nft list` does; egressd never sends them (a new counter starts at 0).
struct StmtCounter {
  bool listed = false;
  std::uint64_t packets = 0, bytes = 0;
};
// limit rate N/second [burst B packets]: matches while under the rate, so the
// statements after it in the rule run at most that often (nft omits the
// default burst 5 when listing).
struct StmtLimit { std::uint32_t per_second; std::uint32_t burst = 5; };
// log group N
struct StmtLog { std::uint16_t group; };
// ct mark set value
struct StmtCtMarkSet { std::uint32_t value; };
// meta mark set value
struct StmtMetaMarkSet { std::uint32_t value; };
// meta priority set value
struct StmtMetaPrioritySet { std::uint32_t value; };
// meta mark set ct id: hands the flow's conntrack id to the queue reader
// (NFQA_MARK), which tells a new connection from a straggler of an old one
// on the same addresses and ports.
struct StmtMetaMarkSetCtId {};
// redirect to :port
struct StmtRedirect { std::uint16_t port; };
// meta l4proto tcp reject with tcp reset  -> use with MatchL4Proto{6} before it
struct StmtRejectTcpReset {};
// reject with icmpx admin-prohibited
struct StmtRejectAdminProhibited {};
// queue num N: hands the packet to the nfnetlink_queue listener of queue N;
// without the bypass flag, so with no listener the packet is dropped.
// netlink.cc sends it as the xtables NFQUEUE target (nft_compat), which
// every kernel with xt_NFQUEUE runs, nft_queue or not; nft lists it as
// `queue num N` all the same.
struct StmtQueue { std::uint16_t num; };
enum class VerdictKind { accept, drop, jump, goto_, return_ };
struct StmtVerdict { VerdictKind kind; std::string chain; };

using Stmt = std::variant<MatchOifLoopback, MatchIifLoopback, MatchMetaMark, MatchMetaPriority, MatchMetaHasSocket, MatchMetaProtocolArp,
                          MatchMetaNfproto,
                          MatchCtDirectionReply, MatchCtDirectionOriginal, MatchCtStateNew, MatchCtStateNewOrEstablished, MatchCtStateRelated, MatchCtStateInvalid, MatchCtStatus,
                          MatchCtMark, MatchCtMarkNot, MatchTcpFlagSyn, MatchTcpFlagUrg, MatchTcpFlagRst, MatchTcpSynOnly, MatchL4Proto, MatchDport, MatchSport, MatchLinkIcmpv6, MatchDaddrSet, MatchDaddr, MatchSaddr,
                          MatchFibAddrType, MatchSocketMark, MatchSocketCgroupv2, MatchSaddrSet, MatchCtOriginalDaddrSet, MatchFrameSaddr, MatchFrameBytes, MatchIpv6RoutingHeader, MatchIpv4Options, MatchTcpOption, MatchUdpLongHeader, MatchMetaLengthOver, MatchTcpHeaderOnly, StmtCounter,
                          StmtLimit, StmtLog, StmtCtMarkSet, StmtMetaMarkSet, StmtMetaPrioritySet, StmtMetaMarkSetCtId, StmtRedirect,
                          StmtRejectTcpReset, StmtRejectAdminProhibited, StmtQueue, StmtVerdict>;

struct Rule {
  std::vector<Stmt> stmts;
  std::string comment;  // rule userdata comment; "" for none (max 127 bytes)
};

// ---- chains and table ----------------------------------------------------

// The two table families egressd uses: inet (the policy, hooks output and
// input) and netdev (the egress hook of each interface: what leaves the
// device, raw AF_PACKET frames included).
enum class Family : std::uint8_t { inet, netdev };
std::string_view to_string(Family f);  // "inet", "netdev"

enum class HookType { filter, nat };
enum class Hook { output, input, forward, egress, prerouting };

struct BaseChain {
  // A constructor rather than an aggregate: most chains hook output and name
  // no device, and `BaseChain{HookType::filter, 0, true}` says so.
  BaseChain(HookType type_ = HookType::filter, int priority_ = 0, bool policy_drop_ = false,
            Hook hook_ = Hook::output, std::string device_ = "")
      : type(type_), priority(priority_), policy_drop(policy_drop_), hook(hook_), device(std::move(device_)) {}
  HookType type = HookType::filter;
  int priority = 0;            // filter: 0 ("filter"), nat: -100 ("dstnat")
  bool policy_drop = false;    // policy drop vs accept
  Hook hook = Hook::output;    // output/input in inet tables, egress in netdev
  std::string device;          // egress: the interface the chain is bound to
};

struct Chain {
  std::string name;
  std::optional<BaseChain> base;  // nullopt = regular chain
  std::vector<Rule> rules;
};

struct Table {
  std::string name = "egressd";
  Family family = Family::inet;
  std::string comment;           // table userdata comment (max 127 bytes)
  std::vector<Set> sets;         // declared before chains (inet only)
  std::vector<Chain> chains;     // in this order; jump targets are declared too
};

// ---- changes -------------------------------------------------------------

// One atomic change = one netlink batch. Operations run in order. Every
// operation names objects of table `Change::table` in its `family` (inet
// unless said otherwise), so one batch can change both of egressd's tables.
struct OpAddTable { Table table; };       // the whole table with all contents
struct OpDeleteTable { std::string name; Family family = Family::inet; };
// `add table` without NLM_F_EXCL: creates an empty table when there is none,
// leaves an existing one and its contents alone (and clears its flags, e.g.
// dormant). Followed by OpDeleteTable and OpAddTable it replaces a table that
// may or may not exist, in one transaction.
struct OpEnsureTable { std::string name; Family family = Family::inet; };
struct OpAddSet { Set set; };             // with its elements
struct OpDeleteSet { std::string name; };
struct OpAddElems { std::string set; SetType type; bool interval; std::vector<SetElem> elems; };
struct OpDeleteElems { std::string set; SetType type; bool interval; std::vector<SetElem> elems; };
struct OpAddChain { Chain chain; Family family = Family::inet; };  // with its rules
struct OpDeleteChain { std::string name; Family family = Family::inet; };  // must be empty and unreferenced
struct OpFlushChain { std::string name; Family family = Family::inet; };
struct OpAddRule { std::string chain; Rule rule; Family family = Family::inet; };

using Op = std::variant<OpAddTable, OpDeleteTable, OpAddSet, OpDeleteSet, OpAddElems, OpDeleteElems,
                        OpAddChain, OpDeleteChain, OpFlushChain, OpAddRule, OpEnsureTable>;

struct Change {
  std::string table = "egressd";
  std::vector<Op> ops;
};

// ---- text rendering (render.cc) ------------------------------------------

// nft(8) text for a whole table, loadable with `nft -f`. Deterministic.
std::string render_table(const Table& table);
// The nft(8) text of a tc handle as `meta priority` prints it: "none" (0),
// "root" (0xffffffff), else major:minor in hex ("1234:5678").
std::string priority_text(std::uint32_t value);
// nft(8) text for one rule's statements (no trailing newline), e.g.
// `ip daddr @ph_agent_v4 ct mark set 0x45470001 accept`.
std::string render_rule(const Rule& rule);

}  // namespace egressd::nft
