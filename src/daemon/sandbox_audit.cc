// The audit side of a Sandbox: denied records from NFLOG and the DNS proxy,
// and the `denied` and `hosts` control requests (docs/protocol.md).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "control/protocol.h"
#include "daemon/sandbox.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;

// A `denied` long-poll waits at most this long; clients re-ask.
constexpr std::uint64_t kMaxWaitMs = 60000;
// Waiting `denied` requests at once (each holds a reply and a timer).
constexpr std::size_t kMaxWaiters = 64;

json records_json(const std::vector<const audit::DeniedRecord*>& recs) {
  json out = json::array();
  for (const auto* r : recs) out.push_back(audit::to_json(*r));
  return out;
}

// An unsigned integer field, or an error reply naming it.
std::optional<json> read_uint(const json& req, const char* key, std::uint64_t max, std::uint64_t& out) {
  if (!req.contains(key)) return std::nullopt;
  const json& v = req[key];
  const bool non_negative = v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0);
  if (!non_negative || v.get<std::uint64_t>() > max) {
    return control::error_reply("invalid_request", std::string("\"") + key + "\" must be an integer from 0 to " +
                                                       std::to_string(max));
  }
  out = v.get<std::uint64_t>();
  return std::nullopt;
}

}  // namespace

void Sandbox::denied_packet(const audit::LoggedPacket& pkt) {
  const bool fresh = denied_.add_packet(pkt.proto, pkt.dst, pkt.port, state_.phase,
                                        [&] { return names_.names_for(pkt.dst); });
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
    w.reply(control::ok_reply({{"records", records_json(recs)}, {"last_id", denied_.last_id()}}));
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

void Sandbox::handle_audit(const json& req, std::function<void(json)> reply) {
  using control::error_reply;
  using control::ok_reply;
  const std::string cmd = req.value("cmd", "");
  for (const auto& [k, v] : req.items()) {
    const bool known = k == "cmd" || (cmd == "denied" && (k == "since" || k == "limit" || k == "wait_ms")) ||
                       (cmd == "hosts" && k == "phase");
    if (!known) return reply(error_reply("invalid_request", "unknown field \"" + k + "\" for command " + cmd));
  }
  if (cmd == "hosts") {
    std::string phase;
    if (req.contains("phase")) {
      if (!req["phase"].is_string()) return reply(error_reply("invalid_request", "\"phase\" must be a string"));
      phase = req["phase"].get<std::string>();
    }
    json hosts = json::array();
    for (const auto& h : names_.hosts(phase)) {
      json addrs = json::array();
      for (const auto& a : h.addresses) addrs.push_back(a.to_string());
      hosts.push_back({{"phase", h.phase},
                       {"name", h.name},
                       {"resolved", h.resolved},
                       {"refused", h.refused},
                       {"addresses", addrs},
                       {"first", audit::format_time(h.first)},
                       {"last", audit::format_time(h.last)}});
    }
    return reply(ok_reply({{"hosts", hosts}}));
  }
  std::uint64_t since = 0, limit = 1000000, wait_ms = 0;
  if (auto e = read_uint(req, "since", UINT64_MAX, since)) return reply(*e);
  if (auto e = read_uint(req, "limit", 1000000, limit)) return reply(*e);
  if (auto e = read_uint(req, "wait_ms", kMaxWaitMs, wait_ms)) return reply(*e);
  // A cursor from before a restart (ids start again at 1): everything is new.
  if (since > denied_.last_id()) since = 0;
  auto recs = denied_.since(since, limit);
  if (!recs.empty() || wait_ms == 0 || !opts_.run_after || limit == 0) {
    return reply(ok_reply({{"records", records_json(recs)}, {"last_id", denied_.last_id()}}));
  }
  if (denied_waiters_.size() >= kMaxWaiters) {
    return reply(ok_reply({{"records", json::array()}, {"last_id", denied_.last_id()}}));
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
    w.reply(control::ok_reply({{"records", json::array()}, {"last_id", denied_.last_id()}}));
  });
}

}  // namespace egressd::daemon
