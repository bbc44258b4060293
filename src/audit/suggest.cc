#include "audit/suggest.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "egressd/policy.h"

namespace egressd::audit {

std::string parent_of(const std::string& name) {
  const auto dot = name.find('.');
  return dot == std::string::npos ? std::string() : name.substr(dot + 1);
}

namespace {

// True for parents a wildcard must never sit on: one label ("com"), or a
// two-label name that looks like a public suffix ("co.uk", "com.au").
bool suffix_like(const std::string& parent) {
  const auto dot = parent.find('.');
  if (dot == std::string::npos) return true;
  if (parent.find('.', dot + 1) != std::string::npos) return false;
  static const std::set<std::string> kSecondLevel = {"ac", "co", "com", "edu", "gob", "gov", "go", "ltd",
                                                     "mil", "ne", "net", "nic", "or", "org", "plc", "sch"};
  const std::string first = parent.substr(0, dot), tld = parent.substr(dot + 1);
  return tld.size() == 2 && kSecondLevel.count(first) != 0;
}

bool below(const std::string& name, const std::string& parent) {
  return name.size() > parent.size() + 1 && name.compare(name.size() - parent.size(), parent.size(), parent) == 0 &&
         name[name.size() - parent.size() - 1] == '.';
}

}  // namespace

Suggestion suggest_allowed_hosts(const std::vector<std::string>& names, bool wildcards) {
  Suggestion s;
  std::set<std::string> hosts;
  std::set<std::string> skipped;
  for (const auto& raw : names) {
    auto e = parse_entry(raw);
    if (!e || e->kind != EntryKind::hostname) {
      skipped.insert(raw);
      continue;
    }
    hosts.insert(e->text);
  }
  s.skipped.assign(skipped.begin(), skipped.end());
  if (!wildcards) {
    s.entries.assign(hosts.begin(), hosts.end());
    return s;
  }
  std::map<std::string, std::size_t> children;  // parent -> names exactly one label below it
  for (const auto& h : hosts) {
    const std::string p = parent_of(h);
    if (!p.empty()) ++children[p];
  }
  std::vector<std::string> parents;
  for (const auto& [p, n] : children) {
    if (n >= 2 && !suffix_like(p)) parents.push_back(p);
  }
  // A collapsed parent below another collapsed parent is covered by it.
  std::set<std::string> out;
  for (const auto& p : parents) {
    const bool covered = std::any_of(parents.begin(), parents.end(), [&](const std::string& q) { return below(p, q); });
    if (!covered) out.insert("*." + p);
  }
  for (const auto& h : hosts) {
    const bool covered = std::any_of(parents.begin(), parents.end(), [&](const std::string& q) { return below(h, q); });
    if (!covered) out.insert(h);
  }
  s.entries.assign(out.begin(), out.end());
  return s;
}

std::string printable(const std::string& name) {
  std::string out;
  out.reserve(name.size());
  for (const unsigned char c : name) {
    if (c > 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

std::string suggestion_yaml(const Suggestion& s) {
  std::string out;
  if (!s.skipped.empty()) {
    out += "# not valid allowlist entries, left out:";
    // Appended piece by piece: `" " + printable(n)` trips g++ 12's -Wrestrict false
    // positive (GCC PR 105329) at -O3, which fails the release build.
    for (const auto& n : s.skipped) {
      out += ' ';
      out += printable(n);
    }
    out += "\n";
  }
  if (s.entries.empty()) return out + "allowed_hosts: []\n";
  out += "allowed_hosts:\n";
  for (const auto& e : s.entries) out += e[0] == '*' ? "  - \"" + e + "\"\n" : "  - " + e + "\n";
  return out;
}

}  // namespace egressd::audit
