// Precompiled for the daemon layer's unit test program (tests/meson.build): the standard,
// doctest, Boost.Asio and daemon headers its thirteen files share, parsed once instead of
// once per file (clang, the sanitizer tree: the program's compile 67 s -> 56 s, the header
// 4 s of it). Nothing here may be needed for a file to compile: every file includes what it
// uses.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <spdlog/spdlog.h>

#include "daemon/sandbox.h"
