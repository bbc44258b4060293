// The control protocol's types (docs/protocol.md): every request and the
// replies the daemon builds field by field, each with its JSON mapping, and
// the reply envelope. The one place that knows the wire shapes; the server
// (framing), the daemon (meaning) and the clients (rendering) use these.
//
// Requests are read with decode<T>(), which checks what the daemon used to
// check field by field, in the same order and with the same messages:
// unknown fields, then types, then values. A request that fails gets an
// ErrorReply naming the culprit and changes nothing. to_json writes a request
// as clients send it (absent optionals stay absent).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "audit/explain.h"
#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd::control {

// Error codes carried in {"ok":false,"error":{"code":...,"message":...}}.
// "invalid_request" (malformed JSON / wrong types), "request_too_large",
// "unknown_command", "unknown_phase", "invalid_policy", "unauthorized",
// "kernel_error", "internal", "unavailable".
struct ErrorReply {
  std::string code;
  std::string message;
  bool operator==(const ErrorReply&) const = default;
};
// The whole reply object: {"ok":false,"error":{"code":...,"message":...}}.
void to_json(nlohmann::json& j, const ErrorReply& e);
// Reads the whole reply object; throws nlohmann::json::exception when it is not one.
void from_json(const nlohmann::json& j, ErrorReply& e);

nlohmann::json error_reply(const std::string& code, const std::string& message);
// {"ok":true} merged with `fields` (an object).
nlohmann::json ok_reply(nlohmann::json fields = nlohmann::json::object());
// Maps an Error to an error reply: invalid -> `invalid_code`, runtime -> "kernel_error".
nlohmann::json error_reply(const Error& err, const std::string& invalid_code = "invalid_policy");

// Calls back exactly once with the reply object (see control/server.h).
using Reply = std::function<void(nlohmann::json)>;

// The reply line as sent: "ok" first, so a person reading socat output sees the
// verdict before the details, then the other keys in alphabetical order (nested
// objects too); invalid UTF-8 (an error message may quote request bytes)
// replaced with U+FFFD; one '\n' at the end.
std::string reply_line(const nlohmann::json& reply);

// What a request must be before any command looks at it: an object with a
// string "cmd". Returns the error otherwise.
std::optional<ErrorReply> check_envelope(const nlohmann::json& request);

// ---- requests ----

struct PingRequest {
  static constexpr const char* kCmd = "ping";
  bool operator==(const PingRequest&) const = default;
};
struct StatusRequest {
  static constexpr const char* kCmd = "status";
  bool operator==(const StatusRequest&) const = default;
};
struct CapabilitiesRequest {
  static constexpr const char* kCmd = "capabilities";
  bool operator==(const CapabilitiesRequest&) const = default;
};
// The tables in force as nft text, with the kernel's counters (reply field "ruleset").
struct RulesRequest {
  static constexpr const char* kCmd = "rules";
  bool operator==(const RulesRequest&) const = default;
};
// The Prometheus text exposition (reply field "text").
struct MetricsRequest {
  static constexpr const char* kCmd = "metrics";
  bool operator==(const MetricsRequest&) const = default;
};

// Either a named phase, or an inline policy (mode, and entries for allowlist).
// Exactly one of `phase` and `mode` is set once decoded.
struct ApplyRequest {
  static constexpr const char* kCmd = "apply";
  std::optional<std::string> phase;
  std::optional<Mode> mode;
  std::optional<std::vector<std::string>> allow;  // with `mode` only; entries are checked by the daemon
  bool operator==(const ApplyRequest&) const = default;
};

// `target` is checked (audit::parse_target) when decoded; the daemon parses it
// again into what it explains.
struct ExplainRequest {
  static constexpr const char* kCmd = "explain";
  std::string target;
  std::optional<std::string> phase;
  bool operator==(const ExplainRequest&) const = default;
};

// Limits of a `denied` request.
inline constexpr std::uint64_t kMaxDeniedLimit = 1000000;  // also the default limit
inline constexpr std::uint64_t kMaxDeniedWaitMs = 60000;   // a long-poll waits at most this long

struct DeniedRequest {
  static constexpr const char* kCmd = "denied";
  std::optional<std::uint64_t> since;    // default 0
  std::optional<std::uint64_t> limit;    // 0..kMaxDeniedLimit, default kMaxDeniedLimit
  std::optional<std::uint64_t> wait_ms;  // 0..kMaxDeniedWaitMs, default 0
  bool operator==(const DeniedRequest&) const = default;
};

struct HostsRequest {
  static constexpr const char* kCmd = "hosts";
  std::optional<std::string> phase;
  bool operator==(const HostsRequest&) const = default;
};

// ---- the agent's own commands (egressd agent; docs/protocol.md "Agent mode") ----
// Every other command sent to the agent names its sandbox in "sandbox" and is
// then the sidecar's command, unchanged.

// A sandbox name: 1 to 64 of [A-Za-z0-9_.-], not starting with '.' (it names
// files in the agent's state directory).
bool valid_sandbox_name(std::string_view name);

// Attaches the namespace `netns` (a path) or that of process `netns_pid`
// (then removed when the process exits). The policy is the file `config`
// (initial `phase`, default its initial_phase), or the built-in phases
// public / no-network / allowlist (with `allow`) starting in `mode` (default
// no-network).
struct SandboxAddRequest {
  static constexpr const char* kCmd = "sandbox_add";
  std::string name;
  std::optional<std::string> netns;
  std::optional<std::uint64_t> netns_pid;
  std::optional<std::string> config;
  std::optional<std::string> phase;
  std::optional<Mode> mode;
  std::optional<std::vector<std::string>> allow;
  std::optional<std::string> socket;                   // the sandbox's own sidecar-protocol socket
  std::optional<std::vector<std::uint64_t>> allow_uid;  // besides root, on that socket
  std::optional<std::uint64_t> dns_port;               // default 53; 0 = no DNS interception
  // Names learned without DNS (docs/pinning.md "Hosts files"); default
  // /proc/PID/root/etc/hosts with netns_pid, none with netns.
  std::optional<std::string> hosts_file;
  bool operator==(const SandboxAddRequest&) const = default;
};
// Detaches a sandbox: its sockets in the namespace close; the policy stays
// in force unless `remove_policy` (fail closed).
struct SandboxRemoveRequest {
  static constexpr const char* kCmd = "sandbox_remove";
  std::string name;
  std::optional<bool> remove_policy;
  bool operator==(const SandboxRemoveRequest&) const = default;
};
struct SandboxListRequest {
  static constexpr const char* kCmd = "sandbox_list";
  bool operator==(const SandboxListRequest&) const = default;
};

// A decoded request, or why it is not one.
template <class T>
using Decoded = std::variant<T, ErrorReply>;

// Per request type: reads `j` (an object whose "cmd" is T::kCmd) into `out`,
// or returns the error reply naming the culprit.
std::optional<ErrorReply> read(const nlohmann::json& j, PingRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, StatusRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, CapabilitiesRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, RulesRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, MetricsRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, ApplyRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, ExplainRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, DeniedRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, HostsRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, SandboxAddRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, SandboxRemoveRequest& out);
std::optional<ErrorReply> read(const nlohmann::json& j, SandboxListRequest& out);

template <class T>
Decoded<T> decode(const nlohmann::json& j) {
  T out;
  if (auto err = read(j, out)) return std::move(*err);
  return out;
}

// Thrown by the from_json of a request (`json.get<ApplyRequest>()`); decode()
// is the non-throwing form the daemon uses.
struct RequestError : std::runtime_error {
  explicit RequestError(ErrorReply e) : std::runtime_error(e.message), error(std::move(e)) {}
  ErrorReply error;
};

void to_json(nlohmann::json& j, const PingRequest& r);
void to_json(nlohmann::json& j, const StatusRequest& r);
void to_json(nlohmann::json& j, const CapabilitiesRequest& r);
void to_json(nlohmann::json& j, const RulesRequest& r);
void to_json(nlohmann::json& j, const MetricsRequest& r);
void to_json(nlohmann::json& j, const ApplyRequest& r);
void to_json(nlohmann::json& j, const ExplainRequest& r);
void to_json(nlohmann::json& j, const DeniedRequest& r);
void to_json(nlohmann::json& j, const HostsRequest& r);
void to_json(nlohmann::json& j, const SandboxAddRequest& r);
void to_json(nlohmann::json& j, const SandboxRemoveRequest& r);
void to_json(nlohmann::json& j, const SandboxListRequest& r);
template <class T, class = decltype(T::kCmd)>
void from_json(const nlohmann::json& j, T& r) {
  if (auto err = read(j, r)) throw RequestError(std::move(*err));
}

// ---- replies (the fields besides "ok"; ok_reply(json(x)) makes the reply) ----
// Member names are the JSON keys; from_json throws nlohmann::json::exception
// when a field is missing or of another type.

// `apply`, once the kernel acknowledged the switch.
struct ApplyReply {
  std::string phase;
  std::string mode;
  std::uint64_t generation = 0;
  std::int64_t duration_us = 0;
  std::map<std::string, std::uint64_t> entries;  // by kind: "hostname", "ipv4", ...
  std::vector<std::string> unresolved;
  bool operator==(const ApplyReply&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ApplyReply, phase, mode, generation, duration_us, entries, unresolved)

// `capabilities`: feature name -> supported.
struct CapabilitiesReply {
  std::map<std::string, bool> capabilities;
  bool operator==(const CapabilitiesReply&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CapabilitiesReply, capabilities)

// `denied`: each record is audit::to_json(DeniedRecord), the documented shape.
struct DeniedReply {
  std::vector<nlohmann::json> records;
  std::uint64_t last_id = 0;
  bool operator==(const DeniedReply&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(DeniedReply, records, last_id)

// One (phase, name) of a `hosts` reply; times are ISO 8601 UTC.
struct HostsEntry {
  std::string phase;
  std::string name;
  std::uint64_t resolved = 0;
  std::uint64_t refused = 0;
  std::vector<std::string> addresses;
  std::string first;
  std::string last;
  bool operator==(const HostsEntry&) const = default;
};
struct HostsReply {
  std::vector<HostsEntry> hosts;
  bool operator==(const HostsReply&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(HostsEntry, phase, name, resolved, refused, addresses, first, last)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(HostsReply, hosts)

// The reply to `explain` is audit::Explanation::to_json(), and to `status`
// the daemon's Sandbox::status(): each shape is built in one place there.

}  // namespace egressd::control
