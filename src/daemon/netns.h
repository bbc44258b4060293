// The calling thread inside another network namespace for a scope (setns
// applies to the calling thread only); back home when the scope ends. Used
// by egressd agent to create a sandbox's sockets (and its reaper thread)
// there, and for upstream sockets with dns.upstream_netns: sandbox.
// check_netns_owner: the test every namespace passes before egressd attaches it.
#pragma once

#include <fcntl.h>
#include <linux/nsfs.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include "egressd/result.h"
#include "egressd/unique_fd.h"

namespace egressd::daemon {

class NetnsScope {
 public:
  // Enters the namespace `target` (an open /proc/.../ns/net or /run/netns/... fd).
  static Result<std::unique_ptr<NetnsScope>> enter(int target) {
    UniqueFd home(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    if (!home.ok()) return errno_error("cannot open the thread's own network namespace", errno);
    if (::setns(target, CLONE_NEWNET) != 0) return errno_error("cannot enter the sandbox's network namespace", errno);
    return std::unique_ptr<NetnsScope>(new NetnsScope(std::move(home)));
  }
  // Failing to come back would leave the thread creating its next sockets in
  // a sandbox: fatal (a restarted egressd adopts every table, so nothing is
  // left open).
  ~NetnsScope() {
    if (::setns(home_.get(), CLONE_NEWNET) != 0) {
      spdlog::critical("cannot return to egressd's own network namespace: {}", errno_text(errno));
      std::abort();
    }
  }
  NetnsScope(const NetnsScope&) = delete;
  NetnsScope& operator=(const NetnsScope&) = delete;

 private:
  explicit NetnsScope(UniqueFd home) : home_(std::move(home)) {}
  UniqueFd home_;
};

// A /proc entry named by a number (a pid, a tid, a descriptor).
// The calling thread's network namespace's cookie (SO_NETNS_COOKIE, Linux
// 5.14), from a socket made in it: unique while the machine runs, never
// reused (inode numbers are). nullopt on an older kernel (ENOPROTOOPT).
inline Result<std::optional<std::uint64_t>> current_netns_cookie() {
  const UniqueFd s(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!s.ok()) return errno_error("socket in the network namespace", errno);
  std::uint64_t cookie = 0;
  socklen_t len = sizeof cookie;
  if (::getsockopt(s.get(), SOL_SOCKET, SO_NETNS_COOKIE, &cookie, &len) != 0) {
    if (errno == ENOPROTOOPT) return std::optional<std::uint64_t>{};
    return errno_error("SO_NETNS_COOKIE", errno);
  }
  return std::optional<std::uint64_t>{cookie};
}

// This boot's id (/proc/sys/kernel/random/boot_id): with a cookie, it names a
// namespace across restarts of egressd. Empty when it cannot be read.
inline std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

inline bool all_digits(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}

// Whether the network namespace `netns_fd` is owned by egressd's own user
// namespace; `what` names it in the error (a path, /proc/PID/ns/net).
// Whoever holds CAP_NET_ADMIN in the owning user namespace can list, change
// and delete egressd's tables there, and any process can make such a
// namespace (unshare -Urn, no privilege needed where unprivileged user
// namespaces are allowed) and move into it keeping its pid: --netns-pid would
// police that decoy while the container's real namespace has no table. A
// rootless runtime's namespaces are owned by its user namespace as well, so
// they are refused too (README "Agent mode"): that user namespace's root,
// which the container runs as, holds CAP_NET_ADMIN over them.
// Invalid error when another user namespace owns it (or the kernel cannot say:
// refused, not trusted); runtime error when a descriptor cannot be had.
inline Status check_netns_owner(int netns_fd, const std::string& what) {
  const std::string refused =
      "a process can create a network namespace of its own and move into it, so it is refused; attach a namespace "
      "the container runtime created (rootless runtimes are not supported, README \"Agent mode\")";
  // The owner's descriptor; EPERM: owned by an ancestor of egressd's.
  const UniqueFd owner(::ioctl(netns_fd, NS_GET_USERNS));
  if (!owner.ok() && (errno == EMFILE || errno == ENFILE || errno == ENOMEM)) {
    return errno_error("cannot tell which user namespace owns " + what, errno);
  }
  if (!owner.ok() && errno == ENOTTY) return Error::invalid(what + " is not a namespace");
  if (!owner.ok()) {
    return Error::invalid(what + " is not owned by egressd's user namespace (NS_GET_USERNS: " + errno_text(errno) +
                          "): " + refused);
  }
  const UniqueFd own(::open("/proc/self/ns/user", O_RDONLY | O_CLOEXEC));
  if (!own.ok()) return errno_error("cannot open egressd's own user namespace", errno);
  struct stat theirs {}, mine {};
  if (::fstat(owner.get(), &theirs) != 0) return errno_error("fstat the user namespace that owns " + what, errno);
  if (::fstat(own.get(), &mine) != 0) return errno_error("fstat egressd's own user namespace", errno);
  if (theirs.st_dev != mine.st_dev || theirs.st_ino != mine.st_ino) {
    return Error::invalid(what + " is owned by another user namespace than egressd's (user:[" +
                          std::to_string(theirs.st_ino) + "]; egressd's: user:[" + std::to_string(mine.st_ino) +
                          "]), in which its creator holds CAP_NET_ADMIN and could change egressd's rules: " + refused);
  }
  return {};
}

}  // namespace egressd::daemon
