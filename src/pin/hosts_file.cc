#include "pin/hosts_file.h"

#include <set>

#include "pin/verdict.h"

namespace egressd::pin {
namespace {

// Printable, bounded: a garbage line must not put control bytes or a
// megabyte into a log line.
std::string quoted(std::string_view s) {
  constexpr std::size_t kMax = 64;
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    out += (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') ? static_cast<char>(c) : '?';
  }
  if (s.size() > kMax) out += "...";
  return out + "\"";
}

}  // namespace

HostsFile parse_hosts(std::string_view text, std::string_view filename, const HostsLimits& limits) {
  HostsFile out;
  const std::string file(filename);
  if (text.size() > limits.max_bytes) {
    out.problems.push_back(file + ": larger than " + std::to_string(limits.max_bytes) + " bytes; not read");
    return out;
  }
  // The addresses each name has so far: a linear search of names[name]
  // made a file of one name with 80,000 addresses take 9 s.
  std::map<std::string, std::set<IpPrefix, IpPrefixLess>> seen;
  std::size_t pairs = 0;
  std::size_t line_no = 0;
  while (!text.empty()) {
    if (out.problems.size() >= limits.max_problems) {
      out.problems.push_back(file + ": more than " + std::to_string(limits.max_problems) +
                             " problems; the rest is not read");
      break;
    }
    ++line_no;
    const auto lf = text.find('\n');
    std::string_view line = text.substr(0, lf);
    text = lf == std::string_view::npos ? std::string_view{} : text.substr(lf + 1);
    if (const auto hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    std::vector<std::string_view> fields;
    std::size_t i = 0;
    while (i < line.size()) {
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
      const std::size_t start = i;
      while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
      if (i > start) fields.push_back(line.substr(start, i - start));
    }
    if (fields.empty()) continue;
    const std::string where = std::string(filename) + ":" + std::to_string(line_no) + ": ";
    const auto addr = parse_ip(fields[0]);
    if (!addr) {
      out.problems.push_back(where + "not an IP address: " + quoted(fields[0]) + "; line skipped");
      continue;
    }
    if (fields.size() == 1) {
      out.problems.push_back(where + "address " + addr->to_string() + " without a name; line skipped");
      continue;
    }
    for (std::size_t f = 1; f < fields.size(); ++f) {
      auto name = normalize_name(fields[f]);
      if (!name) {
        out.problems.push_back(where + "not a host name: " + quoted(fields[f]) + "; name skipped");
        continue;
      }
      if (!seen[*name].insert(*addr).second) continue;
      if (++pairs > limits.max_pairs) {
        out.names.clear();
        out.problems.push_back(file + ": more than " + std::to_string(limits.max_pairs) +
                               " (name, address) pairs; not read");
        return out;
      }
      out.names[*name].push_back(*addr);
    }
  }
  return out;
}

}  // namespace egressd::pin
