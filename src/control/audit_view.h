// How egressctl shows `denied` records and `hosts` for people, and the
// `hosts --suggest` list. Pure functions over the reply JSON (docs/protocol.md).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace egressd::control {

// One line for a denied record (no trailing newline), e.g.
// "2026-11-30T20:18:07.123Z  agent  tcp 192.0.2.1:443  x3  names: pypi.org"
// "2026-11-30T20:18:07.123Z  agent  dns query refused: evil.example  x1",
// "...  agent  tcp 203.0.113.10:443  x1  reset by pinning: tls sni same-ip.test
// to 203.0.113.10:443; address learned for allowed.test" (a pinning reset).
// Names are escaped (audit::printable): they come from the sandbox.
std::string denied_line(const nlohmann::json& record);

// The `hosts` table: PHASE NAME RESOLVED REFUSED ADDRESSES, one row per entry.
std::string hosts_table(const nlohmann::json& hosts);

// Names with at least one answer (resolved > 0), of every phase or of `phase`.
std::vector<std::string> resolved_names(const nlohmann::json& hosts, const std::string& phase = "");

}  // namespace egressd::control
