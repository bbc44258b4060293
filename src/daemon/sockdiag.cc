#include "daemon/sockdiag.h"

#include "nft/transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace egressd::daemon {

namespace {

struct Request {
  nlmsghdr nlh;
  inet_diag_req_v2 req;
};

Request make_request(std::uint16_t type, std::uint16_t flags, std::uint32_t seq, int family, int proto,
                     std::uint32_t states) {
  Request r{};
  r.nlh.nlmsg_len = sizeof r;
  r.nlh.nlmsg_type = type;
  r.nlh.nlmsg_flags = flags;
  r.nlh.nlmsg_seq = seq;
  r.req.sdiag_family = static_cast<std::uint8_t>(family);
  r.req.sdiag_protocol = static_cast<std::uint8_t>(proto);
  r.req.idiag_states = states;
  return r;
}

IpPrefix to_prefix(int family, const __be32* addr) {
  IpPrefix p;
  if (family == AF_INET) {
    p.family = 4;
    p.prefix_len = 32;
    std::memcpy(p.bytes.data(), addr, 4);
    return p;
  }
  p.family = 6;
  p.prefix_len = 128;
  std::memcpy(p.bytes.data(), addr, 16);
  static const std::uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(p.bytes.data(), mapped, 12) == 0) {
    IpPrefix v4;
    v4.family = 4;
    v4.prefix_len = 32;
    std::memcpy(v4.bytes.data(), p.bytes.data() + 12, 4);
    return v4;
  }
  return p;
}

// Dumps sockets of one family/protocol in `states`; calls `fn` per message.
// A dump that lost messages (EINTR from the transport) is taken again: the
// callers collect into fresh containers per attempt.
Status dump(nft::Transport& t, int family, int proto, std::uint32_t states,
            const std::function<void(const inet_diag_msg&)>& fn) {
  int err = EINTR;
  for (int attempt = 0; attempt < 3 && err == EINTR; ++attempt) {
    Request r = make_request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 0, family, proto, states);
    std::vector<inet_diag_msg> got;
    err = t.request(&r.nlh, [&](const nlmsghdr* h) {
      if (h->nlmsg_len >= NLMSG_LENGTH(sizeof(inet_diag_msg))) got.push_back(*static_cast<const inet_diag_msg*>(NLMSG_DATA(h)));
    }, std::chrono::milliseconds(2000));
    if (err == 0) {
      for (const auto& m : got) fn(m);
      return {};
    }
  }
  if (err == ETIMEDOUT) return Error::runtime("sock_diag dump: no answer within 2 s");
  return errno_error("sock_diag dump", err);
}

Status destroy(nft::Transport& t, int family, int proto, const inet_diag_msg& m) {
  Request r = make_request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, 0, family, proto, ~0u);
  r.req.id = m.id;
  const int err = t.request(&r.nlh, [](const nlmsghdr*) {}, std::chrono::milliseconds(2000));
  // ENOENT: the socket closed meanwhile, nothing to do.
  if (err == 0 || err == ENOENT) return {};
  if (err == ETIMEDOUT) return Error::runtime("SOCK_DESTROY: no ack within 2 s");
  return errno_error("SOCK_DESTROY", err);
}

constexpr std::uint32_t state_bit(int s) { return 1u << s; }

// Sockets of `family` hashed in the calling thread's namespace, TCP and UDP
// (/proc/thread-self/net/sockstat{,6}: "TCP: inuse N", "UDP: inuse N"). TCP
// counts listening sockets and every one with a flow (not TIME_WAIT); UDP
// every bound socket, so every connected one. Unset when it cannot be read.
struct InUse {
  std::optional<long> tcp, udp;
};

InUse sockets_in_use(int family) {
  std::ifstream in(family == AF_INET ? "/proc/thread-self/net/sockstat" : "/proc/thread-self/net/sockstat6");
  const std::string tcp = family == AF_INET ? "TCP:" : "TCP6:";
  const std::string udp = family == AF_INET ? "UDP:" : "UDP6:";
  InUse out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string k, w;
    long n = 0;
    if (!(words >> k >> w >> n) || w != "inuse") continue;
    if (k == tcp) out.tcp = n;
    if (k == udp) out.udp = n;
  }
  return out;
}

}  // namespace

Result<Reaped> destroy_flows(const std::function<bool(const FlowInfo&)>& keep, const std::vector<OwnSocket>& own) {
  // Opened per call on the reaper's thread (in the sandbox's namespace),
  // without an event loop: requests only.
  auto t = nft::Transport::open(nft::TransportOptions{NETLINK_SOCK_DIAG, {}, 0, "sock_diag"});
  if (!t) return t.error();
  nft::Transport& s = **t;
  Reaped out;
  for (int family : {AF_INET, AF_INET6}) {
    // A listing walks the host's whole hash table of its protocol, shared by
    // every namespace (here TCP's 256k buckets, its listeners' 64k, UDP's
    // 16k: about 2.5 MB read per switch when every listing ran, and the
    // caches of whatever runs next emptied). It is skipped when the
    // namespace's hashed sockets of that protocol and family are egressd's
    // own: each of them is hashed while egressd holds it, so any other
    // socket (a flow, a bound UDP socket, a listener of the sandbox's) makes
    // `inuse` larger, and a socket made after the count was made under the
    // new phase's rules. The sandbox could balance its flow only by
    // unhashing one of egressd's sockets, which takes CAP_NET_ADMIN there
    // (SOCK_DESTROY); either way the rules have cut the flow already.
    const InUse used = sockets_in_use(family);
    const auto owned = [&](bool udp) {
      return static_cast<long>(std::count_if(own.begin(), own.end(), [&](const OwnSocket& o) {
        return o.family == family && o.udp == udp;
      }));
    };
    const bool tcp_flows = !(used.tcp && *used.tcp == owned(false));
    const bool udp_flows = !(used.udp && *used.udp == owned(true));
    // Listening ports tell accepted (inbound) connections from outbound ones.
    std::set<std::uint16_t> listen_ports;
    if (tcp_flows) {
      ++out.tcp_families;
      if (auto st = dump(s, family, IPPROTO_TCP, state_bit(TCP_LISTEN),
                         [&](const inet_diag_msg& m) { listen_ports.insert(ntohs(m.id.idiag_sport)); });
          !st) {
        return st.error();
      }
    }
    if (udp_flows) ++out.udp_families;
    for (int proto : {IPPROTO_TCP, IPPROTO_UDP}) {
      if (!(proto == IPPROTO_TCP ? tcp_flows : udp_flows)) continue;
      const std::uint32_t states = proto == IPPROTO_TCP
                                       ? ~(state_bit(TCP_LISTEN) | state_bit(TCP_CLOSE) | state_bit(TCP_TIME_WAIT))
                                       : state_bit(TCP_ESTABLISHED);  // connected UDP sockets
      std::vector<inet_diag_msg> victims;
      auto st = dump(s, family, proto, states, [&](const inet_diag_msg& m) {
        FlowInfo f;
        f.dst = to_prefix(m.idiag_family, m.id.idiag_dst);
        f.dport = ntohs(m.id.idiag_dport);
        f.udp = proto == IPPROTO_UDP;
        f.inbound = !f.udp && listen_ports.count(ntohs(m.id.idiag_sport)) != 0;
        if (f.dport != 0 && !keep(f)) victims.push_back(m);
      });
      if (!st) return st.error();
      for (const auto& m : victims) {
        if (auto d = destroy(s, family, proto, m); !d) return d.error();
        ++out.destroyed;
      }
    }
  }
  return out;
}

namespace {

// Whether the calling thread is in the namespace `fd` names.
bool in_namespace(int fd) {
  struct stat want {}, here {};
  return ::fstat(fd, &want) == 0 && ::stat("/proc/thread-self/ns/net", &here) == 0 && want.st_dev == here.st_dev &&
         want.st_ino == here.st_ino;
}

}  // namespace

struct FlowReaper::Impl {
  bool inbound_replies;
  bool dns_redirect;
  Report report;
  std::mutex mu;
  std::condition_variable cv;
  struct Job {
    std::shared_ptr<const Phase> phase;
    std::uint64_t generation = 0;
    std::vector<OwnSocket> own;
  };
  std::optional<Job> job;  // newest request only
  std::uint64_t latest = 0;                            // generation of the newest request
  bool stop = false;
  UniqueFd netns;      // where the thread works; invalid: where it was started
  std::thread thread;  // started by the first job (a sandbox never switched out of public has none)

  bool superseded(std::uint64_t gen) {
    std::lock_guard<std::mutex> lock(mu);
    return stop || latest != gen;
  }

  void run() {
    // Lowest CPU priority: aborting sockets only makes failures faster; the
    // event loop (switches, DNS answers) must never wait behind it.
    ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
    // A sidecar's thread starts in the namespace already, and a sidecar in
    // a container has no CAP_SYS_ADMIN, which setns takes even into the
    // namespace the thread is in: only an agent's thread moves.
    if (netns.ok() && !in_namespace(netns.get()) && ::setns(netns.get(), CLONE_NEWNET) != 0) {
      // Never in another namespace's sockets: no job is done.
      const Error e = errno_error("flow reaper: cannot enter the sandbox's network namespace", errno);
      for (;;) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || job.has_value(); });
        if (stop) return;
        const std::uint64_t gen = job->generation;
        job.reset();
        lock.unlock();
        if (report) report(e, gen);
      }
    }
    for (;;) {
      Job j;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || job.has_value(); });
        if (stop) return;
        const std::uint64_t queued = job->generation;
        if (cv.wait_for(lock, kReapSettle, [&] { return stop || latest != queued; })) continue;  // superseded
        j = std::move(*job);
        job.reset();
      }
      const std::uint64_t gen = j.generation;
      auto n = destroy_flows(
          [&](const FlowInfo& f) {
            return superseded(gen) || flow_may_survive(*j.phase, f, inbound_replies, dns_redirect);
          },
          j.own);
      if (!report) continue;
      if (n) {
        report(n->destroyed, gen);
      } else {
        report(n.error(), gen);
      }
    }
  }
};

FlowReaper::FlowReaper(bool inbound_replies, bool dns_redirect, Report report, UniqueFd netns)
    : impl_(std::make_unique<Impl>()) {
  impl_->inbound_replies = inbound_replies;
  impl_->dns_redirect = dns_redirect;
  impl_->report = std::move(report);
  impl_->netns = std::move(netns);
}

FlowReaper::~FlowReaper() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void FlowReaper::reap(std::shared_ptr<const Phase> phase, std::uint64_t generation, std::vector<OwnSocket> own) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->latest = generation;
    // Public allows every flow: nothing to abort, and it supersedes older jobs.
    if (phase->mode == Mode::public_) {
      impl_->job.reset();
      return;
    }
    impl_->job = Impl::Job{std::move(phase), generation, std::move(own)};
  }
  if (!impl_->thread.joinable()) impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
  impl_->cv.notify_one();
}

bool flow_may_survive(const Phase& phase, const FlowInfo& f, bool inbound_replies, bool dns_redirect) {
  if (is_loopback(f.dst)) return true;
  if (f.inbound && inbound_replies) return true;
  // A query in flight at a switch is answered by the proxy under the new
  // phase; aborting its socket would only fail a lookup the sandbox may make.
  if (dns_redirect && f.dport == 53 && !f.inbound) return true;
  switch (phase.mode) {
    case Mode::public_: return true;
    case Mode::no_network: return false;
    case Mode::allowlist: break;
  }
  for (const auto& e : phase.entries) {
    if (e.is_name()) return true;
    if (e.ip.family == f.dst.family && e.ip.contains(f.dst)) return true;
  }
  return false;
}

namespace {

// Dumps one family's sockets of one protocol in the calling thread's
// namespace and gives `take` each one's message and cgroup v2 id (sock_diag
// INET_DIAG_CGROUP_ID; 0 when the kernel gave none). Retries a dump the
// kernel interrupted (EINTR: the hash changed under it), up to 3 times.
Status dump_cgroups(nft::Transport& t, int family, int proto, std::uint32_t states,
                    const std::function<void(const inet_diag_msg&, std::uint64_t)>& take) {
  int err = EINTR;
  std::vector<std::pair<inet_diag_msg, std::uint64_t>> got;
  for (int attempt = 0; attempt < 3 && err == EINTR; ++attempt) {
    got.clear();
    Request r = make_request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 0, family, proto, states);
    err = t.request(&r.nlh, [&](const nlmsghdr* h) {
      if (h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) return;
      const auto* m = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
      std::uint64_t id = 0;
      // The attributes follow the message, each 4-byte aligned.
      const auto* a = reinterpret_cast<const nlattr*>(reinterpret_cast<const char*>(m) + NLMSG_ALIGN(sizeof *m));
      std::size_t left = h->nlmsg_len - NLMSG_LENGTH(NLMSG_ALIGN(sizeof *m));
      while (left >= sizeof(nlattr) && a->nla_len >= sizeof(nlattr) && a->nla_len <= left) {
        if ((a->nla_type & NLA_TYPE_MASK) == INET_DIAG_CGROUP_ID && a->nla_len >= NLA_HDRLEN + sizeof(std::uint64_t)) {
          std::memcpy(&id, reinterpret_cast<const char*>(a) + NLA_HDRLEN, sizeof id);
        }
        const std::size_t step = NLA_ALIGN(a->nla_len);
        if (step >= left) break;
        left -= step;
        a = reinterpret_cast<const nlattr*>(reinterpret_cast<const char*>(a) + step);
      }
      got.emplace_back(*m, id);
    }, std::chrono::milliseconds(2000));
  }
  if (err == ETIMEDOUT) return Error::runtime("sock_diag dump: no answer within 2 s");
  if (err != 0) return errno_error("sock_diag dump", err);
  for (const auto& [m, id] : got) take(m, id);
  return {};
}

}  // namespace

Result<std::vector<std::uint64_t>> socket_cgroups(const std::vector<IpPrefix>& addrs) {
  auto t = nft::Transport::open(nft::TransportOptions{NETLINK_SOCK_DIAG, {}, 0, "sock_diag"});
  if (!t) return t.error();
  // egressd's own sockets on the address (it holds a loopback upstream's
  // port 53 against squatters) are not the resolver's.
  std::set<std::uint64_t> own;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string link = std::filesystem::read_symlink(it->path(), ec).string();
    if (!ec && link.rfind("socket:[", 0) == 0) own.insert(std::strtoull(link.c_str() + 8, nullptr, 10));
    ec.clear();
  }
  std::vector<std::uint64_t> out;
  for (int family : {AF_INET, AF_INET6}) {
    for (const auto& [proto, states] : {std::pair{IPPROTO_UDP, ~0u}, {IPPROTO_TCP, state_bit(TCP_LISTEN)}}) {
      auto s = dump_cgroups(**t, family, proto, states, [&](const inet_diag_msg& m, std::uint64_t id) {
        const IpPrefix local = to_prefix(m.idiag_family, m.id.idiag_src);
        if (id == 0 || std::find(addrs.begin(), addrs.end(), local) == addrs.end() || own.count(m.idiag_inode) != 0) {
          return;
        }
        if (std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
      });
      if (!s) return s.error();
    }
  }
  return out;
}

namespace {

// A small file of /proc, whole ("" when it cannot be read).
std::string read_proc_file(const char* path) {
  std::string out;
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd.ok()) return out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

// Calls `each` with the mount point of every cgroup v2 mount of the
// hierarchy's root (as this mount namespace sees it: in a cgroup namespace,
// from that namespace's root), until it returns true.
void each_cgroup2_root_mount(const std::function<bool(const std::string&)>& each) {
  const std::string info = read_proc_file("/proc/self/mountinfo");
  std::string_view rest = info;
  while (!rest.empty()) {
    const auto nl = rest.find('\n');
    const std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
    // "ID PARENT MAJ:MIN ROOT POINT OPTIONS... - FSTYPE SOURCE SUPER"
    const auto dash = line.find(" - ");
    if (dash == std::string_view::npos || line.substr(dash + 3).substr(0, 8) != "cgroup2 ") continue;
    std::string_view f = line.substr(0, dash);
    std::string_view field[5];
    for (auto& x : field) {
      const auto sp = f.find(' ');
      x = f.substr(0, sp);
      f = sp == std::string_view::npos ? std::string_view{} : f.substr(sp + 1);
    }
    if (field[3] == "/" && each(std::string(field[4]))) return;
  }
}

[[gnu::cold]] Result<OwnCgroup> learn_own_cgroup() {  // once: for size
  // By its directory: /proc/self/cgroup names it ("0::PATH", from the
  // cgroup namespace's root, as the mount sees it), and a cgroup's id is its
  // directory's inode. No socket, no port: nothing a sandbox process can
  // take away first (an attack review held every free port, which failed a
  // lookup through a bound socket).
  std::string why = "no cgroup v2 mount in sight";
  std::string path;
  const std::string cg = read_proc_file("/proc/self/cgroup");
  for (std::size_t at = 0; at < cg.size();) {
    const auto nl = cg.find('\n', at);
    const std::string line = cg.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
    at = nl == std::string::npos ? cg.size() : nl + 1;
  }
  std::optional<OwnCgroup> found_by_path;
  each_cgroup2_root_mount([&](const std::string& mount) {
    struct stat st{};
    if (path.empty() || path[0] != '/' || ::stat((mount + path).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      why = "cgroup " + (path.empty() ? std::string("(none in /proc/self/cgroup)") : path) + " not found under " + mount;
      return false;
    }
    int depth = path.size() > 1 ? 1 : 0;
    for (std::size_t i = 1; i < path.size(); ++i) depth += path[i] == '/' ? 1 : 0;
    found_by_path = OwnCgroup{static_cast<std::uint64_t>(st.st_ino), depth};
    return true;
  });
  if (found_by_path) return *found_by_path;
  // Else by a socket's (a socket's cgroup is its maker's, taken when it is
  // made), bound to a free port: egressd learns this before it joins the
  // sandbox's namespace (own_cgroup is called first thing), so the port is
  // its own namespace's.
  auto t = nft::Transport::open(nft::TransportOptions{NETLINK_SOCK_DIAG, {}, 0, "sock_diag"});
  if (!t) return t.error();
  UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.ok()) return errno_error("own cgroup: socket", errno);
  sockaddr_in any{};
  any.sin_family = AF_INET;
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&any), sizeof any) != 0) {
    return Error::runtime("own cgroup: " + why + "; bind: " + std::strerror(errno));
  }
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) return errno_error("own cgroup: fstat", errno);
  std::uint64_t found = 0;
  auto s = dump_cgroups(**t, AF_INET, IPPROTO_UDP, ~0u, [&](const inet_diag_msg& m, std::uint64_t id) {
    if (m.idiag_inode == st.st_ino) found = id;
  });
  if (!s) return s.error();
  if (found == 0) return Error::runtime("own cgroup: " + why + "; sock_diag gave no cgroup id for egressd's socket");
  return OwnCgroup{found, -1};
}

}  // namespace

Result<OwnCgroup> own_cgroup() {
  static const Result<OwnCgroup> learned = learn_own_cgroup();
  return learned;
}

bool cgroup2_root_in_sight() {
  bool seen = false;
  each_cgroup2_root_mount([&](const std::string& point) {
    struct stat st{};
    seen = ::stat(point.c_str(), &st) == 0 && static_cast<std::uint64_t>(st.st_ino) == kCgroup2RootId;
    return seen;
  });
  return seen;
}

}  // namespace egressd::daemon
