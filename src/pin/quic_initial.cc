#include "pin/quic_initial.h"

#include <nettle/aes.h>
#include <nettle/gcm.h>
#include <nettle/hkdf.h>
#include <nettle/hmac.h>
#include <nettle/memops.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "pin/tls_hello.h"

namespace egressd::pin {
namespace {

constexpr std::array<std::uint8_t, 20> kSaltV1 = {0x38, 0x76, 0x2c, 0xf7, 0xf5, 0x59, 0x34, 0xb3, 0x4d, 0x17,
                                                  0x9a, 0xe6, 0xa4, 0xc8, 0x0c, 0xad, 0xcc, 0xbb, 0x7f, 0x0a};
constexpr std::array<std::uint8_t, 20> kSaltV2 = {0x0d, 0xed, 0xe3, 0xde, 0xf7, 0x00, 0xa6, 0xdb, 0x81, 0x93,
                                                  0x81, 0xbe, 0x6e, 0x26, 0x9d, 0xcb, 0xf9, 0xbd, 0x2e, 0xd9};
constexpr std::size_t kTag = 16;
constexpr std::size_t kSample = 16;
// RFC 9000 §14.1: a server discards a datagram under 1200 bytes that carries
// a client Initial. egressd refuses it: read here and discarded there, it
// would move the packet numbers egressd decodes away from the server's.
constexpr std::size_t kMinInitialDatagram = 1200;
constexpr const char* kSmallDatagram = "quic Initial in a datagram under 1200 bytes (servers discard it)";

// The length of the handshake message at the start of `b` (4 + its body).
std::size_t handshake_end(const std::uint8_t* b) {
  return 4 + (static_cast<std::size_t>(b[1]) << 16 | static_cast<std::size_t>(b[2]) << 8 | b[3]);
}

// Long header packet types (RFC 9000 §17.2, RFC 9369 §3.2).
enum class LongType { initial, zero_rtt, handshake, retry };

LongType long_type(QuicVersion v, std::uint8_t first) {
  const int bits = (first >> 4) & 3;
  if (v == QuicVersion::v2) {
    static constexpr LongType v2[] = {LongType::retry, LongType::initial, LongType::zero_rtt, LongType::handshake};
    return v2[bits];
  }
  static constexpr LongType v1[] = {LongType::initial, LongType::zero_rtt, LongType::handshake, LongType::retry};
  return v1[bits];
}

// HKDF-Expand-Label (RFC 8446 §7.1) with an empty context, over HMAC-SHA256.
template <std::size_t N>
std::array<std::uint8_t, N> expand_label(const std::array<std::uint8_t, 32>& secret, std::string_view label) {
  std::array<std::uint8_t, 2 + 1 + 6 + 32 + 1> info{};
  std::size_t n = 0;
  info[n++] = static_cast<std::uint8_t>(N >> 8);
  info[n++] = static_cast<std::uint8_t>(N);
  info[n++] = static_cast<std::uint8_t>(6 + label.size());
  for (char c : std::string_view("tls13 ")) info[n++] = static_cast<std::uint8_t>(c);
  for (char c : label) info[n++] = static_cast<std::uint8_t>(c);
  info[n++] = 0;
  hmac_sha256_ctx mac;
  hmac_sha256_set_key(&mac, secret.size(), secret.data());
  std::array<std::uint8_t, N> out{};
  hkdf_expand(&mac, reinterpret_cast<nettle_hash_update_func*>(hmac_sha256_update),
              reinterpret_cast<nettle_hash_digest_func*>(hmac_sha256_digest), SHA256_DIGEST_SIZE, n, info.data(),
              out.size(), out.data());
  return out;
}

}  // namespace

std::optional<QuicVersion> quic_version(std::uint32_t wire) {
  if (wire == static_cast<std::uint32_t>(QuicVersion::v1)) return QuicVersion::v1;
  if (wire == static_cast<std::uint32_t>(QuicVersion::v2)) return QuicVersion::v2;
  return std::nullopt;
}

QuicInitialKeys quic_client_initial_keys(QuicVersion version, Bytes dcid) {
  const auto& salt = version == QuicVersion::v2 ? kSaltV2 : kSaltV1;
  hmac_sha256_ctx mac;
  hmac_sha256_set_key(&mac, salt.size(), salt.data());
  std::array<std::uint8_t, 32> initial{};
  hkdf_extract(&mac, reinterpret_cast<nettle_hash_update_func*>(hmac_sha256_update),
               reinterpret_cast<nettle_hash_digest_func*>(hmac_sha256_digest), SHA256_DIGEST_SIZE, dcid.size(),
               dcid.data(), initial.data());
  QuicInitialKeys k;
  k.secret = expand_label<32>(initial, "client in");
  const bool v2 = version == QuicVersion::v2;
  k.key = expand_label<16>(k.secret, v2 ? "quicv2 key" : "quic key");
  k.iv = expand_label<12>(k.secret, v2 ? "quicv2 iv" : "quic iv");
  k.hp = expand_label<16>(k.secret, v2 ? "quicv2 hp" : "quic hp");
  return k;
}

namespace {

// One long-header packet of a datagram, read up to its packet number.
struct LongPacket {
  std::uint8_t first = 0;
  QuicVersion version = QuicVersion::v1;
  LongType type = LongType::initial;
  Bytes dcid;
  Bytes packet;  // the whole packet
  std::size_t pn_offset = 0;
  std::size_t token_len = 0;  // Initial: its Token field's length
};

enum class HeaderRead { ok, short_header, bad };

// Reads the packet at r's position (RFC 9000 §17.2). bad: `why` says what.
HeaderRead read_long_packet(Reader& r, Bytes datagram, LongPacket& out, const char*& why) {
  const std::size_t start = r.pos();
  std::uint32_t wire = 0;
  std::uint8_t dcid_len = 0, scid_len = 0;
  Bytes scid;
  (void)r.u8(out.first);
  // A short header packet carries no length: it runs to the end of the
  // datagram, and it cannot be opened with Initial keys.
  if ((out.first & 0x80) == 0) return HeaderRead::short_header;
  if (!r.u32(wire) || !r.u8(dcid_len) || dcid_len > 20 || !r.bytes(dcid_len, out.dcid) || !r.u8(scid_len) ||
      scid_len > 20 || !r.bytes(scid_len, scid)) {
    why = "malformed quic long header";
    return HeaderRead::bad;
  }
  const auto version = quic_version(wire);
  if (!version) {
    why = "quic version other than 1 and 2";
    return HeaderRead::bad;
  }
  out.version = *version;
  out.type = long_type(*version, out.first);
  if (out.type == LongType::initial) {
    std::uint64_t token_len = 0;
    if (!r.varint(token_len) || token_len > r.left() || !r.skip(static_cast<std::size_t>(token_len))) {
      why = "malformed quic Initial token";
      return HeaderRead::bad;
    }
    out.token_len = static_cast<std::size_t>(token_len);
  }
  if (out.type != LongType::retry) {
    std::uint64_t length = 0;
    if (!r.varint(length) || length > r.left()) {
      why = "truncated quic packet";
      return HeaderRead::bad;
    }
    out.pn_offset = r.pos() - start;
    (void)r.skip(static_cast<std::size_t>(length));
  } else {
    (void)r.skip(r.left());
  }
  out.packet = datagram.subspan(start, r.pos() - start);
  return HeaderRead::ok;
}

}  // namespace

bool quic_datagram_has_initial(Bytes datagram) {
  Reader r(datagram);
  while (!r.empty()) {
    LongPacket lp;
    const char* why = "";
    const HeaderRead h = read_long_packet(r, datagram, lp, why);
    if (h == HeaderRead::short_header) return false;
    if (h == HeaderRead::bad || lp.type == LongType::initial || lp.type == LongType::retry) return true;
  }
  return false;
}

Parse QuicInitialAssembler::feed(Bytes datagram) {
  if (final_) return *final_;
  auto finish = [&](Parse p) {
    if (p.verdict != Verdict::need_more) final_ = p;
    return p;
  };
  ++datagrams_;
  fed_ += datagram.size();
  Reader r(datagram);
  bool first_in_datagram = true;
  while (!r.empty()) {
    LongPacket lp;
    const char* why = "";
    const HeaderRead h = read_long_packet(r, datagram, lp, why);
    if (h == HeaderRead::short_header) {
      if (first_in_datagram && !version_) return finish(Parse::invalid("quic datagram does not start with an Initial"));
      break;
    }
    if (h == HeaderRead::bad) return finish(Parse::invalid(why));
    // The fixed bit is 1 until a peer says it may be greased (RFC 9287),
    // which cannot have happened before the handshake. (Later, a client
    // that was told may clear it: follow() takes that.)
    if ((lp.first & 0x40) == 0) return finish(Parse::invalid("quic fixed bit is 0"));
    if (!version_) {
      if (lp.type != LongType::initial) return finish(Parse::invalid("first quic packet is not an Initial"));
      // RFC 9000 §7.2: at least 8 bytes, or servers drop the packet.
      if (lp.dcid.size() < 8) {
        return finish(Parse::invalid("quic Initial with a Destination Connection ID under 8 bytes"));
      }
      version_ = lp.version;
      dcid_len_ = std::min(lp.dcid.size(), dcid_.size());  // read_long_packet caps it at 20
      std::copy_n(lp.dcid.begin(), dcid_len_, dcid_.begin());
      // The keys of every client Initial come from the first one's DCID
      // (RFC 9001 §5.2), even if the client later switches to the server's.
      keys_ = quic_client_initial_keys(lp.version, lp.dcid);
      aes128_set_encrypt_key(&hp_, keys_.hp.data());
      gcm_aes128_set_key(&gcm_, keys_.key.data());
    } else if (lp.version != *version_) {
      return finish(Parse::invalid("quic version changed between packets"));
    }
    if (lp.type == LongType::retry) return finish(Parse::invalid("quic Retry packet from a client"));
    first_in_datagram = false;
    if (lp.type != LongType::initial) continue;  // 0-RTT, Handshake: not ours to open
    if (datagram.size() < kMinInitialDatagram) return finish(Parse::invalid(kSmallDatagram));
    if (Parse p = open_initial(lp.packet, lp.pn_offset); p.verdict != Verdict::need_more) return finish(p);
  }
  if (Parse p = judge(); p.verdict != Verdict::need_more) return finish(p);
  if (datagrams_ >= kMaxDatagrams) return finish(Parse::invalid("no whole ClientHello in 16 quic datagrams"));
  return Parse::more(fed_);
}

QuicFollow QuicInitialAssembler::follow(Bytes datagram) {
  if (!final_ || final_->verdict != Verdict::complete) return {QuicFollow::Kind::invalid, "quic flow not admitted"};
  Reader r(datagram);
  bool first_in_datagram = true;
  while (!r.empty()) {
    LongPacket lp;
    const char* why = "";
    const HeaderRead h = read_long_packet(r, datagram, lp, why);
    if (h == HeaderRead::short_header) break;  // nothing in it starts a connection
    // What this connection's Initials cannot be may still be another
    // connection's first one: judged afresh, with its own reason if bad. Not
    // under this connection's own Destination Connection ID, though: the
    // server takes that as this connection's, whose stream it holds.
    if (h == HeaderRead::bad) {
      if (first_in_datagram) return {QuicFollow::Kind::other, ""};
      return {QuicFollow::Kind::invalid, why};
    }
    if (lp.version != *version_) {
      if (first_in_datagram && !original_dcid(lp.dcid)) return {QuicFollow::Kind::other, ""};
      return {QuicFollow::Kind::invalid, "quic version changed between packets"};
    }
    if (lp.type == LongType::retry) return {QuicFollow::Kind::invalid, "quic Retry packet from a client"};
    const bool first = first_in_datagram;
    first_in_datagram = false;
    if (lp.type != LongType::initial) continue;
    if (datagram.size() < kMinInitialDatagram) return {QuicFollow::Kind::invalid, kSmallDatagram};
    following_ = true;
    auth_failed_ = false;
    const Parse p = open_initial(lp.packet, lp.pn_offset);
    following_ = false;
    // Another connection's keys. With this connection's Destination
    // Connection ID it is this connection's Initial that egressd cannot open
    // (its packet numbers read otherwise than the server's): refused.
    if (auth_failed_ && first && !original_dcid(lp.dcid)) return after_retry(datagram, lp.dcid, lp.token_len);
    if (p.verdict == Verdict::invalid) return {QuicFollow::Kind::invalid, p.reason};
  }
  // A second ClientHello, after the judged one in the stream: what a client
  // sends after a HelloRetryRequest. The server takes the name from it, so
  // it is judged like the first once whole (until then its pieces go on:
  // the server cannot act on part of a hello). Nothing may follow it.
  if (!second_end_ && contiguous_ > hello_end_) {
    const Bytes rest(crypto_.data() + hello_end_, contiguous_ - hello_end_);
    Parse p = parse_client_hello_message(rest);
    if (p.verdict == Verdict::need_more) {
      if (contiguous_ >= kMaxInspect) return {QuicFollow::Kind::invalid, "ClientHello larger than 16384 bytes"};
      return {QuicFollow::Kind::same, ""};
    }
    if (p.verdict == Verdict::invalid) return {QuicFollow::Kind::invalid, "a second ClientHello: " + p.reason};
    second_end_ = hello_end_ + handshake_end(rest.data());
    if (pieces_[npieces_ - 1].end > second_end_) {
      return {QuicFollow::Kind::invalid, "quic CRYPTO data after the second ClientHello"};
    }
    QuicFollow f{QuicFollow::Kind::hello, ""};
    f.hello = std::move(p);
    return f;
  }
  return {QuicFollow::Kind::same, ""};
}

// The client's first Initial after a server's Retry (RFC 9000 §17.2.5.2):
// under the Destination Connection ID the Retry chose, protected with keys
// from that ID (RFC 9001 §5.2), carrying the Retry's token, its CRYPTO data
// the judged hello sent again. The server takes it as the same connection
// attempt, so it is followed as this one under the new keys, once (a client
// takes at most one Retry per attempt). Anything else under another ID's
// keys is another connection (`other`). The trial runs on a copy, kept only
// when the datagram is read as the connection's: the stream it continues is
// the judged hello alone (whatever followed it under the old keys never
// reaches the server under the new ones), and the old keys open nothing more.
QuicFollow QuicInitialAssembler::after_retry(Bytes datagram, Bytes dcid, std::size_t token_len) {
  if (retried_ || token_len == 0) return {QuicFollow::Kind::other, ""};
  auto next = std::make_unique<QuicInitialAssembler>(*this);
  next->retried_ = true;
  next->dcid_len_ = std::min(dcid.size(), next->dcid_.size());
  std::copy_n(dcid.begin(), next->dcid_len_, next->dcid_.begin());
  next->keys_ = quic_client_initial_keys(*version_, dcid);
  aes128_set_encrypt_key(&next->hp_, next->keys_.hp.data());
  gcm_aes128_set_key(&next->gcm_, next->keys_.key.data());
  next->largest_pn_ = -1;
  next->npieces_ = 1;
  next->pieces_[0] = {0, hello_end_};
  next->contiguous_ = hello_end_;
  next->second_end_ = 0;
  QuicFollow f = next->follow(datagram);
  if (f.kind == QuicFollow::Kind::other || f.kind == QuicFollow::Kind::invalid) return f;
  *this = *next;
  return f;
}

bool QuicInitialAssembler::original_dcid(Bytes dcid) const {
  return dcid.size() == dcid_len_ && std::equal(dcid.begin(), dcid.end(), dcid_.begin());
}

// Removes header protection and the AEAD of one Initial (RFC 9001 §5.3, §5.4)
// in scratch_, then reads its frames. need_more = opened, nothing decided.
Parse QuicInitialAssembler::open_initial(Bytes packet, std::size_t pn_offset) {
  if (packet.size() > kMaxPacket) return Parse::invalid("quic Initial larger than 8192 bytes");
  // The sample starts 4 bytes after the packet number's start, whatever its
  // length; the packet must hold it and the tag.
  if (packet.size() < pn_offset + 4 + kSample) return Parse::invalid("quic Initial too short to sample");
  std::copy(packet.begin(), packet.end(), scratch_.begin());
  std::uint8_t* p = scratch_.data();

  std::array<std::uint8_t, 16> mask{};
  aes128_encrypt(&hp_, mask.size(), mask.data(), p + pn_offset + 4);
  p[0] ^= mask[0] & 0x0f;
  const std::size_t pn_len = (p[0] & 0x03) + 1;
  std::uint64_t truncated = 0;
  for (std::size_t i = 0; i < pn_len; ++i) {
    p[pn_offset + i] ^= mask[1 + i];
    truncated = truncated << 8 | p[pn_offset + i];
  }
  const std::size_t header_len = pn_offset + pn_len;
  if (packet.size() < header_len + kTag) return Parse::invalid("quic Initial too short for its tag");

  // The full packet number (RFC 9000 appendix A.3), for the nonce.
  const std::uint64_t expected = static_cast<std::uint64_t>(largest_pn_ + 1);
  const std::uint64_t win = std::uint64_t{1} << (pn_len * 8);
  const std::uint64_t hwin = win / 2;
  std::uint64_t pn = (expected & ~(win - 1)) | truncated;
  if (pn + hwin <= expected && pn < (std::uint64_t{1} << 62) - win) {
    pn += win;
  } else if (pn > expected + hwin && pn >= win) {
    pn -= win;
  }
  std::array<std::uint8_t, 12> nonce = keys_.iv;
  for (std::size_t i = 0; i < 8; ++i) nonce[11 - i] ^= static_cast<std::uint8_t>(pn >> (8 * i));

  const std::size_t ct_len = packet.size() - header_len - kTag;
  std::uint8_t* payload = p + header_len;
  // set_iv starts a new message on the scheduled key.
  gcm_aes128_set_iv(&gcm_, nonce.size(), nonce.data());
  gcm_aes128_update(&gcm_, header_len, p);
  gcm_aes128_decrypt(&gcm_, ct_len, payload, payload);
  std::array<std::uint8_t, kTag> tag{};
  gcm_aes128_digest(&gcm_, tag.size(), tag.data());
  if (!memeql_sec(tag.data(), payload + ct_len, kTag)) {
    auth_failed_ = true;
    return Parse::invalid("quic Initial fails authentication");
  }
  // Reserved bits are checked only once the packet is authentic (RFC 9000 §17.2).
  if ((p[0] & 0x0c) != 0) return Parse::invalid("quic Initial with reserved bits set");
  largest_pn_ = std::max<std::int64_t>(largest_pn_, static_cast<std::int64_t>(pn));
  return frames(Bytes(payload, ct_len));
}

// The frames of an authenticated Initial (RFC 9000 §12.4, §19).
Parse QuicInitialAssembler::frames(Bytes plaintext) {
  if (plaintext.empty()) return Parse::invalid("quic Initial without frames");
  Reader r(plaintext);
  while (!r.empty()) {
    std::uint64_t type = 0;
    if (!r.varint(type)) return Parse::invalid("malformed quic frame");
    switch (type) {
      case 0x00:  // PADDING: clients pad Initials with hundreds of these
        while (!r.empty() && plaintext[r.pos()] == 0) (void)r.skip(1);
        break;
      case 0x01:  // PING
        break;
      case 0x02:    // ACK
      case 0x03: {  // ACK with ECN counts
        std::uint64_t largest = 0, delay = 0, ranges = 0, first = 0;
        if (!r.varint(largest) || !r.varint(delay) || !r.varint(ranges) || !r.varint(first)) {
          return Parse::invalid("malformed quic ACK frame");
        }
        // Each range is two varints of at least a byte: bounded by what is left.
        if (ranges > r.left() / 2) return Parse::invalid("malformed quic ACK frame");
        for (std::uint64_t i = 0; i < ranges; ++i) {
          std::uint64_t gap = 0, len = 0;
          if (!r.varint(gap) || !r.varint(len)) return Parse::invalid("malformed quic ACK frame");
        }
        if (type == 0x03) {
          std::uint64_t e = 0;
          if (!r.varint(e) || !r.varint(e) || !r.varint(e)) return Parse::invalid("malformed quic ACK frame");
        }
        break;
      }
      case 0x06: {  // CRYPTO
        std::uint64_t offset = 0, len = 0;
        Bytes data;
        if (!r.varint(offset) || !r.varint(len) || len > r.left() || !r.bytes(static_cast<std::size_t>(len), data)) {
          return Parse::invalid("malformed quic CRYPTO frame");
        }
        if (offset > kMaxInspect || len > kMaxInspect - offset) {
          return Parse::invalid("quic CRYPTO data beyond 16384 bytes");
        }
        if (Parse p = add_crypto(static_cast<std::size_t>(offset), data); p.verdict == Verdict::invalid) return p;
        break;
      }
      default:
        return Parse::invalid("quic frame type not allowed in an Initial");
    }
  }
  return Parse::more(fed_);
}

// Copies CRYPTO data into place and merges its range into pieces_.
Parse QuicInitialAssembler::add_crypto(std::size_t offset, Bytes data) {
  if (data.empty()) return Parse::more(fed_);
  const std::size_t end = offset + data.size();
  if (following_ && (second_end_ != 0 || end <= hello_end_)) {
    // After the decision: CRYPTO data may only repeat what was judged, and
    // add nothing but a second hello (follow()).
    for (std::size_t i = 0; i < npieces_; ++i) {
      if (pieces_[i].begin <= offset && end <= pieces_[i].end) {
        if (std::memcmp(crypto_.data() + offset, data.data(), data.size()) != 0) {
          return Parse::invalid("quic CRYPTO data contradicts the judged ClientHello");
        }
        return Parse::more(fed_);
      }
    }
    return Parse::invalid("quic CRYPTO data the judged ClientHello does not hold");
  }
  // A retransmission must repeat what was sent: differing bytes would let a
  // server and egressd read different hellos.
  for (std::size_t i = 0; i < npieces_; ++i) {
    const std::size_t b = std::max(offset, pieces_[i].begin), e = std::min(end, pieces_[i].end);
    if (b < e && std::memcmp(crypto_.data() + b, data.data() + (b - offset), e - b) != 0) {
      return Parse::invalid(following_ ? "quic CRYPTO data contradicts the judged ClientHello"
                                       : "quic CRYPTO data contradicts earlier data");
    }
  }
  std::memcpy(crypto_.data() + offset, data.data(), data.size());
  // Merge: every piece that overlaps or touches [offset, end) joins it.
  Piece merged{offset, end};
  std::size_t out = 0;
  bool placed = false;
  std::array<Piece, kMaxPieces + 1> next{};
  for (std::size_t i = 0; i < npieces_; ++i) {
    const Piece p = pieces_[i];
    if (p.end < merged.begin) {
      next[out++] = p;
    } else if (p.begin > merged.end) {
      if (!placed) {
        next[out++] = merged;
        placed = true;
      }
      next[out++] = p;
    } else {
      merged.begin = std::min(merged.begin, p.begin);
      merged.end = std::max(merged.end, p.end);
    }
  }
  if (!placed) next[out++] = merged;
  if (out > kMaxPieces) return Parse::invalid("quic CRYPTO data in more than 64 pieces");
  std::copy_n(next.begin(), out, pieces_.begin());
  npieces_ = out;
  contiguous_ = pieces_[0].begin == 0 ? pieces_[0].end : 0;
  return Parse::more(fed_);
}

Parse QuicInitialAssembler::judge() {
  if (contiguous_ == 0) return Parse::more(fed_);
  Parse p = parse_client_hello_message(Bytes(crypto_.data(), contiguous_));
  if (p.verdict == Verdict::need_more) {
    // Nothing more can arrive past the cap.
    if (contiguous_ >= kMaxInspect) return Parse::invalid("ClientHello larger than 16384 bytes");
    return Parse::more(fed_);
  }
  if (p.verdict == Verdict::complete) {
    // A client sends a second hello only after the server's
    // HelloRetryRequest, so never with its first: the server would read
    // both and take the name from the second.
    hello_end_ = handshake_end(crypto_.data());
    if (pieces_[npieces_ - 1].end > hello_end_) {
      return Parse::invalid("quic CRYPTO data after the ClientHello (a second hello the server would read too)");
    }
  }
  return p;
}

}  // namespace egressd::pin
