// The audit log: egressd's security-relevant events (startup, adoption,
// switch, tamper, rebinding_guard, shutdown), and the log format of every
// other line.
//
// --log-format text (default, for people):
//   2026-11-30T20:00:00.000000Z info audit: switch from=environment to=agent ...
// --log-format json: one JSON object per line, every line:
//   {"time":"...","level":"info","event":"switch","from":"environment",...}
//   {"time":"...","level":"warn","logger":"dns","message":"..."}
// Strings are escaped in both formats (names from the sandbox are hostile: a
// name with a newline or a quote cannot forge a line); invalid UTF-8 becomes
// U+FFFD in JSON.
//
// The format is process-wide, like spdlog's registry: set once by the daemon
// before anything logs. Thread-safe as spdlog is.
#pragma once

#include <spdlog/common.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace spdlog {
class formatter;
}

namespace egressd::daemon {

enum class LogFormat { text, json };

// Registers the loggers (egressd, sandbox, control, dns, tamper, audit) on
// stderr with `format`. Call once, first thing in `run`.
void setup_logging(LogFormat format);

// Logs one audit event. `fields` must be a JSON object (anything else is
// logged under "value"). In text mode `text`, when given, is printed instead
// of the generated `event k=v ...` (kept for lines people and scripts already
// read); it must not carry untrusted data.
void audit_event(std::string_view event, nlohmann::json fields,
                 spdlog::level::level_enum level = spdlog::level::info, std::string_view text = {});

// Whether setup_logging chose JSON lines (`run` and `agent` with
// --log-format json); text before it is called.
bool logging_json();

// The JSON line formatter (exposed for tests): `{"time","level","logger","message"}`
// for ordinary lines, the event object for lines of the "audit" logger.
std::unique_ptr<spdlog::formatter> make_json_formatter();

// `k=v k=v` with values quoted and escaped when they contain anything but
// [A-Za-z0-9._:/@*+,-] (exposed for tests).
std::string text_fields(const nlohmann::json& fields);

}  // namespace egressd::daemon
