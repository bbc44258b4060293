// Allowlist entries (DESIGN §1): every accepted class, every rejected class,
// normalization, dedupe and name matching.
#include <arpa/inet.h>
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "egressd/policy.h"

using namespace egressd;

namespace {

Entry accept(std::string_view raw) {
  auto r = parse_entry(raw);
  INFO("raw entry: \"" << std::string(raw) << "\"");
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
  // Normalization is idempotent: the normalized text parses to itself.
  auto again = parse_entry(r->text);
  REQUIRE(again.ok());
  CHECK(*again == *r);
  return r.value();
}

// Returns the reason part of the message after checking the common prefix.
std::string reject(std::string_view raw) {
  auto r = parse_entry(raw);
  INFO("raw entry: \"" << std::string(raw) << "\"");
  REQUIRE_MESSAGE(!r.ok(), "accepted as " << (r.ok() ? r->text : std::string()));
  CHECK(r.error().kind == ErrorKind::invalid);
  const std::string prefix = "entry \"" + std::string(raw) + "\": ";
  const std::string& msg = r.error().message;
  if (raw.find_first_of("\"\\\n\t\x01") == std::string_view::npos) {
    REQUIRE_MESSAGE(msg.starts_with(prefix), msg);
    return msg.substr(prefix.size());
  }
  return msg;
}

bool contains(const std::string& s, std::string_view part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("hostnames are accepted and normalized") {
  Entry e = accept("pypi.org");
  CHECK(e.kind == EntryKind::hostname);
  CHECK(e.text == "pypi.org");
  CHECK(e.is_name());
  CHECK(e.name_suffix() == "pypi.org");

  CHECK(accept("localhost").text == "localhost");
  CHECK(accept("a-b.c-d.example").text == "a-b.c-d.example");
  CHECK(accept("xn--bcher-kva.example").text == "xn--bcher-kva.example");
  CHECK(accept("0day.example").text == "0day.example");
  CHECK(accept("a").text == "a");
}

TEST_CASE("normalization: case, one trailing dot, surrounding whitespace") {
  CHECK(accept("PyPI.ORG").text == "pypi.org");
  CHECK(accept("pypi.org.").text == "pypi.org");
  CHECK(accept("  pypi.org\t\n").text == "pypi.org");
  CHECK(accept(" \tFiles.PythonHosted.Org. \r\n").text == "files.pythonhosted.org");
  CHECK(accept("*.GitHub.COM.").text == "*.github.com");
  CHECK(accept(" 2001:DB8::1 ").text == "2001:db8::1");
  CHECK(accept("192.0.2.1.").text == "192.0.2.1");
}

TEST_CASE("only ONE trailing dot is removed") {
  // Harbor strips them all; DESIGN §1 says one, and ".." is a typo.
  CHECK(contains(reject("pypi.org.."), "empty label"));
  CHECK(contains(reject("."), "DNS root"));
}

TEST_CASE("names an IPv4 reader would take for an address are refused (attack review 10, F4)") {
  // Harbor takes these as host names; here they would match only DNS names, never the
  // address meant, so the entry would silently allow nothing.
  CHECK(reject("192.000.002.001") == "an IPv4 address with leading zeros is not accepted: write 192.0.2.1");
  CHECK(reject("010.000.000.001") ==
        "an IPv4 address with leading zeros is not accepted: write 10.0.0.1 (inet_aton(3) would read it as 8.0.0.1)");
  CHECK(reject("08.1.1.1") == "an IPv4 address with leading zeros is not accepted: write 8.1.1.1");
  CHECK(reject("127.1") ==
        "looks like an IPv4 address in inet_aton(3) shorthand (hex, octal or fewer than four parts; it reads as "
        "127.0.0.1): write the address as four decimal numbers, e.g. 127.0.0.1");
  CHECK(contains(reject("0x7f.1"), "it reads as 127.0.0.1): write the address as four decimal numbers"));
  CHECK(contains(reject("1.2.3"), "it reads as 1.2.0.3"));
  CHECK(contains(reject("0xc0000201"), "it reads as 192.0.2.1"));
  CHECK(contains(reject("123"), "it reads as 0.0.0.123"));
  CHECK(reject("192.0.2.256") ==
        "the last label \"256\" is all digits, so this is no host name (no top-level domain is numeric) and no IPv4 "
        "address: write an address as four decimal numbers 0-255, e.g. 192.0.2.1");
  CHECK(contains(reject("1.2.3.4.5"), "the last label \"5\" is all digits"));
  CHECK(contains(reject("*.1.2.3"), "it reads as 1.2.0.3"));
  CHECK(contains(reject("*.x.2"), "the last label \"2\" is all digits"));
  // Digits elsewhere, or a last label with a letter, stay host names.
  CHECK(accept("1.2.3.example").kind == EntryKind::hostname);
  CHECK(accept("123.com").kind == EntryKind::hostname);
  CHECK(accept("1.2.3.4a").kind == EntryKind::hostname);
  CHECK(accept("*.1.2.3.x").kind == EntryKind::wildcard);
  CHECK(accept("0xcafe.org").kind == EntryKind::hostname);
}

TEST_CASE("label and name lengths") {
  const std::string l63(63, 'a');
  const std::string l64(64, 'a');
  CHECK(accept(l63 + ".example").text == l63 + ".example");
  CHECK(reject(l64 + ".example") ==
        "label \"" + l64 + "\" is 64 characters long; DNS allows at most 63");
  CHECK(contains(reject("*." + l64 + ".example"), "64 characters long"));

  // 4 x 63 + 3 dots = 255; trim to exactly 253 and 254.
  const std::string l61(61, 'b');
  const std::string n253 = l63 + "." + l63 + "." + l63 + "." + l61;
  REQUIRE(n253.size() == 253);
  CHECK(accept(n253).text == n253);
  CHECK(accept(n253 + ".").text == n253);  // the root dot does not count
  CHECK(reject(n253 + "b") == "the name is 254 characters long; DNS allows at most 253");
  // A wildcard's "*." counts: no name below a 252-char suffix fits in DNS.
  CHECK(accept("*." + n253.substr(2)).kind == EntryKind::wildcard);
  CHECK(contains(reject("*." + n253), "255 characters long"));
}

TEST_CASE("label characters and hyphens") {
  CHECK(reject("pypi_org.com") == "label \"pypi_org\" contains \"_\": only letters, digits and hyphens are allowed");
  CHECK(reject("-pypi.org") == "label \"-pypi\" starts with a hyphen");
  CHECK(reject("pypi-.org") == "label \"pypi-\" ends with a hyphen");
  CHECK(reject("pypi.org-") == "label \"org-\" ends with a hyphen");
  CHECK(accept("py--pi.org").text == "py--pi.org");
  CHECK(contains(reject("a..b"), "empty label"));
  CHECK(contains(reject(".pypi.org"), "empty label"));
  CHECK(contains(reject("user@pypi.org"), "contains \"@\""));
  CHECK(contains(reject("pypi.org;rm"), "contains \";\""));
  CHECK(contains(reject("pypi!.org"), "contains \"!\""));
  CHECK(contains(reject("bücher.de"), "punycode"));
  CHECK(contains(reject("py pi.org"), "whitespace"));
  CHECK(contains(reject("pypi.org github.com"), "one host per entry"));
}

TEST_CASE("control bytes are escaped in messages") {
  auto r = parse_entry("pypi\x01.org");
  REQUIRE(!r.ok());
  CHECK(r.error().message.starts_with("entry \"pypi\\x01.org\": "));
  auto q = parse_entry("a\"b");
  REQUIRE(!q.ok());
  CHECK(q.error().message.starts_with("entry \"a\\\"b\": "));
}

TEST_CASE("empty entries") {
  CHECK(reject("") == "the entry is empty: give a host name, IP address or CIDR");
  CHECK(contains(reject("   "), "empty"));
  CHECK(contains(reject("\t\n"), "empty"));
}

TEST_CASE("leading wildcards") {
  Entry e = accept("*.github.com");
  CHECK(e.kind == EntryKind::wildcard);
  CHECK(e.text == "*.github.com");
  CHECK(e.name_suffix() == "github.com");
  CHECK(e.is_name());
  CHECK(accept("*.com").name_suffix() == "com");
}

TEST_CASE("misplaced wildcards") {
  CHECK(contains(reject("*"), "would allow every host"));
  CHECK(contains(reject("api.*.x.org"), "middle of a name"));
  CHECK(contains(reject("pypi*.org"), "middle of a name"));
  CHECK(contains(reject("pypi.*"), "trailing wildcards"));
  CHECK(contains(reject("pypi.org*"), "trailing wildcards"));
  CHECK(reject("*pypi.org") == "a wildcard must be the whole leading label, followed by a dot: write \"*.pypi.org\"");
  CHECK(contains(reject("**.pypi.org"), "write \"*.pypi.org\""));
  CHECK(contains(reject("*.*.x.org"), "only one wildcard"));
  CHECK(contains(reject("*.x.*"), "only one wildcard"));
  CHECK(contains(reject("*."), "would allow every host"));  // "*." is "*" with a root dot
  CHECK(contains(reject("*.."), "needs a domain"));
  CHECK(contains(reject("*.-x.org"), "starts with a hyphen"));
  CHECK(contains(reject("*..x.org"), "empty label"));
}

TEST_CASE("wildcards over IP addresses") {
  CHECK(reject("*.1.1.1.1") == "wildcards match host names, not IP addresses: list the address itself or a CIDR");
  CHECK(contains(reject("*.192.0.2.1"), "not IP addresses"));
  CHECK(contains(reject("*.192.0.2.0/24"), "not IP addresses"));
  CHECK(contains(reject("*.2001:db8::1"), "not IP addresses"));
}

TEST_CASE("URLs, paths, ports") {
  CHECK(reject("https://pypi.org") == "URLs are not allowed: give the host name alone");
  CHECK(reject("HTTP://PyPI.org/simple") == "URLs are not allowed: give the host name alone");
  CHECK(reject("ftp://192.0.2.1") == "URLs are not allowed: give the host name alone");
  CHECK(reject("pypi.org:443") == "ports are not allowed: use the host alone");
  CHECK(reject("192.0.2.1:80") == "ports are not allowed: use the host alone");
  CHECK(reject("*.pypi.org:443") == "ports are not allowed: use the host alone");
  CHECK(reject("pypi.org/simple") == "paths are not allowed: give the host name alone");
  CHECK(reject("pypi.org/") == "paths are not allowed: give the host name alone");
  CHECK(reject("*.example.com/x") == "paths are not allowed: give the host name alone");
  CHECK(contains(reject("mailto:user"), "\":\" is not allowed in a host name"));
  CHECK(contains(reject("pypi.org:"), "\":\" is not allowed"));
}

TEST_CASE("brackets and zone ids") {
  CHECK(contains(reject("[2001:db8::1]"), "brackets are not allowed"));
  CHECK(contains(reject("[2001:db8::1]:443"), "brackets are not allowed"));
  CHECK(contains(reject("[::1"), "brackets"));
  CHECK(contains(reject("[pypi.org]"), "brackets"));
  CHECK(reject("fe80::1%eth0") == "IPv6 zone ids (\"%eth0\") are not allowed: give the address alone");
  CHECK(contains(reject("fe80::%eth0/64"), "zone ids"));
  CHECK(accept("fe80::1").text == "fe80::1");
}

TEST_CASE("IPv4 addresses") {
  Entry e = accept("192.0.2.1");
  CHECK(e.kind == EntryKind::ipv4);
  CHECK(e.text == "192.0.2.1");
  CHECK(!e.is_name());
  CHECK(e.ip.family == 4);
  CHECK(e.ip.prefix_len == 32);
  CHECK(e.ip.bytes[0] == 192);
  CHECK(e.ip.bytes[3] == 1);
  CHECK(accept("0.0.0.0").text == "0.0.0.0");
  CHECK(accept("255.255.255.255").text == "255.255.255.255");
}

TEST_CASE("IPv6 addresses are printed compressed, as inet_ntop does") {
  Entry e = accept("2001:DB8::1");
  CHECK(e.kind == EntryKind::ipv6);
  CHECK(e.text == "2001:db8::1");
  CHECK(e.ip.family == 6);
  CHECK(e.ip.prefix_len == 128);
  CHECK(accept("2001:0db8:0000:0000:0000:0000:0000:0001").text == "2001:db8::1");
  CHECK(accept("2001:db8:0:0:1:0:0:1").text == "2001:db8::1:0:0:1");  // first longest run
  CHECK(accept("2001:db8:0:1:1:1:1:1").text == "2001:db8:0:1:1:1:1:1");  // one zero group stays
  CHECK(accept("::1").text == "::1");
  CHECK(accept("::").text == "::");
  // Attack review 10, F4: a mapped address leaves as IPv4, which an IPv6 entry never allows.
  CHECK(reject("::FFFF:192.0.2.1") ==
        "an IPv4-mapped IPv6 address reaches the IPv4 address, which an IPv6 entry does not allow: write 192.0.2.1");
  CHECK(contains(reject("::ffff:c000:201"), "write 192.0.2.1"));
  CHECK(contains(reject("::ffff:0:0/96"), "write 0.0.0.0/0"));
  CHECK(contains(reject("::ffff:192.0.2.0/120"), "write 192.0.2.0/24"));
  CHECK(contains(reject("::ffff:192.0.2.1/128"), "write 192.0.2.1"));
  CHECK(accept("::/0").text == "::/0");  // wider than the mapped range: an IPv6 network
  CHECK(accept("::192.0.2.1").text == "::192.0.2.1");
  CHECK(accept("64:ff9b::192.0.2.1").text == "64:ff9b::c000:201");
  CHECK(contains(reject("2001:db8:::1"), "not a valid IPv6 address"));
  CHECK(contains(reject("1::2::3"), "not a valid IPv6 address"));
  CHECK(contains(reject("2001:db8::g"), "\":\" is not allowed"));
}

TEST_CASE("IPv4 CIDRs") {
  Entry e = accept("192.0.2.0/24");
  CHECK(e.kind == EntryKind::ipv4_cidr);
  CHECK(e.text == "192.0.2.0/24");
  CHECK(e.ip.prefix_len == 24);
  CHECK(accept("10.0.0.0/8").text == "10.0.0.0/8");
  CHECK(accept("0.0.0.0/0").text == "0.0.0.0/0");
  CHECK(accept("198.51.100.128/25").text == "198.51.100.128/25");
  // Python's ip_network (Harbor) forms: leading zeros in the length, netmask.
  CHECK(accept("192.0.2.0/024").text == "192.0.2.0/24");
  CHECK(accept("192.0.2.0/255.255.255.0").text == "192.0.2.0/24");
  CHECK(accept("0.0.0.0/0.0.0.0").text == "0.0.0.0/0");
  // A /32 is one address: same entry as the bare address.
  Entry one = accept("192.0.2.1/32");
  CHECK(one.kind == EntryKind::ipv4);
  CHECK(one.text == "192.0.2.1");
}

TEST_CASE("IPv6 CIDRs") {
  Entry e = accept("2001:db8::/32");
  CHECK(e.kind == EntryKind::ipv6_cidr);
  CHECK(e.text == "2001:db8::/32");
  CHECK(e.ip.prefix_len == 32);
  CHECK(accept("2001:DB8:0::/48").text == "2001:db8::/48");
  CHECK(accept("::/0").text == "::/0");
  CHECK(accept("2001:db8::/032").text == "2001:db8::/32");
  Entry one = accept("2001:db8::1/128");
  CHECK(one.kind == EntryKind::ipv6);
  CHECK(one.text == "2001:db8::1");
}

TEST_CASE("CIDRs with host bits set name the network probably meant") {
  CHECK(reject("192.0.2.1/24") == "host bits are set: did you mean 192.0.2.0/24?");
  CHECK(reject("10.1.2.3/8") == "host bits are set: did you mean 10.0.0.0/8?");
  CHECK(reject("198.51.100.129/31") == "host bits are set: did you mean 198.51.100.128/31?");
  CHECK(reject("2001:db8::1/32") == "host bits are set: did you mean 2001:db8::/32?");
  CHECK(reject("2001:DB8:1::/31") == "host bits are set: did you mean 2001:db8::/31?");
  CHECK(reject("0.0.0.1/0") == "host bits are set: did you mean 0.0.0.0/0?");
}

TEST_CASE("bad prefix lengths") {
  CHECK(reject("192.0.2.0/33") == "prefix length /33 is out of range: IPv4 allows /0 to /32");
  CHECK(reject("2001:db8::/129") == "prefix length /129 is out of range: IPv6 allows /0 to /128");
  CHECK(contains(reject("192.0.2.0/1000"), "out of range"));
  CHECK(contains(reject("192.0.2.0/"), "prefix length after \"/\" is missing"));
  CHECK(contains(reject("192.0.2.0/abc"), "is not a number"));
  CHECK(contains(reject("192.0.2.0/-1"), "is not a number"));
  CHECK(contains(reject("192.0.2.0/+24"), "is not a number"));
  CHECK(contains(reject("2001:db8::/ffff::"), "is not a number"));
  CHECK(contains(reject("192.0.2.0/255.0.255.0"), "not contiguous"));
  CHECK(contains(reject("192.0.2.0/0.0.0.255"), "not contiguous"));  // hostmask
  CHECK(contains(reject("192.0.2.0/24/8"), "more than one \"/\""));
  CHECK(contains(reject("/24"), "needs an address before"));
  CHECK(reject("192.0.2/24") == "\"192.0.2\" is not a valid IP address");
  CHECK(reject("192.0.2.256/32") == "\"192.0.2.256\" is not a valid IP address");
  CHECK(contains(reject("2001:db8:::/32"), "not a valid IP address"));
  CHECK(contains(reject("192.0.2.0/ 24"), "whitespace"));
}

TEST_CASE("parse_entries dedupes after normalization, in input order") {
  auto r = parse_entries({"PyPI.org", "*.x.org", "pypi.org.", " pypi.org ", "192.0.2.1/32", "2001:DB8::1",
                          "192.0.2.1", "2001:db8:0::1", "*.X.org", "github.com"});
  REQUIRE(r.ok());
  std::vector<std::string> texts;
  for (const Entry& e : *r) texts.push_back(e.text);
  CHECK(texts == std::vector<std::string>{"pypi.org", "*.x.org", "192.0.2.1", "2001:db8::1", "github.com"});

  auto empty = parse_entries({});
  REQUIRE(empty.ok());
  CHECK(empty->empty());
}

TEST_CASE("parse_entries fails on the first bad entry, naming it") {
  auto r = parse_entries({"pypi.org", "pypi.org:443", "https://x"});
  REQUIRE(!r.ok());
  CHECK(r.error().kind == ErrorKind::invalid);
  CHECK(r.error().message == "entry \"pypi.org:443\": ports are not allowed: use the host alone");
}

TEST_CASE("matching: exact hostnames") {
  Entry e = accept("pypi.org");
  CHECK(entry_matches_name(e, "pypi.org"));
  CHECK_FALSE(entry_matches_name(e, "www.pypi.org"));
  CHECK_FALSE(entry_matches_name(e, "pypi.org.evil.example"));
  CHECK_FALSE(entry_matches_name(e, "xpypi.org"));
  CHECK_FALSE(entry_matches_name(e, "pypi.or"));
  CHECK_FALSE(entry_matches_name(e, ""));
}

TEST_CASE("matching: wildcards match below the suffix at any depth, never the apex") {
  Entry e = accept("*.github.com");
  CHECK(entry_matches_name(e, "api.github.com"));
  CHECK(entry_matches_name(e, "a.b.github.com"));
  CHECK(entry_matches_name(e, "x.y.z.github.com"));
  CHECK_FALSE(entry_matches_name(e, "github.com"));
  CHECK_FALSE(entry_matches_name(e, "xgithub.com"));
  CHECK_FALSE(entry_matches_name(e, ".github.com"));
  CHECK_FALSE(entry_matches_name(e, "github.com.evil.example"));
  CHECK_FALSE(entry_matches_name(e, "api.github.co"));
  CHECK_FALSE(entry_matches_name(e, "com"));
  CHECK_FALSE(entry_matches_name(e, ""));
}

TEST_CASE("matching: IP entries never match names") {
  CHECK_FALSE(entry_matches_name(accept("192.0.2.1"), "192.0.2.1"));
  CHECK_FALSE(entry_matches_name(accept("192.0.2.0/24"), "192.0.2.0/24"));
}

TEST_CASE("kind names") {
  CHECK(to_string(EntryKind::hostname) == "hostname");
  CHECK(to_string(EntryKind::wildcard) == "wildcard");
  CHECK(to_string(EntryKind::ipv4) == "ipv4");
  CHECK(to_string(EntryKind::ipv6) == "ipv6");
  CHECK(to_string(EntryKind::ipv4_cidr) == "ipv4-cidr");
  CHECK(to_string(EntryKind::ipv6_cidr) == "ipv6-cidr");
}

TEST_CASE("parse_ip accepts bare addresses only") {
  auto v4 = parse_ip("192.0.2.1");
  REQUIRE(v4);
  CHECK(v4->family == 4);
  CHECK(v4->prefix_len == 32);
  CHECK(v4->to_string() == "192.0.2.1");
  auto v6 = parse_ip("2001:DB8::1");
  REQUIRE(v6);
  CHECK(v6->family == 6);
  CHECK(v6->to_string() == "2001:db8::1");

  for (const char* bad : {"", " 192.0.2.1", "192.0.2.1 ", "192.0.2.1/32", "[::1]", "fe80::1%eth0", "01.2.3.4",
                          "1.2.3", "256.0.0.1", "pypi.org", "::1/128", "192.0.2.1:80"}) {
    INFO(bad);
    CHECK_FALSE(parse_ip(bad));
  }
  using namespace std::string_view_literals;
  CHECK_FALSE(parse_ip("192.0.2.1\0junk"sv));  // would pass a C-string parser
  CHECK_FALSE(parse_ip(std::string(100, '1')));
}

TEST_CASE("IpPrefix::contains") {
  const IpPrefix net = accept("192.0.2.0/24").ip;
  CHECK(net.contains(*parse_ip("192.0.2.0")));
  CHECK(net.contains(*parse_ip("192.0.2.255")));
  CHECK_FALSE(net.contains(*parse_ip("192.0.3.0")));
  CHECK_FALSE(net.contains(*parse_ip("::ffff:192.0.2.1")));  // other family

  const IpPrefix odd = accept("198.51.100.128/25").ip;
  CHECK(odd.contains(*parse_ip("198.51.100.200")));
  CHECK_FALSE(odd.contains(*parse_ip("198.51.100.127")));

  CHECK(accept("0.0.0.0/0").ip.contains(*parse_ip("203.0.113.9")));
  const IpPrefix one = accept("192.0.2.1").ip;
  CHECK(one.contains(*parse_ip("192.0.2.1")));
  CHECK_FALSE(one.contains(*parse_ip("192.0.2.2")));
  CHECK_FALSE(one.contains(net));  // a wider prefix is not inside a narrower one

  const IpPrefix v6 = accept("2001:db8::/32").ip;
  CHECK(v6.contains(*parse_ip("2001:db8:ffff::1")));
  CHECK_FALSE(v6.contains(*parse_ip("2001:db9::1")));
  CHECK(accept("::/0").ip.contains(*parse_ip("::1")));
}

TEST_CASE("modes") {
  CHECK(to_string(Mode::public_) == "public");
  CHECK(to_string(Mode::no_network) == "no-network");
  CHECK(to_string(Mode::allowlist) == "allowlist");
  CHECK(parse_mode("public") == Mode::public_);
  CHECK(parse_mode("no-network") == Mode::no_network);
  CHECK(parse_mode("allowlist") == Mode::allowlist);
  CHECK_FALSE(parse_mode("Allowlist"));
  CHECK_FALSE(parse_mode("no_network"));
  CHECK_FALSE(parse_mode(" public"));
  CHECK_FALSE(parse_mode(""));
}

TEST_CASE("phase names") {
  CHECK(valid_phase_name("agent"));
  CHECK(valid_phase_name("Step-1_b"));
  CHECK(valid_phase_name(std::string(32, 'a')));
  CHECK_FALSE(valid_phase_name(std::string(33, 'a')));
  CHECK_FALSE(valid_phase_name(""));
  CHECK_FALSE(valid_phase_name("my phase"));
  CHECK_FALSE(valid_phase_name("a.b"));
  CHECK_FALSE(valid_phase_name("agent/1"));
}

TEST_CASE("Phase::count and Policy::find") {
  auto p = make_inline_phase("agent", Mode::allowlist,
                             {"pypi.org", "*.x.org", "*.y.org", "192.0.2.1", "2001:db8::/32"});
  REQUIRE(p.ok());
  CHECK(p->count(EntryKind::hostname) == 1);
  CHECK(p->count(EntryKind::wildcard) == 2);
  CHECK(p->count(EntryKind::ipv4) == 1);
  CHECK(p->count(EntryKind::ipv6) == 0);
  CHECK(p->count(EntryKind::ipv6_cidr) == 1);

  Policy pol;
  pol.phases.push_back(*p);
  pol.phases.push_back(Phase{"verifier", Mode::no_network, {}});
  REQUIRE(pol.find("verifier") != nullptr);
  CHECK(pol.find("verifier")->mode == Mode::no_network);
  CHECK(pol.find("agent") == &pol.phases[0]);
  CHECK(pol.find("Agent") == nullptr);
  CHECK(pol.find("") == nullptr);
}

TEST_CASE("make_inline_phase") {
  auto ok = make_inline_phase("inline", Mode::allowlist, {"PyPI.org", "pypi.org"});
  REQUIRE(ok.ok());
  CHECK(ok->name == "inline");
  CHECK(ok->mode == Mode::allowlist);
  REQUIRE(ok->entries.size() == 1);
  CHECK(ok->entries[0].text == "pypi.org");

  auto deny_all = make_inline_phase("inline", Mode::allowlist, {});
  REQUIRE(deny_all.ok());
  CHECK(deny_all->entries.empty());

  auto none = make_inline_phase("inline", Mode::no_network, {});
  REQUIRE(none.ok());
  CHECK(none->mode == Mode::no_network);

  auto mixed = make_inline_phase("inline", Mode::public_, {"pypi.org"});
  REQUIRE(!mixed.ok());
  CHECK(mixed.error().kind == ErrorKind::invalid);
  CHECK(mixed.error().message == "allowlist entries are only valid with mode allowlist, not public");

  auto bad = make_inline_phase("inline", Mode::allowlist, {"pypi.org", "*"});
  REQUIRE(!bad.ok());
  CHECK(bad.error().message.starts_with("entry \"*\": "));

  auto bad_name = make_inline_phase("in line", Mode::no_network, {});
  REQUIRE(!bad_name.ok());
  CHECK(bad_name.error().kind == ErrorKind::invalid);
}

TEST_CASE("a rejected wildcard's hint escapes control bytes like the entry itself") {
  // Found by tests/fuzz/entry_fuzz: the "write ..." hint quoted the raw rest
  // of the entry, so an ESC sequence or NUL reached `egressd check`'s stderr.
  const std::string msg = reject("*\x1b" "c.example\x01");  // ESC c resets a terminal
  CHECK(msg.find('\x1b') == std::string::npos);
  CHECK(msg.find('\x01') == std::string::npos);
  CHECK(contains(msg, "write \"*.\\x1bc.example\\x01\""));
}

TEST_CASE("IPv4 text form is inet_ntop's, for every byte value and prefix length") {
  // IpPrefix::to_string formats IPv4 by hand (it is on the path of every
  // inline allowlist entry); the text must stay exactly what inet_ntop prints.
  for (unsigned v = 0; v < 256; ++v) {
    for (std::size_t pos = 0; pos < 4; ++pos) {
      IpPrefix ip;
      ip.family = 4;
      ip.prefix_len = 32;
      ip.bytes = {198, 51, 100, 7};
      ip.bytes[pos] = static_cast<std::uint8_t>(v);
      char want[INET_ADDRSTRLEN] = {};
      REQUIRE(inet_ntop(AF_INET, ip.bytes.data(), want, sizeof want) != nullptr);
      CHECK(ip.to_string() == want);
      const auto back = parse_ip(ip.to_string());
      REQUIRE(back.has_value());
      CHECK(back->bytes == ip.bytes);
    }
  }
  IpPrefix net;
  net.family = 4;
  net.bytes = {0, 0, 0, 0};
  for (int len = 0; len < 32; ++len) {
    net.prefix_len = static_cast<std::uint8_t>(len);
    CHECK(net.to_string() == "0.0.0.0/" + std::to_string(len));
  }
  net.bytes = {255, 255, 255, 255};
  net.prefix_len = 32;
  CHECK(net.to_string() == "255.255.255.255");
  CHECK(accept("203.0.113.0/31").text == "203.0.113.0/31");
}

TEST_CASE("addresses order by family, then byte by byte, then prefix length") {
  const auto ip = [](const char* s) { return *parse_ip(s); };
  const IpAddrLess less;
  // Byte order, not host word order: each of the 16 bytes decides in turn.
  const std::vector<IpPrefix> ordered = {
      ip("0.0.0.1"),      ip("0.0.1.0"),     ip("192.0.2.1"),       ip("192.0.2.2"),
      ip("198.51.100.1"), ip("::1"),         ip("::1:0"),           ip("::100:0:0:0"),
      ip("::1:0:0:0:0"),  ip("2001:db8::1"), ip("2001:db8::100"),   ip("2001:db8:0:1::"),
      ip("2001:db8:1::"), ip("2001:db9::"),  ip("ff02::1")};
  for (std::size_t i = 0; i < ordered.size(); ++i) {
    for (std::size_t j = 0; j < ordered.size(); ++j) {
      INFO(ordered[i].to_string(), " vs ", ordered[j].to_string());
      CHECK(less(ordered[i], ordered[j]) == (i < j));
    }
  }
  IpPrefix net = ip("192.0.2.0");
  net.prefix_len = 24;
  CHECK_FALSE(less(net, ip("192.0.2.0")));  // the prefix length aside
  CHECK_FALSE(less(ip("192.0.2.0"), net));
  CHECK(IpPrefixLess{}(net, ip("192.0.2.0")));
  CHECK_FALSE(IpPrefixLess{}(ip("192.0.2.0"), net));
}
