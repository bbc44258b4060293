#include "harbor/harbor.h"

#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "control/protocol.h"
#include "control/reply_text.h"

namespace egressd::harbor {

using Json = nlohmann::json;
using control::field;
using control::text;

namespace {

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string plural(std::size_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

}  // namespace

std::vector<std::string> split_blanks(std::string_view s) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && is_blank(s[i])) ++i;
    const std::size_t start = i;
    while (i < s.size() && !is_blank(s[i])) ++i;
    if (i > start) out.emplace_back(s.substr(start, i - start));
  }
  return out;
}

Result<EntrypointPlan> plan_entrypoint(const char* mode_env, const char* hosts_env) {
  EntrypointPlan plan;
  plan.mode = (mode_env == nullptr || *mode_env == '\0') ? "public" : mode_env;
  if (plan.mode != "public" && plan.mode != "no-network" && plan.mode != "allowlist") {
    return Error::invalid(std::string("invalid ") + kModeEnv + ": " + plan.mode);
  }
  std::vector<std::string> hosts = split_blanks(hosts_env == nullptr ? "" : hosts_env);
  if (plan.mode == "allowlist") {
    plan.hosts = std::move(hosts);
  } else if (!hosts.empty()) {
    // Harbor's entrypoint.sh reads the hosts only for allowlist; say so instead of silently.
    plan.notes.push_back(std::string(kHostsEnv) + " ignored: " + kModeEnv + " is " + plan.mode);
  }
  return plan;
}

bool can_bind_port_53(std::string_view cap_eff_hex, int unprivileged_port_start) {
  constexpr int kCapNetBindService = 10;  // <linux/capability.h>
  if (unprivileged_port_start <= 53) return true;
  unsigned long long mask = 0;
  const std::string hex(cap_eff_hex);
  char* end = nullptr;
  mask = std::strtoull(hex.c_str(), &end, 16);
  if (end == hex.c_str()) return false;
  return (mask >> kCapNetBindService) & 1u;
}

std::vector<std::string> egressd_run_argv(const std::string& egressd, const EntrypointPlan& plan,
                                          const std::string& socket, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {egressd, "run", "--socket", socket, "--phase", plan.mode, "--ready-file",
                                   kReadyFile};
  for (const auto& h : plan.hosts) {
    // `--allow=VALUE` keeps an entry that starts with '-' from being read as an option.
    argv.push_back("--allow=" + h);
  }
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

Json apply_request(Verb verb, const std::vector<std::string>& targets) {
  control::ApplyRequest req;
  switch (verb) {
    case Verb::allow_all:
      req.mode = Mode::public_;
      break;
    case Verb::deny_all:
      req.mode = Mode::no_network;
      break;
    case Verb::allow:
      req.mode = Mode::allowlist;
      req.allow = targets;
      break;
  }
  return req;
}

std::string describe_apply(const Json& r) {
  const std::string mode = field(r, "mode");
  std::string line = "egress policy: " + mode;
  if (mode == "allowlist") {
    std::size_t n = 0;
    if (r.contains("entries") && r["entries"].is_object()) {
      for (const auto& [kind, count] : r["entries"].items()) {
        if (count.is_number_unsigned()) n += count.get<std::size_t>();
      }
    }
    line += n == 0 ? ", no entries: all egress denied" : ", " + plural(n, "entry", "entries");
  }
  line += " (generation " + field(r, "generation");
  if (auto ms = control::duration_ms(r)) line += ", " + *ms + " ms";
  line += ")\n";
  // Exact names the switch could not resolve: still allowed, learned when the sandbox asks.
  if (r.contains("unresolved") && r["unresolved"].is_array() && !r["unresolved"].empty()) {
    line += "unresolved: " + control::join(r["unresolved"], ", ") + " (allowed; reachable once they resolve)\n";
  }
  return line;
}

std::string describe_status(const Json& r) {
  const Json counters = r.value("counters", Json::object());
  std::string out;
  out += "mode:        " + field(r, "mode") + "\n";
  out += "phase:       " + field(r, "phase") + "\n";
  out += "generation:  " + field(r, "generation") + "\n";
  out += "allowed:     " + control::traffic(counters, "allowed") + "\n";
  out += "denied:      " + control::traffic(counters, "denied") + "\n";
  const Json entries = r.value("entries", Json::array());
  if (!entries.is_array() || entries.empty()) {
    out += std::string("entries:     none") + (field(r, "mode") == "allowlist" ? " (all egress denied)" : "") + "\n";
  } else {
    std::size_t width = 0;
    for (const auto& e : entries) width = std::max(width, field(e, "entry").size());
    out += "entries:\n";
    for (const auto& e : entries) {
      const std::string entry = field(e, "entry");
      out += "  " + entry + std::string(width - entry.size() + 2, ' ') + field(e, "kind") + " (" +
             field(e, "state") + ")\n";
    }
  }
  // Addresses the DNS proxy learned for allowed names, as `egressctl status` lists them.
  const Json learned = r.value("learned", Json::array());
  if (learned.is_array() && !learned.empty()) {
    out += "learned:\n";
    for (const auto& l : learned) {
      std::string addrs;
      for (const auto& a : l.value("addresses", Json::array())) {
        addrs += (addrs.empty() ? "" : ", ") + field(a, "address") + " (" + field(a, "expires_in_s") + " s)";
      }
      out += "  " + field(l, "name") + "  " + addrs + "\n";
    }
  }
  return out;
}

namespace {

// Unary file and string operators of test(1).
bool is_unary(const std::string& op) {
  static const char* const ops[] = {"-e", "-f", "-d", "-s", "-r", "-w", "-x", "-L", "-h", "-S", "-p", "-n", "-z"};
  return std::any_of(std::begin(ops), std::end(ops), [&](const char* o) { return op == o; });
}

bool is_binary(const std::string& op) {
  static const char* const ops[] = {"=", "!=", "-eq", "-ne", "-lt", "-le", "-gt", "-ge"};
  return std::any_of(std::begin(ops), std::end(ops), [&](const char* o) { return op == o; });
}

bool unary(const std::string& op, const std::string& arg) {
  if (op == "-n") return !arg.empty();
  if (op == "-z") return arg.empty();
  struct stat st {};
  if (op == "-L" || op == "-h") return ::lstat(arg.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
  if (op == "-r" || op == "-w" || op == "-x") {
    const int mode = op == "-r" ? R_OK : op == "-w" ? W_OK : X_OK;
    return ::faccessat(AT_FDCWD, arg.c_str(), mode, AT_EACCESS) == 0;
  }
  if (::stat(arg.c_str(), &st) != 0) return false;
  if (op == "-e") return true;
  if (op == "-f") return S_ISREG(st.st_mode);
  if (op == "-d") return S_ISDIR(st.st_mode);
  if (op == "-s") return st.st_size > 0;
  if (op == "-S") return S_ISSOCK(st.st_mode);
  if (op == "-p") return S_ISFIFO(st.st_mode);
  return false;
}

std::optional<long long> integer(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && is_blank(s[b])) ++b;
  while (e > b && is_blank(s[e - 1])) --e;
  const std::string t = s.substr(b, e - b);
  if (t.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(t.c_str(), &end, 10);
  if (errno != 0 || end != t.c_str() + t.size()) return std::nullopt;
  return v;
}

// Returns 0/1, or 2 with *err set.
int binary(const std::string& a, const std::string& op, const std::string& b, std::string* err) {
  if (op == "=") return a == b ? 0 : 1;
  if (op == "!=") return a != b ? 0 : 1;
  const auto x = integer(a), y = integer(b);
  if (!x || !y) {
    *err = (x ? b : a) + ": integer expression expected";
    return 2;
  }
  bool r = false;
  if (op == "-eq") r = *x == *y;
  if (op == "-ne") r = *x != *y;
  if (op == "-lt") r = *x < *y;
  if (op == "-le") r = *x <= *y;
  if (op == "-gt") r = *x > *y;
  if (op == "-ge") r = *x >= *y;
  return r ? 0 : 1;
}

int negate(int r) { return r == 2 ? 2 : 1 - r; }

// POSIX's rules by argument count (XCU test, "Application usage" algorithm).
int evaluate(const std::vector<std::string>& a, std::string* err) {
  switch (a.size()) {
    case 0:
      return 1;
    case 1:
      return a[0].empty() ? 1 : 0;
    case 2:
      if (a[0] == "!") return a[1].empty() ? 0 : 1;
      if (is_unary(a[0])) return unary(a[0], a[1]) ? 0 : 1;
      *err = a[0] + ": unary operator expected";
      return 2;
    case 3:
      if (is_binary(a[1])) return binary(a[0], a[1], a[2], err);
      if (a[0] == "!") return negate(evaluate({a[1], a[2]}, err));
      if (a[0] == "(" && a[2] == ")") return evaluate({a[1]}, err);
      *err = a[1] + ": binary operator expected";
      return 2;
    case 4:
      if (a[0] == "!") return negate(evaluate({a[1], a[2], a[3]}, err));
      if (a[0] == "(" && a[3] == ")") return evaluate({a[1], a[2]}, err);
      [[fallthrough]];
    default:
      *err = "too many arguments (this test supports the POSIX forms of up to four arguments)";
      return 2;
  }
}

}  // namespace

int eval_test(std::vector<std::string> args, bool bracket, std::string* err) {
  if (bracket) {
    if (args.empty() || args.back() != "]") {
      *err = "missing ]";
      return 2;
    }
    args.pop_back();
  }
  return evaluate(args, err);
}

Result<std::vector<std::string>> parse_simple_command(std::string_view s) {
  auto refuse = [](const std::string& what) -> Error {
    return Error::invalid(what + " needs a shell, and this image has none (only `sh -c 'COMMAND ARG...'` with " +
                          "plain words is supported)");
  };
  std::vector<std::string> words;
  std::string word, unquoted;  // the word, and the characters of it that were not quoted
  bool in_word = false;
  auto finish = [&]() -> Status {
    if (!in_word) return {};
    // Anything a real shell would give a meaning to is refused rather than run as something else.
    for (const char c : unquoted) {
      if (std::string_view("$`\\|;&<>(){}*?~").find(c) != std::string_view::npos)
        return refuse(std::string("'") + c + "'");
    }
    const bool first = words.empty();
    if (!unquoted.empty() && unquoted[0] == '#') return refuse("a comment");
    if (unquoted.find('[') != std::string::npos && unquoted != "[") return refuse("a glob");
    if (first && unquoted.find('=') != std::string::npos) return refuse("a variable assignment");
    if (first && unquoted == "!") return refuse("'!'");
    words.push_back(std::move(word));
    word.clear();
    unquoted.clear();
    in_word = false;
    return {};
  };
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (is_blank(c)) {
      if (auto st = finish(); !st) return st.error();
      continue;
    }
    in_word = true;
    if (c == '\'' || c == '"') {
      const std::size_t close = s.find(c, i + 1);
      if (close == std::string_view::npos) return Error::invalid(std::string("unterminated ") + c + " quote");
      const std::string_view quoted = s.substr(i + 1, close - i - 1);
      if (c == '"' && quoted.find_first_of("$`\\") != std::string_view::npos) return refuse("expansion inside \"...\"");
      word.append(quoted);
      i = close;
      continue;
    }
    word.push_back(c);
    unquoted.push_back(c);
  }
  if (auto st = finish(); !st) return st.error();
  if (words.empty()) return Error::invalid("empty command");
  return words;
}

}  // namespace egressd::harbor
