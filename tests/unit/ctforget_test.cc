// The ctnetlink message ConntrackForgetter sends (src/daemon/ctforget.h),
// parsed back with libmnl: a delete request for exactly one UDP tuple.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <libmnl/libmnl.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_conntrack.h>
#include <netinet/in.h>

#include <map>
#include <vector>

#include "daemon/ctforget.h"

using namespace egressd;

namespace {

dns::FlowTuple tuple(const char* src, std::uint16_t sport, const char* dst, std::uint16_t dport) {
  dns::FlowTuple t;
  t.src = *parse_ip(src);
  t.dst = *parse_ip(dst);
  t.sport = sport;
  t.dport = dport;
  return t;
}

// Attribute type -> payload of the attributes nested in `nest`.
// The attributes in [begin, end), by type (libmnl's iteration macros are C only).
std::map<int, const nlattr*> attrs(const void* begin, const void* end) {
  std::map<int, const nlattr*> out;
  auto* a = static_cast<nlattr*>(const_cast<void*>(begin));
  const auto left = [&] { return static_cast<int>(static_cast<const char*>(end) - reinterpret_cast<const char*>(a)); };
  for (; mnl_attr_ok(a, left()); a = mnl_attr_next(a)) out[mnl_attr_get_type(a)] = a;
  return out;
}

std::map<int, const nlattr*> children(const nlattr* nest) {
  const void* p = mnl_attr_get_payload(nest);
  return attrs(p, static_cast<const char*>(p) + mnl_attr_get_payload_len(nest));
}

}  // namespace

TEST_CASE("a delete request for one UDP tuple, IPv4 and IPv6, several in one batch") {
  std::vector<std::uint8_t> batch;
  daemon::ConntrackForgetter::append_delete(batch, tuple("192.0.2.2", 40001, "192.0.2.1", 53), 7);
  daemon::ConntrackForgetter::append_delete(batch, tuple("2001:db8:1::2", 40002, "2001:db8:1::1", 53), 8);
  int len = static_cast<int>(batch.size());
  int n = 0;
  for (auto* h = reinterpret_cast<nlmsghdr*>(batch.data()); mnl_nlmsg_ok(h, len); h = mnl_nlmsg_next(h, &len), ++n) {
    const bool v6 = n == 1;
    CHECK(h->nlmsg_type == ((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE));
    CHECK(h->nlmsg_flags == NLM_F_REQUEST);
    CHECK(h->nlmsg_seq == static_cast<std::uint32_t>(7 + n));
    const auto* nfg = static_cast<const nfgenmsg*>(mnl_nlmsg_get_payload(h));
    CHECK(nfg->nfgen_family == (v6 ? AF_INET6 : AF_INET));
    auto top = attrs(mnl_nlmsg_get_payload_offset(h, sizeof(nfgenmsg)), mnl_nlmsg_get_payload_tail(h));
    REQUIRE(top.size() == 1);
    REQUIRE(top.count(CTA_TUPLE_ORIG) == 1);
    auto tup = children(top[CTA_TUPLE_ORIG]);
    REQUIRE(tup.count(CTA_TUPLE_IP) == 1);
    REQUIRE(tup.count(CTA_TUPLE_PROTO) == 1);
    auto ip = children(tup[CTA_TUPLE_IP]);
    auto proto = children(tup[CTA_TUPLE_PROTO]);
    char text[INET6_ADDRSTRLEN];
    if (v6) {
      inet_ntop(AF_INET6, mnl_attr_get_payload(ip.at(CTA_IP_V6_SRC)), text, sizeof text);
      CHECK(std::string(text) == "2001:db8:1::2");
      inet_ntop(AF_INET6, mnl_attr_get_payload(ip.at(CTA_IP_V6_DST)), text, sizeof text);
      CHECK(std::string(text) == "2001:db8:1::1");
    } else {
      inet_ntop(AF_INET, mnl_attr_get_payload(ip.at(CTA_IP_V4_SRC)), text, sizeof text);
      CHECK(std::string(text) == "192.0.2.2");
      inet_ntop(AF_INET, mnl_attr_get_payload(ip.at(CTA_IP_V4_DST)), text, sizeof text);
      CHECK(std::string(text) == "192.0.2.1");
    }
    CHECK(mnl_attr_get_u8(proto.at(CTA_PROTO_NUM)) == IPPROTO_UDP);
    CHECK(ntohs(mnl_attr_get_u16(proto.at(CTA_PROTO_SRC_PORT))) == (v6 ? 40002 : 40001));
    CHECK(ntohs(mnl_attr_get_u16(proto.at(CTA_PROTO_DST_PORT))) == 53);
  }
  CHECK(n == 2);
}
