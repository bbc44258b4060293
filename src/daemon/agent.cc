// `egressd agent`: one process, one event loop, any number of sandboxes.
// Each sandbox is an Instance (instance.h), exactly what `egressd run` builds,
// created with the loop's thread moved into the sandbox's network namespace
// for the duration (setns applies to the calling thread only): its sockets and
// its flow reaper's thread live there, and nothing else of the agent does.
// Upstream DNS leaves from the agent's own namespace.
//
// The agent socket takes sandbox_add / sandbox_remove / sandbox_list, and
// every sidecar command with "sandbox": NAME (docs/protocol.md). With
// --state-dir each sandbox's add request is kept there, so a restarted agent
// attaches them again and adopts their tables (no window, same generations).
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <linux/sockios.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <chrono>
#include <map>
#include <tuple>

#include "control/protocol.h"
#include "control/server.h"
#include "daemon/audit_log.h"
#include "daemon/commands.h"
#include "daemon/sockdiag.h"
#include "daemon/ctforget.h"
#include "daemon/instance.h"
#include "daemon/netns.h"
#include "daemon/sandbox.h"
#include "egressd/unique_fd.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// Identifies a namespace across an agent restart. The inode number of its
// namespace file alone does not: the kernel gives a freed number to the next
// namespace, lowest first, so a namespace made after a kept one went would
// take its number, behind the same path or a reused pid (attack review 6).
// The netns cookie is never reused within a boot, so it is saved with the
// boot's id; the inode number finds candidates cheaply.
struct NsId {
  std::uint64_t dev = 0, ino = 0;
  bool operator==(const NsId&) const = default;
};

Result<NsId> ns_id(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("fstat network namespace", errno);
  return NsId{static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

// The namespace's cookie (current_netns_cookie), from inside it; nullopt on
// an older kernel, where the inode number is all there is.
Result<std::optional<std::uint64_t>> ns_cookie(int nsfd) {
  auto scope = NetnsScope::enter(nsfd);
  if (!scope) return scope.error();
  return current_netns_cookie();
}

// The start time of process `pid` (field 22 of /proc/PID/stat, clock ticks
// since boot): with the boot's id, it tells the process from a later one
// given the same pid. nullopt when it cannot be read.
std::optional<std::uint64_t> process_start(std::uint64_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');  // the name before it may hold anything
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) return std::nullopt;
  }
  try {
    return std::stoull(field);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// A namespace kept in the state directory: its inode number, and its cookie
// when the state file has one (files written before 2026-12-07 do not).
struct KeptNs {
  NsId id;
  std::optional<std::uint64_t> cookie;
};

// Whether `fd` is the kept namespace `want`.
bool is_kept(int fd, const KeptNs& want) {
  auto id = ns_id(fd);
  if (!id || !(*id == want.id)) return false;
  if (!want.cookie) return true;
  auto c = ns_cookie(fd);
  return c && *c && **c == *want.cookie;
}

// The network namespace `want` through any thread still in it, with the path
// that led there: nullopt when no thread is (the namespace is gone, or held
// only by a mount or sockets). Threads, not only processes: a process whose
// main thread exited (a zombie leader) has no /proc/PID/ns any more while
// its other threads live on in the namespace (attack review 6). The
// descriptor is checked after it is opened (the thread may move or exit
// meanwhile).
[[gnu::cold]] std::optional<std::pair<UniqueFd, std::string>> open_netns_of_any_thread(const KeptNs& want) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string pid = e.path().filename().string();
    if (!all_digits(pid)) continue;
    std::error_code tec;
    for (const auto& t : fs::directory_iterator("/proc/" + pid + "/task", tec)) {
      const std::string tid = t.path().filename().string();
      if (!all_digits(tid)) continue;
      const std::string path = "/proc/" + pid + "/task/" + tid + "/ns/net";
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0 || st.st_dev != want.id.dev || st.st_ino != want.id.ino) continue;
      UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      if (fd.ok() && is_kept(fd.get(), want)) return std::pair{std::move(fd), path};
    }
  }
  return std::nullopt;
}

// The network namespace `want` through a socket made in it, held by any
// process (pidfd_getfd, then SIOCGSKNS): a process that moved itself out
// leaving no thread behind keeps the namespace alive through such sockets,
// and reaches out through them (attack review 6). Needs ptrace rights over
// the holder (root with CAP_SYS_PTRACE); processes it has none over are
// skipped. Slow on a busy host (every socket descriptor is looked at): only
// after open_netns_of_any_thread found nothing.
// Gives up at `deadline` (a sandbox process can hold a million sockets).
[[gnu::cold]] std::optional<std::pair<UniqueFd, std::string>> open_netns_through_sockets(
    const KeptNs& want, std::chrono::steady_clock::time_point deadline) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string pid = e.path().filename().string();
    if (!all_digits(pid)) continue;
    UniqueFd pidfd;
    std::error_code fec;
    for (const auto& f : fs::directory_iterator("/proc/" + pid + "/fd", fec)) {
      const std::string fd = f.path().filename().string();
      if (!all_digits(fd)) continue;
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      char target[64] = {};
      const ssize_t n = ::readlink(f.path().c_str(), target, sizeof target - 1);
      if (n <= 0 || std::string_view(target, static_cast<std::size_t>(n)).rfind("socket:", 0) != 0) continue;
      if (!pidfd.ok()) {
        pidfd = UniqueFd(static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(std::stoi(pid)), 0)));
        if (!pidfd.ok()) break;
      }
      const UniqueFd sock(static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), std::stoi(fd), 0)));
      if (!sock.ok()) {
        if (errno == EPERM) break;  // no rights over this process
        continue;
      }
      UniqueFd ns(::ioctl(sock.get(), SIOCGSKNS));
      if (!ns.ok()) continue;
      if (::fcntl(ns.get(), F_SETFD, FD_CLOEXEC) != 0) continue;
      if (is_kept(ns.get(), want)) return std::pair{std::move(ns), "a socket of process " + pid};
    }
  }
  return std::nullopt;
}

// The soft RLIMIT_NOFILE (after prepare_descriptors).
std::size_t descriptor_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return std::size_t{1} << 20;
  return static_cast<std::size_t>(rl.rlim_cur);
}

class Agent {
 public:
  Agent(boost::asio::io_context& io, const AgentArgs& args)
      : io_(io), args_(args), fds_(dns::FdBudget::create(descriptor_limit())), trim_(io), reap_timer_(io) {
    const dns::FdSizing z;
    log_->info("descriptors: limit {}: {} kept for the control socket and sandbox add, {} for each sandbox, the "
               "rest for upstream DNS sockets and DNS-over-TCP clients, shared by the sandboxes (at least {} each "
               "while it lasts)",
               fds_->limit(), z.reserve, z.fixed, z.floor);
    if (args.events == "shared") {
      hub_ = open_hub(io, nftables_events(), "nftables events");
      link_hub_ = open_hub(io, link_events(), "interface changes");
    }
    if (auto ct = ConntrackForgetter::open(io)) {
      conntrack_ = std::move(*ct);
    } else {
      log_->warn("finished upstream DNS flows stay in this namespace's conntrack table until they time out: {}",
                 ct.error().message);
    }
    auto how = [](const auto& hub) { return hub ? "one socket for every sandbox" : "a socket in each sandbox's namespace"; };
    log_->info("nftables events: {}; interface changes: {}", how(hub_), how(link_hub_));
  }

  std::unique_ptr<EventHub> open_hub(boost::asio::io_context& io, const EventSource& source, const char* what) {
    auto hub = EventHub::open(io, source);
    if (hub) return std::move(*hub);
    log_->warn("{}: a socket in each sandbox's namespace (the shared one needs CAP_NET_BROADCAST in the initial user "
               "namespace): {}", what, hub.error().message);
    return nullptr;
  }

  Status listen() {
    control::ServerOptions sopts;
    sopts.path = args_.socket;
    sopts.allowed_uids.insert(args_.allow_uids.begin(), args_.allow_uids.end());
    sopts.watch_interval = std::chrono::seconds(1);
    auto s = control::Server::listen(io_, sopts, [this](const json& req, control::Reply reply) {
      handle(req, std::move(reply));
    });
    if (!s) return s.error();
    server_ = std::move(*s);
    return {};
  }

  // Attaches every sandbox kept in the state directory (a restart).
  void restore() {
    if (args_.state_dir.empty()) return;
    std::error_code ec;
    // Sandboxes whose namespace no thread leads to: looked for through
    // sockets once every other sandbox is attached, within 2 s in all (a
    // scan of every socket on the host, which a sandbox's process can make
    // long).
    std::vector<std::tuple<std::string, control::SandboxAddRequest, Kept>> lost;
    for (const auto& e : fs::directory_iterator(args_.state_dir, ec)) {
      if (e.path().extension() != ".json") continue;
      const std::string file = e.path().string();
      json saved;
      try {
        std::ifstream in(file);
        saved = json::parse(in);
      } catch (const json::exception& ex) {
        log_->error("state file {} is not JSON ({}); its sandbox is not attached", file, ex.what());
        continue;
      }
      auto add = control::decode<control::SandboxAddRequest>(saved.value("request", json::object()));
      if (auto* err = std::get_if<control::ErrorReply>(&add)) {
        log_->error("state file {}: {}; its sandbox is not attached", file, err->message);
        continue;
      }
      Kept kept;
      kept.ns.id = {saved.value("ns_dev", std::uint64_t{0}), saved.value("ns_ino", std::uint64_t{0})};
      bool gone = false;
      Status r;
      try {
        if (saved.contains("ns_cookie")) kept.ns.cookie = saved.at("ns_cookie").get<std::uint64_t>();
        if (saved.contains("pid_start")) kept.pid_start = saved.at("pid_start").get<std::uint64_t>();
        if (saved.contains("boot_id") && saved.at("boot_id").get<std::string>() != boot_id()) {
          // Saved before a reboot: that namespace and process are gone, whatever the path leads to now.
          gone = true;
          r = Error::invalid("its namespace was attached before the machine restarted");
        }
      } catch (const json::exception& ex) {
        log_->error("state file {}: {}; its sandbox is not attached", file, ex.what());
        continue;
      }
      if (!gone) r = attach(std::get<control::SandboxAddRequest>(add), &kept, &gone);
      if (!r && !gone && kept.lost && kept.ns.cookie) {
        lost.emplace_back(file, std::get<control::SandboxAddRequest>(add), kept);
        continue;
      }
      restored(file, std::get<control::SandboxAddRequest>(add).name, r, gone);
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (auto& [file, req, kept] : lost) {
      kept.sockets_until = until;
      bool gone = false;
      Status r = attach(req, &kept, &gone);
      restored(file, req.name, r, gone);
    }
  }

  // Logs how restoring the sandbox of state file `file` went; drops the file when it is over.
  void restored(const std::string& file, const std::string& name, const Status& r, bool gone) {
    if (!r && gone) {
      log_->warn("sandbox={} not attached again, dropped: {}", name, r.error().message);
      ::unlink(file.c_str());
    } else if (!r) {
      // Its namespace may be there: the file stays for the next start
      // (another egressd serving the namespace meanwhile, descriptors run
      // out, ...).
      log_->error("sandbox={} not attached again (its state file {} is kept for the next start): {}", name, file,
                  r.error().message);
    }
  }

  void shutdown() {
    for (auto& [name, sb] : sandboxes_) {
      if (sb.pidfd) sb.pidfd->cancel();
      (void)sb.inst->close(false);
    }
    if (server_) server_->close();
    reap_timer_.cancel();
  }

  // Destroys the sandboxes (after the loop stopped).
  void clear() {
    sandboxes_.clear();
    removed_.clear();
  }

 private:
  struct Attached {
    std::unique_ptr<Instance> inst;
    std::string netns;  // as given: a path, or /proc/PID/ns/net
    NsId id;            // the namespace itself (another path may name it too)
    std::uint64_t pid = 0;
    std::unique_ptr<boost::asio::posix::stream_descriptor> pidfd;
  };

  void handle(const json& req, control::Reply reply) {
    const std::string cmd = req["cmd"].get<std::string>();
    if (cmd == control::SandboxAddRequest::kCmd) return add(req, std::move(reply));
    if (cmd == control::SandboxRemoveRequest::kCmd) return remove(req, std::move(reply));
    if (cmd == control::SandboxListRequest::kCmd) return list(req, std::move(reply));
    auto it = req.find("sandbox");
    if (it == req.end()) {
      if (cmd == "ping") {
        return reply(control::ok_reply(
            {{"agent", true}, {"sandboxes", sandboxes_.size()}, {"nft_events", hub_ ? "shared" : "per-sandbox"},
             {"link_events", link_hub_ ? "shared" : "per-sandbox"}}));
      }
      return reply(control::error_reply(
          "invalid_request", "this is egressd's agent socket: name the sandbox (\"sandbox\": NAME) for " + cmd +
                                 ", or use sandbox_add, sandbox_remove, sandbox_list"));
    }
    if (!it->is_string()) return reply(control::error_reply("invalid_request", "\"sandbox\" must be a string"));
    auto sb = sandboxes_.find(it->get<std::string>());
    if (sb == sandboxes_.end()) {
      return reply(control::error_reply("unknown_sandbox", "no sandbox \"" + it->get<std::string>() + "\""));
    }
    json inner = req;
    inner.erase("sandbox");
    sb->second.inst->sandbox().handle(inner, std::move(reply));
  }

  void add(const json& req, control::Reply reply) {
    auto d = control::decode<control::SandboxAddRequest>(req);
    if (auto* err = std::get_if<control::ErrorReply>(&d)) return reply(json(*err));
    const auto& r = std::get<control::SandboxAddRequest>(d);
    if (sandboxes_.count(r.name) != 0) {
      return reply(control::error_reply("invalid_request", "sandbox \"" + r.name + "\" is already attached"));
    }
    auto st = attach(r, nullptr);
    if (!st) return reply(control::error_reply(st.error(), "invalid_policy"));
    Sandbox& sb = sandboxes_.at(r.name).inst->sandbox();
    reply(control::ok_reply({{"name", r.name},
                             {"phase", sb.state().phase},
                             {"mode", std::string(to_string(sb.state().mode))},
                             {"generation", sb.state().generation},
                             {"netns", sandboxes_.at(r.name).netns}}));
  }

  // What a state file says of the sandbox attached before a restart.
  struct Kept {
    KeptNs ns;
    std::optional<std::uint64_t> pid_start;  // with netns_pid: its process's start time
    // Set: look for the namespace through sockets too, until then. Set by
    // attach(): its process lives, and no thread is left in its namespace.
    std::optional<std::chrono::steady_clock::time_point> sockets_until;
    bool lost = false;
  };

  // Builds the sandbox of `r`. `kept`: what the state file says of the
  // namespace and process it had before a restart (another namespace behind
  // the same path or pid is not adopted). `gone`, when given, is set when the
  // sandbox is over: its process exited (netns_pid), or its namespace is not
  // there any more (no such path, or another namespace behind it, and no
  // thread left in it).
  Status attach(const control::SandboxAddRequest& r, Kept* kept, bool* gone = nullptr) {
    bool ignored = false;
    bool& missing = gone != nullptr ? *gone : ignored;
    Attached a;
    UniqueFd pidfd;
    std::optional<std::uint64_t> pid_start;
    if (r.netns_pid) {
      a.pid = *r.netns_pid;
      // The pidfd first: the namespace opened next is that process's (it
      // cannot be a reused pid's once the pidfd is held and not yet readable).
      pidfd = UniqueFd(static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(a.pid), 0)));
      missing = !pidfd.ok() && errno == ESRCH;
      if (!pidfd.ok()) return Error::invalid("no process " + std::to_string(a.pid) + ": " + errno_text(errno));
      a.netns = "/proc/" + std::to_string(a.pid) + "/ns/net";
      pid_start = process_start(a.pid);
      if (kept && kept->pid_start && pid_start != kept->pid_start) {
        // The pid is another process's now: the sandbox's process exited
        // while the agent was down, which ends the sandbox (policy stays).
        missing = true;
        return Error::invalid("process " + std::to_string(a.pid) + " exited while the agent was down (the pid is " +
                              "another process's now)");
      }
    } else {
      a.netns = *r.netns;
    }
    UniqueFd nsfd(::open(a.netns.c_str(), O_RDONLY | O_CLOEXEC));
    const int open_errno = errno;
    if (pidfd.ok()) {
      pollfd p{pidfd.get(), POLLIN, 0};
      missing = ::poll(&p, 1, 0) == 1;
      if (missing) return Error::invalid("process " + std::to_string(a.pid) + " has exited");
    }
    if (kept && !(nsfd.ok() && is_kept(nsfd.get(), kept->ns))) {
      // After a restart the path or pid leads elsewhere, or nowhere: the
      // process moved itself (keeping its pid) into a namespace of its own,
      // which a sandbox's process can do where user namespaces are allowed;
      // or it ended its main thread (a zombie leader has no /proc/PID/ns),
      // which any process can. The namespace attached before is the one to
      // keep serving, as the agent did while it ran; dropping it would leave
      // it stuck in its phase, unserved (attack reviews). Found by its
      // identity through any thread still in it.
      // Without a cookie (a state file from before 2026-12-07, or a kernel
      // before 5.14) an inode number may be another namespace's: searched
      // for only as before, for a --netns-pid sandbox whose process lives.
      std::optional<std::pair<UniqueFd, std::string>> there;
      if (kept->ns.cookie || pidfd.ok()) there = open_netns_of_any_thread(kept->ns);
      if (!there && kept->ns.cookie && kept->sockets_until) {
        there = open_netns_through_sockets(kept->ns, *kept->sockets_until);
      }
      if (there) {
        log_->warn("sandbox={} {} no longer leads to the network namespace attached before the restart; that "
                   "namespace is attached again through {}",
                   r.name, a.netns, there->second);
        nsfd = std::move(there->first);
      } else if (pidfd.ok()) {
        // Its process lives, elsewhere; the namespace may live on without a
        // thread in it (held by sockets made there): not known to be over.
        kept->lost = true;
        return Error::invalid("process " + std::to_string(a.pid) + " is no longer in the network namespace " +
                              "attached before the restart, and no thread is");
      } else {
        missing = true;
        return Error::invalid(nsfd.ok() ? a.netns + " is another network namespace than the one attached before " +
                                              "the restart, and no thread is left in that one"
                                        : "cannot open network namespace " + a.netns + ": " + errno_text(open_errno) +
                                              ", and no thread is left in the one attached before the restart");
      }
    }
    if (!nsfd.ok()) {
      missing = open_errno == ENOENT;
      return Error::invalid("cannot open network namespace " + a.netns + ": " + errno_text(open_errno));
    }
    auto id = ns_id(nsfd.get());
    if (!id) return id.error();
    if (const UniqueFd own(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC)); own.ok()) {
      // Its own rules would then hold the agent's upstream queries and every
      // other sandbox's DNS to them.
      if (auto mine = ns_id(own.get()); mine && *mine == *id) {
        return Error::invalid(a.netns + " is the agent's own network namespace");
      }
    }
    // Before anything is installed: a namespace whose owner is another user
    // namespace is one its creator can rule (netns.h). After a restart such a
    // sandbox is dropped, not kept for the next start: it fails every time.
    if (auto owned = check_netns_owner(nsfd.get(), a.netns); !owned) {
      missing = owned.error().kind == ErrorKind::invalid;
      return owned;
    }
    const Result<std::optional<std::uint64_t>> cookie = ns_cookie(nsfd.get());
    if (!cookie) return cookie.error();
    for (const auto& [name, other] : sandboxes_) {
      // By the namespace, not the path: two sandboxes in one namespace would
      // share its table, each undoing the other's switches as tampering.
      if (other.id == *id) {
        return Error::invalid(a.netns + " is already attached as sandbox \"" + name + "\"" +
                              (other.netns == a.netns ? "" : " (as " + other.netns + ")"));
      }
    }
    a.id = *id;

    if (r.socket) {
      // Checked before anything is installed: a refused add changes nothing.
      const fs::path sp(*r.socket);
      std::error_code ec;
      if (r.socket->empty() || r.socket->size() >= sizeof(sockaddr_un::sun_path) || !sp.has_filename()) {
        return Error::invalid("socket " + *r.socket + ": not a usable socket path (at most " +
                              std::to_string(sizeof(sockaddr_un::sun_path) - 1) + " bytes)");
      }
      const fs::path dir = sp.has_parent_path() ? sp.parent_path() : fs::path(".");
      if (!fs::is_directory(dir, ec)) return Error::invalid("socket " + *r.socket + ": no directory " + dir.string());
    }
    // A hosts file named in the request must be there (checked before anything
    // is installed). None by default, not even /proc/PID/root/etc/hosts with
    // netns_pid: the agent attaches a container that already runs, whose
    // root may have written its own pairs there before the snapshot is taken
    // (docs/pinning.md "Hosts files").
    // Not at a restart: what a restart learns is the snapshot kept at the add
    // (NAME.state.hosts), and the live file is the sandbox's to break (its
    // root may write a line egressd refuses; a zombie leader has no
    // /proc/PID/root): refusing it there left the namespace unserved in its
    // phase (attack review 7). A live file that cannot be read then is
    // logged, as while the agent runs.
    const std::string hosts_file = r.hosts_file ? hosts_file_for(*r.hosts_file, "") : "";
    if (!hosts_file.empty() && kept == nullptr) {
      if (auto s = check_hosts_file(hosts_file); !s) return s;
    }
    Result<Policy> policy = r.config ? load_policy_file(*r.config) : builtin_policy(r.allow.value_or(std::vector<std::string>{}));
    if (!policy) return policy.error();
    InstanceOptions o;
    o.name = r.name;
    o.initial = r.config ? r.phase.value_or(policy->initial_phase) : std::string(to_string(r.mode.value_or(Mode::no_network)));
    if (policy->find(o.initial) == nullptr) return Error::invalid("unknown phase \"" + o.initial + "\"");
    o.policy = std::move(*policy);
    o.netns = a.netns;
    o.socket = r.socket.value_or("");
    for (auto u : r.allow_uid.value_or(std::vector<std::uint64_t>{})) o.allow_uids.push_back(static_cast<std::uint32_t>(u));
    o.state_file = (args_.state_dir.empty() ? args_.socket + "." : args_.state_dir + "/") + r.name + ".state";
    o.dns_port = static_cast<int>(r.dns_port.value_or(53));
    o.verify_interval_s = args_.verify_interval_s;
    o.resolv_conf = resolv_conf_;
    o.hosts_file = hosts_file;
    o.upstream_in_sandbox = false;
    if (o.policy.dns.upstream_netns == UpstreamNetns::sandbox) {
      o.upstream_netns = UniqueFd(::fcntl(nsfd.get(), F_DUPFD_CLOEXEC, 0));
      if (!o.upstream_netns.ok()) return errno_error("dns.upstream_netns: sandbox", errno);
    }
    o.capabilities = caps_;
    o.can_log = can_log_;
    o.after_switch = [this] { trim_(); };
    o.nft_events = hub_.get();
    o.link_events = link_hub_.get();
    o.fd_budget = fds_;
    o.own_conntrack = conntrack_.get();
    Result<std::unique_ptr<Instance>> inst = Error::runtime("not built");
    // Here, not inside the namespace: other sandboxes' restores may run.
    // (The link hub needs no settling: a stale notification handed to the
    // new sandbox costs it one more dump of its links, nothing else.)
    if (hub_) hub_->settle();
    {
      auto scope = NetnsScope::enter(nsfd.get());
      if (!scope) return scope.error();
      inst = Instance::create(io_, std::move(o));
    }
    if (!inst) return inst.error();
    a.inst = std::move(*inst);
    a.inst->preresolve();  // home again: from the agent's namespace
    if (!caps_) caps_ = a.inst->sandbox().capabilities();
    if (!can_log_ && o_log_group(a)) can_log_ = a.inst->can_log();
    if (pidfd.ok()) {
      a.pidfd = std::make_unique<boost::asio::posix::stream_descriptor>(io_, pidfd.release());
      // By name and by its own pidfd: a completion already queued when the
      // sandbox was removed must not remove one added again under that name.
      a.pidfd->async_wait(boost::asio::posix::stream_descriptor::wait_read,
                          [this, name = r.name, mine = a.pidfd.get()](const boost::system::error_code& ec) {
                            if (ec) return;
                            if (auto it = sandboxes_.find(name); it == sandboxes_.end() || it->second.pidfd.get() != mine) {
                              return;
                            }
                            log_->info("sandbox={} its process exited; removed (policy stays)", name);
                            (void)detach(name, false);
                          });
    }
    if (!args_.state_dir.empty()) {
      json saved = {{"request", json(r)}, {"ns_dev", id->dev}, {"ns_ino", id->ino}, {"boot_id", boot_id()}};
      if (*cookie) saved["ns_cookie"] = **cookie;
      if (pid_start) saved["pid_start"] = *pid_start;
      if (auto s = write_atomically(args_.state_dir + "/" + r.name + ".json", saved.dump(2) + "\n"); !s) {
        log_->warn("sandbox={} not kept for a restart: {}", r.name, s.error().message);
      }
    }
    Sandbox& sb = a.inst->sandbox();
    audit_event("sandbox_add",
                {{"sandbox", r.name},
                 {"netns", a.netns},
                 {"phase", sb.state().phase},
                 {"mode", to_string(sb.state().mode)},
                 {"generation", sb.state().generation},
                 {"startup_us", a.inst->startup_us()}},
                spdlog::level::info,
                fmt::format("sandbox={} attached netns={} phase={} mode={} gen={} startup_us={}", r.name, a.netns,
                            sb.state().phase, to_string(sb.state().mode), sb.state().generation,
                            a.inst->startup_us()));
    sandboxes_.emplace(r.name, std::move(a));
    trim_();
    return {};
  }

  Status detach(const std::string& name, bool remove_policy) {
    auto it = sandboxes_.find(name);
    if (it == sandboxes_.end()) return Error::invalid("no sandbox \"" + name + "\"");
    Attached a = std::move(it->second);
    sandboxes_.erase(it);
    if (a.pidfd) a.pidfd->cancel();
    Status st = a.inst->close(remove_policy);
    if (!args_.state_dir.empty()) ::unlink((args_.state_dir + "/" + name + ".json").c_str());
    audit_event("sandbox_remove", {{"sandbox", name}, {"policy", remove_policy && st ? "removed" : "stays"}},
                spdlog::level::info,
                fmt::format("sandbox={} removed; policy {}", name, remove_policy && st ? "removed" : "stays in force"));
    // Its sockets are closed; the object goes once nothing of it runs on the
    // loop any more.
    removed_.push_back(std::move(a));
    reap();
    return st;
  }

  void reap() {
    std::erase_if(removed_, [](const Attached& a) { return a.inst->idle(); });
    if (removed_.empty()) return;
    reap_timer_.expires_after(std::chrono::milliseconds(50));
    reap_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (!ec) reap();
    });
  }

  void remove(const json& req, control::Reply reply) {
    auto d = control::decode<control::SandboxRemoveRequest>(req);
    if (auto* err = std::get_if<control::ErrorReply>(&d)) return reply(json(*err));
    const auto& r = std::get<control::SandboxRemoveRequest>(d);
    if (sandboxes_.count(r.name) == 0) {
      return reply(control::error_reply("unknown_sandbox", "no sandbox \"" + r.name + "\""));
    }
    const bool remove_policy = r.remove_policy.value_or(false);
    if (auto st = detach(r.name, remove_policy); !st) return reply(control::error_reply(st.error(), "kernel_error"));
    reply(control::ok_reply({{"name", r.name}, {"policy", remove_policy ? "removed" : "stays"}}));
  }

  void list(const json& req, control::Reply reply) {
    auto d = control::decode<control::SandboxListRequest>(req);
    if (auto* err = std::get_if<control::ErrorReply>(&d)) return reply(json(*err));
    json out = json::array();
    for (const auto& [name, a] : sandboxes_) {
      Sandbox& sb = a.inst->sandbox();
      json e = {{"name", name},
                {"netns", a.netns},
                {"phase", sb.state().phase},
                {"mode", std::string(to_string(sb.state().mode))},
                {"generation", sb.state().generation},
                {"socket", a.inst->options().socket},
                {"dns_port", a.inst->dns_port()}};
      if (a.pid != 0) e["pid"] = a.pid;
      out.push_back(std::move(e));
    }
    reply(control::ok_reply({{"sandboxes", std::move(out)}}));
  }

  boost::asio::io_context& io_;
  const AgentArgs& args_;
  std::shared_ptr<spdlog::logger> log_ = spdlog::get("egressd");
  const std::string resolv_conf_ = read_resolv_conf();  // the agent's: upstream DNS is asked from here
  // Shared by every sandbox's DNS proxy: no sandbox takes the descriptors
  // the others, or the control socket, need (attack review).
  std::shared_ptr<dns::FdBudget> fds_;
  TrimWhenIdle trim_;
  std::unique_ptr<control::Server> server_;
  // Probed with the first sandbox, then known (see InstanceOptions::capabilities).
  std::optional<Capabilities> caps_;
  std::optional<bool> can_log_;
  // Before the sandboxes, which use it (InstanceOptions::own_conntrack).
  std::unique_ptr<ConntrackForgetter> conntrack_;
  // Before the sandboxes: their tamper guards' feeds go first.
  std::unique_ptr<EventHub> hub_;       // nftables changes
  std::unique_ptr<EventHub> link_hub_;  // link and IPv6 route changes
  static bool o_log_group(const Attached& a) { return a.inst->options().policy.enforce.log_group != 0; }
  std::map<std::string, Attached> sandboxes_;
  std::vector<Attached> removed_;
  boost::asio::steady_timer reap_timer_;
};

// Every attached sandbox holds 15 to 17 descriptors (its netlink sockets,
// DNS proxy listeners, control socket, queue and timers), and its share of
// the upstream DNS budget (dns/fd_budget.h) on top. A shell or
// service manager starts a process with a soft limit of 1024 out of a far
// larger hard one: held to it, the agent would refuse `sandbox add` with
// EMFILE near the 80th sandbox. Raised to the hard limit, as a server that
// needs them does. The kernel's table of them grows by doubling, and while
// the process has threads each growth waits for an RCU grace period (~20 ms
// here, inside whichever `sandbox add` opened the descriptor); grown once now,
// before any thread, to room for kTableRoom.
void prepare_descriptors() {
  constexpr rlim_t kTableRoom = 4096;
  auto log = spdlog::get("egressd");
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  if (rl.rlim_cur < rl.rlim_max) {
    const rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &rl) == 0) {
      log->info("descriptors: soft limit raised from {} to {} (64 + 32 per sandbox)", was, rl.rlim_max);
    } else {
      rl.rlim_cur = was;
      log->warn("descriptors: soft limit {} cannot be raised ({}): about {} sandboxes fit (64 + 32 each)", was,
                errno_text(errno), was > 64 ? (was - 64) / 32 : 0);
    }
  }
  const rlim_t room = std::min<rlim_t>(rl.rlim_cur, kTableRoom);
  UniqueFd probe(::open("/", O_PATH | O_CLOEXEC));
  if (probe.ok() && room > 1) {
    const int high = ::fcntl(probe.get(), F_DUPFD_CLOEXEC, static_cast<int>(room - 1));
    if (high >= 0) ::close(high);
  }
}

// One agent per state directory: a second one would try to attach every
// sandbox of the first (each namespace's claim refuses it, netns_claim.h) and
// then serve none of them. Held (flock) for as long as the agent runs; the
// kernel lets go when it exits, however it exits. The file holds the holder's
// pid, for the message.
Result<UniqueFd> lock_state_dir(const std::string& dir) {
  const std::string path = dir + "/agent.lock";
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.ok()) return errno_error("--state-dir " + dir + ": cannot open " + path, errno);
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) return errno_error("--state-dir " + dir + ": cannot lock " + path, err);
    char pid[32] = {};
    const ssize_t n = ::pread(fd.get(), pid, sizeof pid - 1, 0);
    std::string who = n > 0 ? std::string(pid, static_cast<std::size_t>(n)) : "";
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    return Error::runtime("--state-dir " + dir + " is in use by another egressd agent" +
                          (who.empty() ? "" : " (pid " + who + ")") + "; one agent per state directory");
  }
  const std::string mine = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd.get(), 0) != 0 || ::pwrite(fd.get(), mine.data(), mine.size(), 0) < 0) {
    spdlog::get("egressd")->warn("--state-dir {}: cannot write the agent's pid into {}: {}", dir, path,
                                 errno_text(errno));
  }
  return fd;
}

}  // namespace

int cmd_agent(const AgentArgs& a) {
  setup_logging(a.log_format == "json" ? LogFormat::json : LogFormat::text);
  ::signal(SIGPIPE, SIG_IGN);
  prepare_descriptors();
  if (!a.state_dir.empty()) {
    std::error_code ec;
    fs::create_directories(a.state_dir, ec);
    if (ec) return report(Error::invalid("--state-dir " + a.state_dir + ": " + ec.message()));
  }
  UniqueFd state_lock;
  if (!a.state_dir.empty()) {
    auto l = lock_state_dir(a.state_dir);
    if (!l) return report(l.error());
    state_lock = std::move(*l);
  }
  // In the agent's own namespace, before any sandbox's (sockdiag.h own_cgroup).
  (void)own_cgroup();
  boost::asio::io_context io;
  Agent agent(io, a);
  // Sandboxes first: a client that finds the socket finds them attached.
  agent.restore();
  if (auto s = agent.listen(); !s) return report(s.error());
  spdlog::get("egressd")->info("agent ready socket={} state_dir={}", a.socket, a.state_dir.empty() ? "-" : a.state_dir);
  boost::asio::signal_set signals(io, SIGTERM, SIGINT);
  signals.async_wait([&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    spdlog::get("egressd")->info("signal={} agent shutting down; every sandbox's policy stays in force", sig);
    agent.shutdown();
    io.stop();
  });
  io.run();
  agent.clear();
  return 0;
}

}  // namespace egressd::daemon
