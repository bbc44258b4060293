#include "control/protocol.h"

#include <initializer_list>

namespace egressd::control {

using Json = nlohmann::json;

namespace {

ErrorReply invalid(std::string message) { return {"invalid_request", std::move(message)}; }

// The first field of `j` that the command does not take.
std::optional<ErrorReply> unknown_field(const Json& j, const char* cmd, std::initializer_list<const char*> allowed) {
  for (const auto& [k, v] : j.items()) {
    bool ok = k == "cmd";
    for (const char* a : allowed) ok = ok || k == a;
    if (!ok) return invalid("unknown field \"" + k + "\" for command " + cmd);
  }
  return std::nullopt;
}

// An optional string field.
std::optional<ErrorReply> read_string(const Json& j, const char* key, std::optional<std::string>& out) {
  auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  if (!it->is_string()) return invalid(std::string("\"") + key + "\" must be a string");
  out = it->get<std::string>();
  return std::nullopt;
}

// An optional unsigned integer field no larger than `max`.
std::optional<ErrorReply> read_uint(const Json& j, const char* key, std::uint64_t max,
                                    std::optional<std::uint64_t>& out) {
  auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  const bool non_negative = it->is_number_unsigned() || (it->is_number_integer() && it->get<std::int64_t>() >= 0);
  if (!non_negative || it->get<std::uint64_t>() > max)
    return invalid(std::string("\"") + key + "\" must be an integer from 0 to " + std::to_string(max));
  out = it->get<std::uint64_t>();
  return std::nullopt;
}

Json with_cmd(const char* cmd) { return Json{{"cmd", cmd}}; }

}  // namespace

// ---- the envelope ----

void to_json(Json& j, const ErrorReply& e) {
  j = Json{{"ok", false}, {"error", {{"code", e.code}, {"message", e.message}}}};
}

void from_json(const Json& j, ErrorReply& e) {
  const Json& err = j.at("error");
  e.code = err.at("code").get<std::string>();
  e.message = err.value("message", "");
}

Json error_reply(const std::string& code, const std::string& message) { return ErrorReply{code, message}; }

Json ok_reply(Json fields) {
  if (fields.is_null()) fields = Json::object();
  // A non-object here is a bug in the caller; answering with a well-formed
  // internal error keeps the "one {"ok":...} object per request" promise.
  if (!fields.is_object())
    return error_reply("internal", std::string("reply fields are a JSON ") + fields.type_name() + ", not an object");
  fields["ok"] = true;
  return fields;
}

Json error_reply(const Error& err, const std::string& invalid_code) {
  return error_reply(err.kind == ErrorKind::invalid ? invalid_code : "kernel_error", err.message);
}

std::string reply_line(const Json& reply) {
  // Json objects keep their keys sorted; ordered_json keeps insertion order,
  // which puts "ok" first and the rest, copied in sorted order, after it.
  nlohmann::ordered_json out;
  if (reply.is_object() && reply.contains("ok")) {
    out["ok"] = reply["ok"];
    for (const auto& [key, value] : reply.items())
      if (key != "ok") out[key] = value;
  } else {
    out = reply;
  }
  return out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

std::optional<ErrorReply> check_envelope(const Json& request) {
  if (!request.is_object())
    return invalid(std::string("request must be a JSON object, got ") + request.type_name());
  auto it = request.find("cmd");
  if (it == request.end()) return invalid("request has no \"cmd\" field");
  if (!it->is_string()) return invalid(std::string("\"cmd\" must be a string, got ") + it->type_name());
  return std::nullopt;
}

// ---- requests ----

std::optional<ErrorReply> read(const Json& j, PingRequest&) { return unknown_field(j, PingRequest::kCmd, {}); }
std::optional<ErrorReply> read(const Json& j, StatusRequest&) { return unknown_field(j, StatusRequest::kCmd, {}); }
std::optional<ErrorReply> read(const Json& j, CapabilitiesRequest&) {
  return unknown_field(j, CapabilitiesRequest::kCmd, {});
}
std::optional<ErrorReply> read(const Json& j, RulesRequest&) { return unknown_field(j, RulesRequest::kCmd, {}); }
std::optional<ErrorReply> read(const Json& j, MetricsRequest&) { return unknown_field(j, MetricsRequest::kCmd, {}); }

std::optional<ErrorReply> read(const Json& j, ApplyRequest& out) {
  if (auto e = unknown_field(j, ApplyRequest::kCmd, {"phase", "mode", "allow"})) return e;
  const bool has_phase = j.contains("phase"), has_mode = j.contains("mode");
  if (has_phase == has_mode) return invalid("apply takes either \"phase\" or \"mode\" (with optional \"allow\")");
  if (has_phase) {
    if (auto e = read_string(j, "phase", out.phase)) return e;
    if (j.contains("allow")) return invalid("\"allow\" goes with \"mode\", not \"phase\"");
    return std::nullopt;
  }
  std::optional<std::string> mode;
  if (auto e = read_string(j, "mode", mode)) return e;
  out.mode = parse_mode(*mode);
  if (!out.mode) return ErrorReply{"invalid_policy", "unknown mode \"" + *mode + "\" (modes: public, no-network, allowlist)"};
  if (auto it = j.find("allow"); it != j.end()) {
    if (!it->is_array()) return invalid("\"allow\" must be an array of strings");
    auto& allow = out.allow.emplace();
    allow.reserve(it->size());
    for (const auto& e : *it) {
      if (!e.is_string()) return invalid("\"allow\" must be an array of strings");
      allow.push_back(e.get<std::string>());
    }
  }
  return std::nullopt;
}

std::optional<ErrorReply> read(const Json& j, ExplainRequest& out) {
  if (auto e = unknown_field(j, ExplainRequest::kCmd, {"target", "phase"})) return e;
  auto it = j.find("target");
  if (it == j.end() || !it->is_string())
    return invalid("explain needs a string \"target\" (a hostname, IP or IP:port)");
  out.target = it->get<std::string>();
  if (auto t = audit::parse_target(out.target); !t) return invalid(t.error().message);
  return read_string(j, "phase", out.phase);
}

std::optional<ErrorReply> read(const Json& j, DeniedRequest& out) {
  if (auto e = unknown_field(j, DeniedRequest::kCmd, {"since", "limit", "wait_ms"})) return e;
  if (auto e = read_uint(j, "since", UINT64_MAX, out.since)) return e;
  if (auto e = read_uint(j, "limit", kMaxDeniedLimit, out.limit)) return e;
  return read_uint(j, "wait_ms", kMaxDeniedWaitMs, out.wait_ms);
}

std::optional<ErrorReply> read(const Json& j, HostsRequest& out) {
  if (auto e = unknown_field(j, HostsRequest::kCmd, {"phase"})) return e;
  return read_string(j, "phase", out.phase);
}

bool valid_sandbox_name(std::string_view name) {
  if (name.empty() || name.size() > 64 || name.front() == '.') return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

namespace {

std::optional<ErrorReply> read_name(const Json& j, const char* cmd, std::string& out) {
  auto it = j.find("name");
  if (it == j.end() || !it->is_string()) return invalid(std::string(cmd) + " needs a string \"name\"");
  out = it->get<std::string>();
  if (!valid_sandbox_name(out))
    return invalid("sandbox name \"" + out + "\" must be 1 to 64 of A-Z a-z 0-9 _ . - and not start with '.'");
  return std::nullopt;
}

}  // namespace

std::optional<ErrorReply> read(const Json& j, SandboxAddRequest& out) {
  if (auto e = unknown_field(j, SandboxAddRequest::kCmd,
                             {"name", "netns", "netns_pid", "config", "phase", "mode", "allow", "socket", "allow_uid",
                              "dns_port", "hosts_file"}))
    return e;
  if (auto e = read_name(j, SandboxAddRequest::kCmd, out.name)) return e;
  if (j.contains("netns") == j.contains("netns_pid"))
    return invalid("sandbox_add takes either \"netns\" (a path) or \"netns_pid\"");
  if (auto e = read_string(j, "netns", out.netns)) return e;
  if (out.netns && out.netns->empty()) return invalid("\"netns\" is empty");
  if (auto e = read_uint(j, "netns_pid", 4194304, out.netns_pid)) return e;
  if (out.netns_pid && *out.netns_pid == 0) return invalid("\"netns_pid\" must be a process id, not 0");
  if (j.contains("config") && j.contains("mode"))
    return invalid("sandbox_add takes \"config\" (a policy file) or \"mode\" (built-in phases), not both");
  if (auto e = read_string(j, "config", out.config)) return e;
  if (auto e = read_string(j, "phase", out.phase)) return e;
  if (out.phase && !out.config) return invalid("\"phase\" goes with \"config\"; without one, give \"mode\"");
  if (j.contains("mode")) {
    std::optional<std::string> mode;
    if (auto e = read_string(j, "mode", mode)) return e;
    out.mode = parse_mode(*mode);
    if (!out.mode)
      return ErrorReply{"invalid_policy", "unknown mode \"" + *mode + "\" (modes: public, no-network, allowlist)"};
  }
  if (auto it = j.find("allow"); it != j.end()) {
    if (out.config) return invalid("\"allow\" goes with \"mode\", not \"config\" (put entries in the file)");
    if (!it->is_array()) return invalid("\"allow\" must be an array of strings");
    auto& allow = out.allow.emplace();
    for (const auto& e : *it) {
      if (!e.is_string()) return invalid("\"allow\" must be an array of strings");
      allow.push_back(e.get<std::string>());
    }
  }
  if (auto e = read_string(j, "socket", out.socket)) return e;
  if (auto it = j.find("allow_uid"); it != j.end()) {
    if (!it->is_array()) return invalid("\"allow_uid\" must be an array of uids");
    auto& uids = out.allow_uid.emplace();
    for (const auto& u : *it) {
      if (!u.is_number_unsigned() || u.get<std::uint64_t>() > 0xfffffffeULL)
        return invalid("\"allow_uid\" must be an array of uids");
      uids.push_back(u.get<std::uint64_t>());
    }
  }
  if (auto e = read_string(j, "hosts_file", out.hosts_file)) return e;
  if (out.hosts_file && out.hosts_file->empty()) return invalid("\"hosts_file\" is empty");
  return read_uint(j, "dns_port", 65535, out.dns_port);
}

std::optional<ErrorReply> read(const Json& j, SandboxRemoveRequest& out) {
  if (auto e = unknown_field(j, SandboxRemoveRequest::kCmd, {"name", "remove_policy"})) return e;
  if (auto e = read_name(j, SandboxRemoveRequest::kCmd, out.name)) return e;
  if (auto it = j.find("remove_policy"); it != j.end()) {
    if (!it->is_boolean()) return invalid("\"remove_policy\" must be true or false");
    out.remove_policy = it->get<bool>();
  }
  return std::nullopt;
}

std::optional<ErrorReply> read(const Json& j, SandboxListRequest&) {
  return unknown_field(j, SandboxListRequest::kCmd, {});
}

void to_json(Json& j, const SandboxAddRequest& r) {
  j = with_cmd(SandboxAddRequest::kCmd);
  j["name"] = r.name;
  if (r.netns) j["netns"] = *r.netns;
  if (r.netns_pid) j["netns_pid"] = *r.netns_pid;
  if (r.config) j["config"] = *r.config;
  if (r.phase) j["phase"] = *r.phase;
  if (r.mode) j["mode"] = std::string(to_string(*r.mode));
  if (r.allow) j["allow"] = *r.allow;
  if (r.socket) j["socket"] = *r.socket;
  if (r.allow_uid) j["allow_uid"] = *r.allow_uid;
  if (r.dns_port) j["dns_port"] = *r.dns_port;
  if (r.hosts_file) j["hosts_file"] = *r.hosts_file;
}

void to_json(Json& j, const SandboxRemoveRequest& r) {
  j = with_cmd(SandboxRemoveRequest::kCmd);
  j["name"] = r.name;
  if (r.remove_policy) j["remove_policy"] = *r.remove_policy;
}

void to_json(Json& j, const SandboxListRequest&) { j = with_cmd(SandboxListRequest::kCmd); }

void to_json(Json& j, const PingRequest&) { j = with_cmd(PingRequest::kCmd); }
void to_json(Json& j, const StatusRequest&) { j = with_cmd(StatusRequest::kCmd); }
void to_json(Json& j, const CapabilitiesRequest&) { j = with_cmd(CapabilitiesRequest::kCmd); }
void to_json(Json& j, const RulesRequest&) { j = with_cmd(RulesRequest::kCmd); }
void to_json(Json& j, const MetricsRequest&) { j = with_cmd(MetricsRequest::kCmd); }

void to_json(Json& j, const ApplyRequest& r) {
  j = with_cmd(ApplyRequest::kCmd);
  if (r.phase) j["phase"] = *r.phase;
  if (r.mode) j["mode"] = std::string(to_string(*r.mode));
  if (r.allow) j["allow"] = *r.allow;
}

void to_json(Json& j, const ExplainRequest& r) {
  j = with_cmd(ExplainRequest::kCmd);
  j["target"] = r.target;
  if (r.phase) j["phase"] = *r.phase;
}

void to_json(Json& j, const DeniedRequest& r) {
  j = with_cmd(DeniedRequest::kCmd);
  if (r.since) j["since"] = *r.since;
  if (r.limit) j["limit"] = *r.limit;
  if (r.wait_ms) j["wait_ms"] = *r.wait_ms;
}

void to_json(Json& j, const HostsRequest& r) {
  j = with_cmd(HostsRequest::kCmd);
  if (r.phase) j["phase"] = *r.phase;
}

}  // namespace egressd::control
