// A clock the test moves by hand: hands out an egressd::TimeSource (give it
// to SandboxOptions::clock) whose steady and wall times only change on
// advance(), so expiry is tested without sleeping. The TimeSource refers to
// this object: keep it alive as long as whatever was given the source.
#pragma once

#include <chrono>

#include "egressd/clock.h"

namespace egressd::testing {

class ManualClock {
 public:
  // Starts at an arbitrary fixed point: steady 1000 s after its epoch, wall
  // 2027-01-15 08:00:00 UTC (1'800'000'000 s after the Unix epoch).
  std::chrono::steady_clock::time_point steady{std::chrono::seconds(1000)};
  std::chrono::system_clock::time_point wall{std::chrono::seconds(1'800'000'000)};

  void advance(std::chrono::steady_clock::duration d) {
    steady += d;
    wall += std::chrono::duration_cast<std::chrono::system_clock::duration>(d);
  }
  TimeSource source() {
    return {[this] { return steady; }, [this] { return wall; }};
  }
};

}  // namespace egressd::testing
