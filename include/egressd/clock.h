// Where time-based logic reads the time: the real clocks by default, a clock
// a test moves by hand (tests/support/clock.h) so expiry is tested without
// waiting. Only for what expires or is stamped (learned addresses, denied
// records, name attribution); durations measured for logs read the real
// steady clock directly.
#pragma once

#include <chrono>
#include <functional>

namespace egressd {

struct TimeSource {
  // Monotonic time: expiry of learned addresses.
  std::function<std::chrono::steady_clock::time_point()> steady = [] { return std::chrono::steady_clock::now(); };
  // Wall-clock time: the timestamps of denied records and name attribution.
  std::function<std::chrono::system_clock::time_point()> wall = [] { return std::chrono::system_clock::now(); };
};

}  // namespace egressd
