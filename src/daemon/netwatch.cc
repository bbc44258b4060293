#include "daemon/netwatch.h"

#include <libmnl/libmnl.h>
#include <linux/if.h>
#include <linux/rtnetlink.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <tuple>

namespace egressd::daemon {

namespace {

constexpr int kReplyTimeoutMs = 2000;
constexpr int kDumpAttempts = 8;

}  // namespace

std::optional<LinkInfo> parse_link(const nlmsghdr* nlh) {
  if (nlh->nlmsg_type != RTM_NEWLINK || nlh->nlmsg_len < NLMSG_LENGTH(sizeof(ifinfomsg))) return std::nullopt;
  const auto* ifi = static_cast<const ifinfomsg*>(mnl_nlmsg_get_payload(nlh));
  std::array<const nlattr*, IFLA_IFNAME + 1> tb;
  (void)nft::attr_table(nlh, sizeof(ifinfomsg), tb);
  const nlattr* name = tb[IFLA_IFNAME];
  if (name == nullptr || mnl_attr_validate(name, MNL_TYPE_NUL_STRING) < 0) return std::nullopt;
  LinkInfo l;
  l.index = ifi->ifi_index;
  l.name = mnl_attr_get_str(name);
  l.loopback = (ifi->ifi_flags & IFF_LOOPBACK) != 0;
  if (l.name.empty() || l.index <= 0) return std::nullopt;
  return l;
}

std::optional<IpPrefix> parse_onlink6_route(const nlmsghdr* nlh, const std::vector<int>& loopback_ifindexes) {
  if (nlh->nlmsg_type != RTM_NEWROUTE || nlh->nlmsg_len < NLMSG_LENGTH(sizeof(rtmsg))) return std::nullopt;
  const auto* rt = static_cast<const rtmsg*>(mnl_nlmsg_get_payload(nlh));
  if (rt->rtm_family != AF_INET6 || rt->rtm_type != RTN_UNICAST || rt->rtm_dst_len > 128) return std::nullopt;
  std::array<const nlattr*, RTA_MULTIPATH + 1> tb;
  (void)nft::attr_table(nlh, sizeof(rtmsg), tb);
  if (tb[RTA_GATEWAY] != nullptr || tb[RTA_MULTIPATH] != nullptr) return std::nullopt;
  const nlattr* oif = tb[RTA_OIF];
  if (oif == nullptr || mnl_attr_validate(oif, MNL_TYPE_U32) < 0) return std::nullopt;
  const int index = static_cast<int>(mnl_attr_get_u32(oif));
  if (std::find(loopback_ifindexes.begin(), loopback_ifindexes.end(), index) != loopback_ifindexes.end()) {
    return std::nullopt;
  }
  IpPrefix p;
  p.family = 6;
  p.prefix_len = rt->rtm_dst_len;
  if (const nlattr* dst = tb[RTA_DST]; dst != nullptr) {
    if (mnl_attr_get_payload_len(dst) != 16) return std::nullopt;
    std::memcpy(p.bytes.data(), mnl_attr_get_payload(dst), 16);
  } else if (p.prefix_len != 0) {
    return std::nullopt;
  }
  // Host bits are zero in a route, but do not rely on it.
  for (std::size_t bit = p.prefix_len; bit < 128; ++bit) {
    p.bytes[bit / 8] &= static_cast<std::uint8_t>(~(0x80u >> (bit % 8)));
  }
  const bool link_local = p.prefix_len >= 10 && p.bytes[0] == 0xfe && (p.bytes[1] & 0xc0) == 0x80;
  const bool multicast = p.prefix_len >= 8 && p.bytes[0] == 0xff;
  if (link_local || multicast) return std::nullopt;
  return p;
}

bool changes_view(const nlmsghdr* nlh) {
  switch (nlh->nlmsg_type) {
    case RTM_NEWLINK:
    case RTM_DELLINK:
    case RTM_NEWROUTE:
    case RTM_DELROUTE:
      return true;
    default:
      return false;
  }
}

Result<NetWatch> NetWatch::open() {
  nft::TransportOptions rq;
  rq.protocol = NETLINK_ROUTE;
  rq.what = "rtnetlink";
  auto requests = nft::Transport::open(std::move(rq));
  if (!requests) return requests.error();
  return NetWatch(std::move(*requests));
}

Status NetWatch::dump_request(std::uint16_t type, std::uint8_t family, const std::function<void()>& reset,
                              const std::function<void(const nlmsghdr*)>& on_msg) {
  for (int attempt = 0; attempt < kDumpAttempts; ++attempt) {
    reset();
    char req[NLMSG_SPACE(sizeof(rtgenmsg)) + 64] = {};
    nlmsghdr* nlh = mnl_nlmsg_put_header(req);
    nlh->nlmsg_type = type;
    nlh->nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
    // rtgenmsg is enough for a dump (the kernel reads only the family).
    auto* g = static_cast<rtgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(rtgenmsg)));
    g->rtgen_family = family;
    // A dump interrupted by a change (or whose replies were lost) is
    // started over, from `reset`.
    const int err = requests_->request(nlh, on_msg, std::chrono::milliseconds(kReplyTimeoutMs));
    if (err == 0) return {};
    if (err == ETIMEDOUT) return Error::runtime("rtnetlink dump: no answer within 2 s");
    if (err != EINTR) return errno_error("rtnetlink dump", err);
  }
  return Error::runtime("rtnetlink dump: interrupted by changes " + std::to_string(kDumpAttempts) + " times");
}

Result<NetworkView> NetWatch::dump() {
  std::vector<LinkInfo> links;
  auto st = dump_request(RTM_GETLINK, AF_UNSPEC, [&] { links.clear(); }, [&](const nlmsghdr* nlh) {
    if (auto l = parse_link(nlh)) links.push_back(std::move(*l));
  });
  if (!st) return st.error().wrap("list interfaces");
  std::vector<int> loopbacks;
  NetworkView view;
  for (const auto& l : links) {
    if (l.loopback) {
      loopbacks.push_back(l.index);
    } else {
      view.interfaces.push_back(l.name);
    }
  }
  st = dump_request(RTM_GETROUTE, AF_INET6, [&] { view.onlink6.clear(); }, [&](const nlmsghdr* nlh) {
    if (auto p = parse_onlink6_route(nlh, loopbacks)) view.onlink6.push_back(*p);
  });
  if (!st) return st.error().wrap("list IPv6 routes");
  std::sort(view.interfaces.begin(), view.interfaces.end());
  view.interfaces.erase(std::unique(view.interfaces.begin(), view.interfaces.end()), view.interfaces.end());
  std::sort(view.onlink6.begin(), view.onlink6.end(), [](const IpPrefix& a, const IpPrefix& b) {
    return std::tie(a.bytes, a.prefix_len) < std::tie(b.bytes, b.prefix_len);
  });
  view.onlink6.erase(std::unique(view.onlink6.begin(), view.onlink6.end()), view.onlink6.end());
  return view;
}

}  // namespace egressd::daemon
