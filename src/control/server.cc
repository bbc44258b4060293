// The control socket (DESIGN §3 "Control protocol"): a Unix stream socket,
// one request per line, one reply per request.
//
// Over 500 lines because the socket file is part of the security boundary and
// is kept whole here: binding with the right owner and mode, refusing to clear
// anything that is not a stale socket, peer credentials checked per
// connection, limits on line length and connections, and the watch that
// re-creates the file when someone removes or replaces it. Splitting the file
// handling from the sessions would split one invariant across two files.
#include "control/server.h"
#include "egressd/module_logger.h"
#include "egressd/unique_fd.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <spdlog/spdlog.h>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "control/protocol.h"

namespace egressd::control {
namespace {

namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;
using stream = asio::local::stream_protocol;
using Json = nlohmann::json;

// Requests are small flat objects; a cap on nesting keeps a 1 MiB "[[[[..."
// from reaching a handler that might dump() it recursively.
constexpr int kMaxRequestDepth = 64;
// Read granularity, per connection. Unrelated to kMaxRequestBytes (a line is
// assembled across reads); kept small because 128 idle clients each hold one.
constexpr std::size_t kReadChunk = 16 * 1024;
// Pause after a failed accept (EMFILE, ENOBUFS) so a persistent failure does not spin the loop.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

std::shared_ptr<spdlog::logger> control_logger() { return module_logger("control"); }

Result<sockaddr_un> make_addr(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // An empty path or a leading NUL would make an abstract socket, which every
  // process in the network namespace (the sandbox included) could reach.
  if (path.empty() || path.find('\0') != std::string::npos)
    return Error::invalid("control socket path must be a non-empty filesystem path");
  if (path.size() >= sizeof(addr.sun_path))
    return Error::invalid("control socket path is too long (" + std::to_string(path.size()) + " bytes, limit " +
                          std::to_string(sizeof(addr.sun_path) - 1) + "): " + path);
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

// What is at a control socket's path.
enum class AtPath { nothing, stale_socket, live_server, not_a_socket };

Result<AtPath> at_path(const std::string& path, const sockaddr_un& addr) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return AtPath::nothing;
    return errno_error("cannot stat control socket " + path, errno);
  }
  if (!S_ISSOCK(st.st_mode)) return AtPath::not_a_socket;
  UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe.ok()) return errno_error("cannot create probe socket for " + path, errno);
  if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0 || errno == EAGAIN ||
      errno == EINPROGRESS)
    // EAGAIN: a listener exists but its backlog is full; it is alive all the same.
    return AtPath::live_server;
  if (errno != ECONNREFUSED && errno != ENOENT)
    return errno_error("cannot probe existing control socket " + path, errno);
  return AtPath::stale_socket;
}

std::string not_a_socket_text(const std::string& path) {
  return "control socket path " + path + " exists and is not a socket; not replacing it";
}

// Decides what to do with an existing path: fail if a live server answers,
// unlink it if it is a stale socket, refuse to touch anything that is not a socket.
Status clear_stale(const std::string& path, const sockaddr_un& addr) {
  auto at = at_path(path, addr);
  if (!at) return at.error();
  switch (*at) {
    case AtPath::nothing:
      return Status::success();
    case AtPath::not_a_socket:
      return Error::runtime(not_a_socket_text(path));
    case AtPath::live_server:
      return Error::runtime("another egressd is serving " + path);
    case AtPath::stale_socket:
      break;
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    return errno_error("cannot remove stale control socket " + path, errno);
  return Status::success();
}

Status ensure_parent_dir(const std::string& path) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) return Status::success();
  std::error_code ec;
  if (std::filesystem::is_directory(parent, ec)) return Status::success();
  // Only created when missing; an existing directory keeps the mode its owner chose.
  std::filesystem::create_directories(parent, ec);
  if (ec) return Error::runtime("cannot create directory " + parent.string() + " for control socket: " + ec.message());
  std::filesystem::permissions(parent, std::filesystem::perms(0755), ec);
  if (ec) return Error::runtime("cannot set mode 0755 on " + parent.string() + ": " + ec.message());
  return Status::success();
}

// How a new socket takes its path: beside a path that must be free (start-up),
// or over whatever socket is there now (the socket-file check puts ours back).
enum class Publish { if_free, over };

// Binds, sets the mode (and owner) and listens on `at`; no other path is touched.
Result<UniqueFd> listening_socket(const std::string& at, std::optional<uid_t> owner) {
  auto addr = make_addr(at);
  if (!addr) return addr.error();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.ok()) return errno_error("cannot create control socket " + at, errno);
  // Linux creates the socket file with (socket inode mode & ~umask): setting the
  // inode mode first makes the file 0600 from its first instant, whatever the
  // umask. The restrictive umask around bind() is a second guard (it is
  // process-wide, but only ever narrows what another thread creates meanwhile).
  if (::fchmod(fd.get(), 0600) != 0) return errno_error("cannot set mode on control socket " + at, errno);
  const mode_t old_mask = ::umask(0177);
  const int rc = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr));
  const int bind_errno = errno;
  ::umask(old_mask);
  if (rc != 0) {
    if (bind_errno == EADDRINUSE) return Error::runtime("another egressd is serving " + at);
    return errno_error("cannot bind control socket " + at, bind_errno);
  }
  auto undo = [&](const std::string& what, int err) {
    ::unlink(at.c_str());
    return errno_error(what, err);
  };
  if (::chmod(at.c_str(), 0600) != 0) return undo("cannot set mode 0600 on control socket " + at, errno);
  // A non-root orchestrator needs write permission on the file to connect at
  // all; the mode stays 0600, so it is the owner and nobody else.
  if (owner && ::chown(at.c_str(), *owner, static_cast<gid_t>(-1)) != 0)
    return undo("cannot give control socket " + at + " to uid " + std::to_string(*owner), errno);
  if (::listen(fd.get(), SOMAXCONN) != 0) return undo("cannot listen on control socket " + at, errno);
  return fd;
}

// Moves the socket file `from` to `to`; with Publish::if_free only while `to`
// does not exist (a second egressd racing for the path loses here).
int publish(const std::string& from, const std::string& to, Publish how) {
  if (how == Publish::over) return ::rename(from.c_str(), to.c_str());
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return 0;
  if (errno != EINVAL && errno != ENOSYS) return -1;
  // A filesystem without RENAME_NOREPLACE: link() refuses an existing name too.
  if (::link(from.c_str(), to.c_str()) != 0) return -1;
  ::unlink(from.c_str());
  return 0;
}

// Returns a listening, close-on-exec socket at `path` with mode 0600. The file
// appears at `path` only once the socket listens: it is bound beside the path
// and renamed onto it, so an orchestrator that waits for the file and connects
// at once is never refused. A path too long for the suffix is bound in place.
Result<UniqueFd> bind_socket(const std::string& path, std::optional<uid_t> owner, Publish how) {
  auto addr = make_addr(path);
  if (!addr) return addr.error();
  if (auto st = ensure_parent_dir(path); !st) return st.error();
  if (how == Publish::if_free) {
    if (auto st = clear_stale(path, *addr); !st) return st.error();
  }
  const std::string beside = path + ".new-" + std::to_string(::getpid());
  if (!make_addr(beside)) {
    if (how == Publish::over && ::unlink(path.c_str()) != 0 && errno != ENOENT)
      return errno_error("cannot remove the socket at " + path, errno);
    return listening_socket(path, owner);
  }
  // One left behind by a killed egressd with this pid; never anything but a socket.
  if (struct stat s {}; ::lstat(beside.c_str(), &s) == 0 && S_ISSOCK(s.st_mode)) ::unlink(beside.c_str());
  auto fd = listening_socket(beside, owner);
  if (!fd) return fd.error();
  if (publish(beside, path, how) != 0) {
    const int err = errno;
    ::unlink(beside.c_str());
    if (err == EEXIST) return Error::runtime("another egressd is serving " + path);
    return errno_error("cannot put control socket in place at " + path, err);
  }
  return fd;
}

struct Conn {
  Conn(stream::socket s, std::uint64_t i) : sock(std::move(s)), reply_ready(sock.get_executor()), id(i) {
    reply_ready.expires_at(asio::steady_timer::time_point::max());
  }
  // Runs on the io thread. Ignores replies for a request that is no longer current.
  void deliver(std::uint64_t for_seq, Json reply) {
    if (closed || for_seq != seq || pending) return;
    pending = std::move(reply);
    reply_ready.cancel();
  }
  void close() {
    closed = true;
    boost::system::error_code ec;
    sock.shutdown(stream::socket::shutdown_both, ec);
    sock.close(ec);
    reply_ready.cancel();
  }

  stream::socket sock;
  // An event, not a timeout: it never expires; deliver()/close() cancel the wait.
  asio::steady_timer reply_ready;
  std::optional<Json> pending;
  std::uint64_t seq = 0;  // request counter; a Reply carries the seq it answers
  std::uint64_t id;
  bool closed = false;
  uid_t uid = static_cast<uid_t>(-1);
  pid_t pid = 0;
  std::array<char, kReadChunk> buf{};
};

// Shared by the Reply copies a handler holds. Delivers at most once; if every
// copy is dropped without a call, the client still gets an answer instead of
// a connection that hangs forever.
struct ReplyState {
  std::weak_ptr<Conn> conn;
  std::uint64_t seq;
  std::atomic<bool> done{false};

  ReplyState(std::weak_ptr<Conn> c, std::uint64_t s) : conn(std::move(c)), seq(s) {}
  ReplyState(const ReplyState&) = delete;
  ReplyState& operator=(const ReplyState&) = delete;
  ~ReplyState() { fire(error_reply("internal", "the request handler dropped the request without replying")); }

  void fire(Json reply) {
    if (done.exchange(true)) return;
    auto c = conn.lock();
    if (!c) return;  // client gone, or server closed: nothing to answer
    // dispatch: inline on the io thread, posted from any other thread.
    asio::dispatch(c->sock.get_executor(),
                   [c, s = seq, r = std::move(reply)]() mutable { c->deliver(s, std::move(r)); });
  }
};

struct State {
  State(asio::io_context& io, ServerOptions o, Handler h)
      : acceptor(io), watch_timer(io), opts(std::move(o)), handler(std::move(h)), log(control_logger()) {}

  stream::acceptor acceptor;
  asio::steady_timer watch_timer;  // socket-file check (ServerOptions::watch_interval)
  ServerOptions opts;
  Handler handler;
  std::shared_ptr<spdlog::logger> log;
  std::set<std::shared_ptr<Conn>> conns;
  std::uint64_t next_id = 1;
  bool closed = false;
  dev_t dev = 0;
  ino_t ino = 0;
  std::optional<uid_t> owner;  // who the socket file is given to (see Server::listen)
  // Bumped each time the socket is bound again; an accept loop of an older
  // listener ends instead of accepting on the new one.
  std::uint64_t listen_gen = 0;
  std::string watch_problem;  // the last problem logged by the socket-file check

  bool authorized(uid_t uid) const { return uid == 0 || opts.allowed_uids.count(uid) > 0; }
};

// Reasons a request line is not a request; empty when it is one.
std::optional<Json> check_request(std::string_view line, Json& out) {
  struct TooDeep {};
  struct Duplicate {
    std::string key;
  };
  // The keys of each object open at the moment. A key given twice would
  // otherwise be taken silently, the last one winning: {"cmd":"apply",
  // "phase":"off","phase":"open"} installed public, and a request naming
  // "sandbox" twice switched the second sandbox (attack review 10). A
  // policy file refuses duplicate keys for the same reason.
  std::vector<std::set<std::string>> keys;
  try {
    out = Json::parse(line, [&keys](int depth, Json::parse_event_t ev, Json& parsed) {
      if (depth > kMaxRequestDepth) throw TooDeep{};
      switch (ev) {
        case Json::parse_event_t::object_start:
          keys.emplace_back();
          break;
        case Json::parse_event_t::object_end:
          if (!keys.empty()) keys.pop_back();
          break;
        case Json::parse_event_t::key:
          if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second) {
            throw Duplicate{parsed.get<std::string>()};
          }
          break;
        default:
          break;
      }
      return true;
    });
  } catch (const Duplicate& d) {
    return error_reply("invalid_request",
                       "duplicate key " + Json(d.key).dump(-1, ' ', false, Json::error_handler_t::replace) +
                           " in the request: which one was meant is unclear, so neither is taken");
  } catch (const Json::exception& e) {
    // Not only parse_error: a number too large for a double ("1e400") is an
    // out_of_range (406) thrown from the same parse, and an exception that
    // escapes here ends the session without a reply.
    return error_reply("invalid_request", std::string("malformed JSON: ") + e.what());
  } catch (const TooDeep&) {
    return error_reply("invalid_request",
                       "request nests deeper than " + std::to_string(kMaxRequestDepth) + " levels");
  }
  if (auto err = check_envelope(out)) return Json(*err);
  return std::nullopt;
}

// Replies must keep the protocol's shape whatever a handler produced:
// {"ok":true,...} or {"ok":false,"error":{"code":string,"message":string}}.
Json checked_reply(Json reply, State& st, const Conn& c) {
  if (reply.is_object()) {
    auto ok = reply.find("ok");
    if (ok != reply.end() && ok->is_boolean()) {
      if (ok->get<bool>()) return reply;
      auto err = reply.find("error");
      if (err != reply.end() && err->is_object() && err->contains("code") && (*err)["code"].is_string()) {
        if (!err->contains("message") || !(*err)["message"].is_string()) (*err)["message"] = "";
        return reply;
      }
    }
  }
  st.log->error("bad handler reply conn={} peer_uid={} reply={}", c.id, c.uid,
                reply.dump(-1, ' ', false, Json::error_handler_t::replace).substr(0, 200));
  return error_reply("internal", "the request handler produced a malformed reply");
}

awaitable<bool> write_line(Conn& c, const Json& reply) {
  const std::string out = reply_line(reply);
  boost::system::error_code ec;
  co_await asio::async_write(c.sock, asio::buffer(out), asio::redirect_error(use_awaitable, ec));
  co_return !ec;
}

// Runs one request to its reply. Returns false when the connection is gone.
awaitable<bool> serve_line(std::shared_ptr<State> st, std::shared_ptr<Conn> c, std::string_view line) {
  const auto started = std::chrono::steady_clock::now();
  Json request;
  std::string cmd = "-";
  Json reply;
  if (auto bad = check_request(line, request)) {
    reply = std::move(*bad);
  } else {
    cmd = request["cmd"].get<std::string>();
    const std::uint64_t seq = ++c->seq;
    c->pending.reset();
    auto state = std::make_shared<ReplyState>(c, seq);
    try {
      st->handler(request, [state](Json r) { state->fire(std::move(r)); });
    } catch (const std::exception& e) {
      st->log->error("handler threw conn={} peer_uid={} cmd={} what={}", c->id, c->uid, cmd, e.what());
      state->fire(error_reply("internal", std::string("request handler failed: ") + e.what()));
    } catch (...) {
      state->fire(error_reply("internal", "request handler failed"));
    }
    state.reset();  // the handler holds its own copies; ours must not keep the fallback alive
    // The next request is read only after this one's reply went out: replies stay in order.
    while (!c->pending && !c->closed) {
      boost::system::error_code ec;
      c->reply_ready.expires_at(asio::steady_timer::time_point::max());
      co_await c->reply_ready.async_wait(asio::redirect_error(use_awaitable, ec));
    }
    if (c->closed) co_return false;
    reply = checked_reply(std::move(*c->pending), *st, *c);
    c->pending.reset();
  }
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started);
  const bool ok = reply.value("ok", false);
  if (ok) {
    st->log->debug("request conn={} peer_uid={} cmd={} ok=true duration_us={}", c->id, c->uid, cmd, us.count());
  } else {
    st->log->info("request conn={} peer_uid={} cmd={} ok=false code={} duration_us={}", c->id, c->uid, cmd,
                  reply["error"]["code"].get<std::string>(), us.count());
  }
  co_return co_await write_line(*c, reply);
}

awaitable<void> session(std::shared_ptr<State> st, std::shared_ptr<Conn> c) {
  struct Cleanup {
    State& st;
    const std::shared_ptr<Conn>& c;
    ~Cleanup() {
      c->close();
      st.conns.erase(c);
      st.log->debug("closed conn={} peer_uid={} clients={}", c->id, c->uid, st.conns.size());
    }
  } cleanup{*st, c};

  if (!st->authorized(c->uid)) {
    st->log->warn("rejected conn={} peer_uid={} peer_pid={} reason=unauthorized", c->id, c->uid, c->pid);
    co_await write_line(*c, error_reply("unauthorized", "uid " + std::to_string(c->uid) +
                                                            " may not use this control socket"));
    co_return;
  }

  std::string line;        // the current request line, without its newline
  bool discarding = false; // inside an oversized line, dropping bytes until its newline
  // One extra byte so a '\r' before the newline does not count against the limit.
  const std::size_t cap = kMaxRequestBytes + 1;
  for (;;) {
    boost::system::error_code ec;
    const std::size_t n =
        co_await c->sock.async_read_some(asio::buffer(c->buf), asio::redirect_error(use_awaitable, ec));
    if (ec || c->closed) co_return;  // EOF, reset or close(): a half line is simply dropped
    std::string_view data(c->buf.data(), n);
    while (!data.empty()) {
      const auto nl = data.find('\n');
      const std::string_view seg = data.substr(0, nl);
      data = nl == std::string_view::npos ? std::string_view{} : data.substr(nl + 1);
      if (discarding) {
        if (nl != std::string_view::npos) discarding = false;
        continue;
      }
      if (line.size() + seg.size() > cap) {
        // Answer as soon as the limit is crossed, not at the newline, so a
        // client that waits for a reply before sending more is not stuck.
        st->log->info("request conn={} peer_uid={} ok=false code=request_too_large", c->id, c->uid);
        line.clear();
        line.shrink_to_fit();
        discarding = nl == std::string_view::npos;
        if (!co_await write_line(*c, error_reply("request_too_large",
                                                 "request line exceeds " + std::to_string(kMaxRequestBytes) +
                                                     " bytes; discarded")))
          co_return;
        continue;
      }
      line.append(seg);
      if (nl == std::string_view::npos) break;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.size() > kMaxRequestBytes) {
        line.clear();
        if (!co_await write_line(*c, error_reply("request_too_large", "request line exceeds " +
                                                                          std::to_string(kMaxRequestBytes) +
                                                                          " bytes; discarded")))
          co_return;
        continue;
      }
      // Blank lines (an extra Enter in socat) are not requests and get no reply.
      if (line.find_first_not_of(" \t") != std::string::npos) {
        if (!co_await serve_line(st, c, line)) co_return;
      }
      line.clear();
      // Do not let one big request pin a MiB per idle connection.
      if (line.capacity() > kReadChunk) std::string().swap(line);
    }
  }
}

awaitable<void> accept_loop(std::shared_ptr<State> st, std::uint64_t gen) {
  asio::steady_timer backoff(st->acceptor.get_executor());
  while (!st->closed && st->listen_gen == gen) {
    boost::system::error_code ec;
    stream::socket sock = co_await st->acceptor.async_accept(asio::redirect_error(use_awaitable, ec));
    if (st->closed) co_return;
    if (ec && st->listen_gen != gen) co_return;  // our listener was replaced by a new one
    if (ec) {
      if (ec == asio::error::operation_aborted) co_return;
      st->log->warn("accept failed path={} error={}", st->opts.path, ec.message());
      backoff.expires_after(kAcceptBackoff);
      co_await backoff.async_wait(asio::redirect_error(use_awaitable, ec));
      continue;
    }
    ::fcntl(sock.native_handle(), F_SETFD, FD_CLOEXEC);  // asio accepts without SOCK_CLOEXEC
    const std::uint64_t id = st->next_id++;
    if (st->conns.size() >= st->opts.max_clients) {
      st->log->warn("rejected conn={} reason=max_clients max_clients={}", id, st->opts.max_clients);
      sock.close(ec);
      continue;
    }
    auto c = std::make_shared<Conn>(std::move(sock), id);
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(c->sock.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      st->log->warn("rejected conn={} reason=no_peer_credentials error={}", id, errno_text(errno));
      c->close();
      continue;
    }
    c->uid = cred.uid;
    c->pid = cred.pid;
    st->conns.insert(c);
    st->log->debug("accepted conn={} peer_uid={} peer_pid={} clients={}", id, c->uid, c->pid, st->conns.size());
    asio::co_spawn(st->acceptor.get_executor(), session(st, c), asio::detached);
  }
}

bool file_intact(const State& st) {
  if (st.ino == 0) return false;
  struct stat s {};
  if (::lstat(st.opts.path.c_str(), &s) != 0) return false;
  return S_ISSOCK(s.st_mode) && s.st_dev == st.dev && s.st_ino == st.ino;
}

const char* file_kind(mode_t m) {
  if (S_ISREG(m)) return "regular file";
  if (S_ISDIR(m)) return "directory";
  if (S_ISLNK(m)) return "symbolic link";
  if (S_ISFIFO(m)) return "fifo";
  if (S_ISCHR(m) || S_ISBLK(m)) return "device node";
  return "file";
}

// Takes the new listening socket `fd` (bound at the path) in place of the old one.
Status adopt_listener(State& st, UniqueFd fd) {
  struct stat s {};
  if (::stat(st.opts.path.c_str(), &s) != 0)
    return errno_error("cannot stat control socket " + st.opts.path + " after bind", errno);
  boost::system::error_code ec;
  st.acceptor.close(ec);  // wakes the old accept loop with operation_aborted
  st.acceptor.assign(stream(), fd.get(), ec);
  if (ec) {
    ::unlink(st.opts.path.c_str());
    st.dev = 0;
    st.ino = 0;
    return Error::runtime("cannot watch control socket " + st.opts.path + ": " + ec.message());
  }
  (void)fd.release();  // the acceptor owns it now
  st.dev = s.st_dev;
  st.ino = s.st_ino;
  ++st.listen_gen;
  return Status::success();
}

// The socket-file check: a path that no longer leads to our socket is bound
// again if it is free or holds a socket (ours unlinked and re-created, a stale
// one, or someone else's, live or not); anything else there is left alone.
// The rule is documented in docs/security.md and docs/protocol.md.
void check_socket_file(const std::shared_ptr<State>& st) {
  if (st->closed || file_intact(*st)) return;
  const std::string& path = st->opts.path;
  auto problem = [&](const std::string& msg) {
    if (msg == st->watch_problem) return;  // said once, not every tick
    st->watch_problem = msg;
    st->log->error("control socket path={} unusable: {}; egressctl cannot connect until this is fixed", path, msg);
  };
  std::string what;
  struct stat s {};
  if (::lstat(path.c_str(), &s) != 0) {
    if (errno != ENOENT) return problem(std::string("cannot stat it: ") + errno_text(errno));
    what = "was deleted";
  } else if (S_ISSOCK(s.st_mode)) {
    what = "was replaced by another socket (owner uid " + std::to_string(s.st_uid) + ", inode " +
           std::to_string(s.st_ino) + ")";
  } else {
    return problem(std::string("it is now a ") + file_kind(s.st_mode) + " (owner uid " + std::to_string(s.st_uid) +
                   "), not our socket; not replacing it");
  }
  // Bound beside the path and renamed over it: an orchestrator connecting
  // meanwhile finds the other socket or ours, never no file at all.
  auto fd = bind_socket(path, st->owner, Publish::over);
  if (!fd) return problem("cannot bind it again: " + fd.error().message);
  if (auto a = adopt_listener(*st, std::move(*fd)); !a) return problem(a.error().message);
  st->watch_problem.clear();
  st->log->warn("control socket path={} {}; listening there again (mode 0600)", path, what);
  asio::co_spawn(st->acceptor.get_executor(), accept_loop(st, st->listen_gen), asio::detached);
}

awaitable<void> watch_loop(std::shared_ptr<State> st) {
  while (!st->closed) {
    boost::system::error_code ec;
    st->watch_timer.expires_after(st->opts.watch_interval);
    co_await st->watch_timer.async_wait(asio::redirect_error(use_awaitable, ec));
    if (st->closed) co_return;
    check_socket_file(st);
  }
}

class ServerImpl final : public Server {
 public:
  explicit ServerImpl(std::shared_ptr<State> st) : st_(std::move(st)) {}
  ~ServerImpl() override { close(); }

  void close() override {
    if (st_->closed) return;
    st_->closed = true;
    boost::system::error_code ec;
    st_->acceptor.close(ec);
    st_->watch_timer.cancel();
    // Copy: closing wakes sessions, whose cleanup erases from the set.
    auto conns = st_->conns;
    for (auto& c : conns) c->close();
    st_->conns.clear();
    // Only remove the file if it is still the one we bound: a successor may own the path now.
    if (socket_file_intact()) ::unlink(st_->opts.path.c_str());
    st_->dev = 0;
    st_->ino = 0;
    st_->log->info("control socket closed path={}", st_->opts.path);
  }

  bool socket_file_intact() const override { return file_intact(*st_); }

 private:
  std::shared_ptr<State> st_;
};

}  // namespace

Status check_socket_path(const std::string& path) {
  auto addr = make_addr(path);
  if (!addr) return addr.error();
  auto at = at_path(path, *addr);
  if (!at) return at.error();
  if (*at == AtPath::not_a_socket) return Error::invalid(not_a_socket_text(path));
  if (*at == AtPath::live_server) return Error::invalid("another egressd is serving " + path);
  return Status::success();
}

Result<std::unique_ptr<Server>> Server::listen(boost::asio::io_context& io, ServerOptions opts, Handler handler) {
  if (!handler) return Error::invalid("control server needs a request handler");
  std::optional<uid_t> owner;
  for (uid_t u : opts.allowed_uids) {
    if (u != 0) {
      owner = u;
      break;
    }
  }
  auto fd = bind_socket(opts.path, owner, Publish::if_free);
  if (!fd) return fd.error();
  auto st = std::make_shared<State>(io, std::move(opts), std::move(handler));
  st->owner = owner;
  if (auto a = adopt_listener(*st, std::move(*fd)); !a) return a.error();
  std::string uids = "0";
  for (uid_t u : st->opts.allowed_uids)
    if (u != 0) uids += "," + std::to_string(u);
  st->log->info("listening path={} allowed_uids={} max_clients={}", st->opts.path, uids, st->opts.max_clients);
  asio::co_spawn(io, accept_loop(st, st->listen_gen), asio::detached);
  if (st->opts.watch_interval.count() > 0) asio::co_spawn(io, watch_loop(st), asio::detached);
  return std::unique_ptr<Server>(std::make_unique<ServerImpl>(std::move(st)));
}

}  // namespace egressd::control
