#include "daemon/learned.h"

#include <algorithm>

namespace egressd::daemon {

bool LearnedStore::remember(const std::string& name, const IpPrefix& addr, std::chrono::milliseconds ttl) {
  const TimePoint now = clock_.steady();
  const TimePoint expires = now + ttl;
  auto& v = by_name_[name];
  // Only extended: a pair's expiry never shrinks, and one swept had passed.
  for (auto& a : v) {
    if (a.addr == addr) {
      a.dns_expires = std::max(a.dns_expires, expires);
      if (!a.hosts) a.expires = a.dns_expires;
      auto& at = by_addr_[addr];
      at.dns_expires = std::max(at.dns_expires, expires);
      return true;
    }
  }
  if (count_ >= max_) {
    sweep(now, name);
    if (count_ >= max_) {
      if (v.empty()) by_name_.erase(name);
      return false;
    }
  }
  v.push_back({addr, expires, false, expires});
  auto& at = by_addr_[addr];
  at.names.insert(name);
  at.dns_expires = std::max(at.dns_expires, expires);
  ++count_;
  return true;
}

bool LearnedStore::room_for(const std::string& name, const IpPrefix& addr, std::size_t per_name) {
  const auto it = by_name_.find(name);
  if (it != by_name_.end()) {
    if (std::any_of(it->second.begin(), it->second.end(), [&](const Addr& a) { return a.addr == addr; })) return true;
    if (it->second.size() >= per_name) {
      sweep(clock_.steady(), name);
      if (it->second.size() >= per_name) return false;
    }
  }
  if (count_ >= max_) sweep(clock_.steady(), name);
  return count_ < max_;
}

std::size_t LearnedStore::set_hosts(const HostsPairs& pairs) {
  auto listed = [&](const std::string& name, const IpPrefix& addr) {
    auto it = pairs.find(name);
    return it != pairs.end() && std::find(it->second.begin(), it->second.end(), addr) != it->second.end();
  };
  // Pairs the file no longer has: back to their DNS expiry (the sweep
  // removes them once that has passed).
  for (auto& [name, addrs] : by_name_) {
    for (auto& a : addrs) {
      if (a.hosts && !listed(name, a.addr)) {
        a.hosts = false;
        a.expires = a.dns_expires;
      }
    }
  }
  std::size_t missed = 0;
  const TimePoint now = clock_.steady();
  for (const auto& [name, list] : pairs) {
    for (const auto& addr : list) {
      auto& v = by_name_[name];
      auto it = std::find_if(v.begin(), v.end(), [&](const Addr& a) { return a.addr == addr; });
      if (it != v.end()) {
        it->hosts = true;
        it->expires = TimePoint::max();
        continue;
      }
      if (count_ >= max_) sweep(now, name);
      if (count_ >= max_) {
        ++missed;
        if (v.empty()) by_name_.erase(name);
        continue;
      }
      v.push_back({addr, TimePoint::max(), true, TimePoint{}});
      by_addr_[addr].names.insert(name);
      ++count_;
    }
  }
  // from_hosts is asked for every DNS answer: an index, not a walk over the
  // names of an address (a wildcard gives one address thousands of names).
  // Hosts pairs are never swept, so only this function changes the index.
  hosts_addrs_.clear();
  for (const auto& [name, addrs] : by_name_) {
    for (const auto& a : addrs) {
      if (a.hosts) hosts_addrs_.insert(a.addr);
    }
  }
  return missed;
}

void LearnedStore::sweep(TimePoint now, const std::string& keep) {
  if (now < next_sweep_) return;
  next_sweep_ = now + std::chrono::seconds(1);
  for (auto it = by_name_.begin(); it != by_name_.end();) {
    auto& addrs = it->second;
    std::erase_if(addrs, [&](const Addr& a) {
      if (a.expires > now) return false;
      auto at = by_addr_.find(a.addr);
      if (at != by_addr_.end()) {
        at->second.names.erase(it->first);
        if (at->second.names.empty()) by_addr_.erase(at);
      }
      --count_;
      return true;
    });
    it = addrs.empty() && it->first != keep ? by_name_.erase(it) : std::next(it);
  }
}

bool LearnedStore::live(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return false;
  const TimePoint now = clock_.steady();
  return std::any_of(it->second.begin(), it->second.end(), [&](const Addr& a) { return a.expires > now; });
}

bool LearnedStore::dns_pair_until(const std::string& name, const IpPrefix& addr, TimePoint t) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(),
                     [&](const Addr& a) { return a.addr == addr && !a.hosts && a.expires >= t; });
}

std::vector<std::string> LearnedStore::names_for(const IpPrefix& addr, bool include_expired) const {
  std::vector<std::string> out;
  auto at = by_addr_.find(addr);
  if (at == by_addr_.end()) return out;
  const TimePoint now = clock_.steady();
  for (const auto& name : at->second.names) {
    if (include_expired) {
      out.push_back(name);
      continue;
    }
    const auto& addrs = by_name_.at(name);
    if (std::any_of(addrs.begin(), addrs.end(), [&](const Addr& a) { return a.addr == addr && a.expires > now; }))
      out.push_back(name);
  }
  return out;
}

std::chrono::milliseconds LearnedStore::dns_left(const IpPrefix& addr) const {
  const auto it = by_addr_.find(addr);
  const TimePoint now = clock_.steady();
  if (it == by_addr_.end() || it->second.dns_expires <= now) return std::chrono::milliseconds(0);
  return std::chrono::ceil<std::chrono::milliseconds>(it->second.dns_expires - now);
}

std::vector<std::string> LearnedStore::some_live_names(const IpPrefix& addr, std::size_t limit) const {
  std::vector<std::string> out;
  const auto at = by_addr_.find(addr);
  if (at == by_addr_.end()) return out;
  const TimePoint now = clock_.steady();
  std::size_t looked = 0;
  for (const auto& name : at->second.names) {
    if (out.size() >= limit || looked++ >= 4 * limit) break;
    const auto& addrs = by_name_.at(name);
    if (std::any_of(addrs.begin(), addrs.end(), [&](const Addr& a) { return a.addr == addr && a.expires > now; }))
      out.push_back(name);
  }
  return out;
}

bool LearnedStore::from_hosts(const IpPrefix& addr) const { return hosts_addrs_.contains(addr); }

std::size_t LearnedStore::live_count() const {
  const TimePoint now = clock_.steady();
  std::size_t n = 0;
  for (const auto& [name, addrs] : by_name_) {
    for (const auto& a : addrs) n += a.expires > now ? 1 : 0;
  }
  return n;
}

std::string names_comment(const std::vector<std::string>& names, std::size_t max_bytes) {
  std::vector<std::string> kept;
  std::size_t used = 0;
  for (const auto& n : names) {
    if (n.empty() || std::find(kept.begin(), kept.end(), n) != kept.end()) continue;
    const std::size_t cost = n.size() + (kept.empty() ? 0 : 1);
    if (used + cost > max_bytes) continue;
    kept.push_back(n);
    used += cost;
  }
  std::sort(kept.begin(), kept.end());
  std::string out;
  for (const auto& n : kept) out += (out.empty() ? "" : " ") + n;
  return out;
}

std::vector<std::string> names_from_comment(std::string_view comment) {
  auto name_char = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
  };
  std::vector<std::string> out;
  while (!comment.empty()) {
    const std::size_t sp = comment.find(' ');
    const std::string_view word = comment.substr(0, sp);
    comment = sp == std::string_view::npos ? std::string_view{} : comment.substr(sp + 1);
    if (word.empty() || word.size() > 253 || !std::all_of(word.begin(), word.end(), name_char)) continue;
    if (word.front() == '.' || word.back() == '.' || word.find("..") != std::string_view::npos) continue;
    if (std::find(out.begin(), out.end(), word) == out.end()) out.emplace_back(word);
  }
  return out;
}

}  // namespace egressd::daemon
