// For the unit tests' cases that need the kernel ("... as root": the kernel
// suite runs them, tests/meson.build): each runs its body in a network
// namespace of its own, on a thread that unshared it, with lo up.
#pragma once

#include <doctest/doctest.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>

namespace egressd::testing {

inline bool lo_up() {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ifreq ifr{};
  std::strcpy(ifr.ifr_name, "lo");
  bool ok = fd >= 0 && ::ioctl(fd, SIOCGIFFLAGS, &ifr) == 0;
  ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
  ok = ok && ::ioctl(fd, SIOCSIFFLAGS, &ifr) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

// Runs `body` on a thread of its own in a new network namespace (gone when
// the thread ends and nothing else holds it).
inline void in_new_netns(const std::function<void()>& body) {
  std::thread([&] {
    if (::unshare(CLONE_NEWNET) != 0 || !lo_up()) {
      FAIL_CHECK("cannot make a network namespace: ", std::strerror(errno));
      return;
    }
    body();
  }).join();
}

// The kernel cases need a network namespace of their own: root. False (the
// case is skipped, and says so) otherwise.
inline bool as_root() {
  if (::geteuid() == 0) return true;
  MESSAGE("skipped: a network namespace of its own needs root");
  return false;
}

}  // namespace egressd::testing
