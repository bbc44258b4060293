// Where a tamper guard hears the nftables changes of its sandbox's namespace.
//
//   own socket   a netlink socket in the namespace, joined to NFNLGRP_NFTABLES
//                (the sidecar; the agent when it cannot use the hub).
//   the hub      the agent's one socket in its own namespace, listening in
//                every namespace (NETLINK_LISTEN_ALL_NSID) and handing each
//                datagram to the feed of the namespace it came from.
//
// Why the hub: the kernel hands every nftables notification, of any commit in
// any namespace, to a walk over every socket on the host joined to that group
// (netlink_broadcast checks each one's namespace only then). With one guard
// socket per sandbox, an agent with 200 sandboxes made each commit on the host
// — each switch, each DNS answer's learned addresses, Docker's own — walk 200
// sockets: +26 us per switch warm, +80 us after 10 ms idle, measured on a
// sidecar's switch with 200 such sockets in other namespaces (+130 / +590 us
// with 1000). The hub is one socket in that walk, whatever the count.
//
// The hub needs CAP_NET_BROADCAST over each sandbox's namespace (the kernel
// silently delivers nothing from a namespace without it) and an id for each
// namespace in the agent's own (RTM_NEWNSID, made here when there is none;
// ids live as long as the namespace and hold no reference to it). open()
// refuses without the capability in the initial user namespace; the agent
// then gives every sandbox its own socket, as before.
//
// The hub's socket is shared, so a guard cannot stop listening for one large
// batch of its own (the sidecar's `unheard` batches): there the
// notifications are read and told apart by the portid like any others. An
// overrun of the shared socket is reported to every feed; a guard on the hub
// re-dumps only when its namespace's ruleset generation moved past the last
// one it verified (docs/security.md, "Safety net").
//
// Not thread-safe: one event loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "egressd/result.h"
#include "nft/transport.h"

namespace boost::asio {
class io_context;
}

namespace egressd::daemon {

class NftEventFeed {
 public:
  virtual ~NftEventFeed() = default;
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
  // A socket of this namespace alone: it may leave the group for one batch
  // (leave / join return 0 or errno).
  virtual bool own_socket() const = 0;
  virtual int leave() = 0;
  virtual int join() = 0;
};

// A socket of the feed's own, in the calling thread's namespace.
Result<std::unique_ptr<NftEventFeed>> open_own_feed(boost::asio::io_context& io, int rcvbuf);

class NftEventHub {
 public:
  static constexpr int kMaxRcvbuf = 64 << 20;
  // In the calling thread's namespace. Fails without CAP_NET_BROADCAST, or
  // when egressd is not in the initial user namespace.
  static Result<std::unique_ptr<NftEventHub>> open(boost::asio::io_context& io, int rcvbuf = 8 << 20);
  ~NftEventHub();
  NftEventHub(const NftEventHub&) = delete;
  NftEventHub& operator=(const NftEventHub&) = delete;

  // The feed of the namespace `netns_fd` names (not the hub's own). The hub
  // must outlive it. One feed per namespace at a time. Runs no handler.
  Result<std::unique_ptr<NftEventFeed>> feed(int netns_fd);
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
  NftEventHub(std::unique_ptr<nft::Transport> events, std::unique_ptr<nft::Transport> rtnl);
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
