#include "audit/nflog.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <libmnl/libmnl.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_log.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <chrono>
#include <cerrno>
#include <cstring>
#include <vector>

#include "nft/transport.h"

namespace egressd::audit {

namespace asio = boost::asio;

namespace {

constexpr std::uint8_t kIcmp = 1, kTcp = 6, kUdp = 17, kIcmpv6 = 58, kSctp = 132, kUdplite = 136;
// Enough of a packet for IPv6 with a few extension headers and the ports.
constexpr std::uint32_t kCopyRange = 160;
// IPv6 extension headers walked before giving up (a packet may chain many to
// hide its transport header; the kernel does not bound them either).
constexpr int kMaxExtHeaders = 8;

std::uint16_t be16(std::span<const std::uint8_t> b, std::size_t off) {
  return static_cast<std::uint16_t>(b[off] << 8 | b[off + 1]);
}

void transport(std::span<const std::uint8_t> pkt, std::size_t off, bool first_fragment, LoggedPacket& p) {
  if (!first_fragment) return;
  switch (p.proto) {
    case kTcp:
    case kUdp:
    case kUdplite:
    case kSctp:
      if (off + 4 <= pkt.size()) p.port = be16(pkt, off + 2);
      break;
    case kIcmp:
    case kIcmpv6:
      if (off + 1 <= pkt.size()) p.icmp_type = pkt[off];
      break;
    default: break;
  }
}

std::uint32_t host32(std::span<const std::uint8_t> b, std::size_t off) {
  std::uint32_t v;
  std::memcpy(&v, b.data() + off, sizeof v);
  return v;  // netlink headers are in host byte order
}
std::uint16_t host16(std::span<const std::uint8_t> b, std::size_t off) {
  std::uint16_t v;
  std::memcpy(&v, b.data() + off, sizeof v);
  return v;
}

}  // namespace

std::optional<LoggedPacket> parse_ip_packet(std::span<const std::uint8_t> pkt) {
  if (pkt.empty()) return std::nullopt;
  LoggedPacket p;
  const int version = pkt[0] >> 4;
  if (version == 4) {
    if (pkt.size() < 20) return std::nullopt;
    const std::size_t ihl = static_cast<std::size_t>(pkt[0] & 0x0f) * 4;
    if (ihl < 20 || ihl > pkt.size()) return std::nullopt;
    p.proto = pkt[9];
    p.dst.family = 4;
    p.dst.prefix_len = 32;
    std::memcpy(p.dst.bytes.data(), pkt.data() + 16, 4);
    const bool first = (be16(pkt, 6) & 0x1fff) == 0;
    transport(pkt, ihl, first, p);
    return p;
  }
  if (version != 6 || pkt.size() < 40) return std::nullopt;
  p.dst.family = 6;
  p.dst.prefix_len = 128;
  std::memcpy(p.dst.bytes.data(), pkt.data() + 24, 16);
  std::uint8_t nh = pkt[6];
  std::size_t off = 40;
  bool first = true;
  for (int i = 0; i < kMaxExtHeaders; ++i) {
    if (nh == 0 || nh == 43 || nh == 60) {  // hop-by-hop, routing, destination options
      if (off + 2 > pkt.size()) break;
      const std::uint8_t next = pkt[off];
      off += (static_cast<std::size_t>(pkt[off + 1]) + 1) * 8;
      nh = next;
    } else if (nh == 44) {  // fragment
      if (off + 8 > pkt.size()) break;
      const std::uint8_t next = pkt[off];
      first = (be16(pkt, off + 2) & 0xfff8) == 0;
      off += 8;
      nh = next;
    } else if (nh == 51) {  // authentication header (length in 4-octet units)
      if (off + 2 > pkt.size()) break;
      const std::uint8_t next = pkt[off];
      off += (static_cast<std::size_t>(pkt[off + 1]) + 2) * 4;
      nh = next;
    } else {
      break;
    }
  }
  p.proto = nh;
  transport(pkt, off, first, p);
  return p;
}

std::optional<std::span<const std::uint8_t>> nflog_payload(std::span<const std::uint8_t> msg) {
  constexpr std::size_t kHdr = NLMSG_HDRLEN, kAttrs = NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(nfgenmsg));
  if (msg.size() < kAttrs) return std::nullopt;
  const std::uint32_t len = host32(msg, 0);
  const std::uint16_t type = host16(msg, 4);
  if (len < kAttrs || len > msg.size()) return std::nullopt;
  if (type != ((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET)) return std::nullopt;
  (void)kHdr;
  std::size_t off = kAttrs;
  while (off + NLA_HDRLEN <= len) {
    const std::uint16_t alen = host16(msg, off);
    const std::uint16_t atype = host16(msg, off + 2) & NLA_TYPE_MASK;
    if (alen < NLA_HDRLEN || off + alen > len) return std::nullopt;
    if (atype == NFULA_PAYLOAD) return msg.subspan(off + NLA_HDRLEN, alen - NLA_HDRLEN);
    off += NLA_ALIGN(alen);
  }
  return std::nullopt;
}

namespace {

// Binds `group` to the transport's socket (NFULNL_CFG_CMD_BIND) with full
// packet copies up to kCopyRange, one packet per message.
Status configure(nft::Transport& t, std::uint16_t group) {
  std::vector<char> buf(MNL_SOCKET_BUFFER_SIZE);
  nlmsghdr* nlh = mnl_nlmsg_put_header(buf.data());
  nlh->nlmsg_type = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG;
  nlh->nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK;
  auto* nfg = static_cast<nfgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(nfgenmsg)));
  nfg->nfgen_family = AF_UNSPEC;
  nfg->version = NFNETLINK_V0;
  nfg->res_id = htons(group);
  nfulnl_msg_config_cmd cmd{NFULNL_CFG_CMD_BIND};
  mnl_attr_put(nlh, NFULA_CFG_CMD, sizeof cmd, &cmd);
  nfulnl_msg_config_mode mode{};
  mode.copy_range = htonl(kCopyRange);
  mode.copy_mode = NFULNL_COPY_PACKET;
  mnl_attr_put(nlh, NFULA_CFG_MODE, sizeof mode, &mode);
  // One packet per message, sent at once: the default (100 packets or 1 s)
  // would hold a denial back from `denied --follow` for up to a second.
  mnl_attr_put_u32(nlh, NFULA_CFG_QTHRESH, htonl(1));
  // Bounded: a kernel without nfnetlink_log must not hang start-up.
  const int err = t.request(nlh, [](const nlmsghdr*) {}, std::chrono::seconds(1));
  if (err == ETIMEDOUT) {
    return errno_error("nflog: no answer to the bind request for group " + std::to_string(group), EAGAIN);
  }
  if (err == EBUSY) {
    return Error::runtime("nflog: group " + std::to_string(group) +
                          " is already bound by another listener in this network namespace");
  }
  if (err != 0) return errno_error("nflog: cannot bind group " + std::to_string(group), err);
  return {};
}

class Reader : public NflogReader {
 public:
  Reader(std::unique_ptr<nft::Transport> t, std::function<void(const LoggedPacket&)> on_packet)
      : t_(std::move(t)), on_packet_(std::move(on_packet)) {}
  ~Reader() override { close(); }  // first: the handlers below use on_packet_ and stats_

  // Bounded per turn (the transport's) so a log flood cannot starve control requests.
  void start() {
    nft::Transport::Handlers h;
    h.message = [this](const nlmsghdr* nlh) { handle(nlh); };
    h.overrun = [this] { ++stats_.overruns; };  // messages lost; the next read continues after them
    t_->start(std::move(h));
  }
  NflogStats stats() const override { return stats_; }
  void close() override { t_->stop(); }

 private:
  void handle(const nlmsghdr* nlh) {
    if (nlh->nlmsg_type != ((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET)) return;
    auto msg = std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(nlh), nlh->nlmsg_len);
    auto payload = nflog_payload(msg);
    auto pkt = payload ? parse_ip_packet(*payload) : std::nullopt;
    if (pkt) {
      ++stats_.packets;
      on_packet_(*pkt);
    } else {
      ++stats_.unparsable;
    }
  }

  std::unique_ptr<nft::Transport> t_;
  std::function<void(const LoggedPacket&)> on_packet_;
  NflogStats stats_;
};

}  // namespace

Result<std::unique_ptr<NflogReader>> NflogReader::open(asio::io_context& io, std::uint16_t group,
                                                       std::function<void(const LoggedPacket&)> on_packet) {
  nft::TransportOptions o;
  o.protocol = NETLINK_NETFILTER;
  // Room for bursts between event-loop turns (the kernel rate limit bounds them).
  o.rcvbuf = 1 << 20;
  o.what = "nflog";
  auto t = nft::Transport::open(io, std::move(o));
  if (!t) return t.error();
  if (auto s = configure(**t, group); !s) return s.error();
  auto r = std::make_unique<Reader>(std::move(*t), std::move(on_packet));
  r->start();
  return std::unique_ptr<NflogReader>(std::move(r));
}

}  // namespace egressd::audit
