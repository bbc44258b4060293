#include "nft/model.h"

#include <algorithm>

namespace egressd::nft {

namespace {

// Addresses as 128-bit big-endian byte arrays compare lexicographically, which
// is numeric order; IPv4 uses the first 4 bytes and zeros after.
using Bytes = std::array<std::uint8_t, 16>;

Bytes range_start(const IpPrefix& p) {
  Bytes b = p.bytes;
  const std::size_t n = p.size();
  for (std::size_t bit = p.prefix_len; bit < n * 8; ++bit) b[bit / 8] &= static_cast<std::uint8_t>(~(0x80u >> (bit % 8)));
  return b;
}

Bytes range_end(const IpPrefix& p) {
  Bytes b = p.bytes;
  const std::size_t n = p.size();
  for (std::size_t bit = p.prefix_len; bit < n * 8; ++bit) b[bit / 8] |= static_cast<std::uint8_t>(0x80u >> (bit % 8));
  return b;
}

IpPrefix addr(int family, const Bytes& b) {
  IpPrefix p;
  p.family = family;
  p.bytes = b;
  p.prefix_len = static_cast<std::uint8_t>(family == 4 ? 32 : 128);
  return p;
}

}  // namespace

bool increment(std::array<std::uint8_t, 16>& b, std::size_t n) {
  for (std::size_t i = n; i-- > 0;) {
    if (++b[i] != 0) return true;
  }
  return false;
}

std::string_view to_string(Family f) { return f == Family::netdev ? "netdev" : "inet"; }

std::vector<SetElem> make_interval_elems(const std::vector<IpPrefix>& prefixes) {
  if (prefixes.empty()) return {};
  const int family = prefixes.front().family;
  const std::size_t n = prefixes.front().size();
  std::vector<std::pair<Bytes, Bytes>> ranges;
  ranges.reserve(prefixes.size());
  for (const auto& p : prefixes) ranges.emplace_back(range_start(p), range_end(p));
  std::sort(ranges.begin(), ranges.end());

  std::vector<SetElem> out;
  Bytes cur_from = ranges[0].first, cur_to = ranges[0].second;
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    Bytes next_after = cur_to;
    const bool fits = increment(next_after, n);
    // Overlapping or adjacent (or cur_to is the top of the space): merge.
    if (!fits || ranges[i].first <= next_after) {
      if (ranges[i].second > cur_to) cur_to = ranges[i].second;
      continue;
    }
    out.push_back({addr(family, cur_from), addr(family, cur_to), 0});
    cur_from = ranges[i].first;
    cur_to = ranges[i].second;
  }
  out.push_back({addr(family, cur_from), addr(family, cur_to), 0});
  return out;
}

std::vector<SetElem> make_addr_elems(const std::vector<IpPrefix>& addrs) {
  std::vector<Bytes> v;
  v.reserve(addrs.size());
  for (const auto& a : addrs) v.push_back(a.bytes);
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  std::vector<SetElem> out;
  out.reserve(v.size());
  const int family = addrs.empty() ? 4 : addrs.front().family;
  for (const auto& b : v) out.push_back({addr(family, b), addr(family, b), 0});
  return out;
}

}  // namespace egressd::nft
