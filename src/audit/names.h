// Name attribution: which hostnames the sandbox resolved through egressd, per
// phase, and which names an address came from. Fed by the DNS proxy's answers
// (every mode, `public` included) and by its refusals (name only: a refused
// name is never resolved upstream, that is the exfiltration channel egressd
// closes). Read by `denied` (names behind a blocked address), `hosts` and
// `explain`.
//
// Bounded: at most `max_entries` (phase, name) entries and `max_addrs_per_name`
// addresses each; the least recently seen entry (address) goes first.
// Not thread-safe: owned by one Sandbox on one event loop.
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "egressd/policy.h"

namespace egressd::audit {

using WallClock = std::chrono::system_clock;

struct NameIndexOptions {
  std::size_t max_entries = 8192;       // (phase, name) pairs
  std::size_t max_addrs_per_name = 16;  // addresses kept per (phase, name)
};

// One (phase, name) as `hosts` reports it.
struct HostEntry {
  std::string phase;
  std::string name;
  std::uint64_t resolved = 0;  // answers with addresses seen
  std::uint64_t refused = 0;   // queries answered locally (REFUSED/NXDOMAIN by policy)
  std::vector<IpPrefix> addresses;  // most recent first
  WallClock::time_point first{}, last{};
};

class NameIndex {
 public:
  explicit NameIndex(NameIndexOptions opts = {});

  // One answer: `name` (lower-case, no trailing dot) resolved to `addrs`
  // (single addresses) while `phase` was in force.
  void observe(const std::string& phase, const std::string& name, const std::vector<IpPrefix>& addrs,
               WallClock::time_point now = WallClock::now());
  // A query for `name` was refused under `phase` (recorded by name only).
  void refused(const std::string& phase, const std::string& name, WallClock::time_point now = WallClock::now());

  // The names `addr` (a single address) was answered for, in any phase, most
  // recently seen first; empty when none is remembered.
  std::vector<std::string> names_for(const IpPrefix& addr) const;

  // Every entry, ordered by phase (in order of first appearance), then name.
  // `phase` non-empty: only that phase's entries.
  std::vector<HostEntry> hosts(const std::string& phase = "") const;

  std::size_t size() const { return entries_.size(); }
  std::uint64_t evicted() const { return evicted_; }

 private:
  struct Addr {
    IpPrefix addr;
    std::uint64_t tick;
  };
  struct Entry {
    std::string phase, name;
    std::uint64_t resolved = 0, refused = 0;
    std::vector<Addr> addrs;
    WallClock::time_point first{}, last{};
  };
  using Lru = std::list<Entry>;  // front = most recently seen
  // Lookups by (phase, name) without building a key string.
  struct PhaseName {
    std::string_view phase, name;
    friend bool operator==(const PhaseName&, const PhaseName&) = default;
  };
  struct PhaseNameHash {
    std::size_t operator()(const PhaseName& k) const;
  };

  Lru::iterator touch(const std::string& phase, const std::string& name, WallClock::time_point now);

  NameIndexOptions opts_;
  Lru lru_;
  // Keys view the phase and name strings of their Lru entry (list nodes never move).
  std::unordered_map<PhaseName, Lru::iterator, PhaseNameHash> entries_;
  std::vector<std::string> phase_order_;
  std::uint64_t tick_ = 0;
  std::uint64_t evicted_ = 0;
};

}  // namespace egressd::audit
