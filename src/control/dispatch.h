// The table from command name to handler. Each entry decodes its request
// type (control/protocol.h) and hands the typed request to its handler; a
// request that does not decode gets the error naming the culprit without
// reaching the handler. Adding a command is one add<>() plus its handler.
#pragma once

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "control/protocol.h"

namespace egressd::control {

class Dispatcher {
 public:
  // Registers `handler` for Req::kCmd (once per command; a second add<> of the
  // same command replaces the handler). `handler` calls its Reply exactly once.
  template <class Req>
  void add(std::function<void(const Req&, Reply)> handler) {
    auto [it, fresh] = table_.insert_or_assign(
        Req::kCmd, [h = std::move(handler)](const nlohmann::json& request, Reply reply) {
          auto req = decode<Req>(request);
          if (auto* err = std::get_if<ErrorReply>(&req)) return reply(nlohmann::json(*err));
          h(std::get<Req>(req), std::move(reply));
        });
    if (fresh) names_.push_back(it->first);
  }

  // Routes one request: an object without a string "cmd" is invalid_request,
  // a command not in the table unknown_command (the message lists the table).
  void handle(const nlohmann::json& request, Reply reply) const;

  // The commands, in the order they were added.
  const std::vector<std::string>& commands() const { return names_; }

 private:
  std::map<std::string, std::function<void(const nlohmann::json&, Reply)>> table_;
  std::vector<std::string> names_;
};

}  // namespace egressd::control
