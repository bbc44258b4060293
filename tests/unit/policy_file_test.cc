// Policy files (DESIGN §2): a full valid file, every option, and every
// rejection with its exact file:line:col.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "egressd/policy.h"

using namespace egressd;

namespace {

Policy accept(std::string_view text) {
  auto r = parse_policy(text, "p.yaml");
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
  return std::move(r).value();
}

std::string reject(std::string_view text) {
  auto r = parse_policy(text, "p.yaml");
  REQUIRE_MESSAGE(!r.ok(), "unexpectedly valid:\n" << std::string(text));
  CHECK(r.error().kind == ErrorKind::invalid);
  return r.error().message;
}

std::vector<std::string> texts(const Phase& p) {
  std::vector<std::string> out;
  for (const Entry& e : p.entries) out.push_back(e.text);
  return out;
}

std::string source_root() {
  const char* root = std::getenv("EGRESSD_SOURCE_ROOT");
  return root != nullptr ? root : ".";
}

}  // namespace

TEST_CASE("the DESIGN §2 example, with every option set") {
  const Policy p = accept(
      "initial_phase: environment\n"
      "dns: { upstream: [resolv.conf, 192.0.2.53, \"2001:DB8::53\"], min_ttl: 5m, deny_answer: nxdomain, "
      "observe_public: false }\n"
      "enforce: { deny: drop, inbound_replies: false, log_group: 7 }\n"
      "phases:\n"
      "  environment: public\n"
      "  agent:\n"
      "    network_mode: allowlist\n"
      "    allowed_hosts: [pypi.org, \"*.pythonhosted.org\", 192.0.2.0/24, \"2001:db8::/32\"]\n"
      "  verifier: { network_mode: no-network }\n");
  CHECK(p.initial_phase == "environment");
  CHECK(p.dns.upstream == std::vector<std::string>{"resolv.conf", "192.0.2.53", "2001:db8::53"});
  CHECK(p.dns.min_ttl_s == 300);
  CHECK(p.dns.deny_answer == DenyAnswer::nxdomain);
  CHECK(p.dns.observe_public == false);
  CHECK(p.enforce.deny == DenyAction::drop);
  CHECK(p.enforce.inbound_replies == false);
  CHECK(p.enforce.log_group == 7);

  REQUIRE(p.phases.size() == 3);
  CHECK(p.phases[0].name == "environment");
  CHECK(p.phases[0].mode == Mode::public_);
  CHECK(p.phases[0].entries.empty());
  CHECK(p.phases[1].name == "agent");
  CHECK(p.phases[1].mode == Mode::allowlist);
  CHECK(texts(p.phases[1]) == std::vector<std::string>{"pypi.org", "*.pythonhosted.org", "192.0.2.0/24",
                                                       "2001:db8::/32"});
  CHECK(p.phases[1].entries[1].kind == EntryKind::wildcard);
  CHECK(p.phases[1].entries[3].kind == EntryKind::ipv6_cidr);
  CHECK(p.phases[2].name == "verifier");
  CHECK(p.phases[2].mode == Mode::no_network);
  CHECK(p.find("agent") == &p.phases[1]);
}

TEST_CASE("examples/policy.yaml loads") {
  auto r = load_policy_file(source_root() + "/examples/policy.yaml");
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
  const Policy& p = *r;
  CHECK(p.initial_phase == "environment");
  REQUIRE(p.phases.size() == 3);
  CHECK(p.phases[0].mode == Mode::public_);
  CHECK(p.phases[1].mode == Mode::allowlist);
  CHECK(p.phases[2].mode == Mode::no_network);
  CHECK(texts(p.phases[1]) == std::vector<std::string>{"pypi.org", "*.pythonhosted.org", "github.com",
                                                       "*.githubusercontent.com", "192.0.2.0/24", "2001:db8::/32"});
}

TEST_CASE("defaults: no dns, no enforce, no initial_phase") {
  const Policy p = accept("phases:\n  agent: no-network\n  verifier: public\n");
  CHECK(p.initial_phase == "agent");  // first phase in file order
  CHECK(p.dns.upstream == std::vector<std::string>{"resolv.conf"});
  CHECK(p.dns.min_ttl_s == 30);
  CHECK(p.dns.deny_answer == DenyAnswer::refused);
  CHECK(p.dns.observe_public);
  CHECK(p.enforce.deny == DenyAction::reject);
  CHECK(p.enforce.inbound_replies);
  CHECK(p.enforce.log_group == kDefaultLogGroup);

  const Policy q = accept("dns:\nenforce: ~\nphases: {a: public}\n");
  CHECK(q.dns.min_ttl_s == 30);
  CHECK(q.enforce.deny == DenyAction::reject);
}

TEST_CASE("phases keep file order") {
  const Policy p = accept("phases:\n  zeta: public\n  alpha: no-network\n  mid: allowlist\n");
  REQUIRE(p.phases.size() == 3);
  CHECK(p.phases[0].name == "zeta");
  CHECK(p.phases[1].name == "alpha");
  CHECK(p.phases[2].name == "mid");
  CHECK(p.initial_phase == "zeta");
}

TEST_CASE("an allowlist with empty, null or missing allowed_hosts denies all") {
  const Policy p = accept(
      "phases:\n"
      "  a: allowlist\n"
      "  b: {network_mode: allowlist}\n"
      "  c: {network_mode: allowlist, allowed_hosts: []}\n"
      "  d:\n"
      "    network_mode: allowlist\n"
      "    allowed_hosts:\n");
  for (const Phase& ph : p.phases) {
    CHECK(ph.mode == Mode::allowlist);
    CHECK(ph.entries.empty());
  }
}

TEST_CASE("entries are normalized and deduped in file order") {
  const Policy p = accept(
      "phases:\n"
      "  agent:\n"
      "    network_mode: allowlist\n"
      "    allowed_hosts:\n"
      "      - PyPI.org.\n"
      "      - \" github.com \"\n"
      "      - pypi.org\n"
      "      - 192.0.2.1/32\n"
      "      - 192.0.2.1\n");
  CHECK(texts(p.phases[0]) == std::vector<std::string>{"pypi.org", "github.com", "192.0.2.1"});
}

TEST_CASE("JSON documents load, with positions") {
  const Policy p = accept(R"({"initial_phase": "agent",
 "phases": {"agent": {"network_mode": "allowlist", "allowed_hosts": ["pypi.org", "*.github.com"]},
            "verifier": "no-network"}})");
  CHECK(p.initial_phase == "agent");
  REQUIRE(p.phases.size() == 2);
  CHECK(texts(p.phases[0]) == std::vector<std::string>{"pypi.org", "*.github.com"});

  CHECK(reject(R"({"phases": {"agent": {"network_mode": "allowlist",
                      "allowed_hosts": ["pypi.org", "pypi.org:443"]}}})") ==
        "p.yaml:2:53: entry \"pypi.org:443\": ports are not allowed: use the host alone");
  CHECK(reject("{\"phases\": {\"a\": \"public\"},\n \"phase\": 1}") ==
        "p.yaml:2:2: unknown key \"phase\" at the top level: allowed keys are initial_phase, dns, enforce, "
        "phases (did you mean \"phases\"?)");
}

TEST_CASE("min_ttl: seconds, minutes, hours, bare seconds") {
  const auto ttl = [](const std::string& v) {
    return accept("dns: {min_ttl: " + v + "}\nphases: {a: public}\n").dns.min_ttl_s;
  };
  CHECK(ttl("30s") == 30);
  CHECK(ttl("5m") == 300);
  CHECK(ttl("1h") == 3600);
  CHECK(ttl("45") == 45);
  CHECK(ttl("0") == 0);
  CHECK(ttl("24h") == 86400);
  CHECK(ttl("1440m") == 86400);

  CHECK(reject("dns: {min_ttl: 25h}\nphases: {a: public}\n") ==
        "p.yaml:1:16: min_ttl \"25h\" is too long: the maximum is 24h");
  CHECK(reject("dns: {min_ttl: 99999999999999}\nphases: {a: public}\n") ==
        "p.yaml:1:16: min_ttl \"99999999999999\" is too long: the maximum is 24h");
  const std::string not_duration =
      " is not a duration: use seconds (30 or 30s), minutes (5m) or hours (1h)";
  CHECK(reject("dns: {min_ttl: 1d}\nphases: {a: public}\n") == "p.yaml:1:16: min_ttl \"1d\"" + not_duration);
  CHECK(reject("dns: {min_ttl: \"30 s\"}\nphases: {a: public}\n") == "p.yaml:1:16: min_ttl \"30 s\"" + not_duration);
  CHECK(reject("dns: {min_ttl: -5}\nphases: {a: public}\n") == "p.yaml:1:16: min_ttl \"-5\"" + not_duration);
  CHECK(reject("dns: {min_ttl: s}\nphases: {a: public}\n") == "p.yaml:1:16: min_ttl \"s\"" + not_duration);
  CHECK(reject("dns: {min_ttl: 1.5m}\nphases: {a: public}\n") == "p.yaml:1:16: min_ttl \"1.5m\"" + not_duration);
  CHECK(reject("dns: {min_ttl: [30s]}\nphases: {a: public}\n") ==
        "p.yaml:1:16: min_ttl must be a string, not a list");
}

TEST_CASE("dns.max_ttl caps TTLs: default 1h, durations like min_ttl, never below min_ttl") {
  const auto policy = [](const std::string& dns) { return accept("dns: {" + dns + "}\nphases: {a: public}\n").dns; };
  CHECK(policy("").max_ttl_s == 3600);
  CHECK(policy("max_ttl: 5m").max_ttl_s == 300);
  CHECK(policy("max_ttl: 86400").max_ttl_s == 86400);
  CHECK(policy("min_ttl: 10s, max_ttl: 10s").max_ttl_s == 10);
  // A min_ttl above the default cap raises it; against an explicit max_ttl it is an error.
  CHECK(policy("min_ttl: 2h").max_ttl_s == 7200);
  CHECK(reject("dns: {min_ttl: 2h, max_ttl: 1h}\nphases: {a: public}\n") ==
        "p.yaml:1:29: max_ttl (3600s) is shorter than min_ttl (7200s)");
  CHECK(reject("dns: {max_ttl: 0}\nphases: {a: public}\n") == "p.yaml:1:16: max_ttl must be at least 1s");
  CHECK(reject("dns: {max_ttl: 25h}\nphases: {a: public}\n") ==
        "p.yaml:1:16: max_ttl \"25h\" is too long: the maximum is 24h");
  CHECK(reject("dns: {max_ttl: forever}\nphases: {a: public}\n") ==
        "p.yaml:1:16: max_ttl \"forever\" is not a duration: use seconds (30 or 30s), minutes (5m) or hours (1h)");
}

TEST_CASE("dns.private_answers: exact (default) or allow") {
  const auto policy = [](const std::string& dns) { return accept("dns: {" + dns + "}\nphases: {a: public}\n").dns; };
  CHECK(policy("").private_answers == PrivateAnswers::exact);
  CHECK(policy("private_answers: exact").private_answers == PrivateAnswers::exact);
  CHECK(policy("private_answers: allow").private_answers == PrivateAnswers::allow);
  CHECK(reject("dns: {private_answers: yes}\nphases: {a: public}\n") ==
        "p.yaml:1:24: private_answers must be exact (private addresses are learned for exact hostname entries "
        "only) or allow (for wildcard matches too), not \"yes\"");
}

TEST_CASE("dns.upstream_netns: agent (default) or sandbox") {
  const auto policy = [](const std::string& dns) { return accept("dns: {" + dns + "}\nphases: {a: public}\n").dns; };
  CHECK(policy("").upstream_netns == UpstreamNetns::agent);
  CHECK(policy("upstream_netns: agent").upstream_netns == UpstreamNetns::agent);
  CHECK(policy("upstream_netns: sandbox").upstream_netns == UpstreamNetns::sandbox);
  CHECK(reject("dns: {upstream_netns: host}\nphases: {a: public}\n") ==
        "p.yaml:1:23: upstream_netns must be agent (egressd agent asks the upstream from its own namespace) or "
        "sandbox (from the sandbox's), not \"host\"");
}

TEST_CASE("dns.upstream") {
  CHECK(accept("dns: {upstream: [\"::1\", 127.0.0.11, 127.0.0.11]}\nphases: {a: public}\n").dns.upstream ==
        std::vector<std::string>{"::1", "127.0.0.11"});
  CHECK(reject("dns:\n  upstream: resolv.conf\nphases: {a: public}\n") ==
        "p.yaml:2:13: upstream must be a list (e.g. [resolv.conf] or [192.0.2.53]), not a string");
  CHECK(reject("dns:\n  upstream: []\nphases: {a: public}\n") ==
        "p.yaml:2:13: upstream is empty: give at least one server address, or resolv.conf");
  CHECK(reject("dns:\n  upstream: [resolv.conf, \"8.8.8.8:53\"]\nphases: {a: public}\n") ==
        "p.yaml:2:27: upstream server \"8.8.8.8:53\" must be an IP address (no port, no brackets) or the word "
        "resolv.conf");
  CHECK(reject("dns:\n  upstream: [dns.google]\nphases: {a: public}\n") ==
        "p.yaml:2:14: upstream server \"dns.google\" must be an IP address (no port, no brackets) or the word "
        "resolv.conf");
  CHECK(reject("dns:\n  upstream: [[1.1.1.1]]\nphases: {a: public}\n") ==
        "p.yaml:2:14: upstream servers must be strings, not a list");
}

TEST_CASE("dns.deny_answer, dns.observe_public") {
  CHECK(reject("dns: {deny_answer: servfail}\nphases: {a: public}\n") ==
        "p.yaml:1:20: deny_answer must be refused or nxdomain, not \"servfail\"");
  CHECK(reject("dns: {deny_answer: REFUSED}\nphases: {a: public}\n") ==
        "p.yaml:1:20: deny_answer must be refused or nxdomain, not \"REFUSED\"");
  CHECK(accept("dns: {observe_public: true}\nphases: {a: public}\n").dns.observe_public);
  // YAML 1.1 booleans ("no", "off") are refused: they are how "no" turns into
  // false by accident in other tools.
  CHECK(reject("dns: {observe_public: no}\nphases: {a: public}\n") ==
        "p.yaml:1:23: observe_public must be true or false, not \"no\"");
  CHECK(reject("dns:\n  observe_public:\nphases: {a: public}\n") ==
        "p.yaml:2:3: observe_public must be a string, not empty");
}

TEST_CASE("enforce") {
  CHECK(accept("enforce: {log_group: 65535}\nphases: {a: public}\n").enforce.log_group == 65535);
  CHECK(reject("enforce: {deny: block}\nphases: {a: public}\n") ==
        "p.yaml:1:17: deny must be reject or drop, not \"block\"");
  CHECK(reject("enforce: {inbound_replies: 1}\nphases: {a: public}\n") ==
        "p.yaml:1:28: inbound_replies must be true or false, not \"1\"");
  CHECK(reject("enforce: {log_group: 65536}\nphases: {a: public}\n") ==
        "p.yaml:1:22: log_group must be a number from 0 to 65535, not \"65536\"");
  CHECK(reject("enforce: {log_group: -1}\nphases: {a: public}\n") ==
        "p.yaml:1:22: log_group must be a number from 0 to 65535, not \"-1\"");
  CHECK(reject("enforce: drop\nphases: {a: public}\n") == "p.yaml:1:10: enforce must be a map, not a string");
  // Hostname pinning: on unless turned off.
  CHECK(accept("phases: {a: public}\n").enforce.pin_names);
  CHECK_FALSE(accept("enforce: {pin_names: false}\nphases: {a: public}\n").enforce.pin_names);
  CHECK(reject("enforce: {pin_names: no}\nphases: {a: public}\n") ==
        "p.yaml:1:22: pin_names must be true or false, not \"no\"");
}

TEST_CASE("YAML syntax errors carry their position") {
  CHECK(reject("phases:\n  agent: [pypi.org\n") ==
        "p.yaml:3:1: YAML syntax error: end of sequence flow not found");
  CHECK(reject("phases:\n  agent: a: b\n") == "p.yaml:2:11: YAML syntax error: illegal map value");
  // The classic: an unquoted wildcard is a YAML alias.
  CHECK(reject("phases:\n  agent:\n    network_mode: allowlist\n    allowed_hosts:\n      - *.github.com\n") ==
        "p.yaml:5:9: YAML syntax error: the referenced anchor is not defined (a value starting with \"*\" is a "
        "YAML alias: quote wildcard entries, e.g. \"*.example.com\")");
  CHECK(reject("phases:\n\t- a\n") ==
        "p.yaml:2:2: YAML syntax error: illegal block entry");
}

TEST_CASE("a stray top-level comma is a syntax error, not a hang") {
  // yaml-cpp 0.7's LoadAll never returns on these; see DocumentStarts.
  const std::string why = "YAML syntax error: unexpected \",\" (commas separate items only inside [...] or {...})";
  CHECK(reject(",") == "p.yaml:1:1: " + why);
  CHECK(reject(",\nphases: {a: public}\n") == "p.yaml:1:1: " + why);
  CHECK(reject("[a],") == "p.yaml:1:4: " + why);
  CHECK(reject("phases: {a: public}\n---\n,\n") == "p.yaml:3:1: " + why);
}

TEST_CASE("unknown keys at every level are errors that list the allowed keys") {
  CHECK(reject("phase:\n  a: public\n") ==
        "p.yaml:1:1: unknown key \"phase\" at the top level: allowed keys are initial_phase, dns, enforce, "
        "phases (did you mean \"phases\"?)");
  CHECK(reject("phases: {a: public}\ndns:\n  upstreams: [resolv.conf]\n") ==
        "p.yaml:3:3: unknown key \"upstreams\" in dns: allowed keys are upstream, min_ttl, max_ttl, deny_answer, "
        "private_answers, observe_public, upstream_netns (did you mean \"upstream\"?)");
  CHECK(reject("phases: {a: public}\nenforce:\n  log-group: 1\n") ==
        "p.yaml:3:3: unknown key \"log-group\" in enforce: allowed keys are deny, inbound_replies, log_group, pin_names "
        "(did you mean \"log_group\"?)");
  CHECK(reject("phases:\n  agent:\n    network_mode: allowlist\n    allowed_host: [pypi.org]\n") ==
        "p.yaml:4:5: unknown key \"allowed_host\" in phase \"agent\": allowed keys are network_mode, "
        "allowed_hosts (did you mean \"allowed_hosts\"?)");
  CHECK(reject("phases:\n  agent: {network_mode: allowlist, proxy: x}\n") ==
        "p.yaml:2:36: unknown key \"proxy\" in phase \"agent\": allowed keys are network_mode, allowed_hosts");
  CHECK(reject("? [a]\n: 1\nphases: {a: public}\n") == "p.yaml:1:3: keys must be plain names, not a list");
}

TEST_CASE("duplicate keys and duplicate phases") {
  CHECK(reject("phases: {a: public}\ndns: {}\ndns: {min_ttl: 1h}\n") ==
        "p.yaml:3:1: duplicate key \"dns\" (first given at line 2)");
  CHECK(reject("phases:\n  agent: public\n  verifier: no-network\n  agent: allowlist\n") ==
        "p.yaml:4:3: duplicate phase \"agent\" (first defined at line 2)");
  CHECK(reject("phases:\n  agent: {network_mode: allowlist, network_mode: public}\n") ==
        "p.yaml:2:36: duplicate key \"network_mode\" (first given at line 2)");
}

TEST_CASE("modes are lower-case names") {
  CHECK(reject("phases:\n  agent: Allowlist\n") ==
        "p.yaml:2:10: unknown network mode \"Allowlist\": modes are lower-case: public, no-network, allowlist "
        "(did you mean \"allowlist\"?)");
  CHECK(reject("phases:\n  agent:\n    network_mode: PUBLIC\n") ==
        "p.yaml:3:19: unknown network mode \"PUBLIC\": modes are lower-case: public, no-network, allowlist "
        "(did you mean \"public\"?)");
  CHECK(reject("phases:\n  agent: no_network\n") ==
        "p.yaml:2:10: unknown network mode \"no_network\": modes are lower-case: public, no-network, allowlist "
        "(did you mean \"no-network\"?)");
  CHECK(reject("phases:\n  agent: open\n") ==
        "p.yaml:2:10: unknown network mode \"open\": modes are lower-case: public, no-network, allowlist");
  CHECK(reject("phases:\n  agent: {network_mode: [allowlist]}\n") ==
        "p.yaml:2:25: network mode must be a string, not a list");
}

TEST_CASE("allowed_hosts with a mode other than allowlist") {
  CHECK(reject("phases:\n  env:\n    network_mode: public\n    allowed_hosts: [pypi.org]\n") ==
        "p.yaml:4:5: allowed_hosts is only valid with network_mode allowlist, not public");
  // Key order does not matter, and an empty list is still "given" (DESIGN §1).
  CHECK(reject("phases:\n  v: {allowed_hosts: [], network_mode: no-network}\n") ==
        "p.yaml:2:7: allowed_hosts is only valid with network_mode allowlist, not no-network");
}

TEST_CASE("a phase needs a mode") {
  CHECK(reject("phases:\n  agent:\n    allowed_hosts: [pypi.org]\n") ==
        "p.yaml:3:5: phase \"agent\" has no network_mode: give one of public, no-network, allowlist");
  CHECK(reject("phases:\n  agent:\n  verifier: public\n") ==
        "p.yaml:2:3: phase \"agent\" has no network mode: give one of public, no-network, allowlist");
  CHECK(reject("phases:\n  agent: [public]\n") ==
        "p.yaml:2:10: phase \"agent\" must be a mode (public, no-network, allowlist) or a map with network_mode "
        "and allowed_hosts, not a list");
}

TEST_CASE("initial_phase must name a phase") {
  CHECK(reject("initial_phase: agnet\nphases:\n  agent: public\n  verifier: no-network\n") ==
        "p.yaml:1:16: initial_phase \"agnet\" names no phase: the phases are agent, verifier "
        "(did you mean \"agent\"?)");
  CHECK(reject("initial_phase: [agent]\nphases: {agent: public}\n") ==
        "p.yaml:1:16: initial_phase must be a string, not a list");
  CHECK(reject("initial_phase:\nphases: {agent: public}\n") ==
        "p.yaml:1:1: initial_phase must be a string, not empty");
  // Order in the file does not matter.
  CHECK(accept("phases: {a: public, b: no-network}\ninitial_phase: b\n").initial_phase == "b");
}

TEST_CASE("phase names") {
  CHECK(reject("phases:\n  \"my phase\": public\n") ==
        "p.yaml:2:3: invalid phase name \"my phase\": use 1-32 letters, digits, \"_\" or \"-\"");
  CHECK(reject("phases:\n  agent.1: public\n") ==
        "p.yaml:2:3: invalid phase name \"agent.1\": use 1-32 letters, digits, \"_\" or \"-\"");
  CHECK(reject("phases:\n  " + std::string(33, 'a') + ": public\n").starts_with("p.yaml:2:3: invalid phase name"));
  CHECK(accept("phases:\n  " + std::string(32, 'a') + ": public\n  step-2_b: public\n").phases.size() == 2);
  CHECK(reject("phases:\n  [a]: public\n") == "p.yaml:2:3: phase names must be strings, not a list");
}

TEST_CASE("a bad entry is reported at its own position") {
  CHECK(reject("phases:\n"
               "  agent:\n"
               "    network_mode: allowlist\n"
               "    allowed_hosts:\n"
               "      - pypi.org\n"
               "      - https://pypi.org\n") ==
        "p.yaml:6:9: entry \"https://pypi.org\": URLs are not allowed: give the host name alone");
  CHECK(reject("phases:\n  agent: {network_mode: allowlist, allowed_hosts: [pypi.org, \"192.0.2.1/24\"]}\n") ==
        "p.yaml:2:62: entry \"192.0.2.1/24\": host bits are set: did you mean 192.0.2.0/24?");
  CHECK(reject("phases:\n  agent: {network_mode: allowlist, allowed_hosts: [\"api.*.x.org\"]}\n").starts_with(
      "p.yaml:2:52: entry \"api.*.x.org\": wildcards in the middle"));
  CHECK(reject("phases:\n  agent: {network_mode: allowlist, allowed_hosts: [\"\"]}\n") ==
        "p.yaml:2:52: entry \"\": the entry is empty: give a host name, IP address or CIDR");
  CHECK(reject("phases:\n  agent: {network_mode: allowlist, allowed_hosts: [{pypi.org: 443}]}\n") ==
        "p.yaml:2:52: allowed_hosts entries must be strings, not a map");
}

TEST_CASE("wrong types") {
  CHECK(reject("phases:\n  agent: {network_mode: allowlist, allowed_hosts: pypi.org}\n") ==
        "p.yaml:2:51: allowed_hosts must be a list of hosts (e.g. [pypi.org]), not a string");
  CHECK(reject("phases:\n  - agent\n") == "p.yaml:2:3: phases must be a map of phase name to mode, not a list");
  CHECK(reject("dns: resolv.conf\nphases: {a: public}\n") == "p.yaml:1:6: dns must be a map, not a string");
  CHECK(reject("- phases\n") ==
        "p.yaml:1:1: the policy must be a map with keys initial_phase, dns, enforce, phases, not a list");
  CHECK(reject("just a string\n") ==
        "p.yaml:1:1: the policy must be a map with keys initial_phase, dns, enforce, phases, not a string");
}

TEST_CASE("a policy needs phases") {
  CHECK(reject("dns: {min_ttl: 30s}\n") ==
        "p.yaml:1:1: no phases: the policy needs a phases map, e.g. \"phases: {agent: no-network}\"");
  CHECK(reject("initial_phase: a\nphases: {}\n") ==
        "p.yaml:2:9: no phases: define at least one, e.g. \"agent: no-network\"");
  CHECK(reject("initial_phase: a\nphases:\n") ==
        "p.yaml:2:1: no phases: define at least one, e.g. \"agent: no-network\"");
  CHECK(reject("") == "p.yaml:1:1: the policy is empty: it needs at least a phases map");
  CHECK(reject("# nothing but a comment\n") == "p.yaml:1:1: the policy is empty: it needs at least a phases map");
}

TEST_CASE("one document per file") {
  CHECK(reject("phases: {a: public}\n---\nphases: {a: no-network}\n") ==
        "p.yaml:3:1: only one YAML document is allowed; this is a second one (after \"---\")");
  CHECK(accept("---\nphases: {a: public}\n...\n").phases.size() == 1);
}

TEST_CASE("load_policy_file names the path when it cannot read") {
  auto missing = load_policy_file("/nonexistent/egressd/policy.yaml");
  REQUIRE(!missing.ok());
  CHECK(missing.error().kind == ErrorKind::invalid);
  CHECK(missing.error().message ==
        "/nonexistent/egressd/policy.yaml: cannot open policy file: No such file or directory");

  auto dir = load_policy_file(source_root() + "/examples");
  REQUIRE(!dir.ok());
  CHECK(dir.error().kind == ErrorKind::invalid);
  CHECK(dir.error().message == source_root() + "/examples: cannot read policy file: Is a directory");
}

TEST_CASE("load_policy_file reports positions with the path") {
  // /dev/null is an empty file every Linux has; nothing to clean up.
  auto empty = load_policy_file("/dev/null");
  REQUIRE(!empty.ok());
  CHECK(empty.error().message == "/dev/null:1:1: the policy is empty: it needs at least a phases map");
}
