// Allowlist entries (DESIGN §1): normalization, classification, matching,
// plus the small mode/phase helpers of the policy model.
//
// Reference for accept/reject decisions: Harbor's task.toml validator
// (allowed_hosts), which our users already write entries for. Where Harbor
// and DESIGN.md differ, DESIGN.md wins; each such place says so below.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_set>

#include "egressd/policy.h"

namespace egressd {

namespace {

constexpr std::size_t kMaxNameLen = 253;   // RFC 1035 §2.3.4, text form without the root dot
constexpr std::size_t kMaxLabelLen = 63;   // RFC 1035 §2.3.4

constexpr const char* kWildcardOverIp =
    "wildcards match host names, not IP addresses: list the address itself or a CIDR";

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_lower_alnum(char c) { return is_digit(c) || (c >= 'a' && c <= 'z'); }
bool is_ip_char(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || c == ':' || c == '.'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// ASCII only: entries are DNS names or IP literals. Non-ASCII bytes are left
// alone here and rejected later with a punycode hint.
std::string ascii_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!is_digit(c)) return false;
  }
  return true;
}

// The raw entry goes into messages that end up in logs and on terminals:
// control bytes are escaped so an entry cannot forge log lines or move the
// cursor, and quotes/backslashes so the quoting stays unambiguous.
std::string quote_entry(std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "\"";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    } else {
      out += ch;
    }
  }
  out += '"';
  return out;
}

// Why `label` cannot be a DNS label, or empty when it can.
std::string label_problem(std::string_view label) {
  if (label.empty()) return "has an empty label (a leading dot, or two dots in a row)";
  if (label.size() > kMaxLabelLen) {
    return "label " + quote_entry(label) + " is " + std::to_string(label.size()) +
           " characters long; DNS allows at most 63";
  }
  for (char c : label) {
    if (is_lower_alnum(c) || c == '-') continue;
    return "label " + quote_entry(label) + " contains " + quote_entry(std::string_view(&c, 1)) +
           ": only letters, digits and hyphens are allowed";
  }
  if (label.front() == '-') return "label " + quote_entry(label) + " starts with a hyphen";
  if (label.back() == '-') return "label " + quote_entry(label) + " ends with a hyphen";
  return {};
}

// Why `name` (normalized, no wildcard) is not a hostname, or empty when it is.
std::string hostname_problem(std::string_view name) {
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = name.find('.', start);
    const std::string_view label =
        name.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (std::string why = label_problem(label); !why.empty()) return why;
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return {};
}

// "a.b.c.d" read as four decimal numbers up to 255 ("192.000.002.001" -> "192.0.2.1"), or
// empty when `name` is not four such parts.
std::string dotted_decimal(std::string_view name) {
  std::string out;
  int parts = 0;
  std::size_t start = 0;
  while (start <= name.size()) {
    const std::size_t dot = std::min(name.find('.', start), name.size());
    const std::string_view part = name.substr(start, dot - start);
    if (!all_digits(part) || part.size() > 3 || std::stoi(std::string(part)) > 255 || ++parts > 4) return {};
    out += (out.empty() ? "" : ".") + std::to_string(std::stoi(std::string(part)));
    start = dot + 1;
  }
  return parts == 4 ? out : std::string();
}

// Why `name` (valid labels, no wildcard) must not be taken as a host name, or empty.
//
// Harbor accepts all-numeric names such as "1.2.3" or "192.000.002.001" as host names (only
// what ip_address() parses is an address there). egressd would match such an entry against
// DNS names only, so it never allows the address its author almost certainly meant, and a
// resolver that reads it with inet_aton(3) (1.2.0.3) asks for something else again: the
// entry silently allows nothing (attack review 10, F4). No top-level domain is numeric (RFC
// 3696 §2), so refusing costs no real name. The text is not converted: the author says which
// address was meant.
std::string numeric_name_problem(std::string_view name) {
  const std::string text(name);  // valid labels only: no NUL to cut the C string short
  in_addr a{};
  const bool aton = inet_aton(text.c_str(), &a) != 0;
  char read_as[INET_ADDRSTRLEN] = {};
  if (aton) inet_ntop(AF_INET, &a, read_as, sizeof read_as);
  if (const std::string decimal = dotted_decimal(name); !decimal.empty()) {
    // inet_aton reads a leading 0 as octal ("010" is 8): name that reading too when it differs.
    std::string why = "an IPv4 address with leading zeros is not accepted: write " + decimal;
    if (aton && decimal != read_as) why += " (inet_aton(3) would read it as " + std::string(read_as) + ")";
    return why;
  }
  if (aton) {
    return "looks like an IPv4 address in inet_aton(3) shorthand (hex, octal or fewer than four parts; it reads "
           "as " + std::string(read_as) + "): write the address as four decimal numbers, e.g. " + read_as;
  }
  const std::string_view last = name.substr(name.rfind('.') + 1);
  if (all_digits(last)) {
    return "the last label " + quote_entry(last) + " is all digits, so this is no host name (no top-level domain "
           "is numeric) and no IPv4 address: write an address as four decimal numbers 0-255, e.g. 192.0.2.1";
  }
  return {};
}

// An IPv4-mapped IPv6 address (::ffff:0:0/96) as the IPv4 entry to write instead, or empty.
// A socket connecting to ::ffff:192.0.2.1 sends IPv4 to 192.0.2.1, which the IPv6 sets never
// see, so such an entry allows nothing (attack review 10, F4).
std::string mapped_ipv4(const IpPrefix& ip) {
  if (ip.family != 6 || ip.prefix_len < 96) return {};
  in6_addr a6{};
  std::memcpy(&a6, ip.bytes.data(), sizeof a6);
  if (!IN6_IS_ADDR_V4MAPPED(&a6)) return {};
  char v4[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, ip.bytes.data() + 12, v4, sizeof v4);
  return ip.prefix_len == 128 ? std::string(v4) : std::string(v4) + "/" + std::to_string(ip.prefix_len - 96);
}

constexpr const char* kMappedHint =
    "an IPv4-mapped IPv6 address reaches the IPv4 address, which an IPv6 entry does not allow: write ";

std::string length_problem(std::string_view text) {
  if (text.size() <= kMaxNameLen) return {};
  return "the name is " + std::to_string(text.size()) + " characters long; DNS allows at most 253";
}

// Parses a prefix length ("24") or, for IPv4, a dotted netmask ("255.255.255.0");
// the error is the reason alone. Harbor (Python's ip_network) accepts both
// and leading zeros ("/024"); so do we. Python also accepts a hostmask
// ("0.0.0.255", Cisco's wildcard-mask notation); we refuse it: one field that
// holds either a mask or its inverse is a trap, and DESIGN §1 speaks of CIDRs.
Result<int> parse_prefix_len(std::string_view text, int family) {
  const int max = family == 4 ? 32 : 128;
  const std::string range = "IPv" + std::to_string(family) + (family == 4 ? " allows /0 to /32" : " allows /0 to /128");
  if (text.empty()) return Error::invalid("the prefix length after \"/\" is missing: " + range);
  if (all_digits(text)) {
    // Leading zeros are allowed, so only the magnitude bounds the length.
    const std::size_t first = std::min(text.find_first_not_of('0'), text.size() - 1);
    const std::string_view digits = text.substr(first);
    if (digits.size() <= 3) {
      const int len = std::stoi(std::string(digits));
      if (len <= max) return len;
    }
    return Error::invalid("prefix length /" + std::string(text) + " is out of range: " + range);
  }
  if (family == 4) {
    if (auto mask = parse_ip(text); mask && mask->family == 4) {
      int len = 0;
      bool ended = false;
      for (std::size_t b = 0; b < 4; ++b) {
        for (int bit = 7; bit >= 0; --bit) {
          const bool one = (mask->bytes[b] >> bit) & 1;
          if (one && ended) {
            return Error::invalid("netmask " + std::string(text) +
                                  " is not contiguous: give a prefix length such as /24");
          }
          if (one) {
            ++len;
          } else {
            ended = true;
          }
        }
      }
      return len;
    }
  }
  return Error::invalid("prefix length " + quote_entry(text) + " is not a number: " + range);
}

// Classifies an address-looking text that failed parse_ip, for the message.
bool looks_like_ip(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!is_ip_char(c)) return false;
  }
  return s.find(':') != std::string_view::npos || s.find_first_not_of("0123456789.") == std::string_view::npos;
}

// The "/" branch: a CIDR, or a path / URL fragment we explain.
Result<Entry> parse_cidr(std::string_view s, const auto& fail) {
  const std::size_t slash = s.find('/');
  const std::string_view addr_text = s.substr(0, slash);
  const std::string_view len_text = s.substr(slash + 1);
  const auto addr = parse_ip(addr_text);
  if (!addr) {
    if (addr_text.empty()) return fail("a CIDR needs an address before \"/\", e.g. 192.0.2.0/24");
    if (looks_like_ip(addr_text)) return fail(quote_entry(addr_text) + " is not a valid IP address");
    return fail("paths are not allowed: give the host name alone");
  }
  if (len_text.find('/') != std::string_view::npos) return fail("has more than one \"/\"");
  const auto len = parse_prefix_len(len_text, addr->family);
  if (!len) return fail(len.error().message);

  IpPrefix net = *addr;
  net.prefix_len = static_cast<std::uint8_t>(*len);
  // Zero every bit past the prefix; any difference means host bits were set.
  for (std::size_t i = 0; i < net.size(); ++i) {
    const int bits_here = *len - static_cast<int>(i) * 8;
    if (bits_here >= 8) continue;
    net.bytes[i] = bits_here <= 0 ? 0 : static_cast<std::uint8_t>(net.bytes[i] & (0xFFu << (8 - bits_here)));
  }
  if (net.bytes != addr->bytes) {
    // Harbor rejects these too (ip_network strict=True). Users usually meant
    // the enclosing network, so name it rather than guessing silently.
    return fail("host bits are set: did you mean " + net.to_string() + "?");
  }

  if (const std::string v4 = mapped_ipv4(net); !v4.empty()) return fail(kMappedHint + v4);

  Entry e;
  e.ip = net;
  // A /32 or /128 is one address. IpPrefix prints it without the length, so
  // it becomes an address entry: "192.0.2.1/32" and "192.0.2.1" dedupe to one.
  // (Harbor keeps "192.0.2.1/32" as a CIDR; DESIGN's IpPrefix form wins.)
  const bool single = net.prefix_len == (net.family == 4 ? 32 : 128);
  if (net.family == 4) {
    e.kind = single ? EntryKind::ipv4 : EntryKind::ipv4_cidr;
  } else {
    e.kind = single ? EntryKind::ipv6 : EntryKind::ipv6_cidr;
  }
  e.text = net.to_string();
  return e;
}

// The ":" branch without "/": an IPv6 address, or a port / scheme we explain.
Result<Entry> parse_colon(std::string_view s, const auto& fail) {
  if (const auto ip = parse_ip(s)) {
    if (const std::string v4 = mapped_ipv4(*ip); !v4.empty()) return fail(kMappedHint + v4);
    Entry e;
    e.kind = EntryKind::ipv6;
    e.ip = *ip;
    // inet_ntop form (DESIGN §1), as Python's compressed form for what is
    // left once mapped addresses are refused.
    e.text = ip->to_string();
    return e;
  }
  const std::size_t last = s.rfind(':');
  const std::string_view host = s.substr(0, last);
  const std::string_view port = s.substr(last + 1);
  if (host.find(':') == std::string_view::npos && all_digits(port)) {
    return fail("ports are not allowed: use the host alone");
  }
  if (looks_like_ip(s)) return fail(quote_entry(s) + " is not a valid IPv6 address");
  return fail("\":\" is not allowed in a host name (ports, URLs and schemes are not supported)");
}

Result<Entry> parse_wildcard(std::string_view s, const auto& fail) {
  if (s == "*") {
    return fail("a lone \"*\" would allow every host: use network mode public instead");
  }
  if (s.starts_with("*.")) {
    const std::string_view suffix = s.substr(2);
    if (suffix.empty()) return fail("a wildcard needs a domain after \"*.\", e.g. \"*.example.com\"");
    if (suffix.find('*') != std::string_view::npos) {
      return fail("only one wildcard is allowed, as the whole leading label (e.g. \"*.example.com\")");
    }
    if (std::string why = length_problem(s); !why.empty()) return fail(why);
    if (std::string why = hostname_problem(suffix); !why.empty()) return fail(why);
    if (std::string why = numeric_name_problem(suffix); !why.empty()) return fail(why);
    Entry e;
    e.kind = EntryKind::wildcard;
    e.text = std::string(s);
    return e;
  }
  if (s.front() == '*') {
    // "*pypi.org", "**.pypi.org": suggest the form that was probably meant.
    const std::size_t rest = s.find_first_not_of("*.");
    std::string hint;
    if (rest != std::string_view::npos && s.find('*', rest) == std::string_view::npos) {
      // Quoted like the entry itself: the rest may hold control bytes.
      hint = ": write " + quote_entry("*." + std::string(s.substr(rest)));
    }
    return fail("a wildcard must be the whole leading label, followed by a dot" + hint);
  }
  if (s.back() == '*') {
    return fail("trailing wildcards are not allowed: only a leading \"*.\" is supported (e.g. \"*.example.com\")");
  }
  return fail("wildcards in the middle of a name are not allowed: only a leading \"*.\" is supported "
              "(e.g. \"*.example.com\")");
}

}  // namespace

std::string_view to_string(EntryKind kind) {
  switch (kind) {
    case EntryKind::hostname: return "hostname";
    case EntryKind::wildcard: return "wildcard";
    case EntryKind::ipv4: return "ipv4";
    case EntryKind::ipv6: return "ipv6";
    case EntryKind::ipv4_cidr: return "ipv4-cidr";
    case EntryKind::ipv6_cidr: return "ipv6-cidr";
  }
  return "unknown";
}

Result<Entry> parse_entry(std::string_view raw) {
  const auto fail = [raw](const std::string& reason) -> Result<Entry> {
    return Error::invalid("entry " + quote_entry(raw) + ": " + reason);
  };

  // Normalization (DESIGN §1): trim, lower-case, drop ONE trailing dot.
  // Harbor strips every trailing dot; "pypi.org.." is an error here, since a
  // doubled dot is more likely a typo than a fully-qualified name.
  std::string s = ascii_lower(trim(raw));
  if (s.empty()) return fail("the entry is empty: give a host name, IP address or CIDR");
  if (s.back() == '.') s.pop_back();
  if (s.empty()) return fail("the DNS root \".\" cannot be allowlisted: give a host name");

  for (char c : s) {
    if (is_space(c)) return fail("contains whitespace: give one host per entry");
    if (static_cast<unsigned char>(c) >= 0x80) {
      return fail("non-ASCII characters are not allowed: write internationalized names in their "
                  "punycode form (xn--...)");
    }
  }
  // Most specific shape first, so each message names what the user wrote.
  if (s.find("://") != std::string::npos) return fail("URLs are not allowed: give the host name alone");
  if (s.find_first_of("[]") != std::string::npos) {
    return fail("brackets are not allowed: write IPv6 addresses bare (e.g. 2001:db8::1), without a port");
  }
  if (s.find('%') != std::string::npos && s.find(':') != std::string::npos) {
    return fail("IPv6 zone ids (\"%eth0\") are not allowed: give the address alone");
  }
  if (s.starts_with("*.")) {
    // "*.1.1.1.1", "*.192.0.2.0/24", "*.2001:db8::1": checked before the
    // "/" and ":" shapes so the message says what is actually wrong.
    const std::string_view rest = std::string_view(s).substr(2);
    if (parse_ip(rest.substr(0, rest.find('/')))) return fail(kWildcardOverIp);
  }
  if (s.find('/') != std::string::npos) return parse_cidr(s, fail);
  if (s.find(':') != std::string::npos) return parse_colon(s, fail);
  if (s.find('*') != std::string::npos) return parse_wildcard(s, fail);

  if (const auto ip = parse_ip(s)) {
    Entry e;
    e.kind = EntryKind::ipv4;
    e.ip = *ip;
    e.text = ip->to_string();
    return e;
  }
  // Harbor does not bound the total length; DNS does, and a longer entry
  // could never match a query.
  if (std::string why = length_problem(s); !why.empty()) return fail(why);
  if (std::string why = hostname_problem(s); !why.empty()) return fail(why);
  if (std::string why = numeric_name_problem(s); !why.empty()) return fail(why);
  Entry e;
  e.kind = EntryKind::hostname;
  e.text = std::move(s);
  return e;
}

Result<std::vector<Entry>> parse_entries(const std::vector<std::string>& raw) {
  std::vector<Entry> out;
  out.reserve(raw.size());
  // Normalized text is canonical for every kind (IPs via inet_ntop, /32
  // collapsed), so equal text means equal entry.
  std::unordered_set<std::string> seen;
  for (const std::string& r : raw) {
    auto e = parse_entry(r);
    if (!e) return e.error();
    if (seen.insert(e->text).second) out.push_back(std::move(e).value());
  }
  return out;
}

std::string_view Entry::name_suffix() const {
  if (kind == EntryKind::wildcard) return std::string_view(text).substr(2);
  return text;
}

bool entry_matches_name(const Entry& e, std::string_view name) {
  if (e.kind == EntryKind::hostname) return name == e.text;
  if (e.kind != EntryKind::wildcard) return false;
  // At least one label below the suffix: "*.github.com" never matches the
  // apex "github.com" (Harbor's rule too), but matches any depth below it.
  const std::string_view suffix = e.name_suffix();
  return name.size() > suffix.size() + 1 && name.ends_with(suffix) &&
         name[name.size() - suffix.size() - 1] == '.';
}

std::string_view to_string(Mode mode) {
  switch (mode) {
    case Mode::public_: return "public";
    case Mode::no_network: return "no-network";
    case Mode::allowlist: return "allowlist";
  }
  return "unknown";
}

std::optional<Mode> parse_mode(std::string_view text) {
  if (text == "public") return Mode::public_;
  if (text == "no-network") return Mode::no_network;
  if (text == "allowlist") return Mode::allowlist;
  return std::nullopt;
}

bool valid_phase_name(std::string_view name) {
  if (name.empty() || name.size() > 32) return false;
  for (char c : name) {
    const bool ok = is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::size_t Phase::count(EntryKind kind) const {
  std::size_t n = 0;
  for (const Entry& e : entries) {
    if (e.kind == kind) ++n;
  }
  return n;
}

const Phase* Policy::find(std::string_view name) const {
  for (const Phase& p : phases) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

Result<Phase> make_inline_phase(std::string_view name, Mode mode, const std::vector<std::string>& raw_entries) {
  // The name shows up in status, logs and denied records, so it obeys the
  // same rule as a phase from a file.
  if (!valid_phase_name(name)) {
    return Error::invalid("invalid phase name " + quote_entry(name) + ": use 1-32 letters, digits, \"_\" or \"-\"");
  }
  if (mode != Mode::allowlist && !raw_entries.empty()) {
    return Error::invalid("allowlist entries are only valid with mode allowlist, not " + std::string(to_string(mode)));
  }
  auto entries = parse_entries(raw_entries);
  if (!entries) return entries.error();
  Phase p;
  p.name = std::string(name);
  p.mode = mode;
  p.entries = std::move(entries).value();
  return p;
}

}  // namespace egressd
