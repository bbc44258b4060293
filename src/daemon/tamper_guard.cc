#include "daemon/tamper_guard.h"

#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "daemon/audit_log.h"
#include "egressd/module_logger.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::shared_ptr<spdlog::logger> log() { return module_logger("tamper"); }

// Datagrams read per wakeup before the loop lets other work run; events of one
// transaction may span several, the tracker carries them over.
constexpr std::size_t kDatagramsPerWakeup = 256;

// The generation a commit makes of generation `g`: one more, with 0 skipped
// when the counter wraps (the kernel's nf_tables_commit does the same).
std::uint32_t next_generation(std::uint32_t g) { return g + 1 == 0 ? 1 : g + 1; }
constexpr std::chrono::milliseconds kFirstRetry{10};
constexpr std::chrono::milliseconds kMaxRetry{1000};

std::int64_t us_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
}

}  // namespace

Result<std::unique_ptr<TamperGuard>> TamperGuard::open(boost::asio::io_context& io, Sandbox& sandbox,
                                                        TamperGuardOptions opts, std::unique_ptr<EventFeed> feed) {
  if (!feed) {
    auto own = open_own_feed(io, nftables_events(), opts.rcvbuf);
    if (!own) return own.error();
    feed = std::move(*own);
  }
  return std::unique_ptr<TamperGuard>(new TamperGuard(io, sandbox, std::move(feed), opts));
}

TamperGuard::TamperGuard(boost::asio::io_context& io, Sandbox& sandbox, std::unique_ptr<EventFeed> feed,
                         TamperGuardOptions opts)
    : io_(io),
      sandbox_(sandbox),
      feed_(std::move(feed)),
      opts_(opts),
      tracker_(nft::kTableName, {sandbox.kernel_portid()}),
      verify_timer_(io),
      retry_timer_(io),
      tokens_(static_cast<double>(opts.log_burst)),
      tokens_at_(Clock::now()) {}

TamperGuard::~TamperGuard() { close(); }

void TamperGuard::close() {
  if (stop_.stop_requested()) return;
  // First: whatever resumes after this (a wait that completed before the
  // cancels below, a coroutine back from a table read) sees it and returns.
  stop_.request_stop();
  feed_->stop();  // no message handler runs after this
  verify_timer_.cancel();
  retry_timer_.cancel();
}

void TamperGuard::start() {
  log()->info("watching table inet {} for changes by others ({}, portid={}, own portid={}, rcvbuf={}, verify every {} ms)",
              nft::kTableName, feed_->own_socket() ? "own socket" : "the agent's event hub", feed_->portid(),
              sandbox_.kernel_portid(), feed_->rcvbuf(), opts_.verify_interval.count());
  nft::Transport::Handlers h;
  h.message = [this](const nlmsghdr* nlh) { on_message(nlh); };
  h.overrun = [this] { turn_.overrun = true; };
  h.error = [this](const Error& e) {
    log()->error("nftables events: {}; verifying the table instead", e.message);
    turn_.overrun = true;
  };
  h.turn_done = [this] { on_turn_done(); };
  feed_->start(std::move(h));
  if (opts_.verify_interval.count() > 0) {
    verify_timer_.expires_after(opts_.verify_interval);
    spawn(verify_loop(stop_.get_token()));
  }
}

void TamperGuard::on_message(const nlmsghdr* nlh) {
  if (!turn_.started) {
    turn_.started = true;
    turn_.t_event = Clock::now();
  }
  if (auto t = tracker_.feed(nlh)) {
    ++turn_.found_total;
    // Bounded: a loop of tamperers between two reads costs one restore
    // and a few lines, not a list.
    if (turn_.found.size() < 16) turn_.found.push_back(std::move(*t));
  }
  if (const auto c = tracker_.take_commit()) heard_commit(*c);
}

void TamperGuard::heard_commit(const nft::ChangeTracker::Commit& c) {
  // Generations are numbered by the kernel, one per commit (0 skipped): the
  // commit that made generation N was applied to the ruleset of N - 1. When
  // that one was verified and the sandbox's own socket made N, the table at
  // N is the verified one with egressd's own change: the state it keeps in
  // step with its batches. Anyone else's commit in between takes N - 1 away
  // (the chain breaks, the next round compares). Only the sandbox's socket:
  // other sockets of egressd's that the tracker treats as its own are not
  // ones whose batches keep the table in step with the phase in force.
  if (!verified_gen_ || c.portid != sandbox_.kernel_portid()) return;
  if (c.gen == next_generation(*verified_gen_)) {
    verified_gen_ = c.gen;
    ++own_commits_followed_;
  }
}

void TamperGuard::hear_queued() {
  // At most what one turn of the receive loop reads: under a storm of
  // commits by another process the socket may not run empty, and reading
  // until it did would hold the loop (DNS answers, requests) for as long as
  // the storm lasts. What is left is heard by the loop; the chain then
  // decides against the generations heard so far, and a dump follows.
  feed_->hear_queued(kDatagramsPerWakeup);  // its messages, then on_turn_done
}

void TamperGuard::on_turn_done() {
  Turn turn = std::exchange(turn_, Turn{});
  const auto t_event = turn.started ? turn.t_event : Clock::now();
  if (turn.overrun) {
    tracker_.reset();
    ++overruns_;
  }

  if (turn.found_total > 0) {
    tampers_ += turn.found_total;
    // restore_us counts from reading the events to the kernel's ack.
    auto restored = restore();
    Result<std::int64_t> timed = restored ? Result<std::int64_t>(us_since(t_event)) : restored;
    for (const auto& t : turn.found) log_tamper(t, timed);
    if (turn.found_total > turn.found.size()) suppressed_ += turn.found_total - turn.found.size();
  }
  if (turn.overrun) {
    // Some notifications are gone: the table may have been changed by
    // anyone, also after a tamper just restored. Re-dump it and compare
    // (off this handler: the read may have to wait out commits by others).
    spawn(check_after_overrun(stop_.get_token(), t_event,
                              {{"redumped", true}, {"overruns", overruns_}, {"rcvbuf", feed_->rcvbuf()}}));
    if (opts_.grow_rcvbuf) feed_->grow_rcvbuf(kMaxRcvbuf);
  }
}

boost::asio::awaitable<void> TamperGuard::check_after_overrun(std::stop_token stop, Clock::time_point t_event,
                                                              json f) {
  if (stop.stop_requested()) co_return;
  if (!feed_->own_socket() && verified_gen_) {
    // The hub's overrun is every sandbox's, and most lost nothing of this
    // namespace: no commit was made here since the verified generation when
    // the kernel's is still that one (every commit moves it by one).
    if (const auto gen = sandbox_.kernel_generation(); gen && *gen == *verified_gen_) co_return;
  }
  auto diffs = co_await sandbox_.verify_table_async();
  if (stop.stop_requested()) co_return;
  // Restore only when it differs (egressd's own big switch can overrun the
  // buffer and must not cause a rebuild, which would cause the next overrun).
  if (!diffs) {
    f["error"] = diffs.error().message;
    audit_event("monitor_overrun", f, spdlog::level::err);
    schedule_retry();
  } else if (diffs->empty()) {
    // Nothing to repair: rate-limited like tamper lines (a flood of changes
    // to other tables can overrun the socket on every wakeup).
    f["differences"] = json::array();
    f["restored"] = false;
    if (take_log_token()) audit_event("monitor_overrun", f, spdlog::level::warn);
  } else {
    ++tampers_;
    auto restored = restore();
    f["differences"] = *diffs;
    f["restored"] = restored.ok();
    if (restored) f["restore_us"] = us_since(t_event);
    if (!restored) f["error"] = restored.error().message;
    audit_event("monitor_overrun", f, spdlog::level::warn);
  }
}

void TamperGuard::spawn(boost::asio::awaitable<void> work) {
  boost::asio::co_spawn(io_, std::move(work), boost::asio::detached);
}

boost::asio::awaitable<void> TamperGuard::verify_loop(std::stop_token stop) {
  for (;;) {
    if (stop.stop_requested()) co_return;
    boost::system::error_code ec;
    co_await verify_timer_.async_wait(boost::asio::redirect_error(boost::asio::use_awaitable, ec));
    if (ec || stop.stop_requested()) co_return;  // operation_aborted: closed
    ++rounds_;
    // Read before the dump: a commit between the two leaves a generation
    // that differs next round, and that round compares again.
    const auto gen = sandbox_.kernel_generation();
    // The notifications of every commit up to `gen` are queued by now (the
    // kernel sends them inside the commit): heard first, egressd's own
    // commits since the last clean comparison (a switch, learned addresses)
    // carry its generation forward, and a tamper among them is restored.
    if (gen && verified_gen_) {
      if (*gen != *verified_gen_) hear_queued();
      if (*gen == *verified_gen_) {
        verify_timer_.expires_after(opts_.verify_interval);
        continue;
      }
    }
    ++full_rounds_;
    verified_gen_.reset();
    auto diffs = co_await sandbox_.verify_table_async();
    if (stop.stop_requested()) co_return;
    if (diffs && diffs->empty() && gen) verified_gen_ = *gen;
    if (!diffs) {
      log()->warn("verification of table inet {} failed: {}", nft::kTableName, diffs.error().message);
    } else if (!diffs->empty()) {
      ++tampers_;
      const auto t0 = Clock::now();
      auto restored = restore();
      std::string what;
      for (const auto& d : *diffs) what += (what.empty() ? "" : ", ") + d;
      Result<std::int64_t> timed = restored ? Result<std::int64_t>(us_since(t0)) : restored;
      json f{{"what", what}, {"found_by", "verification"}, {"by_pid", nullptr}, {"by_comm", nullptr}};
      if (!take_log_token()) {
        ++suppressed_;
      } else {
        f["restored"] = timed.ok();
        if (timed) f["restore_us"] = *timed;
        if (!timed) f["error"] = timed.error().message;
        f["phase"] = sandbox_.state().phase;
        f["generation"] = sandbox_.state().generation;
        f["suppressed"] = std::exchange(suppressed_, 0);
        audit_event("tamper", f, spdlog::level::warn);
      }
    }
    verify_timer_.expires_after(opts_.verify_interval);
  }
}

Status TamperGuard::apply_unheard(const std::function<Status()>& apply) {
  if (stop_.stop_requested()) return apply();
  // A shared socket (the agent's hub) cannot stop listening for one
  // sandbox: heard, as any batch.
  if (!feed_->own_socket()) return apply();
  const auto before = sandbox_.kernel_generation();
  if (!before || feed_->leave() != 0) {
    return apply();  // heard, as any batch
  }
  Status st = apply();
  const int rejoin_errno = feed_->join();
  const bool rejoined = rejoin_errno == 0;
  const auto after = sandbox_.kernel_generation();
  // Our batch moved the generation by one if it committed, else not at all.
  const std::uint32_t expected = st ? next_generation(*before) : *before;
  if (rejoined && after && *after == expected) return st;

  std::string what;
  if (!rejoined) {
    what = std::string("could not listen to nftables events again (") + errno_text(rejoin_errno) + ")";
  } else if (!after) {
    what = "ruleset generation unreadable after an unheard batch: " + after.error().message;
  } else {
    what = fmt::format("{} commit(s) by others while egressd's own batch was not listened to",
                       static_cast<std::uint32_t>(*after - expected));
  }
  // The caller is in the middle of a switch: repair on the next turn of the
  // loop, against the phase then in force.
  spawn(repair_after_unheard(stop_.get_token(), rejoined, std::move(what)));
  return st;
}

boost::asio::awaitable<void> TamperGuard::repair_after_unheard(std::stop_token stop, bool rejoined, std::string what) {
  // The next turn of the loop, whichever way co_spawn starts a coroutine
  // (the executor is the frame's: the guard may be gone by then).
  co_await boost::asio::post(co_await boost::asio::this_coro::executor, boost::asio::use_awaitable);
  if (stop.stop_requested()) co_return;
  if (!rejoined) {
    if (const int err = feed_->join(); err != 0) {
      log()->error("nftables events: cannot subscribe again ({}); only the {} ms verification watches the table",
                   errno_text(err), opts_.verify_interval.count());
    }
  }
  ++tampers_;
  const auto t0 = Clock::now();
  auto restored = restore();
  json f{{"what", what}, {"found_by", "generation"}, {"by_pid", nullptr}, {"by_comm", nullptr},
         {"restored", restored.ok()}, {"phase", sandbox_.state().phase},
         {"generation", sandbox_.state().generation}};
  if (restored) f["restore_us"] = us_since(t0);
  if (!restored) f["error"] = restored.error().message;
  audit_event("tamper", f, spdlog::level::warn);
}

Result<std::int64_t> TamperGuard::restore() {
  const auto t0 = Clock::now();
  if (auto s = sandbox_.restore_table(); !s) {
    log()->error("restore of table inet {} failed: {}; retrying", nft::kTableName, s.error().message);
    schedule_retry();
    return s.error();
  }
  ++restores_;
  retry_delay_ = std::chrono::milliseconds{0};
  return us_since(t0);
}

void TamperGuard::schedule_retry() {
  retry_delay_ = retry_delay_.count() == 0 ? kFirstRetry : std::min(retry_delay_ * 2, kMaxRetry);
  retry_timer_.expires_after(retry_delay_);  // cancels a wait already pending: this one replaces it
  retry_timer_.async_wait([this, stop = stop_.get_token()](const boost::system::error_code& ec) {
    // operation_aborted: re-armed (the newer wait retries) or closed. A wait
    // that had completed before close() comes here without an error: `stop` tells.
    if (ec || stop.stop_requested()) return;
    spawn(retry_restore(stop));
  });
}

boost::asio::awaitable<void> TamperGuard::retry_restore(std::stop_token stop) {
  if (stop.stop_requested()) co_return;
  auto diffs = co_await sandbox_.verify_table_async();
  if (stop.stop_requested()) co_return;
  if (diffs && diffs->empty()) {
    retry_delay_ = std::chrono::milliseconds{0};
    co_return;
  }
  if (auto r = restore(); r) {
    audit_event("tamper", {{"what", "restore retried"}, {"found_by", "retry"}, {"restored", true},
                           {"restore_us", *r}, {"phase", sandbox_.state().phase},
                           {"generation", sandbox_.state().generation}},
                spdlog::level::warn);
  }
}

bool TamperGuard::take_log_token() {
  const auto now = Clock::now();
  const double refill = std::chrono::duration<double>(now - tokens_at_) /
                        std::chrono::duration<double>(opts_.log_refill);
  tokens_ = std::min(static_cast<double>(opts_.log_burst), tokens_ + refill);
  tokens_at_ = now;
  if (tokens_ < 1.0) return false;
  tokens_ -= 1.0;
  return true;
}

void TamperGuard::log_tamper(const nft::Tamper& t, const Result<std::int64_t>& restored) {
  if (!take_log_token()) {
    ++suppressed_;
    return;
  }
  const std::string what = t.changes.describe(nft::kTableName);
  json f{{"what", what},
         {"found_by", "event"},
         {"by_pid", t.proc_pid != 0 ? json(t.proc_pid) : json(nullptr)},
         {"by_comm", t.proc_name.empty() ? json(nullptr) : json(t.proc_name)},
         {"portid", t.portid},
         {"kernel_generation", t.gen_id},
         {"restored", restored.ok()}};
  if (restored) f["restore_us"] = *restored;
  if (!restored) f["error"] = restored.error().message;
  f["phase"] = sandbox_.state().phase;
  f["generation"] = sandbox_.state().generation;
  f["suppressed"] = std::exchange(suppressed_, 0);
  // The text line people read: "tamper: table inet egressd deleted by pid 1234 (nft); restored in 830 us".
  // Object and process names come from whoever tampered: control bytes are
  // escaped so they cannot forge a line.
  auto safe = [](const std::string& v) {
    const bool ctl = std::any_of(v.begin(), v.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; });
    return ctl ? json(v).dump(-1, ' ', false, json::error_handler_t::replace) : v;
  };
  std::string text = "tamper: " + safe(what);
  if (t.proc_pid != 0) text += " by pid " + std::to_string(t.proc_pid);
  if (!t.proc_name.empty()) text += " (" + safe(t.proc_name) + ")";
  text += restored ? "; restored phase=" + sandbox_.state().phase + " in " + std::to_string(*restored) + " us"
                   : "; NOT restored: " + restored.error().message;
  if (f["suppressed"].get<std::uint64_t>() > 0) {
    text += " (" + std::to_string(f["suppressed"].get<std::uint64_t>()) + " tamper events not logged before this)";
  }
  audit_event("tamper", std::move(f), spdlog::level::warn, text);
}

}  // namespace egressd::daemon
