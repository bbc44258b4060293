#include "daemon/event_hub.h"

#include <fcntl.h>
#include <libmnl/libmnl.h>
#include <linux/capability.h>
#include <linux/net_namespace.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/rtnetlink.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <string>

namespace egressd::daemon {

namespace {

// Doubles a socket's receive buffer after an overrun, up to `max` bytes.
void grow_rcvbuf_of(nft::Transport& t, int max) {
  const int now = t.rcvbuf() / 2;  // the kernel reports twice what was set
  if (now <= 0 || now >= max) return;
  int want = std::min(now * 2, max);
  if (::setsockopt(t.fd(), SOL_SOCKET, SO_RCVBUFFORCE, &want, sizeof want) < 0) {
    (void)::setsockopt(t.fd(), SOL_SOCKET, SO_RCVBUF, &want, sizeof want);
  }
}

class OwnFeed final : public EventFeed {
 public:
  OwnFeed(std::unique_ptr<nft::Transport> t, std::vector<unsigned> groups) : t_(std::move(t)), groups_(std::move(groups)) {}
  ~OwnFeed() override { stop(); }
  void start(nft::Transport::Handlers h) override {
    h_ = h;
    t_->start(std::move(h), 256);
  }
  void stop() override { t_->stop(); }
  void hear_queued(std::size_t max_datagrams) override {
    const auto q = t_->read_queued([this](const nlmsghdr* nlh) { h_.message(nlh); }, max_datagrams);
    if (q.overrun && h_.overrun) h_.overrun();
    if (h_.turn_done) h_.turn_done();
  }
  std::uint32_t portid() const override { return t_->portid(); }
  int rcvbuf() const override { return t_->rcvbuf(); }
  void grow_rcvbuf(int max) override { grow_rcvbuf_of(*t_, max); }
  bool own_socket() const override { return true; }
  int leave() override {
    for (unsigned g : groups_) {
      if (int err = t_->leave(g); err != 0) return err;
    }
    return 0;
  }
  int join() override {
    for (unsigned g : groups_) {
      if (int err = t_->join(g); err != 0) return err;
    }
    return 0;
  }

 private:
  std::unique_ptr<nft::Transport> t_;
  std::vector<unsigned> groups_;
  nft::Transport::Handlers h_;
};

// CAP_NET_BROADCAST in the effective set, and the initial user namespace
// (where that capability covers every namespace's).
Status can_listen_everywhere() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3]{};
  if (::syscall(SYS_capget, &hdr, data) != 0) return errno_error("capget", errno);
  if ((data[CAP_NET_BROADCAST / 32].effective & (1u << (CAP_NET_BROADCAST % 32))) == 0) {
    return Error::runtime("no CAP_NET_BROADCAST");
  }
  std::ifstream f("/proc/self/uid_map");
  long inside = -1, outside = -1, count = -1;
  if (!(f >> inside >> outside >> count) || inside != 0 || outside != 0 || count != 4294967295L) {
    return Error::runtime("not in the initial user namespace");
  }
  return {};
}

}  // namespace

EventSource nftables_events() { return {NETLINK_NETFILTER, {NFNLGRP_NFTABLES}, "nftables monitor"}; }

EventSource link_events() {
  return {NETLINK_ROUTE, {RTNLGRP_LINK, RTNLGRP_IPV6_ROUTE}, "rtnetlink (link and route changes)"};
}

Result<std::unique_ptr<EventFeed>> open_own_feed(boost::asio::io_context& io, const EventSource& source, int rcvbuf) {
  nft::TransportOptions to;
  to.protocol = source.protocol;
  to.groups = source.groups;
  to.rcvbuf = rcvbuf;
  to.what = source.what;
  auto t = nft::Transport::open(io, std::move(to));
  if (!t) return t.error();
  return std::unique_ptr<EventFeed>(new OwnFeed(std::move(*t), source.groups));
}

class HubFeed final : public EventFeed {
 public:
  HubFeed(EventHub& hub, std::int32_t nsid) : hub_(hub), nsid_(nsid) {}
  ~HubFeed() override { stop(); }
  void start(nft::Transport::Handlers h) override {
    if (stopped_) return;
    auto& s = *hub_.sinks_.at(nsid_);
    s.h = std::move(h);
    s.started = true;
    hub_.start_loop();
  }
  void stop() override {
    if (stopped_) return;
    stopped_ = true;
    hub_.unregister(nsid_);
  }
  void hear_queued(std::size_t max_datagrams) override {
    if (!stopped_) hub_.hear_queued(max_datagrams);
  }
  std::uint32_t portid() const override { return hub_.events_->portid(); }
  int rcvbuf() const override { return hub_.events_->rcvbuf(); }
  void grow_rcvbuf(int) override {}  // the hub grows its buffer once per overrun
  bool own_socket() const override { return false; }
  int leave() override { return EOPNOTSUPP; }
  int join() override { return 0; }

 private:
  EventHub& hub_;
  const std::int32_t nsid_;
  bool stopped_ = false;
};

Result<std::unique_ptr<EventHub>> EventHub::open(boost::asio::io_context& io, const EventSource& source, int rcvbuf) {
  if (auto ok = can_listen_everywhere(); !ok) return ok.error();
  nft::TransportOptions to;
  to.protocol = source.protocol;
  to.groups = source.groups;
  to.rcvbuf = rcvbuf;
  to.what = source.what + " (every sandbox)";
  to.listen_all_nsid = true;
  auto events = nft::Transport::open(io, std::move(to));
  if (!events) return events.error();
  auto rtnl = nft::Transport::open(nft::TransportOptions{NETLINK_ROUTE, {}, 0, "rtnetlink (namespace ids)"});
  if (!rtnl) return rtnl.error();
  return std::unique_ptr<EventHub>(new EventHub(std::move(*events), std::move(*rtnl)));
}

EventHub::EventHub(std::unique_ptr<nft::Transport> events, std::unique_ptr<nft::Transport> rtnl)
    : events_(std::move(events)), rtnl_(std::move(rtnl)) {}

EventHub::~EventHub() { events_->stop(); }

Result<std::int32_t> EventHub::nsid_of(int netns_fd) {
  // RTM_GETNSID (or RTM_NEWNSID) for the namespace of netns_fd: errno, and
  // the id the reply names (-1: none).
  auto ask = [&](std::uint16_t type, std::int32_t& id) -> int {
    alignas(nlmsghdr) char buf[256];
    nlmsghdr* nlh = mnl_nlmsg_put_header(buf);
    nlh->nlmsg_type = type;
    nlh->nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK;  // the reply, then the ack that ends the request
    auto* g = static_cast<rtgenmsg*>(mnl_nlmsg_put_extra_header(nlh, sizeof(rtgenmsg)));
    g->rtgen_family = AF_UNSPEC;
    mnl_attr_put_u32(nlh, NETNSA_FD, static_cast<std::uint32_t>(netns_fd));
    if (type == RTM_NEWNSID) mnl_attr_put_u32(nlh, NETNSA_NSID, static_cast<std::uint32_t>(-1));  // the kernel picks
    id = -1;
    return rtnl_->request(nlh, [&](const nlmsghdr* r) {
      if (r->nlmsg_type != RTM_NEWNSID) return;
      mnl_attr_parse(r, sizeof(rtgenmsg), [](const nlattr* a, void* d) {
        if (mnl_attr_get_type(a) == NETNSA_NSID && mnl_attr_get_payload_len(a) >= 4) {
          *static_cast<std::int32_t*>(d) = static_cast<std::int32_t>(mnl_attr_get_u32(a));
        }
        return MNL_CB_OK;
      }, &id);
    });
  };
  std::int32_t id = -1;
  if (int err = ask(RTM_GETNSID, id); err != 0) return errno_error("read a namespace id (RTM_GETNSID)", err);
  if (id >= 0) return id;
  // None yet: assign one. Another process may assign one at the same time
  // (EEXIST): read it again either way.
  std::int32_t ignored;
  if (int err = ask(RTM_NEWNSID, ignored); err != 0 && err != EEXIST) {
    return errno_error("assign a namespace id (RTM_NEWNSID)", err);
  }
  if (int err = ask(RTM_GETNSID, id); err != 0) return errno_error("read a namespace id (RTM_GETNSID)", err);
  if (id < 0) return Error::runtime("the namespace got no id in the agent's namespace");
  return id;
}

Result<std::unique_ptr<EventFeed>> EventHub::feed(int netns_fd) {
  auto id = nsid_of(netns_fd);
  if (!id) return id.error();
  if (sinks_.count(*id) != 0) return Error::invalid("this namespace has a feed already");
  sinks_.emplace(*id, std::make_unique<Sink>());
  return std::unique_ptr<EventFeed>(new HubFeed(*this, *id));
}

void EventHub::start_loop() {
  if (loop_started_) return;
  loop_started_ = true;
  nft::Transport::Handlers h;
  h.message = [this](const nlmsghdr* nlh) { on_message(nlh); };
  h.overrun = [this] { on_overrun(); };
  h.turn_done = [this] { on_turn_done(); };
  h.error = [this](const Error& e) { on_error(e); };
  events_->start(std::move(h), 256);
}

void EventHub::touch(std::int32_t nsid, Sink& s) {
  if (s.touched) return;
  s.touched = true;
  touched_.push_back(nsid);
}

void EventHub::on_message(const nlmsghdr* nlh) {
  const std::int32_t nsid = events_->source_nsid();
  auto it = sinks_.find(nsid);
  if (nsid < 0 || it == sinks_.end() || !it->second->started) {
    ++dropped_;  // the agent's own namespace, or one that is no sandbox
    return;
  }
  Sink& s = *it->second;
  touch(nsid, s);
  s.h.message(nlh);
}

void EventHub::on_overrun() {
  // Lost messages could be anyone's: every feed hears of it.
  for (auto& [nsid, s] : sinks_) {
    if (!s->started) continue;
    touch(nsid, *s);
    if (s->h.overrun) s->h.overrun();
  }
  grow_rcvbuf_of(*events_, kMaxRcvbuf);
}

void EventHub::on_error(const Error& e) {
  for (auto& [nsid, s] : sinks_) {
    if (!s->started) continue;
    touch(nsid, *s);
    if (s->h.error) s->h.error(e);
  }
}

void EventHub::on_turn_done() {
  // A handler may stop a feed (or another's): looked up again each time.
  auto touched = std::exchange(touched_, {});
  for (std::int32_t nsid : touched) {
    auto it = sinks_.find(nsid);
    if (it == sinks_.end()) continue;
    it->second->touched = false;
    if (it->second->started && it->second->h.turn_done) it->second->h.turn_done();
  }
}

void EventHub::unregister(std::int32_t nsid) {
  sinks_.erase(nsid);
}

void EventHub::settle() {
  if (loop_started_) hear_queued(1024);
}

void EventHub::hear_queued(std::size_t max_datagrams) {
  const auto q = events_->read_queued([this](const nlmsghdr* nlh) { on_message(nlh); }, max_datagrams);
  if (q.overrun) on_overrun();
  on_turn_done();
}

}  // namespace egressd::daemon
