// check_netns_owner (src/daemon/netns.h): the namespace a process made for
// itself with a user namespace of its own is refused, egressd's own passes.
// Runs as any user; without unprivileged user namespaces the refusal case
// says so and checks nothing.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "daemon/netns.h"

using namespace egressd;
using egressd::daemon::check_netns_owner;

namespace {

// A child in a user and network namespace of its own (unshare -Urn), until
// destroyed. pid() is 0 when the kernel refused it (`why` says why).
class Decoy {
 public:
  Decoy() {
    int ready[2], hold[2];
    REQUIRE(::pipe2(ready, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(hold, O_CLOEXEC) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::close(ready[0]);
      ::close(hold[1]);  // or its own copy would keep the read below from ever ending
      const int err = ::unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0 ? 0 : errno;
      (void)!::write(ready[1], &err, sizeof err);
      char c;
      (void)!::read(hold[0], &c, 1);  // until the parent closes its end
      ::_exit(0);
    }
    ::close(ready[1]);
    ::close(hold[0]);
    hold_ = hold[1];
    int err = -1;
    REQUIRE(::read(ready[0], &err, sizeof err) == static_cast<ssize_t>(sizeof err));
    ::close(ready[0]);
    if (err != 0) {
      why = errno_text(err);
      stop();
    }
  }
  ~Decoy() { stop(); }
  pid_t pid() const { return pid_; }
  std::string why;

 private:
  void stop() {
    if (hold_ >= 0) ::close(hold_);
    hold_ = -1;
    if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }
  pid_t pid_ = 0;
  int hold_ = -1;
};

}  // namespace

TEST_CASE("egressd's own network namespace passes") {
  UniqueFd fd(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  REQUIRE(fd.ok());
  CHECK(check_netns_owner(fd.get(), "/proc/self/ns/net"));
}

TEST_CASE("a network namespace in a user namespace of its own is refused, naming it and why") {
  Decoy decoy;
  if (decoy.pid() == 0) {
    MESSAGE("no user namespace for a child here (" << decoy.why << "): nothing to check");
    return;
  }
  const std::string path = "/proc/" + std::to_string(decoy.pid()) + "/ns/net";
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  REQUIRE(fd.ok());
  Status st = check_netns_owner(fd.get(), path);
  REQUIRE_FALSE(st);
  CHECK(st.error().kind == ErrorKind::invalid);
  CHECK(st.error().message.find(path + " is owned by another user namespace than egressd's") != std::string::npos);
  CHECK(st.error().message.find("a process can create a network namespace of its own") != std::string::npos);
  CHECK(st.error().message.find("attach a namespace the container runtime created") != std::string::npos);
}

TEST_CASE("a file that is not a namespace is refused as such") {
  UniqueFd fd(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
  REQUIRE(fd.ok());
  Status st = check_netns_owner(fd.get(), "/proc/self/status");
  REQUIRE_FALSE(st);
  CHECK(st.error().kind == ErrorKind::invalid);
  CHECK(st.error().message == "/proc/self/status is not a namespace");
}
