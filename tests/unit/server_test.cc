// Control server tests: real Unix sockets in a temporary directory, no root
// needed. The io_context runs in its own thread; the test thread talks to the
// server through blocking sockets with deadlines (never sleeps).
#include "control/server.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <latch>
#include <mutex>
#include <optional>
#include <spdlog/spdlog.h>
#include <thread>
#include <vector>

#include "control/client.h"
#include "control/protocol.h"

namespace asio = boost::asio;
namespace control = egressd::control;
namespace fs = std::filesystem;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

constexpr auto kDeadline = 10s;  // generous: only reached when something is broken

// Keep test output readable: warnings and errors only (set EGRESSD_TEST_LOG=1 for everything).
const bool quiet_logs = [] {
  if (getenv("EGRESSD_TEST_LOG") == nullptr) spdlog::set_level(spdlog::level::warn);
  return true;
}();

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "egressd-ctl-XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Replies {"ok":true,"cmd":...,"id":...} so tests can match replies to requests.
json echo(const json& req) { return control::ok_reply({{"cmd", req["cmd"]}, {"id", req.value("id", json())}}); }

void echo_handler(const json& req, control::Reply reply) { reply(echo(req)); }

// A server on its own io thread, in a fresh temp dir whose socket parent does not exist yet.
struct Harness {
  TempDir dir;
  std::string path = dir.path + "/run/egressd.sock";
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work = asio::make_work_guard(io);
  std::unique_ptr<control::Server> server;
  std::thread thread;

  // `let_me_in`: also allow the uid running the tests (root always is), so
  // the unit suite runs as any user.
  explicit Harness(control::Handler h = echo_handler, control::ServerOptions opts = {}, bool let_me_in = true) {
    opts.path = path;
    if (let_me_in && ::geteuid() != 0) opts.allowed_uids.insert(::geteuid());
    auto r = control::Server::listen(io, opts, std::move(h));
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.error().message));
    server = std::move(r.value());
    thread = std::thread([this] { io.run(); });
  }
  // Runs f on the io thread and waits for it: Server methods belong to that thread.
  template <class F>
  void on_loop(F f) {
    std::promise<void> done;
    asio::post(io, [&] {
      f();
      done.set_value();
    });
    REQUIRE(done.get_future().wait_for(kDeadline) == std::future_status::ready);
  }
  ~Harness() {
    on_loop([this] { server->close(); });
    work.reset();
    io.stop();
    thread.join();
    server.reset();
  }
};

// --- raw socket helpers, for what the blocking Client deliberately cannot do
// (half lines, pipelining, garbage bytes) ---

sockaddr_un addr_of(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  REQUIRE(path.size() < sizeof(a.sun_path));
  std::memcpy(a.sun_path, path.data(), path.size());
  return a;
}

struct Raw {
  int fd = -1;
  std::string buf;
  explicit Raw(const std::string& path) {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    const auto a = addr_of(path);
    REQUIRE(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0);
  }
  Raw(const Raw&) = delete;
  ~Raw() { close(); }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  void send(std::string_view s) {
    while (!s.empty()) {
      const ssize_t n = ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);
      REQUIRE(n > 0);
      s.remove_prefix(static_cast<std::size_t>(n));
    }
  }
  // The next line, or nullopt on EOF/error/deadline.
  std::optional<std::string> line(std::chrono::milliseconds timeout = kDeadline) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (auto nl = buf.find('\n'); nl != std::string::npos) {
        std::string l = buf.substr(0, nl);
        buf.erase(0, nl + 1);
        return l;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return std::nullopt;
      char chunk[4096];
      const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
      if (n <= 0) return std::nullopt;
      buf.append(chunk, static_cast<std::size_t>(n));
    }
  }
  json reply() {
    auto l = line();
    REQUIRE_MESSAGE(l.has_value(), "no reply line before the deadline");
    return json::parse(*l);
  }
  // True when the server closed the connection (EOF or reset) before the deadline.
  bool closed_by_peer() {
    const auto deadline = std::chrono::steady_clock::now() + kDeadline;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
      char chunk[4096];
      const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
      if (n <= 0) return true;
      buf.append(chunk, static_cast<std::size_t>(n));
    }
  }
};

std::string error_code(const json& r) {
  if (r.value("ok", true)) return "";
  return r["error"]["code"].get<std::string>();
}

// A request line of exactly `size` bytes (newline excluded).
std::string line_of_size(std::size_t size) {
  const std::string head = R"({"cmd":"ping","pad":")";
  const std::string tail = R"("})";
  REQUIRE(size >= head.size() + tail.size());
  return head + std::string(size - head.size() - tail.size(), 'x') + tail;
}

control::ServerOptions at(std::string path) {
  control::ServerOptions o;
  o.path = std::move(path);
  return o;
}

control::Client connect_ok(const std::string& path) {
  auto c = control::Client::connect(path);
  REQUIRE_MESSAGE(c.ok(), (c.ok() ? "" : c.error().message));
  return std::move(c.value());
}

json call_ok(control::Client& c, const json& req) {
  auto r = c.call(req, kDeadline);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.error().message));
  return r.value();
}

// Handler that parks "slow" requests until the test releases them.
struct Parking {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<json, control::Reply>> parked;
  std::atomic<int> calls{0};

  control::Handler handler() {
    return [this](const json& req, control::Reply reply) {
      ++calls;
      if (req["cmd"] == "slow") {
        std::lock_guard lk(mu);
        parked.emplace_back(req, std::move(reply));
        cv.notify_all();
        return;
      }
      reply(echo(req));
    };
  }
  bool wait_parked(std::size_t n) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, kDeadline, [&] { return parked.size() >= n; });
  }
  std::pair<json, control::Reply> take() {
    std::lock_guard lk(mu);
    auto p = std::move(parked.front());
    parked.erase(parked.begin());
    return p;
  }
};

}  // namespace

TEST_CASE("one reply per request, in order, \\r\\n tolerated, blank lines ignored") {
  Harness h;
  Raw r(h.path);
  r.send("{\"cmd\":\"a\",\"id\":1}\n{\"cmd\":\"b\",\"id\":2}\r\n\n  \r\n{\"cmd\":\"c\",\"id\":3}\n");
  for (int id = 1; id <= 3; ++id) {
    const json rep = r.reply();
    CHECK(rep["ok"] == true);
    CHECK(rep["id"] == id);
  }
  // The next reply answers the next request: nothing extra was queued.
  r.send("{\"cmd\":\"d\",\"id\":4}\n");
  CHECK(r.reply()["id"] == 4);
}

TEST_CASE("reply lines put \"ok\" first, then the other keys") {
  Harness h;
  Raw r(h.path);
  r.send("{\"cmd\":\"a\",\"id\":1}\n[]\n");
  CHECK(r.line() == R"({"ok":true,"cmd":"a","id":1})");
  CHECK(r.line() == R"({"ok":false,"error":{"code":"invalid_request","message":"request must be a JSON object, got array"}})");
}

TEST_CASE("25 concurrent clients are all answered") {
  Harness h;
  constexpr int kClients = 25, kCalls = 20;
  std::latch connected(kClients);
  std::vector<int> good(kClients, 0);
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      auto c = control::Client::connect(h.path);
      connected.count_down();
      if (!c) {
        errors[i] = c.error().message;
        return;
      }
      connected.wait();  // every client is connected before anyone talks
      for (int k = 0; k < kCalls; ++k) {
        auto rep = c->call({{"cmd", "ping"}, {"id", i * 1000 + k}}, kDeadline);
        if (!rep) {
          errors[i] = rep.error().message;
          return;
        }
        if ((*rep)["id"] == i * 1000 + k) ++good[i];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    CHECK_MESSAGE(errors[i].empty(), errors[i]);
    CHECK(good[i] == kCalls);
  }
}

TEST_CASE("a 3 MB line gets request_too_large once and the connection keeps working") {
  Harness h;
  auto c = connect_ok(h.path);
  const json big = {{"cmd", "apply"}, {"pad", std::string(3u << 20, 'x')}};
  const json rep = call_ok(c, big);
  CHECK(error_code(rep) == "request_too_large");
  // Exactly one error for the whole line: the next reply is the ping's.
  const json pong = call_ok(c, {{"cmd", "ping"}, {"id", 7}});
  CHECK(pong["ok"] == true);
  CHECK(pong["id"] == 7);
}

TEST_CASE("the size bound is exact: kMaxRequestBytes passes, one more byte does not") {
  Harness h;
  Raw r(h.path);
  r.send(line_of_size(control::kMaxRequestBytes) + "\n");
  CHECK(r.reply()["ok"] == true);
  r.send(line_of_size(control::kMaxRequestBytes) + "\r\n");
  CHECK(r.reply()["ok"] == true);
  r.send(line_of_size(control::kMaxRequestBytes + 1) + "\n");
  CHECK(error_code(r.reply()) == "request_too_large");
  r.send("{\"cmd\":\"ping\",\"id\":9}\n");
  CHECK(r.reply()["id"] == 9);
}

TEST_CASE("an oversized line is answered before its newline arrives") {
  Harness h;
  Raw r(h.path);
  r.send(std::string(control::kMaxRequestBytes + 100, 'x'));  // no newline yet
  CHECK(error_code(r.reply()) == "request_too_large");
  r.send(std::string(5000, 'y') + "\n{\"cmd\":\"ping\",\"id\":1}\n");
  CHECK(r.reply()["id"] == 1);
}

TEST_CASE("malformed requests get invalid_request and change nothing") {
  std::atomic<int> calls{0};
  Harness h([&](const json& req, control::Reply reply) {
    ++calls;
    reply(echo(req));
  });
  Raw r(h.path);
  struct Case {
    std::string line, needle;
  } cases[] = {
      {"hello there", "malformed JSON"},
      {"{\"cmd\":\"ping\"", "malformed JSON"},
      {"[1,2]", "JSON object, got array"},
      {"\"ping\"", "JSON object, got string"},
      {"{\"id\":1}", "no \"cmd\""},
      {"{\"cmd\":5}", "\"cmd\" must be a string, got number"},
      {std::string(1000, '[') + std::string(1000, ']'), "deeper than"},
      {"\xff\xfe{garbage", "malformed JSON"},
      // A key given twice: refused, not the last one taken (attack review 10).
      {"{\"cmd\":\"apply\",\"phase\":\"off\",\"phase\":\"open\"}", "duplicate key \"phase\""},
      {"{\"cmd\":\"status\",\"cmd\":\"apply\"}", "duplicate key \"cmd\""},
      {"{\"cmd\":\"apply\",\"sandbox\":\"one\",\"sandbox\":\"two\"}", "duplicate key \"sandbox\""},
      {"{\"cmd\":\"apply\",\"inline\":{\"a\":{\"mode\":\"no-network\",\"mode\":\"public\"}}}",
       "duplicate key \"mode\""},
  };
  for (const auto& tc : cases) {
    CAPTURE(tc.line);
    r.send(tc.line + "\n");
    auto l = r.line();
    REQUIRE(l.has_value());
    const json rep = json::parse(*l);  // must be valid JSON even when echoing invalid UTF-8
    CHECK(error_code(rep) == "invalid_request");
    CHECK(rep["error"]["message"].get<std::string>().find(tc.needle) != std::string::npos);
  }
  CHECK(calls == 0);
  r.send("{\"cmd\":\"ping\",\"id\":2}\n");
  CHECK(r.reply()["id"] == 2);
  // The same key in two objects, or at two depths, is no duplicate.
  r.send("{\"cmd\":\"ping\",\"id\":3,\"a\":{\"id\":1},\"b\":[{\"id\":2},{\"id\":3}]}\n");
  CHECK(r.reply()["id"] == 3);
}

TEST_CASE("half a line from one client does not block another") {
  Harness h;
  Raw stalled(h.path);
  stalled.send("{\"cmd\":\"ping\",\"id\":");
  Raw gone(h.path);
  gone.send("{\"cmd\":\"pi");
  gone.close();  // disconnects mid-request

  auto c = connect_ok(h.path);
  CHECK(call_ok(c, {{"cmd", "ping"}, {"id", 1}})["id"] == 1);

  stalled.send("5}\n");  // the stalled client finishes its line and is answered
  CHECK(stalled.reply()["id"] == 5);
  CHECK(call_ok(c, {{"cmd", "ping"}, {"id", 2}})["id"] == 2);
}

TEST_CASE("asynchronous replies keep request order; replying from another thread is safe") {
  Parking park;
  Harness h(park.handler());
  Raw r(h.path);
  r.send("{\"cmd\":\"slow\",\"id\":1}\n{\"cmd\":\"ping\",\"id\":2}\n");
  REQUIRE(park.wait_parked(1));
  // The ping is not even handed to the handler before the slow reply is issued.
  CHECK(park.calls == 1);

  // Meanwhile other clients are served.
  auto other = connect_ok(h.path);
  CHECK(call_ok(other, {{"cmd", "ping"}, {"id", 3}})["id"] == 3);

  auto [req, reply] = park.take();
  reply(echo(req));  // from the test thread, not the io thread
  reply(control::error_reply("internal", "second call is ignored"));
  CHECK(r.reply()["id"] == 1);
  CHECK(r.reply()["id"] == 2);
  r.send("{\"cmd\":\"ping\",\"id\":4}\n");
  CHECK(r.reply()["id"] == 4);
}

TEST_CASE("a reply after the client left, or after close, is harmless") {
  Parking park;
  Harness h(park.handler());
  {
    Raw r(h.path);
    r.send("{\"cmd\":\"slow\",\"id\":1}\n");
    REQUIRE(park.wait_parked(1));
  }
  auto [req, reply] = park.take();
  reply(echo(req));
  auto c = connect_ok(h.path);
  CHECK(call_ok(c, {{"cmd", "ping"}, {"id", 2}})["id"] == 2);

  Raw r2(h.path);
  r2.send("{\"cmd\":\"slow\",\"id\":3}\n");
  REQUIRE(park.wait_parked(1));
  h.on_loop([&] { h.server->close(); });
  CHECK(r2.closed_by_peer());
  auto [req2, reply2] = park.take();
  reply2(echo(req2));
}

TEST_CASE("handler faults still produce exactly one well-formed reply") {
  Harness h([](const json& req, control::Reply reply) {
    const std::string cmd = req["cmd"];
    if (cmd == "drop") return;  // never replies: the server answers for it
    if (cmd == "throw") throw std::runtime_error("boom");
    if (cmd == "array") return reply(json::array({1}));
    if (cmd == "noerr") return reply(json{{"ok", false}});
    if (cmd == "badutf8") return reply(control::error_reply("invalid_policy", "bad entry \"\xc3\x28\""));
    reply(echo(req));
  });
  auto c = connect_ok(h.path);
  for (const char* cmd : {"drop", "throw", "array", "noerr"}) {
    CAPTURE(cmd);
    CHECK(error_code(call_ok(c, {{"cmd", cmd}})) == "internal");
  }
  const json bad = call_ok(c, {{"cmd", "badutf8"}});
  CHECK(error_code(bad) == "invalid_policy");
  CHECK(call_ok(c, {{"cmd", "ping"}, {"id", 1}})["id"] == 1);
}

TEST_CASE("socket file is 0600, its missing parent is created 0755, close removes it") {
  Harness h;
  struct stat st {};
  REQUIRE(::lstat(h.path.c_str(), &st) == 0);
  CHECK(S_ISSOCK(st.st_mode));
  CHECK((st.st_mode & 07777) == 0600);
  REQUIRE(::stat(fs::path(h.path).parent_path().c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == (0755 & ~[] {
          const mode_t m = ::umask(0);
          ::umask(m);
          return m;
        }()));
  CHECK(h.server->socket_file_intact());
  h.on_loop([&] { h.server->close(); });
  CHECK(!fs::exists(fs::symlink_status(h.path)));
  CHECK(!h.server->socket_file_intact());
}

TEST_CASE("socket_file_intact notices a replaced file, and close leaves the replacement alone") {
  Harness h;
  REQUIRE(h.server->socket_file_intact());
  REQUIRE(::unlink(h.path.c_str()) == 0);
  CHECK(!h.server->socket_file_intact());
  std::ofstream(h.path) << "someone else's";
  CHECK(!h.server->socket_file_intact());
  h.on_loop([&] { h.server->close(); });
  CHECK(fs::is_regular_file(h.path));
}

TEST_CASE("a second listen on a live path fails and leaves the first server intact") {
  Harness h;
  asio::io_context io2;
  auto second = control::Server::listen(io2, at(h.path), echo_handler);
  REQUIRE(!second.ok());
  CHECK(second.error().kind == egressd::ErrorKind::runtime);
  CHECK(second.error().message == "another egressd is serving " + h.path);
  CHECK(h.server->socket_file_intact());
  auto c = connect_ok(h.path);
  CHECK(call_ok(c, {{"cmd", "ping"}, {"id", 1}})["id"] == 1);
}

TEST_CASE("a stale socket file is replaced; a non-socket file is refused untouched") {
  TempDir dir;
  const std::string path = dir.path + "/egressd.sock";
  {
    // What a crashed daemon leaves behind: a bound socket file nobody listens on.
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    const auto a = addr_of(path);
    REQUIRE(::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0);
    ::close(fd);
  }
  asio::io_context io;
  {
    auto s = control::Server::listen(io, at(path), echo_handler);
    REQUIRE_MESSAGE(s.ok(), (s.ok() ? "" : s.error().message));
    CHECK((*s)->socket_file_intact());
    auto c = connect_ok(path);  // the kernel queues it: bound and listening
  }
  CHECK(!fs::exists(fs::symlink_status(path)));

  const std::string file = dir.path + "/not-a-socket";
  std::ofstream(file) << "keep me";
  auto s = control::Server::listen(io, at(file), echo_handler);
  REQUIRE(!s.ok());
  CHECK(s.error().message.find(file) != std::string::npos);
  std::ifstream in(file);
  std::string content;
  std::getline(in, content);
  CHECK(content == "keep me");
}

TEST_CASE("listen rejects paths that are not filesystem socket paths") {
  asio::io_context io;
  auto empty = control::Server::listen(io, at(""), echo_handler);
  CHECK(!empty.ok());
  const std::string long_path = "/tmp/" + std::string(200, 'a');
  auto too_long = control::Server::listen(io, at(long_path), echo_handler);
  REQUIRE(!too_long.ok());
  CHECK(too_long.error().message.find(long_path) != std::string::npos);
}

TEST_CASE("client to a missing path gives a runtime error naming the path") {
  TempDir dir;
  const std::string path = dir.path + "/nobody-home.sock";
  auto c = control::Client::connect(path);
  REQUIRE(!c.ok());
  CHECK(c.error().kind == egressd::ErrorKind::runtime);
  CHECK(c.error().message == "cannot connect to " + path + ": No such file or directory");
}

TEST_CASE("client read_line times out with a deadline and the connection is not reused") {
  Parking park;
  Harness h(park.handler());
  auto c = connect_ok(h.path);
  auto r = c.call({{"cmd", "slow"}}, 50ms);
  REQUIRE(!r.ok());
  CHECK(r.error().message.find("timed out") != std::string::npos);
  auto again = c.call({{"cmd", "ping"}}, 50ms);
  CHECK(!again.ok());
  REQUIRE(park.wait_parked(1));
  auto [req, reply] = park.take();
  reply(echo(req));
}

TEST_CASE("connections beyond max_clients are closed at once; the others keep working") {
  control::ServerOptions two;
  two.max_clients = 2;
  Harness h(echo_handler, two);
  auto a = connect_ok(h.path);
  auto b = connect_ok(h.path);
  CHECK(call_ok(a, {{"cmd", "ping"}, {"id", 1}})["id"] == 1);
  CHECK(call_ok(b, {{"cmd", "ping"}, {"id", 2}})["id"] == 2);
  Raw extra(h.path);
  CHECK(extra.closed_by_peer());
  CHECK(call_ok(a, {{"cmd", "ping"}, {"id", 3}})["id"] == 3);

  // Once a slot frees up, a new client gets in (the server notices the hang-up asynchronously).
  { auto gone = std::move(b); }
  const auto deadline = std::chrono::steady_clock::now() + kDeadline;
  bool served = false;
  while (!served && std::chrono::steady_clock::now() < deadline) {
    auto c = connect_ok(h.path);
    auto rep = c.call({{"cmd", "ping"}, {"id", 4}}, kDeadline);
    served = rep.ok() && (*rep)["id"] == 4;
  }
  CHECK(served);
}

namespace {

// Connects as `uid` from a forked child (SO_PEERCRED records the uid at
// connect time) and returns the first reply line. Needs root to setuid.
// The child runs only async-signal-safe calls: the parent has other threads.
std::string ping_as(const std::string& path, uid_t uid) {
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  const sockaddr_un a = addr_of(path);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(pipefd[0]);
    if (::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(3);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) ::_exit(4);
    static const char req[] = "{\"cmd\":\"ping\"}\n";
    (void)!::send(fd, req, sizeof(req) - 1, MSG_NOSIGNAL);  // the server may already have hung up
    char buf[512];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof(buf))) > 0) {
      (void)!::write(pipefd[1], buf, static_cast<std::size_t>(n));
      if (::memchr(buf, '\n', static_cast<std::size_t>(n)) != nullptr) break;
    }
    ::_exit(0);
  }
  ::close(pipefd[1]);
  std::string out;
  char buf[512];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  if (auto nl = out.find('\n'); nl != std::string::npos) out.resize(nl);
  return out;
}

}  // namespace

// The uid rule as seen from the user running the tests (unit suite, any
// user); connections from other uids need root to setuid: the case after
// this one, run in the kernel suite.
TEST_CASE("peers are authenticated by SO_PEERCRED") {
  if (::geteuid() == 0) {
    control::ServerOptions opts;
    opts.allowed_uids = {65533};
    Harness h(echo_handler, opts);
    auto root = connect_ok(h.path);  // root is always let in
    CHECK(call_ok(root, {{"cmd", "ping"}})["ok"] == true);
  } else {
    {
      Harness h(echo_handler, {}, false);  // only root allowed
      auto c = connect_ok(h.path);
      CHECK(error_code(call_ok(c, {{"cmd", "ping"}})) == "unauthorized");
    }
    control::ServerOptions opts;
    opts.allowed_uids = {::geteuid()};
    Harness h(echo_handler, opts);
    auto c = connect_ok(h.path);
    CHECK(call_ok(c, {{"cmd", "ping"}})["ok"] == true);
  }
}

// Kernel suite only (tests/meson.build selects it by name): forks peers that
// setuid to other uids, which needs root.
TEST_CASE("peers are authenticated by SO_PEERCRED - other uids, as root") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: connecting as other uids needs root");
    return;
  }
  constexpr uid_t kNobody = 65534, kAllowed = 65533;
  control::ServerOptions opts;
  opts.allowed_uids = {kAllowed};
  Harness h(echo_handler, opts);
  // The socket is 0600 root-owned; open the directory and file so the check under test is the uid one.
  REQUIRE(::chmod(h.path.c_str(), 0666) == 0);
  REQUIRE(::chmod(fs::path(h.path).parent_path().c_str(), 0755) == 0);
  REQUIRE(::chmod(h.dir.path.c_str(), 0755) == 0);
  const json denied = json::parse(ping_as(h.path, kNobody));
  CHECK(error_code(denied) == "unauthorized");
  CHECK(denied["error"]["message"].get<std::string>().find("65534") != std::string::npos);
  CHECK(json::parse(ping_as(h.path, kAllowed))["ok"] == true);
  auto root = connect_ok(h.path);
  CHECK(call_ok(root, {{"cmd", "ping"}})["ok"] == true);
}

TEST_CASE("a number too large for a double gets invalid_request, and the connection goes on") {
  // Found by tests/fuzz/control_server_fuzz: nlohmann reports "1e400" as an
  // out_of_range (406), not a parse_error; it escaped the session, which
  // closed without a reply and dropped the pipelined request after it.
  std::atomic<int> calls{0};
  Harness h([&](const json& req, control::Reply reply) {
    ++calls;
    reply(echo(req));
  });
  Raw r(h.path);
  r.send("{\"cmd\":\"ping\",\"x\":1e400}\n{\"cmd\":\"ping\",\"id\":3}\n");
  const json bad = r.reply();
  CHECK(error_code(bad) == "invalid_request");
  CHECK(bad["error"]["message"].get<std::string>().find("number overflow") != std::string::npos);
  CHECK(r.reply()["id"] == 3);
  CHECK(calls == 1);
}

// --- the socket file under the server's feet (ServerOptions::watch_interval) ---

// True when a fresh connection to `path` gets a reply line from a server (ours:
// the only one here that answers) before the deadline. Polls: the check runs
// on the server's timer.
bool answers_within(const std::string& path, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    const auto a = addr_of(path);
    bool ok = false;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0 &&
        ::send(fd, "{\"cmd\":\"ping\"}\n", 15, MSG_NOSIGNAL) == 15) {
      pollfd p{fd, POLLIN, 0};
      char c = 0;
      ok = ::poll(&p, 1, 200) == 1 && ::recv(fd, &c, 1, 0) == 1 && c == '{';
    }
    ::close(fd);
    if (ok) return true;
    std::this_thread::sleep_for(20ms);  // the next attempt, not a synchronisation
  }
  return false;
}

control::ServerOptions watched() {
  control::ServerOptions o;
  o.watch_interval = 50ms;
  return o;
}

TEST_CASE("a deleted socket file is bound again, mode 0600; open connections keep working") {
  Harness h(echo_handler, watched());
  Raw before(h.path);
  REQUIRE(::unlink(h.path.c_str()) == 0);
  CHECK(answers_within(h.path, kDeadline));
  struct stat st {};
  REQUIRE(::lstat(h.path.c_str(), &st) == 0);
  CHECK(S_ISSOCK(st.st_mode));
  CHECK((st.st_mode & 07777) == 0600);
  bool intact = false;
  h.on_loop([&] { intact = h.server->socket_file_intact(); });
  CHECK(intact);
  before.send("{\"cmd\":\"ping\",\"id\":1}\n");
  CHECK(before.reply()["id"] == 1);
}

TEST_CASE("another socket put at the path is replaced by ours") {
  Harness h(echo_handler, watched());
  REQUIRE(::unlink(h.path.c_str()) == 0);
  // A listener that accepts and never answers: an impostor.
  const int other = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(other >= 0);
  const auto a = addr_of(h.path);
  // The server may have re-created the file already: then take it over the same way.
  bool bound = false;
  for (int i = 0; i < 100 && !bound; ++i) {
    bound = ::bind(other, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0;
    if (!bound) {
      REQUIRE(errno == EADDRINUSE);
      ::unlink(h.path.c_str());
    }
  }
  REQUIRE(bound);
  REQUIRE(::listen(other, 8) == 0);
  CHECK(answers_within(h.path, kDeadline));
  bool intact = false;
  h.on_loop([&] { intact = h.server->socket_file_intact(); });
  CHECK(intact);
  ::close(other);
}

TEST_CASE("a regular file put at the path is left alone; once it is gone the socket comes back") {
  Harness h(echo_handler, watched());
  REQUIRE(::unlink(h.path.c_str()) == 0);
  // Same race as above: the server may have bound again in between.
  for (int i = 0; i < 100; ++i) {
    const int fd = ::open(h.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      REQUIRE(::write(fd, "keep me\n", 8) == 8);
      ::close(fd);
      break;
    }
    REQUIRE(errno == EEXIST);
    ::unlink(h.path.c_str());
  }
  // For 10 watch intervals, after each turn of the server's loop, the file
  // must still be a regular file: the check runs and leaves it alone.
  struct stat st {};
  for (const auto until = std::chrono::steady_clock::now() + 500ms; std::chrono::steady_clock::now() < until;) {
    h.on_loop([] {});
    REQUIRE(::lstat(h.path.c_str(), &st) == 0);
    REQUIRE(S_ISREG(st.st_mode));
  }
  std::ifstream in(h.path);
  std::string content;
  std::getline(in, content);
  CHECK(content == "keep me");
  REQUIRE(::unlink(h.path.c_str()) == 0);
  CHECK(answers_within(h.path, kDeadline));
}
