#include "control/audit_view.h"


#include "audit/suggest.h"
#include "control/reply_text.h"

namespace egressd::control {

namespace {

using nlohmann::json;

std::string str(const json& o, const char* key) {
  if (!o.is_object() || !o.contains(key) || o[key].is_null()) return "-";
  const json& v = o[key];
  return v.is_string() ? audit::printable(v.get<std::string>()) : v.dump();
}

std::string names_of(const json& o) {
  std::string out;
  if (!o.is_object() || !o.contains("names") || !o["names"].is_array()) return out;
  for (const auto& n : o["names"]) {
    if (!n.is_string()) continue;
    out += (out.empty() ? "" : ", ") + audit::printable(n.get<std::string>());
  }
  return out;
}

// A sentence with words from the sandbox in it (a pinning reason): each word
// escaped, the spaces between them kept.
std::string printable_words(const std::string& text) {
  std::string out, word;
  for (char c : text) {
    if (c == ' ') {
      out += audit::printable(word) + ' ';
      word.clear();
    } else {
      word += c;
    }
  }
  return out + audit::printable(word);
}

}  // namespace

std::string denied_line(const json& r) {
  std::string line = str(r, "time") + "  " + str(r, "phase") + "  ";
  if (str(r, "kind") == "dns") {
    line += "dns query refused: " + names_of(r);
  } else {
    const std::string dst = str(r, "dst");
    const bool v6 = dst.find(':') != std::string::npos;
    line += str(r, "proto") + " ";
    if (r.contains("port") && r["port"].is_number()) {
      line += (v6 ? "[" + dst + "]" : dst) + ":" + str(r, "port");
    } else {
      line += dst;
    }
  }
  line += "  x" + str(r, "count");
  // A flow hostname pinning reset: its reason names the name presented and the
  // names the address was learned for, which `names` alone does not (it lists
  // only the latter, so the line would read as if the allowed name was refused).
  if (r.is_object() && r.contains("pin") && r["pin"].is_string() && !r["pin"].get<std::string>().empty()) {
    line += "  reset by pinning: " + printable_words(r["pin"].get<std::string>());
    return line;
  }
  if (str(r, "kind") != "dns") {
    const std::string n = names_of(r);
    line += n.empty() ? "  (no name resolved to it through egressd)" : "  names: " + n;
  }
  return line;
}

std::string hosts_table(const json& hosts) {
  std::vector<std::vector<std::string>> rows = {{"PHASE", "NAME", "RESOLVED", "REFUSED", "ADDRESSES"}};
  if (hosts.is_array()) {
    for (const auto& h : hosts) {
      std::string addrs;
      if (h.contains("addresses") && h["addresses"].is_array()) {
        for (const auto& a : h["addresses"]) {
          // Appended piece by piece: `"..." + tmp` trips g++ 12's -Wrestrict false positive
          // (GCC PR 105329) at -O3, which fails the release build.
          if (!addrs.empty()) addrs += ' ';
          addrs += a.is_string() ? a.get<std::string>() : a.dump();
        }
      }
      rows.push_back({str(h, "phase"), str(h, "name"), str(h, "resolved"), str(h, "refused"), addrs.empty() ? "-" : addrs});
    }
  }
  return table(rows);
}

std::vector<std::string> resolved_names(const json& hosts, const std::string& phase) {
  std::vector<std::string> out;
  if (!hosts.is_array()) return out;
  for (const auto& h : hosts) {
    if (!h.is_object() || !h.contains("name") || !h["name"].is_string()) continue;
    if (!phase.empty() && h.value("phase", "") != phase) continue;
    if (!h.contains("resolved") || !h["resolved"].is_number_unsigned() || h["resolved"].get<std::uint64_t>() == 0) continue;
    out.push_back(h["name"].get<std::string>());
  }
  return out;
}

}  // namespace egressd::control
