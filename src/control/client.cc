#include "control/client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace egressd::control {
namespace {

using Clock = std::chrono::steady_clock;

// A reply line longer than this is treated as a broken peer rather than
// buffered forever (a status with 100k entries is a few MiB).
constexpr std::size_t kMaxReplyBytes = 256u << 20;

// Waits for `events` on fd until `deadline`. Returns 1 ready, 0 timed out, -1 error (errno set).
int wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, events, 0};
    // Round up so a sub-millisecond remainder still waits instead of spinning at 0.
    const int rc = ::poll(&p, 1, left <= 0 ? 0 : static_cast<int>(std::min<long long>(left + 1, 1 << 30)));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return rc;
    return 1;  // readable/writable, or HUP/ERR that the next recv/send reports
  }
}

constexpr const char* kTimedOut = "timed out after ";

Error timed_out(std::chrono::milliseconds timeout) {
  return Error::runtime(kTimedOut + std::to_string(timeout.count()) + " ms waiting for egressd");
}

}  // namespace

Result<Client> Client::connect(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.find('\0') != std::string::npos)
    return Error::invalid("cannot connect to \"" + path + "\": not a filesystem socket path");
  if (path.size() >= sizeof(addr.sun_path))
    return Error::invalid("cannot connect to " + path + ": path too long (" + std::to_string(path.size()) +
                          " bytes, limit " + std::to_string(sizeof(addr.sun_path) - 1) + ")");
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.ok()) return errno_error("cannot connect to " + path, errno);
  // Blocking connect: a Unix socket connect completes or fails at once unless the
  // listener's backlog is full, and then waiting is the right thing to do.
  int rc;
  do rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  while (rc != 0 && errno == EINTR);
  if (rc != 0) return errno_error("cannot connect to " + path, errno);
  // Non-blocking from here on: every wait goes through poll() with a deadline.
  if (::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) | O_NONBLOCK) != 0)
    return errno_error("cannot connect to " + path, errno);
  return Client(std::move(fd));
}

Result<nlohmann::json> Client::call(const nlohmann::json& request, std::chrono::milliseconds timeout) {
  if (!fd_.ok()) return Error::runtime("connection to egressd is closed after an earlier error");
  const auto deadline = Clock::now() + timeout;
  const std::string out = request.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t n = ::send(fd_.get(), out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const int rc = wait_fd(fd_.get(), POLLOUT, deadline);
      if (rc < 0) return errno_error("cannot send request to egressd", errno);
      if (rc == 0) {
        fd_.reset();
        return Error::runtime("timed out after " + std::to_string(timeout.count()) +
                              " ms sending a request to egressd");
      }
      continue;
    }
    const int err = errno;
    // The server may have answered and hung up before reading (an unauthorized
    // peer is told so at once): that answer explains more than EPIPE does.
    auto early = read_line(std::chrono::milliseconds(0));
    if (early) return early;
    return errno_error("cannot send request to egressd", err);
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  auto reply = read_line(std::max(left, std::chrono::milliseconds(0)));
  // Report the caller's whole budget, not what was left of it after sending.
  if (!reply && reply.error().message.rfind(kTimedOut, 0) == 0) return timed_out(timeout);
  return reply;
}

Result<nlohmann::json> Client::read_line(std::chrono::milliseconds timeout) {
  if (!fd_.ok()) return Error::runtime("connection to egressd is closed after an earlier error");
  const auto deadline = Clock::now() + timeout;
  std::size_t scanned = 0;
  for (;;) {
    const auto nl = buf_.find('\n', scanned);
    if (nl != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      try {
        return nlohmann::json::parse(line);
      } catch (const nlohmann::json::parse_error& e) {
        fd_.reset();
        return Error::runtime(std::string("malformed reply from egressd: ") + e.what());
      }
    }
    scanned = buf_.size();
    if (buf_.size() > kMaxReplyBytes) {
      fd_.reset();
      return Error::runtime("reply from egressd exceeds " + std::to_string(kMaxReplyBytes) + " bytes");
    }
    char chunk[16 * 1024];
    const ssize_t n = ::recv(fd_.get(), chunk, sizeof(chunk), 0);
    if (n > 0) {
      buf_.append(chunk, static_cast<std::size_t>(n));
      continue;
    }
    if (n == 0) {
      fd_.reset();
      return Error::runtime("egressd closed the connection without a reply");
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      const int err = errno;
      fd_.reset();
      return errno_error("cannot read reply from egressd", err);
    }
    const int rc = wait_fd(fd_.get(), POLLIN, deadline);
    if (rc < 0) return errno_error("cannot read reply from egressd", errno);
    if (rc == 0) {
      // A late reply would be taken for the answer to the next request: this
      // connection cannot be reused.
      fd_.reset();
      return timed_out(timeout);
    }
  }
}

std::string default_socket_path() {
  const char* env = std::getenv("EGRESSD_SOCKET");
  if (env != nullptr && *env != '\0') return env;
  return "/run/egressd/egressd.sock";
}

}  // namespace egressd::control
