// DNS message reader/writer (src/dns/message.h): valid queries and answers,
// compression, hostile input (loops, truncation at every offset, random
// corruption), CNAME chains, local answers.
#include <doctest/doctest.h>

#include <array>
#include <set>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dns/message.h"

using namespace egressd;
using namespace egressd::dns;

namespace {

// Writes DNS wire data by hand, so tests can build what no sane encoder would.
struct Wire {
  std::vector<std::uint8_t> b;

  Wire& u8(std::uint8_t v) {
    b.push_back(v);
    return *this;
  }
  Wire& u16(std::uint16_t v) {
    b.push_back(static_cast<std::uint8_t>(v >> 8));
    b.push_back(static_cast<std::uint8_t>(v & 0xFF));
    return *this;
  }
  Wire& u32(std::uint32_t v) {
    u16(static_cast<std::uint16_t>(v >> 16));
    return u16(static_cast<std::uint16_t>(v & 0xFFFF));
  }
  Wire& header(std::uint16_t id, std::uint16_t flags, std::uint16_t qd, std::uint16_t an, std::uint16_t ns = 0,
               std::uint16_t ar = 0) {
    return u16(id).u16(flags).u16(qd).u16(an).u16(ns).u16(ar);
  }
  // Labels of a dotted name, then the root (or nothing when `terminate` is false,
  // for a name that continues with a pointer).
  Wire& name(std::string_view dotted, bool terminate = true) {
    std::size_t i = 0;
    while (i < dotted.size()) {
      auto dot = dotted.find('.', i);
      if (dot == std::string_view::npos) dot = dotted.size();
      u8(static_cast<std::uint8_t>(dot - i));
      for (std::size_t k = i; k < dot; ++k) u8(static_cast<std::uint8_t>(dotted[k]));
      i = dot + 1;
    }
    if (terminate) u8(0);
    return *this;
  }
  Wire& ptr(std::uint16_t offset) { return u16(static_cast<std::uint16_t>(0xC000 | offset)); }
  Wire& question(std::string_view qname, std::uint16_t type = qtype::A) { return name(qname).u16(type).u16(kClassIN); }
  // Record head after an owner already written: type, class IN, ttl, rdlength.
  Wire& rr(std::uint16_t type, std::uint32_t ttl, std::uint16_t rdlen) {
    return u16(type).u16(kClassIN).u32(ttl).u16(rdlen);
  }
  Wire& a(std::uint8_t a0, std::uint8_t a1, std::uint8_t a2, std::uint8_t a3, std::uint32_t ttl = 300) {
    return rr(qtype::A, ttl, 4).u8(a0).u8(a1).u8(a2).u8(a3);
  }
  Wire& aaaa_last(std::uint8_t last, std::uint32_t ttl = 300) {
    rr(qtype::AAAA, ttl, 16).u16(0x2001).u16(0x0db8);
    for (int i = 0; i < 11; ++i) u8(0);
    return u8(last);
  }
  std::size_t size() const { return b.size(); }
  Bytes bytes() const { return b; }
};

constexpr std::uint16_t kQueryRD = 0x0100;
constexpr std::uint16_t kAnswerFlags = 0x8180;  // QR RD RA, NOERROR

std::string addr(const ChainAddress& a) { return a.addr.to_string(); }

IpPrefix ip(std::string_view text) {
  auto p = parse_ip(text);
  REQUIRE(p.has_value());
  return *p;
}

}  // namespace

TEST_CASE("header needs 12 bytes") {
  std::vector<std::uint8_t> m(11, 0);
  CHECK_FALSE(read_header(m).has_value());
  m.push_back(0);
  CHECK(read_header(m).has_value());
  CHECK(parse_query(Bytes(m.data(), 11)).status == QueryStatus::drop);
}

TEST_CASE("a plain query parses; the name is lower-cased without trailing dot") {
  Wire w;
  w.header(0xBEEF, kQueryRD, 1, 0).question("WwW.Example.COM", qtype::AAAA);
  ParsedQuery q = parse_query(w.bytes());
  REQUIRE(q.status == QueryStatus::ok);
  CHECK(q.header.id == 0xBEEF);
  CHECK(q.header.rd());
  CHECK(q.question.name == "www.example.com");
  CHECK(q.question.qtype == qtype::AAAA);
  CHECK(q.question.qclass == kClassIN);
  CHECK(q.question_end == w.size());
  CHECK(q.udp_size == kClassicUdpSize);
}

TEST_CASE("EDNS payload size is read from the OPT record and clamped") {
  for (auto [asked, expect] : {std::pair<std::uint16_t, std::size_t>{1232, 1232}, {100, 512}, {65000, 4096}}) {
    Wire w;
    w.header(1, kQueryRD, 1, 0, 0, 1).question("pypi.org");
    w.u8(0).u16(qtype::OPT).u16(asked).u32(0).u16(0);
    ParsedQuery q = parse_query(w.bytes());
    REQUIRE(q.status == QueryStatus::ok);
    CHECK(q.udp_size == expect);
  }
  SUBCASE("OPT with options passes") {
    Wire w;
    w.header(1, kQueryRD, 1, 0, 0, 1).question("pypi.org");
    w.u8(0).u16(qtype::OPT).u16(1232).u32(0x8000).u16(12).u16(10).u16(8).u32(1).u32(2);  // DO + cookie
    CHECK(parse_query(w.bytes()).status == QueryStatus::ok);
  }
  SUBCASE("OPT options that do not tile the data are malformed") {
    Wire w;
    w.header(1, kQueryRD, 1, 0, 0, 1).question("pypi.org");
    w.u8(0).u16(qtype::OPT).u16(1232).u32(0).u16(6).u16(10).u16(8).u16(0);  // option claims 8, has 2
    CHECK(parse_query(w.bytes()).status == QueryStatus::formerr);
    Wire tail;
    tail.header(1, kQueryRD, 1, 0, 0, 1).question("pypi.org");
    tail.u8(0).u16(qtype::OPT).u16(1232).u32(0).u16(2).u16(10);  // 2 stray bytes
    CHECK(parse_query(tail.bytes()).status == QueryStatus::formerr);
  }
  SUBCASE("an OPT not owned by the root is malformed") {
    Wire w;
    w.header(1, kQueryRD, 1, 0, 0, 1).question("pypi.org");
    w.name("x").u16(qtype::OPT).u16(1232).u32(0).u16(0);
    CHECK(parse_query(w.bytes()).status == QueryStatus::formerr);
  }
  SUBCASE("two OPT records are malformed") {
    Wire w;
    w.header(1, kQueryRD, 1, 0, 0, 2).question("pypi.org");
    w.u8(0).u16(qtype::OPT).u16(1232).u32(0).u16(0);
    w.u8(0).u16(qtype::OPT).u16(1232).u32(0).u16(0);
    CHECK(parse_query(w.bytes()).status == QueryStatus::formerr);
  }
}

TEST_CASE("malformed queries: formerr when a header could be read, drop when nothing can be echoed") {
  SUBCASE("qdcount 0 and 2 are formerr") {
    Wire w0;
    w0.header(1, kQueryRD, 0, 0);
    CHECK(parse_query(w0.bytes()).status == QueryStatus::formerr);
    Wire w2;
    w2.header(1, kQueryRD, 2, 0).question("a.org").question("b.org");
    ParsedQuery q = parse_query(w2.bytes());
    CHECK(q.status == QueryStatus::formerr);
    CHECK(q.question_end == 0);  // nothing echoed
  }
  SUBCASE("a response is dropped") {
    Wire w;
    w.header(1, 0x8100, 1, 0).question("a.org");
    CHECK(parse_query(w.bytes()).status == QueryStatus::drop);
  }
  SUBCASE("truncated question is dropped") {
    Wire w;
    w.header(1, kQueryRD, 1, 0).question("a.org");
    w.b.pop_back();
    CHECK(parse_query(w.bytes()).status == QueryStatus::drop);
  }
  SUBCASE("trailing bytes are formerr and keep the question") {
    Wire w;
    w.header(1, kQueryRD, 1, 0).question("a.org").u8(0xAA);
    ParsedQuery q = parse_query(w.bytes());
    CHECK(q.status == QueryStatus::formerr);
    CHECK(q.question_end == w.size() - 1);
  }
  SUBCASE("answer records in a query are formerr") {
    Wire w;
    w.header(1, kQueryRD, 1, 1).question("a.org").ptr(12).a(1, 2, 3, 4);
    CHECK(parse_query(w.bytes()).status == QueryStatus::formerr);
  }
  SUBCASE("opcode other than QUERY is notimp") {
    Wire w;
    w.header(1, static_cast<std::uint16_t>(kQueryRD | (4 << 11)), 1, 0).question("a.org");
    CHECK(parse_query(w.bytes()).status == QueryStatus::notimp);
  }
  SUBCASE("zone transfers are notimp") {
    Wire w;
    w.header(1, 0, 1, 0).question("a.org", qtype::AXFR);
    CHECK(parse_query(w.bytes()).status == QueryStatus::notimp);
  }
  SUBCASE("a compression pointer in a query's question is dropped") {
    Wire w;
    w.header(1, kQueryRD, 1, 0).name("a", false).ptr(0).u16(1).u16(1);
    CHECK(parse_query(w.bytes()).status == QueryStatus::drop);
  }
}

TEST_CASE("names: canonical text form") {
  SUBCASE("root") {
    Wire w;
    w.header(1, 0, 1, 0).question("");
    ParsedQuery q = parse_query(w.bytes());
    REQUIRE(q.status == QueryStatus::ok);
    CHECK(q.question.name == "");
  }
  SUBCASE("a dot inside a label cannot pose as a separator") {
    Wire w;
    w.header(1, 0, 1, 0).u8(3).u8('a').u8('.').u8('B').name("org").u16(1).u16(1);
    ParsedQuery q = parse_query(w.bytes());
    REQUIRE(q.status == QueryStatus::ok);
    CHECK(q.question.name == "a\\046b.org");
  }
  SUBCASE("spaces, '=', newlines and high bytes are escaped") {
    Wire w;
    w.header(1, 0, 1, 0).u8(5).u8('x').u8(' ').u8('=').u8('\n').u8(0xFF).name("org").u16(1).u16(1);
    ParsedQuery q = parse_query(w.bytes());
    REQUIRE(q.status == QueryStatus::ok);
    CHECK(q.question.name == "x\\032\\061\\010\\255.org");
  }
  SUBCASE("underscore and hyphen stay") {
    Wire w;
    w.header(1, 0, 1, 0).question("_sip._tcp.my-host.org");
    CHECK(parse_query(w.bytes()).question.name == "_sip._tcp.my-host.org");
  }
}

TEST_CASE("names: label and name length limits") {
  const std::string l63(63, 'a');
  SUBCASE("63-byte label is fine, 64 is an unsupported label type") {
    Wire ok;
    ok.header(1, 0, 1, 0).question(l63 + ".org");
    CHECK(parse_query(ok.bytes()).status == QueryStatus::ok);
    Wire bad;
    bad.header(1, 0, 1, 0).question(std::string(64, 'a') + ".org");
    CHECK(parse_query(bad.bytes()).status == QueryStatus::drop);
  }
  SUBCASE("255 wire bytes pass, 256 fail") {
    // 3 x 64 + 62 + 1 = 255: labels of 63,63,63,61 bytes.
    const std::string n255 = l63 + "." + l63 + "." + l63 + "." + std::string(61, 'b');
    Wire ok;
    ok.header(1, 0, 1, 0).question(n255);
    REQUIRE(parse_query(ok.bytes()).status == QueryStatus::ok);
    auto name = read_name(ok.bytes(), kHeaderSize);
    REQUIRE(name.ok());
    CHECK(name->end == kHeaderSize + 255);
    Wire bad;
    bad.header(1, 0, 1, 0).question(n255 + "b");
    CHECK(parse_query(bad.bytes()).status == QueryStatus::drop);
    auto r = read_name(bad.bytes(), kHeaderSize);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message.find("255") != std::string::npos);
  }
  SUBCASE("a long name built through pointers is still capped at 255") {
    Wire w;
    w.header(1, 0x8180, 0, 0);
    const std::size_t first = w.size();
    w.name(l63 + "." + l63);  // 129 bytes
    const std::size_t second = w.size();
    w.name(l63 + "." + l63, false).ptr(static_cast<std::uint16_t>(first));  // 128 + 129 = 257
    auto r = read_name(w.bytes(), second);
    CHECK_FALSE(r.ok());
  }
}

TEST_CASE("compression pointers") {
  Wire w;
  w.header(1, 0x8180, 1, 0).question("example.org");
  const std::size_t org = kHeaderSize + 8;  // "org" inside the question
  SUBCASE("backwards pointer into an earlier name") {
    const std::size_t at = w.size();
    w.name("www", false).ptr(static_cast<std::uint16_t>(kHeaderSize));
    auto n = read_name(w.bytes(), at);
    REQUIRE(n.ok());
    CHECK(n->text == "www.example.org");
    CHECK(n->end == w.size());
    CHECK(n->compressed);
  }
  SUBCASE("pointer into the middle of a name") {
    const std::size_t at = w.size();
    w.name("cdn", false).ptr(static_cast<std::uint16_t>(org));
    auto n = read_name(w.bytes(), at);
    REQUIRE(n.ok());
    CHECK(n->text == "cdn.org");
  }
  SUBCASE("chained pointers") {
    const std::size_t p1 = w.size();
    w.name("b", false).ptr(static_cast<std::uint16_t>(kHeaderSize));
    const std::size_t p2 = w.size();
    w.name("a", false).ptr(static_cast<std::uint16_t>(p1));
    auto n = read_name(w.bytes(), p2);
    REQUIRE(n.ok());
    CHECK(n->text == "a.b.example.org");
  }
  SUBCASE("forward pointer is rejected") {
    const std::size_t at = w.size();
    w.ptr(static_cast<std::uint16_t>(at + 2)).name("x");
    CHECK_FALSE(read_name(w.bytes(), at).ok());
  }
  SUBCASE("pointer to itself is rejected") {
    const std::size_t at = w.size();
    w.ptr(static_cast<std::uint16_t>(at));
    CHECK_FALSE(read_name(w.bytes(), at).ok());
  }
  SUBCASE("backward pointers that form a loop are rejected") {
    // label "a" at L, then a pointer at L+2 back to L: each jump is
    // backwards, yet following them never ends.
    const std::size_t l = w.size();
    w.name("a", false).ptr(static_cast<std::uint16_t>(l));
    CHECK_FALSE(read_name(w.bytes(), l).ok());
    // Two names pointing into each other.
    Wire v;
    v.header(1, 0, 0, 0);
    const std::size_t x = v.size();
    v.name("x", false).ptr(static_cast<std::uint16_t>(x + 6));  // x -> y (forward)
    v.name("y", false).ptr(static_cast<std::uint16_t>(x));      // y -> x (backward)
    CHECK_FALSE(read_name(v.bytes(), x).ok());
    CHECK_FALSE(read_name(v.bytes(), x + 4).ok());
  }
  SUBCASE("pointer past the end and truncated pointer") {
    const std::size_t at = w.size();
    w.u8(0xC0);
    CHECK_FALSE(read_name(w.bytes(), at).ok());
  }
  SUBCASE("label types 0x40 and 0x80 are rejected") {
    const std::size_t at = w.size();
    w.u8(0x41).u8(0).u8(0);
    CHECK_FALSE(read_name(w.bytes(), at).ok());
    Wire v;
    v.header(1, 0, 0, 0).u8(0x80).u8(0);
    CHECK_FALSE(read_name(v.bytes(), kHeaderSize).ok());
  }
}

namespace {

// www.example.org -> CNAME edge.cdn.net -> CNAME e1.cdn.net -> A x2, AAAA,
// plus records that do not chain from the query name, compressed names,
// and an OPT in the additional section.
Wire chain_answer(std::uint16_t id = 0x1234) {
  Wire w;
  w.header(id, kAnswerFlags, 1, 6, 0, 1).question("www.Example.org");
  const auto q = static_cast<std::uint16_t>(kHeaderSize);
  // A record for a name that is not in the chain (must be ignored).
  w.name("evil.org").a(6, 6, 6, 6);
  // CNAME www.example.org -> edge.cdn.net (owner by pointer, upper-case target).
  w.ptr(q).rr(qtype::CNAME, 60, 14);
  const auto edge = static_cast<std::uint16_t>(w.size());
  w.name("EDGE.cdn.net");
  // Final addresses come before the second CNAME: order must not matter.
  const auto e1_owner = static_cast<std::uint16_t>(w.size());
  w.name("e1", false).ptr(static_cast<std::uint16_t>(edge + 5)).a(192, 0, 2, 10, 20);
  w.ptr(e1_owner).aaaa_last(0x10, 0x80000001);  // TTL with the top bit: counts as 0
  // CNAME edge.cdn.net -> e1.cdn.net
  w.ptr(edge).rr(qtype::CNAME, 60, 2).ptr(e1_owner);
  w.ptr(e1_owner).a(192, 0, 2, 11, 30);
  w.u8(0).u16(qtype::OPT).u16(1232).u32(0).u16(0);
  return w;
}

}  // namespace

TEST_CASE("CNAME chain: only records chaining from the query name count") {
  Wire w = chain_answer();
  auto r = parse_answer(w.bytes(), "www.example.org");
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.error().message));
  CHECK(r->header.id == 0x1234);
  CHECK(r->question.name == "www.example.org");
  CHECK(r->question_end == kHeaderSize + 17 + 4);
  CHECK(r->chain == std::vector<std::string>{"www.example.org", "edge.cdn.net", "e1.cdn.net"});
  REQUIRE(r->addresses.size() == 3);
  CHECK(addr(r->addresses[0]) == "192.0.2.10");
  CHECK(r->addresses[0].ttl == 20);
  CHECK(addr(r->addresses[1]) == "2001:db8::10");
  CHECK(r->addresses[1].ttl == 0);
  CHECK(addr(r->addresses[2]) == "192.0.2.11");
  CHECK(r->chained_records == 5);  // 2 CNAMEs + 3 addresses; evil.org ignored
  CHECK_FALSE(r->chain_too_long);
}

TEST_CASE("CNAME chain: a record for another name, and a CNAME not from the chain, are ignored") {
  Wire w;
  w.header(1, kAnswerFlags, 1, 3).question("a.org");
  w.name("b.org").rr(qtype::CNAME, 60, 7).name("c.org");  // b -> c, not from a
  w.name("c.org").a(203, 0, 113, 9);
  w.name("a.org").a(198, 51, 100, 1);
  auto r = parse_answer(w.bytes(), "a.org");
  REQUIRE(r.ok());
  REQUIRE(r->addresses.size() == 1);
  CHECK(addr(r->addresses[0]) == "198.51.100.1");
  CHECK(r->chain.size() == 1);
}

TEST_CASE("CNAME chain: addresses of an intermediate name are not learned") {
  Wire w;
  w.header(1, kAnswerFlags, 1, 3).question("a.org");
  w.name("a.org").a(198, 51, 100, 1);  // not allowed next to a CNAME; never learned
  w.name("a.org").rr(qtype::CNAME, 60, 7).name("b.org");
  w.name("b.org").a(198, 51, 100, 2);
  auto r = parse_answer(w.bytes(), "a.org");
  REQUIRE(r.ok());
  REQUIRE(r->addresses.size() == 1);
  CHECK(addr(r->addresses[0]) == "198.51.100.2");
}

namespace {

// n0 -> n1 -> ... -> n<len>, then an A at the last name.
Wire chain_of(std::size_t len, bool loop = false) {
  Wire w;
  w.header(1, kAnswerFlags, 1, static_cast<std::uint16_t>(len + 1)).question("n0.org");
  for (std::size_t i = 0; i < len; ++i) {
    const std::string from = "n" + std::to_string(i) + ".org";
    const std::string to = loop && i + 1 == len ? "n0.org" : "n" + std::to_string(i + 1) + ".org";
    w.name(from).rr(qtype::CNAME, 60, static_cast<std::uint16_t>(to.size() + 2)).name(to);
  }
  w.name("n" + std::to_string(len) + ".org").a(192, 0, 2, 1);
  return w;
}

}  // namespace

TEST_CASE("CNAME chain is capped") {
  auto ok = parse_answer(chain_of(kMaxChain).bytes(), "n0.org");
  REQUIRE(ok.ok());
  CHECK_FALSE(ok->chain_too_long);
  CHECK(ok->addresses.size() == 1);
  CHECK(ok->chain.size() == kMaxChain + 1);

  auto longer = parse_answer(chain_of(kMaxChain + 1).bytes(), "n0.org");
  REQUIRE(longer.ok());
  CHECK(longer->chain_too_long);
  CHECK(longer->addresses.empty());

  auto loop = parse_answer(chain_of(2, true).bytes(), "n0.org");
  REQUIRE(loop.ok());
  CHECK(loop->chain_too_long);
  CHECK(loop->addresses.empty());
}

TEST_CASE("answers: bad shapes are errors") {
  SUBCASE("not a response") {
    Wire w;
    w.header(1, 0x0100, 1, 0).question("a.org");
    CHECK_FALSE(parse_answer(w.bytes(), "a.org").ok());
  }
  SUBCASE("qdcount 0") {
    Wire w;
    w.header(1, 0x8181, 0, 0);
    CHECK_FALSE(parse_answer(w.bytes(), "a.org").ok());
  }
  SUBCASE("A with 5 bytes at the chain end") {
    Wire w;
    w.header(1, kAnswerFlags, 1, 1).question("a.org").ptr(12).rr(qtype::A, 1, 5).u32(1).u8(1);
    CHECK_FALSE(parse_answer(w.bytes(), "a.org").ok());
  }
  SUBCASE("rdlength past the end") {
    Wire w;
    w.header(1, kAnswerFlags, 1, 1).question("a.org").ptr(12).rr(qtype::A, 1, 40).u32(1);
    CHECK_FALSE(parse_answer(w.bytes(), "a.org").ok());
  }
  SUBCASE("ancount larger than the records present") {
    Wire w;
    w.header(1, kAnswerFlags, 1, 3).question("a.org").ptr(12).a(1, 2, 3, 4);
    CHECK_FALSE(parse_answer(w.bytes(), "a.org").ok());
  }
  SUBCASE("NXDOMAIN with no records parses") {
    Wire w;
    w.header(1, 0x8183, 1, 0).question("a.org");
    auto r = parse_answer(w.bytes(), "a.org");
    REQUIRE(r.ok());
    CHECK(r->header.rcode() == Rcode::nxdomain);
    CHECK(r->addresses.empty());
  }
}

TEST_CASE("hostile input: every truncation and random corruption is handled without crashing") {
  const Wire base = chain_answer();
  const std::vector<std::uint8_t>& full = base.b;
  for (std::size_t n = 0; n <= full.size(); ++n) {
    Bytes prefix(full.data(), n);
    (void)parse_query(prefix);
    auto r = parse_answer(prefix, "www.example.org");
    if (n < full.size() - 11) CHECK_FALSE(r.ok());  // the OPT (last 11 bytes) is not read
    for (std::size_t off = 0; off <= n; ++off) (void)read_name(prefix, off);
    (void)question_end(prefix);
  }
  std::mt19937 rng(12345);
  std::size_t accepted = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<std::uint8_t> m = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) m[rng() % m.size()] = static_cast<std::uint8_t>(rng());
    if (rng() % 4 == 0) m.resize(rng() % (m.size() + 1));
    auto r = parse_answer(m, "www.example.org");
    if (r.ok()) {
      ++accepted;
      CHECK(r->addresses.size() <= 3);
      CHECK(r->chain.size() <= kMaxChain + 1);
    }
    ParsedQuery q = parse_query(m);
    CHECK(q.question_end <= m.size());
  }
  CHECK(accepted > 0);  // the corpus still exercises the success path
}

TEST_CASE("local answers echo ID, RD and the question") {
  Wire w;
  w.header(0xABCD, kQueryRD | 0x0010, 1, 0, 0, 1).question("Blocked.Example");
  w.u8(0).u16(qtype::OPT).u16(1232).u32(0).u16(0);
  ParsedQuery q = parse_query(w.bytes());
  REQUIRE(q.status == QueryStatus::ok);
  for (Rcode rc : {Rcode::refused, Rcode::nxdomain, Rcode::servfail, Rcode::formerr}) {
    auto out = make_local_answer(w.bytes(), q.header, q.question_end, rc);
    auto h = read_header(out);
    REQUIRE(h.has_value());
    CHECK(h->id == 0xABCD);
    CHECK(h->qr());
    CHECK(h->rd());
    CHECK((h->flags & 0x0080) != 0);  // RA
    CHECK((h->flags & 0x0010) != 0);  // CD echoed
    CHECK(h->rcode() == rc);
    CHECK(h->qdcount == 1);
    CHECK(h->ancount + h->nscount + h->arcount == 0);
    // The question bytes are the client's own (case included).
    CHECK(std::vector<std::uint8_t>(out.begin() + 12, out.end()) ==
          std::vector<std::uint8_t>(w.b.begin() + 12, w.b.begin() + static_cast<std::ptrdiff_t>(q.question_end)));
    auto back = parse_answer(out, "blocked.example");
    REQUIRE(back.ok());
    CHECK(back->question.name == "blocked.example");
  }
  SUBCASE("RD clear stays clear; FORMERR without a readable question has none") {
    Wire m;
    m.header(7, 0, 2, 0);
    ParsedQuery bad = parse_query(m.bytes());
    REQUIRE(bad.status == QueryStatus::formerr);
    auto out = make_local_answer(m.bytes(), bad.header, bad.question_end, Rcode::formerr);
    REQUIRE(out.size() == kHeaderSize);
    auto h = read_header(out);
    CHECK(h->id == 7);
    CHECK_FALSE(h->rd());
    CHECK(h->qdcount == 0);
    CHECK(h->rcode() == Rcode::formerr);
  }
}

TEST_CASE("upstream answers get the client's ID and question case back") {
  Wire client;
  client.header(0x1111, kQueryRD, 1, 0).question("WwW.ExAmple.ORG");
  Wire up = chain_answer(0x9999);
  auto parsed = parse_answer(up.bytes(), "www.example.org");
  REQUIRE(parsed.ok());
  std::vector<std::uint8_t> out = up.b;
  restore_client_view(out, parsed->question_end, 0x1111, Bytes(client.b).subspan(kHeaderSize));
  CHECK(read_header(out)->id == 0x1111);
  CHECK(std::equal(client.b.begin() + 12, client.b.end(), out.begin() + 12));
  // The records are untouched.
  CHECK(std::equal(up.b.begin() + static_cast<std::ptrdiff_t>(parsed->question_end), up.b.end(),
                   out.begin() + static_cast<std::ptrdiff_t>(parsed->question_end)));

  SUBCASE("a different question is left alone") {
    Wire other;
    other.header(0x2222, kQueryRD, 1, 0).question("www.example.net");
    std::vector<std::uint8_t> o2 = up.b;
    restore_client_view(o2, parsed->question_end, 0x2222, Bytes(other.b).subspan(kHeaderSize));
    CHECK(read_header(o2)->id == 0x2222);
    CHECK(std::equal(up.b.begin() + 2, up.b.end(), o2.begin() + 2));
  }
}

TEST_CASE("truncated answer for UDP keeps header and question, sets TC") {
  Wire up = chain_answer(0x4242);
  const std::size_t qend = question_end(up.bytes());
  REQUIRE(qend == kHeaderSize + 21);
  auto t = make_truncated(up.bytes(), Bytes(up.b).subspan(kHeaderSize, qend - kHeaderSize));
  auto h = read_header(t);
  REQUIRE(h.has_value());
  CHECK(h->id == 0x4242);
  CHECK(h->tc());
  CHECK(h->qr());
  CHECK(h->qdcount == 1);
  CHECK(h->ancount == 0);
  CHECK(t.size() == qend);
  CHECK(parse_answer(t, "www.example.org").ok());
}

TEST_CASE("build_query writes what parse_query reads") {
  auto q = build_query(0x0102, "pypi.org", qtype::AAAA);
  REQUIRE(q.ok());
  ParsedQuery p = parse_query(*q);
  REQUIRE(p.status == QueryStatus::ok);
  CHECK(p.header.id == 0x0102);
  CHECK(p.header.rd());
  CHECK(p.question.name == "pypi.org");
  CHECK(p.question.qtype == qtype::AAAA);

  auto esc = build_query(1, "a\\046b.org", qtype::A);
  REQUIRE(esc.ok());
  CHECK(parse_query(*esc).question.name == "a\\046b.org");

  CHECK_FALSE(build_query(1, "a..org", qtype::A).ok());
  CHECK_FALSE(build_query(1, ".org", qtype::A).ok());
  CHECK_FALSE(build_query(1, "org.", qtype::A).ok());
  CHECK_FALSE(build_query(1, std::string(64, 'a') + ".org", qtype::A).ok());
  CHECK_FALSE(build_query(1, "a\\99", qtype::A).ok());
  CHECK_FALSE(build_query(1, "a\\999", qtype::A).ok());
  std::string long_name;
  for (int i = 0; i < 5; ++i) long_name += std::string(60, 'x') + ".";
  long_name += "org";
  CHECK_FALSE(build_query(1, long_name, qtype::A).ok());
}

TEST_CASE("rebinding targets") {
  for (const char* yes : {"127.0.0.1", "127.255.0.9", "0.0.0.0", "0.1.2.3", "169.254.169.254", "169.254.0.1", "::1",
                          "::", "fe80::1", "febf::1", "fd00:ec2::254", "::ffff:127.0.0.1", "::ffff:169.254.169.254",
                          "::ffff:0.0.0.1", "::2"}) {
    INFO(yes);
    CHECK(is_rebinding_target(ip(yes)));
  }
  for (const char* no : {"192.0.2.1", "198.51.100.7", "128.0.0.1", "169.253.1.1", "2001:db8::1", "fec0::1",
                         "fd00:ec2::253", "::ffff:192.0.2.1"}) {
    INFO(no);
    CHECK_FALSE(is_rebinding_target(ip(no)));
  }
}

TEST_CASE("rcode names") {
  CHECK(to_string(Rcode::refused) == "REFUSED");
  CHECK(to_string(static_cast<Rcode>(9)) == "RCODE9");
}

// ---- issue 14: what egressd sends upstream and takes back ----------------

namespace {

std::array<std::uint8_t, kCaseBits> bits_of(std::uint8_t fill) {
  std::array<std::uint8_t, kCaseBits> b;
  b.fill(fill);
  return b;
}

// The question bytes of a message with qdcount 1.
std::vector<std::uint8_t> question_bytes(Bytes msg) {
  const std::size_t end = question_end(msg);
  REQUIRE(end > kHeaderSize);
  return {msg.begin() + kHeaderSize, msg.begin() + static_cast<std::ptrdiff_t>(end)};
}

}  // namespace

TEST_CASE("the forwarded query is rebuilt from the parsed question only") {
  // Everything a client may add: odd flags (AA, TC, AD, Z), additional
  // records, an OPT with DO and options (a cookie and a 600-byte padding).
  Wire w;
  w.header(0xBEEF, 0x0100 | 0x0400 | 0x0200 | 0x0040 | 0x0020 | 0x0010, 1, 0, 0, 3).question("Data.Pypi.ORG",
                                                                                           qtype::AAAA);
  w.name("smuggled.example").a(192, 0, 2, 99);
  w.name("more.example").rr(qtype::TXT, 60, 6).u8(5).u8('h').u8('e').u8('l').u8('l').u8('o');
  w.u8(0).u16(qtype::OPT).u16(1232).u32(0x8000).u16(12 + 604).u16(10).u16(8).u32(1).u32(2).u16(12).u16(600);
  for (int i = 0; i < 600; ++i) w.u8(0xAA);
  const ParsedQuery q = parse_query(w.bytes());
  REQUIRE(q.status == QueryStatus::ok);
  CHECK(q.edns);
  CHECK(q.dnssec_ok);

  const ForwardQuery f = build_forward_query(q, w.bytes(), 0x1234, bits_of(0x00));
  // Header: our ID, RD and CD from the client, nothing else; one question,
  // one additional record (the OPT).
  const auto h = read_header(f.wire);
  REQUIRE(h.has_value());
  CHECK(h->id == 0x1234);
  CHECK(h->flags == 0x0110);
  CHECK(h->qdcount == 1);
  CHECK(h->ancount == 0);
  CHECK(h->nscount == 0);
  CHECK(h->arcount == 1);
  // The question: same name (case as the bits say: all lower), type, class.
  Wire lower;
  lower.question("data.pypi.org", qtype::AAAA);
  CHECK(std::vector<std::uint8_t>(f.wire.begin() + 12, f.wire.begin() + static_cast<std::ptrdiff_t>(f.question_end)) ==
        lower.b);
  // A bare OPT: root owner, our payload size, DO copied, no options; and
  // nothing after it.
  Wire opt;
  opt.u8(0).u16(qtype::OPT).u16(kUpstreamPayload).u32(0x8000).u16(0);
  CHECK(std::vector<std::uint8_t>(f.wire.begin() + static_cast<std::ptrdiff_t>(f.question_end), f.wire.end()) ==
        opt.b);
  // It is a query egressd itself accepts.
  const ParsedQuery back = parse_query(f.wire);
  CHECK(back.status == QueryStatus::ok);
  CHECK(back.question.name == "data.pypi.org");

  SUBCASE("without DO and without EDNS in the client's query, the OPT has no DO") {
    Wire plain;
    plain.header(7, 0x0100, 1, 0).question("pypi.org");
    const ParsedQuery pq = parse_query(plain.bytes());
    REQUIRE(pq.status == QueryStatus::ok);
    CHECK_FALSE(pq.edns);
    const ForwardQuery pf = build_forward_query(pq, plain.bytes(), 9, bits_of(0xFF));
    CHECK(read_header(pf.wire)->arcount == 1);
    CHECK(pf.wire.size() == pf.question_end + 11);
    CHECK(pf.wire[pf.question_end + 7] == 0);  // DO clear
    CHECK(read_header(pf.wire)->flags == 0x0100);
  }
  SUBCASE("RD is set whatever the client asked: RD=0 would ask the upstream's cache, a bit the sandbox chose") {
    Wire norec;
    norec.header(7, 0x0010, 1, 0).question("pypi.org");
    const ParsedQuery nq = parse_query(norec.bytes());
    REQUIRE(nq.status == QueryStatus::ok);
    CHECK(read_header(build_forward_query(nq, norec.bytes(), 9, bits_of(0xFF)).wire)->flags == 0x0110);
  }
}

TEST_CASE("a query of another class than IN is not implemented: nothing of it is forwarded") {
  for (const std::uint16_t klass : {std::uint16_t{3}, std::uint16_t{4}, std::uint16_t{255}, std::uint16_t{0x1234},
                                    std::uint16_t{0}}) {
    INFO(klass);
    Wire w;
    w.header(7, 0x0100, 1, 0).name("pypi.org").u16(qtype::A).u16(klass);
    const ParsedQuery q = parse_query(w.bytes());
    CHECK(q.status == QueryStatus::notimp);
    CHECK(q.reason == "class " + std::to_string(klass) + " (only IN is answered)");
  }
}

TEST_CASE("0x20: each letter's case comes from one random bit; digits, hyphens and lengths stay") {
  Wire w;
  w.name("ab-1.cd");
  std::vector<std::uint8_t> name = w.b;
  std::array<std::uint8_t, kCaseBits> bits{};
  bits[0] = 0b00000101;  // bit k: the k-th byte of the name's labels
  apply_0x20(name, bits);
  Wire want;
  want.name("Ab-1.cd");
  CHECK(name.size() == want.b.size());
  // Bits: a=1 -> A, b=0, '-'=1 (not a letter), '1'=0, c=0, d=0.
  CHECK(name == std::vector<std::uint8_t>{4, 'A', 'b', '-', '1', 2, 'c', 'd', 0});
  apply_0x20(name, bits_of(0xFF));
  CHECK(name == std::vector<std::uint8_t>{4, 'A', 'B', '-', '1', 2, 'C', 'D', 0});
  apply_0x20(name, bits_of(0x00));
  CHECK(name == std::vector<std::uint8_t>{4, 'a', 'b', '-', '1', 2, 'c', 'd', 0});

  SUBCASE("random bits give a name that matches case-insensitively only") {
    std::mt19937 rng(14);
    Wire q;
    q.header(1, kQueryRD, 1, 0).question("files.pythonhosted.org");
    const ParsedQuery pq = parse_query(q.bytes());
    std::set<std::vector<std::uint8_t>> seen;
    for (int i = 0; i < 64; ++i) {
      std::array<std::uint8_t, kCaseBits> r;
      for (auto& b : r) b = static_cast<std::uint8_t>(rng());
      const ForwardQuery f = build_forward_query(pq, q.bytes(), 1, r);
      const ParsedQuery back = parse_query(f.wire);
      REQUIRE(back.status == QueryStatus::ok);
      CHECK(back.question.name == "files.pythonhosted.org");
      seen.insert(question_bytes(f.wire));
    }
    CHECK(seen.size() > 60);  // 20 letters: 2^20 patterns
  }
}

TEST_CASE("an answer is taken only when it echoes the query's ID and question bytes exactly") {
  Wire q;
  q.header(0x5151, kQueryRD, 1, 0).question("WwW.eXaMpLe.ORG");
  const auto question = question_bytes(q.b);
  auto answer = [](std::uint16_t id, std::string_view name, std::uint16_t type = qtype::A, std::uint16_t flags = 0x8180) {
    Wire a;
    a.header(id, flags, 1, 1).question(name, type).ptr(12).a(192, 0, 2, 1);
    return a.b;
  };
  CHECK(echoes_query(answer(0x5151, "WwW.eXaMpLe.ORG"), 0x5151, question));
  CHECK_FALSE(echoes_query(answer(0x5151, "www.example.org"), 0x5151, question));  // case lost: a forger's guess
  CHECK_FALSE(echoes_query(answer(0x5151, "WWW.EXAMPLE.ORG"), 0x5151, question));
  CHECK_FALSE(echoes_query(answer(0x5152, "WwW.eXaMpLe.ORG"), 0x5151, question));  // another ID
  CHECK_FALSE(echoes_query(answer(0x5151, "WwW.eXaMpLe.ORG", qtype::AAAA), 0x5151, question));
  CHECK_FALSE(echoes_query(answer(0x5151, "WwW.eXaMpLe.ORG", qtype::A, 0x0100), 0x5151, question));  // no QR
  CHECK_FALSE(echoes_query(Bytes(), 0x5151, question));
  auto cut = answer(0x5151, "WwW.eXaMpLe.ORG");
  cut.resize(20);
  CHECK_FALSE(echoes_query(cut, 0x5151, question));
}

TEST_CASE("TTLs are capped in every section, top-bit TTLs become 0, OPT untouched") {
  Wire w;
  w.header(1, 0x8180, 1, 2, 1, 2).question("x.example");
  w.ptr(12).a(192, 0, 2, 1, 0x7FFFFFFF);  // 2^31 - 1
  w.ptr(12).a(192, 0, 2, 2, 30);
  w.name("example").rr(qtype::NS, 0x80000000, 2).ptr(14);  // 2^31: RFC 2181 says 0
  w.name("ns.example").a(192, 0, 2, 53, 7200);
  w.u8(0).u16(qtype::OPT).u16(1232).u32(0x00008000).u16(0);
  std::vector<std::uint8_t> m = w.b;
  REQUIRE(cap_ttls(m, 3600).ok());
  std::vector<std::uint32_t> ttls;
  auto h = read_header(m);
  // Walk by hand: every record's TTL.
  std::size_t pos = question_end(m);
  for (int i = 0; i < h->ancount + h->nscount + h->arcount; ++i) {
    auto owner = read_name(m, pos);
    REQUIRE(owner.ok());
    const std::size_t p = owner->end;
    ttls.push_back((std::uint32_t{m[p + 4]} << 24) | (std::uint32_t{m[p + 5]} << 16) | (std::uint32_t{m[p + 6]} << 8) |
                   m[p + 7]);
    pos = p + 10 + ((m[p + 8] << 8) | m[p + 9]);
  }
  CHECK(ttls == std::vector<std::uint32_t>{3600, 30, 0, 3600, 0x8000});
  // parse_answer reads the capped value.
  auto parsed = parse_answer(m, "x.example");
  REQUIRE(parsed.ok());
  CHECK(parsed->addresses.at(0).ttl == 3600);

  SUBCASE("a message that cannot be walked is an error") {
    std::vector<std::uint8_t> cut(w.b.begin(), w.b.end() - 3);
    CHECK_FALSE(cap_ttls(cut, 3600).ok());
  }
}

TEST_CASE("an OPT at the end of an answer is removed for a client that sent none") {
  Wire w;
  w.header(1, 0x8180, 1, 1, 0, 1).question("x.example").ptr(12).a(192, 0, 2, 1);
  const std::size_t before_opt = w.size();
  w.u8(0).u16(qtype::OPT).u16(1232).u32(0).u16(0);
  std::vector<std::uint8_t> m = w.b;
  CHECK(strip_trailing_opt(m));
  CHECK(m.size() == before_opt);
  CHECK(read_header(m)->arcount == 0);
  CHECK(parse_answer(m, "x.example").ok());
  CHECK_FALSE(strip_trailing_opt(m));  // none left

  SUBCASE("an OPT followed by another record is left alone") {
    Wire o;
    o.header(1, 0x8180, 1, 0, 0, 2).question("x.example");
    o.u8(0).u16(qtype::OPT).u16(1232).u32(0).u16(0);
    o.name("ns.example").a(192, 0, 2, 53);
    std::vector<std::uint8_t> om = o.b;
    CHECK_FALSE(strip_trailing_opt(om));
    CHECK(om == o.b);
  }
}

TEST_CASE("learn guards: ranges, embedded IPv4 forms, and private ranges only for wildcard matches") {
  struct Case {
    const char* addr;
    const char* range;     // "" when learnable
    bool private_range;
    const char* embedded;  // "" when not embedded
  };
  const Case cases[] = {
      {"255.255.255.255", "255.255.255.255 (broadcast)", false, ""},
      {"224.0.0.251", "224.0.0.0/4 (multicast)", false, ""},
      {"239.255.255.250", "224.0.0.0/4 (multicast)", false, ""},
      {"240.0.0.1", "240.0.0.0/4 (reserved)", false, ""},
      {"169.254.169.254", "169.254.169.254 (cloud metadata)", false, ""},
      {"127.0.0.53", "127.0.0.0/8 (loopback)", false, ""},
      {"10.1.2.3", "10.0.0.0/8 (private)", true, ""},
      {"172.16.0.1", "172.16.0.0/12 (private)", true, ""},
      {"172.31.255.255", "172.16.0.0/12 (private)", true, ""},
      {"172.32.0.1", "", false, ""},
      {"192.168.1.1", "192.168.0.0/16 (private)", true, ""},
      {"100.64.0.1", "100.64.0.0/10 (shared, CGNAT)", true, ""},
      {"100.100.100.200", "100.64.0.0/10 (shared, CGNAT)", true, ""},  // Alibaba Cloud metadata
      {"100.128.0.1", "", false, ""},
      {"198.51.100.7", "", false, ""},
      {"ff02::1", "ff00::/8 (multicast)", false, ""},
      {"fd12:3456::1", "fc00::/7 (private, unique local)", true, ""},
      {"fd00:ec2::254", "fd00:ec2::254 (cloud metadata)", false, ""},
      {"2001:db8::1", "", false, ""},
      // IPv4 in IPv6: judged by the IPv4 address.
      {"::ffff:10.0.0.1", "10.0.0.0/8 (private)", true, "IPv4-mapped ::ffff:0:0/96"},
      {"::ffff:0:127.0.0.1", "127.0.0.0/8 (loopback)", false, "IPv4-translated ::ffff:0:0:0/96"},
      {"::169.254.169.254", "169.254.169.254 (cloud metadata)", false, "IPv4-compatible ::/96"},
      {"64:ff9b::a9fe:a9fe", "169.254.169.254 (cloud metadata)", false, "NAT64 64:ff9b::/96"},
      {"64:ff9b::7f00:1", "127.0.0.0/8 (loopback)", false, "NAT64 64:ff9b::/96"},
      {"64:ff9b::ffff:ffff", "255.255.255.255 (broadcast)", false, "NAT64 64:ff9b::/96"},
      {"64:ff9b::c0a8:101", "192.168.0.0/16 (private)", true, "NAT64 64:ff9b::/96"},
      {"64:ff9b::c633:6407", "", false, ""},
      // The local-use NAT64 prefix: its layout is the operator's, none of it is learned
      // (169.254.169.254 as a /96 and as a /48 layout, and a public address).
      {"64:ff9b:1::a9fe:a9fe", "64:ff9b:1::/48 (local-use NAT64: the IPv4 address it carries cannot be told)", false, ""},
      {"64:ff9b:1:a9fe:a9:fe00::", "64:ff9b:1::/48 (local-use NAT64: the IPv4 address it carries cannot be told)", false, ""},
      {"64:ff9b:1::c633:6407", "64:ff9b:1::/48 (local-use NAT64: the IPv4 address it carries cannot be told)", false, ""},
      {"64:ff9b:2::c633:6407", "", false, ""},
      {"2002:7f00:1::1", "127.0.0.0/8 (loopback)", false, "6to4 2002::/16"},
      {"2002:a00:1::", "10.0.0.0/8 (private)", true, "6to4 2002::/16"},
      {"2002:c633:6407::1", "", false, ""},
      // Teredo: the client's IPv4 address, inverted, in the last 32 bits (127.0.0.1 -> 80ff:fffe).
      {"2001:0:c000:201::80ff:fffe", "127.0.0.0/8 (loopback)", false, "Teredo 2001::/32"},
  };
  for (const Case& c : cases) {
    INFO(c.addr);
    const auto g = learn_guard(ip(c.addr));
    if (std::string_view(c.range).empty()) {
      CHECK_FALSE(g.has_value());
      CHECK_FALSE(guard_for(ip(c.addr), false, PrivateAnswers::exact).has_value());
      continue;
    }
    REQUIRE(g.has_value());
    CHECK(g->range == c.range);
    CHECK(g->private_range == c.private_range);
    CHECK(g->embedded == c.embedded);
    // Exact names keep private answers (Compose service names); wildcard
    // matches lose them unless private_answers is allow; the rest is never learned.
    CHECK(guard_for(ip(c.addr), true, PrivateAnswers::exact).has_value() == !c.private_range);
    CHECK(guard_for(ip(c.addr), false, PrivateAnswers::exact).has_value());
    CHECK(guard_for(ip(c.addr), false, PrivateAnswers::allow).has_value() == !c.private_range);
    CHECK(is_rebinding_target(ip(c.addr)) == !c.private_range);
  }
  CHECK(learn_guard(ip("64:ff9b::7f00:1"))->to_string() == "127.0.0.0/8 (loopback) in NAT64 64:ff9b::/96");
}

TEST_CASE("a TTL that a compression pointer points into is not rewritten into a different name") {
  // Found by dns_message_fuzz: record 2's owner points at record 1's TTL,
  // whose bytes 01 61 00 00 read as the name "a". Capping that TTL would
  // rename record 2; the message is refused instead.
  Wire w;
  w.header(1, 0x8180, 1, 2).question("x.example");
  const std::size_t ttl_at = w.size() + 2 + 4;  // pointer (2) + type/class (4)
  // TTL bytes: label of length 1 "a", then the root: reads as the name "a".
  w.ptr(12).rr(qtype::A, (1u << 24) | ('a' << 16), 4).u8(192).u8(0).u8(2).u8(1);
  w.ptr(static_cast<std::uint16_t>(ttl_at)).a(192, 0, 2, 2);
  std::vector<std::uint8_t> m = w.b;
  REQUIRE(read_name(m, ttl_at).ok());
  CHECK(read_name(m, ttl_at)->text == "a");
  // The TTL (0x01610000, about 6 months) must be capped, which would rename record 2.
  CHECK_FALSE(cap_ttls(m, 3600).ok());
  // Below the cap nothing changes and all is well.
  std::vector<std::uint8_t> m2 = w.b;
  CHECK(cap_ttls(m2, 0x7FFFFFFF).ok());
  CHECK(m2 == w.b);
}
