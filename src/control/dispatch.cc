#include "control/dispatch.h"

namespace egressd::control {

void Dispatcher::handle(const nlohmann::json& request, Reply reply) const {
  if (auto err = check_envelope(request)) return reply(nlohmann::json(*err));
  const std::string cmd = request["cmd"].get<std::string>();
  auto it = table_.find(cmd);
  if (it == table_.end()) {
    std::string names;
    for (const auto& n : names_) names += (names.empty() ? "" : ", ") + n;
    return reply(error_reply("unknown_command", "unknown command \"" + cmd + "\" (commands: " + names + ")"));
  }
  it->second(request, std::move(reply));
}

}  // namespace egressd::control
