#include "egressd/result.h"

#include <cstring>

namespace egressd {

std::string errno_text(int err) { return std::strerror(err); }

Error errno_error(const std::string& what, int err) { return Error::runtime(what + ": " + errno_text(err)); }

}  // namespace egressd
