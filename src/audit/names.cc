#include "audit/names.h"

#include <algorithm>

namespace egressd::audit {

NameIndex::NameIndex(NameIndexOptions opts) : opts_(opts) {
  if (opts_.max_entries == 0) opts_.max_entries = 1;
  if (opts_.max_addrs_per_name == 0) opts_.max_addrs_per_name = 1;
}

std::size_t NameIndex::PhaseNameHash::operator()(const PhaseName& k) const {
  const std::size_t a = std::hash<std::string_view>{}(k.phase), b = std::hash<std::string_view>{}(k.name);
  return a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
}

NameIndex::Lru::iterator NameIndex::touch(const std::string& phase, const std::string& name,
                                          WallClock::time_point now) {
  if (auto it = entries_.find(PhaseName{phase, name}); it != entries_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    it->second->last = now;
    return it->second;
  }
  if (std::find(phase_order_.begin(), phase_order_.end(), phase) == phase_order_.end()) {
    phase_order_.push_back(phase);
  }
  if (entries_.size() >= opts_.max_entries) {
    // Forget the least recently seen entry. Its list and map nodes (and its
    // strings' buffers) become the new entry's: a full index, which a stream
    // of new names keeps it, then allocates nothing per answer.
    auto oldest = std::prev(lru_.end());
    auto node = entries_.extract(PhaseName{oldest->phase, oldest->name});
    ++evicted_;
    oldest->phase = phase;
    oldest->name = name;
    oldest->resolved = oldest->refused = 0;
    oldest->addrs.clear();
    oldest->first = oldest->last = now;
    lru_.splice(lru_.begin(), lru_, oldest);
    if (node.empty()) {
      entries_.emplace(PhaseName{oldest->phase, oldest->name}, oldest);
    } else {
      node.key() = PhaseName{oldest->phase, oldest->name};
      node.mapped() = oldest;
      entries_.insert(std::move(node));
    }
    return oldest;
  }
  lru_.push_front(Entry{phase, name, 0, 0, {}, now, now});
  entries_.emplace(PhaseName{lru_.front().phase, lru_.front().name}, lru_.begin());
  return lru_.begin();
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
      continue;
    }
    if (e->addrs.size() >= opts_.max_addrs_per_name) {
      // A name with many rotating addresses (a CDN) keeps its latest ones.
      auto oldest = std::min_element(e->addrs.begin(), e->addrs.end(),
                                     [](const Addr& x, const Addr& y) { return x.tick < y.tick; });
      e->addrs.erase(oldest);
    }
    e->addrs.push_back({a, t});
  }
}

void NameIndex::refused(const std::string& phase, const std::string& name, WallClock::time_point now) {
  ++touch(phase, name, now)->refused;
}

// A scan, not a reverse index: answers arrive thousands of times a second and
// each would have to update the index (measured: 7 % of the proxy's CPU at
// 30k qps), while this is asked only for a new denied record (the kernel logs
// at most 100 packets a second) or an `explain`. 8192 entries of a few
// addresses each take tens of microseconds.
std::vector<std::string> NameIndex::names_for(const IpPrefix& addr) const {
  const std::size_t n = addr.family == 4 ? 4 : 16;
  std::vector<std::pair<std::uint64_t, const std::string*>> v;
  for (const Entry& e : lru_) {
    for (const Addr& a : e.addrs) {
      if (a.addr.family == addr.family && std::equal(addr.bytes.begin(), addr.bytes.begin() + n, a.addr.bytes.begin())) {
        v.emplace_back(a.tick, &e.name);
        break;
      }
    }
  }
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> out;
  out.reserve(v.size());
  for (const auto& [tick, name] : v) {
    // The same name in several phases: once, where it was seen last.
    if (std::find(out.begin(), out.end(), *name) == out.end()) out.push_back(*name);
  }
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
