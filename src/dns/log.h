// The DNS module's logger, "dns" (see egressd/module_logger.h).
#pragma once

#include "egressd/module_logger.h"

namespace egressd::dns {

inline std::shared_ptr<spdlog::logger> dns_logger() { return module_logger("dns"); }

}  // namespace egressd::dns
