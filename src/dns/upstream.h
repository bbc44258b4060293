// The upstream exchange: sends a DNS query to the configured name servers
// and hands back the one answer that provably belongs to it, driven by the
// asio io_context.
//
// Every try goes out from a fresh random source port, chosen by the kernel
// when egressd connects the socket to the server, with egressd's own SO_MARK;
// when the try ends the socket is closed, or, after a clean answer,
// disconnected (the kernel releases an autobound port then) and kept for a
// later query, which connects it again from a new random port. No port
// outlives its query, so a sandbox process cannot learn one ahead of time,
// nor reuse a flow egressd made earlier (issue 14, classes 2 and 3). An answer is taken only when its ID
// and its question bytes are exactly those sent (the question carries
// 0x20-randomised case, build_forward_query); datagrams with another ID are
// ignored, an answer with the right ID and the wrong question fails the query.
//
// Not c-ares: c-ares 1.18 (Debian 12) multiplexes every query of a channel
// over one long-lived socket per server and has no per-query socket option
// (UDP_MAX_QUERIES is 1.20); one channel per in-flight query would cost
// 73 KiB of RSS and ~170 µs of set-up each (measured), and its answer
// matching is case-insensitive. What it did for egressd (timeouts, retries
// over the servers, TCP on truncation, skipping a server that answers
// SERVFAIL/REFUSED/NOTIMP) is done here with the same schedule.
//
// Single-threaded: every call, and every completion, runs on the thread that
// runs the io_context.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dns/fd_budget.h"
#include "dns/message.h"
#include "egressd/async_callback.h"
#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd::dns {

struct Exchange;

// One upstream server: address and port (53 unless given).
struct Server {
  IpPrefix ip;
  std::uint16_t port = 53;
  // "192.0.2.1:53", "[2001:db8::1]:53".
  std::string to_string() const;
  friend bool operator==(const Server&, const Server&) = default;
};

// `ip` (a single address) as Asio's address type.
boost::asio::ip::address to_address(const IpPrefix& ip);

// Parses "192.0.2.1", "192.0.2.1:5353", "2001:db8::1", "[2001:db8::1]" or
// "[2001:db8::1]:5353". Error (invalid) naming the text otherwise.
Result<Server> parse_server(std::string_view text);

// A UDP flow of egressd's to an upstream that has ended (its answer read).
struct FlowTuple {
  IpPrefix src, dst;  // single addresses, same family
  std::uint16_t sport = 0, dport = 0;
  std::uint8_t proto = 17;  // IPPROTO_UDP; IPPROTO_TCP (6) for a TCP try's port (Exchange::clear_tcp_port)
};
// Told of such flows, so their conntrack entries are dropped before their
// ports go back to the namespace's ephemeral range: a sandbox process that
// draws one for its own DNS query (to the same server: the sandbox's
// queries go where egressd's do) must get a new flow, redirected to the
// proxy, not the reply-less tail of egressd's (which the output chain
// denies: EPERM); and egressd's next query that draws it must not have its
// own flow deleted under it (its answer would then come in as a new flow
// to a marked socket, which chain input drops). Called once per turn of the
// loop with that turn's flows; the deletions must be in the kernel when it
// returns, for the ports are released right after. Called from close() and
// the destructor too: it must outlive the Upstream. Called as well with the
// one flow of a send that failed EPERM: a sandbox query's stale entry on the
// port the kernel drew again (see Exchange::send_udp), and with the TCP
// flow of a TCP try before its connect (Exchange::clear_tcp_port). Conntrack
// finds an entry by either of its directions: the one flow also takes an
// entry whose reply direction it is. May be empty.
using ForgetFlow = std::function<void(std::span<const FlowTuple>)>;

struct UpstreamOptions {
  std::vector<std::string> servers;  // as parse_server reads them, in order of preference
  std::uint32_t mark = 0;            // SO_MARK on every upstream socket (0 = none)
  ForgetFlow forget;                 // see ForgetFlow
  // Budget for one query across every server and retry: a dead upstream
  // fails the query after about this long.
  std::chrono::milliseconds timeout{1500};
  // Opens every upstream socket (domain, type as for socket(2), SOCK_NONBLOCK
  // and SOCK_CLOEXEC included): the fd, or -1 with errno. Unset: socket(2) in
  // the calling thread's namespace. egressd agent uses it to open them in a
  // sandbox's namespace (dns.upstream_netns: sandbox).
  std::function<int(int domain, int type)> open_socket;
  // A pooled socket unused for this long (up to twice it) is closed: a
  // burst's sockets go back to the process once it is over. Checked on a
  // timer armed only while the pool holds any.
  std::chrono::milliseconds pool_idle{1000};
  // Charged for every socket this upstream holds, pooled or in use (the
  // agent's budget shared by its sandboxes, fd_budget.h); a socket refused
  // fails its query at once (UpstreamFailure::descriptors). Null: no budget
  // (the sidecar: its descriptors are its own).
  std::shared_ptr<FdAccount> fds;
};

// Asked before every try of an exchange after its first (the next server or
// round, TCP after a truncated answer): false fails the exchange at once
// (UpstreamFailure::withdrawn) and nothing more is sent. The proxy's: does
// the phase in force still forward this name? A switch must stop what an
// earlier phase sent, not let it go out again (DESIGN §1: the upstream sees
// no query for a name the phase does not allow).
using MayRetry = std::function<bool()>;

// An exchange's outcome: the answer's bytes (owned: a coroutine reads them
// after it resumes, when the receive buffer already holds another answer),
// or why there is none.
using Answer = Result<std::vector<std::uint8_t>>;

// Why a query failed, for logs and counters.
enum class UpstreamFailure {
  none,
  timeout,       // no answer from any server in time
  unreachable,   // every try was refused (ICMP unreachable, connection refused) or could not be sent
  rcode,         // every server answered SERVFAIL, REFUSED or NOTIMP
  mismatch,      // an answer with the query's ID did not echo its question exactly (0x20 check)
  unavailable,   // no server may be used now (every one held by someone else)
  descriptors,   // no descriptor for a socket: the budget's share is held (UpstreamOptions::fds), or EMFILE
  withdrawn,     // a try after the first was due and the caller's MayRetry said no
  closed,
};

class Upstream {
 public:
  // Error (invalid) for a bad or empty server list.
  static Result<std::unique_ptr<Upstream>> create(boost::asio::io_context& io, const UpstreamOptions& opts);
  // Abandons pending queries: their callbacks are destroyed, never called.
  // Safe to run from inside a callback.
  ~Upstream();
  Upstream(const Upstream&) = delete;
  Upstream& operator=(const Upstream&) = delete;

  // Sends `query` exactly as given: a whole message with qdcount 1 whose ID
  // and question go on the wire unchanged. Tries the usable servers in
  // order, over UDP (TCP when an answer is truncated, or from the start with
  // `tcp`), each try on a new socket; a try times out after timeout /
  // (servers * 3), the second round after twice that. Completes exactly
  // once, with signature void(Answer): an answer that echoes the query's ID
  // and question bytes, or a runtime error naming the server and the reason
  // (last_failure() tells which, until the next exchange completes). Never
  // completes inside this call: an immediate failure (no usable server, a
  // query that is not a message) is posted to the handler's executor. When
  // the Upstream is destroyed first, the handler is destroyed uncalled (a
  // coroutine waiting on it is unwound, never resumed). `query` is copied
  // when the operation is initiated (with use_awaitable: when awaited).
  //
  //   Answer a = co_await upstream.async_exchange(q, false, boost::asio::use_awaitable);
  //
  // The signature is one Result rather than (error_code, bytes): the error a
  // caller logs and counts is a message naming the server and the reason
  // (a mismatched 0x20 echo, SERVFAIL from every server), which an
  // error_code cannot carry, and a Result cannot be read without checking.
  //
  // `may_retry` (optional): asked before each try after the first; see MayRetry.
  template <class CompletionToken>
  auto async_exchange(Bytes query, bool tcp, CompletionToken&& token, MayRetry may_retry = {}) {
    return async_from_callback<Answer>(
        executor(), std::forward<CompletionToken>(token),
        [this, query, tcp, may_retry = std::move(may_retry)](AnswerCallback done) mutable {
          send(query, std::move(done), tcp, std::move(may_retry));
        });
  }

  // What made the last failed exchange fail (for the caller's logs), valid
  // when its completion runs, until the next one completes.
  UpstreamFailure last_failure() const;

  // Excludes servers()[i] from every later try (`usable` false), with the
  // reason a query gets when no server is left; or takes it back.
  void set_usable(std::size_t i, bool usable, std::string why = {});
  bool usable(std::size_t i) const;

  // The SO_MARK of sockets opened from now on.
  void set_mark(std::uint32_t mark);

  // A query ID from the kernel's CSPRNG, so the IDs the upstream sees cannot
  // be predicted (or chosen) by the sandbox.
  std::uint16_t random_id();
  // Random bits for 0x20 (build_forward_query), from the same source.
  void random_case(std::span<std::uint8_t, kCaseBits> out);

  std::size_t pending() const;
  // Datagrams read and dropped from pooled sockets (queued before the
  // disconnect that ended their query) so the next query never sees them.
  std::uint64_t stale_dropped() const;
  // Sockets held now (UDP pooled or in use, TCP).
  std::size_t sockets() const;
  const std::vector<Server>& servers() const;

  // The local port of every socket an unfinished query holds right now.
  std::vector<std::uint16_t> open_ports() const;

 private:
  struct Impl;
  friend struct Exchange;
  using AnswerCallback = std::function<void(Answer)>;
  explicit Upstream(std::shared_ptr<Impl> impl);
  boost::asio::io_context::executor_type executor() const;
  // The initiation of async_exchange: calls `done` exactly once, maybe
  // before it returns; destroys it uncalled when the Upstream goes first.
  void send(Bytes query, AnswerCallback done, bool tcp, MayRetry may_retry = {});
  std::shared_ptr<Impl> impl_;
};

}  // namespace egressd::dns
