// Active abort of flows a new phase does not allow: sock_diag SOCK_DESTROY
// (CONFIG_INET_DIAG_DESTROY) on TCP and connected UDP sockets of the current
// network namespace, so clients fail at once instead of retransmitting into
// rejects. The nftables rules already cut these flows; this only makes the
// failure fast.
#pragma once

#include <chrono>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "egressd/policy.h"
#include "egressd/result.h"
#include "egressd/unique_fd.h"

namespace egressd::daemon {

struct FlowInfo {
  IpPrefix dst;            // peer address (IPv4-mapped IPv6 peers are given as IPv4)
  std::uint16_t dport = 0;
  bool inbound = false;    // the socket was accepted from a local listener
  bool udp = false;
};

// One of egressd's own sockets in the namespace that stays bound (hashed) for
// as long as egressd holds it: the DNS proxy's listeners
// (dns::Proxy::listeners).
struct OwnSocket {
  int family = 0;  // AF_INET or AF_INET6
  bool udp = false;  // a bound UDP socket; else a listening TCP one
};

// What one destroy_flows call did.
struct Reaped {
  int destroyed = 0;        // sockets aborted
  int tcp_families = 0;     // address families whose TCP flows were listed (0-2)
  int udp_families = 0;     // address families whose UDP sockets were listed (0-2)
};

// Calls `keep` for every TCP socket (not listening) and every connected UDP
// socket in the namespace; destroys those for which it returns false.
// Returns how many were destroyed, and how many listings it made. Fails
// (runtime) when sock_diag is unavailable; EOPNOTSUPP from the kernel means no
// CONFIG_INET_DIAG_DESTROY. `own`: egressd's own sockets in the namespace.
// A family whose TCP (UDP) sockets are exactly those is not listed: no flow
// can be there, and each listing walks the host's whole hash table.
Result<Reaped> destroy_flows(const std::function<bool(const FlowInfo&)>& keep, const std::vector<OwnSocket>& own = {});

// The cgroup v2 ids (sock_diag INET_DIAG_CGROUP_ID) of the UDP sockets and
// listening TCP sockets bound to one of `addrs` in the calling thread's
// namespace, each id once: where a loopback upstream (Docker's resolver)
// really listens. Fails when sock_diag is unavailable.
Result<std::vector<std::uint64_t>> socket_cgroups(const std::vector<IpPrefix>& addrs);

// The cgroup v2 id of egressd's own sockets: its own cgroup's, by the
// directory /proc/self/cgroup names under the cgroup v2 mount, else by
// sock_diag on a socket bound for the purpose. Learned once, at the first
// call, which `run` and `agent` make before they join any sandbox's
// namespace; later calls return the same. `depth`: its level below the root
// of egressd's cgroup namespace (where the kernel counts a rule's levels
// from), -1 when learned by a socket (unknown).
struct OwnCgroup {
  std::uint64_t id = 0;
  int depth = -1;
};
Result<OwnCgroup> own_cgroup();

// The id of the cgroup v2 hierarchy's root (kernfs' first node, on 64-bit
// kernels), where every socket of a cgroup v1 host is.
inline constexpr std::uint64_t kCgroup2RootId = 1;

// Whether egressd's mount namespace has the cgroup v2 hierarchy mounted from
// its root (the host's view, not a cgroup namespace's): then a socket in the
// root cgroup is there on a host that uses cgroup v2, not on one without it.
bool cgroup2_root_in_sight();

// Runs destroy_flows on a thread of its own so the event loop never waits for
// sock_diag dumps (they walk the kernel's global socket hash tables: 1-5 ms of
// kernel time on a host with a 256k-bucket TCP hash). Only the newest request
// matters: a job superseded by a later switch stops destroying at once, so a
// late job can never abort a flow that the phase now in force allows. A job
// waits kReapSettle first, so a burst of switches (an orchestrator stepping
// through phases) is reaped once, for its last phase, instead of taking a CPU
// from the switches that follow. The rules cut those flows at the switch
// itself; the reaper only makes their sockets fail at once.
//
// The thread is started by the first job, and works in `netns` (an open
// namespace file; invalid: the namespace of the thread that starts it), so a
// sandbox that never leaves public has none. The reaper holds `netns` open
// for its lifetime.
inline constexpr std::chrono::milliseconds kReapSettle{10};

class FlowReaper {
 public:
  using Report = std::function<void(Result<int> destroyed, std::uint64_t generation)>;
  // `dns_redirect`: the DNS proxy runs, so every udp/tcp flow to port 53 goes
  // to it (nat redirect) or is egressd's own upstream traffic.
  FlowReaper(bool inbound_replies, bool dns_redirect, Report report, UniqueFd netns = {});
  ~FlowReaper();
  FlowReaper(const FlowReaper&) = delete;
  FlowReaper& operator=(const FlowReaper&) = delete;

  // Queues the abort of flows `phase` (in force at `generation`) does not
  // allow. `own` as for destroy_flows.
  void reap(std::shared_ptr<const Phase> phase, std::uint64_t generation, std::vector<OwnSocket> own = {});

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// True when a flow to `f` may still be allowed by `phase` and must be kept:
// loopback peers, inbound flows (when `inbound_replies`), DNS to port 53 of
// any address (when `dns_redirect`: the rules send it to egressd's proxy, which
// answers it under the new phase, and egressd's own upstream sockets are
// exempt in every phase), public mode, allowlisted addresses and CIDRs, and —
// conservatively — every peer while the phase has hostname entries (a learned
// address may allow it).
bool flow_may_survive(const Phase& phase, const FlowInfo& f, bool inbound_replies, bool dns_redirect);

}  // namespace egressd::daemon
