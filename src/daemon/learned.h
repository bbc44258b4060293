// The addresses the DNS proxy learned, per name, each until its set timeout
// runs out: what `status` lists, what a switch carries into the next phase's
// learned sets, and what pinning and `explain` ask ("which names resolved to
// this address?", answered from an address index, not a walk). Bounded:
// when full, expired pairs are swept (at most once a second, so a flood of
// answers never walks the store on every answer); still full, the pair is
// not remembered (the kernel set holds the address anyway). Time comes from
// the TimeSource it is given, so expiry is tested without waiting.
//
// Pairs from a hosts file (--hosts-file, issue 16 point 7) live here too,
// so pinning and `explain` see them like DNS answers: they do not expire
// while set_hosts keeps them; dropped from it, a pair falls back to what DNS
// taught for it (expired, or gone at the next sweep, if nothing).
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "egressd/clock.h"
#include "egressd/policy.h"

namespace egressd::daemon {

class LearnedStore {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Addr {
    IpPrefix addr;
    TimePoint expires;          // TimePoint::max() while from the hosts file
    bool hosts = false;         // set_hosts holds it
    TimePoint dns_expires{};    // what DNS answers alone give it (epoch: none)
  };
  using HostsPairs = std::map<std::string, std::vector<IpPrefix>>;

  LearnedStore(std::size_t max_pairs, TimeSource clock) : max_(max_pairs), clock_(std::move(clock)) {}

  // Remembers `addr` for `name` until now + ttl (extending, never
  // shortening, a pair already there). False when the store is full.
  bool remember(const std::string& name, const IpPrefix& addr, std::chrono::milliseconds ttl);

  // Makes `pairs` the hosts-file pairs (replacing the previous ones; a pair
  // that was one and is not in `pairs` keeps only its DNS expiry). Returns
  // how many pairs were not remembered because the store is full.
  std::size_t set_hosts(const HostsPairs& pairs);

  TimePoint now() const { return clock_.steady(); }
  // True when `name` has an address that has not expired.
  bool live(const std::string& name) const;
  // True when DNS gave `name` the address `addr` until `t` or later, not the
  // hosts file (whose pairs the kernel times out on a clock of their own).
  bool dns_pair_until(const std::string& name, const IpPrefix& addr, TimePoint t) const;
  // The names `addr` was learned for, in name order: unexpired pairs only,
  // or every pair still remembered with `include_expired` (they still say
  // where an address came from).
  std::vector<std::string> names_for(const IpPrefix& addr, bool include_expired = false) const;
  // How many names are remembered for `addr` (expired ones included), without copying them.
  std::size_t name_count(const IpPrefix& addr) const {
    const auto it = by_addr_.find(addr);
    return it == by_addr_.end() ? 0 : it->second.names.size();
  }
  // How long the latest DNS expiry of any pair with `addr` is away (zero when
  // all have passed): what its learned set element has left, as far as DNS
  // answers go. O(log addresses).
  std::chrono::milliseconds dns_left(const IpPrefix& addr) const;
  // Up to `limit` names with an unexpired pair for `addr`, in name order,
  // looking at no more than 4 x `limit` of its names (an address behind a
  // wildcard may have thousands): what an element comment can hold.
  std::vector<std::string> some_live_names(const IpPrefix& addr, std::size_t limit) const;
  // True when a hosts-file pair (set_hosts) has `addr`. O(log addresses).
  bool from_hosts(const IpPrefix& addr) const;
  // True when the next new pair is not remembered unless a sweep frees room.
  bool full() const { return count_ >= max_; }
  // Whether the pair (`name`, `addr`) would be remembered: it is here
  // already, or the store has room (after a sweep, at most once a second)
  // and `name` has fewer than `per_name` addresses. What a sandbox may put
  // into the kernel: a zone under an allowed wildcard that invents
  // addresses must not grow the learned sets without bound (attack review 9).
  bool room_for(const std::string& name, const IpPrefix& addr, std::size_t per_name);
  // Unexpired pairs.
  std::size_t live_count() const;
  // Every remembered pair, expired ones included until swept, by name.
  const std::map<std::string, std::vector<Addr>>& by_name() const { return by_name_; }
  std::size_t size() const { return count_; }

 private:
  void sweep(TimePoint now, const std::string& keep);

  std::size_t max_;
  TimeSource clock_;
  std::map<std::string, std::vector<Addr>> by_name_;
  struct ByAddr {
    std::set<std::string> names;  // every remembered pair of the address
    TimePoint dns_expires{};      // the latest DNS expiry of any of them (epoch: none)
  };
  // One map for both, so a new pair costs one lookup here (issue 17's CPU per answer).
  std::map<IpPrefix, ByAddr, IpPrefixLess> by_addr_;
  std::set<IpPrefix, IpPrefixLess> hosts_addrs_;  // addresses of hosts-file pairs
  std::size_t count_ = 0;
  TimePoint next_sweep_{};
};

// The comment a learned set element carries (docs/pinning.md "Restarts"):
// `names` (normalized; in priority order, duplicates ignored) joined by one
// space, sorted, keeping in priority order those that fit in `max_bytes`
// (nft's limit on element comments); a name that does not fit is left out.
std::string names_comment(const std::vector<std::string>& names, std::size_t max_bytes);
// The names in such a comment. The kernel keeps whatever anyone wrote, so a
// word that is not a normalized name (lower-case letters, digits, '-', '_',
// '.', at most 253 bytes) is skipped: it never reaches pinning or a log.
std::vector<std::string> names_from_comment(std::string_view comment);

}  // namespace egressd::daemon
