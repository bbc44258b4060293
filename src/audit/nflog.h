// Denied packets as the kernel logs them: the deny chain's `log group N`
// statement hands each (rate-limited) packet to nfnetlink_log, and this
// reader receives it on a NETLINK_NETFILTER socket bound to group N in the
// sandbox's network namespace (netlink sockets belong to the namespace they
// are created in: create the reader after joining it).
//
// The parsers are pure and bounds-checked: the logged bytes are a packet the
// untrusted sandbox wrote.
#pragma once

#include <linux/netlink.h>

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd::audit {

// What a denied record needs of a packet.
struct LoggedPacket {
  std::uint8_t proto = 0;  // IP protocol (after IPv6 extension headers)
  IpPrefix dst;            // single address
  std::optional<std::uint16_t> port;  // tcp/udp/udplite/sctp destination port, when present in the copy
  std::optional<std::uint8_t> icmp_type;  // icmp/ipv6-icmp type, when present in the copy
};

// Parses an IPv4 or IPv6 packet starting at its IP header, as NFLOG copied it
// (possibly cut short by the copy range). nullopt when the bytes are not an
// IP packet or its IP header is incomplete; a missing transport header only
// leaves port/icmp_type empty. Non-first fragments carry no port.
std::optional<LoggedPacket> parse_ip_packet(std::span<const std::uint8_t> pkt);

// The packet payload (NFULA_PAYLOAD) of one nfnetlink_log NFULNL_MSG_PACKET
// message `msg` (netlink header included, `msg.size()` bytes available).
// nullopt when it is another message, or malformed or truncated.
std::optional<std::span<const std::uint8_t>> nflog_payload(std::span<const std::uint8_t> msg);

struct NflogStats {
  std::uint64_t packets = 0;      // logged packets parsed
  std::uint64_t unparsable = 0;   // messages or packets that did not parse
  std::uint64_t overruns = 0;     // ENOBUFS: the socket buffer overflowed, messages were lost
};

// Receives the log messages of one NFLOG group on the event loop and calls
// `on_packet` for each parsed packet (on the io_context's thread).
//
// Shutdown: close() (also run by the destructor) stops the nft::Transport's
// receive loop, the reader's only pending work. That coroutine holds the
// transport's state, not the reader, and ends at its next resumption without
// a callback: when its wait is cancelled, and also when the wait had
// completed before close() (then queued, no longer cancellable). So the
// reader may be destroyed with a receive pending and the loop run on.
class NflogReader {
 public:
  // Binds group `group` in the current network namespace. Runtime error when
  // netlink fails or another listener already holds the group (EBUSY).
  static Result<std::unique_ptr<NflogReader>> open(boost::asio::io_context& io, std::uint16_t group,
                                                    std::function<void(const LoggedPacket&)> on_packet);
  virtual ~NflogReader() = default;
  virtual NflogStats stats() const = 0;
  // Stops reading; no callback after this returns.
  virtual void close() = 0;
};

}  // namespace egressd::audit
