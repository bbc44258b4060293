#include "audit/denied.h"

#include <cstdio>
#include <ctime>

namespace egressd::audit {

std::string proto_name(std::uint8_t proto) {
  switch (proto) {
    case 1: return "icmp";
    case 6: return "tcp";
    case 17: return "udp";
    case 58: return "ipv6-icmp";
    case 132: return "sctp";
    case 136: return "udplite";
    default: return std::to_string(proto);
  }
}

std::string format_time(WallClock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms % 1000));
  return buf;
}

nlohmann::json to_json(const DeniedRecord& r) {
  using nlohmann::json;
  const bool packet = r.kind == DeniedKind::packet;
  json j{{"id", r.id},
         {"time", format_time(r.time)},
         {"last", format_time(r.last)},
         {"kind", packet ? "packet" : "dns"},
         {"proto", packet ? json(proto_name(r.proto)) : json(nullptr)},
         {"dst", r.dst ? json(r.dst->to_string()) : json(nullptr)},
         {"port", r.port ? json(*r.port) : json(nullptr)},
         {"names", r.names},
         {"phase", r.phase},
         {"count", r.count}};
  if (!r.pin.empty()) j["pin"] = r.pin;
  return j;
}

namespace {

// Records with the same key within the window are one burst.
std::string key_of(const DeniedRecord& r) {
  if (r.kind == DeniedKind::dns) return "d\n" + (r.names.empty() ? std::string() : r.names[0]) + '\n' + r.phase;
  return "p\n" + std::to_string(r.proto) + '\n' + (r.dst ? r.dst->to_string() : "-") + '\n' +
         (r.port ? std::to_string(*r.port) : "-") + '\n' + r.phase;
}

}  // namespace

DeniedLog::DeniedLog(DeniedOptions opts) : opts_(opts) {
  if (opts_.capacity == 0) opts_.capacity = 1;
}

DeniedRecord* DeniedLog::find(std::uint64_t id) {
  if (ring_.empty() || id < ring_.front().id || id > ring_.back().id) return nullptr;
  return &ring_[id - ring_.front().id];
}

bool DeniedLog::add(std::string key, DeniedRecord r, const std::function<std::vector<std::string>()>* names) {
  ++total_;
  if (auto it = recent_.find(key); it != recent_.end()) {
    DeniedRecord* old = find(it->second);
    if (old != nullptr && r.time - old->last <= opts_.window && r.time >= old->last) {
      ++old->count;
      old->last = r.time;
      return false;
    }
    recent_.erase(it);
  }
  if (ring_.size() >= opts_.capacity) {
    // recent_ never points at an evicted record: drop its key with it.
    const DeniedRecord& gone = ring_.front();
    if (auto it = recent_.find(key_of(gone)); it != recent_.end() && it->second == gone.id) recent_.erase(it);
    ring_.pop_front();
    ++evicted_;
  }
  r.id = next_id_++;
  r.last = r.time;
  if (names != nullptr && *names) r.names = (*names)();
  recent_[std::move(key)] = r.id;
  ring_.push_back(std::move(r));
  return true;
}

bool DeniedLog::add_packet(std::uint8_t proto, const IpPrefix& dst, std::optional<std::uint16_t> port,
                           const std::string& phase, const std::function<std::vector<std::string>()>& names,
                           WallClock::time_point now) {
  DeniedRecord r;
  r.time = now;
  r.kind = DeniedKind::packet;
  r.proto = proto;
  r.dst = dst;
  r.port = port;
  r.phase = phase;
  std::string key = key_of(r);
  return add(std::move(key), std::move(r), &names);
}

bool DeniedLog::add_pin_reset(const IpPrefix& dst, std::uint16_t port, const std::string& reason,
                              const std::string& phase, const std::function<std::vector<std::string>()>& names,
                              WallClock::time_point now) {
  DeniedRecord r;
  r.time = now;
  r.kind = DeniedKind::packet;
  r.proto = 6;
  r.dst = dst;
  r.port = port;
  r.phase = phase;
  r.pin = reason;
  std::string key = key_of(r) + "\npin\n" + reason;
  return add(std::move(key), std::move(r), &names);
}

bool DeniedLog::add_dns(const std::string& name, const std::string& phase, WallClock::time_point now) {
  DeniedRecord r;
  r.time = now;
  r.kind = DeniedKind::dns;
  r.names = {name};
  r.phase = phase;
  std::string key = key_of(r);
  return add(std::move(key), std::move(r), nullptr);
}

std::vector<const DeniedRecord*> DeniedLog::since(std::uint64_t since, std::size_t limit) const {
  std::vector<const DeniedRecord*> out;
  if (ring_.empty() || since >= ring_.back().id) return out;
  std::size_t start = since < ring_.front().id ? 0 : static_cast<std::size_t>(since - ring_.front().id + 1);
  if (ring_.size() - start > limit) start = ring_.size() - limit;
  for (std::size_t i = start; i < ring_.size(); ++i) out.push_back(&ring_[i]);
  return out;
}

}  // namespace egressd::audit
