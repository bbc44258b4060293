// TLS ClientHello parser (src/pin/tls_hello.h): real hellos from Python's ssl
// (data/tls_hellos.txt), split at every offset and across records; ECH
// outer; no SNI; truncated and malformed hellos.
#include <doctest/doctest.h>

#include <cstdlib>

#include "pin/tls_hello.h"
#include "support/pin_support.h"

using namespace egressd::pin;
using pintest::Buf;

namespace {

std::string root() {
  const char* r = std::getenv("EGRESSD_SOURCE_ROOT");
  return r ? r : ".";
}

const std::map<std::string, Buf>& hellos() {
  static const auto h = pintest::load_hellos(root());
  return h;
}

Parse parse(const Buf& b) { return parse_tls_client_hello(Bytes(b.data(), b.size())); }

// Re-frames the handshake bytes of `stream` (one record) into records of at
// most `chunk` bytes each.
Buf rerecord(const Buf& stream, std::size_t chunk) {
  const Buf hs = pintest::handshake_of(stream);
  Buf out;
  for (std::size_t i = 0; i < hs.size(); i += chunk) {
    const std::size_t n = std::min(chunk, hs.size() - i);
    out.insert(out.end(), {22, 3, 1, static_cast<std::uint8_t>(n >> 8), static_cast<std::uint8_t>(n)});
    out.insert(out.end(), hs.begin() + static_cast<std::ptrdiff_t>(i), hs.begin() + static_cast<std::ptrdiff_t>(i + n));
  }
  return out;
}

// A minimal ClientHello record with the given extensions block contents
// (each already type+length+data).
Buf make_hello(const Buf& extensions, bool with_ext_block = true) {
  Buf body{0x03, 0x03};
  body.resize(2 + 32, 0xab);
  body.push_back(0);                       // session id
  body.insert(body.end(), {0, 2, 0x13, 0x01});  // one cipher suite
  body.insert(body.end(), {1, 0});         // null compression
  if (with_ext_block) {
    body.push_back(static_cast<std::uint8_t>(extensions.size() >> 8));
    body.push_back(static_cast<std::uint8_t>(extensions.size()));
    body.insert(body.end(), extensions.begin(), extensions.end());
  }
  Buf hs{1, 0, static_cast<std::uint8_t>(body.size() >> 8), static_cast<std::uint8_t>(body.size())};
  hs.insert(hs.end(), body.begin(), body.end());
  Buf rec{22, 3, 1, static_cast<std::uint8_t>(hs.size() >> 8), static_cast<std::uint8_t>(hs.size())};
  rec.insert(rec.end(), hs.begin(), hs.end());
  return rec;
}

Buf ext(std::uint16_t type, const Buf& data) {
  Buf e{static_cast<std::uint8_t>(type >> 8), static_cast<std::uint8_t>(type),
        static_cast<std::uint8_t>(data.size() >> 8), static_cast<std::uint8_t>(data.size())};
  e.insert(e.end(), data.begin(), data.end());
  return e;
}

Buf sni(std::string_view name, std::uint8_t type = 0) {
  const std::size_t n = name.size();
  Buf d{static_cast<std::uint8_t>((n + 3) >> 8), static_cast<std::uint8_t>(n + 3), type,
        static_cast<std::uint8_t>(n >> 8), static_cast<std::uint8_t>(n)};
  d.insert(d.end(), name.begin(), name.end());
  return ext(0, d);
}

Buf cat(Buf a, const Buf& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("real hellos from Python's ssl give their server name") {
  Parse p = parse(hellos().at("sni_allowed"));
  REQUIRE(p.verdict == Verdict::complete);
  CHECK(p.name == "allowed.test");
  CHECK_FALSE(p.ech);

  p = parse(hellos().at("tls12_sni"));
  REQUIRE(p.verdict == Verdict::complete);
  CHECK(p.name == "allowed.test");

  // Upper case and a trailing dot are normalized as names are matched.
  p = parse(hellos().at("sni_upper_trailing_dot"));
  REQUIRE(p.verdict == Verdict::complete);
  CHECK(p.name == "allowed.test");
}

TEST_CASE("a hello without server_name is complete with no name") {
  const Parse p = parse(hellos().at("no_sni"));
  REQUIRE(p.verdict == Verdict::complete);
  CHECK_FALSE(p.name.has_value());
  // Also an old-style hello with no extensions block at all.
  const Parse q = parse(make_hello({}, false));
  REQUIRE(q.verdict == Verdict::complete);
  CHECK_FALSE(q.name.has_value());
}

TEST_CASE("ECH: the outer server name is the one reported, with the ech flag") {
  const Parse p = parse(hellos().at("ech_outer"));
  REQUIRE(p.verdict == Verdict::complete);
  CHECK(p.name == "public.example");
  CHECK(p.ech);
}

TEST_CASE("a 1.8 KB hello is judged whole, whatever segment boundary the stream has") {
  const Buf& big = hellos().at("big_sni_allowed");
  REQUIRE(big.size() > 1700);
  // Segments only ever grow the stream: every strict prefix waits.
  for (std::size_t k = 0; k < big.size(); ++k) {
    const Parse p = parse_tls_client_hello(Bytes(big.data(), k));
    REQUIRE_MESSAGE(p.verdict == Verdict::need_more, "prefix " << k);
    CHECK(p.buffered == k);
  }
  const Parse p = parse(big);
  REQUIRE(p.verdict == Verdict::complete);
  CHECK(p.name == "allowed.test");
  // Early data after the hello does not change the verdict.
  const Parse q = parse(cat(big, Buf{23, 3, 3, 0, 1, 0}));
  REQUIRE(q.verdict == Verdict::complete);
  CHECK(q.name == "allowed.test");
}

TEST_CASE("a hello split across TLS records is refused at any offset: a router reading its bytes as they come reads others") {
  // HAProxy's req.ssl_sni walks the bytes without joining records: the second record's header
  // inside the hello moves its walk, and it read a name hidden in an extension's data (an
  // attack review reached same-ip.test's backend with a hello naming allowed.test).
  const Buf& big = hellos().at("big_sni_allowed");
  const Buf hs = pintest::handshake_of(big);
  const std::string why = "ClientHello split over TLS records";
  for (std::size_t k = 1; k < hs.size(); ++k) {
    Buf two{22, 3, 1, static_cast<std::uint8_t>(k >> 8), static_cast<std::uint8_t>(k)};
    two.insert(two.end(), hs.begin(), hs.begin() + static_cast<std::ptrdiff_t>(k));
    // Refused once the first record is whole, before the second has come.
    REQUIRE_MESSAGE(parse(two).verdict == Verdict::invalid, "split at " << k);
    CHECK(parse(two).reason == why);
    CHECK(parse_tls_client_hello(Bytes(two.data(), two.size() - 1)).verdict == Verdict::need_more);
    const std::size_t rest = hs.size() - k;
    two.insert(two.end(), {22, 3, 1, static_cast<std::uint8_t>(rest >> 8), static_cast<std::uint8_t>(rest)});
    two.insert(two.end(), hs.begin() + static_cast<std::ptrdiff_t>(k), hs.end());
    REQUIRE_MESSAGE(parse(two).verdict == Verdict::invalid, "split at " << k);
  }
  for (std::size_t chunk : {1u, 7u, 100u, 512u}) {
    const Parse p = parse(rerecord(big, chunk));
    CHECK_MESSAGE(p.verdict == Verdict::invalid, "chunk " << chunk);
    CHECK(p.reason == why);
  }
  // The same hello in one record is judged.
  const Parse one = parse(rerecord(big, hs.size()));
  REQUIRE(one.verdict == Verdict::complete);
  CHECK(one.name == "allowed.test");
}

TEST_CASE("the handshake layer alone (QUIC's CRYPTO stream) parses the same") {
  const Buf hs = pintest::handshake_of(hellos().at("sni_allowed"));
  const Parse p = parse_client_hello_message(Bytes(hs.data(), hs.size()));
  REQUIRE(p.verdict == Verdict::complete);
  CHECK(p.name == "allowed.test");
  CHECK(parse_client_hello_message(Bytes(hs.data(), hs.size() - 1)).verdict == Verdict::need_more);
}

TEST_CASE("truncated or interrupted hellos are never complete") {
  const Buf& h = hellos().at("sni_allowed");
  // A record cut short and then an alert: refused, not waited for.
  Buf cut(h.begin(), h.begin() + 100);
  cut[3] = 0;
  cut[4] = 95;
  const Parse p = parse(cat(cut, Buf{21, 3, 3, 0, 2, 2, 40}));
  CHECK(p.verdict == Verdict::invalid);
  CHECK(p.reason.starts_with("ClientHello split over TLS records"));
  // An alert in place of the hello's first record.
  CHECK(parse(Buf{21, 3, 3, 0, 2, 2, 40}).reason == "not a TLS handshake record");
  // A hello whose inner lengths run past the handshake message.
  Buf bad = make_hello(sni("allowed.test"));
  bad[5 + 4 + 2 + 32 + 1 + 1] = 0x7f;  // cipher suites length
  CHECK(parse(bad).verdict == Verdict::invalid);
}

TEST_CASE("malformed hellos are invalid, with a reason") {
  CHECK(parse(make_hello(sni("allowed.test"))).name == "allowed.test");
  auto reason = [](const Buf& b) {
    const Parse p = parse(b);
    return p.verdict == Verdict::invalid ? p.reason : std::string("not invalid");
  };
  CHECK(reason(make_hello(cat(sni("allowed.test"), sni("other.test")))) == "duplicate ClientHello extension");
  CHECK(reason(make_hello(cat(ext(16, {0, 3, 2, 'h', '2'}), ext(16, {0, 3, 2, 'h', '2'})))) ==
        "duplicate ClientHello extension");
  // Two names in one server_name list.
  Buf two{0, 26, 0, 0, 10};
  for (char c : std::string_view("allowed.te")) two.push_back(static_cast<std::uint8_t>(c));
  two.insert(two.end(), {0, 0, 10});
  for (char c : std::string_view("other.test")) two.push_back(static_cast<std::uint8_t>(c));
  CHECK(reason(make_hello(ext(0, two))) == "server_name with more than one name");
  CHECK(reason(make_hello(sni("allowed.test", 1))) == "server_name of a type other than host_name");
  CHECK(reason(make_hello(sni(std::string_view("allowed.test\0evil", 17)))) == "server_name is not a valid host name");
  CHECK(reason(make_hello(sni("a..test"))) == "server_name is not a valid host name");
  CHECK(reason(make_hello(sni(""))) == "server_name is not a valid host name");
  CHECK(reason(make_hello(ext(0, {}))) == "malformed server_name extension");
  Buf not_hello = make_hello(sni("allowed.test"));
  not_hello[5] = 2;  // ServerHello
  CHECK(reason(not_hello) == "first handshake message is not a ClientHello");
  Buf appdata = make_hello(sni("allowed.test"));
  appdata[0] = 23;
  CHECK(reason(appdata) == "not a TLS handshake record");
  CHECK(reason(Buf{0x80, 0x2e, 0x01, 0x03, 0x01}) == "SSLv2-format ClientHello");
  CHECK(reason(Buf{22, 3, 1, 0, 0}) == "empty TLS handshake record");
  CHECK(reason(Buf{22, 3, 1, 0x40, 0x01}) == "TLS record longer than 16384 bytes");
  // A hello that declares more than can ever be held is refused at once.
  CHECK(reason(Buf{22, 3, 1, 0x10, 0x00, 1, 0x00, 0x40, 0x00}) == "ClientHello larger than 16384 bytes");
  // Extensions length that does not match what follows.
  Buf trailing = make_hello(sni("allowed.test"));
  trailing.push_back(0);
  trailing[4] = static_cast<std::uint8_t>(trailing[4] + 1);
  trailing[8] = static_cast<std::uint8_t>(trailing[8] + 1);
  CHECK(reason(trailing) == "malformed ClientHello extensions length");
}

TEST_CASE("a hello in many small records is refused at its first record, not after 16 KiB") {
  // 1-byte records of a hello that claims 12000 bytes: nothing waits for the budget to run out.
  Buf hs{1, 0, 0x2e, 0xe0};
  hs.resize(4 + 12000, 0);
  Buf s;
  for (std::size_t i = 0; i < hs.size() && s.size() < kMaxInspect + 10; ++i) {
    s.insert(s.end(), {22, 3, 1, 0, 1, hs[i]});
  }
  CHECK(parse_tls_client_hello(Bytes(s.data(), 5)).verdict == Verdict::need_more);
  CHECK(parse_tls_client_hello(Bytes(s.data(), 6)).verdict == Verdict::invalid);
  const Parse p = parse(s);
  CHECK(p.verdict == Verdict::invalid);
  CHECK(p.reason.starts_with("ClientHello split over TLS records"));
}
