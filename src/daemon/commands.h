// The subcommands of the egressd binary. Each returns the process exit code:
// 0 ok, 1 runtime failure, 2 invalid input (message on stderr names the culprit).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "egressd/policy.h"
#include "egressd/result.h"
#include "nft/compile.h"

namespace egressd::daemon {

struct CheckArgs {
  std::string config;               // "" = none
  std::vector<std::string> allow;
};
int cmd_check(const CheckArgs& args);

struct RenderArgs {
  std::string config;
  std::string phase;
  int dns_port = 53;
  std::vector<std::string> interfaces;  // one egress chain each in table netdev egressd
};
int cmd_render(const RenderArgs& args);

struct RunArgs {
  std::string socket;
  std::string config;               // "" = built-in phases public / no-network / allowlist
  std::string phase;                // initial phase on a fresh start ("" = initial_phase)
  std::string netns_path;           // "" = stay in the current namespace
  int netns_pid = 0;                // 0 = unused
  std::string ready_file;
  std::string state_file;           // "" = <socket>.state
  std::vector<std::uint32_t> allow_uids;
  bool cleanup_on_exit = false;
  std::string log_format = "text";  // text | json
  std::vector<std::string> allow;   // extra entries for --phase allowlist without config
  int dns_port = 53;                // DNS proxy port on loopback in the sandbox; 0 = no interception
  double verify_interval_s = 5;     // tamper safety net: compare the table every N s; 0 = off
  int monitor_rcvbuf = 0;           // nftables event socket buffer, bytes; 0 = default (8 MiB, grows)
  std::size_t denied_records = 1024;  // denied-record ring size
  std::size_t names = 8192;         // (phase, name) pairs remembered for attribution and `hosts`
  std::string metrics_file;         // "" = none; else rewritten every metrics_interval_s (textfile collector)
  double metrics_interval_s = 5;
  // Names resolved without DNS (docs/pinning.md "Hosts files"); "" = the
  // default: /etc/hosts, or /proc/PID/root/etc/hosts with netns_pid.
  std::string hosts_file;
};
int cmd_run(const RunArgs& args);

// The hosts file a sandbox learns from: `given`, else `fallback` (the
// sidecar's: /etc/hosts, or the --netns-pid process's own); "" (none) when
// `given` is kNoHostsFile.
inline constexpr const char* kNoHostsFile = "/dev/null";
std::string hosts_file_for(const std::string& given, const std::string& fallback);
// Checks a hosts file named on the command line or in sandbox_add before
// anything is installed: it must exist, be readable and parse without a
// problem. Invalid error naming the file (and line) otherwise.
Status check_hosts_file(const std::string& path);

// The phases `run` and `sandbox add` offer without a policy file: public,
// no-network (the initial one: fail closed) and allowlist with `allow`.
Result<Policy> builtin_policy(const std::vector<std::string>& allow);

// Writes "phase=P generation=G" to `path` atomically (temp file + rename).
Status write_ready_file(const std::string& path, const nft::ActiveState& st);

// Building a policy (parse, compile, the netlink batch) allocates far more
// than the policy in force keeps; glibc holds the freed memory in its heap
// unless asked. Calling this after start-up or a switch hands it back once
// the process has been idle for 300 ms (about 1 MiB of 8 idle with 1k
// entries); deferred, so back-to-back switches never wait for a trim.
class TrimWhenIdle {
 public:
  explicit TrimWhenIdle(boost::asio::io_context& io);
  void operator()();

 private:
  boost::asio::steady_timer timer_;
};

struct AgentArgs {
  std::string socket = "/run/egressd/agent.sock";
  std::string state_dir;            // "" = no restart adoption
  std::vector<std::uint32_t> allow_uids;
  std::string log_format = "text";
  double verify_interval_s = 5;
  // "shared": one nftables event socket and one rtnetlink socket for every
  // sandbox (event_hub.h), when the agent may listen in every namespace;
  // "per-sandbox": sockets in each namespace.
  std::string events = "shared";
};
int cmd_agent(const AgentArgs& args);

// Prints `error: <message>` to stderr and returns 2 (invalid) or 1 (runtime).
int report(const Error& err);


}  // namespace egressd::daemon
