// The subcommands of the egressd binary. Each returns the process exit code:
// 0 ok, 1 runtime failure, 2 invalid input (message on stderr names the culprit).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "egressd/result.h"

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
};
int cmd_run(const RunArgs& args);

// Prints `error: <message>` to stderr and returns 2 (invalid) or 1 (runtime).
int report(const Error& err);


}  // namespace egressd::daemon
