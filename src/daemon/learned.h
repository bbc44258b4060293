// The addresses the DNS proxy learned, per name, each until its set timeout
// runs out: what `status` lists, what a switch carries into the next phase's
// learned sets, and what pinning and `explain` ask ("which names resolved to
// this address?", answered from an address index, not a walk). Bounded:
// when full, expired pairs are swept (at most once a second, so a flood of
// answers never walks the store on every answer); still full, the pair is
// not remembered (the kernel set holds the address anyway). Time comes from
// the TimeSource it is given, so expiry is tested without waiting.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "egressd/clock.h"
#include "egressd/policy.h"

namespace egressd::daemon {

class LearnedStore {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Addr {
    IpPrefix addr;
    TimePoint expires;
  };

  LearnedStore(std::size_t max_pairs, TimeSource clock) : max_(max_pairs), clock_(std::move(clock)) {}

  // Remembers `addr` for `name` until now + ttl (extending, never
  // shortening, a pair already there). False when the store is full.
  bool remember(const std::string& name, const IpPrefix& addr, std::chrono::milliseconds ttl);

  TimePoint now() const { return clock_.steady(); }
  // True when `name` has an address that has not expired.
  bool live(const std::string& name) const;
  // The names `addr` was learned for, in name order: unexpired pairs only,
  // or every pair still remembered with `include_expired` (they still say
  // where an address came from).
  std::vector<std::string> names_for(const IpPrefix& addr, bool include_expired = false) const;
  // Unexpired pairs.
  std::size_t live_count() const;
  // Every remembered pair, expired ones included until swept, by name.
  const std::map<std::string, std::vector<Addr>>& by_name() const { return by_name_; }
  std::size_t size() const { return count_; }

 private:
  struct PrefixLess {
    bool operator()(const IpPrefix& a, const IpPrefix& b) const {
      if (a.family != b.family) return a.family < b.family;
      if (a.bytes != b.bytes) return a.bytes < b.bytes;
      return a.prefix_len < b.prefix_len;
    }
  };
  void sweep(TimePoint now, const std::string& keep);

  std::size_t max_;
  TimeSource clock_;
  std::map<std::string, std::vector<Addr>> by_name_;
  std::map<IpPrefix, std::set<std::string>, PrefixLess> by_addr_;  // every remembered pair, by address
  std::size_t count_ = 0;
  TimePoint next_sweep_{};
};

}  // namespace egressd::daemon
