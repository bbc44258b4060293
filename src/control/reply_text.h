// How clients show replies for people: the helpers egressctl and Harbor's
// network-policy share, over the reply JSON as received (fields may be
// missing or added, docs/protocol.md: a client shows "-" and goes on), and how
// a reply, or the failure to get one, becomes a message and an exit code.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "egressd/result.h"

namespace egressd::control {

// Exit codes (DESIGN §2): 0 ok, 1 runtime failure, 2 invalid input.
inline constexpr int kExitOk = 0, kExitRuntime = 1, kExitInvalid = 2;

// Compact JSON (indent < 0) or pretty-printed, invalid UTF-8 replaced.
std::string dump(const nlohmann::json& j, int indent = -1);
// A scalar for people: strings unquoted, null as "-", anything else as JSON.
std::string text(const nlohmann::json& j);
// text() of obj[key], "-" when obj is not an object or has no such key.
std::string field(const nlohmann::json& obj, const char* key);
// text() of each element joined with `sep`; a non-array as text().
std::string join(const nlohmann::json& arr, const char* sep);
// Rows as left-aligned columns two spaces apart, one line each.
std::string table(const std::vector<std::vector<std::string>>& rows);
// "X packets, Y bytes" of `what` ("allowed", "denied") in status counters.
std::string traffic(const nlohmann::json& counters, const std::string& what);
// An apply reply's duration_us in milliseconds, two decimals ("0.41"); nullopt without one.
std::optional<std::string> duration_ms(const nlohmann::json& reply);
// --json output: the reply as received minus "ok", keys sorted, two-space
// indent, one newline.
std::string json_output(nlohmann::json reply);

// The exit code of an error reply's code: 2 for the codes that blame the
// request (invalid_request, request_too_large, unknown_command, unknown_phase,
// invalid_policy), else 1.
int exit_code_for(const std::string& code);

// What became of a call: exit code, and what to print on stderr after the
// program's own prefix when it failed ("" when the reply is a success).
struct Outcome {
  int exit_code = kExitOk;
  std::string error;
};
// A Client::call result: a transport error (1), a reply that is not the
// protocol's shape (1), an error reply (its message, exit_code_for its code),
// or success.
Outcome outcome(const Result<nlohmann::json>& reply);

// Why Client::connect(socket) failed, without the "cannot connect to SOCKET: "
// its message starts with ("No such file or directory").
std::string unreachable_reason(const Error& err, const std::string& socket);

}  // namespace egressd::control
