// rtnetlink parsing for the interface watch: which links get an egress chain,
// which IPv6 routes make a prefix on-link. Messages built by hand as the
// kernel sends them; no root needed.
#include <doctest/doctest.h>
#include <libmnl/libmnl.h>
#include <linux/if.h>
#include <linux/rtnetlink.h>
#include <sys/socket.h>

#include <cstring>
#include <vector>

#include "daemon/netwatch.h"

using namespace egressd;
using namespace egressd::daemon;

namespace {

struct Msg {
  std::vector<char> buf = std::vector<char>(MNL_SOCKET_BUFFER_SIZE);
  nlmsghdr* nlh = mnl_nlmsg_put_header(buf.data());
};

Msg link(int index, const char* name, unsigned flags) {
  Msg m;
  m.nlh->nlmsg_type = RTM_NEWLINK;
  auto* ifi = static_cast<ifinfomsg*>(mnl_nlmsg_put_extra_header(m.nlh, sizeof(ifinfomsg)));
  ifi->ifi_family = AF_UNSPEC;
  ifi->ifi_index = index;
  ifi->ifi_flags = flags;
  mnl_attr_put_strz(m.nlh, IFLA_IFNAME, name);
  return m;
}

Msg route6(const char* dst, int len, int oif, unsigned char type = RTN_UNICAST, const char* gateway = nullptr) {
  Msg m;
  m.nlh->nlmsg_type = RTM_NEWROUTE;
  auto* rt = static_cast<rtmsg*>(mnl_nlmsg_put_extra_header(m.nlh, sizeof(rtmsg)));
  rt->rtm_family = AF_INET6;
  rt->rtm_dst_len = static_cast<unsigned char>(len);
  rt->rtm_type = type;
  rt->rtm_table = RT_TABLE_MAIN;
  if (len > 0) mnl_attr_put(m.nlh, RTA_DST, 16, parse_ip(dst)->bytes.data());
  if (gateway != nullptr) mnl_attr_put(m.nlh, RTA_GATEWAY, 16, parse_ip(gateway)->bytes.data());
  mnl_attr_put_u32(m.nlh, RTA_OIF, static_cast<std::uint32_t>(oif));
  return m;
}

}  // namespace

TEST_CASE("links: name, index, and whether it is a loopback") {
  auto l = parse_link(link(2, "eth0", IFF_UP | IFF_BROADCAST).nlh);
  REQUIRE(l.has_value());
  CHECK(l->index == 2);
  CHECK(l->name == "eth0");
  CHECK_FALSE(l->loopback);
  auto lo = parse_link(link(1, "lo", IFF_UP | IFF_LOOPBACK).nlh);
  REQUIRE(lo.has_value());
  CHECK(lo->loopback);
  Msg other;
  other.nlh->nlmsg_type = RTM_DELLINK;
  mnl_nlmsg_put_extra_header(other.nlh, sizeof(ifinfomsg));
  CHECK_FALSE(parse_link(other.nlh).has_value());
}

TEST_CASE("on-link IPv6 prefixes: unicast routes without a gateway through a non-loopback device") {
  const std::vector<int> lo{1};
  auto p = parse_onlink6_route(route6("2001:db8:1::", 64, 2).nlh, lo);
  REQUIRE(p.has_value());
  CHECK(p->to_string() == "2001:db8:1::/64");
  // A default route without a gateway: everything is on-link there.
  auto all = parse_onlink6_route(route6("::", 0, 2).nlh, lo);
  REQUIRE(all.has_value());
  CHECK(all->prefix_len == 0);
  // Via a gateway, on loopback, local/multicast types, link-local and multicast prefixes: no.
  CHECK_FALSE(parse_onlink6_route(route6("::", 0, 2, RTN_UNICAST, "2001:db8:1::1").nlh, lo).has_value());
  CHECK_FALSE(parse_onlink6_route(route6("2001:db8:9::", 64, 1).nlh, lo).has_value());
  CHECK_FALSE(parse_onlink6_route(route6("2001:db8:1::2", 128, 2, RTN_LOCAL).nlh, lo).has_value());
  CHECK_FALSE(parse_onlink6_route(route6("ff00::", 8, 2, RTN_MULTICAST).nlh, lo).has_value());
  CHECK_FALSE(parse_onlink6_route(route6("fe80::", 64, 2).nlh, lo).has_value());
  CHECK_FALSE(parse_onlink6_route(link(2, "eth0", 0).nlh, lo).has_value());
}

TEST_CASE("a link or route notification makes the watch dump again; others do not") {
  Msg m = link(2, "eth0", 0);
  CHECK(changes_view(m.nlh));
  m.nlh->nlmsg_type = RTM_DELLINK;
  CHECK(changes_view(m.nlh));
  Msg r = route6("2001:db8::", 64, 2);
  CHECK(changes_view(r.nlh));
  r.nlh->nlmsg_type = RTM_DELROUTE;
  CHECK(changes_view(r.nlh));
  // An address or a neighbour entry changes neither the interfaces nor the
  // on-link routes (an address's prefix route comes as its own RTM_NEWROUTE).
  for (std::uint16_t type : {RTM_NEWADDR, RTM_DELADDR, RTM_NEWNEIGH, RTM_NEWNSID}) {
    m.nlh->nlmsg_type = type;
    CHECK_FALSE(changes_view(m.nlh));
  }
}
