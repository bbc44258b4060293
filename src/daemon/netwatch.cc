#include "daemon/netwatch.h"

#include <libmnl/libmnl.h>
#include <linux/if.h>
#include <linux/rtnetlink.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <tuple>

namespace egressd::daemon {

namespace {

constexpr int kReplyTimeoutMs = 2000;
constexpr int kDumpAttempts = 8;
// One datagram of a dump or a burst of notifications.
constexpr std::size_t kBufSize = 32 * 1024;

// Attributes of one message, indexed by type (up to `max`).
std::vector<const nlattr*> attrs(const nlmsghdr* nlh, std::size_t header, std::uint16_t max) {
  std::vector<const nlattr*> tb(max + 1, nullptr);
  struct Ctx {
    std::vector<const nlattr*>* tb;
    std::uint16_t max;
  } ctx{&tb, max};
  mnl_attr_parse(
      nlh, static_cast<unsigned>(header),
      [](const nlattr* a, void* p) -> int {
        auto* c = static_cast<Ctx*>(p);
        const std::uint16_t type = mnl_attr_get_type(a);
        if (type <= c->max) (*c->tb)[type] = a;
        return MNL_CB_OK;
      },
      &ctx);
  return tb;
}

}  // namespace

std::optional<LinkInfo> parse_link(const nlmsghdr* nlh) {
  if (nlh->nlmsg_type != RTM_NEWLINK || nlh->nlmsg_len < NLMSG_LENGTH(sizeof(ifinfomsg))) return std::nullopt;
  const auto* ifi = static_cast<const ifinfomsg*>(mnl_nlmsg_get_payload(nlh));
  const auto tb = attrs(nlh, sizeof(ifinfomsg), IFLA_IFNAME);
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
  const auto tb = attrs(nlh, sizeof(rtmsg), RTA_MULTIPATH);
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

Result<NetWatch> NetWatch::open() {
  UniqueFd events(::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, NETLINK_ROUTE));
  if (!events.ok()) return errno_error("open rtnetlink socket", errno);
  sockaddr_nl addr{};
  addr.nl_family = AF_NETLINK;
  addr.nl_groups = RTMGRP_LINK | RTMGRP_IPV6_ROUTE;
  if (::bind(events.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) < 0) {
    return errno_error("subscribe to rtnetlink link and route changes", errno);
  }
  UniqueFd requests(::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, NETLINK_ROUTE));
  if (!requests.ok()) return errno_error("open rtnetlink socket", errno);
  sockaddr_nl any{};
  any.nl_family = AF_NETLINK;
  if (::bind(requests.get(), reinterpret_cast<const sockaddr*>(&any), sizeof any) < 0) {
    return errno_error("bind rtnetlink socket", errno);
  }
  return NetWatch(std::move(events), std::move(requests));
}

Result<bool> NetWatch::drain() {
  std::vector<char> buf(kBufSize);
  bool relevant = false;
  for (;;) {
    const ssize_t n = ::recv(events_.get(), buf.data(), buf.size(), MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOBUFS) {  // notifications lost: dump to find out
        relevant = true;
        continue;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK) return relevant;
      return errno_error("read rtnetlink notifications", errno);
    }
    int rest = static_cast<int>(n);
    for (auto* nlh = reinterpret_cast<const nlmsghdr*>(buf.data()); mnl_nlmsg_ok(nlh, rest);
         nlh = mnl_nlmsg_next(nlh, &rest)) {
      switch (nlh->nlmsg_type) {
        case RTM_NEWLINK:
        case RTM_DELLINK:
        case RTM_NEWROUTE:
        case RTM_DELROUTE:
          relevant = true;
          break;
        default:
          break;
      }
    }
  }
}

Status NetWatch::dump_request(std::uint16_t type, std::uint8_t family,
                              const std::function<void(const nlmsghdr*)>& on_msg) {
  std::vector<char> buf(kBufSize);
  for (int attempt = 0; attempt < kDumpAttempts; ++attempt) {
    // Anything left from an abandoned exchange goes first.
    while (::recv(requests_.get(), buf.data(), buf.size(), MSG_DONTWAIT) > 0) {
    }
    char req[NLMSG_SPACE(sizeof(rtgenmsg)) + 64] = {};
    nlmsghdr* nlh = mnl_nlmsg_put_header(req);
    nlh->nlmsg_type = type;
    nlh->nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
    const std::uint32_t seq = nlh->nlmsg_seq = seq_++;
    // rtgenmsg is enough for a dump (the kernel reads only the family).
    auto* g = static_cast<rtgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(rtgenmsg)));
    g->rtgen_family = family;
    const sockaddr_nl kernel{AF_NETLINK, 0, 0, 0};
    if (::sendto(requests_.get(), nlh, nlh->nlmsg_len, 0, reinterpret_cast<const sockaddr*>(&kernel), sizeof kernel) < 0) {
      return errno_error("rtnetlink dump request", errno);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kReplyTimeoutMs);
    bool interrupted = false, done = false;
    while (!done) {
      const ssize_t n = ::recv(requests_.get(), buf.data(), buf.size(), MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == ENOBUFS) {
          interrupted = true;
          break;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) return errno_error("rtnetlink dump", errno);
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) return Error::runtime("rtnetlink dump: no answer within 2 s");
        pollfd p{requests_.get(), POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(left.count())) < 0 && errno != EINTR) return errno_error("poll", errno);
        continue;
      }
      int rest = static_cast<int>(n);
      for (auto* m = reinterpret_cast<const nlmsghdr*>(buf.data()); mnl_nlmsg_ok(m, rest); m = mnl_nlmsg_next(m, &rest)) {
        if (m->nlmsg_seq != seq) continue;
        if (m->nlmsg_flags & NLM_F_DUMP_INTR) interrupted = true;
        if (m->nlmsg_type == NLMSG_DONE) {
          done = true;
          break;
        }
        if (m->nlmsg_type == NLMSG_ERROR) {
          const auto* e = static_cast<const nlmsgerr*>(mnl_nlmsg_get_payload(m));
          return errno_error("rtnetlink dump", -e->error);
        }
        on_msg(m);
      }
    }
    if (!interrupted) return {};
  }
  return Error::runtime("rtnetlink dump: interrupted by changes " + std::to_string(kDumpAttempts) + " times");
}

Result<NetworkView> NetWatch::dump() {
  std::vector<LinkInfo> links;
  auto st = dump_request(RTM_GETLINK, AF_UNSPEC, [&](const nlmsghdr* nlh) {
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
  st = dump_request(RTM_GETROUTE, AF_INET6, [&](const nlmsghdr* nlh) {
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
