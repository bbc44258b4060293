// Tamper detection: watches nftables change events in the sandbox's namespace
// and puts table inet egressd back when anyone else changes it.
//
//   event      a transaction (ended by its NEWGEN) that deleted the table,
//              flushed the ruleset, or added/deleted/changed chains, rules,
//              sets or elements of the table, sent from a socket that is not
//              egressd's own -> restore at once, log a `tamper` event.
//   overrun    ENOBUFS on the event socket (notifications lost) -> re-dump
//              the table, compare with the phase in force, restore if it
//              differs; log a `monitor_overrun` event.
//   timer      every verify_interval, the same comparison (safety net for
//              anything the events could not show), unless the namespace's
//              ruleset generation is the one the last clean comparison saw,
//              or one the sandbox's own commits alone made from it (their
//              NEWGENs, heard in order: heard_commit): nothing in nftables
//              changes without a commit, and every commit moves it by one.
//              (200 sandboxes' dumps every 5 s on one loop delayed the other
//              sandboxes' requests; a dump after every switch and every
//              answer's learned addresses was a tenth of an agent's CPU.)
//   unheard    (own socket only, see event_hub.h) egressd's own large batches (Sandbox::kLargeBatchElements set
//              elements or more) are sent with the subscription dropped: the
//              kernel would write a notification per element to this socket,
//              which doubled a 10k-entry inline switch. The ruleset generation
//              is read before and after; if anyone else committed meanwhile,
//              the phase in force is restored at once and a `tamper` event
//              logged (found_by "generation"). A commit racing the
//              unsubscribe itself by microseconds is caught at the next event
//              or by the timer.
//
// A tamperer in a loop gets a restore per wakeup (never fewer: egressd must not
// fail open), and at most `log_burst` tamper lines, then one per
// `log_refill`; the suppressed count goes into the next line.
//
// Shutdown: close() (also run by the destructor) requests the guard's stop
// (a std::stop_source), stops the transport's receive loop and cancels both
// timers. The work the guard leaves on the loop is one coroutine per activity
// (the verification loop; a re-dump after an overrun; a retried restore; the
// repair after an unheard batch), each started with co_spawn and a detached
// completion, and the retry timer's handler. Each carries a std::stop_token
// (the stop state is shared, not the guard's) and checks it before it first
// touches the guard and after every wait, and a cancelled wait
// (operation_aborted) ends it too. The token, not the error code alone: a
// wait that completed just before close() is already queued and resumes
// without an error. So nothing runs against the guard once close() returned,
// and the guard may be destroyed while work is pending; the loop runs that
// work to its (immediate) end afterwards, or its io_context destroys it.
//
// Not thread-safe: runs on the daemon's event loop.
#pragma once

#include <utility>  // before awaitable.hpp: Boost 1.74 uses std::exchange without it
#include <boost/asio/awaitable.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>

#include "daemon/event_hub.h"
#include "daemon/sandbox.h"
#include "egressd/result.h"
#include "nft/monitor.h"
#include "nft/transport.h"

namespace egressd::daemon {

struct TamperGuardOptions {
  std::chrono::milliseconds verify_interval{5000};  // 0 = no periodic verification
  // Event socket receive buffer. Large: egressd's own switch of a 10k-entry
  // policy is 10k element notifications (coalesced by the kernel into ~8 KiB
  // skbs). grow_rcvbuf doubles it on each overrun up to kMaxRcvbuf.
  int rcvbuf = 8 << 20;
  bool grow_rcvbuf = true;
  std::size_t log_burst = 10;
  std::chrono::milliseconds log_refill{1000};
};

class TamperGuard {
 public:
  static constexpr int kMaxRcvbuf = 64 << 20;

  // Subscribes to the events of the current network namespace (a socket of
  // its own), or hears them from `feed` (the agent's hub). Call before
  // sandbox.start() so that nothing after it goes unseen; start() begins
  // reading. The sandbox must outlive the guard.
  static Result<std::unique_ptr<TamperGuard>> open(boost::asio::io_context& io, Sandbox& sandbox,
                                                    TamperGuardOptions opts,
                                                    std::unique_ptr<EventFeed> feed = nullptr);
  ~TamperGuard();

  void start();
  // Stops watching; no handler or coroutine of the guard runs after this
  // returns (see "Shutdown" above). Idempotent.
  void close();
  // Another netlink socket of egressd's own whose nftables changes are not
  // tampering (the sandbox's kernel socket is known from the start).
  void add_own_portid(std::uint32_t portid) { tracker_.add_own_portid(portid); }

  // Runs `apply` (egressd's own batch) without listening to change events;
  // see `unheard` above. Installed with Sandbox::set_large_batch_runner.
  Status apply_unheard(const std::function<Status()>& apply);

  std::uint64_t tampers() const { return tampers_; }
  // Periodic verification rounds, and those that dumped the table (the
  // generation had moved since the last clean comparison, or is unknown).
  std::uint64_t verification_rounds() const { return rounds_; }
  std::uint64_t full_verifications() const { return full_rounds_; }
  // Commits of the sandbox's own that kept the verified generation current.
  std::uint64_t own_commits_followed() const { return own_commits_followed_; }
  std::uint64_t restores() const { return restores_; }

 private:
  TamperGuard(boost::asio::io_context& io, Sandbox& sandbox, std::unique_ptr<EventFeed> feed,
              TamperGuardOptions opts);
  // The transport's receive loop: each message, then the end of each turn
  // (restore, log, re-dump after an overrun).
  void on_message(const nlmsghdr* nlh);
  void on_turn_done();
  // A commit's NEWGEN: carries verified_gen_ forward over the sandbox's own.
  void heard_commit(const nft::ChangeTracker::Commit& c);
  // One turn of the receive loop now, over what is queued.
  void hear_queued();
  // Coroutines, started by spawn() on the loop; `stop` is stop_'s token,
  // checked before the guard is first touched and after every wait (the
  // guard may be gone by then).
  // Every verify_interval (verify_timer_ armed by start()) until closed.
  boost::asio::awaitable<void> verify_loop(std::stop_token stop);
  // `f`: the monitor_overrun event's fields known when the overrun was read.
  boost::asio::awaitable<void> check_after_overrun(std::stop_token stop, std::chrono::steady_clock::time_point t_event,
                                                   nlohmann::json f);
  boost::asio::awaitable<void> retry_restore(std::stop_token stop);
  // The restore after an unheard batch that others committed during, on the
  // next turn of the loop (the caller is in the middle of a switch).
  boost::asio::awaitable<void> repair_after_unheard(std::stop_token stop, bool rejoined, std::string what);
  void spawn(boost::asio::awaitable<void> work);
  // Restores the table; returns the time it took (us) or the error.
  Result<std::int64_t> restore();
  void schedule_retry();
  bool take_log_token();
  void log_tamper(const nft::Tamper& t, const Result<std::int64_t>& restored);

  boost::asio::io_context& io_;
  Sandbox& sandbox_;
  std::unique_ptr<EventFeed> feed_;
  TamperGuardOptions opts_;
  nft::ChangeTracker tracker_;
  // What the current turn of the receive loop found.
  struct Turn {
    bool started = false;
    std::chrono::steady_clock::time_point t_event;
    std::vector<nft::Tamper> found;
    std::size_t found_total = 0;
    bool overrun = false;
  } turn_;
  boost::asio::steady_timer verify_timer_;
  boost::asio::steady_timer retry_timer_;
  std::chrono::milliseconds retry_delay_{0};
  // Requested by close(); its tokens outlive the guard in the work it left.
  std::stop_source stop_;
  // log rate limit (token bucket)
  double tokens_;
  std::chrono::steady_clock::time_point tokens_at_;
  std::uint64_t suppressed_ = 0;
  std::uint64_t tampers_ = 0;
  std::uint64_t rounds_ = 0, full_rounds_ = 0;
  // A ruleset generation at which the table was as it should be: read just
  // before a comparison that found it so (reset by any other outcome), or
  // reached from one by the sandbox's own commits alone (heard_commit).
  std::optional<std::uint32_t> verified_gen_;
  std::uint64_t own_commits_followed_ = 0;
  std::uint64_t restores_ = 0;
  std::uint64_t overruns_ = 0;
};

}  // namespace egressd::daemon
