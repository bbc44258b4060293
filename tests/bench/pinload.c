/* pinload: the fake TLS server and the clients of tests/bench/pinning.py (hostname pinning,
 * issue 16). Compiled by pinning.py at run time (cc -O2), so a Python client's own cost does
 * not hide what the datapath costs. IPv4 only; the lab's addresses are documentation ones.
 *
 *   pinload serve ADDR TPUTPORT FBPORT...
 *       One epoll thread. On every port it reads the client's first TLS record (the
 *       ClientHello, whatever its size; if the first byte is not 22 it answers at once) and
 *       answers with 6 bytes (the "first byte", standing in for a ServerHello). On an FBPORT it
 *       then waits for the client to go; on TPUTPORT it counts every later byte, answers the
 *       first of them with 6 bytes more (as a TLS 1.3 server sends its session tickets once
 *       the client's Finished arrives), and at the client's EOF writes "BYTES USEC\n" (USEC
 *       from its first answer to the EOF) and closes.
 *       Prints "ready" when all listen.
 *   pinload lat ADDR PORT HELLO N
 *       N times, one after the other: connect, send HELLO (a file), read the first byte;
 *       prints the connect-to-first-byte time in microseconds, one line each, or "err WHAT".
 *       Every connection is closed with a reset (SO_LINGER 0): no TIME_WAIT piles up.
 *   pinload tput ADDR PORT HELLO SECONDS
 *       connect, HELLO, wait for the answer (as a TLS client waits for the ServerHello),
 *       then send TLS application data records (16 KiB of 'x' each, as a TLS client's bulk
 *       data looks on the wire) for SECONDS, shut down, print the server's "BYTES USEC".
 *   pinload pps ADDR PORT N
 *       One connected UDP socket sends 10,000 datagrams of 32 bytes to warm up, then N more in
 *       5 batches; prints the CPU time (user + system, getrusage) per datagram in nanoseconds
 *       of the cheapest batch (the others had the machine's other work in them):
 *       the datapath's cost of one packet of a decided flow, netfilter's output path included
 *       (the send runs it in the sender's context). Send errors are counted, not fatal.
 *   pinload rate ADDR PORT[,PORT...] HELLO BADHELLO RATE SECONDS BADEVERY [SPORTBASE]
 *       Open loop: RATE new connections per second for SECONDS (started in 1 ms batches on
 *       schedule, at most 8192 in flight, to the PORTs in turn: more ports, more 4-tuples
 *       before the kernel's port choice comes back to one), each sends HELLO (every BADEVERY-th sends BADHELLO
 *       instead; 0 = never) and waits up to 3 s for the first byte. A HELLO connection must get
 *       the byte, a BADHELLO one must be refused (reset or closed without data). Prints one
 *       line of key=value counters, the achieved rate and the latency p50/p99 of the good ones;
 *       reused counts connections whose 4-tuple an earlier one of the same run had. With
 *       SPORTBASE >= 0 the source ports are not the kernel's choice: connection i (counting
 *       from SPORTBASE, so that successive runs continue the sequence) binds source port
 *       1024 + (SPORTBASE + i) / NPORTS % 31744 (below 32768, where pinning.py starts the
 *       kernel's range) and goes to PORT (SPORTBASE + i) % NPORTS, so no 4-tuple comes back
 *       within 31744 x NPORTS connections.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char kAnswer[6] = {0x16, 0x03, 0x03, 0x00, 0x01, 0x02};

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what) {
  perror(what);
  exit(1);
}

static void raise_nofile(void) {
  struct rlimit r = {65536, 65536};
  if (setrlimit(RLIMIT_NOFILE, &r) != 0) {
    getrlimit(RLIMIT_NOFILE, &r);
    r.rlim_cur = r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
  }
}

static struct sockaddr_in addr_of(const char *ip, const char *port) {
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)atoi(port));
  if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1) {
    fprintf(stderr, "bad IPv4 address %s\n", ip);
    exit(2);
  }
  return sa;
}

static unsigned char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) die(path);
  static unsigned char buf[16384];
  unsigned char *out = malloc(sizeof buf);
  *len = fread(buf, 1, sizeof buf, f);
  fclose(f);
  memcpy(out, buf, *len);
  return out;
}

static void close_reset(int fd) {
  struct linger l = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close(fd);
}

static int send_all(int fd, const unsigned char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* --- serve ----------------------------------------------------------------------------- */

struct sconn {
  unsigned char kind;     /* 0 free, 1 first byte, 2 throughput */
  unsigned char answered;
  unsigned char ticketed; /* throughput: the "session ticket" sent after the client's first bytes */
  unsigned char hdr[5];
  unsigned char have;     /* bytes of hdr */
  uint32_t need;          /* bytes of the first record's body still to read */
  uint64_t bytes, t0;
};

static int listener(struct sockaddr_in sa) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0) die("bind");
  if (listen(fd, 4096) != 0) die("listen");
  return fd;
}

static int serve(int argc, char **argv) {
  raise_nofile();
  int ep = epoll_create1(0);
  static unsigned char is_listener[65536]; /* 1 first byte, 2 throughput */
  for (int i = 1; i < argc; i++) {
    int l = listener(addr_of(argv[0], argv[i]));
    is_listener[l] = i == 1 ? 2 : 1;
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = l};
    epoll_ctl(ep, EPOLL_CTL_ADD, l, &ev);
  }
  static struct sconn conns[65536];
  static unsigned char buf[1 << 18];
  printf("ready\n");
  fflush(stdout);
  struct epoll_event evs[256];
  for (;;) {
    int n = epoll_wait(ep, evs, 256, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die("epoll_wait");
    for (int i = 0; i < n; i++) {
      int fd = evs[i].data.fd;
      if (is_listener[fd]) {
        for (;;) {
          int c = accept4(fd, NULL, NULL, SOCK_NONBLOCK);
          if (c < 0) break;
          if (c >= 65536) {
            close(c);
            continue;
          }
          memset(&conns[c], 0, sizeof conns[c]);
          conns[c].kind = is_listener[fd];
          struct epoll_event ce = {.events = EPOLLIN, .data.fd = c};
          epoll_ctl(ep, EPOLL_CTL_ADD, c, &ce);
        }
        continue;
      }
      struct sconn *s = &conns[fd];
      for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r < 0 && errno == EAGAIN) break;
        if (r <= 0) {
          if (r == 0 && s->kind == 2 && s->answered) {
            char line[64];
            int k = snprintf(line, sizeof line, "%llu %llu\n", (unsigned long long)s->bytes,
                             (unsigned long long)((now_ns() - s->t0) / 1000));
            send_all(fd, (unsigned char *)line, (size_t)k);
          }
          s->kind = 0;
          close(fd);
          break;
        }
        size_t off = 0;
        while (!s->answered && off < (size_t)r) {
          if (s->have < 5) {
            s->hdr[s->have++] = buf[off++];
            if (s->have == 1 && s->hdr[0] != 22) s->need = 0, s->have = 5;  /* not TLS: answer now */
            else if (s->have == 5) s->need = (uint32_t)s->hdr[3] << 8 | s->hdr[4];
            else continue;
          } else {
            size_t take = (size_t)r - off < s->need ? (size_t)r - off : s->need;
            off += take;
            s->need -= (uint32_t)take;
          }
          if (s->have == 5 && s->need == 0) {
            s->answered = 1;
            send_all(fd, (const unsigned char *)kAnswer, sizeof kAnswer);
            s->t0 = now_ns();
          }
        }
        s->bytes += (size_t)r - off;
        /* As a TLS 1.3 server sends its session tickets once the client's Finished arrives:
         * 6 bytes more, after the client's first bytes past its hello. */
        if (s->kind == 2 && s->answered && !s->ticketed && s->bytes > 0) {
          s->ticketed = 1;
          send_all(fd, (const unsigned char *)kAnswer, sizeof kAnswer);
        }
      }
    }
  }
  return 0;
}

/* --- clients --------------------------------------------------------------------------- */

static int lat(char **argv) {
  struct sockaddr_in sa = addr_of(argv[0], argv[1]);
  size_t hlen;
  unsigned char *hello = read_file(argv[2], &hlen);
  long n = atol(argv[3]);
  struct timeval tv = {3, 0};
  unsigned char b[64];
  for (long i = 0; i < n; i++) {
    uint64_t t0 = now_ns();
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
      printf("err connect %s\n", strerrorname_np(errno));
    } else if (send_all(fd, hello, hlen) != 0) {
      printf("err send %s\n", strerrorname_np(errno));
    } else {
      ssize_t r = recv(fd, b, sizeof b, 0);
      uint64_t t1 = now_ns();
      if (r > 0) printf("%.1f\n", (double)(t1 - t0) / 1000.0);
      else if (r == 0) printf("err eof\n");
      else printf("err recv %s\n", strerrorname_np(errno));
    }
    close_reset(fd);
  }
  return 0;
}

static int tput(char **argv) {
  struct sockaddr_in sa = addr_of(argv[0], argv[1]);
  size_t hlen;
  unsigned char *hello = read_file(argv[2], &hlen);
  double seconds = atof(argv[3]);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct timeval tv = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) die("connect");
  if (send_all(fd, hello, hlen) != 0) die("send hello");
  unsigned char b[64];
  ssize_t r = recv(fd, b, sizeof b, 0);
  if (r <= 0) {
    fprintf(stderr, "no answer to the hello: %s\n", r == 0 ? "eof" : strerrorname_np(errno));
    return 1;
  }
  /* 16 whole records: pinning reads a TLS flow's records until its handshake is over, and
   * the first application data record after the server's answer ends it. */
  enum { kRecord = 5 + 16384 };
  static unsigned char buf[16 * kRecord];
  memset(buf, 'x', sizeof buf);
  for (size_t at = 0; at < sizeof buf; at += kRecord) {
    buf[at] = 23, buf[at + 1] = 3, buf[at + 2] = 3, buf[at + 3] = 0x40, buf[at + 4] = 0;
  }
  uint64_t end = now_ns() + (uint64_t)(seconds * 1e9), sent = 0;
  while (now_ns() < end) {
    if (send_all(fd, buf, sizeof buf) != 0) die("send");
    sent += sizeof buf;
  }
  shutdown(fd, SHUT_WR);
  char line[128];
  size_t got = 0;
  while (got < sizeof line - 1 && (r = recv(fd, line + got, sizeof line - 1 - got, 0)) > 0) got += (size_t)r;
  line[got] = 0;
  close(fd);
  unsigned long long bytes, usec;
  /* The server's "session ticket" (6 bytes) comes first. */
  if (got < 6 || sscanf(line + 6, "%llu %llu", &bytes, &usec) != 2) {
    fprintf(stderr, "no count from the server (%s)\n", r < 0 ? strerrorname_np(errno) : "eof");
    return 1;
  }
  printf("%llu %llu %llu\n", bytes, usec, (unsigned long long)sent);
  return 0;
}

static int pps(char **argv) {
  struct sockaddr_in sa = addr_of(argv[0], argv[1]);
  long n = atol(argv[2]);
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) die("udp connect");
  unsigned char b[32];
  memset(b, 'x', sizeof b);
  long errors = 0;
  for (int i = 0; i < 10000; ++i) errors += send(fd, b, sizeof b, 0) < 0;
  double best = 0;
  for (int batch = 0; batch < 5; ++batch) {
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    for (long i = 0; i < n / 5; ++i) errors += send(fd, b, sizeof b, 0) < 0;
    getrusage(RUSAGE_SELF, &r1);
    double us = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) * 1e6 +
                (double)(r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec - r0.ru_stime.tv_usec);
    double ns = us * 1000.0 / (double)(n / 5);
    if (batch == 0 || ns < best) best = ns;
  }
  close(fd);
  printf("%.1f %ld\n", best, errors);
  return 0;
}

struct cslot {
  uint64_t t0;
  uint32_t gen;
  unsigned char state;  /* 0 free, 1 connecting, 2 hello sent */
  unsigned char bad;
};

struct pending {
  int fd;
  uint32_t gen;
  uint64_t t0;
};

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static int rate(char **argv) {
  raise_nofile();
  struct sockaddr_in sa = addr_of(argv[0], "0");
  uint16_t ports[64];
  int nports = 0;
  for (char *tok = strtok(argv[1], ","); tok && nports < 64; tok = strtok(NULL, ",")) ports[nports++] = htons((uint16_t)atoi(tok));
  size_t glen, blen;
  unsigned char *good = read_file(argv[2], &glen), *bad = read_file(argv[3], &blen);
  double r = atof(argv[4]), seconds = atof(argv[5]);
  long bad_every = atol(argv[6]);
  long sport_base = argv[7] ? atol(argv[7]) : -1;
  const uint64_t timeout = 3000000000ull;
  const long max_inflight = 8192;
  long total = (long)(r * seconds);
  static struct cslot slots[65536];
  struct pending *ring = calloc((size_t)total + 1, sizeof *ring);
  double *lat = calloc((size_t)total + 1, sizeof *lat);
  long ring_head = 0, ring_tail = 0, nlat = 0, reused = 0;
  static unsigned char used[64][8192]; /* source ports seen per destination port */
  long started = 0, inflight = 0, ok = 0, refused_ok = 0, wrong_admit = 0, wrong_refused = 0, timeouts = 0,
       conn_err = 0, other_err = 0, blocked = 0;
  uint64_t max_lag = 0, last_done = 0;
  int ep = epoll_create1(0);
  struct epoll_event evs[512];
  unsigned char b[64];
  const uint64_t t_start = now_ns(), interval = (uint64_t)(1e9 / r);
  const uint64_t hard_end = t_start + (uint64_t)(seconds * 1e9) + timeout + 1000000000ull;

  for (;;) {
    uint64_t now = now_ns();
    if (now > hard_end) break;
    while (started < total && t_start + (uint64_t)started * interval <= now) {
      if (inflight >= max_inflight) {
        blocked++;
        break;
      }
      uint64_t lag = now - (t_start + (uint64_t)started * interval);
      if (lag > max_lag) max_lag = lag;
      int isbad = bad_every > 0 && started % bad_every == bad_every - 1;
      started++;
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      if (fd < 0 || fd >= 65536) {
        conn_err++;
        if (fd >= 0) close(fd);
        continue;
      }
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      int pi = (int)((sport_base >= 0 ? sport_base + started : started) % nports);
      sa.sin_port = ports[pi];
      if (sport_base >= 0) {
        struct sockaddr_in src = {.sin_family = AF_INET};
        src.sin_port = htons((uint16_t)(1024 + (sport_base + started) / nports % 31744));
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, (struct sockaddr *)&src, sizeof src) != 0) {
          conn_err++;
          close(fd);
          continue;
        }
      }
      if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno != EINPROGRESS) {
        conn_err++;
        close(fd);
        continue;
      }
      struct sockaddr_in me;
      socklen_t ml = sizeof me;
      if (getsockname(fd, (struct sockaddr *)&me, &ml) == 0) {
        unsigned sp = ntohs(me.sin_port);
        if (used[pi][sp >> 3] & (1u << (sp & 7))) reused++;
        used[pi][sp >> 3] |= (unsigned char)(1u << (sp & 7));
      }
      struct cslot *s = &slots[fd];
      s->t0 = now;
      s->gen++;
      s->state = 1;
      s->bad = (unsigned char)isbad;
      struct epoll_event ev = {.events = EPOLLOUT, .data.fd = fd};
      epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
      ring[ring_tail++] = (struct pending){fd, s->gen, now};
      inflight++;
    }
    if (started >= total && inflight == 0) break;
    int n = epoll_wait(ep, evs, 512, started < total ? 1 : 10);
    now = now_ns();
    for (int i = 0; i < n; i++) {
      int fd = evs[i].data.fd;
      struct cslot *s = &slots[fd];
      int done = 0;
      if (s->state == 1) {
        int err = 0;
        socklen_t el = sizeof err;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        if (err) {
          conn_err++;
          done = 1;
        } else if (send(fd, s->bad ? bad : good, s->bad ? blen : glen, MSG_NOSIGNAL) != (ssize_t)(s->bad ? blen : glen)) {
          other_err++;
          done = 1;
        } else {
          s->state = 2;
          struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
          epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev);
        }
      } else if (s->state == 2) {
        ssize_t got = recv(fd, b, sizeof b, 0);
        if (got < 0 && errno == EAGAIN) continue;
        done = 1;
        if (got > 0) {
          if (s->bad) wrong_admit++;
          else {
            ok++;
            lat[nlat++] = (double)(now - s->t0) / 1000.0;
          }
        } else if (got == 0 || errno == ECONNRESET) {
          if (s->bad) refused_ok++;
          else wrong_refused++;
        } else {
          other_err++;
        }
      }
      if (done) {
        s->state = 0;
        close_reset(fd);
        inflight--;
        last_done = now;
      }
    }
    while (ring_head < ring_tail) {
      struct pending *p = &ring[ring_head];
      struct cslot *s = &slots[p->fd];
      if (s->state == 0 || s->gen != p->gen) {
        ring_head++;
        continue;
      }
      if (p->t0 + timeout > now) break;
      timeouts++;
      s->state = 0;
      close_reset(p->fd);
      inflight--;
      ring_head++;
    }
  }
  uint64_t end = last_done ? last_done : now_ns();
  qsort(lat, (size_t)nlat, sizeof *lat, cmp_double);
  double p50 = nlat ? lat[(nlat - 1) / 2] : 0, p99 = nlat ? lat[(long)((nlat - 1) * 0.99)] : 0;
  double elapsed = (double)(end - t_start) / 1e9;
  printf("target=%g seconds=%g total=%ld started=%ld ok=%ld refused_ok=%ld wrong_admit=%ld wrong_refused=%ld "
         "timeouts=%ld conn_err=%ld other_err=%ld unfinished=%ld blocked=%ld reused=%ld max_lag_ms=%.2f elapsed=%.4f "
         "achieved=%.1f p50_us=%.1f p99_us=%.1f\n",
         r, seconds, total, started, ok, refused_ok, wrong_admit, wrong_refused, timeouts, conn_err, other_err,
         inflight, blocked, reused, (double)max_lag / 1e6, elapsed,
         elapsed > 0 ? (double)(ok + refused_ok + wrong_admit + wrong_refused) / elapsed : 0.0, p50, p99);
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 5 && !strcmp(argv[1], "serve")) return serve(argc - 2, argv + 2);
  if (argc >= 6 && !strcmp(argv[1], "lat")) return lat(argv + 2);
  if (argc >= 6 && !strcmp(argv[1], "tput")) return tput(argv + 2);
  if (argc >= 9 && !strcmp(argv[1], "rate")) return rate(argv + 2);
  if (argc >= 5 && !strcmp(argv[1], "pps")) return pps(argv + 2);
  fprintf(stderr,
          "usage: pinload serve ADDR TPUTPORT FBPORT... | lat ADDR PORT HELLO N | tput ADDR PORT HELLO SECONDS |\n"
          "       rate ADDR PORT[,PORT...] HELLO BADHELLO RATE SECONDS BADEVERY | pps ADDR PORT N\n");
  return 2;
}
