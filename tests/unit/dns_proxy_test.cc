// The DNS proxy end to end on loopback: a real Proxy, a fake upstream name
// server (UDP + TCP on 127.0.0.1) that answers canned records and records
// what it was asked, and fake PolicyHooks. Everything runs on one
// io_context in the test thread; waits are on conditions with deadlines.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/udp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "dns/fd_budget.h"
#include "dns/message.h"
#include "dns/proxy.h"

using namespace egressd;
using namespace egressd::dns;
namespace asio = boost::asio;
using udp = asio::ip::udp;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using Msg = std::vector<std::uint8_t>;
using namespace std::chrono_literals;

namespace {

// Runs the loop until `done()` holds or `limit` passes; true if it held.
bool run_until(asio::io_context& io, const std::function<bool()>& done, std::chrono::milliseconds limit = 5000ms) {
  const auto deadline = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    io.restart();
    io.run_one_for(10ms);
  }
  return true;
}

// Runs every handler that is ready now (nothing that waits on time).
void drain(asio::io_context& io) {
  for (int i = 0; i < 20; ++i) {
    io.restart();
    io.poll();
  }
}

// --- wire helpers (answers built by hand, as a name server would) ---------

void put16(Msg& m, std::uint16_t v) {
  m.push_back(static_cast<std::uint8_t>(v >> 8));
  m.push_back(static_cast<std::uint8_t>(v & 0xFF));
}
void put32(Msg& m, std::uint32_t v) {
  put16(m, static_cast<std::uint16_t>(v >> 16));
  put16(m, static_cast<std::uint16_t>(v & 0xFFFF));
}
void put_name(Msg& m, std::string_view dotted) {
  std::size_t i = 0;
  while (i < dotted.size()) {
    auto dot = dotted.find('.', i);
    if (dot == std::string_view::npos) dot = dotted.size();
    m.push_back(static_cast<std::uint8_t>(dot - i));
    for (std::size_t k = i; k < dot; ++k) m.push_back(static_cast<std::uint8_t>(dotted[k]));
    i = dot + 1;
  }
  m.push_back(0);
}
void put_a(Msg& m, std::string_view owner, std::array<std::uint8_t, 4> a, std::uint32_t ttl = 60) {
  put_name(m, owner);
  put16(m, qtype::A);
  put16(m, kClassIN);
  put32(m, ttl);
  put16(m, 4);
  m.insert(m.end(), a.begin(), a.end());
}
void put_aaaa(Msg& m, std::string_view owner, std::uint8_t last, std::uint32_t ttl = 60) {
  put_name(m, owner);
  put16(m, qtype::AAAA);
  put16(m, kClassIN);
  put32(m, ttl);
  put16(m, 16);
  put16(m, 0x2001);
  put16(m, 0x0db8);
  for (int i = 0; i < 11; ++i) m.push_back(0);
  m.push_back(last);
}
void put_cname(Msg& m, std::string_view owner, std::string_view target) {
  put_name(m, owner);
  put16(m, qtype::CNAME);
  put16(m, kClassIN);
  put32(m, 60);
  put16(m, static_cast<std::uint16_t>(target.size() + 2));
  put_name(m, target);
}

Msg query(std::uint16_t id, std::string_view name, std::uint16_t type = qtype::A, std::uint16_t edns = 0) {
  auto q = build_query(id, name, type);
  REQUIRE(q.ok());
  Msg m = q.value();
  if (edns != 0) {
    m[11] = 1;  // arcount
    m.push_back(0);
    put16(m, qtype::OPT);
    put16(m, edns);
    put32(m, 0);
    put16(m, 0);
  }
  return m;
}

std::uint16_t id_of(const Msg& m) { return read_header(m)->id; }
Rcode rcode_of(const Msg& m) { return read_header(m)->rcode(); }

// --- fake upstream name server --------------------------------------------

class FakeUpstream {
 public:
  explicit FakeUpstream(asio::io_context& io) : io_(io), udp_(io), acc_(io) {
    // The same port for UDP and TCP; the kernel's UDP pick may be some TCP
    // connection's ephemeral port, so retry.
    const auto lo = asio::ip::make_address("127.0.0.1");
    for (int attempt = 0;; ++attempt) {
      REQUIRE(attempt < 50);
      boost::system::error_code ec;
      udp_.open(udp::v4());
      udp_.bind(udp::endpoint(lo, 0));
      acc_.open(tcp::v4());
      acc_.set_option(tcp::acceptor::reuse_address(true));
      acc_.bind(tcp::endpoint(lo, udp_.local_endpoint().port()), ec);
      if (!ec) break;
      udp_.close();
      acc_.close();
    }
    acc_.listen();
    receive();
    accept();
  }
  std::uint16_t port() const { return udp_.local_endpoint().port(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port()); }

  // Every (name, qtype, transport) asked, in order.
  struct Seen {
    std::string name;
    std::uint16_t qtype;
    std::uint16_t id;
    bool tcp;
    Msg raw = {};               // the query as received
    std::uint16_t port = 0;     // its source port
  };
  std::vector<Seen> seen;
  bool silent = false;  // receive and record, never answer
  bool truncate_big = false;  // big.test over UDP is truncated whatever the query's EDNS size
  int copies = 1;       // each UDP answer sent this many times, back to back
  int tcp_connections = 0;
  // Answers echo the question lower-cased (as a forger who did not see the
  // query's case would).
  bool lower_question = false;
  std::uint32_t ttl = 60;  // of the A/AAAA answers of the canned zone
  // Docker's embedded resolver: names in `services` answered here (A
  // 172.18.0.5), every other name sent on unchanged (same bytes, same ID)
  // over UDP to `forward_to` (the proxy: Docker's copy comes back to it
  // through the redirect), the answer relayed back as it came.
  std::set<std::string> services;
  std::optional<udp::endpoint> forward_to;
  int forwarded = 0;

  bool saw(std::string_view name) const {
    for (const Seen& s : seen) {
      if (s.name == name) return true;
    }
    return false;
  }

 private:
  // The canned zone.
  std::optional<Msg> answer(const Msg& q, bool over_tcp, std::uint16_t port = 0) {
    ParsedQuery pq = parse_query(q);
    if (pq.status != QueryStatus::ok) return std::nullopt;
    seen.push_back({pq.question.name, pq.question.qtype, pq.header.id, over_tcp, q, port});
    if (silent) return std::nullopt;
    Msg m(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(pq.question_end));
    if (lower_question) {
      for (std::size_t i = kHeaderSize; i < m.size(); ++i) {
        if (m[i] >= 'A' && m[i] <= 'Z') m[i] = static_cast<std::uint8_t>(m[i] + 32);
      }
    }
    m[2] = 0x81;  // QR RD
    m[3] = 0x80;  // RA
    m[10] = m[11] = 0;
    std::uint16_t an = 0;
    const std::string& n = pq.question.name;
    const std::uint16_t t = pq.question.qtype;
    if (n == "www.cname.test") {
      // www.cname.test -> edge.cdn.test -> e1.cdn.test -> A; plus an
      // unrelated A that must not be learned.
      put_a(m, "other.test", {203, 0, 113, 66});
      put_cname(m, "WWW.cname.test", "edge.cdn.test");
      put_cname(m, "edge.cdn.test", "e1.cdn.test");
      put_a(m, "e1.cdn.test", {198, 51, 100, 7}, 120);
      an = 4;
    } else if (n == "nx.test" || (nxdomain_invalid && n.ends_with(".invalid"))) {
      m[3] = 0x83;  // NXDOMAIN
    } else if (n == "big.test") {
      for (std::uint8_t i = 1; i <= 40; ++i) put_a(m, "big.test", {198, 18, 0, i});
      an = 40;
      if (!over_tcp && (truncate_big || m.size() > pq.udp_size)) {
        m.resize(pq.question_end);
        m[2] |= 0x02;  // TC
        an = 0;
      }
    } else if (services.count(n) != 0) {
      put_a(m, n, {172, 18, 0, 5}, 600);
      an = 1;
    } else if (t == qtype::A) {
      put_a(m, n, {192, 0, 2, static_cast<std::uint8_t>(n.size())}, ttl);
      an = 1;
    } else if (t == qtype::AAAA) {
      put_aaaa(m, n, static_cast<std::uint8_t>(n.size()), ttl);
      an = 1;
    }
    m[6] = static_cast<std::uint8_t>(an >> 8);
    m[7] = static_cast<std::uint8_t>(an & 0xFF);
    return m;
  }

  void receive() {
    udp_.async_receive_from(asio::buffer(buf_), peer_, [this](const boost::system::error_code& ec, std::size_t n) {
      if (ec) return;
      Msg q(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(n));
      ParsedQuery pq = parse_query(q);
      if (silent_udp && pq.status == QueryStatus::ok) {
        seen.push_back({pq.question.name, pq.question.qtype, pq.header.id, false, q, peer_.port()});
      } else if (!silent && forward_to && pq.status == QueryStatus::ok && services.count(pq.question.name) == 0) {
        seen.push_back({pq.question.name, pq.question.qtype, pq.header.id, false, q, peer_.port()});
        relay(std::move(q), peer_);
      } else if (auto a = answer(q, false, peer_.port())) {
        for (int i = 0; i < copies; ++i) udp_.send_to(asio::buffer(*a), peer_);
      }
      receive();
    });
  }

  // Docker's forwarding: the query as received, from a socket of its own,
  // and the answer as received back to whoever asked.
  void relay(Msg q, udp::endpoint from) {
    ++forwarded;
    auto s = std::make_shared<udp::socket>(io_, udp::v4());
    auto buf = std::make_shared<std::array<std::uint8_t, 65536>>();
    s->send_to(asio::buffer(q), *forward_to);
    s->async_receive(asio::buffer(*buf), [this, s, buf, from](const boost::system::error_code& ec, std::size_t n) {
      if (ec) return;
      udp_.send_to(asio::buffer(buf->data(), n), from);
    });
    pending_relays_.push_back(s);
  }
  std::vector<std::shared_ptr<udp::socket>> pending_relays_;

  struct Conn {
    explicit Conn(asio::io_context& io) : sock(io) {}
    tcp::socket sock;
    std::uint8_t len[2];
    Msg body;
    std::deque<Msg> out;
  };

  void accept() {
    auto c = std::make_shared<Conn>(io_);
    acc_.async_accept(c->sock, [this, c](const boost::system::error_code& ec) {
      if (ec) return;
      ++tcp_connections;
      read(c);
      accept();
    });
  }

  void read(const std::shared_ptr<Conn>& c) {
    asio::async_read(c->sock, asio::buffer(c->len), [this, c](const boost::system::error_code& ec, std::size_t) {
      if (ec) return;
      c->body.resize(static_cast<std::size_t>((c->len[0] << 8) | c->len[1]));
      asio::async_read(c->sock, asio::buffer(c->body), [this, c](const boost::system::error_code& ec2, std::size_t) {
        if (ec2) return;
        if (tcp_forward_to) return tcp_relay(c);
        boost::system::error_code pe;
        const auto peer = c->sock.remote_endpoint(pe);
        if (auto a = answer(c->body, true, pe ? 0 : peer.port())) {
          auto framed = std::make_shared<Msg>();
          put16(*framed, static_cast<std::uint16_t>(a->size()));
          framed->insert(framed->end(), a->begin(), a->end());
          asio::async_write(c->sock, asio::buffer(*framed), [framed](const boost::system::error_code&, std::size_t) {});
        }
        read(c);
      });
    });
  }

  // Docker's forwarding of a TCP query: over TCP to `tcp_forward_to`
  // (`copies` times: more than one is a racer's copy), the first answer back.
  void tcp_relay(const std::shared_ptr<Conn>& c) {
    tcp_queries.push_back(c->body);
    if (tcp_copies == 0) {
      // Forwarded from outside the namespace (or the copy suppressed): the
      // proxy sees nothing, egressd gets an answer all the same.
      if (auto a = answer(c->body, true)) {
        auto framed = std::make_shared<Msg>();
        put16(*framed, static_cast<std::uint16_t>(a->size()));
        framed->insert(framed->end(), a->begin(), a->end());
        asio::async_write(c->sock, asio::buffer(*framed), [framed](const boost::system::error_code&, std::size_t) {});
      }
      return;
    }
    for (int i = 0; i < tcp_copies; ++i) {
      ++forwarded;
      auto out = std::make_shared<tcp::socket>(io_);
      out->connect(*tcp_forward_to);
      auto framed = std::make_shared<Msg>();
      put16(*framed, static_cast<std::uint16_t>(c->body.size()));
      framed->insert(framed->end(), c->body.begin(), c->body.end());
      asio::write(*out, asio::buffer(*framed));
      auto len = std::make_shared<std::array<std::uint8_t, 2>>();
      asio::async_read(*out, asio::buffer(*len), [this, out, len, c, i](const boost::system::error_code& ec, std::size_t) {
        if (ec) return;
        ++tcp_copies_answered;
        auto body = std::make_shared<Msg>(static_cast<std::size_t>(((*len)[0] << 8) | (*len)[1]));
        asio::async_read(*out, asio::buffer(*body), [out, len, body, c, i](const boost::system::error_code& e2, std::size_t) {
          if (e2 || i != 0) return;
          auto framed2 = std::make_shared<Msg>();
          put16(*framed2, static_cast<std::uint16_t>(body->size()));
          framed2->insert(framed2->end(), body->begin(), body->end());
          asio::async_write(c->sock, asio::buffer(*framed2), [framed2](const boost::system::error_code&, std::size_t) {});
        });
      });
    }
  }

 public:
  std::optional<tcp::endpoint> tcp_forward_to;
  int tcp_copies = 1;          // 0: answered here, no copy reaches the proxy
  int tcp_copies_answered = 0; // copies the proxy accepted and answered
  std::vector<Msg> tcp_queries;  // every TCP query to forward (egressd's probes), as a sniffer sees them
  bool silent_udp = false;     // UDP queries recorded, never answered nor forwarded
  bool nxdomain_invalid = false;  // names under .invalid: NXDOMAIN, as a real upstream answers

 private:
  asio::io_context& io_;
  udp::socket udp_;
  tcp::acceptor acc_;
  std::array<std::uint8_t, 65536> buf_{};
  udp::endpoint peer_;
};

// --- fake hooks -----------------------------------------------------------

class FakeHooks : public PolicyHooks {
 public:
  std::set<std::string> allowed;  // names forwarded; "nx-*" names get NXDOMAIN, the rest REFUSED
  bool defer_learn = false;       // hold learn's done until release_learn()
  Status learn_status;
  std::vector<std::vector<Learned>> learned;
  std::vector<std::pair<std::string, std::uint16_t>> refused_names;
  std::vector<std::function<void(Status)>> held;
  std::vector<std::string> events;  // "learn", "learn-done", in order

  Action decide(const std::string& qname) override {
    if (allowed.count(qname) != 0) return Action::forward;
    if (qname.starts_with("nx-")) return Action::nxdomain;
    return Action::refuse;
  }
  void learn(std::vector<Learned> addrs, std::function<void(Status)> done) override {
    learned.push_back(std::move(addrs));
    events.push_back("learn");
    if (defer_learn) {
      held.push_back(std::move(done));
    } else {
      done(learn_status);
    }
  }
  void refused(const std::string& qname, std::uint16_t qtype) override { refused_names.emplace_back(qname, qtype); }
  std::vector<std::pair<std::vector<IpPrefix>, std::string>> relay_calls;
  void relay_targets(const std::vector<IpPrefix>& targets, const std::string& source,
                     std::function<void(Status)> done) override {
    relay_calls.emplace_back(targets, source);
    done({});
  }
  void release_learn() {
    auto h = std::move(held);
    held.clear();
    for (auto& d : h) {
      events.push_back("learn-done");
      d(learn_status);
    }
  }
};

// --- clients --------------------------------------------------------------

class UdpClient {
 public:
  UdpClient(asio::io_context& io, std::uint16_t port, const char* addr = "127.0.0.1")
      : sock_(io), to_(asio::ip::make_address(addr), port) {
    sock_.open(to_.protocol());
    receive();
  }
  void send(const Msg& m) { sock_.send_to(asio::buffer(m), to_); }
  std::vector<Msg> got;
  std::function<void(const Msg&)> on_receive;

 private:
  void receive() {
    sock_.async_receive(asio::buffer(buf_), [this](const boost::system::error_code& ec, std::size_t n) {
      if (ec) return;
      got.emplace_back(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(n));
      if (on_receive) on_receive(got.back());
      receive();
    });
  }
  udp::socket sock_;
  udp::endpoint to_;
  std::array<std::uint8_t, 65536> buf_{};
};

class TcpClient {
 public:
  TcpClient(asio::io_context& io, std::uint16_t port) : sock_(io) {
    sock_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    read();
  }
  void send(const Msg& m) {
    Msg framed;
    put16(framed, static_cast<std::uint16_t>(m.size()));
    framed.insert(framed.end(), m.begin(), m.end());
    asio::write(sock_, asio::buffer(framed));
  }
  void send_raw(const Msg& m) { asio::write(sock_, asio::buffer(m)); }
  void shutdown_send() { sock_.shutdown(tcp::socket::shutdown_send); }
  // Closes the connection; the client must outlive the aborted read's
  // handler (it runs on the next turn of the loop), so close, not destroy.
  void close() {
    boost::system::error_code ec;
    sock_.close(ec);
  }
  std::vector<Msg> got;
  bool eof = false;

 private:
  void read() {
    asio::async_read(sock_, asio::buffer(len_), [this](const boost::system::error_code& ec, std::size_t) {
      if (ec) {
        eof = true;
        return;
      }
      body_.resize(static_cast<std::size_t>((len_[0] << 8) | len_[1]));
      asio::async_read(sock_, asio::buffer(body_), [this](const boost::system::error_code& ec2, std::size_t) {
        if (ec2) {
          eof = true;
          return;
        }
        got.push_back(body_);
        read();
      });
    });
  }
  tcp::socket sock_;
  std::uint8_t len_[2];
  Msg body_;
};

struct Fixture {
  asio::io_context io;
  FakeUpstream upstream{io};
  FakeHooks hooks;
  // Before the proxy: it forgets its last flows when it closes.
  std::vector<FlowTuple> forgotten;  // flows the proxy said it was done with
  int ports_free_when_forgotten = 0;  // a flow's port was someone else's to take while forgotten
  std::vector<int> tcp_seen_when_forgotten;  // by forgotten[i]: TCP queries the upstream had read by then
  std::unique_ptr<Proxy> proxy;

  void start(ProxyOptions opts = {}) {
    if (opts.upstream.empty()) opts.upstream = {upstream.address()};
    opts.forget_flow = [this](std::span<const FlowTuple> flows) {
      for (const FlowTuple& t : flows) {
        forgotten.push_back(t);
        tcp_seen_when_forgotten.push_back(static_cast<int>(
            std::count_if(upstream.seen.begin(), upstream.seen.end(), [](const auto& s) { return s.tcp; })));
        // The port is still the flow's while it is forgotten (released after).
        const int s = ::socket(t.src.family == 4 ? AF_INET : AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        sockaddr_storage ss{};
        socklen_t len = 0;
        if (t.src.family == 4) {
          auto& a = reinterpret_cast<sockaddr_in&>(ss);
          a.sin_family = AF_INET;
          a.sin_port = htons(t.sport);
          std::memcpy(&a.sin_addr, t.src.bytes.data(), 4);
          len = sizeof a;
        } else {
          auto& a = reinterpret_cast<sockaddr_in6&>(ss);
          a.sin6_family = AF_INET6;
          a.sin6_port = htons(t.sport);
          std::memcpy(&a.sin6_addr, t.src.bytes.data(), 16);
          len = sizeof a;
        }
        if (::bind(s, reinterpret_cast<const sockaddr*>(&ss), len) == 0 || errno != EADDRINUSE) ++ports_free_when_forgotten;
        ::close(s);
      }
    };
    // Root here: exercises SO_MARK for real (EPERM elsewhere is logged, not fatal).
    opts.own_mark = 0x2a;
    // Nothing of this test may bind addresses on port 53.
    opts.own_local_upstreams = false;
    auto p = Proxy::start(io, opts, hooks);
    REQUIRE_MESSAGE(p.ok(), (p.ok() ? "" : p.error().message));
    proxy = std::move(p.value());
    REQUIRE(proxy->port() != 0);
  }
};

std::string learned_text(const std::vector<Learned>& v) {
  std::string out;
  for (const Learned& l : v) out += (out.empty() ? "" : " ") + l.qname + "=" + l.addr.to_string() + "/" + std::to_string(l.ttl);
  return out;
}

}  // namespace

TEST_CASE("an allowed name is forwarded and answered with the client's ID") {
  Fixture f;
  f.hooks.allowed = {"pypi.org"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(0x1234, "PyPI.org"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  const Msg& a = c.got[0];
  CHECK(id_of(a) == 0x1234);
  CHECK(rcode_of(a) == Rcode::noerror);
  auto parsed = parse_answer(a, "pypi.org");
  REQUIRE(parsed.ok());
  REQUIRE(parsed->addresses.size() == 1);
  CHECK(parsed->addresses[0].addr.to_string() == "192.0.2.8");
  // The client's own question case comes back.
  CHECK(std::equal(a.begin() + 12, a.begin() + 12 + 10, query(0x1234, "PyPI.org").begin() + 12));
  REQUIRE(f.upstream.seen.size() == 1);
  CHECK(f.upstream.seen[0].name == "pypi.org");
  REQUIRE(f.hooks.learned.size() == 1);
  CHECK(learned_text(f.hooks.learned[0]) == "pypi.org=192.0.2.8/60");
  CHECK(f.proxy->counters().forwarded == 1);
}

TEST_CASE("the upstream sees random IDs, not the sandbox's") {
  Fixture f;
  f.hooks.allowed = {"a.test", "b.test", "c.test", "d.test"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  for (const char* n : {"a.test", "b.test", "c.test", "d.test"}) c.send(query(0x0001, n));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 4; }));
  int same = 0;
  for (const auto& s : f.upstream.seen) same += s.id == 0x0001 ? 1 : 0;
  CHECK(same < 4);
  for (const Msg& m : c.got) CHECK(id_of(m) == 0x0001);
}

TEST_CASE("a refused name is answered locally and never reaches the upstream") {
  Fixture f;
  f.hooks.allowed = {"pypi.org"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(0x0BAD, "secret-data.attacker.example", qtype::TXT));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 1; }));
  CHECK(id_of(c.got[0]) == 0x0BAD);
  CHECK(rcode_of(c.got[0]) == Rcode::refused);
  auto back = parse_answer(c.got[0], "secret-data.attacker.example");
  REQUIRE(back.ok());  // the question is echoed
  CHECK(back->question.qtype == qtype::TXT);

  c.send(query(0x0BAE, "nx-hidden.example"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 2; }));
  CHECK(rcode_of(c.got[1]) == Rcode::nxdomain);

  // An allowed query afterwards, answered: the upstream has seen everything
  // the proxy ever sent it by now.
  c.send(query(3, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 3; }));
  REQUIRE(f.upstream.seen.size() == 1);
  CHECK(f.upstream.seen[0].name == "pypi.org");
  REQUIRE(f.hooks.refused_names.size() == 2);
  CHECK(f.hooks.refused_names[0] == std::pair<std::string, std::uint16_t>{"secret-data.attacker.example", qtype::TXT});
  CHECK(f.hooks.refused_names[1].first == "nx-hidden.example");
  CHECK(f.proxy->counters().refused == 2);
  CHECK(f.proxy->counters().forwarded == 1);
}

TEST_CASE("the answer is released only after learn completes") {
  Fixture f;
  f.hooks.allowed = {"pypi.org"};
  f.hooks.defer_learn = true;
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.on_receive = [&](const Msg&) { f.hooks.events.push_back("client-answer"); };
  c.send(query(0x77, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return f.hooks.held.size() == 1; }));
  // Give any datagram already sent every chance to be delivered.
  drain(f.io);
  CHECK(c.got.empty());
  REQUIRE(f.hooks.learned.size() == 1);
  CHECK(learned_text(f.hooks.learned[0]) == "pypi.org=192.0.2.8/60");

  // Complete the kernel update later, from the event loop.
  asio::steady_timer later(f.io, 20ms);
  later.async_wait([&](const boost::system::error_code&) { f.hooks.release_learn(); });
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  CHECK(id_of(c.got[0]) == 0x77);
  CHECK(f.hooks.events == std::vector<std::string>{"learn", "learn-done", "client-answer"});
}

TEST_CASE("a failed learn gives SERVFAIL, not an answer the kernel cannot honour") {
  Fixture f;
  f.hooks.allowed = {"pypi.org"};
  f.hooks.learn_status = Error::runtime("netlink: ENOBUFS");
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(0x78, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  CHECK(rcode_of(c.got[0]) == Rcode::servfail);
  CHECK(id_of(c.got[0]) == 0x78);
  CHECK(f.proxy->counters().failed == 1);
}

TEST_CASE("CNAME chain: only the addresses at the end of the chain are learned, under the query name") {
  Fixture f;
  f.hooks.allowed = {"www.cname.test"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(9, "www.cname.test"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  REQUIRE(f.hooks.learned.size() == 1);
  CHECK(learned_text(f.hooks.learned[0]) == "www.cname.test=198.51.100.7/120");
  // The client gets the whole answer, unrelated record included.
  auto parsed = parse_answer(c.got[0], "www.cname.test");
  REQUIRE(parsed.ok());
  CHECK(parsed->header.ancount == 4);
}

TEST_CASE("answers without addresses are released without calling learn") {
  Fixture f;
  f.hooks.allowed = {"nx.test", "txt.test"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(1, "nx.test"));
  c.send(query(2, "txt.test", qtype::TXT));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 2; }));
  for (const Msg& m : c.got) CHECK(rcode_of(m) == (id_of(m) == 1 ? Rcode::nxdomain : Rcode::noerror));
  CHECK(f.hooks.learned.empty());
}

TEST_CASE("TCP: two queries on one connection") {
  Fixture f;
  f.hooks.allowed = {"a.test"};
  f.start();
  TcpClient c(f.io, f.proxy->port());
  c.send(query(0x0A, "a.test"));
  c.send(query(0x0B, "a.test", qtype::AAAA));
  c.send(query(0x0C, "blocked.test"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 3; }));
  std::map<std::uint16_t, Rcode> by_id;
  for (const Msg& m : c.got) by_id[id_of(m)] = rcode_of(m);
  CHECK(by_id == std::map<std::uint16_t, Rcode>{{0x0A, Rcode::noerror}, {0x0B, Rcode::noerror}, {0x0C, Rcode::refused}});
  REQUIRE(f.hooks.learned.size() == 2);
  CHECK(learned_text(f.hooks.learned[0]) + " " + learned_text(f.hooks.learned[1]) ==
        "a.test=192.0.2.6/60 a.test=2001:db8::6/60");
}

TEST_CASE("TCP: a query split across writes, and a short frame, are handled") {
  Fixture f;
  f.hooks.allowed = {"a.test"};
  f.start();
  TcpClient c(f.io, f.proxy->port());
  c.send(Msg{1, 2, 3});  // shorter than a header: dropped, connection kept
  Msg framed;
  const Msg q = query(0x0D, "a.test");
  put16(framed, static_cast<std::uint16_t>(q.size()));
  framed.insert(framed.end(), q.begin(), q.end());
  c.send_raw(Msg(framed.begin(), framed.begin() + 5));
  drain(f.io);
  c.send_raw(Msg(framed.begin() + 5, framed.end()));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 1; }));
  CHECK(id_of(c.got[0]) == 0x0D);
  CHECK(f.proxy->counters().malformed == 1);
}

TEST_CASE("TCP: a client that half-closes after sending still gets its answers") {
  Fixture f;
  f.hooks.allowed = {"a.test"};
  f.hooks.defer_learn = true;  // keep the first answer pending past the half-close
  f.start();
  TcpClient c(f.io, f.proxy->port());
  c.send(query(0x21, "a.test"));
  c.send(query(0x22, "blocked.test"));
  c.shutdown_send();
  REQUIRE(run_until(f.io, [&] { return f.hooks.held.size() == 1; }));
  f.hooks.release_learn();
  REQUIRE(run_until(f.io, [&] { return c.eof; }));
  REQUIRE(c.got.size() == 2);
  CHECK(id_of(c.got[0]) == 0x22);  // the local answer first: answers go out as they are ready
  CHECK(id_of(c.got[1]) == 0x21);
}

TEST_CASE("TCP: idle connections are closed") {
  Fixture f;
  ProxyOptions o;
  o.tcp_idle = 1s;
  f.start(o);
  TcpClient c(f.io, f.proxy->port());
  const auto t0 = Clock::now();
  REQUIRE(run_until(f.io, [&] { return c.eof; }, 4000ms));
  CHECK(Clock::now() - t0 >= 900ms);
}

TEST_CASE("TCP: connections beyond the limit are closed at once") {
  Fixture f;
  f.hooks.allowed = {"a.test"};
  ProxyOptions o;
  o.max_tcp_connections = 2;
  f.start(o);
  TcpClient c1(f.io, f.proxy->port());
  TcpClient c2(f.io, f.proxy->port());
  // The first two are served.
  c1.send(query(1, "a.test"));
  c2.send(query(2, "a.test"));
  REQUIRE(run_until(f.io, [&] { return c1.got.size() == 1 && c2.got.size() == 1; }));
  TcpClient c3(f.io, f.proxy->port());
  REQUIRE(run_until(f.io, [&] { return c3.eof; }));
  CHECK(c3.got.empty());
}

TEST_CASE("TCP: a connection beyond the sandbox's descriptor share is closed at once, and counted") {
  Fixture f;
  f.hooks.allowed = {"a.test"};
  auto budget = FdBudget::create(3, FdSizing{0, 0, 1});
  auto account = budget->open("A");
  ProxyOptions o;
  o.fd_account = account;
  f.start(o);
  // Two connections and the upstream socket of their queries: the share of 3.
  TcpClient c1(f.io, f.proxy->port());
  TcpClient c2(f.io, f.proxy->port());
  c1.send(query(1, "a.test"));
  REQUIRE(run_until(f.io, [&] { return c1.got.size() == 1; }));
  c2.send(query(2, "a.test"));
  REQUIRE(run_until(f.io, [&] { return c2.got.size() == 1; }));
  CHECK(account->held() == 3);  // the upstream socket is pooled
  TcpClient c3(f.io, f.proxy->port());
  REQUIRE(run_until(f.io, [&] { return c3.eof; }));
  CHECK(c3.got.empty());
  CHECK(f.proxy->counters().fd_denied == 1);
  // A connection closed gives its descriptor back.
  f.proxy->close();
  drain(f.io);
  CHECK(account->held() == 0);
}

TEST_CASE("a dead upstream gives SERVFAIL within 2 s") {
  SUBCASE("silent (packets vanish)") {
    Fixture f;
    f.upstream.silent = true;
    f.hooks.allowed = {"pypi.org"};
    f.start();
    UdpClient c(f.io, f.proxy->port());
    const auto t0 = Clock::now();
    c.send(query(0x51, "pypi.org"));
    REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }, 3000ms));
    const auto took = Clock::now() - t0;
    MESSAGE("SERVFAIL after " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
    CHECK(took < 2000ms);
    CHECK(id_of(c.got[0]) == 0x51);
    CHECK(rcode_of(c.got[0]) == Rcode::servfail);
    CHECK(f.upstream.seen.size() >= 1);  // it was asked (and retried)
    CHECK(f.proxy->counters().failed == 1);
  }
  SUBCASE("closed port (ICMP unreachable)") {
    Fixture f;
    f.hooks.allowed = {"pypi.org"};
    // A port nothing listens on: bind one, note it, close it.
    std::uint16_t dead = 0;
    {
      udp::socket s(f.io, udp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
      dead = s.local_endpoint().port();
    }
    ProxyOptions o;
    o.upstream = {"127.0.0.1:" + std::to_string(dead)};
    f.start(o);
    UdpClient c(f.io, f.proxy->port());
    const auto t0 = Clock::now();
    c.send(query(0x52, "pypi.org"));
    REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }, 3000ms));
    CHECK(Clock::now() - t0 < 2000ms);
    CHECK(rcode_of(c.got[0]) == Rcode::servfail);
  }
}

TEST_CASE("a query whose name the phase stopped forwarding is not sent again: SERVFAIL at its next try") {
  // A switch lands between two tries of a query (attack review 10: the next round half a
  // second after a switch to no-network carried the name to the upstream again).
  Fixture f;
  f.upstream.silent = true;
  f.hooks.allowed = {"pypi.org"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(0x53, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return f.upstream.seen.size() == 1; }, 2000ms));
  f.hooks.allowed.clear();  // the phase in force refuses it now
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }, 3000ms));
  CHECK(rcode_of(c.got[0]) == Rcode::servfail);
  CHECK(f.upstream.seen.size() == 1);
  CHECK(f.proxy->counters().failed == 1);
  // Still forwarded: the schedule goes on (the control, in "a dead upstream ..." above).
}

TEST_CASE("malformed packets get FORMERR or are dropped, and the proxy keeps serving") {
  Fixture f;
  f.hooks.allowed = {"pypi.org"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(Msg{0xde, 0xad, 0xbe});  // shorter than a header: dropped
  Msg two = query(0x61, "pypi.org");
  two[5] = 2;  // qdcount 2
  c.send(two);
  Msg garbage_question = query(0x62, "pypi.org");
  garbage_question[12] = 0xC0;  // pointer into the header... then junk
  garbage_question[13] = 0xFF;
  c.send(garbage_question);
  Msg reply_bit = query(0x63, "pypi.org");
  reply_bit[2] |= 0x80;  // a response: never answered
  c.send(reply_bit);
  c.send(query(0x64, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 2; }));
  drain(f.io);
  REQUIRE(c.got.size() == 2);
  CHECK(id_of(c.got[0]) == 0x61);
  CHECK(rcode_of(c.got[0]) == Rcode::formerr);
  CHECK(id_of(c.got[1]) == 0x64);
  CHECK(rcode_of(c.got[1]) == Rcode::noerror);
  CHECK(f.proxy->counters().malformed == 4);
  CHECK(f.upstream.seen.size() == 1);
}

TEST_CASE("queries that arrive together from many clients are each answered to their own client") {
  // More than one recvmmsg batch waits before the loop runs; the replies of a
  // turn leave in sendmmsg batches, each to the address it came from.
  Fixture f;
  f.hooks.allowed = {"pypi.org"};
  f.start();
  std::vector<std::unique_ptr<UdpClient>> clients;
  for (int i = 0; i < 40; ++i) clients.push_back(std::make_unique<UdpClient>(f.io, f.proxy->port()));
  for (int i = 0; i < 40; ++i) {
    const auto id = static_cast<std::uint16_t>(0x100 + i);
    clients[static_cast<std::size_t>(i)]->send(i % 2 == 0 ? query(id, "pypi.org") : query(id, "refused.example"));
  }
  // A datagram one byte over the largest query, in the middle of the batch:
  // dropped, the others answered.
  UdpClient big(f.io, f.proxy->port());
  Msg oversized = query(0x0B16, "pypi.org");
  oversized.resize(kMaxUdpSize + 1, 0);
  big.send(oversized);
  REQUIRE(run_until(f.io, [&] {
    return std::all_of(clients.begin(), clients.end(), [](const auto& c) { return !c->got.empty(); });
  }));
  drain(f.io);
  for (int i = 0; i < 40; ++i) {
    const auto& got = clients[static_cast<std::size_t>(i)]->got;
    REQUIRE(got.size() == 1);
    CHECK(id_of(got[0]) == 0x100 + i);
    CHECK(rcode_of(got[0]) == (i % 2 == 0 ? Rcode::noerror : Rcode::refused));
  }
  CHECK(big.got.empty());
  CHECK(f.proxy->counters().malformed == 1);
  CHECK(f.proxy->counters().forwarded == 20);
  CHECK(f.proxy->counters().refused == 20);
}

TEST_CASE("with a loopback upstream, the same name asked twice at once is answered twice, whatever case egressd drew") {
  // With a local upstream the proxy takes a query whose question bytes are
  // those of one of its own in flight for Docker relaying it. Its case is
  // random: for "x.9" (one letter) the draw matches the client's lower case
  // half the time, and the second client got SERVFAIL (no relay target). The
  // forwarded case now always differs from the client's.
  Fixture f;
  f.hooks.allowed = {"x.9"};
  f.start();
  for (int round = 0; round < 24; ++round) {
    UdpClient a(f.io, f.proxy->port()), b(f.io, f.proxy->port());
    const auto id = static_cast<std::uint16_t>(0x200 + round);
    a.send(query(id, "x.9"));
    b.send(query(id, "x.9"));
    REQUIRE(run_until(f.io, [&] { return !a.got.empty() && !b.got.empty(); }));
    CHECK(rcode_of(a.got[0]) == Rcode::noerror);
    CHECK(rcode_of(b.got[0]) == Rcode::noerror);
  }
  CHECK(f.proxy->counters().failed == 0);
  CHECK(f.proxy->counters().relayed == 0);
}

TEST_CASE("beyond max_inflight, new queries get SERVFAIL at once") {
  Fixture f;
  f.upstream.silent = true;
  f.hooks.allowed = {"a.test", "b.test", "c.test"};
  ProxyOptions o;
  o.max_inflight = 2;
  f.start(o);
  UdpClient c(f.io, f.proxy->port());
  c.send(query(1, "a.test"));
  c.send(query(2, "b.test"));
  REQUIRE(run_until(f.io, [&] { return f.upstream.seen.size() >= 2; }));
  const auto t0 = Clock::now();
  c.send(query(3, "c.test"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  CHECK(Clock::now() - t0 < 500ms);  // not the upstream timeout
  CHECK(id_of(c.got[0]) == 3);
  CHECK(rcode_of(c.got[0]) == Rcode::servfail);
  CHECK_FALSE(f.upstream.saw("c.test"));
  // The first two fail by timeout and free their slots.
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 3; }, 3000ms));
  f.upstream.silent = false;
  c.send(query(4, "c.test"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 4; }));
  CHECK(rcode_of(c.got[3]) == Rcode::noerror);
}

// Descriptors this process holds now.
std::size_t open_fds() {
  std::size_t n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    ++n;
  }
  return n;
}

TEST_CASE("a burst's upstream sockets are closed once they have been idle") {
  // Attack review: 256 pooled sockets per family stayed after a burst, for
  // good; an agent's sandboxes then had no descriptors left.
  Fixture f;
  for (int i = 0; i < 64; ++i) f.hooks.allowed.insert("b" + std::to_string(i) + ".test");
  ProxyOptions o;
  o.upstream_pool_idle = 100ms;
  f.start(o);
  UdpClient c(f.io, f.proxy->port());
  const std::size_t before = open_fds();
  f.upstream.silent = true;  // all 64 in flight at once, each on a socket of its own
  for (int i = 0; i < 64; ++i) c.send(query(static_cast<std::uint16_t>(i), "b" + std::to_string(i) + ".test"));
  REQUIRE(run_until(f.io, [&] { return f.upstream.seen.size() == 64; }));
  CHECK(f.proxy->counters().upstream_sockets == 64);
  CHECK(open_fds() >= before + 64);
  SUBCASE("answered: pooled, then closed") {
    // Answered late (the second try, each query's own new socket) ...
    f.upstream.silent = false;
    REQUIRE(run_until(f.io, [&] { return c.got.size() == 64; }, 5000ms));
    for (const Msg& m : c.got) CHECK(rcode_of(m) == Rcode::noerror);
  }
  SUBCASE("unanswered: closed when they time out") {
    REQUIRE(run_until(f.io, [&] { return c.got.size() == 64; }, 5000ms));
  }
  // ... and every socket is closed a tick or two after its last use.
  CHECK(run_until(f.io, [&] { return f.proxy->counters().upstream_sockets == 0; }, 2000ms));
  CHECK(open_fds() <= before);
  // The proxy still answers, from a new socket.
  f.upstream.silent = false;
  c.send(query(100, "b1.test"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 65; }));
  CHECK(rcode_of(c.got.back()) == Rcode::noerror);
}

TEST_CASE("a sandbox at its descriptor share gets SERVFAIL at once; the others keep theirs") {
  // Two sandboxes' proxies sharing one budget: a pool of 8, a share of 4 each.
  asio::io_context io;
  FakeUpstream upstream{io};
  auto budget = FdBudget::create(8, FdSizing{0, 0, 1});
  struct One {
    FakeHooks hooks;
    std::unique_ptr<Proxy> proxy;
    std::shared_ptr<FdAccount> account;
  };
  One a, b;
  for (One* s : {&a, &b}) {
    for (int i = 0; i < 8; ++i) s->hooks.allowed.insert("n" + std::to_string(i) + ".test");
    s->account = budget->open(s == &a ? "A" : "B");
    ProxyOptions o;
    o.upstream = {upstream.address()};
    o.own_local_upstreams = false;
    o.fd_account = s->account;
    auto p = Proxy::start(io, o, s->hooks);
    REQUIRE(p.ok());
    s->proxy = std::move(p.value());
  }
  CHECK(budget->share() == 4);
  upstream.silent = true;
  UdpClient ca(io, a.proxy->port());
  for (int i = 0; i < 6; ++i) ca.send(query(static_cast<std::uint16_t>(i), "n" + std::to_string(i) + ".test"));
  // Four go upstream; two are refused a socket and answered SERVFAIL at once.
  REQUIRE(run_until(io, [&] { return ca.got.size() == 2 && upstream.seen.size() == 4; }, 1000ms));
  for (const Msg& m : ca.got) CHECK(rcode_of(m) == Rcode::servfail);
  CHECK(a.account->held() == 4);
  CHECK(a.proxy->counters().fd_denied == 2);
  CHECK(a.proxy->counters().upstream_sockets == 4);
  // B still gets its share: answered while A's four wait.
  upstream.silent = false;
  UdpClient cb(io, b.proxy->port());
  cb.send(query(7, "n7.test"));
  REQUIRE(run_until(io, [&] { return !cb.got.empty(); }));
  CHECK(rcode_of(cb.got[0]) == Rcode::noerror);
  CHECK(b.proxy->counters().fd_denied == 0);
  CHECK(budget->used() <= 8);
  // A's queries end; its sockets come back, and so does its service.
  REQUIRE(run_until(io, [&] { return ca.got.size() == 6; }, 5000ms));
  ca.send(query(9, "n0.test"));
  REQUIRE(run_until(io, [&] { return ca.got.size() == 7; }));
  CHECK(rcode_of(ca.got.back()) == Rcode::noerror);
  a.proxy->close();
  b.proxy->close();
  drain(io);
}

TEST_CASE("an answer too big for the client's UDP size is truncated; TCP gets it whole") {
  Fixture f;
  f.hooks.allowed = {"big.test"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(0x71, "big.test"));  // no EDNS: 512 bytes
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 1; }));
  auto h = read_header(c.got[0]);
  CHECK(h->id == 0x71);
  CHECK(h->tc());
  CHECK(h->ancount == 0);
  CHECK(c.got[0].size() <= 512);
  // The upstream truncated too, so c-ares retried over TCP; the proxy
  // learned the full answer anyway.
  REQUIRE(f.hooks.learned.size() == 1);
  CHECK(f.hooks.learned[0].size() == 40);

  c.send(query(0x72, "big.test", qtype::A, 4096));  // EDNS 4096: fits
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 2; }));
  CHECK_FALSE(read_header(c.got[1])->tc());
  CHECK(read_header(c.got[1])->ancount == 40);

  TcpClient t(f.io, f.proxy->port());
  t.send(query(0x73, "big.test"));
  REQUIRE(run_until(f.io, [&] { return t.got.size() == 1; }));
  CHECK(read_header(t.got[0])->ancount == 40);
}

TEST_CASE("a TCP try's own flow is handed over to be forgotten before it connects, from the port it then uses") {
  // A sandbox's stale SYN_SENT entry on that flow would take egressd's SYN
  // to the proxy (docs/security.md, the TCP twin).
  Fixture f;
  f.hooks.allowed = {"big.test"};
  f.upstream.truncate_big = true;
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(0x71, "big.test"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 1; }));
  std::vector<std::uint16_t> tcp_ports;
  for (const auto& s : f.upstream.seen) {
    if (s.tcp) tcp_ports.push_back(s.port);
  }
  REQUIRE(tcp_ports.size() == 1);
  int tcp_forgotten = 0;
  for (std::size_t i = 0; i < f.forgotten.size(); ++i) {
    const FlowTuple& t = f.forgotten[i];
    if (t.proto != IPPROTO_TCP) continue;
    ++tcp_forgotten;
    CHECK(t.sport == tcp_ports[0]);
    CHECK(t.src.to_string() == "127.0.0.1");
    CHECK(t.dst.to_string() == "127.0.0.1");
    CHECK(t.dport == f.upstream.port());
    CHECK(f.tcp_seen_when_forgotten[i] == 0);  // before the connect
  }
  CHECK(tcp_forgotten == 1);
}

TEST_CASE("IPv6 loopback is served too") {
  Fixture f;
  f.hooks.allowed = {"a.test"};
  f.start();
  boost::system::error_code ec;
  udp::socket probe(f.io);
  probe.open(udp::v6(), ec);
  if (!ec) probe.bind(udp::endpoint(asio::ip::make_address("::1"), 0), ec);
  if (ec) {
    MESSAGE("SKIP: no ::1 here");
    return;
  }
  UdpClient c(f.io, f.proxy->port(), "::1");
  c.send(query(0x66, "a.test"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  CHECK(id_of(c.got[0]) == 0x66);
}

TEST_CASE("resolve() pre-resolves A and AAAA") {
  Fixture f;
  f.start();
  std::optional<Result<std::vector<Learned>>> got;
  f.proxy->resolve("Pypi.Org.", [&](Result<std::vector<Learned>> r) { got = std::move(r); });
  REQUIRE(run_until(f.io, [&] { return got.has_value(); }));
  REQUIRE(got->ok());
  CHECK(learned_text(got->value()) == "pypi.org=192.0.2.8/60 pypi.org=2001:db8::8/60");
  // Pre-resolution is not a query of the sandbox: no hooks.
  CHECK(f.hooks.learned.empty());

  got.reset();
  f.proxy->resolve("nx.test", [&](Result<std::vector<Learned>> r) { got = std::move(r); });
  REQUIRE(run_until(f.io, [&] { return got.has_value(); }));
  REQUIRE_FALSE(got->ok());
  CHECK(got->error().message.find("NXDOMAIN") != std::string::npos);

  got.reset();
  f.proxy->resolve("bad..name", [&](Result<std::vector<Learned>> r) { got = std::move(r); });
  REQUIRE(got.has_value());
  CHECK_FALSE(got->ok());
}

TEST_CASE("close() stops serving and abandons pending queries without calling hooks") {
  Fixture f;
  f.upstream.silent = true;
  f.hooks.allowed = {"a.test"};
  f.start();
  const std::uint16_t port = f.proxy->port();
  UdpClient c(f.io, port);
  c.send(query(1, "a.test"));
  REQUIRE(run_until(f.io, [&] { return f.upstream.seen.size() == 1; }));
  f.proxy->close();
  f.upstream.silent = false;
  drain(f.io);
  CHECK(c.got.empty());
  CHECK(f.hooks.learned.empty());
  // The port is free again.
  udp::socket s(f.io);
  s.open(udp::v4());
  boost::system::error_code ec;
  s.bind(udp::endpoint(asio::ip::make_address("127.0.0.1"), port), ec);
  CHECK_FALSE(ec);
  f.proxy.reset();
  drain(f.io);
}

TEST_CASE("start fails naming the address when the port is taken") {
  Fixture f;
  f.start();
  FakeHooks other;
  ProxyOptions o;
  o.port = f.proxy->port();
  o.upstream = {f.upstream.address()};
  auto p = Proxy::start(f.io, o, other);
  REQUIRE_FALSE(p.ok());
  CHECK(p.error().message.find("127.0.0.1:" + std::to_string(o.port)) != std::string::npos);
}

TEST_CASE("the proxy refuses itself as upstream") {
  asio::io_context io;
  FakeHooks h;
  // A free port: the kernel's pick for UDP may be taken for TCP (another
  // connection's ephemeral port), so try a few.
  std::string message;
  for (int attempt = 0; attempt < 20; ++attempt) {
    udp::socket probe(io, udp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    const std::uint16_t port = probe.local_endpoint().port();
    probe.close();
    ProxyOptions o;
    o.port = port;
    o.upstream = {"127.0.0.1:" + std::to_string(port)};
    auto p = Proxy::start(io, o, h);
    REQUIRE_FALSE(p.ok());
    message = p.error().message;
    if (message.find("bind") == std::string::npos) break;
  }
  CHECK(message.find("the proxy itself") != std::string::npos);
}

TEST_CASE("bad upstream configuration is rejected") {
  asio::io_context io;
  FakeHooks h;
  for (const char* bad : {"resolv.conf", "dns.google", "192.0.2.1:0", "[192.0.2.1]:53", "192.0.2.1:99999", ""}) {
    ProxyOptions o;
    o.upstream = {bad};
    auto p = Proxy::start(io, o, h);
    INFO(bad);
    CHECK_FALSE(p.ok());
  }
  ProxyOptions none;
  CHECK_FALSE(Proxy::start(io, none, h).ok());
}

TEST_CASE("nameservers_from_resolv_conf") {
  const std::string text =
      "# generated\n"
      "search example.org\n"
      "nameserver 127.0.0.11\n"
      "nameserver\t2001:DB8::53 # comment\n"
      "options ndots:0\n"
      "nameserver fe80::1%eth0\n"
      "nameserver dns.example\n"
      "nameserver 127.0.0.11\n"
      ";nameserver 192.0.2.9\n"
      "nameserver 192.0.2.53\n"
      "nameserver 192.0.2.54\n";
  CHECK(nameservers_from_resolv_conf(text) == std::vector<std::string>{"127.0.0.11", "2001:db8::53", "192.0.2.53"});
  CHECK(nameservers_from_resolv_conf("").empty());
  CHECK(nameservers_from_resolv_conf("nameserver 10.0.0.1") == std::vector<std::string>{"10.0.0.1"});
}

// ---- issue 14 ----------------------------------------------------------------

TEST_CASE("the upstream gets a query rebuilt from the question: our ID and case, RD/CD, one bare OPT") {
  Fixture f;
  f.hooks.allowed = {"data.pypi.org"};
  f.start();
  // The client's query carries what a payload channel would: odd flags,
  // records in the additional section, an OPT with DO and 2 KiB of options.
  Msg q = query(0x4444, "Data.PyPI.org", qtype::A);
  q[2] |= 0x04;  // AA
  q[3] |= 0x30;  // AD, CD
  q[11] = 3;     // arcount
  put_a(q, "smuggled.example", {192, 0, 2, 99});
  put_cname(q, "more.example", "payload.example");
  q.push_back(0);
  put16(q, qtype::OPT);
  put16(q, 1232);
  put32(q, 0x8000);
  put16(q, 4 + 2048);
  put16(q, 65001);
  put16(q, 2048);
  for (int i = 0; i < 2048; ++i) q.push_back(static_cast<std::uint8_t>(i));
  TcpClient c(f.io, f.proxy->port());
  c.send(q);
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  CHECK(rcode_of(c.got[0]) == Rcode::noerror);
  CHECK(id_of(c.got[0]) == 0x4444);
  REQUIRE(f.upstream.seen.size() == 1);
  const Msg& up = f.upstream.seen[0].raw;
  const auto h = read_header(up);
  REQUIRE(h.has_value());
  CHECK(h->flags == 0x0110);  // RD and CD, nothing else
  CHECK(h->ancount == 0);
  CHECK(h->nscount == 0);
  CHECK(h->arcount == 1);
  const std::size_t qend = question_end(up);
  // One bare OPT with our payload size and the client's DO, and nothing after.
  REQUIRE(up.size() == qend + 11);
  CHECK(up[qend] == 0);
  CHECK(((up[qend + 1] << 8) | up[qend + 2]) == qtype::OPT);
  CHECK(((up[qend + 3] << 8) | up[qend + 4]) == kUpstreamPayload);
  CHECK(up[qend + 7] == 0x80);  // DO
  CHECK(up[qend + 9] == 0);
  CHECK(up[qend + 10] == 0);
  // The client's answer has its own question bytes back; an OPT only
  // because it sent one.
  CHECK(std::equal(q.begin() + 12, q.begin() + 12 + 19, c.got[0].begin() + 12));
}

TEST_CASE("a client without EDNS gets no OPT back") {
  Fixture f;
  f.hooks.allowed = {"pypi.org"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(1, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  REQUIRE(f.upstream.seen.size() == 1);
  CHECK(read_header(f.upstream.seen[0].raw)->arcount == 1);  // the upstream got our OPT
  CHECK(read_header(c.got[0])->arcount == 0);
}

TEST_CASE("the upstream sees the name in random case (0x20), the client its own") {
  Fixture f;
  const std::string name = "abcdefghijklmnop.example";
  f.hooks.allowed = {name};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  for (int i = 0; i < 8; ++i) c.send(query(static_cast<std::uint16_t>(i), name));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 8; }));
  std::set<Msg> cases;
  for (const auto& s : f.upstream.seen) {
    CHECK(s.name == name);  // same name, case-insensitively
    cases.insert(Msg(s.raw.begin() + 12, s.raw.begin() + static_cast<std::ptrdiff_t>(question_end(s.raw))));
  }
  CHECK(cases.size() == 8);  // 23 letters: a repeat is a 1-in-8-million chance
  for (const Msg& a : c.got) {
    CHECK(rcode_of(a) == Rcode::noerror);
    const Msg mine = query(0, name);
    CHECK(std::equal(mine.begin() + 12, mine.end(), a.begin() + 12));
  }
}

TEST_CASE("an answer that does not echo the query's case is rejected: SERVFAIL, nothing learned") {
  Fixture f;
  const std::string name = "abcdefghijklmnopqrstuvwxyz.example";  // 33 letters: never all lower by chance
  f.hooks.allowed = {name};
  f.upstream.lower_question = true;
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(9, name));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  CHECK(rcode_of(c.got[0]) == Rcode::servfail);
  CHECK(f.hooks.learned.empty());
  CHECK(f.proxy->counters().failed == 1);
}

TEST_CASE("each query goes out on a socket of its own") {
  Fixture f;
  f.upstream.silent = true;
  f.hooks.allowed = {};
  for (int i = 0; i < 20; ++i) f.hooks.allowed.insert("n" + std::to_string(i) + ".test");
  f.start();
  UdpClient c(f.io, f.proxy->port());
  for (int i = 0; i < 20; ++i) c.send(query(static_cast<std::uint16_t>(i), "n" + std::to_string(i) + ".test"));
  REQUIRE(run_until(f.io, [&] { return f.upstream.seen.size() == 20; }));
  std::set<std::uint16_t> ports;
  for (const auto& s : f.upstream.seen) ports.insert(s.port);
  CHECK(ports.size() == 20);
}

TEST_CASE("every answered query's flow is handed over to be forgotten, from the port it used") {
  Fixture f;
  f.hooks.allowed = {"a.test", "b.test", "c.test"};
  f.start();
  UdpClient c(f.io, f.proxy->port());
  for (const char* n : {"a.test", "b.test", "c.test"}) c.send(query(1, n));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 3 && f.forgotten.size() == 3; }));
  std::set<std::uint16_t> seen_ports, forgotten_ports;
  for (const auto& s : f.upstream.seen) seen_ports.insert(s.port);
  for (const FlowTuple& t : f.forgotten) {
    forgotten_ports.insert(t.sport);
    CHECK(t.src.to_string() == "127.0.0.1");
    CHECK(t.dst.to_string() == "127.0.0.1");
    CHECK(t.dport == f.upstream.port());
  }
  CHECK(forgotten_ports == seen_ports);
  CHECK(f.ports_free_when_forgotten == 0);

  SUBCASE("a query that got no answer is not forgotten (a late answer must still match it)") {
    f.upstream.silent = true;
    f.hooks.allowed.insert("late.test");
    c.send(query(2, "late.test"));
    REQUIRE(run_until(f.io, [&] { return c.got.size() == 4; }));
    CHECK(rcode_of(c.got[3]) == Rcode::servfail);
    CHECK(f.forgotten.size() == 3);
  }
}

TEST_CASE("one query after the other: a new source port each time") {
  // The proxy reuses a socket once its query is answered, but disconnected:
  // the kernel then binds a new random port at the next connect.
  Fixture f;
  for (int i = 0; i < 20; ++i) f.hooks.allowed.insert("s" + std::to_string(i) + ".test");
  f.start();
  UdpClient c(f.io, f.proxy->port());
  for (int i = 0; i < 20; ++i) {
    c.send(query(static_cast<std::uint16_t>(i), "s" + std::to_string(i) + ".test"));
    REQUIRE(run_until(f.io, [&] { return c.got.size() == static_cast<std::size_t>(i + 1); }));
  }
  std::set<std::uint16_t> ports;
  for (const auto& s : f.upstream.seen) ports.insert(s.port);
  CHECK(ports.size() >= 18);  // 20 draws from ~28k ports: a repeat or two at most, by chance
}

TEST_CASE("what a query's socket still holds when it ends never reaches the next query on that socket") {
  // The answer and two copies are queued together; the first ends the try,
  // the socket goes back to the pool disconnected with the copies in it.
  // They must be read and dropped before the socket serves again, one query
  // at a time (the pool's socket taken right away) and many at once.
  Fixture f;
  f.upstream.copies = 3;
  for (int i = 0; i < 40; ++i) f.hooks.allowed.insert("c" + std::to_string(i) + ".test");
  f.start();
  UdpClient c(f.io, f.proxy->port());
  for (int i = 0; i < 20; ++i) {
    c.send(query(static_cast<std::uint16_t>(i), "c" + std::to_string(i) + ".test"));
    REQUIRE(run_until(f.io, [&] { return c.got.size() == static_cast<std::size_t>(i + 1); }));
    CHECK(rcode_of(c.got.back()) == Rcode::noerror);
  }
  // Every socket but the last was taken again, so its two copies went first.
  CHECK(f.proxy->counters().stale >= 2 * 19);
  for (int i = 20; i < 40; ++i) c.send(query(static_cast<std::uint16_t>(i), "c" + std::to_string(i) + ".test"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 40; }));
  for (const auto& m : c.got) CHECK(rcode_of(m) == Rcode::noerror);
  CHECK(f.proxy->counters().failed == 0);
  std::set<std::uint16_t> ports;
  for (const auto& s : f.upstream.seen) ports.insert(s.port);
  CHECK(ports.size() >= 36);  // a fresh port per query (40 draws from ~28k: a repeat or two by chance)
}

TEST_CASE("TTLs are capped at max_ttl, in the answer relayed and in what is learned") {
  Fixture f;
  f.hooks.allowed = {"long.test"};
  f.upstream.ttl = 0x7FFFFFFF;
  ProxyOptions o;
  o.max_ttl = 3600;
  f.start(o);
  UdpClient c(f.io, f.proxy->port());
  c.send(query(5, "long.test"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  auto parsed = parse_answer(c.got[0], "long.test");
  REQUIRE(parsed.ok());
  REQUIRE(parsed->addresses.size() == 1);
  CHECK(parsed->addresses[0].ttl == 3600);
  REQUIRE(f.hooks.learned.size() == 1);
  CHECK(learned_text(f.hooks.learned[0]) == "long.test=192.0.2.9/3600");
}

namespace {

// The proxy with Docker's resolver as its upstream (on loopback, forwarding
// to the proxy as the redirect would), and a relay target T.
struct DockerFixture {
  asio::io_context io;
  FakeUpstream docker{io};  // 127.0.0.11's resolver
  FakeUpstream target{io};  // T: where it forwards
  FakeHooks hooks;
  std::unique_ptr<Proxy> proxy;

  void start(bool pinned = true) {
    ProxyOptions o;
    o.upstream = {docker.address()};
    o.own_local_upstreams = false;
    if (pinned) {
      o.forwarder.targets = {target.address()};
      o.forwarder.source = "test";
    }
    auto p = Proxy::start(io, o, hooks);
    REQUIRE(p.ok());
    proxy = std::move(p.value());
    docker.forward_to = udp::endpoint(asio::ip::make_address("127.0.0.1"), proxy->port());
  }
};

}  // namespace

TEST_CASE("Docker's forwarder: egressd's own query comes back and goes to the target; service names stay local") {
  DockerFixture f;
  f.hooks.allowed = {"pypi.org", "db"};
  f.docker.services = {"db"};
  f.start();
  REQUIRE(f.hooks.relay_calls.size() == 1);
  CHECK(f.hooks.relay_calls[0].second == "test");
  CHECK(f.hooks.relay_calls[0].first.at(0).to_string() == "127.0.0.1");
  UdpClient c(f.io, f.proxy->port());
  c.send(query(0x0101, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }));
  CHECK(rcode_of(c.got[0]) == Rcode::noerror);
  CHECK(id_of(c.got[0]) == 0x0101);
  // Docker forwarded it once; the target (not Docker, not the proxy again) answered.
  CHECK(f.docker.forwarded == 1);
  REQUIRE(f.target.seen.size() == 1);
  CHECK(f.target.seen[0].name == "pypi.org");
  CHECK(f.proxy->counters().relayed == 1);
  CHECK(f.proxy->counters().forwarded == 1);
  CHECK(f.proxy->counters().refused == 0);
  REQUIRE(f.hooks.learned.size() == 1);
  CHECK(learned_text(f.hooks.learned[0]) == "pypi.org=192.0.2.8/60");

  // A service name: Docker answers it itself, nothing is relayed.
  c.send(query(0x0102, "db"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 2; }));
  auto svc = parse_answer(c.got[1], "db");
  REQUIRE(svc.ok());
  REQUIRE(svc->addresses.size() == 1);
  CHECK(svc->addresses[0].addr.to_string() == "172.18.0.5");
  CHECK(f.proxy->counters().relayed == 1);

  // A name the policy refuses never reaches Docker.
  c.send(query(0x0103, "exfil.example"));
  REQUIRE(run_until(f.io, [&] { return c.got.size() == 3; }));
  CHECK(rcode_of(c.got[2]) == Rcode::refused);
  for (const auto& s : f.docker.seen) CHECK(s.name != "exfil.example");
  CHECK(f.target.seen.size() == 1);
}

TEST_CASE("a copy of egressd's in-flight query goes to the target only, and only while it is in flight") {
  DockerFixture f;
  f.hooks.allowed = {"abcdefghij.example"};
  f.docker.silent = true;  // egressd's query stays in flight
  f.start();
  UdpClient c(f.io, f.proxy->port());
  c.send(query(1, "abcdefghij.example"));
  REQUIRE(run_until(f.io, [&] { return f.docker.seen.size() == 1; }));
  // A racer copies egressd's query (it sniffed loopback) and sends it to
  // "its" resolver: the redirect brings it to the proxy.
  Msg copy = f.docker.seen[0].raw;
  UdpClient racer(f.io, f.proxy->port());
  racer.send(copy);
  REQUIRE(run_until(f.io, [&] { return !racer.got.empty(); }));
  CHECK(rcode_of(racer.got[0]) == Rcode::noerror);
  REQUIRE(f.target.seen.size() == 1);
  CHECK(f.target.seen[0].name == "abcdefghij.example");
  // Its exact question bytes went to the target (T must echo them).
  CHECK(std::equal(copy.begin() + 12, copy.begin() + static_cast<std::ptrdiff_t>(question_end(copy)),
                   f.target.seen[0].raw.begin() + 12));
  // Bounded: a flood of copies does not multiply it.
  for (int i = 0; i < 20; ++i) racer.send(copy);
  REQUIRE(run_until(f.io, [&] { return racer.got.size() == 21; }));
  CHECK(f.target.seen.size() == 8);
  // The same name in another case is the sandbox's own query: under policy
  // (allowed here, so forwarded to the upstream, not relayed).
  racer.send(query(2, "ABCDEFGHIJ.example"));
  REQUIRE(run_until(f.io, [&] { return f.docker.seen.size() == 2; }));
  CHECK(f.target.seen.size() == 8);
}

TEST_CASE("without a relay target a copy of egressd's query gets SERVFAIL and goes nowhere") {
  DockerFixture f;
  f.hooks.allowed = {"pypi.org"};
  f.start(false);
  UdpClient c(f.io, f.proxy->port());
  c.send(query(1, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return !c.got.empty(); }, 5000ms));
  CHECK(rcode_of(c.got[0]) == Rcode::servfail);
  CHECK(f.docker.forwarded == 1);
  CHECK(f.target.seen.empty());
  CHECK(f.proxy->counters().relayed == 0);
}

TEST_CASE("the forwarder probe pins the target from the one copy that arrives, and nothing on a race") {
  for (int copies : {1, 2}) {
    INFO(copies);
    asio::io_context io;
    FakeUpstream docker(io);
    FakeHooks hooks;
    ProxyOptions o;
    o.upstream = {docker.address()};
    o.own_local_upstreams = false;
    o.forwarder.probe = true;
    o.forwarder.probe_grace = 100ms;
    o.forwarder.probe_retry = 60000ms;
    // No nat here: where the copy "was going" is what Docker's ExtServer would be.
    o.original_dst = [](int, bool) -> std::optional<Server> { return parse_server("192.0.2.53").value(); };
    auto b = Proxy::bind(io, o, hooks);
    REQUIRE(b.ok());
    auto proxy = std::move(b.value());
    docker.tcp_forward_to = tcp::endpoint(asio::ip::make_address("127.0.0.1"), proxy->port());
    docker.tcp_copies = copies;
    proxy->serve(0, 0);
    REQUIRE(run_until(io, [&] { return docker.forwarded == copies; }));
    // The probe's name is under .invalid and answered by the proxy.
    if (copies == 1) {
      REQUIRE(run_until(io, [&] { return hooks.relay_calls.size() == 1; }));
      CHECK(hooks.relay_calls[0].first.at(0).to_string() == "192.0.2.53");
      CHECK(hooks.relay_calls[0].second == "probe");
    } else {
      // Past the grace: still nothing pinned.
      const auto until = Clock::now() + 400ms;
      run_until(io, [&] { return Clock::now() > until; }, 1000ms);
      CHECK(hooks.relay_calls.empty());
    }
  }
}

namespace {

// The proxy probing Docker's resolver (`docker`), with short timers: a
// probe that pins nothing is retried after 300 ms.
struct ProbeFixture {
  asio::io_context io;
  FakeUpstream docker{io};
  FakeHooks hooks;
  std::unique_ptr<Proxy> proxy;

  void start(std::size_t max_tcp = 64, int first_copies = 2) {
    ProxyOptions o;
    o.upstream = {docker.address()};
    o.own_local_upstreams = false;
    o.max_tcp_connections = max_tcp;
    o.upstream_timeout = 5000ms;
    o.forwarder.probe = true;
    o.forwarder.probe_grace = 100ms;
    o.forwarder.probe_retry = 300ms;
    o.original_dst = [](int, bool) -> std::optional<Server> { return parse_server("192.0.2.53").value(); };
    auto b = Proxy::bind(io, o, hooks);
    REQUIRE(b.ok());
    proxy = std::move(b.value());
    docker.tcp_forward_to = tcp::endpoint(asio::ip::make_address("127.0.0.1"), proxy->port());
    docker.tcp_copies = first_copies;
    proxy->serve(0, 0);
  }
  // A sandbox connection to the proxy, accepted and served (one refused query answered).
  std::unique_ptr<TcpClient> held_connection(std::uint16_t id) {
    auto c = std::make_unique<TcpClient>(io, proxy->port());
    c->send(query(id, "held.example"));
    REQUIRE(run_until(io, [&] { return !c->got.empty(); }));
    return c;
  }
};

}  // namespace

TEST_CASE("the forwarder probe pins nothing from a copy on a connection opened before it") {
  // Finding F2: the sandbox holds a connection "to" its resolver, keeps
  // Docker's copy of the probe from arriving, and sends its own copy over
  // the held connection.
  ProbeFixture f;
  f.start();
  // The first probe races (two copies): nothing pinned, retried.
  REQUIRE(run_until(f.io, [&] { return f.docker.forwarded == 2; }));
  auto racer = f.held_connection(1);
  f.docker.tcp_copies = 0;  // Docker's copy of the next probe never arrives
  REQUIRE(run_until(f.io, [&] { return f.docker.tcp_queries.size() == 2; }));
  racer->send(f.docker.tcp_queries[1]);
  REQUIRE(run_until(f.io, [&] { return racer->got.size() == 2; }));
  // That probe ends without a pin and the next one starts (with Docker's
  // copy arriving again it pins the real target).
  f.docker.tcp_copies = 1;
  REQUIRE(run_until(f.io, [&] { return f.docker.tcp_queries.size() == 3 || !f.hooks.relay_calls.empty(); }));
  CHECK(f.docker.tcp_queries.size() == 3);
  REQUIRE(run_until(f.io, [&] { return !f.hooks.relay_calls.empty(); }));
  CHECK(f.hooks.relay_calls.size() == 1);
  CHECK(f.docker.forwarded == 3);
}

TEST_CASE("a lone copy on a fresh connection pins nothing unless egressd's probe gets the proxy's answer back") {
  // Found by a second review: the sandbox uses up the namespace's ports to
  // the target (TIME_WAIT), so Docker's resolver cannot connect and its copy
  // never exists; the sandbox sends the only copy, over a new connection,
  // to its own resolver. Docker answers egressd's probe itself (not the
  // proxy's NXDOMAIN): nothing is pinned.
  ProbeFixture f;
  f.start();
  REQUIRE(run_until(f.io, [&] { return f.docker.forwarded == 2; }));  // the first probe races
  f.docker.tcp_copies = 0;  // Docker's copy of the next probe never arrives
  REQUIRE(run_until(f.io, [&] { return f.docker.tcp_queries.size() == 2; }));
  TcpClient racer(f.io, f.proxy->port());  // opened after the probe
  racer.send(f.docker.tcp_queries[1]);
  REQUIRE(run_until(f.io, [&] { return racer.got.size() == 1; }));
  CHECK(rcode_of(racer.got[0]) == Rcode::nxdomain);
  // Past that probe's grace the next one starts, and nothing was pinned
  // (a pin comes a grace after its probe, so none can be the next one's
  // yet). With Docker's copy arriving again, that one pins the real target.
  f.docker.tcp_copies = 1;
  REQUIRE(run_until(f.io, [&] { return f.docker.tcp_queries.size() == 3 || !f.hooks.relay_calls.empty(); }));
  CHECK(f.hooks.relay_calls.empty());
  REQUIRE(run_until(f.io, [&] { return !f.hooks.relay_calls.empty(); }));
  CHECK(f.hooks.relay_calls[0].first.at(0).to_string() == "192.0.2.53");
  racer.close();
}

TEST_CASE("with the resolver forwarding from outside, a lone copy of the first probe pins nothing") {
  // Docker forwarding from the host's namespace answers egressd's probe from
  // there (NXDOMAIN, as any upstream does for .invalid); a sandbox process
  // present at start copies the probe once, over a fresh connection, to a
  // resolver of its own. The proxy's answer to that copy carries a token;
  // egressd's own answer does not bring it back, so nothing is pinned.
  ProbeFixture f;
  f.docker.nxdomain_invalid = true;
  f.start(64, 0);
  REQUIRE(run_until(f.io, [&] { return f.docker.tcp_queries.size() == 1; }));
  TcpClient racer(f.io, f.proxy->port());  // opened after the probe
  racer.send(f.docker.tcp_queries[0]);
  REQUIRE(run_until(f.io, [&] { return racer.got.size() == 1; }));
  CHECK(rcode_of(racer.got[0]) == Rcode::nxdomain);
  const Msg& copy_answer = racer.got[0];
  REQUIRE(copy_answer.size() > kHeaderSize);
  CHECK(copy_answer[9] == 1);  // NSCOUNT: the SOA with the copy's token
  CHECK(std::string(copy_answer.begin(), copy_answer.end()).find("egressd-copy-") != std::string::npos);
  // That probe ends without a pin (the next one starts); none ever pins.
  REQUIRE(run_until(f.io, [&] { return f.docker.tcp_queries.size() == 2 || !f.hooks.relay_calls.empty(); }));
  CHECK(f.hooks.relay_calls.empty());
  racer.close();
}

TEST_CASE("a probe while the sandbox holds the TCP slots pins nothing, and Docker's copy still finds room") {
  ProbeFixture f;
  f.start(4);
  REQUIRE(run_until(f.io, [&] { return f.docker.forwarded == 2; }));
  // Every ordinary slot held.
  std::vector<std::unique_ptr<TcpClient>> held;
  for (std::uint16_t i = 0; i < 4; ++i) held.push_back(f.held_connection(i));
  f.docker.tcp_copies = 1;
  REQUIRE(run_until(f.io, [&] { return f.docker.tcp_queries.size() == 3 || !f.hooks.relay_calls.empty(); }));
  // The second probe: Docker's copy was accepted beyond the limit and
  // answered, but the probe counted nothing; the third started.
  CHECK(f.hooks.relay_calls.empty());
  CHECK(f.docker.tcp_copies_answered >= 3);
  for (auto& c : held) c->close();
  REQUIRE(run_until(f.io, [&] { return !f.hooks.relay_calls.empty(); }));
  CHECK(f.hooks.relay_calls[0].first.at(0).to_string() == "192.0.2.53");
}

TEST_CASE("after a probe that saw no copy, a copy of egressd's query gets SERVFAIL and starts no probe") {
  // Finding F3: the resolver forwards from outside the namespace; a
  // sandbox process that copies egressd's query must not get a new probe
  // that it would answer alone.
  ProbeFixture f;
  f.hooks.allowed = {"pypi.org"};
  f.start(64, 0);
  f.docker.silent_udp = true;  // egressd's query stays in flight
  REQUIRE(run_until(f.io, [&] { return f.docker.tcp_queries.size() == 1; }));
  UdpClient c(f.io, f.proxy->port());
  c.send(query(1, "pypi.org"));
  REQUIRE(run_until(f.io, [&] { return f.docker.saw("pypi.org"); }));
  const Msg copy = f.docker.seen.back().raw;
  UdpClient racer(f.io, f.proxy->port());
  // Copies, one after the other, until a new probe starts or 1.5 s (five
  // probe retries) pass.
  const auto deadline = Clock::now() + 1500ms;
  std::size_t sent = 0;
  while (Clock::now() < deadline && f.docker.tcp_queries.size() == 1) {
    racer.send(copy);
    ++sent;
    REQUIRE(run_until(f.io, [&] { return racer.got.size() == sent; }));
    CHECK(rcode_of(racer.got.back()) == Rcode::servfail);
    run_until(f.io, [&] { return f.docker.tcp_queries.size() > 1; }, 50ms);
  }
  CHECK(f.docker.tcp_queries.size() == 1);
  CHECK(f.hooks.relay_calls.empty());
  CHECK(f.proxy->counters().relayed == 0);
}

TEST_CASE("resolv.conf's ExtServers comment (Docker >= 25)") {
  const std::string text =
      "# Generated by Docker Engine.\n"
      "nameserver 127.0.0.11\n"
      "options ndots:0\n"
      "\n"
      "# Based on host file: '/etc/resolv.conf' (internal resolver)\n"
      "# ExtServers: [192.0.2.53 host(127.0.0.53) 2001:DB8::53 192.0.2.53 [2001:db8::54]:5353 invalid IP]\n"
      "# Overrides: []\n";
  const ExtServers e = ext_servers_from_resolv_conf(text);
  CHECK(e.present);
  CHECK(e.targets == std::vector<std::string>{"192.0.2.53", "2001:db8::53"});
  CHECK(e.host_side == std::vector<std::string>{"127.0.0.53"});
  CHECK(nameservers_from_resolv_conf(text) == std::vector<std::string>{"127.0.0.11"});

  CHECK_FALSE(ext_servers_from_resolv_conf("nameserver 127.0.0.11\noptions ndots:0\n").present);
  const ExtServers host_only = ext_servers_from_resolv_conf("#ExtServers: [host(192.168.65.7)]");
  CHECK(host_only.present);
  CHECK(host_only.targets.empty());
  CHECK(host_only.host_side == std::vector<std::string>{"192.168.65.7"});
  const ExtServers none = ext_servers_from_resolv_conf("# ExtServers: []\n");
  CHECK(none.present);
  CHECK(none.targets.empty());
  CHECK_FALSE(ext_servers_from_resolv_conf("nameserver 192.0.2.1 # ExtServers: [192.0.2.9]\n").present);
}
