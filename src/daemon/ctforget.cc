#include "daemon/ctforget.h"

#include <libmnl/libmnl.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_conntrack.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <spdlog/spdlog.h>

#include "egressd/module_logger.h"

namespace egressd::daemon {

namespace {

// Well above one event-loop turn of answers; a bigger batch is sent in parts.
constexpr std::size_t kMaxBatch = 32 * 1024;

}  // namespace

Result<std::unique_ptr<ConntrackForgetter>> ConntrackForgetter::open(boost::asio::io_context& io) {
  nft::TransportOptions o;
  o.protocol = NETLINK_NETFILTER;
  o.what = "conntrack netlink";
  auto t = nft::Transport::open(io, std::move(o));
  if (!t) return t.error();
  std::unique_ptr<ConntrackForgetter> f(new ConntrackForgetter(std::move(*t)));
  // The kernel handles a batch inside the send and queues its error
  // reports (ENOENT for flows already gone); they are read when they come,
  // so a batch costs no read of an empty socket, and the buffer never
  // fills. The transport stops before the forgetter goes (it owns it).
  ConntrackForgetter* self = f.get();
  f->t_->start({.message =
                    [self](const nlmsghdr* h) {
                      if (h->nlmsg_type != NLMSG_ERROR || h->nlmsg_len < NLMSG_LENGTH(sizeof(nlmsgerr))) return;
                      const auto* e = static_cast<const nlmsgerr*>(mnl_nlmsg_get_payload(h));
                      if (e->error != 0 && e->error != -ENOENT) ++self->failed_;
                    },
                .overrun = {},
                .turn_done = {},
                .error = {}});
  return f;
}

namespace {

// nlmsghdr + nfgenmsg + CTA_TUPLE_ORIG for `proto` src:sport -> dst:dport.
nlmsghdr* put_ct_tuple(std::uint8_t* buf, std::uint16_t msg, std::uint32_t seq, std::uint8_t proto,
                       const IpPrefix& src, const IpPrefix& dst, std::uint16_t sport, std::uint16_t dport) {
  nlmsghdr* nlh = mnl_nlmsg_put_header(buf);
  nlh->nlmsg_type = static_cast<std::uint16_t>((NFNL_SUBSYS_CTNETLINK << 8) | msg);
  // No NLM_F_ACK: the kernel still reports errors, and they are drained.
  nlh->nlmsg_flags = NLM_F_REQUEST;
  nlh->nlmsg_seq = seq;
  auto* nfg = static_cast<nfgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(nfgenmsg)));
  const bool v4 = src.family == 4;
  nfg->nfgen_family = v4 ? AF_INET : AF_INET6;
  nfg->version = NFNETLINK_V0;
  nfg->res_id = 0;
  nlattr* tuple = mnl_attr_nest_start(nlh, CTA_TUPLE_ORIG);
  nlattr* ip = mnl_attr_nest_start(nlh, CTA_TUPLE_IP);
  if (v4) {
    mnl_attr_put(nlh, CTA_IP_V4_SRC, 4, src.bytes.data());
    mnl_attr_put(nlh, CTA_IP_V4_DST, 4, dst.bytes.data());
  } else {
    mnl_attr_put(nlh, CTA_IP_V6_SRC, 16, src.bytes.data());
    mnl_attr_put(nlh, CTA_IP_V6_DST, 16, dst.bytes.data());
  }
  mnl_attr_nest_end(nlh, ip);
  nlattr* p = mnl_attr_nest_start(nlh, CTA_TUPLE_PROTO);
  mnl_attr_put_u8(nlh, CTA_PROTO_NUM, proto);
  mnl_attr_put_u16(nlh, CTA_PROTO_SRC_PORT, htons(sport));
  mnl_attr_put_u16(nlh, CTA_PROTO_DST_PORT, htons(dport));
  mnl_attr_nest_end(nlh, p);
  mnl_attr_nest_end(nlh, tuple);
  return nlh;
}

}  // namespace

void append_delete_ct(std::vector<std::uint8_t>& out, std::uint8_t proto, const IpPrefix& src, const IpPrefix& dst,
                      std::uint16_t sport, std::uint16_t dport, std::uint32_t seq) {
  alignas(4) std::uint8_t buf[256];
  std::memset(buf, 0, sizeof buf);
  const nlmsghdr* nlh = put_ct_tuple(buf, IPCTNL_MSG_CT_DELETE, seq, proto, src, dst, sport, dport);
  out.insert(out.end(), buf, buf + nlh->nlmsg_len);
}

void ConntrackForgetter::append_delete(std::vector<std::uint8_t>& out, const dns::FlowTuple& t, std::uint32_t seq) {
  append_delete_ct(out, t.proto, t.src, t.dst, t.sport, t.dport, seq);
}

void append_set_ct_mark(std::vector<std::uint8_t>& out, std::uint8_t proto, const IpPrefix& src, const IpPrefix& dst,
                        std::uint16_t sport, std::uint16_t dport, std::uint32_t mark, std::uint32_t seq) {
  alignas(4) std::uint8_t buf[256];
  std::memset(buf, 0, sizeof buf);
  // IPCTNL_MSG_CT_NEW without NLM_F_CREATE: updates the entry, creates none.
  nlmsghdr* nlh = put_ct_tuple(buf, IPCTNL_MSG_CT_NEW, seq, proto, src, dst, sport, dport);
  mnl_attr_put_u32(nlh, CTA_MARK, htonl(mark));
  out.insert(out.end(), buf, buf + nlh->nlmsg_len);
}

void ConntrackForgetter::forget(std::span<const dns::FlowTuple> flows) {
  for (const dns::FlowTuple& t : flows) {
    if (t.src.family != t.dst.family || (t.src.family != 4 && t.src.family != 6)) continue;
    append_delete(batch_, t, t_->next_seq());
    ++pending_;
    if (batch_.size() >= kMaxBatch) flush();
  }
  flush();
}

void ConntrackForgetter::flush() {
  if (batch_.empty()) return;
  if (const int err = t_->send(batch_.data(), batch_.size()); err != 0) {
    module_logger("dns")->warn("event=conntrack_forget_failed error=\"{}\"", errno_text(err));
  }
  sent_ += pending_;
  pending_ = 0;
  batch_.clear();
}

}  // namespace egressd::daemon
