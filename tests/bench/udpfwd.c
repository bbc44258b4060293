/* udpfwd: the floor of any userspace DNS proxy on this machine, for tests/bench/dns_proxy.py
 * (contender `floor`, issue 17's "sidecar qps >= 0.9 x the upstream asked directly").
 * Compiled by dns_proxy.py at run time (cc -O2). IPv4 only.
 *
 *   udpfwd LISTENADDR PORT UPSTREAMADDR UPSTREAMPORT
 *
 * One thread, one epoll loop, two sockets: the listening one and one socket connected to the
 * upstream (one source port for everything). Queries are taken 64 at a time with recvmmsg and
 * sent on with sendmmsg; answers likewise, back to whoever asked under that DNS ID. Nothing is
 * parsed, checked, rewritten, learned or inserted: no fresh port per query, no 0x20, no set
 * element, no conntrack delete. So its qps is what the hop itself (two more datagrams per
 * query through the kernel, one more process on the CPUs) allows, and anything egressd does
 * beyond that shows as the distance to it. Prints "ready" once both sockets are set up. A DNS
 * ID asked again before its answer came overwrites the client it goes back to (dnsperf never
 * has one ID twice in flight).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define BATCH 64
#define MAXMSG 4096

static struct sockaddr_in clients[65536];

static void die(const char *what) {
  perror(what);
  exit(1);
}

static struct sockaddr_in addr_of(const char *ip, const char *port) {
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_port = htons((unsigned short)atoi(port));
  if (inet_pton(AF_INET, ip, &a.sin_addr) != 1) {
    fprintf(stderr, "udpfwd: not an IPv4 address: %s\n", ip);
    exit(2);
  }
  return a;
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: udpfwd LISTENADDR PORT UPSTREAMADDR UPSTREAMPORT\n");
    return 2;
  }
  struct sockaddr_in listen_at = addr_of(argv[1], argv[2]), upstream = addr_of(argv[3], argv[4]);
  int ls = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0), us = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
  if (ls < 0 || us < 0) die("socket");
  int one = 1, big = 4 << 20;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  setsockopt(ls, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
  setsockopt(us, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
  if (bind(ls, (struct sockaddr *)&listen_at, sizeof listen_at) < 0) die("bind");
  if (connect(us, (struct sockaddr *)&upstream, sizeof upstream) < 0) die("connect");
  int ep = epoll_create1(0);
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls};
  if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev) < 0) die("epoll");
  ev.data.fd = us;
  if (epoll_ctl(ep, EPOLL_CTL_ADD, us, &ev) < 0) die("epoll");

  static unsigned char buf[BATCH][MAXMSG];
  static struct iovec iov[BATCH];
  static struct mmsghdr msgs[BATCH];
  static struct sockaddr_in from[BATCH];
  printf("ready\n");
  fflush(stdout);
  for (;;) {
    struct epoll_event evs[2];
    int n = epoll_wait(ep, evs, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      die("epoll_wait");
    }
    for (int e = 0; e < n; ++e) {
      const int fd = evs[e].data.fd;
      for (;;) {
        for (int i = 0; i < BATCH; ++i) {
          iov[i].iov_base = buf[i];
          iov[i].iov_len = MAXMSG;
          memset(&msgs[i].msg_hdr, 0, sizeof msgs[i].msg_hdr);
          msgs[i].msg_hdr.msg_iov = &iov[i];
          msgs[i].msg_hdr.msg_iovlen = 1;
          if (fd == ls) {
            msgs[i].msg_hdr.msg_name = &from[i];
            msgs[i].msg_hdr.msg_namelen = sizeof from[i];
          }
        }
        int got = recvmmsg(fd, msgs, BATCH, MSG_DONTWAIT, NULL);
        if (got <= 0) break;
        int keep = 0;
        for (int i = 0; i < got; ++i) {
          if (msgs[i].msg_len < 12) continue;  /* not a DNS message */
          const unsigned id = (unsigned)buf[i][0] << 8 | buf[i][1];
          iov[keep].iov_base = buf[i];
          iov[keep].iov_len = msgs[i].msg_len;
          memset(&msgs[keep].msg_hdr, 0, sizeof msgs[keep].msg_hdr);
          msgs[keep].msg_hdr.msg_iov = &iov[keep];
          msgs[keep].msg_hdr.msg_iovlen = 1;
          if (fd == ls) {
            clients[id] = from[i];  /* the query goes to the upstream's connected socket */
          } else {
            msgs[keep].msg_hdr.msg_name = &clients[id];
            msgs[keep].msg_hdr.msg_namelen = sizeof clients[id];
          }
          ++keep;
        }
        for (int sent = 0; sent < keep;) {
          int r = sendmmsg(fd == ls ? us : ls, msgs + sent, (unsigned)(keep - sent), 0);
          if (r <= 0) break;  /* a full buffer drops the rest, as a lost datagram would */
          sent += r;
        }
        if (got < BATCH) break;
      }
    }
  }
}
