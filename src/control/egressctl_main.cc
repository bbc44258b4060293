// egressctl: the command-line client of egressd's control socket.
// Each subcommand builds one request, sends it, and prints the reply for
// people (default) or scripts (--json). Exit codes (DESIGN §2): 0 ok,
// 1 runtime failure (daemon unreachable, kernel_error, internal,
// unauthorized), 2 invalid input (usage errors, and replies that blame the request).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "audit/explain.h"
#include "audit/suggest.h"
#include "control/audit_view.h"
#include "control/client.h"
#include "control/protocol.h"
#include "control/reply_text.h"

namespace {

using egressd::ErrorKind;
using egressd::control::Client;
using Json = nlohmann::json;
using namespace egressd::control;  // the protocol's types and the shared rendering helpers

struct Options {
  std::string socket = egressd::control::default_socket_path();
  double timeout_s = 30;
  bool json = false;
  // apply
  std::string phase;
  std::string mode;
  std::vector<std::string> allow;
  // explain (--phase NAME goes into `phase`)
  std::string target;
  // denied, hosts
  bool follow = false;
  bool suggest = false;
  bool wildcards = false;
  std::string hosts_phase;
};

void print_table(const std::vector<std::vector<std::string>>& rows) { std::cout << table(rows); }

// The documented comma form of --allow ("a.org,b.org"): each piece exactly as typed, empty
// ones included, for the daemon's entry validator to judge (an empty entry is an error there).
std::vector<std::string> split_commas(const std::vector<std::string>& values) {
  std::vector<std::string> out;
  for (const std::string& v : values) {
    std::size_t start = 0;
    while (true) {
      const std::size_t comma = v.find(',', start);
      out.push_back(v.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

std::string dump(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', false, Json::error_handler_t::replace);
}

int print_json(const Json& reply) {
  std::cout << json_output(reply);
  return kExitOk;
}

int print_apply(const Json& r) {
  std::string line = "applied ";
  if (r.contains("phase") && r["phase"].is_string() && !r["phase"].get<std::string>().empty())
    line += "phase " + r["phase"].get<std::string>();
  else
    line += "inline policy";
  if (r.contains("mode")) line += " (" + text(r["mode"]) + ")";
  if (r.contains("generation")) line += " generation " + text(r["generation"]);
  if (auto ms = duration_ms(r)) line += " in " + *ms + " ms";
  std::cout << line << '\n';
  if (r.contains("unresolved") && r["unresolved"].is_array() && !r["unresolved"].empty())
    std::cout << "not resolved at apply time: " << join(r["unresolved"], ", ")
              << " (allowed; their addresses are learned when the sandbox resolves them)\n";
  return kExitOk;
}

int print_status(const Json& r) {
  const Json counters = r.value("counters", Json::object());
  std::vector<std::vector<std::string>> summary = {
      {"phase:", field(r, "phase")},
      {"mode:", field(r, "mode")},
      {"generation:", field(r, "generation")},
  };
  if (r.contains("phases")) summary.push_back({"phases:", join(r["phases"], ", ")});
  if (r.contains("netns")) summary.push_back({"netns:", field(r, "netns")});
  if (r.contains("socket")) summary.push_back({"socket:", field(r, "socket")});
  summary.push_back({"allowed:", traffic(counters, "allowed")});
  summary.push_back({"denied:", traffic(counters, "denied")});
  if (r.contains("dns") && r["dns"].is_object()) {
    const Json& d = r["dns"];
    summary.push_back({"dns:", field(d, "forwarded") + " forwarded, " + field(d, "refused") + " refused, " +
                                   field(d, "failed") + " failed, " + field(d, "malformed") + " malformed"});
  }
  const Json entries = r.value("entries", Json::array());
  if (!entries.is_array() || entries.empty()) summary.push_back({"entries:", "none"});
  print_table(summary);
  if (entries.is_array() && !entries.empty()) {
    std::vector<std::vector<std::string>> rows = {{"ENTRY", "KIND", "STATE"}};
    for (const auto& e : entries) rows.push_back({field(e, "entry"), field(e, "kind"), field(e, "state")});
    std::cout << '\n';
    print_table(rows);
  }
  const Json learned = r.value("learned", Json::array());
  if (learned.is_array() && !learned.empty()) {
    std::vector<std::vector<std::string>> rows = {{"LEARNED NAME", "ADDRESS", "EXPIRES IN"}};
    for (const auto& l : learned) {
      for (const auto& a : l.value("addresses", Json::array())) {
        rows.push_back({field(l, "name"), field(a, "address"), field(a, "expires_in_s") + " s"});
      }
    }
    std::cout << '\n';
    print_table(rows);
  }
  return kExitOk;
}

int print_capabilities(const Json& r) {
  std::vector<std::vector<std::string>> rows;
  const Json caps = r.value("capabilities", Json::object());
  for (const auto& [name, v] : caps.items()) rows.push_back({name, v.is_boolean() ? (v.get<bool>() ? "yes" : "no") : text(v)});
  print_table(rows);
  return kExitOk;
}

// explain: one verdict line, then the reason and the names behind an address.
int print_explain(const Json& r) {
  const bool allowed = r.value("allowed", false);
  std::string line = std::string(allowed ? "allowed: " : "denied: ") + field(r, "target");
  if (r.contains("entry") && r["entry"].is_string()) line += " by entry " + text(r["entry"]);
  if (r.contains("learned_name") && r["learned_name"].is_string())
    line += " via learned name " + text(r["learned_name"]);
  line += " (phase " + field(r, "phase") + ", " + field(r, "mode") + ")";
  if (r.contains("hint") && r["hint"].is_string()) line += " \u2014 hint: " + text(r["hint"]);
  std::cout << line << '\n' << "  reason: " << field(r, "reason") << '\n';
  if (r.contains("names") && r["names"].is_array() && !r["names"].empty())
    std::cout << "  names that resolved to it: " << join(r["names"], ", ") << '\n';
  return kExitOk;
}

// Sends one request and hands a successful reply to `on_ok`; everything else
// becomes a message on stderr and an exit code.
int run(const Options& o, const Json& request, const std::function<int(const Json&)>& on_ok) {
  auto client = Client::connect(o.socket);
  if (!client) {
    const auto& err = client.error();
    if (err.kind == ErrorKind::invalid) {
      std::cerr << "error: " << err.message << '\n';
      return kExitInvalid;
    }
    std::cerr << "egressctl: cannot reach egressd at " << o.socket << ": " << unreachable_reason(err, o.socket)
              << '\n';
    return kExitRuntime;
  }
  const auto timeout = std::chrono::milliseconds(static_cast<long long>(o.timeout_s * 1000));
  const auto reply = client->call(request, timeout);
  if (const Outcome out = outcome(reply); out.exit_code != kExitOk) {
    std::cerr << "error: " << out.error << '\n';
    return out.exit_code;
  }
  return on_ok(*reply);
}

int cmd_apply(const Options& o) {
  Json req = {{"cmd", ApplyRequest::kCmd}};
  if (!o.phase.empty()) {
    req["phase"] = o.phase;
  } else {
    req["mode"] = o.mode;
    // Sent only when given: the daemon rejects allowed hosts with non-allowlist modes.
    if (!o.allow.empty()) req["allow"] = o.allow;
  }
  // Checked as the daemon checks it, so a bad mode fails fast (exit 2) even with no daemon.
  auto typed = decode<ApplyRequest>(req);
  if (auto* err = std::get_if<ErrorReply>(&typed)) {
    std::cerr << "error: " << err->message << '\n';
    return exit_code_for(err->code);
  }
  return run(o, std::get<ApplyRequest>(typed), [&](const Json& r) { return o.json ? print_json(r) : print_apply(r); });
}

int cmd_status(const Options& o) {
  return run(o, StatusRequest{}, [&](const Json& r) { return o.json ? print_json(r) : print_status(r); });
}

int cmd_capabilities(const Options& o) {
  return run(o, CapabilitiesRequest{},
             [&](const Json& r) { return o.json ? print_json(r) : print_capabilities(r); });
}

// Exit 0 whether the target is allowed or denied: the request succeeded.
int cmd_explain(const Options& o) {
  // Checked here too, so a typo fails fast (exit 2) even with no daemon.
  if (auto t = egressd::audit::parse_target(o.target); !t) {
    std::cerr << "error: " << t.error().message << '\n';
    return kExitInvalid;
  }
  ExplainRequest req{o.target, std::nullopt};
  if (!o.phase.empty()) req.phase = o.phase;
  return run(o, req, [&](const Json& r) { return o.json ? print_json(r) : print_explain(r); });
}

int cmd_ping(const Options& o) {
  return run(o, PingRequest{}, [](const Json&) {
    std::cout << "ok\n";
    return kExitOk;
  });
}

// rules / metrics: the daemon's text, printed as it comes (`field`: "ruleset" or "text").
int print_text(const Json& r, const char* field) {
  if (!r.contains(field) || !r[field].is_string()) {
    std::cerr << "error: egressd's reply has no \"" << field << "\" text\n";
    return kExitRuntime;
  }
  std::cout << r[field].get<std::string>() << std::flush;
  return kExitOk;
}

int cmd_rules(const Options& o) {
  return run(o, Json(egressd::control::RulesRequest{}), [](const Json& r) { return print_text(r, "ruleset"); });
}

int cmd_metrics(const Options& o) {
  return run(o, Json(egressd::control::MetricsRequest{}), [](const Json& r) { return print_text(r, "text"); });
}

// denied: the records; --follow asks again and again with the last id seen
// as the cursor, each request waiting in the daemon (long-poll) until a new
// record or wait_ms, so a quiet sandbox costs one request every 20 s.
int cmd_denied(const Options& o) {
  auto print = [&](const Json& records) {
    if (!records.is_array()) return;
    for (const auto& rec : records) {
      std::cout << (o.json ? dump(rec) : egressd::control::denied_line(rec)) << '\n';
    }
    std::cout << std::flush;
  };
  if (!o.follow) {
    return run(o, DeniedRequest{}, [&](const Json& r) {
      if (o.json) return print_json(r);
      const Json records = r.value("records", Json::array());
      if (records.empty()) std::cout << "no denied connections recorded\n";
      print(records);
      return kExitOk;
    });
  }
  const auto wait_ms = static_cast<std::uint64_t>(std::clamp(o.timeout_s * 1000 / 2, 1.0, 20000.0));
  // The first request prints what is recorded already, then each waits.
  std::uint64_t since = 0;
  for (bool first = true;; first = false) {
    const int rc = run(o, DeniedRequest{since, std::nullopt, first ? 0 : wait_ms}, [&](const Json& r) {
      const Json records = r.value("records", Json::array());
      print(records);
      for (const auto& rec : records) {
        if (rec.contains("id") && rec["id"].is_number_unsigned()) since = std::max(since, rec["id"].get<std::uint64_t>());
      }
      return kExitOk;
    });
    if (rc != kExitOk) return rc;
  }
}

// hosts: names per phase; --suggest / --wildcards: the allowed_hosts list.
int cmd_hosts(const Options& o) {
  HostsRequest req;
  if (!o.hosts_phase.empty()) req.phase = o.hosts_phase;
  return run(o, req, [&](const Json& r) {
    const Json hosts = r.value("hosts", Json::array());
    if (o.suggest || o.wildcards) {
      const auto s = egressd::audit::suggest_allowed_hosts(egressd::control::resolved_names(hosts), o.wildcards);
      if (o.json) {
        std::cout << dump(Json{{"allowed_hosts", s.entries}, {"skipped", s.skipped}}, 2) << '\n';
      } else {
        std::cout << egressd::audit::suggestion_yaml(s);
      }
      return kExitOk;
    }
    if (o.json) return print_json(r);
    if (hosts.empty()) {
      std::cout << "no names resolved through egressd yet\n";
      return kExitOk;
    }
    std::cout << egressd::control::hosts_table(hosts);
    return kExitOk;
  });
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"egressctl: control a running egressd over its Unix socket", "egressctl"};
  // Parent options are also accepted after the subcommand (egressctl status --socket P).
  app.fallthrough();
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return "error: " + std::string(e.what()) + "\nrun 'egressctl --help' for usage\n";
  });
  app.add_option("--socket", o.socket, "control socket of egressd ($EGRESSD_SOCKET, else /run/egressd/egressd.sock)")
      ->capture_default_str();
  app.add_option("--timeout", o.timeout_s, "seconds to wait for the reply")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 86400.0));

  struct Command {
    const char* name;
    const char* help;
    int (*run)(const Options&);
    CLI::App* sub = nullptr;
  };
  Command commands[] = {
      {"apply", "switch to a named phase, or to an inline policy with --mode", cmd_apply},
      {"status", "show the phase, mode, generation, counters and entries in force", cmd_status},
      {"capabilities", "show what this egressd and kernel support", cmd_capabilities},
      {"ping", "check that egressd answers", cmd_ping},
      {"explain", "say whether a hostname, IP or IP:port is allowed, by which entry, or why not", cmd_explain},
      {"denied", "recent denied connections and refused DNS queries, with the names behind them", cmd_denied},
      {"hosts", "names the sandbox resolved, per phase; --suggest prints an allowed_hosts list", cmd_hosts},
      {"rules", "print egressd's tables as the kernel holds them (nft text, with counters)", cmd_rules},
      {"metrics", "print egressd's counters in the Prometheus text format", cmd_metrics},
  };
  for (auto& c : commands) c.sub = app.add_subcommand(c.name, c.help);

  CLI::App* apply = commands[0].sub;
  auto* phase = apply->add_option("PHASE", o.phase, "phase name from the policy file");
  auto* mode = apply->add_option("--mode", o.mode, "inline policy mode: public, allowlist or no-network");
  // One value per --allow, kept as typed (allow_extra_args(false): no CLI11 "[a,b]" list
  // expansion); split on commas after parsing by split_commas, which keeps empty pieces so
  // the daemon's entry validator sees "a,,b" as it is. CLI11's delimiter would drop them.
  auto* allow = apply->add_option("--allow", o.allow, "allowlist entry (repeatable, or comma-separated)")
                    ->allow_extra_args(false);
  phase->excludes(mode);
  allow->needs(mode);
  apply->add_flag("--json", o.json, "print the reply as JSON");
  commands[1].sub->add_flag("--json", o.json, "print the reply as JSON");
  commands[2].sub->add_flag("--json", o.json, "print the reply as JSON");
  CLI::App* explain = commands[4].sub;
  explain->add_option("TARGET", o.target, "hostname, IP, NAME:PORT, IPv4:PORT or [IPv6]:PORT")->required();
  explain->add_option("--phase", o.phase, "explain for this phase of the policy file (default: the one in force)");
  explain->add_flag("--json", o.json, "print the reply as JSON");

  for (auto& c : commands) {
    if (std::string(c.name) == "denied") {
      c.sub->add_flag("--json", o.json, "print JSON (with --follow: one record per line)");
      c.sub->add_flag("--follow,-f", o.follow, "keep printing new records until interrupted");
    } else if (std::string(c.name) == "hosts") {
      c.sub->add_flag("--json", o.json, "print the reply as JSON");
      c.sub->add_flag("--suggest", o.suggest, "print a ready-to-paste allowed_hosts list of the names resolved");
      c.sub->add_flag("--wildcards", o.wildcards, "with --suggest: collapse sibling names into *.parent");
      c.sub->add_option("--phase", o.hosts_phase, "only names resolved while this phase was in force");
    }
  }

  try {
    app.parse(argc, argv);
    if (apply->parsed() && o.phase.empty() && o.mode.empty())
      throw CLI::ValidationError("apply", "give a PHASE or --mode MODE");
    if (apply->parsed() && allow->count() > 0 && !o.phase.empty())
      throw CLI::ValidationError("apply", "--allow goes with --mode, not with a PHASE");
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help (stdout) or the error (stderr)
    return rc == 0 ? kExitOk : kExitInvalid;
  }
  o.allow = split_commas(o.allow);
  for (const auto& c : commands)
    if (c.sub->parsed()) return c.run(o);
  return kExitInvalid;  // unreachable: require_subcommand(1)
}
