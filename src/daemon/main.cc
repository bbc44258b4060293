// egressd: the daemon (`run`, `agent`) and its offline tools (`check`, `render`).
// main only parses arguments; each subcommand is a function over the core library.
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>

#include "control/client.h"
#include "daemon/commands.h"

int main(int argc, char** argv) {
  using namespace egressd::daemon;
  CLI::App app{"egressd: egress control for sandboxes (nftables + allowlisting DNS proxy)"};
  app.require_subcommand(1);

  CheckArgs check;
  auto* c = app.add_subcommand("check", "validate a policy file and/or entries; print normalized entries");
  c->add_option("--config", check.config, "policy file (YAML or JSON)");
  // allow_extra_args(false): one value per --allow, kept as typed. With it on (CLI11's
  // default for a vector) a value "[a,b]" is expanded into a and b before egressd sees it,
  // so "[2001:db8::1]" passed as 2001:db8::1 and the entry validator never saw the brackets.
  c->add_option("--allow", check.allow, "an allowlist entry (repeatable)")->allow_extra_args(false);

  RenderArgs render;
  auto* r = app.add_subcommand("render", "print the nft script a phase compiles to");
  r->add_option("--config", render.config, "policy file")->required();
  r->add_option("--phase", render.phase, "phase name")->required();
  r->add_option("--dns-port", render.dns_port, "DNS proxy port the redirect points at (as for run); 0 = none")
      ->check(CLI::Range(0, 65535));
  r->add_option("--interface", render.interfaces,
                "an interface to give an egress chain in table netdev egressd (repeatable; run makes one per "
                "non-loopback interface of its namespace)");

  RunArgs run;
  run.socket = egressd::control::default_socket_path();
  auto* d = app.add_subcommand("run", "enforce a policy in a network namespace and serve the control socket");
  d->add_option("--socket", run.socket, "control socket path (default $EGRESSD_SOCKET or /run/egressd/egressd.sock)");
  d->add_option("--config", run.config, "policy file; without it the phases are public, no-network and allowlist");
  d->add_option("--phase", run.phase, "initial phase on a fresh start (an adopted table keeps its phase)");
  auto* ns_path = d->add_option("--netns", run.netns_path, "network namespace to join (path, e.g. /run/netns/NAME)");
  d->add_option("--netns-pid", run.netns_pid, "join the network namespace of this process")->excludes(ns_path);
  d->add_option("--hosts-file", run.hosts_file,
                "hosts file whose names are learned like DNS answers (default /etc/hosts, or "
                "/proc/PID/root/etc/hosts with --netns-pid; /dev/null for none); read at start, at every switch and "
                "when it changes; pairs added after start are not taken, across restarts too (the start's pairs are "
                "kept in <state-file>.hosts)");
  d->add_option("--ready-file", run.ready_file, "created once the initial policy is in the kernel");
  d->add_option("--state-file", run.state_file, "where inline policies are kept for adoption (default <socket>.state)");
  d->add_option("--allow-uid", run.allow_uids, "uid allowed on the control socket besides root (repeatable)");
  d->add_option("--allow", run.allow, "entries of the built-in allowlist phase (without --config; repeatable)")
      ->allow_extra_args(false);  // verbatim, as for check
  d->add_option("--dns-port", run.dns_port,
                "port of the DNS proxy on 127.0.0.1/::1 in the sandbox (default 53); 0 = no DNS interception")
      ->check(CLI::Range(0, 65535));
  d->add_option("--denied-records", run.denied_records, "denied-connection records kept (oldest dropped first)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  d->add_option("--names", run.names, "resolved (phase, name) pairs kept for `hosts` and attribution")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  d->add_option("--metrics-file", run.metrics_file,
                "write the `egressctl metrics` text to this file (atomically: temp file + rename) every "
                "--metrics-interval seconds, for node_exporter's textfile collector (name it *.prom)");
  d->add_option("--metrics-interval", run.metrics_interval_s, "seconds between --metrics-file writes")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  d->add_flag("--cleanup-on-exit", run.cleanup_on_exit, "delete the nftables table on SIGTERM/SIGINT");
  d->add_option("--log-format", run.log_format, "text or json")->check(CLI::IsMember({"text", "json"}));
  d->add_option("--verify-interval", run.verify_interval_s,
                "seconds between checks of the nftables table against the phase in force (tamper safety net); 0 = off")
      ->check(CLI::Range(0.0, 86400.0));
  d->add_option("--monitor-rcvbuf", run.monitor_rcvbuf,
                "receive buffer of the nftables event socket in bytes (default 8 MiB, grows on overrun)")
      ->check(CLI::Range(0, 1 << 30));

  AgentArgs agent;
  auto* ag = app.add_subcommand("agent", "serve many sandboxes from one process: attach each network namespace with "
                                         "`egressctl --socket AGENT sandbox add`");
  ag->add_option("--socket", agent.socket, "the agent's control socket")->capture_default_str();
  ag->add_option("--state-dir", agent.state_dir,
                 "keep each sandbox here, so that a restarted agent attaches them again and adopts their tables");
  ag->add_option("--allow-uid", agent.allow_uids, "uid allowed on the agent socket besides root (repeatable)");
  ag->add_option("--log-format", agent.log_format, "text or json")->check(CLI::IsMember({"text", "json"}));
  ag->add_option("--verify-interval", agent.verify_interval_s,
                 "seconds between checks of each sandbox's table against its phase (tamper safety net); 0 = off")
      ->check(CLI::Range(0.0, 86400.0));
  ag->add_option("--events,--nft-events", agent.events,
                 "shared: the sandboxes' tamper guards hear nftables changes, and their interface watches link and "
                 "route changes, through one socket each in the agent's namespace (needs CAP_NET_BROADCAST; else "
                 "per-sandbox); per-sandbox: sockets in each namespace")
      ->check(CLI::IsMember({"shared", "per-sandbox"}))
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "error: " << e.what() << "\n" << "run 'egressd --help' for usage\n";
    return 2;
  }
  if (c->parsed()) return cmd_check(check);
  if (r->parsed()) return cmd_render(render);
  if (ag->parsed()) return cmd_agent(agent);
  return cmd_run(run);
}
