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
