// The DNS proxy (DESIGN §1 "DNS proxy"). One Core per sandbox holds the
// sockets, the upstream channel and the counters; every handler holds a
// shared_ptr to it, so a handler that completes after close() finds a live
// (closed) object instead of freed memory.
//
// Single-threaded: everything runs on the thread that runs the io_context,
// PolicyHooks included.
#include "dns/proxy.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/udp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <algorithm>
#include <deque>
#include <spdlog/spdlog.h>
#include <unordered_set>

#include "dns/log.h"
#include "dns/message.h"
#include "dns/upstream.h"

namespace egressd::dns {

namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;
using boost::system::error_code;
using udp = asio::ip::udp;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// Queries read from one TCP connection and not yet answered (or answers not
// yet written): beyond this the connection is not read until some drain, so
// a client that never reads cannot grow our memory.
constexpr std::size_t kMaxPipeline = 16;
// Lines per second per kind of per-query event at info/warn level; the
// sandbox controls the query rate and must not control the log volume.
constexpr unsigned kLogBurst = 50;

class Core;
class TcpConn;

// Where an answer goes: a UDP peer (with its payload limit) or a TCP connection.
struct Client {
  udp::socket* udp_sock = nullptr;
  udp::endpoint peer;
  std::size_t limit = kClassicUdpSize;
  std::shared_ptr<TcpConn> tcp;
};

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
  void query_started() { ++pending_; }
  void query_finished();

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
};

class Core : public std::enable_shared_from_this<Core> {
 public:
  Core(asio::io_context& io, ProxyOptions opts, PolicyHooks& hooks)
      : io_(io), opts_(std::move(opts)), hooks_(hooks), log_(dns_logger()) {}

  Status start();
  void close();
  bool closed() const { return closed_; }
  std::uint16_t port() const { return port_; }
  ProxyCounters counters() const {
    ProxyCounters c = counters_;
    c.inflight = inflight_;
    return c;
  }
  void resolve(const std::string& name, std::function<void(Result<std::vector<Learned>>)> done);

  // One query from a client. `msg` is modified (the upstream ID is written
  // into it before it is forwarded).
  void handle(std::span<std::uint8_t> msg, const Client& client);
  void reply(const Client& client, std::vector<std::uint8_t> answer);

  void malformed() { ++counters_.malformed; }
  spdlog::logger& log() { return *log_; }
  asio::io_context& io() { return io_; }
  const ProxyOptions& opts() const { return opts_; }
  bool tcp_slot() { return tcp_.size() < opts_.max_tcp_connections; }
  void tcp_opened(TcpConn* c) { tcp_.insert(c); }
  void tcp_closed(TcpConn* c) { tcp_.erase(c); }
  void inflight_done() { --inflight_; }

 private:
  Status bind_all(std::uint16_t port);
  // `self` keeps the Core alive for as long as the loop runs.
  awaitable<void> udp_loop(std::shared_ptr<Core> self, udp::socket& sock);
  awaitable<void> accept_loop(std::shared_ptr<Core> self, tcp::acceptor& acc);
  void answer_local(std::span<const std::uint8_t> msg, const ParsedQuery& q, const Client& client, Rcode rcode);
  void forward(std::span<std::uint8_t> msg, const ParsedQuery& q, const Client& client);
  void on_upstream(const std::shared_ptr<Pending>& p, Result<Bytes> r);
  void release(const std::shared_ptr<Pending>& p, std::vector<std::uint8_t> answer, std::size_t learned);
  void fail(const std::shared_ptr<Pending>& p, std::string_view why);

  asio::io_context& io_;
  ProxyOptions opts_;
  PolicyHooks& hooks_;
  std::shared_ptr<spdlog::logger> log_;
  std::unique_ptr<Upstream> upstream_;
  std::vector<std::unique_ptr<udp::socket>> udp_;
  std::vector<std::unique_ptr<tcp::acceptor>> acceptors_;
  std::unordered_set<TcpConn*> tcp_;
  ProxyCounters counters_;
  std::size_t inflight_ = 0;
  std::uint16_t port_ = 0;
  bool closed_ = false;
  LogLimit refuse_log_, fail_log_, bad_log_;
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
  if (client.tcp) client.tcp->query_finished();
}

// ---------------------------------------------------------------- TCP

TcpConn::TcpConn(std::shared_ptr<Core> core, tcp::socket sock)
    : core_(std::move(core)), sock_(std::move(sock)), idle_(core_->io()), wake_(core_->io()) {}

void TcpConn::start() {
  core_->tcp_opened(this);
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
  std::vector<std::uint8_t> framed;
  framed.reserve(msg.size() + 2);
  framed.push_back(static_cast<std::uint8_t>(msg.size() >> 8));
  framed.push_back(static_cast<std::uint8_t>(msg.size() & 0xFF));
  framed.insert(framed.end(), msg.begin(), msg.end());
  out_.push_back(std::move(framed));
  if (!writing_) write_next();
}

void TcpConn::write_next() {
  writing_ = true;
  asio::async_write(sock_, asio::buffer(out_.front()),
                    [self = shared_from_this()](const error_code& ec, std::size_t) {
                      self->writing_ = false;
                      if (ec || self->closed_) {
                        self->close();
                        return;
                      }
                      self->out_.pop_front();
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
  out_.clear();
  core_->tcp_closed(this);
}

// ---------------------------------------------------------------- Core

Status Core::start() {
  UpstreamOptions uo;
  uo.servers = opts_.upstream;
  uo.mark = opts_.own_mark;
  uo.timeout = opts_.upstream_timeout;
  auto up = Upstream::create(io_, uo);
  if (!up) return up.error().wrap("dns proxy");
  upstream_ = std::move(up.value());

  // Port 0: the kernel picks the UDP port on 127.0.0.1 and the other three
  // sockets must get the same one; retry if another socket holds it.
  Status st;
  for (int attempt = 0; attempt < (opts_.port == 0 ? 16 : 1); ++attempt) {
    st = bind_all(opts_.port);
    if (st.ok()) break;
    udp_.clear();
    acceptors_.clear();
  }
  if (!st.ok()) return st;
  // Forwarding to ourselves would bounce every query until max_inflight.
  for (const Server& s : upstream_->servers()) {
    const bool loopback_self = (s.ip.to_string() == "127.0.0.1" || s.ip.to_string() == "::1") && s.port == port_;
    if (loopback_self) return Error::invalid("dns proxy: upstream " + s.to_string() + " is the proxy itself");
  }

  auto self = shared_from_this();
  for (auto& s : udp_) asio::co_spawn(io_, udp_loop(self, *s), log_exception);
  for (auto& a : acceptors_) asio::co_spawn(io_, accept_loop(self, *a), log_exception);
  std::string servers;
  for (const Server& s : upstream_->servers()) servers += (servers.empty() ? "" : ",") + s.to_string();
  log_->info("event=proxy_started port={} ipv6={} upstream={} mark={:#x} inflight_max={}", port_,
             udp_.size() > 1, servers, opts_.own_mark, opts_.max_inflight);
  return {};
}

Status Core::bind_all(std::uint16_t port) {
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
      return Error::runtime("dns proxy: bind udp " + where + ": " + ec.message());
    }
    if (port == 0) port = us->local_endpoint().port();
    us->non_blocking(true, ec);
    auto acc = std::make_unique<tcp::acceptor>(io_);
    const tcp::endpoint tep(a.addr, port);
    const std::string twhere =
        (a.addr.is_v4() ? a.addr.to_string() : "[" + a.addr.to_string() + "]") + ":" + std::to_string(port);
    acc->open(tep.protocol(), ec);
    if (!ec) acc->set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acc->bind(tep, ec);
    if (!ec) acc->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Error::runtime("dns proxy: bind tcp " + twhere + ": " + ec.message());
    udp_.push_back(std::move(us));
    acceptors_.push_back(std::move(acc));
  }
  port_ = port;
  return {};
}

void Core::close() {
  if (closed_) return;
  closed_ = true;
  error_code ec;
  for (auto& s : udp_) s->close(ec);
  for (auto& a : acceptors_) a->close(ec);
  // TcpConn::close erases itself from tcp_.
  std::vector<TcpConn*> conns(tcp_.begin(), tcp_.end());
  for (TcpConn* c : conns) c->close();
  // Pending queries are abandoned: no hook and no callback runs after close.
  upstream_.reset();
  if (port_ == 0) return;  // never started
  log_->info("event=proxy_closed forwarded={} refused={} failed={} malformed={}", counters_.forwarded,
             counters_.refused, counters_.failed, counters_.malformed);
}

awaitable<void> Core::udp_loop([[maybe_unused]] std::shared_ptr<Core> self, udp::socket& sock) {
  // One byte over the largest query we accept: a datagram that fills the
  // buffer was cut short by the kernel and is dropped.
  std::vector<std::uint8_t> buf(kMaxUdpSize + 1);
  error_code ec;
  while (!closed_) {
    co_await sock.async_wait(udp::socket::wait_read, asio::redirect_error(use_awaitable, ec));
    if (closed_ || ec == asio::error::operation_aborted) co_return;
    if (ec) {
      log_->error("event=udp_wait_failed error=\"{}\"", ec.message());
      co_return;
    }
    // Drain what is queued (bounded, so TCP and upstream answers get turns).
    for (int i = 0; i < 64 && !closed_; ++i) {
      udp::endpoint peer;
      const std::size_t n = sock.receive_from(asio::buffer(buf), peer, 0, ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) break;
      if (ec) {
        log_->debug("event=udp_receive_failed error=\"{}\"", ec.message());
        break;
      }
      if (n > kMaxUdpSize) {
        ++counters_.malformed;
        continue;
      }
      handle(std::span(buf.data(), n), Client{&sock, peer, kClassicUdpSize, nullptr});
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
    if (!tcp_slot()) {
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
  error_code ec;
  client.udp_sock->send_to(asio::buffer(answer), client.peer, 0, ec);
  if (ec) log_->debug("event=udp_send_failed error=\"{}\"", ec.message());
}

void Core::forward(std::span<std::uint8_t> msg, const ParsedQuery& q, const Client& client) {
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
  p->start = Clock::now();
  ++counters_.forwarded;
  // The upstream sees our random ID, not the sandbox's.
  set_id(msg, upstream_->random_id());
  upstream_->send(msg, [p](Result<Bytes> r) { p->core->on_upstream(p, std::move(r)); });
}

void Core::fail(const std::shared_ptr<Pending>& p, std::string_view why) {
  if (p->done) return;
  p->done = true;
  ++counters_.failed;
  unsigned suppressed = 0;
  if (fail_log_.allow(Clock::now(), suppressed)) {
    log_->warn("event=query qname={} qtype={} action=servfail reason=\"{}\" ms={} suppressed={}", p->qname, p->qtype,
               why,
               std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - p->start).count(), suppressed);
  }
  reply(p->client, make_local_answer(p->prefix, p->header, p->prefix.size(), Rcode::servfail));
}

void Core::on_upstream(const std::shared_ptr<Pending>& p, Result<Bytes> r) {
  if (closed_) return;
  if (!r) return fail(p, r.error().message);
  const Bytes answer = *r;
  auto parsed = parse_answer(answer, p->qname);
  if (!parsed) return fail(p, "bad upstream answer: " + parsed.error().message);
  if (parsed->question.name != p->qname || parsed->question.qtype != p->qtype) {
    return fail(p, "upstream answered another question");
  }
  std::vector<std::uint8_t> out(answer.begin(), answer.end());
  restore_client_view(out, parsed->question_end, p->header.id,
                      Bytes(p->prefix).subspan(kHeaderSize));
  if (parsed->header.rcode() != Rcode::noerror || parsed->addresses.empty()) {
    release(p, std::move(out), 0);
    return;
  }
  std::vector<Learned> learned;
  learned.reserve(parsed->addresses.size());
  for (const ChainAddress& a : parsed->addresses) learned.push_back({p->qname, a.addr, a.ttl});
  const std::size_t n = learned.size();
  // The answer waits for the kernel: the client's first packet to these
  // addresses must not race the set update.
  hooks_.learn(std::move(learned), [p, out = std::move(out), n](Status st) mutable {
    Core& core = *p->core;
    if (core.closed()) return;
    if (!st.ok()) return core.fail(p, "learn: " + st.error().message);
    core.release(p, std::move(out), n);
  });
}

void Core::release(const std::shared_ptr<Pending>& p, std::vector<std::uint8_t> answer, std::size_t learned) {
  if (p->done) return;
  p->done = true;
  if (log_->should_log(spdlog::level::debug)) {
    const auto h = read_header(answer);
    log_->debug("event=query qname={} qtype={} action=forward rcode={} learned={} us={}", p->qname, p->qtype,
                h ? to_string(h->rcode()) : "?", learned,
                std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - p->start).count());
  }
  reply(p->client, std::move(answer));
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
    upstream_->send(queries[i], [st, type, finish](Result<Bytes> r) {
      State& s = *st;
      if (!r) {
        s.errors += std::string(" ") + type + ": " + r.error().message;
      } else if (auto a = parse_answer(*r, s.name); !a) {
        s.errors += std::string(" ") + type + ": " + a.error().message;
      } else if (a->header.rcode() != Rcode::noerror) {
        s.errors += std::string(" ") + type + ": " + to_string(a->header.rcode());
      } else {
        s.answered = true;
        for (const ChainAddress& c : a->addresses) s.out.push_back({s.name, c.addr, c.ttl});
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
  std::uint16_t port() const override { return core_->port(); }
  ProxyCounters counters() const override { return core_->counters(); }
  void resolve(const std::string& name, std::function<void(Result<std::vector<Learned>>)> done) override {
    core_->resolve(name, std::move(done));
  }
  void close() override { core_->close(); }

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace

Result<std::unique_ptr<Proxy>> Proxy::start(asio::io_context& io, ProxyOptions opts, PolicyHooks& hooks) {
  auto core = std::make_shared<Core>(io, std::move(opts), hooks);
  if (Status st = core->start(); !st.ok()) {
    core->close();
    return st.error();
  }
  return std::unique_ptr<Proxy>(new ProxyImpl(std::move(core)));
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

}  // namespace egressd::dns
