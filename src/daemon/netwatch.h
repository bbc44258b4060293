// The namespace's network devices and on-link IPv6 prefixes, read from
// rtnetlink and watched for changes. Table netdev egressd needs one egress
// chain per non-loopback interface, interfaces that appear later included (a
// veth moved in after egressd started), and neighbour discovery may address
// on-link global IPv6 neighbours only (compile.h, kOnlinkSet6).
//
// Kept small on purpose: the message parsing is pure (parse_link,
// parse_onlink6_route, changes_view; tested on hand-built messages), and
// NetWatch only owns the socket it dumps with. What says "something changed"
// is an EventFeed of link_events() (event_hub.h): a socket of the sandbox's
// own, or the agent's one socket for every namespace. Nothing is tracked from
// the notifications; every change is answered with a fresh dump (changes are
// rare, and a lost notification, ENOBUFS, then costs nothing).
//
// Not thread-safe: used from the daemon's event loop.
#pragma once

#include <linux/netlink.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "egressd/policy.h"
#include "egressd/result.h"
#include "nft/transport.h"

namespace egressd::daemon {

// What table netdev egressd and the on-link set are built from.
struct NetworkView {
  std::vector<std::string> interfaces;  // non-loopback interface names, sorted
  std::vector<IpPrefix> onlink6;        // see parse_onlink6_route, sorted
  friend bool operator==(const NetworkView&, const NetworkView&) = default;
};

struct LinkInfo {
  int index = 0;
  std::string name;
  bool loopback = false;  // IFF_LOOPBACK
};

// One RTM_NEWLINK message (a dump entry or a notification); nullopt for any
// other message or a malformed one.
std::optional<LinkInfo> parse_link(const nlmsghdr* nlh);

// One RTM_NEWROUTE message for AF_INET6: the destination prefix when the route
// says "on-link": a unicast route with no gateway (no RTA_GATEWAY, no
// RTA_MULTIPATH) through an interface other than `loopback_ifindexes`, and a
// destination that is not link-local or multicast (those are allowed anyway).
// nullopt otherwise.
std::optional<IpPrefix> parse_onlink6_route(const nlmsghdr* nlh, const std::vector<int>& loopback_ifindexes);

// True for a notification that may change the view: a link, or a route
// (the caller then dumps).
bool changes_view(const nlmsghdr* nlh);

class NetWatch {
 public:
  // Opens the dump socket in the current network namespace.
  static Result<NetWatch> open();

  // Links and IPv6 routes, now. Waits at most 2 s for the kernel.
  Result<NetworkView> dump();

 private:
  explicit NetWatch(std::unique_ptr<nft::Transport> requests) : requests_(std::move(requests)) {}
  // Sends one dump request and hands each reply message to on_msg until
  // NLMSG_DONE; a dump interrupted by a change is started over (`reset`
  // first, each time).
  Status dump_request(std::uint16_t type, std::uint8_t family, const std::function<void()>& reset,
                      const std::function<void(const nlmsghdr*)>& on_msg);

  std::unique_ptr<nft::Transport> requests_;  // dumps
};

}  // namespace egressd::daemon
