// The audit log formats: every JSON line parses, hostile strings are escaped
// in both formats, audit events carry their fields at the top level.
#include <doctest/doctest.h>
#include <spdlog/formatter.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <sstream>

#include "daemon/audit_log.h"

using namespace egressd::daemon;
using nlohmann::json;

namespace {

std::string format_json(const char* logger, const std::string& payload,
                        spdlog::level::level_enum lvl = spdlog::level::info) {
  auto f = make_json_formatter();
  spdlog::details::log_msg msg(logger, lvl, payload);
  spdlog::memory_buf_t out;
  f->format(msg, out);
  return std::string(out.data(), out.size());
}

}  // namespace

TEST_CASE("ordinary lines in JSON mode are objects with an escaped message") {
  const std::string hostile = "name=\"evil\"\n{\"event\":\"tamper\"} \\ \x01 \xff\xfe end";
  const std::string line = format_json("dns", hostile, spdlog::level::warn);
  REQUIRE(line.back() == '\n');
  CHECK(line.find('\n') == line.size() - 1);  // one line, whatever the message held
  const json j = json::parse(line);
  CHECK(j["level"] == "warning");
  CHECK(j["logger"] == "dns");
  CHECK(j["message"].get<std::string>().rfind("name=\"evil\"\n{", 0) == 0);
  CHECK(j["time"].get<std::string>().size() == std::string("2026-11-30T20:00:00.000000Z").size());
  CHECK(!j.contains("event"));
}

TEST_CASE("audit events in JSON mode carry event and fields at the top level") {
  // What audit_event hands the "audit" logger in JSON mode.
  const std::string line = format_json("audit", R"("event":"switch","from":"a","to":"b","generation":3)");
  const json j = json::parse(line);
  CHECK(j["event"] == "switch");
  CHECK(j["from"] == "a");
  CHECK(j["generation"] == 3);
  CHECK(j["level"] == "info");
  CHECK(j.contains("time"));
}

TEST_CASE("text fields quote and escape anything but plain tokens") {
  CHECK(text_fields({{"phase", "agent"}, {"generation", 7}}) == "generation=7 phase=agent");
  CHECK(text_fields({{"name", "a b"}}) == "name=\"a b\"");
  CHECK(text_fields({{"name", "x\nforged=1"}}) == "name=\"x\\nforged=1\"");
  CHECK(text_fields({{"name", ""}, {"pid", nullptr}}) == "name=\"\" pid=-");
  CHECK(text_fields({{"addr", "2001:db8::1"}, {"entry", "*.example.com"}}) == "addr=2001:db8::1 entry=*.example.com");
}

TEST_CASE("audit_event writes one line per event through the audit logger") {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto logger = std::make_shared<spdlog::logger>("audit", sink);
  logger->set_pattern("%v");
  spdlog::register_logger(logger);
  audit_event("rebinding_guard", {{"name", "lo.\"x\"\n.example.org"}, {"address", "127.0.0.1"}});
  audit_event("shutdown", {{"signal", 15}}, spdlog::level::info, "signal=15 shutting down");
  spdlog::drop("audit");
  CHECK(out.str() == "rebinding_guard address=127.0.0.1 name=\"lo.\\\"x\\\"\\n.example.org\"\n"
                     "signal=15 shutting down\n");
}
