#include "daemon/netns_claim.h"

#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <string>

#include "daemon/pinq.h"
#include "egressd/socket_owner.h"
#include "nft/transport.h"

namespace egressd::daemon {

namespace {

// The portid of the socket bound to `queue` in the calling thread's network
// namespace, from /proc/net/netfilter/nfnetlink_queue ("queue portid ..."
// per bound queue); 0 when none is listed.
std::uint32_t queue_holder(std::uint16_t queue) {
  std::ifstream in("/proc/thread-self/net/netfilter/nfnetlink_queue");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    unsigned long number = 0, portid = 0;
    if ((ls >> number >> portid) && number == queue) return static_cast<std::uint32_t>(portid);
  }
  return 0;
}

// "netlink port 4711, pid 4711 (egressd)": the process part when this
// process can see it (not across pid namespaces).
std::string describe_port(std::uint32_t portid) {
  std::string out = "netlink port " + std::to_string(portid);
  std::ifstream in("/proc/thread-self/net/netlink");
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    // sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
    std::istringstream ls(line);
    std::string sk, groups, rmem, wmem, dump, locks, drops, inode;
    int eth = -1;
    unsigned long pid = 0;
    if (!(ls >> sk >> eth >> pid >> groups >> rmem >> wmem >> dump >> locks >> drops >> inode)) continue;
    if (eth != NETLINK_NETFILTER || pid != portid) continue;
    if (const std::string who = process_holding_socket(inode); !who.empty()) out += ", " + who;
    break;
  }
  return out;
}

}  // namespace

[[gnu::cold]] Result<std::unique_ptr<NetnsClaim>> NetnsClaim::acquire() {  // start-up only: for size
  std::unique_ptr<NetnsClaim> c(new NetnsClaim);
  nft::TransportOptions o;
  o.protocol = NETLINK_NETFILTER;
  o.what = "namespace claim";
  auto t = nft::Transport::open(std::move(o));
  if (!t) {
    c->unheld_reason_ = t.error().message;
    return c;
  }
  const int err = queue_command(**t, kClaimQueueNum, NFQNL_CFG_CMD_BIND);
  if (err == 0) {
    c->transport_ = std::move(*t);
    return c;
  }
  // EPERM: another socket holds the queue, or this process lacks
  // CAP_NET_ADMIN here. Every nfnetlink request needs the capability, and the
  // obsolete PF_UNBIND does nothing else: its success says which.
  if (err == EPERM && queue_command(**t, kClaimQueueNum, NFQNL_CFG_CMD_PF_UNBIND) == 0) {
    const std::uint32_t holder = queue_holder(kClaimQueueNum);
    return Error::runtime("another egressd already serves this network namespace (it holds nfnetlink_queue " +
                          std::to_string(kClaimQueueNum) + ": " +
                          (holder != 0 ? describe_port(holder) : std::string("a process this one cannot see")) +
                          "); two would undo each other's switches. Stop it first, or remove its sandbox from "
                          "its agent");
  }
  // Without CAP_NET_ADMIN nothing can be claimed, nor changed: the capability
  // check that follows says so, alone.
  if (err != EPERM) c->unheld_reason_ = "nfnetlink_queue " + std::to_string(kClaimQueueNum) + ": " + errno_text(err);
  return c;
}

NetnsClaim::~NetnsClaim() { release(); }

void NetnsClaim::release() {
  if (transport_) transport_->stop();
  transport_.reset();
}

}  // namespace egressd::daemon
