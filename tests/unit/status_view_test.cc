// The status reply and the traffic counters as pure functions
// (daemon/status_view.h): the arithmetic over the two counted chains, the
// entry states and the reply's exact shape, without a Sandbox or a kernel.
#include <doctest/doctest.h>

#include "daemon/status_view.h"
#include "nft/compile.h"

using namespace egressd;
using namespace egressd::daemon;
using nlohmann::json;

namespace {

// A rule of `chain` with this comment and counters (bytes: 100 a packet
// unless given).
nft::RuleInfo rule(const std::string& chain, const std::string& comment, std::uint64_t packets,
                   std::optional<std::uint64_t> bytes = std::nullopt) {
  nft::RuleInfo r;
  r.chain = chain;
  r.comment = comment;
  r.packets = packets;
  r.bytes = bytes.value_or(100 * packets);
  return r;
}

json counts(const Traffic::Counts& c) {
  return {{"allowed_packets", c.allowed_packets}, {"allowed_bytes", c.allowed_bytes},
          {"denied_packets", c.denied_packets}, {"denied_bytes", c.denied_bytes}};
}

json totals(const Traffic& t) {
  return {{"allowed_packets", t.allowed_packets}, {"allowed_bytes", t.allowed_bytes},
          {"denied_packets", t.denied_packets}, {"denied_bytes", t.denied_bytes}};
}

IpPrefix ip(const char* s) { return *parse_ip(s); }

}  // namespace

TEST_CASE("traffic: what deny did not take was allowed; IPv4 from the count-only rules and the fast path's, IPv6 the rest") {
  const std::vector<nft::RuleInfo> output{
      rule("output", nft::kCountV4Fast, 9),  // the fast path: 9 IPv4
      rule("output", "", 5),                 // and 5 IPv6
      rule("output", nft::kLoUpstreamDeny4, 2),
      rule("output", nft::kLoUpstreamDeny6, 1),
      rule("output", nft::kCountV4AtSaddrCheck, 50),
      rule("output", "", 4),  // forged sources, both families: 3 IPv4 (50 - 47), 1 IPv6
      rule("output", nft::kCountV4PastSaddrCheck, 47),
      rule("output", nft::kCountV4Decided, 20),
      rule("output", "", 30),  // counter jump active: 20 IPv4, 10 IPv6
  };
  const std::vector<nft::RuleInfo> deny{
      rule("deny", "", 1),
      rule("deny", nft::kCountV4Denied, 12),
      rule("deny", "", 15),
  };
  const Traffic t = traffic_from(&output, &deny);
  // Decided 9 + 5 + 2 + 1 + 4 + 30 = 51, denied 1 + 15 = 16.
  CHECK(totals(t) == json{{"allowed_packets", 35}, {"allowed_bytes", 3500},
                          {"denied_packets", 16}, {"denied_bytes", 1600}});
  // IPv4: decided 9 + 2 + (50 - 47) + 20 = 34, denied 12.
  CHECK(counts(t.family[0]) == json{{"allowed_packets", 22}, {"allowed_bytes", 2200},
                                    {"denied_packets", 12}, {"denied_bytes", 1200}});
  // IPv6: decided 51 - 34 = 17, denied 16 - 12 = 4.
  CHECK(counts(t.family[1]) == json{{"allowed_packets", 13}, {"allowed_bytes", 1300},
                                    {"denied_packets", 4}, {"denied_bytes", 400}});
}

TEST_CASE("traffic: a count ahead of the one it is taken from gives 0, never a wrapped number") {
  // deny was dumped after output and counted packets output had not yet:
  // 10 decided, 12 denied.
  const std::vector<nft::RuleInfo> output{
      rule("output", nft::kCountV4AtSaddrCheck, 3),
      rule("output", nft::kCountV4PastSaddrCheck, 5),  // past > at: no forged IPv4
      rule("output", nft::kCountV4Decided, 4),
      rule("output", "", 10),
  };
  const std::vector<nft::RuleInfo> deny{
      rule("deny", nft::kCountV4Denied, 6),
      rule("deny", "", 12, 1),  // fewer bytes than the IPv4 share: bytes clamp on their own
  };
  const Traffic t = traffic_from(&output, &deny);
  CHECK(t.allowed_packets == 0);
  CHECK(t.allowed_bytes == 999);  // 1000 decided - 1 denied
  CHECK(t.denied_packets == 12);
  CHECK(t.denied_bytes == 1);
  // IPv4: decided 0 + 0 + 4 = 4 (400 bytes), denied 6 (600 bytes).
  CHECK(counts(t.family[0]) == json{{"allowed_packets", 0}, {"allowed_bytes", 0},
                                    {"denied_packets", 6}, {"denied_bytes", 600}});
  // IPv6: denied 12 - 6 = 6 packets, bytes 1 - 600 -> 0; decided 10 - 4 = 6
  // packets (600 bytes), allowed 6 - 6 = 0 and 600 - 0 bytes.
  CHECK(counts(t.family[1]) == json{{"allowed_packets", 0}, {"allowed_bytes", 600},
                                    {"denied_packets", 6}, {"denied_bytes", 0}});
}

TEST_CASE("traffic: a chain that could not be read counts nothing") {
  const std::vector<nft::RuleInfo> output{rule("output", nft::kCountV4Decided, 3), rule("output", "", 9)};
  const std::vector<nft::RuleInfo> deny{rule("deny", nft::kCountV4Denied, 1), rule("deny", "", 2)};

  const Traffic no_deny = traffic_from(&output, nullptr);
  CHECK(totals(no_deny) == json{{"allowed_packets", 9}, {"allowed_bytes", 900},
                                {"denied_packets", 0}, {"denied_bytes", 0}});
  CHECK(no_deny.family[0].allowed_packets == 3);
  CHECK(no_deny.family[1].allowed_packets == 6);

  const Traffic no_output = traffic_from(nullptr, &deny);
  CHECK(totals(no_output) == json{{"allowed_packets", 0}, {"allowed_bytes", 0},
                                  {"denied_packets", 2}, {"denied_bytes", 200}});
  CHECK(counts(no_output.family[0]) == json{{"allowed_packets", 0}, {"allowed_bytes", 0},
                                            {"denied_packets", 1}, {"denied_bytes", 100}});
  CHECK(counts(no_output.family[1]) == json{{"allowed_packets", 0}, {"allowed_bytes", 0},
                                            {"denied_packets", 1}, {"denied_bytes", 100}});

  const Traffic neither = traffic_from(nullptr, nullptr);
  CHECK(totals(neither) == json{{"allowed_packets", 0}, {"allowed_bytes", 0},
                                {"denied_packets", 0}, {"denied_bytes", 0}});
  CHECK(counts(neither.family[1]) == counts(Traffic::Counts{}));
}

TEST_CASE("entry states: names wait for the DNS proxy; a hostname is resolved while an address is learned") {
  CHECK(entry_state(EntryKind::hostname, false, true) == EntryState::pending);
  CHECK(entry_state(EntryKind::wildcard, false, false) == EntryState::pending);
  CHECK(entry_state(EntryKind::hostname, true, true) == EntryState::resolved);
  CHECK(entry_state(EntryKind::hostname, true, false) == EntryState::unresolved);
  CHECK(entry_state(EntryKind::wildcard, true, false) == EntryState::active);
  CHECK(entry_state(EntryKind::ipv4, false, false) == EntryState::active);
  CHECK(entry_state(EntryKind::ipv6_cidr, true, true) == EntryState::active);
  CHECK(to_string(EntryState::unresolved) == "unresolved");
}

TEST_CASE("status JSON: every field, learned addresses by time left, DNS and pin counters") {
  using namespace std::chrono_literals;
  const LearnedStore::TimePoint now{1000s};
  const std::map<std::string, std::vector<LearnedStore::Addr>> learned{
      {"files.pypi.org", {{ip("198.51.100.7"), now - 1s, false, now - 1s}}},  // expired: name left out
      {"pypi.org",
       {{ip("198.51.100.1"), now + 59'900ms, false, now + 59'900ms},  // 59.9 s: 59
        {ip("2001:db8::1"), now, false, now},                          // expires now: left out
        {ip("203.0.113.5"), LearnedStore::TimePoint::max(), true, {}}}},
  };
  StatusInput in;
  in.phase = "agent";
  in.mode = Mode::allowlist;
  in.generation = 7;
  in.entries = {{"pypi.org", EntryKind::hostname, EntryState::resolved},
                {"*.example.org", EntryKind::wildcard, EntryState::active},
                {"192.0.2.0/24", EntryKind::ipv4_cidr, EntryState::active}};
  in.entry_counts = {1, 1, 0, 0, 1, 0};
  in.learned = &learned;
  in.now = now;
  in.traffic.allowed_packets = 5, in.traffic.allowed_bytes = 500;
  in.traffic.denied_packets = 2, in.traffic.denied_bytes = 120;
  in.traffic.family[0] = {4, 400, 2, 120};
  in.traffic.family[1] = {1, 100, 0, 0};
  in.phases = {"environment", "agent", "verifier"};
  in.netns = "/run/netns/sb";
  in.socket = "/run/egressd.sock";
  dns::ProxyCounters c;
  c.forwarded = 10, c.refused = 3, c.failed = 1, c.malformed = 2, c.relayed = 4, c.inflight = 6;
  c.answer_count = 99;  // not part of status (metrics has it)
  in.dns = c;
  in.audit = {{"denied_records", 2}, {"log_group", nullptr}};
  in.pin = std::array<std::uint64_t, 3>{8, 6, 2};

  const json expected = json::parse(R"({
    "audit": {"denied_records": 2, "log_group": null},
    "counters": {"allowed_bytes": 500, "allowed_packets": 5, "denied_bytes": 120, "denied_packets": 2},
    "counters_by_family": {
      "ipv4": {"allowed_bytes": 400, "allowed_packets": 4, "denied_bytes": 120, "denied_packets": 2},
      "ipv6": {"allowed_bytes": 100, "allowed_packets": 1, "denied_bytes": 0, "denied_packets": 0}},
    "dns": {"failed": 1, "forwarded": 10, "inflight": 6, "malformed": 2, "refused": 3, "relayed": 4},
    "entries": [
      {"entry": "pypi.org", "kind": "hostname", "state": "resolved"},
      {"entry": "*.example.org", "kind": "wildcard", "state": "active"},
      {"entry": "192.0.2.0/24", "kind": "ipv4-cidr", "state": "active"}],
    "entry_counts": {"hostname": 1, "ipv4": 0, "ipv4-cidr": 1, "ipv6": 0, "ipv6-cidr": 0, "wildcard": 1},
    "generation": 7,
    "learned": [
      {"addresses": [
         {"address": "198.51.100.1", "expires_in_s": 59, "source": "dns"},
         {"address": "203.0.113.5", "expires_in_s": null, "source": "hosts"}],
       "name": "pypi.org"}],
    "mode": "allowlist",
    "netns": "/run/netns/sb",
    "phase": "agent",
    "phases": ["environment", "agent", "verifier"],
    "pin": {"admitted": 6, "inspected": 8, "reset": 2},
    "socket": "/run/egressd.sock"
  })");
  // The text itself: keys, their order and the nulls are what clients read.
  CHECK(status_json(in).dump() == expected.dump());
}

TEST_CASE("status JSON: no DNS proxy, no pinning, entries unknown, nothing learned") {
  StatusInput in;
  in.phase = "inline";
  in.mode = Mode::allowlist;
  in.generation = 3;
  in.entries_unknown = true;
  in.audit = json::object();
  const json j = status_json(in);
  CHECK(j["dns"].is_null());
  CHECK(j["pin"].is_null());
  CHECK(j["entries_unknown"] == true);
  CHECK(j["entries"] == json::array());
  CHECK(j["learned"] == json::array());
  CHECK(j["phases"] == json::array());
  CHECK(j["entry_counts"] == json{{"hostname", 0}, {"wildcard", 0}, {"ipv4", 0},
                                  {"ipv6", 0}, {"ipv4-cidr", 0}, {"ipv6-cidr", 0}});
  CHECK(j.dump().find("\"entries_unknown\":true") != std::string::npos);

  // Known entries: the key is absent, not false.
  in.entries_unknown = false;
  CHECK_FALSE(status_json(in).contains("entries_unknown"));
}
