// `egressd run`: join the namespace, install or adopt the policy, serve the
// control socket until SIGTERM/SIGINT. The policy stays in the kernel when
// egressd exits or dies (fail closed) unless --cleanup-on-exit is given.
// The sandbox itself is an Instance (instance.h), as each of the agent's is.
#include <fcntl.h>
#include <malloc.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <algorithm>
#include <optional>

#include "daemon/audit_log.h"
#include "daemon/commands.h"
#include "daemon/sockdiag.h"
#include "daemon/instance.h"
#include "daemon/netns.h"
#include "daemon/sandbox.h"
#include "egressd/unique_fd.h"

namespace egressd::daemon {

namespace {

// The /proc directory the --netns-pid process's namespace and root are read
// through: /proc/PID, or, once its main thread has exited while others live
// on (a zombie leader has no ns/ or root/; any process may do it, without
// privilege), /proc/PID/task/TID of a thread still there. A sidecar
// restarted then could not join, and left the namespace in its phase with
// no one to switch it (the agent's restart had the same hole, attack review
// 6). `how` says which thread, for the log; empty for /proc/PID.
std::string netns_pid_dir(int pid, std::string* how) {
  const std::string dir = "/proc/" + std::to_string(pid);
  if (::access((dir + "/ns/net").c_str(), F_OK) == 0) return dir;
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator(dir + "/task", ec)) {
    const std::string tid = t.path().filename().string();
    if (!all_digits(tid)) continue;
    if (::access((t.path() / "ns/net").c_str(), F_OK) != 0) continue;
    *how = "the main thread of process " + std::to_string(pid) + " has exited; its thread " + tid + " is used";
    return t.path().string();
  }
  return dir;  // its open fails below, naming the process's own path
}

// Joins the target network namespace (`path`; none when empty). Must run
// before any socket that has to live in the sandbox (netlink, DNS proxy) is
// created, and before any thread starts: setns applies to the calling thread
// only.
Status join_netns(const std::string& path) {
  if (path.empty()) return {};
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.ok()) return Error::invalid("cannot open network namespace " + path + ": " + errno_text(errno));
  // The descriptor checked is the one joined: the process behind a pid may
  // move again, the namespace it was in when opened stays this one.
  if (auto owned = check_netns_owner(fd.get(), path); !owned) return owned;
  if (::setns(fd.get(), CLONE_NEWNET) != 0) return errno_error("cannot join network namespace " + path, errno);
  return {};
}

// Whether CAP_NET_RAW is in the bounding set of process `pid` (/proc/PID/status,
// CapBnd): then a process of its own can hold it (root, a file capability, a setuid
// binary). nullopt when that cannot be read.
std::optional<bool> may_hold_net_raw(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapBnd:", 0) != 0) continue;
    try {
      return ((std::stoull(line.substr(7), nullptr, 16) >> 13) & 1) != 0;  // CAP_NET_RAW = 13
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

// The one forged-answer path egressd does not close (docs/security.md, "An upstream
// inside the namespace"): with the resolver on loopback in the sandbox's namespace
// (Docker's 127.0.0.11), a task process with raw sockets sniffs egressd's query there
// and answers it from the resolver's own port before the resolver does. Said once at
// start, where the operator who can drop NET_RAW looks, with what to do.
void warn_if_task_can_forge_answers(int pid, const std::vector<IpPrefix>& upstreams) {
  const auto lo_upstream = std::find_if(upstreams.begin(), upstreams.end(), is_loopback);
  if (lo_upstream == upstreams.end()) return;
  const std::string lo = lo_upstream->to_string();
  const auto raw = may_hold_net_raw(pid);
  if (raw && !*raw) return;
  const std::string risk =
      "a task process that sniffs egressd's queries there can answer them from the resolver's own port before it "
      "does, and egressd cannot tell the two apart without the resolver's cgroup (docs/security.md, \"An upstream "
      "inside the namespace\")";
  const std::string remedy =
      "run egressd where it sees the host's cgroup v2 hierarchy (dockerd in the hierarchy's root) or where the "
      "resolver is listening when egressd starts, drop NET_RAW from the task "
      "(--cap-drop NET_RAW) or use an upstream outside the namespace (dns.upstream)";
  audit_event("upstream_exposed",
              {{"pid", pid},
               {"upstream", lo},
               {"net_raw", raw ? "in the bounding set" : "unknown"},
               {"risk", risk},
               {"remedy", remedy}},
              spdlog::level::warn,
              fmt::format("upstream {} is on loopback in the sandbox and the task (pid {}) may use raw sockets{}: {}; {}",
                          lo, pid, raw ? "" : " (its capabilities cannot be read)", risk, remedy));
}

}  // namespace

std::string hosts_file_for(const std::string& given, const std::string& fallback) {
  // /dev/null names no file (as documented): nothing is learned from one,
  // and it is not read (a device is refused as a hosts file).
  if (given == kNoHostsFile) return "";
  if (!given.empty()) return given;
  return fallback;
}

Status check_hosts_file(const std::string& path) {
  auto text = read_hosts_file(path);
  if (!text) return text.error();
  if (!*text) return Error::invalid("hosts file " + path + " does not exist");
  HostsLoad load = load_hosts(**text, path);
  if (!load.problems.empty()) {
    std::string msg = load.problems.front();
    if (load.problems.size() > 1) msg += " (and " + std::to_string(load.problems.size() - 1) + " more problems)";
    return Error::invalid(msg);
  }
  return {};
}

Result<Policy> builtin_policy(const std::vector<std::string>& allow) {
  Policy p;
  p.phases.push_back({"public", Mode::public_, {}});
  p.phases.push_back({"no-network", Mode::no_network, {}});
  auto al = make_inline_phase("allowlist", Mode::allowlist, allow);
  if (!al) return al.error();
  p.phases.push_back(*al);
  // Fail closed: without a config and without --phase, nothing leaves.
  p.initial_phase = "no-network";
  return p;
}

Status write_ready_file(const std::string& path, const nft::ActiveState& st) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "phase=" << st.phase << " generation=" << st.generation << "\n";
    if (!out) return errno_error("cannot write ready file " + tmp, errno);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return errno_error("cannot create ready file " + path, errno);
  return {};
}

// The namespace egressd is in, as "<boot id>:<cookie>" (netns.h): never the
// name of another. Empty on a kernel without the cookie (before 5.14).
std::string netns_identity() {
  const auto cookie = current_netns_cookie();
  const std::string boot = boot_id();
  if (!cookie || !*cookie || boot.empty()) return {};
  return boot + ":" + std::to_string(**cookie);
}

// The file /etc/resolv.conf is, as "<boot id>:<device>:<inode>:<birth
// time>": the same while the file lives (written in place or not), another
// for a file made anew, even on a reused inode. Empty where the file system
// gives no birth time.
std::string resolv_conf_identity() {
  struct statx stx {};
  if (::statx(AT_FDCWD, "/etc/resolv.conf", 0, STATX_INO | STATX_BTIME, &stx) != 0) return {};
  if ((stx.stx_mask & STATX_BTIME) == 0) return {};
  const std::string boot = boot_id();
  if (boot.empty()) return {};
  return fmt::format("{}:{}:{}:{}:{}.{:09}", boot, stx.stx_dev_major, stx.stx_dev_minor, stx.stx_ino,
                     stx.stx_btime.tv_sec, stx.stx_btime.tv_nsec);
}

// The resolv.conf this egressd reads its upstream from (and Docker's
// forwarder targets): the one egressd first read from this file, kept in
// `kept` (beside the state file), for as long as the file lives. A container
// that shares its resolv.conf with egressd's (Docker's `network_mode:
// service:X`, a pod) can write it, as root with no capability at all: read
// afresh at a restart, a server of the sandbox's would become egressd's
// upstream and answer allowed names with any address, or an empty file would
// stop egressd from starting again, leaving the phase in force with no one
// to switch it (attack review 11). That holds whether the restart is in the
// same namespace or, egressd's container restarted, in a new one with the
// same file (attack review L). A new file (a new container, a new task's
// with --netns-pid) is read afresh and kept again. Where the file system
// gives no birth time, the key is the namespace, as before review L.
std::string kept_resolv_conf(const std::string& kept, const std::shared_ptr<spdlog::logger>& log) {
  const std::string current = read_resolv_conf();
  std::string id = resolv_conf_identity();
  std::string what = "file " + id;
  if (id.empty()) {
    id = netns_identity();
    what = "network namespace " + id;
  }
  if (id.empty()) return current;
  const std::string head = "# egressd: the resolv.conf first read from " + what + "\n";
  {
    std::ifstream in(kept);
    std::stringstream text;
    text << in.rdbuf();
    const std::string was = text.str();
    if (in && was.starts_with(head)) {
      const std::string first = was.substr(head.size());
      if (first != current) {
        log->warn("event=resolv_conf_changed /etc/resolv.conf changed since egressd first read it (a container "
                  "sharing it may have written it): keeping the first, from {} (remove that file to read "
                  "/etc/resolv.conf afresh)",
                  kept);
      }
      return first;
    }
  }
  const std::string tmp = kept + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << head << current;
    if (!out) {
      log->warn("cannot keep /etc/resolv.conf in {} ({}): a restart reads it afresh", tmp, errno_text(errno));
      return current;
    }
  }
  if (std::rename(tmp.c_str(), kept.c_str()) != 0) {
    log->warn("cannot keep /etc/resolv.conf in {} ({}): a restart reads it afresh", kept, errno_text(errno));
  }
  return current;
}

TrimWhenIdle::TrimWhenIdle(boost::asio::io_context& io) : timer_(io) {}

void TrimWhenIdle::operator()() {
  timer_.expires_after(std::chrono::milliseconds(300));  // cancels a pending trim
  timer_.async_wait([](const boost::system::error_code& ec) {
    if (!ec) ::malloc_trim(0);
  });
}

int cmd_run(const RunArgs& a) {
  setup_logging(a.log_format == "json" ? LogFormat::json : LogFormat::text);
  auto log = spdlog::get("egressd");
  ::signal(SIGPIPE, SIG_IGN);

  Result<Policy> policy = a.config.empty() ? builtin_policy(a.allow) : load_policy_file(a.config);
  if (!policy) return report(policy.error());
  if (!a.config.empty() && !a.allow.empty()) {
    return report(Error::invalid("--allow is only for the built-in allowlist phase; put entries in " + a.config));
  }
  const std::string initial = a.phase.empty() ? policy->initial_phase : a.phase;
  if (policy->find(initial) == nullptr) return report(Error::invalid("unknown phase \"" + initial + "\""));
  if (auto s = check_output_file("--metrics-file", a.metrics_file); !s) return report(s.error());
  if (auto s = check_output_file("--ready-file", a.ready_file); !s) return report(s.error());
  // A hosts file the operator named must be there and readable, or nothing
  // is installed (exit 2); the default one may be missing.
  std::string pid_note;
  const std::string pid_dir = a.netns_pid != 0 ? netns_pid_dir(a.netns_pid, &pid_note) : "";
  const std::string netns = a.netns_pid != 0 ? pid_dir + "/ns/net" : a.netns_path;
  const std::string hosts_file = hosts_file_for(a.hosts_file, a.netns_pid != 0 ? pid_dir + "/root/etc/hosts" : "/etc/hosts");
  if (!a.hosts_file.empty() && !hosts_file.empty()) {
    if (auto s = check_hosts_file(hosts_file); !s) return report(s.error());
  }

  // Before the sandbox's namespace is joined (sockdiag.h own_cgroup).
  (void)own_cgroup();
  if (auto s = join_netns(netns); !s) return report(s.error());
  if (!pid_note.empty()) log->warn("joined the network namespace of process {} through {}: {}", a.netns_pid, netns, pid_note);
  boost::asio::io_context io;
  TrimWhenIdle trim_when_idle(io);

  InstanceOptions o;
  o.policy = std::move(*policy);
  o.initial = initial;
  o.netns = netns;
  o.socket = a.socket;
  o.allow_uids = a.allow_uids;
  o.state_file = a.state_file.empty() ? a.socket + ".state" : a.state_file;
  o.dns_port = a.dns_port;
  o.verify_interval_s = a.verify_interval_s;
  o.monitor_rcvbuf = a.monitor_rcvbuf;
  o.denied_records = a.denied_records;
  o.names = a.names;
  o.metrics_file = a.metrics_file;
  o.metrics_interval_s = a.metrics_interval_s;
  o.resolv_conf = kept_resolv_conf(o.state_file + ".resolv", log);
  o.hosts_file = hosts_file;
  // A ready file says this egressd is ready: one a killed egressd left goes
  // before this one installs anything (a second egressd, refused, leaves the
  // first one's alone).
  o.claimed = [&a] {
    if (!a.ready_file.empty()) ::unlink(a.ready_file.c_str());
  };
  o.after_switch = [&trim_when_idle] { trim_when_idle(); };
  o.after_request = [&trim_when_idle] { trim_when_idle(); };
  // Every interface of the namespace gone, after it had some: its container
  // stopped. Docker and Podman give a restarted container a new namespace,
  // so when egressd joined the task's (`network_mode: service:task`), the
  // restarted task ran in one with no policy while this egressd, in the old
  // one, still looked ready and took every switch (attack review 11). It
  // exits (3) instead, the ready file gone: the orchestrator's next request
  // fails, and a restart policy starts egressd in the task's new namespace.
  int exit_code = 0;
  bool had_interfaces = false;
  o.interfaces_changed = [&](const std::vector<std::string>& interfaces) {
    if (!interfaces.empty()) {
      had_interfaces = true;
      return;
    }
    if (!had_interfaces || exit_code != 0) return;
    if (!a.ready_file.empty()) ::unlink(a.ready_file.c_str());
    log->error("event=namespace_abandoned every network interface left the namespace egressd serves (its "
               "container stopped; a restarted container gets a new namespace, with no policy in it): exiting");
    exit_code = 3;
    io.stop();
  };
  auto made = Instance::create(io, std::move(o));
  if (!made) return report(made.error());
  Instance& inst = **made;
  Sandbox& sandbox = inst.sandbox();

  std::string ups;
  for (const auto& u : inst.upstream()) ups += (ups.empty() ? "" : ",") + u;
  audit_event("startup",
              {{"version", EGRESSD_VERSION},
               {"pid", ::getpid()},
               {"netns", inst.options().netns},
               {"phase", sandbox.state().phase},
               {"mode", to_string(sandbox.state().mode)},
               {"generation", sandbox.state().generation},
               {"socket", a.socket},
               {"dns_port", inst.dns_port()},
               {"upstream", inst.upstream()},
               {"capabilities", sandbox.capabilities().to_json()},
               {"verify_interval_s", a.verify_interval_s},
               {"startup_us", inst.startup_us()}},
              spdlog::level::info,
              fmt::format("ready phase={} mode={} gen={} socket={} dns_port={} upstream={} startup_us={}",
                          sandbox.state().phase, to_string(sandbox.state().mode), sandbox.state().generation,
                          a.socket, inst.dns_port(), ups.empty() ? "-" : ups, inst.startup_us()));

  // Only while the hole is open: the resolver's cgroup unknown (chain output
  // cannot tell its sockets from a raw socket of the task's) or no netdev
  // egress hook (chain lo_replies cannot stop frames written to `lo`).
  if (a.netns_pid != 0 && (!sandbox.compile_options().lo_resolver || !sandbox.compile_options().netdev)) {
    warn_if_task_can_forge_answers(a.netns_pid, sandbox.compile_options().upstreams);
  }

  boost::asio::signal_set signals(io, SIGTERM, SIGINT);
  signals.async_wait([&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    const auto [tampers, restores] = sandbox.tamper_counts();
    audit_event("shutdown",
                {{"signal", sig},
                 {"phase", sandbox.state().phase},
                 {"generation", sandbox.state().generation},
                 {"policy", a.cleanup_on_exit ? "removed" : "stays"},
                 {"tampers", tampers},
                 {"restores", restores}},
                spdlog::level::info,
                fmt::format("signal={} shutting down; policy {}", sig,
                            a.cleanup_on_exit ? "removed (--cleanup-on-exit)" : "stays in force"));
    if (auto s = inst.close(a.cleanup_on_exit); !s) {
      log->error("cleanup failed: {}", s.error().message);
      exit_code = 1;
    }
    io.stop();
  });
  // Ready only once SIGTERM is handled: an orchestrator may stop us at once.
  if (!a.ready_file.empty()) {
    if (auto s = write_ready_file(a.ready_file, sandbox.state()); !s) return report(s.error());
  }
  trim_when_idle();
  io.run();
  made->reset();  // joins the state file writer: nothing written is lost
  if (!a.ready_file.empty()) ::unlink(a.ready_file.c_str());
  return exit_code;
}

}  // namespace egressd::daemon
