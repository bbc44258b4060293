// LearnedStore (src/daemon/learned.h): expiry on an injected clock, the
// address index, the bound and its once-a-second sweep.
#include "daemon/learned.h"

#include <doctest/doctest.h>

#include "support/clock.h"

using namespace egressd;
using daemon::LearnedStore;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {

IpPrefix ip(const char* text) {
  auto p = parse_ip(text);
  REQUIRE(p.has_value());
  return *p;
}

using Names = std::vector<std::string>;

}  // namespace

TEST_CASE("a learned address is live until its timeout, then only remembered") {
  testing::ManualClock clock;
  LearnedStore store(16, clock.source());
  CHECK(store.remember("pypi.org", ip("198.51.100.7"), seconds(30)));
  CHECK(store.live("pypi.org"));
  CHECK_FALSE(store.live("files.pythonhosted.org"));
  CHECK(store.names_for(ip("198.51.100.8")).empty());
  CHECK(store.names_for(ip("198.51.100.7")) == Names{"pypi.org"});
  CHECK(store.live_count() == 1);
  clock.advance(seconds(29));
  CHECK(store.live("pypi.org"));
  clock.advance(seconds(1));
  CHECK_FALSE(store.live("pypi.org"));
  CHECK(store.names_for(ip("198.51.100.7")).empty());
  CHECK(store.names_for(ip("198.51.100.7"), true) == Names{"pypi.org"});  // where it came from
  CHECK(store.live_count() == 0);
  CHECK(store.size() == 1);
}

TEST_CASE("a second answer extends a pair, never shortens it") {
  testing::ManualClock clock;
  LearnedStore store(16, clock.source());
  CHECK(store.remember("a.example", ip("192.0.2.1"), seconds(60)));
  CHECK(store.remember("a.example", ip("192.0.2.1"), seconds(5)));
  clock.advance(seconds(30));
  CHECK(store.live("a.example"));
  CHECK(store.remember("a.example", ip("192.0.2.1"), seconds(90)));
  clock.advance(seconds(80));
  CHECK(store.live("a.example"));
  CHECK(store.size() == 1);
}

TEST_CASE("a DNS pair says whether it lasts until a given time; a hosts-file pair never does") {
  testing::ManualClock clock;
  LearnedStore store(16, clock.source());
  const auto now = clock.steady;
  CHECK(store.remember("pypi.org", ip("198.51.100.7"), seconds(30)));
  CHECK(store.dns_pair_until("pypi.org", ip("198.51.100.7"), now + seconds(30)));
  CHECK_FALSE(store.dns_pair_until("pypi.org", ip("198.51.100.7"), now + seconds(31)));
  CHECK_FALSE(store.dns_pair_until("pypi.org", ip("198.51.100.8"), now));
  CHECK_FALSE(store.dns_pair_until("files.pythonhosted.org", ip("198.51.100.7"), now));
  // The hosts file's pairs time out in the kernel on their own refresh, not on DNS answers.
  CHECK(store.set_hosts({{"pypi.org", {ip("198.51.100.7")}}}) == 0);
  CHECK_FALSE(store.dns_pair_until("pypi.org", ip("198.51.100.7"), now));
}

TEST_CASE("an address's DNS lifetime is its longest pair's; a few live names of it are listed, bounded") {
  testing::ManualClock clock;
  LearnedStore store(64, clock.source());
  const IpPrefix cdn = ip("203.0.113.10");
  CHECK(store.dns_left(cdn) == milliseconds(0));
  CHECK(store.remember("a.test", cdn, seconds(70)));
  CHECK(store.remember("b.test", cdn, seconds(20)));
  CHECK(store.dns_left(cdn) == seconds(70));  // b's shorter lifetime does not shorten it
  clock.advance(seconds(30));
  CHECK(store.dns_left(cdn) == seconds(40));
  CHECK(store.some_live_names(cdn, 8) == Names{"a.test"});  // b expired
  // Hosts-file pairs have no DNS lifetime, and count as live names.
  CHECK(store.set_hosts({{"h.test", {cdn}}}) == 0);
  CHECK(store.dns_left(cdn) == seconds(40));
  CHECK(store.some_live_names(cdn, 8) == Names{"a.test", "h.test"});
  clock.advance(seconds(40));
  CHECK(store.dns_left(cdn) == milliseconds(0));
  // Many names on one address: at most `limit`, in name order, looking at 4 x limit names.
  for (int i = 0; i < 40; ++i) CHECK(store.remember("n" + std::to_string(10 + i) + ".test", cdn, seconds(5)));
  CHECK(store.some_live_names(cdn, 3) == Names{"h.test", "n10.test", "n11.test"});
  clock.advance(seconds(5));
  CHECK(store.some_live_names(cdn, 3) == Names{"h.test"});  // the 39 expired ones are not read past 12
}

TEST_CASE("the address index answers every name an address was learned for, in name order") {
  testing::ManualClock clock;
  LearnedStore store(16, clock.source());
  CHECK(store.remember("b.example", ip("2001:db8::1"), seconds(10)));
  CHECK(store.remember("a.example", ip("2001:db8::1"), seconds(20)));
  CHECK(store.remember("a.example", ip("192.0.2.1"), seconds(20)));
  CHECK(store.names_for(ip("2001:db8::1")) == Names{"a.example", "b.example"});
  CHECK(store.names_for(ip("192.0.2.1")) == Names{"a.example"});
  CHECK(store.names_for(ip("192.0.2.2")).empty());
  clock.advance(seconds(15));  // b.example's pair expired, a.example's did not
  CHECK(store.names_for(ip("2001:db8::1")) == Names{"a.example"});
  CHECK(store.names_for(ip("2001:db8::1"), true) == Names{"a.example", "b.example"});
}

TEST_CASE("a full store sweeps expired pairs at most once a second, and refuses when still full") {
  testing::ManualClock clock;
  LearnedStore store(2, clock.source());
  CHECK(store.remember("a.example", ip("192.0.2.1"), seconds(1)));
  CHECK(store.remember("b.example", ip("192.0.2.2"), seconds(60)));
  // t=0: full, nothing expired: refused (and a sweep happened: the next waits until t=1 s).
  CHECK_FALSE(store.remember("c.example", ip("192.0.2.3"), milliseconds(500)));
  CHECK(store.by_name().count("c.example") == 0);
  // t=1.2 s: a.example expired; sweeping is allowed again.
  clock.advance(milliseconds(1200));
  CHECK(store.remember("c.example", ip("192.0.2.3"), milliseconds(500)));
  CHECK(store.size() == 2);
  CHECK(store.by_name().count("a.example") == 0);
  CHECK(store.names_for(ip("192.0.2.1"), true).empty());  // swept from the index too
  CHECK(store.names_for(ip("192.0.2.3")) == Names{"c.example"});
  // t=1.8 s: c.example expired, but the last sweep was 0.6 s ago: refused without a walk.
  clock.advance(milliseconds(600));
  CHECK_FALSE(store.remember("d.example", ip("192.0.2.4"), seconds(60)));
  // t=2.3 s: the sweep runs again and makes room.
  clock.advance(milliseconds(500));
  CHECK(store.remember("d.example", ip("192.0.2.4"), seconds(60)));
  CHECK(store.names_for(ip("192.0.2.3"), true).empty());
  CHECK(store.size() == 2);
}

TEST_CASE("hosts-file pairs do not expire while set; dropped, they keep only what DNS gave them") {
  testing::ManualClock clock;
  LearnedStore store(16, clock.source());
  CHECK(store.remember("allowed.test", ip("203.0.113.10"), seconds(30)));
  CHECK(store.set_hosts({{"allowed.test", {ip("203.0.113.10")}}, {"host.docker.internal", {ip("192.0.2.1")}}}) == 0);
  CHECK(store.from_hosts(ip("203.0.113.10")));
  CHECK(store.from_hosts(ip("192.0.2.1")));
  CHECK_FALSE(store.from_hosts(ip("192.0.2.2")));
  clock.advance(std::chrono::hours(24 * 365));
  CHECK(store.names_for(ip("192.0.2.1")) == Names{"host.docker.internal"});
  CHECK(store.names_for(ip("203.0.113.10")) == Names{"allowed.test"});
  CHECK(store.live_count() == 2);
  // A DNS answer for a hosts pair changes nothing visible, and survives it.
  CHECK(store.remember("host.docker.internal", ip("192.0.2.1"), seconds(60)));
  CHECK(store.size() == 2);
  CHECK(store.set_hosts({}) == 0);
  CHECK_FALSE(store.from_hosts(ip("192.0.2.1")));
  CHECK(store.names_for(ip("192.0.2.1")) == Names{"host.docker.internal"});  // its DNS answer
  CHECK(store.names_for(ip("203.0.113.10")).empty());  // its DNS answer expired long ago
  CHECK(store.names_for(ip("203.0.113.10"), true) == Names{"allowed.test"});
  clock.advance(seconds(61));
  CHECK(store.names_for(ip("192.0.2.1")).empty());
  CHECK(store.live_count() == 0);
}

TEST_CASE("hosts-file pairs count against the bound") {
  testing::ManualClock clock;
  LearnedStore store(2, clock.source());
  CHECK(store.remember("a.test", ip("192.0.2.1"), seconds(30)));
  CHECK(store.set_hosts({{"b.test", {ip("192.0.2.2"), ip("192.0.2.3")}}}) == 1);
  CHECK(store.size() == 2);
  clock.advance(seconds(31));  // the DNS pair expires; a sweep makes room
  CHECK(store.set_hosts({{"b.test", {ip("192.0.2.2"), ip("192.0.2.3")}}}) == 0);
  CHECK(store.names_for(ip("192.0.2.3")) == Names{"b.test"});
}

TEST_CASE("an element comment names what its address was learned for, bounded, and reads back") {
  using daemon::names_comment;
  using daemon::names_from_comment;
  CHECK(names_comment({"b.test", "a.test", "b.test"}, 127) == "a.test b.test");
  CHECK(names_comment({}, 127).empty());
  // Priority order decides what fits; the kept ones are sorted.
  const std::string long_name(100, 'x');
  CHECK(names_comment({"z.test", long_name + ".test", "a.test"}, 20) == "a.test z.test");
  CHECK(names_comment({long_name, "a.test"}, 106) == long_name);
  CHECK(names_comment({long_name, "a.test"}, 99) == "a.test");
  CHECK(names_comment({long_name, "a.test"}, 107) == "a.test " + long_name);
  CHECK(names_from_comment("a.test b.test") == Names{"a.test", "b.test"});
  CHECK(names_from_comment("") == Names{});
  // The kernel keeps whatever anyone wrote: only normalized names come out.
  CHECK(names_from_comment("A.test  x\ty.test ok-1_2.test .a a. a..b b.test b.test") ==
        Names{"ok-1_2.test", "b.test"});
  CHECK(names_from_comment(std::string(254, 'a')) == Names{});
}

TEST_CASE("room for a pair: one already there always; a new one within the store's and the name's bounds") {
  testing::ManualClock clock;
  LearnedStore store(4, clock.source());
  CHECK(store.room_for("a.wild.test", ip("198.51.100.1"), 2));
  CHECK(store.remember("a.wild.test", ip("198.51.100.1"), seconds(30)));
  CHECK(store.remember("a.wild.test", ip("198.51.100.2"), seconds(30)));
  // The name holds its 2: a third address is refused, one of its own is not.
  CHECK_FALSE(store.room_for("a.wild.test", ip("198.51.100.3"), 2));
  CHECK(store.room_for("a.wild.test", ip("198.51.100.2"), 2));
  CHECK(store.room_for("b.wild.test", ip("198.51.100.3"), 2));
  CHECK(store.remember("b.wild.test", ip("198.51.100.3"), seconds(60)));
  CHECK(store.remember("b.wild.test", ip("198.51.100.4"), seconds(60)));
  // The store holds its 4.
  CHECK_FALSE(store.room_for("c.wild.test", ip("198.51.100.5"), 2));
  CHECK(store.room_for("b.wild.test", ip("198.51.100.4"), 2));
  // Expired pairs are swept to make room (a.wild.test's, after 30 s).
  clock.advance(seconds(31));
  CHECK(store.room_for("a.wild.test", ip("198.51.100.3"), 2));
  CHECK(store.room_for("c.wild.test", ip("198.51.100.5"), 2));
}
