// Drops egressd's finished upstream DNS flows from conntrack (ctnetlink
// IPCTNL_MSG_CT_DELETE), batched: one netlink write per turn of the event
// loop however many answers came in it.
//
// Why: every upstream query leaves from a fresh random port, and that port
// goes back to the namespace's ephemeral range when the query is answered.
// Its conntrack entry would stay for the UDP timeout (30 s); a sandbox
// process whose own DNS query to the same server drew that port would then
// be the original direction of egressd's old flow: not redirected to the
// proxy, and denied by the output chain (EPERM). After a burst of a few
// thousand queries that was one sandbox query in ten.
//
// Shutdown: the destructor requests the forgetter's stop (a std::stop_source);
// a flush already posted carries a std::stop_token of it (the stop state is
// shared, not the forgetter's) and returns without touching the forgetter.
// Queued deletions not yet sent are dropped. The io_context may run on after.
//
// Not thread-safe: owned and driven by one event loop.
#pragma once

#include <boost/asio/io_context.hpp>
#include <memory>
#include <stop_token>
#include <vector>

#include "dns/upstream.h"
#include "egressd/result.h"
#include "nft/transport.h"

namespace egressd::daemon {

class ConntrackForgetter {
 public:
  // A NETLINK_NETFILTER socket in the current network namespace. Runtime
  // error when it cannot be opened.
  static Result<std::unique_ptr<ConntrackForgetter>> open(boost::asio::io_context& io);
  // Queues the UDP flow `t` (its original direction) for deletion on the
  // next turn of the loop. A flow conntrack no longer has is no error.
  void forget(const dns::FlowTuple& t);
  // How many deletions were sent, and how many the kernel refused for a
  // reason other than "no such entry" (for tests and logs).
  std::uint64_t sent() const { return sent_; }
  std::uint64_t failed() const { return failed_; }

  // The IPCTNL_MSG_CT_DELETE message for `t` with sequence number `seq`,
  // appended to `out` (exposed for tests).
  static void append_delete(std::vector<std::uint8_t>& out, const dns::FlowTuple& t, std::uint32_t seq);

 private:
  ConntrackForgetter(boost::asio::io_context& io, std::unique_ptr<nft::Transport> t) : io_(io), t_(std::move(t)) {}
  void flush();

  boost::asio::io_context& io_;
  std::unique_ptr<nft::Transport> t_;
  std::vector<std::uint8_t> batch_;
  bool scheduled_ = false;
  std::uint64_t sent_ = 0, failed_ = 0, pending_ = 0;
  // Requested by the destructor; its tokens outlive the forgetter in the flush it posted.
  std::stop_source stop_;

 public:
  ~ConntrackForgetter() { stop_.request_stop(); }
};

// The IPCTNL_MSG_CT_NEW message (no NLM_F_CREATE: an update) that sets the ct
// mark of the existing flow whose original direction is `proto`
// src:sport -> dst:dport, appended to `out`. Hostname pinning marks the flows
// a switch cuts with it (nft::kPinCutMark).
void append_set_ct_mark(std::vector<std::uint8_t>& out, std::uint8_t proto, const IpPrefix& src, const IpPrefix& dst,
                        std::uint16_t sport, std::uint16_t dport, std::uint32_t mark, std::uint32_t seq);

}  // namespace egressd::daemon
