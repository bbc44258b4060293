// Kernel tests for src/nft/netlink.cc: what egressd sends over netlink must
// leave exactly the ruleset `nft -f` of the rendered text leaves.
//
// Each test makes its own network namespaces (`egnl-<pid>-<n>`, deleted by
// RAII also when a check fails, and swept at start if a crashed run left
// some), applies through open_kernel() inside one, and diffs `nft list
// ruleset` against a second namespace loaded with nft(8). Needs root, nft(8)
// and ip(8); exits 77 (skip) with the reason otherwise.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include "audit/nflog.h"
#include "daemon/ctforget.h"
#include "daemon/event_hub.h"
#include "daemon/netwatch.h"
#include "daemon/sandbox.h"
#include "daemon/tamper_guard.h"
#include "nft/compile.h"
#include "nft/monitor.h"
#include "nft/netlink.h"
#include "nft/transport.h"
#include "egressd/unique_fd.h"

#include <libmnl/libmnl.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/rtnetlink.h>

using namespace egressd;
using namespace egressd::nft;

namespace {

// A DNS proxy on `port` with one IPv4 and one IPv6 upstream, so the
// equivalence checks cover the own-traffic exemption rules too.
egressd::nft::CompileOptions dns_opts(std::uint16_t port) {
  egressd::nft::CompileOptions o;
  o.dns_port = port;
  o.own_mark = 0x1234abcd;
  o.upstreams = {*egressd::parse_ip("192.0.2.1"), *egressd::parse_ip("2001:db8::53")};
  return o;
}


// For tests of table inet egressd alone: switches leave the netdev table be.
const egressd::nft::CompileOptions kInetOnly = [] {
  egressd::nft::CompileOptions o;
  o.netdev = false;
  return o;
}();

struct CmdResult {
  int status = -1;
  std::string out;  // stdout and stderr
};

CmdResult run(const std::string& cmd) {
  CmdResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// Deletes namespaces of earlier runs that died before their destructors ran.
void sweep_stale_namespaces() {
  DIR* d = opendir("/run/netns");
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    int pid = 0;
    if (std::sscanf(e->d_name, "egnl-%d-", &pid) == 1 && pid > 0 && kill(pid, 0) < 0 && errno == ESRCH) {
      (void)run(std::string("ip netns del ") + e->d_name);
    }
  }
  closedir(d);
}

// Runs before any test: skip (77) with a reason when the kernel tests cannot run.
const bool kEnvironmentChecked = [] {
  auto skip = [](const char* why) {
    std::fprintf(stderr, "SKIP netlink tests: %s\n", why);
    std::exit(77);
  };
  if (getuid() != 0) skip("needs root (network namespaces and nftables)");
  if (run("nft --version").status != 0) skip("nft(8) not found (apt-get install nftables)");
  if (run("ip -V").status != 0) skip("ip(8) not found (apt-get install iproute2)");
  sweep_stale_namespaces();
  const std::string probe = "egnl-" + std::to_string(getpid()) + "-probe";
  if (run("ip netns add " + probe).status != 0) skip("cannot create network namespaces (no CAP_SYS_ADMIN?)");
  const bool nft_ok = run("ip netns exec " + probe + " nft list ruleset").status == 0;
  (void)run("ip netns del " + probe);
  if (!nft_ok) skip("nftables not usable in a network namespace");
  return true;
}();

// A named network namespace for one test; removed on destruction.
class TestNetns {
 public:
  TestNetns() : name_("egnl-" + std::to_string(getpid()) + "-" + std::to_string(++counter_)) {
    const CmdResult r = run("ip netns add " + name_);
    REQUIRE_MESSAGE(r.status == 0, "ip netns add " << name_ << ": " << r.out);
  }
  ~TestNetns() { (void)run("ip netns del " + name_); }
  TestNetns(const TestNetns&) = delete;
  TestNetns& operator=(const TestNetns&) = delete;

  const std::string& name() const { return name_; }

  CmdResult exec(const std::string& cmd) const { return run("ip netns exec " + name_ + " " + cmd); }

  // Runs `f` with this thread in the namespace, then back in its own: what
  // `f` opens (netlink sockets) stays bound to this namespace.
  template <class F>
  auto in_netns(F&& f) const {
    const int self = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    const int target = open(("/run/netns/" + name_).c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(self >= 0);
    REQUIRE(target >= 0);
    REQUIRE(setns(target, CLONE_NEWNET) == 0);
    auto out = f();
    const int back = setns(self, CLONE_NEWNET);
    close(target);
    close(self);
    REQUIRE(back == 0);
    return out;
  }

  // A Kernel bound to this namespace (the socket keeps it after we leave).
  std::unique_ptr<Kernel> kernel() const {
    auto k = in_netns([] { return open_kernel(); });
    REQUIRE_MESSAGE(k.ok(), (k.ok() ? "" : k.error().message));
    return std::move(k).value();
  }

  // `nft list ruleset`, with the only time-dependent part (remaining
  // timeouts: "expires 29s992ms") removed.
  std::string listing() const {
    const CmdResult r = exec("nft list ruleset");
    REQUIRE_MESSAGE(r.status == 0, r.out);
    static const std::regex expires(" expires [0-9hmsd]+");
    return std::regex_replace(r.out, expires, "");
  }

  // The kernel's view below the text: each rule's expression list with its
  // handle, each set element's key, flags and userdata, as nft decodes them.
  // Elements of hash sets come in hash order (per-set random seed), so each
  // run of element lines is sorted.
  std::string debug_listing() const {
    const CmdResult r = exec("nft --debug=netlink list ruleset");
    REQUIRE_MESSAGE(r.status == 0, r.out);
    std::vector<std::string> lines;
    std::size_t pos = 0;
    while (pos < r.out.size()) {
      const std::size_t nl = r.out.find('\n', pos);
      lines.push_back(r.out.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos));
      pos = nl == std::string::npos ? r.out.size() : nl + 1;
    }
    auto is_elem = [](const std::string& l) { return l.rfind("\telement ", 0) == 0; };
    for (auto it = lines.begin(); it != lines.end();) {
      if (!is_elem(*it)) {
        ++it;
        continue;
      }
      const auto run_end = std::find_if_not(it, lines.end(), is_elem);
      std::sort(it, run_end);
      it = run_end;
    }
    std::string out;
    for (const auto& l : lines) out += l + "\n";
    return out;
  }

  // Loads `text` with nft -f.
  void nft_load(const std::string& text) const {
    char path[] = "/tmp/egnl-XXXXXX";
    const int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    REQUIRE(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
    close(fd);
    const CmdResult r = exec(std::string("nft -f ") + path);
    unlink(path);
    REQUIRE_MESSAGE(r.status == 0, "nft -f failed: " << r.out << "\n--- input:\n" << text);
  }

 private:
  std::string name_;
  static inline int counter_ = 0;
};

// ---- policies ------------------------------------------------------------------

Phase phase(const std::string& name, Mode mode, const std::vector<std::string>& entries = {}) {
  Phase p;
  p.name = name;
  p.mode = mode;
  auto parsed = parse_entries(entries);
  REQUIRE_MESSAGE(parsed.ok(), (parsed.ok() ? "" : parsed.error().message));
  p.entries = std::move(parsed).value();
  return p;
}

// Mixed allowlist: single addresses, CIDRs that overlap, nest and touch, both
// families, ranges at the bottom and the top of the address space.
const std::vector<std::string> kAgentEntries = {
    "pypi.org", "*.pythonhosted.org", "192.0.2.1", "192.0.2.7", "198.51.100.0/24", "198.51.100.128/25",
    "198.51.101.0/24",  // adjacent to 198.51.100.0/24: merged into one range
    "203.0.113.0/26", "203.0.113.64/26", "203.0.113.192/26", "10.0.0.0/8", "0.0.0.0/8", "240.0.0.0/4",
    "2001:db8::1", "2001:db8::abcd", "2001:db8:1::/48", "2001:db8:1:1::/64", "2001:db8:2::/48", "fe00::/8",
    "ff00::/8", "255.255.255.255"};

Policy make_policy(const std::vector<std::string>& agent_entries) {
  Policy p;
  p.initial_phase = "environment";
  p.phases.push_back(phase("environment", Mode::public_));
  p.phases.push_back(phase("agent", Mode::allowlist, agent_entries));
  p.phases.push_back(phase("verifier", Mode::no_network));
  p.phases.push_back(phase("strict", Mode::allowlist));  // empty allowlist: denies everything
  return p;
}

const Phase& find_phase(const Policy& p, const std::string& name) {
  const auto it = std::find_if(p.phases.begin(), p.phases.end(), [&](const Phase& ph) { return ph.name == name; });
  REQUIRE(it != p.phases.end());
  return *it;
}

ActiveState named_state(const Policy& p, const std::string& name, std::uint64_t gen) {
  ActiveState st;
  st.generation = gen;
  st.phase = name;
  st.mode = find_phase(p, name).mode;
  st.mark = phase_mark(p, name);
  return st;
}

ActiveState inline_state(const Phase& ph, std::uint64_t gen) {
  ActiveState st;
  st.generation = gen;
  st.phase = "inline";
  st.is_inline = true;
  st.mode = ph.mode;
  st.mark = inline_mark(gen);
  return st;
}

Status apply_table(Kernel& k, const Table& t) {
  Change ch;
  ch.table = t.name;
  ch.ops.push_back(OpAddTable{t});
  return k.apply(ch);
}

// Applies `tables` over netlink in one namespace, in one batch, and `nft -f`
// of their render in another; both listings must be identical, and so must
// the kernel objects behind them (expressions, rule handles, every set
// element).
void check_equivalent(const std::vector<Table>& tables) {
  TestNetns via_netlink, via_nft;
  auto k = via_netlink.kernel();
  Change ch;
  ch.table = tables.front().name;
  std::string text;
  for (const Table& t : tables) {
    ch.ops.push_back(OpAddTable{t});
    text += render_table(t);
  }
  const Status st = k->apply(ch);
  REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));
  via_nft.nft_load(text);
  const std::string got = via_netlink.listing();
  CHECK(got == via_nft.listing());
  for (const Table& t : tables) {
    CHECK(got.find("table " + std::string(to_string(t.family)) + " " + t.name) != std::string::npos);
  }
  const std::string got_debug = via_netlink.debug_listing();
  CHECK(got_debug == via_nft.debug_listing());
  CHECK(got_debug.find("[ lookup reg 1 set ") != std::string::npos);
}

void check_equivalent(const Table& table) { check_equivalent(std::vector<Table>{table}); }

// Both of egressd's tables for `state`, the netdev one with an egress chain
// on `lo` (the one interface every namespace has).
std::vector<Table> both_tables(const Policy& p, const Phase* inline_phase, const ActiveState& state,
                               CompileOptions opts) {
  opts.interfaces = {"lo"};
  return {build_table(p, inline_phase, state, opts), *build_netdev_table(state, opts)};
}

std::string ipv4(std::uint32_t v) {
  return std::to_string(v >> 24) + "." + std::to_string((v >> 16) & 255) + "." + std::to_string((v >> 8) & 255) + "." +
         std::to_string(v & 255);
}

IpPrefix v4(std::uint32_t v, int len = 32) {
  IpPrefix p;
  p.family = 4;
  p.bytes[0] = static_cast<std::uint8_t>(v >> 24);
  p.bytes[1] = static_cast<std::uint8_t>(v >> 16);
  p.bytes[2] = static_cast<std::uint8_t>(v >> 8);
  p.bytes[3] = static_cast<std::uint8_t>(v);
  p.prefix_len = static_cast<std::uint8_t>(len);
  return p;
}

double micros_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

// ---- equivalence with nft -f ---------------------------------------------------

TEST_CASE("netlink apply of build_table lists exactly like nft -f of its render") {
  SUBCASE("defaults: reject, no log, no DNS proxy, mixed allowlist") {
    const Policy p = make_policy(kAgentEntries);
    check_equivalent(build_table(p, nullptr, named_state(p, "agent", 1), {}));
  }
  SUBCASE("log group, deny=drop, dns_port=5353, no inbound replies, both tables in one batch") {
    Policy p = make_policy(kAgentEntries);
    p.enforce.log_group = 100;
    p.enforce.deny = DenyAction::drop;
    p.enforce.inbound_replies = false;
    check_equivalent(both_tables(p, nullptr, named_state(p, "environment", 7), dns_opts(5353)));
  }
  SUBCASE("both tables, allowlist in force, secrets drawn, relay targets and on-link prefixes") {
    const Policy p = make_policy(kAgentEntries);
    CompileOptions o = dns_opts(53);
    o.own_mark = 0x0badf00d;
    o.pass_mark = 0x5ec2e7ed;
    o.pass_priority = 0xfeed0001;
    o.mark_salt = 0x1234567;
    o.upstreams.push_back(*parse_ip("127.0.0.11"));
    o.extra_upstreams = {*parse_ip("198.51.100.53"), *parse_ip("::1")};
    IpPrefix onlink = *parse_ip("2001:db8:1::");
    onlink.prefix_len = 64;
    o.onlink6 = {onlink};
    const ActiveState st = make_state(p, find_phase(p, "agent"), 5, false, o.mark_salt);
    check_equivalent(both_tables(p, nullptr, st, o));
  }
  SUBCASE("empty allowlist active, no-network and public phases") {
    const Policy p = make_policy({});
    check_equivalent(build_table(p, nullptr, named_state(p, "strict", 2), dns_opts(5353)));
  }
  SUBCASE("inline allowlist in force") {
    const Policy p = make_policy({"192.0.2.9"});
    const Phase il = phase("inline", Mode::allowlist, {"198.51.100.0/24", "198.51.100.7", "2001:db8::/33", "2001:db8::5"});
    check_equivalent(build_table(p, &il, inline_state(il, 12), dns_opts(5353)));
  }
  SUBCASE("every statement of the model, hand-built") {
    Table t;
    t.name = "egressd";
    t.comment = "every statement";
    t.sets.push_back({"s4", SetType::ipv4_addr, false, false, {}});
    t.sets.push_back({"s6", SetType::ipv6_addr, true, true, {}});
    const StmtVerdict accept{VerdictKind::accept, ""};
    Chain out{"output", BaseChain{HookType::filter, 0, true}, {}};
    out.rules = {
        {{MatchOifLoopback{}, accept}, ""},
        {{MatchMetaMark{0x45470000}, MatchDport{17, 53}, accept}, ""},
        {{MatchMetaMark{0x45470000, true}, MatchL4Proto{17}, StmtCounter{}, accept}, "mark"},
        {{MatchCtDirectionReply{}, accept}, ""},
        {{MatchCtMark{0x45470001}, accept}, "gen=3 phase=agent"},
        {{MatchCtStateNewOrEstablished{}, MatchCtMarkNot{0xffffffff, 0}, MatchCtMarkNot{0xfffffffc, 0x7ffffffc}, accept},
         ""},
        {{MatchLinkIcmpv6{134, 255}, accept}, ""},
        {{MatchDaddr{*parse_ip("192.0.2.9")}, StmtLog{7}, StmtCtMarkSet{0x45470001}, accept}, ""},
        {{MatchDaddr{*parse_ip("2001:db8::9")}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{MatchDaddrSet{"s4", SetType::ipv4_addr}, StmtVerdict{VerdictKind::jump, "sub"}}, ""},
        {{MatchDaddrSet{"s6", SetType::ipv6_addr}, StmtVerdict{VerdictKind::goto_, "sub"}}, ""},
        {{MatchL4Proto{6}, StmtRejectTcpReset{}}, ""},
        {{MatchMetaNfproto{4}, StmtCounter{}}, "ipv4 only"},
        {{MatchMetaNfproto{6}, StmtCounter{}}, ""},
        {{StmtRejectAdminProhibited{}}, std::string(127, 'c')},
    };
    t.chains.push_back(out);
    t.chains.push_back({"sub", std::nullopt, {{{StmtCounter{}}, ""}}});
    t.chains.push_back({"nat", BaseChain{HookType::nat, -100, false},
                        {{{MatchDport{6, 53}, StmtRedirect{5353}}, ""}, {{MatchDport{17, 53}, StmtRedirect{53}}, ""}}});
    check_equivalent(t);
  }
  SUBCASE("every statement of issue 14's ruleset, hand-built, with a netdev table in the same batch") {
    auto pfx = [](const char* a, int len) {
      IpPrefix p = *parse_ip(a);
      p.prefix_len = static_cast<std::uint8_t>(len);
      return p;
    };
    Table t;
    t.name = "egressd";
    t.sets.push_back({"s4", SetType::ipv4_addr, false, false, {}});
    t.sets.push_back({"s6", SetType::ipv6_addr, true, false, {}});
    const StmtVerdict accept{VerdictKind::accept, ""};
    Chain out{"output", BaseChain{HookType::filter, 0, true}, {}};
    out.rules = {
        {{MatchMetaMark{0x11223344}, MatchCtDirectionOriginal{}, MatchDaddrSet{"s4", SetType::ipv4_addr},
          MatchDport{17, 53}, StmtVerdict{VerdictKind::goto_, "sub"}},
         ""},
        {{MatchDaddrSet{"s4", SetType::ipv4_addr}, StmtCtMarkSet{0x7ffffffe}, StmtMetaMarkSet{0}, accept}, ""},
        {{MatchOifLoopback{}, MatchFibAddrType{false, AddrType::local}, accept}, ""},
        {{MatchDaddr{pfx("127.0.0.0", 8)}, MatchCtStatus{CtStatusBit::dnat}, MatchFibAddrType{false, AddrType::local},
          accept},
         ""},
        {{MatchOifLoopback{}, MatchCtDirectionReply{}, MatchCtStatus{CtStatusBit::confirmed, true}, accept}, ""},
        {{MatchSaddr{*parse_ip("::")}, MatchLinkIcmpv6{135, 255}, MatchDaddr{pfx("ff02::", 16)}, accept}, ""},
        {{MatchFibAddrType{false, AddrType::local, true}, StmtCounter{}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{MatchLinkIcmpv6{136, 255}, MatchDaddr{pfx("fe80::", 10)}, accept}, ""},
        {{MatchLinkIcmpv6{135, 255}, MatchDaddrSet{"s6", SetType::ipv6_addr}, accept}, ""},
        {{MatchDaddr{pfx("100.64.0.0", 10)}, accept}, ""},
        {{MatchSaddr{pfx("192.0.2.0", 25)}, accept}, ""},
        {{MatchIpv6RoutingHeader{}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{MatchIpv4Options{}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{MatchLinkIcmpv6{135, 255, true}, MatchDaddr{pfx("ff02::", 16)}, accept}, ""},
        {{MatchMetaHasSocket{}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{MatchDport{17, 443}, MatchUdpLongHeader{}, StmtVerdict{VerdictKind::goto_, "sub"}}, ""},
        {{MatchDport{17, 443}, MatchMetaLengthOver{1500}, StmtVerdict{VerdictKind::goto_, "sub"}}, ""},
        {{MatchTcpFlagUrg{}, StmtVerdict{VerdictKind::goto_, "sub"}}, ""},
        {{MatchTcpHeaderOnly{4, 5}, accept}, ""},
        {{MatchTcpHeaderOnly{4, 15}, StmtVerdict{VerdictKind::goto_, "sub"}}, ""},
        {{MatchTcpHeaderOnly{6, 8}, accept}, ""},
        {{MatchCtMark{0x7ffffffc}, MatchTcpHeaderOnly{6, 15}, accept}, ""},
        {{MatchCtStateRelated{}, MatchTcpFlagRst{}, accept}, ""},
        {{MatchL4Proto{1}, MatchCtStateInvalid{}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{MatchL4Proto{58}, MatchCtStateInvalid{}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{MatchFibAddrType{true, AddrType::broadcast}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{MatchFibAddrType{true, AddrType::multicast}, StmtVerdict{VerdictKind::drop, ""}}, ""},
        {{StmtMetaMarkSet{0xdeadbeef}, StmtMetaPrioritySet{0x12345678}, accept}, ""},
    };
    t.chains.push_back(out);
    t.chains.push_back({"sub", std::nullopt, {{{StmtCounter{}}, ""}}});
    t.chains.push_back(
        {"input", BaseChain{HookType::filter, 0, false, Hook::input},
         {{{MatchMetaMark{0xdeadbeef}, StmtMetaMarkSet{0}, StmtMetaPrioritySet{0}}, ""},
          {{MatchIifLoopback{}, MatchFibAddrType{false, AddrType::local, true}, StmtVerdict{VerdictKind::drop, ""}}, ""},
          {{MatchSocketMark{0x11223344}, MatchCtDirectionOriginal{}, StmtVerdict{VerdictKind::drop, ""}}, ""},
          {{MatchCtStateInvalid{}, MatchSocketMark{0x11223344}, StmtVerdict{VerdictKind::drop, ""}}, ""},
          {{MatchIifLoopback{true}, MatchCtStateNew{}, StmtCtMarkSet{0x7fffffff}}, ""},
          {{MatchIifLoopback{true}, MatchTcpSynOnly{}, MatchCtStateNew{}, StmtCtMarkSet{0x7fffffff}}, ""},
          {{MatchIifLoopback{true}, MatchL4Proto{6, true}, MatchCtStateNew{}, StmtCtMarkSet{0x7fffffff}}, ""}}});
    Table nd;
    nd.name = "egressd";
    nd.family = Family::netdev;
    nd.comment = "egressd v1";
    nd.chains.push_back({"egress_check", std::nullopt,
                         {{{MatchMetaProtocolArp{}, accept}, ""},
                          {{MatchMetaMark{0xdeadbeef}, MatchMetaPriority{0x12345678}, StmtMetaMarkSet{0},
                            StmtMetaPrioritySet{0}, accept},
                           ""},
                          {{StmtCounter{}}, ""}}});
    nd.chains.push_back(egress_chain("lo"));
    check_equivalent({t, nd});
  }
  SUBCASE("whole address spaces and ranges at both ends") {
    const Policy p = make_policy({"0.0.0.0/0", "::/0", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "0.0.0.0"});
    check_equivalent(build_table(p, nullptr, named_state(p, "agent", 3), {}));
  }
}

TEST_CASE("timeout elements and element ops list like nft") {
  const Policy p = make_policy({"192.0.2.1", "192.0.2.2", "198.51.100.0/24", "240.0.0.0/4", "2001:db8::/32", "ff00::/8"});
  Table t = build_table(p, nullptr, named_state(p, "agent", 1), {});
  // DNS-learned addresses: timeout sets filled after the table exists.
  std::vector<SetElem> learned;
  for (std::uint32_t i = 1; i <= 5; ++i) learned.push_back({v4(0xc6120000u + i), v4(0xc6120000u + i), 30000u * i});
  // The names an address was learned for ride in its comment (docs/pinning.md "Restarts").
  learned[1].comment = "a.test b.test";
  const std::vector<SetElem> ten = make_interval_elems({v4(0x0a000000u, 8)});
  IpPrefix ff00;
  ff00.family = 6;
  ff00.bytes[0] = 0xff;
  ff00.prefix_len = 8;

  TestNetns via_netlink, via_nft;
  auto k = via_netlink.kernel();
  REQUIRE(apply_table(*k, t).ok());
  Change ch;
  ch.ops.push_back(OpAddElems{"ph_agent_d4", SetType::ipv4_addr, false, learned});
  ch.ops.push_back(OpAddElems{"ph_agent_n4", SetType::ipv4_addr, true, ten});
  ch.ops.push_back(OpDeleteElems{"ph_agent_a4", SetType::ipv4_addr, false, make_addr_elems({v4(0xc0000201u)})});
  // Ranges ending at the top of the address space have no end element.
  ch.ops.push_back(OpDeleteElems{"ph_agent_n4", SetType::ipv4_addr, true, make_interval_elems({v4(0xf0000000u, 4)})});
  ch.ops.push_back(OpDeleteElems{"ph_agent_n6", SetType::ipv6_addr, true, make_interval_elems({ff00})});
  const Status st = k->apply(ch);
  REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));

  for (auto& s : t.sets) {
    if (s.name == "ph_agent_d4") s.elems = learned;
    if (s.name == "ph_agent_n4") s.elems = make_interval_elems({v4(0x0a000000u, 8), v4(0xc6336400u, 24)});
    if (s.name == "ph_agent_a4") s.elems = make_addr_elems({v4(0xc0000202u)});
    if (s.name == "ph_agent_n6") s.elems.erase(s.elems.begin() + 1);
  }
  via_nft.nft_load(render_table(t));
  const std::string got = via_netlink.listing();
  CHECK(got == via_nft.listing());
  CHECK(got.find("198.18.0.5 timeout 2m30s") != std::string::npos);
  CHECK(got.find("comment \"a.test b.test\"") != std::string::npos);
  // Read back: the comment, and the time left (counting down from the timeout).
  auto back = k->read_set_elems("egressd", "ph_agent_d4", SetType::ipv4_addr);
  REQUIRE(back.ok());
  REQUIRE(back->size() == learned.size());
  for (const auto& e : *back) {
    const bool named = e.from == learned[1].from;
    CHECK(e.comment == (named ? "a.test b.test" : ""));
    CHECK(e.expires_ms > 0);
    CHECK(e.expires_ms <= e.timeout_ms);
  }
  CHECK(got.find("240.0.0.0") == std::string::npos);
  CHECK(got.find("ff00::") == std::string::npos);
}

// ---- switches ------------------------------------------------------------------

TEST_CASE("switch batches leave the ruleset a fresh build_table load would") {
  const Policy p = make_policy(kAgentEntries);
  const CompileOptions opts = dns_opts(5353);
  const Phase inline_a = phase("inline", Mode::allowlist, {"192.0.2.0/25", "192.0.2.200", "2001:db8:5::/48"});
  const Phase inline_b = phase("inline", Mode::allowlist, {"203.0.113.9", "2001:db8::77"});
  const Phase inline_c = phase("inline", Mode::no_network);

  struct Step {
    const Phase* inline_phase;  // nullptr: switch to the named phase
    std::string named;
  };
  // named -> named, named -> inline, inline -> inline (allowlist -> allowlist,
  // allowlist -> no-network), inline -> named, then back and forth.
  const std::vector<Step> steps = {
      {nullptr, "agent"}, {nullptr, "verifier"}, {&inline_a, ""}, {&inline_b, ""}, {&inline_c, ""},
      {nullptr, "strict"}, {&inline_a, ""}, {nullptr, "environment"},
  };

  // Both tables: every switch rewrites `active` and the netdev egress_check in
  // one batch.
  TestNetns ns;
  auto k = ns.kernel();
  ActiveState prev = named_state(p, "environment", 1);
  {
    Change install;
    for (const Table& t : both_tables(p, nullptr, prev, opts)) install.ops.push_back(OpAddTable{t});
    const Status st = k->apply(install);
    REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));
  }

  std::uint64_t gen = 1;
  for (const Step& s : steps) {
    ++gen;
    const Phase& target = s.inline_phase != nullptr ? *s.inline_phase : find_phase(p, s.named);
    const ActiveState next = s.inline_phase != nullptr ? inline_state(target, gen) : named_state(p, s.named, gen);
    CAPTURE(next.to_comment());
    const Change ch = build_switch(p, target, next, prev, opts);
    const Status st = k->apply(ch);
    REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));

    TestNetns fresh;
    std::string text;
    for (const Table& t : both_tables(p, s.inline_phase, next, opts)) text += render_table(t);
    fresh.nft_load(text);
    CHECK(ns.listing() == fresh.listing());
    prev = next;
  }
}

TEST_CASE("a failing operation on the netdev table aborts the whole two-table batch and is named") {
  const Policy p = make_policy(kAgentEntries);
  TestNetns ns;
  auto k = ns.kernel();
  const ActiveState st = named_state(p, "environment", 1);
  Change install;
  for (const Table& t : both_tables(p, nullptr, st, dns_opts(53))) install.ops.push_back(OpAddTable{t});
  REQUIRE(k->apply(install).ok());
  const std::string before = ns.listing();
  // A switch whose netdev part names a chain that is not there: nothing of it may stay.
  Change sw = build_switch(p, find_phase(p, "verifier"), named_state(p, "verifier", 2), st, dns_opts(53));
  sw.ops.push_back(OpFlushChain{"eg_missing", Family::netdev});
  const Status r = k->apply(sw);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message.find("flush chain netdev eg_missing") != std::string::npos);
  CHECK(ns.listing() == before);
}

TEST_CASE("delete table + add table in one batch replaces it atomically") {
  const Policy p1 = make_policy(kAgentEntries);
  const Policy p2 = make_policy({"203.0.113.0/24", "2001:db8::9"});
  const Table t2 = build_table(p2, nullptr, named_state(p2, "agent", 9), dns_opts(5353));
  TestNetns ns, fresh;
  auto k = ns.kernel();
  REQUIRE(apply_table(*k, build_table(p1, nullptr, named_state(p1, "verifier", 1), {})).ok());
  Change ch;
  ch.ops.push_back(OpDeleteTable{"egressd"});
  ch.ops.push_back(OpAddTable{t2});
  const Status st = k->apply(ch);
  REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));
  fresh.nft_load(render_table(t2));
  CHECK(ns.listing() == fresh.listing());

  // Add and delete in one batch (how capabilities are probed): nothing stays.
  Table probe;
  probe.name = "egressd_probe";
  probe.chains.push_back({"nat", BaseChain{HookType::nat, -100, false}, {{{MatchDport{17, 53}, StmtRedirect{53}}, ""}}});
  Change pc;
  pc.table = probe.name;
  pc.ops.push_back(OpAddTable{probe});
  pc.ops.push_back(OpDeleteTable{probe.name});
  CHECK(k->apply(pc).ok());
  CHECK(ns.listing() == fresh.listing());
}

// ---- failures change nothing ---------------------------------------------------

TEST_CASE("a failing change names the op and object and changes nothing") {
  const Policy p = make_policy(kAgentEntries);
  const ActiveState st0 = named_state(p, "agent", 1);
  TestNetns ns;
  auto k = ns.kernel();
  REQUIRE(apply_table(*k, build_table(p, nullptr, st0, {})).ok());
  const std::string before = ns.listing();

  SUBCASE("rule referencing a missing set, after valid ops in the same batch") {
    Change ch;
    ch.ops.push_back(OpFlushChain{"active"});
    ch.ops.push_back(OpAddSet{Set{"fresh_v4", SetType::ipv4_addr, false, false, make_addr_elems({v4(0xc0000205u)})}});
    ch.ops.push_back(OpAddRule{"active", Rule{{MatchDaddrSet{"no_such_set", SetType::ipv4_addr}, StmtVerdict{VerdictKind::accept, ""}}, ""}});
    const Status st = k->apply(ch);
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().message ==
          "add rule to chain active (ip daddr @no_such_set accept): No such file or directory");
  }
  SUBCASE("a failing message ahead of valid ones: the batch is answered at once") {
    // Only the batch's last message asks for an ack; the kernel reports the
    // failure and still acks the last message, so nothing waits for an ack
    // that is not coming.
    Change ch;
    ch.ops.push_back(OpAddSet{Set{"ph_agent_a4", SetType::ipv4_addr, false, false, {}}});
    ch.ops.push_back(OpFlushChain{"active"});
    ch.ops.push_back(OpAddSet{Set{"fresh_v4", SetType::ipv4_addr, false, false, make_addr_elems({v4(0xc0000205u)})}});
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = k->apply(ch);
    const auto took = std::chrono::steady_clock::now() - t0;
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().message == "add set ph_agent_a4: File exists");
    CHECK(took < std::chrono::milliseconds(200));
  }
  SUBCASE("adding a set that exists") {
    Change ch;
    ch.ops.push_back(OpAddSet{Set{"ph_agent_a4", SetType::ipv4_addr, false, false, {}}});
    const Status st = k->apply(ch);
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().message == "add set ph_agent_a4: File exists");
  }
  SUBCASE("adding the table again") {
    const Status st = apply_table(*k, build_table(p, nullptr, st0, {}));
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().message == "add table egressd: File exists");
  }
  SUBCASE("deleting a chain that is still referenced") {
    Change ch;
    ch.ops.push_back(OpFlushChain{"deny"});
    ch.ops.push_back(OpDeleteChain{"deny"});
    const Status st = k->apply(ch);
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().message == "delete chain deny: Device or resource busy");
  }
  SUBCASE("invalid input is refused before the kernel sees it") {
    Change ch;
    ch.ops.push_back(OpFlushChain{"active"});
    ch.ops.push_back(OpAddRule{"active", Rule{{StmtVerdict{VerdictKind::accept, ""}}, std::string(200, 'x')}});
    const Status st = k->apply(ch);
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().kind == ErrorKind::invalid);
    CHECK(st.error().message == "add rule to chain active: comment longer than 127 bytes");

    Change wrong_family;
    wrong_family.ops.push_back(OpAddElems{"ph_agent_a6", SetType::ipv6_addr, false, make_addr_elems({v4(0xc0000205u)})});
    const Status st2 = k->apply(wrong_family);
    REQUIRE_FALSE(st2.ok());
    CHECK(st2.error().message == "add elements to set ph_agent_a6: element 192.0.2.5 is not of type ipv6_addr");
  }
  CHECK(ns.listing() == before);

  // The socket is still in a clean state: the next change works. (The learned
  // set, not ph_agent_a4: static address sets are sized to their elements.)
  Change ok;
  ok.ops.push_back(OpAddElems{"ph_agent_d4", SetType::ipv4_addr, false, make_addr_elems({v4(0xc0000263u)})});
  const Status st = k->apply(ok);
  CHECK_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));
}

// ---- big sets ------------------------------------------------------------------

TEST_CASE("100k addresses and 50k ranges load in one batch") {
  Table t;
  t.name = "egressd";
  t.comment = "big";
  std::vector<IpPrefix> addrs;
  addrs.reserve(100000);
  for (std::uint32_t i = 0; i < 100000; ++i) addrs.push_back(v4(0x0a000000u + i * 3));
  std::vector<IpPrefix> nets;
  nets.reserve(50000);
  for (std::uint32_t i = 0; i < 50000; ++i) nets.push_back(v4(0x64000000u + i * 64, 27));  // /27 every /26: none merge
  t.sets.push_back({"big_a4", SetType::ipv4_addr, false, false, make_addr_elems(addrs)});
  t.sets.push_back({"big_n4", SetType::ipv4_addr, true, false, make_interval_elems(nets)});
  REQUIRE(t.sets[1].elems.size() == 50000);
  t.chains.push_back({"c", std::nullopt, {{{MatchDaddrSet{"big_a4", SetType::ipv4_addr}, StmtVerdict{VerdictKind::accept, ""}}, ""},
                                           {{MatchDaddrSet{"big_n4", SetType::ipv4_addr}, StmtVerdict{VerdictKind::accept, ""}}, ""}}});

  TestNetns ns;
  auto k = ns.kernel();
  const auto t0 = std::chrono::steady_clock::now();
  const Status st = apply_table(*k, t);
  const double us = micros_since(t0);
  REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));
  std::printf("[netlink] 100k addresses + 50k ranges: one batch applied in %.0f us\n", us);

  auto count_elems = [&](const std::string& set) {
    const CmdResult r = ns.exec("nft list set inet egressd " + set);
    REQUIRE(r.status == 0);
    const auto open = r.out.find("elements = {");
    REQUIRE(open != std::string::npos);
    return std::count(r.out.begin() + static_cast<long>(open), r.out.end(), ',') + 1;
  };
  CHECK(count_elems("big_a4") == 100000);
  CHECK(count_elems("big_n4") == 50000);
  // Spot checks: first, last, a gap between elements.
  CHECK(ns.exec("nft get element inet egressd big_a4 '{ 10.0.0.0 }'").status == 0);
  CHECK(ns.exec("nft get element inet egressd big_a4 '{ " + ipv4(0x0a000000u + 99999 * 3) + " }'").status == 0);
  CHECK(ns.exec("nft get element inet egressd big_a4 '{ 10.0.0.1 }'").status != 0);
  CHECK(ns.exec("nft get element inet egressd big_n4 '{ 100.0.0.31 }'").status == 0);
  CHECK(ns.exec("nft get element inet egressd big_n4 '{ 100.0.0.32 }'").status != 0);
  CHECK(ns.exec("nft get element inet egressd big_n4 '{ " + ipv4(0x64000000u + 49999 * 64 + 31) + " }'").status == 0);
}

// ---- read back -----------------------------------------------------------------

TEST_CASE("read_table returns comment, chains, sets and rules") {
  const Policy p = make_policy({"192.0.2.1"});
  const ActiveState st = named_state(p, "agent", 4);
  const Table t = build_table(p, nullptr, st, {});
  TestNetns ns;
  auto k = ns.kernel();

  auto missing = k->read_table("egressd", Family::inet);
  REQUIRE(missing.ok());
  CHECK_FALSE(missing->has_value());

  REQUIRE(apply_table(*k, t).ok());
  auto got = k->read_table("egressd", Family::inet);
  REQUIRE_MESSAGE(got.ok(), (got.ok() ? "" : got.error().message));
  REQUIRE(got->has_value());
  const TableInfo& info = **got;
  CHECK(info.comment == t.comment);
  std::vector<std::string> chains, sets;
  for (const auto& c : t.chains) chains.push_back(c.name);
  for (const auto& s : t.sets) sets.push_back(s.name);
  CHECK(info.chains == chains);
  CHECK(info.sets == sets);

  std::size_t nrules = 0;
  for (const auto& c : t.chains) nrules += c.rules.size();
  REQUIRE(info.rules.size() == nrules);
  std::size_t i = 0;
  for (const auto& c : t.chains) {
    for (const auto& r : c.rules) {
      CHECK(info.rules[i].chain == c.name);
      CHECK(info.rules[i].comment == r.comment);
      CHECK(info.rules[i].handle != 0);
      ++i;
    }
  }
  // The state comment on the first commented rule of `active` is what a restart adopts.
  const auto active = std::find_if(info.rules.begin(), info.rules.end(),
                                   [](const RuleInfo& r) { return r.chain == "active" && !r.comment.empty(); });
  REQUIRE(active != info.rules.end());
  CHECK(active->comment == st.to_comment());
  // Table netdev egressd reads back the same way.
  CompileOptions lo_only;
  lo_only.interfaces = {"lo"};
  REQUIRE(apply_table(*k, *build_netdev_table(st, lo_only)).ok());
  auto nd = k->read_table("egressd", Family::netdev);
  REQUIRE_MESSAGE(nd.ok(), (nd.ok() ? "" : nd.error().message));
  REQUIRE(nd->has_value());
  CHECK((*nd)->comment == "egressd v1");
  CHECK((*nd)->chains == std::vector<std::string>{"egress_check", "eg_lo", "lo_replies"});
  CHECK((*nd)->rules.size() == 13);  // 3 + 1, and 9 on lo for the DNS proxy's answers and the marks' clear
  // And the elements of a set (relay targets adopted at a restart).
  Change relay;
  relay.ops.push_back(OpAddElems{kUpstreamSet4, SetType::ipv4_addr, false, make_addr_elems({*parse_ip("198.51.100.53")})});
  REQUIRE(k->apply(relay).ok());
  auto elems = k->read_set_elems("egressd", kUpstreamSet4, SetType::ipv4_addr);
  REQUIRE_MESSAGE(elems.ok(), (elems.ok() ? "" : elems.error().message));
  REQUIRE(elems->size() == 1);
  CHECK(elems->front().from.to_string() == "198.51.100.53");
  CHECK_FALSE(k->read_set_elems("egressd", "no_such_set", SetType::ipv4_addr).ok());

  // Counters: a datagram to an address the phase does not allow, routed via
  // a veth pair whose both ends stay in this namespace, hits the deny chain
  // (the output hook runs before neighbour resolution).
  REQUIRE(ns.exec("ip link add egnl0 type veth peer name egnl1").status == 0);
  REQUIRE(ns.exec("ip link set egnl0 up").status == 0);
  REQUIRE(ns.exec("ip addr add 192.0.2.100/24 dev egnl0").status == 0);
  (void)ns.exec("bash -c 'echo x > /dev/udp/192.0.2.50/9'");
  auto after = k->read_table("egressd", Family::inet);
  REQUIRE(after.ok());
  std::uint64_t deny_packets = 0;
  for (const auto& r : (*after)->rules) {
    if (r.chain == "deny") deny_packets += r.packets;
  }
  CHECK(deny_packets >= 1);

  CHECK_FALSE(k->read_table("no_such_table", Family::inet)->has_value());

  // Reads stay whole while another socket commits element changes without
  // pause (the DNS proxy does this): each read retries until it saw one
  // generation.
  auto writer = ns.kernel();
  std::atomic<bool> stop{false};
  std::atomic<int> commits{0};
  std::thread churn([&] {
    const std::vector<SetElem> e = make_addr_elems({v4(0xc6120001u)});
    while (!stop) {
      Change add, del;
      add.ops.push_back(OpAddElems{"ph_agent_d4", SetType::ipv4_addr, false, e});
      del.ops.push_back(OpDeleteElems{"ph_agent_d4", SetType::ipv4_addr, false, e});
      if (writer->apply(add).ok() && writer->apply(del).ok()) commits += 2;
    }
  });
  int reads_ok = 0;
  for (int i = 0; i < 100; ++i) {
    auto r = k->read_table("egressd", Family::inet);
    if (r.ok() && r->has_value() && (*r)->rules.size() == nrules && (*r)->chains == chains) {
      ++reads_ok;
    } else {
      CAPTURE(i);
      CHECK_MESSAGE(false, (r.ok() ? (r->has_value() ? "incomplete table" : "no table") : r.error().message));
    }
  }
  stop = true;
  churn.join();
  CHECK(reads_ok == 100);
  CHECK(commits > 100);

  // Switches to and from inline policies meanwhile (chains and sets come and
  // go): every read is still of one table state, never chains of one and
  // rules of another.
  stop = false;
  commits = 0;
  const Phase il = phase("inline", Mode::allowlist, {"198.51.100.0/24", "2001:db8::5"});
  std::thread switcher([&] {
    ActiveState prev = st;
    std::uint64_t gen = st.generation;
    while (!stop) {
      const ActiveState to_inline = inline_state(il, ++gen);
      const ActiveState back = named_state(p, "agent", ++gen);
      if (writer->apply(build_switch(p, il, to_inline, prev, kInetOnly)).ok() &&
          writer->apply(build_switch(p, find_phase(p, "agent"), back, to_inline, kInetOnly)).ok()) {
        commits += 2;
      }
      prev = back;
    }
  });
  int consistent = 0;
  for (int i = 0; i < 100; ++i) {
    auto r = k->read_table("egressd", Family::inet);
    if (!r.ok() || !r->has_value()) {
      CHECK_MESSAGE(false, (r.ok() ? "no table" : r.error().message));
      continue;
    }
    const TableInfo& ti = **r;
    bool ok = ti.comment == t.comment;
    for (const auto& rule : ti.rules) {
      ok = ok && std::find(ti.chains.begin(), ti.chains.end(), rule.chain) != ti.chains.end();
    }
    const bool has_inline_chain = std::any_of(ti.chains.begin(), ti.chains.end(), [](const std::string& c) { return c.rfind("il", 0) == 0; });
    const bool has_inline_set = std::any_of(ti.sets.begin(), ti.sets.end(), [](const std::string& s) { return s.rfind("il", 0) == 0; });
    ok = ok && has_inline_chain == has_inline_set;
    if (ok) {
      ++consistent;
    } else {
      std::string text = "chains:";
      for (const auto& c : ti.chains) text += " " + c;
      text += "\nsets:";
      for (const auto& x : ti.sets) text += " " + x;
      text += "\nrules in:";
      for (const auto& x : ti.rules) text += " " + x.chain;
      CHECK_MESSAGE(false, "read mixes two table states\n" << text);
    }
  }
  stop = true;
  switcher.join();
  CHECK(consistent == 100);
  CHECK(commits > 10);
}

// ---- timing (printed, not asserted: DESIGN §5 budgets are benchmarks) -----------

TEST_CASE("timing: named switch and 10k-entry inline switch") {
  const Policy p = make_policy(kAgentEntries);
  const CompileOptions opts = dns_opts(5353);

  // Switches between staged named phases: a constant-size batch.
  {
    TestNetns ns;
    auto k = ns.kernel();
    ActiveState prev = named_state(p, "environment", 1);
    REQUIRE(apply_table(*k, build_table(p, nullptr, prev, opts)).ok());
    std::vector<double> us;
    std::uint64_t gen = 1;
    for (int i = 0; i < 200; ++i) {
      const char* name = i % 2 == 0 ? "agent" : "verifier";
      const ActiveState next = named_state(p, name, ++gen);
      const Change ch = build_switch(p, find_phase(p, name), next, prev, kInetOnly);
      const auto t0 = std::chrono::steady_clock::now();
      const Status st = k->apply(ch);
      us.push_back(micros_since(t0));
      REQUIRE(st.ok());
      prev = next;
    }
    std::sort(us.begin(), us.end());
    std::printf("[netlink] switch named->named (apply until every ack): median %.0f us, p99 %.0f us, max %.0f us (n=%zu)\n",
                us[us.size() / 2], us[us.size() * 99 / 100], us.back(), us.size());
  }

  // Inline policies of 10k entries: the switch batch against `nft -f` of the
  // same ruleset (the whole table with that inline policy in force).
  struct Mix {
    const char* what;
    std::uint32_t addrs, cidrs;
  };
  for (const Mix& mix : {Mix{"10k addresses", 10000, 0}, Mix{"5k addresses + 5k CIDRs", 5000, 5000},
                         Mix{"10k CIDRs", 0, 10000}}) {
    std::vector<std::string> entries;
    for (std::uint32_t i = 0; i < mix.addrs; ++i) entries.push_back(ipv4(0xc6120000u + i * 2));
    for (std::uint32_t i = 0; i < mix.cidrs; ++i) entries.push_back(ipv4(0xc6130000u + i * 8) + "/30");
    const Phase il = phase("inline", Mode::allowlist, entries);

    TestNetns ns;
    auto k = ns.kernel();
    ActiveState prev = named_state(p, "environment", 1);
    REQUIRE(apply_table(*k, build_table(p, nullptr, prev, opts)).ok());
    std::vector<double> in_us, out_us;
    std::uint64_t gen = 1;
    for (int round = 0; round < 5; ++round) {
      const ActiveState next = inline_state(il, ++gen);
      const Change to_inline = build_switch(p, il, next, prev, kInetOnly);
      auto t0 = std::chrono::steady_clock::now();
      Status st = k->apply(to_inline);
      in_us.push_back(micros_since(t0));
      REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));
      const ActiveState back = named_state(p, "agent", ++gen);
      const Change to_named = build_switch(p, find_phase(p, "agent"), back, next, kInetOnly);
      t0 = std::chrono::steady_clock::now();
      st = k->apply(to_named);
      out_us.push_back(micros_since(t0));
      REQUIRE(st.ok());
      prev = back;
    }
    TestNetns ref;
    const std::string text = render_table(build_table(p, &il, inline_state(il, 99), opts));
    char path[] = "/tmp/egnl-XXXXXX";
    const int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    REQUIRE(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
    close(fd);
    std::vector<double> nft_us;
    for (int i = 0; i < 3; ++i) {
      (void)ref.exec("nft flush ruleset");
      // nft runs inside the namespace and times only itself, not `ip netns exec`.
      const CmdResult r = ref.exec(std::string("sh -c 's=$(date +%s%N); nft -f ") + path + " && e=$(date +%s%N) && echo $(((e-s)/1000))'");
      REQUIRE_MESSAGE(r.status == 0, r.out);
      nft_us.push_back(std::stod(r.out));
    }
    unlink(path);
    const double ours = median(in_us), theirs = median(nft_us);
    std::printf("[netlink] inline %s: switch %.0f us, nft -f %.0f us, ratio %.2f; switching away (deletes it) %.0f us\n",
                mix.what, ours, theirs, ours / theirs, median(out_us));
  }
}

// ---- tamper detection around egressd's own large batches -----------------------

namespace {

// The real kernel, plus a tamperer that commits from its own socket right
// after egressd's next batch: inside the window in which the tamper guard is
// not subscribed to change events.
class RacingKernel final : public Kernel {
 public:
  RacingKernel(std::unique_ptr<Kernel> real, std::unique_ptr<Kernel> tamperer)
      : real_(std::move(real)), tamperer_(std::move(tamperer)) {}
  std::optional<Change> race_after_next;
  Status apply(const Change& ch) override {
    Status st = real_->apply(ch);
    if (race_after_next) {
      const Change foreign = std::move(*race_after_next);
      race_after_next.reset();
      const Status t = tamperer_->apply(foreign);
      REQUIRE_MESSAGE(t.ok(), (t.ok() ? "" : t.error().message));
    }
    return st;
  }
  Result<std::optional<TableInfo>> read_table(const std::string& name, Family f) override {
    return real_->read_table(name, f);
  }
  Result<std::vector<SetElem>> read_set_elems(const std::string& table, const std::string& set, SetType t) override {
    return real_->read_set_elems(table, set, t);
  }
  std::uint32_t portid() const override { return real_->portid(); }
  Result<std::uint32_t> generation() override { return real_->generation(); }

 private:
  std::unique_ptr<Kernel> real_, tamperer_;
};

std::vector<std::string> many_addresses(int n, int third_octet) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back("198.18." + std::to_string(third_octet + i / 256) + "." + std::to_string(i % 256));
  return out;
}

// A sandbox with one public phase whose posted work runs on `io`.
daemon::SandboxOptions public_sandbox_options(boost::asio::io_context& io) {
  daemon::SandboxOptions o;
  Policy p;
  p.phases.push_back(phase("environment", Mode::public_, {}));
  p.initial_phase = "environment";
  o.policy = p;
  o.post = [&io](std::function<void()> fn) { boost::asio::post(io, std::move(fn)); };
  return o;
}

}  // namespace

TEST_CASE("own large batches are not heard, and a commit by others meanwhile is still caught and undone") {
  TestNetns ns;
  auto racing_owned = std::make_unique<RacingKernel>(ns.kernel(), ns.kernel());
  RacingKernel& racing = *racing_owned;
  boost::asio::io_context io;
  daemon::SandboxOptions o = public_sandbox_options(io);
  daemon::Sandbox sb(std::move(o), std::move(racing_owned), daemon::Capabilities{true, true, true, true, true});
  auto guard = ns.in_netns([&] { return daemon::TamperGuard::open(io, sb, {}); });  // its socket: in ns
  REQUIRE(guard.ok());
  sb.set_large_batch_runner([g = guard->get()](const std::function<Status()>& apply) { return g->apply_unheard(apply); });
  REQUIRE(sb.start("environment").ok());
  (*guard)->start();
  auto settle = [&] {
    // Handlers the switch posted, and every event already queued on the socket.
    for (int i = 0; i < 50 && io.poll() > 0; ++i) {
    }
  };

  // 1000 addresses: a large batch, sent unheard. Nothing is reported as tampering.
  const auto allow = many_addresses(1000, 0);
  REQUIRE(sb.handle({{"cmd", "apply"}, {"mode", "allowlist"}, {"allow", allow}})["ok"] == true);
  settle();
  CHECK((*guard)->tampers() == 0);

  // Again, with a foreign element added inside the unheard window: only the
  // generation tells, and the element is gone after the restore.
  racing.race_after_next = Change{kTableName, {}};
  Change& foreign = *racing.race_after_next;
  // (The learned set: the static one is sized to its elements and full.)
  const std::string next_set = "il" + std::to_string(sb.state().generation + 1) + "_d4";
  foreign.ops.push_back(OpAddElems{next_set, SetType::ipv4_addr, false, {{v4(0xcb007163u), v4(0xcb007163u), 600000}}});
  REQUIRE(sb.handle({{"cmd", "apply"}, {"mode", "allowlist"}, {"allow", many_addresses(1000, 8)}})["ok"] == true);
  CHECK(ns.exec("nft list set inet egressd " + next_set).out.find("203.0.113.99") != std::string::npos);
  settle();
  CHECK((*guard)->tampers() == 1);
  CHECK((*guard)->restores() == 1);
  const CmdResult after = ns.exec("nft list set inet egressd " + next_set);
  REQUIRE(after.status == 0);
  CHECK(after.out.find("203.0.113.99") == std::string::npos);
  CHECK(ns.exec("nft list set inet egressd il" + std::to_string(sb.state().generation) + "_a4").out.find("198.18.8.0") !=
        std::string::npos);
  (*guard)->close();
}

// A sandbox in `ns` (phases: environment public, agent allowlist
// 198.51.100.11) started in "agent", and its tamper guard verifying every
// `interval`, started.
struct GuardedSandbox {
  GuardedSandbox(TestNetns& ns, std::chrono::milliseconds interval)
      : sb(options(io), ns.kernel(), daemon::Capabilities{true, true, true, true, true}) {
    daemon::TamperGuardOptions go;
    go.verify_interval = interval;
    auto opened = ns.in_netns([&] { return daemon::TamperGuard::open(io, sb, go); });
    REQUIRE(opened.ok());
    guard = std::move(*opened);
    REQUIRE(sb.start("agent").ok());
    guard->start();
  }
  static daemon::SandboxOptions options(boost::asio::io_context& io) {
    daemon::SandboxOptions o;
    o.policy.phases.push_back(phase("environment", Mode::public_, {}));
    o.policy.phases.push_back(phase("agent", Mode::allowlist, {"198.51.100.11"}));
    o.policy.initial_phase = "agent";
    o.post = [&io](std::function<void()> fn) { boost::asio::post(io, std::move(fn)); };
    return o;
  }
  // Runs the loop (events, timers) until `done` or the deadline.
  bool run_until(const std::function<bool()>& done, std::chrono::milliseconds deadline) {
    const auto end = std::chrono::steady_clock::now() + deadline;
    while (!done() && std::chrono::steady_clock::now() < end) io.run_for(std::chrono::milliseconds(5));
    return done();
  }
  boost::asio::io_context io;
  daemon::Sandbox sb;
  std::unique_ptr<daemon::TamperGuard> guard;
};

TEST_CASE("the verification timer undoes a change the change events did not show") {
  // The safety net of DESIGN's tamper detection: a change whose notification
  // the event path cannot use (here: committed from a socket registered as
  // egressd's own, as a lost or misattributed notification would be) is found
  // by the periodic re-dump and undone.
  TestNetns ns;
  const auto interval = std::chrono::milliseconds(50);
  GuardedSandbox g(ns, interval);
  const std::string installed = ns.listing();

  // Three verification rounds of egressd's own table find nothing.
  const auto t0 = std::chrono::steady_clock::now();
  (void)g.run_until([&] { return g.guard->tampers() > 0 || std::chrono::steady_clock::now() - t0 > 3 * interval; },
                    std::chrono::milliseconds(1000));
  CHECK(g.guard->tampers() == 0);

  auto blind = ns.kernel();
  g.guard->add_own_portid(blind->portid());
  Change ch{kTableName, {}};
  ch.ops.push_back(OpAddRule{"output", Rule{{StmtVerdict{VerdictKind::accept, ""}}, ""}});
  REQUIRE(blind->apply(ch).ok());
  CHECK(ns.exec("nft list chain inet egressd output").out.find("\t\taccept\n") != std::string::npos);

  REQUIRE(g.run_until([&] { return g.guard->restores() >= 1; }, std::chrono::milliseconds(2000)));
  CHECK(g.guard->tampers() == 1);
  CHECK(ns.listing() == installed);
  g.guard->close();
}

// ---- shutdown with work pending (the guard's stop token, not liveness flags) ----

namespace {

// The real kernel, refusing every batch while `refuse` is set (a restore that
// fails, so the guard schedules a retry).
class RefusingKernel final : public Kernel {
 public:
  explicit RefusingKernel(std::unique_ptr<Kernel> real) : real_(std::move(real)) {}
  bool refuse = false;
  int refused = 0, applied = 0;
  Status apply(const Change& ch) override {
    if (refuse) {
      ++refused;
      return Error::runtime("refused by the test");
    }
    ++applied;
    return real_->apply(ch);
  }
  Result<std::optional<TableInfo>> read_table(const std::string& name, Family f) override {
    return real_->read_table(name, f);
  }
  Result<std::vector<SetElem>> read_set_elems(const std::string& table, const std::string& set, SetType t) override {
    return real_->read_set_elems(table, set, t);
  }
  std::uint32_t portid() const override { return real_->portid(); }
  Result<std::uint32_t> generation() override { return real_->generation(); }

 private:
  std::unique_ptr<Kernel> real_;
};

// Runs every handler that is ready, until none is. Afterwards the next handler
// posted runs only after the loop has polled the kernel for completions (asio
// queues those behind it): a wait that completes then is queued, not
// cancellable, when that handler runs.
void settle(boost::asio::io_context& io) {
  for (int i = 0; i < 100 && io.poll() > 0; ++i) {
  }
}

bool has_accept_rule(const TestNetns& ns) {
  return ns.exec("nft list chain inet egressd output").out.find("\t\taccept\n") != std::string::npos;
}

// A rule added to egressd's output chain from `k`.
void add_accept_rule(Kernel& k) {
  Change ch{kTableName, {}};
  ch.ops.push_back(OpAddRule{"output", Rule{{StmtVerdict{VerdictKind::accept, ""}}, ""}});
  const Status st = k.apply(ch);
  REQUIRE_MESSAGE(st.ok(), (st.ok() ? "" : st.error().message));
}

}  // namespace

// ---- the agent's event hub: one socket for every sandbox's namespace ----

namespace {

// Sockets of this process in `ns` of netlink `protocol` joined to `group`
// (from the namespace's /proc/net/netlink, matched to our descriptors by
// inode).
int own_listeners_in(const TestNetns& ns, int protocol, unsigned group) {
  std::vector<std::string> ours;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      char target[128];
      const ssize_t n = readlinkat(dirfd(d), e->d_name, target, sizeof target - 1);
      if (n > 0) ours.emplace_back(target, static_cast<std::size_t>(n));
    }
    closedir(d);
  }
  const CmdResult r = ns.exec("cat /proc/net/netlink");
  REQUIRE(r.status == 0);
  int found = 0;
  std::istringstream lines(r.out);
  std::string line;
  std::getline(lines, line);  // header: sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
  while (std::getline(lines, line)) {
    std::istringstream f(line);
    std::string sk, groups, skip, inode;
    int eth = -1;
    f >> sk >> eth >> skip >> groups >> skip >> skip >> skip >> skip >> skip >> inode;
    if (eth != protocol || (std::stoul(groups, nullptr, 16) & (1u << (group - 1))) == 0) continue;
    found += std::count(ours.begin(), ours.end(), "socket:[" + inode + "]") > 0;
  }
  return found;
}

int own_nftables_listeners_in(const TestNetns& ns) { return own_listeners_in(ns, NETLINK_NETFILTER, NFNLGRP_NFTABLES); }
int own_link_listeners_in(const TestNetns& ns) { return own_listeners_in(ns, NETLINK_ROUTE, RTNLGRP_LINK); }

struct HubGuarded {
  HubGuarded(boost::asio::io_context& io, daemon::EventHub& hub, TestNetns& ns)
      : sb(GuardedSandbox::options(io), ns.kernel(), daemon::Capabilities{true, true, true, true, true}) {
    const UniqueFd fd(open(("/run/netns/" + ns.name()).c_str(), O_RDONLY | O_CLOEXEC));
    REQUIRE(fd.ok());
    auto feed = hub.feed(fd.get());
    REQUIRE_MESSAGE(feed.ok(), (feed.ok() ? "" : feed.error().message));
    CHECK_FALSE((*feed)->own_socket());
    daemon::TamperGuardOptions go;
    go.verify_interval = std::chrono::milliseconds(0);  // events only: no timer to catch what they miss
    auto opened = daemon::TamperGuard::open(io, sb, go, std::move(*feed));
    REQUIRE(opened.ok());
    guard = std::move(*opened);
    REQUIRE(sb.start("agent").ok());
    guard->start();
  }
  daemon::Sandbox sb;
  std::unique_ptr<daemon::TamperGuard> guard;
};

bool run_until(boost::asio::io_context& io, const std::function<bool()>& done, std::chrono::milliseconds deadline) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  while (!done() && std::chrono::steady_clock::now() < end) io.run_for(std::chrono::milliseconds(5));
  return done();
}

}  // namespace

TEST_CASE("the agent's one event socket hears each sandbox's tampering, and hands it to that sandbox only") {
  TestNetns a, b;
  boost::asio::io_context io;
  auto hub = daemon::EventHub::open(io, daemon::nftables_events());  // in this thread's namespace, as the agent's
  REQUIRE_MESSAGE(hub.ok(), (hub.ok() ? "" : hub.error().message));
  HubGuarded ga(io, **hub, a), gb(io, **hub, b);
  CHECK((*hub)->feeds() == 2);
  // Neither namespace has a socket of ours on the kernel's list of nftables
  // listeners, where a guard with a socket of its own has one.
  CHECK(own_nftables_listeners_in(a) == 0);
  CHECK(own_nftables_listeners_in(b) == 0);
  {
    TestNetns c;
    GuardedSandbox gc(c, std::chrono::milliseconds(0));
    CHECK(own_nftables_listeners_in(c) == 1);
    gc.guard->close();
  }
  const std::string installed_a = a.listing(), installed_b = b.listing();
  // Each sandbox's own install is heard and is not tampering.
  io.run_for(std::chrono::milliseconds(50));
  CHECK(ga.guard->tampers() == 0);
  CHECK(gb.guard->tampers() == 0);

  // A rule added in a: a's guard restores a; b's hears nothing of it.
  REQUIRE(a.exec("nft add rule inet egressd output accept").status == 0);
  REQUIRE(run_until(io, [&] { return ga.guard->restores() >= 1; }, std::chrono::milliseconds(2000)));
  CHECK(ga.guard->tampers() == 1);
  CHECK(a.listing() == installed_a);
  CHECK(gb.guard->tampers() == 0);

  // The table deleted in b: b's guard puts it back.
  REQUIRE(b.exec("nft delete table inet egressd").status == 0);
  REQUIRE(run_until(io, [&] { return gb.guard->restores() >= 1; }, std::chrono::milliseconds(2000)));
  CHECK(b.listing() == installed_b);
  CHECK(ga.guard->tampers() == 1);

  // A closed guard's namespace is no one's: its changes are read and dropped.
  ga.guard->close();
  CHECK((*hub)->feeds() == 1);
  const auto dropped = (*hub)->dropped();
  REQUIRE(a.exec("nft add rule inet egressd output accept").status == 0);
  REQUIRE(run_until(io, [&] { return (*hub)->dropped() > dropped; }, std::chrono::milliseconds(2000)));
  CHECK(ga.guard->restores() == 1);
  CHECK(has_accept_rule(a));
  CHECK(gb.guard->tampers() == 1);
  gb.guard->close();
}

TEST_CASE("the agent's one rtnetlink socket hears each namespace's interface changes, and hands them to it only") {
  TestNetns a, b;
  boost::asio::io_context io;
  auto hub = daemon::EventHub::open(io, daemon::link_events());  // in this thread's namespace, as the agent's
  REQUIRE_MESSAGE(hub.ok(), (hub.ok() ? "" : hub.error().message));
  // What each namespace's feed hands out: the names of links that appeared.
  struct Heard {
    std::vector<std::string> links;
    int turns = 0;
  };
  std::map<std::string, Heard> heard;
  std::vector<std::unique_ptr<daemon::EventFeed>> feeds;
  for (TestNetns* ns : {&a, &b}) {
    const UniqueFd fd(open(("/run/netns/" + ns->name()).c_str(), O_RDONLY | O_CLOEXEC));
    REQUIRE(fd.ok());
    auto feed = (*hub)->feed(fd.get());
    REQUIRE_MESSAGE(feed.ok(), (feed.ok() ? "" : feed.error().message));
    Heard& h = heard[ns->name()];
    nft::Transport::Handlers handlers;
    handlers.message = [&h](const nlmsghdr* nlh) {
      if (auto l = daemon::parse_link(nlh); l && daemon::changes_view(nlh)) h.links.push_back(l->name);
    };
    handlers.turn_done = [&h] { ++h.turns; };
    (*feed)->start(std::move(handlers));
    feeds.push_back(std::move(*feed));
  }
  CHECK((*hub)->feeds() == 2);
  // Neither namespace has a socket of ours listening for link changes, where
  // an interface watch with a socket of its own has one.
  CHECK(own_link_listeners_in(a) == 0);
  CHECK(own_link_listeners_in(b) == 0);
  {
    TestNetns c;
    auto own = c.in_netns([&] { return daemon::open_own_feed(io, daemon::link_events(), 0); });
    REQUIRE(own.ok());
    CHECK(own_link_listeners_in(c) == 1);
  }
  auto saw = [&](const TestNetns& ns, const std::string& link) {
    const auto& l = heard[ns.name()].links;
    return std::find(l.begin(), l.end(), link) != l.end();
  };
  REQUIRE(a.exec("ip link add hubd0 type veth peer name hubd0p").status == 0);
  REQUIRE(run_until(io, [&] { return saw(a, "hubd0"); }, std::chrono::milliseconds(2000)));
  REQUIRE(b.exec("ip link add hubd1 type veth peer name hubd1p").status == 0);
  REQUIRE(run_until(io, [&] { return saw(b, "hubd1"); }, std::chrono::milliseconds(2000)));
  CHECK_FALSE(saw(b, "hubd0"));
  CHECK_FALSE(saw(a, "hubd1"));
  CHECK(heard[a.name()].turns >= 1);

  // A stopped feed's namespace is no one's: its changes are read and dropped.
  feeds[0]->stop();
  CHECK((*hub)->feeds() == 1);
  const auto dropped = (*hub)->dropped();
  const std::size_t a_heard = heard[a.name()].links.size();
  REQUIRE(a.exec("ip link add hubd2 type veth peer name hubd2p").status == 0);
  REQUIRE(run_until(io, [&] { return (*hub)->dropped() > dropped; }, std::chrono::milliseconds(2000)));
  CHECK(heard[a.name()].links.size() == a_heard);
  CHECK_FALSE(saw(b, "hubd2"));
}

TEST_CASE("a tamper guard destroyed with a repair posted runs none of it, and the loop runs on") {
  TestNetns ns;
  auto racing_owned = std::make_unique<RacingKernel>(ns.kernel(), ns.kernel());
  RacingKernel& racing = *racing_owned;
  boost::asio::io_context io;
  daemon::SandboxOptions o = public_sandbox_options(io);
  daemon::Sandbox sb(std::move(o), std::move(racing_owned), daemon::Capabilities{true, true, true, true, true});
  auto guard = ns.in_netns([&] { return daemon::TamperGuard::open(io, sb, {}); });
  REQUIRE(guard.ok());
  sb.set_large_batch_runner([g = guard->get()](const std::function<Status()>& apply) { return g->apply_unheard(apply); });
  REQUIRE(sb.start("environment").ok());
  (*guard)->start();
  settle(io);

  // A commit by others inside an unheard batch: the guard leaves its repair
  // for the next turn of the loop; it is destroyed before that turn.
  racing.race_after_next = Change{kTableName, {}};
  const std::string next_set = "il" + std::to_string(sb.state().generation + 1) + "_d4";
  racing.race_after_next->ops.push_back(
      OpAddElems{next_set, SetType::ipv4_addr, false, {{v4(0xcb007163u), v4(0xcb007163u), 600000}}});
  REQUIRE(sb.handle({{"cmd", "apply"}, {"mode", "allowlist"}, {"allow", many_addresses(1000, 0)}})["ok"] == true);
  sb.set_large_batch_runner({});
  guard->reset();
  settle(io);
  bool ran = false;
  io.restart();  // out of work once the guard is gone
  boost::asio::post(io, [&] { ran = true; });
  settle(io);
  CHECK(ran);
  // No repair ran: the foreign element is still there.
  CHECK(ns.exec("nft list set inet egressd " + next_set).out.find("203.0.113.99") != std::string::npos);
}

TEST_CASE("the verification dumps the table only when the ruleset generation moved") {
  // 200 sandboxes of one agent each dumped and compared their table every
  // 5 s on the one loop: other sandboxes' requests waited behind them. A
  // ruleset changes only by a commit, and every commit moves the namespace's
  // generation: an unchanged one needs no dump. Any commit, egressd's own or
  // one the events do not show, makes the next round compare again.
  TestNetns ns;
  GuardedSandbox g(ns, std::chrono::milliseconds(10));
  auto rounds_from = [&](std::uint64_t n) {
    return [&, n] { return g.guard->verification_rounds() >= n; };
  };
  const auto deadline = std::chrono::seconds(3);
  REQUIRE(g.run_until(rounds_from(6), deadline));
  CHECK(g.guard->full_verifications() == 1);  // the first; then the same generation five times

  // egressd's own switches, and its learned addresses, made from the
  // verified generation: followed by their NEWGENs, no dump.
  REQUIRE(g.sb.handle({{"cmd", "apply"}, {"phase", "environment"}})["ok"] == true);
  REQUIRE(g.sb.handle({{"cmd", "apply"}, {"mode", "allowlist"}, {"allow", nlohmann::json::array({"198.51.100.7"})}})["ok"] == true);
  std::uint64_t r = g.guard->verification_rounds();
  REQUIRE(g.run_until(rounds_from(r + 4), deadline));
  CHECK(g.guard->full_verifications() == 1);
  CHECK(g.guard->own_commits_followed() == 2);
  CHECK(g.guard->tampers() == 0);

  // Anyone else's commit, even one that leaves egressd's table alone (no
  // tamper event): the next round compares, once.
  CHECK(ns.exec("nft add table inet someone_else").status == 0);
  r = g.guard->verification_rounds();
  REQUIRE(g.run_until(rounds_from(r + 4), deadline));
  CHECK(g.guard->full_verifications() == 2);
  // And egressd's own commit right after it does not skip that comparison:
  // its generation does not follow the verified one.
  CHECK(ns.exec("nft add table inet someone_else2").status == 0);
  REQUIRE(g.sb.handle({{"cmd", "apply"}, {"phase", "environment"}})["ok"] == true);
  r = g.guard->verification_rounds();
  REQUIRE(g.run_until(rounds_from(r + 4), deadline));
  CHECK(g.guard->full_verifications() == 3);
  CHECK(g.guard->own_commits_followed() == 2);
  CHECK(g.guard->tampers() == 0);

  // A change the events do not show: the generation moved, so it is found and undone.
  auto blind = ns.kernel();
  g.guard->add_own_portid(blind->portid());
  add_accept_rule(*blind);
  REQUIRE(g.run_until([&] { return g.guard->tampers() > 0; }, deadline));
  CHECK_FALSE(has_accept_rule(ns));
  r = g.guard->verification_rounds();
  const std::uint64_t full = g.guard->full_verifications();
  REQUIRE(g.run_until(rounds_from(r + 4), deadline));
  CHECK(g.guard->full_verifications() == full + 1);  // the restore committed; once more, then quiet
}

TEST_CASE("a tamper guard destroyed after its verification timer fired, before the loop ran it, verifies nothing") {
  TestNetns ns;
  boost::asio::io_context io;
  daemon::SandboxOptions o;
  Policy p;
  p.phases.push_back(phase("agent", Mode::allowlist, {"198.51.100.11"}));
  p.initial_phase = "agent";
  o.policy = p;
  o.post = [&io](std::function<void()> fn) { boost::asio::post(io, std::move(fn)); };
  daemon::Sandbox sb(std::move(o), ns.kernel(), daemon::Capabilities{true, true, true, true, true});
  daemon::TamperGuardOptions go;
  go.verify_interval = std::chrono::milliseconds(30);
  auto guard = ns.in_netns([&] { return daemon::TamperGuard::open(io, sb, go); });
  REQUIRE(guard.ok());
  REQUIRE(sb.start("agent").ok());
  const auto armed = std::chrono::steady_clock::now();
  (*guard)->start();
  settle(io);  // the verification loop waits on its timer
  // A change the events do not show (from a socket the guard counts as its
  // own): only the verification would undo it.
  auto blind = ns.kernel();
  (*guard)->add_own_portid(blind->portid());
  add_accept_rule(*blind);
  REQUIRE(has_accept_rule(ns));

  // The timer is due; the loop has not looked. Destroyed from the handler
  // that runs before its (already queued, no longer cancellable) completion.
  std::this_thread::sleep_until(armed + go.verify_interval + std::chrono::milliseconds(20));
  boost::asio::post(io, [&] { guard->reset(); });
  const auto end = std::chrono::steady_clock::now() + 3 * go.verify_interval;
  while (std::chrono::steady_clock::now() < end) io.run_for(std::chrono::milliseconds(5));
  CHECK(!*guard);
  CHECK(has_accept_rule(ns));  // nothing verified or restored after the guard was gone
}

TEST_CASE("a tamper guard destroyed with a restore retry pending retries nothing") {
  TestNetns ns;
  auto refusing_owned = std::make_unique<RefusingKernel>(ns.kernel());
  RefusingKernel& kernel = *refusing_owned;
  boost::asio::io_context io;
  daemon::SandboxOptions o;
  Policy p;
  p.phases.push_back(phase("agent", Mode::allowlist, {"198.51.100.11"}));
  p.initial_phase = "agent";
  o.policy = p;
  o.post = [&io](std::function<void()> fn) { boost::asio::post(io, std::move(fn)); };
  daemon::Sandbox sb(std::move(o), std::move(refusing_owned), daemon::Capabilities{true, true, true, true, true});
  daemon::TamperGuardOptions go;
  go.verify_interval = std::chrono::milliseconds(0);
  auto guard = ns.in_netns([&] { return daemon::TamperGuard::open(io, sb, go); });
  REQUIRE(guard.ok());
  REQUIRE(sb.start("agent").ok());
  (*guard)->start();
  settle(io);

  // Tampering the guard hears; its restore is refused, so it schedules a
  // retry (refused too while `refuse` stays set: each schedules the next).
  kernel.refuse = true;
  auto other = ns.kernel();
  add_accept_rule(*other);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (kernel.refused == 0 && std::chrono::steady_clock::now() < end) io.run_for(std::chrono::milliseconds(5));
  REQUIRE(kernel.refused >= 1);
  CHECK((*guard)->tampers() == 1);
  settle(io);

  // The first retry waits 10 ms: likely due by now, its completion queued
  // behind the handler that destroys the guard (or else still waiting, and
  // cancelled). A retry after that would be let through.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  boost::asio::post(io, [&] {
    kernel.refuse = false;
    guard->reset();
  });
  const auto stop = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  while (std::chrono::steady_clock::now() < stop) io.run_for(std::chrono::milliseconds(5));
  CHECK(!*guard);
  CHECK(kernel.applied == 1);  // start's batch only: no retried restore
  CHECK(has_accept_rule(ns));
}

// ---- nft::Transport (src/nft/transport.h) over real netlink ----

TEST_CASE("transport: a multi-part dump, an ack, and the kernel's error for a request") {
  const Policy p = make_policy({"192.0.2.1"});
  const Table t = build_table(p, nullptr, named_state(p, "agent", 1), {});
  TestNetns ns;
  auto k = ns.kernel();
  REQUIRE(apply_table(*k, t).ok());
  boost::asio::io_context io;
  auto tr = ns.in_netns([&] { return Transport::open(io, {}); });
  REQUIRE_MESSAGE(tr.ok(), (tr.ok() ? "" : tr.error().message));
  CHECK((*tr)->portid() != 0);

  std::vector<char> buf(4096);
  auto request = [&](std::uint16_t type, std::uint16_t flags, const char* table) {
    nlmsghdr* nlh = mnl_nlmsg_put_header(buf.data());
    nlh->nlmsg_type = static_cast<std::uint16_t>((NFNL_SUBSYS_NFTABLES << 8) | type);
    nlh->nlmsg_flags = static_cast<std::uint16_t>(NLM_F_REQUEST | flags);
    auto* g = static_cast<nfgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(nfgenmsg)));
    g->nfgen_family = NFPROTO_INET;
    g->version = NFNETLINK_V0;
    if (table != nullptr) mnl_attr_put_strz(nlh, NFTA_TABLE_NAME, table);
    return nlh;
  };

  // Every rule of the table: more replies than fit one datagram, all handed over.
  std::size_t nrules = 0;
  for (const auto& c : t.chains) nrules += c.rules.size();
  std::size_t got = 0;
  int err = (*tr)->request(request(NFT_MSG_GETRULE, NLM_F_DUMP, "egressd"), [&](const nlmsghdr* nlh) {
    if (NFNL_MSG_TYPE(nlh->nlmsg_type) == NFT_MSG_NEWRULE) ++got;
  });
  CHECK(err == 0);
  CHECK(got == nrules);

  // A get with an ack: the table's one reply, then the ack.
  std::size_t tables = 0;
  err = (*tr)->request(request(NFT_MSG_GETTABLE, NLM_F_ACK, "egressd"), [&](const nlmsghdr*) { ++tables; });
  CHECK(err == 0);
  CHECK(tables == 1);
  // The kernel's error, as a positive errno.
  err = (*tr)->request(request(NFT_MSG_GETTABLE, NLM_F_ACK, "no-such-table"), [&](const nlmsghdr*) {});
  CHECK(err == ENOENT);
}

TEST_CASE("transport: the receive loop hands over each notification, reports ENOBUFS, and stops on destruction") {
  TestNetns ns;
  boost::asio::io_context io;
  TransportOptions o;
  o.groups = {NFNLGRP_NFTABLES};
  o.rcvbuf = 4096;  // the kernel's minimum is about this: easy to overrun
  auto tr = ns.in_netns([&] { return Transport::open(io, o); });
  REQUIRE_MESSAGE(tr.ok(), (tr.ok() ? "" : tr.error().message));
  std::vector<std::string> tables;
  std::size_t overruns = 0, turns = 0;
  Transport::Handlers h;
  h.message = [&](const nlmsghdr* nlh) {
    if (auto ev = parse_event(nlh); ev && !ev->is_gen && ev->kind == ObjKind::table && ev->added) tables.push_back(ev->table);
  };
  h.overrun = [&] { ++overruns; };
  h.turn_done = [&] { ++turns; };
  (*tr)->start(std::move(h));
  auto run_until = [&](const std::function<bool()>& done) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!done() && std::chrono::steady_clock::now() < end) io.run_for(std::chrono::milliseconds(5));
    return done();
  };

  REQUIRE(ns.exec("nft add table inet probe1").status == 0);
  CHECK(run_until([&] { return !tables.empty(); }));
  CHECK(tables == std::vector<std::string>{"probe1"});
  CHECK(turns >= 1);

  // Far more notifications than a 4 KiB buffer holds, none read meanwhile.
  std::string many;
  for (int i = 0; i < 300; ++i) many += "add table inet t" + std::to_string(i) + "\n";
  REQUIRE(ns.exec("sh -c 'printf \"" + std::regex_replace(many, std::regex("\n"), "\\n") + "\" | nft -i'").status == 0);
  CHECK(run_until([&] { return overruns > 0; }));

  // Destroyed with a wait pending and notifications queued: no handler runs.
  const std::size_t seen = tables.size();
  REQUIRE(ns.exec("nft add table inet probe2").status == 0);
  tr->reset();
  io.restart();
  io.run_for(std::chrono::milliseconds(50));
  CHECK(tables.size() == seen);
}

TEST_CASE("transport: read_queued stops at its datagram limit and says more are queued") {
  // The tamper guard hears what is queued before a verification round, at most one loop
  // turn's worth: a socket another process keeps filling may never run empty.
  TestNetns ns;
  TransportOptions o;
  o.groups = {NFNLGRP_NFTABLES};
  o.rcvbuf = 1 << 20;
  auto tr = ns.in_netns([&] { return Transport::open(o); });
  REQUIRE_MESSAGE(tr.ok(), (tr.ok() ? "" : tr.error().message));
  // Ten separate commits: ten NEWGENs, each in a datagram of its own or with its table.
  for (int i = 0; i < 10; ++i) REQUIRE(ns.exec("nft add table inet q" + std::to_string(i)).status == 0);
  std::size_t gens = 0;
  auto count = [&](const nlmsghdr* nlh) {
    if (auto ev = parse_event(nlh); ev && ev->is_gen) ++gens;
  };
  const auto first = (*tr)->read_queued(count, 3);
  CHECK(first.more);
  CHECK(gens >= 1);
  CHECK(gens <= 3);
  const auto rest = (*tr)->read_queued(count);
  CHECK_FALSE(rest.more);
  CHECK(rest.error == 0);
  CHECK(gens == 10);
}

TEST_CASE("transport: a datagram from another netlink socket is never read as the kernel's") {
  // Any socket that may address this one (CAP_NET_ADMIN in the namespace, as root here) can
  // send it datagrams that look like the kernel's: an ack, an event. Only the kernel's count.
  TestNetns ns;
  TransportOptions o;
  o.groups = {NFNLGRP_NFTABLES};
  auto tr = ns.in_netns([&] { return Transport::open(o); });
  REQUIRE_MESSAGE(tr.ok(), (tr.ok() ? "" : tr.error().message));
  UniqueFd forger(ns.in_netns([] { return ::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER); }));
  REQUIRE(forger.ok());
  const sockaddr_nl to{AF_NETLINK, 0, (*tr)->portid(), 0};
  // A "NEWGEN" and an "ack", as the kernel would word them.
  alignas(nlmsghdr) char buf[256]{};
  auto* gen = mnl_nlmsg_put_header(buf);
  gen->nlmsg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN;
  mnl_nlmsg_put_extra_header(gen, sizeof(nfgenmsg));
  mnl_attr_put_u32(gen, NFTA_GEN_ID, htonl(4242));
  REQUIRE(::sendto(forger.get(), gen, gen->nlmsg_len, 0, reinterpret_cast<const sockaddr*>(&to), sizeof to) ==
          static_cast<ssize_t>(gen->nlmsg_len));
  auto* ack = mnl_nlmsg_put_header(buf);
  ack->nlmsg_type = NLMSG_ERROR;
  ack->nlmsg_seq = 1;
  mnl_nlmsg_put_extra_header(ack, sizeof(nlmsgerr));
  REQUIRE(::sendto(forger.get(), ack, ack->nlmsg_len, 0, reinterpret_cast<const sockaddr*>(&to), sizeof to) ==
          static_cast<ssize_t>(ack->nlmsg_len));
  // Then one real commit: its NEWGEN is read, the forged datagrams are not.
  REQUIRE(ns.exec("nft add table inet forged").status == 0);
  std::size_t messages = 0, gens = 0;
  const auto q = (*tr)->read_queued([&](const nlmsghdr* nlh) {
    ++messages;
    if (auto ev = parse_event(nlh); ev && ev->is_gen) {
      ++gens;
      CHECK(ev->gen_id != 4242);
    }
    CHECK(nlh->nlmsg_type != NLMSG_ERROR);
  });
  CHECK(q.error == 0);
  CHECK(gens == 1);
  CHECK(messages >= 2);  // the table and the generation
}

// ---- the conntrack forgetter and the NFLOG reader, destroyed with work pending ----

TEST_CASE("conntrack forgetter: the flows are gone from conntrack when forget returns") {
  TestNetns ns;
  REQUIRE(ns.exec("ip link set lo up").status == 0);
  // Conntrack tracks this namespace once a rule uses it.
  ns.nft_load("table inet t {\n chain o {\n  type filter hook output priority 0;\n  ct state new counter\n }\n}\n");
  boost::asio::io_context io;
  auto f = ns.in_netns([&] { return daemon::ConntrackForgetter::open(io); });
  REQUIRE_MESSAGE(f.ok(), (f.ok() ? "" : f.error().message));

  // Two UDP flows 127.0.0.1:<port> -> 127.0.0.1:53, and this namespace's
  // conntrack table as text.
  auto entries = [&] {
    return ns.in_netns([] {
      std::ifstream in("/proc/thread-self/net/nf_conntrack");
      return std::string(std::istreambuf_iterator<char>(in), {});
    });
  };
  std::vector<dns::FlowTuple> flows;
  std::vector<int> socks;
  for (int i = 0; i < 2; ++i) {
    ns.in_netns([&] {
      const int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      REQUIRE(s >= 0);
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_port = htons(53);
      to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      REQUIRE(::connect(s, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0);
      REQUIRE(::send(s, "x", 1, 0) == 1);
      sockaddr_in me{};
      socklen_t len = sizeof me;
      REQUIRE(::getsockname(s, reinterpret_cast<sockaddr*>(&me), &len) == 0);
      dns::FlowTuple t;
      t.src = *parse_ip("127.0.0.1");
      t.dst = *parse_ip("127.0.0.1");
      t.sport = ntohs(me.sin_port);
      t.dport = 53;
      flows.push_back(t);
      socks.push_back(s);
      return 0;
    });
  }
  auto has = [&](const std::string& table, const dns::FlowTuple& t) {
    return table.find("sport=" + std::to_string(t.sport) + " dport=53") != std::string::npos;
  };
  const std::string before = entries();
  REQUIRE_MESSAGE(has(before, flows[0]), before);
  REQUIRE_MESSAGE(has(before, flows[1]), before);

  (*f)->forget(flows);  // one write, handled before it returns: no turn of the loop
  const std::string after = entries();
  CHECK_MESSAGE(!has(after, flows[0]), after);
  CHECK_MESSAGE(!has(after, flows[1]), after);
  CHECK((*f)->sent() == 2);
  for (const int s : socks) ::close(s);
}

TEST_CASE("nflog reader: hands over a logged packet; destroyed with a packet queued and its wait done, no callback") {
  TestNetns ns;
  REQUIRE(ns.exec("ip link set lo up").status == 0);
  REQUIRE(ns.exec("ip addr add 192.0.2.1/32 dev lo").status == 0);  // so the probes stay in the namespace
  ns.nft_load("table inet t {\n chain o {\n  type filter hook output priority 0;\n  udp dport 9 log group 7\n }\n}\n");
  boost::asio::io_context io;
  std::vector<audit::LoggedPacket> got;
  auto r = ns.in_netns([&] { return audit::NflogReader::open(io, 7, [&](const audit::LoggedPacket& p) { got.push_back(p); }); });
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.error().message));
  auto probe = [&] {
    ns.in_netns([] {
      const int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      REQUIRE(s >= 0);
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_port = htons(9);
      to.sin_addr.s_addr = htonl(0xc0000201u);  // 192.0.2.1
      const ssize_t n = ::sendto(s, "x", 1, 0, reinterpret_cast<const sockaddr*>(&to), sizeof to);
      ::close(s);
      REQUIRE(n == 1);
      return 0;
    });
  };

  probe();
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (got.empty() && std::chrono::steady_clock::now() < end) io.run_for(std::chrono::milliseconds(5));
  REQUIRE(got.size() == 1);
  CHECK(got[0].proto == 17);
  CHECK(got[0].dst.to_string() == "192.0.2.1");
  CHECK(got[0].port == 9);
  CHECK((*r)->stats().packets == 1);

  // The log message is queued on the socket before sendto returns (one
  // packet per message); the reader's wait completes on the next poll of the
  // kernel, behind the handler that destroys the reader.
  settle(io);
  probe();
  boost::asio::post(io, [&] { r->reset(); });
  settle(io);
  CHECK(!*r);
  CHECK(got.size() == 1);
}
