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
  REQUIRE(active->rules.size() == 2);
  CHECK(render_rule(active->rules[0]) ==
        "ct mark 0x45470002 counter accept comment \"egressd gen=4 phase=agent mode=allowlist mark=0x45470002\"");
  CHECK(render_rule(active->rules[1]) == "goto ph_agent");
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
  CHECK(text.front() == "oif \"lo\" accept");
  CHECK(text.back() == "counter jump active");  // counts every packet the policy decides (status)
  for (const auto& r : text) CHECK(r.find("ct state") == std::string::npos);
  CHECK(std::find(text.begin(), text.end(), "ct direction reply accept") != text.end());
}

TEST_CASE("inbound replies can be turned off; drop replaces reject; log group is used") {
  Policy p = three_phases();
  p.enforce.inbound_replies = false;
  p.enforce.deny = DenyAction::drop;
  p.enforce.log_group = 9;
  const Table t = build_table(p, nullptr, named(p, "verifier", 1), CompileOptions{});
  for (const auto& r : find_chain(t, "output")->rules) CHECK(render_rule(r) != "ct direction reply accept");
  const Chain* deny = find_chain(t, "deny");
  REQUIRE(deny->rules.size() == 5);
  CHECK(render_rule(deny->rules[3]) == "limit rate 100/second burst 50 packets log group 9");
  CHECK(render_rule(deny->rules[4]) == "counter drop");
}

TEST_CASE("reject: TCP gets a reset, everything else admin-prohibited") {
  const Policy p = three_phases();
  const Table t = build_table(p, nullptr, named(p, "verifier", 1), CompileOptions{});
  const Chain* deny = find_chain(t, "deny");
  REQUIRE(deny->rules.size() == 6);
  // The kernel's own MLD reports (link-local, hop limit 1) first: dropped and
  // counted, never logged, never answered.
  CHECK(render_rule(deny->rules[0]) == "icmpv6 type mld-listener-report ip6 hoplimit 1 counter drop");
  CHECK(render_rule(deny->rules[1]) == "icmpv6 type mld-listener-done ip6 hoplimit 1 counter drop");
  CHECK(render_rule(deny->rules[2]) == "icmpv6 type mld2-listener-report ip6 hoplimit 1 counter drop");
  // Logging is on by default, rate-limited in the kernel.
  CHECK(render_rule(deny->rules[3]) == "limit rate 100/second burst 50 packets log group 1985");
  CHECK(render_rule(deny->rules[4]) == "meta l4proto tcp counter reject with tcp reset");
  CHECK(render_rule(deny->rules[5]) == "counter reject with icmpx admin-prohibited");
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
  // egressd's own upstream traffic reaches the configured servers' port 53 only.
  std::vector<std::string> marked;
  for (const auto& r : find_chain(t, "output")->rules) {
    const std::string text = render_rule(r);
    if (text.find("meta mark") != std::string::npos) marked.push_back(text);
  }
  CHECK(marked == std::vector<std::string>{
                      "meta mark 0x1234abcd ip daddr 192.0.2.1 udp dport 53 accept",
                      "meta mark 0x1234abcd ip daddr 192.0.2.1 tcp dport 53 accept",
                      "meta mark 0x1234abcd ip6 daddr 2001:db8::53 udp dport 53 accept",
                      "meta mark 0x1234abcd ip6 daddr 2001:db8::53 tcp dport 53 accept",
                  });
  // The mark is kept in the table comment for adoption.
  CHECK(mark_from_table_comment(t.comment) == 0x1234abcd);
  CHECK(mark_from_table_comment("hand-made mark=0x1") == 0);
}

TEST_CASE("a switch between named phases is a constant-size batch whatever the allowlist size") {
  Policy p = three_phases();
  std::vector<std::string> many;
  for (int i = 0; i < 10000; ++i) many.push_back("198.18." + std::to_string(i / 256) + "." + std::to_string(i % 256));
  p.phases.push_back(phase("big", Mode::allowlist, many));
  const ActiveState from = named(p, "environment", 3);
  const Change ch = build_switch(p, *p.find("big"), named(p, "big", 4), from);
  REQUIRE(ch.ops.size() == 3);
  CHECK(std::holds_alternative<OpFlushChain>(ch.ops[0]));
  CHECK(std::get<OpFlushChain>(ch.ops[0]).name == "active");
  CHECK(std::get<OpAddRule>(ch.ops[1]).rule.comment == "egressd gen=4 phase=big mode=allowlist mark=0x45470004");
  CHECK(render_rule(std::get<OpAddRule>(ch.ops[2]).rule) == "goto ph_big");
}

TEST_CASE("inline policies get their own objects, removed by the next switch") {
  const Policy p = three_phases();
  const Phase inl = phase("inline", Mode::allowlist, {"203.0.113.7"});
  const ActiveState next = make_state(p, inl, 8, true);
  const Change in = build_switch(p, inl, next, named(p, "agent", 7));
  CHECK(has_op<OpAddSet>(in));
  CHECK(has_op<OpAddChain>(in));
  CHECK_FALSE(has_op<OpDeleteChain>(in));
  CHECK(render_rule(std::get<OpAddRule>(in.ops.back()).rule) == "goto il8");

  const Change out = build_switch(p, *p.find("verifier"), named(p, "verifier", 9), next);
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
