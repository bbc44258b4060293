// nft(8) text of the ruleset model. Each statement's text is what
// `nft list ruleset` prints for the expressions netlink.cc sends for it (the
// kernel tests in tests/integration/netlink_test.cc diff the two); here the
// text itself is pinned.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "nft/model.h"

using namespace egressd;
using namespace egressd::nft;

namespace {

IpPrefix ip(const std::string& text) {
  auto a = parse_ip(text);
  REQUIRE_MESSAGE(a.has_value(), text);
  return *a;
}

std::string one(Stmt s) { return render_rule(Rule{{std::move(s)}, ""}); }

SetElem addr(const std::string& a, std::uint64_t timeout_ms = 0) { return {ip(a), ip(a), timeout_ms}; }
SetElem range(const std::string& from, const std::string& to) { return {ip(from), ip(to), 0}; }

const StmtVerdict kAccept{VerdictKind::accept, ""};

}  // namespace

TEST_CASE("every statement renders as nft lists it") {
  CHECK(one(MatchOifLoopback{}) == "oif \"lo\"");
  CHECK(one(MatchMetaMark{0x65677264}) == "meta mark 0x65677264");
  CHECK(one(MatchMetaMark{0x65677264, true}) == "meta mark != 0x65677264");
  CHECK(one(MatchMetaMark{0x1}) == "meta mark 0x00000001");
  CHECK(one(MatchCtDirectionReply{}) == "ct direction reply");
  CHECK(one(MatchCtMark{0x45470001}) == "ct mark 0x45470001");
  CHECK(one(MatchCtMarkNot{0xffffffff, 0}) == "ct mark != 0x00000000");
  CHECK(one(MatchCtStateNewOrEstablished{}) == "ct state established,new");
  CHECK(one(MatchCtMarkNot{0xfffffffc, 0x7ffffffc}) == "ct mark != 0x7ffffffc/30");
  CHECK(one(MatchCtMarkNot{0x0000ff00, 0x00000100}) == "ct mark & 0x0000ff00 != 0x00000100");
  CHECK(one(MatchL4Proto{6}) == "meta l4proto tcp");
  CHECK(one(MatchL4Proto{17}) == "meta l4proto udp");
  CHECK(one(MatchL4Proto{6, true}) == "meta l4proto != tcp");
  CHECK(one(MatchDport{17, 53}) == "udp dport 53");
  CHECK(one(MatchDport{6, 853}) == "tcp dport 853");
  CHECK(one(MatchLinkIcmpv6{133, 255}) == "icmpv6 type nd-router-solicit ip6 hoplimit 255");
  CHECK(one(MatchLinkIcmpv6{134, 255}) == "icmpv6 type nd-router-advert ip6 hoplimit 255");
  CHECK(one(MatchLinkIcmpv6{135, 255}) == "icmpv6 type nd-neighbor-solicit ip6 hoplimit 255");
  CHECK(one(MatchLinkIcmpv6{136, 255}) == "icmpv6 type nd-neighbor-advert ip6 hoplimit 255");
  CHECK(one(MatchDaddrSet{"ph_agent_a4", SetType::ipv4_addr}) == "ip daddr @ph_agent_a4");
  CHECK(one(MatchDaddrSet{"ph_agent_a6", SetType::ipv6_addr}) == "ip6 daddr @ph_agent_a6");
  CHECK(one(MatchDaddr{ip("192.0.2.9")}) == "ip daddr 192.0.2.9");
  CHECK(one(MatchDaddr{ip("2001:DB8::9")}) == "ip6 daddr 2001:db8::9");
  CHECK(one(StmtCounter{}) == "counter");
  // Values read back from the kernel (egressctl rules), as `nft list` prints them.
  CHECK(one(StmtCounter{true, 12, 3456}) == "counter packets 12 bytes 3456");
  CHECK(one(StmtCounter{true, 0, 0}) == "counter packets 0 bytes 0");
  CHECK(one(StmtLog{100}) == "log group 100");
  CHECK(one(StmtLimit{100, 50}) == "limit rate 100/second burst 50 packets");
  CHECK(one(StmtLimit{20}) == "limit rate 20/second");  // nft omits the default burst 5
  CHECK(one(StmtCtMarkSet{0x45470001}) == "ct mark set 0x45470001");
  CHECK(one(StmtRedirect{5353}) == "redirect to :5353");
  CHECK(one(StmtRejectTcpReset{}) == "reject with tcp reset");
  CHECK(one(StmtRejectAdminProhibited{}) == "reject with icmpx admin-prohibited");
  CHECK(one(StmtVerdict{VerdictKind::accept, ""}) == "accept");
  CHECK(one(StmtVerdict{VerdictKind::drop, ""}) == "drop");
  CHECK(one(StmtVerdict{VerdictKind::jump, "active"}) == "jump active");
}

TEST_CASE("the statements of the enforcement-integrity ruleset render as nft 1.0.6 lists them") {
  CHECK(one(MatchIifLoopback{}) == "iif \"lo\"");
  CHECK(one(MatchIifLoopback{true}) == "iif != \"lo\"");
  CHECK(one(MatchMetaPriority{0x65677264}) == "meta priority 6567:7264");
  CHECK(one(MatchMetaPriority{7}) == "meta priority 0:7");
  CHECK(one(MatchMetaPriority{0x100000}) == "meta priority 10:0");
  CHECK(one(StmtMetaPrioritySet{0}) == "meta priority set none");
  CHECK(one(StmtMetaPrioritySet{0xffffffff}) == "meta priority set root");
  CHECK(one(StmtMetaMarkSet{0}) == "meta mark set 0x00000000");
  CHECK(one(MatchMetaProtocolArp{}) == "meta protocol arp");
  CHECK(one(MatchCtDirectionOriginal{}) == "ct direction original");
  CHECK(one(MatchCtStateNew{}) == "ct state new");
  CHECK(one(MatchCtStatus{CtStatusBit::dnat}) == "ct status dnat");
  CHECK(one(MatchCtStatus{CtStatusBit::confirmed, true}) == "ct status ! confirmed");
  CHECK(one(MatchFibAddrType{false, AddrType::local}) == "fib saddr type local");
  CHECK(one(MatchFibAddrType{false, AddrType::local, true}) == "fib saddr type != local");
  CHECK(one(MatchFibAddrType{true, AddrType::broadcast}) == "fib daddr type broadcast");
  CHECK(one(MatchFibAddrType{true, AddrType::multicast}) == "fib daddr type multicast");
  CHECK(one(MatchSocketMark{0x65677264}) == "socket mark 0x65677264");
  CHECK(one(MatchSocketCgroupv2{1, 77, false}) == "socket cgroupv2 level 1 77");
  CHECK(one(MatchSocketCgroupv2{2, 0, true}) == "socket cgroupv2 level 2 != 0");
  CHECK(one(MatchSaddrSet{"lo_upstream6", SetType::ipv6_addr}) == "ip6 saddr @lo_upstream6");
  CHECK(one(MatchCtOriginalDaddrSet{"lo_upstream4", SetType::ipv4_addr}) == "ct original ip daddr @lo_upstream4");
  CHECK(one(MatchFrameSaddr{*parse_ip("::1")}) == "@ll,96,16 0x86dd @ll,176,128 0x1");
  CHECK(one(MatchIpv6RoutingHeader{}) == "exthdr rt exists");
  CHECK(one(MatchIpv4Options{}) == "ip hdrlength != 5");
  CHECK(one(MatchLinkIcmpv6{135, 255, true}) == "ip6 nexthdr ipv6-icmp ip6 hoplimit 255 icmpv6 type nd-neighbor-solicit");
  CHECK(one(MatchMetaHasSocket{}) == "meta skuid != 4294967295");
  CHECK(one(MatchUdpLongHeader{}) == "@th,64,8 & 0x80 == 0x80");
  CHECK(one(MatchMetaLengthOver{1500}) == "meta length > 1500");
  CHECK(one(MatchTcpHeaderOnly{4, 8}) == "ip hdrlength 5 ip length 52 tcp doff 8");
  CHECK(one(MatchTcpHeaderOnly{6, 5}) == "ip6 length 20 ip6 nexthdr tcp tcp doff 5");
  CHECK(one(MatchTcpFlagUrg{}) == "tcp flags urg");
  CHECK(one(MatchTcpFlagRst{}) == "tcp flags rst");
  // As nft lists `tcp flags & (syn | ack) == syn`.
  CHECK(one(MatchTcpSynOnly{}) == "tcp flags syn / syn,ack");
  CHECK(one(MatchCtStateRelated{}) == "ct state related");
  CHECK(one(MatchCtStateInvalid{}) == "ct state invalid");
  CHECK(one(MatchL4Proto{1}) == "meta l4proto icmp");
  CHECK(one(MatchL4Proto{58}) == "meta l4proto ipv6-icmp");
  CHECK(one(MatchMetaNfproto{4}) == "meta nfproto ipv4");
  CHECK(one(MatchMetaNfproto{6}) == "meta nfproto ipv6");
  auto pfx = [](const char* a, int len) {
    IpPrefix p = ip(a);
    p.prefix_len = static_cast<std::uint8_t>(len);
    return p;
  };
  CHECK(one(MatchDaddr{pfx("fe80::", 10)}) == "ip6 daddr fe80::/10");
  CHECK(one(MatchDaddr{pfx("ff02::", 16)}) == "ip6 daddr ff02::/16");
  CHECK(one(MatchDaddr{pfx("100.64.0.0", 10)}) == "ip daddr 100.64.0.0/10");
  CHECK(one(MatchDaddr{pfx("127.0.0.0", 8)}) == "ip daddr 127.0.0.0/8");
  CHECK(one(MatchSaddr{ip("::")}) == "ip6 saddr ::");
  CHECK(one(MatchSaddr{ip("192.0.2.1")}) == "ip saddr 192.0.2.1");
  CHECK(one(StmtVerdict{VerdictKind::goto_, "ph_agent"}) == "goto ph_agent");
  CHECK(one(StmtVerdict{VerdictKind::return_, ""}) == "return");
}

TEST_CASE("rules join statements with spaces and end with the comment") {
  CHECK(render_rule({{MatchMetaMark{0x45470000}, MatchDport{17, 53}, kAccept}, ""}) ==
        "meta mark 0x45470000 udp dport 53 accept");
  CHECK(render_rule({{MatchDaddrSet{"ph_agent_v4", SetType::ipv4_addr}, StmtCtMarkSet{0x45470001}, kAccept}, ""}) ==
        "ip daddr @ph_agent_v4 ct mark set 0x45470001 accept");
  CHECK(render_rule({{MatchCtMark{0x45470001}, kAccept}, "gen=3 phase=agent"}) ==
        "ct mark 0x45470001 accept comment \"gen=3 phase=agent\"");
  CHECK(render_rule({{MatchL4Proto{6}, StmtCounter{}, StmtRejectTcpReset{}}, ""}) ==
        "meta l4proto tcp counter reject with tcp reset");
  CHECK(render_rule({{MatchMetaMark{0x65677264, true}, MatchDport{6, 53}, StmtRedirect{5353}}, ""}) ==
        "meta mark != 0x65677264 tcp dport 53 redirect to :5353");
}

TEST_CASE("an empty table") {
  Table t;
  CHECK(render_table(t) == "table inet egressd {\n}\n");
  t.name = "other";
  t.comment = "egressd v1 digest=0123456789abcdef";
  CHECK(render_table(t) == "table inet other {\n\tcomment \"egressd v1 digest=0123456789abcdef\"\n}\n");
}

TEST_CASE("sets: type, flags, elements four to a line") {
  Table t;
  t.sets.push_back({"a4", SetType::ipv4_addr, false, false,
                    {addr("192.0.2.1"), addr("192.0.2.2"), addr("192.0.2.3"), addr("192.0.2.4"), addr("192.0.2.5")}});
  t.sets.push_back({"a6", SetType::ipv6_addr, false, false, {}});
  t.sets.push_back({"d4", SetType::ipv4_addr, false, true, {addr("198.18.0.1", 30000)}});
  t.sets.push_back({"n4", SetType::ipv4_addr, true, false,
                    {range("0.0.0.0", "0.255.255.255"), range("192.0.2.7", "192.0.2.7"),
                     range("192.0.2.16", "192.0.2.40"), range("240.0.0.0", "255.255.255.255")}});
  t.sets.push_back({"n6", SetType::ipv6_addr, true, true, {range("2001:db8::", "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff")}});
  CHECK(render_table(t) ==
        "table inet egressd {\n"
        "\tset a4 {\n"
        "\t\ttype ipv4_addr\n"
        "\t\telements = { 192.0.2.1, 192.0.2.2, 192.0.2.3, 192.0.2.4,\n"
        "\t\t\t     192.0.2.5 }\n"
        "\t}\n"
        "\n"
        "\tset a6 {\n"
        "\t\ttype ipv6_addr\n"
        "\t}\n"
        "\n"
        "\tset d4 {\n"
        "\t\ttype ipv4_addr\n"
        "\t\tflags timeout\n"
        "\t\telements = { 198.18.0.1 timeout 30s }\n"
        "\t}\n"
        "\n"
        "\tset n4 {\n"
        "\t\ttype ipv4_addr\n"
        "\t\tflags interval\n"
        "\t\telements = { 0.0.0.0/8, 192.0.2.7, 192.0.2.16-192.0.2.40, 240.0.0.0/4 }\n"
        "\t}\n"
        "\n"
        "\tset n6 {\n"
        "\t\ttype ipv6_addr\n"
        "\t\tflags interval,timeout\n"
        "\t\telements = { 2001:db8::/32 }\n"
        "\t}\n"
        "}\n");
}

TEST_CASE("element timeouts as nft lists them") {
  Set s{"t", SetType::ipv4_addr, false, true, {addr("192.0.2.1", 40'000), addr("192.0.2.2", 70'000),
                                               addr("192.0.2.3", 1'500), addr("192.0.2.4", 90'061'001)}};
  Table t;
  t.sets.push_back(s);
  CHECK(render_table(t).find("elements = { 192.0.2.1 timeout 40s, 192.0.2.2 timeout 1m10s, "
                             "192.0.2.3 timeout 1s500ms, 192.0.2.4 timeout 1d1h1m1s1ms }") != std::string::npos);
}

TEST_CASE("element comments follow the timeout, as nft lists them") {
  SetElem e = addr("192.0.2.1", 40'000);
  e.comment = "a.test b.test";
  e.expires_ms = 39'000;  // read back only: egressd never prints it
  Table t;
  t.sets.push_back(Set{"t", SetType::ipv4_addr, false, true, {e, addr("192.0.2.2", 1'000)}});
  CHECK(render_table(t).find("elements = { 192.0.2.1 timeout 40s comment \"a.test b.test\", 192.0.2.2 timeout 1s }") !=
        std::string::npos);
}

TEST_CASE("input and netdev egress base chains") {
  Table in;
  in.chains.push_back({"input", BaseChain{HookType::filter, 0, false, Hook::input}, {}});
  CHECK(render_table(in) ==
        "table inet egressd {\n"
        "\tchain input {\n"
        "\t\ttype filter hook input priority filter; policy accept;\n"
        "\t}\n"
        "}\n");
  Table nd;
  nd.family = Family::netdev;
  nd.comment = "egressd v1";
  nd.chains.push_back({"egress_check", std::nullopt, {{{StmtCounter{}}, ""}}});
  nd.chains.push_back({"eg_eth0", BaseChain{HookType::filter, 0, true, Hook::egress, "eth0"},
                       {{{StmtVerdict{VerdictKind::jump, "egress_check"}}, ""}}});
  CHECK(render_table(nd) ==
        "table netdev egressd {\n"
        "\tcomment \"egressd v1\"\n"
        "\tchain egress_check {\n"
        "\t\tcounter\n"
        "\t}\n"
        "\n"
        "\tchain eg_eth0 {\n"
        "\t\ttype filter hook egress device \"eth0\" priority filter; policy drop;\n"
        "\t\tjump egress_check\n"
        "\t}\n"
        "}\n");
}

TEST_CASE("chains: base chain headers, rules, declaration order") {
  Table t;
  t.sets.push_back({"s", SetType::ipv4_addr, false, false, {}});
  t.chains.push_back({"output", BaseChain{HookType::filter, 0, true}, {{{MatchOifLoopback{}, kAccept}, ""}}});
  t.chains.push_back({"active", std::nullopt, {}});
  t.chains.push_back({"dns_redirect", BaseChain{HookType::nat, -100, false},
                      {{{MatchDport{17, 53}, StmtRedirect{5353}}, ""}}});
  CHECK(render_table(t) ==
        "table inet egressd {\n"
        "\tset s {\n"
        "\t\ttype ipv4_addr\n"
        "\t}\n"
        "\n"
        "\tchain output {\n"
        "\t\ttype filter hook output priority filter; policy drop;\n"
        "\t\toif \"lo\" accept\n"
        "\t}\n"
        "\n"
        "\tchain active {\n"
        "\t}\n"
        "\n"
        "\tchain dns_redirect {\n"
        "\t\ttype nat hook output priority -100; policy accept;\n"
        "\t\tudp dport 53 redirect to :5353\n"
        "\t}\n"
        "}\n");
}
