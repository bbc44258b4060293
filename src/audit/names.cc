#include "audit/names.h"

#include <algorithm>

namespace egressd::audit {

NameIndex::NameIndex(NameIndexOptions opts) : opts_(opts) {
  if (opts_.max_entries == 0) opts_.max_entries = 1;
  if (opts_.max_addrs_per_name == 0) opts_.max_addrs_per_name = 1;
}

NameIndex::Lru::iterator NameIndex::touch(const std::string& phase, const std::string& name,
                                          WallClock::time_point now) {
  const std::string k = key(phase, name);
  if (auto it = entries_.find(k); it != entries_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    it->second->last = now;
    return it->second;
  }
  if (entries_.size() >= opts_.max_entries) {
    // Forget the least recently seen entry and its share of the reverse index.
    Entry& old = lru_.back();
    for (const Addr& a : old.addrs) unlink(a.addr, old.name);
    entries_.erase(key(old.phase, old.name));
    lru_.pop_back();
    ++evicted_;
  }
  if (std::find(phase_order_.begin(), phase_order_.end(), phase) == phase_order_.end()) {
    phase_order_.push_back(phase);
  }
  lru_.push_front(Entry{phase, name, 0, 0, {}, now, now});
  entries_.emplace(k, lru_.begin());
  return lru_.begin();
}

void NameIndex::link(const IpPrefix& addr, const std::string& name, std::uint64_t tick) {
  NameRef& r = by_addr_[addr_key(addr)][name];
  ++r.refs;
  r.tick = std::max(r.tick, tick);
}

void NameIndex::unlink(const IpPrefix& addr, const std::string& name) {
  auto it = by_addr_.find(addr_key(addr));
  if (it == by_addr_.end()) return;
  auto n = it->second.find(name);
  if (n == it->second.end()) return;
  if (--n->second.refs == 0) it->second.erase(n);
  if (it->second.empty()) by_addr_.erase(it);
}

void NameIndex::observe(const std::string& phase, const std::string& name, const std::vector<IpPrefix>& addrs,
                        WallClock::time_point now) {
  auto e = touch(phase, name, now);
  ++e->resolved;
  for (const IpPrefix& a : addrs) {
    const std::uint64_t t = ++tick_;
    auto same = std::find_if(e->addrs.begin(), e->addrs.end(), [&](const Addr& x) { return x.addr == a; });
    if (same != e->addrs.end()) {
      same->tick = t;
      by_addr_[addr_key(a)][name].tick = t;
      continue;
    }
    if (e->addrs.size() >= opts_.max_addrs_per_name) {
      // A name with many rotating addresses (a CDN) keeps its latest ones.
      auto oldest = std::min_element(e->addrs.begin(), e->addrs.end(),
                                     [](const Addr& x, const Addr& y) { return x.tick < y.tick; });
      unlink(oldest->addr, name);
      e->addrs.erase(oldest);
    }
    e->addrs.push_back({a, t});
    link(a, name, t);
  }
}

void NameIndex::refused(const std::string& phase, const std::string& name, WallClock::time_point now) {
  ++touch(phase, name, now)->refused;
}

std::vector<std::string> NameIndex::names_for(const IpPrefix& addr) const {
  std::vector<std::string> out;
  auto it = by_addr_.find(addr_key(addr));
  if (it == by_addr_.end()) return out;
  std::vector<std::pair<std::uint64_t, const std::string*>> v;
  v.reserve(it->second.size());
  for (const auto& [name, ref] : it->second) v.emplace_back(ref.tick, &name);
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  out.reserve(v.size());
  for (const auto& [tick, name] : v) out.push_back(*name);
  return out;
}

std::vector<HostEntry> NameIndex::hosts(const std::string& phase) const {
  std::vector<HostEntry> out;
  for (const Entry& e : lru_) {
    if (!phase.empty() && e.phase != phase) continue;
    HostEntry h{e.phase, e.name, e.resolved, e.refused, {}, e.first, e.last};
    std::vector<Addr> addrs = e.addrs;
    std::sort(addrs.begin(), addrs.end(), [](const Addr& a, const Addr& b) { return a.tick > b.tick; });
    for (const Addr& a : addrs) h.addresses.push_back(a.addr);
    out.push_back(std::move(h));
  }
  auto rank = [&](const std::string& p) {
    return std::find(phase_order_.begin(), phase_order_.end(), p) - phase_order_.begin();
  };
  std::sort(out.begin(), out.end(), [&](const HostEntry& a, const HostEntry& b) {
    const auto ra = rank(a.phase), rb = rank(b.phase);
    return ra != rb ? ra < rb : a.name < b.name;
  });
  return out;
}

}  // namespace egressd::audit
