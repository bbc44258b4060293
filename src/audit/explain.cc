#include "audit/explain.h"

#include <algorithm>
#include <set>

#include "audit/suggest.h"
#include "dns/matcher.h"
#include "dns/message.h"
#include "pin/decide.h"

namespace egressd::audit {

namespace {

constexpr const char* kForms =
    "a target is a hostname, an IP address, NAME:PORT, IPv4:PORT, [IPv6]:PORT or NAME@ADDRESS[:PORT]";

// The raw target for messages: JSON string syntax escapes quotes and control
// bytes, so a hostile target cannot forge log lines or move the cursor.
std::string quoted(std::string_view s) {
  return nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Error bad(std::string_view raw, const std::string& why) {
  return Error::invalid("target " + quoted(raw) + ": " + why);
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string_view trim(std::string_view s) {
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

Result<std::uint16_t> parse_port(std::string_view raw, std::string_view text) {
  // At most 5 digits before converting, so no overflow; leading zeros are
  // refused so one port has one spelling.
  if (!all_digits(text) || text.size() > 5 || (text.size() > 1 && text.front() == '0')) {
    return bad(raw, "port " + quoted(text) + " is not a number from 1 to 65535");
  }
  const int port = std::stoi(std::string(text));
  if (port < 1 || port > 65535) return bad(raw, "port " + std::string(text) + " is not a number from 1 to 65535");
  return static_cast<std::uint16_t>(port);
}

// parse_entry's messages read `entry "<raw>": <reason>`; keep the reason.
std::string entry_reason(const std::string& message) {
  if (message.rfind("entry \"", 0) != 0) return message;
  for (std::size_t i = 7; i < message.size(); ++i) {
    if (message[i] == '\\') {
      ++i;  // quote() escapes `"` and `\` with a backslash
    } else if (message[i] == '"') {
      return message.compare(i + 1, 2, ": ") == 0 ? message.substr(i + 3) : message;
    }
  }
  return message;
}

// The host part (no port) of a target: an IPv4 address or a hostname.
Result<Target> parse_host(std::string_view raw, std::string_view host) {
  Target t;
  if (auto ip = parse_ip(host)) {
    t.is_address = true;
    t.addr = *ip;
    return t;
  }
  // "192.0.2.256" or "1.2.3": almost surely a typo'd address (parse_entry refuses them
  // too, with a longer hint meant for allowlists).
  if (!host.empty() && host.find_first_not_of("0123456789.") == std::string_view::npos) {
    return bad(raw, quoted(host) + " is not a valid IPv4 address");
  }
  auto e = parse_entry(host);
  if (!e) return bad(raw, entry_reason(e.error().message));
  switch (e->kind) {
    case EntryKind::hostname:
      t.hostname = e->text;
      return t;
    case EntryKind::wildcard:
      return bad(raw, "a wildcard is an allowlist entry, not a target: ask about one name, such as www." +
                          std::string(e->name_suffix()));
    case EntryKind::ipv4_cidr:
    case EntryKind::ipv6_cidr:
      return bad(raw, "a CIDR is an allowlist entry, not a target: ask about one address");
    case EntryKind::ipv4:
    case EntryKind::ipv6:
      break;
  }
  return bad(raw, kForms);
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::string addr_hint(const IpPrefix& a) {
  // A CIDR of the usual allocation size around it: /24 for IPv4, /64 for IPv6.
  IpPrefix net = a;
  net.prefix_len = a.family == 4 ? 24 : 64;
  for (std::size_t i = net.prefix_len / 8; i < net.size(); ++i) net.bytes[i] = 0;
  return "add " + a.to_string() + ", or a CIDR such as " + net.to_string();
}

// Multicast (224.0.0.0/4, ff00::/8) or the limited broadcast 255.255.255.255.
bool is_group_address(const IpPrefix& a) {
  if (a.family == 6) return a.bytes[0] == 0xff;
  if ((a.bytes[0] & 0xf0) == 0xe0) return true;
  return a.bytes[0] == 255 && a.bytes[1] == 255 && a.bytes[2] == 255 && a.bytes[3] == 255;
}

const Entry* best_ip_entry(const Phase& phase, const IpPrefix& addr) {
  const Entry* best = nullptr;
  for (const auto& e : phase.entries) {
    if (e.is_name() || !e.ip.contains(addr)) continue;
    if (best == nullptr || e.ip.prefix_len > best->ip.prefix_len) best = &e;
  }
  return best;
}

void explain_address(Explanation& x, const Phase& phase, const IpPrefix& addr, const LearnedView& learned,
                     PrivateAnswers private_answers) {
  const std::string a = addr.to_string();
  if (phase.entries.empty()) {
    x.reason = "phase " + phase.name + " is an allowlist with no entries: all egress is denied";
    x.hint = x.names.empty() ? addr_hint(addr) : suggest_entries(x.names);
    return;
  }
  if (const Entry* e = best_ip_entry(phase, addr)) {
    x.allowed = true;
    x.entry = e->text;
    x.reason = e->ip.prefix_len == (addr.family == 4 ? 32 : 128)
                   ? a + " is entry " + e->text + " of phase " + phase.name
                   : a + " is inside entry " + e->text + " of phase " + phase.name;
    return;
  }
  const dns::NameMatcher matcher(phase.entries);
  // The learn guard that keeps `addr` out for `name` under this phase, if any.
  auto guard_for_name = [&](const std::string& name) -> std::optional<dns::LearnGuard> {
    const Entry* e = matcher.match(name);
    if (e == nullptr) return std::nullopt;
    return dns::guard_for(addr, e->kind == EntryKind::hostname, private_answers);
  };
  for (const auto& [name, addrs] : learned) {
    if (std::find(addrs.begin(), addrs.end(), addr) == addrs.end()) continue;
    const Entry* e = matcher.match(name);
    if (e == nullptr || guard_for_name(name)) continue;
    // std::map order: the first allowed name alphabetically, so the answer is stable.
    x.allowed = true;
    x.entry = e->text;
    x.learned_name = name;
    x.reason = a + " was learned from DNS for " + name + ", which entry " + e->text + " of phase " + phase.name +
               " allows";
    return;
  }
  const std::string none = a + " is in no IP or CIDR entry of phase " + phase.name;
  // Names the phase allows that resolved to it, but whose answer a learn
  // guard kept out (never learned, whatever the answer's age).
  std::vector<std::string> guarded_names;
  std::optional<dns::LearnGuard> guard;
  for (const auto& n : x.names) {
    if (auto g = guard_for_name(n)) {
      guarded_names.push_back(n);
      guard = g;
    }
  }
  if (guard) {
    x.guard = guard->to_string();
    if (guard->private_range) {
      x.reason = none + "; " + join(guarded_names, ", ") + " resolved to it, but " + guard->to_string() +
                 " is a private range, and addresses there are learned only for names an exact hostname entry "
                 "allows, not a wildcard (rebinding guard; dns.private_answers: allow learns them)";
      x.hint = "add " + guarded_names.front() + " as an exact hostname entry, or " + a + " as an IP entry";
    } else {
      x.reason = none + "; " + join(guarded_names, ", ") + " resolved to it, but DNS answers in " +
                 guard->to_string() + " are never learned (rebinding guard)";
      x.hint = "add " + a + " as an IP entry if the sandbox really needs it";
    }
    return;
  }
  // Names that resolved to it earlier and are allowed now: the answer expired
  // (or came before the switch and was not carried), so a fresh query fixes it.
  std::vector<std::string> allowed_names;
  for (const auto& n : x.names)
    if (matcher.matches(n)) allowed_names.push_back(n);
  if (!allowed_names.empty()) {
    x.reason = none + ", and it is not a live answer for an allowed name: " + join(allowed_names, ", ") +
               " resolved to it before, but that answer has expired";
    x.hint = "resolve " + allowed_names.front() + " again through egressd (a new DNS answer allows its addresses), "
             "or add " + a;
    return;
  }
  if (!x.names.empty()) {
    x.reason = none + ", and no name it allows resolved to it (resolved from: " + join(x.names, ", ") + ")";
    x.hint = suggest_entries(x.names);
    return;
  }
  x.reason = none + ", and no name resolved to it through egressd";
  x.hint = addr_hint(addr);
}

void explain_hostname(Explanation& x, const Phase& phase, const std::string& host, const LearnedView& learned) {
  const dns::NameMatcher matcher(phase.entries);
  if (const Entry* e = matcher.match(host)) {
    x.allowed = true;
    x.entry = e->text;
    x.reason = "the DNS proxy answers " + host + " (entry " + e->text + " of phase " + phase.name + ")";
    if (e->kind == EntryKind::hostname) x.reason += "; exact hostnames are pre-resolved when the phase is applied";
    x.reason += "; connections to the addresses it resolves to through egressd are allowed";
    if (auto it = learned.find(host); it != learned.end() && !it->second.empty()) {
      std::vector<std::string> now;
      for (const auto& a : it->second) now.push_back(a.to_string());
      x.reason += " (now: " + join(now, ", ") + ")";
    }
    return;
  }
  x.reason = "no entry of phase " + phase.name + " matches " + host +
             ": the DNS proxy refuses it without asking upstream, so the sandbox cannot reach it by name";
  for (const auto& e : phase.entries) {
    if (e.kind == EntryKind::wildcard && e.name_suffix() == host) {
      x.reason += " (entry " + e.text + " matches only names below " + host + ", never " + host + " itself)";
      break;
    }
  }
  x.hint = suggest_entries({host});
}

}  // namespace

std::string Target::text() const {
  std::string host = is_address ? addr.to_string() : hostname;
  const std::string name = presented ? *presented + "@" : "";
  if (!port) return name + host;
  if (is_address && addr.family == 6) host = "[" + host + "]";
  return name + host + ":" + std::to_string(*port);
}

namespace {
Result<Target> parse_plain_target(std::string_view raw, std::string_view s);
}  // namespace

Result<Target> parse_target(std::string_view raw) {
  const std::string_view s = trim(raw);
  const auto at = s.find('@');
  if (at == std::string_view::npos) return parse_plain_target(raw, s);
  // NAME@ADDRESS[:PORT]: the name a flow presents on that address.
  const std::string_view name = s.substr(0, at), where = s.substr(at + 1);
  if (where.find('@') != std::string_view::npos) return bad(raw, "more than one \"@\"; write NAME@ADDRESS[:PORT]");
  if (name.empty()) {
    return bad(raw, "no name before \"@\": write NAME@ADDRESS[:PORT], NAME being the TLS server name or HTTP Host");
  }
  if (where.empty()) return bad(raw, "no address after \"@\": write NAME@ADDRESS[:PORT]");
  auto n = pin::normalize_name(name);
  if (!n) {
    return bad(raw, "the name " + quoted(name) +
                        " before \"@\" is not a host name (labels of letters, digits, \"-\" and \"_\", 1-63 "
                        "characters each, at most 253 in all; no wildcard)");
  }
  auto t = parse_plain_target(raw, where);
  if (!t) return t;
  if (!t->is_address) {
    return bad(raw, "after \"@\" comes the address the flow goes to (an IP address, IPv4:PORT or [IPv6]:PORT), not "
                    "the hostname " + quoted(std::string_view(t->hostname)));
  }
  t->presented = *n;
  return t;
}

namespace {

Result<Target> parse_plain_target(std::string_view raw, std::string_view s) {
  if (s.empty()) return bad(raw, "empty; " + std::string(kForms));
  if (s.front() == '[') {
    const auto close = s.find(']');
    if (close == std::string_view::npos) return bad(raw, "\"[\" without \"]\"; " + std::string(kForms));
    auto ip = parse_ip(s.substr(1, close - 1));
    if (!ip || ip->family != 6) return bad(raw, quoted(s.substr(1, close - 1)) + " is not a valid IPv6 address");
    Target t;
    t.is_address = true;
    t.addr = *ip;
    const std::string_view rest = s.substr(close + 1);
    if (rest.empty()) return t;
    if (rest.front() != ':') return bad(raw, "expected \":PORT\" after \"]\"");
    auto port = parse_port(raw, rest.substr(1));
    if (!port) return port.error();
    t.port = *port;
    return t;
  }
  const auto colon = s.find(':');
  if (colon != std::string_view::npos && s.find(':', colon + 1) != std::string_view::npos) {
    // Two or more colons: a bare IPv6 address, which cannot carry a port.
    if (auto ip = parse_ip(s)) {
      Target t;
      t.is_address = true;
      t.addr = *ip;
      return t;
    }
    const auto last = s.rfind(':');
    if (all_digits(s.substr(last + 1)) && parse_ip(s.substr(0, last))) {
      return bad(raw, "an IPv6 address with a port is written [" + std::string(s.substr(0, last)) + "]:" +
                          std::string(s.substr(last + 1)));
    }
    if (s.find("://") != std::string_view::npos) return bad(raw, "URLs are not targets: give the hostname alone");
    return bad(raw, quoted(s) + " is not a valid IPv6 address");
  }
  if (colon == std::string_view::npos) return parse_host(raw, s);
  if (s.compare(colon, 3, "://") == 0) return bad(raw, "URLs are not targets: give the hostname alone");
  auto t = parse_host(raw, s.substr(0, colon));
  if (!t) return t;
  auto port = parse_port(raw, s.substr(colon + 1));
  if (!port) return port.error();
  t->port = *port;
  return t;
}

}  // namespace

std::string suggest_entries(const std::vector<std::string>& names_in) {
  std::set<std::string> names(names_in.begin(), names_in.end());
  // Exact names only. The names are what the sandbox resolved, so it chooses
  // their parents: "or *.github.io" was advice to allow every tenant of a
  // provider (attack review 10). `hosts --suggest --wildcards` offers
  // wildcards where the Public Suffix List says a parent has one owner.
  std::vector<std::string> exact(names.begin(), names.end());
  // Long lists are not advice either; the full list is in `names`.
  constexpr std::size_t kMax = 5;
  auto shown = [&](const std::vector<std::string>& v) {
    std::vector<std::string> head(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(std::min(v.size(), kMax)));
    std::string out = join(head, " or ");
    if (v.size() > kMax) out += " (or one of " + std::to_string(v.size() - kMax) + " more)";
    return out;
  };
  return "add " + shown(exact);
}

namespace {

// pin::PinFacts over what explain is given: the live learned names of an
// address (name order, as the LearnedStore answers the datapath) and the
// phase's matcher.
class ExplainPinFacts : public pin::PinFacts {
 public:
  ExplainPinFacts(const LearnedView& learned, const dns::NameMatcher& matcher) : learned_(learned), m_(matcher) {}
  std::vector<std::string> names_for(const IpPrefix& addr) const override {
    std::vector<std::string> out;
    for (const auto& [name, addrs] : learned_) {
      if (std::find(addrs.begin(), addrs.end(), addr) != addrs.end()) out.push_back(name);
    }
    return out;
  }
  const Entry* allowed(std::string_view name) const override { return m_.match(name); }

 private:
  const LearnedView& learned_;
  const dns::NameMatcher& m_;
};

// The hostname-pinning half of NAME@ADDRESS: `x` already explains the address.
void explain_pinned(Explanation& x, const Phase& phase, const Target& target, const LearnedView& learned,
                    bool pin_names) {
  const std::string& name = *target.presented;
  const std::string a = target.addr.to_string();
  const bool by_name = x.allowed && x.learned_name.has_value();
  if (phase.mode != Mode::allowlist || !x.allowed || !by_name) {
    // The address decides alone: say why no name is read.
    if (!x.allowed) {
      x.reason += "; the flow is refused by address before any name is read";
    } else if (phase.mode == Mode::allowlist && x.entry) {
      x.reason += "; hostname pinning never inspects an address an IP or CIDR entry allows, so a flow presenting " +
                  name + " (or any name) passes";
    } else {
      x.reason += "; hostname pinning inspects only allowlist phases' addresses learned from names, so a flow "
                  "presenting " + name + " (or any name) passes";
    }
    return;
  }
  if (!pin_names) {
    x.reason += "; hostname pinning is off (enforce.pin_names: false), so a flow presenting " + name +
                " (or any name) passes";
    return;
  }
  x.inspected = true;
  const dns::NameMatcher matcher(phase.entries);
  const ExplainPinFacts facts(learned, matcher);
  const std::uint16_t port = target.port.value_or(443);
  const pin::PinProto proto = port == 80 ? pin::PinProto::http : pin::PinProto::tls;
  const pin::Decision d = pin::decide(proto, pin::Parse::complete_with(name), target.addr, port, facts);
  x.pin = d.reason;
  const std::vector<std::string> learned_for = facts.names_for(target.addr);
  const std::string learned_text = learned_for.empty() ? std::string("no name") : join(learned_for, ", ");
  if (d.kind == pin::Decision::Kind::admit) {
    x.allowed = true;
    x.entry = d.entry;
    x.learned_name = name;
    x.reason = a + " was learned for " + name + ", which entry " + d.entry + " of phase " + phase.name +
               " allows: a TLS ClientHello or HTTP request presenting " + name + " is admitted (hostname pinning)";
    return;
  }
  x.allowed = false;
  x.entry.reset();
  x.learned_name.reset();
  const Entry* e = matcher.match(name);
  if (e == nullptr) {
    x.reason = "no entry of phase " + phase.name + " allows " + name + ": a TLS ClientHello or HTTP request to " + a +
               " presenting it is reset (hostname pinning; " + a + " is allowed only for " + learned_text + ")";
    x.hint = suggest_entries({name}) + " (its answer must then include " + a + "), or add " + a +
             " as an IP entry (never inspected)";
    return;
  }
  std::string elsewhere;
  if (auto it = learned.find(name); it != learned.end() && !it->second.empty()) {
    std::vector<std::string> list;
    for (const auto& addr : it->second) list.push_back(addr.to_string());
    elsewhere = " (it resolved to " + join(list, ", ") + ")";
  } else {
    elsewhere = " (no live answer for it)";
  }
  x.reason = "entry " + e->text + " of phase " + phase.name + " allows " + name + ", but " + name +
             " did not resolve to " + a + " through egressd" + elsewhere + ": a TLS ClientHello or HTTP request to " + a +
             " presenting it is reset (strict pinning: " + a + " admits only " + learned_text + ")";
  x.hint = "resolve " + name + " through egressd and connect to an address it answers";
}

}  // namespace

Explanation explain(const Phase& phase, const Target& target, const LearnedView& learned, const NamesFor& names_for,
                    const std::vector<IpPrefix>& loopback_upstreams, PrivateAnswers private_answers,
                    bool pin_names) {
  Explanation x;
  x.target = target.text();
  x.phase = phase.name;
  x.mode = phase.mode;
  if (target.is_address) {
    std::set<std::string> names;
    if (names_for) {
      for (auto& n : names_for(target.addr)) names.insert(std::move(n));
    }
    for (const auto& [name, addrs] : learned) {
      if (std::find(addrs.begin(), addrs.end(), target.addr) != addrs.end()) names.insert(name);
    }
    x.names.assign(names.begin(), names.end());
  }
  const std::string what = target.is_address ? target.addr.to_string() : target.hostname;

  if (target.is_address && std::find(loopback_upstreams.begin(), loopback_upstreams.end(), target.addr) !=
                               loopback_upstreams.end()) {
    x.reason = what + " is one of egressd's loopback DNS upstreams (such as Docker's embedded resolver): only egressd "
               "reaches it, on any port, in every phase; ask egressd's DNS proxy instead";
  } else if (target.is_address && is_loopback(target.addr)) {
    x.allowed = true;
    x.reason = what + " is a loopback address: loopback is always allowed";
  } else if (phase.mode == Mode::public_) {
    x.allowed = true;
    x.reason = "phase " + phase.name + " is public: all egress is allowed";
    if (!target.is_address) x.reason += " and DNS queries are forwarded";
  } else if (phase.mode == Mode::no_network) {
    x.reason = "phase " + phase.name + " is no-network: all egress is denied (loopback excepted)";
    if (!target.is_address) x.reason += " and every DNS query is refused";
    x.hint = "switch to a phase that allows it (egressctl apply PHASE; check one first with explain --phase PHASE)";
  } else if (target.is_address && is_group_address(target.addr)) {
    x.reason = what + " is a " + (target.addr.family == 4 && target.addr.bytes[0] == 255 ? "broadcast" : "multicast") +
               " address: outside public, broadcast and multicast destinations are denied whatever entry covers them "
               "(one datagram would reach every host of the segment)";
    // DNS answers never teach them either: the learn guard says which range.
    if (auto g = dns::learn_guard(target.addr)) x.guard = g->to_string();
  } else if (target.is_address) {
    explain_address(x, phase, target.addr, learned, private_answers);
  } else {
    explain_hostname(x, phase, target.hostname, learned);
  }
  if (target.presented) {
    explain_pinned(x, phase, target, learned, pin_names);
  } else if (target.port) {
    x.reason += "; this holds for any port (egressd policies do not depend on the port)";
  }
  return x;
}

nlohmann::json Explanation::to_json() const {
  auto opt = [](const std::optional<std::string>& s) { return s ? nlohmann::json(*s) : nlohmann::json(nullptr); };
  return {{"target", target},
          {"phase", phase},
          {"mode", std::string(to_string(mode))},
          {"allowed", allowed},
          {"reason", reason},
          {"entry", opt(entry)},
          {"learned_name", opt(learned_name)},
          {"names", names},
          {"hint", opt(hint)},
          {"guard", opt(guard)},
          {"inspected", inspected},
          {"pin", opt(pin)}};
}

}  // namespace egressd::audit
