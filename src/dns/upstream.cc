// egressd's own upstream DNS client (DESIGN §1 "DNS proxy"; issue 14): one
// Exchange per query, tried across the configured servers, UDP with a TCP
// fallback on TC, a pool of disconnected UDP sockets so each query leaves
// from a fresh port, 0x20 case and ID checks on every answer.
//
// Over 500 lines because the exchange is one state machine (tries, timers,
// sockets, the answer checks) whose every transition is an integrity
// property of issue 14; split across files, a reviewer could no longer see
// that no path accepts an answer without the checks.
#include "dns/upstream.h"

#include <linux/errqueue.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <array>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/udp.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <random>
#include <spdlog/spdlog.h>
#include <unordered_map>

#include "dns/log.h"

namespace egressd::dns {

namespace asio = boost::asio;
using udp = asio::ip::udp;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

namespace {

// Each server is tried `kTries` times, and the timeout doubles after every
// round over all servers (c-ares' schedule, kept): the total is
// n * first * (2^kTries - 1).
constexpr int kTries = 2;
constexpr std::chrono::milliseconds kMinFirstTry{50};
// The largest answer read over UDP: more than the payload size egressd
// advertises (a server may ignore it); a bigger datagram is cut by the
// kernel and fails to parse.
constexpr std::size_t kUdpReceive = 65535;

// Reads the ICMP errors queued on `fd` (IP_RECVERR, IPV6_RECVERR; at most
// 64 a call: level-triggered epoll brings the rest): true when one of them
// came from `server` itself. An ICMP error reaches a connected socket from
// anyone who can send to its address, quoting its ports: a sandbox that can
// reach the agent's host (a public phase, host.docker.internal) swept the
// ephemeral ports with port unreachables and ended every other sandbox's
// tries, SERVFAIL (attack review 9). Only the server's own word ends a try
// early; any other error waits out the try's timeout, as a router's host
// unreachable then does. The sandbox cannot send from the server's address
// (the forged-source deny).
bool icmp_error_from(int fd, const asio::ip::address& server) {
  bool from_server = false;
  for (int i = 0; i < 64; ++i) {
    alignas(cmsghdr) std::array<char, 256> ctl{};
    std::array<std::uint8_t, 64> data{};
    iovec iov{data.data(), data.size()};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.data();
    mh.msg_controllen = ctl.size();
    if (::recvmsg(fd, &mh, MSG_ERRQUEUE | MSG_DONTWAIT) < 0) break;
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
      const bool v4 = c->cmsg_level == SOL_IP && c->cmsg_type == IP_RECVERR;
      const bool v6 = c->cmsg_level == SOL_IPV6 && c->cmsg_type == IPV6_RECVERR;
      if ((!v4 && !v6) || c->cmsg_len < CMSG_LEN(sizeof(sock_extended_err))) continue;
      sock_extended_err ee{};
      std::memcpy(&ee, CMSG_DATA(c), sizeof ee);
      if (ee.ee_origin != SO_EE_ORIGIN_ICMP && ee.ee_origin != SO_EE_ORIGIN_ICMP6) continue;
      // The offender's address follows the structure in the same message.
      const std::size_t room = c->cmsg_len - CMSG_LEN(sizeof(sock_extended_err));
      const auto* off = reinterpret_cast<const std::uint8_t*>(CMSG_DATA(c)) + sizeof(sock_extended_err);
      if (server.is_v4() && room >= sizeof(sockaddr_in)) {
        sockaddr_in sin{};
        std::memcpy(&sin, off, sizeof sin);
        from_server |= sin.sin_family == AF_INET && server.to_v4().to_bytes() ==
                                                        std::bit_cast<asio::ip::address_v4::bytes_type>(sin.sin_addr);
      } else if (server.is_v6() && room >= sizeof(sockaddr_in6)) {
        sockaddr_in6 sin6{};
        std::memcpy(&sin6, off, sizeof sin6);
        from_server |= sin6.sin6_family == AF_INET6 && server.to_v6().to_bytes() ==
                                                           std::bit_cast<asio::ip::address_v6::bytes_type>(sin6.sin6_addr);
      }
    }
  }
  return from_server;
}

std::chrono::milliseconds first_try(std::chrono::milliseconds budget, std::size_t nservers) {
  const auto rounds = static_cast<std::int64_t>(nservers) * ((1 << kTries) - 1);
  return std::max(kMinFirstTry, std::chrono::milliseconds(budget.count() / std::max<std::int64_t>(rounds, 1)));
}

// The address and port a socket is bound to (getsockname).
std::optional<sockaddr_storage> local_address(int fd) {
  sockaddr_storage ss{};
  socklen_t sl = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl) != 0) return std::nullopt;
  return ss;
}

std::uint16_t port_of(const sockaddr_storage& ss) {
  return ntohs(ss.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in&>(ss).sin_port
                                       : reinterpret_cast<const sockaddr_in6&>(ss).sin6_port);
}

// The flow from a socket's address and port `ss` to `to`.
FlowTuple flow_from(const sockaddr_storage& ss, const Server& to, std::uint8_t proto) {
  FlowTuple t;
  t.proto = proto;
  const bool v4 = ss.ss_family == AF_INET;
  t.src.family = v4 ? 4 : 6;
  t.src.prefix_len = v4 ? 32 : 128;
  if (v4) {
    std::memcpy(t.src.bytes.data(), &reinterpret_cast<const sockaddr_in&>(ss).sin_addr, 4);
  } else {
    std::memcpy(t.src.bytes.data(), &reinterpret_cast<const sockaddr_in6&>(ss).sin6_addr, 16);
  }
  t.sport = port_of(ss);
  t.dst = to.ip;
  t.dport = to.port;
  return t;
}

}  // namespace

boost::asio::ip::address to_address(const IpPrefix& ip) {
  if (ip.family == 4) {
    boost::asio::ip::address_v4::bytes_type b;
    std::copy_n(ip.bytes.begin(), 4, b.begin());
    return boost::asio::ip::address_v4(b);
  }
  boost::asio::ip::address_v6::bytes_type b;
  std::copy_n(ip.bytes.begin(), 16, b.begin());
  return boost::asio::ip::address_v6(b);
}

std::string Server::to_string() const {
  const std::string addr = ip.to_string();
  return (ip.family == 6 ? "[" + addr + "]" : addr) + ":" + std::to_string(port);
}

Result<Server> parse_server(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return Error::invalid("upstream \"" + std::string(text) + "\": " + std::string(why));
  };
  if (text == "resolv.conf") {
    return bad("expand it first with nameservers_from_resolv_conf(/etc/resolv.conf)");
  }
  std::string_view host = text;
  std::string_view port;
  if (!host.empty() && host.front() == '[') {
    const auto close = host.find(']');
    if (close == std::string_view::npos) return bad("missing ]");
    std::string_view rest = host.substr(close + 1);
    host = host.substr(1, close - 1);
    if (!rest.empty()) {
      if (rest.front() != ':') return bad("junk after ]");
      port = rest.substr(1);
      if (port.empty()) return bad("empty port");
    }
    if (host.find(':') == std::string_view::npos) return bad("brackets around a non-IPv6 address");
  } else if (std::count(host.begin(), host.end(), ':') == 1) {
    const auto colon = host.find(':');
    port = host.substr(colon + 1);
    host = host.substr(0, colon);
    if (port.empty()) return bad("empty port");
  }
  auto ip = parse_ip(host);
  if (!ip) return bad("not an IP address (a name server must be given by address)");
  Server s;
  s.ip = *ip;
  if (!port.empty()) {
    unsigned v = 0;
    auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), v);
    if (ec != std::errc() || end != port.data() + port.size() || v == 0 || v > 65535) return bad("bad port");
    s.port = static_cast<std::uint16_t>(v);
  }
  return s;
}

struct Exchange;

struct Upstream::Impl : std::enable_shared_from_this<Impl> {
  explicit Impl(asio::io_context& io_) : io(io_), timer(io_), trim_timer(io_) {}

  asio::io_context& io;
  std::vector<Server> servers;
  std::vector<asio::ip::address> addrs;  // servers[i]'s address for asio
  std::vector<bool> usable;
  std::vector<std::string> unusable_why;
  std::chrono::milliseconds first{500};
  std::uint32_t mark = 0;
  bool mark_warned = false;
  ForgetFlow forget;
  std::function<int(int, int)> socket_opener;  // UpstreamOptions::open_socket

  int open_socket(int domain, int type) const {
    return socket_opener ? socket_opener(domain, type) : ::socket(domain, type, 0);
  }
  std::size_t pending = 0;
  bool closed = false;
  UpstreamFailure last_failure = UpstreamFailure::none;
  std::shared_ptr<spdlog::logger> log = dns_logger();

  // Tries waiting for an answer, one FIFO per round: every try of a round
  // has the same timeout, so each list is in deadline order and one timer
  // armed at the earliest head covers them all (no timer per query, and no
  // timerfd update per answer).
  struct List {
    Exchange* head = nullptr;
    Exchange* tail = nullptr;
  };
  std::array<List, kTries> waiting;
  asio::steady_timer timer;
  bool timer_armed = false;
  Clock::time_point timer_at{};

  // Every UDP answer is read here, then handled before the next read: one
  // buffer for all queries (a 64 KiB buffer per query cost more than the
  // rest of the exchange, zeroing included). Not zeroed either: only the
  // pages answers were written to are resident (an agent has one upstream
  // per sandbox; zeroed, 200 of them held 12.5 MiB).
  std::unique_ptr<std::uint8_t[]> rbuf{new std::uint8_t[kUdpReceive]};

  // 4 KiB of kernel randomness at a time: 128 queries' IDs and case bits
  // per getrandom call.
  std::array<std::uint8_t, 4096> rnd{};
  std::size_t rnd_pos = rnd.size();

  void random_bytes(std::uint8_t* out, std::size_t n) {
    while (n > 0) {
      if (rnd_pos == rnd.size()) {
        // getrandom from the initialised urandom pool does not block; a
        // 4 KiB read may be cut short by a signal only past 256 bytes, so
        // loop until it is full.
        std::size_t got = 0;
        while (got < rnd.size()) {
          const ssize_t r = ::getrandom(rnd.data() + got, rnd.size() - got, 0);
          if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            // Unreachable in practice; never send predictable IDs.
            std::random_device rd;
            for (std::size_t i = got; i < rnd.size(); ++i) rnd[i] = static_cast<std::uint8_t>(rd());
            break;
          }
          got += static_cast<std::size_t>(r);
        }
        rnd_pos = 0;
      }
      const std::size_t k = std::min(n, rnd.size() - rnd_pos);
      std::memcpy(out, rnd.data() + rnd_pos, k);
      rnd_pos += k;
      out += k;
      n -= k;
    }
  }

  // UDP sockets to reuse, one pool per family. A socket that ended its try
  // with an answer is disconnected (connect AF_UNSPEC): the kernel releases
  // its autobound port, and the next connect binds a new random one. So
  // every query still gets a fresh port, without a new socket, SO_MARK and
  // epoll registration each time (together a third of the proxy's CPU when
  // every query made its own socket).
  //
  // A disconnected socket receives nothing more, but may hold what came
  // before (a late duplicate, a forger's datagram, an error), which must not
  // reach the next query. Reading it empty costs a recv per query; instead
  // the epoll set says: a pooled socket that a complete epoll_wait after its
  // disconnect did not name (or named and found drained) is empty. `polls`
  // counts such waits; a socket taken from the pool before one happened
  // makes one, once for all sockets disconnected before it.
  //
  // Pooled sockets are held descriptors: in an agent, one sandbox's burst
  // once left 256 per family pooled for good, and with them the agent's
  // last descriptors (attack review). A socket unused for a whole tick of
  // trim_timer is closed (trim()); the timer runs only while the pool holds
  // any, so nothing is paid per query and an idle upstream never wakes.
  static constexpr std::size_t kPoolMax = 256;
  struct Pooled {
    int fd;
    std::uint64_t at;    // `polls` when it was disconnected
    std::uint64_t tick;  // `ticks` when it was pooled
  };
  // Pushed and taken at the back: each pool is in `tick` order, the
  // longest unused at the front.
  std::vector<Pooled> pool4, pool6;
  asio::steady_timer trim_timer;
  std::chrono::milliseconds pool_idle{1000};
  bool trim_armed = false;
  std::uint64_t ticks = 0;  // trim_timer's expiries
  void arm_trim();
  void trim();
  // The budget's account (UpstreamOptions::fds), charged for every socket
  // made and credited for every socket closed; `nsockets` counts them.
  std::shared_ptr<FdAccount> fds;
  std::size_t nsockets = 0;
  bool refused = false;  // the last charge() was refused by the budget
  bool charge() {
    refused = fds && !fds->take();
    if (refused) return false;
    ++nsockets;
    return true;
  }
  void uncharge() {
    --nsockets;
    if (fds) fds->give();
  }
  std::uint64_t polls = 1;
  std::uint64_t stale = 0;  // datagrams drain() read
  std::vector<bool> dirty;  // by descriptor: pooled, and not drained empty
  void recycle(int fd, bool v4);
  int reuse(bool v4);

  // Answered tries' flows and sockets, released once per turn (release()):
  // the flows' conntrack deletions first, then the ports (disconnect). In
  // the other order a query of the same turn could draw a port whose old
  // entry still stood, and lose its own flow to that entry's deletion.
  std::vector<FlowTuple> to_forget;
  struct Released {
    int fd;
    bool v4;
  };
  std::vector<Released> to_recycle;
  bool release_posted = false;
  void release_later(const FlowTuple& t, int fd, bool v4);
  void release();
  bool drain(int fd);     // reads a socket empty (at most 64 datagrams); false if it is not
  using Events = std::array<epoll_event, 64>;
  int poll(Events& evs);  // one epoll_wait: drains the pooled sockets it names; how many it named
  void poll_pooled();     // poll() for reuse(), the events left for on_udp_ready

  // The UDP sockets are plain descriptors in an epoll set of the upstream's
  // own, added once when made (level-triggered), and only that set is in
  // the event loop's: asio re-arms a descriptor with epoll_ctl at every
  // wait, a system call per query; here one epoll_wait a turn names every
  // socket with something to read.
  int ep = -1;  // owned by ep_desc
  std::optional<asio::posix::stream_descriptor> ep_desc;
  bool ep_armed = false;
  // By descriptor: whether it is one of ours (made by open_udp, not yet
  // closed), and the exchange whose try waits on it (holding it alive). The
  // owners are keyed, not indexed: an agent's descriptors number in the
  // thousands, and a table as long as the highest one, per sandbox, cost
  // 16 bytes a descriptor (ours and dirty are a bit each).
  std::vector<bool> ours;
  std::unordered_map<int, std::shared_ptr<Exchange>> owner;
  std::size_t watching = 0;
  int open_udp(bool v4);  // made, marked and in the set; -1 with errno
  void close_udp(int fd);
  void watch(int fd, std::shared_ptr<Exchange> x);
  void unwatch(int fd);
  void arm_udp();
  void on_udp_ready();

  void link(Exchange* x, int round);
  void unlink(Exchange* x);
  void arm_timer();
  void on_timer();
  void close();

  void apply_mark(int fd) {
    if (mark == 0) return;
    if (::setsockopt(fd, SOL_SOCKET, SO_MARK, &mark, sizeof mark) != 0 && !mark_warned) {
      // Without the mark nftables treats our upstream traffic like the
      // sandbox's. Still send: the ruleset decides. Needs CAP_NET_ADMIN.
      const int err = errno;
      log->warn("event=upstream_mark_failed error=\"{}\"", errno_text(err));  // the mark is a secret
      mark_warned = true;
    }
  }
};

// One query from send() to done(): its tries, one at a time.
struct Exchange : std::enable_shared_from_this<Exchange> {
  Exchange(std::shared_ptr<Upstream::Impl> i, Upstream::AnswerCallback d) : impl(std::move(i)), done(std::move(d)) {}

  std::shared_ptr<Upstream::Impl> impl;
  Upstream::AnswerCallback done;
  std::vector<std::uint8_t> out;  // 2-byte TCP length prefix, then the query
  std::uint16_t id = 0;
  std::size_t question_len = 0;  // bytes [12, 12 + question_len) must come back
  std::uint64_t skip = 0;        // bit i: servers[i] answered SERVFAIL/REFUSED/NOTIMP (at most 64 servers)
  unsigned next = 0;             // next position in the schedule: round * n + server
  std::size_t server = 0;        // the server of the current try
  bool force_tcp = false;
  MayRetry may_retry;            // asked before every try after the first
  bool tried = false;            // a try was started
  unsigned serial = 0;           // of the current try; completions of older ones are stale
  int ufd = -1;           // the UDP socket of the current try
  // ufd's address and port, as the answer's destination said (IP_ORIGDSTADDR):
  // the flow to forget, without a getsockname.
  std::optional<sockaddr_storage> local;
  bool reusable = false;  // ufd's try ended with an answer read and nothing pending
  std::optional<tcp::socket> tsock;
  std::vector<std::uint8_t> buf;
  std::array<std::uint8_t, 2> len{};
  bool finished = false;
  UpstreamFailure failure = UpstreamFailure::timeout;
  std::string error;  // why the last try failed

  // Intrusive FIFO links (Impl::waiting).
  Exchange* prev = nullptr;
  Exchange* nxt = nullptr;
  int round = -1;  // the list it is in; -1: none
  Clock::time_point deadline{};

  Bytes query() const { return Bytes(out).subspan(2); }

  // The flow of ufd's try, whose answer was read (nothing more is due on it):
  // ufd's address and port to the server's; nullopt if they cannot be read.
  std::optional<FlowTuple> answered_flow() const {
    const auto ss = local ? local : local_address(ufd);
    if (!ss) return std::nullopt;
    return flow_from(*ss, impl->servers[server], IPPROTO_UDP);
  }
  Bytes question() const { return query().subspan(kHeaderSize, question_len); }

  void close_sockets() {
    error_code ec;
    if (ufd >= 0) {
      impl->unwatch(ufd);
      const bool v4 = impl->addrs[server].is_v4();
      if (!reusable || impl->closed) {
        impl->close_udp(ufd);
      } else if (const auto flow = impl->forget ? answered_flow() : std::nullopt) {
        impl->release_later(*flow, ufd, v4);  // forgotten first, then recycled
      } else {
        impl->recycle(ufd, v4);
      }
    }
    ufd = -1;
    local.reset();
    reusable = false;
    if (tsock) {
      if (tsock->is_open()) impl->uncharge();
      tsock->close(ec);
    }
    tsock.reset();
  }

  void note(UpstreamFailure f, std::string why) {
    // The most telling failure wins the final message: a mismatch over a
    // refusal over an unreachable server over a timeout.
    if (static_cast<int>(f) >= static_cast<int>(failure) || error.empty()) {
      failure = f;
      error = std::move(why);
    }
  }

  void finish(Result<Bytes> r) {
    if (finished) return;
    finished = true;
    impl->unlink(this);
    close_sockets();
    --impl->pending;
    Upstream::AnswerCallback cb = std::move(done);
    done = nullptr;
    if (impl->closed) return;
    impl->last_failure = r ? UpstreamFailure::none : failure;
    if (!r) return cb(r.error());
    // The one copy of the answer: out of the shared receive buffer (or the
    // TCP buffer), into what the caller keeps.
    cb(std::vector<std::uint8_t>(r->begin(), r->end()));
  }

  // Starts the next try of the schedule, or fails the query.
  void next_try() {
    if (finished) return;
    impl->unlink(this);
    close_sockets();
    ++serial;
    const std::size_t n = impl->servers.size();
    while (next < n * kTries) {
      const unsigned pos = next++;
      const std::size_t s = pos % n;
      if (!impl->usable[s] || (skip >> s & 1) != 0) continue;
      server = s;
      start(static_cast<int>(pos / n), force_tcp);
      return;
    }
    bool any_usable = false;
    for (std::size_t i = 0; i < n; ++i) any_usable = any_usable || impl->usable[i];
    if (!any_usable) {
      failure = UpstreamFailure::unavailable;
      std::string why = "upstream: no usable server";
      for (std::size_t i = 0; i < n; ++i) {
        if (!impl->unusable_why[i].empty()) why += "; " + impl->unusable_why[i];
      }
      error = std::move(why);
    }
    finish(Error::runtime(error.empty() ? std::string("upstream: no answer") : error));
  }

  void start(int round_no, bool tcp_try) {
    if (tried && may_retry && !may_retry()) {
      failure = UpstreamFailure::withdrawn;
      error = "upstream: not asked again, the phase in force no longer forwards the name";
      return finish(Error::runtime(error));
    }
    tried = true;
    const Server& srv = impl->servers[server];
    auto fail_now = [&](UpstreamFailure f, const error_code& ec, const char* what) {
      note(f, "upstream " + srv.to_string() + ": " + what + ": " + ec.message());
      next_try();
    };
    error_code ec;
    const auto addr = impl->addrs[server];
    if (tcp_try) {
      if (!impl->charge()) return out_of_descriptors(EMFILE);
      tsock.emplace(impl->io);
      if (const int tfd = impl->open_socket(addr.is_v4() ? AF_INET : AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC);
          tfd < 0) {
        ec = error_code(errno, boost::system::system_category());
      } else {
        tsock->assign(addr.is_v4() ? tcp::v4() : tcp::v6(), tfd, ec);
        if (ec) ::close(tfd);
      }
      if (ec) {
        impl->uncharge();
        tsock.reset();
        if (ec.value() == EMFILE || ec.value() == ENFILE) return out_of_descriptors(ec.value());
        return fail_now(UpstreamFailure::unreachable, ec, "socket");
      }
      impl->apply_mark(tsock->native_handle());
      if (impl->forget) clear_tcp_port(tsock->native_handle(), addr.is_v4());
      impl->link(this, round_no);
      tsock->async_connect(tcp::endpoint(addr, srv.port),
                           [self = shared_from_this(), s = serial](const error_code& e) { self->on_tcp_connect(s, e); });
      return;
    }
    // connect() binds a port the kernel picks at random from the ephemeral
    // range, and makes the kernel deliver datagrams from this server only.
    const bool v4 = addr.is_v4();
    const udp::endpoint to(addr, srv.port);
    int fd = impl->reuse(v4);
    if (fd < 0) {
      // Made by hand (non-blocking from the start, close-on-exec).
      fd = impl->open_udp(v4);
      if (fd < 0) {
        const int err = errno;
        if (err == EMFILE || err == ENFILE) return out_of_descriptors(err);
        return fail_now(UpstreamFailure::unreachable, error_code(err, boost::system::system_category()), "socket");
      }
    }
    ufd = fd;
    impl->watch(fd, shared_from_this());
    if (::connect(fd, to.data(), static_cast<socklen_t>(to.size())) != 0 || !send_udp()) {
      const error_code e(errno, boost::system::system_category());
      return fail_now(UpstreamFailure::unreachable, e, "send");
    }
    impl->link(this, round_no);
    impl->arm_udp();
  }

  // Sends the query on the connected ufd; false with errno. EPERM, with the
  // upstream in the sandbox's namespace: a sandbox query's flow from this
  // address and port to this server outlives its socket in conntrack (the UDP
  // timeout), and the kernel drew the port again for ufd. Conntrack took our
  // datagram for the sandbox's flow, redirected it to the proxy, and the
  // output chain denied it (one query in a few hundred after a burst failed
  // so). That entry goes, the same way an answered query's own flow goes,
  // and the datagram is sent again as a flow of its own. Deleting it harms
  // no one: its socket is closed (ufd holds the port), and what a raw
  // socket of the sandbox's sent on that tuple is the sandbox's loss.
  bool send_udp() {
    if (::send(ufd, query().data(), query().size(), 0) >= 0) return true;
    if (errno != EPERM || !impl->forget) return false;
    const auto flow = answered_flow();
    if (!flow) {
      errno = EPERM;
      return false;
    }
    impl->forget(std::span<const FlowTuple>(&*flow, 1));
    return ::send(ufd, query().data(), query().size(), 0) >= 0;
  }

  // The TCP twin of send_udp's case, where no send fails to tell: a sandbox
  // process leaves a conntrack entry on the port egressd's socket draws next
  // (a SYN to the server's port 53 that never reaches the proxy, from a
  // socket bound to a device or a raw one with a bad checksum: SYN_SENT for
  // two minutes), and egressd's SYN follows it to the proxy and is dropped,
  // again at each retransmission: the try times out. So the port is drawn
  // before the connect (bind to the source address the route gives, port 0)
  // and any entry on that flow, in either direction, deleted first. Best
  // effort: when a step fails the connect goes ahead as before.
  void clear_tcp_port(int fd, bool v4) {
    const Server& srv = impl->servers[server];
    const udp::endpoint to(impl->addrs[server], srv.port);
    // The source address: a connected UDP socket's, with the same mark.
    const int probe = impl->open_socket(v4 ? AF_INET : AF_INET6, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (probe < 0) return;
    impl->apply_mark(probe);
    std::optional<sockaddr_storage> src;
    if (::connect(probe, to.data(), static_cast<socklen_t>(to.size())) == 0) src = local_address(probe);
    ::close(probe);
    if (!src) return;
    if (v4) {
      reinterpret_cast<sockaddr_in&>(*src).sin_port = 0;
    } else {
      reinterpret_cast<sockaddr_in6&>(*src).sin6_port = 0;
    }
    const socklen_t len = v4 ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&*src), len) != 0) return;
    const auto bound = local_address(fd);
    if (!bound) return;
    const FlowTuple t = flow_from(*bound, srv, IPPROTO_TCP);
    impl->forget(std::span<const FlowTuple>(&t, 1));
  }

  // No descriptor for this try's socket: the account's share is held (the
  // agent's budget; EMFILE), or the process has none (EMFILE, ENFILE). No
  // other server or round would fare better now: the query fails at once
  // (SERVFAIL to the client) rather than queueing for a descriptor.
  void out_of_descriptors(int err) {
    failure = UpstreamFailure::descriptors;
    if (impl->refused) {
      error = "upstream: no descriptor for a socket: sandbox " + impl->fds->name() + " holds " +
              std::to_string(impl->fds->held()) + ", its share of the agent's (or the sandboxes together hold all)";
    } else {
      error = std::string("upstream: socket: ") + errno_text(err);
    }
    finish(Error::runtime(error));
  }

  // The socket of this try has something to read (Impl::on_udp_ready):
  // read into the shared buffer, no buffer per query.
  void on_udp() {
    if (finished || impl->closed || ufd < 0) return;
    const Server& srv = impl->servers[server];
    std::size_t n = 0;
    error_code ec;
    // recvmsg for the control message naming the datagram's destination,
    // which is this socket's address and port.
    alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(sockaddr_in6))> ctl{};
    iovec iov{impl->rbuf.get(), kUdpReceive};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.data();
    mh.msg_controllen = ctl.size();
    const ssize_t r = ::recvmsg(ufd, &mh, MSG_DONTWAIT);
    bool server_error = false;  // icmp_error_from read the queue already and found the server's
    if (r < 0) {
      // Nothing after all: the set reports it again when something comes.
      // Errors may still be queued (the set names the socket while any
      // is): read, so it stops naming it.
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        if (!icmp_error_from(ufd, impl->addrs[server])) return;
        server_error = true;
        ec = error_code(ECONNREFUSED, boost::system::system_category());
      } else {
        ec = error_code(errno, boost::system::system_category());
      }
    } else {
      n = static_cast<std::size_t>(r);
    }
    if (ec) {
      // ECONNREFUSED: an ICMP port unreachable for an earlier datagram.
      // Ends the try only when the server sent it (icmp_error_from); the
      // socket stays watched otherwise, its answer may still come.
      if (!server_error && !icmp_error_from(ufd, impl->addrs[server])) return;
      note(UpstreamFailure::unreachable, "upstream " + srv.to_string() + ": " + ec.message());
      return next_try();
    }
    const Bytes msg(impl->rbuf.get(), n);
    auto h = read_header(msg);
    if (!h || !h->qr() || h->id != id) {
      // Not an answer to this query: ignored, as c-ares did (the socket
      // stays watched). Only the server's address and port reach this
      // connected socket.
      return;
    }
    // No error pending: the socket may serve another query, from another
    // port, once this try ends.
    reusable = true;
    local.reset();
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
      const bool v4 = c->cmsg_level == SOL_IP && c->cmsg_type == IP_ORIGDSTADDR && c->cmsg_len >= CMSG_LEN(sizeof(sockaddr_in));
      const bool v6 =
          c->cmsg_level == SOL_IPV6 && c->cmsg_type == IPV6_ORIGDSTADDR && c->cmsg_len >= CMSG_LEN(sizeof(sockaddr_in6));
      if (!v4 && !v6) continue;
      sockaddr_storage ss{};
      std::memcpy(&ss, CMSG_DATA(c), v4 ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
      ss.ss_family = v4 ? AF_INET : AF_INET6;
      local = ss;
    }
    on_answer(msg, *h, false);
  }

  void on_tcp_connect(unsigned s, const error_code& ec) {
    if (s != serial || finished || impl->closed || ec == asio::error::operation_aborted) return;
    if (ec) {
      note(UpstreamFailure::unreachable, "upstream " + impl->servers[server].to_string() + " (tcp): " + ec.message());
      return next_try();
    }
    const std::size_t qn = out.size() - 2;
    out[0] = static_cast<std::uint8_t>(qn >> 8);
    out[1] = static_cast<std::uint8_t>(qn & 0xFF);
    asio::async_write(*tsock, asio::buffer(out), [self = shared_from_this(), s](const error_code& e, std::size_t) {
      if (s != self->serial || self->finished || self->impl->closed || e == asio::error::operation_aborted) return;
      if (e) {
        self->note(UpstreamFailure::unreachable,
                   "upstream " + self->impl->servers[self->server].to_string() + " (tcp): " + e.message());
        return self->next_try();
      }
      self->read_tcp_length(s);
    });
  }

  void read_tcp_length(unsigned s) {
    asio::async_read(*tsock, asio::buffer(len), [self = shared_from_this(), s](const error_code& e, std::size_t) {
      if (s != self->serial || self->finished || self->impl->closed || e == asio::error::operation_aborted) return;
      if (e) {
        self->note(UpstreamFailure::unreachable,
                   "upstream " + self->impl->servers[self->server].to_string() + " (tcp): " + e.message());
        return self->next_try();
      }
      self->buf.resize(static_cast<std::size_t>((self->len[0] << 8) | self->len[1]));
      asio::async_read(*self->tsock, asio::buffer(self->buf), [self, s](const error_code& e2, std::size_t) {
        if (s != self->serial || self->finished || self->impl->closed || e2 == asio::error::operation_aborted) return;
        if (e2) {
          self->note(UpstreamFailure::unreachable,
                     "upstream " + self->impl->servers[self->server].to_string() + " (tcp): " + e2.message());
          return self->next_try();
        }
        const Bytes msg(self->buf);
        auto h = read_header(msg);
        if (!h || !h->qr() || h->id != self->id) {
          self->note(UpstreamFailure::unreachable,
                     "upstream " + self->impl->servers[self->server].to_string() + " (tcp): answer with another ID");
          return self->next_try();
        }
        self->on_answer(msg, *h, true);
      });
    });
  }

  void on_answer(Bytes msg, const Header& h, bool over_tcp) {
    const Server& srv = impl->servers[server];
    if (!echoes_query(msg, id, question())) {
      // Right ID, wrong question: someone who does not know the query's
      // 0x20 case (or a broken server). Never learned from; the query fails
      // rather than waiting for a second guess.
      failure = UpstreamFailure::mismatch;
      error = "upstream " + srv.to_string() +
              ": answer does not echo the query's question exactly (0x20 check); rejected";
      return finish(Error::runtime(error));
    }
    if (h.tc() && !over_tcp) {
      // Too big for UDP: the same server over TCP, a fresh timeout.
      const int round_no = round < 0 ? 0 : round;
      impl->unlink(this);
      close_sockets();
      ++serial;
      return start(round_no, true);
    }
    const Rcode rc = h.rcode();
    if (rc == Rcode::servfail || rc == Rcode::refused || rc == Rcode::notimp) {
      // This server will not answer this query: the next one may.
      skip |= std::uint64_t{1} << server;
      note(UpstreamFailure::rcode, "upstream " + srv.to_string() + " answered " + to_string(rc));
      return next_try();
    }
    finish(msg);
  }
};

void Upstream::Impl::link(Exchange* x, int round_no) {
  unlink(x);
  x->round = round_no;
  x->deadline = Clock::now() + first * (1 << round_no);
  List& l = waiting[static_cast<std::size_t>(round_no)];
  x->prev = l.tail;
  x->nxt = nullptr;
  if (l.tail != nullptr) {
    l.tail->nxt = x;
  } else {
    l.head = x;
  }
  l.tail = x;
  arm_timer();
}

void Upstream::Impl::unlink(Exchange* x) {
  if (x->round < 0) return;
  List& l = waiting[static_cast<std::size_t>(x->round)];
  if (x->prev != nullptr) {
    x->prev->nxt = x->nxt;
  } else {
    l.head = x->nxt;
  }
  if (x->nxt != nullptr) {
    x->nxt->prev = x->prev;
  } else {
    l.tail = x->prev;
  }
  x->prev = x->nxt = nullptr;
  x->round = -1;
}

void Upstream::Impl::recycle(int fd, bool v4) {
  auto& pool = v4 ? pool4 : pool6;
  sockaddr unspec{};
  unspec.sa_family = AF_UNSPEC;
  // Disconnecting an autobound UDP socket unhashes it and clears its port
  // (__udp_disconnect): nothing more reaches it until the next connect.
  if (pool.size() >= kPoolMax || ::connect(fd, &unspec, sizeof unspec) != 0) {
    close_udp(fd);
    return;
  }
  dirty[static_cast<std::size_t>(fd)] = false;
  pool.push_back({fd, polls, ticks});
  arm_trim();
}

void Upstream::Impl::arm_trim() {
  if (trim_armed || closed) return;
  trim_armed = true;
  trim_timer.expires_after(pool_idle);
  trim_timer.async_wait([self = shared_from_this()](const error_code& ec) {
    self->trim_armed = false;
    if (ec || self->closed) return;
    self->trim();
  });
}

void Upstream::Impl::trim() {
  // Pooled before the last expiry and not taken since: unused for a whole
  // tick at least.
  for (auto* pool : {&pool4, &pool6}) {
    const auto keep = std::find_if(pool->begin(), pool->end(), [this](const Pooled& p) { return p.tick >= ticks; });
    for (auto it = pool->begin(); it != keep; ++it) close_udp(it->fd);
    pool->erase(pool->begin(), keep);
  }
  ++ticks;
  if (!pool4.empty() || !pool6.empty()) arm_trim();
}

void Upstream::Impl::release_later(const FlowTuple& t, int fd, bool v4) {
  to_forget.push_back(t);
  to_recycle.push_back({fd, v4});
  if (release_posted) return;
  release_posted = true;
  asio::post(io, [self = shared_from_this()] { self->release(); });
}

void Upstream::Impl::release() {
  release_posted = false;
  if (!to_forget.empty()) {
    forget(to_forget);
    to_forget.clear();
  }
  for (const Released& r : to_recycle) {
    if (closed) {
      close_udp(r.fd);
    } else {
      recycle(r.fd, r.v4);
    }
  }
  to_recycle.clear();
}

bool Upstream::Impl::drain(int fd) {
  // ICMP errors first (IP_RECVERR queues them, for a pooled socket too): the
  // set names a socket while any is queued. Bounded by the socket's receive
  // buffer; a socket still not empty is taken out of the set, and closed
  // when reuse() comes to it.
  std::array<std::uint8_t, 64> err{};
  bool errors_empty = false;
  for (int i = 0; i < 1024; ++i) {
    iovec iov{err.data(), err.size()};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (::recvmsg(fd, &mh, MSG_ERRQUEUE | MSG_DONTWAIT) < 0) {
      errors_empty = true;
      break;
    }
  }
  if (errors_empty) {
    for (int i = 0; i < 64; ++i) {
      const ssize_t r = ::recv(fd, rbuf.get(), kUdpReceive, MSG_DONTWAIT);
      if (r >= 0) ++stale;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    }
  }
  (void)::epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
  return false;
}

int Upstream::Impl::poll(Events& evs) {
  const int n = ::epoll_wait(ep, evs.data(), static_cast<int>(evs.size()), 0);
  if (n < 0) return 0;
  // A full array may have left sockets unnamed: no statement about the rest.
  if (static_cast<std::size_t>(n) < evs.size()) ++polls;
  // Pooled sockets (disconnected: only what came before) are drained now,
  // before any answer can start a query that takes one from the pool as
  // empty, so the level-triggered set stops naming them; one that does not
  // run empty is never reused. Sockets a try waits on stay ready for
  // on_udp_ready.
  for (int i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(evs[static_cast<std::size_t>(i)].data.fd);
    if (k < ours.size() && ours[k] && !owner.contains(static_cast<int>(k)) && !drain(static_cast<int>(k))) dirty[k] = true;
  }
  return n;
}

void Upstream::Impl::poll_pooled() {
  Events evs{};
  (void)poll(evs);
}

int Upstream::Impl::reuse(bool v4) {
  auto& pool = v4 ? pool4 : pool6;
  while (!pool.empty()) {
    if (pool.back().at >= polls) poll_pooled();
    const Pooled p = pool.back();
    pool.pop_back();
    const auto k = static_cast<std::size_t>(p.fd);
    // No complete wait since its disconnect (a full array twice): read it.
    if (!dirty[k] && (p.at < polls || drain(p.fd))) return p.fd;
    close_udp(p.fd);
  }
  return -1;
}

int Upstream::Impl::open_udp(bool v4) {
  if (!charge()) {
    errno = EMFILE;  // this account's share of the budget
    return -1;
  }
  const int fd = open_socket(v4 ? AF_INET : AF_INET6, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    uncharge();
    errno = err;
    return -1;
  }
  apply_mark(fd);
  // Each answer names its destination, this socket's address and port
  // (what close_sockets hands to forget); without it, a getsockname.
  const int one = 1;
  (void)::setsockopt(fd, v4 ? SOL_IP : SOL_IPV6, v4 ? IP_RECVORIGDSTADDR : IPV6_RECVORIGDSTADDR, &one, sizeof one);
  // ICMP errors with their sender (icmp_error_from); without it none ends a try early.
  (void)::setsockopt(fd, v4 ? SOL_IP : SOL_IPV6, v4 ? IP_RECVERR : IPV6_RECVERR, &one, sizeof one);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  if (::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
    const int err = errno;
    ::close(fd);
    uncharge();
    errno = err;
    return -1;
  }
  const auto i = static_cast<std::size_t>(fd);
  if (ours.size() <= i) {
    ours.resize(i + 1, false);
    dirty.resize(i + 1, false);
  }
  ours[i] = true;
  return fd;
}

void Upstream::Impl::close_udp(int fd) {
  // Closing the last reference takes it out of the epoll set.
  ours[static_cast<std::size_t>(fd)] = false;
  ::close(fd);
  uncharge();
}

void Upstream::Impl::watch(int fd, std::shared_ptr<Exchange> x) {
  auto& o = owner[fd];
  if (!o) ++watching;
  o = std::move(x);
}

void Upstream::Impl::unwatch(int fd) {
  // The caller holds the exchange: resetting here never destroys it.
  const auto it = owner.find(fd);
  if (it == owner.end()) return;
  if (it->second) --watching;
  owner.erase(it);
}

void Upstream::Impl::arm_udp() {
  if (ep_armed || watching == 0 || closed) return;
  ep_armed = true;
  ep_desc->async_wait(asio::posix::stream_descriptor::wait_read, [self = shared_from_this()](const error_code& ec) {
    self->ep_armed = false;
    if (ec || self->closed) return;
    self->on_udp_ready();
    self->arm_udp();
  });
}

void Upstream::Impl::on_udp_ready() {
  Events evs{};
  const int n = poll(evs);
  for (int i = 0; i < n && !closed; ++i) {
    const auto k = static_cast<std::size_t>(evs[static_cast<std::size_t>(i)].data.fd);
    // An earlier answer of this batch may have ended the try (its socket
    // closed or pooled, or taken by another query, which reads nothing).
    if (k >= ours.size() || !ours[k]) continue;
    const auto it = owner.find(static_cast<int>(k));
    if (it == owner.end() || !it->second) continue;
    std::shared_ptr<Exchange> x = it->second;  // on_udp may unwatch it
    x->on_udp();
  }
}

// Invariant: while any try waits, the timer is armed no later than the
// earliest deadline. A try that ends early leaves the timer where it was; it
// then fires once for nothing and re-arms for the next head.
void Upstream::Impl::arm_timer() {
  if (closed) return;
  std::optional<Clock::time_point> earliest;
  for (const List& l : waiting) {
    if (l.head != nullptr && (!earliest || l.head->deadline < *earliest)) earliest = l.head->deadline;
  }
  if (!earliest) return;
  if (timer_armed && timer_at <= *earliest) return;
  timer_armed = true;
  timer_at = *earliest;
  timer.expires_at(*earliest);
  timer.async_wait([self = shared_from_this(), at = *earliest](const error_code& ec) {
    if (ec || self->closed || self->timer_at != at) return;
    self->timer_armed = false;
    self->on_timer();
  });
}

void Upstream::Impl::on_timer() {
  const auto now = Clock::now();
  for (List& l : waiting) {
    while (l.head != nullptr && l.head->deadline <= now && !closed) {
      std::shared_ptr<Exchange> x = l.head->shared_from_this();
      const std::string what = x->tsock ? " (tcp)" : "";
      x->note(UpstreamFailure::timeout, "upstream " + servers[x->server].to_string() + what + ": no answer within " +
                                            std::to_string((first * (1 << x->round)).count()) + " ms");
      x->next_try();  // unlinks it
    }
  }
  arm_timer();
}

void Upstream::Impl::close() {
  if (closed) return;
  closed = true;
  release();  // flows forgotten, then their sockets closed
  error_code ec;
  timer.cancel();
  trim_timer.cancel();
  for (auto* pool : {&pool4, &pool6}) {
    for (const Pooled& p : *pool) close_udp(p.fd);
    pool->clear();
  }
  for (List& l : waiting) {
    while (l.head != nullptr) {
      const std::shared_ptr<Exchange> x = l.head->shared_from_this();
      unlink(x.get());
      x->finished = true;
      x->done = nullptr;  // abandoned: destroyed, never called
      x->close_sockets();
    }
  }
  if (ep_desc) ep_desc->close(ec);
}

Result<std::unique_ptr<Upstream>> Upstream::create(asio::io_context& io, const UpstreamOptions& opts) {
  if (opts.servers.empty()) return Error::invalid("upstream: no name servers configured");
  if (opts.servers.size() > 64) return Error::invalid("upstream: more than 64 name servers");
  auto impl = std::make_shared<Impl>(io);
  for (const std::string& s : opts.servers) {
    auto server = parse_server(s);
    if (!server) return server.error();
    impl->servers.push_back(*server);
    impl->addrs.push_back(to_address(server->ip));
  }
  impl->usable.assign(impl->servers.size(), true);
  impl->unusable_why.assign(impl->servers.size(), "");
  impl->mark = opts.mark;
  impl->socket_opener = opts.open_socket;
  impl->forget = opts.forget;
  impl->pool_idle = opts.pool_idle;
  impl->fds = opts.fds;
  impl->first = first_try(opts.timeout, impl->servers.size());
  impl->ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (impl->ep < 0) return Error::runtime(std::string("upstream: epoll_create1: ") + errno_text(errno));
  impl->ep_desc.emplace(io, impl->ep);
  return std::unique_ptr<Upstream>(new Upstream(std::move(impl)));
}

Upstream::Upstream(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Upstream::~Upstream() { impl_->close(); }

asio::io_context::executor_type Upstream::executor() const { return impl_->io.get_executor(); }

void Upstream::send(Bytes query, AnswerCallback done, bool tcp, MayRetry may_retry) {
  Impl& s = *impl_;
  if (s.closed) {
    s.last_failure = UpstreamFailure::closed;
    done(Error::runtime("upstream: closed"));
    return;
  }
  const std::size_t qend = question_end(query);
  if (qend == 0 || query.size() > kMaxMessage) {
    s.last_failure = UpstreamFailure::unreachable;
    done(Error::runtime("upstream: not a query with one question"));
    return;
  }
  auto x = std::make_shared<Exchange>(impl_, std::move(done));
  x->out.reserve(query.size() + 2);
  x->out.push_back(0);
  x->out.push_back(0);
  x->out.insert(x->out.end(), query.begin(), query.end());
  x->id = read_header(query)->id;
  x->question_len = qend - kHeaderSize;
  x->force_tcp = tcp;
  x->may_retry = std::move(may_retry);
  ++s.pending;
  x->next_try();
}

UpstreamFailure Upstream::last_failure() const { return impl_->last_failure; }

void Upstream::set_usable(std::size_t i, bool usable, std::string why) {
  if (i >= impl_->servers.size()) return;
  impl_->usable[i] = usable;
  impl_->unusable_why[i] = usable ? std::string() : std::move(why);
}

bool Upstream::usable(std::size_t i) const { return i < impl_->usable.size() && impl_->usable[i]; }

void Upstream::set_mark(std::uint32_t mark) {
  if (mark == impl_->mark) return;
  impl_->mark = mark;
  // Pooled sockets carry the old mark.
  for (auto* pool : {&impl_->pool4, &impl_->pool6}) {
    for (const auto& p : *pool) impl_->close_udp(p.fd);
    pool->clear();
  }
}

std::uint16_t Upstream::random_id() {
  std::uint8_t b[2];
  impl_->random_bytes(b, 2);
  return static_cast<std::uint16_t>((b[0] << 8) | b[1]);
}

void Upstream::random_case(std::span<std::uint8_t, kCaseBits> out) { impl_->random_bytes(out.data(), out.size()); }

std::size_t Upstream::pending() const { return impl_->pending; }

std::uint64_t Upstream::stale_dropped() const { return impl_->stale; }

std::size_t Upstream::sockets() const { return impl_->nsockets; }

const std::vector<Server>& Upstream::servers() const { return impl_->servers; }

std::vector<std::uint16_t> Upstream::open_ports() const {
  std::vector<std::uint16_t> ports;
  for (const auto& l : impl_->waiting) {
    for (const Exchange* x = l.head; x != nullptr; x = x->nxt) {
      error_code ec;
      if (const auto ss = x->ufd >= 0 ? local_address(x->ufd) : std::nullopt) ports.push_back(port_of(*ss));
      if (x->tsock) {
        auto ep = x->tsock->local_endpoint(ec);
        if (!ec) ports.push_back(ep.port());
      }
    }
  }
  return ports;
}

}  // namespace egressd::dns
