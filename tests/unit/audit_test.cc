// Audit (src/audit/): name index bounds and attribution order, the denied
// ring with burst de-duplication and its cursor, the allowed_hosts
// suggestion with wildcard collapsing, and the NFLOG parsers fed hostile and
// truncated bytes.
#include <doctest/doctest.h>

#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_log.h>
#include <linux/netlink.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "audit/denied.h"
#include "audit/names.h"
#include "audit/nflog.h"
#include "audit/psl.h"
#include "audit/suggest.h"

using namespace egressd;
using namespace egressd::audit;
using namespace std::chrono_literals;

namespace {

IpPrefix ip(const char* s) { return *parse_ip(s); }
const WallClock::time_point t0 = WallClock::time_point(std::chrono::seconds(1'800'000'000));

}  // namespace

TEST_CASE("names_for: every name that resolved to an address, most recent first, across phases") {
  NameIndex idx;
  idx.observe("env", "a.example", {ip("192.0.2.1"), ip("2001:db8::1")}, t0);
  idx.observe("env", "b.example", {ip("192.0.2.1")}, t0);
  idx.observe("agent", "c.example", {ip("192.0.2.2")}, t0);
  CHECK(idx.names_for(ip("192.0.2.1")) == std::vector<std::string>{"b.example", "a.example"});
  CHECK(idx.names_for(ip("2001:db8::1")) == std::vector<std::string>{"a.example"});
  CHECK(idx.names_for(ip("192.0.2.9")).empty());
  // Seen again: first again.
  idx.observe("agent", "a.example", {ip("192.0.2.1")}, t0);
  CHECK(idx.names_for(ip("192.0.2.1")) == std::vector<std::string>{"a.example", "b.example"});
  // Same name in two phases: listed once.
  CHECK(idx.names_for(ip("192.0.2.1")).size() == 2);
}

TEST_CASE("a refused name is recorded by name only and attributes no address") {
  NameIndex idx;
  idx.refused("agent", "evil.example", t0);
  idx.refused("agent", "evil.example", t0);
  auto hosts = idx.hosts();
  REQUIRE(hosts.size() == 1);
  CHECK(hosts[0].refused == 2);
  CHECK(hosts[0].resolved == 0);
  CHECK(hosts[0].addresses.empty());
}

TEST_CASE("the name index is bounded: the least recently seen entry and its addresses go first") {
  NameIndex idx({3, 2});
  idx.observe("p", "n1", {ip("192.0.2.1")}, t0);
  idx.observe("p", "n2", {ip("192.0.2.2")}, t0);
  idx.observe("p", "n3", {ip("192.0.2.3")}, t0);
  idx.observe("p", "n1", {ip("192.0.2.1")}, t0);  // n2 is now the oldest
  idx.observe("p", "n4", {ip("192.0.2.4")}, t0);
  CHECK(idx.size() == 3);
  CHECK(idx.evicted() == 1);
  CHECK(idx.names_for(ip("192.0.2.2")).empty());
  CHECK(idx.names_for(ip("192.0.2.1")) == std::vector<std::string>{"n1"});
  // Per-name address cap keeps the latest addresses.
  idx.observe("p", "cdn", {ip("198.51.100.1"), ip("198.51.100.2"), ip("198.51.100.3")}, t0);
  CHECK(idx.names_for(ip("198.51.100.1")).empty());
  CHECK(idx.names_for(ip("198.51.100.3")) == std::vector<std::string>{"cdn"});
  // A flood of distinct names stays within the bound.
  for (int i = 0; i < 10000; ++i) idx.observe("p", "x" + std::to_string(i) + ".example", {ip("203.0.113.7")}, t0);
  CHECK(idx.size() == 3);
  CHECK(idx.names_for(ip("203.0.113.7")).size() == 3);
  // An evicted entry's place is reused: the new entry keeps nothing of it.
  idx.refused("p", "r.example", t0);
  idx.refused("p", "r.example", t0);
  idx.observe("q", "s.example", {ip("192.0.2.9"), ip("192.0.2.10")}, t0);
  for (int i = 0; i < 3; ++i) idx.observe("p", "y" + std::to_string(i) + ".example", {ip("203.0.113.8")}, t0 + 1s);
  for (const HostEntry& h : idx.hosts()) {
    CHECK(h.resolved == 1);
    CHECK(h.refused == 0);
    CHECK(h.addresses == std::vector<IpPrefix>{ip("203.0.113.8")});
    CHECK(h.first == t0 + 1s);
  }
  CHECK(idx.names_for(ip("192.0.2.9")).empty());
  CHECK(idx.hosts("q").empty());
}

TEST_CASE("a name seen in two phases keeps its address while either entry remembers it") {
  NameIndex idx({2, 4});
  idx.observe("env", "a.example", {ip("192.0.2.1")}, t0);
  idx.observe("agent", "a.example", {ip("192.0.2.1")}, t0);
  idx.observe("agent", "b.example", {ip("192.0.2.5")}, t0);  // evicts (env, a.example)
  CHECK(idx.names_for(ip("192.0.2.1")) == std::vector<std::string>{"a.example"});
  auto h = idx.hosts("agent");
  CHECK(h.size() == 2);
  CHECK(idx.hosts("env").empty());
}

TEST_CASE("denied bursts: same key within the window bumps count; another key, phase or a gap makes a new record") {
  DeniedLog log({8, 10s});
  int lookups = 0;
  auto names = [&] {
    ++lookups;
    return std::vector<std::string>{"a.example"};
  };
  CHECK(log.add_packet(6, ip("192.0.2.1"), 443, "agent", names, t0));
  for (int i = 1; i <= 999; ++i) CHECK_FALSE(log.add_packet(6, ip("192.0.2.1"), 443, "agent", names, t0 + i * 1ms));
  CHECK(lookups == 1);
  REQUIRE(log.size() == 1);
  auto recs = log.since(0);
  CHECK(recs[0]->count == 1000);
  CHECK(recs[0]->last == t0 + 999ms);
  CHECK(recs[0]->names == std::vector<std::string>{"a.example"});
  CHECK(log.add_packet(6, ip("192.0.2.1"), 80, "agent", names, t0));
  CHECK(log.add_packet(17, ip("192.0.2.1"), 443, "agent", names, t0));
  CHECK(log.add_packet(6, ip("192.0.2.1"), 443, "verifier", names, t0));
  // The window runs from the last bump: a pause longer than it starts a new record.
  CHECK(log.add_packet(6, ip("192.0.2.1"), 443, "agent", names, t0 + 999ms + 11s));
  CHECK(log.add_dns("evil.example", "agent", t0));
  CHECK_FALSE(log.add_dns("evil.example", "agent", t0 + 1s));
  CHECK(log.add_dns("other.example", "agent", t0));
  CHECK(log.size() == 7);
  CHECK(log.total() == 1000 + 3 + 1 + 3);
  auto j = to_json(*log.since(5)[0]);
  CHECK(j["kind"] == "dns");
  CHECK(j["names"] == nlohmann::json::array({"evil.example"}));
  CHECK(j["count"] == 2);
  CHECK(j["dst"].is_null());
  auto p = to_json(*log.since(0)[0]);
  CHECK(p["kind"] == "packet");
  CHECK(p["proto"] == "tcp");
  CHECK(p["dst"] == "192.0.2.1");
  CHECK(p["port"] == 443);
  CHECK(p["phase"] == "agent");
  CHECK(p["time"] == "2027-01-15T08:00:00.000Z");
}

TEST_CASE("the denied ring is bounded and the since cursor skips what a client has seen") {
  DeniedLog log({4, 10s});
  for (int i = 0; i < 10; ++i) {
    CHECK(log.add_packet(6, ip("192.0.2.1"), static_cast<std::uint16_t>(1000 + i), "a", {}, t0));
  }
  CHECK(log.size() == 4);
  CHECK(log.evicted() == 6);
  CHECK(log.last_id() == 10);
  auto all = log.since(0);
  REQUIRE(all.size() == 4);
  CHECK(all.front()->id == 7);
  CHECK(log.since(8).size() == 2);
  CHECK(log.since(10).empty());
  CHECK(log.since(0, 1).front()->id == 10);
  // An evicted record's key no longer bumps anything: its port is new again.
  CHECK(log.add_packet(6, ip("192.0.2.1"), 1000, "a", {}, t0));
}

TEST_CASE("suggest: exactly the resolved names, normalized, sorted, unique; invalid names left out") {
  auto s = suggest_allowed_hosts({"pypi.org", "Files.PythonHosted.org.", "pypi.org", "_srv._tcp.example"}, false);
  CHECK(s.entries == std::vector<std::string>{"files.pythonhosted.org", "pypi.org"});
  CHECK(s.skipped == std::vector<std::string>{"_srv._tcp.example"});
  CHECK(suggestion_yaml(s) ==
        "# not valid allowlist entries, left out: _srv._tcp.example\n"
        "allowed_hosts:\n  - files.pythonhosted.org\n  - pypi.org\n");
  CHECK(suggestion_yaml({}) == "allowed_hosts: []\n");
}

namespace {

// The real list, as egressctl loads it (Debian: publicsuffix's DAFSA file
// through libpsl5). Loaded once for the file.
const PublicSuffixes& real_psl() {
  static const LoadedPsl loaded = load_public_suffixes();
  REQUIRE_MESSAGE(loaded.list != nullptr, loaded.error);
  return *loaded.list;
}

// A stand-in list: only what is in `suffixes` (and one-label names) is a suffix.
struct FakePsl : PublicSuffixes {
  std::vector<std::string> suffixes;
  bool registrable(const std::string& name) const override {
    return name.find('.') != std::string::npos &&
           std::find(suffixes.begin(), suffixes.end(), name) == suffixes.end();
  }
};

bool has_note(const Suggestion& s, const std::string& text) {
  return std::any_of(s.notes.begin(), s.notes.end(),
                     [&](const std::string& n) { return n.find(text) != std::string::npos; });
}

}  // namespace

TEST_CASE("wildcards: two or more siblings collapse to *.parent; never onto a public suffix") {
  auto s = suggest_allowed_hosts({"a.files.example.com", "b.files.example.com", "c.d.files.example.com",
                                  "files.example.com", "pypi.org", "x.com", "y.com", "a.co.uk", "b.co.uk",
                                  "solo.other.example"},
                                 true, &real_psl());
  CHECK(s.entries == std::vector<std::string>{"*.files.example.com", "a.co.uk", "b.co.uk", "files.example.com",
                                              "pypi.org", "solo.other.example", "x.com", "y.com"});
  CHECK(suggestion_yaml(s).find("  - \"*.files.example.com\"\n") != std::string::npos);
  CHECK(has_note(s, "co.uk is a public suffix: names below it belong to different owners"));
  CHECK(has_note(s, "com is a public suffix"));
  // Nested collapses: the outer wildcard covers the inner one.
  auto n = suggest_allowed_hosts({"a.b.example.net", "c.b.example.net", "b.example.net", "z.example.net"}, true,
                                 &real_psl());
  CHECK(n.entries == std::vector<std::string>{"*.example.net"});
  CHECK(n.notes.empty());
  // A registrable domain under a two-label suffix, and a name below a PRIVATE suffix's tenant.
  CHECK(suggest_allowed_hosts({"a.example.com", "b.example.com"}, true, &real_psl()).entries ==
        std::vector<std::string>{"*.example.com"});
  CHECK(suggest_allowed_hosts({"www.foo.co.uk", "api.foo.co.uk"}, true, &real_psl()).entries ==
        std::vector<std::string>{"*.foo.co.uk"});
  CHECK(suggest_allowed_hosts({"a.me.github.io", "b.me.github.io"}, true, &real_psl()).entries ==
        std::vector<std::string>{"*.me.github.io"});
}

// Attack review 10 (F3): the sandbox resolves two names of its choice in public; the
// suggestion must not hand it every tenant of a hosting or tunnel provider.
TEST_CASE("wildcards: never over a suffix of the list's PRIVATE section; the names stay listed") {
  for (const std::string suffix : {"github.io", "trycloudflare.com", "workers.dev", "s3.amazonaws.com",
                                   "herokuapp.com", "co.uk", "com"}) {
    CAPTURE(suffix);
    const auto s = suggest_allowed_hosts({"attacker-1." + suffix, "attacker-2." + suffix}, true, &real_psl());
    CHECK(s.entries == std::vector<std::string>{"attacker-1." + suffix, "attacker-2." + suffix});
    const auto y = suggestion_yaml(s);
    CHECK(y.find("*.") == std::string::npos);
    CHECK(y.find("# " + suffix + " is a public suffix: names below it belong to different owners\n") !=
          std::string::npos);
  }
}

TEST_CASE("wildcards: never below a service that answers any address written in the name") {
  for (const std::string svc : {"nip.io", "sslip.io", "traefik.me", "localtest.me", "lvh.me"}) {
    CAPTURE(svc);
    const auto s = suggest_allowed_hosts({"app." + svc, "api." + svc, "x.y." + svc, "z.y." + svc}, true,
                                         &real_psl());
    CHECK(s.entries == std::vector<std::string>{"api." + svc, "app." + svc, "x.y." + svc, "z.y." + svc});
    CHECK(has_note(s, svc + " answers with any address written in the name"));
  }
}

TEST_CASE("wildcards: never when a sibling label reads as an address") {
  for (const std::string label : {"1-2-3-4", "192-0-2-1", "c0a80001", "10", "ip-10-0-0-1", "2001-db8--1"}) {
    CAPTURE(label);
    CHECK(address_like_label(label));
    const auto s = suggest_allowed_hosts({label + ".rebind.example", "www.rebind.example"}, true, &real_psl());
    CHECK(s.entries.size() == 2);
    CHECK(has_note(s, "names below rebind.example look like addresses (" + label + ")"));
  }
  for (const std::string label : {"www", "api", "cdn-01", "edge-2", "files", "eu-west-1", "v2"}) {
    CAPTURE(label);
    CHECK_FALSE(address_like_label(label));
  }
}

TEST_CASE("wildcards: with no Public Suffix List, none at all, and the output says so") {
  const auto s = suggest_allowed_hosts({"a.example.com", "b.example.com", "pypi.org"}, true, nullptr);
  CHECK(s.entries == std::vector<std::string>{"a.example.com", "b.example.com", "pypi.org"});
  CHECK(suggestion_yaml(s) ==
        "# no Public Suffix List could be loaded: no wildcards suggested, every name listed\n"
        "allowed_hosts:\n  - a.example.com\n  - b.example.com\n  - pypi.org\n");
  // The loader fails closed on a missing file (no builtin fallback) and on a missing library.
  PslSources missing;
  missing.files = {"/nonexistent/public_suffix_list.dafsa"};
  missing.builtin = false;
  const auto none = load_public_suffixes(missing);
  CHECK(none.list == nullptr);
  CHECK(none.error.find("/nonexistent/public_suffix_list.dafsa: cannot be read") != std::string::npos);
  PslSources no_lib;
  no_lib.library = "libpsl-not-there.so.5";
  const auto nolib = load_public_suffixes(no_lib);
  CHECK(nolib.list == nullptr);
  CHECK(nolib.error.find("libpsl-not-there.so.5") != std::string::npos);
  // A list without its PRIVATE section is refused as incomplete.
  const auto dir = std::filesystem::temp_directory_path() / ("egressd-psl-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "icann_only.dat") << "// ===BEGIN ICANN DOMAINS===\ncom\nuk\nco.uk\n// ===END ICANN DOMAINS===\n";
  }
  PslSources partial;
  partial.files = {(dir / "icann_only.dat").string()};
  partial.builtin = false;
  const auto inc = load_public_suffixes(partial);
  CHECK(inc.list == nullptr);
  CHECK(inc.error.find("incomplete") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("wildcards: the decision takes the list it is given") {
  FakePsl fake;
  fake.suffixes = {"hosting.example"};
  const auto s = suggest_allowed_hosts({"a.hosting.example", "b.hosting.example", "a.mine.example",
                                        "b.mine.example"},
                                       true, &fake);
  CHECK(s.entries == std::vector<std::string>{"*.mine.example", "a.hosting.example", "b.hosting.example"});
  CHECK(s.notes == std::vector<std::string>{"hosting.example is a public suffix: names below it belong to different owners"});
}

TEST_CASE("names from the sandbox cannot forge lines of the suggested YAML") {
  Suggestion s;
  s.skipped = {"evil\n  - attacker.example"};
  const auto y = suggestion_yaml(s);
  CHECK(y.find("\n  - attacker") == std::string::npos);
  CHECK(printable("a\nb\\c") == "a\\x0ab\\x5cc");
}

namespace {

std::vector<std::uint8_t> ipv4_tcp(std::uint16_t dport) {
  std::vector<std::uint8_t> p(40, 0);
  p[0] = 0x45;
  p[9] = 6;
  const std::uint8_t dst[4] = {192, 0, 2, 7};
  std::memcpy(&p[16], dst, 4);
  p[20 + 2] = static_cast<std::uint8_t>(dport >> 8);
  p[20 + 3] = static_cast<std::uint8_t>(dport);
  return p;
}

std::vector<std::uint8_t> ipv6(std::uint8_t nh, std::vector<std::uint8_t> rest) {
  std::vector<std::uint8_t> p(40, 0);
  p[0] = 0x60;
  p[6] = nh;
  auto dst = ip("2001:db8::53");
  std::memcpy(&p[24], dst.bytes.data(), 16);
  p.insert(p.end(), rest.begin(), rest.end());
  return p;
}

std::vector<std::uint8_t> nflog_msg(const std::vector<std::uint8_t>& payload, std::uint16_t type = NFULA_PAYLOAD) {
  std::vector<std::uint8_t> m(NLMSG_HDRLEN + 4, 0);
  const std::uint16_t mt = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET;
  std::memcpy(&m[4], &mt, 2);
  // An unrelated attribute first (NFULA_PREFIX "x"), then the payload.
  const std::uint16_t plen = 5, ptype = NFULA_PREFIX;
  m.resize(m.size() + 8, 0);
  std::memcpy(&m[NLMSG_HDRLEN + 4], &plen, 2);
  std::memcpy(&m[NLMSG_HDRLEN + 6], &ptype, 2);
  m[NLMSG_HDRLEN + 8] = 'x';
  const std::size_t at = m.size();
  const std::uint16_t alen = static_cast<std::uint16_t>(4 + payload.size());
  m.resize(at + NLA_ALIGN(alen), 0);
  std::memcpy(&m[at], &alen, 2);
  std::memcpy(&m[at + 2], &type, 2);
  std::memcpy(&m[at + 4], payload.data(), payload.size());
  const std::uint32_t len = static_cast<std::uint32_t>(m.size());
  std::memcpy(&m[0], &len, 4);
  return m;
}

}  // namespace

TEST_CASE("parse_ip_packet: IPv4 and IPv6 destination, protocol and port") {
  auto p = parse_ip_packet(ipv4_tcp(443));
  REQUIRE(p);
  CHECK(p->proto == 6);
  CHECK(p->dst.to_string() == "192.0.2.7");
  CHECK(p->port == 443);
  // IPv6 UDP behind a hop-by-hop and a destination-options header.
  auto v6 = parse_ip_packet(ipv6(0, {60, 0, 0, 0, 0, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0, 0, 0x12, 0x34, 0x00, 0x35, 0, 8, 0, 0}));
  REQUIRE(v6);
  CHECK(v6->proto == 17);
  CHECK(v6->dst.to_string() == "2001:db8::53");
  CHECK(v6->port == 53);
  auto icmp6 = parse_ip_packet(ipv6(58, {128, 0, 0, 0}));
  REQUIRE(icmp6);
  CHECK(icmp6->proto == 58);
  CHECK(icmp6->icmp_type == 128);
  CHECK_FALSE(icmp6->port);
  // A non-first IPv6 fragment carries no port.
  auto frag = parse_ip_packet(ipv6(44, {6, 0, 0x00, 0x08, 0, 0, 0, 1, 0, 80, 0, 80}));
  REQUIRE(frag);
  CHECK(frag->proto == 6);
  CHECK_FALSE(frag->port);
  // A non-first IPv4 fragment neither.
  auto f4 = ipv4_tcp(443);
  f4[7] = 1;
  CHECK_FALSE(parse_ip_packet(f4)->port);
}

TEST_CASE("parse_ip_packet: truncated and hostile packets never read out of bounds") {
  const auto good = ipv4_tcp(443);
  for (std::size_t n = 0; n < good.size(); ++n) {
    auto p = parse_ip_packet(std::span(good.data(), n));
    if (n < 20) {
      CHECK_FALSE(p);
    } else {
      REQUIRE(p);
      CHECK(p->port.has_value() == (n >= 24));
    }
  }
  auto bad_ihl = good;
  bad_ihl[0] = 0x4f;  // 60-byte header in a 40-byte packet
  CHECK_FALSE(parse_ip_packet(bad_ihl));
  bad_ihl[0] = 0x44;  // 16 bytes: shorter than the minimum
  CHECK_FALSE(parse_ip_packet(bad_ihl));
  std::vector<std::uint8_t> v5(40, 0);
  v5[0] = 0x55;
  CHECK_FALSE(parse_ip_packet(v5));
  // Extension headers whose lengths point past the end, and an endless chain.
  CHECK(parse_ip_packet(ipv6(0, {0, 255})));
  std::vector<std::uint8_t> chain;
  for (int i = 0; i < 40; ++i) chain.insert(chain.end(), {0, 0, 0, 0, 0, 0, 0, 0});
  auto endless = parse_ip_packet(ipv6(0, chain));
  REQUIRE(endless);
  CHECK_FALSE(endless->port);
  // Random bytes: any answer, but no crash (ASan checks the reads).
  std::mt19937 rng(5);
  for (int i = 0; i < 20000; ++i) {
    std::vector<std::uint8_t> b(rng() % 120);
    for (auto& c : b) c = static_cast<std::uint8_t>(rng());
    if (!b.empty()) b[0] = static_cast<std::uint8_t>((i % 2 ? 0x40 : 0x60) | (b[0] & 0x0f));
    (void)parse_ip_packet(b);
  }
}

TEST_CASE("nflog_payload: finds NFULA_PAYLOAD; refuses other messages and bad lengths") {
  const auto pkt = ipv4_tcp(8443);
  const auto msg = nflog_msg(pkt);
  auto pl = nflog_payload(msg);
  REQUIRE(pl);
  CHECK(pl->size() == pkt.size());
  CHECK(parse_ip_packet(*pl)->port == 8443);
  CHECK_FALSE(nflog_payload(nflog_msg(pkt, NFULA_PREFIX)));
  auto other = msg;
  other[4] = NFULNL_MSG_CONFIG;
  CHECK_FALSE(nflog_payload(other));
  for (std::size_t n = 0; n < msg.size(); ++n) {
    // The header length says more than there is: refused, whatever the cut.
    CHECK_FALSE(nflog_payload(std::span(msg.data(), n)));
  }
  auto liar = msg;
  const std::uint16_t huge = 0xfff0;
  std::memcpy(&liar[NLMSG_HDRLEN + 4], &huge, 2);
  CHECK_FALSE(nflog_payload(liar));
  auto tiny = msg;
  const std::uint16_t three = 3;
  std::memcpy(&tiny[NLMSG_HDRLEN + 4], &three, 2);
  CHECK_FALSE(nflog_payload(tiny));
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    auto m = msg;
    m[rng() % m.size()] = static_cast<std::uint8_t>(rng());
    auto p = nflog_payload(m);
    if (p) (void)parse_ip_packet(*p);
  }
}
