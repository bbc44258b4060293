// QUIC Initial parser (src/pin/quic_initial.h): the RFC 9001 and RFC 9369
// appendix A client Initials (keys, header protection, payload), CRYPTO
// reassembly across packets and datagrams, and what must be refused.
#include <doctest/doctest.h>

#include <cstdlib>

#include "data/quic_rfc_vectors.h"
#include "pin/quic_initial.h"
#include "support/pin_support.h"

using namespace egressd::pin;
using pintest::Buf;
using pintest::hex;

namespace {

const Buf kDcid = hex("8394c8f03e515708");
const Buf kScid = hex("f067a5502a4262b5");

std::string root() {
  const char* r = std::getenv("EGRESSD_SOURCE_ROOT");
  return r ? r : ".";
}

const Buf& big_handshake() {
  static const Buf h = pintest::handshake_of(pintest::load_hellos(root()).at("big_sni_allowed"));
  return h;
}

template <std::size_t N>
Buf vec(const std::array<std::uint8_t, N>& a) {
  return Buf(a.begin(), a.end());
}

Parse feed(QuicInitialAssembler& a, const Buf& d) { return a.feed(Bytes(d.data(), d.size())); }

Buf slice(const Buf& b, std::size_t from, std::size_t to) {
  return Buf(b.begin() + static_cast<std::ptrdiff_t>(from), b.begin() + static_cast<std::ptrdiff_t>(to));
}

Buf cat(Buf a, const Buf& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("RFC 9001 A.1: v1 client Initial keys") {
  const auto k = quic_client_initial_keys(QuicVersion::v1, kDcid);
  CHECK(vec(k.secret) == hex("c00cf151ca5be075ed0ebfb5c80323c4 2d6b7db67881289af4008f1f6c357aea"));
  CHECK(vec(k.key) == hex("1f369613dd76d5467730efcbe3b1a22d"));
  CHECK(vec(k.iv) == hex("fa044b2f42a3fd3b46fb255c"));
  CHECK(vec(k.hp) == hex("9f50449e04a0e810283a1e9933adedd2"));
}

TEST_CASE("RFC 9369 A.1: v2 client Initial keys") {
  const auto k = quic_client_initial_keys(QuicVersion::v2, kDcid);
  CHECK(vec(k.secret) == hex("14ec9d6eb9fd7af83bf5a668bc17a7e2 83766aade7ecd0891f70f9ff7f4bf47b"));
  CHECK(vec(k.key) == hex("8b1a0bc121284290a29e0971b5cd045d"));
  CHECK(vec(k.iv) == hex("91f73e2351d8fa91660e909f"));
  CHECK(vec(k.hp) == hex("45b95e15235d6f45a6b19cbcb0294ba9"));
}

TEST_CASE("RFC 9001 A.2 and RFC 9369 A.2: the protected client Initial opens to its CRYPTO frame") {
  for (auto [packet, frame] : {std::pair{pintest::rfc::kV1ProtectedPacket, pintest::rfc::kV1CryptoFrame},
                               std::pair{pintest::rfc::kV2ProtectedPacket, pintest::rfc::kV2CryptoFrame}}) {
    const Buf p = hex(packet);
    REQUIRE(p.size() == 1200);
    QuicInitialAssembler a;
    const Parse r = feed(a, p);
    REQUIRE(r.verdict == Verdict::complete);
    CHECK(r.name == "example.com");
    CHECK_FALSE(r.ech);
    // The frame is 06 (CRYPTO) 00 (offset 0) 40f1 (length 241) + data.
    const Buf f = hex(frame);
    CHECK(Buf(a.crypto_prefix().begin(), a.crypto_prefix().end()) == slice(f, 4, f.size()));
  }
}

TEST_CASE("a changed byte anywhere in the RFC packet is refused") {
  const Buf good = hex(pintest::rfc::kV1ProtectedPacket);
  for (std::size_t at : {good.size() - 1, good.size() - 17, std::size_t{30}, std::size_t{600}}) {
    Buf bad = good;
    bad[at] ^= 0x01;
    QuicInitialAssembler a;
    const Parse r = feed(a, bad);
    CHECK(r.verdict == Verdict::invalid);
    CHECK(r.reason == "quic Initial fails authentication");
  }
  // A cut datagram: the Length field runs past its end.
  QuicInitialAssembler a;
  CHECK(feed(a, slice(good, 0, 1000)).reason == "truncated quic packet");
}

TEST_CASE("a ClientHello over two Initials in two datagrams, either order, v1 and v2") {
  const Buf& hs = big_handshake();
  REQUIRE(hs.size() > 1700);
  for (QuicVersion v : {QuicVersion::v1, QuicVersion::v2}) {
    const std::size_t half = 1000;
    const Buf d1 = pintest::seal_initial(v, kDcid, kScid, 0, pintest::crypto_frame(0, slice(hs, 0, half)));
    const Buf d2 = pintest::seal_initial(v, kDcid, kScid, 1, pintest::crypto_frame(half, slice(hs, half, hs.size())));
    {
      QuicInitialAssembler a;
      const Parse r1 = feed(a, d1);
      REQUIRE(r1.verdict == Verdict::need_more);
      CHECK(r1.buffered == d1.size());
      const Parse r2 = feed(a, d2);
      REQUIRE(r2.verdict == Verdict::complete);
      CHECK(r2.name == "allowed.test");
      // The verdict sticks.
      CHECK(feed(a, d1).name == "allowed.test");
    }
    {
      QuicInitialAssembler a;
      REQUIRE(feed(a, d2).verdict == Verdict::need_more);
      const Parse r = feed(a, d1);
      REQUIRE(r.verdict == Verdict::complete);
      CHECK(r.name == "allowed.test");
    }
    {
      // Both packets coalesced into one datagram, a 0-RTT packet after them.
      const Buf p1 = pintest::seal_initial(v, kDcid, kScid, 0, pintest::crypto_frame(0, slice(hs, 0, half)), 0);
      const Buf p2 =
          pintest::seal_initial(v, kDcid, kScid, 1, pintest::crypto_frame(half, slice(hs, half, hs.size())), 0);
      Buf zero_rtt = hex("d0 00000001 08 8394c8f03e515708 00 4005 0102030405");
      if (v == QuicVersion::v2) zero_rtt = hex("e0 6b3343cf 08 8394c8f03e515708 00 4005 0102030405");
      QuicInitialAssembler a;
      const Parse r = feed(a, cat(cat(p1, p2), zero_rtt));
      REQUIRE(r.verdict == Verdict::complete);
      CHECK(r.name == "allowed.test");
    }
  }
}

TEST_CASE("CRYPTO frames: out of order, overlapping, retransmitted, with ACK and PING around them") {
  const Buf& hs = big_handshake();
  Buf frames = hex("01 0200000000");  // PING, ACK(largest 0, delay 0, no ranges, first 0)
  frames = cat(frames, pintest::crypto_frame(500, slice(hs, 500, hs.size())));
  frames = cat(frames, pintest::crypto_frame(0, slice(hs, 0, 600)));  // overlaps 500..600, same bytes
  QuicInitialAssembler a;
  const Parse r = feed(a, pintest::seal_initial(QuicVersion::v1, kDcid, {}, 7, frames, 2500));
  REQUIRE(r.verdict == Verdict::complete);
  CHECK(r.name == "allowed.test");

  // The same range again with other bytes: two hellos, refused.
  Buf other = slice(hs, 0, 600);
  other[300] ^= 0xff;
  QuicInitialAssembler b;
  REQUIRE(feed(b, pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, pintest::crypto_frame(0, slice(hs, 0, 600))))
              .verdict == Verdict::need_more);
  const Parse c = feed(b, pintest::seal_initial(QuicVersion::v1, kDcid, {}, 1, pintest::crypto_frame(0, other)));
  CHECK(c.verdict == Verdict::invalid);
  CHECK(c.reason == "quic CRYPTO data contradicts earlier data");
}

TEST_CASE("CRYPTO data in many pieces: merged as it arrives, refused past 64 holes") {
  const Buf& hs = big_handshake();
  // Every other 10-byte piece first (holes between them), then the rest.
  Buf odd, even;
  for (std::size_t off = 0; off < 1280; off += 20) odd = cat(odd, pintest::crypto_frame(off + 10, slice(hs, off + 10, off + 20)));
  for (std::size_t off = 0; off < 1280; off += 20) even = cat(even, pintest::crypto_frame(off, slice(hs, off, off + 10)));
  even = cat(even, pintest::crypto_frame(1280, slice(hs, 1280, hs.size())));
  QuicInitialAssembler a;
  REQUIRE(feed(a, pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, odd)).verdict == Verdict::need_more);
  CHECK(a.crypto_prefix().empty());
  const Parse r = feed(a, pintest::seal_initial(QuicVersion::v1, kDcid, {}, 1, even, 2500));
  REQUIRE(r.verdict == Verdict::complete);
  CHECK(r.name == "allowed.test");

  Buf holes;
  for (std::size_t off = 0; off < 65 * 20; off += 20) holes = cat(holes, pintest::crypto_frame(off + 10, slice(hs, off + 10, off + 20)));
  QuicInitialAssembler b;
  const Parse q = feed(b, pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, holes, 2500));
  CHECK(q.verdict == Verdict::invalid);
  CHECK(q.reason == "quic CRYPTO data in more than 64 pieces");
}

TEST_CASE("Initials that cannot be judged are invalid") {
  const Buf hello = pintest::crypto_frame(0, big_handshake());
  auto reason = [](const Buf& d) {
    QuicInitialAssembler a;
    const Parse p = a.feed(Bytes(d.data(), d.size()));
    return p.verdict == Verdict::invalid ? p.reason : std::string("not invalid");
  };
  CHECK(reason(pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, cat(hex("08 00 01 61"), hello), 2500)) ==
        "quic frame type not allowed in an Initial");
  CHECK(reason(pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, cat(hex("1c 00 00 00"), hello), 2500)) ==
        "quic frame type not allowed in an Initial");
  CHECK(reason(pintest::seal_initial(QuicVersion::v1, hex("0102030405"), {}, 0, hello, 2500)) ==
        "quic Initial with a Destination Connection ID under 8 bytes");
  CHECK(reason(pintest::crypto_frame(0, {})) == "quic datagram does not start with an Initial");
  CHECK(reason(hex("c0 ff00001d 08 8394c8f03e515708 00 00 4010 00")) == "quic version other than 1 and 2");
  CHECK(reason(hex("c0 00000001 15")) == "malformed quic long header");
  CHECK(reason(hex("e0 00000001 08 8394c8f03e515708 00 4005 0102030405")) == "first quic packet is not an Initial");
  CHECK(reason(pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, pintest::crypto_frame(20000, hex("01")))) ==
        "quic CRYPTO data beyond 16384 bytes");
  // The first handshake message is not a ClientHello.
  CHECK(reason(pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, pintest::crypto_frame(0, hex("02000000")))) ==
        "first handshake message is not a ClientHello");
  // Reserved bits: set before protection, so the packet still authenticates.
  CHECK(reason(pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, hello, 2500, {}, 0x08)) ==
        "quic Initial with reserved bits set");
  CHECK(reason(pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, hello, 2500, {}, 0x00)) == "not invalid");
  // A token (from an earlier Retry or NEW_TOKEN) is carried through.
  CHECK(reason(pintest::seal_initial(QuicVersion::v2, kDcid, kScid, 0, hello, 1200, hex("aabbccdd"))) ==
        "not invalid");
  CHECK(reason(pintest::seal_initial(QuicVersion::v1, kDcid, {}, 0, hello, 9000)) ==
        "quic Initial larger than 8192 bytes");
}

TEST_CASE("no ClientHello after 16 datagrams is invalid; a hello without SNI is complete with no name") {
  QuicInitialAssembler a;
  Parse p;
  for (std::uint32_t i = 0; i < QuicInitialAssembler::kMaxDatagrams; ++i) {
    p = feed(a, pintest::seal_initial(QuicVersion::v1, kDcid, {}, i, hex("01")));
  }
  CHECK(p.verdict == Verdict::invalid);
  CHECK(p.reason == "no whole ClientHello in 16 quic datagrams");

  const Buf no_sni = pintest::handshake_of(pintest::load_hellos(root()).at("no_sni"));
  QuicInitialAssembler b;
  const Parse q = feed(b, pintest::seal_initial(QuicVersion::v2, kDcid, {}, 0, pintest::crypto_frame(0, no_sni)));
  REQUIRE(q.verdict == Verdict::complete);
  CHECK_FALSE(q.name.has_value());
}

namespace {

QuicFollow follow(QuicInitialAssembler& a, const Buf& d) { return a.follow(Bytes(d.data(), d.size())); }

// The RFC 9001 appendix A ClientHello (server name example.com), and the same with another
// name of that length.
Buf rfc_hello(bool other_name = false) {
  Buf f = hex(pintest::rfc::kV1CryptoFrame);
  Buf h = slice(f, 4, f.size());  // 06 00 40f1: CRYPTO at offset 0, 241 bytes
  REQUIRE(h.size() == 241);
  if (other_name) {
    const std::string from = "example.com";
    auto it = std::search(h.begin(), h.end(), from.begin(), from.end());
    REQUIRE(it != h.end());
    it[6] = 'x';
  }
  return h;
}

Buf initial(std::uint32_t pn, const Buf& frames, std::size_t min_size = 1200) {
  return pintest::seal_initial(QuicVersion::v1, kDcid, {}, pn, frames, min_size);
}

}  // namespace

TEST_CASE("a second ClientHello: refused in the first one's stream, judged once whole after it, nothing after it") {
  const Buf ch = rfc_hello(), other = rfc_hello(true);
  // Both hellos in the stream before anything was decided: a client sends its second only
  // after the server's HelloRetryRequest, and the server would read both and take the second's
  // name. Refused whatever the second names, and also when it comes in a later packet of
  // the same datagram.
  for (const Buf& second : {ch, other}) {
    QuicInitialAssembler a;
    const Parse p = feed(a, initial(0, cat(pintest::crypto_frame(0, ch), pintest::crypto_frame(241, second))));
    CHECK(p.verdict == Verdict::invalid);
    CHECK(p.reason == "quic CRYPTO data after the ClientHello (a second hello the server would read too)");
  }
  {
    QuicInitialAssembler a;
    const Buf two = cat(initial(0, pintest::crypto_frame(0, ch), 0), initial(1, pintest::crypto_frame(241, other)));
    CHECK(feed(a, two).verdict == Verdict::invalid);
  }
  // After the decision (the server answered with a HelloRetryRequest): the second hello, in
  // pieces. The first piece goes on (a server cannot act on part of a hello); once whole it
  // is handed over to be judged, once; a repeat is the same; anything after it is refused.
  for (const bool named_other : {false, true}) {
    const Buf& second = named_other ? other : ch;
    QuicInitialAssembler a;
    REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
    CHECK(follow(a, initial(1, pintest::crypto_frame(241, slice(second, 0, 100)))).kind == QuicFollow::Kind::same);
    const QuicFollow f = follow(a, initial(2, pintest::crypto_frame(341, slice(second, 100, 241))));
    REQUIRE(f.kind == QuicFollow::Kind::hello);
    CHECK(f.hello.verdict == Verdict::complete);
    CHECK(f.hello.name == (named_other ? "examplx.com" : "example.com"));
    CHECK(follow(a, initial(3, pintest::crypto_frame(241, second))).kind == QuicFollow::Kind::same);
    const QuicFollow third = follow(a, initial(4, pintest::crypto_frame(482, ch)));
    CHECK(third.kind == QuicFollow::Kind::invalid);
    CHECK(third.reason == "quic CRYPTO data the judged ClientHello does not hold");
  }
  {
    // A second hello followed by more bytes in the same datagram: refused.
    QuicInitialAssembler a;
    REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
    const QuicFollow f = follow(a, initial(1, cat(pintest::crypto_frame(241, ch), pintest::crypto_frame(482, ch))));
    CHECK(f.kind == QuicFollow::Kind::invalid);
    CHECK(f.reason == "quic CRYPTO data after the second ClientHello");
  }
  {
    // What is not a ClientHello where the second would start: refused.
    QuicInitialAssembler a;
    REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
    const QuicFollow f = follow(a, initial(1, pintest::crypto_frame(241, hex("0b000000"))));
    CHECK(f.kind == QuicFollow::Kind::invalid);
    CHECK(f.reason == "a second ClientHello: first handshake message is not a ClientHello");
  }
}

TEST_CASE("an Initial in a datagram under 1200 bytes is refused, before and after the decision") {
  // A server discards it (RFC 9000 §14.1); read here, it would move the packet numbers egressd
  // expects away from the server's.
  const Buf ch = rfc_hello();
  {
    QuicInitialAssembler a;
    const Parse p = feed(a, initial(0, pintest::crypto_frame(0, ch), 1199));
    CHECK(p.verdict == Verdict::invalid);
    CHECK(p.reason == "quic Initial in a datagram under 1200 bytes (servers discard it)");
  }
  QuicInitialAssembler a;
  REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch), 1200)).verdict == Verdict::complete);
  const QuicFollow f = follow(a, initial(1000, hex("01"), 57));
  CHECK(f.kind == QuicFollow::Kind::invalid);
  CHECK(f.reason == "quic Initial in a datagram under 1200 bytes (servers discard it)");
}

TEST_CASE("after admission, an Initial under the connection's own id that does not open is refused, not judged afresh") {
  // egressd read an Initial with packet number 1000 the server never took (a raw socket's bad
  // checksum, say), so a 1-byte packet number 1 decodes to 1025 here and to 1 at the server:
  // it does not open here. Taken for another connection's first Initial, a new assembler
  // would judge a hello at offset 0, of which the server keeps only the bytes past what it
  // holds. Under the connection's own Destination Connection ID it is refused.
  const Buf ch = rfc_hello();
  QuicInitialAssembler a;
  REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
  REQUIRE(follow(a, initial(1000, hex("01"))).kind == QuicFollow::Kind::same);
  Buf one;
  pintest::seal_initial_into(one, QuicVersion::v1, kDcid, {}, 1, ch.data(), 0, 1200, {}, 0, nullptr, 1);
  const QuicFollow f = follow(a, one);
  CHECK(f.kind == QuicFollow::Kind::invalid);
  CHECK(f.reason == "quic Initial fails authentication");
  // The same packet sealed for another connection id opens with that id's keys: another
  // connection, judged afresh by the caller.
  Buf other;
  const Buf dcid2 = hex("0011223344556677");
  pintest::seal_initial_into(other, QuicVersion::v1, dcid2, {}, 1, ch.data(), 0, 1200, {}, 0, nullptr, 1);
  CHECK(follow(a, other).kind == QuicFollow::Kind::other);
  // A version change under the connection's own id is refused too; under another id it is
  // another connection's.
  CHECK(follow(a, pintest::seal_initial(QuicVersion::v2, kDcid, {}, 0, pintest::crypto_frame(0, ch))).kind ==
        QuicFollow::Kind::invalid);
  CHECK(follow(a, pintest::seal_initial(QuicVersion::v2, dcid2, {}, 0, pintest::crypto_frame(0, ch))).kind ==
        QuicFollow::Kind::other);
}

TEST_CASE("the client's Initial after a server's Retry is the same connection under the Retry's keys, once") {
  // RFC 9000 §17.2.5.2: the client answers a Retry with an Initial to the connection ID the
  // Retry chose, protected with keys from that ID (RFC 9001 §5.2), carrying the Retry's
  // token, its CRYPTO stream the hello already sent. Refused as another connection, HTTP/3
  // broke against every server that validates addresses (gtlsserver -V; found by attack
  // review 8).
  const Buf ch = rfc_hello(), other = rfc_hello(true);
  const Buf retry_id = hex("a1a2a3a4a5a6a7a8a9"), token = hex("0102030405060708");
  auto retried = [&](std::uint32_t pn, const Buf& frames, const Buf& tok) {
    return pintest::seal_initial(QuicVersion::v1, retry_id, kScid, pn, frames, 1200, tok);
  };
  {
    QuicInitialAssembler a;
    REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
    CHECK(follow(a, retried(1, pintest::crypto_frame(0, ch), token)).kind == QuicFollow::Kind::same);
    CHECK(Buf(a.dcid().begin(), a.dcid().end()) == retry_id);
    // Its later Initials, pieces of the same hello and ACKs, are the connection's.
    CHECK(follow(a, retried(2, pintest::crypto_frame(100, slice(ch, 100, 241)), token)).kind ==
          QuicFollow::Kind::same);
    // A second hello after a HelloRetryRequest is judged as before, under the new keys.
    const QuicFollow f = follow(a, retried(3, pintest::crypto_frame(241, other), token));
    REQUIRE(f.kind == QuicFollow::Kind::hello);
    CHECK(f.hello.name == "examplx.com");
    // The old keys open nothing more: the connection moved, and what they carry is another
    // connection's.
    CHECK(follow(a, initial(4, pintest::crypto_frame(0, ch))).kind == QuicFollow::Kind::other);
  }
  {
    // Another hello under the Retry's keys: refused, and the connection stays where it was.
    QuicInitialAssembler a;
    REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
    const QuicFollow f = follow(a, retried(1, pintest::crypto_frame(0, other), token));
    CHECK(f.kind == QuicFollow::Kind::invalid);
    CHECK(f.reason == "quic CRYPTO data contradicts the judged ClientHello");
    CHECK(Buf(a.dcid().begin(), a.dcid().end()) == kDcid);
    // More than the hello in the first Initial under new keys: the hello and a second one
    // at once is what a client never sends after a Retry; read as the connection's, the
    // second is judged.
    QuicInitialAssembler b;
    REQUIRE(feed(b, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
    const QuicFollow g = follow(b, retried(1, cat(pintest::crypto_frame(0, ch), pintest::crypto_frame(241, other)), token));
    REQUIRE(g.kind == QuicFollow::Kind::hello);
    CHECK(g.hello.name == "examplx.com");
  }
  {
    // Without a token it is not a Retry's answer: another connection.
    QuicInitialAssembler a;
    REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
    CHECK(follow(a, retried(1, pintest::crypto_frame(0, ch), {})).kind == QuicFollow::Kind::other);
    CHECK(Buf(a.dcid().begin(), a.dcid().end()) == kDcid);
  }
  {
    // One Retry per connection: a second move is another connection, and so is going back.
    QuicInitialAssembler a;
    REQUIRE(feed(a, initial(0, pintest::crypto_frame(0, ch))).verdict == Verdict::complete);
    REQUIRE(follow(a, retried(1, pintest::crypto_frame(0, ch), token)).kind == QuicFollow::Kind::same);
    const Buf third_id = hex("b1b2b3b4b5b6b7b8");
    CHECK(follow(a, pintest::seal_initial(QuicVersion::v1, third_id, kScid, 2, pintest::crypto_frame(0, ch), 1200,
                                          token)).kind == QuicFollow::Kind::other);
    CHECK(follow(a, pintest::seal_initial(QuicVersion::v1, kDcid, kScid, 2, pintest::crypto_frame(0, ch), 1200,
                                          token)).kind == QuicFollow::Kind::other);
  }
}
