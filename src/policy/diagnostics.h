// Wording shared by the policy readers (policy_file.cc, harbor_task.cc): how a value is
// quoted in a message, "did you mean", and which unknown keys are about the network.
// Internal to src/policy.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace egressd::policy_detail {

// s in double quotes, control bytes shown as '?', so a message stays one line.
std::string quote(std::string_view s);

// " (did you mean "x"?)" when `got` is within 2 edits of a candidate (case differences
// count as near: "Allowlist" -> "allowlist"); else empty.
std::string did_you_mean(std::string_view got, const std::vector<std::string_view>& candidates);
std::string did_you_mean(std::string_view got, std::initializer_list<std::string_view> candidates);

// The candidate did_you_mean would suggest, or empty: for messages that show it in their own
// form ("did you mean [environment]?").
std::string_view nearest(std::string_view got, const std::vector<std::string_view>& candidates);

// The network modes, as error messages list them.
inline constexpr std::string_view kModes = "public, no-network, allowlist";

// "a, b, c".
std::string join(const std::vector<std::string_view>& words);
std::string join(std::initializer_list<std::string_view> words);

// True for a key that is about network access but is not one the reader knows: it
// contains network, allow, host, internet, egress, deny or block (any case), or is within
// 2 edits of one of `known`. A harness ignores keys it does not know, so a typo there
// ("network_mod") silently leaves the phase open; egressd refuses such a key instead,
// while other keys of the harness's file (timeouts, resources) are none of its business.
bool is_network_key(std::string_view key, const std::vector<std::string_view>& known);

// True for a key within 2 edits of one of `known` (any case): the narrower test, for tables
// whose keys are someone else's (a table egressd does not read), where "host" or "allow"
// in a key says nothing.
bool is_near_key(std::string_view key, const std::vector<std::string_view>& known);

// True when `key` contains one of `words` (lower-case), in any case.
bool contains_word(std::string_view key, std::initializer_list<std::string_view> words);

// True for a network mode word in any case ("public", "No-Network"): an unknown key whose
// value is one is about the network whatever its name ("mode = \"no-network\"").
bool is_mode_word(std::string_view value);

}  // namespace egressd::policy_detail
