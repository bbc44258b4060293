#include "daemon/audit_log.h"

#include <spdlog/formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <time.h>

#include <atomic>
#include <chrono>

#include "egressd/module_logger.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;

std::atomic<LogFormat> g_format{LogFormat::text};

constexpr const char* kAuditLogger = "audit";

// JSON text of `s`; invalid UTF-8 is replaced, never thrown about: log text
// may carry bytes a sandbox chose.
std::string quote(std::string_view s) {
  return json(std::string(s)).dump(-1, ' ', false, json::error_handler_t::replace);
}

void append(spdlog::memory_buf_t& dest, std::string_view s) { dest.append(s.data(), s.data() + s.size()); }

// "2026-11-30T20:00:00.123456Z", as the text pattern prints it.
std::string utc_time(spdlog::log_clock::time_point t) {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  const time_t secs = static_cast<time_t>(us / 1000000);
  tm tmv{};
  gmtime_r(&secs, &tmv);
  char buf[40];
  const size_t n = strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tmv);
  return std::string(buf, n) + fmt::format(".{:06d}Z", us % 1000000);
}

class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    append(dest, "{\"time\":\"");
    append(dest, utc_time(msg.time));
    append(dest, "\",\"level\":");
    const auto lvl = spdlog::level::to_string_view(msg.level);
    append(dest, quote(std::string_view(lvl.data(), lvl.size())));
    const std::string_view payload(msg.payload.data(), msg.payload.size());
    const std::string_view logger(msg.logger_name.data(), msg.logger_name.size());
    if (logger == kAuditLogger && !payload.empty() && payload.front() == '"') {
      // audit_event already rendered `"event":...,"k":v` as valid JSON.
      append(dest, ",");
      append(dest, payload);
    } else {
      append(dest, ",\"logger\":");
      append(dest, quote(logger));
      append(dest, ",\"message\":");
      append(dest, quote(payload));
    }
    append(dest, "}\n");
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonFormatter>(); }
};

bool plain(std::string_view s) {
  if (s.empty()) return false;
  for (unsigned char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    std::string_view("._:/@*+,-").find(static_cast<char>(c)) != std::string_view::npos;
    if (!ok) return false;
  }
  return true;
}

std::shared_ptr<spdlog::logger> audit_logger() { return module_logger(kAuditLogger); }

}  // namespace

std::string text_fields(const json& fields) {
  std::string out;
  if (!fields.is_object()) return fields.dump(-1, ' ', false, json::error_handler_t::replace);
  for (const auto& [k, v] : fields.items()) {
    if (!out.empty()) out += ' ';
    out += k;
    out += '=';
    if (v.is_string()) {
      const auto& s = v.get_ref<const std::string&>();
      out += plain(s) ? s : quote(s);
    } else if (v.is_null()) {
      out += '-';
    } else {
      out += v.dump(-1, ' ', false, json::error_handler_t::replace);
    }
  }
  return out;
}

std::unique_ptr<spdlog::formatter> make_json_formatter() { return std::make_unique<JsonFormatter>(); }

void setup_logging(LogFormat format) {
  g_format = format;
  // One named logger per module, all to stderr; one line per event.
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  for (const char* name : {"egressd", "sandbox", "control", "dns", "tamper", kAuditLogger}) {
    if (spdlog::get(name)) continue;
    spdlog::register_logger(std::make_shared<spdlog::logger>(name, sink));
  }
  spdlog::set_default_logger(spdlog::get("egressd"));
  if (format == LogFormat::json) {
    spdlog::set_formatter(make_json_formatter());
  } else {
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%fZ %l %n: %v", spdlog::pattern_time_type::utc);
  }
  spdlog::flush_on(spdlog::level::info);
}

bool logging_json() { return g_format.load() == LogFormat::json; }

void audit_event(std::string_view event, json fields, spdlog::level::level_enum level, std::string_view text) {
  if (!fields.is_object()) fields = json{{"value", std::move(fields)}};
  auto log = audit_logger();
  if (!log->should_log(level)) return;
  if (g_format.load() == LogFormat::json) {
    std::string body = "\"event\":" + quote(event);
    const std::string rest = fields.dump(-1, ' ', false, json::error_handler_t::replace);
    if (rest.size() > 2) {  // without the braces; appended, as `"," + tmp` trips g++ 12 -Wrestrict at -O3
      body += ',';
      body.append(rest, 1, rest.size() - 2);
    }
    log->log(level, "{}", body);
    return;
  }
  if (!text.empty()) {
    log->log(level, "{}", text);
    return;
  }
  const std::string kv = text_fields(fields);
  log->log(level, "{}{}{}", event, kv.empty() ? "" : " ", kv);
}

}  // namespace egressd::daemon
