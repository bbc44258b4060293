#include "control/protocol.h"

#include <doctest/doctest.h>
#include <stdlib.h>

#include "control/client.h"
#include "control/dispatch.h"

using egressd::Error;
using nlohmann::json;
namespace control = egressd::control;

TEST_CASE("error_reply has the documented shape") {
  const json r = control::error_reply("unknown_phase", "no phase named \"x\"");
  CHECK(r == json::parse(R"({"ok":false,"error":{"code":"unknown_phase","message":"no phase named \"x\""}})"));
}

TEST_CASE("ok_reply merges fields and forces ok=true") {
  CHECK(control::ok_reply() == json::parse(R"({"ok":true})"));
  CHECK(control::ok_reply(nullptr) == json::parse(R"({"ok":true})"));
  CHECK(control::ok_reply({{"generation", 8}, {"phase", "agent"}}) ==
        json::parse(R"({"ok":true,"generation":8,"phase":"agent"})"));
  CHECK(control::ok_reply({{"ok", false}, {"x", 1}}) == json::parse(R"({"ok":true,"x":1})"));
}

TEST_CASE("ok_reply with a non-object is an internal error, never a malformed reply") {
  const json r = control::ok_reply(json::array({1, 2}));
  CHECK(r["ok"] == false);
  CHECK(r["error"]["code"] == "internal");
  CHECK(r["error"]["message"].get<std::string>().find("array") != std::string::npos);
}

TEST_CASE("error_reply(Error) maps invalid and runtime errors") {
  CHECK(control::error_reply(Error::invalid("bad entry \"pypi.*\""))["error"] ==
        json::parse(R"({"code":"invalid_policy","message":"bad entry \"pypi.*\""})"));
  CHECK(control::error_reply(Error::invalid("no phase x"), "unknown_phase")["error"]["code"] == "unknown_phase");
  const json r = control::error_reply(Error::runtime("netlink: Operation not permitted"));
  CHECK(r["ok"] == false);
  CHECK(r["error"]["code"] == "kernel_error");
  CHECK(r["error"]["message"] == "netlink: Operation not permitted");
}

TEST_CASE("default_socket_path honours EGRESSD_SOCKET") {
  const char* saved = getenv("EGRESSD_SOCKET");
  const std::string keep = saved ? saved : "";
  unsetenv("EGRESSD_SOCKET");
  CHECK(control::default_socket_path() == "/run/egressd/egressd.sock");
  setenv("EGRESSD_SOCKET", "", 1);
  CHECK(control::default_socket_path() == "/run/egressd/egressd.sock");
  setenv("EGRESSD_SOCKET", "/tmp/x/ctl.sock", 1);
  CHECK(control::default_socket_path() == "/tmp/x/ctl.sock");
  if (saved) setenv("EGRESSD_SOCKET", keep.c_str(), 1);
  else unsetenv("EGRESSD_SOCKET");
}

// ---- typed requests and replies ----

namespace {

// decode(to_json(x)) == x, and the JSON is what docs/protocol.md shows.
template <class T>
void round_trips(const T& value, const char* wire) {
  const json j = value;
  CAPTURE(j.dump());
  CHECK(j == json::parse(wire));
  auto back = control::decode<T>(j);
  REQUIRE(std::holds_alternative<T>(back));
  CHECK(std::get<T>(back) == value);
  CHECK(j.get<T>() == value);  // the throwing from_json agrees
}

template <class T>
void reply_round_trips(const T& value, const char* wire) {
  const json j = value;
  CAPTURE(j.dump());
  CHECK(j == json::parse(wire));
  CHECK(j.get<T>() == value);
}

// The error a request decodes to (the request must not decode).
template <class T>
control::ErrorReply decode_error(const json& j) {
  auto r = control::decode<T>(j);
  REQUIRE(std::holds_alternative<control::ErrorReply>(r));
  return std::get<control::ErrorReply>(r);
}

}  // namespace

TEST_CASE("every request round-trips through its JSON") {
  round_trips(control::PingRequest{}, R"({"cmd":"ping"})");
  round_trips(control::StatusRequest{}, R"({"cmd":"status"})");
  round_trips(control::CapabilitiesRequest{}, R"({"cmd":"capabilities"})");
  round_trips(control::ApplyRequest{"agent", std::nullopt, std::nullopt}, R"({"cmd":"apply","phase":"agent"})");
  round_trips(control::ApplyRequest{std::nullopt, egressd::Mode::no_network, std::nullopt},
              R"({"cmd":"apply","mode":"no-network"})");
  round_trips(control::ApplyRequest{std::nullopt, egressd::Mode::allowlist,
                                    std::vector<std::string>{"pypi.org", "192.0.2.0/24"}},
              R"({"cmd":"apply","mode":"allowlist","allow":["pypi.org","192.0.2.0/24"]})");
  round_trips(control::ApplyRequest{std::nullopt, egressd::Mode::allowlist, std::vector<std::string>{}},
              R"({"cmd":"apply","mode":"allowlist","allow":[]})");
  round_trips(control::ExplainRequest{"198.51.100.11:443", std::nullopt},
              R"({"cmd":"explain","target":"198.51.100.11:443"})");
  round_trips(control::ExplainRequest{"files.pythonhosted.org", "agent"},
              R"({"cmd":"explain","target":"files.pythonhosted.org","phase":"agent"})");
  round_trips(control::DeniedRequest{}, R"({"cmd":"denied"})");
  round_trips(control::DeniedRequest{0, 100, 20000}, R"({"cmd":"denied","since":0,"limit":100,"wait_ms":20000})");
  round_trips(control::HostsRequest{}, R"({"cmd":"hosts"})");
  round_trips(control::HostsRequest{"environment"}, R"({"cmd":"hosts","phase":"environment"})");
}

TEST_CASE("every reply the daemon builds round-trips through its JSON") {
  reply_round_trips(control::ErrorReply{"unknown_phase", "unknown phase \"x\""},
                    R"({"ok":false,"error":{"code":"unknown_phase","message":"unknown phase \"x\""}})");
  reply_round_trips(control::ApplyReply{"agent", "allowlist", 8, 412,
                                        {{"hostname", 2}, {"ipv4", 0}, {"ipv4-cidr", 1}, {"ipv6", 0},
                                         {"ipv6-cidr", 0}, {"wildcard", 0}},
                                        {"gone.example"}},
                    R"({"duration_us":412,"entries":{"hostname":2,"ipv4":0,"ipv4-cidr":1,"ipv6":0,"ipv6-cidr":0,)"
                    R"("wildcard":0},"generation":8,"mode":"allowlist","phase":"agent","unresolved":["gone.example"]})");
  reply_round_trips(control::CapabilitiesReply{{{"disable_internet", true}, {"network_allowlist", false}}},
                    R"({"capabilities":{"disable_internet":true,"network_allowlist":false}})");
  reply_round_trips(control::DeniedReply{{json::parse(R"({"id":7,"kind":"dns","dst":null})")}, 7},
                    R"({"last_id":7,"records":[{"dst":null,"id":7,"kind":"dns"}]})");
  reply_round_trips(control::DeniedReply{}, R"({"last_id":0,"records":[]})");
  reply_round_trips(
      control::HostsReply{{{"environment", "pypi.org", 2, 0, {"198.51.100.7"}, "2026-11-30T20:10:01.002Z",
                            "2026-11-30T20:12:44.310Z"}}},
      R"({"hosts":[{"addresses":["198.51.100.7"],"first":"2026-11-30T20:10:01.002Z",)"
      R"("last":"2026-11-30T20:12:44.310Z","name":"pypi.org","phase":"environment","refused":0,"resolved":2}]})");
  reply_round_trips(control::HostsReply{}, R"({"hosts":[]})");
}

TEST_CASE("a request that does not decode names its culprit, checked in the documented order") {
  struct Case {
    json req;
    const char* code;
    const char* message;
  };
  const Case apply_cases[] = {
      {{{"cmd", "apply"}, {"phase", "agent"}, {"force", true}}, "invalid_request",
       "unknown field \"force\" for command apply"},
      {{{"cmd", "apply"}}, "invalid_request", "apply takes either \"phase\" or \"mode\" (with optional \"allow\")"},
      {{{"cmd", "apply"}, {"phase", "agent"}, {"mode", "public"}}, "invalid_request",
       "apply takes either \"phase\" or \"mode\" (with optional \"allow\")"},
      {{{"cmd", "apply"}, {"phase", 3}}, "invalid_request", "\"phase\" must be a string"},
      {{{"cmd", "apply"}, {"phase", "agent"}, {"allow", json::array()}}, "invalid_request",
       "\"allow\" goes with \"mode\", not \"phase\""},
      {{{"cmd", "apply"}, {"mode", 1}}, "invalid_request", "\"mode\" must be a string"},
      {{{"cmd", "apply"}, {"mode", "Allowlist"}, {"allow", 5}}, "invalid_policy",
       "unknown mode \"Allowlist\" (modes: public, no-network, allowlist)"},
      {{{"cmd", "apply"}, {"mode", "allowlist"}, {"allow", "pypi.org"}}, "invalid_request",
       "\"allow\" must be an array of strings"},
      {{{"cmd", "apply"}, {"mode", "allowlist"}, {"allow", {"pypi.org", 7}}}, "invalid_request",
       "\"allow\" must be an array of strings"},
  };
  for (const auto& c : apply_cases) {
    CAPTURE(c.req.dump());
    CHECK(decode_error<control::ApplyRequest>(c.req) == control::ErrorReply{c.code, c.message});
  }
  CHECK(decode_error<control::PingRequest>({{"cmd", "ping"}, {"n", 1}}) ==
        control::ErrorReply{"invalid_request", "unknown field \"n\" for command ping"});
  CHECK(decode_error<control::ExplainRequest>({{"cmd", "explain"}}).message ==
        "explain needs a string \"target\" (a hostname, IP or IP:port)");
  const auto bad_target = decode_error<control::ExplainRequest>({{"cmd", "explain"}, {"target", "*.example.org"}});
  CHECK(bad_target.code == "invalid_request");
  CHECK(bad_target.message.find("*.example.org") != std::string::npos);
  CHECK(decode_error<control::ExplainRequest>({{"cmd", "explain"}, {"target", "pypi.org"}, {"phase", 1}}).message ==
        "\"phase\" must be a string");
  CHECK(decode_error<control::DeniedRequest>({{"cmd", "denied"}, {"wait_ms", 60001}}).message ==
        "\"wait_ms\" must be an integer from 0 to 60000");
  CHECK(decode_error<control::DeniedRequest>({{"cmd", "denied"}, {"since", -1}}).message ==
        "\"since\" must be an integer from 0 to 18446744073709551615");
  CHECK(decode_error<control::DeniedRequest>({{"cmd", "denied"}, {"limit", 1.5}}).message ==
        "\"limit\" must be an integer from 0 to 1000000");
  CHECK(decode_error<control::HostsRequest>({{"cmd", "hosts"}, {"phase", false}}).message ==
        "\"phase\" must be a string");
  CHECK_THROWS_AS(json({{"cmd", "hosts"}, {"x", 1}}).get<control::HostsRequest>(), control::RequestError);
}

TEST_CASE("the agent's sandbox requests round-trip and refuse what they must") {
  control::SandboxAddRequest add;
  add.name = "trial-1";
  add.netns = "/run/netns/trial-1";
  add.config = "/etc/egressd/policy.yaml";
  add.phase = "setup";
  add.socket = "/run/egressd/t1.sock";
  add.allow_uid = std::vector<std::uint64_t>{1000};
  add.dns_port = 53;
  round_trips(add, R"({"cmd":"sandbox_add","name":"trial-1","netns":"/run/netns/trial-1",)"
                   R"("config":"/etc/egressd/policy.yaml","phase":"setup","socket":"/run/egressd/t1.sock",)"
                   R"("allow_uid":[1000],"dns_port":53})");
  control::SandboxAddRequest by_pid;
  by_pid.name = "t2";
  by_pid.netns_pid = 4242;
  by_pid.mode = egressd::Mode::allowlist;
  by_pid.allow = std::vector<std::string>{"pypi.org"};
  round_trips(by_pid, R"({"cmd":"sandbox_add","name":"t2","netns_pid":4242,"mode":"allowlist","allow":["pypi.org"]})");
  round_trips(control::SandboxRemoveRequest{"t2", true}, R"({"cmd":"sandbox_remove","name":"t2","remove_policy":true})");
  round_trips(control::SandboxListRequest{}, R"({"cmd":"sandbox_list"})");

  struct Case {
    const char* req;
    const char* message;
  };
  const Case cases[] = {
      {R"({"cmd":"sandbox_add","name":"a","netns":"/x","extra":1})", "unknown field \"extra\" for command sandbox_add"},
      {R"({"cmd":"sandbox_add","netns":"/x"})", "sandbox_add needs a string \"name\""},
      {R"({"cmd":"sandbox_add","name":"../etc","netns":"/x"})",
       "sandbox name \"../etc\" must be 1 to 64 of A-Z a-z 0-9 _ . - and not start with '.'"},
      {R"({"cmd":"sandbox_add","name":".hidden","netns":"/x"})",
       "sandbox name \".hidden\" must be 1 to 64 of A-Z a-z 0-9 _ . - and not start with '.'"},
      {R"({"cmd":"sandbox_add","name":"a"})", "sandbox_add takes either \"netns\" (a path) or \"netns_pid\""},
      {R"({"cmd":"sandbox_add","name":"a","netns":"/x","netns_pid":3})",
       "sandbox_add takes either \"netns\" (a path) or \"netns_pid\""},
      {R"({"cmd":"sandbox_add","name":"a","netns_pid":0})", "\"netns_pid\" must be a process id, not 0"},
      {R"({"cmd":"sandbox_add","name":"a","netns":"/x","config":"p.yaml","mode":"public"})",
       "sandbox_add takes \"config\" (a policy file) or \"mode\" (built-in phases), not both"},
      {R"({"cmd":"sandbox_add","name":"a","netns":"/x","phase":"agent"})",
       "\"phase\" goes with \"config\"; without one, give \"mode\""},
      {R"({"cmd":"sandbox_add","name":"a","netns":"/x","config":"p.yaml","allow":["x.org"]})",
       "\"allow\" goes with \"mode\", not \"config\" (put entries in the file)"},
      {R"({"cmd":"sandbox_add","name":"a","netns":"/x","allow_uid":[-1]})", "\"allow_uid\" must be an array of uids"},
      {R"({"cmd":"sandbox_add","name":"a","netns":"/x","dns_port":70000})",
       "\"dns_port\" must be an integer from 0 to 65535"},
      {R"({"cmd":"sandbox_remove","name":"a","remove_policy":1})", "\"remove_policy\" must be true or false"},
      {R"({"cmd":"sandbox_list","all":true})", "unknown field \"all\" for command sandbox_list"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.req);
    const json j = json::parse(c.req);
    const std::string cmd = j["cmd"];
    control::ErrorReply e;
    if (cmd == "sandbox_add") e = decode_error<control::SandboxAddRequest>(j);
    if (cmd == "sandbox_remove") e = decode_error<control::SandboxRemoveRequest>(j);
    if (cmd == "sandbox_list") e = decode_error<control::SandboxListRequest>(j);
    CHECK(e == control::ErrorReply{"invalid_request", c.message});
  }
  CHECK(decode_error<control::SandboxAddRequest>(
            json::parse(R"({"cmd":"sandbox_add","name":"a","netns":"/x","mode":"open"})")) ==
        control::ErrorReply{"invalid_policy", "unknown mode \"open\" (modes: public, no-network, allowlist)"});
  CHECK(control::valid_sandbox_name(std::string(64, 'a')));
  CHECK_FALSE(control::valid_sandbox_name(std::string(65, 'a')));
  CHECK_FALSE(control::valid_sandbox_name(""));
  CHECK_FALSE(control::valid_sandbox_name("a/b"));
}

TEST_CASE("reply_line puts ok first, then the other keys sorted, one line") {
  CHECK(control::reply_line(control::ok_reply({{"phase", "agent"}, {"generation", 8}, {"entries", {{"z", 1}, {"a", 2}}}})) ==
        "{\"ok\":true,\"entries\":{\"a\":2,\"z\":1},\"generation\":8,\"phase\":\"agent\"}\n");
  CHECK(control::reply_line(control::error_reply("internal", "x")) ==
        "{\"ok\":false,\"error\":{\"code\":\"internal\",\"message\":\"x\"}}\n");
  CHECK(control::reply_line(control::error_reply("invalid_request", "bad \xff byte")) ==
        "{\"ok\":false,\"error\":{\"code\":\"invalid_request\",\"message\":\"bad \xef\xbf\xbd byte\"}}\n");
  CHECK(control::reply_line(json::array({1})) == "[1]\n");
}

TEST_CASE("the dispatch table routes by command and answers what it does not know") {
  control::Dispatcher d;
  std::vector<std::string> seen;
  d.add<control::PingRequest>([&](const control::PingRequest&, control::Reply reply) {
    seen.push_back("ping");
    reply(control::ok_reply());
  });
  d.add<control::HostsRequest>([&](const control::HostsRequest& req, control::Reply reply) {
    seen.push_back("hosts " + req.phase.value_or("-"));
    reply(control::ok_reply(json(control::HostsReply{})));
  });
  CHECK(d.commands() == std::vector<std::string>{"ping", "hosts"});
  auto call = [&](const json& req) {
    std::optional<json> out;
    d.handle(req, [&](json r) {
      REQUIRE_FALSE(out.has_value());
      out = std::move(r);
    });
    REQUIRE(out.has_value());
    return *out;
  };
  CHECK(call({{"cmd", "ping"}}) == json::parse(R"({"ok":true})"));
  CHECK(call({{"cmd", "hosts"}, {"phase", "agent"}}) == json::parse(R"({"ok":true,"hosts":[]})"));
  CHECK(seen == std::vector<std::string>{"ping", "hosts agent"});

  // A request that does not decode never reaches its handler.
  CHECK(call({{"cmd", "hosts"}, {"phase", 1}}) == control::error_reply("invalid_request", "\"phase\" must be a string"));
  CHECK(call({{"cmd", "reboot"}}) ==
        control::error_reply("unknown_command", "unknown command \"reboot\" (commands: ping, hosts)"));
  CHECK(call({{"cmd", 1}}) == control::error_reply("invalid_request", "\"cmd\" must be a string, got number"));
  CHECK(call({{"phase", "x"}}) == control::error_reply("invalid_request", "request has no \"cmd\" field"));
  CHECK(call(json::array()) == control::error_reply("invalid_request", "request must be a JSON object, got array"));
  CHECK(seen.size() == 2);
}
