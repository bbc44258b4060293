// explain (src/audit/explain.h): target parsing, and the verdict, entry,
// learned name and hint for each way a phase allows or denies a target.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "audit/explain.h"

using namespace egressd;
using namespace egressd::audit;

namespace {

Phase allowlist(std::vector<std::string> raw, std::string name = "agent") {
  auto ph = make_inline_phase(name, Mode::allowlist, raw);
  REQUIRE(ph.ok());
  return *ph;
}

Target target(std::string_view raw) {
  auto t = parse_target(raw);
  const std::string what(raw);
  REQUIRE_MESSAGE(t.ok(), what);
  return *t;
}

IpPrefix ip(const char* s) { return *parse_ip(s); }

std::string parse_error(std::string_view raw) {
  auto t = parse_target(raw);
  const std::string what = std::string(raw) + " parsed as " + (t.ok() ? t->text() : "");
  REQUIRE_MESSAGE(!t.ok(), what);
  CHECK(t.error().kind == ErrorKind::invalid);
  return t.error().message;
}

Explanation ask(const Phase& ph, std::string_view raw, const LearnedView& learned = {},
                const NamesFor& names_for = {}) {
  return explain(ph, target(raw), learned, names_for);
}

}  // namespace

TEST_CASE("targets: hostnames, addresses, ports") {
  CHECK(target("PyPI.org.").text() == "pypi.org");
  CHECK_FALSE(target("pypi.org").is_address);
  CHECK(target("pypi.org:443").text() == "pypi.org:443");
  CHECK(target(" 192.0.2.10 ").text() == "192.0.2.10");
  CHECK(target("192.0.2.10:443").text() == "192.0.2.10:443");
  CHECK(*target("192.0.2.10:443").port == 443);
  CHECK(target("2001:DB8::0:1").text() == "2001:db8::1");
  CHECK_FALSE(target("2001:db8::1").port.has_value());
  const Target v6 = target("[2001:db8::1]:8443");
  CHECK(v6.is_address);
  CHECK(v6.addr == ip("2001:db8::1"));
  CHECK(*v6.port == 8443);
  CHECK(v6.text() == "[2001:db8::1]:8443");
  CHECK(target("[2001:db8::1]").text() == "2001:db8::1");
  CHECK(*target("198.51.100.1:65535").port == 65535);
}

TEST_CASE("bad targets are refused with a message naming them") {
  CHECK(parse_error("").find("target \"\": empty") == 0);
  CHECK(parse_error("*.example.com").find("target \"*.example.com\": a wildcard is an allowlist entry") == 0);
  CHECK(parse_error("192.0.2.0/24").find("a CIDR is an allowlist entry") != std::string::npos);
  CHECK(parse_error("https://pypi.org/simple").find("URLs are not targets") != std::string::npos);
  CHECK(parse_error("192.0.2.256").find("\"192.0.2.256\" is not a valid IPv4 address") != std::string::npos);
  CHECK(parse_error("192.0.2.10:0").find("port \"0\"") == std::string::npos);
  CHECK(parse_error("192.0.2.10:0").find("port 0 is not a number from 1 to 65535") != std::string::npos);
  CHECK(parse_error("192.0.2.10:65536").find("port 65536") != std::string::npos);
  CHECK(parse_error("192.0.2.10:http").find("port \"http\"") != std::string::npos);
  CHECK(parse_error("192.0.2.10:").find("port \"\"") != std::string::npos);
  CHECK(parse_error("2001:db8::1:443:x").find("is not a valid IPv6 address") != std::string::npos);
  CHECK(parse_error("[192.0.2.1]:80").find("is not a valid IPv6 address") != std::string::npos);
  CHECK(parse_error("[2001:db8::1]443").find("expected \":PORT\"") != std::string::npos);
  CHECK(parse_error("[2001:db8::1").find("without \"]\"") != std::string::npos);
  CHECK(parse_error("fe80::1%eth0").find("fe80::1%eth0") != std::string::npos);
  CHECK(parse_error("bad_name.example").find("target \"bad_name.example\": label") == 0);
  // A control byte is escaped, so the message cannot forge a log line.
  CHECK(parse_error("a\nb").find("\\n") != std::string::npos);
}

TEST_CASE("an IPv6 address with an unbracketed port is explained, not guessed") {
  // 2001:db8::1:443 is itself a valid address, so only a non-address reads as addr:port.
  CHECK(target("2001:db8::1:443").text() == "2001:db8::1:443");
  CHECK(parse_error("2001:db8:::443").find("written [2001:db8::]:443") != std::string::npos);
  CHECK(parse_error("2001:db8::g").find("is not a valid IPv6 address") != std::string::npos);
  CHECK(parse_error("::ffff:192.0.2.1:80").find("written [::ffff:192.0.2.1]:80") != std::string::npos);
}

TEST_CASE("an IP entry and the most specific CIDR entry allow an address") {
  const Phase ph = allowlist({"192.0.2.0/24", "192.0.2.10", "2001:db8::/32", "2001:db8:2::/64", "pypi.org"});
  auto x = ask(ph, "192.0.2.10");
  CHECK(x.allowed);
  REQUIRE(x.entry);
  CHECK(*x.entry == "192.0.2.10");
  CHECK_FALSE(x.learned_name);
  CHECK_FALSE(x.hint);
  CHECK(x.reason == "192.0.2.10 is entry 192.0.2.10 of phase agent");

  x = ask(ph, "192.0.2.99");
  CHECK(x.allowed);
  CHECK(*x.entry == "192.0.2.0/24");
  CHECK(x.reason == "192.0.2.99 is inside entry 192.0.2.0/24 of phase agent");

  x = ask(ph, "[2001:db8:2::10]:443");
  CHECK(x.allowed);
  CHECK(*x.entry == "2001:db8:2::/64");
  CHECK(x.target == "[2001:db8:2::10]:443");
  CHECK(x.reason.find("any port") != std::string::npos);

  x = ask(ph, "2001:db8:ffff::1");
  CHECK(x.allowed);
  CHECK(*x.entry == "2001:db8::/32");

  // IPv4 entries never allow IPv6 addresses and the other way round.
  x = ask(allowlist({"2001:db8::/32"}), "192.0.2.1");
  CHECK_FALSE(x.allowed);
  CHECK_FALSE(x.entry);
}

TEST_CASE("an address learned for a name a wildcard allows: entry and learned name") {
  const Phase ph = allowlist({"*.cdn.example", "pypi.org"});
  const LearnedView learned = {
      {"foo.cdn.example", {ip("203.0.113.10"), ip("2001:db8:3::10")}},
      {"other.example", {ip("203.0.113.10"), ip("198.51.100.11")}},
      {"pypi.org", {ip("198.51.100.10")}},
  };
  auto x = ask(ph, "203.0.113.10:443", learned);
  CHECK(x.allowed);
  CHECK(*x.entry == "*.cdn.example");
  CHECK(*x.learned_name == "foo.cdn.example");
  CHECK(x.names == std::vector<std::string>{"foo.cdn.example", "other.example"});
  CHECK(x.reason.find("203.0.113.10 was learned from DNS for foo.cdn.example, which entry *.cdn.example of phase agent allows") == 0);

  x = ask(ph, "2001:db8:3::10", learned);
  CHECK(x.allowed);
  CHECK(*x.learned_name == "foo.cdn.example");

  x = ask(ph, "198.51.100.10", learned);
  CHECK(x.allowed);
  CHECK(*x.entry == "pypi.org");
  CHECK(*x.learned_name == "pypi.org");

  // Learned only for a name the phase does not allow.
  x = ask(ph, "198.51.100.11", learned);
  CHECK_FALSE(x.allowed);
  CHECK_FALSE(x.entry);
  CHECK_FALSE(x.learned_name);
  CHECK(x.names == std::vector<std::string>{"other.example"});
  CHECK(*x.hint == "add other.example");
}

TEST_CASE("a denied address names the hostnames that resolved to it and hints like for a name") {
  const Phase ph = allowlist({"pypi.org"});
  std::vector<IpPrefix> asked;
  const NamesFor names_for = [&](const IpPrefix& a) {
    asked.push_back(a);
    return std::vector<std::string>{"files.pythonhosted.org", "files.pythonhosted.org"};
  };
  auto x = ask(ph, "198.51.100.11:443", {}, names_for);
  CHECK_FALSE(x.allowed);
  CHECK(asked == std::vector<IpPrefix>{ip("198.51.100.11")});
  CHECK(x.names == std::vector<std::string>{"files.pythonhosted.org"});
  CHECK(*x.hint == "add files.pythonhosted.org");
  CHECK(x.reason.find("198.51.100.11 is in no IP or CIDR entry of phase agent") == 0);
  CHECK(x.reason.find("files.pythonhosted.org") != std::string::npos);

  // Several names: each exact name, and each sibling wildcard once.
  const NamesFor several = [](const IpPrefix&) {
    return std::vector<std::string>{"b.cdn.example", "a.cdn.example", "x.other.example"};
  };
  x = ask(ph, "198.51.100.11", {}, several);
  CHECK(*x.hint == "add a.cdn.example or b.cdn.example or x.other.example");

  // No name: the address itself, or a CIDR around it.
  x = ask(ph, "198.51.100.11");
  CHECK(x.names.empty());
  CHECK(*x.hint == "add 198.51.100.11, or a CIDR such as 198.51.100.0/24");
  x = ask(ph, "2001:db8:3::10");
  CHECK(*x.hint == "add 2001:db8:3::10, or a CIDR such as 2001:db8:3::/64");
}

TEST_CASE("a denied address whose allowed name's answer expired: resolve again") {
  const Phase ph = allowlist({"a.example.com"});
  const NamesFor names_for = [](const IpPrefix&) { return std::vector<std::string>{"a.example.com"}; };
  auto x = ask(ph, "198.51.100.10", {}, names_for);
  CHECK_FALSE(x.allowed);
  CHECK(x.reason.find("has expired") != std::string::npos);
  CHECK(x.hint->find("resolve a.example.com again") == 0);
}

TEST_CASE("rebinding-guard addresses are never allowed through a learned name") {
  const Phase ph = allowlist({"*.example.org"});
  const LearnedView learned = {{"meta.example.org", {ip("169.254.169.254")}}};
  auto x = ask(ph, "169.254.169.254", learned);
  CHECK_FALSE(x.allowed);
  CHECK(x.reason.find("rebinding guard") != std::string::npos);
  // An explicit entry still allows it (DESIGN §1).
  x = ask(allowlist({"169.254.169.254"}), "169.254.169.254", learned);
  CHECK(x.allowed);
  CHECK(*x.entry == "169.254.169.254");
}

TEST_CASE("hostnames: answered by the DNS proxy by an exact entry or a wildcard") {
  const Phase ph = allowlist({"pypi.org", "*.example.com", "192.0.2.0/24"});
  const LearnedView learned = {{"pypi.org", {ip("198.51.100.10")}}};
  auto x = ask(ph, "PyPI.org", learned);
  CHECK(x.allowed);
  CHECK(*x.entry == "pypi.org");
  CHECK_FALSE(x.learned_name);
  CHECK(x.names.empty());
  CHECK(x.reason.find("the DNS proxy answers pypi.org") == 0);
  CHECK(x.reason.find("pre-resolved") != std::string::npos);
  CHECK(x.reason.find("198.51.100.10") != std::string::npos);

  x = ask(ph, "a.b.example.com:443");
  CHECK(x.allowed);
  CHECK(*x.entry == "*.example.com");
  CHECK(x.reason.find("pre-resolved") == std::string::npos);
  CHECK(x.reason.find("any port") != std::string::npos);
}

TEST_CASE("a denied hostname gets a hint with the wildcard over its parent") {
  const Phase ph = allowlist({"pypi.org"});
  auto x = ask(ph, "files.pythonhosted.org");
  CHECK_FALSE(x.allowed);
  CHECK_FALSE(x.entry);
  CHECK(*x.hint == "add files.pythonhosted.org");
  CHECK(x.reason.find("refuses it without asking upstream") != std::string::npos);
  // Never a wildcard over a top-level domain.
  x = ask(ph, "example.com");
  CHECK(*x.hint == "add example.com");
}

TEST_CASE("a wildcard does not allow its apex") {
  const Phase ph = allowlist({"*.example.com"});
  auto x = ask(ph, "example.com");
  CHECK_FALSE(x.allowed);
  CHECK(x.reason.find("entry *.example.com matches only names below example.com, never example.com itself") !=
        std::string::npos);
  CHECK(*x.hint == "add example.com");
  CHECK(ask(ph, "www.example.com").allowed);
}

TEST_CASE("public allows everything, no-network denies everything, loopback is always allowed") {
  const Phase pub{"environment", Mode::public_, {}};
  auto x = ask(pub, "198.51.100.11:443");
  CHECK(x.allowed);
  CHECK_FALSE(x.entry);
  CHECK(x.mode == Mode::public_);
  CHECK(x.reason.find("phase environment is public") == 0);
  x = ask(pub, "files.pythonhosted.org");
  CHECK(x.allowed);
  CHECK(x.reason.find("DNS queries are forwarded") != std::string::npos);

  const Phase none{"verifier", Mode::no_network, {}};
  x = ask(none, "192.0.2.10");
  CHECK_FALSE(x.allowed);
  CHECK_FALSE(x.entry);
  CHECK(x.reason.find("phase verifier is no-network") == 0);
  CHECK(x.hint->find("switch to a phase") == 0);
  x = ask(none, "pypi.org");
  CHECK_FALSE(x.allowed);
  CHECK(x.reason.find("refused") != std::string::npos);

  CHECK(ask(none, "127.0.0.53").allowed);
  CHECK(ask(none, "[::1]:8080").allowed);
  CHECK(ask(none, "127.0.0.53").reason.find("loopback is always allowed") != std::string::npos);

  // An allowlist with no entries denies everything.
  x = ask(allowlist({}), "192.0.2.10");
  CHECK_FALSE(x.allowed);
  CHECK(x.reason.find("no entries") != std::string::npos);
}

TEST_CASE("outside public broadcast and multicast are denied whatever entry covers them; loopback upstreams are egressd's") {
  const Phase wide = allowlist({"224.0.0.0/4", "ff00::/8", "255.255.255.255", "198.51.100.0/24"});
  for (const char* t : {"224.1.2.3", "ff0e::1234", "255.255.255.255:9"}) {
    CAPTURE(t);
    const auto x = ask(wide, t);
    CHECK_FALSE(x.allowed);
    CHECK(x.reason.find("broadcast and multicast destinations are denied") != std::string::npos);
  }
  CHECK(ask(wide, "198.51.100.7").allowed);
  const Phase pub{"environment", Mode::public_, {}};
  CHECK(ask(pub, "224.1.2.3").allowed);
  const std::vector<IpPrefix> lo = {ip("127.0.0.11")};
  for (const Phase* ph : {&pub, &wide}) {
    const auto x = explain(*ph, *parse_target("127.0.0.11:53"), {}, {}, lo);
    CHECK_FALSE(x.allowed);
    CHECK(x.reason.find("only egressd reaches it") != std::string::npos);
    CHECK(explain(*ph, *parse_target("127.0.0.1"), {}, {}, lo).allowed);
  }
}

TEST_CASE("the JSON shape") {
  const Phase ph = allowlist({"*.cdn.example"});
  const LearnedView learned = {{"foo.cdn.example", {ip("203.0.113.10")}}};
  auto j = ask(ph, "203.0.113.10", learned).to_json();
  CHECK(j["target"] == "203.0.113.10");
  CHECK(j["phase"] == "agent");
  CHECK(j["mode"] == "allowlist");
  CHECK(j["allowed"] == true);
  CHECK(j["entry"] == "*.cdn.example");
  CHECK(j["learned_name"] == "foo.cdn.example");
  CHECK(j["names"] == nlohmann::json::array({"foo.cdn.example"}));
  CHECK(j["hint"].is_null());
  CHECK(j["reason"].is_string());
  CHECK(j["guard"].is_null());
  CHECK(j["inspected"] == false);
  CHECK(j["pin"].is_null());
  CHECK(j.size() == 12);

  j = ask(ph, "files.pythonhosted.org").to_json();
  CHECK(j["allowed"] == false);
  CHECK(j["entry"].is_null());
  CHECK(j["learned_name"].is_null());
  CHECK(j["names"] == nlohmann::json::array());
  CHECK(j["hint"] == "add files.pythonhosted.org");
}

// ---- NAME@ADDRESS[:PORT]: hostname pinning (issue 16 point 8) ----

TEST_CASE("NAME@ADDRESS targets: the name a flow presents on an address") {
  const Target t = target("Same-IP.test.@203.0.113.10:443");
  CHECK(t.is_address);
  CHECK(t.addr == ip("203.0.113.10"));
  CHECK(*t.presented == "same-ip.test");
  CHECK(*t.port == 443);
  CHECK(t.text() == "same-ip.test@203.0.113.10:443");
  CHECK(target("a.test@2001:db8::10").text() == "a.test@2001:db8::10");
  CHECK(target("a.test@[2001:db8::10]:8443").text() == "a.test@[2001:db8::10]:8443");
  CHECK_FALSE(target("a.test@192.0.2.1").port.has_value());
  CHECK_FALSE(target("192.0.2.1").presented.has_value());
}

TEST_CASE("bad NAME@ADDRESS targets name the culprit") {
  CHECK(parse_error("foo@").find("no address after \"@\"") != std::string::npos);
  CHECK(parse_error("@1.2.3.4").find("no name before \"@\"") != std::string::npos);
  CHECK(parse_error("bad name@192.0.2.1").find("the name \"bad name\" before \"@\" is not a host name") !=
        std::string::npos);
  CHECK(parse_error("*.a.test@192.0.2.1").find("\"*.a.test\"") != std::string::npos);
  CHECK(parse_error("a..test@192.0.2.1").find("not a host name") != std::string::npos);
  CHECK(parse_error("a.test@b.test").find("not the hostname \"b.test\"") != std::string::npos);
  CHECK(parse_error("a.test@b.test:443").find("not the hostname \"b.test\"") != std::string::npos);
  CHECK(parse_error("a.test@192.0.2.1:0").find("port 0 is not a number") != std::string::npos);
  CHECK(parse_error("a.test@192.0.2.1/24").find("192.0.2.1/24") != std::string::npos);
  CHECK(parse_error("a@b@192.0.2.1").find("more than one \"@\"") != std::string::npos);
  // Every message quotes the whole target as typed.
  CHECK(parse_error("foo@").rfind("target \"foo@\": ", 0) == 0);
}

TEST_CASE("NAME@ADDRESS: the learned name is admitted, with pin::decide's line") {
  const Phase ph = allowlist({"allowed.test", "same-ip.test", "*.wild.test"});
  const LearnedView learned{{"allowed.test", {ip("203.0.113.10")}}, {"same-ip.test", {ip("203.0.113.20")}}};
  const Explanation ok = ask(ph, "allowed.test@203.0.113.10:443", learned);
  CHECK(ok.allowed);
  CHECK(ok.inspected);
  CHECK(*ok.pin == "tls sni allowed.test to 203.0.113.10:443; allowed by allowed.test");
  CHECK(*ok.entry == "allowed.test");
  CHECK(*ok.learned_name == "allowed.test");
  // No port: 443; port 80: the HTTP line.
  CHECK(*ask(ph, "allowed.test@203.0.113.10", learned).pin ==
        "tls sni allowed.test to 203.0.113.10:443; allowed by allowed.test");
  CHECK(*ask(ph, "allowed.test@203.0.113.10:80", learned).pin ==
        "http host allowed.test to 203.0.113.10:80; allowed by allowed.test");
  CHECK(ok.to_json()["pin"] == "tls sni allowed.test to 203.0.113.10:443; allowed by allowed.test");
  CHECK(ok.to_json()["inspected"] == true);
}

TEST_CASE("NAME@ADDRESS: a name the phase allows, learned for another address, is reset (strict pinning)") {
  const Phase ph = allowlist({"allowed.test", "same-ip.test"});
  const LearnedView learned{{"allowed.test", {ip("203.0.113.10")}}, {"same-ip.test", {ip("203.0.113.20")}}};
  const Explanation x = ask(ph, "same-ip.test@203.0.113.10:443", learned);
  CHECK_FALSE(x.allowed);
  CHECK(x.inspected);
  CHECK(*x.pin == "tls sni same-ip.test to 203.0.113.10:443; address learned for allowed.test");
  CHECK_FALSE(x.entry.has_value());
  CHECK(x.reason.find("entry same-ip.test of phase agent allows same-ip.test, but same-ip.test did not resolve to "
                      "203.0.113.10 through egressd (it resolved to 203.0.113.20)") != std::string::npos);
  CHECK(x.hint.has_value());
}

TEST_CASE("NAME@ADDRESS: a name the phase does not allow is reset") {
  const Phase ph = allowlist({"allowed.test"});
  const LearnedView learned{{"allowed.test", {ip("203.0.113.10"), ip("2001:db8::10")}}};
  const Explanation x = ask(ph, "same-ip.test@[2001:db8::10]:443", learned);
  CHECK_FALSE(x.allowed);
  CHECK(x.inspected);
  CHECK(*x.pin == "tls sni same-ip.test to [2001:db8::10]:443; address learned for allowed.test");
  CHECK(x.reason.find("no entry of phase agent allows same-ip.test") != std::string::npos);
  CHECK(x.hint->find("add same-ip.test") != std::string::npos);
  // A wildcard's sibling on an address learned for another name below it.
  const Phase wild = allowlist({"*.example.test"});
  const LearnedView w{{"a.example.test", {ip("198.51.100.5")}}};
  const Explanation b = ask(wild, "b.example.test@198.51.100.5:443", w);
  CHECK_FALSE(b.allowed);
  CHECK(*b.pin == "tls sni b.example.test to 198.51.100.5:443; address learned for a.example.test");
  CHECK(b.reason.find("(no live answer for it)") != std::string::npos);
}

TEST_CASE("NAME@ADDRESS: not inspected where the address alone decides") {
  const Phase ph = allowlist({"allowed.test", "192.0.2.0/24"});
  const LearnedView learned{{"allowed.test", {ip("203.0.113.10")}}};
  // An IP/CIDR entry: any name passes.
  const Explanation cidr = ask(ph, "other.test@192.0.2.7:443", learned);
  CHECK(cidr.allowed);
  CHECK_FALSE(cidr.inspected);
  CHECK_FALSE(cidr.pin.has_value());
  CHECK(cidr.reason.find("never inspects an address an IP or CIDR entry allows") != std::string::npos);
  // pin_names off: the learned address admits any name.
  const Explanation off = explain(ph, target("other.test@203.0.113.10:443"), learned, {}, {}, PrivateAnswers::exact,
                                  false);
  CHECK(off.allowed);
  CHECK_FALSE(off.inspected);
  CHECK(off.reason.find("enforce.pin_names: false") != std::string::npos);
  // Public and no-network phases.
  auto pub = make_inline_phase("environment", Mode::public_, {});
  const Explanation p = ask(*pub, "other.test@203.0.113.10:443", learned);
  CHECK(p.allowed);
  CHECK_FALSE(p.inspected);
  CHECK(p.reason.find("inspects only allowlist phases") != std::string::npos);
  auto none = make_inline_phase("verifier", Mode::no_network, {});
  const Explanation n = ask(*none, "allowed.test@203.0.113.10:443", learned);
  CHECK_FALSE(n.allowed);
  CHECK_FALSE(n.inspected);
  CHECK(n.reason.find("refused by address before any name is read") != std::string::npos);
  // An address no name was learned for: denied by address, whatever the name.
  const Explanation d = ask(ph, "allowed.test@198.51.100.99:443", learned);
  CHECK_FALSE(d.allowed);
  CHECK_FALSE(d.inspected);
  CHECK_FALSE(d.pin.has_value());
  // Loopback.
  const Explanation lo = ask(ph, "allowed.test@127.0.0.1:443", learned);
  CHECK(lo.allowed);
  CHECK_FALSE(lo.inspected);
}
