// Sandbox: everything egressd keeps for one network namespace (DESIGN §1).
// This file has the phase machine: start and adopt, the apply queue with
// its pre-resolution, switches, learning from DNS answers, and gathers the
// state the status reply is built from (status_view.cc builds it).
//
// Over 1,000 lines because these share one invariant: the kernel's table,
// state_ and the learned-address store change together, in one place, on
// the loop. The concerns that do not touch it live beside it:
// sandbox_control.cc (requests), sandbox_tamper.cc, sandbox_rules.cc,
// sandbox_metrics.cc, sandbox_audit.cc, sandbox_explain.cc, sandbox_pin.cc.
#include "daemon/sandbox.h"

#include <spdlog/spdlog.h>
#include <set>
#include <nettle/sha2.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <cassert>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "control/protocol.h"
#include "daemon/audit_log.h"
#include "daemon/inline_state.h"
#include "egressd/async_callback.h"
#include "egressd/module_logger.h"
#include "dns/message.h"
#include "nft/read_async.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::shared_ptr<spdlog::logger> log() { return module_logger("sandbox"); }

}  // namespace

// Appends the adds of `plain` and `replace` to learned set `set`. Each
// element's comment names what its address was learned for (docs/pinning.md
// "Restarts"). Adding an element that exists keeps its old comment and, on
// most kernels, its expiry (named_learned_elems), so an element the kernel
// may have is replaced: add (creates it if it expired meanwhile), delete,
// add with the new comment and timeout, all in the caller's one
// transaction, so the address is never out of the set.
void Sandbox::push_learned_elems(std::vector<nft::Op>& ops, const std::string& set, nft::SetType type,
                                 std::vector<nft::SetElem> plain, std::vector<nft::SetElem> replace) {
  if (!plain.empty()) ops.push_back(nft::OpAddElems{set, type, false, std::move(plain)});
  if (replace.empty()) return;
  ops.push_back(nft::OpAddElems{set, type, false, replace});
  std::vector<nft::SetElem> keys;
  for (const auto& e : replace) keys.push_back({e.from, e.to});
  ops.push_back(nft::OpDeleteElems{set, type, false, std::move(keys)});
  ops.push_back(nft::OpAddElems{set, type, false, std::move(replace)});
}

Status write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return errno_error("cannot write " + tmp, errno);
    out << text;
    out.flush();
    if (!out) return errno_error("cannot write " + tmp, errno);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return errno_error("cannot rename " + tmp + " to " + path, errno);
  return {};
}

std::string read_resolv_conf() {
  std::ifstream in("/etc/resolv.conf");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

nft::CompileOptions compile_options(const std::vector<std::string>& upstream, int dns_port) {
  nft::CompileOptions o;
  o.dns_port = static_cast<std::uint16_t>(dns_port);
  for (const auto& u : upstream) {
    // Bare addresses only (the policy loader accepts nothing else); port 53.
    if (auto ip = parse_ip(u)) o.upstreams.push_back(*ip);
  }
  // The daemon runs the pinning queue reader (daemon/pinq); the policy's
  // enforce.pin_names decides whether allowlist phases use it.
  o.pin = true;
  return o;
}

std::string render_script(const Policy& policy, const nft::ActiveState& st, const nft::CompileOptions& opts) {
  std::string out = nft::render_table(nft::build_table(policy, nullptr, st, opts));
  if (auto nd = nft::build_netdev_table(st, opts)) out += nft::render_table(*nd);
  if (opts.dns_port != 0) {
    // nft -f names a cgroup by its path only; the daemon learns its own
    // cgroup's id when it starts.
    out += "# Not printed: chains own_sockets, own_input, own_nat and what goes with them (their jumps, own_foreign,\n"
           "# own_input_own, own_nat_own), which egressd adds with the id of its own cgroup (event own_cgroup;\n"
           "# docs/security.md, \"The secrets\").\n";
  }
  return out;
}

json Capabilities::to_json() const {
  const bool allow = filter && sets;
  return {
      {"disable_internet", filter},
      {"network_allowlist", allow},
      {"network_allowlist_hostnames", allow && nat && timeout_sets},
      {"network_allowlist_wildcard_hostnames", allow && nat && timeout_sets},
      {"network_allowlist_ipv4_addresses", allow},
      {"network_allowlist_ipv6_addresses", allow && ipv6},
      {"network_allowlist_ipv4_cidrs", allow},
      {"network_allowlist_ipv6_cidrs", allow && ipv6},
      {"dynamic_network_policy", filter},
      // egressd's own: AF_PACKET frames (CAP_NET_RAW) are held to the policy
      // only where the kernel has the netdev egress hook; egressd never
      // claims it otherwise (docs/security.md).
      {"block_raw_frames", filter && egress_hook},
      {"fib_match", fib},
      {"socket_match", socket},
  };
}

Capabilities probe_capabilities(nft::Kernel& kernel) {
  Capabilities caps;
  caps.ipv6 = ::access("/proc/net/if_inet6", F_OK) == 0;
  // Each feature is probed on its own so one missing module does not hide the others.
  auto probe = [&](nft::Table t) {
    t.name = "egressd_probe";
    nft::Change ch;
    ch.table = t.name;
    ch.ops.push_back(nft::OpAddTable{t});
    ch.ops.push_back(nft::OpDeleteTable{t.name});
    return kernel.apply(ch).ok();
  };
  nft::Table filter;
  filter.chains.push_back({"output", nft::BaseChain{nft::HookType::filter, 0, false},
                           {{{nft::StmtCounter{}, nft::StmtRejectAdminProhibited{}}, ""}}});
  caps.filter = probe(filter);
  nft::Table sets;
  sets.sets.push_back({"h", nft::SetType::ipv4_addr, false, false, {}});
  sets.sets.push_back({"i", nft::SetType::ipv6_addr, true, false, {}});
  caps.sets = probe(sets);
  nft::Table timeouts;
  timeouts.sets.push_back({"t", nft::SetType::ipv4_addr, false, true, {}});
  caps.timeout_sets = probe(timeouts);
  nft::Table nat;
  nat.chains.push_back({"nat", nft::BaseChain{nft::HookType::nat, -100, false},
                        {{{nft::MatchDport{17, 53}, nft::StmtRedirect{53}}, ""}}});
  caps.nat = probe(nat);
  nft::Table fib;
  fib.chains.push_back({"output", nft::BaseChain{nft::HookType::filter, 0, false},
                        {{{nft::MatchFibAddrType{false, nft::AddrType::local, true}, nft::StmtCounter{}}, ""}}});
  caps.fib = probe(fib);
  nft::Table sock;
  sock.chains.push_back({"input", nft::BaseChain{nft::HookType::filter, 0, false, nft::Hook::input},
                         {{{nft::MatchSocketMark{1}, nft::StmtCounter{}}, ""}}});
  caps.socket = probe(sock);
  // An egress chain on `lo` (every namespace has it) tells whether the hook
  // exists; nothing stays.
  nft::Table egress;
  egress.family = nft::Family::netdev;
  egress.chains.push_back({"eg", nft::BaseChain{nft::HookType::filter, 0, false, nft::Hook::egress, "lo"},
                           {{{nft::MatchMetaProtocolArp{}, nft::StmtCounter{}}, ""}}});
  {
    egress.name = "egressd_probe";
    nft::Change ch;
    ch.table = egress.name;
    ch.ops.push_back(nft::OpAddTable{egress});
    ch.ops.push_back(nft::OpDeleteTable{egress.name, nft::Family::netdev});
    caps.egress_hook = kernel.apply(ch).ok();
  }
  return caps;
}

Status check_capabilities(const Phase& phase, const Capabilities& caps) {
  if (!caps.filter) return Error::runtime("this kernel cannot filter output in an inet table (nf_tables, nft_reject)");
  if (phase.mode != Mode::allowlist) return {};
  if (!caps.sets) return Error::runtime("this kernel lacks nftables sets, which allowlists need");
  if (caps.ipv6) return {};
  for (const auto& e : phase.entries) {
    if ((e.kind == EntryKind::ipv6 || e.kind == EntryKind::ipv6_cidr) && !caps.ipv6) {
      return Error::invalid("entry \"" + e.text + "\" in phase " + phase.name +
                            ": IPv6 is disabled in this network namespace");
    }
  }
  return {};
}

PhaseFacts::PhaseFacts(const Phase& phase) : matcher(std::make_shared<const dns::NameMatcher>(phase.entries)) {
  for (const Entry& e : phase.entries) {
    ++counts[static_cast<std::size_t>(e.kind)];
    if (e.kind == EntryKind::hostname) hostnames.push_back(e.text);
  }
}

json PhaseFacts::counts_json() const { return entry_counts_json(counts); }

std::shared_ptr<const PhaseFacts> Sandbox::facts(const Phase& phase) const {
  const auto& named = opts_.policy.phases;
  const bool is_named = !named.empty() && &phase >= named.data() && &phase < named.data() + named.size();
  if (!is_named) return std::make_shared<const PhaseFacts>(phase);
  auto& slot = named_facts_[&phase];
  if (!slot) slot = std::make_shared<const PhaseFacts>(phase);
  return slot;
}

static std::size_t element_count(const nft::Change& ch) {
  std::size_t n = 0;
  for (const auto& op : ch.ops) {
    if (const auto* t = std::get_if<nft::OpAddTable>(&op)) {
      for (const auto& set : t->table.sets) n += set.elems.size();
    } else if (const auto* a = std::get_if<nft::OpAddSet>(&op)) {
      n += a->set.elems.size();
    } else if (const auto* e = std::get_if<nft::OpAddElems>(&op)) {
      n += e->elems.size();
    } else if (const auto* d = std::get_if<nft::OpDeleteElems>(&op)) {
      n += d->elems.size();
    }
  }
  return n;
}

Status Sandbox::apply_batch(const nft::Change& ch) {
  if (!large_batch_runner_ || element_count(ch) < kLargeBatchElements) return kernel_->apply(ch);
  return large_batch_runner_([&] { return kernel_->apply(ch); });
}

Sandbox::Sandbox(SandboxOptions opts, std::unique_ptr<nft::Kernel> kernel, Capabilities caps)
    : opts_(std::move(opts)), kernel_(std::move(kernel)), caps_(caps) {}

const Phase& Sandbox::active_phase() const {
  if (state_.is_inline && inline_) return *inline_;
  if (const Phase* p = opts_.policy.find(state_.phase)) return *p;
  static const Phase unknown{"unknown", Mode::no_network, {}};
  return unknown;
}

Status Sandbox::install(const Phase& phase, std::uint64_t generation, bool replace_existing) {
  const nft::ActiveState st = nft::make_state(opts_.policy, phase, generation, opts_.policy.find(phase.name) != &phase,
                                              opts_.compile.mark_salt);
  nft::Change ch;
  ch.table = nft::kTableName;
  if (replace_existing) ch.ops.push_back(nft::OpDeleteTable{nft::kTableName});
  ch.ops.push_back(nft::OpAddTable{
      nft::build_table(opts_.policy, st.is_inline ? &phase : nullptr, st, opts_.compile)});
  const nft::ActiveState prev = std::exchange(state_, st);
  rebuild_netdev(ch);
  if (auto s = apply_batch(ch); !s) {
    state_ = prev;
    return s;
  }
  active_facts_ = facts(phase);
  return {};
}

void Sandbox::rebuild_netdev(nft::Change& ch) const {
  auto t = nft::build_netdev_table(state_, opts_.compile);
  if (!t) return;
  // Stateless (the mode in force, the interfaces, the secrets), so always
  // rebuilt whole: ensure + delete + add is one transaction whether or not
  // the table was there.
  ch.ops.push_back(nft::OpEnsureTable{nft::kTableName, nft::Family::netdev});
  ch.ops.push_back(nft::OpDeleteTable{nft::kTableName, nft::Family::netdev});
  ch.ops.push_back(nft::OpAddTable{std::move(*t)});
}

namespace {

// Secrets must differ from the defaults `render` prints and from each other;
// a priority of 0 ("none") or 0xffffffff ("root") would be one anybody sets.
std::uint32_t draw(const std::function<std::uint32_t()>& random, std::initializer_list<std::uint32_t> not_these) {
  for (;;) {
    const std::uint32_t v = random();
    if (std::find(not_these.begin(), not_these.end(), v) == not_these.end()) return v;
  }
}

}  // namespace

namespace {

// The kernel sets an skb's priority from a queue verdict (NFQA_PRIORITY,
// Linux >= 5.18); an older one ignores the attribute, and a rule that asked
// for it would send every verdict back to the reader.
bool queue_verdict_sets_priority() {
  utsname u{};
  if (::uname(&u) != 0) return false;
  unsigned major = 0, minor = 0;
  if (std::sscanf(u.release, "%u.%u", &major, &minor) != 2) return false;
  return major > 5 || (major == 5 && minor >= 18);
}

// The pin priority (nft/compile.h kPinPriority) follows from the table's other
// secrets, so a restart adopts it with them and the table comment (127 bytes,
// full) needs no room for it: the first 32 bits of a SHA-256 over them that
// are none of the values anybody sets or another secret holds.
std::uint32_t pin_priority_of(const nft::CompileOptions& c) {
  for (std::uint8_t round = 0;; ++round) {
    sha256_ctx ctx;
    sha256_init(&ctx);
    static constexpr char kLabel[] = "egressd pin priority";
    sha256_update(&ctx, sizeof kLabel - 1, reinterpret_cast<const std::uint8_t*>(kLabel));
    for (std::uint32_t v : {c.own_mark, c.pass_mark, c.pass_priority, c.proxy_mark, c.pin_mark}) {
      const std::uint8_t b[4] = {static_cast<std::uint8_t>(v >> 24), static_cast<std::uint8_t>(v >> 16),
                                 static_cast<std::uint8_t>(v >> 8), static_cast<std::uint8_t>(v)};
      sha256_update(&ctx, sizeof b, b);
    }
    sha256_update(&ctx, 1, &round);
    std::uint8_t digest[SHA256_DIGEST_SIZE];
    sha256_digest(&ctx, sizeof digest, digest);
    const std::uint32_t p = (std::uint32_t{digest[0]} << 24) | (std::uint32_t{digest[1]} << 16) |
                            (std::uint32_t{digest[2]} << 8) | digest[3];
    if (p != 0 && p != 0xffffffffu && p != nft::kPinPriority && p != nft::kPassPriority && p != c.pass_priority) {
      return p;
    }
  }
}

}  // namespace

std::string Sandbox::table_id() const {
  // One-way: the state file may be read where the table cannot be.
  const auto& c = opts_.compile;
  const std::string in = fmt::format("egressd table {:08x} {:08x} {:08x} {:08x} {:08x}", c.own_mark, c.pass_mark,
                                     c.pass_priority, c.proxy_mark, c.pin_mark);
  sha256_ctx ctx;
  sha256_init(&ctx);
  sha256_update(&ctx, in.size(), reinterpret_cast<const std::uint8_t*>(in.data()));
  std::array<std::uint8_t, SHA256_DIGEST_SIZE> d{};
  sha256_digest(&ctx, d.size(), d.data());
  std::string out;
  for (std::size_t i = 0; i < 12; ++i) out += fmt::format("{:02x}", d[i]);
  return out;
}

void Sandbox::draw_secrets() {
  if (!opts_.random) return;
  auto& c = opts_.compile;
  c.own_mark = draw(opts_.random, {0, nft::kOwnTrafficMark});
  c.pass_mark = draw(opts_.random, {0, nft::kPassMark, c.own_mark});
  c.pass_priority = draw(opts_.random, {0, 0xffffffffu, nft::kPassPriority});
  c.proxy_mark = draw(opts_.random, {0, nft::kOwnTrafficMark, nft::kPassMark, nft::kProxyMark, c.own_mark, c.pass_mark});
  // Neither it nor the marks derived from it (~m, ~m ^ 1) may be another secret.
  const auto taken = [&c](std::uint32_t m) { return m == c.own_mark || m == c.pass_mark || m == c.proxy_mark; };
  do {
    c.pin_mark = draw(opts_.random, {0, nft::kPinMark, c.own_mark, c.pass_mark, c.proxy_mark});
  } while (taken(nft::pin_admit_mark(c.pin_mark)) || taken(nft::pin_follow_mark(c.pin_mark)));
  draw_salt();
}

void Sandbox::draw_salt() {
  if (!opts_.random) return;
  opts_.compile.mark_salt = draw(opts_.random, {opts_.compile.mark_salt});
}

Status Sandbox::update_network(const NetworkView& view) {
  const NetworkView before{opts_.compile.interfaces, opts_.compile.onlink6};
  if (view == before && started_) return {};
  opts_.compile.interfaces = view.interfaces;
  opts_.compile.onlink6 = view.onlink6;
  if (!started_) return {};
  nft::Change ch;
  ch.table = nft::kTableName;
  if (opts_.compile.netdev) {
    for (const auto& name : before.interfaces) {
      if (std::binary_search(view.interfaces.begin(), view.interfaces.end(), name)) continue;
      // The interface went (deleted, or moved to another namespace): its
      // chain goes too. Flushed first: a chain must be empty to be deleted.
      ch.ops.push_back(nft::OpFlushChain{nft::egress_chain_name(name), nft::Family::netdev});
      ch.ops.push_back(nft::OpDeleteChain{nft::egress_chain_name(name), nft::Family::netdev});
    }
    for (const auto& name : view.interfaces) {
      if (std::binary_search(before.interfaces.begin(), before.interfaces.end(), name)) continue;
      ch.ops.push_back(nft::OpAddChain{nft::egress_chain(name), nft::Family::netdev});
    }
  }
  if (view.onlink6 != before.onlink6) {
    // Whole set: a handful of prefixes, and merged ranges do not diff well.
    const auto old_elems = nft::make_interval_elems(before.onlink6);
    const auto new_elems = nft::make_interval_elems(view.onlink6);
    if (!old_elems.empty()) {
      ch.ops.push_back(nft::OpDeleteElems{nft::kOnlinkSet6, nft::SetType::ipv6_addr, true, old_elems});
    }
    if (!new_elems.empty()) {
      ch.ops.push_back(nft::OpAddElems{nft::kOnlinkSet6, nft::SetType::ipv6_addr, true, new_elems});
    }
  }
  if (ch.ops.empty()) return {};
  if (auto st = kernel_->apply(ch); !st) {
    log()->error("interfaces changed; table update failed (restoring): {}", st.error().message);
    // The table may hold chains for interfaces that no longer exist or lack
    // some: rebuild it from the view (the view is kept either way).
    return restore_table();
  }
  log()->info("interfaces={} onlink6={}", fmt::join(view.interfaces, ","), view.onlink6.size());
  return {};
}

Status Sandbox::add_relay_upstream(const IpPrefix& addr) {
  if ((addr.family != 4 && addr.family != 6) || addr.prefix_len != addr.size() * 8) {
    return Error::invalid("relay upstream " + addr.to_string() + ": not a single address");
  }
  auto& extra = opts_.compile.extra_upstreams;
  const auto& conf = opts_.compile.upstreams;
  if (std::find(extra.begin(), extra.end(), addr) != extra.end() ||
      std::find(conf.begin(), conf.end(), addr) != conf.end()) {
    return {};
  }
  if (started_) {
    nft::Change ch;
    ch.table = nft::kTableName;
    ch.ops.push_back(nft::OpAddElems{upstream_set(addr), addr.family == 4 ? nft::SetType::ipv4_addr : nft::SetType::ipv6_addr,
                                     false, {{addr, addr, 0}}});
    if (auto st = kernel_->apply(ch); !st) return st;
  }
  extra.push_back(addr);
  log()->info("relay upstream added address={}", addr.to_string());
  return {};
}

Status Sandbox::remove_relay_upstream(const IpPrefix& addr) {
  const auto& conf = opts_.compile.upstreams;
  if (std::find(conf.begin(), conf.end(), addr) != conf.end()) {
    return Error::invalid("relay upstream " + addr.to_string() + ": a configured upstream (dns.upstream) stays");
  }
  auto& extra = opts_.compile.extra_upstreams;
  const auto it = std::find(extra.begin(), extra.end(), addr);
  if (it == extra.end()) return {};
  if (started_) {
    nft::Change ch;
    ch.table = nft::kTableName;
    ch.ops.push_back(nft::OpDeleteElems{upstream_set(addr),
                                        addr.family == 4 ? nft::SetType::ipv4_addr : nft::SetType::ipv6_addr, false,
                                        {{addr, addr, 0}}});
    if (auto st = kernel_->apply(ch); !st) return st;
  }
  extra.erase(it);
  log()->info("relay upstream removed address={}", addr.to_string());
  return {};
}

std::string Sandbox::upstream_set(const IpPrefix& addr) {
  const bool lo = is_loopback(addr);
  if (addr.family == 4) return lo ? nft::kLoUpstreamSet4 : nft::kUpstreamSet4;
  return lo ? nft::kLoUpstreamSet6 : nft::kUpstreamSet6;
}

void Sandbox::adopt_relay_upstreams() {
  // Elements of the kernel's upstream sets that the config does not name
  // were added at run time (add_relay_upstream) by the egressd before us.
  for (const auto& [set, type] : {std::pair{nft::kUpstreamSet4, nft::SetType::ipv4_addr},
                                  {nft::kUpstreamSet6, nft::SetType::ipv6_addr},
                                  {nft::kLoUpstreamSet4, nft::SetType::ipv4_addr},
                                  {nft::kLoUpstreamSet6, nft::SetType::ipv6_addr}}) {
    auto elems = kernel_->read_set_elems(nft::kTableName, set, type);
    if (!elems) {
      log()->debug("relay upstreams not adopted from set {}: {}", set, elems.error().message);
      continue;
    }
    for (const auto& e : *elems) {
      const auto& conf = opts_.compile.upstreams;
      auto& extra = opts_.compile.extra_upstreams;
      if (std::find(conf.begin(), conf.end(), e.from) != conf.end()) continue;
      if (std::find(extra.begin(), extra.end(), e.from) != extra.end()) continue;
      extra.push_back(e.from);
      log()->info("relay upstream adopted address={}", e.from.to_string());
    }
  }
}

[[gnu::cold]] Status Sandbox::start(const std::string& initial_phase) {  // start-up only: for size
  for (const auto& ph : opts_.policy.phases) {
    if (auto s = check_capabilities(ph, caps_); !s) return s;
  }
  const Phase* initial = opts_.policy.find(initial_phase);
  if (initial == nullptr) return Error::invalid("unknown phase \"" + initial_phase + "\"");
  opts_.compile.netdev = caps_.egress_hook;

  auto existing = kernel_->read_table(nft::kTableName, nft::Family::inet);
  if (!existing) return existing.error().wrap("cannot read table inet egressd");
  const std::string comment = existing->has_value() ? (*existing)->comment : "";
  const auto secrets = nft::secrets_from_table_comment(comment);
  const std::uint32_t kept_mark = nft::mark_from_table_comment(comment);
  // The secrets of a table we find are adopted (its rules use them, and the
  // own mark is what the DNS proxy's sockets must carry); a fresh table, or
  // one an older egressd made (only a mark), gets new ones.
  draw_secrets();
  if (secrets) {
    opts_.compile.own_mark = secrets->own_mark;
    opts_.compile.pass_mark = secrets->pass_mark;
    opts_.compile.pass_priority = secrets->pass_priority;
    // A table from before the proxy had a mark keeps the one just drawn
    // (its digest differs, so it is staged anew with it).
    if (secrets->proxy_mark != 0) opts_.compile.proxy_mark = secrets->proxy_mark;
    // A table from before the pin mark: its pin rules use marks derived from
    // the pass mark, which is what they were.
    opts_.compile.pin_mark = secrets->pin_mark != 0 ? secrets->pin_mark : secrets->pass_mark;
  } else if (kept_mark != 0) {
    opts_.compile.own_mark = kept_mark;
  }
  // A table made before the pin priority asks for the mark alone: its digest
  // differs, so it is staged anew with both.
  opts_.compile.pin_priority = queue_verdict_sets_priority() ? pin_priority_of(opts_.compile) : 0;
  const bool same_config =
      existing->has_value() && nft::digest_from_table_comment(comment) == nft::staged_digest(opts_.policy, opts_.compile);
  // Class 9: the phase marks derive from the salt. The same config keeps it
  // (flows allowed before the restart keep their mark); a changed config
  // (phases reordered, renamed, entries changed) gets a new one, so a flow a
  // switch cut cannot come back under another phase's old mark.
  if (same_config && secrets) {
    opts_.compile.mark_salt = secrets->mark_salt;
  } else if (secrets) {
    opts_.compile.mark_salt = secrets->mark_salt;
    draw_salt();
  }
  if (existing->has_value()) adopt_relay_upstreams();
  started_ = true;
  if (auto s = start_inet(*initial, existing->has_value() ? &**existing : nullptr, same_config && secrets); !s) {
    started_ = false;
    return s;
  }
  return {};
}

[[gnu::cold]] Status Sandbox::start_inet(const Phase& initial, const nft::TableInfo* existing,
                                        bool same_config) {  // start-up only: for size
  if (existing == nullptr) {
    if (auto s = install(initial, 1, false); !s) return s;
    log()->info("installed phase={} mode={} gen={}", initial.name, to_string(initial.mode), 1);
    return {};
  }
  const nft::TableInfo& info = *existing;
  std::optional<nft::ActiveState> adopted;
  for (const auto& r : info.rules) {
    if (r.chain != "active" || r.comment.empty()) continue;
    if (auto st = nft::ActiveState::parse_comment(r.comment)) adopted = *st;
    break;
  }
  if (!adopted) {
    // A table of our name without our state: someone else's or a torn one.
    // Replace it in one batch (no window) with the initial phase.
    if (auto s = install(initial, 1, true); !s) return s;
    log()->warn("replaced table inet egressd that carried no egressd state; phase={} gen=1", initial.name);
    return {};
  }
  // A restart (or a re-add to the agent): the hosts file's snapshot is the one
  // kept when the table was made, not the file as the sandbox may have
  // rewritten it since (start_hosts).
  adopted_ = true;

  std::optional<Phase> adopted_inline;
  if (adopted->is_inline) {
    adopted_inline = load_inline_state(adopted->generation);
    if (!adopted_inline) inline_unknown_ = true;
  }
  const Phase* named = adopted->is_inline ? nullptr : opts_.policy.find(adopted->phase);

  if (same_config && (named != nullptr || adopted->is_inline)) {
    state_ = *adopted;
    inline_ = adopted_inline;
    active_facts_ = facts(active_phase());
    // The learned sets were kept with the table; the names each address was
    // learned for are in its comment: pinning admits what it admitted.
    restore_learned();
    // The inet table stays as it is; the netdev table is rebuilt for this
    // namespace's interfaces now (one batch: no moment without it).
    nft::Change ch;
    ch.table = nft::kTableName;
    rebuild_netdev(ch);
    // The cgroup ladders name the cgroups of now: a restarted sidecar
    // container (or dockerd) is in a new one, and the old one's id is
    // never reused (until this batch, egressd's own packets were taken for a sandbox's).
    for (auto& chain : nft::cgroup_chains(opts_.compile)) {
      ch.ops.push_back(nft::OpFlushChain{chain.name});
      for (auto& r : chain.rules) ch.ops.push_back(nft::OpAddRule{chain.name, std::move(r)});
    }
    if (!ch.ops.empty()) {
      if (auto s = kernel_->apply(ch); !s) return s.error().wrap("cannot refresh the adopted table");
    }
    audit_event("adoption",
                {{"phase", state_.phase}, {"mode", to_string(state_.mode)}, {"generation", state_.generation},
                 {"restaged", false}},
                spdlog::level::info,
                fmt::format("adopted phase={} mode={} gen={} (table unchanged)", state_.phase,
                            to_string(state_.mode), state_.generation));
    return {};
  }
  // The config changed: restage every phase in one batch, keeping the phase
  // in force and its generation when it still exists.
  if (named != nullptr) {
    if (auto s = install(*named, adopted->generation, true); !s) return s;
    audit_event("adoption",
                {{"phase", named->name}, {"mode", to_string(state_.mode)}, {"generation", state_.generation},
                 {"restaged", true}},
                spdlog::level::info,
                fmt::format("adopted phase={} gen={} and restaged the changed config", named->name,
                            state_.generation));
    return {};
  }
  if (adopted_inline) {
    inline_ = adopted_inline;
    if (auto s = install(*inline_, adopted->generation, true); !s) return s;
    audit_event("adoption",
                {{"phase", "inline"}, {"mode", to_string(state_.mode)}, {"generation", state_.generation},
                 {"restaged", true}},
                spdlog::level::info,
                fmt::format("adopted inline policy gen={} and restaged the changed config", state_.generation));
    return {};
  }
  // Fail closed: the phase in force, which the orchestrator was told of, is
  // unknown here, and the initial phase may be wider (found by an attack
  // review: `ok` for a no-network phase, a kill, a restart with a config
  // without it and `initial_phase: environment` (public) opened everything).
  // An initial phase of mode no-network is taken as it is; any other, no:
  // an inline no-network policy is, until the orchestrator applies one.
  if (initial.mode == Mode::no_network) {
    if (auto s = install(initial, adopted->generation + 1, true); !s) return s;
    inline_.reset();
  } else {
    auto closed = make_inline_phase("inline", Mode::no_network, {});
    if (!closed) return closed.error();
    inline_ = std::move(closed).value();
    if (auto s = install(*inline_, adopted->generation + 1, true); !s) return s;
    save_inline_state();
  }
  inline_unknown_ = false;
  const std::string now = state_.is_inline ? std::string("inline") : initial.name;
  audit_event("adoption",
              {{"phase", now}, {"mode", to_string(state_.mode)}, {"generation", state_.generation},
               {"restaged", true}, {"dropped_phase", adopted->phase}},
              spdlog::level::warn,
              fmt::format("adopted phase={} cannot be carried into the new config (unknown there, or an inline "
                          "policy without its state file); switched to {} (no-network) gen={} until a phase is "
                          "applied",
                          adopted->phase, state_.is_inline ? std::string("an inline policy") : "phase=" + initial.name,
                          state_.generation));
  return {};
}

Result<json> Sandbox::switch_to(const std::shared_ptr<const Phase>& target_ptr,
                                std::shared_ptr<const PhaseFacts> target_facts, bool is_inline,
                                Preresolved pre) {
  std::vector<std::string> unresolved = std::move(pre.unresolved);
  const Phase& target = *target_ptr;
  if (auto s = check_capabilities(target, caps_); !s) return s.error();
  flush_learned();  // addresses answered under the old phase go in before it changes
  // The hosts file is read again at every switch (docs/pinning.md "Hosts files").
  if (hosts_started_) (void)read_hosts();
  const auto t0 = Clock::now();
  const nft::ActiveState next =
      nft::make_state(opts_.policy, target, state_.generation + 1, is_inline, opts_.compile.mark_salt);
  nft::Change ch = nft::build_switch(opts_.policy, target, next, state_, opts_.compile);
  // Addresses the new phase allows by name (pre-resolved just now, or learned
  // earlier) go into its sets in the same transaction: no window where a
  // client's cached address is refused.
  const std::string chain = is_inline ? nft::inline_chain(next.generation) : nft::phase_chain(target.name);
  for (auto& op : carried_learned(target, *target_facts, chain, pre.pairs)) ch.ops.push_back(std::move(op));
  if (auto s = apply_batch(ch); !s) {
    ++switch_failures_;
    // The file may have been read anew above: the phase in force keeps its pairs as read now.
    if (hosts_started_) sync_hosts_store();
    log()->error("switch from={} to={} failed: {}", state_.phase, next.phase, s.error().message);
    return s.error();
  }
  // Remembered only now, with the new phase in force: a pair remembered
  // before a refused batch would let learn() skip a sandbox answer carrying
  // its address as already in the old phase's sets.
  for (const auto& [name, addr, ms] : pre.pairs) remember(name, addr, ms);
  ++switches_;
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
  const std::string from = state_.phase;
  state_ = next;
  active_facts_ = std::move(target_facts);
  if (hosts_started_) {
    sync_hosts_store();  // the new phase's hosts pairs went in with the batch
    hosts_refreshed_ = opts_.clock.steady();
  }
  if (is_inline) {
    inline_ = target;
    // After the reply: the kernel already holds the policy, and the file only
    // restores the entries' names for status after a restart (a crash in
    // between adopts the table with entries_unknown, still enforced).
    if (opts_.post) {
      opts_.post([this, gen = next.generation] {
        if (state_.generation == gen) save_inline_state();
      });
    } else {
      save_inline_state();
    }
  } else {
    inline_.reset();
  }
  inline_unknown_ = false;
  const json counts = active_facts_->counts_json();
  audit_event("switch",
              {{"from", from},
               {"to", next.phase},
               {"mode", to_string(target.mode)},
               {"generation", next.generation},
               {"entries", counts},
               {"unresolved", unresolved.size()},
               {"duration_us", us}},
              spdlog::level::info,
              fmt::format("switch from={} to={} mode={} gen={} entries={} hostname={} wildcard={} ipv4={} ipv6={} "
                          "ipv4_cidr={} ipv6_cidr={} unresolved={} duration_us={}",
                          from, next.phase, to_string(target.mode), next.generation, target.entries.size(),
                          counts["hostname"].get<std::size_t>(), counts["wildcard"].get<std::size_t>(),
                          counts["ipv4"].get<std::size_t>(), counts["ipv6"].get<std::size_t>(),
                          counts["ipv4-cidr"].get<std::size_t>(), counts["ipv6-cidr"].get<std::size_t>(),
                          unresolved.size(), us));
  if (opts_.after_switch) opts_.after_switch(target_ptr, next.generation);
  return json(control::ApplyReply{next.phase, std::string(to_string(target.mode)), next.generation, us,
                                  counts.get<std::map<std::string, std::uint64_t>>(), std::move(unresolved)});
}

void Sandbox::enqueue_apply(ApplyJob job) {
  applies_.push_back(std::move(job));
  if (!applying_) run_applies();
}

void Sandbox::run_applies() {
  applying_ = true;
  while (!applies_.empty()) {
    ApplyJob job = std::move(applies_.front());
    applies_.pop_front();
    job.facts = facts(*job.target);
    std::vector<std::string> names;
    if (proxy_ != nullptr && job.target->mode == Mode::allowlist) names = job.facts->hostnames;
    if (names.empty()) {
      finish_apply(std::move(job), {});
      continue;
    }
    // Without the loop's executor (tests, one-shot tools) the job runs to
    // its end here, on a private io_context: the proxy must then answer on
    // this thread (a fake one does, at once).
    std::optional<boost::asio::io_context> own;
    if (!opts_.executor) own.emplace();
    boost::asio::co_spawn(own ? own->get_executor() : opts_.executor, apply_job(std::move(job), std::move(names)),
                          [](std::exception_ptr e) {
                            if (e) std::rethrow_exception(e);  // out of the loop's run(), as from a callback
                          });
    if (own) own->run();
    return;  // apply_job runs the rest of the queue
  }
  applying_ = false;
}

boost::asio::awaitable<void> Sandbox::apply_job(ApplyJob job, std::vector<std::string> names) {
  Preresolved pre = co_await preresolve(std::move(names));
  finish_apply(std::move(job), std::move(pre));
  run_applies();
}

namespace {

// Proxy::resolve as an asio operation, void(Result<std::vector<Learned>>).
template <class CompletionToken>
auto async_resolve(dns::Proxy& proxy, const std::string& name, const boost::asio::any_io_executor& ex,
                   CompletionToken&& token) {
  using Done = std::function<void(Result<std::vector<dns::Learned>>)>;
  return async_from_callback<Result<std::vector<dns::Learned>>>(
      ex, std::forward<CompletionToken>(token), [&proxy, name](Done done) { proxy.resolve(name, std::move(done)); });
}

}  // namespace

// A switch waits at most this long for its pre-resolution.
constexpr std::chrono::seconds kPreresolveDeadline{3};

boost::asio::awaitable<Sandbox::Preresolved> Sandbox::preresolve(std::vector<std::string> names) {
  // The phase's exact hostnames, A and AAAA, all at once, each in a
  // coroutine of its own, raced against kPreresolveDeadline: this one waits
  // on a timer that either expires or is cancelled by the last resolve to
  // end. Each resolve normally ends within the upstream's own budget (1.5 s
  // by default); the deadline bounds a switch even if one never does. A name
  // not answered by then is reported unresolved, and its late answer is
  // dropped (the sandbox's own lookups learn it later). The children share
  // `round`, not this frame, so they may outlive it. Failures are reported
  // in the reply, never fatal.
  struct Round {
    Round(const boost::asio::any_io_executor& ex, std::size_t n) : remaining(n), all_done(ex) {}
    std::size_t remaining;
    bool over = false;
    std::vector<std::string> failed;
    std::vector<Preresolved::Pair> pairs;
    std::set<std::string> pending;
    boost::asio::steady_timer all_done;
  };
  const auto ex = co_await boost::asio::this_coro::executor;
  auto round = std::make_shared<Round>(ex, names.size());
  round->pending.insert(names.begin(), names.end());
  round->all_done.expires_after(kPreresolveDeadline);
  for (const auto& name : names) {
    boost::asio::co_spawn(
        ex,
        [this, ex, round, name]() -> boost::asio::awaitable<void> {
          auto r = co_await async_resolve(*proxy_, name, ex, boost::asio::use_awaitable);
          if (round->over) co_return;  // the switch went ahead without it
          round->pending.erase(name);
          if (!r || r->empty()) {
            round->failed.push_back(name);
            log()->warn("pre-resolution name={} failed: {}", name, r ? "no addresses" : r.error().message);
          } else {
            for (const auto& l : *r) {
              // Pre-resolution asks for exact hostnames only.
              if (auto g = dns::guard_for(l.addr, true, opts_.policy.dns.private_answers)) {
                guarded(name, l.addr, *g, true);
                continue;
              }
              round->pairs.emplace_back(name, l.addr, learn_timeout_ms(l.ttl));
            }
          }
          if (--round->remaining == 0) round->all_done.cancel();
        },
        [](std::exception_ptr e) {
          if (e) std::rethrow_exception(e);
        });
  }
  if (round->remaining > 0) {
    boost::system::error_code ec;
    co_await round->all_done.async_wait(boost::asio::redirect_error(boost::asio::use_awaitable, ec));
  }
  round->over = true;
  std::vector<std::string> unresolved = std::move(round->failed);
  for (const auto& name : round->pending) {
    log()->warn("pre-resolution name={} failed: no answer within {} s", name, kPreresolveDeadline.count());
    unresolved.push_back(name);
  }
  std::sort(unresolved.begin(), unresolved.end());
  co_return Preresolved{std::move(unresolved), std::move(round->pairs)};
}

void Sandbox::finish_apply(ApplyJob job, Preresolved pre) {
  if (closed_) {
    job.reply(control::error_reply("unknown_sandbox",
                                   "the sandbox was removed before this switch was made; its policy did not change"));
    return;
  }
  auto r = switch_to(job.target, std::move(job.facts), job.is_inline, std::move(pre));
  job.reply(r ? control::ok_reply(*r) : control::error_reply(r.error(), "invalid_policy"));
}

void Sandbox::preresolve_active() {
  if (proxy_ == nullptr || state_.mode != Mode::allowlist) return;
  for (const auto& e : active_phase().entries) {
    if (e.kind != EntryKind::hostname) continue;
    proxy_->resolve(e.text, [this, name = e.text](Result<std::vector<dns::Learned>> r) {
      if (!r || r->empty()) {
        log()->warn("pre-resolution name={} failed: {}", name, r ? "no addresses" : r.error().message);
        return;
      }
      learn(std::move(*r), [name](Status s) {
        if (!s) log()->warn("pre-resolution name={} not inserted: {}", name, s.error().message);
      });
    });
  }
}

std::string Sandbox::active_chain() const {
  return state_.is_inline ? nft::inline_chain(state_.generation) : nft::phase_chain(state_.phase);
}

std::uint64_t Sandbox::learn_timeout_ms(std::uint32_t ttl) const {
  // dns.max_ttl caps what an answer asks for (up to 2^31-1 s, and whoever
  // runs an allowed wildcard's zone chooses it); min_ttl <= max_ttl.
  const std::uint64_t capped = std::min<std::uint64_t>(ttl, opts_.policy.dns.max_ttl_s);
  const std::uint64_t s = std::max<std::uint64_t>(capped, opts_.policy.dns.min_ttl_s) +
                          static_cast<std::uint64_t>(opts_.learn_grace.count());
  return s * 1000;
}

void Sandbox::guarded(const std::string& name, const IpPrefix& addr, const dns::LearnGuard& g, bool exact) {
  audit_event("rebinding_guard",
              {{"name", name},
               {"address", addr.to_string()},
               {"learned", false},
               {"guard", g.to_string()},
               {"match", exact ? "exact" : "wildcard"},
               {"private", g.private_range}},
              spdlog::level::warn);
}

void Sandbox::remember(const std::string& name, const IpPrefix& addr, std::uint64_t timeout_ms) {
  // Full (max_learned): the kernel set holds the address anyway; only status
  // and carrying it across switches miss it.
  (void)learned_.remember(name, addr, std::chrono::milliseconds(timeout_ms));
}

std::vector<nft::Op> Sandbox::carried_learned(const Phase& target, const PhaseFacts& facts, const std::string& chain,
                                              const std::vector<Preresolved::Pair>& preresolved) const {
  std::vector<nft::Op> ops;
  if (target.mode != Mode::allowlist) return ops;
  const dns::NameMatcher& m = *facts.matcher;
  if (m.size() == 0) return ops;
  const auto now = learned_.now();
  const auto [s4, s6] = nft::learned_sets(chain);
  // One element per address, with the longest lifetime any name gives it,
  // naming every name that gives it one.
  struct Carried {
    std::uint64_t ms = 0;
    std::vector<std::string> names;
  };
  std::map<IpPrefix, Carried, IpAddrLess> elems;
  auto add = [&](const IpPrefix& a, std::uint64_t ms, const std::string& name) {
    Carried& c = elems[a];
    c.ms = std::max(c.ms, ms);
    if (std::find(c.names.begin(), c.names.end(), name) == c.names.end()) c.names.push_back(name);
  };
  for (const auto& [name, addrs] : learned_.by_name()) {
    const Entry* e = m.match(name);
    if (e == nullptr) continue;
    const bool exact = e->kind == EntryKind::hostname;
    for (const auto& a : addrs) {
      // A hosts-file pair counts here for what DNS gave it; the file's part
      // comes from hosts_ below (the file may have changed since).
      const auto expires = a.hosts ? a.dns_expires : a.expires;
      if (expires <= now) continue;
      // public remembers every answer (attribution, hosts --suggest), the
      // rebinding guard's addresses included; they never enter a learned set.
      if (dns::guard_for(a.addr, exact, opts_.policy.dns.private_answers)) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(expires - now).count();
      add(a.addr, static_cast<std::uint64_t>(std::max<long long>(left, 1000)), name);
    }
  }
  // The switch's pre-resolved pairs (exact hostnames of the target, guard
  // already applied), not remembered until the batch is in.
  for (const auto& [name, addr, ms] : preresolved) add(addr, ms, name);
  // Hosts-file pairs the target allows: refreshed while they stay in the file.
  const auto hosts_ms = static_cast<std::uint64_t>(std::chrono::milliseconds(kHostsTimeout).count());
  for (const auto& [name, addrs] : hosts_allowed(facts, target.mode)) {
    for (const auto& a : addrs) add(a, hosts_ms, name);
  }
  // The target's sets may still hold an element from when it was last in
  // force, with the names of then: every carried element is replaced.
  std::vector<nft::SetElem> v4, v6;
  for (auto& [a, c] : elems) {
    std::sort(c.names.begin(), c.names.end());
    (a.family == 4 ? v4 : v6).push_back(nft::SetElem{a, a, c.ms, names_comment(c.names, nft::kElemCommentMax)});
  }
  push_learned_elems(ops, s4, nft::SetType::ipv4_addr, {}, std::move(v4));
  push_learned_elems(ops, s6, nft::SetType::ipv6_addr, {}, std::move(v6));
  return ops;
}

dns::Action Sandbox::decide(const std::string& qname) {
  switch (state_.mode) {
    case Mode::public_: return dns::Action::forward;
    case Mode::no_network: return dns::Action::refuse;
    case Mode::allowlist: break;
  }
  if (!state_.is_inline && opts_.policy.find(state_.phase) == nullptr && !inline_) return dns::Action::refuse;
  if (active_facts_->matcher->matches(qname)) return dns::Action::forward;
  return opts_.policy.dns.deny_answer == DenyAnswer::nxdomain ? dns::Action::nxdomain : dns::Action::refuse;
}

void Sandbox::relay_targets(const std::vector<IpPrefix>& targets, const std::string& source,
                            std::function<void(Status)> done) {
  // egressd's own marked traffic may go to the configured upstreams' port 53
  // and to these targets, nowhere else. They stay in the kernel's upstream
  // sets: a restarted egressd adopts them (relay_upstreams()) and does not
  // probe again.
  Status st;
  std::vector<std::string> text;
  for (const auto& t : targets) {
    text.push_back(t.to_string());
    if (st) st = add_relay_upstream(t);
  }
  audit_event("forwarder_pinned", {{"targets", text}, {"source", source}, {"ok", st.ok()}},
              st ? spdlog::level::info : spdlog::level::err);
  done(st);
}

void Sandbox::refused(const std::string& qname, std::uint16_t qtype) {
  ++dns_refused_;
  const auto now = opts_.clock.wall();
  names_.refused(state_.phase, qname, now);
  if (denied_.add_dns(qname, state_.phase, now)) wake_denied_waiters();
  log()->debug("dns refused qname={} qtype={} phase={}", qname, qtype, state_.phase);
}

void Sandbox::learn(std::vector<dns::Learned> addrs, std::function<void(Status)> done) {
  if (addrs.size() > kMaxLearnedPerAnswer) {
    audit_event("answer_capped",
                {{"name", addrs.front().qname}, {"addresses", addrs.size()}, {"learned", kMaxLearnedPerAnswer}},
                spdlog::level::warn,
                fmt::format("answer for {} carried {} addresses; only the first {} are learned (connections to the "
                            "others are denied)",
                            addrs.front().qname, addrs.size(), kMaxLearnedPerAnswer));
    addrs.resize(kMaxLearnedPerAnswer);
  }
  // Every answer, in every mode, feeds name attribution (`denied`, `hosts`).
  // Only answers reach here: a refused name was never resolved.
  if (!addrs.empty()) {
    std::vector<IpPrefix> ips;
    for (std::size_t i = 0; i < addrs.size(); ++i) {
      ips.push_back(addrs[i].addr);
      if (i + 1 == addrs.size() || addrs[i + 1].qname != addrs[i].qname) {
        names_.observe(state_.phase, addrs[i].qname, ips, opts_.clock.wall());
        ips.clear();
      }
    }
  }
  if (state_.mode == Mode::public_) {
    // Everything is allowed: nothing to insert, only observe (for attribution
    // of later denials and for `hosts --suggest`).
    if (opts_.policy.dns.observe_public) {
      for (const auto& l : addrs) remember(l.qname, l.addr, learn_timeout_ms(l.ttl));
    }
    done({});
    return;
  }
  if (state_.mode != Mode::allowlist) {
    done({});
    return;
  }
  if (!pending_learn_) pending_learn_.emplace();
  PendingLearn& p = *pending_learn_;
  const auto [s4, s6] = nft::learned_sets(active_chain());
  for (const auto& l : addrs) {
    // The phase may have changed since the query was decided.
    const Entry* e = active_facts_->matcher->match(l.qname);
    if (e == nullptr) continue;
    const bool exact = e->kind == EntryKind::hostname;
    if (auto g = dns::guard_for(l.addr, exact, opts_.policy.dns.private_answers)) {
      guarded(l.qname, l.addr, *g, exact);
      continue;
    }
    if (!learned_.room_for(l.qname, l.addr, kMaxAddrsPerName)) {
      note_unlearned(l.qname);
      continue;
    }
    std::uint64_t ms = learn_timeout_ms(l.ttl);
    // An element is written with its new timeout: an address the hosts
    // file also gives an allowed name keeps at least the file's lifetime.
    if (learned_.from_hosts(l.addr)) {
      ms = std::max<std::uint64_t>(ms, std::chrono::milliseconds(kHostsTimeout).count());
    } else if (learned_.dns_pair_until(l.qname, l.addr,
                                       learned_.now() + std::chrono::milliseconds(ms) - opts_.learn_grace / 2)) {
      // The pair is in the active sets (every switch and tamper repair
      // carries the learned store there) and its element outlives this
      // answer's TTL by at least half the grace already: no commit. A name
      // asked for again and again costs one commit per half grace (5 s),
      // not one per answer, and those answers never wait on a commit.
      continue;
    }
    const bool v4 = l.addr.family == 4;
    nft::OpAddElems* target = nullptr;
    for (auto& op : p.ops) {
      auto& e = std::get<nft::OpAddElems>(op);
      if (e.set == (v4 ? s4 : s6)) target = &e;
    }
    if (target == nullptr) {
      p.ops.push_back(nft::OpAddElems{v4 ? s4 : s6, v4 ? nft::SetType::ipv4_addr : nft::SetType::ipv6_addr, false, {}});
      target = &std::get<nft::OpAddElems>(p.ops.back());
    }
    target->elems.push_back({l.addr, l.addr, ms});
    p.records.emplace_back(l, ms);
  }
  p.done.push_back(std::move(done));
  // Answers arriving in the same turn of the event loop share one batch; none
  // waits longer than its own insertion.
  if (p.done.size() == 1) {
    if (opts_.post) {
      opts_.post([this] { flush_learned(); });
    } else {
      flush_learned();
    }
  }
}

void Sandbox::note_unlearned(const std::string& name) {
  ++unlearned_;
  const auto now = opts_.clock.steady();
  if (unlearned_log_at_ != std::chrono::steady_clock::time_point{} && now - unlearned_log_at_ < std::chrono::minutes(1)) {
    return;
  }
  unlearned_log_at_ = now;
  audit_event("learned_full",
              {{"name", name}, {"unlearned", unlearned_ - unlearned_logged_}, {"max_learned", opts_.max_learned},
               {"per_name", kMaxAddrsPerName}},
              spdlog::level::warn,
              fmt::format("learned addresses at their bound ({} pairs, {} per name): {} address(es) not learned since "
                          "the last report, the latest for {} (connections to them are denied)",
                          opts_.max_learned, kMaxAddrsPerName, unlearned_ - unlearned_logged_, name));
  unlearned_logged_ = unlearned_;
}

void Sandbox::flush_learned() {
  if (!pending_learn_) return;
  PendingLearn p = std::move(*pending_learn_);
  pending_learn_.reset();
  Status st;
  if (!p.ops.empty()) {
    nft::Change ch;
    ch.table = nft::kTableName;
    ch.ops = named_learned_elems(std::move(p.ops), p.records);
    st = apply_batch(ch);
    if (!st) log()->error("learned addresses not inserted: {}", st.error().message);
  }
  if (st) {
    for (const auto& [l, ms] : p.records) remember(l.qname, l.addr, ms);
  }
  for (auto& d : p.done) d(st);
}

void Sandbox::close() {
  closed_ = true;
  if (!pending_learn_) return;
  PendingLearn p = std::move(*pending_learn_);
  pending_learn_.reset();
  const Status st = Error::runtime("the sandbox was removed before its answers' addresses were written");
  for (auto& d : p.done) d(st);
}

std::vector<nft::Op> Sandbox::named_learned_elems(std::vector<nft::Op> adds,
                                                  const std::vector<std::pair<dns::Learned, std::uint64_t>>& records) const {
  // The names this batch learns, per address: (address, name) pairs sorted
  // by address, then name, each once. Sorted vectors rather than maps: a
  // batch is what arrived in one turn of the loop (tens of answers at most)
  // and this runs for every answer with a new address (issue 17's CPU per
  // answer: the maps' nodes and comparisons were 5 % of the proxy's).
  const IpAddrLess less;
  const auto same = [&](const IpPrefix& a, const IpPrefix& b) { return !less(a, b) && !less(b, a); };
  std::vector<std::pair<const IpPrefix*, const std::string*>> fresh;
  fresh.reserve(records.size());
  for (const auto& [l, ms] : records) fresh.emplace_back(&l.addr, &l.qname);
  std::sort(fresh.begin(), fresh.end(), [&](const auto& a, const auto& b) {
    return less(*a.first, *b.first) || (same(*a.first, *b.first) && *a.second < *b.second);
  });
  fresh.erase(std::unique(fresh.begin(), fresh.end(),
                          [&](const auto& a, const auto& b) { return same(*a.first, *b.first) && *a.second == *b.second; }),
              fresh.end());
  const auto names_of = [&](const IpPrefix& addr) {  // sorted
    auto it = std::lower_bound(fresh.begin(), fresh.end(), addr,
                               [&](const auto& p, const IpPrefix& a) { return less(*p.first, a); });
    std::vector<std::string> names;
    for (; it != fresh.end() && same(*it->first, addr); ++it) names.push_back(*it->second);
    return names;
  };
  const dns::NameMatcher& m = *active_facts_->matcher;
  auto allowed = [&](std::vector<std::string> names) {
    std::erase_if(names, [&](const std::string& n) { return m.match(n) == nullptr; });
    return std::set<std::string>(names.begin(), names.end());
  };
  std::vector<nft::Op> out;
  for (auto& op : adds) {
    auto& add = std::get<nft::OpAddElems>(op);
    // One element per address (two names may bring the same one), with the
    // longest timeout asked for.
    std::vector<std::pair<IpPrefix, std::uint64_t>> ms;
    ms.reserve(add.elems.size());
    std::sort(add.elems.begin(), add.elems.end(),
              [&](const nft::SetElem& a, const nft::SetElem& b) { return less(a.from, b.from); });
    for (const auto& e : add.elems) {
      if (!ms.empty() && same(ms.back().first, e.from)) {
        ms.back().second = std::max(ms.back().second, e.timeout_ms);
      } else {
        ms.emplace_back(e.from, e.timeout_ms);
      }
    }
    std::vector<nft::SetElem> plain, replace;
    for (const auto& [addr, timeout] : ms) {
      std::vector<std::string> names = names_of(addr);  // first: they must fit
      // A new address: one add, its comment this batch's names.
      if (learned_.name_count(addr) == 0 && !learned_.full()) {
        plain.push_back(nft::SetElem{addr, addr, timeout, names_comment(names, nft::kElemCommentMax)});
        continue;
      }
      // An address the store knows may have an element in the kernel (its
      // names' expiry and the kernel's differ by the commit's duration, and
      // a full store may not know it): replaced, never added again. An add
      // of an element that exists changes nothing on kernels before 6.10,
      // and on later ones only when the timeout differs (and then sets the
      // new one, a shorter one too). Seen on 6.18: a name answered again
      // with the same TTL kept its first expiry, and its clients were
      // refused from TTL + grace after the first answer on. The new element
      // lives as long as the longest of its names asks, and its comment
      // names this batch's names first, then live ones it had (a few: an
      // address behind a wildcard may have thousands). Learn's skip keeps
      // this to one per name and half grace.
      const auto left = static_cast<std::uint64_t>(learned_.dns_left(addr).count());
      for (const auto& n : allowed(learned_.some_live_names(addr, kCommentNames))) names.push_back(n);
      replace.push_back(nft::SetElem{addr, addr, std::max(timeout, left), names_comment(names, nft::kElemCommentMax)});
    }
    push_learned_elems(out, add.set, add.type, std::move(plain), std::move(replace));
  }
  return out;
}

void Sandbox::restore_learned() {
  if (state_.mode != Mode::allowlist) return;
  const auto [s4, s6] = nft::learned_sets(active_chain());
  const dns::NameMatcher& m = *active_facts_->matcher;
  std::size_t addrs = 0, pairs = 0;
  for (const auto& [set, type] : {std::pair{s4, nft::SetType::ipv4_addr}, {s6, nft::SetType::ipv6_addr}}) {
    auto elems = kernel_->read_set_elems(nft::kTableName, set, type);
    if (!elems) {
      // Not fatal: pinning resets flows to these addresses until the
      // sandbox resolves their names again, as before names were kept.
      log()->warn("learned names not restored from set {}: {}", set, elems.error().message);
      continue;
    }
    for (const auto& e : *elems) {
      if (e.expires_ms == 0) continue;  // no timeout: not one egressd learned
      bool any = false;
      for (const auto& name : names_from_comment(e.comment)) {
        // The phase in force allowed it when it was learned; a name it does
        // not allow (an element written by someone else) is not taken.
        if (m.match(name) == nullptr) continue;
        if (learned_.remember(name, e.from, std::chrono::milliseconds(e.expires_ms))) {
          ++pairs;
          any = true;
        }
      }
      addrs += any ? 1 : 0;
    }
  }
  log()->info("restored learned names pairs={} addresses={} chain={}", pairs, addrs, active_chain());
}

json Sandbox::status() {
  auto output = nft::read_chain(*kernel_, nft::kTableName, nft::Family::inet, "output");
  auto deny = nft::read_chain(*kernel_, nft::kTableName, nft::Family::inet, "deny");
  return status_from(output, deny);
}

void Sandbox::status(std::function<void(json)> done) {
  if (!opts_.executor) return done(status());
  // Only the two counted chains are read (each one dump), and their retries
  // pause on the loop's timers. The sandbox outlives the loop's work
  // (daemon.cc destroys the loop's pending handlers, this one among them,
  // before anything they point at).
  boost::asio::co_spawn(
      opts_.executor,
      [this, busy = in_flight(), done = std::move(done)]() -> boost::asio::awaitable<void> {
        auto output = co_await nft::read_chain_async(*kernel_, nft::kTableName, nft::Family::inet, "output");
        auto deny = co_await nft::read_chain_async(*kernel_, nft::kTableName, nft::Family::inet, "deny");
        done(status_from(output, deny));
      },
      boost::asio::detached);
}

json Sandbox::status_from(const Result<std::vector<nft::RuleInfo>>& output,
                          const Result<std::vector<nft::RuleInfo>>& deny) {
  StatusInput in;
  in.phase = state_.phase;
  in.mode = state_.mode;
  in.generation = state_.generation;
  in.entries_unknown = inline_unknown_;
  if (!inline_unknown_) {
    const bool dns_running = proxy_ != nullptr;
    const auto& entries = active_phase().entries;
    in.entries.reserve(entries.size());
    for (const auto& e : entries) {
      const bool learned = dns_running && e.kind == EntryKind::hostname && learned_.live(e.text);
      in.entries.push_back({e.text, e.kind, entry_state(e.kind, dns_running, learned)});
    }
  }
  in.entry_counts = active_facts_->counts;
  in.learned = &learned_.by_name();
  in.now = learned_.now();
  in.traffic = traffic_from(output ? &*output : nullptr, deny ? &*deny : nullptr);
  for (const auto& p : opts_.policy.phases) in.phases.push_back(p.name);
  in.netns = opts_.netns;
  in.socket = opts_.socket;
  if (proxy_ != nullptr) in.dns = proxy_->counters();
  in.audit = audit_status();
  if (pin_counts_) in.pin = pin_counts_();
  return status_json(in);
}

Traffic Sandbox::traffic() {
  auto output = nft::read_chain(*kernel_, nft::kTableName, nft::Family::inet, "output");
  auto deny = nft::read_chain(*kernel_, nft::kTableName, nft::Family::inet, "deny");
  return traffic_from(output ? &*output : nullptr, deny ? &*deny : nullptr);
}

Status Sandbox::remove_table() {
  nft::Change ch;
  ch.table = nft::kTableName;
  ch.ops.push_back(nft::OpDeleteTable{nft::kTableName});
  if (opts_.compile.netdev) {
    // The egress chains' policy is drop: left alone they would cut the
    // namespace off once the inet table that signs packets is gone.
    ch.ops.push_back(nft::OpEnsureTable{nft::kTableName, nft::Family::netdev});
    ch.ops.push_back(nft::OpDeleteTable{nft::kTableName, nft::Family::netdev});
  }
  auto st = kernel_->apply(ch);
  // The next table made here is a fresh start with a snapshot of its own,
  // and an inline policy of its own (the state file names its table too).
  if (st && !opts_.hosts_snapshot_file.empty()) ::unlink(opts_.hosts_snapshot_file.c_str());
  if (st && !opts_.state_file.empty()) ::unlink(opts_.state_file.c_str());
  return st;
}

void Sandbox::save_inline_state() {
  if (opts_.state_file.empty() || !inline_) return;
  auto write = [path = opts_.state_file, text = encode_inline_state(state_.generation, *inline_, table_id()),
                lg = log()] {
    if (auto s = write_atomically(path, text); !s) lg->warn("inline policy not saved for adoption: {}", s.error().message);
  };
  if (opts_.write_off_loop) {
    opts_.write_off_loop(std::move(write));
  } else {
    write();
  }
}

std::optional<Phase> Sandbox::load_inline_state(std::uint64_t generation) {
  if (opts_.state_file.empty()) return std::nullopt;
  std::ifstream in(opts_.state_file);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  auto ph = decode_inline_state(text.str(), generation, table_id());
  if (!ph) {
    log()->warn("state file {} {}", opts_.state_file, ph.error().message);
    return std::nullopt;
  }
  return std::move(ph).value();
}

}  // namespace egressd::daemon
