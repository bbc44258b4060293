// Sandbox::verify_table and restore_table over a fake kernel that keeps the
// table's structure: egressd's own switches never look like tampering, every
// kind of tampering is found, and a restore puts the phase in force back (same
// generation, learned addresses included) in one batch. Kernel-free.
#include <doctest/doctest.h>
#include <linux/netfilter/nf_tables.h>

#include <algorithm>

#include "daemon/sandbox.h"
#include "support/fake_kernel.h"

using namespace egressd;
using namespace egressd::daemon;

namespace {

using StructKernel = testing::FakeKernel;

Phase phase(std::string name, Mode mode, std::vector<std::string> entries = {}) {
  auto p = make_inline_phase(name, mode, entries);
  REQUIRE(p.ok());
  return *p;
}

struct Fixture {
  StructKernel* kernel;
  std::unique_ptr<Sandbox> sb;
  Fixture() {
    Policy p;
    p.phases.push_back(phase("environment", Mode::public_));
    p.phases.push_back(phase("agent", Mode::allowlist, {"pypi.org", "*.example.org", "192.0.2.10", "2001:db8::/64"}));
    p.phases.push_back(phase("verifier", Mode::no_network));
    p.initial_phase = "agent";
    auto k = std::make_unique<StructKernel>();
    kernel = k.get();
    SandboxOptions o;
    o.policy = std::move(p);
    sb = std::make_unique<Sandbox>(std::move(o), std::move(k), Capabilities{true, true, true, true, true, true, true, true});
    REQUIRE(sb->update_network({{"eth0"}, {}}).ok());
    REQUIRE(sb->start("agent").ok());
  }
  std::vector<std::string> diffs() {
    auto d = sb->verify_table();
    REQUIRE(d.ok());
    return *d;
  }
};

bool contains(const std::vector<std::string>& v, const std::string& part) {
  return std::any_of(v.begin(), v.end(), [&](const std::string& s) { return s.find(part) != std::string::npos; });
}

}  // namespace

TEST_CASE("egressd's own table matches the phase in force after start and after every kind of switch") {
  Fixture f;
  CHECK(f.diffs().empty());
  for (const char* to : {"environment", "verifier", "agent"}) {
    REQUIRE(f.sb->handle({{"cmd", "apply"}, {"phase", to}})["ok"] == true);
    CHECK_MESSAGE(f.diffs().empty(), to);
  }
  REQUIRE(f.sb->handle({{"cmd", "apply"}, {"mode", "allowlist"}, {"allow", {"203.0.113.0/24"}}})["ok"] == true);
  CHECK(f.diffs().empty());
  REQUIRE(f.sb->handle({{"cmd", "apply"}, {"mode", "no-network"}})["ok"] == true);  // inline to inline
  CHECK(f.diffs().empty());
  REQUIRE(f.sb->handle({{"cmd", "apply"}, {"phase", "agent"}})["ok"] == true);
  CHECK(f.diffs().empty());
}

TEST_CASE("verify_table names what someone else changed") {
  Fixture f;
  SUBCASE("table deleted") {
    f.kernel->table.reset();
    CHECK(f.diffs() == std::vector<std::string>{"table inet egressd missing"});
  }
  SUBCASE("table made dormant") {
    f.kernel->table->flags = NFT_TABLE_F_DORMANT;
    CHECK(f.diffs() == std::vector<std::string>{"table inet egressd dormant"});
  }
  SUBCASE("an accept rule added to the output chain") {
    f.kernel->table->rules.insert(f.kernel->table->rules.begin(), {"output", 0, "", 0, 0});
    CHECK(contains(f.diffs(), "chain output: "));
  }
  SUBCASE("a rule replaced by one without its comment") {
    for (auto& r : f.kernel->table->rules) {
      if (r.chain == "active" && !r.comment.empty()) r.comment.clear();
    }
    CHECK(contains(f.diffs(), "chain active: 7 rules, 7 expected (changed)"));
  }
  SUBCASE("table netdev egressd deleted") {
    f.kernel->netdev.reset();
    CHECK(f.diffs() == std::vector<std::string>{"table netdev egressd missing"});
  }
  SUBCASE("an egress chain deleted, egress_check flushed") {
    std::erase(f.kernel->netdev->chains, "eg_eth0");
    std::erase_if(f.kernel->netdev->rules, [](const nft::RuleInfo& r) { return r.chain != "egress_check"; });
    std::erase_if(f.kernel->netdev->rules, [](const nft::RuleInfo& r) { return r.chain == "egress_check"; });
    const auto d = f.diffs();
    CHECK(contains(d, "chain eg_eth0 (table netdev egressd) missing"));
    CHECK(contains(d, "chain egress_check (table netdev egressd): 0 rules, 3 expected"));
  }
  SUBCASE("a chain and a set deleted, another chain added") {
    std::erase(f.kernel->table->chains, "dns_redirect");
    std::erase_if(f.kernel->table->rules, [](const nft::RuleInfo& r) { return r.chain == "dns_redirect"; });
    std::erase(f.kernel->table->sets, "ph_agent_a4");
    f.kernel->table->chains.push_back("evil");
    const auto d = f.diffs();
    CHECK(contains(d, "chain dns_redirect missing"));
    CHECK(contains(d, "set ph_agent_a4 missing"));
    CHECK(contains(d, "chain evil added"));
  }
}

TEST_CASE("restore_table puts the phase in force back in one batch, same generation, learned addresses too") {
  Fixture f;
  REQUIRE(f.sb->handle({{"cmd", "apply"}, {"phase", "agent"}})["ok"] == true);  // generation 2
  std::optional<Status> done;
  f.sb->learn({{"a.example.org", *parse_ip("198.51.100.7"), 300}}, [&](Status s) { done = s; });
  REQUIRE(done.has_value());
  REQUIRE(done->ok());

  for (bool table_gone : {true, false}) {
    CAPTURE(table_gone);
    if (table_gone) {
      f.kernel->table.reset();
      f.kernel->netdev.reset();
    } else {
      f.kernel->table->rules.push_back({"active", 0, "", 0, 0});
      std::erase(f.kernel->netdev->chains, "eg_eth0");
    }
    const std::size_t before = f.kernel->applied.size();
    REQUIRE(f.sb->restore_table().ok());
    REQUIRE(f.kernel->applied.size() == before + 1);  // one transaction, whatever was there, both tables
    const auto& ops = f.kernel->applied.back().ops;
    REQUIRE(ops.size() >= 7);
    CHECK(std::holds_alternative<nft::OpEnsureTable>(ops[0]));
    CHECK(std::holds_alternative<nft::OpDeleteTable>(ops[1]));
    CHECK(std::holds_alternative<nft::OpAddTable>(ops[2]));
    CHECK(std::get<nft::OpEnsureTable>(ops[3]).family == nft::Family::netdev);
    CHECK(std::get<nft::OpDeleteTable>(ops[4]).family == nft::Family::netdev);
    CHECK(std::get<nft::OpAddTable>(ops[5]).table.family == nft::Family::netdev);
    const auto* elems = std::get_if<nft::OpAddElems>(&ops[6]);
    REQUIRE(elems != nullptr);
    CHECK(elems->set == "ph_agent_d4");
    REQUIRE(elems->elems.size() == 1);
    CHECK(elems->elems[0].from.to_string() == "198.51.100.7");
    CHECK(elems->elems[0].timeout_ms > 250'000);  // what is left of 300 s + grace
    CHECK(f.diffs().empty());
    CHECK(f.sb->state().generation == 2);
    CHECK(f.sb->state().phase == "agent");
  }
}

TEST_CASE("an interface that disappears is not tampering; the restore builds for the interfaces there are") {
  Fixture f;
  REQUIRE(f.sb->update_network({{"eth0", "eth1"}, {}}).ok());
  CHECK(f.diffs().empty());
  REQUIRE(f.sb->update_network({{"eth1"}, {}}).ok());  // eth0 went: its chain goes, by egressd
  CHECK(f.diffs().empty());
  f.kernel->netdev.reset();
  REQUIRE(f.sb->restore_table().ok());
  CHECK(f.diffs().empty());
  const auto& nd = std::get<nft::OpAddTable>(f.kernel->applied.back().ops[5]).table;
  std::vector<std::string> chains;
  for (const auto& c : nd.chains) chains.push_back(c.name);
  CHECK(chains == std::vector<std::string>{"egress_check", "eg_eth1", "lo_replies"});
}
