// Hostname pinning's datapath half (docs/pinning.md, issue 16): the
// nfnetlink_queue reader behind chain `pin` (nft/compile.h). The kernel
// queues every packet of an undecided TCP flow to a learned-only address
// after its handshake, and every datagram of an undecided UDP flow to port
// 443 of such an address (QUIC); the reader holds the flow's payload packets
// (no verdict) until the classifier and parser of src/pin/ can judge the
// first bytes, asks pin::decide, and answers every held packet at once:
//   admit: NF_REPEAT with the skb mark nft::pin_admit_mark (and, as every
//          verdict that lets a packet go, the skb priority nft::kPinPriority's
//          secret value): the phase chain
//          gives the flow the phase's ct mark, and every later packet of the
//          flow never leaves the kernel (the fast path). A TLS flow is first
//          followed (`follow`, as HTTP) through its handshake: every later
//          ClientHello is judged, and a retransmission of bytes read carries
//          the judged bytes, not the pages the sender may have rewritten;
//   reset: NF_REPEAT with the skb mark kPinResetMark: chain pin rejects it
//          with a TCP reset (QUIC: ICMP admin-prohibited), so the client
//          learns at once;
//   a payload-less packet (an ACK, a FIN) of a flow not yet decided:
//          NF_REPEAT with the skb mark = the pass mark: it leaves, the flow
//          stays undecided.
// Bounded: kMaxInspect bytes or kHoldTime per flow, then reset; at most
// kMaxFlows flows (kMaxQuicFlows QUIC flows) held at once (a new one beyond
// that is reset).
//
// PinFlows is the pure part (reassembly and decision, no sockets) so unit
// tests drive it; PinQueue puts it on the shared netlink transport.
#pragma once

#include <boost/asio/io_context.hpp>
#include <array>
#include <chrono>
#include <utility>
#include <cstdint>
#include <deque>
#include <list>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "egressd/policy.h"
#include "egressd/result.h"
#include "pin/decide.h"
#include "pin/http_follow.h"
#include "pin/quic_initial.h"
#include "pin/tls_follow.h"

namespace egressd::nft {
class Transport;
}

namespace egressd::daemon {

// What the reader needs from the sandbox at the moment of a decision.
class PinJudge {
 public:
  virtual ~PinJudge() = default;
  // The learned names and the phase in force.
  virtual const pin::PinFacts& pin_facts() const = 0;
  // The table's pin mark (a secret; chain pin lets a packet carrying it go,
  // and the admit and follow marks derive from it: nft::pin_admit_mark).
  virtual std::uint32_t pin_mark() const = 0;
  // The table's pin priority (nft::kPinPriority), set with each of those
  // marks (NFQA_PRIORITY); 0: none, the mark alone.
  virtual std::uint32_t pin_priority() const { return 0; }
  // Every admit and reset, for `denied`, status and logs.
  virtual void pin_decided(const pin::Decision& d, const IpPrefix& dst, std::uint16_t port) = 0;
};

struct PinStats {
  std::uint64_t inspected = 0;  // flows whose first payload reached the reader
  std::uint64_t admitted = 0;   // ... admitted (a name that passes, or a protocol the address decides)
  std::uint64_t reset = 0;      // ... reset (another name, no name, unparseable, too long, too slow)
  std::uint64_t held = 0;       // flows held right now
  std::uint64_t errors = 0;     // queue messages that did not parse, verdicts the kernel refused
};

// One IP packet as the queue delivered it, reduced to what reassembly needs:
// a TCP segment or a UDP datagram (QUIC).
struct Segment {
  static constexpr std::uint8_t kTcp = 6, kUdp = 17;
  std::uint8_t proto = kTcp;
  IpPrefix src, dst;  // single addresses
  std::uint16_t sport = 0, dport = 0;
  std::uint32_t seq = 0;  // TCP only
  std::uint32_t ack = 0;  // TCP: the acknowledgment number, when ack_flag
  bool ack_flag = false;
  std::uint32_t ct_id = 0;  // the flow's conntrack id (chain pin puts it in the packet's mark)
  bool syn = false, fin = false, rst = false;
  bool urg = false;  // TCP: the urgent flag (a byte the server's stack takes out of the stream)
  // What the path or the server may drop a segment for though the
  // connection's own socket wrote it (a socket option set it, no capability
  // needed): IPv4 options or IPv6 extension headers (routers drop them,
  // hosts drop source routes), a TCP signature option the server has no key
  // for (MD5, RFC 2385; TCP-AO, RFC 5925), a TTL or hop limit low enough to
  // run out on the way. Judged bytes that never arrive let a raw socket write
  // others at the same sequence numbers once the flow is admitted.
  bool ip_options = false;
  bool tcp_signature = false;
  std::uint8_t ttl = 0;  // IPv4 TTL, IPv6 hop limit
  // Written by the connection's own TCP socket. The queue tells: the stack
  // leaves a TCP segment's checksum to the device (CHECKSUM_PARTIAL, the
  // queue's NFQA_SKB_CSUMNOTREADY), a raw socket writes it itself. A segment
  // a raw socket wrote can carry a flaw the server drops it for (a wrong
  // checksum, an old timestamp, a TTL that runs out), so the reader would
  // judge bytes the server never takes. Unknown: false (fail closed).
  bool from_socket = false;
  // A GSO packet (NFQA_SKB_GSO): several datagrams or segments in one. For
  // UDP the reader cannot tell where one datagram ends and the next begins
  // (a short-header QUIC packet runs to the end of its datagram), so a batch
  // could hide a second connection's Initial behind one it can read.
  bool gso = false;
  // From queue kPinFollowQueueNum: the flow's ct mark says the reader follows
  // it (an HTTP connection it admitted).
  bool followed = false;
  // UDP: the kernel passed this flow before (its ct mark is set: the reader
  // admitted it, or an earlier phase passed it). Chain pin then marks the
  // datagram nft::kPinUdpPassedMark instead of its conntrack id.
  bool passed = false;
  // From queue kPinForeignQueueNum: a TCP flow that carries a phase's mark
  // (another phase's, or urgent data on this phase's own flow).
  bool foreign = false;
  // A SYN that met a conntrack entry the server's side started (chain pin or
  // pin_untracked marks it nft::kPinStraySynMark).
  bool stray_syn = false;
  // Too large to go back with a verdict (a GSO packet of about 64 KiB: a
  // netlink attribute holds less). Only a followed connection's reach the
  // reader; one whose bytes decide nothing (an HTTP body) passes as it is,
  // any other is dropped and its socket sends it again, smaller.
  bool oversize = false;
  std::span<const std::uint8_t> payload;
  std::size_t l4 = 0;       // where the TCP or UDP header starts in the packet
  std::size_t ip_end = 0;   // where the packet ends, as its IP header says
};
// Parses an IPv4 or IPv6 TCP or UDP packet (IPv6 extension headers walked; a
// fragment is refused). nullopt when it is anything else or truncated.
std::optional<Segment> parse_packet(std::span<const std::uint8_t> pkt);

// The packet as the reader read it, to go back to the kernel with the
// verdict (NFQA_PAYLOAD), its TCP or UDP checksum complete (the kernel takes
// a re-injected packet's checksum as it is). The kernel then sends these
// bytes, not the queued packet's own: those may still be the sending
// process's pages (MSG_ZEROCOPY, sendfile, splice), which it can rewrite
// between the reader's copy and the packet leaving. `s` is parse_packet(pkt).
std::vector<std::uint8_t> judged_packet(std::span<const std::uint8_t> pkt, const Segment& s);
// Writes `v.patch` over `pkt`'s payload from `v.patch_at` and completes its
// checksum again. False when the packet cannot hold it.
struct PinVerdict;
bool apply_patch(std::vector<std::uint8_t>& pkt, const PinVerdict& v);

inline constexpr std::chrono::milliseconds kHoldTime{2000};
// An HTTP flow whose first head is still incomplete after this long is
// followed as it is (PinFlows::pass_incomplete_http): the bytes held go to
// the server, as the incomplete heads of later requests do, and the segment
// that completes the head is judged before it leaves. Held longer, a client
// whose retransmission timeout (200 ms at least) runs out enters loss
// recovery with one segment in flight and sends nothing new until it is
// acknowledged: a client that pauses mid-head would never finish it.
inline constexpr std::chrono::milliseconds kPassIncompleteAfter{100};
inline constexpr std::size_t kMaxFlows = 4096;
// QUIC flows held at once (each holds a ~25 KiB Initial assembler).
inline constexpr std::size_t kMaxQuicFlows = 256;
// Admitted QUIC flows whose assembler is kept to judge their later long-header
// datagrams (QuicInitialAssembler::follow), and for how long: a client sends
// Initials only during its handshake. One forgotten earlier has its later
// Initials judged as a new connection's (a resent whole hello passes, an
// Initial without one is refused: the client falls back to TCP).
inline constexpr std::size_t kMaxQuicFollowed = 256;
inline constexpr std::chrono::seconds kQuicFollowTime{30};
// The Destination Connection IDs of admitted QUIC connections, by server
// address and port, kept longer than any handshake (a server finds a
// connection by its ID, whatever the four-tuple: an Initial under it on a
// flow the reader never admitted, from a new source port or after conntrack
// forgot the first one, would extend a stream the server holds). Full, no
// ID is let go early: a new QUIC flow, and a Retry's new ID, are refused
// until the oldest are 10 minutes old (the client falls back to TCP; attack
// review L: admitted connections pushing an ID out would re-open it).
inline constexpr std::size_t kMaxQuicIds = 8192;
inline constexpr std::chrono::minutes kQuicIdMemory{10};
// HTTP connections followed at once (their later requests are judged); the
// least recently active is forgotten past this, and its next packet refused.
inline constexpr std::size_t kMaxHttpFollowed = 4096;
// TLS flows admitted and not yet answered by their server (their judged
// hello kept for its retransmissions), at once; the oldest is forgotten past
// this, and its next packet with bytes refused.
inline constexpr std::size_t kMaxTlsFollowed = 4096;
// Judged bytes kept for retransmissions: per flow (a whole 16 KiB head or
// hello), and across all flows of each kind (past it, the least recently
// active flow is forgotten).
inline constexpr std::size_t kMaxKeptPerFlow = 16384;
inline constexpr std::size_t kMaxKeptBytes = 8u << 20;

// A flow admitted because it presented `name` (TLS SNI, HTTP Host, QUIC SNI),
// or, `by_address`, a TCP flow whose first bytes are neither TLS nor HTTP,
// which the address decides (a switch never cuts it by name; the new phase's
// rules decide it by its address).
struct AdmittedFlow {
  std::uint8_t proto = Segment::kTcp;
  IpPrefix src, dst;
  std::uint16_t sport = 0, dport = 0;
  std::string name;
  std::uint64_t order = 0;  // admission order (the oldest is forgotten first)
  std::uint32_t ct_id = 0;
  bool by_address = false;
  // The other names the flow was admitted for later: a second ClientHello
  // (after a HelloRetryRequest: the server's session is that name's), a
  // later HTTP request's Host. A switch keeps the flow only while the new
  // phase keeps every one (attack review L: the second hello's name was
  // never recorded, so a switch that forbade it kept its session). Past
  // kMaxNamesPerFlow, `names_full`: the next switch cuts the flow.
  std::vector<std::string> also{};
  bool names_full = false;
};
inline constexpr std::size_t kMaxNamesPerFlow = 8;
// Whether a switch keeps `f`, given whether the new phase keeps a name on its address.
bool keeps_every_name(const AdmittedFlow& f, const std::function<bool(const std::string&)>& keeps);
// A refused TCP flow's server end: the handshake reached the server, the held
// bytes never did, so a RST at `seq` (the first byte the server waits for)
// closes its half of the connection, and a new connection on the same
// addresses and ports is not refused by the server's stale one.
struct ServerReset {
  IpPrefix src, dst;
  std::uint16_t sport = 0, dport = 0;
  std::uint32_t seq = 0;
};
// The IPv4/IPv6 + TCP RST packet for `r` (checksummed).
std::vector<std::uint8_t> server_reset_packet(const ServerReset& r);

// Admitted flows remembered for switches (the most recent ones).
inline constexpr std::size_t kMaxAdmitted = 65536;

// A queued packet: the queue's number in the high 32 bits, the kernel's
// packet id (counted per queue) in the low 32.
using PinPacketId = std::uint64_t;
constexpr PinPacketId pin_packet_id(std::uint16_t queue, std::uint32_t id) {
  return PinPacketId{queue} << 32 | id;
}

// The verdict for one queued packet.
struct PinVerdict {
  // recheck: NF_REPEAT with no mark: the packet takes the fast path if its
  // flow's ct mark is set by now, else it comes back to the reader.
  // follow: admitted for an HTTP request, the flow stays followed
  // (nft::kPinFollowMark): its later packets come back to the reader.
  enum class Kind { admit, reset, pass, drop, recheck, follow };
  PinPacketId packet_id = 0;
  Kind kind = Kind::drop;
  // Bytes to send in place of the packet's own, from payload offset
  // `patch_at`: a retransmission of bytes the reader judged carries the
  // bytes judged, not what the sender's pages hold now (PinFlows::Kept).
  std::size_t patch_at = 0;
  std::vector<std::uint8_t> patch{};
  // The packet leaves as the reader read it (its bytes decided something):
  // the verdict carries the reader's copy. False for bytes read only to be
  // counted (an HTTP body): the packet leaves as it is.
  bool as_read = true;
};

class PinFlows {
 public:
  using Clock = std::chrono::steady_clock;
  explicit PinFlows(PinJudge& judge) : judge_(judge) {}
  // One queued packet: returns the verdicts that can be given now (none
  // while the flow's first bytes are still incomplete).
  std::vector<PinVerdict> packet(PinPacketId id, const Segment& seg, Clock::time_point now);
  // Flows held past kHoldTime: reset (their packets' verdicts).
  std::vector<PinVerdict> expire(Clock::time_point now);
  const PinStats& stats() const { return stats_; }
  // When the oldest held flow runs out, if any.
  std::optional<Clock::time_point> next_deadline() const;
  // A switch: forgets and returns the admitted flows `keep` refuses (their
  // name is not allowed for their address any more); a packet of one that
  // still reaches the reader is refused.
  std::vector<AdmittedFlow> cut(const std::function<bool(const AdmittedFlow&)>& keep, Clock::time_point now);
  // A flow an earlier egressd admitted (found in conntrack at start): known
  // from here on, its name unknown (""), so a switch keeps it only where the
  // address alone decides (pin_keeps). Nothing if the flow is known already.
  void adopt(const AdmittedFlow& f);
  std::size_t admitted_remembered() const { return admitted_.size(); }
  std::size_t quic_followed() const { return followed_.size(); }
  std::size_t http_followed() const { return http_.size(); }
  std::size_t tls_followed() const { return tls_.size(); }
  // HTTP flows whose first head was let through incomplete and is not whole
  // yet (kPassIncompleteAfter): counted as held, though no packet of theirs is.
  std::size_t pending_first() const { return pending_first_; }
  // Judged bytes kept for retransmissions, across all followed flows.
  std::size_t kept_bytes() const { return http_kept_ + tls_kept_; }
  // TCP payload bytes held across all flows (each flow keeps at most kMaxInspect).
  std::size_t held_bytes() const;
  // The refused flows whose server end should be reset, since the last call.
  std::vector<ServerReset> take_server_resets() { return std::exchange(server_resets_, {}); }
  // The flows whose ct mark must go back to 0 before their packets' verdicts
  // (`seq` unused), since the last call: a SYN the connection's socket wrote
  // on an old entry starts a new connection, judged as new (chain output
  // hands such SYNs to the reader with the old mark in place; a raw socket's
  // is dropped and leaves it).
  std::vector<ServerReset> take_mark_clears() { return std::exchange(mark_clears_, {}); }
  // The flows whose conntrack entry must go before their SYN's verdict (`seq`
  // unused), since the last call: a socket's SYN met an entry the server's side
  // started (see PinFlows::packet), and the retried SYN starts a new one.
  std::vector<ServerReset> take_entry_deletes() { return std::exchange(entry_deletes_, {}); }

 private:
  // A flow: family, protocol, source, destination, source port, destination
  // port. Ordered by words, not by arrays: a tuple of arrays compared each
  // address with two memcmp calls, in maps searched several times for every
  // queued packet (7 % of the reader's CPU under pinning.py's load).
  struct Key {
    std::uint8_t family = 0, proto = 0;
    std::array<std::uint8_t, 16> src{}, dst{};
    std::uint16_t sport = 0, dport = 0;
    friend bool operator==(const Key&, const Key&) = default;
    friend bool operator<(const Key& a, const Key& b) noexcept {
      if (a.family != b.family) return a.family < b.family;
      if (a.proto != b.proto) return a.proto < b.proto;
      if (a.sport != b.sport) return a.sport < b.sport;
      if (a.dport != b.dport) return a.dport < b.dport;
      for (const std::size_t at : {0, 8}) {
        if (const auto x = IpAddrLess::word(a.src, at), y = IpAddrLess::word(b.src, at); x != y) return x < y;
      }
      for (const std::size_t at : {0, 8}) {
        if (const auto x = IpAddrLess::word(a.dst, at), y = IpAddrLess::word(b.dst, at); x != y) return x < y;
      }
      return false;
    }
  };
  struct Flow {
    IpPrefix dst;
    std::uint16_t dport = 0;
    Clock::time_point started;
    std::uint32_t base = 0;                            // TCP: sequence number of the first byte held
    std::map<std::uint32_t, std::vector<std::uint8_t>> segs;  // TCP: offset from base -> bytes
    std::vector<PinPacketId> ids;                      // packets held, in arrival order
    std::unique_ptr<pin::QuicInitialAssembler> quic;   // QUIC: the Initials' CRYPTO stream
    std::uint32_t ct_id = 0;
    std::uint32_t extent = 0;  // TCP: the furthest byte held (offset from base), kept or not
    // TCP: base is the stream's start, as the socket's handshake ACK said;
    // else it is only the first byte seen, and earlier ones may exist.
    bool start_known = false;
    // TCP: when the oldest packet in `ids` came.
    Clock::time_point held_since{};
    // TCP: the bytes held are an HTTP request whose head is incomplete
    // (kPassIncompleteAfter).
    bool http_incomplete = false;
  };
  // Judged bytes a flow's server may not have received yet, by sequence
  // number, oldest first. The socket keeps its own copy of what it sent and
  // resends it if the segment is lost on the way, from pages its process may
  // have rewritten since the reader read them (MSG_ZEROCOPY, sendfile()): so
  // every retransmission is sent with these bytes in place of its own.
  struct Kept {
    std::deque<std::pair<std::uint32_t, std::vector<std::uint8_t>>> ranges;
    std::size_t size = 0;
    // Judged bytes before this sequence number were forgotten (the flow's
    // bound): a retransmission that starts before it is refused.
    std::optional<std::uint32_t> forgotten_until;
    // The first byte judged (the flow's base): bytes before it were never
    // read, and a segment that starts before it is refused.
    std::optional<std::uint32_t> start;
    // Appends the judged bytes at `seq`; returns how many bytes it now holds
    // more (negative: fewer).
    std::ptrdiff_t add(std::uint32_t seq, std::span<const std::uint8_t> bytes);
    // The patch for `seg` (its bytes that repeat kept ones, replaced by
    // these), or the reason it is refused.
    std::optional<std::string> patch(const Segment& seg, PinVerdict& v) const;
  };
  // A TLS flow admitted on its hello, until its handshake is over and the
  // server has shown it got the end: its client's records are read
  // (pin::TlsClientStream) and every later ClientHello judged (a
  // HelloRetryRequest asks for a second one) until an application data record
  // starts in a segment whose ACK moved past `ack` (the server had sent
  // nothing more when the hello was judged): that segment's ACK is `done_ack`.
  // The bytes read are kept, and a retransmission of them is sent with them,
  // until a later segment's ACK moves past `done_ack`: the server spoke after
  // that segment, which a server waiting for a second hello never does
  // without it. (Read at once, that segment could be lost, or dropped by the
  // server for an old timestamp a raw ACK sent ahead of it made it expect,
  // and resent from rewritten pages as the hello it stood in for.)
  struct TlsFollowed {
    Kept judged;
    pin::TlsClientStream records;
    IpPrefix dst;
    std::uint16_t dport = 0;
    std::uint32_t ack = 0;
    std::uint32_t ct_id = 0;
    std::uint32_t next = 0;  // sequence number of the first byte not yet read
    std::optional<std::uint32_t> done_ack;
    std::list<Key>::iterator lru;
    // Admitted by its address (follow_other): its packets keep coming on
    // the first queue, with ct mark 0, handshake ACKs and all.
    bool by_address = false;
    // Admitted by its address on a request to upgrade to TLS
    // (pin::tls_upgrade_request): the client's next write is judged as a
    // first hello if it is one, and the flow stays off the fast path until
    // then, whatever the server says.
    bool upgrade = false;
  };
  std::map<Key, TlsFollowed> tls_;
  std::list<Key> tls_lru_;  // most recently active first
  std::size_t tls_kept_ = 0, http_kept_ = 0;
  std::vector<PinVerdict> follow_tls(std::map<Key, Flow>::iterator it, const Segment& seg, Clock::time_point now);
  // A flow admitted by its address ("other" first bytes): followed as a TLS
  // flow whose handshake is over, until the server speaks after its judged
  // bytes (TlsFollowed::done_ack), its ct mark left at 0 (other_packet).
  std::vector<PinVerdict> follow_other(std::map<Key, Flow>::iterator it, const Segment& seg, bool upgrade,
                                       Clock::time_point now);
  std::vector<PinVerdict> after_judged(PinPacketId id, std::map<Key, TlsFollowed>::iterator tf, const Segment& seg,
                                       Clock::time_point now);
  std::vector<PinVerdict> start_following_tls(std::map<Key, Flow>::iterator it, TlsFollowed t,
                                              const std::vector<std::uint8_t>& bytes, PinVerdict::Kind kind,
                                              Clock::time_point now);
  std::vector<PinVerdict> other_packet(PinPacketId id, std::map<Key, TlsFollowed>::iterator tf, const Segment& seg,
                                       Clock::time_point now);
  std::vector<PinVerdict> tls_packet(PinPacketId id, std::map<Key, TlsFollowed>::iterator tf, const Segment& seg,
                                     Clock::time_point now);
  void forget_tls(const Key& key);
  void bound_tls(Clock::time_point now);
  // An HTTP connection admitted for `name`: its later bytes are read as
  // requests (pin::HttpRequestStream), each head's host judged.
  struct HttpFollowed {
    pin::HttpRequestStream requests;
    std::string name;
    IpPrefix dst;
    std::uint16_t dport = 0;
    std::uint32_t ct_id = 0;
    std::uint32_t next = 0;  // sequence number of the first byte not yet read
    std::list<Key>::iterator lru;
    Kept framing;  // the requests' framing read (heads, chunk lines, trailers)
    // The first request's head is not whole yet (pass_incomplete_http): it is
    // judged, and `name` set, when it is; the flow counts as held until then.
    bool first_pending = false;
  };
  // An HTTP flow whose first head stays incomplete (kPassIncompleteAfter):
  // followed from here, its held packets pass (as read), its head judged as
  // the first one when whole.
  std::vector<PinVerdict> pass_incomplete_http(std::map<Key, Flow>::iterator it, Clock::time_point now);
  // A followed flow whose first head was still pending is refused (`d`).
  std::vector<PinVerdict> refuse_first(PinPacketId id, const Key& key, const Segment& seg, const pin::Decision& d,
                                       std::uint32_t server_seq, Clock::time_point now);
  std::size_t pending_first_ = 0;  // http_ entries with first_pending
  // Follows `key` from here as `h` says (any earlier connection on it forgotten).
  void start_following(const Key& key, HttpFollowed h);
  void count_held() { stats_.held = flows_.size() + pending_first_; }
  // Feeds a followed connection `bytes` at sequence number `seq` and keeps
  // their framing.
  pin::HttpRequestStream::Step feed_http(HttpFollowed& h, std::uint32_t seq, std::span<const std::uint8_t> bytes);
  std::map<Key, HttpFollowed> http_;
  std::list<Key> http_lru_;  // most recently active first
  std::vector<PinVerdict> follow_http(std::map<Key, Flow>::iterator it, const std::string& name,
                                      Clock::time_point now);
  std::vector<PinVerdict> http_packet(PinPacketId id, const Key& key, const Segment& seg, Clock::time_point now);
  std::vector<PinVerdict> refuse_followed(PinPacketId id, const Key& key, const Segment& seg, const std::string& why,
                                          std::uint32_t server_seq, Clock::time_point now);
  void forget_followed(const Key& key);
  // Forgets the least recently active followed connections past the bounds.
  void bound_http();
  static std::uint64_t fingerprint(const Segment& seg);
  static constexpr std::size_t kMaxRechecks = 64;
  std::vector<PinVerdict> quic_packet(PinPacketId id, const Key& key, const Segment& seg, Clock::time_point now);
  std::vector<PinVerdict> foreign_packet(PinPacketId id, const Key& key, const Segment& seg, Clock::time_point now);
  bool refused_already(const Key& key, const Segment& seg) const;
  std::vector<PinVerdict> quic_gso(PinPacketId id, const Key& key, const Segment& seg, Clock::time_point now);
  // `counted`: the flow was counted as inspected already.
  std::vector<PinVerdict> refuse_decided(PinPacketId id, const Key& key, const Segment& seg, const std::string& why,
                                         Clock::time_point now, bool counted = false);
  // A long-header datagram of an admitted QUIC flow (chain active keeps them
  // off the fast path).
  struct Followed {
    std::unique_ptr<pin::QuicInitialAssembler> quic;
    Clock::time_point at;
  };
  std::vector<PinVerdict> quic_follow(PinPacketId id, std::map<Key, Followed>::iterator fo, const Segment& seg,
                                      Clock::time_point now);
  std::map<Key, Followed> followed_;
  std::deque<std::pair<Clock::time_point, Key>> followed_order_;
  struct QuicId {
    Clock::time_point at;
  };
  // family, server address, port and the ID, as bytes.
  static std::string quic_id_key(const Key& key, pin::Bytes dcid);
  void remember_quic_id(const Key& key, pin::Bytes dcid, Clock::time_point now);
  std::map<std::string, QuicId> quic_ids_;
  std::deque<std::pair<Clock::time_point, std::string>> quic_ids_order_;
  void forget_admitted(const Key& key);
  std::vector<PinVerdict> new_connection_on_old_entry(PinPacketId id, const Key& key, const Segment& seg,
                                                      Clock::time_point now);
  struct Decided {
    bool admitted;
    Clock::time_point at;
    std::uint32_t ct_id;
    // Packets of an admitted flow sent back to the hook (recheck), by
    // fingerprint: one that returns belongs to a flow the kernel has not
    // marked, i.e. a new connection on the same addresses and ports.
    std::vector<std::uint64_t> rechecked{};
  };
  // A packet of an admitted flow not seen sent back yet: remembered, true
  // (send it back to the hook). False when it came back (or too many did).
  static bool recheck_once(Decided& d, const Segment& seg);
  static bool bare_ack(const Segment& seg);
  std::vector<PinVerdict> finish(std::map<Key, Flow>::iterator it, bool admit, Clock::time_point now,
                                 bool reset_server = true);
  std::vector<PinVerdict> reset_flow(std::map<Key, Flow>::iterator it, const std::string& why, Clock::time_point now,
                                     bool reset_server = true);
  // The contiguous bytes from the flow's start (at most kMaxInspect).
  static std::vector<std::uint8_t> stream(const Flow& f);

  PinJudge& judge_;
  std::map<Key, Flow> flows_;
  // Flows decided lately: a retransmission queued before the mark was set
  // gets the same answer (a reset flow is never reconsidered).
  std::map<Key, Decided> decided_;
  // Where undecided flows' streams start, from their handshake ACK.
  struct Start {
    std::uint32_t seq;
    Clock::time_point at;
    std::uint32_t ct_id;
    std::uint32_t ack;  // the handshake ACK's acknowledgment: the server's ISN + 1
  };
  std::map<Key, Start> starts_;
  // Every write of decided_ and starts_ as (time, key), oldest first: expire()
  // pops what is past kDecidedMemory instead of walking both maps on every
  // turn of the loop (their size grows with the rate of new flows: 10 s of
  // them). An entry written again later is erased only by its last write's pair.
  std::deque<std::pair<Clock::time_point, Key>> decided_order_, starts_order_;
  void set_decided(const Key& key, Decided d);
  void set_start(const Key& key, Start st);
  // Flows admitted by their address whose following tls_'s bounds ended
  // (bound_tls): their server end is reset then, and the connection's next
  // bytes are refused with the reason. Without this, the socket's next ACK
  // recorded a start where the stream goes on, and its next bytes were
  // judged as a first write (attack review 5's side note). Kept as long as a
  // start, 4096 at most (the oldest goes first; its server end is reset).
  struct Evicted {
    std::uint32_t ct_id;
    Clock::time_point at;
  };
  std::map<Key, Evicted> evicted_;
  std::deque<std::pair<Clock::time_point, Key>> evicted_order_;
  std::size_t quic_flows_ = 0;  // flows_ entries with an assembler
  std::vector<ServerReset> server_resets_;
  std::vector<ServerReset> mark_clears_;
  std::vector<ServerReset> entry_deletes_;
  // SYNs passed on an old entry lately (sequence number, when): one that comes
  // back at once found its entry's mark not cleared (the entry gone meanwhile)
  // and would go round chain output and the reader for ever; it is dropped
  // (the socket sends its SYN again a second later).
  std::map<Key, std::pair<std::uint32_t, Clock::time_point>> syns_passed_;
  void remember(const Key& key, const Segment& seg, const std::string& name);
  void remember(const Key& key, AdmittedFlow f);
  // A later name the admitted flow at `key` presented and was admitted for.
  void admitted_also(const Key& key, const std::string& name);
  std::map<Key, AdmittedFlow> admitted_;
  std::map<std::uint64_t, Key> admitted_order_;
  std::uint64_t next_order_ = 0;
  PinStats stats_;
};

// Sends nfnetlink_queue configuration `command` (NFQNL_CFG_CMD_*) for `queue`
// of the current network namespace on `t`, copy mode none: NetnsClaim binds a
// queue no rule sends packets to, held only so that nobody else can bind it.
// 0 or the kernel's errno (a bind: EPERM when another socket holds the queue,
// or without CAP_NET_ADMIN).
int queue_command(nft::Transport& t, std::uint16_t queue, std::uint8_t command);

// The reader on queues nft::kPinQueueNum (TCP) and nft::kPinUdpQueueNum
// (QUIC) of the current network namespace
// (open it after joining the sandbox's, like NflogReader).
class PinQueue {
 public:
  // Binds both queues (copy-packet mode). Runtime error when netlink fails or
  // another listener holds one.
  static Result<std::unique_ptr<PinQueue>> open(boost::asio::io_context& io, PinJudge& judge);
  virtual ~PinQueue() = default;
  virtual PinStats stats() const = 0;
  // Stops reading (held packets stay without verdict: the kernel drops them
  // when the socket closes). No callback after this returns.
  virtual void close() = 0;
  // After a switch: every remembered admitted flow `keep` refuses gets the
  // ct mark nft::kPinCutMark (chain active denies its later packets).
  // Returns how many.
  virtual std::size_t cut(const std::function<bool(const AdmittedFlow&)>& keep) = 0;
  // PinFlows::adopt for each of `flows`.
  virtual void adopt(const std::vector<AdmittedFlow>& flows) = 0;
};

// The TCP flows, and UDP flows to port 443, conntrack holds in the current
// network namespace with ct mark `mark` (one ctnetlink dump, filtered by the
// kernel): at start, the flows an earlier egressd admitted under the phase
// in force, whose names this one never learnt. Runtime error when the dump
// fails.
Result<std::vector<AdmittedFlow>> conntrack_flows_marked(boost::asio::io_context& io, std::uint32_t mark);

}  // namespace egressd::daemon
