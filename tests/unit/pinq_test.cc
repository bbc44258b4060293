// Hostname pinning's reassembly and verdicts (daemon/pinq.h, PinFlows): no sockets.
#include <doctest/doctest.h>

#include "daemon/pinq.h"

using namespace egressd;
using namespace egressd::daemon;

namespace {

struct Judge : PinJudge, pin::PinFacts {
  std::vector<std::string> learned{"allowed.test"};
  Entry entry;
  std::vector<std::string> reasons;
  const pin::PinFacts& pin_facts() const override { return *this; }
  std::uint32_t pass_mark() const override { return 1; }
  void pin_decided(const pin::Decision& d, const IpPrefix&, std::uint16_t) override { reasons.push_back(d.reason); }
  std::vector<std::string> names_for(const IpPrefix&) const override { return learned; }
  const Entry* allowed(std::string_view name) const override { return name == "allowed.test" ? &entry : nullptr; }
};

TcpSegment seg(std::uint32_t seq, const std::string& bytes, std::uint16_t sport = 40000) {
  TcpSegment s;
  s.src = *parse_ip("192.0.2.2");
  s.dst = *parse_ip("203.0.113.10");
  s.sport = sport;
  s.dport = 80;
  s.seq = seq;
  s.payload = {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()};
  return s;
}

using K = PinVerdict::Kind;
const auto t0 = PinFlows::Clock::time_point{} + std::chrono::hours(1);

}  // namespace

TEST_CASE("a request split over segments is held, then judged whole; all held packets get the verdict") {
  Judge j;
  PinFlows f(j);
  const std::string a = "GET / HTTP/1.1\r\nHo", b = "st: allowed.test\r\n\r\n";
  CHECK(f.packet(1, seg(1000, a), t0).empty());
  CHECK(f.stats().held == 1);
  const auto v = f.packet(2, seg(1000 + a.size(), b), t0);
  REQUIRE(v.size() == 2);
  CHECK((v[0].packet_id == 1 && v[0].kind == K::admit && v[1].packet_id == 2 && v[1].kind == K::admit));
  CHECK(f.stats().admitted == 1);
  CHECK(f.stats().held == 0);
}

TEST_CASE("out of order and duplicate segments are put in order by sequence number") {
  Judge j;
  PinFlows f(j);
  const std::string a = "GET / HTTP/1.1\r\n", b = "Host: same-ip.test\r\n\r\n";
  // The handshake's ACK (no payload) passes and marks where the stream starts.
  CHECK(f.packet(1, seg(5000, ""), t0)[0].kind == K::pass);
  CHECK(f.packet(2, seg(5000 + a.size(), b), t0).empty());  // the second half first
  CHECK(f.packet(3, seg(5000 + a.size(), b), t0).empty());  // and again
  const auto v = f.packet(4, seg(5000, a), t0);
  REQUIRE(v.size() == 3);
  CHECK(v[0].kind == K::reset);  // one reset answers the client
  CHECK((v[1].kind == K::drop && v[2].kind == K::drop));
  REQUIRE(j.reasons.size() == 1);
  CHECK(j.reasons[0] == "http host same-ip.test to 203.0.113.10:80; address learned for allowed.test");
}

TEST_CASE("payload-less packets pass without deciding; other protocols are admitted") {
  Judge j;
  PinFlows f(j);
  const auto ack = f.packet(1, seg(1, ""), t0);
  REQUIRE(ack.size() == 1);
  CHECK(ack[0].kind == K::pass);
  CHECK(f.stats().inspected == 0);
  const auto ssh = f.packet(2, seg(1, "SSH-2.0-OpenSSH_9.2\r\n"), t0);
  REQUIRE(ssh.size() == 1);
  CHECK(ssh[0].kind == K::admit);
  // A straggler of a decided flow gets the same answer.
  CHECK(f.packet(3, seg(1, "SSH-2.0-OpenSSH_9.2\r\n"), t0)[0].kind == K::admit);
}

TEST_CASE("a flow that never completes its first bytes is reset after the hold time") {
  Judge j;
  PinFlows f(j);
  CHECK(f.packet(1, seg(1, "GET / HTTP/1.1\r\n"), t0).empty());
  CHECK(f.expire(t0 + std::chrono::milliseconds(1999)).empty());
  REQUIRE(f.next_deadline().has_value());
  const auto v = f.expire(t0 + kHoldTime);
  REQUIRE(v.size() == 1);
  CHECK(v[0].kind == K::reset);
  CHECK(j.reasons.back() == "no decision within 2 seconds");
  CHECK(f.stats().reset == 1);
}

TEST_CASE("parse_tcp_packet reads IPv4 and refuses fragments and truncation") {
  std::vector<std::uint8_t> p(40 + 3, 0);
  p[0] = 0x45;
  p[3] = static_cast<std::uint8_t>(p.size());
  p[9] = 6;
  p[12] = 192, p[13] = 0, p[14] = 2, p[15] = 2;
  p[16] = 203, p[17] = 0, p[18] = 113, p[19] = 10;
  p[22] = 0x01, p[23] = 0xbb;  // dport 443
  p[24] = 0, p[27] = 7;        // seq 7
  p[32] = 0x50;                // doff 5
  p[40] = 'a', p[41] = 'b', p[42] = 'c';
  auto s = parse_tcp_packet(p);
  REQUIRE(s.has_value());
  CHECK(s->dport == 443);
  CHECK(s->seq == 7);
  CHECK(s->payload.size() == 3);
  p[6] = 0x20;  // more fragments
  CHECK_FALSE(parse_tcp_packet(p).has_value());
  p[6] = 0;
  CHECK_FALSE(parse_tcp_packet(std::span(p).first(30)).has_value());
}
