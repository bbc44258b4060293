#include "audit/suggest.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <utility>

#include "egressd/policy.h"

namespace egressd::audit {

std::string parent_of(const std::string& name) {
  const auto dot = name.find('.');
  return dot == std::string::npos ? std::string() : name.substr(dot + 1);
}

namespace {

// Services that answer every name below them with the address written in
// the name (1-2-3-4.nip.io -> 1.2.3.4): a wildcard over one allows every
// address, loopback and the host's own network included. They are
// registrable domains in the PSL, so the list alone does not stop them.
// The well-known ones only; the address-like label check below catches the
// rest when the sandbox uses them.
constexpr const char* kAnyAddressServices[] = {
    "nip.io", "sslip.io", "traefik.me", "localtest.me", "lvh.me",
};

bool below(const std::string& name, const std::string& parent) {
  return name.size() > parent.size() + 1 && name.compare(name.size() - parent.size(), parent.size(), parent) == 0 &&
         name[name.size() - parent.size() - 1] == '.';
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f'); }

// The any-address service `p` is, or is below; empty if none.
std::string any_address_service(const std::string& p) {
  for (const char* s : kAnyAddressServices) {
    if (p == s || below(p, s)) return s;
  }
  return {};
}

// Why `*.p` must not be suggested; empty if it may. `labels` are the
// sibling labels exactly one below p.
std::string withheld_because(const std::string& p, const std::vector<std::string>& labels,
                             const PublicSuffixes& psl) {
  if (p.find('.') == std::string::npos || !psl.registrable(p)) {
    return p + " is a public suffix: names below it belong to different owners";
  }
  if (const auto svc = any_address_service(p); !svc.empty()) {
    return svc + " answers with any address written in the name: a wildcard below it allows every address";
  }
  for (const auto& l : labels) {
    if (address_like_label(l)) {
      return "names below " + p + " look like addresses (" + l + "): a wildcard could allow every address";
    }
  }
  return {};
}

}  // namespace

bool address_like_label(const std::string& label) {
  if (label.empty()) return false;
  std::size_t digits = 0, hex = 0, dashes = 0;
  for (const char c : label) {
    if (is_digit(c)) ++digits;
    if (is_hex(c)) ++hex;
    if (c == '-') ++dashes;
  }
  // "10", "1-2-3-4", "192-0-2-1": decimal, plain or dashed.
  if (digits > 0 && digits + dashes == label.size()) return true;
  // "c0a80001": an IPv4 address in hex (nip.io, sslip.io decode it).
  if (label.size() == 8 && hex == 8) return true;
  // "2001-db8--1", "fe80--1": IPv6 with dashes for colons.
  if (digits > 0 && dashes >= 2 && hex + dashes == label.size()) return true;
  // "ip-192-0-2-1", "www-10-0-0-1": a dashed dotted quad after a prefix.
  std::size_t groups = 0, i = label.size();
  while (groups < 4 && i > 0 && is_digit(label[i - 1])) {
    std::size_t n = 0;
    while (i > 0 && is_digit(label[i - 1]) && n < 4) --i, ++n;
    if (n > 3) break;
    ++groups;
    if (i == 0 || label[i - 1] != '-') break;
    --i;
  }
  return groups == 4;
}

Suggestion suggest_allowed_hosts(const std::vector<std::string>& names, bool wildcards, const PublicSuffixes* psl) {
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
  std::map<std::string, std::vector<std::string>> children;  // parent -> labels of the names exactly one below it
  for (const auto& h : hosts) {
    const std::string p = parent_of(h);
    if (!p.empty()) children[p].push_back(h.substr(0, h.size() - p.size() - 1));
  }
  std::vector<std::string> parents;
  for (const auto& [p, labels] : children) {
    if (labels.size() < 2) continue;
    if (psl == nullptr) {
      // No list: nothing tells a registrable domain from a suffix, and a
      // guess is what let *.github.io through (attack review 10). Fail closed.
      s.notes.assign(1, "no Public Suffix List could be loaded: no wildcards suggested, every name listed");
      parents.clear();
      break;
    }
    if (auto why = withheld_because(p, labels, *psl); !why.empty()) {
      s.notes.push_back(std::move(why));
    } else {
      parents.push_back(p);
    }
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
  // Notes name only entries parse_entry accepted (letters, digits, '-', '.'): no line to forge.
  for (const auto& n : s.notes) {
    out += "# ";
    out += n;
    out += '\n';
  }
  if (s.entries.empty()) return out + "allowed_hosts: []\n";
  out += "allowed_hosts:\n";
  for (const auto& e : s.entries) out += e[0] == '*' ? "  - \"" + e + "\"\n" : "  - " + e + "\n";
  return out;
}

}  // namespace egressd::audit
