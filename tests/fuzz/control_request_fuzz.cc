// libFuzzer target for control requests as the daemon handles them:
// egressd::daemon::Sandbox::handle (src/daemon/sandbox.h) over a fake
// nft::Kernel and a fake DNS proxy, fed one request per input line, parsed
// with nlohmann exactly as the server does (depth limit 64; anything that is
// not an object with a string "cmd" never reaches the handler, see
// control_server_fuzz.cc for that part). One Sandbox per input, so a line
// sequence explores state: inline policies, named phases, learned addresses.
//
// The Sandbox runs on an io_context the harness drives, as the daemon's
// loop does: after each line the ready handlers run (io_context::poll), then
// the fake proxy answers every pending pre-resolution and they run again.
// Nothing waits on a clock (a pre-resolution answered at once never meets
// its 3 s deadline).
//
// Lines starting with '#' are harness directives, not requests:
//   #fail               the next kernel batch fails (a kernel refusal)
//   #hold               do not complete pre-resolutions after the next line
//                       (so applies queue behind one another)
//   #learn NAME ADDR    the DNS proxy learned ADDR for NAME (Sandbox::learn)
//   #decide NAME        the DNS proxy asks about NAME (Sandbox::decide)
//
// Properties checked:
//  - every request gets exactly one reply, {"ok":true,...} or
//    {"ok":false,"error":{"code":<known code>,"message":<string>}}, which
//    serializes (invalid UTF-8 replaced) without throwing;
//  - an error reply changes nothing: same phase and generation, no kernel
//    batch sent;
//  - a successful apply is exactly one kernel batch, bumps the generation by
//    one, reports it, and the state stored in the kernel (comment of the
//    first rule of chain `active`) parses back to the state in force;
//  - replies to queued applies come in arrival order (increasing generations);
//  - status always carries phase, mode, generation, entries and counters.
#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <spdlog/spdlog.h>
#include <string>
#include <string_view>
#include <vector>

#include "control/protocol.h"
#include "daemon/sandbox.h"
#include "support/fake_kernel.h"
#include "support/fake_proxy.h"
#include "fuzz_check.h"

using namespace egressd;
using nlohmann::json;

namespace {

constexpr int kMaxRequestDepth = 64;  // as src/control/server.cc

const std::set<std::string> kCodes = {"invalid_request", "request_too_large", "unknown_command", "unknown_phase",
                                      "invalid_policy",  "unauthorized",      "kernel_error",    "internal",
                                      "unavailable"};

// Resolutions complete when the harness says so. Names containing "fail"
// fail; names starting with "lo" resolve to loopback (the rebinding guard
// must keep it out); others get a documentation address.
testing::FakeProxy make_proxy() {
  testing::FakeProxy p;
  p.deferred = true;
  p.answer = testing::FakeProxy::synthesised;
  return p;
}

Phase phase(const std::string& name, Mode mode, std::vector<std::string> entries = {}) {
  auto p = make_inline_phase(name, mode, entries);
  FUZZ_CHECK(p.ok());
  return *p;
}

Policy policy() {
  Policy p;
  p.phases.push_back(phase("environment", Mode::public_));
  p.phases.push_back(phase("agent", Mode::allowlist,
                           {"pypi.org", "*.pythonhosted.org", "192.0.2.0/24", "2001:db8::/32", "198.51.100.10",
                            "fail.example"}));
  p.phases.push_back(phase("verifier", Mode::no_network));
  p.phases.push_back(phase("locked", Mode::allowlist));
  p.initial_phase = "environment";
  return p;
}

// Mirrors check_request() in src/control/server.cc: what reaches the handler.
std::optional<json> parse_request(std::string_view line) {
  struct TooDeep {};
  json out;
  try {
    out = json::parse(line, [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxRequestDepth) throw TooDeep{};
      return true;
    });
  } catch (const json::exception&) {
    return std::nullopt;
  } catch (const TooDeep&) {
    return std::nullopt;
  }
  if (!out.is_object()) return std::nullopt;
  auto it = out.find("cmd");
  if (it == out.end() || !it->is_string()) return std::nullopt;
  return out;
}

void check_shape(const json& r) {
  FUZZ_CHECK(r.is_object());
  FUZZ_CHECK(r.contains("ok") && r["ok"].is_boolean());
  if (!r["ok"].get<bool>()) {
    FUZZ_CHECK(r.contains("error") && r["error"].is_object());
    const json& e = r["error"];
    FUZZ_CHECK(e.contains("code") && e["code"].is_string() && kCodes.count(e["code"].get<std::string>()) == 1);
    FUZZ_CHECK(e.contains("message") && e["message"].is_string());
  }
  // What the server writes: must not throw whatever bytes a message quotes.
  const std::string line = r.dump(-1, ' ', false, json::error_handler_t::replace);
  FUZZ_CHECK(line.find('\n') == std::string::npos);
}

void check_kernel_state(const testing::FakeKernel& k, const daemon::Sandbox& sb) {
  FUZZ_CHECK(k.table.has_value());
  for (const auto& r : k.table->rules) {
    // The state rule is the one with the comment: outside public, per-packet
    // guards (routing headers, source routes) come before it.
    if (r.chain != "active" || r.comment.empty()) continue;
    auto st = nft::ActiveState::parse_comment(r.comment);
    FUZZ_CHECK(st.ok());
    FUZZ_CHECK(st->generation == sb.state().generation && st->phase == sb.state().phase &&
               st->mode == sb.state().mode && st->is_inline == sb.state().is_inline);
    return;
  }
  FUZZ_CHECK(!"chain active has no rule");
}

template <class T>
void check_agent_decode(const json& req) {
  if (req["cmd"] != T::kCmd) return;
  auto d = control::decode<T>(req);
  if (auto* e = std::get_if<control::ErrorReply>(&d)) {
    FUZZ_CHECK(e->code == "invalid_request" || e->code == "invalid_policy");
    FUZZ_CHECK(!e->message.empty());
    return;
  }
  const json back = std::get<T>(d);
  auto again = control::decode<T>(back);
  FUZZ_CHECK(std::holds_alternative<T>(again) && std::get<T>(again) == std::get<T>(d));
}

struct Slot {
  int replies = 0;
  json reply;
  std::string cmd;
  // True until the line's own handlers have run: a reply then is immediate
  // (no pre-resolution answered). Kept here, not on the loop's stack,
  // because a held apply replies after its line's iteration.
  bool sync = true;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto kernel_owned = std::make_unique<testing::FakeKernel>();
  testing::FakeKernel& kernel = *kernel_owned;
  testing::FakeProxy proxy = make_proxy();
  std::vector<std::uint64_t> switched;  // generations reported to after_switch
  daemon::SandboxOptions opts;
  opts.policy = policy();
  opts.after_switch = [&](std::shared_ptr<const Phase>, std::uint64_t gen) { switched.push_back(gen); };
  boost::asio::io_context io;  // outlives the Sandbox: its handlers die after it
  opts.executor = io.get_executor();
  // Runs what is ready (restart: an io_context that ran out of work stops).
  const auto drain = [&io] {
    io.restart();
    io.poll();
  };
  daemon::Sandbox sb(std::move(opts), std::move(kernel_owned), {true, true, true, true, true, true, true, true});
  sb.attach_proxy(&proxy);
  FUZZ_CHECK(sb.start("environment").ok());

  std::deque<Slot> slots;  // deque: references stay valid as it grows
  std::uint64_t last_async_gen = 0;
  bool hold = false;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::size_t start = 0;
  for (int lines = 0; start < text.size() && lines < 32; ++lines) {
    const std::size_t nl = text.find('\n', start);
    const std::string_view line = text.substr(start, nl == std::string_view::npos ? std::string_view::npos : nl - start);
    start = nl == std::string_view::npos ? text.size() : nl + 1;

    if (!line.empty() && line.front() == '#') {
      const std::string_view d = line.substr(1);
      if (d == "fail") {
        kernel.fail_next = Error::runtime("add rule active: No buffer space available (injected)");
      } else if (d == "hold") {
        hold = true;
      } else if (d.rfind("decide ", 0) == 0) {
        (void)sb.decide(std::string(d.substr(7)));
      } else if (d.rfind("learn ", 0) == 0) {
        const std::string_view rest = d.substr(6);
        const std::size_t sp = rest.find(' ');
        if (sp != std::string_view::npos) {
          if (auto ip = parse_ip(rest.substr(sp + 1))) {
            int done = 0;
            sb.learn({{std::string(rest.substr(0, sp)), *ip, 60}}, [&](Status) { ++done; });
            FUZZ_CHECK(done == 1);  // no `post`: the batch goes in at once
          }
        }
      }
      continue;
    }
    auto req = parse_request(line);
    if (!req) continue;
    // The agent's own commands decode the same way: an error names the culprit with a
    // known code, and what decodes encodes back to the same request.
    check_agent_decode<control::SandboxAddRequest>(*req);
    check_agent_decode<control::SandboxRemoveRequest>(*req);
    check_agent_decode<control::SandboxListRequest>(*req);

    const auto gen_before = sb.state().generation;
    const auto phase_before = sb.state().phase;
    const auto accepted_before = kernel.accepted;
    const auto switched_before = switched.size();
    Slot& slot = slots.emplace_back();
    slot.cmd = (*req)["cmd"].get<std::string>();
    sb.handle(*req, [&slot, &sb, &last_async_gen, &kernel](json r) {
      ++slot.replies;
      FUZZ_CHECK(slot.replies == 1);
      check_shape(r);
      if (!slot.sync && r["ok"].get<bool>()) {
        // A queued apply completing: in order, and in force when answered.
        const auto g = r["generation"].get<std::uint64_t>();
        FUZZ_CHECK(g == sb.state().generation);
        FUZZ_CHECK(g > last_async_gen);
        last_async_gen = g;
        check_kernel_state(kernel, sb);
      }
      slot.reply = std::move(r);
    });
    drain();
    slot.sync = false;
    if (slot.replies == 1) {
      const json& r = slot.reply;
      if (!r["ok"].get<bool>()) {
        if (proxy.pending.empty()) {
          FUZZ_CHECK(sb.state().generation == gen_before);
          FUZZ_CHECK(sb.state().phase == phase_before);
          FUZZ_CHECK(kernel.accepted == accepted_before);
        }
      } else if (slot.cmd == "apply") {
        FUZZ_CHECK(r["generation"].get<std::uint64_t>() == gen_before + 1);
        FUZZ_CHECK(sb.state().generation == gen_before + 1);
        FUZZ_CHECK(kernel.accepted == accepted_before + 1);
        FUZZ_CHECK(switched.size() == switched_before + 1 && switched.back() == gen_before + 1);
        last_async_gen = gen_before + 1;
      } else {
        FUZZ_CHECK(sb.state().generation == gen_before);
        FUZZ_CHECK(kernel.accepted == accepted_before);
        if (slot.cmd == "status") {
          for (const char* k : {"phase", "mode", "generation", "entries", "counters"}) FUZZ_CHECK(r.contains(k));
        }
        if (slot.cmd == "explain") {  // the DESIGN §2 contract
          FUZZ_CHECK(r["allowed"].is_boolean() && r["reason"].is_string());
          FUZZ_CHECK(r["entry"].is_string() || (r["entry"].is_null() && r["learned_name"].is_null()));
        }
      }
      check_kernel_state(kernel, sb);
    }
    if (!hold) {
      proxy.complete_all();
      drain();
    }
    hold = false;
  }
  // Each queued apply asks its names once the one before it is done.
  for (int round = 0; round < 64 && !proxy.pending.empty(); ++round) {
    proxy.complete_all();
    drain();
  }
  for (const Slot& s : slots) FUZZ_CHECK(s.replies == 1);
  check_kernel_state(kernel, sb);
  return 0;
}
