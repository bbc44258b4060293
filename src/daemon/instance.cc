// One sandbox, wired (see instance.h): the per-namespace half of what
// `egressd run` did in one function, so that the agent builds the same
// thing once per attached namespace.
//
// Over 500 lines because it is the wiring of every per-sandbox part: the
// policy checks against the kernel's capabilities, the Sandbox, the DNS proxy,
// the tamper guard, NFLOG, the interface watch, the flow reaper, pinning's
// queue reader, the control server, the metrics file and the close order,
// each a few dozen lines; the per-sandbox logic itself lives in sandbox*.cc.
#include "daemon/instance.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <atomic>
#include <filesystem>
#include <set>

#include "audit/nflog.h"
#include "control/protocol.h"
#include "control/server.h"
#include "daemon/audit_log.h"
#include "daemon/ctforget.h"
#include "daemon/netns.h"
#include "daemon/netns_claim.h"
#include "daemon/netwatch.h"
#include "daemon/pinq.h"
#include "daemon/sandbox.h"
#include "daemon/sockdiag.h"
#include "daemon/tamper_guard.h"
#include "dns/proxy.h"

namespace egressd::daemon {

namespace {

// Hostname pinning's questions, answered by the sandbox (daemon/pinq.h).
class SandboxPinJudge : public PinJudge, private pin::PinFacts {
 public:
  explicit SandboxPinJudge(Sandbox& sb) : sb_(sb) {}
  const pin::PinFacts& pin_facts() const override { return *this; }
  std::uint32_t pin_mark() const override { return sb_.compile_options().pin_mark; }
  std::uint32_t pin_priority() const override { return sb_.compile_options().pin_priority; }
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

// 32 bits for the table's secrets (Sandbox::draw_secrets rejects the values
// that must not be used and draws again).
std::uint32_t random32() {
  std::uint32_t m = 0;
  while (::getrandom(&m, sizeof m, 0) != static_cast<ssize_t>(sizeof m)) {
  }
  return m;
}

// Watches the namespace's interfaces: every link or IPv6 route change heard
// through the feed (a socket of the sandbox's own, or the agent's one socket
// for every namespace) is answered, at the end of the turn that heard it, with
// a fresh dump handed to the sandbox (new interfaces get their egress chain,
// vanished ones lose it). Listening starts before the first dump, so no change
// after it is missed; until go_live() (the sandbox started) changes are only
// noted, and go_live() dumps if there were any. Errors are logged and the
// watch goes on.
class NetWatchLoop {
 public:
  NetWatchLoop(NetWatch watch, std::unique_ptr<EventFeed> feed, Sandbox& sandbox, std::string prefix)
      : watch_(std::move(watch)), feed_(std::move(feed)), sandbox_(sandbox), prefix_(std::move(prefix)) {}
  ~NetWatchLoop() { close(); }
  // Told the interfaces after each refresh (InstanceOptions::interfaces_changed).
  std::function<void(const std::vector<std::string>&)> changed;
  void listen() {
    nft::Transport::Handlers h;
    h.message = [this](const nlmsghdr* nlh) { changed_ = changed_ || changes_view(nlh); };
    h.overrun = [this] { changed_ = true; };  // notifications lost: dump to find out
    h.turn_done = [this] {
      if (live_ && changed_) refresh();
    };
    h.error = [this](const Error& e) {
      spdlog::get("egressd")->error("{}interface watch: {}", prefix_, e.message);
      changed_ = true;
    };
    feed_->start(std::move(h));
  }
  Result<NetworkView> dump() { return watch_.dump(); }
  void go_live() {
    live_ = true;
    if (changed_) refresh();
  }
  void close() { feed_->stop(); }

 private:
  void refresh() {
    changed_ = false;
    auto view = watch_.dump();
    if (!view) {
      spdlog::get("egressd")->error("{}interface watch: {}", prefix_, view.error().message);
      return;
    }
    if (auto st = sandbox_.update_network(*view); !st) {
      spdlog::get("egressd")->error("{}interface watch: {}", prefix_, st.error().message);
    }
    if (changed) changed(view->interfaces);
  }

  NetWatch watch_;
  std::unique_ptr<EventFeed> feed_;
  Sandbox& sandbox_;
  const std::string prefix_;
  bool changed_ = false;
  bool live_ = false;
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

Status check_output_file(const std::string& option, const std::string& path) {
  if (path.empty()) return {};
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (!p.has_filename() || fs::is_directory(p, ec)) {
    return Error::invalid(option + " " + path + ": names a directory, not a file");
  }
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) return Error::invalid(option + " " + path + ": no directory " + dir.string());
  if (::access(dir.c_str(), W_OK) != 0) {
    Error e = errno_error(option + " " + path + ": cannot write in " + dir.string(), errno);
    e.kind = ErrorKind::invalid;
    return e;
  }
  return {};
}

struct Instance::Impl {
  Impl(boost::asio::io_context& io, InstanceOptions o) : io(io), opts(std::move(o)) {}
  boost::asio::io_context& io;
  InstanceOptions opts;
  std::vector<std::string> upstream;
  std::uint64_t startup_us = 0;
  // Upstream queries leave from the sandbox's namespace (a sidecar, or the
  // agent with dns.upstream_netns: sandbox), else from the agent's.
  bool upstream_inside = true;
  std::shared_ptr<spdlog::logger> log = spdlog::get("egressd");
  // Work this sandbox left on the loop through SandboxOptions::post and
  // run_after (counted: the object must outlive it), and the run_after
  // timers, cancelled by close().
  std::size_t queued = 0;
  std::set<std::shared_ptr<boost::asio::steady_timer>> timers;
  bool closed = false;
  Status close_status;
  // In construction order; destroyed in reverse (the Sandbox last but the
  // file writer, whose queued writes it outlives).
  // Started by the first inline state write: a sandbox whose phases all come
  // from a file never writes one, and a process without a second thread
  // takes its descriptors' references without atomics (fdget) on every
  // system call of the DNS path.
  std::optional<boost::asio::thread_pool> file_writer;
  std::unique_ptr<FlowReaper> reaper;
  std::unique_ptr<Sandbox> sandbox;
  std::unique_ptr<TamperGuard> guard;
  std::unique_ptr<ConntrackForgetter> forgetter;  // outlives the proxy that tells it
  std::unique_ptr<dns::Proxy> proxy;
  std::unique_ptr<NetWatchLoop> netwatch;
  std::unique_ptr<audit::NflogReader> nflog;
  std::unique_ptr<NetnsClaim> claim;  // held from before the first change until close
  std::unique_ptr<SandboxPinJudge> pin_judge;
  std::unique_ptr<PinQueue> pinq;
  std::unique_ptr<control::Server> server;
  std::unique_ptr<MetricsFile> metrics;

  std::string prefix() const { return opts.name.empty() ? std::string() : "sandbox=" + opts.name + " "; }

  // A loopback upstream (Docker's resolver) answers from sockets of its own
  // cgroup: found here, in the sandbox's namespace, so that chain output
  // drops "answers" a sandbox process sends from the same address and port
  // with a raw socket. When it cannot be found, egressd says so and runs
  // without that rule (the frames check, chain lo_replies, still holds).
  [[gnu::cold]] void find_resolver_cgroup(nft::CompileOptions& c) {
    std::vector<IpPrefix> lo;
    for (const auto& u : c.upstreams) {
      if (is_loopback(u)) lo.push_back(u);
    }
    if (lo.empty()) return;
    std::vector<std::string> names;
    for (const auto& u : lo) names.push_back(u.to_string());
    const std::string where = fmt::format("{}", fmt::join(names, ","));
    nlohmann::json f{{"upstream", where}};
    if (!opts.name.empty()) f["sandbox"] = opts.name;
    std::string why;
    auto ids = socket_cgroups(lo);
    if (!ids) {
      why = "its sockets cannot be listed: " + ids.error().message;
    } else if (ids->empty()) {
      why = "no socket listens there yet";
    } else if (ids->size() > 1) {
      why = fmt::format("its sockets are in {} different cgroups", ids->size());
    } else if (ids->front() == kCgroup2RootId && !cgroup2_root_in_sight()) {
      // Every socket of a host without cgroup v2 is there, the sandbox's too.
      why = "it is in the root of the cgroup v2 hierarchy, where every process of a cgroup v1 host is, and egressd "
            "cannot see that hierarchy to tell (run egressd with the host's cgroup v2 mount)";
    } else {
      // Its level need not be known: chain lo_answers tries them all (egressd
      // in a cgroup namespace of its own sees neither dockerd's cgroup nor
      // its depth, but the id is the kernel's, in every namespace).
      c.lo_resolver = nft::CompileOptions::ResolverCgroup{ids->front()};
      f["cgroup_id"] = ids->front();
      audit_event("resolver_cgroup", f, spdlog::level::info,
                  fmt::format("{}upstream {} answers from cgroup id {}: answers from any other socket are dropped",
                              prefix(), where, ids->front()));
      return;
    }
    f["reason"] = why;
    f["risk"] = "a sandbox process with NET_RAW that sniffs egressd's queries can answer them from a raw socket";
    audit_event("resolver_unverified", f, spdlog::level::warn,
                fmt::format("{}upstream {}: the resolver's cgroup is unknown ({}); a sandbox process with NET_RAW that "
                            "sniffs egressd's queries can answer them from a raw socket",
                            prefix(), where, why));
  }
  // egressd's own sockets (upstream queries with the own mark, the proxy's
  // answers with the proxy mark) are told from the sandbox's by their
  // cgroup too: chain own_sockets takes either mark off a packet from any
  // other socket. In the hierarchy's root egressd cannot be told from
  // whatever else nobody placed in a cgroup (every process of a cgroup v1
  // host; a sandbox's started beside it): there the marks hold alone and
  // egressd says so. A lookup that fails stops the start: egressd never runs
  // weaker than it could for want of an answer (fail closed).
  [[gnu::cold]] Status find_own_cgroup(nft::CompileOptions& c) {
    nlohmann::json f;
    if (!opts.name.empty()) f["sandbox"] = opts.name;
    auto id = own_cgroup();
    if (!id) {
      return Error::runtime("cannot learn egressd's own cgroup (" + id.error().message +
                            "); without it a sandbox process with NET_RAW that guesses egressd's own mark could query "
                            "the upstream past the proxy");
    }
    std::string why;
    if (id->id == kCgroup2RootId) {
      why = "egressd is in the root of the cgroup v2 hierarchy, where every process nobody placed in a cgroup is (a "
            "sandbox's started beside it, every process of a cgroup v1 host): run it in a cgroup of its own (a "
            "container, a systemd unit)";
    } else if (id->depth >= static_cast<int>(nft::kResolverLevels)) {
      // Chain own_sockets would not know egressd's own sockets: their
      // queries would lose the mark and come back to the proxy.
      why = fmt::format("egressd's cgroup is {} levels deep, below the {} chain own_sockets tries", id->depth,
                        nft::kResolverLevels);
    } else {
      c.own_cgroup = id->id;
      f["cgroup_id"] = id->id;
      audit_event("own_cgroup", f, spdlog::level::info,
                  fmt::format("{}egressd's sockets are in cgroup id {}: the own and proxy marks count only from them",
                              prefix(), id->id));
      return {};
    }
    f["reason"] = why;
    f["risk"] = "a sandbox process with NET_RAW that guesses egressd's own mark (32 bits) can query the upstream "
                "past the proxy";
    audit_event("own_cgroup_unverified", f, spdlog::level::warn,
                fmt::format("{}egressd's own cgroup cannot tell it from the sandbox ({}); a sandbox process with "
                            "NET_RAW that guesses egressd's own mark (32 bits) can query the upstream past the proxy",
                            prefix(), why));
    return {};
  }
  Status build();
  // Runs `fn` on the loop after the handler running now, unless the
  // instance closed meanwhile (counted in `queued`).
  void post(std::function<void()> fn) {
    ++queued;
    boost::asio::post(io, [this, fn = std::move(fn)] {
      --queued;
      if (!closed) fn();
    });
  }
  void run_after(std::chrono::milliseconds delay, std::function<void()> fn) {
    auto t = std::make_shared<boost::asio::steady_timer>(io, delay);
    timers.insert(t);
    ++queued;
    t->async_wait([this, t, fn = std::move(fn)](const boost::system::error_code& ec) {
      --queued;
      timers.erase(t);
      if (!ec && !closed) fn();
    });
  }

  // The proxy could not listen on any port (every one it tried held by the
  // sandbox's sockets): these options, without the fallback, try again on
  // the port the table's redirect names, every second, from the sandbox's
  // namespace (an agent's thread is home between turns).
  std::optional<dns::ProxyOptions> proxy_retry;
  int proxy_netns = -1;  // the sandbox's namespace, owned by the reaper
  bool forwarder_from_kernel = false;  // no forwarder configured: one pinned in the kernel is adopted
  void attach_proxy();
  void retry_proxy();
};

// Start-up only: compiled for size ([[gnu::cold]]; the image budget is 10 MiB).
[[gnu::cold]] Status Instance::Impl::build() {
  Policy& policy = opts.policy;
  // Before anything is changed or bound in the namespace (netns_claim.h): a
  // second egressd there stops here, and the first one's policy stays as it is.
  auto claimed = NetnsClaim::acquire();
  if (!claimed) return claimed.error();
  claim = std::move(*claimed);
  if (!claim->held() && !claim->unheld_reason().empty()) {
    log->warn("{}cannot make sure that no other egressd serves this network namespace ({}); two would undo each "
              "other's switches", prefix(), claim->unheld_reason());
  }
  // The control socket is bound last (a client that finds it finds the policy
  // in force), so a path it could not take is refused now, before anything
  // is installed: another egressd serving it, a file that is not a socket.
  if (!opts.socket.empty()) {
    if (auto s = control::check_socket_path(opts.socket); !s) return s.error().wrap("--socket");
  }
  if (opts.claimed) opts.claimed();
  auto kernel = nft::open_kernel();
  if (!kernel) return kernel.error();
  const Capabilities caps = opts.capabilities ? *opts.capabilities : probe_capabilities(**kernel);
  if (!caps.filter) {
    // Every probe failed: almost always a missing capability, not a kernel
    // without nf_tables.
    return Error::runtime(
        "cannot program nftables in this network namespace: egressd needs CAP_NET_ADMIN there "
        "(Operation not permitted), or the kernel lacks nf_tables");
  }
  if (!caps.fib || (opts.dns_port != 0 && !caps.socket)) {
    // Integral to the ruleset (forged sources, broadcast guards; egressd's
    // upstream sockets taking replies only): without them there is no policy
    // to offer, only a weaker one, and egressd never weakens silently.
    return Error::runtime(std::string("this kernel lacks nftables ") + (!caps.fib ? "fib" : "socket") +
                          " matching (" + (!caps.fib ? "nft_fib_inet" : "nft_socket") +
                          "), which egressd's ruleset needs; load the module on the host");
  }
  if (!caps.egress_hook) {
    // Run, but never claim it: `capabilities` says block_raw_frames=false.
    log->warn("{}this kernel has no netdev egress hook (Linux >= 5.16, CONFIG_NETFILTER_EGRESS): frames a sandbox "
              "process writes with AF_PACKET (CAP_NET_RAW, in Docker's default set) are NOT held to the policy; drop "
              "NET_RAW from the sandbox (docs/security.md)", prefix());
  }
  if (opts.dns_port != 0 && !caps.nat) {
    return Error::runtime(
        "this kernel cannot redirect DNS to egressd (no nat in nf_tables); hostnames cannot be enforced. "
        "Run with --dns-port 0 to enforce addresses only");
  }
  if (policy.enforce.log_group != 0 && !opts.can_log) opts.can_log = probe_log(**kernel, policy.enforce.log_group);
  if (policy.enforce.log_group != 0 && !*opts.can_log) {
    // Logging is for `egressctl denied`, not enforcement: run without it
    // rather than not at all, and say so.
    log->warn("{}this kernel cannot log denied packets (nft log/limit, nfnetlink_log); running without "
              "log_group={}: `denied` will show refused DNS queries only",
              prefix(), policy.enforce.log_group);
    policy.enforce.log_group = 0;
  }
  upstream = dns::expand_upstreams(policy.dns, opts.resolv_conf);
  // Upstream queries leave from inside the sandbox (a sidecar; the agent with
  // dns.upstream_netns: sandbox): Docker's forwarder, conntrack cleanup and
  // the own-traffic mark apply. From the agent's namespace none does.
  upstream_inside = opts.upstream_in_sandbox || opts.upstream_netns.ok();

  SandboxOptions so;
  so.state_file = opts.state_file;
  // Where Docker's embedded resolver forwards (the DNS proxy's relay
  // targets): from resolv.conf's "# ExtServers:" comment (Docker >= 25);
  // else those an earlier egressd pinned, which start() adopts from the
  // kernel's upstream sets; else the proxy's probe pins them. Only when the
  // upstream is reached from inside the sandbox.
  dns::ForwarderOptions forwarder;
  forwarder.probe = upstream_inside;
  if (const dns::ExtServers ext = dns::ext_servers_from_resolv_conf(opts.resolv_conf);
      ext.present && upstream_inside) {
    forwarder.targets = ext.targets;
    forwarder.source = "resolv.conf";
    forwarder.probe = false;  // Docker said where it forwards: nothing to guess
  }
  so.compile = compile_options(upstream, opts.dns_port);
  if (upstream_inside && opts.dns_port != 0) find_resolver_cgroup(so.compile);
  if (opts.dns_port != 0) {
    if (auto s = find_own_cgroup(so.compile); !s) return s;
  }
  // A fresh table gets secrets nobody can predict (see nft/compile.h).
  so.random = random32;
  so.policy = policy;
  so.netns = opts.netns;
  so.socket = opts.socket;
  // Its thread, started by the first switch out of public (from the loop's
  // thread, which an agent keeps in its own namespace), works in this one.
  UniqueFd here(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
  if (!here.ok()) return errno_error("flow reaper: cannot open the sandbox's network namespace", errno);
  // Owned by the reaper from here on, which lives as long as this instance;
  // the agent's event hub reads the namespace's id from it below.
  const int sandbox_netns = here.get();
  reaper = std::make_unique<FlowReaper>(
      policy.enforce.inbound_replies, opts.dns_port != 0,
      [log = log, p = prefix()](Result<int> n, std::uint64_t gen) {
        if (!n) {
          log->warn("{}flows not aborted gen={} (the rules still cut them): {}", p, gen, n.error().message);
        } else if (*n > 0) {
          log->info("{}aborted sockets={} gen={} (flows the new phase does not allow)", p, *n, gen);
        }
      },
      std::move(here));
  so.after_switch = [this](std::shared_ptr<const Phase> phase, std::uint64_t gen) {
    // Hostname pinning: a flow admitted for a name the new phase does not
    // allow is cut, even when its address is still allowed (through another
    // name). The rules would re-decide it by address alone.
    if (pinq) {
      const std::size_t n =
          pinq->cut([this](const AdmittedFlow& f) {
            return keeps_every_name(f, [&](const std::string& name) { return sandbox->pin_keeps(name, f.dst); });
          });
      if (n > 0) log->info("{}pin: cut flows={} gen={} (admitted for names the new phase does not allow, or to addresses whose lookup expired)", prefix(), n, gen);
    }
    // The reaper's thread is woken after the reply has gone out (the reply is
    // written before the loop runs posted work): on a busy host the woken
    // thread could otherwise take this CPU while the orchestrator waits. The
    // rules already cut those flows; the reaper only aborts their sockets.
    post([this, phase = std::move(phase), gen] {
      std::vector<OwnSocket> own;
      if (proxy) {
        for (const auto& l : proxy->listeners()) own.push_back({l.family, l.udp});
      }
      reaper->reap(phase, gen, std::move(own));
    });
    if (opts.after_switch) opts.after_switch();
  };
  so.post = [this](std::function<void()> fn) { post(std::move(fn)); };
  so.run_after = [this](std::chrono::milliseconds delay, std::function<void()> fn) {
    run_after(delay, std::move(fn));
  };
  // The inline state file is written off the loop; one thread, so writes
  // land in order.
  so.write_off_loop = [this](std::function<void()> fn) {
    if (!file_writer) file_writer.emplace(1);
    boost::asio::post(*file_writer, std::move(fn));
  };
  so.executor = io.get_executor();
  if (!opts.hosts_file.empty()) {
    so.hosts_path = opts.hosts_file;
    so.read_hosts = [reader = std::make_shared<HostsFileReader>(opts.hosts_file)] { return (*reader)(); };
    // Beside the state file, keyed and owned as it is (<socket>.state.hosts,
    // <state-dir>/NAME.state.hosts).
    if (!opts.state_file.empty()) so.hosts_snapshot_file = opts.state_file + ".hosts";
  }
  so.denied.capacity = opts.denied_records;
  so.names.max_entries = opts.names;
  sandbox = std::make_unique<Sandbox>(std::move(so), std::move(*kernel), caps);
  const auto t0 = std::chrono::steady_clock::now();

  // Subscribed before start: every change after it is seen (start's own are
  // told apart by the portid).
  TamperGuardOptions gopts;
  gopts.verify_interval = std::chrono::milliseconds(static_cast<std::int64_t>(opts.verify_interval_s * 1000));
  if (opts.monitor_rcvbuf > 0) {
    gopts.rcvbuf = opts.monitor_rcvbuf;
    gopts.grow_rcvbuf = false;
  }
  // The agent's hub for this namespace, or null (logged): the watcher then
  // opens a socket of its own in the namespace.
  auto hub_feed = [&](EventHub* hub, const char* what) -> std::unique_ptr<EventFeed> {
    if (hub == nullptr) return nullptr;
    auto f = hub->feed(sandbox_netns);
    if (f) return std::move(*f);
    log->warn("{}{} through a socket of the sandbox's own: the agent's event hub cannot serve this namespace: {}",
              prefix(), what, f.error().message);
    return nullptr;
  };
  auto g = TamperGuard::open(io, *sandbox, gopts, hub_feed(opts.nft_events, "nftables events"));
  if (!g) return g.error().wrap("tamper detection");
  guard = std::move(*g);
  sandbox->set_tamper_counts([gd = guard.get()] { return std::pair{gd->tampers(), gd->restores()}; });
  sandbox->set_large_batch_runner(
      [gd = guard.get()](const std::function<Status()>& apply) { return gd->apply_unheard(apply); });

  // The proxy binds before the table is built (issue 14, class 10): if its
  // port was taken while egressd was down, it listens elsewhere and the
  // redirect is built (or restaged: the port is part of the staged digest)
  // to point there. It also binds the upstreams local to the namespace
  // before anything is served. It serves once the own-traffic mark is fixed
  // by start (drawn, or adopted from the table); until then queries queue.
  if (opts.dns_port != 0) {
    if (upstream.empty()) log->warn("{}no upstream DNS server (dns.upstream); allowed names will get SERVFAIL", prefix());
    dns::ProxyOptions popts;
    popts.port = static_cast<std::uint16_t>(opts.dns_port);
    popts.fallback_port = true;
    popts.upstream = upstream;
    popts.max_ttl = policy.dns.max_ttl_s;
    popts.forwarder = forwarder;
    forwarder_from_kernel = forwarder.targets.empty();
    if (opts.fd_budget) popts.fd_account = opts.fd_budget->open(opts.name);
    if (opts.upstream_netns.ok()) {
      popts.open_socket = [ns = opts.upstream_netns.get()](int domain, int type) {
        auto scope = NetnsScope::enter(ns);
        if (!scope) return -1;  // errno as setns left it
        return ::socket(domain, type, 0);
      };
    }
    if (!upstream_inside && opts.own_conntrack != nullptr) {
      popts.forget_flow = [f = opts.own_conntrack](std::span<const dns::FlowTuple> flows) { f->forget(flows); };
    }
    if (upstream_inside) {
      if (auto ct = ConntrackForgetter::open(io)) {
        forgetter = std::move(*ct);
        popts.forget_flow = [f = forgetter.get()](std::span<const dns::FlowTuple> flows) { f->forget(flows); };
      } else {
        log->warn("{}finished upstream DNS flows stay in conntrack (a sandbox query that reuses their port will "
                  "fail): {}", prefix(), ct.error().message);
      }
    }
    auto p = dns::Proxy::bind(io, popts, *sandbox);
    if (!p && p.error().message.find(errno_text(EADDRINUSE)) != std::string::npos) {
      // Port 53 and every other port tried are held (found by an attack
      // review: a uid-65534 process under Docker held 127.0.0.1:53, [::1]:53
      // and TCP [::1] on every ephemeral port, and egressd exited, or the
      // agent refused to attach). Failing here left the namespace without
      // egressd: no switch, or no policy at all. So the policy goes in as
      // usual, the redirect names the configured port, where egressd does
      // not answer (the sandbox's own socket may: it hears only itself, and
      // nothing it answers is learned), and the proxy tries again.
      log->error("{}the DNS proxy cannot listen: {}; another socket in the sandbox holds port {} and every other "
                 "port tried (under Docker any process may bind any port: ip_unprivileged_port_start=0). The "
                 "policy is installed and enforced; no name resolves through egressd, so nothing is learned, "
                 "until the proxy can listen on port {}: it tries again every second",
                 prefix(), p.error().message, opts.dns_port, opts.dns_port);
      popts.fallback_port = false;
      proxy_retry = std::move(popts);
      proxy_netns = sandbox_netns;
    } else if (!p) {
      return p.error();
    } else {
      proxy = std::move(*p);
    }
    if (proxy && proxy->port_fell_back()) {
      log->warn("{}port {} in the sandbox was taken by another process while egressd was down; the DNS proxy "
                "listens on port {} and the redirect points there. Under Docker any process may bind port 53 "
                "(net.ipv4.ip_unprivileged_port_start=0): start the task container with "
                "--sysctl net.ipv4.ip_unprivileged_port_start=1024",
                prefix(), opts.dns_port, proxy->port());
      sandbox->set_dns_port(proxy->port());
    }
  }

  // The interfaces before start (its table gets an egress chain for each),
  // and the watch listening before the dump so no change is missed.
  auto watch = NetWatch::open();
  if (!watch) return watch.error().wrap("interface watch");
  std::unique_ptr<EventFeed> link_feed = hub_feed(opts.link_events, "interface changes");
  if (!link_feed) {
    auto f = open_own_feed(io, link_events(), 0);
    if (!f) return f.error().wrap("interface watch");
    link_feed = std::move(*f);
  }
  netwatch = std::make_unique<NetWatchLoop>(std::move(*watch), std::move(link_feed), *sandbox, prefix());
  netwatch->changed = opts.interfaces_changed;
  netwatch->listen();
  auto view = netwatch->dump();
  if (!view) return view.error().wrap("interface watch");
  (void)sandbox->update_network(*view);
  if (opts.interfaces_changed) opts.interfaces_changed(view->interfaces);
  if (auto s = sandbox->start(opts.initial); !s) return s;
  // A broken or unreadable file is logged and teaches nothing; egressd runs
  // (a file named by the operator was checked before anything was installed).
  (void)sandbox->start_hosts();
  guard->start();
  netwatch->go_live();
  if (proxy) {
    attach_proxy();
    // The agent's thread is in the sandbox's namespace here, and an upstream
    // socket belongs to the namespace it is made in: the agent asks once it
    // is home (Instance::preresolve).
    if (upstream_inside) sandbox->preresolve_active();
  } else if (proxy_retry) {
    run_after(std::chrono::seconds(1), [this] { retry_proxy(); });
  }

  // Denied packets: the deny chain logs to this group (rate-limited in the
  // kernel). Without the reader the policy is enforced all the same; only
  // `denied` lacks packet records, so a failure here is not fatal.
  if (const std::uint16_t group = policy.enforce.log_group; group != 0) {
    auto r = audit::NflogReader::open(io, group, [sb = sandbox.get()](const audit::LoggedPacket& p) {
      sb->denied_packet(p);
    });
    if (r) {
      nflog = std::move(*r);
      sandbox->attach_nflog(nflog.get());
    } else {
      log->warn("{}denied packets will not be recorded: {}", prefix(), r.error().message);
    }
  }

  // Hostname pinning: the reader of the queue chain pin sends TCP flows to
  // (compile.h). Without it those flows get nowhere (no bypass): fail closed.
  if (policy.enforce.pin_names) {
    pin_judge = std::make_unique<SandboxPinJudge>(*sandbox);
    auto r = PinQueue::open(io, *pin_judge);
    if (r) {
      pinq = std::move(*r);
      sandbox->attach_pin([q = pinq.get()] {
        const PinStats s = q->stats();
        return std::array<std::uint64_t, 3>{s.inspected, s.admitted, s.reset};
      });
      // Flows an earlier egressd admitted under the phase in force (an
      // adopted table keeps its marks): this reader never learnt their names,
      // so they are known as admitted for an unknown one, and the next
      // switch keeps them only where an address entry allows them. Without
      // this, a switch cut nothing of them and the new phase re-marked them
      // by address. A fresh table's marks are new: nothing matches.
      if (sandbox->state().mode == Mode::allowlist) {
        if (auto flows = conntrack_flows_marked(io, sandbox->state().mark)) {
          std::erase_if(*flows, [&](const AdmittedFlow& f) { return sandbox->allowed_by_address_entry(f.dst); });
          if (!flows->empty()) {
            pinq->adopt(*flows);
            log->info("{}pin: adopted flows={} (admitted before a restart; their names are unknown)", prefix(),
                      flows->size());
          }
        } else {
          log->warn("{}pin: flows admitted before a restart not adopted (a switch will not cut them): {}", prefix(),
                    flows.error().message);
        }
      }
    } else {
      log->error("{}hostname pinning has no queue reader, so TCP flows to addresses allowed only by name "
                 "cannot pass: {}", prefix(), r.error().message);
    }
  }

  if (!opts.socket.empty()) {
    control::ServerOptions sopts;
    sopts.path = opts.socket;
    sopts.allowed_uids.insert(opts.allow_uids.begin(), opts.allow_uids.end());
    sopts.watch_interval = std::chrono::seconds(1);  // re-create the socket file if it goes
    auto s = control::Server::listen(io, sopts,
                                     [sb = sandbox.get(), after = opts.after_request](const nlohmann::json& req,
                                                                                      control::Reply reply) {
                                       sb->handle(req, std::move(reply));
                                       if (after) after();
                                     });
    if (!s) return s.error();
    server = std::move(*s);
  }
  startup_us = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());

  // After everything it reports on is attached.
  if (!opts.metrics_file.empty()) {
    metrics = std::make_unique<MetricsFile>(
        io, *sandbox, opts.metrics_file,
        std::chrono::milliseconds(static_cast<std::int64_t>(opts.metrics_interval_s * 1000)));
    if (auto s = metrics->start(); !s) return s.error().wrap("--metrics-file");
  }
  return {};
}

void Instance::Impl::attach_proxy() {
  if (forwarder_from_kernel && !sandbox->relay_upstreams().empty() && upstream_inside) {
    // Pinned by an earlier egressd: adopted from the kernel, no probe.
    dns::ForwarderOptions kept;
    for (const auto& t : sandbox->relay_upstreams()) kept.targets.push_back(t.to_string());
    kept.source = "kernel";
    proxy->set_forwarder(std::move(kept));
  }
  // From the agent's namespace the upstream sockets carry no mark: the
  // sandbox's own-traffic mark means nothing there (and could meet the
  // host's own mark-based routing).
  proxy->serve(upstream_inside ? sandbox->own_mark() : 0, sandbox->proxy_mark());
  sandbox->attach_proxy(proxy.get());
}

[[gnu::cold]] void Instance::Impl::retry_proxy() {
  if (closed || proxy || !proxy_retry) return;
  Result<std::unique_ptr<dns::Proxy>> p = Error::runtime("not tried");
  {
    auto scope = NetnsScope::enter(proxy_netns);
    if (!scope) {
      log->warn("{}the DNS proxy cannot try again: {}", prefix(), scope.error().message);
      return run_after(std::chrono::seconds(1), [this] { retry_proxy(); });
    }
    p = dns::Proxy::bind(io, *proxy_retry, *sandbox);
    if (p) {
      proxy = std::move(*p);
      attach_proxy();
      if (upstream_inside) sandbox->preresolve_active();  // as at build: from the sandbox's namespace
    }
  }
  if (!p) {
    log->debug("{}the DNS proxy still cannot listen: {}", prefix(), p.error().message);
    return run_after(std::chrono::seconds(1), [this] { retry_proxy(); });
  }
  proxy_retry.reset();
  log->warn("{}the DNS proxy listens on port {} now; names resolve through egressd again", prefix(), proxy->port());
  // Home again: the upstream sockets of an agent's own namespace are made here.
  if (!upstream_inside) sandbox->preresolve_active();
}

Instance::Instance(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Instance::~Instance() {
  (void)close(false);
  if (impl_->file_writer) impl_->file_writer->join();  // the last state file write lands
}

Result<std::unique_ptr<Instance>> Instance::create(boost::asio::io_context& io, InstanceOptions opts) {
  auto impl = std::make_unique<Impl>(io, std::move(opts));
  std::unique_ptr<Instance> inst(new Instance(std::move(impl)));
  if (auto s = inst->impl_->build(); !s) return s.error();
  return inst;
}

Sandbox& Instance::sandbox() { return *impl_->sandbox; }
const InstanceOptions& Instance::options() const { return impl_->opts; }
std::uint16_t Instance::dns_port() const {
  return impl_->proxy ? impl_->proxy->port() : static_cast<std::uint16_t>(impl_->opts.dns_port);
}
std::vector<std::string> Instance::upstream() const { return impl_->upstream; }
std::uint64_t Instance::startup_us() const { return impl_->startup_us; }
bool Instance::can_log() const { return impl_->opts.can_log.value_or(true); }

void Instance::preresolve() {
  if (impl_->proxy && !impl_->upstream_inside) {
    impl_->sandbox->preresolve_active();
  }
}

Status Instance::close(bool remove_policy) {
  Impl& m = *impl_;
  if (m.closed) return m.close_status;
  m.closed = true;
  if (m.guard) m.guard->close();  // a removal by egressd is not tampering
  if (m.netwatch) m.netwatch->close();
  if (remove_policy && m.sandbox) {
    if (auto s = m.sandbox->remove_table(); !s) m.close_status = s;
  }
  if (m.server) m.server->close();
  if (m.metrics) m.metrics->close();
  if (m.proxy) m.proxy->close();
  if (m.nflog) m.nflog->close();
  if (m.pinq) m.pinq->close();
  for (const auto& t : m.timers) t->cancel();
  // Nothing is written into the namespace after this: answers whose
  // addresses wait for the next turn's batch are dropped (post() skips that
  // batch once closed; left pending, they kept the sandbox busy and a removed
  // sandbox was never released, nor the namespace it holds open), and a
  // switch still waiting for its pre-resolution ends without changing it.
  if (m.sandbox) m.sandbox->close();
  // Last: another egressd may take the namespace from here on.
  if (m.claim) m.claim->release();
  return m.close_status;
}

bool Instance::idle() const {
  const Impl& m = *impl_;
  return m.closed && m.queued == 0 && (!m.sandbox || !m.sandbox->busy());
}

}  // namespace egressd::daemon
