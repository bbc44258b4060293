// Which flows the reaper keeps after a switch (src/daemon/sockdiag.cc,
// flow_may_survive): it destroys only sockets whose flows the new phase cuts.
#include <doctest/doctest.h>

#include "daemon/sockdiag.h"
#include "support/netns.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <linux/capability.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <cstring>
#include <functional>
#include <thread>

using namespace egressd;
using namespace egressd::daemon;
using egressd::testing::as_root;
using egressd::testing::in_new_netns;

namespace {

Phase phase(Mode mode, const std::vector<std::string>& entries) {
  auto p = make_inline_phase("p", mode, entries);
  REQUIRE(p.ok());
  return *p;
}

FlowInfo flow(const char* ip, std::uint16_t port, bool udp = false, bool inbound = false) {
  auto a = parse_ip(ip);
  REQUIRE(a.has_value());
  return FlowInfo{*a, port, inbound, udp};
}

}  // namespace

TEST_CASE("no-network aborts outbound flows but keeps loopback") {
  const Phase p = phase(Mode::no_network, {});
  CHECK_FALSE(flow_may_survive(p, flow("192.0.2.10", 443), true, true));
  CHECK_FALSE(flow_may_survive(p, flow("2001:db8::10", 443, true), true, true));
  CHECK(flow_may_survive(p, flow("127.0.0.1", 8080), true, true));
  CHECK(flow_may_survive(p, flow("::1", 8080), true, true));
}

TEST_CASE("DNS to port 53 survives a switch while the proxy redirects it") {
  // The redirect sends every query to egressd's proxy, which answers it under
  // the new phase (REFUSED in no-network): a lookup in flight at the switch
  // must get that answer, not ECONNABORTED.
  const Phase none = phase(Mode::no_network, {});
  const Phase allow = phase(Mode::allowlist, {"198.51.100.0/24"});
  for (const Phase* p : {&none, &allow}) {
    CHECK(flow_may_survive(*p, flow("192.0.2.1", 53, true), true, true));
    CHECK(flow_may_survive(*p, flow("192.0.2.1", 53, false), true, true));
    CHECK(flow_may_survive(*p, flow("2001:db8::1", 53, true), true, true));
    // Not to other ports of the same server.
    CHECK_FALSE(flow_may_survive(*p, flow("192.0.2.1", 853), true, true));
    CHECK_FALSE(flow_may_survive(*p, flow("192.0.2.1", 5353, true), true, true));
  }
  // Without the proxy (--dns-port 0) port 53 is an ordinary destination.
  CHECK_FALSE(flow_may_survive(none, flow("192.0.2.1", 53, true), true, false));
  CHECK_FALSE(flow_may_survive(allow, flow("192.0.2.1", 53, false), true, false));
  CHECK(flow_may_survive(allow, flow("198.51.100.53", 53, true), true, false));
}

TEST_CASE("an inbound flow follows inbound_replies, even from a peer's port 53") {
  const Phase p = phase(Mode::no_network, {});
  CHECK(flow_may_survive(p, flow("192.0.2.9", 53, false, true), true, true));
  CHECK_FALSE(flow_may_survive(p, flow("192.0.2.9", 53, false, true), false, true));
}

TEST_CASE("allowlist keeps allowed addresses and, with hostname entries, every peer") {
  const Phase ips = phase(Mode::allowlist, {"198.51.100.0/24", "2001:db8::1"});
  CHECK(flow_may_survive(ips, flow("198.51.100.7", 443), true, true));
  CHECK(flow_may_survive(ips, flow("2001:db8::1", 443), true, true));
  CHECK_FALSE(flow_may_survive(ips, flow("203.0.113.7", 443), true, true));
  const Phase names = phase(Mode::allowlist, {"pypi.org"});
  CHECK(flow_may_survive(names, flow("203.0.113.7", 443), true, true));
}

// ---- destroy_flows against the kernel (kernel suite only: tests/meson.build
// selects the cases "as root" by name; each runs in a namespace of its own).

namespace {

// The loopback address of `family` with `port`, in `ss`; returns its length.
socklen_t loopback(int family, std::uint16_t port, sockaddr_storage& ss) {
  ss = sockaddr_storage{};
  if (family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a->sin_port = htons(port);
    return sizeof *a;
  }
  auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
  a->sin6_family = AF_INET6;
  a->sin6_addr = in6addr_loopback;
  a->sin6_port = htons(port);
  return sizeof *a;
}

// A TCP socket listening on the loopback address of `family`, any port.
int listener(int family) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_storage ss;
  const socklen_t len = loopback(family, 0, ss);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0 || ::listen(fd, 4) != 0) return -1;
  return fd;
}

// A UDP socket bound to the loopback address of `family`, any port; connected
// to `peer` (a port on the same address) when it is not 0.
int udp_socket(int family, std::uint16_t peer = 0) {
  const int fd = ::socket(family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_storage ss;
  socklen_t len = loopback(family, 0, ss);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) return -1;
  if (peer != 0) {
    len = loopback(family, peer, ss);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) return -1;
  }
  return fd;
}

std::uint16_t local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  return ntohs(ss.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&ss)->sin_port
                                       : reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
}

// Runs `body` on a thread of its own in a new, empty network namespace.
const auto keep_all = [](const FlowInfo&) { return true; };

// A socket's pending error (SO_ERROR): what an abort left on it; -1 when it
// cannot be read.
int so_error(int fd) {
  int err = 0;
  socklen_t elen = sizeof err;
  return ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) == 0 ? err : -1;
}

}  // namespace

TEST_CASE("TCP flows are listed unless egressd's own listeners are the namespace's only TCP sockets, as root") {
  if (!as_root()) return;
  in_new_netns([] {
    const int own = listener(AF_INET);
    REQUIRE_MESSAGE(own >= 0, std::strerror(errno));
    const std::vector<OwnSocket> ours{{AF_INET, false}};

    auto r = destroy_flows(keep_all, ours);
    REQUIRE(r.ok());
    CHECK(r->tcp_families == 0);
    // A listener egressd is not told is its own counts as the sandbox's.
    r = destroy_flows(keep_all, {});
    REQUIRE(r.ok());
    CHECK(r->tcp_families == 1);

    // A listener of the sandbox's makes its family listed.
    const int theirs = listener(AF_INET6);
    REQUIRE(theirs >= 0);
    r = destroy_flows(keep_all, ours);
    REQUIRE(r.ok());
    CHECK(r->tcp_families == 1);
    ::close(theirs);

    // A flow (to egressd's own listener, over loopback): both ends are
    // listed, and aborting them takes the namespace back to the shortcut.
    const int c = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    socklen_t len = sizeof to;
    REQUIRE(::getsockname(own, reinterpret_cast<sockaddr*>(&to), &len) == 0);
    REQUIRE(::connect(c, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
    const int a = ::accept4(own, nullptr, nullptr, SOCK_CLOEXEC);
    REQUIRE(a >= 0);
    int seen = 0, inbound = 0;
    r = destroy_flows(
        [&](const FlowInfo& f) {
          ++seen;
          inbound += f.inbound ? 1 : 0;
          return true;
        },
        ours);
    REQUIRE(r.ok());
    CHECK(r->tcp_families == 1);
    CHECK(seen == 2);
    CHECK(inbound == 1);
    r = destroy_flows([](const FlowInfo&) { return false; }, ours);
    REQUIRE(r.ok());
    CHECK(r->destroyed == 2);
    const int err = so_error(c);
    CHECK((err == ECONNABORTED || err == ECONNRESET));  // aborted, or reset by its aborted peer first
    r = destroy_flows(keep_all, ours);
    REQUIRE(r.ok());
    CHECK(r->tcp_families == 0);
    ::close(a);
    ::close(c);
    ::close(own);
  });
}

TEST_CASE("UDP sockets are listed unless egressd's own listeners are the namespace's only UDP sockets, as root") {
  if (!as_root()) return;
  in_new_netns([] {
    // The DNS proxy's listeners: UDP and TCP on both loopback addresses.
    std::vector<int> fds;
    std::vector<OwnSocket> ours;
    for (int family : {AF_INET, AF_INET6}) {
      const int u = udp_socket(family);
      const int l = listener(family);
      REQUIRE_MESSAGE((u >= 0 && l >= 0), std::strerror(errno));
      fds.insert(fds.end(), {u, l});
      ours.push_back({family, true});
      ours.push_back({family, false});
    }
    auto r = destroy_flows(keep_all, ours);
    REQUIRE(r.ok());
    CHECK(r->udp_families == 0);
    CHECK(r->tcp_families == 0);
    // Sockets egressd is not told are its own count as the sandbox's.
    r = destroy_flows(keep_all, {});
    REQUIRE(r.ok());
    CHECK(r->udp_families == 2);
    CHECK(r->tcp_families == 2);

    // A connected UDP socket of the sandbox's (to egressd's own, over loopback): its family
    // is listed, the flow is seen, and it is aborted when the phase does not keep it.
    const int c = udp_socket(AF_INET6, local_port(fds[2]));
    REQUIRE_MESSAGE(c >= 0, std::strerror(errno));
    int seen = 0;
    r = destroy_flows(
        [&](const FlowInfo& f) {
          seen += f.udp ? 1 : 0;
          return true;
        },
        ours);
    REQUIRE(r.ok());
    CHECK(r->udp_families == 1);
    CHECK(r->tcp_families == 0);
    CHECK(seen == 1);
    r = destroy_flows([](const FlowInfo&) { return false; }, ours);
    REQUIRE(r.ok());
    CHECK(r->destroyed == 1);
    const int err = so_error(c);
    CHECK(err == ECONNABORTED);
    // Aborted, it is disconnected and its port (any, at bind) released: nothing to list.
    r = destroy_flows(keep_all, ours);
    REQUIRE(r.ok());
    CHECK(r->udp_families == 0);
    ::close(c);
    // A bound, unconnected UDP socket of the sandbox's is counted too.
    const int b = udp_socket(AF_INET);
    REQUIRE(b >= 0);
    r = destroy_flows(keep_all, ours);
    REQUIRE(r.ok());
    CHECK(r->udp_families == 1);
    ::close(b);
    for (int fd : fds) ::close(fd);
  });
}

namespace {

// lo gets 198.51.100.1/24: the rest of that /24 is routed over lo, so a UDP
// socket connects to 198.51.100.2, a peer that is not a loopback address.
bool lo_v4(const char* addr) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ifreq ifr{};
  std::strcpy(ifr.ifr_name, "lo");
  auto* sin = reinterpret_cast<sockaddr_in*>(&ifr.ifr_addr);
  sin->sin_family = AF_INET;
  ::inet_pton(AF_INET, addr, &sin->sin_addr);
  bool ok = fd >= 0 && ::ioctl(fd, SIOCSIFADDR, &ifr) == 0;
  ::inet_pton(AF_INET, "255.255.255.0", &sin->sin_addr);
  ok = ok && ::ioctl(fd, SIOCSIFNETMASK, &ifr) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

// A UDP socket connected to 198.51.100.2:9, over lo (lo_v4 first): a flow
// no-network aborts, to a peer that is not a loopback address. -1 on failure.
int udp_flow_over_lo() {
  if (!lo_v4("198.51.100.1")) return -1;
  const int u = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_port = htons(9);
  ::inet_pton(AF_INET, "198.51.100.2", &peer.sin_addr);
  if (u < 0 || ::connect(u, reinterpret_cast<sockaddr*>(&peer), sizeof peer) != 0) return -1;
  return u;
}

// What a reaper reported for its job, waited for with a deadline.
struct ReaperReport {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Result<int>> got;

  FlowReaper::Report sink() {
    return [this](Result<int> n, std::uint64_t) {
      std::lock_guard<std::mutex> lock(mu);
      got = std::move(n);
      cv.notify_all();
    };
  }
  bool wait() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(5), [&] { return got.has_value(); });
  }
  // The job's report came, without an error, saying `aborted` sockets were.
  void expect(int aborted) {
    REQUIRE(wait());
    REQUIRE_MESSAGE(got->ok(), got->error().message);
    CHECK(**got == aborted);
  }
};

std::shared_ptr<const Phase> no_network() { return std::make_shared<const Phase>(Phase{"verifier", Mode::no_network, {}}); }

std::size_t threads_of_this_process() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

}  // namespace

TEST_CASE("a reaper works in its sandbox's namespace from wherever its first job comes, as root") {
  if (!as_root()) return;
  in_new_netns([] {
    const int u = udp_flow_over_lo();
    REQUIRE_MESSAGE(u >= 0, std::strerror(errno));
    UniqueFd sandbox(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    REQUIRE(sandbox.ok());

    // An agent's loop: a thread in a namespace of its own, where nothing is to be aborted.
    std::thread([&] {
      REQUIRE(::unshare(CLONE_NEWNET) == 0);
      ReaperReport report;
      const std::size_t before = threads_of_this_process();
      FlowReaper reaper(false, false, report.sink(), std::move(sandbox));
      // No job, no thread: a sandbox that stays in public costs none.
      CHECK(threads_of_this_process() == before);
      reaper.reap(no_network(), 1);
      report.expect(1);
    }).join();
    const int err = so_error(u);
    CHECK(err == ECONNABORTED);
    ::close(u);
  });
}

namespace {

// Takes CAP_SYS_ADMIN from the calling thread (capabilities are per thread),
// as a container runtime gives a sidecar none: setns needs it.
bool drop_sys_admin() {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2]{};
  if (::syscall(SYS_capget, &h, d) != 0) return false;
  const auto bit = 1u << (CAP_SYS_ADMIN % 32);
  d[CAP_SYS_ADMIN / 32].effective &= ~bit;
  d[CAP_SYS_ADMIN / 32].permitted &= ~bit;
  d[CAP_SYS_ADMIN / 32].inheritable &= ~bit;
  return ::syscall(SYS_capset, &h, d) == 0;
}

}  // namespace

TEST_CASE("a sidecar's reaper reaps without CAP_SYS_ADMIN, in the namespace it starts in, as root") {
  if (!as_root()) return;
  in_new_netns([] {
    const int u = udp_flow_over_lo();
    REQUIRE_MESSAGE(u >= 0, std::strerror(errno));
    // A sidecar in a container: in the namespace, with NET_ADMIN but not SYS_ADMIN.
    REQUIRE_MESSAGE(drop_sys_admin(), std::strerror(errno));
    REQUIRE(::unshare(CLONE_NEWNET) != 0);  // the capability is gone from this thread
    ReaperReport report;
    FlowReaper reaper(false, false, report.sink(), UniqueFd(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC)));
    reaper.reap(no_network(), 1);
    report.expect(1);
    ::close(u);
  });
}
