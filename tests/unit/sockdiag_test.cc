// Which flows the reaper keeps after a switch (src/daemon/sockdiag.cc,
// flow_may_survive): it destroys only sockets whose flows the new phase cuts.
#include <doctest/doctest.h>

#include "daemon/sockdiag.h"

using namespace egressd;
using namespace egressd::daemon;

namespace {

Phase phase(Mode mode, const std::vector<std::string>& entries) {
  auto p = make_inline_phase("p", mode, entries);
  REQUIRE(p.ok());
  return *p;
}

FlowInfo flow(const char* ip, std::uint16_t port, bool udp = false, bool inbound = false) {
  auto a = parse_ip(ip);
  REQUIRE(a.has_value());
  return FlowInfo{*a, port, inbound, udp};
}

}  // namespace

TEST_CASE("no-network aborts outbound flows but keeps loopback") {
  const Phase p = phase(Mode::no_network, {});
  CHECK_FALSE(flow_may_survive(p, flow("192.0.2.10", 443), true, true));
  CHECK_FALSE(flow_may_survive(p, flow("2001:db8::10", 443, true), true, true));
  CHECK(flow_may_survive(p, flow("127.0.0.1", 8080), true, true));
  CHECK(flow_may_survive(p, flow("::1", 8080), true, true));
}

TEST_CASE("DNS to port 53 survives a switch while the proxy redirects it") {
  // The redirect sends every query to egressd's proxy, which answers it under
  // the new phase (REFUSED in no-network): a lookup in flight at the switch
  // must get that answer, not ECONNABORTED.
  const Phase none = phase(Mode::no_network, {});
  const Phase allow = phase(Mode::allowlist, {"198.51.100.0/24"});
  for (const Phase* p : {&none, &allow}) {
    CHECK(flow_may_survive(*p, flow("192.0.2.1", 53, true), true, true));
    CHECK(flow_may_survive(*p, flow("192.0.2.1", 53, false), true, true));
    CHECK(flow_may_survive(*p, flow("2001:db8::1", 53, true), true, true));
    // Not to other ports of the same server.
    CHECK_FALSE(flow_may_survive(*p, flow("192.0.2.1", 853), true, true));
    CHECK_FALSE(flow_may_survive(*p, flow("192.0.2.1", 5353, true), true, true));
  }
  // Without the proxy (--dns-port 0) port 53 is an ordinary destination.
  CHECK_FALSE(flow_may_survive(none, flow("192.0.2.1", 53, true), true, false));
  CHECK_FALSE(flow_may_survive(allow, flow("192.0.2.1", 53, false), true, false));
  CHECK(flow_may_survive(allow, flow("198.51.100.53", 53, true), true, false));
}

TEST_CASE("an inbound flow follows inbound_replies, even from a peer's port 53") {
  const Phase p = phase(Mode::no_network, {});
  CHECK(flow_may_survive(p, flow("192.0.2.9", 53, false, true), true, true));
  CHECK_FALSE(flow_may_survive(p, flow("192.0.2.9", 53, false, true), false, true));
}

TEST_CASE("allowlist keeps allowed addresses and, with hostname entries, every peer") {
  const Phase ips = phase(Mode::allowlist, {"198.51.100.0/24", "2001:db8::1"});
  CHECK(flow_may_survive(ips, flow("198.51.100.7", 443), true, true));
  CHECK(flow_may_survive(ips, flow("2001:db8::1", 443), true, true));
  CHECK_FALSE(flow_may_survive(ips, flow("203.0.113.7", 443), true, true));
  const Phase names = phase(Mode::allowlist, {"pypi.org"});
  CHECK(flow_may_survive(names, flow("203.0.113.7", 443), true, true));
}
