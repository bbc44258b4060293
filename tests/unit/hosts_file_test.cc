// Hosts file parser (src/pin/hosts_file.h): what glibc reads, and garbage
// reported by line and skipped.
#include <doctest/doctest.h>

#include <chrono>

#include "pin/hosts_file.h"

using namespace egressd;
using namespace egressd::pin;

namespace {

std::vector<std::string> addrs(const HostsFile& h, const std::string& name) {
  std::vector<std::string> out;
  auto it = h.names.find(name);
  if (it != h.names.end()) {
    for (const auto& a : it->second) out.push_back(a.to_string());
  }
  return out;
}

}  // namespace

TEST_CASE("Docker's hosts file with an extra_hosts line") {
  const HostsFile h = parse_hosts(
      "127.0.0.1\tlocalhost\n"
      "::1\tlocalhost ip6-localhost ip6-loopback\n"
      "fe00::0\tip6-localnet\n"
      "ff02::1\tip6-allnodes\n"
      "# extra_hosts\n"
      "192.0.2.254\thost.docker.internal\n"
      "172.18.0.3\t4a3c0d2e1f00\n",
      "/etc/hosts");
  CHECK(h.problems.empty());
  CHECK(addrs(h, "host.docker.internal") == std::vector<std::string>{"192.0.2.254"});
  CHECK(addrs(h, "localhost") == std::vector<std::string>{"127.0.0.1", "::1"});
  CHECK(addrs(h, "ip6-loopback") == std::vector<std::string>{"::1"});
  CHECK(addrs(h, "4a3c0d2e1f00") == std::vector<std::string>{"172.18.0.3"});
  CHECK(h.names.size() == 7);
}

TEST_CASE("comments, several names, case, trailing dots, CRLF, duplicates") {
  const HostsFile h = parse_hosts(
      "  # a comment line\r\n"
      "\r\n"
      "203.0.113.10  Allowed.Test  alias.test.   # trailing comment\r\n"
      "2001:DB8::10 allowed.test\n"
      "203.0.113.10 allowed.test\n"
      "198.51.100.7\talias.test#no space before the comment",
      "hosts");
  CHECK(h.problems.empty());
  CHECK(addrs(h, "allowed.test") == std::vector<std::string>{"203.0.113.10", "2001:db8::10"});
  CHECK(addrs(h, "alias.test") == std::vector<std::string>{"203.0.113.10", "198.51.100.7"});
}

TEST_CASE("garbage lines are reported with their line number and skipped") {
  const HostsFile h = parse_hosts(
      "203.0.113.10 good.test\n"
      "not-an-address bad.test\n"
      "fe80::1%eth0 zoned.test\n"
      "192.0.2.1\n"
      "192.0.2.2 ok.test bad..name also-ok.test\n"
      "192.0.2.3/24 cidr.test\n"
      "\x01\x02 \xff\n",
      "/proc/42/root/etc/hosts");
  CHECK(addrs(h, "good.test") == std::vector<std::string>{"203.0.113.10"});
  CHECK(addrs(h, "ok.test") == std::vector<std::string>{"192.0.2.2"});
  CHECK(addrs(h, "also-ok.test") == std::vector<std::string>{"192.0.2.2"});
  CHECK(h.names.size() == 3);
  REQUIRE(h.problems.size() == 6);
  CHECK(h.problems[0] == "/proc/42/root/etc/hosts:2: not an IP address: \"not-an-address\"; line skipped");
  CHECK(h.problems[1] == "/proc/42/root/etc/hosts:3: not an IP address: \"fe80::1%eth0\"; line skipped");
  CHECK(h.problems[2] == "/proc/42/root/etc/hosts:4: address 192.0.2.1 without a name; line skipped");
  CHECK(h.problems[3] == "/proc/42/root/etc/hosts:5: not a host name: \"bad..name\"; name skipped");
  CHECK(h.problems[4] == "/proc/42/root/etc/hosts:6: not an IP address: \"192.0.2.3/24\"; line skipped");
  CHECK(h.problems[5] == "/proc/42/root/etc/hosts:7: not an IP address: \"??\"; line skipped");
}

TEST_CASE("an empty file has no names and no problems") {
  const HostsFile h = parse_hosts("", "hosts");
  CHECK(h.names.empty());
  CHECK(h.problems.empty());
}

namespace {

// The reviewer's shape: one name, one distinct address a line, up to `bytes`.
std::string one_name_many_addresses(std::size_t bytes, std::size_t* lines) {
  std::string text;
  std::size_t i = 0;
  while (text.size() < bytes - 64) {
    text += std::to_string(1 + (i >> 24)) + "." + std::to_string((i >> 16) & 255) + "." +
            std::to_string((i >> 8) & 255) + "." + std::to_string(i & 255) + " a\n";
    ++i;
  }
  *lines = i;
  return text;
}

}  // namespace

TEST_CASE("one name with 80,000 addresses parses in linear time (it took 9 s, on the agent's only loop)") {
  std::size_t lines = 0;
  const std::string text = one_name_many_addresses(std::size_t{1} << 20, &lines);
  REQUIRE(lines > 70000);
  HostsLimits unbounded;
  unbounded.max_pairs = lines;
  const auto t0 = std::chrono::steady_clock::now();
  const HostsFile h = parse_hosts(text, "hosts", unbounded);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(h.problems.empty());
  CHECK(addrs(h, "a").size() == lines);
  // Linear: tens of milliseconds (unoptimized, under a loaded test run); quadratic was seconds.
  CHECK(took < std::chrono::milliseconds(1500));
}

TEST_CASE("duplicates are kept once, in file order, across lines and names") {
  const HostsFile h = parse_hosts(
      "192.0.2.1 a.test b.test a.test\n"
      "192.0.2.2 a.test\n"
      "192.0.2.1 a.test B.test\n"
      "192.0.2.2 b.test\n",
      "hosts");
  CHECK(h.problems.empty());
  CHECK(addrs(h, "a.test") == std::vector<std::string>{"192.0.2.1", "192.0.2.2"});
  CHECK(addrs(h, "b.test") == std::vector<std::string>{"192.0.2.1", "192.0.2.2"});
}

TEST_CASE("more pairs than the limit: nothing, and one problem naming the file and the limit") {
  std::size_t lines = 0;
  const std::string text = one_name_many_addresses(std::size_t{1} << 20, &lines);
  const auto t0 = std::chrono::steady_clock::now();
  const HostsFile h = parse_hosts(text, "/proc/42/root/etc/hosts");
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1500));
  CHECK(h.names.empty());
  REQUIRE(h.problems.size() == 1);
  CHECK(h.problems[0] == "/proc/42/root/etc/hosts: more than 4096 (name, address) pairs; not read");

  // At the limit: taken. Duplicates do not count.
  HostsLimits three;
  three.max_pairs = 3;
  const HostsFile at = parse_hosts("192.0.2.1 a.test b.test\n192.0.2.1 a.test\n192.0.2.2 a.test\n", "h", three);
  CHECK(at.problems.empty());
  CHECK(at.names.size() == 2);
  const HostsFile over = parse_hosts("192.0.2.1 a.test b.test\n192.0.2.2 a.test b.test\n", "h", three);
  CHECK(over.names.empty());
  REQUIRE(over.problems.size() == 1);
  CHECK(over.problems[0] == "h: more than 3 (name, address) pairs; not read");
}

TEST_CASE("a text over max_bytes is not parsed; problems stop at max_problems") {
  HostsLimits small;
  small.max_bytes = 16;
  const HostsFile big = parse_hosts("192.0.2.1 a.test\n", "h", small);  // 17 bytes
  CHECK(big.names.empty());
  REQUIRE(big.problems.size() == 1);
  CHECK(big.problems[0] == "h: larger than 16 bytes; not read");
  CHECK(parse_hosts("192.0.2.1 a.test", "h", small).problems.empty());

  std::string garbage;
  for (int i = 0; i < 100000; ++i) garbage += "x y\n";
  const HostsFile g = parse_hosts(garbage, "h");
  REQUIRE(g.problems.size() == 65);
  CHECK(g.problems[0] == "h:1: not an IP address: \"x\"; line skipped");
  CHECK(g.problems[64] == "h: more than 64 problems; the rest is not read");
}
