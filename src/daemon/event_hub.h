// Where a sandbox's watchers hear the netlink notifications of its namespace:
// the tamper guard nftables changes (NFNLGRP_NFTABLES), the interface watch
// link and IPv6 route changes (RTNLGRP_LINK, RTNLGRP_IPV6_ROUTE).
//
//   own socket   a netlink socket in the namespace, joined to the groups
//                (the sidecar; the agent when it cannot use a hub).
//   a hub        the agent's one socket per source (nftables, links) in its
//                own namespace, listening in every namespace
//                (NETLINK_LISTEN_ALL_NSID) and handing each datagram to the
//                feed of the namespace it came from.
//
// Why hubs: the kernel hands every notification, of any namespace, to a walk
// over every socket on the host joined to that group (netlink_broadcast checks
// each one's namespace only then). With one guard socket per sandbox, an agent
// with 200 sandboxes made each nftables commit on the host — each switch, each
// DNS answer's learned addresses, Docker's own — walk 200 sockets: +26 us per
// switch warm, +80 us after 10 ms idle, measured on a sidecar's switch with
// 200 such sockets in other namespaces (+130 / +590 us with 1000). Link and
// route changes (every veth a runtime creates, configures or deletes) walked
// the interface watches' 200 sockets the same way: +61 / +71 us for a link
// change after 10 ms idle (tests/bench/host_commits.py). A hub is one socket
// in that walk, whatever the count.
//
// A hub needs CAP_NET_BROADCAST over each sandbox's namespace (the kernel
// silently delivers nothing from a namespace without it) and an id for each
// namespace in the agent's own (RTM_NEWNSID, made here when there is none;
// ids live as long as the namespace and hold no reference to it). open()
// refuses without the capability in the initial user namespace; the agent
// then gives every sandbox its own sockets, as before.
//
// A hub's socket is shared, so a guard cannot stop listening for one large
// batch of its own (the sidecar's `unheard` batches): there the
// notifications are read and told apart by the portid like any others. An
// overrun of the shared socket is reported to every feed; a guard on the hub
// re-dumps only when its namespace's ruleset generation moved past the last
// one it verified (docs/security.md, "Safety net"); an interface watch dumps
// its namespace's links again, as it does after its own socket's overrun.
//
// Not thread-safe: one event loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "egressd/result.h"
#include "nft/transport.h"

namespace boost::asio {
class io_context;
}

namespace egressd::daemon {

// The notifications a feed hands out.
struct EventSource {
  int protocol = 0;
  std::vector<unsigned> groups;
  std::string what;  // names the socket in logs and errors
};
// NFNLGRP_NFTABLES: the tamper guard's.
EventSource nftables_events();
// RTNLGRP_LINK and RTNLGRP_IPV6_ROUTE: the interface watch's.
EventSource link_events();

class EventFeed {
 public:
  virtual ~EventFeed() = default;
  // Starts handing out the namespace's notifications (once): each message,
  // overruns, the end of each turn of reading.
  virtual void start(nft::Transport::Handlers h) = 0;
  // No handler runs after this returns. Idempotent.
  virtual void stop() = 0;
  // Reads what is queued now (at most `max_datagrams`), through the handlers
  // given to start, then ends the turn (turn_done).
  virtual void hear_queued(std::size_t max_datagrams) = 0;
  // For logs.
  virtual std::uint32_t portid() const = 0;
  virtual int rcvbuf() const = 0;
  // Doubles the receive buffer after an overrun, up to `max` bytes.
  virtual void grow_rcvbuf(int max) = 0;
  // A socket of this namespace alone: it may leave its groups for one batch
  // (leave / join return 0 or errno).
  virtual bool own_socket() const = 0;
  virtual int leave() = 0;
  virtual int join() = 0;
};

// A socket of the feed's own, in the calling thread's namespace.
Result<std::unique_ptr<EventFeed>> open_own_feed(boost::asio::io_context& io, const EventSource& source, int rcvbuf);

class EventHub {
 public:
  static constexpr int kMaxRcvbuf = 64 << 20;
  // In the calling thread's namespace. Fails without CAP_NET_BROADCAST, or
  // when egressd is not in the initial user namespace.
  static Result<std::unique_ptr<EventHub>> open(boost::asio::io_context& io, const EventSource& source,
                                                 int rcvbuf = 8 << 20);
  ~EventHub();
  EventHub(const EventHub&) = delete;
  EventHub& operator=(const EventHub&) = delete;

  // The feed of the namespace `netns_fd` names (not the hub's own). The hub
  // must outlive it. One feed per namespace at a time. Runs no handler.
  Result<std::unique_ptr<EventFeed>> feed(int netns_fd);
  // Hands out what is queued now (bounded), to the feeds there are: called
  // before a namespace gets a feed, so that what a sandbox removed from it a
  // moment ago committed (under a portid the new one does not have) is not
  // the new one's. Not from inside another namespace: the feeds' handlers
  // (restores) run here.
  void settle();
  // The namespace's id in the hub's (assigned when it had none).
  Result<std::int32_t> nsid_of(int netns_fd);

  std::size_t feeds() const { return sinks_.size(); }
  std::uint64_t dropped() const { return dropped_; }  // messages of namespaces without a feed

 private:
  friend class HubFeed;
  struct Sink {
    nft::Transport::Handlers h;
    bool started = false;
    bool touched = false;  // has something in the current turn
  };
  EventHub(std::unique_ptr<nft::Transport> events, std::unique_ptr<nft::Transport> rtnl);
  void start_loop();
  void on_message(const nlmsghdr* nlh);
  void on_overrun();
  void on_turn_done();
  void on_error(const Error& e);
  void touch(std::int32_t nsid, Sink& s);
  void unregister(std::int32_t nsid);
  void hear_queued(std::size_t max_datagrams);

  std::unique_ptr<nft::Transport> events_;
  std::unique_ptr<nft::Transport> rtnl_;
  bool loop_started_ = false;
  std::unordered_map<std::int32_t, std::unique_ptr<Sink>> sinks_;
  std::vector<std::int32_t> touched_;
  std::uint64_t dropped_ = 0;
};

}  // namespace egressd::daemon
