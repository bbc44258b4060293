// Reading egressd's table back from the event loop without waiting on it.
//
// A table read (Kernel::read_table) is several dumps that must agree; a
// commit by anyone in the namespace during them spoils the attempt, and a
// process committing back to back spoils attempt after attempt. The retries
// are spaced by a growing, jittered pause. read_table_async takes each pause
// on an asio timer, so DNS answers and everything else on the loop run
// between attempts; Kernel::read_table (start-up, the Harbor tool) sleeps
// the same pauses.
#pragma once

#include <utility>  // before awaitable.hpp: Boost 1.74 uses std::exchange without it
#include <boost/asio/awaitable.hpp>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "egressd/result.h"
#include "nft/netlink.h"

namespace egressd::nft {

// Retries of a table read stop after this long (then an error).
inline constexpr auto kReadDeadline = std::chrono::seconds(2);

// The pause before attempt `attempt` (0-based) of a table read: none for the
// first few, then a random pause growing to 2 ms, which lands the next read
// in a gap between another process's commits.
std::chrono::microseconds read_retry_pause(int attempt);

// The error when kReadDeadline passed with every attempt spoiled.
Error read_table_gave_up(const std::string& name, Family family);

// Kernel::read_table, with the pauses between attempts taken on a timer of
// the calling coroutine's executor. `kernel` must outlive the coroutine.
boost::asio::awaitable<Result<std::optional<TableInfo>>> read_table_async(Kernel& kernel, std::string name,
                                                                          Family family);

// Kernel::read_chain_once, retried the same way.
boost::asio::awaitable<Result<std::vector<RuleInfo>>> read_chain_async(Kernel& kernel, std::string name, Family family,
                                                                       std::string chain);
// The same, sleeping the pauses (no event loop).
Result<std::vector<RuleInfo>> read_chain(Kernel& kernel, const std::string& name, Family family,
                                         const std::string& chain);

}  // namespace egressd::nft
