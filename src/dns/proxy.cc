// The DNS proxy (DESIGN §1 "DNS proxy"). One Core per sandbox holds the
// sockets, the upstream channel and the counters; every handler holds a
// shared_ptr to it, so a handler that completes after close() finds a live
// (closed) object instead of freed memory.
//
// Single-threaded: everything runs on the thread that runs the io_context,
// PolicyHooks included.
//
// Over 1,400 lines because the proxy is one object with one set of limits:
// the UDP and TCP listeners, the per-query coroutine and its answer path,
// Docker's forwarder relay and probe, and pre-resolution all share Core's
// in-flight accounting and its close(); each part is a few functions.
#include "dns/proxy.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/udp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <linux/netfilter_ipv4.h>
#include <linux/netfilter_ipv6/ip6_tables.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <optional>
#include <spdlog/spdlog.h>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "dns/log.h"
#include "dns/message.h"
#include "dns/upstream.h"
#include "egressd/socket_owner.h"

namespace egressd::dns {

namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;
using boost::system::error_code;
using udp = asio::ip::udp;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

void ProxyCounters::answered(std::uint64_t us) {
  std::size_t i = 0;
  while (i < kAnswerBucketsUs.size() && us > kAnswerBucketsUs[i]) ++i;
  ++answer_buckets[i];
  ++answer_count;
  answer_sum_us += us;
}

namespace {

std::uint64_t micros_since(Clock::time_point start) {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
  return us > 0 ? static_cast<std::uint64_t>(us) : 0;
}

// Queries read from one TCP connection and not yet answered (or answers not
// yet written): beyond this the connection is not read until some drain, so
// a client that never reads cannot grow our memory.
constexpr std::size_t kMaxPipeline = 16;
// Answers queued for one sandbox's TCP clients, in bytes (TcpConn::send).
constexpr std::size_t kMaxTcpQueued = 1 << 20;
// Lines per second per kind of per-query event at info/warn level; the
// sandbox controls the query rate and must not control the log volume.
constexpr unsigned kLogBurst = 50;
// How many times Docker's forwarder (or a copy of its query) may be relayed
// for one of egressd's in-flight queries: Docker tries each of its (at most
// 3) servers, over UDP and again over TCP when an answer is truncated. A
// sandbox process that copies egressd's query cannot multiply it further.
constexpr int kMaxRelaysPerQuery = 8;
// TCP connections the proxy accepts beyond max_tcp_connections while a
// forwarder probe is in flight: Docker's forwarded copy of the probe must
// find room even when the sandbox holds every ordinary slot (issue 14,
// finding F2: a sandbox that filled the slots had Docker's copy closed at
// accept and answered the probe alone). A probe that had to close a
// connection anyway counts nothing.
constexpr std::size_t kProbeReserve = 8;

// The original destination of a connection the nat table redirected to us
// (SO_ORIGINAL_DST): where the peer meant to send its query.
std::optional<Server> socket_original_dst(int fd, bool v6) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  const int rc = v6 ? ::getsockopt(fd, SOL_IPV6, IP6T_SO_ORIGINAL_DST, &ss, &len)
                    : ::getsockopt(fd, SOL_IP, SO_ORIGINAL_DST, &ss, &len);
  if (rc != 0) return std::nullopt;
  Server s;
  if (ss.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    s.ip.family = 4;
    s.ip.prefix_len = 32;
    std::memcpy(s.ip.bytes.data(), &in->sin_addr, 4);
    s.port = ntohs(in->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    s.ip.family = 6;
    s.ip.prefix_len = 128;
    std::memcpy(s.ip.bytes.data(), &in6->sin6_addr, 16);
    s.port = ntohs(in6->sin6_port);
  } else {
    return std::nullopt;
  }
  return s;
}

// "uid 65534, inode 4711, pid 42 (python3)": who holds `addr` (bound, UDP
// or TCP), read from /proc/net/* of the current namespace and, for the
// process, from /proc/<pid>/fd. "" when nothing is found (the socket may be
// gone already).
std::string describe_holder(const Server& addr, bool tcp) {
  // /proc/net/{udp,tcp}[6] print the local address as the kernel's bytes in
  // host order per 32-bit word, in hex, then the port.
  char want[64];
  const auto& b = addr.ip.bytes;
  if (addr.ip.family == 4) {
    std::snprintf(want, sizeof want, "%02X%02X%02X%02X:%04X", b[3], b[2], b[1], b[0], addr.port);
  } else {
    int n = 0;
    for (int w = 0; w < 4; ++w) {
      n += std::snprintf(want + n, sizeof want - static_cast<std::size_t>(n), "%02X%02X%02X%02X", b[w * 4 + 3],
                         b[w * 4 + 2], b[w * 4 + 1], b[w * 4]);
    }
    std::snprintf(want + n, sizeof want - static_cast<std::size_t>(n), ":%04X", addr.port);
  }
  const std::string table =
      std::string("/proc/thread-self/net/") + (tcp ? "tcp" : "udp") + (addr.ip.family == 6 ? "6" : "");
  std::ifstream in(table);
  std::string line;
  std::string uid, inode;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string sl, local, remote, st, queues, tr, retr;
    ls >> sl >> local >> remote >> st >> queues >> tr >> retr >> uid;
    std::string timeout;
    ls >> timeout >> inode;
    if (local == want) break;
    uid.clear();
    inode.clear();
  }
  if (inode.empty()) return "";
  std::string out = "uid " + uid + ", inode " + inode;
  if (const std::string who = process_holding_socket(inode); !who.empty()) out += ", " + who;
  return out;
}

class Core;
class TcpConn;

// Where an answer goes: a UDP peer (with its payload limit) or a TCP connection.
struct Client {
  udp::socket* udp_sock = nullptr;
  udp::endpoint peer;
  std::size_t limit = kClassicUdpSize;
  std::shared_ptr<TcpConn> tcp;
};

// The receive buffer of the proxy's UDP sockets (bytes; see bind_all).
constexpr int kListenerRcvbuf = 1 << 20;

// Datagrams taken per recvmmsg(2), and at most this many replies per
// sendmmsg(2): one system call for what arrived together (issue 17).
constexpr unsigned kMmsgBatch = 16;

// The receive slots of recvmmsg. Every slot is one byte over the largest
// query accepted (a datagram that fills it was cut short and is dropped).
// One set per thread, not per proxy: an agent's hundreds of proxies share
// its loop thread, and each drain parses what it received before the next
// one runs (nothing keeps a span into a slot: what outlives handle() is
// copied). Not zero-filled: only the bytes the kernel writes are touched.
struct RecvSlots {
  static constexpr std::size_t kSlot = kMaxUdpSize + 1;
  std::unique_ptr<std::uint8_t[]> bytes{new std::uint8_t[kSlot * kMmsgBatch]};
  std::array<mmsghdr, kMmsgBatch> msgs{};
  std::array<iovec, kMmsgBatch> iov{};
  std::array<sockaddr_storage, kMmsgBatch> from{};

  std::uint8_t* slot(unsigned i) { return bytes.get() + i * kSlot; }
  void arm() {
    for (unsigned i = 0; i < kMmsgBatch; ++i) {
      iov[i] = iovec{slot(i), kSlot};
      msgs[i] = mmsghdr{};
      msgs[i].msg_hdr.msg_name = &from[i];
      msgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_storage);
      msgs[i].msg_hdr.msg_iov = &iov[i];
      msgs[i].msg_hdr.msg_iovlen = 1;
    }
  }
};

RecvSlots& recv_slots() {
  thread_local std::unique_ptr<RecvSlots> slots;
  if (!slots) slots = std::make_unique<RecvSlots>();
  return *slots;
}

// At most kLogBurst lines per second; says how many it swallowed.
class LogLimit {
 public:
  // True when a line may be written now; `suppressed` is set to the number
  // swallowed since the last line written.
  bool allow(Clock::time_point now, unsigned& suppressed) {
    if (now - window_ >= std::chrono::seconds(1)) {
      window_ = now;
      count_ = 0;
    }
    if (count_ >= kLogBurst) {
      ++dropped_;
      return false;
    }
    ++count_;
    suppressed = dropped_;
    dropped_ = 0;
    return true;
  }

 private:
  Clock::time_point window_{};
  unsigned count_ = 0;
  unsigned dropped_ = 0;
};

// A forwarded query between the upstream send and the answer's release.
struct Pending {
  Pending(std::shared_ptr<Core> c, Client cl) : core(std::move(c)), client(std::move(cl)) {}
  ~Pending();
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;

  std::shared_ptr<Core> core;
  Client client;
  Header header;                    // the client's header (its ID included)
  std::vector<std::uint8_t> prefix; // the client's header + question bytes, unmodified
  std::string qname;
  std::uint16_t qtype = 0;
  bool client_edns = false;   // the client sent an OPT: it may get one back
  bool relay = false;         // Docker's forwarder relayed to the target, not a sandbox query
  std::string key;            // the question bytes sent upstream, while registered as in flight
  Clock::time_point start;
  bool done = false;
};

class TcpConn : public std::enable_shared_from_this<TcpConn> {
 public:
  TcpConn(std::shared_ptr<Core> core, tcp::socket sock);
  void start();
  // Queues one framed answer; dropped when the connection is closed.
  void send(std::vector<std::uint8_t> msg);
  void close();
  // Where this connection stands in the order of accepted connections
  // (Core::tcp_opened): the forwarder probe counts only copies on
  // connections accepted after it was sent.
  std::uint64_t seq() const { return seq_; }
  void query_started() { ++pending_; }
  void query_finished();
  int native_handle() { return sock_.native_handle(); }
  bool v6() const {
    error_code ec;
    auto ep = sock_.local_endpoint(ec);
    return !ec && ep.address().is_v6();
  }

 private:
  awaitable<void> read_loop();
  awaitable<void> watchdog();
  void write_next();
  void touch();
  // After the peer stopped sending: closes once every answer is written.
  void maybe_finish();

  std::shared_ptr<Core> core_;
  tcp::socket sock_;
  asio::steady_timer idle_;
  asio::steady_timer wake_;  // cancelled to wake a read loop waiting for the pipeline to drain
  Clock::time_point deadline_;
  std::deque<std::vector<std::uint8_t>> out_;
  bool writing_ = false;
  bool read_done_ = false;  // the peer half-closed (or sent a broken frame)
  bool closed_ = false;
  std::size_t pending_ = 0;
  std::uint64_t seq_ = 0;
};

class Core : public std::enable_shared_from_this<Core> {
 public:
  Core(asio::io_context& io, ProxyOptions opts, PolicyHooks& hooks)
      : io_(io), opts_(std::move(opts)), hooks_(hooks), log_(dns_logger()), own_timer_(io), probe_timer_(io) {}

  // Binds every socket (proxy and owned upstreams); serve() starts the loops.
  Status bind();
  void set_forwarder(ForwarderOptions f) {
    if (!serving_) opts_.forwarder = std::move(f);
  }
  void serve(std::uint32_t own_mark, std::uint32_t proxy_mark);
  void set_mark(int fd, std::uint32_t mark) {
    if (::setsockopt(fd, SOL_SOCKET, SO_MARK, &mark, sizeof mark) != 0) {
      log_->error("event=proxy_mark_failed error=\"{}\"", std::strerror(errno));
    }
  }
  void close();
  bool closed() const { return closed_; }
  std::uint16_t port() const { return port_; }
  bool port_fell_back() const { return port_fell_back_; }
  std::vector<ListenerSocket> listeners() const {
    std::vector<ListenerSocket> out;
    const auto add = [&out](auto& sock, bool udp) {
      error_code ec;
      const auto ep = sock.local_endpoint(ec);
      if (sock.is_open() && !ec) out.push_back({ep.address().is_v4() ? AF_INET : AF_INET6, udp});
    };
    for (const auto& a : acceptors_) add(*a, false);
    for (const auto& u : udp_) add(*u, true);
    return out;
  }
  ProxyCounters counters() const {
    ProxyCounters c = counters_;
    c.inflight = inflight_;
    if (upstream_) c.stale = upstream_->stale_dropped();
    if (upstream_) c.upstream_sockets = upstream_->sockets() + (relay_ ? relay_->sockets() : 0);
    return c;
  }
  void resolve(const std::string& name, std::function<void(Result<std::vector<Learned>>)> done);

  // One query from a client (not modified).
  void handle(std::span<std::uint8_t> msg, const Client& client);
  void reply(const Client& client, std::vector<std::uint8_t> answer);

  void malformed() { ++counters_.malformed; }
  spdlog::logger& log() { return *log_; }
  asio::io_context& io() { return io_; }
  const ProxyOptions& opts() const { return opts_; }
  // Room for one more accepted connection; beyond max_tcp_connections only
  // while a probe is in flight (kProbeReserve). A connection closed at
  // accept during a probe voids it: it may have been Docker's copy.
  bool tcp_slot();
  // Returns the connection's place in the order of accepted connections.
  // An accepted connection is a descriptor of the agent's too: charged to
  // the sandbox's account (accept_loop) and credited when it closes.
  std::uint64_t tcp_opened(TcpConn* c) {
    tcp_.insert(c);
    return ++tcp_accepted_;
  }
  void tcp_closed(TcpConn* c) {
    if (tcp_.erase(c) != 0 && opts_.fd_account) opts_.fd_account->give();
  }
  // Answers queued for the sandbox's TCP clients, in bytes, across its
  // connections (TcpConn::send).
  std::size_t& tcp_queued() { return tcp_queued_; }
  void inflight_done() { --inflight_; }
  // A query registered in flight (Pending::key) has ended.
  void unregister(const std::string& key, bool own = false);

 private:
  // One upstream server that is local to the namespace, on port 53: the
  // proxy holds its address (UDP and TCP) so that nobody else can.
  struct Owned {
    std::size_t index = 0;  // in upstream_->servers()
    Server server;
    std::unique_ptr<udp::socket> usock;
    std::unique_ptr<tcp::socket> tsock;
    bool held = false;      // someone else had it at the last try
    std::string holder;     // who, as describe_holder() said
  };
  // Docker's forwarder copies of egressd's queries in flight to a local
  // upstream: how many of egressd's queries carry these question bytes, and
  // how many copies were relayed for them.
  struct InFlight {
    int queries = 0;
    int relays = 0;
    int own = 0;  // of `queries`, egressd's own (resolve(): pre-resolution for a switch)
  };
  // The forwarder probe (ForwarderOptions::probe).
  struct Probe {
    std::string key;        // its question bytes
    int arrivals = 0;       // copies seen at the proxy
    std::optional<Server> dst;  // where the (last) TCP copy was going
    bool answered = false;  // egressd's probe has its answer (or failed)
    // The token the proxy put in its answer to each copy (probe_answer).
    std::vector<std::string> tokens;
    // ... and egressd's probe got one of them back: it is the proxy's own
    // answer, come back through the resolver, so the copy that arrived is
    // the one the resolver sent. (An NXDOMAIN alone proves nothing: a
    // resolver that forwards from outside the namespace gets one from its
    // upstream for the same name.)
    bool token_back = false;
    // ... and no answer came at all (timeout, unreachable): this error.
    std::string failed;
    // Connections with a TcpConn::seq() above this were accepted after the
    // probe was sent: only a copy on one of them can be Docker's.
    std::uint64_t conns_before = 0;
    // Why the probe counts nothing (it may have been suppressed or copied
    // by the sandbox); empty while it may still pin.
    std::string void_reason;
    std::unique_ptr<Upstream> upstream;
  };

  Status bind_all(std::uint16_t port, error_code& in_use);
  // Binds servers()[i]'s address on port 53; classifies the result.
  void try_own(Owned& o, bool first);
  void own_local_upstreams();
  void retry_owned();
  // `self` keeps the Core alive for as long as the loop runs.
  awaitable<void> udp_loop(std::shared_ptr<Core> self, udp::socket& sock);
  awaitable<void> accept_loop(std::shared_ptr<Core> self, tcp::acceptor& acc);
  void answer_local(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client, Rcode rcode);
  void forward(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client);
  // One forwarded (or, with p->relay, relayed) query: its exchange with the
  // upstream (the relay target), then the answer or SERVFAIL to the client.
  // The upstream is looked up when the query is handed on: one closed or
  // replaced since abandons the query, as it abandons those in flight.
  void exchange(std::shared_ptr<Pending> p, std::vector<std::uint8_t> query);
  void relay(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client, InFlight& entry);
  void on_upstream(const std::shared_ptr<Pending>& p, Answer r);
  // The client's view of an upstream answer: its ID and question bytes, TTLs
  // capped, no OPT unless it sent one. Error when the answer cannot be walked.
  Result<std::vector<std::uint8_t>> client_view(const Pending& p, std::vector<std::uint8_t> answer,
                                                std::size_t answer_question_end);
  void release(const std::shared_ptr<Pending>& p, std::vector<std::uint8_t> answer, std::size_t learned);
  void fail(const std::shared_ptr<Pending>& p, std::string_view why);
  void servfail_now(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client, std::string_view why);

  // Docker's forwarder.
  void start_probe();
  void probe_arrival(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client);
  // `prefix` and `bytes` random bytes (the upstream's CSPRNG) in hex: probe names and tokens.
  std::string random_label(std::string_view prefix, std::size_t bytes);
  void finish_probe();
  void pin(std::vector<Server> targets, const std::string& source);
  void schedule_probe();
  // Marks the probe in flight as counting nothing (the first reason is kept).
  void void_probe(std::string reason);

  asio::io_context& io_;
  ProxyOptions opts_;
  PolicyHooks& hooks_;
  std::shared_ptr<spdlog::logger> log_;
  std::unique_ptr<Upstream> upstream_;
  std::vector<std::unique_ptr<udp::socket>> udp_;
  std::vector<std::unique_ptr<tcp::acceptor>> acceptors_;
  std::unordered_set<TcpConn*> tcp_;
  std::uint64_t tcp_accepted_ = 0;
  std::size_t tcp_queued_ = 0;  // tcp_queued()
  ProxyCounters counters_;
  std::size_t inflight_ = 0;
  std::uint16_t port_ = 0;
  bool port_fell_back_ = false;
  bool serving_ = false;
  bool closed_ = false;
  std::uint32_t own_mark_ = 0;
  std::uint32_t proxy_mark_ = 0;  // SO_MARK of the proxy's own sockets
  LogLimit refuse_log_, fail_log_, bad_log_, relay_log_;

  std::vector<Owned> owned_;
  asio::steady_timer own_timer_;
  // True when an upstream is local to the namespace (owned, or loopback):
  // only then can a forwarder there relay egressd's queries back to it, and
  // only then are in-flight questions registered.
  bool loop_watch_ = false;
  struct KeyHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, InFlight, KeyHash, std::equal_to<>> inflight_q_;
  // Relay targets, once the kernel exempts egressd's traffic to them.
  std::unique_ptr<Upstream> relay_;
  std::vector<Server> relay_targets_;
  std::optional<Probe> probe_;
  // Copies that arrived while the probe runs: relayed once it pins a
  // target, SERVFAIL if it does not (bounded).
  std::vector<std::pair<std::vector<std::uint8_t>, Client>> waiting_relays_;
  void flush_waiting(bool pinned);
  // UDP replies of this turn of the loop (Core::reply), sent by flush_outbox.
  struct OutReply {
    udp::socket* sock;
    udp::endpoint peer;
    std::vector<std::uint8_t> bytes;
  };
  std::vector<OutReply> outbox_;
  void flush_outbox();
  asio::steady_timer probe_timer_;
  bool probe_scheduled_ = false;
  Clock::time_point last_probe_{};
  // A probe got its answer and no copy arrived: the local upstream forwards
  // from outside the namespace (Docker < 25 with the host's resolver on the
  // host's loopback). A copy of egressd's query can then only be a sandbox
  // process's (it sniffed loopback), so it must not start a new probe: the
  // sandbox would answer that one alone and choose the target (finding F3).
  bool forwards_outside_ = false;
};

void log_exception(std::exception_ptr e) {
  if (!e) return;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    dns_logger()->error("event=task_failed error=\"{}\"", ex.what());
  }
}

Pending::~Pending() {
  // Whatever path ends a forwarded query (answered, failed, or abandoned by
  // close()), its slots are given back exactly once.
  core->inflight_done();
  if (!key.empty()) core->unregister(key);
  if (client.tcp) client.tcp->query_finished();
}

// A query registered in flight (Core::inflight_q_) for as long as it lives.
struct Registration {
  Registration(std::shared_ptr<Core> c, std::string k) : core(std::move(c)), key(std::move(k)) {}
  ~Registration() { core->unregister(key, true); }
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  std::shared_ptr<Core> core;
  std::string key;
};

// ---------------------------------------------------------------- TCP

TcpConn::TcpConn(std::shared_ptr<Core> core, tcp::socket sock)
    : core_(std::move(core)), sock_(std::move(sock)), idle_(core_->io()), wake_(core_->io()) {}

void TcpConn::start() {
  seq_ = core_->tcp_opened(this);
  touch();
  asio::co_spawn(core_->io(), [self = shared_from_this()] { return self->read_loop(); }, log_exception);
  asio::co_spawn(core_->io(), [self = shared_from_this()] { return self->watchdog(); }, log_exception);
}

void TcpConn::touch() { deadline_ = Clock::now() + core_->opts().tcp_idle; }

awaitable<void> TcpConn::read_loop() {
  auto self = shared_from_this();
  std::vector<std::uint8_t> buf;
  error_code ec;
  while (!closed_) {
    while (pending_ + out_.size() >= kMaxPipeline && !closed_) {
      wake_.expires_at(Clock::time_point::max());
      co_await wake_.async_wait(asio::redirect_error(use_awaitable, ec));
    }
    if (closed_) break;
    std::uint8_t len[2];
    co_await asio::async_read(sock_, asio::buffer(len), asio::redirect_error(use_awaitable, ec));
    if (ec) break;
    // RFC 7766 framing: a 2-byte length, so at most 65535 bytes by construction.
    buf.resize(static_cast<std::size_t>((len[0] << 8) | len[1]));
    co_await asio::async_read(sock_, asio::buffer(buf), asio::redirect_error(use_awaitable, ec));
    if (ec) break;
    touch();
    core_->handle(buf, Client{nullptr, {}, kMaxMessage, self});
  }
  // A client may send its queries and then shut down its sending side
  // (RFC 7766 §6.2.4 lets either side close): the answers still go out.
  read_done_ = true;
  maybe_finish();
}

void TcpConn::maybe_finish() {
  if (read_done_ && pending_ == 0 && out_.empty() && !writing_) close();
}

// Closes the connection once nothing was read or written for tcp_idle.
// Only whole messages count as activity: a peer trickling one byte at a
// time is still cut off.
awaitable<void> TcpConn::watchdog() {
  auto self = shared_from_this();
  error_code ec;
  while (!closed_) {
    idle_.expires_at(deadline_);
    co_await idle_.async_wait(asio::redirect_error(use_awaitable, ec));
    if (closed_) co_return;
    if (Clock::now() < deadline_) continue;
    if (pending_ > 0) {
      // An answer is still on its way (upstream and learn are bounded).
      touch();
      continue;
    }
    core_->log().debug("event=tcp_idle_close");
    close();
  }
}

void TcpConn::send(std::vector<std::uint8_t> msg) {
  if (closed_ || msg.size() > kMaxMessage) return;
  // A client that does not read its answers holds them in the agent's
  // memory: 64 connections of one sandbox, 16 answers of 64 KiB queued on
  // each, held 37 MiB (attack review 9). Past kMaxTcpQueued bytes across a
  // sandbox's connections, a connection that already has an answer waiting
  // is closed instead (RFC 7766 lets a server close), so a sandbox holds at
  // most that plus one answer per connection.
  std::size_t& queued = core_->tcp_queued();
  if (!out_.empty() && queued + msg.size() + 2 > kMaxTcpQueued) {
    core_->log().info("event=tcp_backlog_close queued_bytes={} reason=\"the sandbox's tcp clients hold more than {} "
                      "bytes of answers unread\"",
                      queued, kMaxTcpQueued);
    close();
    return;
  }
  std::vector<std::uint8_t> framed;
  framed.reserve(msg.size() + 2);
  framed.push_back(static_cast<std::uint8_t>(msg.size() >> 8));
  framed.push_back(static_cast<std::uint8_t>(msg.size() & 0xFF));
  framed.insert(framed.end(), msg.begin(), msg.end());
  queued += framed.size();
  out_.push_back(std::move(framed));
  if (!writing_) write_next();
}

void TcpConn::write_next() {
  writing_ = true;
  asio::async_write(sock_, asio::buffer(out_.front()),
                    [self = shared_from_this()](const error_code& ec, std::size_t) {
                      self->writing_ = false;
                      self->core_->tcp_queued() -= self->out_.front().size();
                      self->out_.pop_front();
                      if (ec || self->closed_) {
                        self->close();
                        return;
                      }
                      self->touch();
                      self->wake_.cancel();
                      if (!self->out_.empty()) {
                        self->write_next();
                      } else {
                        self->maybe_finish();
                      }
                    });
}

void TcpConn::query_finished() {
  --pending_;
  wake_.cancel();
  maybe_finish();
}

void TcpConn::close() {
  if (closed_) return;
  closed_ = true;
  error_code ec;
  sock_.shutdown(tcp::socket::shutdown_both, ec);
  sock_.close(ec);
  idle_.cancel();
  wake_.cancel();
  // The answer being written stays until its write completes (it is the
  // buffer the kernel reads): counted off there, the rest here.
  for (std::size_t i = writing_ ? 1 : 0; i < out_.size(); ++i) core_->tcp_queued() -= out_[i].size();
  if (writing_) {
    out_.resize(1);
  } else {
    out_.clear();
  }
  core_->tcp_closed(this);
}

// ---------------------------------------------------------------- Core

Status Core::bind() {
  UpstreamOptions uo;
  uo.servers = opts_.upstream;
  uo.mark = opts_.own_mark;
  uo.open_socket = opts_.open_socket;
  uo.timeout = opts_.upstream_timeout;
  uo.forget = opts_.forget_flow;
  uo.pool_idle = opts_.upstream_pool_idle;
  uo.fds = opts_.fd_account;
  auto up = Upstream::create(io_, uo);
  if (!up) return up.error().wrap("dns proxy");
  upstream_ = std::move(up.value());

  // Port 0: the kernel picks the UDP port on 127.0.0.1 and the other three
  // sockets must get the same one; retry if another socket holds it.
  Status st;
  error_code in_use;
  for (int attempt = 0; attempt < (opts_.port == 0 ? 16 : 1); ++attempt) {
    st = bind_all(opts_.port, in_use);
    if (st.ok()) break;
    udp_.clear();
    acceptors_.clear();
  }
  if (!st.ok() && in_use && opts_.fallback_port && opts_.port != 0) {
    // Someone took the port while egressd was down (issue 14, class 10):
    // under Docker any uid may bind port 53. Serving elsewhere, with the
    // redirect pointed there, keeps DNS under egressd; failing would leave
    // the sandbox with no DNS and the orchestrator with no control socket.
    const Server lo4{*parse_ip("127.0.0.1"), opts_.port};
    std::string holder = describe_holder(lo4, false);
    if (holder.empty()) holder = describe_holder(lo4, true);
    const std::string first_error = st.error().message;
    for (int attempt = 0; attempt < 16; ++attempt) {
      udp_.clear();
      acceptors_.clear();
      st = bind_all(0, in_use);
      if (st.ok()) break;
    }
    if (st.ok()) {
      port_fell_back_ = true;
      log_->warn(
          "event=proxy_port_fallback port={} listen_port={} holder=\"{}\" error=\"{}\" fix=\"port {} is held by "
          "another socket, so the DNS proxy listens on port {} and the redirect points there; under Docker any "
          "process may bind port 53 (ip_unprivileged_port_start=0): start the task container with --sysctl "
          "net.ipv4.ip_unprivileged_port_start=1024\"",
          opts_.port, port_, holder.empty() ? "unknown" : holder, first_error, opts_.port, port_);
    }
  }
  if (!st.ok()) return st;
  // Forwarding to ourselves would bounce every query until max_inflight.
  for (const Server& s : upstream_->servers()) {
    const bool loopback_self = (s.ip.to_string() == "127.0.0.1" || s.ip.to_string() == "::1") && s.port == port_;
    if (loopback_self) return Error::invalid("dns proxy: upstream " + s.to_string() + " is the proxy itself");
  }
  if (opts_.own_local_upstreams) own_local_upstreams();
  for (const Server& s : upstream_->servers()) loop_watch_ = loop_watch_ || is_loopback(s.ip);
  loop_watch_ = loop_watch_ || !owned_.empty();
  return {};
}

void Core::serve(std::uint32_t own_mark, std::uint32_t proxy_mark) {
  if (serving_ || closed_) return;
  serving_ = true;
  own_mark_ = own_mark;
  proxy_mark_ = proxy_mark;
  upstream_->set_mark(own_mark);
  // What the proxy sends from its address and port must carry the table's
  // proxy mark (chain output drops the rest: nft::proxy_source_rules). An
  // accepted TCP socket takes its listener's; one the kernel accepted
  // before this gets it in accept_loop.
  if (proxy_mark != 0) {
    for (auto& s : udp_) set_mark(s->native_handle(), proxy_mark);
    for (auto& a : acceptors_) set_mark(a->native_handle(), proxy_mark);
  }
  auto self = shared_from_this();
  for (auto& s : udp_) asio::co_spawn(io_, udp_loop(self, *s), log_exception);
  for (auto& a : acceptors_) asio::co_spawn(io_, accept_loop(self, *a), log_exception);
  std::string servers;
  for (const Server& s : upstream_->servers()) servers += (servers.empty() ? "" : ",") + s.to_string();
  // The own mark is a secret of the table's (nft/compile.h): the log says only whether there is one.
  log_->info("event=proxy_started port={} ipv6={} upstream={} marked={} inflight_max={} owned={}", port_,
             udp_.size() > 1, servers, own_mark != 0, opts_.max_inflight, owned_.size());

  const ForwarderOptions& f = opts_.forwarder;
  if (!f.targets.empty()) {
    std::vector<Server> targets;
    for (const auto& t : f.targets) {
      if (auto s = parse_server(t)) targets.push_back(*s);
    }
    if (!targets.empty()) pin(std::move(targets), f.source.empty() ? "configured" : f.source);
  } else if (f.probe && loop_watch_) {
    start_probe();
  }
}

Status Core::bind_all(std::uint16_t port, error_code& in_use) {
  in_use = {};
  struct Addr {
    asio::ip::address addr;
    bool optional;
  };
  // ::1 is skipped (with a warning) in a namespace without IPv6: the nat
  // rules then have no IPv6 DNS to redirect either.
  const Addr addrs[] = {{asio::ip::make_address("127.0.0.1"), false}, {asio::ip::make_address("::1"), true}};
  for (const Addr& a : addrs) {
    error_code ec;
    auto us = std::make_unique<udp::socket>(io_);
    us->open(a.addr.is_v4() ? udp::v4() : udp::v6(), ec);
    if (!ec) us->bind(udp::endpoint(a.addr, port), ec);
    const std::string where = (a.addr.is_v4() ? a.addr.to_string() : "[" + a.addr.to_string() + "]") + ":" +
                              std::to_string(port);
    if (ec) {
      if (a.optional && (ec == asio::error::address_family_not_supported ||
                         ec == boost::system::errc::address_not_available)) {
        log_->warn("event=ipv6_unavailable addr={} error=\"{}\"", where, ec.message());
        continue;
      }
      if (ec == asio::error::address_in_use) in_use = ec;
      return Error::runtime("dns proxy: bind udp " + where + ": " + ec.message());
    }
    if (port == 0) port = us->local_endpoint().port();
    us->non_blocking(true, ec);
    // The kernel's default (net.core.rmem_default, 208 KiB) holds 256
    // small datagrams: a burst that arrives while egressd is not scheduled
    // (a sanitizer build on a loaded CI machine: 256 datagrams, then 64
    // queries, 63 dropped) loses the rest. 1 MiB holds ~1,260, about
    // inflight_max; the memory is the kernel's, and only while queued.
    // SO_RCVBUFFORCE needs CAP_NET_ADMIN, which egressd has; else capped.
    const int want = kListenerRcvbuf;
    if (::setsockopt(us->native_handle(), SOL_SOCKET, SO_RCVBUFFORCE, &want, sizeof want) < 0) {
      (void)::setsockopt(us->native_handle(), SOL_SOCKET, SO_RCVBUF, &want, sizeof want);
    }
    auto acc = std::make_unique<tcp::acceptor>(io_);
    const tcp::endpoint tep(a.addr, port);
    const std::string twhere =
        (a.addr.is_v4() ? a.addr.to_string() : "[" + a.addr.to_string() + "]") + ":" + std::to_string(port);
    acc->open(tep.protocol(), ec);
    if (!ec) acc->set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acc->bind(tep, ec);
    if (!ec) acc->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      if (ec == asio::error::address_in_use) in_use = ec;
      return Error::runtime("dns proxy: bind tcp " + twhere + ": " + ec.message());
    }
    udp_.push_back(std::move(us));
    acceptors_.push_back(std::move(acc));
  }
  port_ = port;
  return {};
}

void Core::own_local_upstreams() {
  const auto& servers = upstream_->servers();
  for (std::size_t i = 0; i < servers.size(); ++i) {
    if (servers[i].port != 53) continue;
    Owned o;
    o.index = i;
    o.server = servers[i];
    try_own(o, true);
    if (o.usock || o.held) owned_.push_back(std::move(o));
  }
  retry_owned();
}

// No SO_REUSEADDR or SO_REUSEPORT: with them another socket could share the
// address. The TCP socket is bound, not listening: nothing connects to it
// (queries to port 53 are redirected to the proxy; egressd's own go through
// Docker's DNAT to its resolver's port).
void Core::try_own(Owned& o, bool first) {
  const auto addr = to_address(o.server.ip);
  const std::string where = o.server.to_string();
  std::string held_by;
  bool in_use = false;
  if (!o.usock) {
    error_code ec;
    auto u = std::make_unique<udp::socket>(io_);
    u->open(addr.is_v4() ? udp::v4() : udp::v6(), ec);
    if (!ec && addr.is_v6()) u->set_option(asio::ip::v6_only(true), ec);
    if (!ec) u->bind(udp::endpoint(addr, o.server.port), ec);
    if (ec == boost::system::errc::address_not_available || ec == asio::error::address_family_not_supported) {
      return;  // not an address of this namespace: nothing to own
    }
    if (ec == asio::error::address_in_use) {
      in_use = true;
      held_by = "udp";
      if (const auto h = describe_holder(o.server, false); !h.empty()) held_by += ", " + h;
    } else if (ec) {
      if (first) {
        log_->warn("event=upstream_not_owned upstream={} error=\"{}\" (the address stays usable; a sandbox process "
                   "that can bind it could answer in its name)",
                   where, ec.message());
      }
      return;
    } else {
      o.usock = std::move(u);
    }
  }
  if (o.usock && !o.tsock) {
    error_code ec;
    auto t = std::make_unique<tcp::socket>(io_);
    t->open(addr.is_v4() ? tcp::v4() : tcp::v6(), ec);
    if (!ec && addr.is_v6()) t->set_option(asio::ip::v6_only(true), ec);
    if (!ec) t->bind(tcp::endpoint(addr, o.server.port), ec);
    if (ec == asio::error::address_in_use) {
      in_use = true;
      held_by = "tcp";
      if (const auto h = describe_holder(o.server, true); !h.empty()) held_by += ", " + h;
    } else if (!ec) {
      o.tsock = std::move(t);
    } else if (first) {
      log_->warn("event=upstream_not_owned upstream={} transport=tcp error=\"{}\"", where, ec.message());
    }
  }
  const bool was_held = o.held;
  o.held = in_use;
  if (in_use) {
    const std::string why = "upstream " + where + " is held by another socket (" + held_by +
                            "), so egressd does not use it: whoever holds it could answer in its name";
    upstream_->set_usable(o.index, false, why);
    if (!was_held || held_by != o.holder) {
      log_->error("event=upstream_held upstream={} holder=\"{}\" action=\"not used; retried every {} ms\"", where,
                  held_by, opts_.own_retry.count());
    }
    o.holder = held_by;
  } else {
    upstream_->set_usable(o.index, true);
    if (was_held) log_->warn("event=upstream_owned upstream={} previously_held_by=\"{}\"", where, o.holder);
  }
}

void Core::retry_owned() {
  if (closed_) return;
  if (std::none_of(owned_.begin(), owned_.end(), [](const Owned& o) { return o.held; })) return;
  own_timer_.expires_after(opts_.own_retry);
  own_timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (ec || self->closed_) return;
    for (Owned& o : self->owned_) {
      if (o.held) self->try_own(o, false);
    }
    self->retry_owned();
  });
}

void Core::close() {
  if (closed_) return;
  closed_ = true;
  error_code ec;
  for (auto& s : udp_) s->close(ec);
  for (auto& a : acceptors_) a->close(ec);
  own_timer_.cancel();
  probe_timer_.cancel();
  // TcpConn::close erases itself from tcp_.
  std::vector<TcpConn*> conns(tcp_.begin(), tcp_.end());
  for (TcpConn* c : conns) c->close();
  // Pending queries are abandoned: no hook and no callback runs after close.
  upstream_.reset();
  relay_.reset();
  probe_.reset();
  // Their clients hold TCP connections that hold this Core: let go.
  waiting_relays_.clear();
  owned_.clear();
  if (port_ == 0) return;  // never started
  log_->info("event=proxy_closed forwarded={} refused={} failed={} malformed={} relayed={}", counters_.forwarded,
             counters_.refused, counters_.failed, counters_.malformed, counters_.relayed);
}

awaitable<void> Core::udp_loop([[maybe_unused]] std::shared_ptr<Core> self, udp::socket& sock) {
  error_code ec;
  while (!closed_) {
    co_await sock.async_wait(udp::socket::wait_read, asio::redirect_error(use_awaitable, ec));
    if (closed_ || ec == asio::error::operation_aborted) co_return;
    if (ec) {
      log_->error("event=udp_wait_failed error=\"{}\"", ec.message());
      co_return;
    }
    // Drain what is queued, kMmsgBatch per system call, at most 64 per
    // wake-up (so TCP, upstream answers and other proxies get turns). No
    // co_await until the batch is handled: the slots are the thread's.
    for (unsigned taken = 0; taken < 64 && !closed_;) {
      RecvSlots& r = recv_slots();
      r.arm();
      const int n = ::recvmmsg(sock.native_handle(), r.msgs.data(), kMmsgBatch, MSG_DONTWAIT, nullptr);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          log_->debug("event=udp_receive_failed error=\"{}\"", std::strerror(errno));
        }
        break;
      }
      for (int i = 0; i < n && !closed_; ++i) {
        const msghdr& h = r.msgs[i].msg_hdr;
        const std::size_t len = r.msgs[i].msg_len;
        if ((h.msg_flags & MSG_TRUNC) != 0 || len > kMaxUdpSize) {
          ++counters_.malformed;
          continue;
        }
        udp::endpoint peer;
        if (h.msg_namelen > peer.capacity()) continue;
        std::memcpy(peer.data(), &r.from[i], h.msg_namelen);
        peer.resize(h.msg_namelen);
        handle(std::span(r.slot(static_cast<unsigned>(i)), len), Client{&sock, peer, kClassicUdpSize, nullptr});
      }
      taken += static_cast<unsigned>(n);
      if (static_cast<unsigned>(n) < kMmsgBatch) break;
    }
  }
}

awaitable<void> Core::accept_loop(std::shared_ptr<Core> self, tcp::acceptor& acc) {
  error_code ec;
  asio::steady_timer backoff(io_);
  while (!closed_) {
    tcp::socket sock = co_await acc.async_accept(asio::redirect_error(use_awaitable, ec));
    if (closed_ || ec == asio::error::operation_aborted) co_return;
    if (ec) {
      // EMFILE and friends: back off instead of spinning on the error.
      log_->warn("event=tcp_accept_failed error=\"{}\"", ec.message());
      backoff.expires_after(std::chrono::milliseconds(100));
      co_await backoff.async_wait(asio::redirect_error(use_awaitable, ec));
      continue;
    }
    if (proxy_mark_ != 0) set_mark(sock.native_handle(), proxy_mark_);
    const bool slot = tcp_slot();
    if (slot && opts_.fd_account && !opts_.fd_account->take()) {
      // The sandbox holds its share of the agent's descriptors (logged by
      // the account, once per burst). Closed at accept: during a probe it
      // may have been Docker's copy, as with a full set of slots.
      ++counters_.fd_denied;
      if (probe_) void_probe("tcp_connection_closed_at_accept");
      sock.close(ec);
      continue;
    }
    if (!slot) {
      unsigned suppressed = 0;
      if (bad_log_.allow(Clock::now(), suppressed)) {
        log_->warn("event=tcp_limit max={} suppressed={}", opts_.max_tcp_connections, suppressed);
      }
      sock.close(ec);
      continue;
    }
    std::make_shared<TcpConn>(self, std::move(sock))->start();
  }
}

void Core::handle(std::span<std::uint8_t> msg, const Client& client_in) {
  if (closed_) return;
  const ParsedQuery q = parse_query(msg);
  if (q.status != QueryStatus::ok) {
    ++counters_.malformed;
    unsigned suppressed = 0;
    if (bad_log_.allow(Clock::now(), suppressed)) {
      log_->info("event=malformed_query action={} reason=\"{}\" suppressed={}",
                 q.status == QueryStatus::drop ? "drop" : (q.status == QueryStatus::notimp ? "notimp" : "formerr"),
                 q.reason, suppressed);
    }
    if (q.status == QueryStatus::formerr) answer_local(msg, q, client_in, Rcode::formerr);
    if (q.status == QueryStatus::notimp) answer_local(msg, q, client_in, Rcode::notimp);
    return;
  }
  Client client = client_in;
  if (client.udp_sock != nullptr) client.limit = q.udp_size;

  if (loop_watch_) {
    // A forwarder on a local upstream (Docker's embedded resolver) sends
    // egressd's own query on from inside the namespace, and the redirect
    // brings it back here. Its question bytes, 0x20 case included, are
    // egressd's: nothing else in the namespace saw them unless it sniffs
    // loopback, and even a copy goes nowhere but to the relay target.
    const std::string_view key(reinterpret_cast<const char*>(msg.data()) + kHeaderSize, q.question_end - kHeaderSize);
    if (probe_ && key == probe_->key) return probe_arrival(msg, q, client);
    if (!inflight_q_.empty()) {
      // A copy of a sandbox query egressd forwarded is relayed only while
      // the phase in force forwards the name: after a switch that refuses
      // it, a copy (sniffed on loopback, the sandbox's NET_RAW) would
      // otherwise go out at the sandbox's timing for as long as the first
      // is in flight (attack review 10). Refused below like any query for
      // it. egressd's own queries (pre-resolution of the phase a switch is
      // about to install, before it is in force) are relayed as ever: their
      // names are the orchestrator's, not the sandbox's.
      if (auto it = inflight_q_.find(key);
          it != inflight_q_.end() &&
          (it->second.own > 0 || hooks_.decide(q.question.name) == Action::forward)) {
        return relay(msg, q, client, it->second);
      }
    }
  }

  const Action action = hooks_.decide(q.question.name);
  if (closed_) return;
  if (action != Action::forward) {
    ++counters_.refused;
    unsigned suppressed = 0;
    if (refuse_log_.allow(Clock::now(), suppressed)) {
      log_->info("event=query qname={} qtype={} action={} suppressed={}", q.question.name, q.question.qtype,
                 action == Action::refuse ? "refuse" : "nxdomain", suppressed);
    }
    // Answered here and never forwarded: the upstream sees no query for a
    // name the policy does not allow (this is what stops exfiltration
    // through DNS).
    answer_local(msg, q, client, action == Action::refuse ? Rcode::refused : Rcode::nxdomain);
    hooks_.refused(q.question.name, q.question.qtype);
    return;
  }
  forward(msg, q, client);
}

void Core::answer_local(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client, Rcode rcode) {
  reply(client, make_local_answer(msg, q.header, q.question_end, rcode));
}

void Core::servfail_now(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client,
                        std::string_view why) {
  ++counters_.failed;
  unsigned suppressed = 0;
  if (fail_log_.allow(Clock::now(), suppressed)) {
    log_->warn("event=query qname={} qtype={} action=servfail reason={} suppressed={}", q.question.name,
               q.question.qtype, why, suppressed);
  }
  answer_local(msg, q, client, Rcode::servfail);
}

void Core::reply(const Client& client, std::vector<std::uint8_t> answer) {
  if (closed_) return;
  if (client.tcp) {
    client.tcp->send(std::move(answer));
    return;
  }
  if (client.udp_sock == nullptr) return;
  if (answer.size() > client.limit) {
    // Does not fit the client's UDP payload size: header + question with
    // TC set, and the client retries over TCP.
    const std::size_t qend = question_end(answer);
    answer = make_truncated(answer, qend != 0 ? Bytes(answer).subspan(kHeaderSize, qend - kHeaderSize) : Bytes());
  }
  // Sent with the other replies of this turn of the loop in one sendmmsg(2)
  // (answers released by one learned-address commit come together).
  outbox_.push_back(OutReply{client.udp_sock, client.peer, std::move(answer)});
  if (outbox_.size() == 1) asio::post(io_, [self = shared_from_this()] { self->flush_outbox(); });
}

void Core::flush_outbox() {
  std::vector<OutReply> out;
  out.swap(outbox_);
  if (closed_) return;  // the sockets are closed
  std::array<mmsghdr, kMmsgBatch> msgs{};
  std::array<iovec, kMmsgBatch> iov{};
  for (std::size_t i = 0; i < out.size();) {
    // A run of replies through the same socket, at most kMmsgBatch.
    std::size_t n = 0;
    while (i + n < out.size() && n < kMmsgBatch && out[i + n].sock == out[i].sock) {
      OutReply& o = out[i + n];
      iov[n] = iovec{o.bytes.data(), o.bytes.size()};
      msgs[n] = mmsghdr{};
      msgs[n].msg_hdr.msg_name = o.peer.data();
      msgs[n].msg_hdr.msg_namelen = static_cast<socklen_t>(o.peer.size());
      msgs[n].msg_hdr.msg_iov = &iov[n];
      msgs[n].msg_hdr.msg_iovlen = 1;
      ++n;
    }
    for (std::size_t k = 0; k < n;) {
      const int sent = ::sendmmsg(out[i].sock->native_handle(), msgs.data() + k, static_cast<unsigned>(n - k),
                                  MSG_DONTWAIT);
      if (sent > 0) {
        k += static_cast<std::size_t>(sent);
        continue;
      }
      if (sent < 0 && errno == EINTR) continue;
      // The reply at k failed (a full send buffer, an unreachable peer): UDP
      // drops it, as send_to did, and the client asks again.
      log_->debug("event=udp_send_failed error=\"{}\"", std::strerror(errno));
      ++k;
    }
    i += n;
  }
}

void Core::forward(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client) {
  if (inflight_ >= opts_.max_inflight) {
    // A flood must not grow memory or the upstream's queue: fail fast.
    ++counters_.failed;
    unsigned suppressed = 0;
    if (fail_log_.allow(Clock::now(), suppressed)) {
      log_->warn("event=query qname={} qtype={} action=servfail reason=inflight_limit max={} suppressed={}",
                 q.question.name, q.question.qtype, opts_.max_inflight, suppressed);
    }
    answer_local(msg, q, client, Rcode::servfail);
    return;
  }
  auto p = std::make_shared<Pending>(shared_from_this(), client);
  ++inflight_;
  if (client.tcp) client.tcp->query_started();
  p->header = q.header;
  p->prefix.assign(msg.begin(), msg.begin() + static_cast<std::ptrdiff_t>(q.question_end));
  p->qname = q.question.name;
  p->qtype = q.question.qtype;
  p->client_edns = q.edns;
  p->start = Clock::now();
  ++counters_.forwarded;
  // Rebuilt from the parsed question (issue 14, class 8): the upstream sees
  // our random ID and case, and nothing else the sandbox wrote.
  std::array<std::uint8_t, kCaseBits> bits;
  upstream_->random_case(bits);
  const std::uint16_t id = upstream_->random_id();
  ForwardQuery fq = build_forward_query(q, msg, id, bits);
  // Registered as in flight (when a local upstream could relay it back)
  // under its question bytes for as long as `p` lives.
  if (loop_watch_) {
    // A sandbox query with exactly these question bytes would be taken for
    // Docker relaying this one (handle()): the same name asked again while
    // this one is in flight, written in the case the draw happened to give
    // (all lower case, for a name with few letters, is a likely draw). So
    // the case is drawn again until it differs from the client's; a name
    // without letters cannot differ.
    const auto same_as_client = [&] {
      return fq.question_end == q.question_end &&
             std::equal(fq.wire.begin() + kHeaderSize, fq.wire.begin() + static_cast<std::ptrdiff_t>(fq.question_end),
                        msg.begin() + kHeaderSize);
    };
    for (int tries = 0; tries < 16 && same_as_client(); ++tries) {
      upstream_->random_case(bits);
      fq = build_forward_query(q, msg, id, bits);
    }
    p->key.assign(reinterpret_cast<const char*>(fq.wire.data()) + kHeaderSize, fq.question_end - kHeaderSize);
    ++inflight_q_[p->key].queries;
  }
  exchange(std::move(p), std::move(fq.wire));
}

// A callback, not a coroutine: a coroutine per query cost a frame, a post to
// start it and another to resume it (about 3 % of the proxy's CPU at
// saturation, issue 17). An immediate failure is still posted (async_exchange).
void Core::exchange(std::shared_ptr<Pending> p, std::vector<std::uint8_t> query) {
  Upstream* up = p->relay ? relay_.get() : upstream_.get();
  if (closed_ || up == nullptr) return;
  // Each try after the first is asked for again under the phase in force
  // then: a switch stops a query an earlier phase sent, and its relayed
  // copies, from going out again (attack review 10: a retry round, or TCP
  // after a truncated answer, half a second after a switch to no-network).
  // The check holds `p` by address: it is asked only while the exchange is
  // pending, when the completion (which owns `p`) is alive; and a raw pointer
  // keeps the std::function within its local storage (no allocation per query).
  up->async_exchange(
      query, false, [p](Answer a) { p->core->on_upstream(p, std::move(a)); },
      [raw = p.get()] { return !raw->core->closed() && raw->core->hooks_.decide(raw->qname) == Action::forward; });
}

bool Core::tcp_slot() {
  if (tcp_.size() < opts_.max_tcp_connections) return true;
  if (probe_ && tcp_.size() < opts_.max_tcp_connections + kProbeReserve) return true;
  if (probe_) void_probe("tcp_connection_closed_at_accept");
  return false;
}

void Core::unregister(const std::string& key, bool own) {
  auto it = inflight_q_.find(key);
  if (it == inflight_q_.end()) return;
  if (own) --it->second.own;
  if (--it->second.queries <= 0) inflight_q_.erase(it);
}

void Core::relay(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client, InFlight& entry) {
  if (!relay_ && probe_ && waiting_relays_.size() < 64) {
    // The probe is about to say where the forwarder's copies may go (at
    // start-up, pre-resolution's queries come back before it has).
    waiting_relays_.emplace_back(std::vector<std::uint8_t>(msg.begin(), msg.end()), client);
    return;
  }
  if (!relay_ && forwards_outside_) {
    // Docker's resolver does not forward through this namespace (the probe
    // saw no copy), so this copy is a sandbox process's: it gets SERVFAIL
    // and starts no probe, which the sandbox could answer alone.
    servfail_now(msg, q, client, "relay_refused");
    unsigned suppressed = 0;
    if (relay_log_.allow(Clock::now(), suppressed)) {
      log_->error("event=relay_refused qname={} suppressed={} action=\"SERVFAIL, no probe\" detail=\"a copy of "
                  "egressd's query arrived, but the probe found that the local upstream forwards from outside the "
                  "namespace: a process in the namespace is copying egressd's queries\" fix=\"Docker 25+ "
                  "(ExtServers in resolv.conf), a forwarder target kept in the state directory, or restart egressd "
                  "to probe again\"",
                  q.question.name, suppressed);
    }
    return;
  }
  if (!relay_) {
    servfail_now(msg, q, client, "relay_target_unknown");
    unsigned suppressed = 0;
    if (relay_log_.allow(Clock::now(), suppressed)) {
      log_->warn("event=relay_unpinned qname={} suppressed={} action=\"SERVFAIL; the upstream forwards egressd's "
                 "queries back into the namespace, but no forwarder target is pinned yet (probe pending)\"",
                 q.question.name, suppressed);
    }
    schedule_probe();
    return;
  }
  if (inflight_ >= opts_.max_inflight) return servfail_now(msg, q, client, "inflight_limit");
  if (entry.relays >= kMaxRelaysPerQuery) return servfail_now(msg, q, client, "relay_limit");
  ++entry.relays;
  auto p = std::make_shared<Pending>(shared_from_this(), client);
  ++inflight_;
  if (client.tcp) client.tcp->query_started();
  p->header = q.header;
  p->prefix.assign(msg.begin(), msg.begin() + static_cast<std::ptrdiff_t>(q.question_end));
  p->qname = q.question.name;
  p->qtype = q.question.qtype;
  p->client_edns = q.edns;
  p->relay = true;
  p->start = Clock::now();
  ++counters_.relayed;
  // The copy's question bytes are egressd's own, 0x20 case included: kept,
  // so the target must echo them and the forwarder gets them back as sent.
  ForwardQuery fq = build_forward_query(q, msg, relay_->random_id());
  exchange(std::move(p), std::move(fq.wire));
}

void Core::fail(const std::shared_ptr<Pending>& p, std::string_view why) {
  if (p->done) return;
  p->done = true;
  ++counters_.failed;
  if (!p->relay) counters_.answered(micros_since(p->start));
  unsigned suppressed = 0;
  if (fail_log_.allow(Clock::now(), suppressed)) {
    log_->warn("event=query qname={} qtype={} action=servfail{} reason=\"{}\" ms={} suppressed={}", p->qname,
               p->qtype, p->relay ? " relay=true" : "", why,
               std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - p->start).count(), suppressed);
  }
  reply(p->client, make_local_answer(p->prefix, p->header, p->prefix.size(), Rcode::servfail));
}

Result<std::vector<std::uint8_t>> Core::client_view(const Pending& p, std::vector<std::uint8_t> out,
                                                     std::size_t answer_question_end) {
  restore_client_view(out, answer_question_end, p.header.id, Bytes(p.prefix).subspan(kHeaderSize));
  if (Status st = cap_ttls(out, opts_.max_ttl); !st.ok()) return st.error();
  if (!p.client_edns) strip_trailing_opt(out);
  return out;
}

void Core::on_upstream(const std::shared_ptr<Pending>& p, Answer r) {
  if (closed_) return;
  if (!r) {
    // last_failure() is this exchange's while its completion runs.
    const Upstream* up = p->relay ? relay_.get() : upstream_.get();
    if (up != nullptr && up->last_failure() == UpstreamFailure::descriptors) ++counters_.fd_denied;
    return fail(p, r.error().message);
  }
  std::vector<std::uint8_t>& answer = *r;
  if (p->relay) {
    // Docker's forwarder gets the target's answer; egressd learns from it
    // only when it comes back as the answer to its own query.
    const std::size_t qend = question_end(answer);
    auto out = client_view(*p, std::move(answer), qend);
    if (!out) return fail(p, "bad relayed answer: " + out.error().message);
    return release(p, std::move(*out), 0);
  }
  auto parsed = parse_answer(answer, p->qname);
  if (!parsed) return fail(p, "bad upstream answer: " + parsed.error().message);
  if (parsed->question.name != p->qname || parsed->question.qtype != p->qtype) {
    return fail(p, "upstream answered another question");
  }
  auto out = client_view(*p, std::move(answer), parsed->question_end);
  if (!out) return fail(p, "bad upstream answer: " + out.error().message);
  if (parsed->header.rcode() != Rcode::noerror || parsed->addresses.empty()) {
    release(p, std::move(*out), 0);
    return;
  }
  std::vector<Learned> learned;
  learned.reserve(parsed->addresses.size());
  for (const ChainAddress& a : parsed->addresses) learned.push_back({p->qname, a.addr, std::min(a.ttl, opts_.max_ttl)});
  const std::size_t n = learned.size();
  // The answer waits for the kernel: the client's first packet to these
  // addresses must not race the set update.
  hooks_.learn(std::move(learned), [p, out = std::move(*out), n](Status st) mutable {
    Core& core = *p->core;
    if (core.closed()) return;
    if (!st.ok()) return core.fail(p, "learn: " + st.error().message);
    core.release(p, std::move(out), n);
  });
}

void Core::release(const std::shared_ptr<Pending>& p, std::vector<std::uint8_t> answer, std::size_t learned) {
  if (p->done) return;
  p->done = true;
  if (!p->relay) counters_.answered(micros_since(p->start));
  if (log_->should_log(spdlog::level::debug)) {
    const auto h = read_header(answer);
    log_->debug("event=query qname={} qtype={} action={} rcode={} learned={} us={}", p->qname, p->qtype,
                p->relay ? "relay" : "forward", h ? to_string(h->rcode()) : "?", learned,
                std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - p->start).count());
  }
  reply(p->client, std::move(answer));
}

// ---------------------------------------------------------------- Docker's forwarder

// The proxy's answer to a copy of the forwarder probe: NXDOMAIN, and in the
// authority section an SOA for "invalid." whose primary server is
// "<token>.invalid." A forwarder relays an answer whole; egressd looks for
// the token in the answer to its own probe.
std::vector<std::uint8_t> probe_answer(std::span<const std::uint8_t> msg, const ParsedQuery& q,
                                       const std::string& token) {
  std::vector<std::uint8_t> out = make_local_answer(msg, q.header, q.question_end, Rcode::nxdomain);
  if (out.size() < kHeaderSize || token.size() > 63) return out;
  static constexpr std::uint8_t kInvalid[] = {7, 'i', 'n', 'v', 'a', 'l', 'i', 'd', 0};
  const auto put16 = [&](std::uint16_t v) {
    out.push_back(static_cast<std::uint8_t>(v >> 8));
    out.push_back(static_cast<std::uint8_t>(v & 0xFF));
  };
  out.insert(out.end(), std::begin(kInvalid), std::end(kInvalid));  // owner
  put16(6);                                                          // SOA
  put16(1);                                                          // IN
  put16(0);
  put16(0);  // TTL 0
  const std::size_t rdlength = 1 + token.size() + sizeof kInvalid + sizeof kInvalid + 20;
  put16(static_cast<std::uint16_t>(rdlength));
  out.push_back(static_cast<std::uint8_t>(token.size()));  // mname: <token>.invalid.
  out.insert(out.end(), token.begin(), token.end());
  out.insert(out.end(), std::begin(kInvalid), std::end(kInvalid));
  out.insert(out.end(), std::begin(kInvalid), std::end(kInvalid));  // rname: invalid.
  out.insert(out.end(), 20, 0);  // serial, refresh, retry, expire, minimum
  out[8] = 0;
  out[9] = 1;  // NSCOUNT
  return out;
}

bool contains(std::span<const std::uint8_t> msg, const std::string& token) {
  const std::string_view hay(reinterpret_cast<const char*>(msg.data()), msg.size());
  return !token.empty() && hay.find(token) != std::string_view::npos;
}

std::string Core::random_label(std::string_view prefix, std::size_t bytes) {
  std::array<std::uint8_t, kCaseBits> rnd;
  upstream_->random_case(rnd);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(prefix);
  for (std::size_t i = 0; i < bytes && i < rnd.size(); ++i) {
    out += kHex[rnd[i] >> 4];
    out += kHex[rnd[i] & 0xF];
  }
  return out;
}

void Core::start_probe() {
  if (closed_ || probe_ || relay_ || !serving_) return;
  // The first upstream that is local to the namespace and ours to use.
  std::optional<Server> local;
  for (std::size_t i = 0; i < upstream_->servers().size() && !local; ++i) {
    const Server& s = upstream_->servers()[i];
    if (!upstream_->usable(i)) continue;
    const bool owned = std::any_of(owned_.begin(), owned_.end(), [&](const Owned& o) { return o.index == i; });
    if (owned || is_loopback(s.ip)) local = s;
  }
  if (!local) return;
  last_probe_ = Clock::now();
  const std::string name = random_label("egressd-probe-", 8) + ".invalid";
  auto q = build_query(upstream_->random_id(), name, qtype::A);
  if (!q) return;
  std::array<std::uint8_t, kCaseBits> rnd;
  upstream_->random_case(rnd);
  apply_0x20(std::span(q.value()).subspan(kHeaderSize), rnd);
  const std::size_t qend = question_end(q.value());
  UpstreamOptions uo;
  uo.servers = {local->to_string()};
  uo.mark = own_mark_;
  uo.open_socket = opts_.open_socket;
  uo.timeout = opts_.upstream_timeout;
  uo.forget = opts_.forget_flow;
  uo.pool_idle = opts_.upstream_pool_idle;
  uo.fds = opts_.fd_account;
  auto up = Upstream::create(io_, uo);
  if (!up) return;
  Probe pr;
  pr.key.assign(reinterpret_cast<const char*>(q.value().data()) + kHeaderSize, qend - kHeaderSize);
  pr.upstream = std::move(up.value());
  pr.conns_before = tcp_accepted_;
  probe_ = std::move(pr);
  log_->info("event=forwarder_probe upstream={} qname={}", local->to_string(), name);
  // Slots (nearly) all held when the probe starts: whoever holds them may
  // be about to take the rest and have Docker's copy closed at accept.
  if (tcp_.size() >= opts_.max_tcp_connections - opts_.max_tcp_connections / 8) void_probe("tcp_slots_nearly_full");
  // Over TCP: a forwarder relays a TCP query over TCP, and the redirected
  // connection tells (SO_ORIGINAL_DST) where it was going.
  probe_->upstream->async_exchange(
      q.value(), true,
      [self = shared_from_this()](Answer a) {
        if (self->closed_ || !self->probe_ || self->probe_->answered) return;
        self->probe_->answered = true;
        // An answer with an error rcode is an answer: the resolver did not
        // send the name on through this namespace either.
        const auto why = self->probe_->upstream->last_failure();
        if (!a && why != UpstreamFailure::rcode && why != UpstreamFailure::mismatch) {
          self->probe_->failed = a.error().message;
        }
        if (a && a.value().size() >= kHeaderSize && (a.value()[3] & 0x0F) == static_cast<std::uint8_t>(Rcode::nxdomain)) {
          for (const std::string& t : self->probe_->tokens) {
            if (contains(a.value(), t)) self->probe_->token_back = true;
          }
        }
        // A copy that races egressd's probe has until the grace ends to show.
        self->probe_timer_.expires_after(self->opts_.forwarder.probe_grace);
        self->probe_timer_.async_wait([self](const error_code& ec) {
          if (!ec && !self->closed_) self->finish_probe();
        });
      });
}

void Core::probe_arrival(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client) {
  ++probe_->arrivals;
  std::string dst = "-";
  // A connection the sandbox opened before the probe (one of those that
  // filled the slots, say) cannot carry Docker's copy of it.
  if (client.tcp && client.tcp->seq() <= probe_->conns_before) void_probe("copy_on_a_connection_older_than_the_probe");
  if (client.tcp) {
    const int fd = client.tcp->native_handle();
    auto d = opts_.original_dst ? opts_.original_dst(fd, client.tcp->v6()) : socket_original_dst(fd, client.tcp->v6());
    if (d) {
      probe_->dst = *d;
      dst = d->to_string();
    }
  }
  log_->info("event=forwarder_probe_arrival transport={} original_dst={} arrivals={}", client.tcp ? "tcp" : "udp", dst,
             probe_->arrivals);
  // The probe's name is under .invalid: its answer is ours to give, with a
  // token of this copy's that egressd's own answer must bring back.
  const std::string token = random_label("egressd-copy-", 12);
  probe_->tokens.push_back(token);
  reply(client, probe_answer(msg, q, token));
}

void Core::flush_waiting(bool pinned) {
  auto waiting = std::move(waiting_relays_);
  waiting_relays_.clear();
  for (auto& [msg, client] : waiting) {
    if (closed_) return;
    if (pinned) {
      handle(msg, client);
      continue;
    }
    const ParsedQuery q = parse_query(msg);
    servfail_now(msg, q, client, "relay_target_unknown");
  }
}

void Core::finish_probe() {
  if (!probe_) return;
  const int arrivals = probe_->arrivals;
  const std::optional<Server> dst = probe_->dst;
  const std::string void_reason = probe_->void_reason;
  const std::string failed = probe_->failed;
  const bool token_back = probe_->token_back;
  probe_.reset();
  if (!void_reason.empty()) {
    // The sandbox may have suppressed Docker's copy or sent one of its own:
    // whatever arrived, nothing is pinned (fail closed) and a later probe,
    // with the slots free again, finds the target.
    flush_waiting(false);
    log_->error("event=forwarder_probe_race arrivals={} original_dst={} reason={} action=\"no forwarder target "
                "pinned; retry in {} ms\" detail=\"egressd's probe could have been suppressed or answered by a "
                "process in the namespace\"",
                arrivals, dst ? dst->to_string() : "-", void_reason, opts_.forwarder.probe_retry.count());
    schedule_probe();
    return;
  }
  if (arrivals == 0 && !failed.empty()) {
    // No answer at all (the resolver not up yet): says nothing about where
    // it forwards.
    flush_waiting(false);
    log_->info("event=forwarder_probe result=failed error=\"{}\" action=\"retry in {} ms\"", failed,
               opts_.forwarder.probe_retry.count());
    schedule_probe();
    return;
  }
  if (arrivals == 0) {
    flush_waiting(false);
    // The upstream answered without sending the name on through this
    // namespace (Docker forwarding from the host's namespace, or not a
    // forwarder at all): nothing will loop, nothing to relay, and a copy
    // of egressd's query that arrives later is a sandbox process's.
    forwards_outside_ = true;
    log_->info("event=forwarder_probe result=none detail=\"the local upstream does not forward through this "
               "namespace; nothing to relay, and copies of egressd's queries are refused\"");
    return;
  }
  auto local_addr = [this](const IpPrefix& ip) {
    error_code ec;
    udp::socket s(io_);
    s.open(ip.family == 4 ? udp::v4() : udp::v6(), ec);
    if (!ec) s.bind(udp::endpoint(to_address(ip), 0), ec);
    return !ec;
  };
  if (arrivals == 1 && !token_back) {
    // One copy, but egressd's probe did not get the proxy's answer to it
    // back (its token): the resolver's own copy never reached the proxy (a
    // sandbox process can use up the namespace's ports to the target, so
    // the resolver cannot connect; or the resolver forwards from outside the
    // namespace and answered from there) and the one that did was someone
    // else's.
    flush_waiting(false);
    log_->error("event=forwarder_probe_race arrivals=1 original_dst={} reason=answer_not_the_proxys action=\"no "
                "forwarder target pinned; retry in {} ms\" detail=\"egressd's probe was not answered with the "
                "proxy's answer to the copy: the copy that arrived may not be the resolver's\"",
                dst ? dst->to_string() : "-", opts_.forwarder.probe_retry.count());
    schedule_probe();
    return;
  }
  if (arrivals == 1 && dst && dst->port == 53 && !is_loopback(dst->ip) && !local_addr(dst->ip)) {
    pin({*dst}, "probe");
    return;
  }
  flush_waiting(false);
  // Two copies: someone in the namespace copied egressd's probe (it had to
  // sniff loopback for it) and may have sent its copy to a resolver of its
  // own. No copy over TCP, or one to an address of this namespace: not
  // what a forwarder does. Pin nothing; a relay finds no target and fails.
  log_->error("event=forwarder_probe_race arrivals={} original_dst={} action=\"no forwarder target pinned; retry in "
              "{} ms\" detail=\"more than one copy of egressd's probe reached the proxy, or none went to a remote "
              "port 53: a process in the namespace may be copying egressd's queries\"",
              arrivals, dst ? dst->to_string() : "-", opts_.forwarder.probe_retry.count());
  schedule_probe();
}

void Core::void_probe(std::string reason) {
  if (!probe_ || !probe_->void_reason.empty()) return;
  log_->warn("event=forwarder_probe_void reason={}", reason);
  probe_->void_reason = std::move(reason);
}

void Core::schedule_probe() {
  if (closed_ || probe_ || relay_ || probe_scheduled_ || forwards_outside_ || !opts_.forwarder.probe || !serving_) {
    return;
  }
  probe_scheduled_ = true;
  probe_timer_.expires_at(std::max(Clock::now(), last_probe_ + opts_.forwarder.probe_retry));
  probe_timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    self->probe_scheduled_ = false;
    if (!ec && !self->closed_) self->start_probe();
  });
}

void Core::pin(std::vector<Server> targets, const std::string& source) {
  std::vector<IpPrefix> ips;
  std::string text;
  for (const Server& t : targets) {
    ips.push_back(t.ip);
    text += (text.empty() ? "" : ",") + t.to_string();
  }
  hooks_.relay_targets(ips, source, [self = shared_from_this(), targets, source, text](Status st) {
    if (self->closed_) return;
    if (!st.ok()) {
      self->log_->error("event=forwarder_not_pinned targets={} source={} error=\"{}\"", text, source,
                        st.error().message);
      self->flush_waiting(false);
      return;
    }
    UpstreamOptions uo;
    for (const Server& t : targets) uo.servers.push_back(t.to_string());
    uo.mark = self->own_mark_;
    uo.open_socket = self->opts_.open_socket;
    uo.timeout = self->opts_.upstream_timeout;
    uo.forget = self->opts_.forget_flow;
    uo.pool_idle = self->opts_.upstream_pool_idle;
    uo.fds = self->opts_.fd_account;
    auto up = Upstream::create(self->io_, uo);
    if (!up) return;
    self->relay_ = std::move(up.value());
    self->relay_targets_ = targets;
    self->log_->info("event=forwarder_pinned targets={} source={}", text, source);
    self->flush_waiting(true);
  });
}

void Core::resolve(const std::string& raw, std::function<void(Result<std::vector<Learned>>)> done) {
  if (closed_ || !upstream_) {
    done(Error::runtime("resolve " + raw + ": dns proxy closed"));
    return;
  }
  std::string name = raw;
  for (char& c : name) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  if (!name.empty() && name.back() == '.') name.pop_back();

  struct State {
    std::string name;
    std::function<void(Result<std::vector<Learned>>)> done;
    std::vector<Learned> out;
    std::string errors;
    int remaining = 2;
    bool answered = false;  // at least one NOERROR answer
  };
  auto st = std::make_shared<State>();
  st->name = name;
  st->done = std::move(done);
  std::vector<std::vector<std::uint8_t>> queries;
  for (std::uint16_t type : {qtype::A, qtype::AAAA}) {
    auto q = build_query(upstream_->random_id(), name, type);
    if (!q) {
      st->done(q.error().wrap("resolve " + raw));
      return;
    }
    std::array<std::uint8_t, kCaseBits> bits;
    upstream_->random_case(bits);
    apply_0x20(std::span(q.value()).subspan(kHeaderSize), bits);
    queries.push_back(std::move(q.value()));
  }
  auto finish = [](State& s) {
    if (--s.remaining > 0) return;
    if (s.answered) {
      s.done(std::move(s.out));
    } else {
      s.done(Error::runtime("resolve " + s.name + ":" + s.errors));
    }
  };
  for (std::size_t i = 0; i < queries.size(); ++i) {
    const char* type = i == 0 ? "A" : "AAAA";
    // Registered in flight like a forwarded query: a local upstream's
    // forwarder relays pre-resolution queries back to us too.
    std::shared_ptr<Registration> reg;
    if (loop_watch_) {
      const std::size_t qend = question_end(queries[i]);
      reg = std::make_shared<Registration>(
          shared_from_this(),
          std::string(reinterpret_cast<const char*>(queries[i].data()) + kHeaderSize, qend - kHeaderSize));
      InFlight& entry = inflight_q_[reg->key];
      ++entry.queries;
      ++entry.own;
    }
    upstream_->async_exchange(queries[i], false, [st, type, finish, reg, max_ttl = opts_.max_ttl](Answer r) {
      State& s = *st;
      if (!r) {
        s.errors += std::string(" ") + type + ": " + r.error().message;
      } else if (auto a = parse_answer(*r, s.name); !a) {
        s.errors += std::string(" ") + type + ": " + a.error().message;
      } else if (a->header.rcode() != Rcode::noerror) {
        s.errors += std::string(" ") + type + ": " + to_string(a->header.rcode());
      } else {
        s.answered = true;
        for (const ChainAddress& c : a->addresses) s.out.push_back({s.name, c.addr, std::min(c.ttl, max_ttl)});
      }
      finish(s);
    });
  }
}


// ---------------------------------------------------------------- Proxy

class ProxyImpl final : public Proxy {
 public:
  explicit ProxyImpl(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  ~ProxyImpl() override { core_->close(); }
  void set_forwarder(ForwarderOptions forwarder) override { core_->set_forwarder(std::move(forwarder)); }
  void serve(std::uint32_t own_mark, std::uint32_t proxy_mark) override { core_->serve(own_mark, proxy_mark); }
  std::uint16_t port() const override { return core_->port(); }
  bool port_fell_back() const override { return core_->port_fell_back(); }
  ProxyCounters counters() const override { return core_->counters(); }
  std::vector<ListenerSocket> listeners() const override { return core_->listeners(); }
  void resolve(const std::string& name, std::function<void(Result<std::vector<Learned>>)> done) override {
    core_->resolve(name, std::move(done));
  }
  void close() override { core_->close(); }

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace

Result<std::unique_ptr<Proxy>> Proxy::bind(asio::io_context& io, ProxyOptions opts, PolicyHooks& hooks) {
  auto core = std::make_shared<Core>(io, std::move(opts), hooks);
  if (Status st = core->bind(); !st.ok()) {
    core->close();
    return st.error();
  }
  return std::unique_ptr<Proxy>(new ProxyImpl(std::move(core)));
}

Result<std::unique_ptr<Proxy>> Proxy::start(asio::io_context& io, ProxyOptions opts, PolicyHooks& hooks) {
  const std::uint32_t mark = opts.own_mark;
  auto p = bind(io, std::move(opts), hooks);
  if (!p) return p.error();
  (*p)->serve(mark, 0);
  return p;
}

std::vector<std::string> expand_upstreams(const DnsOptions& dns, const std::string& resolv_conf_text) {
  std::vector<std::string> out;
  auto add = [&](const std::string& s) {
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  };
  for (const auto& u : dns.upstream) {
    if (u != "resolv.conf") {
      add(u);
      continue;
    }
    for (const auto& ns : nameservers_from_resolv_conf(resolv_conf_text)) add(ns);
  }
  return out;
}

std::vector<std::string> nameservers_from_resolv_conf(const std::string& text) {
  // glibc's reading: "nameserver ADDR" lines, comments from '#' or ';',
  // at most MAXNS (3) servers. Entries glibc would not use as plain
  // addresses (names, zone ids like fe80::1%eth0) are skipped.
  constexpr std::size_t kMaxNs = 3;
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < text.size() && out.size() < kMaxNs) {
    std::size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    if (auto c = line.find_first_of("#;"); c != std::string_view::npos) line = line.substr(0, c);
    auto next_word = [&line]() {
      const auto b = line.find_first_not_of(" \t\r");
      if (b == std::string_view::npos) {
        line = {};
        return std::string_view();
      }
      line.remove_prefix(b);
      const auto e = line.find_first_of(" \t\r");
      std::string_view w = line.substr(0, e);
      line.remove_prefix(e == std::string_view::npos ? line.size() : e);
      return w;
    };
    if (next_word() != "nameserver") continue;
    const std::string_view addr = next_word();
    auto ip = parse_ip(addr);
    if (!ip) continue;
    std::string text_addr = ip->to_string();
    if (std::find(out.begin(), out.end(), text_addr) == out.end()) out.push_back(std::move(text_addr));
  }
  return out;
}

ExtServers ext_servers_from_resolv_conf(const std::string& text) {
  // Docker >= 25 writes, after the settings:
  //   # ExtServers: [192.0.2.53 host(127.0.0.53) [2001:db8::53]:53]
  // One comment line; entries separated by spaces.
  ExtServers out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    const auto b = line.find_first_not_of(" \t");
    if (b == std::string_view::npos || line[b] != '#') continue;
    line.remove_prefix(b + 1);
    const auto k = line.find_first_not_of(" \t");
    if (k == std::string_view::npos) continue;
    line.remove_prefix(k);
    constexpr std::string_view kKey = "ExtServers:";
    if (line.substr(0, kKey.size()) != kKey) continue;
    line.remove_prefix(kKey.size());
    const auto open = line.find('[');
    const auto close = line.rfind(']');
    if (open == std::string_view::npos || close == std::string_view::npos || close < open) continue;
    out.present = true;
    std::string_view list = line.substr(open + 1, close - open - 1);
    while (!list.empty()) {
      const auto s = list.find_first_not_of(" \t");
      if (s == std::string_view::npos) break;
      list.remove_prefix(s);
      auto e = list.find_first_of(" \t");
      std::string_view word = list.substr(0, e);
      list.remove_prefix(e == std::string_view::npos ? list.size() : e);
      bool host = false;
      constexpr std::string_view kHost = "host(";
      if (word.substr(0, kHost.size()) == kHost && word.back() == ')') {
        host = true;
        word = word.substr(kHost.size(), word.size() - kHost.size() - 1);
      }
      auto server = parse_server(word);
      if (!server) continue;  // "invalid IP" and the like
      std::string addr = server->ip.to_string();
      if (host) {
        out.host_side.push_back(std::move(addr));
      } else if (server->port == 53 &&
                 std::find(out.targets.begin(), out.targets.end(), addr) == out.targets.end()) {
        // Only port 53 is redirected back to egressd; another port never loops.
        out.targets.push_back(std::move(addr));
      }
    }
    break;
  }
  return out;
}

}  // namespace egressd::dns
