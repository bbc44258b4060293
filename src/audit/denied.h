// Denied-connection records: what the sandbox tried and was refused, with the
// hostnames behind the address. A bounded ring with burst de-duplication: a
// client retrying one blocked connection a thousand times is one record with
// count 1000, not a thousand records.
//
// Not thread-safe: owned by one Sandbox on one event loop.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "egressd/policy.h"

namespace egressd::audit {

using WallClock = std::chrono::system_clock;

struct DeniedOptions {
  std::size_t capacity = 1024;  // records kept; the oldest goes first
  // A denial with the same key as a record last bumped at most this long ago
  // bumps that record (count, last) instead of adding one.
  std::chrono::milliseconds window{10000};
};

enum class DeniedKind { packet, dns };

struct DeniedRecord {
  std::uint64_t id = 0;  // 1, 2, ... in order of creation; the `since` cursor
  WallClock::time_point time{}, last{};
  DeniedKind kind = DeniedKind::packet;
  std::uint8_t proto = 0;          // IP protocol number (packet)
  std::optional<IpPrefix> dst;     // packet only
  std::optional<std::uint16_t> port;  // tcp/udp/sctp/udplite destination port
  std::vector<std::string> names;  // packet: names that resolved to dst; dns: the refused name
  std::string phase;
  std::uint64_t count = 1;
  // packet: a flow hostname pinning reset, with decide()'s line ("tls sni
  // same-ip.test to 203.0.113.10:443; address learned for allowed.test"); "" otherwise.
  std::string pin;
};

// "tcp", "udp", "icmp", "ipv6-icmp", "sctp", "udplite", else the number as text.
std::string proto_name(std::uint8_t proto);
// ISO 8601 UTC with milliseconds: "2026-11-30T20:18:07.123Z".
std::string format_time(WallClock::time_point t);
// The documented JSON shape (docs/protocol.md).
nlohmann::json to_json(const DeniedRecord& r);

class DeniedLog {
 public:
  explicit DeniedLog(DeniedOptions opts = {});

  // A logged packet. `names` is called only when a new record is made (a
  // bump keeps the first record's names). Returns true for a new record.
  bool add_packet(std::uint8_t proto, const IpPrefix& dst, std::optional<std::uint16_t> port,
                  const std::string& phase, const std::function<std::vector<std::string>()>& names,
                  WallClock::time_point now = WallClock::now());
  // A flow hostname pinning reset: `reason` is decide()'s line.
  bool add_pin_reset(const IpPrefix& dst, std::uint16_t port, const std::string& reason, const std::string& phase,
                     const std::function<std::vector<std::string>()>& names, WallClock::time_point now = WallClock::now());
  // A refused DNS query for `name`. Returns true for a new record.
  bool add_dns(const std::string& name, const std::string& phase, WallClock::time_point now = WallClock::now());

  // Records with id > `since`, oldest first, at most `limit` (the newest ones).
  std::vector<const DeniedRecord*> since(std::uint64_t since, std::size_t limit = SIZE_MAX) const;
  std::uint64_t last_id() const { return next_id_ - 1; }
  std::size_t size() const { return ring_.size(); }
  std::uint64_t total() const { return total_; }      // denials seen (sum of counts ever)
  std::uint64_t evicted() const { return evicted_; }  // records pushed out of the ring

 private:
  bool add(std::string key, DeniedRecord r, const std::function<std::vector<std::string>()>* names);
  DeniedRecord* find(std::uint64_t id);

  DeniedOptions opts_;
  std::deque<DeniedRecord> ring_;  // ids ascending, contiguous
  std::unordered_map<std::string, std::uint64_t> recent_;  // dedupe key -> id of its record
  std::uint64_t next_id_ = 1;
  std::uint64_t total_ = 0;
  std::uint64_t evicted_ = 0;
};

}  // namespace egressd::audit
