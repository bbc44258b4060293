#include "nft/read_async.h"

#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <algorithm>
#include <cstdint>
#include <thread>

namespace egressd::nft {

namespace {

constexpr int kReadImmediateRetries = 4;

}  // namespace

std::chrono::microseconds read_retry_pause(int attempt) {
  if (attempt < kReadImmediateRetries) return std::chrono::microseconds{0};
  const int shift = std::min(attempt - kReadImmediateRetries, 5);
  const long max_us = std::min(2000L, 60L << shift);
  // A cheap per-thread xorshift: the jitter only has to differ from the
  // writer's rhythm, not be unpredictable.
  thread_local std::uint64_t x =
      0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return std::chrono::microseconds{static_cast<long>(x % static_cast<std::uint64_t>(max_us + 1))};
}

Error read_table_gave_up(const std::string& name, Family family) {
  return Error::runtime("read table " + std::string(to_string(family)) + " " + name +
                        ": its chains and sets kept changing during the read");
}

namespace {

// Runs `attempt` (a callable setting its `interfered` argument) until it is not
// interfered with, pausing on a timer of the coroutine's executor before each
// retry: a zero pause too, so whatever else is ready on the loop (a DNS
// answer) runs first. `what` names the read in errors; `gave_up` is the
// error when kReadDeadline passes.
template <class T, class Attempt>
boost::asio::awaitable<Result<T>> retry_on_timer(Attempt attempt_once, std::string what, Error gave_up) {
  const auto deadline = std::chrono::steady_clock::now() + kReadDeadline;
  boost::asio::steady_timer timer(co_await boost::asio::this_coro::executor);
  for (int attempt = 0; attempt == 0 || std::chrono::steady_clock::now() < deadline; ++attempt) {
    if (attempt > 0) {
      timer.expires_after(read_retry_pause(attempt));
      boost::system::error_code ec;
      co_await timer.async_wait(boost::asio::redirect_error(boost::asio::use_awaitable, ec));
      if (ec) co_return Error::runtime(what + ": cancelled");
    }
    bool interfered = false;
    Result<T> read = attempt_once(interfered);
    if (!interfered) co_return read;
  }
  co_return gave_up;
}

std::string chain_what(const std::string& name, Family family, const std::string& chain) {
  return "read chain " + chain + " of table " + std::string(to_string(family)) + " " + name;
}

Error chain_gave_up(const std::string& name, Family family, const std::string& chain) {
  return Error::runtime(chain_what(name, family, chain) + ": commits by others kept interrupting the read");
}

}  // namespace

boost::asio::awaitable<Result<std::vector<RuleInfo>>> read_chain_async(Kernel& kernel, std::string name, Family family,
                                                                       std::string chain) {
  co_return co_await retry_on_timer<std::vector<RuleInfo>>(
      [&](bool& interfered) { return kernel.read_chain_once(name, family, chain, interfered); },
      chain_what(name, family, chain), chain_gave_up(name, family, chain));
}

Result<std::vector<RuleInfo>> read_chain(Kernel& kernel, const std::string& name, Family family,
                                         const std::string& chain) {
  const auto deadline = std::chrono::steady_clock::now() + kReadDeadline;
  for (int attempt = 0; attempt == 0 || std::chrono::steady_clock::now() < deadline; ++attempt) {
    if (const auto pause = read_retry_pause(attempt); pause.count() > 0) std::this_thread::sleep_for(pause);
    bool interfered = false;
    auto read = kernel.read_chain_once(name, family, chain, interfered);
    if (!interfered) return read;
  }
  return chain_gave_up(name, family, chain);
}

boost::asio::awaitable<Result<std::optional<TableInfo>>> read_table_async(Kernel& kernel, std::string name,
                                                                          Family family) {
  co_return co_await retry_on_timer<std::optional<TableInfo>>(
      [&](bool& interfered) { return kernel.read_table_once(name, family, interfered); },
      "read table " + std::string(to_string(family)) + " " + name, read_table_gave_up(name, family));
}

}  // namespace egressd::nft
