// The policy model: allowlist entries, phases, policy files. Pure: no I/O
// except load_policy_file, which reads one file. The harnesses' formats are in
// egressd/policy_input.h.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "egressd/result.h"

namespace egressd {

enum class EntryKind { hostname, wildcard, ipv4, ipv6, ipv4_cidr, ipv6_cidr };

// "hostname", "wildcard", "ipv4", "ipv6", "ipv4-cidr", "ipv6-cidr".
std::string_view to_string(EntryKind kind);

// An address or prefix in network byte order. family is 4 or 6; for IPv4 only
// bytes[0..3] are used. A single address has prefix_len 32 / 128.
struct IpPrefix {
  int family = 0;
  std::array<std::uint8_t, 16> bytes{};
  std::uint8_t prefix_len = 0;

  std::size_t size() const { return family == 4 ? 4 : 16; }
  // Compressed text: "192.0.2.0/24", "2001:db8::1" (no /len for single addresses).
  std::string to_string() const;
  // True when addr (same family, a single address) lies inside this prefix.
  bool contains(const IpPrefix& addr) const;
  friend bool operator==(const IpPrefix&, const IpPrefix&) = default;
};

// Orders addresses by family, then bytes (prefix lengths aside): for maps
// and sorts of single addresses. The bytes are compared as two big-endian
// words, not with memcmp: the DNS proxy's learned store orders addresses
// this way dozens of times per answer (issue 17's CPU per answer).
struct IpAddrLess {
  // Bytes [at, at + 8) of an address as one big-endian word.
  static std::uint64_t word(const std::array<std::uint8_t, 16>& bytes, std::size_t at) noexcept {
    std::uint64_t w;
    std::memcpy(&w, bytes.data() + at, sizeof w);
    if constexpr (std::endian::native == std::endian::little) w = __builtin_bswap64(w);
    return w;
  }
  bool operator()(const IpPrefix& a, const IpPrefix& b) const noexcept {
    if (a.family != b.family) return a.family < b.family;
    if (const auto x = word(a.bytes, 0), y = word(b.bytes, 0); x != y) return x < y;
    return word(a.bytes, 8) < word(b.bytes, 8);
  }
};

// The same, then the prefix length: for maps of prefixes.
struct IpPrefixLess {
  bool operator()(const IpPrefix& a, const IpPrefix& b) const noexcept {
    const IpAddrLess less;
    if (less(a, b)) return true;
    if (less(b, a)) return false;
    return a.prefix_len < b.prefix_len;
  }
};

// Parses a bare IPv4/IPv6 address ("192.0.2.1", "2001:db8::1"); nullopt if it is not one.
std::optional<IpPrefix> parse_ip(std::string_view text);

// A loopback address: in 127.0.0.0/8, or ::1.
bool is_loopback(const IpPrefix& a);

// One normalized allowlist entry.
struct Entry {
  EntryKind kind = EntryKind::hostname;
  // Normalized text: "pypi.org", "*.github.com", "2001:db8::1", "192.0.2.0/24".
  std::string text;
  // Valid for the four IP kinds only.
  IpPrefix ip;

  bool is_name() const { return kind == EntryKind::hostname || kind == EntryKind::wildcard; }
  // For a wildcard, the suffix below which it matches ("github.com"); else text.
  std::string_view name_suffix() const;
  friend bool operator==(const Entry&, const Entry&) = default;
};

// Parses and normalizes one entry (DESIGN §1). On failure the error is
// invalid-kind and reads `entry "<raw>": <reason>`.
Result<Entry> parse_entry(std::string_view raw);

// Parses every entry; input order kept, duplicates after normalization removed.
// Fails on the first bad entry.
Result<std::vector<Entry>> parse_entries(const std::vector<std::string>& raw);

// True when `name` (already lower-case, no trailing dot) is allowed by the
// hostname/wildcard entry `e`: exact match, or any depth below a wildcard's
// suffix but never the apex.
bool entry_matches_name(const Entry& e, std::string_view name);

enum class Mode { public_, no_network, allowlist };
// "public", "no-network", "allowlist".
std::string_view to_string(Mode mode);
// Exact, lower-case names only; nullopt otherwise.
std::optional<Mode> parse_mode(std::string_view text);

enum class DenyAction { reject, drop };
enum class DenyAnswer { refused, nxdomain };
// Whether DNS answers in private ranges (10/8, 172.16/12, 192.168/16,
// 100.64/10, fc00::/7) are learned for names that only a wildcard entry
// allows: `exact` (the default) learns them for exact hostname entries only,
// `allow` for wildcard matches too.
enum class PrivateAnswers { exact, allow };
// Where egressd agent asks the upstream from (docs: README "Agent mode"): its own
// namespace (default: nothing in the sandbox sees or answers the exchange), or the
// sandbox's (the upstream is reachable only from inside). A sidecar always asks from the
// sandbox's namespace, which it has joined.
enum class UpstreamNetns { agent, sandbox };

struct DnsOptions {
  // Upstream servers: IP addresses, or the word "resolv.conf" (default) for the
  // namespace's own nameservers.
  std::vector<std::string> upstream{"resolv.conf"};
  std::uint32_t min_ttl_s = 30;
  // Upper bound on a learned address's TTL, and on every TTL relayed to the
  // sandbox: an answer's TTL (up to 2^31-1 s) must not keep an address
  // allowed for years, nor carry it into later phases.
  std::uint32_t max_ttl_s = 3600;
  DenyAnswer deny_answer = DenyAnswer::refused;
  PrivateAnswers private_answers = PrivateAnswers::exact;
  bool observe_public = true;
  UpstreamNetns upstream_netns = UpstreamNetns::agent;
};

// Denied packets are logged to this NFLOG group unless `enforce.log_group`
// says otherwise (docs/audit.md). NFLOG groups are per network namespace.
inline constexpr std::uint16_t kDefaultLogGroup = 1985;

struct EnforceOptions {
  DenyAction deny = DenyAction::reject;
  // Allow outbound packets of connections initiated from outside the sandbox.
  bool inbound_replies = true;
  // NFLOG group deny rules log to, for `egressctl denied` (0 = no logging).
  std::uint16_t log_group = kDefaultLogGroup;
  // Hostname pinning in allowlist phases (docs/pinning.md): a flow to an
  // address allowed only through learned names must present one of those
  // names (TLS SNI, HTTP Host). Off: the address alone decides.
  bool pin_names = true;
};

struct Phase {
  std::string name;  // [A-Za-z0-9_-]{1,32}
  Mode mode = Mode::no_network;
  std::vector<Entry> entries;  // only for allowlist; empty = deny all

  std::size_t count(EntryKind kind) const;
};

struct Policy {
  std::string initial_phase;  // names one of phases
  DnsOptions dns;
  EnforceOptions enforce;
  std::vector<Phase> phases;  // file order

  // nullptr when absent.
  const Phase* find(std::string_view name) const;
};

// True for a valid phase name: 1-32 of [A-Za-z0-9_-].
bool valid_phase_name(std::string_view name);

// Parses an egressd policy document (YAML or JSON; never the harnesses' formats).
// `filename` is used in messages, which read "<filename>:<line>:<col>: <reason>".
// Errors are invalid-kind.
Result<Policy> parse_policy(std::string_view text, std::string_view filename);

// Reads and parses a policy file in any of the formats of egressd/policy_input.h
// (egressd YAML/JSON, Harbor task.toml, AgentCompass env-params: parse_policy_document
// says which); a missing/unreadable file is an invalid-kind error naming the path.
Result<Policy> load_policy_file(const std::string& path);

// Builds a one-phase policy for an inline request (egressctl apply --mode).
// Fails (invalid) on bad entries or entries with a non-allowlist mode.
Result<Phase> make_inline_phase(std::string_view name, Mode mode, const std::vector<std::string>& raw_entries);

}  // namespace egressd
