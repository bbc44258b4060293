// Harbor's task.toml as an egressd policy (DESIGN §3 "Policy inputs"), parsed with toml++.
//
// The rules below restate Harbor's task-config model (TaskConfig, EnvironmentConfig,
// AgentConfig, VerifierConfig, StepConfig; task.toml schema 1.4) and its trial network-plan
// resolution, as read in Harbor's public source and docs (see the commit that added this
// file); nothing here is Harbor's code:
//  - [environment] is the baseline, in force from environment start: network_mode (default
//    public) and allowed_hosts. The deprecated allow_internet decides it (true: public,
//    false: no-network) only when neither network_mode nor allowed_hosts is set there.
//  - [agent] and [verifier] override the baseline for agent.run() and verify() when they
//    set network_mode; without it they inherit. allowed_hosts needs network_mode
//    "allowlist" beside it; an allowlist with no hosts denies all egress.
//  - A separate verifier (environment_mode = "separate", or a [verifier.environment] table
//    without environment_mode) starts from [verifier.environment]'s baseline, or from a
//    copy of [environment] when that table is absent; [verifier] still overrides it.
//  - Each [[steps]] entry (name required) runs its own agent and verifier phases: the
//    step's [steps.agent]/[steps.verifier] override when they set network_mode, else the
//    task's [agent]/[verifier] override, else the baseline; a step's verifier may be
//    separate too ([steps.verifier] environment_mode / environment, falling back to the
//    task's verifier settings).
// Where egressd is stricter than Harbor it refuses rather than guesses: a key that is about
// the network but unknown in its table ("network_mod", allow_internet under [agent],
// network_mode at the top level, mode = "no-network" under [agent]) is an error, since Harbor would silently ignore it and
// leave the phase more open than its author meant; so is a network key in a table it does
// not read ("[enviroment]", "[Agent]", "[steps.agnet]"). Every other key is ignored.
//
// Over 500 lines because the inheritance rules above (baseline, overrides,
// separate verifiers, steps) are resolved in one pass with file:line:col
// errors for each key; they are one model and read best as one file.
#include <toml++/toml.h>

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <utility>

#include "egressd/policy_input.h"
#include "policy/diagnostics.h"

namespace egressd {

namespace {

using policy_detail::contains_word;
using policy_detail::did_you_mean;
using policy_detail::is_near_key;
using policy_detail::is_mode_word;
using policy_detail::is_network_key;
using policy_detail::kModes;
using policy_detail::join;
using policy_detail::quote;

// The network keys of a phase table ([agent], [verifier], [steps.*]) and of a baseline
// table ([environment], [verifier.environment]).
const std::vector<std::string_view> kPhaseKeys = {"network_mode", "allowed_hosts"};
const std::vector<std::string_view> kBaselineKeys = {"network_mode", "allowed_hosts", "allow_internet"};

// The tables read above, as dotted paths ([[steps]] entries as "steps"): any other table
// that holds a network key is a typo Harbor would ignore ("[enviroment]", "[steps.agnet]").
const std::vector<std::string_view> kReadTables = {
    "environment", "agent", "verifier", "verifier.environment",
    "steps", "steps.agent", "steps.verifier", "steps.verifier.environment"};

std::string_view type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::date:
    case toml::node_type::time:
    case toml::node_type::date_time: return "a date/time";
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    case toml::node_type::none: break;
  }
  return "nothing";
}

// The position (1-based line and column, columns in code points as toml++ counts them)
// of the first byte >= 0x80 outside a string or comment, or right after a backslash (and
// its blanks) in a multi-line basic string, if any.
//
// Why: toml++ 3.3.0 (Debian 12's libtomlplusplus) reaches __builtin_unreachable(), that
// is undefined behaviour, when a code point such as U+00E9 stands where it reads a key
// (its table of Unicode whitespace has no case for U+00A1..U+0499; found by
// harbor_task_fuzz, tests/fuzz/corpus/harbor_task/regress-non-ascii-bare-key holds the
// input). TOML allows non-ASCII only inside strings and comments, so such a file is
// invalid anyway; reporting it here keeps it from ever reaching the parser.
std::optional<std::pair<std::size_t, std::size_t>> non_ascii_outside_strings(std::string_view t) {
  enum class In { code, comment, basic, literal, ml_basic, ml_literal } in = In::code;
  std::size_t line = 1, col = 0;
  // The last character of the line outside strings and blanks ('\n' at a line's start). A
  // quote opens a string only where a key or value starts (line start, after = [ , { .):
  // elsewhere (a quote inside a bare value token) toml++ reads it as part of the token, and
  // so must this scan, or it would skip the very bytes toml++ then trips on.
  char prev = '\n';
  for (std::size_t i = 0; i < t.size(); ++i) {
    const auto c = static_cast<unsigned char>(t[i]);
    if (c == '\n') {
      ++line;
      col = 0;
      if (in == In::comment || in == In::basic || in == In::literal) in = In::code;
      if (in == In::code) prev = '\n';
      continue;
    }
    if ((c & 0xC0) != 0x80) ++col;  // a UTF-8 continuation byte is no new column
    const bool triple = i + 2 < t.size() && t[i + 1] == t[i] && t[i + 2] == t[i];
    switch (in) {
      case In::code: {
        if (c >= 0x80) return std::make_pair(line, col);
        const bool opens = prev == '\n' || prev == '=' || prev == '[' || prev == ',' || prev == '{' || prev == '.';
        if (c == '#') {
          in = In::comment;
        } else if ((c == '"' || c == '\'') && opens) {
          in = c == '"' ? (triple ? In::ml_basic : In::basic) : (triple ? In::ml_literal : In::literal);
          if (triple) i += 2, col += 2;
          prev = '"';  // what follows a string is no key or value start
        } else if (c != ' ' && c != '\t' && c != '\r') {
          prev = static_cast<char>(c);
        }
        break;
      }
      case In::comment: break;
      case In::basic:
        if (c == '\\') ++i, ++col;  // an escaped character, '"' included
        else if (c == '"') in = In::code;
        break;
      case In::literal:
        if (c == '\'') in = In::code;
        break;
      case In::ml_basic:
        if (c == '\\') {
          // toml++ 3.3.0 tests the character after a backslash, and after a line-ending
          // backslash every blank up to the next character, with the same faulty whitespace
          // table: a non-ASCII character there is refused too (valid TOML, but not safe to
          // hand to that parser).
          std::size_t j = i + 1;
          if (j < t.size() && (t[j] == ' ' || t[j] == '\t' || t[j] == '\r' || t[j] == '\n')) {
            while (j < t.size() && (t[j] == ' ' || t[j] == '\t' || t[j] == '\r' || t[j] == '\n')) {
              if (t[j] == '\n') ++line, col = 0;
              else ++col;
              ++j;
            }
            if (j < t.size() && static_cast<unsigned char>(t[j]) >= 0x80) return std::make_pair(line, col + 1);
            i = j - 1;
          } else if (j < t.size()) {
            if (static_cast<unsigned char>(t[j]) >= 0x80) return std::make_pair(line, col + 1);
            i = j, ++col;
          }
        } else if (c == '"' && triple) in = In::code, i += 2, col += 2;
        break;
      case In::ml_literal:
        if (c == '\'' && triple) in = In::code, i += 2, col += 2;
        break;
    }
  }
  return std::nullopt;
}

// A network policy of one phase, and the words that say where it came from.
struct PhasePolicy {
  Mode mode = Mode::public_;
  std::vector<Entry> entries;
  std::string origin;
};

// The network keys one table sets.
struct NetKeys {
  std::optional<Mode> mode;
  std::optional<std::vector<Entry>> hosts;
  std::optional<bool> allow_internet;
};

// What one [verifier] or [steps.verifier] table says about where the verifier runs.
struct VerifierPlace {
  std::optional<bool> separate;          // environment_mode, when given
  const toml::table* environment = nullptr;  // [verifier.environment], when given
  std::string environment_label;
};

class TaskReader {
 public:
  explicit TaskReader(std::string_view file) : file_(file) {}

  Result<PolicyDocument> read(std::string_view text) {
    if (const auto at = non_ascii_outside_strings(text)) {
      return Error::invalid(file_ + ":" + std::to_string(at->first) + ":" + std::to_string(at->second) +
                            ": TOML syntax error: a non-ASCII character outside a string or comment (TOML allows "
                            "them only there), or right after a backslash in a multi-line string");
    }
    // The scan above mirrors toml++'s tokenizer only as far as it can (harbor_task_fuzz found
    // a bare value with a quote inside, `= -="i.<U+FE7F>`, that it took for a string). So no
    // byte >= 0x80 reaches toml++ at all: each becomes '?', which no TOML key, bare value or
    // host name may contain. Strings and comments (where TOML allows them) keep their place;
    // egressd reads nothing but network keys, whose host names are ASCII, and a host name
    // that had one is refused by the entry validator as it would be anyway.
    std::string ascii(text);
    for (char& ch : ascii) {
      if (static_cast<unsigned char>(ch) >= 0x80) ch = '?';
    }
    toml::table root;
    try {
      root = toml::parse(ascii, std::string_view(file_));
    } catch (const toml::parse_error& e) {
      return err(e.source(), "TOML syntax error: " + std::string(e.description()));
    }
    return resolve(root);
  }

 private:
  // "<file>:<line>:<col>: <reason>", 1-based as editors count (toml++ counts so too).
  Error err(const toml::source_region& where, const std::string& reason) const {
    if (where.begin.line == 0) return Error::invalid(file_ + ": " + reason);
    return Error::invalid(file_ + ":" + std::to_string(where.begin.line) + ":" +
                          std::to_string(where.begin.column) + ": " + reason);
  }

  // An unknown key set to a mode word is about the network whatever its name: "mode =
  // \"no-network\"" under [agent] would leave the agent public. (A sub-table holding
  // network_mode is caught by check_unread_tables.)
  static bool network_by_value(const toml::node& v) {
    const auto* s = v.as_string();
    return s != nullptr && is_mode_word(s->get());
  }

  // In a phase table ([agent], [verifier], a step's), which holds no parameters of the
  // environment, a key with mode, policy or net in its name is about the network too
  // ("net_mode", "policy"). Not a sub-table: check_unread_tables looks inside those, and
  // "[steps.agnet]" is a typo of a table, not a key.
  static bool net_in_name(std::string_view k, const toml::node& v) {
    return !v.is_table() && contains_word(k, {"mode", "policy", "net"});
  }

  // Harbor's network keys of a table. `baseline` tables ([environment] and the verifier's
  // environment tables) also take allow_internet. `structural` names the keys this table
  // uses for something else (agent, verifier, steps, ...), handled by the caller; `hint`
  // ends the message for a network key the table does not take.
  Result<NetKeys> net_keys(const toml::table& t, std::string_view label, bool baseline,
                           std::initializer_list<std::string_view> structural, std::string_view hint) const {
    NetKeys out;
    const toml::source_region* hosts_at = nullptr;
    for (const auto& [key, value] : t) {
      const std::string_view k = key.str();
      if (k == "network_mode") {
        auto m = mode(value, label);
        if (!m) return m.error();
        out.mode = *m;
      } else if (k == "allowed_hosts") {
        auto h = hosts(value, label);
        if (!h) return h.error();
        out.hosts = std::move(h).value();
        hosts_at = &key.source();
      } else if (k == "allow_internet" && baseline) {
        const auto* b = value.as_boolean();
        if (b == nullptr) {
          return err(value.source(), "allow_internet in " + std::string(label) + " must be true or false, not " +
                                         std::string(type_name(value)));
        }
        out.allow_internet = b->get();
      } else {
        bool handled = false;
        for (std::string_view s : structural) handled = handled || s == k;
        if (handled) continue;
        const std::vector<std::string_view>& known = baseline ? kBaselineKeys : kPhaseKeys;
        if (k == "allow_internet") {
          return err(key.source(), "allow_internet is read only in [environment] and the verifier's environment "
                                   "table (Harbor ignores it in " + std::string(label) + "): use network_mode");
        }
        const bool by_name = is_network_key(k, known);
        if (by_name || network_by_value(value) || (!baseline && net_in_name(k, value))) {
          std::string dym = did_you_mean(k, known);
          if (dym.empty() && !by_name) dym = " (did you mean \"network_mode\"?)";
          return err(key.source(), "unknown network key " + quote(k) + " in " + std::string(label) +
                                       ": the network keys there are " + join(known) + dym + std::string(hint));
        }
      }
    }
    if (out.hosts && out.mode != Mode::allowlist) {
      // DESIGN §1: an error with any other mode, even for an empty list (Harbor tolerates
      // an empty one); without network_mode Harbor refuses it too.
      return err(*hosts_at, out.mode ? "allowed_hosts in " + std::string(label) +
                                           " is only valid with network_mode \"allowlist\", not " +
                                           quote(to_string(*out.mode))
                                     : "allowed_hosts in " + std::string(label) +
                                           " needs network_mode = \"allowlist\" beside it");
    }
    return out;
  }

  Result<Mode> mode(const toml::node& v, std::string_view label) const {
    const auto* s = v.as_string();
    if (s == nullptr) {
      return err(v.source(), "network_mode in " + std::string(label) + " must be a string (" + std::string(kModes) +
                                 "), not " + std::string(type_name(v)));
    }
    if (auto m = parse_mode(s->get())) return *m;
    return err(v.source(), "unknown network_mode " + quote(s->get()) + " in " + std::string(label) +
                               ": modes are lower-case: " + std::string(kModes) +
                               did_you_mean(s->get(), {"public", "no-network", "allowlist"}));
  }

  Result<std::vector<Entry>> hosts(const toml::node& v, std::string_view label) const {
    const auto* a = v.as_array();
    if (a == nullptr) {
      return err(v.source(), "allowed_hosts in " + std::string(label) +
                                 " must be an array of hosts (e.g. [\"pypi.org\"]), not " + std::string(type_name(v)));
    }
    std::vector<Entry> out;
    std::unordered_set<std::string> seen;
    for (const toml::node& el : *a) {
      const auto* s = el.as_string();
      if (s == nullptr) {
        return err(el.source(), "allowed_hosts entries must be strings, not " + std::string(type_name(el)));
      }
      auto e = parse_entry(s->get());
      if (!e) return err(el.source(), e.error().message);
      if (seen.insert(e->text).second) out.push_back(std::move(e).value());
    }
    return out;
  }

  // A table-valued key of `parent`, or nullptr when absent; an error when it is there but
  // not a table.
  Result<const toml::table*> sub_table(const toml::table& parent, std::string_view key, std::string label) const {
    const toml::node* n = parent.get(key);
    if (n == nullptr) return static_cast<const toml::table*>(nullptr);
    if (const auto* t = n->as_table()) return t;
    return err(n->source(), label + " must be a table, not " + std::string(type_name(*n)));
  }

  // environment_mode and environment of a [verifier]-like table.
  Result<VerifierPlace> verifier_place(const toml::table& v, const std::string& label,
                                       const std::string& env_label) const {
    VerifierPlace place;
    const toml::node* mode_node = v.get("environment_mode");
    if (mode_node != nullptr) {
      const auto* s = mode_node->as_string();
      if (s == nullptr || (s->get() != "shared" && s->get() != "separate")) {
        return err(mode_node->source(), "environment_mode in " + label + " must be \"shared\" or \"separate\"" +
                                            (s == nullptr ? ", not " + std::string(type_name(*mode_node))
                                                          : ", not " + quote(s->get())));
      }
      place.separate = s->get() == "separate";
    }
    auto env = sub_table(v, "environment", env_label);
    if (!env) return env.error();
    place.environment = *env;
    place.environment_label = env_label;
    if (place.environment != nullptr && place.separate == false) {
      return err(mode_node->source(), "environment_mode = \"shared\" in " + label + " contradicts " + env_label +
                                          " (a separate verifier's environment): drop one of them");
    }
    return place;
  }

  // The baseline a table such as [environment] sets, as Harbor resolves it.
  Result<PhasePolicy> baseline(const toml::table* t, const std::string& label) const {
    PhasePolicy p;
    if (t == nullptr) {
      p.origin = "default public: there is no " + label;
      return p;
    }
    auto keys = net_keys(*t, label, true, {"environment"}, "");
    if (!keys) return keys.error();
    if (keys->mode) {
      p.mode = *keys->mode;
      if (keys->hosts) p.entries = std::move(*keys->hosts);
      p.origin = label + (keys->allow_internet ? " (allow_internet ignored: network_mode decides, as in Harbor)" : "");
    } else if (keys->allow_internet) {
      p.mode = *keys->allow_internet ? Mode::public_ : Mode::no_network;
      p.origin = label + " allow_internet = " + (*keys->allow_internet ? "true" : "false") + " (deprecated in Harbor)";
    } else {
      p.origin = "default public: " + label + " sets no network_mode";
    }
    return p;
  }

  // An [agent]/[verifier]-like table's override: nullopt when it sets no network_mode.
  Result<std::optional<PhasePolicy>> override_of(const toml::table* t, const std::string& label,
                                                 std::initializer_list<std::string_view> structural,
                                                 std::string_view hint) const {
    if (t == nullptr) return std::optional<PhasePolicy>();
    auto keys = net_keys(*t, label, false, structural, hint);
    if (!keys) return keys.error();
    if (!keys->mode) return std::optional<PhasePolicy>();
    PhasePolicy p;
    p.mode = *keys->mode;
    if (keys->hosts) p.entries = std::move(*keys->hosts);
    p.origin = label;
    return std::optional<PhasePolicy>(std::move(p));
  }

  // `from` again, as a phase with no override of its own; the origin names the phase it
  // inherits (whose own line says where that came from).
  static PhasePolicy inherit(const PhasePolicy& from, const std::string& from_phase) {
    PhasePolicy p = from;
    p.origin = "inherits " + from_phase;
    return p;
  }

  // Top-level keys that are about the network belong to no phase.
  Status check_top_level(const toml::table& root) const {
    for (const auto& [key, value] : root) {
      const std::string_view k = key.str();
      if (k == "environment" || k == "agent" || k == "verifier" || k == "steps") continue;
      if (is_network_key(k, kBaselineKeys) || network_by_value(value)) {
        return err(key.source(), "network key " + quote(k) +
                                     " at the top level belongs to no phase: put it in [environment], [agent] or "
                                     "[verifier]" +
                                     did_you_mean(k, kBaselineKeys));
      }
    }
    return {};
  }

  // Network keys in a table egressd does not read. Harbor ignores such a table as it ignores
  // an unknown key, so "[enviroment]" or "[Agent]" would leave every phase public. Only keys
  // within 2 edits of Harbor's network keys count here: these tables are Harbor's or the
  // task's own ([metadata], [verifier.continuous]), where "host" in a key says nothing; and
  // env maps ([environment.env], [verifier.env]) are skipped whole, since their keys are
  // variable names (Django reads ALLOWED_HOSTS).
  //
  // `path` holds the keys down to `t` (views into the document); the dotted text is built
  // only for the few paths that can be read tables and for the message, so a deeply nested
  // document costs time linear in its size.
  Status check_unread_tables(const toml::table& t, std::vector<std::string_view>& path, bool array_element) const {
    std::string dotted;
    if (path.size() <= 3) {  // "steps.verifier.environment" is the deepest read table
      for (std::string_view p : path) dotted += (dotted.empty() ? "" : ".") + std::string(p);
    }
    const bool read = path.empty() || (path.size() <= 3 && std::ranges::find(kReadTables, dotted) != kReadTables.end());
    for (const auto& [key, value] : t) {
      const std::string_view k = key.str();
      if (!read && is_near_key(k, kBaselineKeys)) return unread_table_error(key, path, array_element);
      if (k == "env") continue;
      path.push_back(k);
      Status s;
      if (const auto* st = value.as_table()) {
        s = check_unread_tables(*st, path, false);
      } else if (const auto* arr = value.as_array()) {
        for (const toml::node& el : *arr) {
          if (const auto* et = el.as_table(); et != nullptr && s.ok()) s = check_unread_tables(*et, path, true);
        }
      }
      path.pop_back();
      if (!s.ok()) return s;
    }
    return {};
  }

  Status unread_table_error(const toml::key& key, const std::vector<std::string_view>& path,
                            bool array_element) const {
    std::string dotted;
    for (std::string_view p : path) dotted += (dotted.empty() ? "" : ".") + std::string(p);
    const std::string shown = array_element ? "[[" + dotted + "]]" : "[" + dotted + "]";
    std::string hint;
    if (dotted == "steps.environment") {
      hint = ": a Harbor step has no environment of its own (every step runs in the task's [environment]; a "
             "step's separate verifier reads [steps.verifier.environment])";
    } else {
      // "[Agent]" -> [agent], "[step.agent]" -> [steps.agent], "[task.environment]" -> [environment].
      std::string_view best = policy_detail::nearest(dotted, kReadTables);
      const std::string_view last = path.back();
      if (best.empty() && (last == "environment" || last == "agent" || last == "verifier")) best = last;
      if (best == "steps") {
        hint = " (did you mean [[steps]]?)";
      } else if (!best.empty()) {
        hint = " (did you mean [" + std::string(best) + "]?)";
      }
    }
    return err(key.source(), std::string(key.str()) + " in " + shown +
                                 " would be ignored: Harbor reads network keys only in [environment], [agent], "
                                 "[verifier] and the tables of [[steps]]" + hint);
  }

  // Phase names of a step: step-NAME-STAGE when every one of them is a valid phase name,
  // else step-N-STAGE (N = 1-based position), so any step name Harbor takes has phases.
  static std::string step_prefix(const std::string& name, std::size_t index, bool separate) {
    const std::string longest = "step-" + name + (separate ? "-verifier-env" : "-verifier");
    if (valid_phase_name(longest)) return "step-" + name;
    return "step-" + std::to_string(index + 1);
  }

  Result<PolicyDocument> resolve(const toml::table& root) {
    if (Status s = check_top_level(root); !s.ok()) return s.error();

    auto env_t = sub_table(root, "environment", "[environment]");
    if (!env_t) return env_t.error();
    auto agent_t = sub_table(root, "agent", "[agent]");
    if (!agent_t) return agent_t.error();
    auto verifier_t = sub_table(root, "verifier", "[verifier]");
    if (!verifier_t) return verifier_t.error();

    auto base = baseline(*env_t, "[environment]");
    if (!base) return base.error();
    auto agent = override_of(*agent_t, "[agent]", {}, "");
    if (!agent) return agent.error();
    auto verifier = override_of(*verifier_t, "[verifier]", {"environment_mode", "environment"},
                                "; allow_internet belongs in [verifier.environment]");
    if (!verifier) return verifier.error();

    VerifierPlace task_place;
    if (*verifier_t != nullptr) {
      auto p = verifier_place(**verifier_t, "[verifier]", "[verifier.environment]");
      if (!p) return p.error();
      task_place = *p;
    }
    const bool task_separate = task_place.separate.value_or(task_place.environment != nullptr);
    PhasePolicy task_verifier_env;
    if (task_separate) {
      if (task_place.environment != nullptr) {
        auto b = baseline(task_place.environment, "[verifier.environment]");
        if (!b) return b.error();
        task_verifier_env = std::move(b).value();
      } else {
        task_verifier_env = inherit(*base, "environment");
        task_verifier_env.origin = "separate verifier, no [verifier.environment]: a copy of environment";
      }
    }

    PolicyDocument doc;
    doc.format = PolicyFormat::harbor_task;
    const auto add = [&doc](std::string name, PhasePolicy p) {
      Phase ph;
      ph.name = std::move(name);
      ph.mode = p.mode;
      if (p.mode == Mode::allowlist) ph.entries = std::move(p.entries);
      doc.policy.phases.push_back(std::move(ph));
      doc.origins.push_back(std::move(p.origin));
    };
    add("environment", *base);
    add("agent", *agent ? **agent : inherit(*base, "environment"));
    if (task_separate) {
      add("verifier", *verifier ? **verifier : inherit(task_verifier_env, "verifier-env"));
      add("verifier-env", task_verifier_env);
    } else {
      add("verifier", *verifier ? **verifier : inherit(*base, "environment"));
    }

    if (Status s = steps(root, *base, *agent, *verifier, task_place, doc, add); !s.ok()) return s.error();
    std::vector<std::string_view> path;
    if (Status s = check_unread_tables(root, path, false); !s.ok()) return s.error();
    doc.policy.initial_phase = "environment";
    return doc;
  }

  template <class Add>
  Status steps(const toml::table& root, const PhasePolicy& base, const std::optional<PhasePolicy>& task_agent,
               const std::optional<PhasePolicy>& task_verifier, const VerifierPlace& task_place,
               const PolicyDocument& doc, Add&& add) const {
    const toml::node* steps_node = root.get("steps");
    if (steps_node == nullptr) return {};
    const auto* list = steps_node->as_array();
    if (list != nullptr && list->empty()) return {};  // steps = []: a single-step task, as in Harbor
    if (list == nullptr || !list->is_array_of_tables()) {
      return err(steps_node->source(), "steps must be [[steps]] tables (an array of tables), not " +
                                           std::string(type_name(*steps_node)));
    }
    std::set<std::string> names;
    for (std::size_t i = 0; i < list->size(); ++i) {
      const toml::table& step = *list->get(i)->as_table();
      const toml::node* name_node = step.get("name");
      if (name_node == nullptr || name_node->as_string() == nullptr) {
        return err(name_node != nullptr ? name_node->source() : step.source(),
                   "step " + std::to_string(i + 1) + " of [[steps]] needs name = \"...\" (a string)");
      }
      const std::string name = name_node->as_string()->get();
      if (!names.insert(name).second) {
        return err(name_node->source(), "duplicate step name " + quote(name));
      }
      const std::string of_step = " of step " + quote(name);
      // Network keys in the [[steps]] table itself belong to no stage.
      for (const auto& [key, value] : step) {
        const std::string_view k = key.str();
        if (k == "agent" || k == "verifier" || k == "name") continue;
        if (is_network_key(k, kBaselineKeys) || network_by_value(value) || net_in_name(k, value)) {
          return err(key.source(), "network key " + quote(k) + " in [[steps]]" + of_step +
                                       " belongs to no stage: put it in [steps.agent] or [steps.verifier]");
        }
      }
      auto agent_t = sub_table(step, "agent", "[steps.agent]" + of_step);
      if (!agent_t) return agent_t.error();
      auto verifier_t = sub_table(step, "verifier", "[steps.verifier]" + of_step);
      if (!verifier_t) return verifier_t.error();
      auto agent = override_of(*agent_t, "[steps.agent]" + of_step, {}, "");
      if (!agent) return agent.error();
      auto verifier = override_of(*verifier_t, "[steps.verifier]" + of_step, {"environment_mode", "environment"},
                                  "; allow_internet belongs in [steps.verifier.environment]");
      if (!verifier) return verifier.error();

      VerifierPlace place;
      if (*verifier_t != nullptr) {
        auto p = verifier_place(**verifier_t, "[steps.verifier]" + of_step, "[steps.verifier.environment]" + of_step);
        if (!p) return p.error();
        place = *p;
      }
      // Unset step settings fall back to the task's verifier settings.
      const toml::table* env = place.environment != nullptr ? place.environment : task_place.environment;
      const std::string env_label =
          place.environment != nullptr ? place.environment_label : std::string("[verifier.environment]");
      const bool separate =
          place.separate.value_or(place.environment != nullptr ||
                                  task_place.separate.value_or(task_place.environment != nullptr));

      const std::string prefix = step_prefix(name, i, separate);
      PhasePolicy step_agent =
          *agent ? **agent : task_agent ? *task_agent : inherit(base, "environment");
      PhasePolicy verifier_base;
      std::string verifier_base_name = "environment";
      if (separate) {
        if (env != nullptr) {
          auto b = baseline(env, env_label);
          if (!b) return b.error();
          verifier_base = std::move(b).value();
        } else {
          verifier_base = inherit(base, "environment");
          verifier_base.origin = "separate verifier, no environment table: a copy of environment";
        }
        verifier_base_name = prefix + "-verifier-env";
      } else {
        verifier_base = base;
      }
      PhasePolicy step_verifier = *verifier        ? **verifier
                                  : task_verifier ? *task_verifier
                                                  : inherit(verifier_base, verifier_base_name);
      for (const std::string& phase : {prefix + "-agent", prefix + "-verifier", prefix + "-verifier-env"}) {
        if (doc.policy.find(phase) != nullptr) {
          return err(name_node->source(), "step " + quote(name) + " would make phase " + quote(phase) +
                                              ", which another step already has: rename one of the steps");
        }
      }
      add(prefix + "-agent", std::move(step_agent));
      add(prefix + "-verifier", std::move(step_verifier));
      if (separate) add(prefix + "-verifier-env", std::move(verifier_base));
    }
    return {};
  }

  std::string file_;
};

}  // namespace

Result<PolicyDocument> parse_harbor_task(std::string_view text, std::string_view filename) {
  return TaskReader(filename).read(text);
}

}  // namespace egressd
