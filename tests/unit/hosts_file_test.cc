// Hosts file parser (src/pin/hosts_file.h): what glibc reads, and garbage
// reported by line and skipped.
#include <doctest/doctest.h>

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
