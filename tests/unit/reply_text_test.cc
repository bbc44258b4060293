#include "control/reply_text.h"

#include "control/audit_view.h"

#include <doctest/doctest.h>

using egressd::Error;
using nlohmann::json;
namespace control = egressd::control;

TEST_CASE("text and field show scalars for people, '-' for what is missing") {
  CHECK(control::text("agent") == "agent");
  CHECK(control::text(nullptr) == "-");
  CHECK(control::text(8) == "8");
  CHECK(control::text(true) == "true");
  const json r = {{"phase", "agent"}, {"entry", nullptr}, {"generation", 8}};
  CHECK(control::field(r, "phase") == "agent");
  CHECK(control::field(r, "entry") == "-");
  CHECK(control::field(r, "nope") == "-");
  CHECK(control::field(json::array(), "phase") == "-");
  CHECK(control::join(json::array({"a", 1, nullptr}), ", ") == "a, 1, -");
  CHECK(control::join("x", ", ") == "x");
}

TEST_CASE("table aligns columns two spaces apart") {
  CHECK(control::table({{"ENTRY", "KIND"}, {"192.0.2.0/24", "ipv4-cidr"}, {"a", "b"}}) ==
        "ENTRY         KIND\n"
        "192.0.2.0/24  ipv4-cidr\n"
        "a             b\n");
  CHECK(control::table({}) == "");
}

TEST_CASE("traffic, duration and --json output") {
  const json counters = {{"allowed_packets", 1}, {"allowed_bytes", 60}, {"denied_packets", 3}};
  CHECK(control::traffic(counters, "allowed") == "1 packets, 60 bytes");
  CHECK(control::traffic(counters, "denied") == "3 packets, - bytes");
  CHECK(control::duration_ms({{"duration_us", 412}}) == "0.41");
  CHECK_FALSE(control::duration_ms({{"duration_us", "x"}}).has_value());
  CHECK(control::json_output({{"ok", true}, {"b", 1}, {"a", {{"y", 2}}}}) ==
        "{\n  \"a\": {\n    \"y\": 2\n  },\n  \"b\": 1\n}\n");
}

TEST_CASE("outcome: exit 2 for replies that blame the request, 1 for the rest") {
  using R = egressd::Result<json>;
  CHECK(control::outcome(R(json{{"ok", true}})).exit_code == control::kExitOk);
  for (const char* code : {"invalid_request", "request_too_large", "unknown_command", "unknown_phase", "invalid_policy"}) {
    const auto o = control::outcome(R(json::parse(std::string(R"({"ok":false,"error":{"code":")") + code +
                                                  R"(","message":"no phase named \"x\""}})")));
    CHECK(o.exit_code == control::kExitInvalid);
    CHECK(o.error == "no phase named \"x\"");
  }
  for (const char* code : {"unauthorized", "kernel_error", "internal", "unavailable", "something_new"}) {
    CHECK(control::exit_code_for(code) == control::kExitRuntime);
  }
  // An empty message falls back to the code; a reply without the protocol's shape is a failure.
  CHECK(control::outcome(R(json::parse(R"({"ok":false,"error":{"code":"internal","message":""}})"))).error ==
        "internal");
  const auto bad = control::outcome(R(json{{"phase", "x"}}));
  CHECK(bad.exit_code == control::kExitRuntime);
  CHECK(bad.error.rfind("malformed reply from egressd: ", 0) == 0);
  const auto down = control::outcome(R(Error::runtime("timed out after 30000 ms waiting for egressd")));
  CHECK(down.exit_code == control::kExitRuntime);
  CHECK(down.error == "timed out after 30000 ms waiting for egressd");
}

TEST_CASE("unreachable_reason keeps the reason of a connect error") {
  CHECK(control::unreachable_reason(Error::runtime("cannot connect to /run/x.sock: No such file or directory"),
                                    "/run/x.sock") == "No such file or directory");
  CHECK(control::unreachable_reason(Error::invalid("path too long"), "/run/x.sock") == "path too long");
}

TEST_CASE("a denied line names what a pinning reset refused, escaped, not only the learned names") {
  const json pin = {{"time", "2026-12-02T08:00:00.000Z"}, {"phase", "agent"}, {"kind", "flow"},
                    {"proto", "tcp"}, {"dst", "203.0.113.10"}, {"port", 443}, {"count", 1},
                    {"names", {"allowed.test"}},
                    {"pin", "tls sni same-ip.test\x1b[2J to 203.0.113.10:443; address learned for allowed.test"}};
  const std::string line = control::denied_line(pin);
  CHECK(line.find("tcp 203.0.113.10:443  x1  reset by pinning: tls sni same-ip.test") != std::string::npos);
  CHECK(line.find("address learned for allowed.test") != std::string::npos);
  CHECK(line.find('\x1b') == std::string::npos);  // the presented name comes from the sandbox
  json plain = pin;
  plain.erase("pin");
  CHECK(control::denied_line(plain) == "2026-12-02T08:00:00.000Z  agent  tcp 203.0.113.10:443  x1  names: allowed.test");
}
