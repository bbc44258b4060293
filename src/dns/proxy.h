// The DNS proxy: answers the sandbox's queries (redirected to it by nat rules)
// and forwards only what the policy in force allows. It parses packets written
// by the untrusted sandbox: every read is bounds-checked (message.h).
#pragma once

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd::dns {

enum class Action { forward, refuse, nxdomain };

// An address learned from an allowed answer: the A/AAAA at the end of the
// CNAME chain that starts at the query name.
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
};

struct ProxyOptions {
  std::uint16_t port = 0;                 // listen port on 127.0.0.1 and ::1 (0 = pick one)
  std::vector<std::string> upstream;      // IP addresses ("192.0.2.1", "2001:db8::1", "192.0.2.1:5353", "[::1]:5353");
                                          // the word "resolv.conf" must be expanded first (nameservers_from_resolv_conf)
  std::uint32_t own_mark = 0;             // SO_MARK on every upstream socket
  std::chrono::milliseconds upstream_timeout{1500};  // SERVFAIL after this (dead upstream)
  std::size_t max_inflight = 1024;        // beyond this, new queries get SERVFAIL at once
  std::chrono::seconds tcp_idle{10};
  std::size_t max_tcp_connections = 64;   // beyond this, new TCP connections are closed at once
};

// forwarded: sent upstream; refused: answered REFUSED/NXDOMAIN by policy;
// failed: answered SERVFAIL (upstream failure, learn failure, inflight limit);
// malformed: dropped or answered FORMERR/NOTIMP.
// inflight: forwarded queries not answered yet (a gauge, not a counter; at
// most max_inflight).
struct ProxyCounters {
  std::uint64_t forwarded = 0, refused = 0, failed = 0, malformed = 0;
  std::uint64_t inflight = 0;
};

// Single-threaded: every call, and every PolicyHooks call it makes, runs on
// the thread that runs `io`. After close() (or destruction) no hook and no
// resolve callback is called; pending queries are abandoned.
class Proxy {
 public:
  // Binds UDP and TCP on loopback in the current network namespace. Fails
  // (runtime) naming the address when a socket cannot be bound.
  static Result<std::unique_ptr<Proxy>> start(boost::asio::io_context& io, ProxyOptions opts, PolicyHooks& hooks);
  virtual ~Proxy() = default;
  virtual std::uint16_t port() const = 0;
  virtual ProxyCounters counters() const = 0;
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

}  // namespace egressd::dns
