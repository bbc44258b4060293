// libFuzzer target for the control socket's framing (src/control/server.cc):
// a real Server on a Unix socket in a temp directory, driven on this thread,
// with the daemon's real handler (Sandbox::handle over a fake kernel, see
// control_request_fuzz.cc). The framing is internal to the server, so it is
// fuzzed through the socket: the input is written to one client connection
// in chunks and the replies are read back.
//
// Input: the first byte chooses the write size (1-128 bytes per write, so
// lines are split across reads at every position; 0 = one write) and bit 7
// of it makes the client hang up right after writing (a client that leaves
// mid-request); the rest is the byte stream.
//
// Properties checked:
//  - every complete line that is not blank gets exactly one reply, in order;
//    blank lines and a final unterminated line get none (inputs are far below
//    the 1 MiB line limit, which the unit and integration tests cover);
//  - every reply is one line of valid JSON starting with {"ok":true or
//    {"ok":false,"error":{"code":...
//  - after the client leaves (also abruptly), the server still answers a new
//    connection and holds no more file descriptors than before.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <spdlog/spdlog.h>
#include <string>
#include <string_view>

#include "control/server.h"
#include "daemon/sandbox.h"
#include "support/fake_kernel.h"
#include "fuzz_check.h"

using namespace egressd;
using nlohmann::json;

namespace {

// Generous: a healthy exchange of a 4 KiB input takes well under a millisecond.
constexpr auto kDeadline = std::chrono::seconds(10);

Policy policy() {
  Policy p;
  for (auto [name, mode, entries] :
       {std::tuple<const char*, Mode, std::vector<std::string>>{"environment", Mode::public_, {}},
        {"agent", Mode::allowlist, {"pypi.org", "192.0.2.0/24"}},
        {"verifier", Mode::no_network, {}}}) {
    auto ph = make_inline_phase(name, mode, entries);
    FUZZ_CHECK(ph.ok());
    p.phases.push_back(*ph);
  }
  p.initial_phase = "environment";
  return p;
}

struct World {
  boost::asio::io_context io;
  std::unique_ptr<daemon::Sandbox> sandbox;
  std::unique_ptr<control::Server> server;
  std::string dir, path;

  World() {
    char tmpl[] = "/tmp/egressd-fuzz-ctl-XXXXXX";
    FUZZ_CHECK(::mkdtemp(tmpl) != nullptr);
    dir = tmpl;
    path = dir + "/ctl.sock";
    reset_sandbox();
    control::ServerOptions o;
    o.path = path;
    auto s = control::Server::listen(io, o, [this](const json& req, control::Reply reply) {
      sandbox->handle(req, std::move(reply));
    });
    FUZZ_CHECK(s.ok());
    server = std::move(*s);
  }
  ~World() {
    server.reset();
    ::rmdir(dir.c_str());
  }
  void reset_sandbox() {
    daemon::SandboxOptions so;
    so.policy = policy();
    sandbox = std::make_unique<daemon::Sandbox>(std::move(so), std::make_unique<testing::FakeKernel>(),
                                                daemon::Capabilities{true, true, true, true, true, true, true, true});
    FUZZ_CHECK(sandbox->start("environment").ok());
  }
};

World& world() {
  // Lives for the process; at exit only its socket file and directory are
  // removed (tearing down asio and spdlog in static destruction order is not
  // worth it for a fuzzer).
  static World* w = [] {
    auto* made = new World();
    std::atexit([] {
      ::unlink(world().path.c_str());
      ::rmdir(world().dir.c_str());
    });
    return made;
  }();
  return *w;
}

int count_fds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

int connect_client(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  FUZZ_CHECK(fd >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  FUZZ_CHECK(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

// Writes `out` (in writes of `chunk` bytes), then half-closes, and collects
// everything the server sends until it closes its side. Returns the bytes read.
std::string exchange(World& w, int fd, std::string_view out, std::size_t chunk, bool hang_up) {
  std::string in;
  std::size_t sent = 0;
  bool wr_closed = false;
  const auto deadline = std::chrono::steady_clock::now() + kDeadline;
  for (;;) {
    FUZZ_CHECK(std::chrono::steady_clock::now() < deadline);  // the server stopped answering
    if (sent < out.size()) {
      const std::size_t n = std::min(chunk, out.size() - sent);
      const ssize_t k = ::send(fd, out.data() + sent, n, MSG_NOSIGNAL);
      if (k > 0) sent += static_cast<std::size_t>(k);
    } else if (!wr_closed) {
      if (hang_up) {
        ::close(fd);
        return in;
      }
      ::shutdown(fd, SHUT_WR);
      wr_closed = true;
    }
    // Unix socket writes are visible to the peer at once: polling (never
    // blocking) runs everything the server can do with what was sent.
    w.io.poll();
    w.io.restart();
    char buf[65536];
    for (;;) {
      const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
      if (k > 0) {
        in.append(buf, static_cast<std::size_t>(k));
        continue;
      }
      if (k == 0) {
        ::close(fd);
        return in;  // the server closed after our EOF
      }
      break;  // EAGAIN
    }
  }
}

// The replies the framing promises for `stream` (docs/protocol.md, Framing).
std::size_t expected_replies(std::string_view stream) {
  std::size_t n = 0, start = 0;
  for (;;) {
    const std::size_t nl = stream.find('\n', start);
    if (nl == std::string_view::npos) return n;  // a final half line is dropped at EOF
    std::string_view line = stream.substr(start, nl - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") != std::string_view::npos) ++n;
    start = nl + 1;
  }
}

void check_replies(std::string_view in, std::size_t expected) {
  std::size_t n = 0, start = 0;
  while (start < in.size()) {
    const std::size_t nl = in.find('\n', start);
    FUZZ_CHECK(nl != std::string_view::npos);  // every reply is a whole line
    const std::string_view line = in.substr(start, nl - start);
    FUZZ_CHECK(line.rfind("{\"ok\":true", 0) == 0 || line.rfind("{\"ok\":false,\"error\":{\"code\":", 0) == 0);
    FUZZ_CHECK(json::accept(line));
    ++n;
    start = nl + 1;
  }
  FUZZ_CHECK(n == expected);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  World& w = world();
  static const int baseline_fds = count_fds();
  w.reset_sandbox();
  const std::size_t chunk = (data[0] & 0x7f) == 0 ? size : (data[0] & 0x7f);
  const bool hang_up = (data[0] & 0x80) != 0;
  const std::string_view stream(reinterpret_cast<const char*>(data) + 1, size - 1);

  const std::string in = exchange(w, connect_client(w.path), stream, chunk, hang_up);
  if (!hang_up) check_replies(in, expected_replies(stream));

  // Whatever the previous client did, the next one is served.
  const std::string pong = exchange(w, connect_client(w.path), "{\"cmd\":\"ping\"}\n", 64, false);
  FUZZ_CHECK(pong == "{\"ok\":true}\n");
  // A few fds of slack: epoll/eventfd internals may come and go, a leak grows.
  FUZZ_CHECK(count_fds() <= baseline_fds + 4);
  return 0;
}
