#include "control/reply_text.h"

#include <algorithm>
#include <cstdio>
#include <set>

namespace egressd::control {

using Json = nlohmann::json;

std::string dump(const Json& j, int indent) { return j.dump(indent, ' ', false, Json::error_handler_t::replace); }

std::string text(const Json& j) {
  if (j.is_null()) return "-";
  if (j.is_string()) return j.get<std::string>();
  return dump(j);
}

std::string field(const Json& obj, const char* key) {
  return obj.is_object() && obj.contains(key) ? text(obj[key]) : "-";
}

std::string join(const Json& arr, const char* sep) {
  if (!arr.is_array()) return text(arr);
  std::string out;
  for (const auto& v : arr) out += (out.empty() ? "" : sep) + text(v);
  return out;
}

std::string table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width;
  for (const auto& r : rows) {
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], r[i].size());
    }
  }
  std::string out;
  for (const auto& r : rows) {
    for (std::size_t i = 0; i < r.size(); ++i) {
      out += r[i];
      if (i + 1 < r.size()) out += std::string(width[i] - r[i].size() + 2, ' ');
    }
    out += '\n';
  }
  return out;
}

std::string traffic(const Json& counters, const std::string& what) {
  return field(counters, (what + "_packets").c_str()) + " packets, " + field(counters, (what + "_bytes").c_str()) +
         " bytes";
}

std::optional<std::string> duration_ms(const Json& reply) {
  if (!reply.is_object() || !reply.contains("duration_us") || !reply["duration_us"].is_number()) return std::nullopt;
  char ms[32];
  std::snprintf(ms, sizeof(ms), "%.2f", reply["duration_us"].get<double>() / 1000.0);
  return std::string(ms);
}

std::string json_output(Json reply) {
  reply.erase("ok");
  return dump(reply, 2) + "\n";
}

int exit_code_for(const std::string& code) {
  static const std::set<std::string> kInvalidInput = {"invalid_request", "unknown_phase", "invalid_policy",
                                                      "unknown_command", "request_too_large", "unknown_sandbox"};
  return kInvalidInput.count(code) ? kExitInvalid : kExitRuntime;
}

Outcome outcome(const Result<Json>& reply) {
  if (!reply) return {kExitRuntime, reply.error().message};
  const Json& r = *reply;
  if (!r.is_object() || !r.contains("ok") || !r["ok"].is_boolean())
    return {kExitRuntime, "malformed reply from egressd: " + dump(r).substr(0, 200)};
  if (r["ok"].get<bool>()) return {};
  const Json err = r.value("error", Json::object());
  const std::string code = err.is_object() ? err.value("code", "internal") : "internal";
  const std::string message = err.is_object() ? err.value("message", code) : code;
  return {exit_code_for(code), message.empty() ? code : message};
}

std::string unreachable_reason(const Error& err, const std::string& socket) {
  const std::string prefix = "cannot connect to " + socket + ": ";
  return err.message.rfind(prefix, 0) == 0 ? err.message.substr(prefix.size()) : err.message;
}

}  // namespace egressd::control
