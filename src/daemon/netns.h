// The calling thread inside another network namespace for a scope (setns
// applies to the calling thread only); back home when the scope ends. Used
// by egressd agent to create a sandbox's sockets (and its reaper thread)
// there, and for upstream sockets with dns.upstream_netns: sandbox.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <memory>

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

}  // namespace egressd::daemon
