// The hosts file (issue 16 point 7; docs/pinning.md "Hosts files"): names a
// sandbox resolves without DNS (Harbor's host.docker.internal from compose's
// extra_hosts) are learned from the file egressd sees, as if egressd's DNS
// proxy had answered them, so an allowlisted one is reachable and pinned.
//
// What is trusted: the pairs in the file when the sandbox was started (the
// snapshot). In Harbor's compose topology the task container joins the
// sidecar's network namespace, and Docker then gives it the sidecar's hosts
// file, writable by its root: a pair the file gains later could point an
// allowed name at any address, so later reads only drop pairs.
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "daemon/audit_log.h"
#include "daemon/sandbox.h"
#include "dns/message.h"
#include "egressd/module_logger.h"
#include "egressd/unique_fd.h"
#include "pin/hosts_file.h"

namespace egressd::daemon {

namespace {

std::shared_ptr<spdlog::logger> log() { return module_logger("sandbox"); }

// Pairs quoted in the "not learned" warning; the rest are counted.
constexpr std::size_t kShownIgnored = 8;

}  // namespace

HostsLoad load_hosts(std::string_view text, std::string_view path) {
  pin::HostsFile parsed = pin::parse_hosts(text, path);
  HostsLoad out;
  out.problems = std::move(parsed.problems);
  // Fail closed: a file with a line egressd cannot read may mean something
  // else to the resolver that reads it; nothing of it is learned.
  if (out.problems.empty()) out.pairs = std::move(parsed.names);
  return out;
}

namespace {

// "/proc/PID/root/REST" as that process's root ("/proc/PID/root") and REST;
// nothing for any other path.
std::optional<std::pair<std::string, std::string>> split_proc_root(std::string_view p) {
  if (p.rfind("/proc/", 0) != 0) return std::nullopt;
  const auto root_end = p.find("/root/", 6);
  if (root_end == std::string_view::npos ||
      p.substr(6, root_end - 6).find_first_not_of("0123456789") != std::string_view::npos) {
    return std::nullopt;
  }
  return std::pair{std::string(p.substr(0, root_end + 5)), std::string(p.substr(root_end + 6))};
}

// Opens `path` for reading without blocking. Under /proc/PID/root/ the rest
// of the path is resolved inside that process's root (RESOLVE_IN_ROOT), as
// its own resolver would: the file is the sandbox's to shape, and a symlink
// /etc/hosts -> /etc/shadow there must not make egressd read (and quote in
// its log) a file of its own. -1 with errno on failure.
int open_hosts(const std::string& path) {
  constexpr int kFlags = O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
  if (const auto split = split_proc_root(path)) {
    const auto& [root, rest] = *split;
    const UniqueFd dir(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!dir.ok()) return -1;
    open_how how{};
    how.flags = kFlags;
    how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
    const long fd = ::syscall(SYS_openat2, dir.get(), rest.c_str(), &how, sizeof how);
    if (fd >= 0 || errno != ENOSYS) return static_cast<int>(fd);
    // Before Linux 5.6: no symlink at all on the last component.
    return ::openat(dir.get(), rest.c_str(), kFlags | O_NOFOLLOW);
  }
  return ::open(path.c_str(), kFlags);
}

}  // namespace

namespace {

Result<std::optional<std::string>> read_hosts_fd(const std::string& path, struct stat* out) {
  const UniqueFd fd(open_hosts(path));
  if (!fd.ok()) {
    if (errno == ENOENT) return std::optional<std::string>{};
    return Error::invalid("cannot read hosts file " + path + ": " + errno_text(errno));
  }
  // A FIFO or a device there would block the event loop (every sandbox of an
  // agent) or never end.
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Error::invalid("cannot read hosts file " + path + ": " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) return Error::invalid("hosts file " + path + " is not a regular file; not read");
  if (out != nullptr) *out = st;
  std::string text;
  char buf[16384];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Error::invalid("cannot read hosts file " + path + ": " + errno_text(errno));
    }
    if (n == 0) break;
    text.append(buf, static_cast<std::size_t>(n));
    if (text.size() > kMaxHostsFile) {
      return Error::invalid("hosts file " + path + " is larger than " + std::to_string(kMaxHostsFile) +
                            " bytes; not read");
    }
  }
  return std::optional<std::string>(std::move(text));
}

bool same_time(const timespec& a, const timespec& b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; }

}  // namespace

Result<std::optional<std::string>> read_hosts_file(const std::string& path) { return read_hosts_fd(path, nullptr); }

HostsFileReader::HostsFileReader(std::string path, std::function<timespec()> now)
    : path_(std::move(path)), now_(std::move(now)), cacheable_(!split_proc_root(path_)) {
  if (!now_) {
    now_ = [] {
      timespec t{};
      ::clock_gettime(CLOCK_REALTIME, &t);
      return t;
    };
  }
}

Result<std::optional<std::string>> HostsFileReader::operator()() {
  if (cacheable_ && have_) {
    struct stat st {};
    if (::stat(path_.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_ && st.st_size == size_ &&
        same_time(st.st_mtim, mtime_) && same_time(st.st_ctim, ctime_)) {
      return std::optional<std::string>(text_);
    }
  }
  have_ = false;
  struct stat st {};
  const timespec before = now_();
  ++reads_;
  auto r = read_hosts_fd(path_, &st);
  if (!r || !*r || !cacheable_) return r;
  // Kept only when the file's last change came well before this read
  // (its ctime more than kSlack before the clock read ahead of the open).
  // A file that changed within kSlack is read every time.
  const auto ns = [](const timespec& t) { return static_cast<std::int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec; };
  const auto slack_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(kSlack).count();
  if (ns(st.st_ctim) + slack_ns < ns(before)) {
    have_ = true;
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    size_ = st.st_size;
    mtime_ = st.st_mtim;
    ctime_ = st.st_ctim;
    text_ = **r;
  }
  return r;
}

std::string hosts_snapshot_text(const LearnedStore::HostsPairs& pairs, std::string_view path) {
  std::string out = fmt::format(
      "{}\n# The pairs of hosts file {} when egressd made the sandbox's table; after a restart\n"
      "# only these are learned from it (docs/pinning.md \"Hosts files\"). Keep the last line.\n",
      kHostsSnapshotHead, path);
  for (const auto& [name, addrs] : pairs) {
    for (const auto& a : addrs) out += a.to_string() + " " + name + "\n";
  }
  return out + "# end\n";
}

Result<LearnedStore::HostsPairs> parse_hosts_snapshot(std::string_view text, std::string_view file) {
  const std::string f(file);
  if (text.substr(0, text.find('\n')) != kHostsSnapshotHead) {
    return Error::invalid("hosts snapshot " + f + " does not start with \"" + std::string(kHostsSnapshotHead) + "\"");
  }
  constexpr std::string_view kEnd = "\n# end\n";
  if (text.size() < kEnd.size() || text.substr(text.size() - kEnd.size()) != kEnd) {
    return Error::invalid("hosts snapshot " + f + " does not end with \"# end\" (cut short?)");
  }
  HostsLoad load = load_hosts(text, file);
  if (!load.problems.empty()) return Error::invalid("hosts snapshot " + load.problems.front());
  return std::move(load.pairs);
}

void Sandbox::load_hosts_snapshot() {
  const std::string& file = opts_.hosts_snapshot_file;
  auto text = read_hosts_file(file);
  Result<LearnedStore::HostsPairs> pairs = Error::invalid("");
  if (!text) {
    pairs = text.error();
  } else if (!*text) {
    pairs = Error::invalid("hosts snapshot " + file + " does not exist");
  } else {
    pairs = parse_hosts_snapshot(**text, file);
  }
  if (pairs) {
    hosts_snapshot_ = std::move(*pairs);
    return;
  }
  // Fail closed: without the pairs of the file at the start, the file as it
  // is now may hold pairs the sandbox wrote.
  hosts_snapshot_.emplace();
  const std::string error = fmt::format(
      "hosts file {}: nothing is learned from it: this table was adopted and {} (remove the sandbox with its "
      "policy and add it again, or write the pairs to keep into that file; docs/pinning.md \"Hosts files\")",
      opts_.hosts_path, pairs.error().message);
  log()->error("{}", error);
  audit_event("hosts_file", {{"path", opts_.hosts_path}, {"ok", false}, {"error", error}}, spdlog::level::err);
}

[[gnu::cold]] bool Sandbox::read_hosts() {  // start and hosts-file changes: for size
  auto r = opts_.read_hosts();
  std::optional<std::string> text;
  std::string error;
  if (!r) {
    error = r.error().message;
  } else {
    text = std::move(*r);
  }
  if (error.empty() && text == hosts_text_ && hosts_snapshot_) return false;  // unchanged
  hosts_text_ = text;
  LearnedStore::HostsPairs pairs;
  if (error.empty() && text) {
    HostsLoad load = load_hosts(*text, opts_.hosts_path);
    if (!load.problems.empty()) {
      error = load.problems.front() + " (hosts file not used: nothing is learned from it until it is fixed";
      if (load.problems.size() > 1) error += "; " + std::to_string(load.problems.size() - 1) + " more problems";
      error += ")";
    }
    pairs = std::move(load.pairs);
  }
  if (!error.empty()) {
    if (error != hosts_error_) {
      log()->error("{}", error);
      audit_event("hosts_file", {{"path", opts_.hosts_path}, {"ok", false}, {"error", error}}, spdlog::level::err);
    }
  }
  hosts_error_ = error;
  if (!hosts_snapshot_) {
    hosts_snapshot_ = pairs;
    if (!opts_.hosts_snapshot_file.empty()) {
      // Written before anything is learned: a restart that finds no
      // snapshot learns nothing rather than trust the file as it is then.
      if (auto s = write_atomically(opts_.hosts_snapshot_file, hosts_snapshot_text(pairs, opts_.hosts_path)); !s) {
        log()->error("hosts file {}: snapshot not kept for a restart (which will learn nothing from the file): {}",
                     opts_.hosts_path, s.error().message);
      }
    }
  } else {
    // Within the snapshot only: what the file gained since start is not taken.
    LearnedStore::HostsPairs kept;
    std::size_t ignored = 0;
    std::vector<std::string> shown;  // the first few: the file may hold thousands
    for (const auto& [name, addrs] : pairs) {
      auto it = hosts_snapshot_->find(name);
      const std::set<IpPrefix, IpPrefixLess> known =
          it == hosts_snapshot_->end() ? std::set<IpPrefix, IpPrefixLess>{}
                                       : std::set<IpPrefix, IpPrefixLess>(it->second.begin(), it->second.end());
      for (const auto& a : addrs) {
        if (known.contains(a)) {
          kept[name].push_back(a);
        } else if (++ignored <= kShownIgnored) {
          shown.push_back(name + " " + a.to_string());
        }
      }
    }
    if (ignored > 0) {
      log()->warn("hosts file {}: {} pair(s) not in it at start are not learned (a sandbox may be able to write the "
                  "file; docs/pinning.md \"Hosts files\" says how to take them): {}{}",
                  opts_.hosts_path, ignored, fmt::join(shown, ", "),
                  ignored > shown.size() ? fmt::format(" and {} more", ignored - shown.size()) : "");
    }
    pairs = std::move(kept);
  }
  const bool changed = pairs != hosts_;
  hosts_ = std::move(pairs);
  if (changed && error.empty()) {
    std::size_t n = 0;
    for (const auto& [name, addrs] : hosts_) n += addrs.size();
    audit_event("hosts_file", {{"path", opts_.hosts_path}, {"ok", true}, {"names", hosts_.size()}, {"pairs", n}},
                spdlog::level::info);
  }
  return changed;
}

LearnedStore::HostsPairs Sandbox::hosts_allowed(const PhaseFacts& facts, Mode mode) const {
  LearnedStore::HostsPairs out;
  if (mode != Mode::allowlist) return out;
  for (const auto& [name, addrs] : hosts_) {
    const Entry* e = facts.matcher->match(name);
    if (e == nullptr) continue;
    // The same guards as a DNS answer: the file may be the sandbox's to
    // write (see the top), and an address an allowed name must not reach by
    // DNS (metadata, loopback, link-local; private ones for a wildcard
    // match) must not be reachable by writing it here either. An operator
    // who wants one adds it as an IP entry.
    const bool exact = e->kind == EntryKind::hostname;
    for (const auto& a : addrs) {
      if (dns::guard_for(a, exact, opts_.policy.dns.private_answers)) continue;
      out[name].push_back(a);
    }
  }
  return out;
}

void Sandbox::sync_hosts_store() {
  const auto pairs = hosts_allowed(*active_facts_, state_.mode);
  if (const std::size_t missed = learned_.set_hosts(pairs); missed > 0) {
    log()->warn("hosts file {}: {} pair(s) not remembered (max_learned reached): pinning resets their names",
                opts_.hosts_path, missed);
  }
}

Status Sandbox::apply_hosts() {
  hosts_refreshed_ = opts_.clock.steady();
  const auto pairs = hosts_allowed(*active_facts_, state_.mode);
  if (pairs.empty()) return {};
  const auto [s4, s6] = nft::learned_sets(active_chain());
  const std::uint64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(kHostsTimeout).count();
  std::map<IpPrefix, std::vector<std::string>, IpAddrLess> names;  // the file's allowed names per address
  for (const auto& [name, addrs] : pairs) {
    for (const auto& a : addrs) names[a].push_back(name);
  }
  // Every element is replaced (add, delete, add in this one transaction:
  // the address is never out of the set): an add of an element the kernel
  // has does not refresh its timeout (before 6.10 never, since then only
  // when the timeout differs), so a refresh by add let each element lapse
  // kHostsTimeout after it was first written, until the next refresh. The
  // element names the file's names first, then a few live DNS names of it
  // the phase allows; it lives at least as long as those ask.
  const dns::NameMatcher& m = *active_facts_->matcher;
  std::vector<nft::SetElem> elems4, elems6;
  for (auto& [a, file_names] : names) {
    std::sort(file_names.begin(), file_names.end());
    for (const auto& n : learned_.some_live_names(a, kCommentNames)) {
      if (m.match(n) != nullptr && std::find(file_names.begin(), file_names.end(), n) == file_names.end())
        file_names.push_back(n);
    }
    const auto left = static_cast<std::uint64_t>(learned_.dns_left(a).count());
    (a.family == 4 ? elems4 : elems6)
        .push_back(nft::SetElem{a, a, std::max(ms, left), names_comment(file_names, nft::kElemCommentMax)});
  }
  nft::Change ch;
  ch.table = nft::kTableName;
  push_learned_elems(ch.ops, s4, nft::SetType::ipv4_addr, {}, std::move(elems4));
  push_learned_elems(ch.ops, s6, nft::SetType::ipv6_addr, {}, std::move(elems6));
  auto st = apply_batch(ch);
  if (!st) log()->error("hosts file {}: addresses not inserted: {}", opts_.hosts_path, st.error().message);
  return st;
}

Status Sandbox::start_hosts() {
  if (!opts_.read_hosts || hosts_started_) return {};
  hosts_started_ = true;
  if (adopted_ && !opts_.hosts_snapshot_file.empty()) load_hosts_snapshot();
  (void)read_hosts();
  sync_hosts_store();
  Status st = apply_hosts();
  schedule_hosts_poll();
  if (!hosts_error_.empty()) return Error::invalid(hosts_error_);
  return st;
}

Status Sandbox::reload_hosts() {
  if (!opts_.read_hosts || !hosts_started_) return {};
  const bool changed = read_hosts();
  if (changed) sync_hosts_store();
  Status st;
  if (changed || opts_.clock.steady() - hosts_refreshed_ >= kHostsRefresh) st = apply_hosts();
  if (!hosts_error_.empty()) return Error::invalid(hosts_error_);
  return st;
}

void Sandbox::schedule_hosts_poll() {
  if (!opts_.run_after) return;
  opts_.run_after(opts_.hosts_poll, [this] {
    (void)reload_hosts();  // logged there
    schedule_hosts_poll();
  });
}

}  // namespace egressd::daemon
