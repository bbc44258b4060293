// `egressd run`: join the namespace, install or adopt the policy, serve the
// control socket until SIGTERM/SIGINT. The policy stays in the kernel when
// egressd exits or dies (fail closed) unless --cleanup-on-exit is given.
//
// Over 500 lines because it is the wiring of one process: the namespace
// join, the policy, the Sandbox, the DNS proxy, the tamper guard, NFLOG, the
// interface watch, the flow reaper, the control server, the metrics file and
// the shutdown order, each a few dozen lines; the per-sandbox logic itself
// lives in sandbox*.cc.
#include <fcntl.h>
#include <malloc.h>
#include <sched.h>
#include <signal.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "audit/nflog.h"
#include "daemon/pinq.h"
#include "control/protocol.h"
#include "control/server.h"
#include "daemon/audit_log.h"
#include "daemon/commands.h"
#include "daemon/ctforget.h"
#include "daemon/netwatch.h"
#include "daemon/sandbox.h"
#include "daemon/sockdiag.h"
#include "daemon/tamper_guard.h"
#include "dns/proxy.h"
#include "egressd/unique_fd.h"

namespace egressd::daemon {

namespace {

// Hostname pinning's questions, answered by the sandbox (daemon/pinq.h).
class SandboxPinJudge : public PinJudge, private pin::PinFacts {
 public:
  explicit SandboxPinJudge(Sandbox& sb) : sb_(sb) {}
  const pin::PinFacts& pin_facts() const override { return *this; }
  std::uint32_t pass_mark() const override { return sb_.compile_options().pass_mark; }
  void pin_decided(const pin::Decision& d, const IpPrefix& dst, std::uint16_t port) override {
    if (d.kind == pin::Decision::Kind::reset) {
      spdlog::get("egressd")->info("pin reset: {}", d.reason);
      sb_.pin_reset(dst, port, d.reason);
    } else {
      spdlog::get("egressd")->debug("pin admit: {}", d.reason);
    }
  }

 private:
  std::vector<std::string> names_for(const IpPrefix& addr) const override { return sb_.learned_names_for(addr); }
  const Entry* allowed(std::string_view name) const override { return sb_.allowed_name(name); }
  Sandbox& sb_;
};

// Joins the target network namespace. Must run before any socket that has to
// live in the sandbox (netlink, DNS proxy) is created, and before any thread
// starts: setns applies to the calling thread only.
Status join_netns(const RunArgs& a) {
  std::string path = a.netns_path;
  if (a.netns_pid != 0) path = "/proc/" + std::to_string(a.netns_pid) + "/ns/net";
  if (path.empty()) return {};
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.ok()) return Error::invalid("cannot open network namespace " + path + ": " + errno_text(errno));
  if (::setns(fd.get(), CLONE_NEWNET) != 0) return errno_error("cannot join network namespace " + path, errno);
  return {};
}

Result<Policy> builtin_policy(const RunArgs& a) {
  Policy p;
  p.phases.push_back({"public", Mode::public_, {}});
  p.phases.push_back({"no-network", Mode::no_network, {}});
  auto al = make_inline_phase("allowlist", Mode::allowlist, a.allow);
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

// 32 bits for the table's secrets (Sandbox::draw_secrets rejects the values
// that must not be used and draws again).
std::uint32_t random32() {
  std::uint32_t m = 0;
  while (::getrandom(&m, sizeof m, 0) != static_cast<ssize_t>(sizeof m)) {
  }
  return m;
}

// Watches the namespace's interfaces: every link or IPv6 route change is
// answered with a fresh dump handed to the sandbox (new interfaces get their
// egress chain, vanished ones lose it). A wait on the socket, then a drain and
// a dump; errors are logged and the watch goes on.
class NetWatchLoop {
 public:
  NetWatchLoop(boost::asio::io_context& io, NetWatch watch, Sandbox& sandbox)
      : watch_(std::move(watch)), sd_(io, watch_.fd()), sandbox_(sandbox) {}
  ~NetWatchLoop() { close(); }
  void start() { wait(); }
  void close() {
    if (closed_) return;
    closed_ = true;
    boost::system::error_code ec;
    sd_.cancel(ec);
    (void)sd_.release();  // the fd belongs to watch_
  }

 private:
  void wait() {
    sd_.async_wait(boost::asio::posix::stream_descriptor::wait_read, [this](const boost::system::error_code& ec) {
      if (ec || closed_) return;
      on_readable();
      wait();
    });
  }
  void on_readable() {
    auto changed = watch_.drain();
    if (!changed) {
      spdlog::get("egressd")->error("interface watch: {}", changed.error().message);
    } else if (!*changed) {
      return;
    }
    auto view = watch_.dump();
    if (!view) {
      spdlog::get("egressd")->error("interface watch: {}", view.error().message);
      return;
    }
    if (auto st = sandbox_.update_network(*view); !st) {
      spdlog::get("egressd")->error("interface watch: {}", st.error().message);
    }
  }

  NetWatch watch_;
  boost::asio::posix::stream_descriptor sd_;
  Sandbox& sandbox_;
  bool closed_ = false;
};

// True when this kernel takes the deny chain's rate-limited log rule (nft_log
// and nft_limit; nft_log needs the nfnetlink_log backend, which a container
// cannot load as a module). Probed like the capabilities: nothing stays.
bool probe_log(nft::Kernel& kernel, std::uint16_t group) {
  nft::Table t;
  t.name = "egressd_probe";
  t.chains.push_back({"c", std::nullopt, {{{nft::StmtLimit{nft::kLogRate, nft::kLogBurst}, nft::StmtLog{group}}, ""}}});
  nft::Change ch;
  ch.table = t.name;
  ch.ops.push_back(nft::OpAddTable{t});
  ch.ops.push_back(nft::OpDeleteTable{t.name});
  return kernel.apply(ch).ok();
}

// --metrics-file must name a file in a directory egressd can write (the temp
// file goes next to it): checked before anything is installed.
Status check_metrics_file(const std::string& path) {
  if (path.empty()) return {};
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (!p.has_filename() || fs::is_directory(p, ec)) {
    return Error::invalid("--metrics-file " + path + ": names a directory, not a file");
  }
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) return Error::invalid("--metrics-file " + path + ": no directory " + dir.string());
  if (::access(dir.c_str(), W_OK) != 0) {
    Error e = errno_error("--metrics-file " + path + ": cannot write in " + dir.string(), errno);
    e.kind = ErrorKind::invalid;
    return e;
  }
  return {};
}

// `--metrics-file`: every interval the metrics text is built on the event
// loop (tens of microseconds: two chain dumps, retried on timers) and written by a
// thread of its own, so a slow disk never holds up a switch or a DNS answer.
// A write still running when the next is due makes that one skip.
class MetricsFile {
 public:
  MetricsFile(boost::asio::io_context& io, Sandbox& sandbox, std::string path, std::chrono::milliseconds interval)
      : sandbox_(sandbox), path_(std::move(path)), interval_(interval), timer_(io) {}
  ~MetricsFile() {
    timer_.cancel();
    writer_.join();  // the last write finishes
  }
  // Writes once now (synchronously: the file exists when egressd is ready),
  // then every interval.
  Status start() {
    if (auto s = write_atomically(path_, sandbox_.metrics_text()); !s) return s;
    schedule();
    return {};
  }
  void close() {
    closed_ = true;
    timer_.cancel();
  }

 private:
  void schedule() {
    if (closed_) return;
    timer_.expires_after(interval_);
    timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      tick();
    });
  }
  // The text is built from the counted chains read as status reads them
  // (retries on the loop's timers); the next tick is scheduled once it is
  // built, so one build at a time. Pending work is destroyed with the loop,
  // never run after this object is gone (the loop stops first).
  void tick() {
    const auto t0 = std::chrono::steady_clock::now();
    sandbox_.metrics_text([this, t0](std::string text) {
      schedule();
      const auto us =
          std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
      if (busy_.exchange(true)) {
        spdlog::get("egressd")->debug("metrics file write still running; this one skipped");
        return;
      }
      spdlog::get("egressd")->trace("metrics text built us={} bytes={}", us, text.size());
      boost::asio::post(writer_, [this, text = std::move(text)] {
        auto s = write_atomically(path_, text);
        // Said once when writes start failing and once when they work again.
        if (!s && !failing_) spdlog::get("egressd")->warn("metrics file not written: {}", s.error().message);
        if (s && failing_) spdlog::get("egressd")->info("metrics file written again path={}", path_);
        failing_ = !s;
        busy_ = false;
      });
    });
  }

  Sandbox& sandbox_;
  const std::string path_;
  const std::chrono::milliseconds interval_;
  boost::asio::steady_timer timer_;
  boost::asio::thread_pool writer_{1};
  std::atomic<bool> busy_{false};
  bool closed_ = false;   // loop only
  bool failing_ = false;  // writer thread only
};

}  // namespace

int cmd_run(const RunArgs& a) {
  setup_logging(a.log_format == "json" ? LogFormat::json : LogFormat::text);
  auto log = spdlog::get("egressd");
  ::signal(SIGPIPE, SIG_IGN);

  Result<Policy> policy = a.config.empty() ? builtin_policy(a) : load_policy_file(a.config);
  if (!policy) return report(policy.error());
  if (!a.config.empty() && !a.allow.empty()) {
    return report(Error::invalid("--allow is only for the built-in allowlist phase; put entries in " + a.config));
  }
  const std::string initial = a.phase.empty() ? policy->initial_phase : a.phase;
  if (policy->find(initial) == nullptr) return report(Error::invalid("unknown phase \"" + initial + "\""));
  if (auto s = check_metrics_file(a.metrics_file); !s) return report(s.error());

  if (auto s = join_netns(a); !s) return report(s.error());
  auto kernel = nft::open_kernel();
  if (!kernel) return report(kernel.error());
  const Capabilities caps = probe_capabilities(**kernel);

  if (!caps.filter) {
    // Every probe failed: almost always a missing capability, not a kernel
    // without nf_tables.
    return report(Error::runtime(
        "cannot program nftables in this network namespace: egressd needs CAP_NET_ADMIN there "
        "(Operation not permitted), or the kernel lacks nf_tables"));
  }
  if (!caps.fib || (a.dns_port != 0 && !caps.socket)) {
    // Integral to the ruleset (forged sources, broadcast guards; egressd's
    // upstream sockets taking replies only): without them there is no policy
    // to offer, only a weaker one, and egressd never weakens silently.
    return report(Error::runtime(std::string("this kernel lacks nftables ") + (!caps.fib ? "fib" : "socket") +
                                 " matching (" + (!caps.fib ? "nft_fib_inet" : "nft_socket") +
                                 "), which egressd's ruleset needs; load the module on the host"));
  }
  if (!caps.egress_hook) {
    // Run, but never claim it: `capabilities` says block_raw_frames=false.
    log->warn("this kernel has no netdev egress hook (Linux >= 5.16, CONFIG_NETFILTER_EGRESS): frames a sandbox "
              "process writes with AF_PACKET (CAP_NET_RAW, in Docker's default set) are NOT held to the policy; drop "
              "NET_RAW from the sandbox (docs/security.md)");
  }
  if (a.dns_port != 0 && !caps.nat) {
    return report(Error::runtime(
        "this kernel cannot redirect DNS to egressd (no nat in nf_tables); hostnames cannot be enforced. "
        "Run with --dns-port 0 to enforce addresses only"));
  }
  if (policy->enforce.log_group != 0 && !probe_log(**kernel, policy->enforce.log_group)) {
    // Logging is for `egressctl denied`, not enforcement: run without it
    // rather than not at all, and say so.
    log->warn("this kernel cannot log denied packets (nft log/limit, nfnetlink_log); running without "
              "log_group={}: `denied` will show refused DNS queries only",
              policy->enforce.log_group);
    policy->enforce.log_group = 0;
  }
  const std::string resolv_conf = read_resolv_conf();
  const std::vector<std::string> upstream = dns::expand_upstreams(policy->dns, resolv_conf);

  SandboxOptions opts;
  opts.state_file = a.state_file.empty() ? a.socket + ".state" : a.state_file;
  // Where Docker's embedded resolver forwards (the DNS proxy's relay
  // targets): from resolv.conf's "# ExtServers:" comment (Docker >= 25);
  // else those an earlier egressd pinned, which start() adopts from the
  // kernel's upstream sets; else the proxy's probe pins them.
  dns::ForwarderOptions forwarder;
  forwarder.probe = true;
  if (const dns::ExtServers ext = dns::ext_servers_from_resolv_conf(resolv_conf); ext.present) {
    forwarder.targets = ext.targets;
    forwarder.source = "resolv.conf";
    forwarder.probe = false;  // Docker said where it forwards: nothing to guess
  }
  opts.compile = compile_options(upstream, a.dns_port);
  // A fresh table gets secrets nobody can predict (see nft/compile.h).
  opts.random = random32;
  opts.policy = *policy;
  opts.netns = a.netns_pid != 0 ? "/proc/" + std::to_string(a.netns_pid) + "/ns/net" : a.netns_path;
  opts.socket = a.socket;
  boost::asio::io_context io;
  // Created after join_netns: its thread must live in the sandbox namespace.
  FlowReaper reaper(policy->enforce.inbound_replies, a.dns_port != 0, [log](Result<int> n, std::uint64_t gen) {
    if (!n) {
      log->warn("flows not aborted gen={} (the rules still cut them): {}", gen, n.error().message);
    } else if (*n > 0) {
      log->info("aborted sockets={} gen={} (flows the new phase does not allow)", *n, gen);
    }
  });
  // Building a policy (parse, compile, the netlink batch) allocates far more
  // than the policy in force keeps; glibc holds the freed memory in its heap
  // unless asked. Once the daemon has been idle for a moment after start-up
  // or a switch, hand it back: about 1 MiB of 8 idle with 1k entries.
  // Deferred, so that back-to-back switches never wait for a trim.
  boost::asio::steady_timer trim_timer(io);
  auto trim_when_idle = [&trim_timer] {
    trim_timer.expires_after(std::chrono::milliseconds(300));  // cancels a pending trim
    trim_timer.async_wait([](const boost::system::error_code& ec) {
      if (!ec) ::malloc_trim(0);
    });
  };
  opts.after_switch = [&reaper, &trim_when_idle](std::shared_ptr<const Phase> phase, std::uint64_t gen) {
    reaper.reap(std::move(phase), gen);
    trim_when_idle();
  };
  opts.post = [&io](std::function<void()> fn) { boost::asio::post(io, std::move(fn)); };
  opts.run_after = [&io](std::chrono::milliseconds delay, std::function<void()> fn) {
    auto t = std::make_shared<boost::asio::steady_timer>(io, delay);
    t->async_wait([t, fn = std::move(fn)](const boost::system::error_code& ec) {
      if (!ec) fn();
    });
  };
  // The inline state file is written here, off the loop; one thread, so
  // writes land in order. Joined after the loop ends (nothing written is lost).
  boost::asio::thread_pool file_writer(1);
  opts.write_off_loop = [&file_writer](std::function<void()> fn) { boost::asio::post(file_writer, std::move(fn)); };
  opts.executor = io.get_executor();
  opts.denied.capacity = a.denied_records;
  opts.names.max_entries = a.names;
  Sandbox sandbox(std::move(opts), std::move(*kernel), caps);
  const auto t0 = std::chrono::steady_clock::now();

  // Subscribed before start: every change after it is seen (start's own are
  // told apart by the portid).
  TamperGuardOptions gopts;
  gopts.verify_interval = std::chrono::milliseconds(static_cast<std::int64_t>(a.verify_interval_s * 1000));
  if (a.monitor_rcvbuf > 0) {
    gopts.rcvbuf = a.monitor_rcvbuf;
    gopts.grow_rcvbuf = false;
  }
  auto guard = TamperGuard::open(io, sandbox, gopts);
  if (!guard) return report(guard.error().wrap("tamper detection"));
  sandbox.set_tamper_counts([g = guard->get()] { return std::pair{g->tampers(), g->restores()}; });
  sandbox.set_large_batch_runner(
      [g = guard->get()](const std::function<Status()>& apply) { return g->apply_unheard(apply); });

  // The proxy binds before the table is built (issue 14, class 10): if its
  // port was taken while egressd was down, it listens elsewhere and the
  // redirect is built (or restaged: the port is part of the staged digest)
  // to point there. It also binds the upstreams local to the namespace
  // before anything is served. It serves once the own-traffic mark is fixed
  // by start (drawn, or adopted from the table); until then queries queue.
  std::unique_ptr<ConntrackForgetter> forgetter;  // outlives the proxy that tells it
  std::unique_ptr<dns::Proxy> proxy;
  if (a.dns_port != 0) {
    if (upstream.empty()) log->warn("no upstream DNS server (dns.upstream); allowed names will get SERVFAIL");
    dns::ProxyOptions popts;
    popts.port = static_cast<std::uint16_t>(a.dns_port);
    popts.fallback_port = true;
    popts.upstream = upstream;
    popts.max_ttl = policy->dns.max_ttl_s;
    popts.forwarder = forwarder;
    if (auto ct = ConntrackForgetter::open(io)) {
      forgetter = std::move(*ct);
      popts.forget_flow = [f = forgetter.get()](const dns::FlowTuple& t) { f->forget(t); };
    } else {
      log->warn("finished upstream DNS flows stay in conntrack (a sandbox query that reuses their port will "
                "fail): {}", ct.error().message);
    }
    auto p = dns::Proxy::bind(io, popts, sandbox);
    if (!p) return report(p.error());
    proxy = std::move(*p);
    if (proxy->port_fell_back()) {
      log->warn("port {} in the sandbox was taken by another process while egressd was down; the DNS proxy "
                "listens on port {} and the redirect points there. Under Docker any process may bind port 53 "
                "(net.ipv4.ip_unprivileged_port_start=0): start the task container with "
                "--sysctl net.ipv4.ip_unprivileged_port_start=1024",
                a.dns_port, proxy->port());
      sandbox.set_dns_port(proxy->port());
    }
  }

  // The interfaces before start (its table gets an egress chain for each),
  // and the watch subscribed before the dump so no change is missed.
  auto watch = NetWatch::open();
  if (!watch) return report(watch.error().wrap("interface watch"));
  auto view = watch->dump();
  if (!view) return report(view.error().wrap("interface watch"));
  (void)sandbox.update_network(*view);
  if (auto s = sandbox.start(initial); !s) return report(s.error());
  (*guard)->start();
  NetWatchLoop netwatch(io, std::move(*watch), sandbox);
  netwatch.start();
  if (proxy) {
    if (forwarder.targets.empty() && !sandbox.relay_upstreams().empty()) {
      // Pinned by an earlier egressd: adopted from the kernel, no probe.
      dns::ForwarderOptions kept;
      for (const auto& t : sandbox.relay_upstreams()) kept.targets.push_back(t.to_string());
      kept.source = "kernel";
      proxy->set_forwarder(std::move(kept));
    }
    proxy->serve(sandbox.own_mark());
    sandbox.attach_proxy(proxy.get());
    sandbox.preresolve_active();
  }

  // Denied packets: the deny chain logs to this group (rate-limited in the
  // kernel). Without the reader the policy is enforced all the same; only
  // `denied` lacks packet records, so a failure here is not fatal.
  std::unique_ptr<audit::NflogReader> nflog;
  if (const std::uint16_t group = policy->enforce.log_group; group != 0) {
    auto r = audit::NflogReader::open(io, group, [&sandbox](const audit::LoggedPacket& p) { sandbox.denied_packet(p); });
    if (r) {
      nflog = std::move(*r);
      sandbox.attach_nflog(nflog.get());
    } else {
      log->warn("denied packets will not be recorded: {}", r.error().message);
    }
  }

  // Hostname pinning: the reader of the queue chain pin sends TCP flows to
  // (compile.h). Without it those flows get nowhere (no bypass): fail closed.
  std::unique_ptr<SandboxPinJudge> pin_judge;
  std::unique_ptr<PinQueue> pinq;
  if (policy->enforce.pin_names) {
    pin_judge = std::make_unique<SandboxPinJudge>(sandbox);
    auto r = PinQueue::open(io, *pin_judge);
    if (r) {
      pinq = std::move(*r);
      sandbox.attach_pin([q = pinq.get()] {
        const PinStats s = q->stats();
        return std::array<std::uint64_t, 3>{s.inspected, s.admitted, s.reset};
      });
    } else {
      log->error("hostname pinning has no queue reader, so TCP flows to addresses allowed only by name "
                 "cannot pass: {}", r.error().message);
    }
  }

  control::ServerOptions sopts;
  sopts.path = a.socket;
  sopts.allowed_uids.insert(a.allow_uids.begin(), a.allow_uids.end());
  sopts.watch_interval = std::chrono::seconds(1);  // re-create the socket file if it goes
  auto server = control::Server::listen(io, sopts, [&](const nlohmann::json& req, control::Reply reply) {
    sandbox.handle(req, std::move(reply));
  });
  if (!server) return report(server.error());


  std::string ups;
  for (const auto& u : upstream) ups += (ups.empty() ? "" : ",") + u;
  const auto startup_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  audit_event("startup",
              {{"version", EGRESSD_VERSION},
               {"pid", ::getpid()},
               {"netns", a.netns_pid != 0 ? "/proc/" + std::to_string(a.netns_pid) + "/ns/net" : a.netns_path},
               {"phase", sandbox.state().phase},
               {"mode", to_string(sandbox.state().mode)},
               {"generation", sandbox.state().generation},
               {"socket", a.socket},
               {"dns_port", proxy ? proxy->port() : a.dns_port},
               {"upstream", upstream},
               {"capabilities", caps.to_json()},
               {"verify_interval_s", a.verify_interval_s},
               {"startup_us", startup_us}},
              spdlog::level::info,
              fmt::format("ready phase={} mode={} gen={} socket={} dns_port={} upstream={} startup_us={}",
                          sandbox.state().phase, to_string(sandbox.state().mode), sandbox.state().generation,
                          a.socket, proxy ? proxy->port() : a.dns_port, ups.empty() ? "-" : ups, startup_us));

  // After everything it reports on is attached; before ready, so the file
  // is there once egressd is.
  std::unique_ptr<MetricsFile> metrics;
  if (!a.metrics_file.empty()) {
    metrics = std::make_unique<MetricsFile>(
        io, sandbox, a.metrics_file,
        std::chrono::milliseconds(static_cast<std::int64_t>(a.metrics_interval_s * 1000)));
    if (auto s = metrics->start(); !s) return report(s.error().wrap("--metrics-file"));
  }

  int exit_code = 0;
  boost::asio::signal_set signals(io, SIGTERM, SIGINT);
  signals.async_wait([&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    (*guard)->close();  // --cleanup-on-exit deletes the table: not tampering
    netwatch.close();
    audit_event("shutdown",
                {{"signal", sig},
                 {"phase", sandbox.state().phase},
                 {"generation", sandbox.state().generation},
                 {"policy", a.cleanup_on_exit ? "removed" : "stays"},
                 {"tampers", (*guard)->tampers()},
                 {"restores", (*guard)->restores()}},
                spdlog::level::info,
                fmt::format("signal={} shutting down; policy {}", sig,
                            a.cleanup_on_exit ? "removed (--cleanup-on-exit)" : "stays in force"));
    if (a.cleanup_on_exit) {
      if (auto s = sandbox.remove_table(); !s) {
        log->error("cleanup failed: {}", s.error().message);
        exit_code = 1;
      }
    }
    (*server)->close();
    if (metrics) metrics->close();
    if (proxy) proxy->close();
    if (nflog) nflog->close();
    if (pinq) pinq->close();
    io.stop();
  });
  // Ready only once SIGTERM is handled: an orchestrator may stop us at once.
  if (!a.ready_file.empty()) {
    if (auto s = write_ready_file(a.ready_file, sandbox.state()); !s) return report(s.error());
  }
  trim_when_idle();
  io.run();
  file_writer.join();
  if (!a.ready_file.empty()) ::unlink(a.ready_file.c_str());
  return exit_code;
}

}  // namespace egressd::daemon
