// network-policy: the multi-call program of the egressd image, dispatching on argv[0]:
//
//   network-policy allow-all | deny-all | allow [TARGET...] | show [--json] | rules
//       Harbor's verbs, each one control request to the egressd of this container's network
//       namespace ($EGRESSD_SOCKET, else /run/egressd/egressd.sock); a verb that changes the
//       policy returns once the kernel has it.
//   entrypoint.sh [EGRESSD-RUN-ARG...]   (/opt/egress-sidecar/entrypoint.sh)
//       Harbor's sidecar entrypoint: reads EGRESS_CONTROL_INITIAL_NETWORK_MODE and
//       EGRESS_CONTROL_INITIAL_ALLOWED_HOSTS and execs `egressd run` in this namespace.
//   test EXPR / [ EXPR ]                  the healthcheck's `test -f FILE`
//   sh -c 'COMMAND ARG...'                one plain command, for CMD-SHELL healthchecks
//   egressd-init [EGRESSD-RUN-ARG...]     `egressd run` until the policy is in the kernel, then
//                                         exit 0 leaving it there: an init container that makes
//                                         a pod fail closed before any other container starts
//
// Exit codes as egressctl: 0 ok, 1 runtime failure (egressd unreachable, kernel refused),
// 2 invalid input (unknown verb, bad entry). The image has no shell; this is all of it.
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "control/client.h"
#include "control/protocol.h"
#include "control/reply_text.h"
#include "egressd/unique_fd.h"
#include "harbor/harbor.h"

namespace {

using egressd::ErrorKind;
using egressd::control::Client;
using Json = nlohmann::json;
namespace harbor = egressd::harbor;

using egressd::control::kExitInvalid;
using egressd::control::kExitOk;
using egressd::control::kExitRuntime;
constexpr auto kTimeout = std::chrono::seconds(30);

constexpr const char* kUsage =
    "Usage: network-policy allow-all | deny-all | allow [TARGET...] | show [--json] | rules\n"
    "\n"
    "  allow-all          allow all egress (mode public)\n"
    "  deny-all           deny all egress (mode no-network; loopback stays open)\n"
    "  allow [TARGET...]  allow only these hostnames, *.wildcards, IPs and CIDRs;\n"
    "                     no TARGET denies all egress (mode allowlist)\n"
    "  show [--json]      the policy in force\n"
    "  rules              the nftables ruleset egressd keeps in the kernel\n"
    "\n"
    "Talks to egressd at $EGRESSD_SOCKET, else /run/egressd/egressd.sock. Each change\n"
    "returns once the kernel has the new policy. Exit: 0 ok, 1 failure, 2 invalid input.\n";

// The reply to one request, or an exit code after a message on stderr.
struct Outcome {
  int code = kExitOk;
  Json reply;
};

// Connects to egressd; on failure prints why and returns the exit code instead.
std::variant<Client, int> connect() {
  const std::string socket = egressd::control::default_socket_path();
  auto client = Client::connect(socket);
  if (client) return std::move(*client);
  const auto& err = client.error();
  std::cerr << "network-policy: cannot reach egressd at " << socket << ": "
            << egressd::control::unreachable_reason(err, socket) << '\n';
  return err.kind == ErrorKind::invalid ? kExitInvalid : kExitRuntime;
}

// Turns what came back into an Outcome, printing any error.
Outcome interpret(const egressd::Result<Json>& reply) {
  const auto out = egressd::control::outcome(reply);
  if (out.exit_code != kExitOk) {
    std::cerr << "network-policy: error: " << out.error << '\n';
    return {out.exit_code, {}};
  }
  return {kExitOk, *reply};
}

Outcome call(const Json& request) {
  auto c = connect();
  if (std::holds_alternative<int>(c)) return {std::get<int>(c), {}};
  return interpret(std::get<Client>(c).call(request, kTimeout));
}

int usage_error(const std::string& message) {
  if (!message.empty()) std::cerr << "network-policy: " << message << '\n';
  std::cerr << kUsage;
  return kExitInvalid;
}

int cmd_apply(harbor::Verb verb, const std::vector<std::string>& targets) {
  const Outcome o = call(harbor::apply_request(verb, targets));
  if (o.code != kExitOk) return o.code;
  std::cout << harbor::describe_apply(o.reply);
  return kExitOk;
}

int cmd_show(bool json) {
  const Outcome o = call(egressd::control::StatusRequest{});
  if (o.code != kExitOk) return o.code;
  if (json) {
    std::cout << egressd::control::json_output(o.reply);
  } else {
    std::cout << harbor::describe_status(o.reply);
  }
  return kExitOk;
}

// `rules`: the nft text of the tables egressd keeps in the kernel, with their counters, as
// egressd renders them (`egressctl rules`; reply field "ruleset").
int cmd_rules() {
  const Outcome o = call(egressd::control::RulesRequest{});
  if (o.code != kExitOk) return o.code;
  if (!o.reply.contains("ruleset") || !o.reply["ruleset"].is_string()) {
    std::cerr << "network-policy: error: egressd's rules reply has no \"ruleset\" text\n";
    return kExitRuntime;
  }
  std::cout << o.reply["ruleset"].get<std::string>();
  return kExitOk;
}

int network_policy(const std::vector<std::string>& args) {
  if (args.empty()) return usage_error("");
  const std::string& verb = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (verb == "-h" || verb == "--help" || verb == "help") {
    std::cout << kUsage;
    return kExitOk;
  }
  if (verb == "allow") return cmd_apply(harbor::Verb::allow, rest);
  const bool no_args = rest.empty();
  if (verb == "allow-all" && no_args) return cmd_apply(harbor::Verb::allow_all, {});
  if (verb == "deny-all" && no_args) return cmd_apply(harbor::Verb::deny_all, {});
  if (verb == "show" && (no_args || (rest.size() == 1 && rest[0] == "--json"))) return cmd_show(!no_args);
  if (verb == "rules" && no_args) return cmd_rules();
  if (verb == "allow-all" || verb == "deny-all" || verb == "show" || verb == "rules")
    return usage_error(verb + ": unexpected argument " + rest[0]);
  return usage_error("unknown verb: " + verb);
}

// The directory of this program's real file: egressd sits next to it (/usr/local/bin).
std::string own_dir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("/usr/local/bin") : exe.parent_path().string();
}

[[noreturn]] void exec_or_die(const std::vector<std::string>& argv, bool search_path, const char* who) {
  std::vector<char*> c;
  for (const auto& a : argv) c.push_back(const_cast<char*>(a.c_str()));
  c.push_back(nullptr);
  if (search_path) {
    ::execvp(c[0], c.data());
  } else {
    ::execv(c[0], c.data());
  }
  const int err = errno;
  std::cerr << who << ": cannot run " << argv[0] << ": " << egressd::errno_text(err) << '\n';
  std::exit(err == ENOENT ? 127 : 126);
}

// The CapEff: mask of this process, hex ("" if unreadable).
std::string cap_eff() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    const auto words = harbor::split_blanks(line.substr(7));
    return words.empty() ? "" : words[0];
  }
  return "";
}

// net.ipv4.ip_unprivileged_port_start of this network namespace (1024 if unreadable).
int unprivileged_port_start() {
  std::ifstream in("/proc/sys/net/ipv4/ip_unprivileged_port_start");
  int v = 1024;
  if (!(in >> v)) return 1024;
  return v;
}

int entrypoint(const std::vector<std::string>& args) {
  constexpr const char* kWho = "harbor-docker-egress-control-sidecar";
  auto plan = harbor::plan_entrypoint(std::getenv(harbor::kModeEnv), std::getenv(harbor::kHostsEnv));
  if (!plan) {
    std::cerr << plan.error().message << '\n';
    return kExitInvalid;
  }
  for (const auto& n : plan->notes) std::cerr << kWho << ": " << n << '\n';
  // A ready file left by an earlier run of this container must not pass the healthcheck
  // before this egressd has its policy in the kernel.
  if (::unlink(harbor::kReadyFile) != 0 && errno != ENOENT) {
    std::cerr << kWho << ": cannot remove stale " << harbor::kReadyFile << ": " << egressd::errno_text(errno) << '\n';
    return kExitRuntime;
  }
  // egressd's DNS proxy listens on port 53 when it may: an unprivileged process of the
  // sandbox can then never take the port over. Without CAP_NET_BIND_SERVICE (Compose
  // `cap_drop: [ALL]`, `cap_add: [NET_ADMIN]`), move it rather than fail; the nat rule
  // redirects the sandbox's port-53 queries to wherever it listens.
  std::vector<std::string> extra = args;
  const bool port_given = std::any_of(args.begin(), args.end(), [](const std::string& a) {
    return a == "--dns-port" || a.rfind("--dns-port=", 0) == 0;
  });
  if (!port_given && !harbor::can_bind_port_53(cap_eff(), unprivileged_port_start())) {
    extra.push_back("--dns-port=" + std::to_string(harbor::kFallbackDnsPort));
    std::cerr << kWho << ": no CAP_NET_BIND_SERVICE: DNS proxy on port " << harbor::kFallbackDnsPort
              << " instead of 53 (grant NET_BIND_SERVICE to keep it on 53)\n";
  }
  std::cerr << kWho << ": starting egressd, initial egress policy " << plan->mode;
  if (plan->mode == "allowlist") std::cerr << " (" << plan->hosts.size() << " entries)";
  std::cerr << '\n';
  exec_or_die(harbor::egressd_run_argv(own_dir() + "/egressd", *plan, egressd::control::default_socket_path(), extra),
              false, kWho);
}


// Exit status of a waited-for child in shell convention (128+N for signal N).
int exit_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return kExitRuntime;
}

int egressd_init(const std::vector<std::string>& args) {
  constexpr const char* kWho = "egressd-init";
  // Its own socket and ready file, away from the long-running egressd's, which adopts the table.
  const std::string dir = "/tmp/egressd-init";
  const std::string ready = dir + "/ready";
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    std::cerr << kWho << ": cannot create " << dir << ": " << egressd::errno_text(errno) << '\n';
    return kExitRuntime;
  }
  ::unlink(ready.c_str());
  std::vector<std::string> argv = {own_dir() + "/egressd", "run", "--socket", dir + "/egressd.sock"};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.push_back("--ready-file");  // the last one given wins in CLI11, so this is the one used
  argv.push_back(ready);

  // Watch the directory before the child can create the file, so the event cannot be missed.
  const egressd::UniqueFd in(::inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  if (!in.ok() || ::inotify_add_watch(in.get(), dir.c_str(), IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE) < 0) {
    std::cerr << kWho << ": inotify on " << dir << ": " << egressd::errno_text(errno) << '\n';
    return kExitRuntime;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    std::cerr << kWho << ": fork: " << egressd::errno_text(errno) << '\n';
    return kExitRuntime;
  }
  if (pid == 0) exec_or_die(argv, false, kWho);
  // glibc 2.36 declares pidfd_open without C linkage for C++; the raw syscall avoids that.
  const egressd::UniqueFd pfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!pfd.ok()) {
    std::cerr << kWho << ": pidfd_open: " << egressd::errno_text(errno) << '\n';
    ::kill(pid, SIGKILL);
    return kExitRuntime;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  struct stat st {};
  while (::stat(ready.c_str(), &st) != 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      std::cerr << kWho << ": egressd not ready after 30 s; stopping it\n";
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      return kExitRuntime;
    }
    pollfd fds[2] = {{in.get(), POLLIN, 0}, {pfd.get(), POLLIN, 0}};
    if (::poll(fds, 2, static_cast<int>(left.count()) + 1) < 0 && errno != EINTR) return kExitRuntime;
    if (fds[0].revents & POLLIN) {
      char buf[4096];
      while (::read(in.get(), buf, sizeof(buf)) > 0) {
      }
    }
    if ((fds[1].revents & POLLIN) && ::stat(ready.c_str(), &st) != 0) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      std::cerr << kWho << ": egressd exited before its policy was in the kernel\n";
      const int rc = exit_status(status);
      return rc == 0 ? kExitRuntime : rc;
    }
  }
  // egressd writes the ready file before it handles SIGTERM; its first answer on the control
  // socket shows the event loop (and the signal handler) is running, so the stop is clean.
  if (auto c = Client::connect(dir + "/egressd.sock"); c) {
    (void)c->call({{"cmd", "ping"}}, std::chrono::seconds(5));
  }
  // SIGTERM leaves the table in the kernel (no --cleanup-on-exit): fail closed from here on,
  // and the egressd that starts next adopts it.
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const int rc = exit_status(status);
  if (rc != 0) {
    std::cerr << kWho << ": egressd exited " << rc << " after it was ready\n";
    return rc;
  }
  std::cerr << kWho << ": policy installed; it stays in the kernel for the egressd that adopts it\n";
  return kExitOk;
}

int test_applet(const std::vector<std::string>& args, bool bracket) {
  std::string err;
  const int rc = harbor::eval_test(args, bracket, &err);
  if (rc == 2) std::cerr << (bracket ? "[" : "test") << ": " << err << '\n';
  return rc;
}

int sh_applet(const std::vector<std::string>& args) {
  if (args.size() < 2 || args[0] != "-c") {
    std::cerr << "sh: this image has no shell; only `sh -c 'COMMAND ARG...'` with plain words is supported\n";
    return kExitInvalid;
  }
  auto words = harbor::parse_simple_command(args[1]);
  if (!words) {
    std::cerr << "sh: " << words.error().message << '\n';
    return kExitInvalid;
  }
  // Builtins a one-command healthcheck may use; everything else is a program on PATH.
  if ((*words)[0] == "exit") return words->size() > 1 ? std::atoi((*words)[1].c_str()) : 0;
  if ((*words)[0] == "true" || (*words)[0] == ":") return 0;
  if ((*words)[0] == "false") return 1;
  exec_or_die(*words, true, "sh");
}

}  // namespace

int main(int argc, char** argv) {
  struct Applet {
    const char* name;
    int (*run)(const std::vector<std::string>&);
  };
  static const Applet applets[] = {
      {"entrypoint.sh", entrypoint},
      {"egressd-init", egressd_init},
      {"test", [](const std::vector<std::string>& a) { return test_applet(a, false); }},
      {"[", [](const std::vector<std::string>& a) { return test_applet(a, true); }},
      {"sh", sh_applet},
  };
  const std::string name = std::filesystem::path(argc > 0 ? argv[0] : "network-policy").filename().string();
  const std::vector<std::string> args(argv + (argc > 0 ? 1 : 0), argv + argc);
  for (const auto& a : applets)
    if (name == a.name) return a.run(args);
  return network_policy(args);  // network-policy, and any other name
}
