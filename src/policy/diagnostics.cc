// Shared wording of the policy readers; see diagnostics.h.
#include "policy/diagnostics.h"

#include <algorithm>
#include <cctype>

namespace egressd::policy_detail {

namespace {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      out += '?';  // keep messages one line; the position points at the culprit
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

std::string did_you_mean(std::string_view got, const std::vector<std::string_view>& candidates) {
  const std::string_view best = nearest(got, candidates);
  if (best.empty()) return {};
  return " (did you mean " + quote(best) + "?)";
}

std::string_view nearest(std::string_view got, const std::vector<std::string_view>& candidates) {
  // A long key costs length^2 here; nothing that long is a near miss of a short name.
  if (got.size() > 64) return {};
  const std::string low = lower(got);
  std::string_view best;
  std::size_t best_d = 3;  // suggest only within 2 edits
  for (std::string_view c : candidates) {
    const std::size_t d = edit_distance(low, c);
    if (d < best_d && c != got) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::string did_you_mean(std::string_view got, std::initializer_list<std::string_view> candidates) {
  return did_you_mean(got, std::vector<std::string_view>(candidates));
}

std::string join(std::initializer_list<std::string_view> words) {
  return join(std::vector<std::string_view>(words));
}

std::string join(const std::vector<std::string_view>& words) {
  std::string out;
  for (std::string_view w : words) {
    if (!out.empty()) out += ", ";
    out += w;
  }
  return out;
}

bool is_network_key(std::string_view key, const std::vector<std::string_view>& known) {
  return contains_word(key, {"network", "allow", "host", "internet", "egress", "deny", "block"}) ||
         is_near_key(key, known);
}

bool contains_word(std::string_view key, std::initializer_list<std::string_view> words) {
  const std::string low = lower(key);
  for (std::string_view word : words) {
    if (low.find(word) != std::string::npos) return true;
  }
  return false;
}

bool is_near_key(std::string_view key, const std::vector<std::string_view>& known) {
  if (key.size() > 64) return false;  // edit_distance costs length^2
  const std::string low = lower(key);
  for (std::string_view k : known) {
    if (edit_distance(low, k) <= 2) return true;
  }
  return false;
}

bool is_mode_word(std::string_view value) {
  const std::string low = lower(value);
  return low == "public" || low == "no-network" || low == "allowlist";
}

}  // namespace egressd::policy_detail
