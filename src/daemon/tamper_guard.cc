#include "daemon/tamper_guard.h"

#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <boost/asio/post.hpp>

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
constexpr std::chrono::milliseconds kFirstRetry{10};
constexpr std::chrono::milliseconds kMaxRetry{1000};

std::int64_t us_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
}

}  // namespace

Result<std::unique_ptr<TamperGuard>> TamperGuard::open(boost::asio::io_context& io, Sandbox& sandbox,
                                                        TamperGuardOptions opts) {
  auto sock = nft::MonitorSocket::open(opts.rcvbuf);
  if (!sock) return sock.error();
  return std::unique_ptr<TamperGuard>(new TamperGuard(io, sandbox, std::move(*sock), opts));
}

TamperGuard::TamperGuard(boost::asio::io_context& io, Sandbox& sandbox, nft::MonitorSocket sock,
                         TamperGuardOptions opts)
    : io_(io),
      sandbox_(sandbox),
      sock_(std::move(sock)),
      opts_(opts),
      tracker_(nft::kTableName, {sandbox.kernel_portid()}),
      sd_(io, sock_.fd()),
      verify_timer_(io),
      retry_timer_(io),
      tokens_(static_cast<double>(opts.log_burst)),
      tokens_at_(Clock::now()) {}

TamperGuard::~TamperGuard() { close(); }

void TamperGuard::close() {
  if (closed_) return;
  closed_ = true;
  *alive_ = false;
  boost::system::error_code ec;
  sd_.cancel(ec);
  (void)sd_.release();  // the fd belongs to sock_
  verify_timer_.cancel();
  retry_timer_.cancel();
}

void TamperGuard::start() {
  log()->info("watching table inet {} for changes by others (portid={}, own portid={}, rcvbuf={}, verify every {} ms)",
              nft::kTableName, sock_.portid(), sandbox_.kernel_portid(), sock_.rcvbuf(),
              opts_.verify_interval.count());
  wait_readable();
  if (opts_.verify_interval.count() > 0) {
    verify_timer_.expires_after(opts_.verify_interval);
    verify_timer_.async_wait([this, alive = alive_](const boost::system::error_code& ec) {
      if (!ec && *alive) on_verify_timer();
    });
  }
}

void TamperGuard::wait_readable() {
  if (closed_) return;
  sd_.async_wait(boost::asio::posix::stream_descriptor::wait_read,
                 [this, alive = alive_](const boost::system::error_code& ec) {
                   if (ec || !*alive) return;
                   on_readable();
                 });
}

void TamperGuard::on_readable() {
  const auto t_event = Clock::now();
  std::vector<nft::Tamper> found;
  std::size_t found_total = 0;
  auto r = sock_.read(
      [&](const nlmsghdr* nlh) {
        if (auto t = tracker_.feed(nlh)) {
          ++found_total;
          // Bounded: a loop of tamperers between two reads costs one restore
          // and a few lines, not a list.
          if (found.size() < 16) found.push_back(std::move(*t));
        }
      },
      kDatagramsPerWakeup);
  if (!r) {
    log()->error("nftables events: {}; verifying the table instead", r.error().message);
  }
  const bool overrun = !r || r->overrun;
  if (overrun) {
    tracker_.reset();
    ++overruns_;
  }

  if (found_total > 0) {
    tampers_ += found_total;
    // restore_us counts from reading the events to the kernel's ack.
    auto restored = restore();
    Result<std::int64_t> timed = restored ? Result<std::int64_t>(us_since(t_event)) : restored;
    for (const auto& t : found) log_tamper(t, timed);
    if (found_total > found.size()) suppressed_ += found_total - found.size();
  }
  if (overrun) {
    // Some notifications are gone: the table may have been changed by
    // anyone, also after a tamper just restored. Re-dump it and compare;
    // restore only when it differs (egressd's own big switch can overrun the
    // buffer and must not cause a rebuild, which would cause the next overrun).
    auto diffs = sandbox_.verify_table();
    json f{{"redumped", true}, {"overruns", overruns_}, {"rcvbuf", sock_.rcvbuf()}};
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
    if (opts_.grow_rcvbuf) {
      const int now = sock_.rcvbuf() / 2;  // the kernel reports twice what was set
      if (now > 0 && now < kMaxRcvbuf) {
        int want = std::min(now * 2, kMaxRcvbuf);
        if (setsockopt(sock_.fd(), SOL_SOCKET, SO_RCVBUFFORCE, &want, sizeof want) < 0) {
          (void)setsockopt(sock_.fd(), SOL_SOCKET, SO_RCVBUF, &want, sizeof want);
        }
      }
    }
  }

  if (r && r->more) {
    // More queued: read on after other handlers had their turn.
    boost::asio::post(io_, [this, alive = alive_] {
      if (*alive) on_readable();
    });
  } else {
    wait_readable();
  }
}

void TamperGuard::on_verify_timer() {
  auto diffs = sandbox_.verify_table();
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
  verify_timer_.async_wait([this, alive = alive_](const boost::system::error_code& ec) {
    if (!ec && *alive) on_verify_timer();
  });
}

Status TamperGuard::apply_unheard(const std::function<Status()>& apply) {
  if (closed_) return apply();
  int group = NFNLGRP_NFTABLES;
  const auto before = sandbox_.kernel_generation();
  if (!before || setsockopt(sock_.fd(), SOL_NETLINK, NETLINK_DROP_MEMBERSHIP, &group, sizeof group) < 0) {
    return apply();  // heard, as any batch
  }
  Status st = apply();
  const bool rejoined = setsockopt(sock_.fd(), SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, &group, sizeof group) == 0;
  const int rejoin_errno = errno;
  const auto after = sandbox_.kernel_generation();
  // Our batch moved the generation by one if it committed, else not at all.
  const std::uint32_t expected = *before + (st ? 1u : 0u);
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
  boost::asio::post(io_, [this, alive = alive_, rejoined, what] {
    if (!*alive || closed_) return;
    if (!rejoined) {
      int g = NFNLGRP_NFTABLES;
      if (setsockopt(sock_.fd(), SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, &g, sizeof g) < 0) {
        log()->error("nftables events: cannot subscribe again ({}); only the {} ms verification watches the table",
                     errno_text(errno), opts_.verify_interval.count());
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
  });
  return st;
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
  retry_timer_.expires_after(retry_delay_);
  retry_timer_.async_wait([this, alive = alive_](const boost::system::error_code& ec) {
    if (ec || !*alive) return;
    auto diffs = sandbox_.verify_table();
    if (diffs && diffs->empty()) {
      retry_delay_ = std::chrono::milliseconds{0};
      return;
    }
    if (auto r = restore(); r) {
      audit_event("tamper", {{"what", "restore retried"}, {"found_by", "retry"}, {"restored", true},
                             {"restore_us", *r}, {"phase", sandbox_.state().phase},
                             {"generation", sandbox_.state().generation}},
                  spdlog::level::warn);
    }
  });
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
