// One netlink socket and everything every netlink user of egressd needs from
// it: the owned socket (portid, receive buffer, multicast groups), request /
// ack with sequence numbers (multi-part dumps, NLMSG_ERROR and acks, dumps a
// commit interrupted), and a receive loop on the event loop (an asio
// coroutine) that hands each message to one handler and reports ENOBUFS to
// its owner, who knows what to re-read.
//
// Users: NetlinkKernel (nft/netlink.cc: batches and their acks, table
// reads), the nftables change monitor (daemon/event_hub: a tamper guard's own
// socket, or the agent's one socket for every sandbox), the NFLOG reader
// (audit/nflog), the pinning queue reader (daemon/pinq), the namespace claim
// (daemon/netns_claim: one queue bound, nothing read), the conntrack
// forgetter (daemon/ctforget), the interface
// watch (daemon/netwatch), and the flow reaper's sock_diag dumps and
// SOCK_DESTROY requests (daemon/sockdiag, requests only, on its own thread).
// No other code in egressd opens a netlink socket. attr_table reads the
// attributes of what they receive.
//
// Shutdown: stop() (also run by the destructor) marks the state the receive
// coroutine shares (it outlives the Transport until the coroutine ends),
// cancels its wait and closes the socket, so its kernel state (a bound queue
// or log group) is free at once. The coroutine checks the mark after every
// resumption, so a wait that completed just before stop() (queued, no longer
// cancellable) ends it too, before any handler: owners' handlers may capture
// `this`. A stopped transport sends nothing (EBADF).
//
// Not thread-safe: one event loop drives it. The socket belongs to the
// network namespace of the thread that opens it.
#pragma once

#include <linux/netlink.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "egressd/result.h"

// Declared only: users that include this header (netwatch.h, included next
// to <linux/if.h>) must not get asio's <net/if.h>.
namespace boost::asio {
class io_context;
}

namespace egressd::nft {

struct TransportOptions {
  int protocol = NETLINK_NETFILTER;
  std::vector<unsigned> groups;  // multicast groups joined after bind
  // Receive buffer in bytes: SO_RCVBUFFORCE (CAP_NET_ADMIN in the initial
  // user namespace), else SO_RCVBUF capped by net.core.rmem_max. 0: the
  // kernel's default. Set before the groups are joined, so a burst right
  // after fits.
  int rcvbuf = 0;
  // Names the socket in errors ("nftables monitor", "nflog").
  std::string what = "netlink";
  // NETLINK_LISTEN_ALL_NSID: the groups' notifications of every network
  // namespace that has an id in this socket's namespace, each datagram
  // tagged with that id (source_nsid()). The kernel delivers another
  // namespace's only to an opener with CAP_NET_BROADCAST over it.
  bool listen_all_nsid = false;
};

class Transport {
 public:
  // A message handed to the receive loop's handler.
  using OnMessage = std::function<void(const nlmsghdr*)>;
  struct Handlers {
    OnMessage message;                      // each message received
    std::function<void()> overrun;          // ENOBUFS: messages were lost (re-read what matters)
    std::function<void()> turn_done;        // after each turn's messages (may be empty)
    std::function<void(const Error&)> error;  // a receive error other than ENOBUFS (may be empty)
  };

  // Opens a netlink socket of opts.protocol in the current network namespace,
  // bound to a kernel-chosen portid, joined to opts.groups. Error names the step.
  static Result<std::unique_ptr<Transport>> open(boost::asio::io_context& io, TransportOptions opts);
  // The same without an event loop: requests, send and read_queued only
  // (start does nothing).
  static Result<std::unique_ptr<Transport>> open(TransportOptions opts);
  // Stops the receive loop: no handler runs once the destructor (or stop) returns.
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  int fd() const;
  std::uint32_t portid() const;
  // With listen_all_nsid, inside a handler (or read_queued's on_msg): the id,
  // in this socket's namespace, of the namespace the message's datagram came
  // from; -1 for this socket's own namespace.
  std::int32_t source_nsid() const;
  int rcvbuf() const;  // as the kernel reports it (twice what was set)
  // Joins or leaves a multicast group (errno on failure, 0 on success).
  int join(unsigned group);
  int leave(unsigned group);

  // ---- request / ack ----
  // Sends `req` (its nlmsg_seq and nlmsg_pid are set here) and hands every
  // reply carrying its sequence number to `on_reply` until the request is
  // complete: NLMSG_DONE of a dump, or the NLMSG_ERROR that acks it (send
  // non-dump requests with NLM_F_ACK). Returns 0 or a positive errno: the
  // kernel's, ETIMEDOUT (no complete answer within `timeout`), or EINTR when
  // a dump was interrupted by a commit (NLM_F_DUMP_INTR; on_reply no longer
  // called) or replies were lost (ENOBUFS): the caller dumps again. Whatever
  // an earlier, abandoned request left queued is dropped first. The kernel
  // answers requests inside send/recv, so this does not wait in practice.
  // Not while the receive loop runs (the loop would take the replies).
  int request(nlmsghdr* req, const OnMessage& on_reply,
              std::chrono::milliseconds timeout = std::chrono::milliseconds(1000));

  // ---- batches (nf_tables transactions, ctnetlink deletes) ----
  // The next sequence number, for messages the caller builds itself.
  std::uint32_t next_seq();
  // `n` consecutive sequence numbers for a batch; returns the first.
  std::uint32_t reserve_seq(std::uint32_t n);
  // Drops whatever an earlier, abandoned exchange left queued.
  void drain();
  // Sends `len` bytes (one or more whole messages) as one datagram: 0 or
  // errno. The kernel handles it inside the call.
  int send(const void* data, std::size_t len);
  // Hands every message already queued to `on_msg`, without waiting; at
  // most `max_datagrams` datagrams (a socket another process keeps filling
  // may never run empty), then `more` says the limit was reached.
  struct Queued {
    bool overrun = false;  // ENOBUFS: messages were lost
    int error = 0;         // a receive error other than EAGAIN/ENOBUFS
    bool more = false;     // stopped at max_datagrams
  };
  Queued read_queued(const OnMessage& on_msg, std::size_t max_datagrams = SIZE_MAX);
  // Reads the replies to what was sent, handing each message to `on_msg`,
  // until `complete()` holds (checked after each datagram). While nothing is
  // queued it waits for more, up to `timeout` in all, unless
  // `nothing_more_coming(overrun)` says the kernel will send no more (it
  // answers inside sendmsg, so everything is normally queued already).
  // Not while the receive loop runs.
  struct Collected {
    bool complete = false;
    bool overrun = false;  // ENOBUFS: some replies were lost
    int error = 0;         // a receive error (errno), or ETIMEDOUT
  };
  Collected collect(const OnMessage& on_msg, const std::function<bool()>& complete,
                    const std::function<bool(bool overrun)>& nothing_more_coming, std::chrono::milliseconds timeout);

  // ---- receive loop ----
  // Starts reading on the event loop: every message goes to h.message, at
  // most `datagrams_per_turn` datagrams per turn, then other work runs
  // (h.turn_done after each turn). Once.
  void start(Handlers h, std::size_t datagrams_per_turn = 256);
  // Ends the receive loop; no handler runs after this returns (also when
  // called from a handler).
  void stop();

 private:
  struct Impl;
  explicit Transport(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;  // shared with the running receive loop
};

// The attributes of one message after its `header` bytes, or those nested in
// `nest`, by type: tb[type], nullptr where absent (types past the table are
// skipped). Negative when they are malformed (as mnl_attr_parse says).
int attr_table(const nlmsghdr* nlh, std::size_t header, std::span<const nlattr*> tb);
int attr_table(const nlattr* nest, std::span<const nlattr*> tb);

}  // namespace egressd::nft
