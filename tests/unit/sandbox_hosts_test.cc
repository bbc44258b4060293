// The hosts file (Sandbox::start_hosts / reload_hosts, docs/pinning.md "Hosts
// files"): which of its pairs are learned (phase, guards, the snapshot), into
// which sets and for how long, what a broken file does, and what pinning and
// explain then see. Over the fake kernel, a file given as text, a manual clock.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "daemon/sandbox.h"
#include "support/clock.h"
#include "support/fake_kernel.h"

using namespace egressd;
using namespace egressd::daemon;
using nlohmann::json;
using testing::FakeKernel;

namespace {

using Names = std::vector<std::string>;

Phase phase(std::string name, Mode mode, std::vector<std::string> entries = {}) {
  auto p = make_inline_phase(name, mode, entries);
  REQUIRE(p.ok());
  return *p;
}

Policy policy() {
  Policy p;
  p.phases.push_back(phase("environment", Mode::public_));
  p.phases.push_back(phase("agent", Mode::allowlist, {"allowed.test", "host.docker.internal", "*.wild.test"}));
  p.phases.push_back(phase("verifier", Mode::allowlist, {"allowed.test"}));
  p.phases.push_back(phase("offline", Mode::no_network));
  p.initial_phase = "agent";
  return p;
}

IpPrefix ip(const char* s) { return *parse_ip(s); }

struct Fixture {
  testing::ManualClock clock;
  FakeKernel* kernel = nullptr;
  std::unique_ptr<Sandbox> sb;
  // What the "file" holds: text, or nullopt (missing), or an error.
  Result<std::optional<std::string>> file = std::optional<std::string>{};
  std::size_t reads = 0;

  explicit Fixture(std::optional<std::string> text, Policy p = policy(),
                   std::optional<nft::TableInfo> existing = std::nullopt, std::string snapshot_file = "") {
    file = std::move(text);
    auto k = std::make_unique<FakeKernel>();
    k->table = std::move(existing);
    kernel = k.get();
    SandboxOptions o;
    o.policy = std::move(p);
    o.clock = clock.source();
    o.compile.pin = true;
    o.hosts_path = "/etc/hosts";
    o.hosts_snapshot_file = std::move(snapshot_file);
    o.read_hosts = [this]() -> Result<std::optional<std::string>> {
      ++reads;
      return file;
    };
    sb = std::make_unique<Sandbox>(std::move(o), std::move(k), Capabilities{true, true, true, true, true, true, true, true});
  }
};

// Every address added to `set` by the batches from `from` on, sorted.
std::vector<std::pair<std::string, std::uint64_t>> added(const FakeKernel& k, const std::string& set,
                                                         std::size_t from = 0) {
  std::vector<std::pair<std::string, std::uint64_t>> out;
  for (std::size_t i = from; i < k.applied.size(); ++i) {
    const auto& ops = k.applied[i].ops;
    for (std::size_t j = 0; j < ops.size(); ++j) {
      const auto& op = ops[j];
      // An element replaced to change its comment (add, delete, add): counted once.
      if (j + 1 < ops.size() && std::holds_alternative<nft::OpDeleteElems>(ops[j + 1])) continue;
      if (auto* e = std::get_if<nft::OpAddElems>(&op); e && e->set == set) {
        for (const auto& el : e->elems) out.emplace_back(el.from.to_string(), el.timeout_ms);
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

constexpr std::uint64_t kHostsMs = std::chrono::milliseconds(Sandbox::kHostsTimeout).count();

const char* kHarborHosts =
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "# extra_hosts\n"
    "10.0.0.1\thost.docker.internal\n"
    "203.0.113.10 allowed.test  # shared CDN address\n"
    "203.0.113.10 same-ip.test\n"
    "169.254.169.254 a.wild.test\n"
    "10.1.2.3 b.wild.test\n"
    "2001:db8::10 allowed.test\n";

}  // namespace

TEST_CASE("hosts file: names the phase allows are learned into its sets and pinned; others are not") {
  Fixture f{std::string(kHarborHosts)};
  REQUIRE(f.sb->start("agent").ok());
  const std::size_t before = f.kernel->applied.size();
  REQUIRE(f.sb->start_hosts().ok());
  using P = std::vector<std::pair<std::string, std::uint64_t>>;
  // Exact entries: host.docker.internal's private address is learned as a DNS
  // answer for an exact name would be; *.wild.test's metadata address and its
  // private one are kept out by the same guards as DNS answers.
  CHECK(added(*f.kernel, "ph_agent_d4", before) == P{{"10.0.0.1", kHostsMs}, {"203.0.113.10", kHostsMs}});
  CHECK(added(*f.kernel, "ph_agent_d6", before) == P{{"2001:db8::10", kHostsMs}});
  CHECK(f.kernel->applied.size() == before + 1);  // one batch
  CHECK(f.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});
  CHECK(f.sb->learned_names_for(ip("10.0.0.1")) == Names{"host.docker.internal"});
  CHECK(f.sb->learned_names_for(ip("169.254.169.254")).empty());
  CHECK(f.sb->learned_names_for(ip("127.0.0.1")).empty());
  // Never expire while in the file.
  f.clock.advance(std::chrono::hours(24));
  CHECK(f.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});

  // Status lists them as from the hosts file, without expiry.
  const json st = f.sb->status();
  bool seen = false;
  for (const auto& l : st["learned"]) {
    if (l["name"] != "host.docker.internal") continue;
    seen = true;
    CHECK(l["addresses"][0]["source"] == "hosts");
    CHECK(l["addresses"][0]["expires_in_s"].is_null());
  }
  CHECK(seen);

  // explain NAME@ADDRESS: the pinning decision for them.
  json r = f.sb->handle({{"cmd", "explain"}, {"target", "same-ip.test@203.0.113.10:443"}});
  REQUIRE(r["ok"] == true);
  CHECK(r["allowed"] == false);
  CHECK(r["pin"] == "tls sni same-ip.test to 203.0.113.10:443; address learned for allowed.test");
  r = f.sb->handle({{"cmd", "explain"}, {"target", "host.docker.internal@10.0.0.1:80"}});
  CHECK(r["allowed"] == true);
  CHECK(r["pin"] == "http host host.docker.internal to 10.0.0.1:80; allowed by host.docker.internal");
  CHECK(f.sb->handle({{"cmd", "explain"}, {"target", "foo@"}})["error"]["code"] == "invalid_request");
}

TEST_CASE("hosts file: re-read at every switch; the new phase gets only the names it allows") {
  Fixture f{std::string(kHarborHosts)};
  REQUIRE(f.sb->start("agent").ok());
  REQUIRE(f.sb->start_hosts().ok());
  const std::size_t reads = f.reads;
  const std::size_t before = f.kernel->applied.size();
  REQUIRE(f.sb->handle({{"cmd", "apply"}, {"phase", "verifier"}})["ok"] == true);
  CHECK(f.reads == reads + 1);
  using P = std::vector<std::pair<std::string, std::uint64_t>>;
  CHECK(added(*f.kernel, "ph_verifier_d4", before) == P{{"203.0.113.10", kHostsMs}});
  CHECK(f.sb->learned_names_for(ip("10.0.0.1")).empty());  // verifier does not allow it
  CHECK(f.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});
  // No pairs outside allowlist phases.
  REQUIRE(f.sb->handle({{"cmd", "apply"}, {"phase", "offline"}})["ok"] == true);
  CHECK(f.sb->learned_names_for(ip("203.0.113.10")).empty());
  // Back: learned again, within the same switch batch.
  const std::size_t b2 = f.kernel->applied.size();
  REQUIRE(f.sb->handle({{"cmd", "apply"}, {"phase", "agent"}})["ok"] == true);
  CHECK(f.kernel->applied.size() == b2 + 1);
  CHECK(added(*f.kernel, "ph_agent_d4", b2).size() == 2);
  CHECK(f.sb->learned_names_for(ip("10.0.0.1")) == Names{"host.docker.internal"});
}

TEST_CASE("hosts file: a pair dropped from the file stops being pinned at once; one added after start is not taken") {
  Fixture f{std::string("203.0.113.10 allowed.test\n10.0.0.1 host.docker.internal\n")};
  REQUIRE(f.sb->start("agent").ok());
  REQUIRE(f.sb->start_hosts().ok());
  // Dropped: pinning resets the name at once; the element times out in the kernel.
  f.file = std::optional<std::string>("10.0.0.1 host.docker.internal\n");
  const std::size_t before = f.kernel->applied.size();
  REQUIRE(f.sb->reload_hosts().ok());
  CHECK(f.sb->learned_names_for(ip("203.0.113.10")).empty());
  CHECK(f.sb->learned_names_for(ip("10.0.0.1")) == Names{"host.docker.internal"});
  CHECK(added(*f.kernel, "ph_agent_d4", before) ==
        std::vector<std::pair<std::string, std::uint64_t>>{{"10.0.0.1", kHostsMs}});
  // A sandbox that can write the file points an allowed name elsewhere: not taken.
  f.file = std::optional<std::string>("10.0.0.1 host.docker.internal\n198.51.100.66 allowed.test\n"
                                      "203.0.113.10 allowed.test\n");
  REQUIRE(f.sb->reload_hosts().ok());
  CHECK(f.sb->learned_names_for(ip("198.51.100.66")).empty());
  CHECK(f.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});  // back: it was there at start
  // Unchanged text: no batch until the refresh is due, then the same elements again.
  const std::size_t b2 = f.kernel->applied.size();
  REQUIRE(f.sb->reload_hosts().ok());
  CHECK(f.kernel->applied.size() == b2);
  f.clock.advance(Sandbox::kHostsRefresh);
  REQUIRE(f.sb->reload_hosts().ok());
  CHECK(f.kernel->applied.size() == b2 + 1);
  CHECK(added(*f.kernel, "ph_agent_d4", b2).size() == 2);
  // Replaced, not added again: an add of an element the kernel has leaves its expiry as it
  // was, and each element lapsed kHostsTimeout after it was first written.
  const auto& ops = f.kernel->applied.back().ops;
  REQUIRE(ops.size() == 3);
  const auto* del = std::get_if<nft::OpDeleteElems>(&ops[1]);
  REQUIRE(del != nullptr);
  CHECK(del->elems.size() == 2);
  const auto& again = std::get<nft::OpAddElems>(ops[2]);
  REQUIRE(again.elems.size() == 2);
  CHECK(again.elems[0].comment == "host.docker.internal");
  CHECK(again.elems[1].comment == "allowed.test");
}

TEST_CASE("hosts file: a broken file teaches nothing, names FILE:LINE, and the sandbox runs on") {
  Fixture f{std::string("203.0.113.10 allowed.test\n203.0.113.11 bad_name! \n")};
  REQUIRE(f.sb->start("agent").ok());
  const std::size_t before = f.kernel->applied.size();
  auto st = f.sb->start_hosts();
  REQUIRE_FALSE(st.ok());
  CHECK(st.error().message.find("/etc/hosts:2: not a host name") != std::string::npos);
  CHECK(f.kernel->applied.size() == before);
  CHECK(f.sb->learned_names_for(ip("203.0.113.10")).empty());
  CHECK(f.sb->state().phase == "agent");

  // A good file at start, broken later: what it taught is dropped (fail closed).
  Fixture g{std::string("203.0.113.10 allowed.test\n")};
  REQUIRE(g.sb->start("agent").ok());
  REQUIRE(g.sb->start_hosts().ok());
  CHECK(g.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});
  g.file = std::optional<std::string>("203.0.113.10 allowed.test\nfe80::1%eth0 x.test\n");
  st = g.sb->reload_hosts();
  REQUIRE_FALSE(st.ok());
  CHECK(st.error().message.find("/etc/hosts:2: not an IP address") != std::string::npos);
  CHECK(g.sb->learned_names_for(ip("203.0.113.10")).empty());
  // Fixed: taken again (the pairs of the snapshot).
  g.file = std::optional<std::string>("203.0.113.10 allowed.test\n");
  REQUIRE(g.sb->reload_hosts().ok());
  CHECK(g.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});
  // Unreadable: the same.
  g.file = Error::invalid("cannot read hosts file /etc/hosts: Permission denied");
  CHECK_FALSE(g.sb->reload_hosts().ok());
  CHECK(g.sb->learned_names_for(ip("203.0.113.10")).empty());
}

TEST_CASE("hosts file: a missing file is no error and teaches nothing") {
  Fixture f(std::nullopt);
  REQUIRE(f.sb->start("agent").ok());
  const std::size_t before = f.kernel->applied.size();
  CHECK(f.sb->start_hosts().ok());
  CHECK(f.kernel->applied.size() == before);
  CHECK(f.sb->hosts_pairs().empty());
}

TEST_CASE("hosts file: a DNS answer for a hosts address keeps the file's lifetime in the kernel") {
  Policy p = policy();
  p.dns.min_ttl_s = 0;
  Fixture f{std::string("203.0.113.10 allowed.test\n"), p};
  REQUIRE(f.sb->start("agent").ok());
  REQUIRE(f.sb->start_hosts().ok());
  const std::size_t before = f.kernel->applied.size();
  f.sb->learn({{"allowed.test", ip("203.0.113.10"), 1}}, [](Status) {});
  const auto got = added(*f.kernel, "ph_agent_d4", before);
  REQUIRE(got.size() == 1);
  CHECK(got[0].second == kHostsMs);  // not (1 + 10) s
}

TEST_CASE("load_hosts: pairs only from a file without problems") {
  auto ok = load_hosts("192.0.2.1 a.test b.test\n", "h");
  CHECK(ok.problems.empty());
  CHECK(ok.pairs.size() == 2);
  auto bad = load_hosts("192.0.2.1 a.test\n192.0.2.2\n", "h");
  CHECK(bad.pairs.empty());
  REQUIRE(bad.problems.size() == 1);
  CHECK(bad.problems[0] == "h:2: address 192.0.2.2 without a name; line skipped");
}

TEST_CASE("hosts file: a switch the kernel refuses still takes the file as read for the phase in force") {
  Fixture f{std::string("203.0.113.10 allowed.test\n10.0.0.1 host.docker.internal\n")};
  REQUIRE(f.sb->start("agent").ok());
  REQUIRE(f.sb->start_hosts().ok());
  f.file = std::optional<std::string>("10.0.0.1 host.docker.internal\n");
  f.kernel->fail_next = Error::runtime("batch refused");
  CHECK(f.sb->handle({{"cmd", "apply"}, {"phase", "verifier"}})["ok"] == false);
  CHECK(f.sb->state().phase == "agent");
  CHECK(f.sb->learned_names_for(ip("203.0.113.10")).empty());
  CHECK(f.sb->learned_names_for(ip("10.0.0.1")) == Names{"host.docker.internal"});
}

TEST_CASE("read_hosts_file: regular files only, never blocking; /proc/PID/root/ paths resolved inside that root") {
  char tmpl[] = "/tmp/egressd-hosts-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  const std::string file = dir + "/hosts", fifo = dir + "/fifo";
  {
    FILE* f = std::fopen(file.c_str(), "w");
    REQUIRE(f != nullptr);
    std::fputs("192.0.2.1 a.test\n", f);
    std::fclose(f);
  }
  auto r = read_hosts_file(file);
  REQUIRE(r.ok());
  CHECK(**r == "192.0.2.1 a.test\n");
  r = read_hosts_file(dir + "/missing");
  REQUIRE(r.ok());
  CHECK_FALSE(r->has_value());
  // A FIFO would block the loop until someone writes to it.
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  r = read_hosts_file(fifo);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message == "hosts file " + fifo + " is not a regular file; not read");
  r = read_hosts_file(dir);
  CHECK_FALSE(r.ok());
  // Through a process's root (here our own).
  const std::string via_root = "/proc/" + std::to_string(::getpid()) + "/root" + file;
  r = read_hosts_file(via_root);
  REQUIRE(r.ok());
  CHECK(**r == "192.0.2.1 a.test\n");
  // A magic link inside that root is not followed.
  r = read_hosts_file("/proc/" + std::to_string(::getpid()) + "/root/proc/self/root" + file);
  CHECK_FALSE(r.ok());
  std::remove(fifo.c_str());
  std::remove(file.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("HostsFileReader: a stat answers while the file is unchanged; any change, or a racy read, reads it again") {
  char tmpl[] = "/tmp/egressd-hosts-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  const std::string file = dir + "/hosts", other = dir + "/hosts.new";
  auto write = [](const std::string& path, const char* text) {
    FILE* f = std::fopen(path.c_str(), "w");
    REQUIRE(f != nullptr);
    std::fputs(text, f);
    std::fclose(f);
  };
  auto ctime_of = [](const std::string& path) {
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    return st.st_ctim;
  };
  write(file, "192.0.2.1 a.test\n");
  // The clock the reader compares ctime with: "now" is what the test says.
  timespec now = ctime_of(file);
  HostsFileReader read(file, [&] { return now; });

  SUBCASE("a read right after the file changed is never trusted later") {
    // 2 s: within the slack that covers file systems with whole-second times.
    now.tv_sec += 2;
    for (int i = 1; i <= 3; ++i) {
      auto r = read();
      REQUIRE(r.ok());
      CHECK(**r == "192.0.2.1 a.test\n");
      CHECK(read.reads() == static_cast<std::uint64_t>(i));
    }
  }
  SUBCASE("a read well after the last change is kept until the file changes") {
    now.tv_sec += 4;
    REQUIRE((*read()).value() == "192.0.2.1 a.test\n");
    REQUIRE((*read()).value() == "192.0.2.1 a.test\n");
    CHECK(read.reads() == 1);
    // Another size: read again.
    write(file, "192.0.2.2 bb.test\n");
    now = ctime_of(file);
    now.tv_sec += 4;
    CHECK((*read()).value() == "192.0.2.2 bb.test\n");
    CHECK(read.reads() == 2);
    CHECK((*read()).value() == "192.0.2.2 bb.test\n");
    CHECK(read.reads() == 2);
    // The same size, replaced by rename (another inode): read again.
    write(other, "192.0.2.3 cc.test\n");
    REQUIRE(std::rename(other.c_str(), file.c_str()) == 0);
    CHECK((*read()).value() == "192.0.2.3 cc.test\n");
    CHECK(read.reads() == 3);
    // Gone: read (and found missing), then back.
    REQUIRE(std::remove(file.c_str()) == 0);
    auto r = read();
    REQUIRE(r.ok());
    CHECK_FALSE(r->has_value());
    write(file, "192.0.2.4 d.test\n");
    CHECK((*read()).value() == "192.0.2.4 d.test\n");
    CHECK(read.reads() == 5);
  }
  SUBCASE("paths under /proc/PID/root/ are read every time") {
    HostsFileReader via_root("/proc/" + std::to_string(::getpid()) + "/root" + file, [&] {
      timespec t = now;
      t.tv_sec += 4;
      return t;
    });
    for (int i = 1; i <= 3; ++i) {
      auto r = via_root();
      REQUIRE(r.ok());
      CHECK(**r == "192.0.2.1 a.test\n");
    }
    CHECK(via_root.reads() == 3);
  }
  std::remove(other.c_str());
  std::remove(file.c_str());
  ::rmdir(dir.c_str());
}

namespace {

// A file name in a directory of its own, removed with it.
struct TempPath {
  std::string dir, path;
  explicit TempPath(const char* tag) {
    char d[] = "/tmp/egressd-hosts-snap-XXXXXX";
    REQUIRE(::mkdtemp(d) != nullptr);
    dir = d;
    path = dir + "/" + tag;
  }
  ~TempPath() { std::filesystem::remove_all(dir); }
};

std::string slurp(const std::string& path) {
  auto r = read_hosts_file(path);
  REQUIRE(r.ok());
  REQUIRE(r->has_value());
  return **r;
}

}  // namespace

TEST_CASE("hosts snapshot: text and parse agree; a file without its head or end line is refused") {
  LearnedStore::HostsPairs pairs{{"allowed.test", {ip("203.0.113.10"), ip("2001:db8::10")}},
                                 {"host.docker.internal", {ip("10.0.0.1")}}};
  const std::string text = hosts_snapshot_text(pairs, "/proc/7/root/etc/hosts");
  CHECK(text.rfind(std::string(kHostsSnapshotHead) + "\n", 0) == 0);
  auto back = parse_hosts_snapshot(text, "s");
  REQUIRE(back.ok());
  CHECK(*back == pairs);
  CHECK(parse_hosts_snapshot(hosts_snapshot_text({}, "h"), "s").ok());
  CHECK(parse_hosts_snapshot(hosts_snapshot_text({}, "h"), "s")->empty());

  CHECK(parse_hosts_snapshot("", "s").error().message == "hosts snapshot s does not start with \"" +
                                                             std::string(kHostsSnapshotHead) + "\"");
  CHECK(parse_hosts_snapshot("203.0.113.10 allowed.test\n# end\n", "s").error().message.find("does not start") !=
        std::string::npos);
  const std::string cut = text.substr(0, text.size() - 3);
  CHECK(parse_hosts_snapshot(cut, "s").error().message == "hosts snapshot s does not end with \"# end\" (cut short?)");
  std::string bad = text;
  bad.insert(bad.find("# end"), "203.0.113.11\n");
  CHECK(parse_hosts_snapshot(bad, "s").error().message.find("without a name") != std::string::npos);
}

TEST_CASE("hosts file: the snapshot is kept with the state; a restart takes only its pairs, not the file as it is") {
  const TempPath tmp("egressd.sock.state.hosts");
  const std::string& snap = tmp.path;
  std::optional<nft::TableInfo> table;
  {
    Fixture f{std::string("203.0.113.10 allowed.test\n"), policy(), std::nullopt, snap};
    REQUIRE(f.sb->start("agent").ok());
    REQUIRE(f.sb->start_hosts().ok());
    CHECK(f.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});
    CHECK(slurp(snap) == hosts_snapshot_text({{"allowed.test", {ip("203.0.113.10")}}}, "/etc/hosts"));
    // The sandbox adds a pair: held while this egressd runs.
    f.file = std::optional<std::string>("203.0.113.10 allowed.test\n198.51.100.11 allowed.test\n");
    REQUIRE(f.sb->reload_hosts().ok());
    CHECK(f.sb->learned_names_for(ip("198.51.100.11")).empty());
    table = f.kernel->table;
  }
  REQUIRE(table.has_value());
  // The restart adopts the table and reads the file with the sandbox's pair in it: still not taken
  // (before, the snapshot was the file as read at the restart).
  Fixture again{std::string("203.0.113.10 allowed.test\n198.51.100.11 allowed.test\n"), policy(), table, snap};
  REQUIRE(again.sb->start("agent").ok());
  REQUIRE(again.sb->start_hosts().ok());
  CHECK(again.sb->learned_names_for(ip("198.51.100.11")).empty());
  CHECK(again.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});
  CHECK(again.sb->hosts_pairs() == LearnedStore::HostsPairs{{"allowed.test", {ip("203.0.113.10")}}});
  // The snapshot file is not rewritten by the restart.
  CHECK(slurp(snap) == hosts_snapshot_text({{"allowed.test", {ip("203.0.113.10")}}}, "/etc/hosts"));
  // Removing the table (--remove-policy, --cleanup-on-exit) removes the snapshot: the next table is a fresh start.
  REQUIRE(again.sb->remove_table().ok());
  CHECK(::access(snap.c_str(), F_OK) != 0);
}

TEST_CASE("hosts file: a restart without its snapshot, or with a broken one, learns nothing from the file") {
  const TempPath tmp("egressd.sock.state.hosts");
  const std::string& snap = tmp.path;
  std::optional<nft::TableInfo> table;
  {
    Fixture f{std::string("203.0.113.10 allowed.test\n"), policy(), std::nullopt, snap};
    REQUIRE(f.sb->start("agent").ok());
    REQUIRE(f.sb->start_hosts().ok());
    table = f.kernel->table;
  }
  const std::string text = slurp(snap);
  for (const std::string& damage : {std::string("missing"), std::string("cut"), std::string("garbage")}) {
    CAPTURE(damage);
    if (damage == "missing") {
      REQUIRE(::unlink(snap.c_str()) == 0);
    } else {
      std::FILE* out = std::fopen(snap.c_str(), "w");
      REQUIRE(out != nullptr);
      const std::string t = damage == "cut" ? text.substr(0, text.size() - 4) : "garbage\n";
      std::fwrite(t.data(), 1, t.size(), out);
      std::fclose(out);
    }
    Fixture again{std::string("203.0.113.10 allowed.test\n"), policy(), table, snap};
    REQUIRE(again.sb->start("agent").ok());
    (void)again.sb->start_hosts();
    CHECK(again.sb->learned_names_for(ip("203.0.113.10")).empty());
    CHECK(again.sb->hosts_pairs().empty());
  }
  // No table at all: a fresh start takes the file as it is and keeps its snapshot again.
  Fixture fresh{std::string("203.0.113.10 allowed.test\n"), policy(), std::nullopt, snap};
  REQUIRE(fresh.sb->start("agent").ok());
  REQUIRE(fresh.sb->start_hosts().ok());
  CHECK(fresh.sb->learned_names_for(ip("203.0.113.10")) == Names{"allowed.test"});
  CHECK(slurp(snap) == text);
}
