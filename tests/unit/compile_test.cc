// The compiler: what a policy turns into, and what a switch sends. Kernel-free.
#include <doctest/doctest.h>

#include <algorithm>

#include "nft/compile.h"

using namespace egressd;
using namespace egressd::nft;

namespace {

Phase phase(std::string name, Mode mode, std::vector<std::string> entries = {}) {
  auto p = make_inline_phase(name, mode, entries);
  REQUIRE(p.ok());
  return *p;
}

Policy three_phases() {
  Policy p;
  p.phases.push_back(phase("environment", Mode::public_));
  p.phases.push_back(phase("agent", Mode::allowlist, {"pypi.org", "192.0.2.10", "198.51.100.0/24", "2001:db8::/32"}));
  p.phases.push_back(phase("verifier", Mode::no_network));
  p.initial_phase = "environment";
  return p;
}

ActiveState named(const Policy& p, const std::string& name, std::uint64_t gen) {
  return make_state(p, *p.find(name), gen, false);
}

const Chain* find_chain(const Table& t, const std::string& name) {
  for (const auto& c : t.chains)
    if (c.name == name) return &c;
  return nullptr;
}

// Chain output's rules as nft text, with `p`'s agent phase in force.
std::vector<std::string> output_rules(const Policy& p, const CompileOptions& opts) {
  std::vector<std::string> out;
  const Table t = build_table(p, nullptr, named(p, "agent", 1), opts);
  for (const auto& r : find_chain(t, "output")->rules) out.push_back(render_rule(r));
  return out;
}

const Set* find_set(const Table& t, const std::string& name) {
  for (const auto& s : t.sets)
    if (s.name == name) return &s;
  return nullptr;
}

template <class T>
bool has_op(const Change& ch) {
  return std::any_of(ch.ops.begin(), ch.ops.end(), [](const Op& o) { return std::holds_alternative<T>(o); });
}

}  // namespace

TEST_CASE("every named phase is staged, and chain active points at the one in force") {
  const Policy p = three_phases();
  const Table t = build_table(p, nullptr, named(p, "agent", 4), CompileOptions{});
  CHECK(t.name == "egressd");
  for (const char* c : {"output", "active", "deny", "ph_environment", "ph_agent", "ph_verifier"}) {
    CHECK_MESSAGE(find_chain(t, c) != nullptr, c);
  }
  const Chain* active = find_chain(t, "active");
  REQUIRE(active->rules.size() == 7);
  CHECK(render_rule(active->rules[3]) ==
        "ct mark 0x45470002 counter goto pass comment \"egressd gen=4 phase=agent mode=allowlist mark=0x45470002\"");
  CHECK(render_rule(active->rules[6]) == "goto ph_agent");
  // Static entries are in the agent's sets; the hostname is not (the DNS proxy learns it).
  CHECK(find_set(t, "ph_agent_a4")->elems.size() == 1);
  CHECK(find_set(t, "ph_agent_n4")->elems.size() == 1);
  CHECK(find_set(t, "ph_agent_n6")->elems.size() == 1);
  CHECK(find_set(t, "ph_agent_d4")->timeout);
  CHECK(find_set(t, "ph_environment_a4") == nullptr);
}

TEST_CASE("output never accepts established flows wholesale, and ends in the active phase") {
  const Policy p = three_phases();
  const Table t = build_table(p, nullptr, named(p, "agent", 1), CompileOptions{});
  const Chain* out = find_chain(t, "output");
  REQUIRE(out->base.has_value());
  CHECK(out->base->policy_drop);
  std::vector<std::string> text;
  for (const auto& r : out->rules) text.push_back(render_rule(r));
  auto has = [&](const std::string& r) { return std::find(text.begin(), text.end(), r) != text.end(); };
  CHECK(text.back() == "counter jump active");  // counts every packet the policy decides (status)
  // The one use of ct state: the fast path, which sends the flow's own packets (never a
  // related one, never a reply, never a flow without a phase's mark) to chain active, where
  // the phase still decides. Nothing is accepted for being established.
  CHECK(text[0] ==
        "meta nfproto ipv4 ct direction original ct state established,new ct mark != 0x00000000 "
        "ct mark != 0x7ffffffc/30 counter goto active comment \"ipv4 fast path\"");
  CHECK(text[1] ==
        "meta nfproto ipv6 ct direction original ct state established,new ct mark != 0x00000000 "
        "ct mark != 0x7ffffffc/30 counter goto active");
  // And more, on `lo` only. First, right after the fast path and ahead of every accept, the
  // errors that would fail egressd's upstream queries are dropped: what conntrack relates to
  // egressd's own flows (the deny's ICMP error or reset for a packet forged on such a flow, an
  // ICMP error a raw socket writes quoting it), and ICMP errors it relates to no flow (one
  // quoting a DNATed flow as its socket knows it). Then the TCP reset reject makes for a
  // packet of a confirmed flow, which conntrack relates to that flow (a cut client fails at
  // once).
  const std::vector<std::string> upstream_errors = {
      "oif \"lo\" ct state related ct mark 0x7ffffffe counter drop",
      "oif \"lo\" meta l4proto icmp ct state invalid counter drop",
      "oif \"lo\" meta l4proto ipv6-icmp ct state invalid counter drop",
  };
  const std::string related_reset = "oif \"lo\" ct state related ct mark != 0x7ffffffe tcp flags rst accept";
  CHECK(std::vector<std::string>(text.begin() + 2, text.begin() + 5) == upstream_errors);
  for (std::size_t i = 5; i < text.size(); ++i) {
    if (text[i] != related_reset) CHECK(text[i].find("ct state") == std::string::npos);
  }
  CHECK(std::count(text.begin(), text.end(), related_reset) == 1);
  // Replies only on flows that arrived from outside (class 1), never any reply; accepted in
  // chain active, after its per-packet guards (a reply may carry a routing header).
  CHECK(has("ct direction reply ct mark 0x7fffffff goto active"));
  CHECK_FALSE(has("ct direction reply accept"));
  // Loopback only on lo and from a local source; redirected/DNATed traffic to loopback.
  CHECK(has("oif \"lo\" fib saddr type local accept"));
  CHECK(has("ip daddr 127.0.0.0/8 ct status dnat fib saddr type local accept"));
  CHECK(has("ip6 daddr ::1 ct status dnat fib saddr type local accept"));
  CHECK_FALSE(has("ip daddr 127.0.0.0/8 accept"));
  // Forged sources are denied, after the DAD exception and reject's own resets.
  const auto forged = std::find(text.begin(), text.end(), "fib saddr type != local counter goto deny");
  REQUIRE(forged != text.end());
  const auto dad = std::find(text.begin(), text.end(),
                             "ip6 saddr :: ip6 nexthdr ipv6-icmp ip6 hoplimit 255 icmpv6 type nd-neighbor-solicit "
                             "ip6 daddr ff02::/16 goto pass");
  REQUIRE(dad != text.end());
  CHECK(dad < forged);
  CHECK(std::find(text.begin(), text.end(), related_reset) < forged);
  // The IPv4 share of each counted place is counted by rules that only count (status by
  // family): around the forged-source deny, and just before `counter jump active`.
  CHECK(*(forged - 1) == "meta nfproto ipv4 counter comment \"ipv4 at saddr check\"");
  CHECK(*(forged + 1) == "meta nfproto ipv4 counter comment \"ipv4 past saddr check\"");
  CHECK(text[text.size() - 2] == "meta nfproto ipv4 counter comment \"ipv4 decided\"");
  CHECK(has("ip daddr @lo_upstream4 counter goto deny comment \"ipv4 to loopback upstream\""));
  CHECK(has("ip6 daddr @lo_upstream6 counter goto deny comment \"ipv6 to loopback upstream\""));
  CHECK(has("oif \"lo\" ct direction reply ct status ! confirmed accept"));
  // Neighbour discovery only to link-local, multicast and on-link (class 6), and only with
  // ICMPv6 right after the IPv6 header (a routing header would take it past the link).
  CHECK(has("ip6 nexthdr ipv6-icmp ip6 hoplimit 255 icmpv6 type nd-neighbor-advert ip6 daddr fe80::/10 goto pass"));
  CHECK(has("ip6 nexthdr ipv6-icmp ip6 hoplimit 255 icmpv6 type nd-router-solicit ip6 daddr ff02::/16 goto pass"));
  CHECK(has("ip6 nexthdr ipv6-icmp ip6 hoplimit 255 icmpv6 type nd-neighbor-solicit ip6 daddr @onlink6 goto pass"));
  CHECK_FALSE(has("icmpv6 type nd-neighbor-solicit ip6 hoplimit 255 ip6 daddr @onlink6 goto pass"));
  CHECK_FALSE(has("icmpv6 type nd-neighbor-solicit ip6 hoplimit 255 accept"));
  CHECK_FALSE(has("icmpv6 type nd-router-solicit ip6 hoplimit 255 ip6 daddr @onlink6 goto pass"));
  // Every accept for another device is signed: nothing in output accepts but loopback.
  for (const auto& r : text) {
    if (r.ends_with("accept")) {
      const bool loopback = r.find("\"lo\"") != std::string::npos || r.find("127.0.0.0/8") != std::string::npos ||
                            r.find("::1") != std::string::npos || r.find("lo_upstream") != std::string::npos;
      CHECK_MESSAGE(loopback, r);
    }
  }
}

TEST_CASE("lo carries from a foreign source only a local source's packets and reject's resets, pinning on or off") {
  // Ahead of the forged-source deny (output) and drop (input): a local source, reject's reset
  // for a never-confirmed flow, its reset related to a confirmed one, and (input) replies on
  // DNATed flows. Nothing by ct mark alone: pinning's resets are related ones too.
  const Policy p = three_phases();
  for (const bool pin : {false, true}) {
    CAPTURE(pin);
    CompileOptions o;
    o.pin = pin;
    const Table t = build_table(p, nullptr, named(p, "agent", 1), o);
    for (const char* chain : {"output", "input"}) {
      const std::string dev = std::string(chain) == "output" ? "oif \"lo\"" : "iif \"lo\"";
      int seen = 0;
      for (const auto& rule : find_chain(t, chain)->rules) {
        const std::string r = render_rule(rule);
        if (!r.starts_with(dev) || !r.ends_with("accept")) continue;
        ++seen;
        CHECK_MESSAGE((r == dev + " fib saddr type local accept" ||
                       r == dev + " ct direction reply ct status ! confirmed accept" ||
                       r == dev + " ct direction reply ct status dnat accept" ||
                       r == dev + " ct state related ct mark != 0x7ffffffe tcp flags rst accept"),
                      chain << ": " << r);
      }
      CHECK(seen >= 3);
    }
  }
}

TEST_CASE("pass signs, input clears, and the netdev egress chains check and clear the signature") {
  const Policy p = three_phases();
  CompileOptions o;
  o.own_mark = 0x11111111;
  o.pass_mark = 0x22222222;
  o.pass_priority = 0x33334444;
  o.interfaces = {"eth0", "veth-x"};
  const Table t = build_table(p, nullptr, named(p, "agent", 1), o);
  const Chain* pass = find_chain(t, "pass");
  REQUIRE(pass != nullptr);
  REQUIRE(pass->rules.size() == 2);
  CHECK(render_rule(pass->rules[0]) == "oif \"lo\" meta mark set 0x00000000 accept");
  CHECK(render_rule(pass->rules[1]) == "meta mark set 0x22222222 meta priority set 3333:4444 accept");
  // Nothing that arrived on lo is forwarded (a frame written there loses its socket).
  const Chain* fwd = find_chain(t, "forward");
  REQUIRE(fwd != nullptr);
  REQUIRE(fwd->base.has_value());
  CHECK(fwd->base->hook == Hook::forward);
  CHECK_FALSE(fwd->base->policy_drop);
  REQUIRE(fwd->rules.size() == 1);
  CHECK(render_rule(fwd->rules[0]) == "iif \"lo\" counter drop");
  const Chain* in = find_chain(t, "input");
  REQUIRE(in != nullptr);
  REQUIRE(in->base.has_value());
  CHECK(in->base->hook == Hook::input);
  CHECK_FALSE(in->base->policy_drop);
  std::vector<std::string> text;
  for (const auto& r : in->rules) text.push_back(render_rule(r));
  CHECK(text == std::vector<std::string>{
                    // Every delivered packet's mark and priority, not just the secrets' (a
                    // clear of only those would tell a guess apart: SO_RCVMARK).
                    "meta mark set 0x00000000 meta priority set none",
                    "iif \"lo\" ct state related ct mark 0x7ffffffe counter drop",
                    "iif \"lo\" meta l4proto icmp ct state invalid counter drop",
                    "iif \"lo\" meta l4proto ipv6-icmp ct state invalid counter drop",
                    "iif \"lo\" ct direction reply ct status ! confirmed accept",
                    "iif \"lo\" ct direction reply ct status dnat accept",
                    "iif \"lo\" ct state related ct mark != 0x7ffffffe tcp flags rst accept",
                    "iif \"lo\" fib saddr type != local drop",
                    "ct direction original socket mark 0x11111111 drop",
                    "ct state invalid socket mark 0x11111111 counter drop",
                    // No flow starts from an upstream's DNS port (a late answer would be inbound).
                    "ct state new ip saddr @upstream4 udp sport 53 counter drop",
                    "ct state new ip saddr @upstream4 tcp sport 53 counter drop",
                    "ct state new ip6 saddr @upstream6 udp sport 53 counter drop",
                    "ct state new ip6 saddr @upstream6 tcp sport 53 counter drop",
                    // A TCP flow is inbound only from a SYN: a segment conntrack takes up
                    // mid-stream may be of the sandbox's own flow, its entry forgotten.
                    "iif != \"lo\" tcp flags syn / syn,ack ct state new ct mark set 0x7fffffff",
                    // Other protocols: chain inbound_new marks them, outside public only.
                    "iif != \"lo\" meta l4proto != tcp ct state new jump inbound_new",
                });

  for (const char* ph : {"agent", "verifier", "environment"}) {
    CAPTURE(ph);
    const auto nd = build_netdev_table(named(p, ph, 1), o);
    REQUIRE(nd.has_value());
    CHECK(nd->family == Family::netdev);
    REQUIRE(nd->chains.size() == 4);
    CHECK(nd->chains[3].name == kLoRepliesChain);  // the DNS proxy's answers (see below)
    CHECK(nd->chains[0].name == "egress_check");
    CHECK(nd->chains[1].name == "eg_eth0");
    CHECK(nd->chains[2].name == "eg_veth-x");
    REQUIRE(nd->chains[1].base.has_value());
    CHECK(nd->chains[1].base->hook == Hook::egress);
    CHECK(nd->chains[1].base->device == "eth0");
    CHECK(nd->chains[1].base->policy_drop);  // an empty egress_check lets nothing out
    CHECK(render_rule(nd->chains[1].rules.at(0)) == "jump egress_check");
    std::vector<std::string> check;
    for (const auto& r : nd->chains[0].rules) check.push_back(render_rule(r));
    const std::string signed_rule =
        "meta mark 0x22222222 meta priority 3333:4444 meta mark set 0x00000000 meta priority set none accept";
    const std::string arp = "meta protocol arp @ll,96,16 0x806 accept";
    if (std::string(ph) == "environment") {
      // public: what the namespace forwards leaves unsigned; a frame a process wrote does not.
      CHECK(check == std::vector<std::string>{arp, signed_rule, "meta skuid != 4294967295 counter drop", "accept"});
    } else {
      CHECK(check == std::vector<std::string>{arp, signed_rule, "counter"});
    }
  }
  o.netdev = false;
  CHECK_FALSE(build_netdev_table(named(p, "agent", 1), o).has_value());
  // Interface names nft could not read as an identifier are spelled in hex.
  CHECK(egress_chain_name("eth0.100") == "eg_eth0.100");
  CHECK(egress_chain_name("a+b") == "eg_x612b62");
}

TEST_CASE("outside public, active denies routing headers, IPv4 options, broadcast and multicast") {
  const Policy p = three_phases();
  for (const char* ph : {"agent", "verifier"}) {
    CAPTURE(ph);
    const Table t = build_table(p, nullptr, named(p, ph, 1), CompileOptions{});
    std::vector<std::string> text;
    for (const auto& r : find_chain(t, "active")->rules) text.push_back(render_rule(r));
    REQUIRE(text.size() == 7);
    // Per packet, before the fast path: a flow to an allowed first hop cannot carry them.
    CHECK(text[0] == "exthdr rt exists goto deny");
    // Any option: nft's `ip option lsrr exists` misses a source route with an odd pointer.
    CHECK(text[1] == "ip hdrlength != 5 goto deny");
    // Replies on inbound flows meet the guards too (chain output sends them here).
    CHECK(text[2] == "ct direction reply ct mark 0x7fffffff goto pass");
    CHECK(text[3].rfind("ct mark ", 0) == 0);
    // Per flow, after it: a flow's destination does not change.
    CHECK(text[4] == "fib daddr type broadcast goto deny");
    CHECK(text[5] == "fib daddr type multicast goto deny");
  }
  const Table pub = build_table(p, nullptr, named(p, "environment", 1), CompileOptions{});
  const Chain* active = find_chain(pub, "active");
  REQUIRE(active->rules.size() == 3);
  CHECK(render_rule(active->rules[0]) == "ct direction reply ct mark 0x7fffffff goto pass");
  CHECK(render_rule(active->rules[2]) == "goto ph_environment");
}

TEST_CASE("inbound replies can be turned off; drop replaces reject; log group is used") {
  Policy p = three_phases();
  p.enforce.inbound_replies = false;
  p.enforce.deny = DenyAction::drop;
  p.enforce.log_group = 9;
  const Table t = build_table(p, nullptr, named(p, "verifier", 1), CompileOptions{});
  for (const auto& r : find_chain(t, "output")->rules) CHECK(render_rule(r) != "ct direction reply accept");
  for (const char* chain : {"input", "output", "active"}) {
    for (const auto& r : find_chain(t, chain)->rules) CHECK(render_rule(r).find("0x7fffffff") == std::string::npos);
  }
  const Chain* deny = find_chain(t, "deny");
  REQUIRE(deny->rules.size() == 6);
  CHECK(render_rule(deny->rules[4]) == "limit rate 100/second burst 50 packets log group 9");
  CHECK(render_rule(deny->rules[5]) == "counter drop");
}

TEST_CASE("reject: TCP gets a reset, everything else admin-prohibited") {
  const Policy p = three_phases();
  const Table t = build_table(p, nullptr, named(p, "verifier", 1), CompileOptions{});
  const Chain* deny = find_chain(t, "deny");
  REQUIRE(deny->rules.size() == 7);
  // The kernel's own MLD reports (link-local, hop limit 1) first: dropped and
  // counted, never logged, never answered.
  CHECK(render_rule(deny->rules[0]) == "icmpv6 type mld-listener-report ip6 hoplimit 1 counter drop");
  CHECK(render_rule(deny->rules[1]) == "icmpv6 type mld-listener-done ip6 hoplimit 1 counter drop");
  CHECK(render_rule(deny->rules[2]) == "icmpv6 type mld2-listener-report ip6 hoplimit 1 counter drop");
  // Every IPv4 packet denied is counted apart (status and metrics by family).
  CHECK(render_rule(deny->rules[3]) == "meta nfproto ipv4 counter comment \"ipv4 denied\"");
  // Logging is on by default, rate-limited in the kernel.
  CHECK(render_rule(deny->rules[4]) == "limit rate 100/second burst 50 packets log group 1985");
  CHECK(render_rule(deny->rules[5]) == "meta l4proto tcp counter reject with tcp reset");
  CHECK(render_rule(deny->rules[6]) == "counter reject with icmpx admin-prohibited");
}

TEST_CASE("DNS redirect exists only with a proxy port, and exempts only egressd's own mark") {
  const Policy p = three_phases();
  CompileOptions none;
  none.dns_port = 0;
  CHECK(find_chain(build_table(p, nullptr, named(p, "agent", 1), none), "dns_redirect") == nullptr);
  CompileOptions o;
  o.dns_port = 5353;
  o.own_mark = 0x1234abcd;
  o.upstreams = {*parse_ip("192.0.2.1"), *parse_ip("2001:db8::53")};
  const Table t = build_table(p, nullptr, named(p, "agent", 1), o);
  const Chain* nat = find_chain(t, "dns_redirect");
  REQUIRE(nat != nullptr);
  REQUIRE(nat->base.has_value());
  CHECK(nat->base->priority == -101);  // ahead of Docker's DNAT for 127.0.0.11
  CHECK(render_rule(nat->rules[0]) == "meta mark != 0x1234abcd udp dport 53 redirect to :5353");
  CHECK(render_rule(nat->rules[1]) == "meta mark != 0x1234abcd tcp dport 53 redirect to :5353");
  // egressd's own upstream traffic reaches the upstream sets' port 53 only, on flows it
  // created itself, which it marks as its own (never ct mark 0: with pinning, TCP replies of
  // ct mark 0 flows pass over lo); a loopback upstream (Docker's 127.0.0.11) on any port, and
  // nobody else reaches it at all.
  std::vector<std::string> marked;
  for (const auto& r : find_chain(t, "output")->rules) {
    const std::string text = render_rule(r);
    if (text.find("upstream") != std::string::npos) marked.push_back(text);
  }
  CHECK(marked == std::vector<std::string>{
                      "meta mark 0x1234abcd ct direction original ip daddr @upstream4 udp dport 53 ct mark set 0x7ffffffe goto pass",
                      "meta mark 0x1234abcd ct direction original ip daddr @upstream4 tcp dport 53 ct mark set 0x7ffffffe goto pass",
                      "meta mark 0x1234abcd ct direction original ip6 daddr @upstream6 udp dport 53 ct mark set 0x7ffffffe goto pass",
                      "meta mark 0x1234abcd ct direction original ip6 daddr @upstream6 tcp dport 53 ct mark set 0x7ffffffe goto pass",
                      "meta mark 0x1234abcd ct direction original ip daddr @lo_upstream4 ct mark set 0x7ffffffe "
                      "meta mark set 0x00000000 accept",
                      "meta mark 0x1234abcd ct direction original ip6 daddr @lo_upstream6 ct mark set 0x7ffffffe "
                      "meta mark set 0x00000000 accept",
                      "ip daddr @lo_upstream4 ct direction reply ct mark 0x7ffffffe accept",
                      "ip6 daddr @lo_upstream6 ct direction reply ct mark 0x7ffffffe accept",
                      "ip daddr @lo_upstream4 counter goto deny comment \"ipv4 to loopback upstream\"",
                      "ip6 daddr @lo_upstream6 counter goto deny comment \"ipv6 to loopback upstream\"",
                  });
  CHECK(find_set(t, "upstream4")->elems.at(0).from.to_string() == "192.0.2.1");
  CHECK(find_set(t, "upstream6")->elems.at(0).from.to_string() == "2001:db8::53");
  o.upstreams.push_back(*parse_ip("127.0.0.11"));
  o.extra_upstreams.push_back(*parse_ip("198.51.100.53"));
  const Table t2 = build_table(p, nullptr, named(p, "agent", 1), o);
  CHECK(find_set(t2, "lo_upstream4")->elems.at(0).from.to_string() == "127.0.0.11");
  CHECK(find_set(t2, "upstream4")->elems.size() == 2);
  // Relay targets are not config: the digest stays.
  CompileOptions no_relay = o;
  no_relay.extra_upstreams.clear();
  CHECK(staged_digest(p, o) == staged_digest(p, no_relay));
  // The secrets are kept in the table comment for adoption.
  CHECK(mark_from_table_comment(t.comment) == 0x1234abcd);
  CHECK(mark_from_table_comment("hand-made mark=0x1") == 0);
}

TEST_CASE("answers from a loopback upstream: only from the resolver's cgroup, and signed for lo_replies") {
  const Policy p = three_phases();
  CompileOptions o;
  o.own_mark = 0x1234abcd;
  o.pass_mark = 0x22222222;
  o.pass_priority = 0x33334444;
  o.upstreams = {*parse_ip("192.0.2.1")};
  auto answers = [&](const CompileOptions& opts) {
    std::vector<std::string> out;
    const Table table = build_table(p, nullptr, named(p, "agent", 1), opts);
    for (const auto& r : find_chain(table, "output")->rules) {
      const std::string text = render_rule(r);
      if (text.find("saddr @lo_upstream") != std::string::npos || text.find("ct original") != std::string::npos) {
        out.push_back(text);
      }
    }
    return out;
  };
  const std::string sign4 =
      "ct direction reply ct original ip daddr @lo_upstream4 meta mark set 0x22222222 meta priority set 3333:4444";
  const std::string sign6 =
      "ct direction reply ct original ip6 daddr @lo_upstream6 meta mark set 0x22222222 meta priority set 3333:4444";
  // No loopback upstream: nothing to sign, and the chain on lo (there for the DNS proxy's
  // answers) names no upstream.
  CHECK(answers(o).empty());
  const auto no_upstream = build_netdev_table(named(p, "agent", 1), o);
  REQUIRE(find_chain(*no_upstream, kLoRepliesChain) != nullptr);
  for (const auto& r : find_chain(*no_upstream, kLoRepliesChain)->rules) {
    CHECK(render_rule(r).find("0x7f00000b") == std::string::npos);
  }

  o.upstreams.push_back(*parse_ip("127.0.0.11"));
  // The resolver's cgroup unknown: every reply from the upstream's address signed (the frame
  // check), no cgroup match. The signature is no verdict: the rules after it decide.
  CHECK(answers(o) == std::vector<std::string>{sign4, sign6});
  // Known (dockerd's cgroup): egressd's own flows take answers only from sockets in exactly
  // that cgroup, judged in chain lo_answers before anything is signed.
  o.lo_resolver = CompileOptions::ResolverCgroup{4242};
  const auto known = answers(o);
  CHECK(known == std::vector<std::string>{
                     "ip saddr @lo_upstream4 ct direction reply ct mark 0x7ffffffe jump lo_answers",
                     "ip6 saddr @lo_upstream6 ct direction reply ct mark 0x7ffffffe jump lo_answers",
                     sign4,
                     sign6,
                 });
  {
    // At whatever level of the hierarchy the cgroup is (egressd need not see it): a socket
    // there returns, one below it or anywhere else (every full socket has a root) is dropped.
    const Table t = build_table(p, nullptr, named(p, "agent", 1), o);
    const Chain* la = find_chain(t, kLoAnswersChain);
    REQUIRE(la != nullptr);
    CHECK_FALSE(la->base.has_value());
    REQUIRE(la->rules.size() == 2 * kResolverLevels + 1);
    CHECK(render_rule(la->rules[0]) == "socket cgroupv2 level 0 4242 socket cgroupv2 level 1 != 0 counter drop");
    CHECK(render_rule(la->rules[1]) == "socket cgroupv2 level 0 4242 return");
    CHECK(render_rule(la->rules[4]) == "socket cgroupv2 level 2 4242 socket cgroupv2 level 3 != 0 counter drop");
    CHECK(render_rule(la->rules[5]) == "socket cgroupv2 level 2 4242 return");
    CHECK(render_rule(la->rules[2 * kResolverLevels - 1]) ==
          "socket cgroupv2 level " + std::to_string(kResolverLevels - 1) + " 4242 return");
    CHECK(render_rule(la->rules.back()) == "socket cgroupv2 level 0 != 0 counter drop");
    CompileOptions none = o;
    none.lo_resolver.reset();
    CHECK(find_chain(build_table(p, nullptr, named(p, "agent", 1), none), kLoAnswersChain) == nullptr);
  }
  // Ahead of the loopback accept that would otherwise take them.
  const std::vector<std::string> out = output_rules(p, o);
  const auto first_lo = std::find(out.begin(), out.end(), "oif \"lo\" fib saddr type local accept");
  REQUIRE(first_lo != out.end());
  CHECK(std::find(out.begin(), first_lo, sign6) != first_lo);
  // Which cgroup the resolver is in is not config: the digest stays, and a restart re-fills
  // the chain for the cgroup of now (cgroup_chains). Whether the chain is there is the
  // table's shape: a table without it is restaged, not adopted with a jump to nowhere.
  CompileOptions elsewhere = o;
  elsewhere.lo_resolver->id = 4343;
  CHECK(staged_digest(p, o) == staged_digest(p, elsewhere));
  CompileOptions unknown = o;
  unknown.lo_resolver.reset();
  CHECK(staged_digest(p, o) != staged_digest(p, unknown));

  // lo's egress hook: frames from the upstream's address leave only signed, and unsigned.
  const auto nd = build_netdev_table(named(p, "agent", 1), o);
  REQUIRE(nd.has_value());
  const Chain* lo = find_chain(*nd, kLoRepliesChain);
  REQUIRE(lo != nullptr);
  REQUIRE(lo->base.has_value());
  CHECK(lo->base->device == "lo");
  CHECK(lo->base->hook == Hook::egress);
  CHECK_FALSE(lo->base->policy_drop);  // everything else on lo is the namespace's own business
  REQUIRE(lo->rules.size() == 10);
  // The last takes every mark and priority off: no tap on lo reads one (SO_RCVMARK).
  CHECK(render_rule(lo->rules.back()) == "meta mark set 0x00000000 meta priority set none");
  CHECK(render_rule(lo->rules[0]) ==
        "meta mark 0x22222222 meta priority 3333:4444 meta mark set 0x00000000 meta priority set none accept");
  CHECK(render_rule(lo->rules[2]) == "@ll,96,16 0x800 @ll,208,32 0x7f00000b counter drop");
  // Without the netdev hook neither the chain nor the signature; the cgroup check stays.
  o.netdev = false;
  CHECK(answers(o).size() == 2);
}

TEST_CASE("a packet with the own or the proxy mark leaves only from a socket in egressd's cgroup") {
  // A sandbox process with NET_RAW sets any SO_MARK: a guessed own mark would take its
  // query to the upstream past the proxy, a guessed proxy mark its forged answer onto lo.
  // Every packet with a mark (any: the work must not tell a secret from another value) goes
  // through chain own_sockets first, which keeps the marks only for a socket in exactly
  // egressd's cgroup, at whatever level (the ladder of lo_answers).
  const Policy p = three_phases();
  CompileOptions o;
  o.own_mark = 0x11112222;
  o.proxy_mark = 0x55556666;
  o.dns_port = 5353;
  o.own_cgroup = 777;
  auto output = [&](const CompileOptions& opts) { return output_rules(p, opts); };
  const auto text = output(o);
  const auto jump = std::find(text.begin(), text.end(), "meta mark != 0x00000000 jump own_sockets");
  REQUIRE(jump != text.end());
  CHECK(std::count(text.begin(), text.end(), *jump) == 1);
  // Ahead of every rule that reads either mark, and of every accept.
  for (auto it = text.begin(); it != jump; ++it) {
    CHECK(it->find("0x11112222") == std::string::npos);
    CHECK(it->find("0x55556666") == std::string::npos);
    CHECK(it->find("accept") == std::string::npos);
  }
  // egressd's own queries never reach its own proxy (a conntrack entry a sandbox left
  // behind would redirect them there, in a loop), ahead of the loopback accept.
  const auto self = std::find(text.begin(), text.end(), "meta mark 0x11112222 ip daddr 127.0.0.1 udp dport 5353 counter drop");
  const auto lo_accept = std::find(text.begin(), text.end(), "oif \"lo\" fib saddr type local accept");
  REQUIRE(self != text.end());
  CHECK(self < lo_accept);
  CHECK(std::count(text.begin(), text.end(), "meta mark 0x11112222 ip6 daddr ::1 tcp dport 5353 counter drop") == 1);
  const Table t = build_table(p, nullptr, named(p, "agent", 1), o);
  const Chain* ch = find_chain(t, kOwnSocketsChain);
  REQUIRE(ch != nullptr);
  CHECK_FALSE(ch->base.has_value());
  REQUIRE(ch->rules.size() == 2 * kResolverLevels + 1);
  CHECK(render_rule(ch->rules[0]) == "socket cgroupv2 level 0 777 socket cgroupv2 level 1 != 0 goto own_foreign");
  CHECK(render_rule(ch->rules[3]) == "socket cgroupv2 level 1 777 return");
  CHECK(render_rule(ch->rules.back()) == "socket cgroupv2 level 0 != 0 goto own_foreign");
  // Not dropped (EPERM would tell a right guess from a wrong one): the own and proxy marks
  // go, any other mark (pinning's verdicts ride on the sandbox's packets) stays, and the
  // packet goes on as a wrong guess would.
  const Chain* foreign = find_chain(t, kOwnForeignChain);
  REQUIRE(foreign != nullptr);
  std::vector<std::string> f;
  for (const auto& r : foreign->rules) f.push_back(render_rule(r));
  // The same work whatever the mark, but the one store (a review timed a counter's).
  CHECK(f == std::vector<std::string>{"counter", "meta mark 0x11112222 meta mark set 0x00000000",
                                      "meta mark 0x55556666 meta mark set 0x00000000"});
  // The redirect exempts egressd's own sockets' own mark only (own_nat), and leaves every
  // other packet's mark as it was (chain output's ladder then does the same work for all).
  const Chain* nat = find_chain(t, "dns_redirect");
  REQUIRE(nat != nullptr);
  CHECK(render_rule(nat->rules[0]) == "meta mark != 0x00000000 jump own_nat");
  CHECK(render_rule(nat->rules[1]) == "udp dport 53 redirect to :5353");
  const Chain* own_nat = find_chain(t, kOwnNatChain);
  REQUIRE(own_nat != nullptr);
  REQUIRE(own_nat->rules.size() == 2 * kResolverLevels);
  CHECK(render_rule(own_nat->rules[0]) == "socket cgroupv2 level 0 777 socket cgroupv2 level 1 != 0 return");
  CHECK(render_rule(own_nat->rules[1]) == "socket cgroupv2 level 0 777 goto own_nat_own");
  CHECK(render_rule(find_chain(t, kOwnNatOwnChain)->rules.at(0)) == "meta mark 0x11112222 accept");
  // Nothing but egressd's own marked packets goes out on egressd's own flows (a raw socket
  // writing from the port of one of its upstream sockets rode it past the redirect).
  const auto ride = std::find(text.begin(), text.end(), "ct direction original ct mark 0x7ffffffe counter goto deny");
  REQUIRE(ride != text.end());
  CHECK(ride < lo_accept);
  for (auto it = text.begin(); it != ride; ++it) {
    if (it->find("accept") != std::string::npos || it->find("goto pass") != std::string::npos) {
      CHECK(it->find("meta mark 0x11112222") != std::string::npos);
    }
  }
  // Chain input drops new flows and untracked packets to an own-marked socket only when it is
  // egressd's: a sandbox socket with the mark receives what any socket would, and any marked
  // socket takes the same way there.
  std::vector<std::string> input;
  for (const auto& r : find_chain(t, "input")->rules) input.push_back(render_rule(r));
  CHECK(std::count(input.begin(), input.end(), "ct direction original socket mark != 0x00000000 jump own_input") == 1);
  CHECK(std::count(input.begin(), input.end(), "ct state invalid socket mark != 0x00000000 jump own_input") == 1);
  const Chain* in = find_chain(t, kOwnInputChain);
  REQUIRE(in != nullptr);
  REQUIRE(in->rules.size() == 2 * kResolverLevels);
  CHECK(render_rule(in->rules[0]) == "socket cgroupv2 level 0 777 socket cgroupv2 level 1 != 0 return");
  CHECK(render_rule(in->rules[1]) == "socket cgroupv2 level 0 777 goto own_input_own");
  const Chain* in_own = find_chain(t, kOwnInputOwnChain);
  REQUIRE(in_own != nullptr);
  REQUIRE(in_own->rules.size() == 1);
  CHECK(render_rule(in_own->rules[0]) == "socket mark 0x11112222 counter drop");
  // cgroup_chains gives what an adopted table is re-filled with.
  const auto chains = cgroup_chains(o);
  REQUIRE(chains.size() == 3);
  CHECK(chains[0].name == kOwnSocketsChain);
  CHECK(chains[0].rules.size() == ch->rules.size());
  CHECK(chains[1].name == kOwnInputChain);
  // The id is not config; whether the chain is there is.
  CompileOptions moved = o;
  moved.own_cgroup = 778;
  CHECK(staged_digest(p, o) == staged_digest(p, moved));
  CompileOptions unknown = o;
  unknown.own_cgroup.reset();
  CHECK(staged_digest(p, o) != staged_digest(p, unknown));
  // Unknown: the marks alone, as before.
  for (const auto& r : output(unknown)) CHECK(r.find("own_sockets") == std::string::npos);
  const Table plain = build_table(p, nullptr, named(p, "agent", 1), unknown);
  CHECK(find_chain(plain, kOwnSocketsChain) == nullptr);
  CHECK(find_chain(plain, kOwnInputChain) == nullptr);
  CHECK(find_chain(plain, kOwnForeignChain) == nullptr);
  CHECK(render_rule(find_chain(plain, "dns_redirect")->rules[0]) ==
        "meta mark != 0x11112222 udp dport 53 redirect to :5353");
  // No proxy: no marks to check.
  CompileOptions no_proxy = o;
  no_proxy.dns_port = 0;
  CHECK(find_chain(build_table(p, nullptr, named(p, "agent", 1), no_proxy), kOwnSocketsChain) == nullptr);
  CHECK(cgroup_chains(no_proxy).empty());
}

TEST_CASE("what leaves from the DNS proxy's address and port carries the proxy's mark, or is dropped") {
  // A raw socket could write the proxy's answer on a redirected flow (Docker's resolver relaying
  // egressd's own query): chain output drops it unless it carries the proxy sockets' secret
  // mark, which it swaps for the pass signature; chain lo_replies drops a frame written to
  // lo with AF_PACKET from the proxy's address and port unless it is signed.
  const Policy p = three_phases();
  CompileOptions o;
  o.pass_mark = 0x22222222;
  o.pass_priority = 0x33334444;
  o.proxy_mark = 0x55556666;
  o.dns_port = 5353;
  auto output = [&](const CompileOptions& opts) { return output_rules(p, opts); };
  const std::vector<std::string> text = output(o);
  const std::vector<std::string> proxy = {
      "oif \"lo\" ip saddr 127.0.0.1 udp sport 5353 meta mark != 0x55556666 counter drop",
      "oif \"lo\" ip saddr 127.0.0.1 tcp sport 5353 meta mark != 0x55556666 counter drop",
      "oif \"lo\" ip6 saddr ::1 udp sport 5353 meta mark != 0x55556666 counter drop",
      "oif \"lo\" ip6 saddr ::1 tcp sport 5353 meta mark != 0x55556666 counter drop",
      "oif \"lo\" meta mark 0x55556666 meta mark set 0x22222222 meta priority set 3333:4444",
  };
  // Ahead of every accept: right after the fast path and the upstream errors.
  CHECK(std::vector<std::string>(text.begin() + 5, text.begin() + 10) == proxy);
  for (std::size_t i = 0; i < 10; ++i) CHECK(text[i].find("accept") == std::string::npos);
  // Without the netdev hook the mark is cleared (nothing would clear a signature).
  CompileOptions no_netdev = o;
  no_netdev.netdev = false;
  CHECK(output(no_netdev)[9] == "oif \"lo\" meta mark 0x55556666 meta mark set 0x00000000");
  // No proxy, no rules.
  CompileOptions no_proxy = o;
  no_proxy.dns_port = 0;
  for (const auto& r : output(no_proxy)) CHECK(r.find("0x55556666") == std::string::npos);
  CHECK(find_chain(*build_netdev_table(named(p, "agent", 1), no_proxy), kLoRepliesChain) == nullptr);

  const auto nd = build_netdev_table(named(p, "agent", 1), o);
  REQUIRE(nd.has_value());
  const Chain* lo = find_chain(*nd, kLoRepliesChain);
  REQUIRE(lo != nullptr);
  std::vector<std::string> frames;
  for (const auto& r : lo->rules) frames.push_back(render_rule(r));
  CHECK(frames == std::vector<std::string>{
                      "meta mark 0x22222222 meta priority 3333:4444 meta mark set 0x00000000 meta priority set none "
                      "accept",
                      "@ll,96,16 != 0x800 @ll,96,16 != 0x86dd counter drop",
                      "@ll,96,16 0x800 @ll,208,32 0x7f000001 @ll,112,8 != 0x45 counter drop",
                      "@ll,96,16 0x86dd @ll,176,128 0x1 @ll,160,8 != 0x6 @ll,160,8 != 0x11 @ll,160,8 != 0x3a "
                      "counter drop",
                      "@ll,96,16 0x800 @ll,208,32 0x7f000001 @ll,184,8 0x11 @ll,272,16 0x14e9 counter drop",
                      "@ll,96,16 0x86dd @ll,176,128 0x1 @ll,160,8 0x11 @ll,432,16 0x14e9 counter drop",
                      "@ll,96,16 0x800 @ll,208,32 0x7f000001 @ll,184,8 0x6 @ll,272,16 0x14e9 counter drop",
                      "@ll,96,16 0x86dd @ll,176,128 0x1 @ll,160,8 0x6 @ll,432,16 0x14e9 counter drop",
                      "meta mark set 0x00000000 meta priority set none",
                  });
  // The staged digest is the config's: the proxy mark is a secret like the others.
  CHECK(staged_digest(p, o) == staged_digest(p, [&] {
          CompileOptions d = o;
          d.proxy_mark = kProxyMark;
          return d;
        }()));
}

TEST_CASE("the table comment carries the secrets and a restart reads them back") {
  const Policy p = three_phases();
  CompileOptions o;
  o.own_mark = 0xdeadbeef;
  o.pass_mark = 0x01020304;
  o.pass_priority = 0xa0b0c0d0;
  o.mark_salt = 0x7f000001;
  o.proxy_mark = 0x0badf00d;
  o.pin_mark = 0x5ec7e7a1;
  const Table t = build_table(p, nullptr, named(p, "agent", 1), o);
  CHECK(t.comment.size() < 128);
  const auto s = secrets_from_table_comment(t.comment);
  REQUIRE(s.has_value());
  CHECK(s->own_mark == 0xdeadbeef);
  CHECK(s->pass_mark == 0x01020304);
  CHECK(s->pass_priority == 0xa0b0c0d0);
  CHECK(s->mark_salt == 0x7f000001);
  CHECK(s->proxy_mark == 0x0badf00d);
  CHECK(s->pin_mark == 0x5ec7e7a1);
  // A table from before the pin mark: the rest is read, the pin mark is 0 (the sandbox then
  // takes the pass mark, from which that table's pin marks derive).
  const auto no_pin = secrets_from_table_comment(t.comment.substr(0, t.comment.find(" pin=")));
  REQUIRE(no_pin.has_value());
  CHECK(no_pin->proxy_mark == 0x0badf00d);
  CHECK(no_pin->pin_mark == 0);
  // A table from before the proxy's mark: the rest is read, the proxy mark is 0 (drawn anew).
  const auto before = secrets_from_table_comment(t.comment.substr(0, t.comment.find(" proxy=")));
  REQUIRE(before.has_value());
  CHECK(before->own_mark == 0xdeadbeef);
  CHECK(before->proxy_mark == 0);
  // An older egressd's table: only the mark.
  CHECK_FALSE(secrets_from_table_comment("egressd v1 digest=0123456789abcdef mark=0x65677264").has_value());
  CHECK_FALSE(secrets_from_table_comment("someone else's table pass=0x1").has_value());
  // The digest is the config's, not the secrets'.
  CHECK(digest_from_table_comment(t.comment) == staged_digest(p, CompileOptions{}));
}

TEST_CASE("phase and inline marks derive from the salt and stay clear of the fixed marks") {
  const Policy p = three_phases();
  CHECK(phase_mark(p, "environment") == 0x45470001);  // the default salt: what render prints
  CHECK(inline_mark(7) == 0x80000007);
  for (std::uint32_t salt : {0u, 0x7ffffffau, 0x7ffffffbu, 0x7ffffffcu, 0x7ffffffdu, 0xfffffffeu, 0xffffffffu, 0x12345678u}) {
    CAPTURE(salt);
    for (const auto& ph : p.phases) {
      const std::uint32_t m = phase_mark(p, ph.name, salt);
      CHECK(m >= 1);
      // never INBOUND (0x7fffffff), egressd's own (0x7ffffffe), pinning's cut (0x7ffffffd) or
      // followed (0x7ffffffc) flows, or inline
      CHECK(m <= 0x7ffffffb);
    }
    CHECK(phase_mark(p, "environment", salt) != phase_mark(p, "agent", salt));
    CHECK((inline_mark(3, salt) & kInlineMarkBit) != 0);
  }
  CHECK(phase_mark(p, "agent", 0x1000) != phase_mark(p, "agent", 0x2000));
  CHECK(make_state(p, *p.find("agent"), 1, false, 0x1000).mark == phase_mark(p, "agent", 0x1000));
}

TEST_CASE("a switch between named phases is a constant-size batch whatever the allowlist size") {
  Policy p = three_phases();
  std::vector<std::string> many;
  for (int i = 0; i < 10000; ++i) many.push_back("198.18." + std::to_string(i / 256) + "." + std::to_string(i % 256));
  p.phases.push_back(phase("big", Mode::allowlist, many));
  const ActiveState from = named(p, "environment", 3);
  const Change ch = build_switch(p, *p.find("big"), named(p, "big", 4), from, CompileOptions{});
  // inet: flush active + its 7 rules, flush inbound_new + its rule (out of public: flows of
  // other protocols from outside are inbound again); netdev, same batch: flush egress_check +
  // its 3 rules.
  REQUIRE(ch.ops.size() == 14);
  CHECK(std::holds_alternative<OpFlushChain>(ch.ops[0]));
  CHECK(std::get<OpFlushChain>(ch.ops[0]).name == "active");
  CHECK(std::get<OpAddRule>(ch.ops[4]).rule.comment == "egressd gen=4 phase=big mode=allowlist mark=0x45470004");
  CHECK(render_rule(std::get<OpAddRule>(ch.ops[7]).rule) == "goto ph_big");
  CHECK(std::get<OpFlushChain>(ch.ops[8]).name == "inbound_new");
  CHECK(render_rule(std::get<OpAddRule>(ch.ops[9]).rule) == "ct mark set 0x7fffffff");
  CHECK(std::get<OpFlushChain>(ch.ops[10]).name == "egress_check");
  CHECK(std::get<OpFlushChain>(ch.ops[10]).family == Family::netdev);
  for (std::size_t i = 11; i < 14; ++i) CHECK(std::get<OpAddRule>(ch.ops[i]).family == Family::netdev);
  // The same size for a one-entry phase, and whatever the number of interfaces.
  CompileOptions many_ifs;
  for (int i = 0; i < 50; ++i) many_ifs.interfaces.push_back("veth" + std::to_string(i));
  CHECK(build_switch(p, *p.find("agent"), named(p, "agent", 4), from, many_ifs).ops.size() == 14);
  // To public: no guards in active, inbound_new emptied; still one batch over both tables.
  const Change to_pub = build_switch(p, *p.find("environment"), named(p, "environment", 5), named(p, "big", 4),
                                     CompileOptions{});
  CHECK(to_pub.ops.size() == 10);
  CHECK(std::get<OpFlushChain>(to_pub.ops[4]).name == "inbound_new");
  CHECK(std::get<OpFlushChain>(to_pub.ops[5]).family == Family::netdev);
  // Between two phases that are not public, egress_check says the same: chain active only.
  const Change to_verifier =
      build_switch(p, *p.find("verifier"), named(p, "verifier", 5), named(p, "big", 4), CompileOptions{});
  REQUIRE(to_verifier.ops.size() == 8);
  for (const auto& o : to_verifier.ops) {
    const auto* f = std::get_if<OpFlushChain>(&o);
    const auto* r = std::get_if<OpAddRule>(&o);
    CHECK((f != nullptr ? f->name == "active" : r != nullptr && r->chain == "active"));
  }
}

TEST_CASE("inline policies get their own objects, removed by the next switch") {
  const Policy p = three_phases();
  const Phase inl = phase("inline", Mode::allowlist, {"203.0.113.7"});
  const ActiveState next = make_state(p, inl, 8, true);
  const Change in = build_switch(p, inl, next, named(p, "agent", 7), CompileOptions{});
  CHECK(has_op<OpAddSet>(in));
  CHECK(has_op<OpAddChain>(in));
  CHECK_FALSE(has_op<OpDeleteChain>(in));
  std::string last_active;
  for (const auto& o : in.ops) {
    if (const auto* r = std::get_if<OpAddRule>(&o); r && r->chain == "active") last_active = render_rule(r->rule);
  }
  CHECK(last_active == "goto il8");

  const Change out = build_switch(p, *p.find("verifier"), named(p, "verifier", 9), next, CompileOptions{});
  // Order matters: chain active lets go of il8 before il8 and its sets are deleted.
  std::size_t flush_active = 99, del_chain = 0;
  for (std::size_t i = 0; i < out.ops.size(); ++i) {
    if (auto* f = std::get_if<OpFlushChain>(&out.ops[i]); f && f->name == "active") flush_active = i;
    if (auto* d = std::get_if<OpDeleteChain>(&out.ops[i]); d && d->name == "il8") del_chain = i;
  }
  CHECK(flush_active < del_chain);
  std::size_t deleted_sets = 0;
  for (const auto& o : out.ops) deleted_sets += std::holds_alternative<OpDeleteSet>(o);
  CHECK(deleted_sets == 6);
}

TEST_CASE("the state comment round-trips and rejects foreign text") {
  ActiveState st;
  st.generation = 42;
  st.phase = "inline";
  st.is_inline = true;
  st.mode = Mode::allowlist;
  st.mark = inline_mark(42);
  auto back = ActiveState::parse_comment(st.to_comment());
  REQUIRE(back.ok());
  CHECK(back->generation == 42);
  CHECK(back->is_inline);
  CHECK(back->mark == 0x8000002a);
  CHECK(back->mode == Mode::allowlist);
  CHECK_FALSE(ActiveState::parse_comment("hello").ok());
  CHECK_FALSE(ActiveState::parse_comment("egressd gen=x phase=a mode=public mark=0x1").ok());
  CHECK_FALSE(ActiveState::parse_comment("egressd gen=1 phase=a").ok());
}

TEST_CASE("the staged digest follows the config, not the phase in force") {
  const Policy p = three_phases();
  const std::string d = staged_digest(p, CompileOptions{});
  CHECK(d.size() == 16);
  const Table t1 = build_table(p, nullptr, named(p, "agent", 1), CompileOptions{});
  const Table t2 = build_table(p, nullptr, named(p, "verifier", 9), CompileOptions{});
  CHECK(digest_from_table_comment(t1.comment) == d);
  CHECK(digest_from_table_comment(t2.comment) == d);
  Policy changed = p;
  changed.phases[1] = phase("agent", Mode::allowlist, {"192.0.2.11"});
  CHECK(staged_digest(changed, CompileOptions{}) != d);
  CHECK(digest_from_table_comment("someone else's table") == "");
}

TEST_CASE("interval elements: overlapping and adjacent CIDRs merge, the top of the space is kept") {
  auto pfx = [](const char* text, int len) {
    IpPrefix p = *parse_ip(text);
    p.prefix_len = static_cast<std::uint8_t>(len);
    return p;
  };
  auto elems = make_interval_elems({pfx("198.51.100.0", 24), pfx("198.51.100.128", 25), pfx("203.0.113.0", 25),
                                    pfx("203.0.113.128", 25), pfx("255.255.255.0", 24), pfx("192.0.2.0", 24)});
  REQUIRE(elems.size() == 4);
  CHECK(elems[0].from.to_string() == "192.0.2.0");
  CHECK(elems[0].to.to_string() == "192.0.2.255");
  CHECK(elems[1].from.to_string() == "198.51.100.0");
  CHECK(elems[2].from.to_string() == "203.0.113.0");
  CHECK(elems[2].to.to_string() == "203.0.113.255");
  CHECK(elems[3].to.to_string() == "255.255.255.255");
  Set s{"s", SetType::ipv4_addr, true, false, elems};
  Table t;
  t.sets.push_back(s);
  const std::string text = render_table(t);
  CHECK(text.find("192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, 255.255.255.0/24") != std::string::npos);

  auto v6 = make_interval_elems({pfx("2001:db8::", 32), pfx("2001:db8:1::", 48)});
  REQUIRE(v6.size() == 1);
  CHECK(v6[0].to.to_string() == "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff");
}

TEST_CASE("address elements are sorted and deduplicated") {
  auto elems = make_addr_elems({*parse_ip("192.0.2.9"), *parse_ip("192.0.2.1"), *parse_ip("192.0.2.9")});
  REQUIRE(elems.size() == 2);
  CHECK(elems[0].from.to_string() == "192.0.2.1");
}

TEST_CASE("hostname pinning: learned-only TCP and QUIC flows go to chain pin while undecided, IP entries never") {
  Policy p = three_phases();
  CompileOptions o;
  o.pin = true;
  const Table t = build_table(p, nullptr, named(p, "agent", 1), o);
  const Chain* pin = find_chain(t, "pin");
  REQUIRE(pin != nullptr);
  REQUIRE(pin->rules.size() == 14);
  // The reader's pass: its mark and its priority, 64 bits a sandbox would have to guess at
  // once (no answer tells a right half from a wrong one).
  CHECK(render_rule(pin->rules[0]) == "meta mark 0x70696e21 meta priority 7072:6921 goto pass");
  CHECK(render_rule(pin->rules[1]) == "meta mark 0x72737421 meta l4proto tcp counter reject with tcp reset");
  // A refused QUIC flow learns at once, so the client falls back to TCP.
  CHECK(render_rule(pin->rules[2]) ==
        "meta mark 0x72737421 meta l4proto udp counter reject with icmpx admin-prohibited");
  // TCP Fast Open data in a SYN would pass uninspected: such SYNs are dropped (the retry has none).
  CHECK(render_rule(pin->rules[3]) == "tcp option fastopen exists counter drop");
  CHECK(render_rule(pin->rules[4]) == "tcp option 254 exists counter drop");
  // A new connection's handshake passes; a SYN on an entry that has seen replies (a new
  // connection on an old one's addresses and ports) goes to the reader, which forgets the old one.
  CHECK(render_rule(pin->rules[5]) == "tcp flags syn ct state new goto pass");
  // Any other TCP packet that starts an entry: conntrack took the flow up mid-stream (its entry
  // forgotten, e.g. 10 s after a raw RST); the server may hold bytes before it. Refused.
  CHECK(render_rule(pin->rules[6]) == "meta l4proto tcp ct state new counter reject with tcp reset");
  // A SYN in the reply direction of an entry the server's side started: to the reader with a
  // mark that says so (it has the entry deleted and drops the SYN; the socket's retry starts
  // an entry of its own), never reset: a port reused after a refused flow keeps working.
  CHECK(render_rule(pin->rules[7]) ==
        "tcp flags syn / syn,ack ct direction reply meta mark set 0x72657673 counter queue num 16");
  // Any other packet of the sandbox's in the reply direction: conntrack took it up mid-stream.
  CHECK(render_rule(pin->rules[8]) == "meta l4proto tcp ct direction reply counter reject with tcp reset");
  // No bypass: with no reader the packet is dropped. QUIC has its own queue, where the
  // kernel splits a GSO batch into its datagrams.
  CHECK(render_rule(pin->rules[9]) == "meta l4proto udp ct mark 0x00000000 meta mark set ct id counter queue num 17");
  // A QUIC flow the kernel passed before carries a mark that says so, not its id: the reader
  // never judges an Initial on it afresh once it no longer holds the flow's assembler.
  CHECK(render_rule(pin->rules[10]) == "meta l4proto udp meta mark set 0x71756963 counter queue num 17");
  // A followed HTTP connection has a chain and a queue of its own (the reader refuses what it
  // does not follow).
  CHECK(render_rule(pin->rules[11]) == "ct mark 0x7ffffffc goto pin_follow");
  // A TCP flow that carries a phase's mark (another phase's: never judged by name here; or
  // urgent data on this phase's own) has a queue of its own.
  CHECK(render_rule(pin->rules[12]) == "ct mark != 0x00000000 meta mark set ct id counter queue num 20");
  CHECK(render_rule(pin->rules[13]) == "meta mark set ct id counter queue num 16");
  // Its packets without bytes stay in the kernel (a download's ACKs never reach the reader):
  // IPv4 without options and IPv6 without extension headers, each TCP header length; urgent
  // data and everything else go to the reader.
  const Chain* follow = find_chain(t, "pin_follow");
  REQUIRE(follow != nullptr);
  REQUIRE(follow->rules.size() == 24);
  CHECK(render_rule(follow->rules[0]) == "tcp flags urg meta mark set ct id counter queue num 18");
  CHECK(render_rule(follow->rules[1]) == "ip hdrlength 5 ip length 40 tcp doff 5 goto pass");
  CHECK(render_rule(follow->rules[4]) == "ip hdrlength 5 ip length 52 tcp doff 8 goto pass");
  CHECK(render_rule(follow->rules[11]) == "ip hdrlength 5 ip length 80 tcp doff 15 goto pass");
  CHECK(render_rule(follow->rules[12]) == "ip6 length 20 ip6 nexthdr tcp tcp doff 5 goto pass");
  CHECK(render_rule(follow->rules[22]) == "ip6 length 60 ip6 nexthdr tcp tcp doff 15 goto pass");
  CHECK(render_rule(follow->rules[23]) == "meta mark set ct id counter queue num 18");
  CHECK(find_chain(build_table(p, nullptr, named(p, "agent", 1), CompileOptions{}), "pin_follow") == nullptr);
  // Ahead of the fast path, such a SYN goes to the reader with the old connection's mark (cut,
  // followed or a phase's) in place: it clears the mark for the socket's own SYN, so the new
  // connection is judged as new, and drops a raw socket's. Never egressd's own flow's mark (a
  // SYN a sandbox forges on it must not reach the reader) nor an inbound flow's. Only with
  // pinning.
  const Chain* output = find_chain(t, "output");
  REQUIRE(output != nullptr);
  CHECK(render_rule(output->rules[0]) ==
        "tcp flags syn ct direction original ct mark != 0x00000000 ct mark != 0x7ffffffe/31 meta mark set ct id "
        "counter queue num 16");
  CompileOptions no_pin = o;
  no_pin.pin = false;
  CHECK(render_rule(find_chain(build_table(p, nullptr, named(p, "agent", 1), no_pin), "output")->rules[0])
            .starts_with("meta nfproto ipv4 ct direction original"));
  const Chain* agent = find_chain(t, "ph_agent");
  std::vector<std::string> rules;
  for (const auto& r : agent->rules) rules.push_back(render_rule(r));
  // a4, n4 first (an IP entry decides alone), then the reader's admit, then chain pin, then
  // the learned set as before (other protocols, decided by the address).
  REQUIRE(rules.size() == 21);
  CHECK(rules[0] == "ip daddr @ph_agent_a4 counter ct mark set 0x45470002 goto pass");
  // The reader's admit, whatever the flow's ct mark: undecided, a followed TLS flow whose
  // server answered, or a flow admitted by name under another phase and kept by the switch.
  CHECK(rules[2] ==
        "ip daddr @ph_agent_d4 meta l4proto tcp meta mark 0x8f9691de meta priority 7072:6921 counter ct mark set "
        "0x45470002 goto pass");
  // An HTTP flow the reader admits stays followed (its own ct mark, back to chain pin).
  CHECK(rules[3] ==
        "ip daddr @ph_agent_d4 meta l4proto tcp ct mark 0x00000000 meta mark 0x8f9691df meta priority 7072:6921 "
        "counter ct mark set 0x7ffffffc goto pass");
  // Every other TCP packet of a tracked flow: undecided, followed, urgent data on this phase's
  // own (the server would take a byte out), or a flow another phase marked (this phase never
  // judged it by name).
  CHECK(rules[4] == "ip daddr @ph_agent_d4 meta l4proto tcp ct mark 0x00000000 goto pin");
  CHECK(rules[5] == "ip daddr @ph_agent_d4 meta l4proto tcp ct mark != 0x00000000 goto pin");
  // One conntrack gave no entry (a sandbox with NET_RAW can push a live connection's data there
  // with a forged RST and SYN the server drops): only a packet without bytes passes.
  CHECK(rules[6] == "ip daddr @ph_agent_d4 meta l4proto tcp goto pin_untracked");
  // QUIC: UDP 443 only; other UDP ports are decided by the address. The reader's admit
  // holds on a decided flow too; every other UDP 443 packet goes to the reader (chain active
  // sends a decided flow's long-header packets and those longer than one datagram here,
  // another phase's flows come here whole, and so do datagrams without a conntrack entry).
  CHECK(rules[7] ==
        "ip daddr @ph_agent_d4 udp dport 443 meta mark 0x8f9691de meta priority 7072:6921 counter ct mark set "
        "0x45470002 goto pass");
  CHECK(rules[8] == "ip daddr @ph_agent_d4 udp dport 443 goto pin");
  CHECK(rules[9] == "ip daddr @ph_agent_d4 counter ct mark set 0x45470002 goto pass");
  CHECK(rules[12] ==
        "ip6 daddr @ph_agent_d6 meta l4proto tcp meta mark 0x8f9691de meta priority 7072:6921 counter ct mark set "
        "0x45470002 goto pass");
  CHECK(rules[15] == "ip6 daddr @ph_agent_d6 meta l4proto tcp ct mark != 0x00000000 goto pin");
  CHECK(rules[16] == "ip6 daddr @ph_agent_d6 meta l4proto tcp goto pin_untracked");
  CHECK(rules[18] == "ip6 daddr @ph_agent_d6 udp dport 443 goto pin");
  const Chain* untracked = find_chain(t, "pin_untracked");
  REQUIRE(untracked != nullptr);
  REQUIRE(untracked->rules.size() == 25);
  CHECK(render_rule(untracked->rules[0]) == "tcp flags urg counter drop");
  // A SYN conntrack calls invalid met an entry the server's side started: to the reader (it
  // has the entry deleted), never let through, where its handshake would be reset half-way.
  CHECK(render_rule(untracked->rules[1]) == "tcp flags syn / syn,ack meta mark set 0x72657673 counter queue num 16");
  CHECK(render_rule(untracked->rules[2]) == "ip hdrlength 5 ip length 40 tcp doff 5 goto pass");
  CHECK(render_rule(untracked->rules[23]) == "ip6 length 60 ip6 nexthdr tcp tcp doff 15 goto pass");
  CHECK(render_rule(untracked->rules[24]) == "counter drop");
  CHECK(find_chain(build_table(p, nullptr, named(p, "agent", 1), CompileOptions{}), "pin_untracked") == nullptr);
  CHECK(pin_admit_mark(o.pin_mark) == 0x8f9691de);
  CHECK(pin_follow_mark(o.pin_mark) == 0x8f9691df);
  // A flow a switch cut for its name (ct mark set by the daemon) is denied before the fast path.
  const Chain* active = find_chain(t, "active");
  REQUIRE(!active->rules.empty());
  CHECK(render_rule(active->rules[0]) == "ct mark 0x7ffffffd counter goto deny");
  CHECK(kPinCutMark != phase_mark(p, "agent", o.mark_salt));
  // QUIC long headers and packets longer than one datagram skip the fast path (to the phase
  // chain), in allowlist phases only.
  std::vector<std::string> act;
  for (const auto& r : active->rules) act.push_back(render_rule(r));
  const auto lh = std::find(act.begin(), act.end(), "udp dport 443 @th,64,8 & 0x80 == 0x80 goto ph_agent");
  REQUIRE(lh != act.end());
  REQUIRE(lh + 3 < act.end());
  CHECK(lh[1] == "udp dport 443 meta length > 1500 goto ph_agent");
  CHECK(lh[2] == "tcp flags urg goto ph_agent");
  CHECK(lh[3].starts_with("ct mark 0x45470002 counter goto pass"));
  for (const char* other : {"environment", "verifier"}) {
    const Table ot = build_table(p, nullptr, named(p, other, 2), o);
    for (const auto& r : find_chain(ot, "active")->rules) {
      CHECK(render_rule(r).find("@th,64,8") == std::string::npos);
      CHECK(render_rule(r).find("meta length") == std::string::npos);
      CHECK(render_rule(r).find("tcp flags urg") == std::string::npos);
    }
  }

  // enforce.pin_names: false, or a daemon without the reader: none of it.
  p.enforce.pin_names = false;
  const Table off = build_table(p, nullptr, named(p, "agent", 1), o);
  CHECK(find_chain(off, "pin") == nullptr);
  CHECK(find_chain(off, "ph_agent")->rules.size() == 7);
  CHECK(render_rule(find_chain(off, "active")->rules[0]) != "ct mark 0x7ffffffd counter goto deny");
  p.enforce.pin_names = true;
  CHECK(find_chain(build_table(p, nullptr, named(p, "agent", 1), CompileOptions{}), "pin") == nullptr);
  // An inline allowlist applied by a switch gets the same rules.
  const Phase il = phase("inline", Mode::allowlist, {"example.org"});
  const ActiveState next = make_state(p, il, 2, true);
  const Change ch = build_switch(p, il, next, named(p, "agent", 1), o);
  bool queued = false;
  for (const auto& op : ch.ops) {
    if (const auto* add = std::get_if<OpAddChain>(&op)) {
      for (const auto& r : add->chain.rules) queued |= render_rule(r).ends_with("goto pin");
    }
  }
  CHECK(queued);
}

TEST_CASE("hostname pinning without the pin priority asks for the verdict marks alone, and says so in its digest") {
  // A kernel before 5.18 cannot set a queued packet's priority from a verdict: there the rules
  // ask for the mark alone (else every verdict would come back to the reader). A table made
  // before the priority has those rules too: its digest differs, so a restart stages it anew.
  Policy p = three_phases();
  CompileOptions o;
  o.pin = true;
  CompileOptions mark_only = o;
  mark_only.pin_priority = 0;
  const Table t = build_table(p, nullptr, named(p, "agent", 1), mark_only);
  CHECK(render_rule(find_chain(t, "pin")->rules[0]) == "meta mark 0x70696e21 goto pass");
  for (const auto& c : t.chains) {
    for (const auto& r : c.rules) CHECK(render_rule(r).find("7072:6921") == std::string::npos);
  }
  CHECK(staged_digest(p, o) != staged_digest(p, mark_only));
  // Which priority is not config (a secret, like the marks).
  CompileOptions other = o;
  other.pin_priority = 0x12345678;
  CHECK(staged_digest(p, o) == staged_digest(p, other));
}
