#include "pin/verdict.h"

namespace egressd::pin {

std::optional<std::string> normalize_name(std::string_view raw) {
  if (!raw.empty() && raw.back() == '.') raw.remove_suffix(1);
  if (raw.empty() || raw.size() > 253) return std::nullopt;
  std::string out;
  out.reserve(raw.size());
  std::size_t label = 0;
  for (char c : raw) {
    if (c == '.') {
      if (label == 0) return std::nullopt;
      label = 0;
      out.push_back(c);
      continue;
    }
    if (c >= 'A' && c <= 'Z') {
      c = static_cast<char>(c - 'A' + 'a');
    } else if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_')) {
      return std::nullopt;
    }
    if (++label > 63) return std::nullopt;
    out.push_back(c);
  }
  if (label == 0) return std::nullopt;
  return out;
}

}  // namespace egressd::pin
