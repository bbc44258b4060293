#include "daemon/inline_state.h"

#include <nlohmann/json.hpp>
#include <exception>
#include <optional>
#include <vector>

namespace egressd::daemon {

using nlohmann::json;

std::string encode_inline_state(std::uint64_t generation, const Phase& phase, std::string_view table) {
  json entries = json::array();
  for (const auto& e : phase.entries) entries.push_back(e.text);
  const json j{{"generation", generation}, {"mode", to_string(phase.mode)}, {"allow", entries},
               {"table", std::string(table)}};
  return j.dump() + "\n";
}

Result<Phase> decode_inline_state(std::string_view text, std::uint64_t generation, std::string_view table) {
  // Checked in this order, each field read only once the earlier ones
  // passed: what a file of another generation holds does not matter.
  std::optional<Mode> mode;
  std::vector<std::string> allow;
  try {
    const json j = json::parse(text.begin(), text.end());
    // A file of another generation belongs to an earlier inline policy: the
    // table changed after it was written (the write failed, or egressd
    // stopped before it ran), so its entries are not the ones in force.
    // A file of another table (found by an attack review): one removed
    // since (--cleanup-on-exit, `sandbox remove --remove-policy`, another
    // namespace behind the same socket path) whose generation the new
    // table reached, its last write lost to a kill right after the reply.
    const auto saved = j.at("generation").get<std::uint64_t>();
    const auto it = j.find("table");
    if (it == j.end() || !it->is_string() || it->get<std::string>() != table) {
      return Error::invalid("not adopted: saved for another table (one removed since, or an older egressd's)");
    }
    if (saved != generation) {
      return Error::invalid("not adopted: saved for generation " + std::to_string(saved) + ", the table's is " +
                            std::to_string(generation));
    }
    const auto mode_text = j.at("mode").get<std::string>();
    mode = parse_mode(mode_text);
    // Quoted as JSON: the file's text reaches the log escaped.
    if (!mode) return Error::invalid("not adopted: unknown mode " + json(mode_text).dump());
    allow = j.at("allow").get<std::vector<std::string>>();
  } catch (const std::exception& e) {
    return Error::invalid(std::string("unreadable: ") + e.what());
  }
  auto ph = make_inline_phase("inline", *mode, allow);
  if (!ph) return ph.error().wrap("not adopted");
  return ph;
}

}  // namespace egressd::daemon
