// One sandbox: its policy, its nftables table, its phase state. Everything
// that belongs to one network namespace lives here (no globals), so a later
// multi-sandbox agent creates one Sandbox per namespace.
//
// Not thread-safe: owned and driven by one event loop.
#pragma once

#include <sys/stat.h>
#include <time.h>

#include <array>
#include <boost/asio/any_io_executor.hpp>
#include <utility>  // before awaitable.hpp: Boost 1.74 uses std::exchange without it
#include <boost/asio/awaitable.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include <deque>
#include <map>

#include "audit/denied.h"
#include "audit/names.h"
#include "audit/nflog.h"
#include "control/dispatch.h"
#include "daemon/learned.h"
#include "daemon/netwatch.h"
#include "daemon/status_view.h"
#include "dns/matcher.h"
#include "dns/proxy.h"
#include "egressd/clock.h"
#include "egressd/policy.h"
#include "egressd/result.h"
#include "nft/compile.h"
#include "nft/netlink.h"

namespace egressd::daemon {

// What the kernel of this namespace can do, probed once at start.
struct Capabilities {
  bool filter = false;  // inet tables, base chains on output, reject
  bool sets = false;    // hash and interval sets
  bool timeout_sets = false;
  bool nat = false;     // nat output chain with redirect (DNS interception)
  bool ipv6 = false;    // IPv6 enabled in the namespace
  bool fib = false;     // fib saddr/daddr type (forged sources, broadcast guards)
  bool socket = false;  // socket mark in input (egressd's upstream sockets take replies only)
  // The netdev egress hook (>= 5.16, CONFIG_NETFILTER_EGRESS): raw AF_PACKET
  // frames and everything else a device sends meet table netdev egressd.
  bool egress_hook = false;

  // Harbor's capability names -> detected, plus egressd's own
  // (block_raw_frames, fib_match, socket_match).
  nlohmann::json to_json() const;
};

// /etc/resolv.conf of egressd's mount namespace ("" if unreadable).
std::string read_resolv_conf();
// Writes `text` to `path` atomically (the temp file `path`.tmp in the same
// directory, then rename), so a crash or a reader sees the old or the new
// content, never a torn file. Error naming the file on failure.
Status write_atomically(const std::string& path, const std::string& text);
// Compile options for the DNS proxy on `dns_port` with these upstreams (as
// dns::expand_upstreams gives them): what `run` and `render` both use.
nft::CompileOptions compile_options(const std::vector<std::string>& upstream, int dns_port);
// What `egressd render` prints for a policy with `st` in force: both tables
// as nft text, and a note on what the daemon adds at run time.
std::string render_script(const Policy& policy, const nft::ActiveState& st, const nft::CompileOptions& opts);

// Probes by creating and deleting a throwaway table in one batch (nothing stays).
Capabilities probe_capabilities(nft::Kernel& kernel);

// Invalid error naming the entry when `phase` needs something `caps` lacks.
Status check_capabilities(const Phase& phase, const Capabilities& caps);

// What a switch needs to know of a phase besides its entries, gathered in one
// pass over them. For named phases the Sandbox computes it once and keeps it
// (the policy does not change while the daemon runs), so a switch between
// named phases of 100k entries does no per-entry work in userspace.
struct PhaseFacts {
  explicit PhaseFacts(const Phase& phase);
  std::array<std::size_t, 6> counts{};  // by EntryKind
  std::vector<std::string> hostnames;   // exact names: pre-resolved at a switch
  std::shared_ptr<const dns::NameMatcher> matcher;
  nlohmann::json counts_json() const;   // {"hostname": n, ...} as status reports it
};

struct SandboxOptions {
  Policy policy;
  std::string state_file;  // inline policy kept here for adoption ("" = none)
  std::string netns;       // for status only
  std::string socket;      // for status only
  nft::CompileOptions compile;
  // Called after each switch is acknowledged, off the reply path (sock_diag
  // SOCK_DESTROY of flows the new phase does not allow). May be empty.
  // The phase is shared, not copied: a 10k-entry phase copy costs more than
  // the switch itself.
  std::function<void(std::shared_ptr<const Phase>, std::uint64_t generation)> after_switch;
  // Draws 32 random bits for the secrets of a table this sandbox creates (own
  // mark, pass signature, mark salt; adopted tables keep theirs) and for a new
  // mark salt when the config changed. Empty: the secrets in `compile` as
  // given, and the salt is never redrawn (tests).
  std::function<std::uint32_t()> random;
  // Runs `fn` later on the event loop (learned-address batching). Empty:
  // run it at once (tests).
  std::function<void(std::function<void()> fn)> post;
  // Added to max(TTL, dns.min_ttl) for a learned address's set timeout, so a
  // client that connects just after its cached answer expired still gets in.
  std::chrono::seconds learn_grace{10};
  // At most this many (name, address) pairs are remembered (status, carrying
  // learned addresses across switches); the kernel sets are not limited by it.
  std::size_t max_learned = 65536;
  // Name attribution and denied-connection records (docs/protocol.md: denied, hosts).
  audit::NameIndexOptions names;
  audit::DeniedOptions denied;
  // Runs `fn` after `delay` on the event loop (`denied` long-poll). Empty:
  // a `denied` request never waits (tests).
  std::function<void(std::chrono::milliseconds delay, std::function<void()> fn)> run_after;
  // Runs `fn` off the event loop, in order (the inline state file: a slow
  // disk must not hold up DNS answers). Empty: at once (tests).
  std::function<void(std::function<void()> fn)> write_off_loop;
  // The event loop's executor: table reads that have to be retried (a
  // commit by anyone spoils one) pause on its timers instead of sleeping
  // (status, verification). Empty: they sleep (tests, one-shot tools).
  boost::asio::any_io_executor executor;
  // The time learned addresses expire by (steady) and denied records and name
  // attribution are stamped with (wall). Default: the real clocks.
  TimeSource clock;
  // The hosts file (--hosts-file; docs/pinning.md "Hosts files"): reads it
  // and returns its text, std::nullopt when it does not exist, or an error
  // naming it. Empty: no hosts file. `hosts_path` names it in messages.
  std::function<Result<std::optional<std::string>>()> read_hosts;
  std::string hosts_path;
  // Where the pairs of the file at start (the snapshot) are kept for a
  // restart, which adopts the table and then takes only pairs listed there
  // (hosts_snapshot_text). "" = kept in memory only.
  std::string hosts_snapshot_file;
  // How often the file is read for changes (with run_after; none without).
  std::chrono::milliseconds hosts_poll{2000};
};

// A hosts file's text as egressd takes it: the pairs (name -> addresses) of a
// file with no problem, or, with any problem, no pair and the first problem
// ("FILE:LINE: reason"): a broken file teaches nothing (fail closed).
struct HostsLoad {
  LearnedStore::HostsPairs pairs;
  std::vector<std::string> problems;  // every "FILE:LINE: reason"
};
HostsLoad load_hosts(std::string_view text, std::string_view path);
// Reads `path` (at most kMaxHostsFile bytes; a regular file, opened without
// blocking; under /proc/PID/root/ resolved inside that root, symlinks
// included): text, std::nullopt when it does not exist, an invalid error
// naming the file otherwise.
Result<std::optional<std::string>> read_hosts_file(const std::string& path);
constexpr std::size_t kMaxHostsFile = 1 << 20;

// The snapshot file (SandboxOptions::hosts_snapshot_file): `pairs` as hosts
// file lines between a first line kHostsSnapshotHead and a last line "# end"
// (a file cut short is told from one with fewer pairs). `path` is the hosts
// file's, for the reader.
inline constexpr std::string_view kHostsSnapshotHead = "# egressd hosts snapshot v1";
std::string hosts_snapshot_text(const LearnedStore::HostsPairs& pairs, std::string_view path);
// Its pairs; an error naming `file` and what is wrong (no head or end line, a
// line hosts_file.h cannot read).
Result<LearnedStore::HostsPairs> parse_hosts_snapshot(std::string_view text, std::string_view file);

// read_hosts_file for a sandbox, which reads the file at every switch and
// every hosts_poll: a stat of the path that shows the file read last,
// unchanged, answers with that text, without opening it (one system call
// where a read takes five). "Unchanged": same device, inode, size, mtime and
// ctime, and the read came more than kSlack after the file's ctime; a later
// write then carries a later ctime, however coarse the timestamps (the
// kernel stamps from a clock that ticks every few ms; some file systems
// keep whole seconds, FAT two). Paths under
// /proc/PID/root/ are read every time: there the read resolves inside that
// root, which a stat of the path would not. `now` (CLOCK_REALTIME, the
// clock of ctime) is for tests.
class HostsFileReader {
 public:
  static constexpr std::chrono::milliseconds kSlack{3000};
  explicit HostsFileReader(std::string path, std::function<timespec()> now = {});
  Result<std::optional<std::string>> operator()();
  std::uint64_t reads() const { return reads_; }  // files opened and read

 private:
  std::string path_;
  std::function<timespec()> now_;
  bool cacheable_ = false;  // path_ may be answered from a stat
  bool have_ = false;       // the last read is kept below
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  off_t size_ = 0;
  timespec mtime_{}, ctime_{};
  std::string text_;
  std::uint64_t reads_ = 0;
};

class Sandbox : public dns::PolicyHooks {
 public:
  Sandbox(SandboxOptions opts, std::unique_ptr<nft::Kernel> kernel, Capabilities caps);
  // Pinned: the command table and the callbacks it hands out hold `this`.
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;

  // The port the DNS redirect points at. Before start() only: the proxy
  // binds first and may have had to take another port than configured.
  void set_dns_port(std::uint16_t port) { opts_.compile.dns_port = port; }

  // The DNS proxy this sandbox pre-resolves through and reports counters of.
  // Not owned; nullptr = none (hostnames are then only learned from queries).
  void attach_proxy(dns::Proxy* proxy) { proxy_ = proxy; }

  // Installs `initial_phase` at generation 1, or adopts the table a previous
  // egressd left (same phase and generation; rebuilt in one batch if the
  // config changed). Fails with the kernel's error, or invalid when the
  // phase is unknown or needs a missing capability.
  Status start(const std::string& initial_phase);

  // Handles one control request (the table is command_table(), in
  // sandbox_control.cc); calls `reply` exactly once, at once or (apply with
  // hostnames to pre-resolve) later. Applies run one at a time in arrival order.
  void handle(const nlohmann::json& request, std::function<void(nlohmann::json)> reply);
  // Synchronous form for requests that complete at once (tests, no proxy).
  nlohmann::json handle(const nlohmann::json& request);

  // The status reply's fields. The counters are the kernel's: read
  // synchronously here, or without holding up the loop by the callback form
  // (with SandboxOptions::executor; `done` is called once, maybe later).
  nlohmann::json status();
  void status(std::function<void(nlohmann::json)> done);
  // Resolves the exact hostnames of the phase in force and learns their
  // addresses (start-up; `apply` does this itself before switching).
  void preresolve_active();

  // ---- the hosts file (sandbox_hosts.cc; docs/pinning.md "Hosts files") ----
  // After start: reads the hosts file (SandboxOptions::read_hosts) and takes
  // its pairs as the ones it may ever learn (the snapshot: later reads may
  // drop pairs, never add them, since a sandbox may be able to write the
  // file), learns those the phase in force allows, and reads it again every
  // hosts_poll. A broken or unreadable file teaches nothing: the error, also
  // logged. No read_hosts: nothing. With hosts_snapshot_file, a fresh table
  // writes the snapshot there and an adopted one (a restart, a re-add) reads
  // it instead of taking the file as it is now; missing or broken, nothing
  // is learned from the hosts file (logged, audit event hosts_file).
  Status start_hosts();
  // Reads the file again; when its text changed, its pairs (those of the
  // snapshot) replace the previous ones, and those the phase in force
  // allows are added to the kernel; every kHostsRefresh they are written
  // again (replaced; their set elements time out after kHostsTimeout, so a pair
  // dropped from the file leaves the kernel by then; pinning stops admitting
  // it at once). Error as start_hosts.
  Status reload_hosts();
  static constexpr std::chrono::seconds kHostsTimeout{60};
  // Bounds on what DNS answers put into the kernel (attack review 9: a zone
  // under an allowed wildcard answered 2,000 addresses per query, and one
  // sandbox grew its learned set to 478,000 elements in 6 s, slowing every
  // other sandbox of the agent). At most this many addresses of one answer
  // are learned, at most kMaxAddrsPerName per name, and no more pairs than
  // max_learned; an address beyond them is not learned (connections to it
  // are denied) and the answer is logged (answer_capped, learned_full).
  static constexpr std::size_t kMaxLearnedPerAnswer = 64;
  static constexpr std::size_t kMaxAddrsPerName = 1024;
  static constexpr std::chrono::seconds kHostsRefresh{20};
  // At most this many names an address already has go into its learned
  // element's comment when it is replaced (127 bytes hold about as many).
  static constexpr std::size_t kCommentNames = 8;
  // The pairs taken from the hosts file now (after the snapshot), allowed or not.
  const LearnedStore::HostsPairs& hosts_pairs() const { return hosts_; }

  // Deletes the table (--cleanup-on-exit).
  Status remove_table();

  // True while a switch, a pending learn batch, or a request's coroutine
  // (status, metrics, rules) of this sandbox is still on the loop: the agent
  // destroys a removed sandbox only once this is false.
  bool busy() const { return applying_ || pending_learn_.has_value() || *in_flight_ > 0; }
  // The owner closed (the agent removed the sandbox): nothing is written into
  // the namespace any more. The answers waiting for their addresses' batch
  // are released with an error (the closed proxy answers no more) and none is
  // committed; a switch waiting for its pre-resolution, and any queued after
  // it, ends with unknown_sandbox and changes nothing.
  void close();

  const nft::ActiveState& state() const { return state_; }
  // The SO_MARK egressd's own upstream sockets must carry (valid after start).
  std::uint32_t own_mark() const { return opts_.compile.own_mark; }
  // SO_MARK the DNS proxy's own sockets must carry (nft::kProxyMark).
  std::uint32_t proxy_mark() const { return opts_.compile.proxy_mark; }
  // The secrets and salt in force (valid after start).
  const nft::CompileOptions& compile_options() const { return opts_.compile; }

  // ---- relay targets (the DNS proxy's own upstream traffic) ----
  // Lets egressd's own marked traffic (the SO_MARK own_mark()) reach `addr`
  // as it reaches a configured upstream: udp/tcp port 53, or any port for a
  // loopback address (127.0.0.0/8, ::1: Docker's DNAT moves the port). A
  // single address (full prefix length). Kept in the kernel's upstream sets,
  // so restore_table keeps it and a restarted egressd adopts it (see
  // relay_upstreams()). Adding one that is there already is a no-op. On
  // failure the kernel's error (or invalid for a bad address); nothing changed.
  Status add_relay_upstream(const IpPrefix& addr);
  // Takes back add_relay_upstream. A configured upstream is not removed
  // (invalid); one that is not there is a no-op.
  Status remove_relay_upstream(const IpPrefix& addr);
  // The relay targets in force: added since start, or found in the kernel's
  // upstream sets at start (elements the config does not name).
  const std::vector<IpPrefix>& relay_upstreams() const { return opts_.compile.extra_upstreams; }

  // ---- the namespace's interfaces (the rtnetlink watcher drives this) ----
  // Gives the interfaces and on-link IPv6 prefixes. Before start: what start()
  // builds with. After: adds an egress chain for each new interface and
  // deletes those of interfaces that went (one batch), and refreshes the
  // on-link set; a vanished interface is never tampering. Kernel error on
  // failure (the view is kept: restore_table uses it).
  Status update_network(const NetworkView& view);
  const Phase& active_phase() const;

  // ---- tamper repair (sandbox_tamper.cc; the tamper guard drives it) ----
  // Replaces table inet egressd, whatever became of it (missing, changed,
  // dormant), with the phase in force at the same generation, plus the
  // learned addresses that phase allows, in one batch. On failure the kernel's
  // error; nothing changed then.
  Status restore_table();
  // How the kernel's table differs from what the phase in force expects: the
  // table missing or dormant, its comment, chains and sets by name, rules by
  // comment in each chain. Empty when it matches. Set elements are not
  // compared (learned ones come and go).
  Result<std::vector<std::string>> verify_table();
  // The same, the reads' retries pausing on the coroutine's executor's timers.
  boost::asio::awaitable<Result<std::vector<std::string>>> verify_table_async();
  // The netlink portid egressd's own nftables changes carry.
  std::uint32_t kernel_portid() const { return kernel_->portid(); }
  // The namespace's ruleset generation (moved by every commit, anyone's).
  Result<std::uint32_t> kernel_generation() { return kernel_->generation(); }
  // Runs each kernel batch of at least kLargeBatchElements set elements (an
  // install, an inline switch, a big learned flush): `apply` sends it. The
  // tamper guard stops listening to change events meanwhile: the kernel
  // writes one notification per element to every listener, which doubled
  // the time of a 10k-entry inline switch. Empty: batches are sent as they are.
  using BatchRunner = std::function<Status(const std::function<Status()>& apply)>;
  static constexpr std::size_t kLargeBatchElements = 256;
  void set_large_batch_runner(BatchRunner fn) { large_batch_runner_ = std::move(fn); }
  // A packet the deny chain logged (NFLOG): becomes a denied record naming
  // the hostnames its destination resolved from.
  void denied_packet(const audit::LoggedPacket& pkt);
  // The NFLOG reader whose counters status reports. Not owned; may be nullptr.
  void attach_nflog(audit::NflogReader* reader) { nflog_ = reader; }
  // ---- hostname pinning (sandbox_pin.cc; the reader is daemon/pinq) ----
  // The names learned through egressd for `addr` (one address) that are still live.
  std::vector<std::string> learned_names_for(const IpPrefix& addr) const;
  // The hostname/wildcard entry of the phase in force allowing `name`, or nullptr.
  const Entry* allowed_name(std::string_view name) const;
  // An IP or CIDR entry of the phase in force covers `dst` (not a learned address).
  bool allowed_by_address_entry(const IpPrefix& dst) const;
  // Whether a flow admitted for `name` to `dst` may go on under the phase in
  // force (after a switch): public; an IP/CIDR entry allows `dst` (not
  // inspected); or the phase allows `name` and `name` was learned for `dst`
  // ("": a name unknown, a flow admitted before a restart: never).
  bool pin_keeps(const std::string& name, const IpPrefix& dst) const;
  // A flow pinning reset: a `denied` record carrying decide()'s line.
  void pin_reset(const IpPrefix& dst, std::uint16_t port, const std::string& reason);
  // Status counters of the reader: {inspected, admitted, reset}.
  void attach_pin(std::function<std::array<std::uint64_t, 3>()> counts) { pin_counts_ = std::move(counts); }
  // Where `metrics` reads the tamper guard's counts (tampers seen, restores
  // done). Empty: those metrics are left out.
  void set_tamper_counts(std::function<std::pair<std::uint64_t, std::uint64_t>()> fn) { tamper_counts_ = std::move(fn); }
  // (tampers, restores) as the tamper guard counts them; zeros without one.
  std::pair<std::uint64_t, std::uint64_t> tamper_counts() const {
    return tamper_counts_ ? tamper_counts_() : std::pair<std::uint64_t, std::uint64_t>{0, 0};
  }
  const Capabilities& capabilities() const { return caps_; }

  // The counters of this sandbox in the Prometheus text format (the
  // `metrics` request; sandbox_metrics.cc). Reads the kernel's counters.
  std::string metrics_text();
  // The same, with the table reads' retries on the loop's timers.
  void metrics_text(std::function<void(std::string)> done);
  // Tables inet and netdev egressd as nft text, with the kernel's counters
  // and learned elements (the `rules` request; sandbox_rules.cc). Error when
  // the kernel cannot be read or its tables differ from the phase in force.
  boost::asio::awaitable<Result<std::string>> ruleset_text();
  const audit::NameIndex& names() const { return names_; }
  const audit::DeniedLog& denied() const { return denied_; }

  // dns::PolicyHooks
  dns::Action decide(const std::string& qname) override;
  void learn(std::vector<dns::Learned> addrs, std::function<void(Status)> done) override;
  void refused(const std::string& qname, std::uint16_t qtype) override;
  // Exempts egressd's own traffic to `targets` (port 53; add_relay_upstream),
  // which keeps them in the kernel for the next start.
  void relay_targets(const std::vector<IpPrefix>& targets, const std::string& source,
                     std::function<void(Status)> done) override;

 private:
  using Clock = std::chrono::steady_clock;
  struct ApplyJob {
    // A named phase points into opts_.policy (never copied); an inline one is owned.
    std::shared_ptr<const Phase> target;
    bool is_inline;
    std::function<void(nlohmann::json)> reply;
    // The target's facts, computed once when the job starts (an inline
    // phase's are not cached): its hostnames to pre-resolve, then the switch.
    std::shared_ptr<const PhaseFacts> facts;
  };
  struct PendingLearn {
    std::vector<nft::Op> ops;
    std::vector<std::pair<dns::Learned, std::uint64_t>> records;  // (address, timeout ms)
    std::vector<std::function<void(Status)>> done;
  };

  // What a switch's pre-resolution found: the names that got no address
  // (sorted), and the (name, address, timeout ms) pairs of the others.
  struct Preresolved {
    using Pair = std::tuple<std::string, IpPrefix, std::uint64_t>;
    std::vector<std::string> unresolved;
    std::vector<Pair> pairs;
  };
  // `pre.pairs` go into the switch's batch and are remembered only once the
  // kernel took it: remembered while the old phase is still in force (before
  // the batch, or after a refused one), a sandbox answer for a name both
  // phases allow, carrying such an address, would be taken as already in the
  // old phase's sets (learn's skip) and released with the address missing.
  Result<nlohmann::json> switch_to(const std::shared_ptr<const Phase>& target,
                                   std::shared_ptr<const PhaseFacts> target_facts, bool is_inline,
                                   Preresolved pre);
  // ---- control commands (sandbox_control.cc) ----
  control::Dispatcher command_table();
  void apply(const control::ApplyRequest& req, control::Reply reply);
  nlohmann::json unknown_phase_reply(const std::string& name) const;
  // The reply to an `explain` request (src/daemon/sandbox_explain.cc).
  nlohmann::json explain_reply(const control::ExplainRequest& req) const;
  void enqueue_apply(ApplyJob job);
  // Runs the queued applies in order, one at a time: one with nothing to
  // pre-resolve at once, one with hostnames as a coroutine (apply_job) that
  // runs the rest of the queue when it ends.
  void run_applies();
  boost::asio::awaitable<void> apply_job(ApplyJob job, std::vector<std::string> names);
  // Resolves `names` concurrently; remembers nothing (switch_to does).
  boost::asio::awaitable<Preresolved> preresolve(std::vector<std::string> names);
  // The switch and its reply.
  void finish_apply(ApplyJob job, Preresolved pre);
  void flush_learned();
  // Appends to `ops` the adds of `plain` and the replacements of `replace`
  // in learned set `set` (sandbox.cc says why an element is replaced).
  static void push_learned_elems(std::vector<nft::Op>& ops, const std::string& set, nft::SetType type,
                                 std::vector<nft::SetElem> plain, std::vector<nft::SetElem> replace);
  // `adds` (one OpAddElems per learned set, as learn() builds them) with
  // each element's comment naming what its address is learned for (the
  // names in `records` first, then a few live ones remembered), duplicates
  // merged: a new address added, every other one replaced (add, delete,
  // add: an add never refreshes an element the kernel has) with the
  // longest lifetime any of its names asks for.
  std::vector<nft::Op> named_learned_elems(std::vector<nft::Op> adds,
                                           const std::vector<std::pair<dns::Learned, std::uint64_t>>& records) const;
  // After adopting a table unchanged: learned_ := the (name, address,
  // remaining lifetime) the phase in force's learned sets hold in their
  // elements' comments. Errors are logged, not fatal.
  void restore_learned();
  // Elements for `target`'s learned sets: every remembered address whose name
  // `target` allows, with its remaining lifetime, and a switch's pre-resolved
  // pairs (not remembered yet).
  std::vector<nft::Op> carried_learned(const Phase& target, const PhaseFacts& facts, const std::string& chain,
                                       const std::vector<Preresolved::Pair>& preresolved = {}) const;
  std::uint64_t learn_timeout_ms(std::uint32_t ttl) const;
  // Logs the rebinding_guard audit event: `addr` for `name` not learned
  // because of `g` (the name matched an exact entry, or only a wildcard).
  void guarded(const std::string& name, const IpPrefix& addr, const dns::LearnGuard& g, bool exact);
  void remember(const std::string& name, const IpPrefix& addr, std::uint64_t timeout_ms);
  std::string active_chain() const;
  Status install(const Phase& phase, std::uint64_t generation, bool replace_existing);
  // Ensure + delete + add of table netdev egressd for the state in force
  // (nothing without the egress hook), appended to `ch`.
  void rebuild_netdev(nft::Change& ch) const;
  // Draws the secrets of a new table / a new salt (SandboxOptions::random).
  void draw_secrets();
  // Names this table in the inline state file: a digest of its secrets
  // (drawn for a fresh table, adopted with one found), so a file another
  // table left is not taken for this one's.
  std::string table_id() const;
  void draw_salt();
  // start() once the secrets are settled: install, adopt or restage table
  // inet egressd (`existing`: the table found, or nullptr).
  Status start_inet(const Phase& initial, const nft::TableInfo* existing, bool same_config);
  // Relay targets an earlier egressd added (see relay_upstreams()).
  void adopt_relay_upstreams();
  // The upstream set `addr` belongs in (loopback ones apart).
  static std::string upstream_set(const IpPrefix& addr);
  bool started_ = false;  // start() ran: changes go to the kernel at once
  void save_inline_state();
  std::optional<Phase> load_inline_state(std::uint64_t generation);
  // status() around the reads of chains output and deny (an error: counters 0).
  nlohmann::json status_from(const Result<std::vector<nft::RuleInfo>>& output,
                             const Result<std::vector<nft::RuleInfo>>& deny);
  // verify_table's comparisons, one table read each.
  std::vector<std::string> compare_inet(const std::optional<nft::TableInfo>& read);
  void compare_netdev(const std::optional<nft::TableInfo>& read, const nft::Table& want,
                      std::vector<std::string>& diffs);

  // src/daemon/sandbox_audit.cc: `denied` and `hosts` requests.
  void denied_request(const control::DeniedRequest& req, control::Reply reply);
  nlohmann::json hosts_reply(const control::HostsRequest& req) const;
  void wake_denied_waiters();
  nlohmann::json audit_status() const;

  // kernel_->apply, through large_batch_runner_ when the batch is large.
  Status apply_batch(const nft::Change& ch);

  // Packets and bytes chain output decided, from the kernel's counters
  // (status and metrics; traffic_from in status_view.h).
  Traffic traffic();
  std::string metrics_text_from(const Traffic& t);
  // src/daemon/sandbox_rules.cc and sandbox_metrics.cc.
  void rules(std::function<void(nlohmann::json)> reply);
  static std::string request_label(const std::string& cmd);
  void count_request(const std::string& command, const nlohmann::json& reply);
  std::uint64_t switches_ = 0, switch_failures_ = 0;
  std::map<std::pair<std::string, std::string>, std::uint64_t> requests_;  // (command, result) -> count
  std::function<std::pair<std::uint64_t, std::uint64_t>()> tamper_counts_;
  std::function<std::array<std::uint64_t, 3>()> pin_counts_;  // empty: pinning not running

  SandboxOptions opts_;
  std::unique_ptr<nft::Kernel> kernel_;
  BatchRunner large_batch_runner_;
  Capabilities caps_;
  nft::ActiveState state_;
  std::optional<Phase> inline_;  // the inline policy in force, if any
  bool inline_unknown_ = false;  // adopted an inline policy whose entries were not saved
  // Facts of a phase: kept for named phases (by address in opts_.policy),
  // computed afresh for inline ones.
  std::shared_ptr<const PhaseFacts> facts(const Phase& phase) const;
  mutable std::map<const Phase*, std::shared_ptr<const PhaseFacts>> named_facts_;
  // Facts of the phase in force; its matcher holds the hostname/wildcard entries.
  std::shared_ptr<const PhaseFacts> active_facts_ = std::make_shared<const PhaseFacts>(Phase{});
  dns::Proxy* proxy_ = nullptr;
  std::deque<ApplyJob> applies_;
  bool applying_ = false;
  // Coroutines this sandbox spawned that have not ended (busy()). Shared with
  // each coroutine's token, which may be destroyed after the sandbox (with
  // the loop's pending handlers).
  std::shared_ptr<std::size_t> in_flight_ = std::make_shared<std::size_t>(0);
  struct InFlight {
    explicit InFlight(std::shared_ptr<std::size_t> n) : n_(std::move(n)) { ++*n_; }
    InFlight(InFlight&& o) noexcept : n_(std::move(o.n_)) {}
    InFlight& operator=(InFlight&&) = delete;
    ~InFlight() {
      if (n_) --*n_;
    }
    std::shared_ptr<std::size_t> n_;
  };
  InFlight in_flight() { return InFlight(in_flight_); }
  std::optional<PendingLearn> pending_learn_;
  void note_unlearned(const std::string& name);
  // Addresses of answers not learned for the bounds above, and when that was
  // last logged (at most once a minute, with the count since).
  std::uint64_t unlearned_ = 0, unlearned_logged_ = 0;
  std::chrono::steady_clock::time_point unlearned_log_at_{};
  bool closed_ = false;  // close(): no more kernel writes
  // ---- hosts file state (sandbox_hosts.cc) ----
  // Reads the file into hosts_ (through the snapshot); true when hosts_ changed.
  bool read_hosts();
  // The pairs of hosts_ `facts` allows and no learn guard keeps out.
  LearnedStore::HostsPairs hosts_allowed(const PhaseFacts& facts, Mode mode) const;
  // learned_'s hosts pairs := those the phase in force allows.
  void sync_hosts_store();
  // Adds the phase in force's hosts pairs to its learned sets (one batch).
  Status apply_hosts();
  void schedule_hosts_poll();
  bool hosts_started_ = false;
  std::optional<std::string> hosts_text_;   // the text last read (nullopt: none or missing)
  std::optional<LearnedStore::HostsPairs> hosts_snapshot_;  // the pairs at start
  // Sets hosts_snapshot_ from hosts_snapshot_file (an adopted table); empty,
  // and logged, when it is missing or broken.
  void load_hosts_snapshot();
  bool adopted_ = false;  // start() found a table of ours with its state: a restart
  LearnedStore::HostsPairs hosts_;          // the file's pairs now, within the snapshot
  Clock::time_point hosts_refreshed_{};
  std::string hosts_error_;                 // the last read's problem ("" if none)
  LearnedStore learned_{opts_.max_learned, opts_.clock};  // name -> addresses, with an address index
  std::uint64_t dns_refused_ = 0;
  audit::NameIndex names_{opts_.names};
  audit::DeniedLog denied_{opts_.denied};
  audit::NflogReader* nflog_ = nullptr;
  struct DeniedWaiter {
    std::uint64_t id;
    std::uint64_t since;
    std::size_t limit;
    std::function<void(nlohmann::json)> reply;
  };
  std::vector<DeniedWaiter> denied_waiters_;
  std::uint64_t next_waiter_ = 1;
  // Last: its handlers use the members above.
  control::Dispatcher commands_ = command_table();
};

}  // namespace egressd::daemon
