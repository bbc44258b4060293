// The control commands of a Sandbox: the table from command to handler, and
// the handlers that take a decoded request (control/protocol.h checked its
// fields) to the sandbox's work. `explain` is in sandbox_explain.cc, `denied`
// and `hosts` in sandbox_audit.cc.
#include <cassert>

#include "control/protocol.h"
#include "daemon/sandbox.h"

namespace egressd::daemon {

using nlohmann::json;
namespace control = egressd::control;

control::Dispatcher Sandbox::command_table() {
  control::Dispatcher d;
  d.add<control::PingRequest>([](const control::PingRequest&, control::Reply reply) {
    reply(control::ok_reply());
  });
  d.add<control::StatusRequest>([this](const control::StatusRequest&, control::Reply reply) {
    status([reply](json j) { reply(control::ok_reply(std::move(j))); });
  });
  d.add<control::CapabilitiesRequest>([this](const control::CapabilitiesRequest&, control::Reply reply) {
    reply(control::ok_reply(json(control::CapabilitiesReply{caps_.to_json().get<std::map<std::string, bool>>()})));
  });
  d.add<control::ApplyRequest>(
      [this](const control::ApplyRequest& req, control::Reply reply) { apply(req, std::move(reply)); });
  d.add<control::ExplainRequest>(
      [this](const control::ExplainRequest& req, control::Reply reply) { reply(explain_reply(req)); });
  d.add<control::DeniedRequest>(
      [this](const control::DeniedRequest& req, control::Reply reply) { denied_request(req, std::move(reply)); });
  d.add<control::HostsRequest>(
      [this](const control::HostsRequest& req, control::Reply reply) { reply(hosts_reply(req)); });
  d.add<control::RulesRequest>([this](const control::RulesRequest&, control::Reply reply) { rules(std::move(reply)); });
  d.add<control::MetricsRequest>([this](const control::MetricsRequest&, control::Reply reply) {
    metrics_text([reply](std::string text) { reply(control::ok_reply({{"text", std::move(text)}})); });
  });
  return d;
}

void Sandbox::handle(const json& req, std::function<void(json)> reply_to) {
  std::string cmd;
  if (req.is_object()) {
    if (auto it = req.find("cmd"); it != req.end() && it->is_string()) cmd = it->get<std::string>();
  }
  // Every reply is counted (metrics) on its way out, whenever it goes.
  commands_.handle(req, [this, label = request_label(cmd), inner = std::move(reply_to)](json r) {
    count_request(label, r);
    inner(std::move(r));
  });
}

json Sandbox::handle(const json& req) {
  std::optional<json> out;
  handle(req, [&](json r) { out = std::move(r); });
  assert(out.has_value() && "request did not complete synchronously");
  return out ? *out : control::error_reply("internal", "request did not complete");
}

json Sandbox::unknown_phase_reply(const std::string& name) const {
  std::string names;
  for (const auto& p : opts_.policy.phases) names += (names.empty() ? "" : ", ") + p.name;
  return control::error_reply("unknown_phase", "unknown phase \"" + name + "\" (phases: " + names + ")");
}

// Everything is validated here, before any kernel or DNS work is queued.
void Sandbox::apply(const control::ApplyRequest& req, control::Reply reply) {
  if (req.phase) {
    const Phase* ph = opts_.policy.find(*req.phase);
    if (ph == nullptr) return reply(unknown_phase_reply(*req.phase));
    if (auto s = check_capabilities(*ph, caps_); !s) return reply(control::error_reply(s.error(), "invalid_policy"));
    // Aliasing pointer with no owner: the policy outlives every job.
    return enqueue_apply(
        {std::shared_ptr<const Phase>(std::shared_ptr<const Phase>{}, ph), false, std::move(reply), nullptr});
  }
  assert(req.mode.has_value() && "a decoded apply names a phase or a mode");
  auto ph = make_inline_phase("inline", *req.mode, req.allow.value_or(std::vector<std::string>{}));
  if (!ph) return reply(control::error_reply(ph.error(), "invalid_policy"));
  if (auto s = check_capabilities(*ph, caps_); !s) return reply(control::error_reply(s.error(), "invalid_policy"));
  enqueue_apply({std::make_shared<const Phase>(std::move(*ph)), true, std::move(reply), nullptr});
}

}  // namespace egressd::daemon
