// Drops egressd's finished upstream DNS flows from conntrack (ctnetlink
// IPCTNL_MSG_CT_DELETE): the flows of one turn of the event loop in one
// netlink write, done when forget() returns.
//
// Why: every upstream query leaves from a fresh random port, and that port
// goes back to the namespace's ephemeral range when the query is answered.
// Its conntrack entry would stay for the UDP timeout (30 s); a sandbox
// process whose own DNS query to the same server drew that port would then
// be the original direction of egressd's old flow: not redirected to the
// proxy, and denied by the output chain (EPERM). After a burst of a few
// thousand queries that was one sandbox query in ten. The upstream releases
// the ports only after forget() returned (dns::ForgetFlow): a deletion sent
// later could take the flow of a new query that drew the same port.
//
// Not thread-safe: owned and driven by one event loop.
#pragma once

#include <boost/asio/io_context.hpp>
#include <memory>
#include <span>
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
  // Deletes the UDP flows `flows` (their original direction): one netlink
  // write (more past 32 KiB of messages), handled by the kernel before it
  // returns. A flow conntrack no longer has is no error.
  void forget(std::span<const dns::FlowTuple> flows);
  // How many deletions were sent, and how many the kernel refused for a
  // reason other than "no such entry" (for tests and logs).
  std::uint64_t sent() const { return sent_; }
  std::uint64_t failed() const { return failed_; }

  // The IPCTNL_MSG_CT_DELETE message for `t` with sequence number `seq`,
  // appended to `out` (exposed for tests).
  static void append_delete(std::vector<std::uint8_t>& out, const dns::FlowTuple& t, std::uint32_t seq);

 private:
  explicit ConntrackForgetter(std::unique_ptr<nft::Transport> t) : t_(std::move(t)) {}
  void flush();

  std::unique_ptr<nft::Transport> t_;
  std::vector<std::uint8_t> batch_;
  std::uint64_t sent_ = 0, failed_ = 0, pending_ = 0;
};

// The IPCTNL_MSG_CT_NEW message (no NLM_F_CREATE: an update) that sets the ct
// mark of the existing flow whose original direction is `proto`
// src:sport -> dst:dport, appended to `out`. Hostname pinning marks the flows
// a switch cuts with it (nft::kPinCutMark).
void append_set_ct_mark(std::vector<std::uint8_t>& out, std::uint8_t proto, const IpPrefix& src, const IpPrefix& dst,
                        std::uint16_t sport, std::uint16_t dport, std::uint32_t mark, std::uint32_t seq);
// The IPCTNL_MSG_CT_DELETE message for the flow whose original direction is
// `proto` src:sport -> dst:dport, appended to `out`. Hostname pinning drops
// a refused TCP flow's entry with it (Queue::reset_servers).
void append_delete_ct(std::vector<std::uint8_t>& out, std::uint8_t proto, const IpPrefix& src, const IpPrefix& dst,
                      std::uint16_t sport, std::uint16_t dport, std::uint32_t seq);

}  // namespace egressd::daemon
