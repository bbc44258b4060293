// dnsload: one process that asks DNS names from many network namespaces at once, for
// tests/bench/agent_dns.py. 50 dnsperf processes (one per sandbox) cost ~40 µs of CPU per
// answer on a 2-core machine against ~7 µs for one dnsperf at the same total rate, so with
// them the bench measured the clients as much as egressd. This client is one process and one
// epoll loop: a UDP socket per namespace (made there with setns), connected to SERVER:PORT,
// each keeping OUTSTANDING queries in flight until its names are done.
//
// usage: dnsload [-q OUTSTANDING] [-t TIMEOUT_MS] [-s SERVER] [-p PORT] NETNS_PATH=NAMES_FILE...
//   NAMES_FILE: one name per line (dnsperf's format, "name A": only the first word is read);
//   every name is asked once, type A.
// Protocol with the caller: once every socket is open and every name loaded it prints
// "ready\n" and blocks reading one byte from stdin; then it runs and prints one JSON line:
//   {"window_s": S, "clients": [{"sent": N, "completed": N, "lost": N, "noerror": N,
//    "other_rcode": N}, ...]}
// "completed" counts answers (any rcode); a query unanswered after TIMEOUT_MS (default 2000)
// is lost and its slot asks the next name. Exit 0 when it ran, 2 on bad usage or setup error.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_OUTSTANDING 256

struct slot {
  int active;
  uint16_t id;
  uint8_t gen;
  uint64_t sent_ns;
};

struct client {
  int fd;
  char** names;
  size_t count, next;
  size_t sent, completed, lost, noerror, other_rcode;
  int active;  // slots in flight
  struct slot slots[MAX_OUTSTANDING];
};

static void die(const char* what) {
  fprintf(stderr, "dnsload: %s: %s\n", what, strerror(errno));
  exit(2);
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void load_names(struct client* c, const char* path) {
  FILE* f = fopen(path, "r");
  if (!f) die(path);
  size_t cap = 1024;
  c->names = malloc(cap * sizeof *c->names);
  char line[512];
  while (fgets(line, sizeof line, f)) {
    char* end = line + strcspn(line, " \t\r\n");
    if (end == line) continue;
    *end = 0;
    if (c->count == cap) {
      cap *= 2;
      c->names = realloc(c->names, cap * sizeof *c->names);
    }
    c->names[c->count++] = strdup(line);
  }
  fclose(f);
}

// A type A query for `name` with `id`; returns its length, 0 when the name does not fit.
static size_t build_query(uint8_t* buf, size_t cap, uint16_t id, const char* name) {
  if (cap < 12 + 4 + 2) return 0;
  memset(buf, 0, 12);
  buf[0] = (uint8_t)(id >> 8);
  buf[1] = (uint8_t)id;
  buf[2] = 0x01;  // RD
  buf[5] = 1;     // QDCOUNT
  size_t at = 12;
  const char* p = name;
  while (*p) {
    const char* dot = strchr(p, '.');
    size_t len = dot ? (size_t)(dot - p) : strlen(p);
    if (len == 0 || len > 63 || at + 1 + len + 5 > cap) return 0;
    buf[at++] = (uint8_t)len;
    memcpy(buf + at, p, len);
    at += len;
    p += len;
    if (*p == '.') p++;
  }
  buf[at++] = 0;
  buf[at++] = 0;
  buf[at++] = 1;  // A
  buf[at++] = 0;
  buf[at++] = 1;  // IN
  return at;
}

// Sends the next name in slot `s` of `c`, or leaves the slot idle when none is left.
static void ask_next(struct client* c, int s) {
  struct slot* sl = &c->slots[s];
  if (c->next >= c->count) {
    if (sl->active) c->active--;
    sl->active = 0;
    return;
  }
  uint8_t buf[512];
  sl->gen++;
  const uint16_t id = (uint16_t)((sl->gen << 8) | (unsigned)s);
  const size_t len = build_query(buf, sizeof buf, id, c->names[c->next++]);
  if (!sl->active) c->active++;
  sl->active = 1;
  sl->id = id;
  sl->sent_ns = now_ns();
  c->sent++;
  // A failed send is left to the timeout (counted lost there).
  if (len == 0 || send(c->fd, buf, len, 0) < 0) sl->sent_ns = 0;
}

int main(int argc, char** argv) {
  int outstanding = 20, timeout_ms = 2000, port = 53;
  const char* server = "127.0.0.1";
  int opt;
  while ((opt = getopt(argc, argv, "q:t:s:p:")) != -1) {
    switch (opt) {
      case 'q': outstanding = atoi(optarg); break;
      case 't': timeout_ms = atoi(optarg); break;
      case 's': server = optarg; break;
      case 'p': port = atoi(optarg); break;
      default:
        fprintf(stderr, "usage: dnsload [-q OUTSTANDING] [-t TIMEOUT_MS] [-s SERVER] [-p PORT] NETNS=NAMES...\n");
        return 2;
    }
  }
  const int n = argc - optind;
  if (n <= 0 || outstanding < 1 || outstanding > MAX_OUTSTANDING || timeout_ms < 1) {
    fprintf(stderr, "dnsload: need NETNS=NAMES arguments, 1 <= -q <= %d, -t >= 1\n", MAX_OUTSTANDING);
    return 2;
  }
  struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  if (inet_pton(AF_INET, server, &to.sin_addr) != 1) {
    fprintf(stderr, "dnsload: -s %s: not an IPv4 address\n", server);
    return 2;
  }
  const int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  if (home < 0) die("open /proc/self/ns/net");
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) die("epoll_create1");
  struct client* cl = calloc((size_t)n, sizeof *cl);
  for (int k = 0; k < n; k++) {
    char* arg = argv[optind + k];
    char* eq = strchr(arg, '=');
    if (!eq) {
      fprintf(stderr, "dnsload: %s: want NETNS_PATH=NAMES_FILE\n", arg);
      return 2;
    }
    *eq = 0;
    load_names(&cl[k], eq + 1);
    const int ns = open(arg, O_RDONLY | O_CLOEXEC);
    if (ns < 0) die(arg);
    if (setns(ns, CLONE_NEWNET) != 0) die("setns");
    close(ns);
    cl[k].fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (cl[k].fd < 0) die("socket");
    int big = 1 << 20;
    (void)setsockopt(cl[k].fd, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    if (connect(cl[k].fd, (struct sockaddr*)&to, sizeof to) != 0) die("connect");
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)k};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, cl[k].fd, &ev) != 0) die("epoll_ctl");
  }
  if (setns(home, CLONE_NEWNET) != 0) die("setns home");
  printf("ready\n");
  fflush(stdout);
  char go;
  if (read(0, &go, 1) != 1) return 2;

  const uint64_t t0 = now_ns();
  const uint64_t timeout_ns = (uint64_t)timeout_ms * 1000000u;
  int busy = 0;
  for (int k = 0; k < n; k++) {
    for (int s = 0; s < outstanding; s++) ask_next(&cl[k], s);
    busy += cl[k].active > 0;
  }
  uint64_t last_scan = t0;
  struct epoll_event evs[64];
  uint8_t buf[4096];
  while (busy > 0) {
    const int m = epoll_wait(ep, evs, 64, 50);
    if (m < 0 && errno != EINTR) die("epoll_wait");
    for (int i = 0; i < m; i++) {
      struct client* c = &cl[evs[i].data.u32];
      for (;;) {
        const ssize_t len = recv(c->fd, buf, sizeof buf, 0);
        if (len < 0) {
          if (errno != EAGAIN && errno != EINTR && errno != ECONNREFUSED) die("recv");
          if (errno == EAGAIN) break;
          continue;
        }
        if (len < 12 || !(buf[2] & 0x80)) continue;
        const uint16_t id = (uint16_t)(buf[0] << 8 | buf[1]);
        const int s = id & 0xff;
        if (s >= outstanding || !c->slots[s].active || c->slots[s].id != id) continue;  // late or stray
        c->completed++;
        if ((buf[3] & 0x0f) == 0) c->noerror++; else c->other_rcode++;
        ask_next(c, s);
      }
    }
    const uint64_t now = now_ns();
    if (now - last_scan >= 100000000u) {
      last_scan = now;
      for (int k = 0; k < n; k++) {
        for (int s = 0; s < outstanding; s++) {
          struct slot* sl = &cl[k].slots[s];
          if (sl->active && now - sl->sent_ns >= timeout_ns) {
            cl[k].lost++;
            ask_next(&cl[k], s);
          }
        }
      }
    }
    busy = 0;
    for (int k = 0; k < n; k++) busy += cl[k].active > 0;
  }
  const double window = (double)(now_ns() - t0) / 1e9;
  printf("{\"window_s\": %.6f, \"clients\": [", window);
  for (int k = 0; k < n; k++) {
    printf("%s{\"sent\": %zu, \"completed\": %zu, \"lost\": %zu, \"noerror\": %zu, \"other_rcode\": %zu}",
           k ? ", " : "", cl[k].sent, cl[k].completed, cl[k].lost, cl[k].noerror, cl[k].other_rcode);
  }
  printf("]}\n");
  fflush(stdout);
  return 0;
}
