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
#include "audit/psl.h"
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
  std::string sandbox;  // --sandbox: the agent's sandbox every command goes to
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
  // sandbox add/remove/list (the agent's own commands)
  std::string sb_name;
  std::string sb_netns;
  std::uint64_t sb_netns_pid = 0;
  std::string sb_config;
  std::string sb_socket;
  std::vector<std::uint32_t> sb_allow_uids;
  int sb_dns_port = -1;
  std::string sb_hosts_file;
  bool sb_remove_policy = false;
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
  if (r.contains("socket")) {
    // An agent's sandbox added without --socket has none of its own.
    const std::string sock = field(r, "socket");
    summary.push_back({"socket:", sock.empty() ? "none of its own (reached through the agent with --sandbox)" : sock});
  }
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
        // A hosts-file pair has no expiry while the file has it.
        const bool hosts = a.value("source", "") == "hosts";
        rows.push_back({field(l, "name"), field(a, "address"),
                        hosts ? std::string("never (hosts file)") : field(a, "expires_in_s") + " s"});
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
  if (r.contains("pin") && r["pin"].is_string()) std::cout << "  pinning: " << text(r["pin"]) << '\n';
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
  Json req = request;
  if (!o.sandbox.empty() && req.value("cmd", "").rfind("sandbox_", 0) != 0) req["sandbox"] = o.sandbox;
  const auto reply = client->call(req, timeout);
  if (const Outcome out = outcome(reply); out.exit_code != kExitOk) {
    std::cerr << "error: " << out.error << '\n';
    return out.exit_code;
  }
  return on_ok(*reply);
}

// A request checked as the daemon (or agent) decodes it, so a mistake fails fast (exit 2)
// even with nothing listening; then sent.
template <class Request>
int checked_run(const Options& o, const Json& req, const std::function<int(const Json&)>& on_ok) {
  auto typed = decode<Request>(req);
  if (auto* err = std::get_if<ErrorReply>(&typed)) {
    std::cerr << "error: " << err->message << '\n';
    return exit_code_for(err->code);
  }
  return run(o, Json(std::get<Request>(typed)), on_ok);
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
  return checked_run<ApplyRequest>(o, req, [&](const Json& r) { return o.json ? print_json(r) : print_apply(r); });
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
      // Wildcards only where the Public Suffix List says who owns the parent; without a list,
      // none (attack review 10: *.github.io from two names the sandbox chose).
      egressd::audit::LoadedPsl psl;
      if (o.wildcards) psl = egressd::audit::load_public_suffixes();
      auto s = egressd::audit::suggest_allowed_hosts(egressd::control::resolved_names(hosts), o.wildcards,
                                                     psl.list.get());
      if (o.wildcards && !psl.list) s.notes.push_back("Public Suffix List: " + psl.error);
      if (o.json) {
        std::cout << dump(Json{{"allowed_hosts", s.entries}, {"skipped", s.skipped}, {"notes", s.notes}}, 2) << '\n';
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

// sandbox add / remove / list: the agent's own commands.
int cmd_sandbox_add(const Options& o) {
  Json req = {{"cmd", SandboxAddRequest::kCmd}, {"name", o.sb_name}};
  if (!o.sb_netns.empty()) req["netns"] = o.sb_netns;
  if (o.sb_netns_pid != 0) req["netns_pid"] = o.sb_netns_pid;
  if (!o.sb_config.empty()) req["config"] = o.sb_config;
  if (!o.phase.empty()) req["phase"] = o.phase;
  if (!o.mode.empty()) req["mode"] = o.mode;
  if (!o.allow.empty()) req["allow"] = o.allow;
  if (!o.sb_socket.empty()) req["socket"] = o.sb_socket;
  if (!o.sb_allow_uids.empty()) req["allow_uid"] = o.sb_allow_uids;
  if (o.sb_dns_port >= 0) req["dns_port"] = o.sb_dns_port;
  if (!o.sb_hosts_file.empty()) req["hosts_file"] = o.sb_hosts_file;
  return checked_run<SandboxAddRequest>(o, req, [&](const Json& r) {
    if (o.json) return print_json(r);
    std::cout << "attached sandbox " << field(r, "name") << " (" << field(r, "netns") << "): phase "
              << field(r, "phase") << " (" << field(r, "mode") << ") generation " << field(r, "generation") << '\n';
    return kExitOk;
  });
}

int cmd_sandbox_remove(const Options& o) {
  Json req = {{"cmd", SandboxRemoveRequest::kCmd}, {"name", o.sb_name}};
  if (o.sb_remove_policy) req["remove_policy"] = true;
  return checked_run<SandboxRemoveRequest>(o, req, [&](const Json& r) {
    if (o.json) return print_json(r);
    std::cout << "removed sandbox " << field(r, "name") << "; its policy "
              << (field(r, "policy") == "removed" ? "was deleted" : "stays in force") << '\n';
    return kExitOk;
  });
}

int cmd_sandbox_list(const Options& o) {
  return checked_run<SandboxListRequest>(o, Json{{"cmd", SandboxListRequest::kCmd}}, [&](const Json& r) {
    if (o.json) return print_json(r);
    const Json list = r.value("sandboxes", Json::array());
    if (list.empty()) {
      std::cout << "no sandboxes attached\n";
      return kExitOk;
    }
    std::vector<std::vector<std::string>> rows = {{"NAME", "NETNS", "PHASE", "MODE", "GENERATION", "SOCKET"}};
    for (const auto& e : list) {
      const std::string sock = field(e, "socket");
      rows.push_back({field(e, "name"), field(e, "netns"), field(e, "phase"), field(e, "mode"),
                      field(e, "generation"), sock.empty() ? "-" : sock});
    }
    print_table(rows);
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
  app.add_option("--sandbox", o.sandbox,
                 "with egressd agent's socket: the sandbox the command is for (see `egressctl sandbox`)");
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
      {"explain", "say whether a hostname, IP, IP:port or NAME@IP[:port] (a flow presenting NAME) is allowed, by which "
                  "entry, or why not", cmd_explain},
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
  explain->add_option("TARGET", o.target,
                      "hostname, IP, NAME:PORT, IPv4:PORT, [IPv6]:PORT, or NAME@ADDRESS[:PORT]: a flow to ADDRESS "
                      "presenting NAME as TLS server name or HTTP Host (hostname pinning)")
      ->required();
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

  // The agent's own commands (egressd agent).
  CLI::App* sandbox = app.add_subcommand("sandbox", "attach, detach and list the sandboxes of egressd agent");
  sandbox->require_subcommand(1);
  CLI::App* sb_add = sandbox->add_subcommand("add", "attach a network namespace; returns once its policy is in force");
  sb_add->add_option("NAME", o.sb_name, "the sandbox's name (A-Z a-z 0-9 _ . -)")->required();
  auto* sb_ns = sb_add->add_option("--netns", o.sb_netns, "network namespace path (e.g. /run/netns/NAME)");
  auto* sb_pid = sb_add->add_option("--netns-pid", o.sb_netns_pid,
                                    "the network namespace of this process; the sandbox goes when it exits");
  sb_ns->excludes(sb_pid);
  auto* sb_config = sb_add->add_option("--config", o.sb_config, "policy file (as the agent reads it)");
  auto* sb_phase = sb_add->add_option("--phase", o.phase, "initial phase of --config (default its initial_phase)");
  auto* sb_mode = sb_add->add_option("--mode", o.mode, "without --config: start in public, no-network or allowlist");
  auto* sb_allow = sb_add->add_option("--allow", o.allow, "allowlist entry of the built-in allowlist phase (repeatable)")
                       ->allow_extra_args(false);
  sb_config->excludes(sb_mode);
  sb_phase->needs(sb_config);
  sb_allow->excludes(sb_config);
  sb_add->add_option("--socket", o.sb_socket, "a socket of the sandbox's own that speaks the sidecar protocol");
  sb_add->add_option("--allow-uid", o.sb_allow_uids, "uid allowed on that socket besides root (repeatable)");
  sb_add->add_option("--dns-port", o.sb_dns_port, "DNS proxy port in the sandbox (default 53); 0 = none")
      ->check(CLI::Range(0, 65535));
  sb_add->add_option("--hosts-file", o.sb_hosts_file,
                     "hosts file (as the agent reads it) whose names are learned like DNS answers (default none; "
                     "/proc/PID/root/etc/hosts names the process's own)");
  sb_add->add_flag("--json", o.json, "print the reply as JSON");
  CLI::App* sb_remove = sandbox->add_subcommand("remove", "detach a sandbox (its policy stays in force)");
  sb_remove->add_option("NAME", o.sb_name, "the sandbox's name")->required();
  bool keep_policy = false;  // the default; accepted so a script can say it
  auto* keep = sb_remove->add_flag("--keep-policy", keep_policy, "keep the sandbox's tables in its namespace (the default)");
  sb_remove->add_flag("--remove-policy", o.sb_remove_policy, "delete the sandbox's tables too")->excludes(keep);
  sb_remove->add_flag("--json", o.json, "print the reply as JSON");
  CLI::App* sb_list = sandbox->add_subcommand("list", "the sandboxes attached: name, namespace, phase, generation");
  sb_list->add_flag("--json", o.json, "print the reply as JSON");

  try {
    app.parse(argc, argv);
    if (sb_add->parsed() && o.sb_netns.empty() && o.sb_netns_pid == 0)
      throw CLI::ValidationError("sandbox add", "give --netns PATH or --netns-pid PID");
    if (apply->parsed() && o.phase.empty() && o.mode.empty())
      throw CLI::ValidationError("apply", "give a PHASE or --mode MODE");
    if (apply->parsed() && allow->count() > 0 && !o.phase.empty())
      throw CLI::ValidationError("apply", "--allow goes with --mode, not with a PHASE");
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help (stdout) or the error (stderr)
    return rc == 0 ? kExitOk : kExitInvalid;
  }
  o.allow = split_commas(o.allow);
  if (sb_add->parsed()) return cmd_sandbox_add(o);
  if (sb_remove->parsed()) return cmd_sandbox_remove(o);
  if (sb_list->parsed()) return cmd_sandbox_list(o);
  for (const auto& c : commands)
    if (c.sub->parsed()) return c.run(o);
  return kExitInvalid;  // unreachable: require_subcommand(1)
}
