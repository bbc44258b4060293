// IpPrefix text form and containment, and the one bare-address parser every
// layer uses (policy entries, DNS upstreams, explain targets).
#include <arpa/inet.h>

#include <cstring>
#include <string>

#include "egressd/policy.h"

namespace egressd {

namespace {

std::uint8_t full_len(int family) { return family == 4 ? 32 : 128; }

// Appends the decimal form of v (0-255). Digits are appended to a string, not
// written through a pointer into a stack buffer: with std::to_chars into a
// char[19] (unchecked result), g++ 12 -O3 cannot prove the writes stay in
// bounds and -Wstringop-overflow fails the release build.
void append_decimal(std::string& out, unsigned v) {
  if (v >= 100) out += static_cast<char>('0' + v / 100);
  if (v >= 10) out += static_cast<char>('0' + v / 10 % 10);
  out += static_cast<char>('0' + v % 10);
}

}  // namespace

std::string IpPrefix::to_string() const {
  if (family == 4) {
    // Dotted decimal by hand: the same text inet_ntop gives, without its
    // sprintf, which was the largest single cost of parsing a large inline
    // allowlist (docs/benchmarks.md).
    std::string out;
    out.reserve(sizeof "255.255.255.255/32" - 1);
    for (std::size_t i = 0; i < 4; ++i) {
      if (i > 0) out += '.';
      append_decimal(out, bytes[i]);
    }
    if (prefix_len != 32) {
      out += '/';
      append_decimal(out, prefix_len);
    }
    return out;
  }
  // inet_ntop is the reference form (DESIGN §1): lower-case hex, longest zero
  // run compressed, IPv4-mapped addresses in dotted tail form.
  char buf[INET6_ADDRSTRLEN] = {};
  const int af = family == 4 ? AF_INET : AF_INET6;
  if (family != 4 && family != 6) return "<invalid address>";
  if (inet_ntop(af, bytes.data(), buf, sizeof buf) == nullptr) return "<invalid address>";
  std::string out = buf;
  if (prefix_len != full_len(family)) {
    out += '/';
    out += std::to_string(prefix_len);
  }
  return out;
}

bool IpPrefix::contains(const IpPrefix& addr) const {
  if (family != addr.family || (family != 4 && family != 6)) return false;
  // A wider prefix is never inside a narrower one.
  if (addr.prefix_len < prefix_len) return false;
  const std::size_t whole = prefix_len / 8;
  if (std::memcmp(bytes.data(), addr.bytes.data(), whole) != 0) return false;
  const unsigned rest = prefix_len % 8;
  if (rest == 0) return true;
  const auto mask = static_cast<std::uint8_t>(0xFFu << (8 - rest));
  return (bytes[whole] & mask) == (addr.bytes[whole] & mask);
}

std::optional<IpPrefix> parse_ip(std::string_view text) {
  // Longest textual IPv6 address is 45 chars ("ffff:...:255.255.255.255").
  // Bounding it here also keeps the copy below on the stack.
  if (text.empty() || text.size() >= INET6_ADDRSTRLEN) return std::nullopt;
  // inet_pton reads a C string: an embedded NUL would silently cut the input
  // short and accept "192.0.2.1\0junk".
  if (text.find('\0') != std::string_view::npos) return std::nullopt;
  char buf[INET6_ADDRSTRLEN] = {};
  std::memcpy(buf, text.data(), text.size());

  // inet_pton accepts only the bare forms: dotted-quad without leading zeros
  // for AF_INET, RFC 4291 text for AF_INET6. Brackets, zone ids ("%eth0"),
  // prefixes and surrounding spaces all fail, which is what "bare" means.
  IpPrefix ip;
  const bool v6 = text.find(':') != std::string_view::npos;
  if (inet_pton(v6 ? AF_INET6 : AF_INET, buf, ip.bytes.data()) != 1) return std::nullopt;
  ip.family = v6 ? 6 : 4;
  ip.prefix_len = full_len(ip.family);
  return ip;
}

bool is_loopback(const IpPrefix& a) {
  static const IpPrefix lo6 = *parse_ip("::1");
  return (a.family == 4 && a.bytes[0] == 127) || a == lo6;
}

}  // namespace egressd
