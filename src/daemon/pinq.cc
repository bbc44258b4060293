#include "daemon/pinq.h"

#include <arpa/inet.h>
#include <libmnl/libmnl.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_conntrack.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <fmt/format.h>

#include <boost/asio/steady_timer.hpp>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>

#include "daemon/ctforget.h"
#include "egressd/unique_fd.h"
#include "nft/compile.h"
#include "nft/transport.h"
#include "pin/http_head.h"
#include "pin/tls_hello.h"

namespace egressd::daemon {

namespace asio = boost::asio;

namespace {

constexpr std::uint8_t kTcp = Segment::kTcp;
constexpr std::uint8_t kUdp = Segment::kUdp;
constexpr int kMaxExtHeaders = 8;
constexpr std::uint8_t kTcpOptMd5 = 19, kTcpOptAo = 29;
// Room for one whole packet: the kernel hands GSO packets over segmented.
constexpr std::uint32_t kCopyRange = 0xffff;
// The largest packet a verdict can carry back (a netlink attribute's length
// is 16 bits, header included). A first flight is at most the initial
// congestion window (10 segments, ~15 KB): far below.
constexpr std::size_t kMaxReinject = 0xffff - 4;
// The judged copies kept until their verdicts, in bytes: beyond, a new packet
// is dropped unread (a flood of first packets costs the sandbox's own flows).
constexpr std::size_t kMaxHeldBytes = 8u << 20;
constexpr std::size_t kMaxReinjected = 1u << 20;
// Packets the kernel may hold for the reader before it drops new ones (no
// fail-open flag: a full queue drops, it never bypasses the reader).
constexpr std::uint32_t kQueueMaxLen = 4096;
// How long a decided flow's answer is remembered for its stragglers.
constexpr std::chrono::seconds kDecidedMemory{10};
// A stream start waits for its connection's first bytes this long (bounded in
// number by kMaxFlows): a connection idle longer before it writes has an
// unknown start, and its first bytes must be TLS or HTTP (PinFlows::packet).
constexpr std::chrono::minutes kStartMemory{10};

std::uint16_t be16(std::span<const std::uint8_t> b, std::size_t off) {
  return static_cast<std::uint16_t>(b[off] << 8 | b[off + 1]);
}
std::uint32_t be32(std::span<const std::uint8_t> b, std::size_t off) {
  return static_cast<std::uint32_t>(b[off]) << 24 | static_cast<std::uint32_t>(b[off + 1]) << 16 |
         static_cast<std::uint32_t>(b[off + 2]) << 8 | b[off + 3];
}

IpPrefix addr(std::span<const std::uint8_t> b, std::size_t off, int family) {
  IpPrefix p;
  p.family = static_cast<std::uint8_t>(family);
  p.prefix_len = family == 4 ? 32 : 128;
  std::memcpy(p.bytes.data(), b.data() + off, family == 4 ? 4 : 16);
  return p;
}

}  // namespace

std::optional<Segment> parse_packet(std::span<const std::uint8_t> pkt) {
  if (pkt.empty()) return std::nullopt;
  Segment s;
  std::size_t off = 0, end = 0;
  const int version = pkt[0] >> 4;
  if (version == 4) {
    if (pkt.size() < 20) return std::nullopt;
    const std::size_t ihl = static_cast<std::size_t>(pkt[0] & 0x0f) * 4;
    end = be16(pkt, 2);
    if (ihl < 20 || end < ihl || end > pkt.size()) return std::nullopt;
    if ((be16(pkt, 6) & 0x3fff) != 0) return std::nullopt;  // a fragment (MF or an offset)
    if (pkt[9] != kTcp && pkt[9] != kUdp) return std::nullopt;
    s.proto = pkt[9];
    s.ip_options = ihl > 20;
    s.ttl = pkt[8];
    s.src = addr(pkt, 12, 4);
    s.dst = addr(pkt, 16, 4);
    off = ihl;
  } else if (version == 6) {
    if (pkt.size() < 40) return std::nullopt;
    end = 40 + static_cast<std::size_t>(be16(pkt, 4));
    if (end > pkt.size()) return std::nullopt;
    s.src = addr(pkt, 8, 6);
    s.dst = addr(pkt, 24, 6);
    std::uint8_t nh = pkt[6];
    off = 40;
    for (int i = 0; i < kMaxExtHeaders && nh != kTcp && nh != kUdp; ++i) {
      if (nh != 0 && nh != 43 && nh != 60) return std::nullopt;  // fragments, AH, anything else
      if (off + 2 > end) return std::nullopt;
      const std::uint8_t next = pkt[off];
      off += (static_cast<std::size_t>(pkt[off + 1]) + 1) * 8;
      nh = next;
    }
    if (nh != kTcp && nh != kUdp) return std::nullopt;
    s.proto = nh;
    s.ip_options = off > 40;
    s.ttl = pkt[7];
  } else {
    return std::nullopt;
  }
  if (s.proto == kUdp) {
    if (off + 8 > end) return std::nullopt;
    const std::size_t len = be16(pkt, off + 4);
    if (len < 8 || off + len > end) return std::nullopt;
    s.sport = be16(pkt, off);
    s.dport = be16(pkt, off + 2);
    s.payload = pkt.subspan(off + 8, len - 8);
    s.l4 = off;
    s.ip_end = off + len;
    return s;
  }
  if (off + 20 > end) return std::nullopt;
  const std::size_t doff = static_cast<std::size_t>(pkt[off + 12] >> 4) * 4;
  if (doff < 20 || off + doff > end) return std::nullopt;
  s.sport = be16(pkt, off);
  s.dport = be16(pkt, off + 2);
  s.seq = be32(pkt, off + 4);
  s.ack = be32(pkt, off + 8);
  const std::uint8_t flags = pkt[off + 13];
  s.ack_flag = (flags & 0x10) != 0;
  s.fin = (flags & 0x01) != 0;
  s.syn = (flags & 0x02) != 0;
  s.rst = (flags & 0x04) != 0;
  s.urg = (flags & 0x20) != 0;
  // TCP options: kind 0 ends the list, kind 1 is one byte, every other has a
  // length; a malformed list is read as far as it goes (the server's stack
  // ignores the rest, so it cannot hide a signature from it either).
  for (std::size_t i = off + 20; i < off + doff;) {
    const std::uint8_t kind = pkt[i];
    if (kind == 0) break;
    if (kind == 1) {
      ++i;
      continue;
    }
    if (kind == kTcpOptMd5 || kind == kTcpOptAo) s.tcp_signature = true;
    if (i + 1 >= off + doff || pkt[i + 1] < 2) break;
    i += pkt[i + 1];
  }
  s.payload = pkt.subspan(off + doff, end - off - doff);
  s.l4 = off;
  s.ip_end = end;
  return s;
}

namespace {

// The Internet checksum (RFC 1071): 16-bit words added to `sum`, then folded
// and complemented.
std::uint32_t sum16(std::uint32_t sum, const std::uint8_t* b, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 2) sum += static_cast<std::uint32_t>(b[i] << 8 | b[i + 1]);
  return sum;
}
std::uint16_t checksum(std::uint32_t sum) {
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  return static_cast<std::uint16_t>(~sum);
}

}  // namespace

std::vector<std::uint8_t> judged_packet(std::span<const std::uint8_t> pkt, const Segment& s) {
  std::vector<std::uint8_t> p(pkt.begin(), pkt.begin() + static_cast<std::ptrdiff_t>(s.ip_end));
  const std::size_t len = s.ip_end - s.l4;
  const std::size_t at = s.l4 + (s.proto == kTcp ? 16 : 6);  // the checksum field
  p[at] = p[at + 1] = 0;
  // Pseudo-header: addresses, protocol, L4 length.
  const std::size_t alen = s.src.family == 4 ? 4 : 16;
  std::uint32_t sum = sum16(0, s.src.bytes.data(), alen);
  sum = sum16(sum, s.dst.bytes.data(), alen);
  sum += s.proto;
  sum += static_cast<std::uint32_t>(len & 0xffff) + static_cast<std::uint32_t>(len >> 16);
  sum = sum16(sum, p.data() + s.l4, len & ~std::size_t{1});
  if ((len & 1) != 0) sum += static_cast<std::uint32_t>(p[s.l4 + len - 1]) << 8;
  std::uint16_t c = checksum(sum);
  if (s.proto == kUdp && c == 0) c = 0xffff;  // 0 means "none" in UDP
  p[at] = static_cast<std::uint8_t>(c >> 8);
  p[at + 1] = static_cast<std::uint8_t>(c);
  return p;
}

bool apply_patch(std::vector<std::uint8_t>& pkt, const PinVerdict& v) {
  const std::optional<Segment> s = parse_packet(pkt);
  if (!s || v.patch_at > s->payload.size() || v.patch.size() > s->payload.size() - v.patch_at) return false;
  const auto at = static_cast<std::size_t>(s->payload.data() - pkt.data()) + v.patch_at;
  std::copy(v.patch.begin(), v.patch.end(), pkt.begin() + static_cast<std::ptrdiff_t>(at));
  pkt = judged_packet(pkt, *s);
  return true;
}

std::vector<std::uint8_t> server_reset_packet(const ServerReset& r) {
  const bool v4 = r.src.family == 4;
  const std::size_t ip = v4 ? 20 : 40, alen = v4 ? 4 : 16;
  std::vector<std::uint8_t> p(ip + 20, 0);
  if (v4) {
    p[0] = 0x45;
    p[3] = static_cast<std::uint8_t>(p.size());
    p[6] = 0x40;  // don't fragment
    p[8] = 64;
    p[9] = kTcp;
    std::memcpy(&p[12], r.src.bytes.data(), 4);
    std::memcpy(&p[16], r.dst.bytes.data(), 4);
    // The IPv4 header checksum (the kernel fills it too).
    const std::uint16_t c = checksum(sum16(0, p.data(), 20));
    p[10] = static_cast<std::uint8_t>(c >> 8);
    p[11] = static_cast<std::uint8_t>(c);
  } else {
    p[0] = 0x60;
    p[5] = 20;  // payload length
    p[6] = kTcp;
    p[7] = 64;
    std::memcpy(&p[8], r.src.bytes.data(), 16);
    std::memcpy(&p[24], r.dst.bytes.data(), 16);
  }
  std::uint8_t* t = &p[ip];
  t[0] = static_cast<std::uint8_t>(r.sport >> 8), t[1] = static_cast<std::uint8_t>(r.sport);
  t[2] = static_cast<std::uint8_t>(r.dport >> 8), t[3] = static_cast<std::uint8_t>(r.dport);
  for (int i = 0; i < 4; ++i) t[4 + i] = static_cast<std::uint8_t>(r.seq >> (24 - 8 * i));
  t[12] = 5 << 4;  // no options
  t[13] = 0x04;    // RST
  // TCP checksum over the pseudo header (addresses, protocol, length) and the header.
  std::uint32_t sum = sum16(kTcp + 20, r.src.bytes.data(), alen);
  sum = sum16(sum, r.dst.bytes.data(), alen);
  const std::uint16_t c = checksum(sum16(sum, t, 20));
  t[16] = static_cast<std::uint8_t>(c >> 8);
  t[17] = static_cast<std::uint8_t>(c);
  return p;
}

// ---- PinFlows -------------------------------------------------------------------------------

// Drops the oldest (time, key) write of `order`, and the entry of `map` it
// names if that entry was not written again since.
template <typename Order, typename Map>
void pop_oldest(Order& order, Map& map) {
  const auto& [at, key] = order.front();
  if (auto it = map.find(key); it != map.end() && it->second.at == at) map.erase(it);
  order.pop_front();
}

constexpr const char* kRawReason = "tcp segment written by a raw socket, not by the connection's socket";
constexpr const char* kForeignReason =
    "a connection the phase in force never judged by name (opened under an earlier phase, or passed there by "
    "address)";
constexpr const char* kQuicOtherReason =
    "quic Initial of another connection on the four-tuple of an admitted one (the server may hold the first one's "
    "stream)";
constexpr const char* kQuicForgottenReason =
    "quic Initial on a flow admitted earlier whose judged ClientHello egressd no longer holds";
constexpr const char* kQuicIdReason =
    "quic Initial under the connection ID of a connection admitted on another flow (new source port, or after "
    "conntrack forgot the first: the server would read only what extends its first hello)";
constexpr const char* kQuicIdsFullReason =
    "quic connection beyond the 8192 admitted in 10 minutes whose IDs egressd holds (an ID it let go could be "
    "taken up again; the client falls back to TCP)";
constexpr const char* kGsoReason = "quic datagrams sent as one GSO batch (their boundaries cannot be read)";
constexpr const char* kUrgentPinnedReason =
    "tcp urgent data on a pinned flow (the server's stack takes the urgent byte out of the stream)";
constexpr const char* kEvictedOtherReason =
    "bytes of a connection admitted by its address that egressd stopped following before its server answered "
    "(too many followed at once)";
constexpr const char* kReplacedReason = "connection replaced before its first bytes were judged";
constexpr const char* kResentDifferReason =
    "tcp bytes sent again that differ from the ones read at the same place (the pages were rewritten)";
constexpr const char* kUrgentReason = "tcp urgent data in the first bytes (the server's stack takes it out of the stream)";

// Why the path or the server may drop a segment of the first bytes that the
// connection's socket wrote (Segment::ip_options ...): once the flow is
// admitted, the kernel lets it through unread, and a raw socket could write
// other bytes at the sequence numbers of the lost ones. Every Linux stack
// sends its first segments with a TTL of 64 (the default) or more.
constexpr std::uint8_t kMinJudgedTtl = 64;
static std::optional<std::string> droppable(const Segment& seg) {
  std::string what;
  if (seg.ip_options) what = seg.src.family == 4 ? "ip options" : "ipv6 extension headers";
  else if (seg.tcp_signature) what = "a tcp signature option (md5 or ao) the server may have no key for";
  else if (seg.ttl < kMinJudgedTtl) what = fmt::format("{} {}, below {}", seg.src.family == 4 ? "ttl" : "hop limit", seg.ttl, kMinJudgedTtl);
  else return std::nullopt;
  return "tcp segment the path or the server may drop (" + what + "): the server could take other bytes than those judged";
}

std::vector<std::uint8_t> PinFlows::stream(const Flow& f) {
  std::vector<std::uint8_t> out;
  for (const auto& [offset, bytes] : f.segs) {
    if (offset > out.size()) break;  // a gap: what follows it is not yet usable
    const std::size_t skip = out.size() - offset;
    if (skip < bytes.size()) out.insert(out.end(), bytes.begin() + static_cast<std::ptrdiff_t>(skip), bytes.end());
    if (out.size() >= pin::kMaxInspect) {
      out.resize(pin::kMaxInspect);
      break;
    }
  }
  return out;
}

std::vector<PinVerdict> PinFlows::finish(std::map<Key, Flow>::iterator it, bool admit, Clock::time_point now,
                                         bool reset_server) {
  if (!admit && reset_server && !it->second.quic && server_resets_.size() < kMaxFlows) {
    const auto& [family, proto, src, dst, sport, dport] = it->first;
    ServerReset r;
    r.src.family = r.dst.family = family;
    r.src.prefix_len = r.dst.prefix_len = family == 4 ? 32 : 128;
    r.src.bytes = src;
    r.dst.bytes = dst;
    r.sport = sport;
    r.dport = dport;
    r.seq = it->second.base;
    server_resets_.push_back(r);
  }
  std::vector<PinVerdict> out;
  for (std::size_t i = 0; i < it->second.ids.size(); ++i) {
    PinVerdict::Kind k = PinVerdict::Kind::admit;
    // One reset answers the client; the rest of a refused flow's bytes go nowhere.
    if (!admit) k = i == 0 ? PinVerdict::Kind::reset : PinVerdict::Kind::drop;
    out.push_back({it->second.ids[i], k});
  }
  ++(admit ? stats_.admitted : stats_.reset);
  set_decided(it->first, {admit, now, it->second.ct_id});
  if (it->second.quic) {
    --quic_flows_;
    if (admit) {
      // Kept to judge the flow's later Initials (quic_follow).
      followed_[it->first] = Followed{std::move(it->second.quic), now};
      followed_order_.emplace_back(now, it->first);
      while (followed_.size() > kMaxQuicFollowed && !followed_order_.empty()) pop_oldest(followed_order_, followed_);
    }
  }
  flows_.erase(it);
  count_held();
  return out;
}

std::vector<PinVerdict> PinFlows::reset_flow(std::map<Key, Flow>::iterator it, const std::string& why,
                                             Clock::time_point now, bool reset_server) {
  pin::Decision d;
  d.kind = pin::Decision::Kind::reset;
  d.reason = why;
  judge_.pin_decided(d, it->second.dst, it->second.dport);
  return finish(it, false, now, reset_server);
}

std::uint64_t PinFlows::fingerprint(const Segment& seg) {
  const std::string_view bytes(reinterpret_cast<const char*>(seg.payload.data()), seg.payload.size());
  std::uint64_t h = std::hash<std::string_view>{}(bytes);
  h ^= (std::uint64_t{seg.seq} << 32 | std::uint64_t{seg.syn} << 2 | std::uint64_t{seg.fin} << 1 | seg.rst) +
       0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

// A segment with no payload and no SYN, FIN or RST: a client that only
// receives sends many with one sequence number, so they are never taken for
// packets sent back to the hook that came back (recheck_once: the
// fingerprint of a payload-less segment is its sequence number). Two such
// stragglers of a flow admitted a moment ago made the second look like a
// packet of a new connection the kernel had not marked: the flow's memory
// was dropped, and its next straggler with bytes judged as a first write
// (an "other" flow's middle admitted again; a followed TLS flow refused as
// one egressd forgot). Found in CI's release lab, 2026-12-07.
bool PinFlows::bare_ack(const Segment& seg) {
  return seg.proto == kTcp && seg.payload.empty() && !seg.syn && !seg.fin && !seg.rst;
}

bool PinFlows::recheck_once(Decided& d, const Segment& seg) {
  const std::uint64_t fp = fingerprint(seg);
  auto& seen = d.rechecked;
  if (std::find(seen.begin(), seen.end(), fp) != seen.end() || seen.size() >= kMaxRechecks) return false;
  seen.push_back(fp);
  return true;
}

std::vector<PinVerdict> PinFlows::packet(PinPacketId id, const Segment& seg, Clock::time_point now) {
  const Key key{static_cast<std::uint8_t>(seg.dst.family), seg.proto, seg.src.bytes, seg.dst.bytes, seg.sport, seg.dport};
  if (seg.proto == kTcp) {
    // A raw socket's bare ACK (Docker's NET_RAW) is dropped: it carries
    // nothing to judge, but the server takes what its header says. With
    // timestamps ahead of the socket's it has the server drop the socket's
    // next segments as old (PAWS), so the bytes judged never arrive while the
    // flow goes on: a server that speaks first (a banner) answered, the
    // socket acknowledged that, and the flow, admitted by its address, took
    // the fast path with a raw copy of other bytes at the judged ones'
    // sequence numbers still to come (attack review 5, 2026-12-07). One with
    // URG names a byte still to come: refused below.
    if (bare_ack(seg) && !seg.from_socket && !seg.urg) return {{id, PinVerdict::Kind::drop}};
    if (seg.followed) {
      if (auto tf = tls_.find(key); tf != tls_.end() && tf->second.ct_id == seg.ct_id) {
        return tls_packet(id, tf, seg, now);
      }
      // A straggler of a TLS flow admitted a moment ago, queued before its
      // mark was set: sent back to the hook once; if it comes back, the mark
      // did not take, and the flow is refused (http_packet: not followed).
      if (auto hf = http_.find(key); hf == http_.end() || hf->second.ct_id != seg.ct_id) {
        if (auto d = decided_.find(key);
            d != decided_.end() && d->second.admitted && d->second.ct_id == seg.ct_id) {
          if (bare_ack(seg)) return {{id, PinVerdict::Kind::pass}};
          if (recheck_once(d->second, seg)) return {{id, PinVerdict::Kind::recheck}};
          decided_.erase(d);
        }
      }
      return http_packet(id, key, seg, now);
    }
    if (seg.syn && seg.stray_syn) {
      // A SYN that met an entry the server's side started: conntrack forgot a
      // connection on these addresses and ports (egressd deletes a refused
      // flow's entry), and a late packet of the server's started a new entry.
      // Let through, the handshake's ACK would be in that entry's reply
      // direction, which chain pin resets, leaving the server a half-open
      // connection that refuses the socket's next SYN (nft::kPinStraySynMark).
      // The socket's SYN has the entry deleted instead and is dropped, so its
      // retry a second later starts an entry of its own. A raw socket's SYN
      // changes nothing.
      if (seg.from_socket && seg.payload.empty() && entry_deletes_.size() < kMaxFlows) {
        entry_deletes_.push_back({seg.src, seg.dst, seg.sport, seg.dport, 0});
      }
      return {{id, PinVerdict::Kind::drop}};
    }
    if (seg.syn) {
      // A SYN a raw socket wrote on the addresses and ports of a live flow
      // (Docker's NET_RAW, a bad checksum so the server drops it) opens no
      // connection, but output's first rule has zeroed the flow's mark: were
      // it taken for a new connection, what the reader knows of the live one
      // would be forgotten and its next bytes judged as a first request (a
      // followed HTTP connection's body written as one; found in an attack
      // review). Dropped; the flow keeps what the reader knows of it.
      if (!seg.from_socket) return {{id, PinVerdict::Kind::drop}};
      evicted_.erase(key);
      return new_connection_on_old_entry(id, key, seg, now);
    }
    // A new connection on the addresses and ports of a followed one.
    if (auto hf = http_.find(key); hf != http_.end() && hf->second.ct_id != seg.ct_id) forget_followed(key);
    if (auto tf = tls_.find(key); tf != tls_.end() && tf->second.ct_id != seg.ct_id) forget_tls(key);
    // Urgent data on a flow whose bytes are not held: an admitted one (the
    // server would take a byte out of what it has not read yet), or an
    // undecided one, where a payload-less segment's urgent pointer names a
    // byte still to come (written with a raw socket). Refused either way.
    if (seg.urg && !flows_.contains(key)) {
      // An undecided flow's server end waits at the stream's start: reset it there.
      if (auto st = starts_.find(key);
          st != starts_.end() && st->second.ct_id == seg.ct_id && server_resets_.size() < kMaxFlows) {
        server_resets_.push_back({seg.src, seg.dst, seg.sport, seg.dport, st->second.seq});
      }
      return refuse_decided(id, key, seg, kUrgentPinnedReason, now);
    }
    // A flow admitted by its address, not yet answered by its server.
    if (auto tf = tls_.find(key);
        !seg.foreign && tf != tls_.end() && tf->second.by_address && tf->second.ct_id == seg.ct_id) {
      return other_packet(id, tf, seg, now);
    }
    if (seg.foreign) return foreign_packet(id, key, seg, now);
    // A flow admitted by its address that tls_'s bounds made the reader
    // forget (bound_tls): a start recorded now would be where its stream goes
    // on, not where it starts. Packets without bytes pass (the server end is
    // reset); bytes refuse the connection.
    if (auto ev = evicted_.find(key); ev != evicted_.end()) {
      if (ev->second.ct_id != seg.ct_id) {
        evicted_.erase(ev);  // another connection (conntrack forgot the old one)
      } else if (seg.payload.empty()) {
        return {{id, PinVerdict::Kind::pass}};
      } else {
        evicted_.erase(ev);
        return refuse_decided(id, key, seg, kEvictedOtherReason, now);
      }
    }
  }
  if (seg.proto == kUdp && seg.gso) return quic_gso(id, key, seg, now);
  if (seg.proto == kUdp && !flows_.contains(key)) {
    // A long-header datagram of an admitted QUIC flow: its Initials must
    // repeat the judged hello, or be another connection's, judged afresh.
    if (auto fo = followed_.find(key); fo != followed_.end()) return quic_follow(id, fo, seg, now);
    // Its assembler forgotten: what holds no Initial starts no connection.
    const bool initial = pin::quic_datagram_has_initial(pin::Bytes(seg.payload.data(), seg.payload.size()));
    if (admitted_.contains(key) && !initial) return {{id, PinVerdict::Kind::admit}};
    // A flow the kernel already passed (its ct mark is set: admitted here
    // earlier, or by an earlier phase) whose assembler is gone (bounded in
    // number and time, or a restart): an Initial on it cannot be judged
    // afresh, since the server may hold part of the connection's stream
    // (a first hello that asked for a second) and take only what extends it.
    // Without an Initial: a datagram of a flow the kernel passed under
    // another phase (the phase chain sends it here) this reader never admitted.
    if (seg.passed && !flows_.contains(key)) {
      if (refused_already(key, seg)) return {{id, PinVerdict::Kind::reset}};
      return refuse_decided(id, key, seg, initial ? kQuicForgottenReason : kForeignReason, now);
    }
  }
  // Bytes of a followed connection queued on the first queue before the
  // flow's mark took (a straggler of the first write), that continue its
  // stream exactly: read in their place, as if they had come on the follow
  // queue. Sent back to the hook instead, they would come back behind later
  // bytes and be dropped as after a gap (every packet after them too, each
  // one sent again). Anything else is sent back (below): a new connection
  // on the same addresses and ports (conntrack may even give it the old
  // id) comes back, unmarked, and is judged on its own.
  if (seg.proto == kTcp && !seg.payload.empty() && !flows_.contains(key)) {
    if (auto tf = tls_.find(key);
        tf != tls_.end() && tf->second.ct_id == seg.ct_id && seg.seq == tf->second.next) {
      return tls_packet(id, tf, seg, now);
    }
    if (auto hf = http_.find(key); hf != http_.end() && hf->second.ct_id == seg.ct_id && seg.seq == hf->second.next) {
      return http_packet(id, key, seg, now);
    }
  }
  if (auto d = decided_.find(key); d != decided_.end() && !flows_.contains(key)) {
    if (d->second.admitted) {
      // A straggler queued before its flow's mark was set, or the first
      // packet of a new connection on the same addresses and ports (a socket
      // bound to the port of a flow admitted a moment ago; conntrack may even
      // give it the old entry's id). Never admitted from memory: sent back to
      // the hook, where a straggler finds its flow's mark and takes the fast
      // path; a packet that comes back has no mark, so it starts a flow of
      // its own and is judged on its own bytes. A bare ACK carries nothing
      // to judge: it passes below, and leaves the flow's memory as it is.
      if (!bare_ack(seg)) {
        if (recheck_once(d->second, seg)) return {{id, PinVerdict::Kind::recheck}};
        decided_.erase(d);
      }
    } else if (seg.proto == kUdp ||
               (d->second.ct_id == seg.ct_id && !(seg.payload.empty() && !seg.rst && !seg.fin))) {
      // A packet of a refused flow: the same answer. Its client was reset,
      // so a bare ACK (a handshake's last packet) or another conntrack id is
      // a new connection, judged afresh (conntrack may give a new entry the
      // old one's id).
      return {{id, seg.payload.empty() && seg.proto == kTcp ? PinVerdict::Kind::drop : PinVerdict::Kind::reset}};
    } else {
      decided_.erase(d);  // another connection: judged afresh
    }
  }
  if (seg.proto == kUdp) return quic_packet(id, key, seg, now);
  auto it = flows_.find(key);
  std::vector<PinVerdict> replaced;
  if (it != flows_.end() && it->second.ct_id != seg.ct_id) {
    // The held connection is gone and a new one has its addresses and
    // ports: the old one's bytes must not complete the new one's hello.
    // (Its server end was closed by the old connection's end.)
    replaced = reset_flow(it, kReplacedReason, now, false);
    it = flows_.end();
  }
  auto with_replaced = [&](std::vector<PinVerdict> v) {
    if (replaced.empty()) return v;
    replaced.insert(replaced.end(), v.begin(), v.end());
    return std::move(replaced);
  };
  if (seg.payload.empty() && (seg.rst || seg.fin) && it != flows_.end() && !seg.from_socket) {
    // A FIN or RST a raw socket wrote may be one the server drops (a wrong
    // checksum): the held bytes would go while the socket sends them again
    // later, after bytes the reader then took for the stream's start (found
    // by an attack review). The flow is refused.
    it->second.ids.push_back(id);
    return with_replaced(reset_flow(it, kRawReason, now));
  }
  if (seg.payload.empty() && (seg.rst || seg.fin) && it != flows_.end()) {
    // The client ends a connection whose first bytes are still held: they
    // never leave; its RST/FIN does (the server closes its end), and the
    // addresses and ports are free for a new connection, judged afresh.
    std::vector<PinVerdict> out;
    for (const PinPacketId held : it->second.ids) out.push_back({held, PinVerdict::Kind::drop});
    out.push_back({id, PinVerdict::Kind::pass});
    if (it->second.quic) --quic_flows_;
    flows_.erase(it);
    count_held();
    return with_replaced(std::move(out));
  }
  if (seg.payload.empty() && seg.urg && it != flows_.end()) {
    it->second.ids.push_back(id);
    return with_replaced(reset_flow(it, kUrgentReason, now));
  }
  if (seg.payload.empty()) {
    // An ACK, FIN or RST without data carries no name: it passes and the
    // flow stays undecided (a held flow keeps its held packets). The
    // handshake's ACK tells where the stream starts (ISN + 1), so a later
    // segment that arrives first is not mistaken for the first bytes; only
    // the socket's own ACK says so (a raw one could move the start).
    // A start stays until the connection's first bytes come, so one whose
    // client never wrote a byte (the server reset it) outlives it. The next
    // connection on the four-tuple may get its conntrack id (derived from the
    // entry's address and tuple; the freed entry's memory is used again):
    // its handshake ACK acknowledges another server ISN, and replaces it.
    // Within one connection the acknowledgment moves only when the server
    // sends first, which the pinned protocols' servers do not.
    if (it == flows_.end() && !seg.rst && !seg.fin && seg.from_socket) {
      auto st = starts_.find(key);
      if (st == starts_.end() ? starts_.size() < kMaxFlows
                              : st->second.ct_id != seg.ct_id || st->second.ack != seg.ack)
        set_start(key, Start{seg.seq, now, seg.ct_id, seg.ack});
    }
    return with_replaced({{id, PinVerdict::Kind::pass}});
  }
  if (!replaced.empty()) {
    auto rest = packet(id, seg, now);
    return with_replaced(std::move(rest));
  }
  if (it == flows_.end()) {
    ++stats_.inspected;
    std::uint32_t base = seg.seq;
    bool start_known = false;
    if (auto st = starts_.find(key); st != starts_.end()) {
      if (st->second.ct_id == seg.ct_id) {
        base = st->second.seq;
        start_known = true;
      }
      starts_.erase(st);
    }
    it = flows_.emplace(key, Flow{seg.dst, seg.dport, now, base, {}, {}, nullptr, seg.ct_id, 0, start_known}).first;
    count_held();
    if (flows_.size() > kMaxFlows) {
      it->second.ids.push_back(id);
      return reset_flow(it, "too many flows held at once", now);
    }
  }
  Flow& f = it->second;
  if (f.ids.empty()) f.held_since = now;
  f.ids.push_back(id);
  // Insertion: the server must take exactly the bytes judged here. A segment
  // a raw socket wrote may be one it drops (a wrong checksum, a timestamp
  // PAWS refuses, a TTL that runs out on the way) while the socket later
  // sends other bytes at the same sequence numbers, which the admitted flow
  // lets through unread; and an urgent byte is taken out of the stream by
  // the server's stack, so it reads other bytes than these.
  if (!seg.from_socket) return reset_flow(it, kRawReason, now);
  if (seg.urg) return reset_flow(it, kUrgentReason, now);
  if (const auto why = droppable(seg)) return reset_flow(it, *why, now);
  // Sequence numbers relative to the first byte held (mod 2^32). A segment
  // that starts before it (reordered) moves the start back.
  std::uint32_t rel = seg.seq - f.base;
  if (rel >= 0x80000000u) {
    const std::uint32_t back = f.base - seg.seq;
    if (back >= pin::kMaxInspect) return reset_flow(it, "tcp segments out of order beyond 16384 bytes", now);
    std::map<std::uint32_t, std::vector<std::uint8_t>> moved;
    for (auto& [o, b] : f.segs) moved.emplace(o + back, std::move(b));
    f.segs = std::move(moved);
    f.base = seg.seq;
    f.extent += back;
    rel = 0;
  }
  if (rel < 0x80000000u) f.extent = std::max<std::uint32_t>(f.extent, rel + static_cast<std::uint32_t>(seg.payload.size()));
  if (rel < pin::kMaxInspect) {
    // Bytes sent again must repeat the ones read: every held copy leaves as
    // read, and the judgement is made on one of them. (A socket does not
    // resend a segment a copy of which is queued, so it takes a raw socket,
    // or pages rewritten between two copies a socket made: MSG_ZEROCOPY,
    // sendfile().)
    const std::size_t len = std::min<std::size_t>(seg.payload.size(), pin::kMaxInspect - rel);
    for (const auto& [o, b] : f.segs) {
      if (o >= rel + len) break;
      const std::size_t from = std::max<std::size_t>(o, rel), to = std::min<std::size_t>(o + b.size(), rel + len);
      if (from < to && !std::equal(b.begin() + static_cast<std::ptrdiff_t>(from - o),
                                   b.begin() + static_cast<std::ptrdiff_t>(to - o),
                                   seg.payload.begin() + static_cast<std::ptrdiff_t>(from - rel))) {
        return reset_flow(it, kResentDifferReason, now);
      }
    }
    auto& slot = f.segs[rel];
    // A retransmission may carry more than the first copy; keep the longer.
    // Only what the parsers may look at is kept: a GSO packet (the queue
    // hands them over whole) can carry 64 KiB.
    const std::size_t keep = std::min<std::size_t>(seg.payload.size(), pin::kMaxInspect - rel);
    if (keep > slot.size()) slot.assign(seg.payload.begin(), seg.payload.begin() + static_cast<std::ptrdiff_t>(keep));
  }
  const std::vector<std::uint8_t> bytes = stream(f);
  const pin::Bytes view(bytes.data(), bytes.size());
  pin::PinProto proto = pin::PinProto::tls;
  switch (pin::classify_tcp(view)) {
    case pin::TcpKind::need_more:
      if (bytes.size() >= pin::kMaxInspect) return reset_flow(it, "no decision within 16384 bytes", now);
      f.http_incomplete = false;
      return {};
    case pin::TcpKind::other: {
      // Bytes the reader cannot place: where the stream starts is unknown
      // (egressd restarted since the handshake, or the start was dropped
      // from a full memory), so these may come from its middle, and the
      // bytes before them, held back, would follow on the fast path unread
      // (an attack review). Refused: a TLS or HTTP start is judged, and
      // bytes before it are refused later (Kept::start). The server holds
      // none of a flow's bytes while its ct mark is 0: no rule takes a
      // mark off a flow the reader let bytes through on (chain output hands
      // a SYN on an old entry to the reader, which clears it only for the
      // socket's own; chain pin refuses a flow conntrack takes up mid-stream).
      if (!f.start_known) {
        return reset_flow(it, "first bytes of a connection whose start egressd never saw are neither tls nor http",
                          now);
      }
      // Not TLS, not HTTP: the address decides, as without pinning. Known
      // as such, so a later phase that allows the address takes it on
      // (foreign_packet).
      // A request to upgrade to TLS: the hello that follows once the server
      // agreed is judged (other_packet). Whatever came with the request in
      // one write would be read by the server as the start of that TLS
      // (a server that keeps what it has buffered, against the protocols'
      // advice): refused.
      const std::optional<std::size_t> upgrade = pin::tls_upgrade_request(view);
      if (upgrade && (bytes.size() > *upgrade || f.extent > *upgrade)) {
        return reset_flow(it, "bytes after a request to upgrade the connection to tls, before the server answered it",
                          now);
      }
      AdmittedFlow a{seg.proto, seg.src, seg.dst, seg.sport, seg.dport, "", 0, f.ct_id};
      a.by_address = true;
      remember(key, std::move(a));
      return follow_other(it, seg, upgrade.has_value(), now);
    }
    case pin::TcpKind::tls: proto = pin::PinProto::tls; break;
    case pin::TcpKind::http: proto = pin::PinProto::http; break;
  }
  const pin::Parse parse = proto == pin::PinProto::tls ? pin::parse_tls_client_hello(view) : pin::parse_http_head(view);
  pin::Decision d = pin::decide(proto, parse, seg.dst, seg.dport, judge_.pin_facts());
  if (d.kind == pin::Decision::Kind::need_more) {
    if (bytes.size() >= pin::kMaxInspect) return reset_flow(it, "no decision within 16384 bytes", now);
    f.http_incomplete = proto == pin::PinProto::http;
    return {};
  }
  if (d.kind == pin::Decision::Kind::admit && proto == pin::PinProto::tls && parse.early_data) {
    // After a HelloRetryRequest a server skips the encrypted records of
    // refused early data, so a client that offered it can send records the
    // reader must take for the end of the handshake, then a second hello.
    d.kind = pin::Decision::Kind::reset;
    d.reason = "tls early data (0-RTT) offered on a pinned flow (" + d.reason +
               "): a server skips such records after a HelloRetryRequest, so they could hide a second ClientHello";
  }
  judge_.pin_decided(d, seg.dst, seg.dport);
  if (d.kind == pin::Decision::Kind::admit) remember(key, seg, d.name);
  if (d.kind == pin::Decision::Kind::admit && proto == pin::PinProto::http) return follow_http(it, d.name, now);
  if (d.kind == pin::Decision::Kind::admit) return follow_tls(it, seg, now);
  return finish(it, false, now);
}

// ---- Judged bytes kept for retransmissions --------------------------------------------------

namespace {
// How far sequence number `a` is after `b` (negative: before).
std::int64_t seq_after(std::uint32_t a, std::uint32_t b) { return static_cast<std::int32_t>(a - b); }
}  // namespace

std::ptrdiff_t PinFlows::Kept::add(std::uint32_t seq, std::span<const std::uint8_t> bytes) {
  if (bytes.empty()) return 0;
  const std::size_t before = size;
  if (!ranges.empty() && seq_after(seq, ranges.back().first + static_cast<std::uint32_t>(ranges.back().second.size())) == 0) {
    ranges.back().second.insert(ranges.back().second.end(), bytes.begin(), bytes.end());
  } else {
    ranges.emplace_back(seq, std::vector<std::uint8_t>(bytes.begin(), bytes.end()));
  }
  size += bytes.size();
  // Over the bound: the oldest bytes go, and a retransmission of them is refused.
  while (size > kMaxKeptPerFlow) {
    auto& [at, b] = ranges.front();
    const std::size_t drop = std::min(b.size(), size - kMaxKeptPerFlow);
    forgotten_until = at + static_cast<std::uint32_t>(drop);
    if (drop == b.size()) {
      ranges.pop_front();
    } else {
      b.erase(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(drop));
      at += static_cast<std::uint32_t>(drop);
    }
    size -= drop;
  }
  return static_cast<std::ptrdiff_t>(size) - static_cast<std::ptrdiff_t>(before);
}

std::optional<std::string> PinFlows::Kept::patch(const Segment& seg, PinVerdict& v) const {
  const auto len = static_cast<std::uint32_t>(seg.payload.size());
  if (len == 0) return std::nullopt;
  if (forgotten_until && seq_after(*forgotten_until, seg.seq) > 0) {
    return std::string("a retransmission of judged bytes the reader no longer keeps (more than 16384 bytes of them "
                       "not yet answered)");
  }
  if (start && seq_after(*start, seg.seq) > 0) {
    return std::string("bytes before the first ones judged on the connection (the reader never read them)");
  }
  std::vector<std::uint8_t> out;
  std::size_t first = len, last = 0;  // the payload span the patch covers
  for (const auto& [at, b] : ranges) {
    const std::int64_t from = std::max<std::int64_t>(0, seq_after(at, seg.seq));
    const std::int64_t to = std::min<std::int64_t>(len, seq_after(at, seg.seq) + static_cast<std::int64_t>(b.size()));
    if (from >= to) continue;
    if (out.empty()) out.assign(seg.payload.begin(), seg.payload.end());
    const std::int64_t in_b = from - seq_after(at, seg.seq);
    std::copy_n(b.begin() + in_b, to - from, out.begin() + from);
    first = std::min(first, static_cast<std::size_t>(from));
    last = std::max(last, static_cast<std::size_t>(to));
  }
  if (out.empty()) return std::nullopt;
  v.patch_at = first;
  v.patch.assign(out.begin() + static_cast<std::ptrdiff_t>(first), out.begin() + static_cast<std::ptrdiff_t>(last));
  return std::nullopt;
}

// ---- TLS: admitted, followed through the handshake ------------------------------------------

// A TLS flow admitted on its hello: followed (kPinFollowMark) rather than
// given the fast path, its records read and its bytes kept, until its
// handshake is over (TlsFollowed).
std::vector<PinVerdict> PinFlows::follow_tls(std::map<Key, Flow>::iterator it, const Segment& seg,
                                             Clock::time_point now) {
  const Key key = it->first;
  Flow& f = it->second;
  TlsFollowed t;
  t.dst = f.dst;
  t.dport = f.dport;
  t.ct_id = f.ct_id;
  t.ack = seg.ack;
  const std::vector<std::uint8_t> bytes = stream(f);
  // A second hello may follow the first in the same write (the server reads
  // it after its HelloRetryRequest): the bytes held are read as records too.
  const pin::TlsClientStream::Step step = t.records.feed(bytes, false);
  std::optional<std::string> bad = step.invalid;
  if (!bad && f.extent > bytes.size()) bad = "tls bytes beyond the first 16384 before the handshake ended";
  for (std::size_t i = 0; !bad && i < step.hellos.size(); ++i) {
    const pin::Parse p = pin::parse_client_hello_message(step.hellos[i]);
    const pin::Decision d = pin::decide(pin::PinProto::tls, p, f.dst, f.dport, judge_.pin_facts());
    if (d.kind != pin::Decision::Kind::admit) bad = "a second ClientHello on the connection: " + d.reason;
    else admitted_also(key, d.name);
  }
  if (bad) {
    forget_admitted(key);
    return reset_flow(it, *bad, now);
  }
  t.next = f.base + static_cast<std::uint32_t>(bytes.size());
  return start_following_tls(it, std::move(t), bytes, PinVerdict::Kind::follow, now);
}

// The flow's held packets get `kind`; the bytes judged are kept in `t`,
// which follows the flow from here on.
std::vector<PinVerdict> PinFlows::start_following_tls(std::map<Key, Flow>::iterator it, TlsFollowed t,
                                                      const std::vector<std::uint8_t>& bytes, PinVerdict::Kind kind,
                                                      Clock::time_point now) {
  const Key key = it->first;
  t.judged.start = it->second.base;
  const std::ptrdiff_t grew = t.judged.add(it->second.base, bytes);
  std::vector<PinVerdict> out = finish(it, true, now);
  for (PinVerdict& v : out) v.kind = kind;
  forget_tls(key);
  tls_lru_.push_front(key);
  t.lru = tls_lru_.begin();
  tls_.emplace(key, std::move(t));
  tls_kept_ += static_cast<std::size_t>(grew);
  bound_tls(now);
  return out;
}

// "Other" first bytes let the flow through by its address, but the server
// must get the bytes judged, not others at their sequence numbers: were they
// lost after the verdict (the path, or a forged timestamp that has the
// server drop them, PAWS, with NET_RAW), the socket's retransmission, from
// pages rewritten since (sendfile, zero-copy) or a raw segment, went on the
// fast path unread, a request or hello for another name (an attack review,
// 2026-12-07). So the flow is followed as a TLS flow past its handshake:
// retransmitted judged bytes leave as they were read, later bytes as they
// are, and once the server has spoken after the judged bytes (the socket
// acknowledges more of the server's stream than when it sent them) the flow
// takes the fast path. Its ct mark stays 0 meanwhile (the verdicts are
// `pass`), so every packet, the socket's pure ACK of the server's answer
// included, comes to the reader (other_packet) and the flow is admitted
// within a round trip, not at the client's next write; a followed mark would
// leave those ACKs in the kernel, and the flow walking the learned set until
// then, cut if its address expired meanwhile.
std::vector<PinVerdict> PinFlows::follow_other(std::map<Key, Flow>::iterator it, const Segment& seg, bool upgrade,
                                               Clock::time_point now) {
  Flow& f = it->second;
  // The first 16 KiB are kept (what the parsers look at): a first write
  // larger than that (a GSO packet) goes whole, as read, and a later copy of
  // its bytes past them, a stream's middle, goes as it is.
  const std::vector<std::uint8_t> bytes = stream(f);
  TlsFollowed t;
  t.dst = f.dst;
  t.dport = f.dport;
  t.ct_id = f.ct_id;
  t.ack = seg.ack;
  t.done_ack = seg.ack;
  t.by_address = true;
  t.upgrade = upgrade;
  t.next = f.base + static_cast<std::uint32_t>(std::max<std::size_t>(f.extent, bytes.size()));
  return start_following_tls(it, std::move(t), bytes, PinVerdict::Kind::pass, now);
}

// A packet of a flow admitted by its address, not yet answered by its server
// (follow_other), from the first queue.
std::vector<PinVerdict> PinFlows::other_packet(PinPacketId id, std::map<Key, TlsFollowed>::iterator tf,
                                               const Segment& seg, Clock::time_point now) {
  const Key key = tf->first;
  TlsFollowed& t = tf->second;
  tls_lru_.splice(tls_lru_.begin(), tls_lru_, t.lru);
  if (!seg.payload.empty() && !seg.from_socket) return refuse_followed(id, key, seg, kRawReason, t.next, now);
  if (!seg.payload.empty()) {
    if (const auto why = droppable(seg)) return refuse_followed(id, key, seg, *why, t.next, now);
  }
  if (t.upgrade && !seg.payload.empty() && seq_after(seg.seq + static_cast<std::uint32_t>(seg.payload.size()), t.next) > 0) {
    // The client's first write after its request to upgrade to TLS. A
    // hello (a TLS record) is judged as a connection's first bytes, from
    // here: the flow is held and judged afresh, with this byte as its
    // start. Anything else: the server declined, the protocol goes on in
    // the clear, and the address decides (a PostgreSQL client that got
    // 'N' sends its startup message). New bytes behind older ones in one
    // segment (a retransmission the stack merged) cannot be held apart:
    // refused if they start a record.
    const std::int64_t at = seq_after(t.next, seg.seq);
    if (at < 0) {
      return refuse_followed(id, key, seg, "bytes after a gap, after a request to upgrade the connection to tls",
                             t.next, now);
    }
    const std::uint8_t b = seg.payload[static_cast<std::size_t>(at)];
    const bool record = b >= 20 && b <= 25;
    if (record && at != 0) {
      return refuse_followed(id, key, seg, "a tls record after a request to upgrade the connection, behind bytes "
                                           "sent before it in one segment", t.next, now);
    }
    if (record) {
      forget_tls(key);
      forget_admitted(key);
      decided_.erase(key);
      set_start(key, Start{seg.seq, now, seg.ct_id, seg.ack});
      return packet(id, seg, now);
    }
    t.upgrade = false;
  }
  return after_judged(id, tf, seg, now);
}

// A packet of a followed flow whose judging is over (a TLS handshake that
// ended, an "other" flow's first bytes): retransmitted judged bytes go as
// read, later ones as they are. Once the server spoke after the judged bytes
// (the socket acknowledges more of its stream than at done_ack), it has
// them: admitted, the fast path. Only the socket's word counts (a raw ACK
// could acknowledge anything).
std::vector<PinVerdict> PinFlows::after_judged(PinPacketId id, std::map<Key, TlsFollowed>::iterator tf,
                                               const Segment& seg, Clock::time_point now) {
  const Key key = tf->first;
  TlsFollowed& t = tf->second;
  PinVerdict v{id, PinVerdict::Kind::pass};
  if (!seg.payload.empty()) {
    if (auto bad = t.judged.patch(seg, v)) return refuse_followed(id, key, seg, *bad, t.next, now);
    v.as_read = !v.patch.empty();
    if (v.as_read && seg.oversize) return {{id, PinVerdict::Kind::drop}};
    // An "other" flow's later bytes move where its server end waits, so a
    // reset (bound_tls, refuse_followed) lands there (attack review 7).
    if (const auto end = seg.seq + static_cast<std::uint32_t>(seg.payload.size());
        t.by_address && seq_after(end, t.next) > 0) {
      t.next = end;
    }
  }
  if (seg.from_socket && seg.ack_flag && t.done_ack && !t.upgrade && seq_after(seg.ack, *t.done_ack) > 0) {
    set_decided(key, {true, now, t.ct_id});  // stragglers: sent back to the hook (packet())
    v.kind = PinVerdict::Kind::admit;
    forget_tls(key);
  }
  return {std::move(v)};
}

// Past the bounds, the least recently active flow is forgotten. A TLS flow's
// mark sends its next packets to the follow queue, where a flow not followed
// is refused. One admitted by its address has no mark yet (follow_other): it
// is refused here, its server end reset where the reader's reading ended,
// and its next bytes refused with the reason (packet(): evicted_).
void PinFlows::bound_tls(Clock::time_point now) {
  while (!tls_lru_.empty() && (tls_.size() > kMaxTlsFollowed || tls_kept_ > kMaxKeptBytes)) {
    const Key key = tls_lru_.back();
    if (const auto tf = tls_.find(key); tf != tls_.end() && tf->second.by_address) {
      const int family = key.family;
      if (server_resets_.size() < kMaxFlows) {
        server_resets_.push_back(
            {addr(key.src, 0, family), addr(key.dst, 0, family), key.sport, key.dport, tf->second.next});
      }
      evicted_[key] = {tf->second.ct_id, now};
      evicted_order_.emplace_back(now, key);
      while (evicted_.size() > kMaxFlows && !evicted_order_.empty()) pop_oldest(evicted_order_, evicted_);
    }
    forget_tls(key);
  }
}

void PinFlows::forget_tls(const Key& key) {
  if (auto it = tls_.find(key); it != tls_.end()) {
    tls_kept_ -= it->second.judged.size;
    tls_lru_.erase(it->second.lru);
    tls_.erase(it);
  }
}

// A packet of a followed TLS flow (queue kPinFollowQueueNum): bytes that
// repeat ones read go with those; new ones are read as records, a later
// hello judged; the packet that ends the handshake is admitted, and the flow
// takes the fast path.
std::vector<PinVerdict> PinFlows::tls_packet(PinPacketId id, std::map<Key, TlsFollowed>::iterator tf,
                                             const Segment& seg, Clock::time_point now) {
  const Key key = tf->first;
  TlsFollowed& t = tf->second;
  tls_lru_.splice(tls_lru_.begin(), tls_lru_, t.lru);
  if (!seg.payload.empty() && !seg.from_socket) return refuse_followed(id, key, seg, kRawReason, t.next, now);
  if (seg.urg) return refuse_followed(id, key, seg, kUrgentPinnedReason, t.next, now);
  if (seg.payload.empty()) return {{id, PinVerdict::Kind::pass}};
  // As for the first bytes: bytes the server drops would be sent again.
  if (const auto why = droppable(seg)) return refuse_followed(id, key, seg, *why, t.next, now);
  // The handshake is over: bytes after it are not read (encrypted), and
  // leave as they are; retransmitted ones go with the bytes read.
  if (t.done_ack) return after_judged(id, tf, seg, now);
  PinVerdict v{id, PinVerdict::Kind::pass};
  // Too large to go back as read: unread, as if lost (its socket sends it again, smaller).
  if (seg.oversize) return {{id, PinVerdict::Kind::drop}};
  const std::int64_t ahead = seq_after(seg.seq, t.next);
  // Bytes after a gap: the ones before them have not come through here yet.
  if (ahead > 0) return {{id, PinVerdict::Kind::drop}};
  if (auto bad = t.judged.patch(seg, v)) return refuse_followed(id, key, seg, *bad, t.next, now);
  const auto seen = static_cast<std::size_t>(-ahead);
  if (seen >= seg.payload.size()) return {std::move(v)};
  const auto fresh = seg.payload.subspan(seen);
  const bool answered = seg.ack_flag && seq_after(seg.ack, t.ack) > 0;
  const pin::TlsClientStream::Step step = t.records.feed(fresh, answered);
  const std::ptrdiff_t grew = t.judged.add(t.next, fresh);
  tls_kept_ = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(tls_kept_) + grew);
  const std::uint32_t server_seq = t.next;
  t.next += static_cast<std::uint32_t>(fresh.size());
  if (step.invalid) return refuse_followed(id, key, seg, *step.invalid, server_seq, now);
  for (const auto& hello : step.hellos) {
    const pin::Parse p = pin::parse_client_hello_message(hello);
    const pin::Decision d = pin::decide(pin::PinProto::tls, p, t.dst, t.dport, judge_.pin_facts());
    if (d.kind != pin::Decision::Kind::admit) {
      return refuse_followed(id, key, seg, "a second ClientHello on the connection: " + d.reason, server_seq, now);
    }
    admitted_also(key, d.name);
  }
  if (t.records.done()) t.done_ack = seg.ack;
  bound_tls(now);
  return {std::move(v)};
}

// ---- HTTP: the requests after the first ----------------------------------------------------

// An HTTP flow admitted on its first request head: read from its first byte
// as requests, so a second head already held (pipelined) is judged too, and
// followed from then on.
std::vector<PinVerdict> PinFlows::follow_http(std::map<Key, Flow>::iterator it, const std::string& name,
                                              Clock::time_point now) {
  Flow& f = it->second;
  HttpFollowed h;
  h.name = name;
  h.dst = f.dst;
  h.dport = f.dport;
  h.ct_id = f.ct_id;
  h.next = f.base + f.extent;
  h.framing.start = f.base;
  const std::vector<std::uint8_t> bytes = stream(f);
  const pin::HttpRequestStream::Step step = feed_http(h, f.base, bytes);
  std::optional<std::string> bad = step.invalid;
  if (!bad && f.extent > bytes.size()) bad = h.requests.skip(f.extent - bytes.size());
  if (bad) {
    http_kept_ -= h.framing.size;
    forget_admitted(it->first);
    return reset_flow(it, *bad, now);
  }
  const pin::PinFacts& facts = judge_.pin_facts();
  for (std::size_t i = 1; i < step.heads.size(); ++i) {
    if (step.heads[i] && *step.heads[i] == name) continue;
    const pin::Decision d =
        pin::decide(pin::PinProto::http, pin::Parse::complete_with(step.heads[i]), f.dst, f.dport, facts);
    if (d.kind != pin::Decision::Kind::admit) {
      http_kept_ -= h.framing.size;
      forget_admitted(it->first);
      return reset_flow(it, "a later request on the connection: " + d.reason, now);
    }
    admitted_also(it->first, d.name);
  }
  const Key key = it->first;
  std::vector<PinVerdict> out = finish(it, true, now);
  for (PinVerdict& v : out) v.kind = PinVerdict::Kind::follow;
  start_following(key, std::move(h));
  return out;
}

std::vector<PinVerdict> PinFlows::pass_incomplete_http(std::map<Key, Flow>::iterator it, Clock::time_point now) {
  const Key key = it->first;
  Flow& f = it->second;
  HttpFollowed h;
  h.dst = f.dst;
  h.dport = f.dport;
  h.ct_id = f.ct_id;
  h.first_pending = true;
  h.requests.first_request();
  h.framing.start = f.base;
  const std::vector<std::uint8_t> bytes = stream(f);
  // Bytes after a gap would pass unread: held on (until the hold time).
  if (f.extent > bytes.size()) {
    f.http_incomplete = false;
    return {};
  }
  h.next = f.base + static_cast<std::uint32_t>(bytes.size());
  const pin::HttpRequestStream::Step step = feed_http(h, f.base, bytes);
  std::optional<std::string> bad = step.invalid;
  // (The held path judges a whole head: none can be here.)
  if (!bad && !step.heads.empty()) bad = "http request head read whole by one parser and not by the other";
  if (bad) {
    http_kept_ -= h.framing.size;
    return reset_flow(it, *bad, now);
  }
  std::vector<PinVerdict> out;
  for (const PinPacketId held : f.ids) out.push_back({held, PinVerdict::Kind::follow});
  // Stragglers of the first write: sent back to the hook, as for an admitted flow.
  set_decided(key, {true, now, f.ct_id});
  // Known to a switch, its name unknown: kept only where the address alone decides.
  AdmittedFlow a;
  a.proto = kTcp;
  a.src.family = a.dst.family = key.family;
  a.src.prefix_len = a.dst.prefix_len = key.family == 4 ? 32 : 128;
  a.src.bytes = key.src;
  a.dst.bytes = key.dst;
  a.sport = key.sport;
  a.dport = key.dport;
  a.ct_id = f.ct_id;
  remember(key, std::move(a));
  flows_.erase(it);
  forget_tls(key);
  start_following(key, std::move(h));
  return out;
}

void PinFlows::start_following(const Key& key, HttpFollowed h) {
  forget_followed(key);
  http_lru_.push_front(key);
  h.lru = http_lru_.begin();
  const bool pending = h.first_pending;
  http_.emplace(key, std::move(h));
  if (pending) {
    ++pending_first_;
    count_held();
  }
  bound_http();
}

void PinFlows::bound_http() {
  while (!http_lru_.empty() && (http_.size() > kMaxHttpFollowed || http_kept_ > kMaxKeptBytes)) {
    forget_followed(http_lru_.back());
  }
}

pin::HttpRequestStream::Step PinFlows::feed_http(HttpFollowed& h, std::uint32_t seq,
                                                 std::span<const std::uint8_t> bytes) {
  pin::HttpRequestStream::Step step = h.requests.feed(pin::Bytes(bytes.data(), bytes.size()));
  if (step.invalid) return step;
  for (const auto& [from, to] : step.framing) {
    const std::ptrdiff_t grew = h.framing.add(seq + static_cast<std::uint32_t>(from), bytes.subspan(from, to - from));
    http_kept_ = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(http_kept_) + grew);
  }
  return step;
}

void PinFlows::forget_followed(const Key& key) {
  if (auto it = http_.find(key); it != http_.end()) {
    if (it->second.first_pending) {
      --pending_first_;
      count_held();
    }
    http_kept_ -= it->second.framing.size;
    http_lru_.erase(it->second.lru);
    http_.erase(it);
  }
}

// A packet of a followed HTTP connection (queue kPinFollowQueueNum).
std::vector<PinVerdict> PinFlows::http_packet(PinPacketId id, const Key& key, const Segment& seg,
                                              Clock::time_point now) {
  auto hf = http_.find(key);
  if (hf == http_.end() || hf->second.ct_id != seg.ct_id) {
    // Refused already: the same answer, without another record.
    if (auto d = decided_.find(key); d != decided_.end() && !d->second.admitted && d->second.ct_id == seg.ct_id) {
      return {{id, seg.payload.empty() ? PinVerdict::Kind::drop : PinVerdict::Kind::reset}};
    }
    if (seg.payload.empty() && (seg.fin || seg.rst)) return {{id, PinVerdict::Kind::pass}};
    // The kernel says followed, the reader does not know the connection (it
    // restarted, or forgot it for newer ones): its next request could not be
    // judged, so it is refused rather than let through unread.
    return refuse_followed(id, key, seg,
                           "connection followed before egressd restarted, or one of more than 4096 followed at once",
                           seg.seq, now);
  }
  HttpFollowed& h = hf->second;
  http_lru_.splice(http_lru_.begin(), http_lru_, h.lru);
  // The bytes read must be the bytes the server takes (as for the first ones).
  if (!seg.payload.empty() && !seg.from_socket) return refuse_followed(id, key, seg, kRawReason, h.next, now);
  if (seg.urg) {
    return refuse_followed(id, key, seg,
                           "tcp urgent data on a followed http connection (the server's stack takes it out of the stream)",
                           h.next, now);
  }
  if (seg.payload.empty()) return {{id, PinVerdict::Kind::pass}};
  // As for the first bytes: a request the server drops would be sent again
  // later, unread (below), with whatever bytes the pages then hold.
  if (const auto why = droppable(seg)) return refuse_followed(id, key, seg, *why, h.next, now);
  const auto ahead = static_cast<std::int32_t>(seg.seq - h.next);
  // Bytes after a gap: the ones before them have not come through here yet
  // (the stack sends this segment again once they have).
  if (ahead > 0) return {{id, PinVerdict::Kind::drop}};
  const auto seen = static_cast<std::size_t>(-static_cast<std::int64_t>(ahead));
  // Bytes already read (a retransmission): the socket sends them again from
  // its own copy, which may be pages its process rewrote since; the server
  // gets the framing the reader read (body bytes are body bytes whatever
  // they hold).
  PinVerdict v{id, PinVerdict::Kind::pass};
  if (seen > 0) {
    if (auto bad = h.framing.patch(seg, v)) return refuse_followed(id, key, seg, *bad, h.next, now);
  }
  // Body bytes are read only to be counted: a packet of nothing else leaves
  // as it is. One that must leave as read but cannot (too large) is dropped:
  // its socket sends it again, and the bytes read then are patched in.
  auto as_read = [&](bool framing) -> std::vector<PinVerdict> {
    v.as_read = framing || !v.patch.empty();
    if (v.as_read && seg.oversize) return {{id, PinVerdict::Kind::drop}};
    return {std::move(v)};
  };
  if (seen >= seg.payload.size()) return as_read(false);
  const std::uint32_t server_seq = h.next;
  const pin::HttpRequestStream::Step step = feed_http(h, h.next, seg.payload.subspan(seen));
  h.next = seg.seq + static_cast<std::uint32_t>(seg.payload.size());
  if (step.invalid && h.first_pending) {
    pin::Decision d;
    d.kind = pin::Decision::Kind::reset;
    d.reason = *step.invalid;
    return refuse_first(id, key, seg, d, server_seq, now);
  }
  if (step.invalid) return refuse_followed(id, key, seg, *step.invalid, server_seq, now);
  for (const auto& name : step.heads) {
    if (h.first_pending) {
      // The first request's head, whole at last: judged as a held one is.
      const pin::Decision d =
          pin::decide(pin::PinProto::http, pin::Parse::complete_with(name), h.dst, h.dport, judge_.pin_facts());
      if (d.kind != pin::Decision::Kind::admit) return refuse_first(id, key, seg, d, server_seq, now);
      judge_.pin_decided(d, h.dst, h.dport);
      h.first_pending = false;
      --pending_first_;
      count_held();
      ++stats_.admitted;
      h.name = d.name;
      remember(key, seg, d.name);
      continue;
    }
    if (name && *name == h.name) continue;
    const pin::Decision d =
        pin::decide(pin::PinProto::http, pin::Parse::complete_with(name), h.dst, h.dport, judge_.pin_facts());
    if (d.kind == pin::Decision::Kind::admit) {
      admitted_also(key, d.name);
      continue;
    }
    return refuse_followed(id, key, seg, "a later request on the connection: " + d.reason, server_seq, now);
  }
  bound_http();
  return as_read(!step.framing.empty());
}

// A followed connection refused as any decided flow is; the server's end is
// reset too (at the first byte it has not been given).
std::vector<PinVerdict> PinFlows::refuse_followed(PinPacketId id, const Key& key, const Segment& seg,
                                                  const std::string& why, std::uint32_t server_seq,
                                                  Clock::time_point now) {
  const auto hf = http_.find(key);
  const bool counted = hf != http_.end() && hf->second.first_pending;  // inspected, not yet decided
  forget_followed(key);
  forget_tls(key);
  if (server_resets_.size() < kMaxFlows) server_resets_.push_back({seg.src, seg.dst, seg.sport, seg.dport, server_seq});
  return refuse_decided(id, key, seg, why, now, counted);
}

std::vector<PinVerdict> PinFlows::refuse_first(PinPacketId id, const Key& key, const Segment& seg,
                                               const pin::Decision& d, std::uint32_t server_seq,
                                               Clock::time_point now) {
  forget_followed(key);
  forget_admitted(key);
  if (server_resets_.size() < kMaxFlows) server_resets_.push_back({seg.src, seg.dst, seg.sport, seg.dport, server_seq});
  ++stats_.reset;
  judge_.pin_decided(d, seg.dst, seg.dport);
  set_decided(key, {false, now, seg.ct_id});
  return {{id, PinVerdict::Kind::reset}};
}

// Whether the reader refused the flow `seg` belongs to (for TCP, the same
// conntrack entry; a UDP datagram of a passed flow carries no id).
bool PinFlows::refused_already(const Key& key, const Segment& seg) const {
  const auto d = decided_.find(key);
  return d != decided_.end() && !d->second.admitted && (seg.proto == kUdp || d->second.ct_id == seg.ct_id);
}

// A packet of a TCP flow that carries another phase's mark (queue
// kPinForeignQueueNum): the phase in force never judged it. Admitted again
// (the admit mark gives it this phase's mark) only if this reader admitted
// the connection by name (the switch kept it, or it would carry the cut
// mark) and is not following it; a followed connection whose mark a phase
// that passes by address overwrote missed bytes the reader never read.
std::vector<PinVerdict> PinFlows::foreign_packet(PinPacketId id, const Key& key, const Segment& seg,
                                                 Clock::time_point now) {
  if (refused_already(key, seg)) return {{id, PinVerdict::Kind::reset}};
  // (By name, or by its address as another protocol: this phase's chain sent
  // it here from its learned set, so the address is allowed.)
  if (auto a = admitted_.find(key); a != admitted_.end() && a->second.ct_id == seg.ct_id &&
                                    (!a->second.name.empty() || a->second.by_address) && !flows_.contains(key) &&
                                    !http_.contains(key) && !tls_.contains(key)) {
    return {{id, PinVerdict::Kind::admit}};
  }
  return refuse_decided(id, key, seg, kForeignReason, now);
}

// A datagram of an undecided UDP flow to port 443: QUIC Initials whose
// ClientHello is judged like a TLS flow's. Anything that is not a v1/v2
// Initial the parser can open is refused (ICMP), so clients fall back to TCP.
std::vector<PinVerdict> PinFlows::quic_packet(PinPacketId id, const Key& key, const Segment& seg,
                                              Clock::time_point now) {
  auto it = flows_.find(key);
  if (it == flows_.end()) {
    ++stats_.inspected;
    it = flows_.emplace(key, Flow{seg.dst, seg.dport, now, 0, {}, {}, nullptr, seg.ct_id}).first;
    count_held();
    if (flows_.size() > kMaxFlows || quic_flows_ >= kMaxQuicFlows) {
      it->second.ids.push_back(id);
      return reset_flow(it, "too many QUIC flows held at once", now);
    }
    if (quic_ids_.size() >= kMaxQuicIds) {
      it->second.ids.push_back(id);
      return reset_flow(it, kQuicIdsFullReason, now);
    }
    it->second.quic = std::make_unique<pin::QuicInitialAssembler>();
    ++quic_flows_;
  }
  Flow& f = it->second;
  f.ids.push_back(id);
  const pin::Parse parse = f.quic->feed(pin::Bytes(seg.payload.data(), seg.payload.size()));
  if (const pin::Bytes dcid = f.quic->dcid(); !dcid.empty() && quic_ids_.contains(quic_id_key(key, dcid))) {
    return reset_flow(it, kQuicIdReason, now);
  }
  pin::Decision d = pin::decide(pin::PinProto::quic, parse, seg.dst, seg.dport, judge_.pin_facts());
  if (d.kind == pin::Decision::Kind::need_more) return {};
  judge_.pin_decided(d, seg.dst, seg.dport);
  if (d.kind == pin::Decision::Kind::admit) {
    remember(key, seg, d.name);
    if (const pin::Bytes dcid = f.quic->dcid(); !dcid.empty()) remember_quic_id(key, dcid, now);
  }
  return finish(it, d.kind == pin::Decision::Kind::admit, now);
}

void PinFlows::remember_quic_id(const Key& key, pin::Bytes dcid, Clock::time_point now) {
  std::string k = quic_id_key(key, dcid);
  quic_ids_[k] = QuicId{now};
  quic_ids_order_.emplace_back(now, std::move(k));
  // No new QUIC flow starts once kMaxQuicIds are held; the flows held
  // before then may still add theirs (at most kMaxQuicFlows more). Only a
  // bound for memory's sake lets the oldest go.
  while (quic_ids_.size() > kMaxQuicIds + kMaxQuicFlows && !quic_ids_order_.empty()) {
    pop_oldest(quic_ids_order_, quic_ids_);
  }
}

std::string PinFlows::quic_id_key(const Key& key, pin::Bytes dcid) {
  std::string k;
  k.reserve(1 + key.dst.size() + 2 + dcid.size());
  k.push_back(static_cast<char>(key.family));
  k.append(reinterpret_cast<const char*>(key.dst.data()), key.dst.size());
  k.push_back(static_cast<char>(key.dport >> 8));
  k.push_back(static_cast<char>(key.dport & 0xFF));
  k.append(reinterpret_cast<const char*>(dcid.data()), dcid.size());
  return k;
}

std::vector<PinVerdict> PinFlows::quic_follow(PinPacketId id, std::map<Key, Followed>::iterator fo,
                                              const Segment& seg, Clock::time_point now) {
  const Key key = fo->first;
  const pin::Bytes before = fo->second.quic->dcid();
  const std::vector<std::uint8_t> id_before(before.begin(), before.end());
  const pin::QuicFollow r = fo->second.quic->follow(pin::Bytes(seg.payload.data(), seg.payload.size()));
  if (const pin::Bytes dcid = fo->second.quic->dcid();
      r.kind != pin::QuicFollow::Kind::invalid && r.kind != pin::QuicFollow::Kind::other &&
      !std::equal(dcid.begin(), dcid.end(), id_before.begin(), id_before.end())) {
    // The client moved to the connection ID a server's Retry chose: the
    // server knows the connection by it now, from any four-tuple. A Retry's
    // ID is new; one an admitted connection has is that connection's, whose
    // stream the server may still hold and read only from where it ends
    // (attack review L: a fresh connection's hello, crafted to carry a
    // second hello for another name at that offset, was taken for the
    // connection a Retry moved to).
    if (quic_ids_.contains(quic_id_key(key, dcid))) return refuse_decided(id, key, seg, kQuicIdReason, now);
    if (quic_ids_.size() >= kMaxQuicIds) return refuse_decided(id, key, seg, kQuicIdsFullReason, now);
    remember_quic_id(key, dcid, now);
  }
  switch (r.kind) {
    case pin::QuicFollow::Kind::same:
      return {{id, PinVerdict::Kind::admit}};
    case pin::QuicFollow::Kind::other:
      // Another connection on the four-tuple: never judged afresh. The
      // server may hold the first one's CRYPTO stream (a first hello that
      // asked for a second), and an Initial of that connection the current
      // assembler cannot open (after such a datagram switched assemblers)
      // would be judged from offset 0 while the server reads only what
      // extends its stream. A client starts a new connection from a new
      // socket; this one falls back to TCP.
      return refuse_decided(id, key, seg, kQuicOtherReason, now);
    case pin::QuicFollow::Kind::hello: {
      // A second ClientHello (after a HelloRetryRequest): the server takes
      // the name from it, so it must be allowed here as the first was.
      const pin::Decision d = pin::decide(pin::PinProto::quic, r.hello, seg.dst, seg.dport, judge_.pin_facts());
      if (d.kind == pin::Decision::Kind::admit) {
        admitted_also(key, d.name);
        return {{id, PinVerdict::Kind::admit}};
      }
      return refuse_decided(id, key, seg, "a second ClientHello on the connection: " + d.reason, now);
    }
    case pin::QuicFollow::Kind::invalid:
      break;
  }
  return refuse_decided(id, key, seg, "quic Initial after the flow was admitted: " + r.reason, now);
}

// A packet of a decided flow (a QUIC datagram, a TCP segment with urgent
// data, a followed HTTP connection's), refused: the flow is refused from now on.
std::vector<PinVerdict> PinFlows::refuse_decided(PinPacketId id, const Key& key, const Segment& seg,
                                                 const std::string& why, Clock::time_point now, bool counted) {
  followed_.erase(key);
  forget_admitted(key);
  if (!counted) ++stats_.inspected;
  ++stats_.reset;
  pin::Decision d;
  d.kind = pin::Decision::Kind::reset;
  d.reason = why;
  judge_.pin_decided(d, seg.dst, seg.dport);
  set_decided(key, {false, now, seg.ct_id});
  return {{id, PinVerdict::Kind::reset}};
}

// Datagrams sent in one GSO batch (UDP_SEGMENT) reach the reader as one
// packet with no boundaries: refused, whatever the flow's state (the client
// sees ICMP and falls back to TCP, or sends its datagrams one by one).
std::vector<PinVerdict> PinFlows::quic_gso(PinPacketId id, const Key& key, const Segment& seg,
                                           Clock::time_point now) {
  if (auto it = flows_.find(key); it != flows_.end()) {
    it->second.ids.push_back(id);
    return reset_flow(it, kGsoReason, now);
  }
  return refuse_decided(id, key, seg, kGsoReason, now);
}

// Chain pin sends a SYN here only when conntrack has seen replies on its
// entry: the client opens a new connection on the addresses and ports of an
// old one whose ends are gone without conntrack seeing the client close (a
// server's reset passes it in the reply direction only; egressd's reset of a
// cut or refused flow reaches the client only), and conntrack takes it up in
// the old entry, id included. What is remembered for the old connection, keyed
// by that id, would answer for the new one: it is forgotten, and the new
// connection's bytes are judged on their own.
std::vector<PinVerdict> PinFlows::new_connection_on_old_entry(PinPacketId id, const Key& key, const Segment& seg,
                                                             Clock::time_point now) {
  std::vector<PinVerdict> out;
  if (auto it = flows_.find(key); it != flows_.end())
    out = reset_flow(it, kReplacedReason, now, false);
  decided_.erase(key);
  starts_.erase(key);
  forget_followed(key);
  forget_tls(key);
  forget_admitted(key);
  // Bytes in a SYN (no Fast Open option: a raw socket wrote them) never pass unread.
  // Else the entry's mark (the old connection's) goes back to 0 before the SYN
  // goes on, so the new connection is judged as new.
  if (!seg.payload.empty()) {
    out.push_back({id, PinVerdict::Kind::drop});
    return out;
  }
  if (auto p = syns_passed_.find(key);
      p != syns_passed_.end() && p->second.first == seg.seq && now - p->second.second < std::chrono::milliseconds(200)) {
    out.push_back({id, PinVerdict::Kind::drop});
    return out;
  }
  if (syns_passed_.size() >= kMaxFlows) syns_passed_.clear();
  syns_passed_[key] = {seg.seq, now};
  if (mark_clears_.size() < kMaxFlows) mark_clears_.push_back({seg.src, seg.dst, seg.sport, seg.dport, 0});
  out.push_back({id, PinVerdict::Kind::pass});
  return out;
}

void PinFlows::forget_admitted(const Key& key) {
  if (auto old = admitted_.find(key); old != admitted_.end()) {
    admitted_order_.erase(old->second.order);
    admitted_.erase(old);
  }
}

void PinFlows::remember(const Key& key, const Segment& seg, const std::string& name) {
  remember(key, AdmittedFlow{seg.proto, seg.src, seg.dst, seg.sport, seg.dport, name, 0, seg.ct_id});
}

void PinFlows::admitted_also(const Key& key, const std::string& name) {
  auto it = admitted_.find(key);
  if (it == admitted_.end()) return;
  AdmittedFlow& f = it->second;
  if (name == f.name || std::find(f.also.begin(), f.also.end(), name) != f.also.end()) return;
  if (f.also.size() >= kMaxNamesPerFlow) {
    f.names_full = true;
    return;
  }
  f.also.push_back(name);
}

bool keeps_every_name(const AdmittedFlow& f, const std::function<bool(const std::string&)>& keeps) {
  if (f.names_full || !keeps(f.name)) return false;
  return std::all_of(f.also.begin(), f.also.end(), keeps);
}

void PinFlows::remember(const Key& key, AdmittedFlow f) {
  forget_admitted(key);
  f.order = next_order_++;
  admitted_order_.emplace(f.order, key);
  admitted_.emplace(key, std::move(f));
  if (admitted_.size() > kMaxAdmitted) {
    admitted_.erase(admitted_order_.begin()->second);
    admitted_order_.erase(admitted_order_.begin());
  }
}

std::vector<AdmittedFlow> PinFlows::cut(const std::function<bool(const AdmittedFlow&)>& keep, Clock::time_point now) {
  std::vector<AdmittedFlow> out;
  for (auto it = admitted_.begin(); it != admitted_.end();) {
    if (it->second.by_address || keep(it->second)) {  // by address: the new phase's rules decide
      ++it;
      continue;
    }
    set_decided(it->first, {false, now, it->second.ct_id});
    followed_.erase(it->first);
    forget_followed(it->first);
    forget_tls(it->first);
    admitted_order_.erase(it->second.order);
    out.push_back(std::move(it->second));
    it = admitted_.erase(it);
  }
  return out;
}

void PinFlows::adopt(const AdmittedFlow& f) {
  const Key key{static_cast<std::uint8_t>(f.dst.family), f.proto, f.src.bytes, f.dst.bytes, f.sport, f.dport};
  if (admitted_.contains(key)) return;
  AdmittedFlow unknown = f;
  unknown.name.clear();
  remember(key, std::move(unknown));
}

std::vector<PinVerdict> PinFlows::expire(Clock::time_point now) {
  std::vector<PinVerdict> out;
  for (auto it = flows_.begin(); it != flows_.end();) {
    auto next = std::next(it);
    const Flow& f = it->second;
    if (now - f.started >= kHoldTime) {
      auto v = reset_flow(it, "no decision within 2 seconds", now);
      out.insert(out.end(), v.begin(), v.end());
    } else if (f.http_incomplete && !f.ids.empty() && now - f.held_since >= kPassIncompleteAfter) {
      auto v = pass_incomplete_http(it, now);
      out.insert(out.end(), v.begin(), v.end());
    }
    it = next;
  }
  auto pop_old = [now](auto& order, auto& map, auto age) {
    while (!order.empty() && now - order.front().first >= age) pop_oldest(order, map);
  };
  pop_old(decided_order_, decided_, kDecidedMemory);
  pop_old(starts_order_, starts_, kStartMemory);
  pop_old(evicted_order_, evicted_, kStartMemory);
  pop_old(followed_order_, followed_, kQuicFollowTime);
  pop_old(quic_ids_order_, quic_ids_, kQuicIdMemory);
  return out;
}

void PinFlows::set_decided(const Key& key, Decided d) {
  const Clock::time_point at = d.at;
  decided_[key] = std::move(d);
  decided_order_.emplace_back(at, key);
}

void PinFlows::set_start(const Key& key, Start st) {
  const Clock::time_point at = st.at;
  starts_[key] = st;
  starts_order_.emplace_back(at, key);
}

std::size_t PinFlows::held_bytes() const {
  std::size_t n = 0;
  for (const auto& [k, f] : flows_) {
    for (const auto& [o, b] : f.segs) n += b.size();
  }
  return n;
}

std::optional<PinFlows::Clock::time_point> PinFlows::next_deadline() const {
  std::optional<Clock::time_point> t;
  for (const auto& [k, f] : flows_) {
    Clock::time_point at = f.started + kHoldTime;
    if (f.http_incomplete && !f.ids.empty()) at = std::min(at, f.held_since + kPassIncompleteAfter);
    if (!t || at < *t) t = at;
  }
  return t;
}

// ---- PinQueue -------------------------------------------------------------------------------

namespace {

constexpr std::uint16_t msg_type(std::uint8_t t) { return static_cast<std::uint16_t>(NFNL_SUBSYS_QUEUE << 8 | t); }

nlmsghdr* put_queue_header(char* buf, std::uint8_t type, std::uint16_t flags, std::uint16_t queue) {
  nlmsghdr* nlh = mnl_nlmsg_put_header(buf);
  nlh->nlmsg_type = msg_type(type);
  nlh->nlmsg_flags = flags;
  auto* nfg = static_cast<nfgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(nfgenmsg)));
  nfg->nfgen_family = AF_UNSPEC;
  nfg->version = NFNETLINK_V0;
  nfg->res_id = htons(queue);
  return nlh;
}

// A configuration request for `queue`: `command` (NFQNL_CFG_CMD_*) and the
// copy parameters; the caller may add attributes.
nlmsghdr* put_queue_config(char* buf, std::uint16_t queue, std::uint8_t command, std::uint8_t copy_mode,
                           std::uint32_t copy_range) {
  nlmsghdr* nlh = put_queue_header(buf, NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, queue);
  nfqnl_msg_config_cmd cmd{};
  cmd.command = command;
  mnl_attr_put(nlh, NFQA_CFG_CMD, sizeof cmd, &cmd);
  nfqnl_msg_config_params params{};
  params.copy_range = htonl(copy_range);
  params.copy_mode = copy_mode;
  mnl_attr_put(nlh, NFQA_CFG_PARAMS, sizeof params, &params);
  return nlh;
}

// Binds `queue`; `gso`: packets as the stack made them (NFQA_CFG_F_GSO),
// else the kernel splits GSO packets and completes checksums first.
Status bind_queue(nft::Transport& t, std::uint16_t queue, bool gso) {
  std::vector<char> buf(MNL_SOCKET_BUFFER_SIZE);
  nlmsghdr* nlh = put_queue_config(buf.data(), queue, NFQNL_CFG_CMD_BIND, NFQNL_COPY_PACKET, kCopyRange);
  mnl_attr_put_u32(nlh, NFQA_CFG_QUEUE_MAXLEN, htonl(kQueueMaxLen));
  mnl_attr_put_u32(nlh, NFQA_CFG_FLAGS, htonl(gso ? NFQA_CFG_F_GSO : 0));
  mnl_attr_put_u32(nlh, NFQA_CFG_MASK, htonl(NFQA_CFG_F_GSO));
  const int err = t.request(nlh, [](const nlmsghdr*) {}, std::chrono::seconds(1));
  const std::string q = "pinning queue " + std::to_string(queue);
  if (err == ETIMEDOUT) return errno_error(q + ": no answer to the bind request", EAGAIN);
  if (err == EBUSY) return Error::runtime(q + " is already bound by another listener in this network namespace");
  if (err != 0) return errno_error(q + ": cannot bind", err);
  return {};
}

Status configure(nft::Transport& t) {
  // TCP: packets as the stack made them. A TCP socket's segment still has
  // its checksum left to the device and says so (NFQA_SKB_CSUMNOTREADY),
  // where a queue without the flag completes every checksum before copying
  // and a raw socket's segment would look the same (Segment::from_socket).
  // GSO packets then come whole (at most 64 KiB: the copy range).
  if (auto s = bind_queue(t, nft::kPinQueueNum, true); !s) return s;
  // QUIC: a GSO batch (UDP_SEGMENT) is split by the kernel into its
  // datagrams, each queued and judged on its own; whole, its boundaries
  // could not be read (a short-header packet runs to its datagram's end).
  if (auto s = bind_queue(t, nft::kPinUdpQueueNum, false); !s) return s;
  // Followed HTTP connections: TCP, as queue 16.
  if (auto s = bind_queue(t, nft::kPinFollowQueueNum, true); !s) return s;
  // TCP flows another phase marked: judged whole, GSO packets too.
  return bind_queue(t, nft::kPinForeignQueueNum, true);
}

class Queue : public PinQueue {
 public:
  Queue(asio::io_context& io, std::unique_ptr<nft::Transport> t, PinJudge& judge)
      : t_(std::move(t)), judge_(judge), flows_(judge), timer_(io) {}
  ~Queue() override { close(); }

  void start() {
    nft::Transport::Handlers h;
    h.message = [this](const nlmsghdr* nlh) { handle(nlh); };
    // Packets lost to an overrun get no verdict: the kernel drops them when
    // their flow's next packet is retransmitted and queued again.
    h.overrun = [this] { ++errors_; };
    h.turn_done = [this] { flush(); };
    t_->start(std::move(h));
  }
  PinStats stats() const override {
    PinStats s = flows_.stats();
    s.errors += errors_;
    return s;
  }
  void adopt(const std::vector<AdmittedFlow>& flows) override {
    for (const AdmittedFlow& f : flows) flows_.adopt(f);
  }

  std::size_t cut(const std::function<bool(const AdmittedFlow&)>& keep) override {
    if (closed_) return 0;
    const std::vector<AdmittedFlow> gone = flows_.cut(keep, PinFlows::Clock::now());
    std::vector<std::uint8_t> batch;
    for (const AdmittedFlow& f : gone) {
      append_set_ct_mark(batch, f.proto, f.src, f.dst, f.sport, f.dport, nft::kPinCutMark, t_->next_seq());
      if (batch.size() >= 32 * 1024) {
        if (t_->send(batch.data(), batch.size()) != 0) ++errors_;
        batch.clear();
      }
    }
    if (!batch.empty() && t_->send(batch.data(), batch.size()) != 0) ++errors_;
    return gone.size();
  }
  void close() override {
    if (closed_) return;
    closed_ = true;
    t_->stop();  // unbinds the queues now
    timer_.cancel();
    raw4_.reset();  // sockets in the sandbox's namespace: none outlives the removal
    raw6_.reset();
  }

 private:
  void handle(const nlmsghdr* nlh) {
    if (nlh->nlmsg_type == NLMSG_ERROR) {
      const auto* e = static_cast<const nlmsgerr*>(mnl_nlmsg_get_payload(nlh));
      // A verdict the kernel refused; a cut flow (ct mark update) that
      // conntrack no longer has is none.
      if (e->error != 0 && e->error != -ENOENT) ++errors_;
      return;
    }
    if (nlh->nlmsg_type != msg_type(NFQNL_MSG_PACKET)) return;
    std::array<const nlattr*, NFQA_MAX + 1> tb;
    if (nft::attr_table(nlh, sizeof(nfgenmsg), tb) < 0 || tb[NFQA_PACKET_HDR] == nullptr ||
        mnl_attr_get_payload_len(tb[NFQA_PACKET_HDR]) < sizeof(nfqnl_msg_packet_hdr)) {
      ++errors_;
      return;
    }
    const auto* ph = static_cast<const nfqnl_msg_packet_hdr*>(mnl_attr_get_payload(tb[NFQA_PACKET_HDR]));
    const auto* nfg = static_cast<const nfgenmsg*>(mnl_nlmsg_get_payload(nlh));
    const std::uint16_t queue = ntohs(nfg->res_id);
    const PinPacketId id = pin_packet_id(queue, ntohl(ph->packet_id));
    std::optional<Segment> seg;
    std::span<const std::uint8_t> pkt;
    // A packet cut short by the copy range cannot be judged: reset (fail closed).
    if (tb[NFQA_PAYLOAD] != nullptr && tb[NFQA_CAP_LEN] == nullptr) {
      pkt = {static_cast<const std::uint8_t*>(mnl_attr_get_payload(tb[NFQA_PAYLOAD])),
             mnl_attr_get_payload_len(tb[NFQA_PAYLOAD])};
      seg = parse_packet(pkt);
    }
    if (!seg) {
      ++errors_;
      pending_.push_back({id, PinVerdict::Kind::drop});
      return;
    }
    // What goes back with the verdict: the bytes judged, not the queued
    // packet's (judged_packet). Too large for a netlink attribute: dropped.
    if (!seg->payload.empty() && (seg->ip_end > kMaxReinject || queue == nft::kPinForeignQueueNum)) {
      // A foreign flow's packet is admitted or refused whole, never read:
      // nothing of it is held, and it goes back as it is.
      if (queue != nft::kPinFollowQueueNum && queue != nft::kPinForeignQueueNum) {
        ++errors_;
        pending_.push_back({id, PinVerdict::Kind::drop});
        return;
      }
      seg->oversize = true;  // not held: PinFlows lets it go only if its bytes decide nothing
    } else if (!seg->payload.empty()) {
      // Full: this packet is dropped unread, as if lost on the way; its
      // socket sends it again. (Never an older one's copy: a held segment
      // dropped after the reader read it would be judged and then sent again
      // by the socket, from its pages, on the admitted flow's fast path.)
      if (held_bytes_ + seg->ip_end > kMaxHeldBytes) {
        ++errors_;
        pending_.push_back({id, PinVerdict::Kind::drop});
        return;
      }
      held_bytes_ += seg->ip_end;
      held_.emplace(id, judged_packet(pkt, *seg));
    }
    if (tb[NFQA_SKB_INFO] != nullptr && mnl_attr_get_payload_len(tb[NFQA_SKB_INFO]) == 4) {
      const std::uint32_t info = ntohl(mnl_attr_get_u32(tb[NFQA_SKB_INFO]));
      seg->from_socket = (info & NFQA_SKB_CSUMNOTREADY) != 0;
      seg->gso = (info & NFQA_SKB_GSO) != 0;
    }
    // A packet the reader sent back with its verdict carries a complete
    // checksum, so it no longer looks like the socket's: when it comes back
    // (a held segment of an HTTP flow whose first segment made it followed),
    // it is known by its bytes, compared whole.
    if (!seg->from_socket && !seg->payload.empty() && own_reinjection(pkt, *seg)) seg->from_socket = true;
    seg->followed = queue == nft::kPinFollowQueueNum;
    seg->foreign = queue == nft::kPinForeignQueueNum;
    // Chain pin set the packet's mark to its conntrack id.
    if (tb[NFQA_MARK] != nullptr && mnl_attr_get_payload_len(tb[NFQA_MARK]) == 4) {
      seg->ct_id = ntohl(mnl_attr_get_u32(tb[NFQA_MARK]));
    }
    // ... or, for a SYN that met an entry the server's side started,
    // kPinStraySynMark (a SYN whose conntrack id is that value by chance has
    // its entry deleted and is sent again by its socket: a second late).
    seg->stray_syn = queue == nft::kPinQueueNum && seg->syn && seg->ct_id == nft::kPinStraySynMark;
    // ... or, for a UDP flow the kernel passed before, kPinUdpPassedMark.
    seg->passed = queue == nft::kPinUdpQueueNum && seg->ct_id == nft::kPinUdpPassedMark;
    auto v = flows_.packet(id, *seg, PinFlows::Clock::now());
    pending_.insert(pending_.end(), v.begin(), v.end());
  }

  // Sends the verdicts gathered this turn (several per datagram) and re-arms
  // the hold timer.
  void flush() {
    if (closed_) return;
    auto expired = flows_.expire(PinFlows::Clock::now());
    pending_.insert(pending_.end(), expired.begin(), expired.end());
    std::vector<char>& buf = verdict_buf_;
    std::size_t used = 0;
    auto send = [&] {
      if (used != 0 && t_->send(buf.data(), used) != 0) ++errors_;
      used = 0;
    };
    const std::uint32_t pin_mark = judge_.pin_mark();
    const std::uint32_t pin_priority = judge_.pin_priority();
    // Refused flows' server ends are reset and their entries deleted before
    // any verdict: the client's reset comes from its verdict, and a client
    // that reconnects from the same port at once must not find the old entry.
    // Its SYN would take the entry up (conntrack ignores a SYN on an
    // established entry and lets it through), the deletion would then leave
    // the new connection without one, and its handshake's ACK would start a
    // new entry mid-stream, which chain pin resets, leaving the server a
    // half-open connection that refuses the next SYN from the port (CI runs
    // 9 to 11, the ASan lab: an allowed name on a reused port reset or
    // refused).
    reset_servers(pin_mark, pin_priority);
    // Marks to clear go first: the kernel handles the messages of a socket in
    // order, so the entry has mark 0 when its SYN goes on. (A verdict's own
    // NFQA_CT would do it in one message, but needs the kernel's
    // CONFIG_NETFILTER_NETLINK_GLUE_CT, and without it is ignored.)
    if (const auto clears = flows_.take_mark_clears(); !clears.empty()) {
      std::vector<std::uint8_t> batch;
      for (const ServerReset& c : clears) {
        append_set_ct_mark(batch, Segment::kTcp, c.src, c.dst, c.sport, c.dport, 0, t_->next_seq());
      }
      if (t_->send(batch.data(), batch.size()) != 0) ++errors_;
    }
    if (const auto deletes = flows_.take_entry_deletes(); !deletes.empty()) {
      std::vector<std::uint8_t> batch;
      // By the SYN's own tuple: conntrack finds an entry by either direction's.
      for (const ServerReset& d : deletes) {
        append_delete_ct(batch, Segment::kTcp, d.src, d.dst, d.sport, d.dport, t_->next_seq());
      }
      if (t_->send(batch.data(), batch.size()) != 0) ++errors_;
    }
    for (const PinVerdict& v : pending_) {
      // The bytes judged go back with every verdict that lets the packet
      // leave; a packet dropped or reset needs none.
      std::vector<std::uint8_t> judged;
      bool drop = v.kind == PinVerdict::Kind::drop;
      if (auto h = held_.find(v.packet_id); h != held_.end()) {
        held_bytes_ -= h->second.size();
        if (v.kind != PinVerdict::Kind::drop && v.kind != PinVerdict::Kind::reset) judged = std::move(h->second);
        held_.erase(h);
      }
      // A retransmission of judged bytes goes with them. If that cannot be
      // done (it cannot happen: the patch was made from this packet), the
      // packet is dropped, never sent with the pages' bytes.
      if (!drop && !v.patch.empty() && (judged.empty() || !apply_patch(judged, v))) {
        ++errors_;
        judged.clear();
        drop = true;
      }
      if (!v.as_read) judged.clear();  // bytes read only to be counted: the packet as it is
      if (buf.size() - used < 512 + judged.size()) send();
      nlmsghdr* nlh = put_queue_header(buf.data() + used, NFQNL_MSG_VERDICT, NLM_F_REQUEST,
                                       static_cast<std::uint16_t>(v.packet_id >> 32));
      nlh->nlmsg_seq = t_->next_seq();
      nfqnl_msg_verdict_hdr vh{};
      vh.id = htonl(static_cast<std::uint32_t>(v.packet_id));
      vh.verdict = htonl(drop ? NF_DROP : NF_REPEAT);
      mnl_attr_put(nlh, NFQA_VERDICT_HDR, sizeof vh, &vh);
      if (!judged.empty()) {
        mnl_attr_put(nlh, NFQA_PAYLOAD, judged.size(), judged.data());
        remember_reinjection(std::move(judged));
      }
      switch (drop ? PinVerdict::Kind::drop : v.kind) {
        case PinVerdict::Kind::admit: mnl_attr_put_u32(nlh, NFQA_MARK, htonl(nft::pin_admit_mark(pin_mark))); break;
        case PinVerdict::Kind::reset: mnl_attr_put_u32(nlh, NFQA_MARK, htonl(nft::kPinResetMark)); break;
        case PinVerdict::Kind::pass: mnl_attr_put_u32(nlh, NFQA_MARK, htonl(pin_mark)); break;
        case PinVerdict::Kind::recheck: mnl_attr_put_u32(nlh, NFQA_MARK, 0); break;
        case PinVerdict::Kind::follow: mnl_attr_put_u32(nlh, NFQA_MARK, htonl(nft::pin_follow_mark(pin_mark))); break;
        case PinVerdict::Kind::drop: break;
      }
      // The second half of the verdict's signature: the rules that take the
      // pass, admit and follow marks ask for it too.
      const bool signed_verdict = !drop && (v.kind == PinVerdict::Kind::admit || v.kind == PinVerdict::Kind::pass ||
                                  v.kind == PinVerdict::Kind::follow);
      if (signed_verdict && pin_priority != 0) mnl_attr_put_u32(nlh, NFQA_PRIORITY, htonl(pin_priority));

      used += NLMSG_ALIGN(nlh->nlmsg_len);
    }
    send();
    pending_.clear();
    arm();
  }

  // The server's end of each refused TCP flow (ahead of the client's reset,
  // see flush). The RST carries the pin mark, so it leaves as the reader's
  // own "pass" verdicts do; the sockets are send-only (IPPROTO_RAW receives
  // nothing).
  void reset_servers(std::uint32_t pin_mark, std::uint32_t pin_priority) {
    const std::vector<ServerReset> resets = flows_.take_server_resets();
    if (resets.empty()) return;
    for (const UniqueFd* fd : {&raw4_, &raw6_}) {
      if (fd->get() >= 0 && ::setsockopt(fd->get(), SOL_SOCKET, SO_MARK, &pin_mark, sizeof pin_mark) != 0) {
        ++errors_;
      }
      if (fd->get() >= 0 && pin_priority != 0 &&
          ::setsockopt(fd->get(), SOL_SOCKET, SO_PRIORITY, &pin_priority, sizeof pin_priority) != 0) {
        ++errors_;
      }
    }
    // After its reset, each flow's conntrack entry goes. Conntrack took the
    // held bytes (its hook runs before the queue), so it expects the stream
    // past them and ignores the reset at its start: the entry would stay
    // established with that window, and a new connection from the same port
    // could be left with data conntrack calls invalid, which has no entry and
    // may not pass (chain pin_untracked). Without the entry, its SYN starts a
    // new one.
    std::vector<std::uint8_t> deletes;
    for (const ServerReset& r : resets) {
      append_delete_ct(deletes, Segment::kTcp, r.src, r.dst, r.sport, r.dport, t_->next_seq());
      const std::vector<std::uint8_t> pkt = server_reset_packet(r);
      sockaddr_storage ss{};
      socklen_t len = 0;
      int fd = -1;
      if (r.dst.family == 4) {
        auto* sa = reinterpret_cast<sockaddr_in*>(&ss);
        sa->sin_family = AF_INET;
        std::memcpy(&sa->sin_addr, r.dst.bytes.data(), 4);
        len = sizeof(sockaddr_in);
        fd = raw4_.get();
      } else {
        auto* sa = reinterpret_cast<sockaddr_in6*>(&ss);
        sa->sin6_family = AF_INET6;
        std::memcpy(&sa->sin6_addr, r.dst.bytes.data(), 16);
        len = sizeof(sockaddr_in6);
        fd = raw6_.get();
      }
      if (fd < 0 || ::sendto(fd, pkt.data(), pkt.size(), MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&ss), len) < 0) {
        ++errors_;
      }
    }
    if (!deletes.empty() && t_->send(deletes.data(), deletes.size()) != 0) ++errors_;
  }

  void arm() {
    const auto next = flows_.next_deadline();
    if (!next || (armed_ && *next >= armed_at_)) return;
    armed_ = true;
    armed_at_ = *next;
    timer_.expires_at(*next);
    timer_.async_wait([this](const boost::system::error_code& ec) {
      armed_ = false;
      if (ec || closed_) return;
      flush();
    });
  }

  std::unique_ptr<nft::Transport> t_;
  PinJudge& judge_;
  PinFlows flows_;
  asio::steady_timer timer_;
  bool armed_ = false;
  PinFlows::Clock::time_point armed_at_{};
  bool closed_ = false;
  std::vector<PinVerdict> pending_;
  // Where flush() writes its verdicts: room for a verdict and the largest
  // packet that goes back with one (~74 KiB, made once, not zeroed again at
  // every turn).
  std::vector<char> verdict_buf_ = std::vector<char>(MNL_SOCKET_BUFFER_SIZE + kMaxReinject + 512);
  // The last packets sent back with a verdict (judged_packet), oldest first,
  // at most kMaxReinjected bytes: known again when one comes back.
  std::deque<std::vector<std::uint8_t>> reinjected_;
  std::size_t reinjected_bytes_ = 0;
  void remember_reinjection(std::vector<std::uint8_t> p) {
    reinjected_bytes_ += p.size();
    reinjected_.push_back(std::move(p));
    while (reinjected_bytes_ > kMaxReinjected) {
      reinjected_bytes_ -= reinjected_.front().size();
      reinjected_.pop_front();
    }
  }
  // `seg` (parsed from `pkt`) is a packet sent back with a verdict: the same
  // addresses, and the same TCP or UDP header and payload, byte for byte
  // (then forgotten: it comes back once). The whole header: a raw SYN that
  // copied a re-injected segment's sequence number and bytes was taken for
  // the socket's, and forgot a followed connection (an attack review).
  bool own_reinjection(std::span<const std::uint8_t> pkt, const Segment& seg) {
    const auto l4 = pkt.subspan(seg.l4, seg.ip_end - seg.l4);
    for (auto it = reinjected_.begin(); it != reinjected_.end(); ++it) {
      const auto o = parse_packet(*it);
      if (!o || o->proto != seg.proto || o->src != seg.src || o->dst != seg.dst ||
          o->ip_end - o->l4 != l4.size() ||
          !std::equal(it->begin() + static_cast<std::ptrdiff_t>(o->l4),
                      it->begin() + static_cast<std::ptrdiff_t>(o->ip_end), l4.begin())) {
        continue;
      }
      reinjected_bytes_ -= it->size();
      reinjected_.erase(it);
      return true;
    }
    return false;
  }
  // The judged copies of queued packets with payload, until their verdicts.
  std::map<PinPacketId, std::vector<std::uint8_t>> held_;
  std::size_t held_bytes_ = 0;
  std::uint64_t errors_ = 0;
  // Opened with the queue, in the sandbox's namespace (reset_servers).
  UniqueFd raw4_{::socket(AF_INET, SOCK_RAW | SOCK_CLOEXEC, IPPROTO_RAW)};
  UniqueFd raw6_{::socket(AF_INET6, SOCK_RAW | SOCK_CLOEXEC, IPPROTO_RAW)};
};

}  // namespace

int queue_command(nft::Transport& t, std::uint16_t queue, std::uint8_t command) {
  std::vector<char> buf(MNL_SOCKET_BUFFER_SIZE);
  nlmsghdr* nlh = put_queue_config(buf.data(), queue, command, NFQNL_COPY_NONE, 0);
  return t.request(nlh, [](const nlmsghdr*) {}, std::chrono::seconds(1));
}

Result<std::unique_ptr<PinQueue>> PinQueue::open(asio::io_context& io, PinJudge& judge) {
  nft::TransportOptions o;
  o.protocol = NETLINK_NETFILTER;
  // Bursts of first packets between event-loop turns.
  o.rcvbuf = 4 << 20;
  o.what = "pinning queue";
  auto t = nft::Transport::open(io, std::move(o));
  if (!t) return t.error();
  if (auto s = configure(**t); !s) return s.error();
  auto q = std::make_unique<Queue>(io, std::move(*t), judge);
  q->start();
  return std::unique_ptr<PinQueue>(std::move(q));
}

namespace {

// CTA_TUPLE_ORIG's addresses and ports into `f`; false when incomplete.
bool read_orig_tuple(const nlattr* tuple, AdmittedFlow& f) {
  std::array<const nlattr*, CTA_TUPLE_MAX + 1> t;
  if (nft::attr_table(tuple, t) < 0 || t[CTA_TUPLE_IP] == nullptr || t[CTA_TUPLE_PROTO] == nullptr) return false;
  std::array<const nlattr*, CTA_IP_MAX + 1> ip;
  std::array<const nlattr*, CTA_PROTO_MAX + 1> proto;
  if (nft::attr_table(t[CTA_TUPLE_IP], ip) < 0 || nft::attr_table(t[CTA_TUPLE_PROTO], proto) < 0) return false;
  auto take = [](const nlattr* a, IpPrefix& out, int family, std::size_t len) {
    if (a == nullptr || mnl_attr_get_payload_len(a) != len) return false;
    out.family = static_cast<std::uint8_t>(family);
    out.prefix_len = static_cast<std::uint8_t>(len * 8);
    std::memcpy(out.bytes.data(), mnl_attr_get_payload(a), len);
    return true;
  };
  const bool v4 = take(ip[CTA_IP_V4_SRC], f.src, 4, 4) && take(ip[CTA_IP_V4_DST], f.dst, 4, 4);
  const bool v6 = !v4 && take(ip[CTA_IP_V6_SRC], f.src, 6, 16) && take(ip[CTA_IP_V6_DST], f.dst, 6, 16);
  if ((!v4 && !v6) || proto[CTA_PROTO_NUM] == nullptr || proto[CTA_PROTO_SRC_PORT] == nullptr ||
      proto[CTA_PROTO_DST_PORT] == nullptr) {
    return false;
  }
  f.proto = mnl_attr_get_u8(proto[CTA_PROTO_NUM]);
  f.sport = ntohs(mnl_attr_get_u16(proto[CTA_PROTO_SRC_PORT]));
  f.dport = ntohs(mnl_attr_get_u16(proto[CTA_PROTO_DST_PORT]));
  return true;
}

}  // namespace

Result<std::vector<AdmittedFlow>> conntrack_flows_marked(boost::asio::io_context& io, std::uint32_t mark) {
  nft::TransportOptions o;
  o.protocol = NETLINK_NETFILTER;
  o.what = "conntrack dump";
  auto t = nft::Transport::open(io, std::move(o));
  if (!t) return t.error();
  std::vector<AdmittedFlow> out;
  for (int attempt = 0; attempt < 3; ++attempt) {
    out.clear();
    std::vector<char> buf(MNL_SOCKET_BUFFER_SIZE);
    nlmsghdr* nlh = mnl_nlmsg_put_header(buf.data());
    nlh->nlmsg_type = static_cast<std::uint16_t>((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET);
    nlh->nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
    auto* nfg = static_cast<nfgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(nfgenmsg)));
    nfg->nfgen_family = AF_UNSPEC;  // both families
    nfg->version = NFNETLINK_V0;
    nfg->res_id = 0;
    // The kernel filters the dump by mark.
    mnl_attr_put_u32(nlh, CTA_MARK, htonl(mark));
    mnl_attr_put_u32(nlh, CTA_MARK_MASK, htonl(0xffffffff));
    const int err = (*t)->request(nlh, [&](const nlmsghdr* h) {
      if (h->nlmsg_type != ((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW)) return;
      std::array<const nlattr*, CTA_MAX + 1> tb;
      if (nft::attr_table(h, sizeof(nfgenmsg), tb) < 0 || tb[CTA_TUPLE_ORIG] == nullptr || tb[CTA_MARK] == nullptr ||
          ntohl(mnl_attr_get_u32(tb[CTA_MARK])) != mark) {
        return;
      }
      AdmittedFlow f;
      if (!read_orig_tuple(tb[CTA_TUPLE_ORIG], f)) return;
      if (f.proto != Segment::kTcp && !(f.proto == Segment::kUdp && f.dport == 443)) return;
      if (tb[CTA_ID] != nullptr) f.ct_id = ntohl(mnl_attr_get_u32(tb[CTA_ID]));
      out.push_back(f);
    }, std::chrono::seconds(2));
    if (err == EINTR) continue;  // interrupted: dump again
    if (err != 0) return errno_error("conntrack dump", err);
    return out;
  }
  return Error::runtime("conntrack dump: interrupted three times");
}

}  // namespace egressd::daemon
