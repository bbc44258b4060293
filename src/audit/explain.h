// `explain`: why a hostname or address is allowed or denied by a phase.
// Pure: the caller passes the phase, what DNS taught it (learned addresses)
// and a way to ask which names resolved to an address; nothing here touches
// the kernel, the proxy or a clock, so every answer is unit-tested.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd::audit {

// What `egressctl explain TARGET` asks about.
struct Target {
  bool is_address = false;
  std::string hostname;  // normalized (lower-case, no trailing dot) when !is_address
  IpPrefix addr;         // a single address when is_address
  std::optional<std::uint16_t> port;
  // NAME@ADDRESS[:PORT]: the name a flow to `addr` presents (TLS SNI, HTTP
  // Host), normalized as the datapath normalizes it (pin::normalize_name);
  // is_address is then true.
  std::optional<std::string> presented;

  // Canonical text: "pypi.org", "pypi.org:443", "192.0.2.10:443",
  // "2001:db8::1", "[2001:db8::1]:443", "pypi.org@192.0.2.10:443".
  std::string text() const;
};

// Parses a hostname (normalized like an allowlist entry: trimmed,
// lower-cased, one trailing dot dropped), an IPv4/IPv6 address, NAME:port,
// IPv4:port or [IPv6]:port (port 1-65535), or NAME@ADDRESS[:PORT] with one
// of the address forms after the "@". On failure an invalid-kind error
// reading `target "<raw>": <reason>` (wildcards, CIDRs, URLs, bad ports, an
// IPv6 address with an unbracketed port, malformed addresses, an empty or
// invalid name before "@", a hostname or nothing after it).
Result<Target> parse_target(std::string_view raw);

// Name -> addresses DNS answers taught the sandbox that are still live (not
// expired). Names are normalized; addresses are single addresses.
using LearnedView = std::map<std::string, std::vector<IpPrefix>>;
// Hostnames that resolved to an address in this sandbox (any phase, expired
// answers included), for attribution and hints. May return duplicates.
using NamesFor = std::function<std::vector<std::string>(const IpPrefix&)>;

struct Explanation {
  std::string target;  // Target::text()
  std::string phase;
  Mode mode = Mode::no_network;
  bool allowed = false;
  std::string reason;                       // one sentence for people
  std::optional<std::string> entry;         // the entry that allows it
  std::optional<std::string> learned_name;  // the DNS name through which `entry` allows an address
  std::vector<std::string> names;           // sorted, unique: names that resolved to the address
  // The learn guard (dns/message.h) that keeps the address from being
  // learned for the names the phase allows: "10.0.0.0/8 (private)".
  std::optional<std::string> guard;
  std::optional<std::string> hint;          // what to change when denied
  // NAME@ADDRESS: whether hostname pinning inspects such a flow, and then
  // pin::decide's line for it ("tls sni a.test to 192.0.2.1:443; allowed by
  // a.test"); false/nullopt for other targets.
  bool inspected = false;
  std::optional<std::string> pin;

  // The protocol fields (docs/protocol.md "explain"), without "ok":
  // target, phase, mode, allowed, reason, entry, learned_name, names, hint,
  // guard, inspected, pin (absent optionals are null).
  nlohmann::json to_json() const;
};

// Explains `target` under `phase` as egressd enforces it: loopback always
// allowed, except `loopback_upstreams` (egressd's own loopback DNS upstreams,
// Docker's 127.0.0.11: nobody else reaches them, in any phase); public allows
// all; no-network denies all; outside public multicast and 255.255.255.255
// are denied whatever entry covers them (so are the namespace's subnet
// broadcasts, which this pure function cannot know); allowlist allows an
// address inside an IP/CIDR entry (the most specific one wins) or learned
// from DNS for a name an entry allows (never a rebinding-guard address), and
// a hostname the DNS proxy would answer. `names_for` may be empty.
// `private_answers` is the policy's dns.private_answers (learn guards).
//
// NAME@ADDRESS[:PORT] (hostname pinning, docs/pinning.md): the address is
// explained as above; then, in an allowlist phase with `pin_names`, a flow to
// an address allowed only through learned names is decided by pin::decide as
// the datapath decides a TLS ClientHello (an HTTP request on port 80) naming
// NAME, with `learned` as the names learned for the address and the phase's
// name matcher: admitted iff the phase allows NAME and NAME is one of them.
// No port: 443. Not inspected (the address alone decides): public and
// no-network phases, loopback, addresses an IP/CIDR entry allows, and every
// address with `pin_names` false.
Explanation explain(const Phase& phase, const Target& target, const LearnedView& learned,
                    const NamesFor& names_for, const std::vector<IpPrefix>& loopback_upstreams = {},
                    PrivateAnswers private_answers = PrivateAnswers::exact, bool pin_names = true);

// The allowlist advice for a denied name: "add files.pythonhosted.org, or
// *.pythonhosted.org" (no wildcard over a single-label parent such as *.org).
std::string suggest_entries(const std::vector<std::string>& names);

}  // namespace egressd::audit
