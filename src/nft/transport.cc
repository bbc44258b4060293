#include "nft/transport.h"

#include <libmnl/libmnl.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sys/socket.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "egressd/unique_fd.h"

namespace egressd::nft {

namespace asio = boost::asio;

namespace {

// One datagram of any netlink family egressd reads: notification skbs are
// NLMSG_GOODSIZE (a page, up to 8 KiB), dump replies up to 32 KiB, NFLOG
// messages up to 64 KiB.
constexpr std::size_t kRxSize = 65536 + 4096;

// recv(2) of the next datagram the kernel sent. A datagram from any other
// sender (a netlink socket of a process that may address this one: it needs
// CAP_NET_ADMIN in the namespace for these families, so only a holder of it)
// is dropped unread: nothing but the kernel speaks for the kernel.
// With `nsid` (a socket listening in every namespace), the id the kernel
// tagged the datagram with goes there: -1 when it has none (this socket's own
// namespace).
ssize_t recv_from_kernel(int fd, char* buf, std::int32_t* nsid = nullptr) {
  for (;;) {
    sockaddr_nl from{};
    if (nsid == nullptr) {
      socklen_t len = sizeof from;
      const ssize_t n = ::recvfrom(fd, buf, kRxSize, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&from), &len);
      if (n >= 0 && from.nl_pid != 0) continue;
      return n;
    }
    iovec iov{buf, kRxSize};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    msghdr mh{};
    mh.msg_name = &from;
    mh.msg_namelen = sizeof from;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control;
    mh.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(fd, &mh, MSG_DONTWAIT);
    if (n < 0) return n;
    if (from.nl_pid != 0) continue;
    *nsid = -1;
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level == SOL_NETLINK && c->cmsg_type == NETLINK_LISTEN_ALL_NSID &&
          c->cmsg_len >= CMSG_LEN(sizeof(int))) {
        int id;
        std::memcpy(&id, CMSG_DATA(c), sizeof id);
        *nsid = id;
      }
    }
    return n;
  }
}

}  // namespace

struct Transport::Impl {
  Impl(UniqueFd fd, std::uint32_t portid, std::string what, bool all_nsid)
      : fd(std::move(fd)), portid(portid), what(std::move(what)), all_nsid(all_nsid), rx(new char[kRxSize]) {}

  // The next datagram from the kernel into rx (its source namespace into
  // nsid when listening in all).
  ssize_t recv() { return recv_from_kernel(fd.get(), rx.get(), all_nsid ? &nsid : nullptr); }

  UniqueFd fd;
  // Waits on fd for the receive loop (not owning: released before fd
  // closes); none for a transport opened without an event loop.
  std::optional<asio::posix::stream_descriptor> sd;
  std::uint32_t portid;
  std::uint32_t seq = 1;
  std::string what;
  bool all_nsid;
  std::int32_t nsid = -1;  // of the datagram being handed out
  // Not zero-filled: only the pages a datagram was written to are ever
  // resident (most are a few hundred bytes), which matters with eight
  // transports per sandbox and hundreds of sandboxes in the agent.
  std::unique_ptr<char[]> rx;
  Handlers handlers;
  bool started = false;
  bool stopped = false;

  void drain() {
    while (::recv(fd.get(), rx.get(), kRxSize, MSG_DONTWAIT) > 0 || errno == EINTR || errno == ENOBUFS) {
    }
  }

  // The receive loop. `self` keeps the state alive until the coroutine ends;
  // `stopped` (set by stop(), the destructor) ends it before any handler
  // would run.
  static asio::awaitable<void> receive(std::shared_ptr<Impl> self, std::size_t per_turn) {
    for (;;) {
      boost::system::error_code ec;
      co_await self->sd->async_wait(asio::posix::stream_descriptor::wait_read, asio::redirect_error(asio::use_awaitable, ec));
      if (self->stopped) co_return;
      if (ec) {
        if (self->handlers.error) self->handlers.error(Error::runtime(self->what + ": wait: " + ec.message()));
        co_return;
      }
      bool more = true;
      std::size_t i = 0;
      for (; i < per_turn && !self->stopped; ++i) {
        const ssize_t n = self->recv();
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == ENOBUFS) {  // the queue overflowed: what was dropped is gone
            if (self->handlers.overrun) self->handlers.overrun();
            continue;
          }
          if (errno != EAGAIN && errno != EWOULDBLOCK && self->handlers.error) {
            self->handlers.error(errno_error(self->what + ": receive", errno));
          }
          more = false;
          break;
        }
        int rest = static_cast<int>(n);
        for (auto* nlh = reinterpret_cast<const nlmsghdr*>(self->rx.get()); mnl_nlmsg_ok(nlh, rest) && !self->stopped;
             nlh = mnl_nlmsg_next(nlh, &rest)) {
          self->handlers.message(nlh);
        }
      }
      if (self->stopped) co_return;
      if (self->handlers.turn_done) self->handlers.turn_done();
      if (self->stopped) co_return;
      if (more) {
        // More may be queued: read on after other handlers had their turn.
        co_await asio::post(self->sd->get_executor(), asio::use_awaitable);
        if (self->stopped) co_return;
      }
    }
  }
};

Result<std::unique_ptr<Transport>> Transport::open(asio::io_context& io, TransportOptions opts) {
  auto t = open(std::move(opts));
  if (!t) return t;
  Impl& impl = *(*t)->impl_;
  boost::system::error_code ec;
  impl.sd.emplace(io);
  impl.sd->assign(impl.fd.get(), ec);
  if (ec) return Error::runtime(impl.what + ": " + ec.message());
  return t;
}

Result<std::unique_ptr<Transport>> Transport::open(TransportOptions opts) {
  UniqueFd fd(::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, opts.protocol));
  if (!fd.ok()) return errno_error("open " + opts.what + " socket", errno);
  if (opts.rcvbuf > 0) {
    if (::setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUFFORCE, &opts.rcvbuf, sizeof opts.rcvbuf) < 0) {
      (void)::setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &opts.rcvbuf, sizeof opts.rcvbuf);
    }
  }
  sockaddr_nl addr{};
  addr.nl_family = AF_NETLINK;
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) < 0) {
    return errno_error("bind " + opts.what + " socket", errno);
  }
  socklen_t len = sizeof addr;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) < 0) {
    return errno_error("getsockname of " + opts.what + " socket", errno);
  }
  if (opts.listen_all_nsid) {
    const int on = 1;
    if (::setsockopt(fd.get(), SOL_NETLINK, NETLINK_LISTEN_ALL_NSID, &on, sizeof on) < 0) {
      return errno_error(opts.what + ": listen in every network namespace", errno);
    }
  }
  for (unsigned g : opts.groups) {
    if (::setsockopt(fd.get(), SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, &g, sizeof g) < 0) {
      return errno_error(opts.what + ": join multicast group " + std::to_string(g), errno);
    }
  }
  auto impl = std::make_shared<Impl>(std::move(fd), addr.nl_pid, std::move(opts.what), opts.listen_all_nsid);
  return std::unique_ptr<Transport>(new Transport(std::move(impl)));
}

Transport::~Transport() { stop(); }

void Transport::stop() {
  if (impl_->stopped) return;
  impl_->stopped = true;
  // The wait ends (operation_aborted) and the reactor lets go of the socket;
  // then the socket is closed now, not when the loop lets go of impl_: what
  // it holds in the kernel (a bound queue or log group, a subscription) must
  // be free for whoever binds it next, e.g. a sandbox removed and added again
  // in the same namespace while its removed predecessor still finishes work.
  if (impl_->sd) (void)impl_->sd->release();
  impl_->fd.reset();
}

int Transport::fd() const { return impl_->fd.get(); }
std::uint32_t Transport::portid() const { return impl_->portid; }
std::int32_t Transport::source_nsid() const { return impl_->nsid; }

int Transport::rcvbuf() const {
  int v = 0;
  socklen_t l = sizeof v;
  if (::getsockopt(impl_->fd.get(), SOL_SOCKET, SO_RCVBUF, &v, &l) < 0) return 0;
  return v;
}

int Transport::join(unsigned group) {
  return ::setsockopt(impl_->fd.get(), SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, &group, sizeof group) < 0 ? errno : 0;
}

int Transport::leave(unsigned group) {
  return ::setsockopt(impl_->fd.get(), SOL_NETLINK, NETLINK_DROP_MEMBERSHIP, &group, sizeof group) < 0 ? errno : 0;
}

int Transport::request(nlmsghdr* req, const OnMessage& on_reply, std::chrono::milliseconds timeout) {
  Impl& s = *impl_;
  s.drain();
  const std::uint32_t seq = s.seq++;
  req->nlmsg_seq = seq;
  req->nlmsg_pid = 0;  // to the kernel
  const sockaddr_nl kernel{AF_NETLINK, 0, 0, 0};
  ssize_t sent;
  do {
    sent = ::sendto(s.fd.get(), req, req->nlmsg_len, 0, reinterpret_cast<const sockaddr*>(&kernel), sizeof kernel);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) return errno;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool interrupted = false;
  for (;;) {
    const ssize_t n = s.recv();
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOBUFS) return EINTR;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return ETIMEDOUT;
      pollfd p{s.fd.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) < 0 && errno != EINTR) return errno;
      continue;
    }
    int rest = static_cast<int>(n);
    for (auto* nlh = reinterpret_cast<const nlmsghdr*>(s.rx.get()); mnl_nlmsg_ok(nlh, rest);
         nlh = mnl_nlmsg_next(nlh, &rest)) {
      if (nlh->nlmsg_seq != seq) continue;
      if (nlh->nlmsg_type == NLMSG_DONE) return interrupted ? EINTR : 0;
      if (nlh->nlmsg_type == NLMSG_ERROR) {
        if (nlh->nlmsg_len < NLMSG_LENGTH(sizeof(nlmsgerr))) return EPROTO;
        const int e = -static_cast<const nlmsgerr*>(mnl_nlmsg_get_payload(nlh))->error;
        return e != 0 ? e : (interrupted ? EINTR : 0);
      }
      if (nlh->nlmsg_flags & NLM_F_DUMP_INTR) interrupted = true;
      if (!interrupted) on_reply(nlh);
    }
  }
}

std::uint32_t Transport::next_seq() { return impl_->seq++; }

std::uint32_t Transport::reserve_seq(std::uint32_t n) {
  const std::uint32_t first = impl_->seq;
  impl_->seq += n;
  return first;
}

void Transport::drain() { impl_->drain(); }

Transport::Collected Transport::collect(const OnMessage& on_msg, const std::function<bool()>& complete,
                                        const std::function<bool(bool overrun)>& nothing_more_coming,
                                        std::chrono::milliseconds timeout) {
  Impl& s = *impl_;
  Collected c;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!(c.complete = complete())) {
    const ssize_t n = s.recv();
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOBUFS) {
        c.overrun = true;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        c.error = errno;
        return c;
      }
      if (nothing_more_coming(c.overrun)) return c;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        c.error = ETIMEDOUT;
        return c;
      }
      pollfd p{s.fd.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) < 0 && errno != EINTR) {
        c.error = errno;
        return c;
      }
      continue;
    }
    int rest = static_cast<int>(n);
    for (auto* nlh = reinterpret_cast<const nlmsghdr*>(s.rx.get()); mnl_nlmsg_ok(nlh, rest);
         nlh = mnl_nlmsg_next(nlh, &rest)) {
      on_msg(nlh);
    }
  }
  return c;
}

int Transport::send(const void* data, std::size_t len) {
  const sockaddr_nl kernel{AF_NETLINK, 0, 0, 0};
  ssize_t sent;
  do {
    sent = ::sendto(impl_->fd.get(), data, len, 0, reinterpret_cast<const sockaddr*>(&kernel), sizeof kernel);
  } while (sent < 0 && errno == EINTR);
  return sent < 0 ? errno : 0;
}

Transport::Queued Transport::read_queued(const OnMessage& on_msg, std::size_t max_datagrams) {
  Impl& s = *impl_;
  Queued q;
  for (std::size_t got = 0;; ++got) {
    if (got == max_datagrams) {
      q.more = true;
      return q;
    }
    const ssize_t n = s.recv();
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOBUFS) {
        q.overrun = true;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) q.error = errno;
      return q;
    }
    if (n == 0) return q;
    int rest = static_cast<int>(n);
    for (auto* nlh = reinterpret_cast<const nlmsghdr*>(s.rx.get()); mnl_nlmsg_ok(nlh, rest);
         nlh = mnl_nlmsg_next(nlh, &rest)) {
      on_msg(nlh);
    }
  }
}

void Transport::start(Handlers h, std::size_t datagrams_per_turn) {
  if (impl_->started || impl_->stopped || !impl_->sd) return;
  impl_->started = true;
  impl_->handlers = std::move(h);
  asio::co_spawn(impl_->sd->get_executor(), Impl::receive(impl_, datagrams_per_turn), asio::detached);
}

namespace {

int put_attr(const nlattr* a, void* data) {
  auto& tb = *static_cast<std::span<const nlattr*>*>(data);
  const std::uint16_t type = mnl_attr_get_type(a);
  if (type < tb.size()) tb[type] = a;
  return MNL_CB_OK;
}

}  // namespace

int attr_table(const nlmsghdr* nlh, std::size_t header, std::span<const nlattr*> tb) {
  std::fill(tb.begin(), tb.end(), nullptr);
  return mnl_attr_parse(nlh, static_cast<unsigned>(header), put_attr, &tb);
}

int attr_table(const nlattr* nest, std::span<const nlattr*> tb) {
  std::fill(tb.begin(), tb.end(), nullptr);
  return mnl_attr_parse_nested(nest, put_attr, &tb);
}

}  // namespace egressd::nft
