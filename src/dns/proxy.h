// The DNS proxy: answers the sandbox's queries (redirected to it by nat rules)
// and forwards only what the policy in force allows. It parses packets written
// by the untrusted sandbox: every read is bounds-checked (message.h).
#pragma once

#include <array>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dns/upstream.h"
#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd::dns {

enum class Action { forward, refuse, nxdomain };

// An address learned from an allowed answer: the A/AAAA at the end of the
// CNAME chain that starts at the query name.
// One of the proxy's listening sockets in the sandbox's namespace (bound,
// so hashed, for as long as the proxy holds it).
struct ListenerSocket {
  int family = 0;  // AF_INET or AF_INET6
  bool udp = false;
};

struct Learned {
  std::string qname;   // the name the sandbox asked for (lower-case, no trailing dot)
  IpPrefix addr;       // single address
  std::uint32_t ttl;   // seconds, as answered
};

// What the proxy asks of the rest of egressd. Implemented by the daemon's
// Sandbox; faked in tests.
class PolicyHooks {
 public:
  virtual ~PolicyHooks() = default;
  // What to do with a query for `qname` (lower-case, no trailing dot) under
  // the phase in force. public: forward; no-network: refuse; allowlist:
  // forward if a hostname/wildcard entry matches, else refuse/nxdomain.
  virtual Action decide(const std::string& qname) = 0;
  // Inserts the learned addresses into the kernel sets; calls `done` once the
  // kernel acknowledged (or failed). The answer is released only after `done`.
  virtual void learn(std::vector<Learned> addrs, std::function<void(Status)> done) = 0;
  // A query was refused locally (for denied records and counters).
  virtual void refused(const std::string& qname, std::uint16_t qtype) = 0;
  // The proxy is about to relay Docker's forwarder to `targets` (issue 14,
  // "names do not resolve under Docker's user-defined networks"): exempt
  // egressd's own marked traffic to their port 53 and keep them for the
  // next start (`source` says where they came from: "resolv.conf", "state",
  // "probe"); call `done` once the kernel has the exemption. Nothing is
  // relayed before. Default: nothing to do.
  virtual void relay_targets(const std::vector<IpPrefix>& targets, const std::string& source,
                             std::function<void(Status)> done) {
    (void)targets;
    (void)source;
    done({});
  }
};

// Where Docker's embedded resolver forwards names it does not know: the
// relay targets ("T"). Docker's resolver forwards egressd's own query as it
// received it, from inside the namespace, where egressd's redirect brings it
// straight back; the proxy recognises it by its exact question bytes
// (0x20 case included) and sends it to T itself.
struct ForwarderOptions {
  // Known targets (resolv.conf's "# ExtServers:" comment, or pinned by an
  // earlier egressd and kept in the kernel): no probe.
  std::vector<std::string> targets;
  std::string source;  // where `targets` came from (for relay_targets and logs)
  // Without known targets, when an upstream is local to the namespace: ask
  // it once over TCP for a random name under .invalid and pin T from the
  // original destination of the one forwarded copy that arrives, over a
  // connection accepted after the probe was sent, with no connection closed
  // at accept meanwhile and the TCP slots not nearly full at its start
  // (otherwise the sandbox may have suppressed Docker's copy: nothing is
  // pinned). A probe answered with no copy is final: later copies of
  // egressd's queries get SERVFAIL and start no probe.
  bool probe = false;
  // How long after the probe's answer a second arrival still counts as a
  // race (someone copying egressd's probe): then nothing is pinned.
  std::chrono::milliseconds probe_grace{200};
  // A probe that raced, was voided or got no answer, or a relay that found
  // no target (before any probe said "none"): the next probe waits this long.
  std::chrono::milliseconds probe_retry{10000};
};

struct ProxyOptions {
  std::uint16_t port = 0;                 // listen port on 127.0.0.1 and ::1 (0 = pick one)
  // When `port` is held by another socket: listen on another port (the same
  // for UDP and TCP, IPv4 and IPv6) instead of failing; port() says which.
  bool fallback_port = false;
  std::vector<std::string> upstream;      // IP addresses ("192.0.2.1", "2001:db8::1", "192.0.2.1:5353", "[::1]:5353");
                                          // the word "resolv.conf" must be expanded first (nameservers_from_resolv_conf)
  std::uint32_t own_mark = 0;             // SO_MARK on every upstream socket
  std::function<int(int domain, int type)> open_socket;  // opens upstream sockets (UpstreamOptions::open_socket)
  std::chrono::milliseconds upstream_timeout{1500};  // SERVFAIL after this (dead upstream)
  std::size_t max_inflight = 1024;        // beyond this, new queries get SERVFAIL at once
  std::chrono::seconds tcp_idle{10};
  std::size_t max_tcp_connections = 64;   // beyond this, new TCP connections are closed at once
                                          // (8 more while a forwarder probe is in flight)
  // Every TTL relayed to the sandbox, and every learned TTL, is capped here (dns.max_ttl).
  std::uint32_t max_ttl = 3600;
  // Upstreams local to the namespace (Docker's 127.0.0.11) on port 53: the
  // proxy binds each of them, UDP and TCP, before it serves, so no sandbox
  // process can take the address and answer in the upstream's name. One held
  // by someone else is not used (its queries fail) and is tried again every
  // `own_retry`.
  bool own_local_upstreams = true;
  std::chrono::milliseconds own_retry{1000};
  ForwarderOptions forwarder;
  // Where a redirected TCP connection was going (the socket's fd, IPv6 or
  // not): SO_ORIGINAL_DST when empty. Tests without nat substitute it.
  std::function<std::optional<Server>(int fd, bool v6)> original_dst;
  // Told of each upstream flow that has ended (see ForgetFlow). May be empty.
  ForgetFlow forget_flow;
  // Upstream sockets unused this long are closed (UpstreamOptions::pool_idle).
  std::chrono::milliseconds upstream_pool_idle{1000};
  // The agent's descriptor budget for this sandbox (UpstreamOptions::fds);
  // null in the sidecar.
  std::shared_ptr<FdAccount> fd_account;
};

// forwarded: sent upstream; refused: answered REFUSED/NXDOMAIN by policy;
// failed: answered SERVFAIL (upstream failure, learn failure, inflight limit);
// malformed: dropped or answered FORMERR/NOTIMP.
// inflight: forwarded queries not answered yet (a gauge, not a counter; at
// most max_inflight).
// relayed: queries of Docker's forwarder sent on to the relay target.
// answer_*: how long the sandbox waited for the answer to a forwarded query,
// from its arrival to the answer's release (after the learned addresses were
// in the kernel) or to egressd's SERVFAIL; one count per bucket of
// kAnswerBucketsUs (the last one counts the rest), not cumulative.
inline constexpr std::array<std::uint64_t, 12> kAnswerBucketsUs = {
    250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 1000000, 5000000};
struct ProxyCounters {
  std::uint64_t forwarded = 0, refused = 0, failed = 0, malformed = 0, relayed = 0;
  std::uint64_t inflight = 0;
  // Datagrams still queued on an upstream socket when its query ended (a
  // duplicate answer, a forger's guess), read and dropped before the
  // socket served another query.
  std::uint64_t stale = 0;
  // Upstream sockets held now, pooled or in use (a gauge).
  std::uint64_t upstream_sockets = 0;
  // Upstream sockets refused by the agent's descriptor budget (each failed
  // a query with SERVFAIL; also counted in `failed`).
  std::uint64_t fd_denied = 0;
  std::array<std::uint64_t, kAnswerBucketsUs.size() + 1> answer_buckets{};
  std::uint64_t answer_count = 0, answer_sum_us = 0;
  // Records one answer that took `us` microseconds.
  void answered(std::uint64_t us);
};

// Single-threaded: every call, and every PolicyHooks call it makes, runs on
// the thread that runs `io`. After close() (or destruction) no hook and no
// resolve callback is called; pending queries are abandoned.
class Proxy {
 public:
  // Binds UDP and TCP on loopback in the current network namespace, and the
  // local upstreams (own_local_upstreams), without serving yet: queries
  // queue in the kernel until serve(). Fails (runtime) naming the address
  // when a socket cannot be bound.
  static Result<std::unique_ptr<Proxy>> bind(boost::asio::io_context& io, ProxyOptions opts, PolicyHooks& hooks);
  // bind(), then serve(opts.own_mark, 0).
  static Result<std::unique_ptr<Proxy>> start(boost::asio::io_context& io, ProxyOptions opts, PolicyHooks& hooks);
  virtual ~Proxy() = default;
  // Replaces ProxyOptions::forwarder (before serve() only): targets an
  // earlier egressd pinned, adopted from the kernel.
  virtual void set_forwarder(ForwarderOptions forwarder) = 0;
  // Starts answering, with `own_mark` on every upstream socket and
  // `proxy_mark` (SO_MARK; 0: none) on the proxy's own sockets; runs the
  // forwarder probe when it is needed. Once.
  virtual void serve(std::uint32_t own_mark, std::uint32_t proxy_mark) = 0;
  virtual std::uint16_t port() const = 0;
  // True when port() is not the port asked for (it was held by someone else).
  virtual bool port_fell_back() const = 0;
  virtual ProxyCounters counters() const = 0;
  // The proxy's listening sockets (UDP and TCP, 127.0.0.1 and ::1): the flow
  // reaper counts them against the namespace's sockets. Empty once closed.
  virtual std::vector<ListenerSocket> listeners() const = 0;
  // Resolves A and AAAA of `name` upstream (pre-resolution at apply time);
  // calls `done` with the addresses (empty + error on failure).
  virtual void resolve(const std::string& name, std::function<void(Result<std::vector<Learned>>)> done) = 0;
  virtual void close() = 0;
};

// The upstream servers of `dns.upstream`: addresses as given, the word
// resolv.conf replaced by the nameservers of `resolv_conf_text`; duplicates
// removed, order kept.
std::vector<std::string> expand_upstreams(const DnsOptions& dns, const std::string& resolv_conf_text);

// Upstream servers from a resolv.conf text ("nameserver" lines), in order:
// at most 3 (glibc's MAXNS), duplicates and non-addresses (names, zone ids) skipped.
std::vector<std::string> nameservers_from_resolv_conf(const std::string& text);

// What Docker (>= 25) says in a container's resolv.conf about where its
// embedded resolver forwards: "# ExtServers: [192.0.2.53 host(127.0.0.53)]".
// Servers in host(...) are reached from the host's namespace (their queries
// never pass egressd); the others from the container's.
struct ExtServers {
  bool present = false;                 // the comment was there
  std::vector<std::string> targets;     // forwarded from inside the namespace: relay targets, port 53 only
  std::vector<std::string> host_side;   // host(...) entries
};
ExtServers ext_servers_from_resolv_conf(const std::string& text);

}  // namespace egressd::dns
