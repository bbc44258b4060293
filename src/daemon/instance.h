// One sandbox, wired: its Sandbox (phases, learned addresses, denied
// records), the DNS proxy listening in its namespace, the tamper guard, the
// interface watch, the flow reaper, NFLOG, the pinning queue reader, its
// control socket and metrics file. `egressd run` makes one; `egressd agent`
// makes one per attached namespace on its single event loop. Nothing here is
// process-wide but the loop passed in and, in the agent, the sockets its tamper
// guard and interface watch hear the namespace's changes through
// (InstanceOptions::nft_events, link_events).
#pragma once

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/event_hub.h"
#include "dns/fd_budget.h"
#include "daemon/sandbox.h"
#include "egressd/policy.h"
#include "egressd/result.h"
#include "egressd/unique_fd.h"

namespace egressd::daemon {

class ConntrackForgetter;

struct InstanceOptions {
  std::string name;                  // the agent's name for the sandbox ("" for the sidecar); in logs
  Policy policy;
  std::string initial;               // the phase installed on a fresh start
  std::string netns;                 // as reported (status, logs)
  std::string socket;                // the sidecar protocol's socket; "" = none
  std::vector<std::uint32_t> allow_uids;
  std::string state_file;            // where an inline policy is kept for adoption
  int dns_port = 53;                 // 0 = no DNS interception
  double verify_interval_s = 5;
  int monitor_rcvbuf = 0;
  std::size_t denied_records = 1024;
  std::size_t names = 8192;
  std::string metrics_file;          // "" = none
  double metrics_interval_s = 5;
  std::string hosts_file;            // names learned without DNS (Sandbox::start_hosts); "" = none
  std::string resolv_conf;           // text of the resolv.conf upstreams (and Docker's ExtServers) come from
  // False in the agent: upstream queries leave from the agent's own
  // namespace (sockets created on the loop's thread, there), unmarked, so
  // nothing in the sandbox sees or answers them; no Docker forwarder probe
  // and no conntrack cleanup of upstream flows in the sandbox.
  bool upstream_in_sandbox = true;
  // The agent with dns.upstream_netns: sandbox: every upstream socket is
  // opened in this namespace (the loop's thread enters it for the
  // socket(2) call), marked, so the exchange happens inside as in a sidecar.
  UniqueFd upstream_netns;
  // What the kernel supports, when already known (the agent probes once per
  // process: every namespace shares the kernel, and each probe's table
  // deletion costs the next commit an RCU grace period, ~20 ms). Unset: probed.
  std::optional<Capabilities> capabilities;
  std::optional<bool> can_log;  // the deny chain's log rule (nfnetlink_log); unset: probed
  // The agent's one nftables event socket for every sandbox (event_hub.h);
  // null: the tamper guard opens a socket of its own in the namespace. Must
  // outlive the instance.
  EventHub* nft_events = nullptr;
  // The same for link and IPv6 route changes (the interface watch).
  EventHub* link_events = nullptr;
  // The agent's descriptors for upstream DNS sockets, shared by every
  // sandbox (fd_budget.h): the proxy opens an account named `name` and
  // charges its upstream sockets and TCP clients to it. Null (the sidecar):
  // no budget.
  std::shared_ptr<dns::FdBudget> fd_budget;
  // The agent's conntrack socket in its own namespace, where its upstream DNS
  // sockets are: their finished flows are deleted there, as a sidecar's are
  // in the sandbox (a sandbox's query flood left thousands of entries in the
  // host's table otherwise; attack review 9). Null: none. Must outlive the
  // instance.
  ConntrackForgetter* own_conntrack = nullptr;
  // Called once the namespace and the socket path are this egressd's (a
  // second egressd stops before it), before anything is installed: the
  // sidecar removes a ready file a killed egressd left there.
  std::function<void()> claimed;
  // Called after every switch (the process trims its heap once idle).
  std::function<void()> after_switch;
  // Called with the namespace's non-loopback interfaces (sorted) each time
  // the interface watch finds them changed, once the instance is live.
  std::function<void(const std::vector<std::string>&)> interfaces_changed;
  // Called after every request on the sandbox's own socket (the same: a
  // status of 1k entries leaves its JSON's heap behind).
  std::function<void()> after_request;
};

class Instance {
 public:
  // Builds and starts everything: the initial phase (or the adopted table)
  // is in the kernel when this returns. The calling thread must be in the
  // sandbox's network namespace: every socket, and the flow reaper's thread,
  // is created in the namespace of the thread that creates it.
  static Result<std::unique_ptr<Instance>> create(boost::asio::io_context& io, InstanceOptions opts);
  ~Instance();
  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;

  Sandbox& sandbox();
  const InstanceOptions& options() const;
  std::uint16_t dns_port() const;            // the proxy's port (it may have fallen back); 0 = none
  std::vector<std::string> upstream() const;
  std::uint64_t startup_us() const;
  bool can_log() const;  // the log rule's probe result (or what was given)
  // The agent, back in its own namespace after create(): resolves the
  // initial phase's names (a sidecar's create() does it itself). Upstream
  // sockets belong to the namespace of the thread that makes them, and the
  // agent's upstream queries must leave from its own.
  void preresolve();

  // Stops serving: the tamper guard first (a removal by egressd is not
  // tampering), then with `remove_policy` the tables, then every socket in
  // the namespace. The tables stay otherwise (fail closed). Idempotent; the
  // first call's cleanup result is returned.
  Status close(bool remove_policy);
  // True once closed and no request or switch of this sandbox is still
  // running on the loop: the object may then be destroyed while the loop
  // goes on.
  bool idle() const;

 private:
  struct Impl;
  explicit Instance(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A file egressd writes once it runs (--metrics-file, --ready-file: the temp
// file goes next to it) must be in a directory egressd can write: checked
// before anything is installed. `option` names it in the error.
Status check_output_file(const std::string& option, const std::string& path);

}  // namespace egressd::daemon
