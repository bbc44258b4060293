// The audit side of a Sandbox: denied records from NFLOG and the DNS proxy,
// and the `denied` and `hosts` control requests (docs/protocol.md).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "control/protocol.h"
#include "daemon/sandbox.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;

// Waiting `denied` requests at once (each holds a reply and a timer).
constexpr std::size_t kMaxWaiters = 64;

// The `denied` reply: `recs`, and the cursor for the next request.
json denied_reply(const std::vector<const audit::DeniedRecord*>& recs, std::uint64_t last_id) {
  control::DeniedReply r;
  r.records.reserve(recs.size());
  for (const auto* rec : recs) r.records.push_back(audit::to_json(*rec));
  r.last_id = last_id;
  return control::ok_reply(json(r));
}

}  // namespace

void Sandbox::denied_packet(const audit::LoggedPacket& pkt) {
  const bool fresh = denied_.add_packet(pkt.proto, pkt.dst, pkt.port, state_.phase,
                                        [&] { return names_.names_for(pkt.dst); }, opts_.clock.wall());
  if (fresh) wake_denied_waiters();
}

void Sandbox::wake_denied_waiters() {
  if (denied_waiters_.empty()) return;
  // Replies may re-enter handle() (a client asking again at once): take the list first.
  auto waiters = std::move(denied_waiters_);
  denied_waiters_.clear();
  for (auto& w : waiters) {
    auto recs = denied_.since(w.since, w.limit);
    if (recs.empty()) {
      denied_waiters_.push_back(std::move(w));
      continue;
    }
    w.reply(denied_reply(recs, denied_.last_id()));
  }
}

json Sandbox::audit_status() const {
  json j{{"denied_records", denied_.size()},
         {"denied_total", denied_.total()},
         {"denied_evicted", denied_.evicted()},
         {"names", names_.size()},
         {"names_evicted", names_.evicted()}};
  if (nflog_ != nullptr) {
    const auto s = nflog_->stats();
    j["log_group"] = opts_.policy.enforce.log_group;
    j["log_packets"] = s.packets;
    j["log_unparsable"] = s.unparsable;
    j["log_dropped"] = s.overruns;
  } else {
    j["log_group"] = nullptr;
  }
  return j;
}

json Sandbox::hosts_reply(const control::HostsRequest& req) const {
  control::HostsReply r;
  for (const auto& h : names_.hosts(req.phase.value_or(""))) {
    control::HostsEntry e{h.phase, h.name, h.resolved, h.refused, {}, audit::format_time(h.first),
                          audit::format_time(h.last)};
    for (const auto& a : h.addresses) e.addresses.push_back(a.to_string());
    r.hosts.push_back(std::move(e));
  }
  return control::ok_reply(json(r));
}

void Sandbox::denied_request(const control::DeniedRequest& req, control::Reply reply) {
  std::uint64_t since = req.since.value_or(0);
  const std::uint64_t limit = req.limit.value_or(control::kMaxDeniedLimit), wait_ms = req.wait_ms.value_or(0);
  // A cursor from before a restart (ids start again at 1): everything is new.
  if (since > denied_.last_id()) since = 0;
  auto recs = denied_.since(since, limit);
  if (!recs.empty() || wait_ms == 0 || !opts_.run_after || limit == 0) {
    return reply(denied_reply(recs, denied_.last_id()));
  }
  if (denied_waiters_.size() >= kMaxWaiters) {
    return reply(denied_reply({}, denied_.last_id()));
  }
  // Long-poll: the reply waits for the next record, or for wait_ms.
  const std::uint64_t id = next_waiter_++;
  denied_waiters_.push_back({id, since, static_cast<std::size_t>(limit), std::move(reply)});
  opts_.run_after(std::chrono::milliseconds(wait_ms), [this, id] {
    auto it = std::find_if(denied_waiters_.begin(), denied_waiters_.end(),
                           [&](const DeniedWaiter& w) { return w.id == id; });
    if (it == denied_waiters_.end()) return;
    auto w = std::move(*it);
    denied_waiters_.erase(it);
    w.reply(denied_reply({}, denied_.last_id()));
  });
}

}  // namespace egressd::daemon
