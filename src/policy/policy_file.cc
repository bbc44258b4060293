// Policy files (DESIGN §2): YAML (and so JSON) into a validated Policy; also
// AgentCompass's env-params object, which is JSON too, and the format detection of
// parse_policy_document (egressd/policy_input.h).
//
// Strict on purpose: a policy file is a security boundary, so anything we do
// not understand is an error with its file:line:col, never a default. A typo'd
// key silently ignored would weaken the policy without anyone noticing.
//
// Over 500 lines because each of the three input shapes (the YAML/JSON
// policy, AgentCompass's env-params and the format detection) needs its own
// strict reader with positions in its errors; they share the diagnostics
// and the validation of entries and phases here.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include "egressd/policy.h"
#include "egressd/policy_input.h"
#include "egressd/unique_fd.h"
#include "policy/diagnostics.h"

namespace egressd {

namespace {

using YAML::Node;
using policy_detail::did_you_mean;
using policy_detail::is_mode_word;
using policy_detail::is_network_key;
using policy_detail::kModes;
using policy_detail::join;
using policy_detail::quote;

// Upper bound for dns.min_ttl and dns.max_ttl. Learned addresses stay in the kernel sets at
// least this long; beyond a day they would outlive their DNS records by far,
// which quietly widens the allowlist. A value this large is almost surely a
// unit typo ("30h" for "30s"), and refusing it is the safe reading.
constexpr std::uint64_t kMaxMinTtlS = 24 * 3600;

// A policy file is small; anything bigger is the wrong file (or /dev/zero).
constexpr std::size_t kMaxPolicyBytes = 4u << 20;

std::string_view type_name(const Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null: return "empty";
    case YAML::NodeType::Scalar: return "a string";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Undefined: break;
  }
  return "undefined";
}

// yaml-cpp's messages are terse; add the fix for the mistakes people make.
std::string yaml_reason(const std::string& msg) {
  std::string out = "YAML syntax error: " + msg;
  if (msg == YAML::ErrorMsg::UNKNOWN_ANCHOR || msg == YAML::ErrorMsg::ALIAS_NOT_FOUND) {
    out += " (a value starting with \"*\" is a YAML alias: quote wildcard entries, e.g. \"*.example.com\")";
  } else if (msg == YAML::ErrorMsg::TAB_IN_INDENTATION) {
    out += " (indent with spaces, not tabs)";
  }
  return out;
}

// Walks the document stream once, only to find where documents start.
//
// yaml-cpp 0.7 loops forever in LoadAll on a stray top-level "," (for
// example ",", "[a]," or a "---" followed by ","): its scanner stops
// advancing and every call yields another empty document at the same
// position. A document that starts where the previous one started is that
// state, so we stop there and report it, and only then run LoadAll, which
// is then known to terminate on the same input.
class DocumentStarts final : public YAML::EventHandler {
 public:
  // The position of a document that made no progress, if any; null mark otherwise.
  static YAML::Mark find_stuck(const std::string& text) {
    std::istringstream in(text);
    YAML::Parser parser(in);
    DocumentStarts h;
    // Every real document consumes at least one byte, so this bound is
    // never reached by valid input; it backs up the position check.
    for (std::size_t docs = 0; docs <= text.size() + 1; ++docs) {
      h.progressed_ = true;
      if (!parser.HandleNextDocument(h)) return YAML::Mark::null_mark();
      if (!h.progressed_) return h.last_;
    }
    return h.last_;
  }

  void OnDocumentStart(const YAML::Mark& m) override {
    progressed_ = !seen_ || m.pos != last_.pos;
    seen_ = true;
    last_ = m;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}

 private:
  YAML::Mark last_ = YAML::Mark::null_mark();
  bool seen_ = false;
  bool progressed_ = true;
};

class Parser {
 public:
  explicit Parser(std::string_view file) : file_(file) {}

  // What the document is read as: an egressd policy, AgentCompass env-params, or
  // whichever of the two its top level says (parse_policy_document's rule).
  enum class Want { egressd, env_params, detect };

  Result<PolicyDocument> parse(std::string_view text, Want want) {
    std::vector<Node> docs;
    try {
      const std::string input(text);
      if (const YAML::Mark stuck = DocumentStarts::find_stuck(input); !stuck.is_null()) {
        return err(stuck, "YAML syntax error: unexpected \",\" (commas separate items only inside [...] or {...})");
      }
      docs = YAML::LoadAll(input);
    } catch (const YAML::Exception& e) {  // ParserException and its kin
      return err(e.mark, yaml_reason(e.msg));
    }
    try {
      return parse_docs(docs, want);
    } catch (const YAML::Exception& e) {
      // Not expected once the document loaded; kept so a yaml-cpp surprise
      // still becomes an error naming the file instead of an abort.
      return err(e.mark, "cannot read the policy: " + e.msg);
    }
  }

 private:
  // "<file>:<line>:<col>: <reason>", 1-based as editors count.
  Error err(const YAML::Mark& m, const std::string& reason) const {
    if (m.is_null()) return Error::invalid(file_ + ": " + reason);
    return Error::invalid(file_ + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1) + ": " +
                          reason);
  }

  // yaml-cpp marks an empty value at wherever the scanner stood next (often
  // the following line); its key is where the user looks.
  static YAML::Mark where(const Node& value, const Node& key) {
    return value.IsNull() ? key.Mark() : value.Mark();
  }

  // Walks a map in document order. Keys must be strings, unique, and one of
  // `allowed`; `context` names the map in messages ("in dns").
  template <class Fn>
  Status walk(const Node& map, std::initializer_list<std::string_view> allowed, std::string_view context,
              Fn&& on_key) const {
    std::unordered_map<std::string, int> seen;  // key -> 1-based line
    for (const auto& kv : map) {
      const Node& key = kv.first;
      const Node& value = kv.second;
      if (!key.IsScalar()) return err(key.Mark(), "keys must be plain names, not " + std::string(type_name(key)));
      const std::string& name = key.Scalar();
      bool known = false;
      for (std::string_view a : allowed) known = known || a == name;
      if (!known) {
        return err(key.Mark(), "unknown key " + quote(name) + " " + std::string(context) + ": allowed keys are " +
                                   join(allowed) + did_you_mean(name, allowed));
      }
      if (auto [it, fresh] = seen.emplace(name, key.Mark().line + 1); !fresh) {
        return err(key.Mark(), "duplicate key " + quote(name) + " (first given at line " +
                                   std::to_string(it->second) + ")");
      }
      if (Status s = on_key(name, key, value); !s.ok()) return s;
    }
    return {};
  }

  Result<std::string> scalar(const Node& value, const Node& key, std::string_view what) const {
    if (!value.IsScalar()) {
      return err(where(value, key), std::string(what) + " must be a string, not " + std::string(type_name(value)));
    }
    return value.Scalar();
  }

  Result<bool> boolean(const Node& value, const Node& key, std::string_view what) const {
    auto s = scalar(value, key, what);
    if (!s) return s.error();
    // YAML 1.2 core booleans only. yaml-cpp would also take yes/no/on/off
    // (YAML 1.1), which is how "no" silently becomes false elsewhere.
    if (*s == "true") return true;
    if (*s == "false") return false;
    return err(value.Mark(), std::string(what) + " must be true or false, not " + quote(*s));
  }

  // Parses a non-negative decimal no larger than `max`; nullopt otherwise.
  static std::optional<std::uint64_t> number(std::string_view s, std::uint64_t max) {
    if (s.empty() || s.size() > 10) return std::nullopt;
    std::uint64_t v = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return std::nullopt;
      v = v * 10 + static_cast<std::uint64_t>(c - '0');
    }
    if (v > max) return std::nullopt;
    return v;
  }

  Status parse_dns(const Node& dns, const Node& key, DnsOptions& out) const {
    if (dns.IsNull()) return {};
    if (!dns.IsMap()) return err(where(dns, key), "dns must be a map, not " + std::string(type_name(dns)));
    std::optional<YAML::Mark> max_ttl_at;
    Status st = walk(
        dns, {"upstream", "min_ttl", "max_ttl", "deny_answer", "private_answers", "observe_public", "upstream_netns"},
        "in dns",
                [&](const std::string& name, const Node& k, const Node& v) -> Status {
                  if (name == "upstream") return parse_upstream(v, k, out.upstream);
                  if (name == "min_ttl" || name == "max_ttl") {
                    auto s = scalar(v, k, name);
                    if (!s) return s.error();
                    auto ttl = parse_duration(name, *s);
                    if (!ttl) return err(v.Mark(), ttl.error().message);
                    if (name == "min_ttl") {
                      out.min_ttl_s = *ttl;
                    } else {
                      if (*ttl == 0) return err(v.Mark(), "max_ttl must be at least 1s");
                      out.max_ttl_s = *ttl;
                      max_ttl_at = v.Mark();
                    }
                    return {};
                  }
                  if (name == "private_answers") {
                    auto s = scalar(v, k, "private_answers");
                    if (!s) return s.error();
                    if (*s == "exact") {
                      out.private_answers = PrivateAnswers::exact;
                    } else if (*s == "allow") {
                      out.private_answers = PrivateAnswers::allow;
                    } else {
                      return err(v.Mark(), "private_answers must be exact (private addresses are learned for exact "
                                           "hostname entries only) or allow (for wildcard matches too), not " +
                                               quote(*s));
                    }
                    return {};
                  }
                  if (name == "upstream_netns") {
                    auto s = scalar(v, k, "upstream_netns");
                    if (!s) return s.error();
                    if (*s == "agent") {
                      out.upstream_netns = UpstreamNetns::agent;
                    } else if (*s == "sandbox") {
                      out.upstream_netns = UpstreamNetns::sandbox;
                    } else {
                      return err(v.Mark(), "upstream_netns must be agent (egressd agent asks the upstream from its "
                                           "own namespace) or sandbox (from the sandbox's), not " +
                                               quote(*s));
                    }
                    return {};
                  }
                  if (name == "deny_answer") {
                    auto s = scalar(v, k, "deny_answer");
                    if (!s) return s.error();
                    if (*s == "refused") {
                      out.deny_answer = DenyAnswer::refused;
                    } else if (*s == "nxdomain") {
                      out.deny_answer = DenyAnswer::nxdomain;
                    } else {
                      return err(v.Mark(), "deny_answer must be refused or nxdomain, not " + quote(*s));
                    }
                    return {};
                  }
                  auto b = boolean(v, k, "observe_public");
                  if (!b) return b.error();
                  out.observe_public = *b;
                  return {};
                });
    if (!st.ok()) return st;
    if (out.min_ttl_s > out.max_ttl_s) {
      // A min_ttl above the default cap raises the cap with it; against a
      // max_ttl given explicitly it is a contradiction.
      if (!max_ttl_at) {
        out.max_ttl_s = out.min_ttl_s;
      } else {
        return err(*max_ttl_at, "max_ttl (" + std::to_string(out.max_ttl_s) + "s) is shorter than min_ttl (" +
                                    std::to_string(out.min_ttl_s) + "s)");
      }
    }
    return {};
  }

  Status parse_upstream(const Node& v, const Node& k, std::vector<std::string>& out) const {
    if (!v.IsSequence()) {
      return err(where(v, k), "upstream must be a list (e.g. [resolv.conf] or [192.0.2.53]), not " +
                                  std::string(type_name(v)));
    }
    if (v.size() == 0) {
      return err(v.Mark(), "upstream is empty: give at least one server address, or resolv.conf");
    }
    out.clear();
    for (const Node& el : v) {
      if (!el.IsScalar()) {
        return err(el.Mark(), "upstream servers must be strings, not " + std::string(type_name(el)));
      }
      std::string server = el.Scalar();
      if (server != "resolv.conf") {
        const auto ip = parse_ip(server);
        if (!ip) {
          return err(el.Mark(), "upstream server " + quote(server) +
                                    " must be an IP address (no port, no brackets) or the word resolv.conf");
        }
        server = ip->to_string();
      }
      bool dup = false;
      for (const std::string& s : out) dup = dup || s == server;
      if (!dup) out.push_back(std::move(server));
    }
    return {};
  }

  // "30s", "5m", "1h" or bare seconds ("30").
  // `what` names the key in messages.
  static Result<std::uint32_t> parse_duration(std::string_view what, std::string_view s) {
    std::uint64_t mult = 1;
    std::string_view digits = s;
    if (!s.empty()) {
      switch (s.back()) {
        case 's': mult = 1; digits.remove_suffix(1); break;
        case 'm': mult = 60; digits.remove_suffix(1); break;
        case 'h': mult = 3600; digits.remove_suffix(1); break;
        default: break;
      }
    }
    const auto n = number(digits, kMaxMinTtlS);
    if (!n) {
      if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos) {
        return Error::invalid(std::string(what) + " " + quote(s) + " is too long: the maximum is 24h");
      }
      return Error::invalid(std::string(what) + " " + quote(s) +
                            " is not a duration: use seconds (30 or 30s), minutes (5m) or hours (1h)");
    }
    if (*n * mult > kMaxMinTtlS) {
      return Error::invalid(std::string(what) + " " + quote(s) + " is too long: the maximum is 24h");
    }
    return static_cast<std::uint32_t>(*n * mult);
  }

  Status parse_enforce(const Node& enforce, const Node& key, EnforceOptions& out) const {
    if (enforce.IsNull()) return {};
    if (!enforce.IsMap()) {
      return err(where(enforce, key), "enforce must be a map, not " + std::string(type_name(enforce)));
    }
    return walk(enforce, {"deny", "inbound_replies", "log_group", "pin_names"}, "in enforce",
                [&](const std::string& name, const Node& k, const Node& v) -> Status {
                  if (name == "pin_names") {
                    auto b = boolean(v, k, "pin_names");
                    if (!b) return b.error();
                    out.pin_names = *b;
                    return {};
                  }
                  if (name == "deny") {
                    auto s = scalar(v, k, "deny");
                    if (!s) return s.error();
                    if (*s == "reject") {
                      out.deny = DenyAction::reject;
                    } else if (*s == "drop") {
                      out.deny = DenyAction::drop;
                    } else {
                      return err(v.Mark(), "deny must be reject or drop, not " + quote(*s));
                    }
                    return {};
                  }
                  if (name == "inbound_replies") {
                    auto b = boolean(v, k, "inbound_replies");
                    if (!b) return b.error();
                    out.inbound_replies = *b;
                    return {};
                  }
                  auto s = scalar(v, k, "log_group");
                  if (!s) return s.error();
                  // NFLOG groups are 16-bit (struct nfulnl_msg_config_cmd).
                  const auto n = number(*s, 65535);
                  if (!n) return err(v.Mark(), "log_group must be a number from 0 to 65535, not " + quote(*s));
                  out.log_group = static_cast<std::uint16_t>(*n);
                  return {};
                });
  }

  Result<Mode> mode(const Node& v, const Node& k) const {
    auto s = scalar(v, k, "network mode");
    if (!s) return s.error();
    if (auto m = parse_mode(*s)) return *m;
    return err(v.Mark(), "unknown network mode " + quote(*s) + ": modes are lower-case: " + std::string(kModes) +
                             did_you_mean(*s, {"public", "no-network", "allowlist"}));
  }

  Result<std::vector<Entry>> allowed_hosts(const Node& v, const Node& k) const {
    std::vector<Entry> out;
    if (v.IsNull()) return out;  // "allowed_hosts:" with nothing: deny all
    if (!v.IsSequence()) {
      return err(where(v, k), "allowed_hosts must be a list of hosts (e.g. [pypi.org]), not " +
                                  std::string(type_name(v)));
    }
    std::unordered_set<std::string> seen;
    for (const Node& el : v) {
      if (!el.IsScalar() && !el.IsNull()) {
        return err(el.Mark(), "allowed_hosts entries must be strings, not " + std::string(type_name(el)));
      }
      auto e = parse_entry(el.IsNull() ? std::string() : el.Scalar());
      if (!e) return err(el.Mark(), e.error().message);
      if (seen.insert(e->text).second) out.push_back(std::move(e).value());
    }
    return out;
  }

  // A phase: a mode, or a map with network_mode and allowed_hosts. `label` names it in
  // messages ("phase \"agent\"", "run_network_policy").
  Result<Phase> phase(const std::string& name, const std::string& label, const Node& v, const Node& k) const {
    Phase p;
    p.name = name;
    if (v.IsNull()) {
      return err(k.Mark(), label + " has no network mode: give one of " + std::string(kModes));
    }
    if (v.IsScalar()) {
      auto m = mode(v, k);
      if (!m) return m.error();
      p.mode = *m;
      return p;
    }
    if (!v.IsMap()) {
      return err(v.Mark(), label + " must be a mode (" + std::string(kModes) +
                               ") or a map with network_mode and allowed_hosts, not " + std::string(type_name(v)));
    }
    std::optional<Mode> m;
    // std::optional because assigning to a bound YAML::Node rewrites the
    // document instead of rebinding the handle.
    std::optional<Node> hosts_key;
    std::optional<Node> hosts;
    Status s = walk(v, {"network_mode", "allowed_hosts"}, "in " + label,
                    [&](const std::string& key_name, const Node& kk, const Node& vv) -> Status {
                      if (key_name == "network_mode") {
                        auto r = mode(vv, kk);
                        if (!r) return r.error();
                        m = *r;
                      } else {
                        hosts_key.emplace(kk);
                        hosts.emplace(vv);
                      }
                      return {};
                    });
    if (!s.ok()) return s.error();
    if (!m) return err(v.Mark(), label + " has no network_mode: give one of " + std::string(kModes));
    p.mode = *m;
    if (hosts_key) {
      // DESIGN §1: given with any other mode it is an error, even when empty
      // (Harbor tolerates an empty list there).
      if (p.mode != Mode::allowlist) {
        return err(hosts_key->Mark(), "allowed_hosts is only valid with network_mode allowlist, not " +
                                         std::string(to_string(p.mode)));
      }
      auto entries = allowed_hosts(*hosts, *hosts_key);
      if (!entries) return entries.error();
      p.entries = std::move(entries).value();
    }
    return p;
  }

  Status parse_phases(const Node& phases, const Node& key, std::vector<Phase>& out) const {
    if (phases.IsNull() || (phases.IsMap() && phases.size() == 0)) {
      return err(where(phases, key), "no phases: define at least one, e.g. \"agent: no-network\"");
    }
    if (!phases.IsMap()) {
      return err(phases.Mark(), "phases must be a map of phase name to mode, not " + std::string(type_name(phases)));
    }
    std::unordered_map<std::string, int> seen;
    for (const auto& kv : phases) {
      const Node& k = kv.first;
      if (!k.IsScalar()) return err(k.Mark(), "phase names must be strings, not " + std::string(type_name(k)));
      const std::string& name = k.Scalar();
      if (!valid_phase_name(name)) {
        return err(k.Mark(), "invalid phase name " + quote(name) + ": use 1-32 letters, digits, \"_\" or \"-\"");
      }
      if (auto [it, fresh] = seen.emplace(name, k.Mark().line + 1); !fresh) {
        return err(k.Mark(), "duplicate phase " + quote(name) + " (first defined at line " +
                                 std::to_string(it->second) + ")");
      }
      auto p = phase(name, "phase " + quote(name), kv.second, k);
      if (!p) return p.error();
      out.push_back(std::move(p).value());
    }
    return {};
  }

  // env-params keys: AgentCompass's setup, run and verifier policies, in phase order.
  static constexpr std::string_view kEnvParamsKeys[] = {"network_policy", "run_network_policy",
                                                         "verifier_network_policy"};

  static bool looks_like_env_params(const Node& root) {
    if (!root.IsMap() || root["phases"]) return false;
    for (std::string_view k : kEnvParamsKeys) {
      if (root[std::string(k)]) return true;
    }
    return false;
  }

  // An unknown top-level key of env-params is an error when it is about the network: its name
  // says so ("run_network_polcy", "verifier_policy"), its value is a mode word, or its value
  // is a map holding a network key ("params": {"run_network_policy": ...}). AgentCompass
  // would ignore it, leaving the phase its author closed open.
  Status unknown_env_params_key(const Node& key, const Node& value) const {
    static const std::vector<std::string_view> known(std::begin(kEnvParamsKeys), std::end(kEnvParamsKeys));
    const std::string& name = key.Scalar();
    if (value.IsMap()) {
      for (const auto& kv : value) {
        if (!kv.first.IsScalar()) continue;
        const std::string& inner = kv.first.Scalar();
        if (inner == "network_mode" || inner == "allowed_hosts" || std::ranges::find(known, inner) != known.end()) {
          return err(kv.first.Mark(), quote(inner) + " in " + quote(name) +
                                          " is not read: the network keys of env-params (network_policy, "
                                          "run_network_policy, verifier_network_policy) are read only at the top "
                                          "level");
        }
      }
    }
    std::string low = name;
    for (char& c : low) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const bool by_value = value.IsScalar() && is_mode_word(value.Scalar());
    // "run_policy", "verifier_policy": a known key without its "network_". Other "_policy"
    // keys ("restart_policy": "always") are the environment's own parameters.
    const std::string longer = low.ends_with("_policy") ? low.substr(0, low.size() - 7) + "_network_policy" : "";
    const bool shortened = std::ranges::find(known, longer) != known.end();
    if (!is_network_key(name, known) && !shortened && !by_value) return {};
    std::string dym = did_you_mean(name, known);
    if (dym.empty() && !is_network_key(name, known)) {
      // "verifier_policy" -> verifier_network_policy, "offline" -> network_policy.
      dym = " (did you mean " + quote(shortened ? longer : "network_policy") + "?)";
    }
    return err(key.Mark(), "unknown network key " + quote(name) +
                               " in env-params: the network keys are network_policy, run_network_policy, "
                               "verifier_network_policy" + dym);
  }

  // AgentCompass env-params: network_policy (the setup policy), run_network_policy and
  // verifier_network_policy, each a mode or {network_mode, allowed_hosts}. An omitted or
  // null run/verifier policy inherits the setup policy; with no network_policy the setup
  // is public (no restriction, as with no env-params at all). Other keys of the object are
  // the environment's own parameters and are ignored, except ones that are about the
  // network, which are errors (a misspelt "run_network_polcy" must not leave the run open).
  Result<PolicyDocument> env_params(const Node& root) const {
    if (!root.IsMap()) {
      return err(root.Mark(), "env-params must be a JSON object with network_policy, run_network_policy or "
                              "verifier_network_policy, not " + std::string(type_name(root)));
    }
    std::optional<Node> keys[3];
    std::optional<Node> values[3];
    std::unordered_map<std::string, int> seen;
    for (const auto& kv : root) {
      const Node& key = kv.first;
      if (!key.IsScalar()) return err(key.Mark(), "keys must be plain names, not " + std::string(type_name(key)));
      const std::string& name = key.Scalar();
      std::size_t i = 0;
      while (i < 3 && kEnvParamsKeys[i] != name) ++i;
      if (i == 3) {
        if (Status s = unknown_env_params_key(key, kv.second); !s.ok()) return s.error();
        continue;
      }
      if (auto [it, fresh] = seen.emplace(name, key.Mark().line + 1); !fresh) {
        return err(key.Mark(), "duplicate key " + quote(name) + " (first given at line " +
                                   std::to_string(it->second) + ")");
      }
      keys[i].emplace(key);
      values[i].emplace(kv.second);
    }
    if (seen.empty()) {
      return err(root.Mark(), "env-params has none of network_policy, run_network_policy, verifier_network_policy");
    }
    static const char* const kPhases[] = {"setup", "run", "verifier"};
    PolicyDocument doc;
    doc.format = PolicyFormat::env_params;
    for (std::size_t i = 0; i < 3; ++i) {
      const std::string field(kEnvParamsKeys[i]);
      if (!values[i] || values[i]->IsNull()) {
        if (i == 0) {
          Phase setup;
          setup.name = kPhases[0];
          setup.mode = Mode::public_;
          doc.policy.phases.push_back(std::move(setup));
          doc.origins.push_back("default public: no network_policy");
        } else {
          Phase inherited = doc.policy.phases.front();
          inherited.name = kPhases[i];
          doc.policy.phases.push_back(std::move(inherited));
          doc.origins.push_back("inherits setup (" + doc.origins.front() + ")");
        }
        continue;
      }
      auto ph = phase(kPhases[i], field, *values[i], *keys[i]);
      if (!ph) return ph.error();
      doc.policy.phases.push_back(std::move(ph).value());
      doc.origins.push_back(field);
    }
    doc.policy.initial_phase = kPhases[0];
    return doc;
  }

  Result<PolicyDocument> parse_docs(const std::vector<Node>& docs, Want want) const {
    for (std::size_t i = 1; i < docs.size(); ++i) {
      // A second document would be ignored by a reader that takes the first:
      // exactly the silent surprise this parser exists to prevent.
      if (!docs[i].IsNull()) {
        return err(docs[i].Mark(), "only one YAML document is allowed; this is a second one (after \"---\")");
      }
    }
    if (want == Want::env_params || (want == Want::detect && !docs.empty() && looks_like_env_params(docs[0]))) {
      if (docs.empty() || docs[0].IsNull()) return err(YAML::Mark(), "env-params is empty");
      return env_params(docs[0]);
    }
    auto policy = egressd_policy(docs);
    if (!policy) return policy.error();
    PolicyDocument doc;
    doc.policy = std::move(policy).value();
    doc.origins.resize(doc.policy.phases.size());
    return doc;
  }

  Result<Policy> egressd_policy(const std::vector<Node>& docs) const {
    if (docs.empty() || docs[0].IsNull()) {
      return err(YAML::Mark(), "the policy is empty: it needs at least a phases map");
    }
    const Node& root = docs[0];
    if (!root.IsMap()) {
      return err(root.Mark(), "the policy must be a map with keys initial_phase, dns, enforce, phases, not " +
                                  std::string(type_name(root)));
    }
    Policy policy;
    std::optional<Node> initial_key;
    std::optional<Node> initial;
    bool have_phases = false;
    Status s = walk(root, {"initial_phase", "dns", "enforce", "phases"}, "at the top level",
                    [&](const std::string& name, const Node& k, const Node& v) -> Status {
                      if (name == "initial_phase") {
                        initial_key.emplace(k);
                        initial.emplace(v);
                        return {};
                      }
                      if (name == "dns") return parse_dns(v, k, policy.dns);
                      if (name == "enforce") return parse_enforce(v, k, policy.enforce);
                      have_phases = true;
                      return parse_phases(v, k, policy.phases);
                    });
    if (!s.ok()) return s.error();
    if (!have_phases) {
      return err(root.Mark(), "no phases: the policy needs a phases map, e.g. \"phases: {agent: no-network}\"");
    }
    if (!initial_key) {
      // DESIGN §2 leaves it optional: the first phase in file order starts.
      policy.initial_phase = policy.phases.front().name;
      return policy;
    }
    auto name = scalar(*initial, *initial_key, "initial_phase");
    if (!name) return name.error();
    if (policy.find(*name) == nullptr) {
      std::string names;
      std::vector<std::string_view> candidates;
      for (const Phase& p : policy.phases) {
        names += (names.empty() ? "" : ", ") + p.name;
        candidates.push_back(p.name);
      }
      return err(initial->Mark(), "initial_phase " + quote(*name) + " names no phase: the phases are " + names +
                                     did_you_mean(*name, candidates));
    }
    policy.initial_phase = *name;
    return policy;
  }

  std::string file_;
};


}  // namespace

Result<Policy> parse_policy(std::string_view text, std::string_view filename) {
  auto doc = Parser(filename).parse(text, Parser::Want::egressd);
  if (!doc) return doc.error();
  return std::move(doc->policy);
}

Result<PolicyDocument> parse_env_params(std::string_view text, std::string_view filename) {
  return Parser(filename).parse(text, Parser::Want::env_params);
}

std::string_view to_string(PolicyFormat format) {
  switch (format) {
    case PolicyFormat::egressd: return "egressd policy";
    case PolicyFormat::harbor_task: return "Harbor task.toml";
    case PolicyFormat::env_params: return "AgentCompass env-params";
  }
  return "unknown format";
}

Result<PolicyDocument> parse_policy_document(std::string_view text, std::string_view filename) {
  // The extension decides TOML: TOML and YAML overlap too little to sniff safely ("a = 1"
  // is both), and a task.toml is always named so.
  constexpr std::string_view kToml = ".toml";
  if (filename.size() >= kToml.size()) {
    std::string ext(filename.substr(filename.size() - kToml.size()));
    for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (ext == kToml) return parse_harbor_task(text, filename);
  }
  return Parser(filename).parse(text, Parser::Want::detect);
}

Result<Policy> load_policy_file(const std::string& path) {
  auto doc = load_policy_document(path);
  if (!doc) return doc.error();
  return std::move(doc->policy);
}

Result<PolicyDocument> load_policy_document(const std::string& path) {
  // A file the user named on the command line: failing to read it is bad
  // input (exit 2), not a runtime failure, hence invalid-kind.
  const auto invalid_errno = [&path](std::string_view what, int e) {
    Error err = errno_error(path + ": " + std::string(what), e);
    err.kind = ErrorKind::invalid;
    return err;
  };
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY));
  if (fd.get() < 0) return invalid_errno("cannot open policy file", errno);
  std::string text;
  char buf[65536];
  while (true) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return invalid_errno("cannot read policy file", errno);
    }
    if (n == 0) break;
    text.append(buf, static_cast<std::size_t>(n));
    if (text.size() > kMaxPolicyBytes) {
      return Error::invalid(path + ": policy file is larger than 4 MiB; is this the right file?");
    }
  }
  return parse_policy_document(text, path);
}

}  // namespace egressd
