// nftables change notifications: parsing, grouping per transaction, and
// telling egressd's own changes and other tables apart from tampering.
// Messages are built by hand as the kernel sends them; no root needed.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <libmnl/libmnl.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>

#include <vector>

#include "nft/monitor.h"

using namespace egressd::nft;

namespace {

constexpr std::uint32_t kOwn = 4242;
constexpr std::uint32_t kNft = 777;

// One notification as nf_tables_api.c builds it: nfgenmsg, then the table
// name (attribute 1) and the object's name attribute.
struct Msg {
  std::vector<char> buf = std::vector<char>(MNL_SOCKET_BUFFER_SIZE);
  nlmsghdr* nlh;
  Msg(std::uint16_t type, std::uint32_t portid, std::uint8_t family = NFPROTO_INET) {
    nlh = mnl_nlmsg_put_header(buf.data());
    nlh->nlmsg_type = static_cast<std::uint16_t>((NFNL_SUBSYS_NFTABLES << 8) | type);
    nlh->nlmsg_pid = portid;
    auto* g = static_cast<nfgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(nfgenmsg)));
    g->nfgen_family = family;
    g->version = NFNETLINK_V0;
  }
  Msg& str(std::uint16_t attr, const char* v) {
    mnl_attr_put_strz(nlh, attr, v);
    return *this;
  }
  Msg& u32(std::uint16_t attr, std::uint32_t v) {
    mnl_attr_put_u32(nlh, attr, htonl(v));
    return *this;
  }
  Msg& elements(int n) {
    nlattr* list = mnl_attr_nest_start(nlh, NFTA_SET_ELEM_LIST_ELEMENTS);
    for (int i = 0; i < n; ++i) {
      nlattr* e = mnl_attr_nest_start(nlh, static_cast<std::uint16_t>(i + 1));
      mnl_attr_put_u32(nlh, NFTA_SET_ELEM_FLAGS, 0);
      mnl_attr_nest_end(nlh, e);
    }
    mnl_attr_nest_end(nlh, list);
    return *this;
  }
};

Msg table_msg(std::uint16_t type, std::uint32_t portid, const char* table, std::uint8_t family = NFPROTO_INET) {
  Msg m(type, portid, family);
  m.str(NFTA_TABLE_NAME, table);
  return m;
}
Msg rule_msg(std::uint16_t type, std::uint32_t portid, const char* table, const char* chain) {
  Msg m(type, portid);
  m.str(NFTA_RULE_TABLE, table).str(NFTA_RULE_CHAIN, chain);
  return m;
}
Msg elem_msg(std::uint16_t type, std::uint32_t portid, const char* table, const char* set, int n) {
  Msg m(type, portid, NFPROTO_INET);
  m.str(NFTA_SET_ELEM_LIST_TABLE, table).str(NFTA_SET_ELEM_LIST_SET, set).elements(n);
  return m;
}
Msg gen_msg(std::uint32_t portid, std::uint32_t id, std::uint32_t pid, const char* comm) {
  Msg m(NFT_MSG_NEWGEN, portid, AF_UNSPEC);
  m.u32(NFTA_GEN_ID, id).u32(NFTA_GEN_PROC_PID, pid).str(NFTA_GEN_PROC_NAME, comm);
  return m;
}

}  // namespace

TEST_CASE("parse_event reads kind, table, object, portid and the NEWGEN process") {
  auto ev = parse_event(rule_msg(NFT_MSG_NEWRULE, kNft, "egressd", "active").nlh);
  REQUIRE(ev);
  CHECK(!ev->is_gen);
  CHECK(ev->kind == ObjKind::rule);
  CHECK(ev->added);
  CHECK(ev->portid == kNft);
  CHECK(ev->family == NFPROTO_INET);
  CHECK(ev->table == "egressd");
  CHECK(ev->object == "active");

  ev = parse_event(elem_msg(NFT_MSG_DELSETELEM, kNft, "egressd", "ph_agent_a4", 3).nlh);
  REQUIRE(ev);
  CHECK(ev->kind == ObjKind::element);
  CHECK(!ev->added);
  CHECK(ev->object == "ph_agent_a4");
  CHECK(ev->elements == 3);

  ev = parse_event(gen_msg(kNft, 99, 1234, "nft").nlh);
  REQUIRE(ev);
  CHECK(ev->is_gen);
  CHECK(ev->gen_id == 99);
  CHECK(ev->proc_pid == 1234);
  CHECK(ev->proc_name == "nft");
}

TEST_CASE("parse_event ignores other subsystems, unknown types and messages without a table") {
  Msg other(NFT_MSG_NEWTABLE, kNft);
  other.nlh->nlmsg_type = (NFNL_SUBSYS_CTNETLINK << 8) | 0;
  other.str(1, "egressd");
  CHECK(!parse_event(other.nlh));
  Msg unknown(200, kNft);
  unknown.str(1, "egressd");
  CHECK(!parse_event(unknown.nlh));
  Msg no_table(NFT_MSG_NEWRULE, kNft);
  CHECK(!parse_event(no_table.nlh));
  Msg truncated(NFT_MSG_NEWTABLE, kNft);
  truncated.nlh->nlmsg_len = NLMSG_LENGTH(1);  // shorter than nfgenmsg
  CHECK(!parse_event(truncated.nlh));
}

TEST_CASE("a foreign transaction on egressd's table is a tamper, reported at its NEWGEN") {
  ChangeTracker t("egressd", {kOwn});
  CHECK(!t.feed(rule_msg(NFT_MSG_NEWRULE, kNft, "egressd", "active").nlh));
  auto tamper = t.feed(gen_msg(kNft, 10, 1234, "nft").nlh);
  REQUIRE(tamper);
  CHECK(tamper->proc_pid == 1234);
  CHECK(tamper->proc_name == "nft");
  CHECK(tamper->portid == kNft);
  CHECK(tamper->gen_id == 10);
  CHECK(tamper->changes.describe("egressd") == "rule added to chain active");
  // The transaction is over: the next NEWGEN alone reports nothing.
  CHECK(!t.feed(gen_msg(kNft, 11, 1234, "nft").nlh));
}

TEST_CASE("egressd's own changes, learned-address inserts included, are never a tamper") {
  ChangeTracker t("egressd", {kOwn});
  for (int i = 0; i < 1000; ++i) {
    CHECK(!t.feed(elem_msg(NFT_MSG_NEWSETELEM, kOwn, "egressd", "ph_agent_d4", 2).nlh));
    CHECK(!t.feed(gen_msg(kOwn, static_cast<std::uint32_t>(i), 1, "egressd").nlh));
  }
  // A whole switch / restore: flush, delete, add.
  CHECK(!t.feed(table_msg(NFT_MSG_DELTABLE, kOwn, "egressd").nlh));
  CHECK(!t.feed(table_msg(NFT_MSG_NEWTABLE, kOwn, "egressd").nlh));
  CHECK(!t.feed(rule_msg(NFT_MSG_DELRULE, kOwn, "egressd", "active").nlh));
  CHECK(!t.feed(gen_msg(kOwn, 2000, 1, "egressd").nlh));
}

TEST_CASE("changes to other tables, and to a table named egressd of another family, are ignored") {
  ChangeTracker t("egressd", {kOwn});
  CHECK(!t.feed(rule_msg(NFT_MSG_NEWRULE, kNft, "docker", "DOCKER").nlh));
  CHECK(!t.feed(table_msg(NFT_MSG_DELTABLE, kNft, "user").nlh));
  CHECK(!t.feed(table_msg(NFT_MSG_DELTABLE, kNft, "egressd", NFPROTO_IPV4).nlh));
  CHECK(!t.feed(elem_msg(NFT_MSG_NEWSETELEM, kNft, "user", "s", 100).nlh));
  CHECK(!t.feed(gen_msg(kNft, 5, 99, "nft").nlh));
}

TEST_CASE("deleting the table is named as such; with other tables it is a flushed ruleset") {
  ChangeTracker t("egressd", {kOwn});
  // The kernel announces every rule, set and chain of a deleted table before the table.
  t.feed(rule_msg(NFT_MSG_DELRULE, kNft, "egressd", "output").nlh);
  t.feed(table_msg(NFT_MSG_DELTABLE, kNft, "egressd").nlh);
  auto tamper = t.feed(gen_msg(kNft, 3, 50, "nft").nlh);
  REQUIRE(tamper);
  CHECK(tamper->changes.describe("egressd") == "table inet egressd deleted");

  t.feed(table_msg(NFT_MSG_DELTABLE, kNft, "docker", NFPROTO_IPV4).nlh);
  t.feed(table_msg(NFT_MSG_DELTABLE, kNft, "egressd").nlh);
  t.feed(table_msg(NFT_MSG_DELTABLE, kNft, "user").nlh);
  tamper = t.feed(gen_msg(kNft, 4, 51, "nft").nlh);
  REQUIRE(tamper);
  CHECK(tamper->changes.describe("egressd") == "ruleset flushed (table inet egressd and 2 other tables deleted)");
}

TEST_CASE("element and set changes are counted per set; the summary stays bounded") {
  ChangeTracker t("egressd", {kOwn});
  t.feed(elem_msg(NFT_MSG_DELSETELEM, kNft, "egressd", "ph_agent_a4", 2).nlh);
  t.feed(elem_msg(NFT_MSG_DELSETELEM, kNft, "egressd", "ph_agent_a4", 3).nlh);
  auto tamper = t.feed(gen_msg(kNft, 1, 7, "nft").nlh);
  REQUIRE(tamper);
  CHECK(tamper->changes.describe("egressd") == "5 elements deleted from set ph_agent_a4");

  for (int i = 0; i < 100; ++i) {
    const std::string chain = "c" + std::to_string(i);
    Msg m(NFT_MSG_NEWCHAIN, kNft);
    m.str(NFTA_CHAIN_TABLE, "egressd").str(NFTA_CHAIN_NAME, chain.c_str());
    t.feed(m.nlh);
  }
  tamper = t.feed(gen_msg(kNft, 2, 7, "nft").nlh);
  REQUIRE(tamper);
  CHECK(tamper->changes.objects.size() == TableChanges::kMaxObjects);
  CHECK(tamper->changes.more == 100 - TableChanges::kMaxObjects);
  CHECK(tamper->changes.describe("egressd").find("92 more changes") != std::string::npos);
}

TEST_CASE("after lost messages (reset) a half-seen transaction is forgotten") {
  ChangeTracker t("egressd", {kOwn});
  t.feed(rule_msg(NFT_MSG_NEWRULE, kNft, "egressd", "active").nlh);
  t.reset();
  CHECK(!t.feed(gen_msg(kNft, 1, 7, "nft").nlh));
}

TEST_CASE("a change by the kernel itself (portid 0) to egressd's table is not egressd's own") {
  ChangeTracker t("egressd", {kOwn});
  t.feed(table_msg(NFT_MSG_DELTABLE, 0, "egressd").nlh);
  auto tamper = t.feed(gen_msg(0, 1, 0, "").nlh);
  REQUIRE(tamper);
  CHECK(tamper->proc_pid == 0);
}

TEST_CASE("table netdev egressd (the egress chains) is egressd's too; a vanished interface is not tampering") {
  ChangeTracker t("egressd", {kOwn});
  SUBCASE("deleted by someone") {
    t.feed(table_msg(NFT_MSG_DELTABLE, kNft, "egressd", NFPROTO_NETDEV).nlh);
    auto tamper = t.feed(gen_msg(kNft, 3, 50, "nft").nlh);
    REQUIRE(tamper);
    CHECK(tamper->changes.describe("egressd") == "table netdev egressd deleted");
  }
  SUBCASE("an egress chain deleted, a rule added to egress_check") {
    Msg chain(NFT_MSG_DELCHAIN, kNft, NFPROTO_NETDEV);
    chain.str(NFTA_CHAIN_TABLE, "egressd").str(NFTA_CHAIN_NAME, "eg_eth0");
    t.feed(chain.nlh);
    Msg rule(NFT_MSG_NEWRULE, kNft, NFPROTO_NETDEV);
    rule.str(NFTA_RULE_TABLE, "egressd").str(NFTA_RULE_CHAIN, "egress_check");
    t.feed(rule.nlh);
    auto tamper = t.feed(gen_msg(kNft, 4, 51, "nft").nlh);
    REQUIRE(tamper);
    const std::string what = tamper->changes.describe("egressd");
    CHECK(what.find("chain eg_eth0 of table netdev egressd deleted") != std::string::npos);
    CHECK(what.find("rule added to chain egress_check of table netdev egressd") != std::string::npos);
  }
  SUBCASE("the kernel deleting the chain of an interface that went away (kernels before 6.10)") {
    Msg chain(NFT_MSG_DELCHAIN, 0, NFPROTO_NETDEV);
    chain.str(NFTA_CHAIN_TABLE, "egressd").str(NFTA_CHAIN_NAME, "eg_veth1");
    CHECK(!t.feed(chain.nlh));
    CHECK(!t.feed(gen_msg(0, 5, 0, "").nlh));
  }
  SUBCASE("egressd's own changes to it") {
    CHECK(!t.feed(table_msg(NFT_MSG_NEWTABLE, kOwn, "egressd", NFPROTO_NETDEV).nlh));
    CHECK(!t.feed(gen_msg(kOwn, 6, 1, "egressd").nlh));
  }
}

TEST_CASE("a deleted netdev table is named once, without the chains and rules that went with it") {
  ChangeTracker t("egressd", {kOwn});
  Msg rule(NFT_MSG_DELRULE, kNft, NFPROTO_NETDEV);
  rule.str(NFTA_RULE_TABLE, "egressd").str(NFTA_RULE_CHAIN, "egress_check");
  t.feed(rule.nlh);
  Msg chain(NFT_MSG_DELCHAIN, kNft, NFPROTO_NETDEV);
  chain.str(NFTA_CHAIN_TABLE, "egressd").str(NFTA_CHAIN_NAME, "eg_eth0");
  t.feed(chain.nlh);
  t.feed(table_msg(NFT_MSG_DELTABLE, kNft, "egressd", NFPROTO_NETDEV).nlh);
  auto tamper = t.feed(gen_msg(kNft, 3, 50, "nft").nlh);
  REQUIRE(tamper);
  CHECK(tamper->changes.describe("egressd") == "table netdev egressd deleted");
}
