// One named spdlog logger per module ("sandbox", "dns", "control", "tamper",
// "audit"). The daemon registers them all in setup_logging(); when it has not
// (unit tests, fuzz targets, the offline tools), the module's logger is cloned
// from the default one, so lines still carry the module's name, sinks, level
// and format.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace egressd {

inline std::shared_ptr<spdlog::logger> module_logger(const std::string& name) {
  if (auto l = spdlog::get(name)) return l;
  auto l = spdlog::default_logger()->clone(name);
  try {
    spdlog::register_logger(l);
  } catch (const spdlog::spdlog_ex&) {
    // Registered by someone else in between: use theirs.
    if (auto other = spdlog::get(name)) return other;
  }
  return l;
}

}  // namespace egressd
