// Turns a callback-style operation into an asio initiating function, so it
// can be awaited (`co_await op(..., boost::asio::use_awaitable)`) or given
// any other completion token. Boost 1.74 has async_initiate but neither
// deferred operations nor a move-only std::function to carry a handler in.
#pragma once

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/post.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <utility>

namespace egressd {

// Initiates an operation completing with void(Arg): calls
// `start(std::function<void(Arg)> done)`, where `start` must call `done` at
// most once, and may do so before it returns. The handler runs:
// - posted to its associated executor (`fallback` when it has none) when
//   `done` ran inside `start` (an asio handler never runs inside its
//   initiating function);
// - at once, on the caller's thread, when `done` runs later (the callers
//   here are single-threaded: that thread runs the handler's executor);
// - never, when `done` is destroyed uncalled: the handler is destroyed (a
//   coroutine waiting on it is unwound, never resumed).
template <class Arg, class Executor, class CompletionToken, class Start>
auto async_from_callback(const Executor& fallback, CompletionToken&& token, Start&& start) {
  return boost::asio::async_initiate<CompletionToken, void(Arg)>(
      [fallback](auto handler, auto start_fn) {
        // A std::function must be copyable; an asio handler is move-only.
        using Handler = decltype(handler);
        struct Op {
          Handler handler;
          bool initiating = true;
          std::optional<Arg> early;
        };
        auto op = std::make_shared<Op>(Op{std::move(handler), true, std::nullopt});
        std::move(start_fn)(std::function<void(Arg)>([op](Arg a) {
          if (op->initiating) {
            op->early.emplace(std::move(a));
            return;
          }
          std::move(op->handler)(std::move(a));
        }));
        op->initiating = false;
        if (op->early) {
          const auto ex = boost::asio::get_associated_executor(op->handler, fallback);
          boost::asio::post(ex, [op] { std::move(op->handler)(std::move(*op->early)); });
        }
      },
      token, std::forward<Start>(start));
}

}  // namespace egressd
