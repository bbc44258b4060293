/* qfloor: the floor of a queue-based pinning design, for tests/bench/pinning.py (issue 16).
 * Compiled by pinning.py at run time (cc -O2 ... -lmnl), like pinload.c.
 *
 *   qfloor QUEUENUM
 *       Binds NFQUEUE QUEUENUM of the current network namespace in copy-packet mode with a
 *       copy range of 64 bytes (enough for the IPv4 and TCP headers' fixed parts), prints
 *       "ready" once the kernel acknowledged the bind, then answers every packet at once, one
 *       verdict each: NF_REPEAT (the hook runs again, as egressd's reader answers) with an skb
 *       mark the table acts on:
 *         0x51  the packet carries TCP payload: the table sets the flow's ct mark ("decided")
 *               and every later packet of the flow stays in the kernel;
 *         0x50  no payload (the handshake's bare ACK, with queue2's table): the table lets it
 *               go, the flow stays undecided, so its first data segment comes here too.
 *       No parsing beyond the three header fields that give the payload length, no decision:
 *       what is left is the cost of the trip through the queue itself.
 *       On SIGUSR1 it writes the line "count packets=N data=D bare=B", so the bench
 *       can check that its side really queued.
 *
 * IPv4 only (the bench's addresses are IPv4 documentation ones).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <libmnl/libmnl.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum { kCopyRange = 64, kMarkBare = 0x50, kMarkData = 0x51 };

static volatile unsigned long packets, data, bare;
static uint16_t queue_num;

static char *put_num(char *p, const char *key, unsigned long v) {
  while (*key) *p++ = *key++;
  char digits[24];
  int k = 0;
  do digits[k++] = (char)('0' + v % 10); while ((v /= 10) != 0);
  while (k > 0) *p++ = digits[--k];
  return p;
}

/* The count, written from the handler itself (write is async-signal-safe): the main loop stays a
 * plain blocking recv, and a request is answered even when no packet comes. */
static void on_usr1(int sig) {
  (void)sig;
  int saved = errno;
  char line[128], *p = line;
  p = put_num(p, "count packets=", packets);
  p = put_num(p, " data=", data);
  p = put_num(p, " bare=", bare);
  *p++ = '\n';
  ssize_t w = write(STDOUT_FILENO, line, (size_t)(p - line));
  (void)w;
  errno = saved;
}

static struct nlmsghdr *queue_header(char *buf, uint8_t type, uint16_t flags) {
  struct nlmsghdr *nlh = mnl_nlmsg_put_header(buf);
  nlh->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | type;
  nlh->nlmsg_flags = flags;
  struct nfgenmsg *nfg = mnl_nlmsg_put_extra_header(nlh, sizeof *nfg);
  nfg->nfgen_family = AF_UNSPEC;
  nfg->version = NFNETLINK_V0;
  nfg->res_id = htons(queue_num);
  return nlh;
}

static int attr_cb(const struct nlattr *a, void *data_) {
  const struct nlattr **tb = data_;
  int type = mnl_attr_get_type(a);
  if (type >= 0 && type <= NFQA_MAX) tb[type] = a;
  return MNL_CB_OK;
}

/* Payload bytes of an IPv4/TCP packet from its first bytes; -1 if they do not say. */
static int tcp_payload_len(const uint8_t *p, size_t n) {
  if (n < 20 || (p[0] >> 4) != 4) return -1;
  size_t ihl = (size_t)(p[0] & 0x0f) * 4, tot = (size_t)p[2] << 8 | p[3];
  if (p[9] != 6 || n < ihl + 13) return -1;
  size_t doff = (size_t)(p[ihl + 12] >> 4) * 4;
  return tot > ihl + doff ? (int)(tot - ihl - doff) : 0;
}

static struct mnl_socket *nl;

static int packet_cb(const struct nlmsghdr *nlh, void *unused) {
  (void)unused;
  const struct nlattr *tb[NFQA_MAX + 1] = {0};
  if (mnl_attr_parse(nlh, sizeof(struct nfgenmsg), attr_cb, tb) < 0 || !tb[NFQA_PACKET_HDR]) return MNL_CB_OK;
  const struct nfqnl_msg_packet_hdr *ph = mnl_attr_get_payload(tb[NFQA_PACKET_HDR]);
  int len = tb[NFQA_PAYLOAD] ? tcp_payload_len(mnl_attr_get_payload(tb[NFQA_PAYLOAD]),
                                               mnl_attr_get_payload_len(tb[NFQA_PAYLOAD]))
                             : -1;
  uint32_t mark = len == 0 ? kMarkBare : kMarkData;
  packets++;
  if (len == 0) bare++; else data++;

  char buf[256];
  struct nlmsghdr *v = queue_header(buf, NFQNL_MSG_VERDICT, NLM_F_REQUEST);
  struct nfqnl_msg_verdict_hdr vh = {.verdict = htonl(NF_REPEAT), .id = ph->packet_id};
  mnl_attr_put(v, NFQA_VERDICT_HDR, sizeof vh, &vh);
  mnl_attr_put_u32(v, NFQA_MARK, htonl(mark));
  if (mnl_socket_sendto(nl, v, v->nlmsg_len) < 0) {
    perror("qfloor: verdict");
    exit(1);
  }
  return MNL_CB_OK;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: qfloor QUEUENUM\n");
    return 2;
  }
  queue_num = (uint16_t)atoi(argv[1]);
  struct sigaction sa = {.sa_handler = on_usr1, .sa_flags = SA_RESTART};
  sigaction(SIGUSR1, &sa, NULL);

  nl = mnl_socket_open(NETLINK_NETFILTER);
  if (!nl || mnl_socket_bind(nl, 0, MNL_SOCKET_AUTOPID) < 0) {
    perror("qfloor: netlink");
    return 1;
  }
  char buf[MNL_SOCKET_BUFFER_SIZE];
  struct nlmsghdr *nlh = queue_header(buf, NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK);
  struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND};
  mnl_attr_put(nlh, NFQA_CFG_CMD, sizeof cmd, &cmd);
  struct nfqnl_msg_config_params params = {.copy_range = htonl(kCopyRange), .copy_mode = NFQNL_COPY_PACKET};
  mnl_attr_put(nlh, NFQA_CFG_PARAMS, sizeof params, &params);
  nlh->nlmsg_seq = 1;
  if (mnl_socket_sendto(nl, nlh, nlh->nlmsg_len) < 0) {
    perror("qfloor: bind");
    return 1;
  }
  ssize_t n = mnl_socket_recvfrom(nl, buf, sizeof buf);
  if (n < 0 || mnl_cb_run(buf, n, 1, mnl_socket_get_portid(nl), NULL, NULL) < 0) {
    perror("qfloor: bind queue");
    return 1;
  }
  printf("ready\n");
  fflush(stdout);

  unsigned int portid = mnl_socket_get_portid(nl);
  for (;;) {
    n = mnl_socket_recvfrom(nl, buf, sizeof buf);
    if (n < 0) {
      perror("qfloor: recv (ENOBUFS: the socket buffer overflowed, packets were lost)");
      return 1;
    }
    if (mnl_cb_run(buf, n, 0, portid, packet_cb, NULL) < 0) {
      perror("qfloor: a queue message");
      return 1;
    }
  }
}
