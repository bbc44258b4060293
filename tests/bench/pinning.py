#!/usr/bin/env python3
"""Hostname pinning (issue 16): egressd vs no rules vs HAProxy `req_ssl_sni`, side by side (DESIGN §5).

    server namespace  <tag>-up                           six client namespaces <tag>-norules, -conntrack,
      lo 198.51.100.53/32  dnsmasq :53 (the upstream)     -queue1, -queue2, -egressd, -haproxy, each eth0 192.0.2.(4k+2)/30,
         203.0.113.10/32   pinload serve :443, :5201  <-veth->  routes to the two server addresses only
                                                               (no default route, no host-namespace veth)

  norules  no nftables table at all
  conntrack  the floor of any stateful design (as in datapath.py): a table that tracks every
           flow and accepts on a ct mark, no sets, no pinning; a diagnostic, no budget
  queue1   the floor of any design that sends one packet per new flow to userspace through NFQUEUE
           (a diagnostic, no budget, latency only): conntrack's nat chain, and iptables-nft's
           filter OUTPUT (the queue is xtables' NFQUEUE target through nft_compat, as egressd
           sends it: this kernel has no nft_queue) queues, of a flow to 203.0.113.10 whose ct mark
           is still 0, the first client packet that carries payload (IP length > 80, more than
           any header-only IPv4/TCP packet: the ClientHello; the handshake's bare ACK is not).
           The reader, qfloor.c (compiled here like pinload.c, with -lmnl), binds the queue in
           copy-packet mode (64 bytes) and answers every packet at once, NF_REPEAT with an skb
           mark, as egressd's reader does; the re-run chain turns mark 0x51 into the ct mark 1,
           so every later packet of the flow stays in the kernel. No parsing, no decision: what
           is left is the trip through the queue.
  queue2   the same, but every client packet of an undecided established flow is queued, so the
           handshake's bare ACK makes a trip too (the reader answers it with mark 0x50: passed,
           the flow stays undecided) before the ClientHello: two trips, as egressd makes now.
  egressd  egressd run --netns <tag>-egressd, phase `agent`: allowlist [pinned.bench.example]
           (pinning on: the default). The client resolves pinned.bench.example through egressd
           first, so 203.0.113.10 is a name-learned address and every new TCP flow to it has its
           first bytes judged by the NFQUEUE reader (docs/pinning.md).
  haproxy  Debian's haproxy in the client namespace, TCP mode, transparent: an nft nat output
           rule redirects the client's TCP to 203.0.113.10 ports 443 and 5201 to haproxy
           (127.0.0.1:10443 and :10444; haproxy's own connections, uid nobody, are exempt);
           haproxy waits for the ClientHello (`tcp-request inspect-delay`), rejects unless
           `req_ssl_hello_type 1` and `req_ssl_sni -i -f allow.lst` (the same allowlist:
           pinned.bench.example), and connects to the original destination (`server orig
           0.0.0.0`, SO_ORIGINAL_DST), splicing both ways. This is what a user would deploy instead.

Both names pinned.bench.example and other.bench.example resolve to 203.0.113.10 (a shared CDN
address); every client sends a real ClientHello made once by Python's ssl (MemoryBIO) with
SNI pinned.bench.example (good) or other.bench.example (bad). The server and the clients are
pinload.c (compiled here with cc -O2): the server answers 6 bytes once it has read the whole
first TLS record (standing in for the ServerHello: only the first bytes are judged, so no
handshake crypto is in the numbers), and every client connection ends with a reset
(SO_LINGER 0) so no TIME_WAIT piles up.

Before measuring, each side is checked: the good hello gets its answer everywhere; the bad one
is refused by egressd and haproxy and answered with no rules, conntrack and the queue floors; and
each queue floor's reader must have seen exactly the packets its side queues (1 or 2 per
connection, asked with SIGUSR1), so a floor row cannot measure a queue that queued nothing.

Three measurements, the sides rotating from round to round:
  latency     connect + first byte: `pinload lat`, one connection after the other (connect,
              hello, first byte of the answer), in slices that alternate between the sides;
              p50 per side and round, then added = p50(side) - p50(norules) within the round.
              Budgets: egressd added p50 <= 100 µs, and <= 0.2 x haproxy's added p50. The
              queue floors are in this measurement only (not in throughput or rate).
  throughput  `pinload tput`: one connection sends the hello, waits for the answer (as TLS
              waits for the ServerHello), then streams for S seconds; the server counts what it
              received. Ratios egressd / norules (budget >= 0.97) and haproxy / norules.
  rate        `pinload rate`, open loop: new connections at a fixed rate for S seconds to 8
              server ports in turn, every 10th with the bad hello; a good one must get its
              answer, a bad one must be reset (no rules: all good). Decision errors = a good
              flow refused or a bad one admitted, a timeout, or egressd's `status` pin counters
              not matching (inspected = started, admitted = good, reset = bad).
              Every side first runs once at 10000/s with the kernel's choice of source port,
              as real clients have it, which revisits 4-tuples within seconds (the count is
              printed); then egressd climbs a ladder of rates (2500 .. 15000/s) with source
              ports that pinload picks so that no 4-tuple comes back (the capacity), and
              reports the highest rate sustained (achieved >= 0.97 x target) with zero errors.
              Budget: 10000/s with zero errors. The client is one C process on a 2-core machine
              it shares with the server, egressd and the kernel's softirq work, so its ceiling
              may be the generator's.
  per packet  `pinload pps`: small UDP datagrams on one connected socket to the pinned
              address (a flow the address decides: it is name-learned, the port is not 443),
              and the sender's CPU time per datagram, which holds netfilter's output path: the
              datapath's cost of one packet of a decided flow, without GSO to spread it (a
              TCP stream's packets are 64 KB, so throughput hides it). Each round measures the
              sides three times in turn, N/3 datagrams each in 5 batches, and keeps each side's
              cheapest batch (the machine's other work only adds). No budget; egressd's
              cost is printed over no rules and over conntrack alone.
  reuse       a new connection on the 4-tuple of one that just ended, from fixed source ports:
              a bad hello after an admitted flow must be refused, a good one after a refused
              flow answered.

Defaults: 5 rounds, 3000 connections per side and round in 6 slices, 2 s of throughput, rate
steps of 3 s (about 60 s). --quick: 1 round, 300 connections, 1 s, one rate step of 2000/s
for 1 s (a smoke test, about 15 s). Exits 0 when it ran (numbers are judged in docs), 1 when
something failed to run, 77 with "SKIP: reason" when not root.

usage: pinning.py [--quick] [--rounds R] [--conns N] [--seconds S] [--rates LIST] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import signal
import ssl
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dns_proxy as dp  # noqa: E402  (BenchRun, preflight, start_egressd, BenchError, ...)
from dns_proxy import lab  # noqa: E402
from datapath import CONNTRACK_TABLE  # noqa: E402  (the floor: conntrack and a ct mark rule, nothing else)

PREFIX = "egbpin-"
UPSTREAM = dp.UPSTREAM  # 198.51.100.53: the DNS upstream
PINNED = "203.0.113.10"
NAME, OTHER = "pinned.bench.example", "other.bench.example"
FB_PORT, TPUT_PORT = 443, 5201
# The rate's connections go to these ports in turn (the server listens on all of them): with
# one port, the kernel's choice of source port comes back to the same 4-tuple every ~32k
# connections, seconds apart at these rates, and a reused 4-tuple is a different test (below).
RATE_PORTS = tuple(range(10001, 10009))
REUSE_SPORTS = (20000, 20002)
HAP_FB, HAP_TPUT = 10443, 10444
NOBODY = 65534
SIDES = ("norules", "conntrack", "queue1", "queue2", "egressd", "haproxy")
TPUT_SIDES = ("norules", "conntrack", "egressd", "haproxy")  # throughput: the queue floors queue one packet, no more
PPS_SIDES = ("norules", "conntrack", "egressd")  # per packet: UDP, which haproxy does not carry
PPS_PORT = 9  # the upstream namespace drops it silently (SINK_TABLE): no ICMP errors back
SINK_TABLE = """table inet pps_sink {
    chain input {
        type filter hook input priority 0; policy accept;
        udp dport 9 drop
    }
}
"""
QUEUE_TRIPS = {"queue1": 1, "queue2": 2}  # packets each queue floor sends to its reader per connection
QUEUE_NUM = 17
LAT_BUDGET_US = 100.0
LAT_RATIO_BUDGET = 0.2
TPUT_BUDGET = 0.97
RATE_BUDGET = 10000
RATE_LADDER = (2500, 5000, 7500, 10000, 12500, 15000)
BAD_EVERY = 10
BUILD = dp.ROOT / os.environ.get("BUILD_DIR", "build")
if "EGRESSD" not in os.environ:
    dp.EGRESSD = BUILD / "src/egressd"
EGRESSCTL = Path(os.environ.get("EGRESSCTL") or dp.EGRESSD.parent / "egressctl")


def client_hello(name: str) -> bytes:
    """A real ClientHello with SNI name, as Python's ssl (OpenSSL) sends it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=name)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = out.read()
    if not hello or hello[0] != 22:
        raise dp.BenchError(f"could not make a ClientHello for {name}")
    return hello


# The queue floors' rules, as iptables-nft-restore input (the NFQUEUE target exists only as
# xtables' here: no nft_queue). Marks: the reader's verdicts, see qfloor.c. The first rule is the
# fast path of a decided flow; a verdict's re-run (NF_REPEAT) finds the reader's mark in the next.
QUEUE_IPT = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A OUTPUT -m connmark --mark 0x1 -j ACCEPT
-A OUTPUT -m mark --mark 0x51 -j CONNMARK --set-mark 0x1
-A OUTPUT -m mark --mark 0x51 -j ACCEPT
-A OUTPUT -m mark --mark 0x50 -j ACCEPT
-A OUTPUT -d {addr}/32 -p tcp -m conntrack --ctstate ESTABLISHED{payload} -j NFQUEUE --queue-num {num}
COMMIT
"""
QUEUE_PAYLOAD = {"queue1": " -m length --length 81:65535", "queue2": ""}
# The same nat hook as the conntrack floor's table (and egressd's): the queue rows are conntrack + trips.
QUEUE_NAT = """table ip qfloor {
  chain nat { type nat hook output priority -101; policy accept; }
}
"""

HAPROXY_CFG = """global
    maxconn 9000
    user nobody
    group nogroup
    pidfile {tmp}/haproxy.pid

defaults
    mode tcp
    timeout connect 3s
    timeout client 10s
    timeout server 10s

# connect + first byte and the rate: every flow ends with a reset, both sides
frontend tls_fb
    bind 127.0.0.1:{fb}
    option nolinger
    tcp-request inspect-delay 2s
    tcp-request content reject unless {{ req_ssl_hello_type 1 }}
    tcp-request content reject unless {{ req_ssl_sni -i -f {tmp}/allow.lst }}
    default_backend orig_fb

backend orig_fb
    option nolinger
    server orig 0.0.0.0

# throughput: the same check, ordinary closes
frontend tls_tput
    bind 127.0.0.1:{tput}
    tcp-request inspect-delay 2s
    tcp-request content reject unless {{ req_ssl_hello_type 1 }}
    tcp-request content reject unless {{ req_ssl_sni -i -f {tmp}/allow.lst }}
    default_backend orig_tput

backend orig_tput
    server orig 0.0.0.0
"""

HAPROXY_NFT = f"""table ip haptransparent {{
  chain out {{
    type nat hook output priority -100; policy accept;
    meta skuid {NOBODY} return
    ip daddr {PINNED} tcp dport {{ {FB_PORT}, {RATE_PORTS[0]}-{RATE_PORTS[-1]} }} redirect to :{HAP_FB}
    ip daddr {PINNED} tcp dport {TPUT_PORT} redirect to :{HAP_TPUT}
  }}
}}
"""


class Pinning:
    def __init__(self, a, run: dp.BenchRun):
        self.a, self.run = a, run
        self.tmp, self.topo, self.procs = run.tmp, run.topo, run.procs
        self.pinload = self.tmp / "pinload"
        self.qfloor = self.tmp / "qfloor"
        self.readers: dict[str, subprocess.Popen] = {}
        self.good, self.bad = self.tmp / "good.hello", self.tmp / "bad.hello"
        self.procs_by_name: dict[str, subprocess.Popen] = {}
        self.sport_next: dict[str, int] = {}

    # --- set-up ------------------------------------------------------------------------------

    def build_tools(self):
        cp = subprocess.run(["cc", "-O2", "-o", str(self.pinload), str(HERE / "pinload.c")],
                            capture_output=True, text=True, timeout=60)
        if cp.returncode != 0:
            raise dp.BenchError(f"cc pinload.c failed: {cp.stderr.strip()}")
        cp = subprocess.run(["cc", "-O2", "-o", str(self.qfloor), str(HERE / "qfloor.c"), "-lmnl"],
                            capture_output=True, text=True, timeout=60)
        if cp.returncode != 0:
            raise dp.BenchError(f"cc qfloor.c -lmnl failed (libmnl-dev?): {cp.stderr.strip()}")
        self.good.write_bytes(client_hello(NAME))
        self.bad.write_bytes(client_hello(OTHER))

    def build_lab(self):
        topo = self.topo
        topo.build(SIDES)
        topo.up.ip("addr", "add", f"{PINNED}/32", "dev", "lo")
        for k, side in enumerate(SIDES):
            ns = topo.clients[side]
            ns.ip("route", "add", f"{PINNED}/32", "via", f"192.0.2.{4 * k + 1}")
            # The kernel's source ports: 32768-65535 (the default ends at 60999), all above the
            # ones pinload binds itself (1024-32767) and the reuse probe's.
            ns.sysctl("net.ipv4.ip_local_port_range", "32768 65535")
        hosts = self.tmp / "hosts"
        hosts.write_text(f"{PINNED} {NAME}\n{PINNED} {OTHER}\n")
        up = self.procs.spawn(
            ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
             f"--addn-hosts={hosts}", "--local-ttl=600", "--cache-size=0", "--bind-interfaces",
             f"--listen-address={UPSTREAM}", "--port=53", "--pid-file=", "--user=root", "--group=root",
             f"--log-facility={self.tmp / 'upstream.log'}"], topo.up, self.tmp / "upstream.out")
        server = self.procs.spawn([self.pinload, "serve", PINNED, TPUT_PORT, FB_PORT, *RATE_PORTS], topo.up,
                                  self.tmp / "server.log")
        listening = lambda ns, spec: spec in ns.exec("ss", "-Hltn").stdout  # noqa: E731
        lab.wait_for(lambda: dp.alive_or_fail(server, "pinload serve") or dp.alive_or_fail(up, "dnsmasq") or
                     (listening(topo.up, f"{PINNED}:{FB_PORT}") and listening(topo.up, f"{PINNED}:{TPUT_PORT}")
                      and listening(topo.up, f"{UPSTREAM}:53")), 10, "the server and the upstream")
        self.procs_by_name.update(server=server, upstream=up)

    def start_egressd(self):
        ns = self.topo.clients["egressd"]
        policy = self.tmp / "policy.json"
        policy.write_text(json.dumps({
            "initial_phase": "agent", "dns": {"upstream": [UPSTREAM]},
            "phases": {"agent": {"network_mode": "allowlist", "allowed_hosts": [NAME]}}}))
        t0 = time.monotonic()
        self.egressd = dp.start_egressd(self.procs, ns, self.tmp, "egressd", policy)
        self.ready_s = time.monotonic() - t0
        # The address becomes name-learned: resolved through egressd (its nat takes port 53).
        rep = lab.wait_for(lambda: (lambda r: r if r.outcome == "ok" else None)(
            ns.dns_query(NAME, server=UPSTREAM, timeout=1.0)), 10, f"{NAME} through egressd")
        if rep.rcode != "NOERROR" or rep.addresses != [PINNED]:
            raise dp.BenchError(f"egressd answered {NAME} with {rep.rcode} {rep.addresses}, expected {PINNED}")
        if self.pin_counts() is None:
            raise dp.BenchError("egressd status has no pin counters: pinning is not running")

    def pin_counts(self) -> dict | None:
        cp = lab.run([EGRESSCTL, "--socket", self.tmp / "egressd.sock", "status", "--json"], timeout=10)
        return json.loads(cp.stdout).get("pin")

    def start_haproxy(self):
        ns = self.topo.clients["haproxy"]
        (self.tmp / "allow.lst").write_text(f"{NAME}\n")
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(tmp=self.tmp, fb=HAP_FB, tput=HAP_TPUT))
        cp = lab.run(["haproxy", "-c", "-q", "-f", cfg], check=False)
        if cp.returncode != 0:
            raise dp.BenchError(f"haproxy -c: {cp.stdout.strip()} {cp.stderr.strip()}")
        dp.nft(ns, "-f", "-", input=HAPROXY_NFT)
        p = self.procs.spawn(["haproxy", "-db", "-f", cfg], ns, self.tmp / "haproxy.log")
        listening = lambda spec: spec in ns.exec("ss", "-Hltn").stdout  # noqa: E731
        lab.wait_for(lambda: dp.alive_or_fail(p, "haproxy") or
                     (listening(f"127.0.0.1:{HAP_FB}") and listening(f"127.0.0.1:{HAP_TPUT}")), 10, "haproxy")
        self.procs_by_name["haproxy"] = p
        self.haproxy_version = lab.run(["haproxy", "-v"]).stdout.splitlines()[0]

    def start_queue_floors(self):
        for side in QUEUE_TRIPS:
            ns = self.topo.clients[side]
            log = self.tmp / f"qfloor-{side}.log"
            p = self.procs.spawn([self.qfloor, QUEUE_NUM], ns, log)
            lab.wait_for(lambda: dp.alive_or_fail(p, f"qfloor {side}") or "ready" in log.read_text(), 10,
                         f"qfloor {side} bound to queue {QUEUE_NUM}")
            # The rules only once the queue has its reader: a queued packet with none is dropped.
            cp = ns.exec("iptables-nft-restore", input=QUEUE_IPT.format(
                addr=PINNED, payload=QUEUE_PAYLOAD[side], num=QUEUE_NUM), check=False, timeout=30)
            if cp.returncode != 0:
                raise dp.BenchError(f"{side}: iptables-nft-restore: {cp.stderr.strip()}")
            dp.nft(ns, "-f", "-", input=QUEUE_NAT)
            self.readers[side] = p
            self.procs_by_name[f"qfloor {side}"] = p

    def queue_count(self, side: str) -> dict:
        """The reader's counters (packets, data, bare), asked with SIGUSR1."""
        p = self.readers[side]
        start = p.log.stat().st_size
        p.send_signal(signal.SIGUSR1)

        def answered():
            dp.alive_or_fail(p, f"qfloor {side}")
            for line in p.log.read_bytes()[start:].decode(errors="replace").splitlines():
                if line.startswith("count "):
                    return {k: int(v) for k, v in (kv.split("=", 1) for kv in line.split()[1:])}
            return None
        return lab.wait_for(answered, 5, f"qfloor {side}'s count")

    def alive(self):
        for what, p in self.procs_by_name.items():
            dp.alive_or_fail(p, what)
        dp.alive_or_fail(self.egressd, "egressd")

    # --- the clients -------------------------------------------------------------------------

    def pinload_run(self, side: str, *args, timeout: float) -> str:
        ns = self.topo.clients[side]
        try:
            cp = ns.exec(self.pinload, *args, timeout=timeout, check=False)
        except lab.LabError as e:
            raise dp.BenchError(str(e)) from None
        if cp.returncode != 0:
            raise dp.BenchError(f"pinload {args[0]} in {side} exited {cp.returncode}: {cp.stderr.strip()}")
        return cp.stdout

    def lat(self, side: str, n: int, hello: Path | None = None) -> tuple[list[float], list[str]]:
        out = self.pinload_run(side, "lat", PINNED, FB_PORT, hello or self.good, n, timeout=10 + n * 0.05)
        vals, errs = [], []
        for line in out.splitlines():
            (errs.append(line[4:]) if line.startswith("err ") else vals.append(float(line)))
        return vals, errs

    def tput(self, side: str, seconds: float) -> dict:
        out = self.pinload_run(side, "tput", PINNED, TPUT_PORT, self.good, seconds, timeout=seconds + 30)
        received, usec, sent = (int(x) for x in out.split())
        return {"bps": received * 8 / (usec / 1e6), "bytes": received, "sent": sent, "usec": usec}

    def pps(self, side: str, n: int) -> float:
        ns_per, errors = self.pinload_run(side, "pps", PINNED, PPS_PORT, n, timeout=120).split()
        if int(errors) != 0:
            raise dp.BenchError(f"pinload pps in {side}: {errors} of {n} datagrams refused")
        return float(ns_per)

    def rate(self, side: str, target: int, seconds: float, bad_every: int, own_ports: bool = False) -> dict:
        """own_ports: source ports chosen by pinload, continuing from the previous such run, so no
        4-tuple comes back (the capacity); otherwise the kernel's choice, as real clients have."""
        before = self.pin_counts() if side == "egressd" else None
        base = self.sport_next.get(side, 0) if own_ports else -1
        out = self.pinload_run(side, "rate", PINNED, ",".join(map(str, RATE_PORTS)), self.good, self.bad, target,
                               seconds, bad_every, base, timeout=seconds + 30)
        if own_ports:
            self.sport_next[side] = base + int(target * seconds) + 1
        r = {}
        for kv in out.split():
            k, v = kv.split("=", 1)
            r[k] = float(v) if "." in v else int(v)
        bad_expected = r["total"] // bad_every if bad_every else 0
        r["errors"] = (r["wrong_admit"] + r["wrong_refused"] + r["timeouts"] + r["conn_err"] + r["other_err"]
                       + r["unfinished"] + (r["total"] - r["started"]))
        if before is not None:
            after = self.pin_counts()
            d = {k: after[k] - before[k] for k in ("inspected", "admitted", "reset")}
            r["pin_delta"] = d
            # Every started flow was inspected once; the bad ones reset, the good ones admitted.
            r["pin_mismatch"] = (d["inspected"] != r["started"] or d["reset"] != bad_expected
                                 or d["admitted"] != r["started"] - bad_expected)
            r["errors"] += int(r["pin_mismatch"])
        r["sustained"] = r["errors"] == 0 and r["achieved"] >= 0.97 * target
        r["own_ports"] = own_ports
        return r

    def check_enforcement(self):
        for side in SIDES:
            before = self.queue_count(side) if side in QUEUE_TRIPS else None
            g, ge = self.lat(side, 1)
            b, be = self.lat(side, 1, self.bad)
            if not g:
                raise dp.BenchError(f"{side}: the ClientHello for {NAME} got no answer: {ge}")
            if side in ("norules", "conntrack", *QUEUE_TRIPS) and not b:
                raise dp.BenchError(f"{side}: the ClientHello for {OTHER} got no answer: {be}")
            if side in ("egressd", "haproxy") and b:
                raise dp.BenchError(f"{side}: the ClientHello for {OTHER} was answered, expected a refusal")
            if before is not None:
                # Two connections: each queued its ClientHello (and, queue2, its bare ACK) once.
                after = self.queue_count(side)
                d = {k: after[k] - before[k] for k in after}
                trips = QUEUE_TRIPS[side]
                want = {"packets": 2 * trips, "data": 2, "bare": 2 * (trips - 1)}
                if d != want:
                    raise dp.BenchError(f"{side}: its reader saw {d} for two connections, expected {want}")


    def first_answer(self, side: str, hello: Path, sport: int) -> str:
        """One connection from source port sport: "answered", "refused" (reset or EOF) or what else."""
        s = self.topo.clients[side].socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", sport))
            s.settimeout(2.0)
            s.connect((PINNED, FB_PORT))
            s.sendall(hello.read_bytes())
            return "answered" if s.recv(64) else "refused"
        except ConnectionResetError:
            return "refused"
        except (TimeoutError, socket.timeout):
            return "timeout"
        except OSError as e:
            return f"error {e.strerror}"
        finally:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()

    def tuple_reuse(self) -> dict:
        """A new connection on the 4-tuple of one that just ended (what the kernel's port choice
        does every ~32k connections to one server port) must be judged afresh: a bad hello after
        an admitted flow refused, a good one after a refused flow answered."""
        g, b = self.good, self.bad
        first = {"bad_after_good": [self.first_answer("egressd", g, REUSE_SPORTS[0])],
                 "good_after_bad": [self.first_answer("egressd", b, REUSE_SPORTS[1])]}
        first["bad_after_good"].append(self.first_answer("egressd", b, REUSE_SPORTS[0]))
        first["good_after_bad"].append(self.first_answer("egressd", g, REUSE_SPORTS[1]))
        ok = (first["bad_after_good"] == ["answered", "refused"] and first["good_after_bad"] == ["refused", "answered"])
        return {**first, "ok": ok}

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: 1 round, 300 connections, 1 s, one rate step")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, quick 1)")
    ap.add_argument("--conns", type=int, help="latency connections per side and round (default 3000, quick 300)")
    ap.add_argument("--slices", type=int, help="latency slices per round (default 6, quick 2)")
    ap.add_argument("--seconds", type=float, help="throughput seconds per side and round (default 2, quick 1)")
    ap.add_argument("--rates", help=f"egressd's rate ladder, connections/s (default {','.join(map(str, RATE_LADDER))}; "
                                    "quick 2000)")
    ap.add_argument("--rate-seconds", type=float, help="seconds per rate step (default 3, quick 1)")
    ap.add_argument("--pps", type=int, help="per-packet datagrams per side and round (default 200000, quick 20000)")
    ap.add_argument("--json", dest="json_out", metavar="FILE")
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 5)
    a.conns = a.conns or (300 if a.quick else 3000)
    a.slices = a.slices or (2 if a.quick else 6)
    a.seconds = a.seconds or (1.0 if a.quick else 2.0)
    a.rate_seconds = a.rate_seconds or (1.0 if a.quick else 3.0)
    a.pps = a.pps or (20000 if a.quick else 200000)
    ladder = [int(x) for x in a.rates.split(",")] if a.rates else ([2000] if a.quick else list(RATE_LADDER))
    compare_rate = ladder[-1] if a.quick else RATE_BUDGET

    status = dp.preflight(("nft", "ip", "ss", "setpriv", "dnsmasq", "haproxy", "cc", "iptables-nft-restore"))
    if status is not None:
        return status
    if not EGRESSCTL.exists():
        print(f"error: missing {EGRESSCTL}", file=sys.stderr)
        return 1

    run = dp.BenchRun(PREFIX, ("egressd.log", "haproxy.log", "server.log", "upstream.out", "qfloor-queue1.log",
                                  "qfloor-queue2.log"))
    b = Pinning(a, run)
    rounds, rates = [], {"egressd": [], "egressd_kernel_ports": [], "norules": [], "haproxy": []}
    load_before = dp.loadavg()
    t_start = time.monotonic()
    with run:
        b.build_tools()
        b.build_lab()
        b.start_egressd()
        b.start_haproxy()
        dp.nft(b.topo.clients["conntrack"], "-f", "-", input=CONNTRACK_TABLE)
        dp.nft(b.topo.up, "-f", "-", input=SINK_TABLE)
        b.start_queue_floors()
        b.check_enforcement()
        queued_before = {s: b.queue_count(s)["packets"] for s in QUEUE_TRIPS}
        reuse = b.tuple_reuse()

        per_slice = max(1, a.conns // a.slices)
        for r in range(a.rounds):
            order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
            lat = {s: [] for s in SIDES}
            errs = {s: [] for s in SIDES}
            for k in range(a.slices):
                for side in order[k % len(SIDES):] + order[:k % len(SIDES)]:
                    v, e = b.lat(side, per_slice)
                    lat[side] += v
                    errs[side] += e
            b.alive()
            res = {"lat_p50_us": {s: statistics.median(lat[s]) for s in SIDES},
                   "lat_p99_us": {s: dp.pct(lat[s], 99) for s in SIDES},
                   "lat_n": {s: len(lat[s]) for s in SIDES},
                   "lat_errors": {s: errs[s] for s in SIDES}, "tput": {}}
            for side in order:
                if side in TPUT_SIDES:
                    res["tput"][side] = b.tput(side, a.seconds)
            # Three passes over the sides, the cheapest of each side's: a side measured just
            # after another's throughput run can find the softirq work of that still going.
            passes = [{side: b.pps(side, a.pps // 3) for side in order if side in PPS_SIDES} for _ in range(3)]
            res["pps_ns"] = {side: min(p[side] for p in passes) for side in PPS_SIDES}
            b.alive()
            rounds.append(res)

        # The rate: the budget's rate with the kernel's source ports on every side, then
        # egressd's ladder with distinct 4-tuples, last because its top step overloads the
        # machine (stop at the first step not sustained).
        rates["egressd_kernel_ports"] = [b.rate("egressd", compare_rate, a.rate_seconds, BAD_EVERY)]
        rates["norules"].append(b.rate("norules", compare_rate, a.rate_seconds, 0))
        rates["haproxy"].append(b.rate("haproxy", compare_rate, a.rate_seconds, BAD_EVERY))
        for target in ladder:
            res = b.rate("egressd", target, a.rate_seconds, BAD_EVERY, own_ports=True)
            rates["egressd"].append(res)
            b.alive()
            if not res["sustained"]:
                break
        final_pin = b.pin_counts()
        # Packets per measured connection (latency only: no other measurement uses these sides).
        queued = {s: b.queue_count(s)["packets"] - queued_before[s] for s in QUEUE_TRIPS}
    if run.failed:
        return 1

    elapsed = time.monotonic() - t_start
    p50 = {s: statistics.median(r["lat_p50_us"][s] for r in rounds) for s in SIDES}
    added = {s: [r["lat_p50_us"][s] - r["lat_p50_us"]["norules"] for r in rounds]
             for s in ("conntrack", *QUEUE_TRIPS, "egressd", "haproxy")}
    lat_ratio = [e / h if h > 0 else float("inf") for e, h in zip(added["egressd"], added["haproxy"])]
    tput = {s: statistics.median(r["tput"][s]["bps"] for r in rounds) / 1e9 for s in TPUT_SIDES}
    tput_ratio = {s: [r["tput"][s]["bps"] / r["tput"]["norules"]["bps"] for r in rounds]
                  for s in ("conntrack", "egressd", "haproxy")}
    lat_errors = {s: sum(len(r["lat_errors"][s]) for r in rounds) for s in SIDES}
    pps_ns = {s: statistics.median(r["pps_ns"][s] for r in rounds) for s in PPS_SIDES}
    pps_added = {key: [r["pps_ns"][side] - r["pps_ns"][base] for r in rounds]
                 for key, side, base in (("conntrack", "conntrack", "norules"), ("egressd", "egressd", "norules"),
                                         ("egressd_over_conntrack", "egressd", "conntrack"))}
    sustained = [x for x in rates["egressd"] if x["sustained"]]
    best = max((x["target"] for x in sustained), default=0)

    summary = {
        "lat_p50_us": p50,
        "lat_p99_us": {s: statistics.median(r["lat_p99_us"][s] for r in rounds) for s in SIDES},
        "lat_added_p50_us": {s: statistics.median(v) for s, v in added.items()},
        "lat_added_ratio_egressd_over_haproxy": statistics.median(lat_ratio),
        "tput_gbps": tput,
        "tput_ratio": {s: statistics.median(v) for s, v in tput_ratio.items()},
        "rate_sustained_egressd": best,
        "rate_kernel_ports": compare_rate,
        "rate_kernel_ports_sustained": rates["egressd_kernel_ports"][0]["sustained"],
        "rate_kernel_ports_errors": rates["egressd_kernel_ports"][0]["errors"],
        "lat_errors": lat_errors,
        "tuple_reuse_ok": reuse["ok"],
        "pps_cpu_ns": pps_ns,
        "pps_added_ns": {s: statistics.median(v) for s, v in pps_added.items()},
        "queue_packets_per_conn": {s: queued[s] / max(1, sum(r["lat_n"][s] + len(r["lat_errors"][s]) for r in rounds))
                                   for s in QUEUE_TRIPS},
    }
    verdict = lambda ok: "pass" if ok else "MISS"  # noqa: E731

    print(f"pinning: {a.rounds} round(s); latency {a.conns} connections per side and round in {a.slices} slices; "
          f"throughput {a.seconds:g} s; rate steps of {a.rate_seconds:g} s (every {BAD_EVERY}th hello bad)")
    print(f"machine: {os.cpu_count()} cpus, load average {load_before[0]:.2f} before, {dp.loadavg()[0]:.2f} after; "
          f"{elapsed:.0f} s; {b.haproxy_version}; egressd ready in {b.ready_s:.2f} s")
    print(f"{'side':<8} {'p50 µs':>8} {'p99 µs':>8} {'added p50':>10} {'TCP Gb/s':>9} {'ratio':>6}  errors")
    for s in SIDES:
        ad = f"{summary['lat_added_p50_us'][s]:+.0f}" if s in added else "-"
        tr = f"{summary['tput_ratio'][s]:.3f}" if s in tput_ratio else "-"
        tg = f"{tput[s]:.2f}" if s in tput else "-"
        print(f"{s:<8} {p50[s]:>8.0f} {summary['lat_p99_us'][s]:>8.0f} {ad:>10} {tg:>9} {tr:>6}  {lat_errors[s]}")

    def spread(xs, fmt):
        return f" (rounds {fmt.format(min(xs))} .. {fmt.format(max(xs))})" if len(xs) > 1 else ""

    e_add = summary["lat_added_p50_us"]["egressd"]
    print(f"connect+first byte, egressd added p50: {e_add:+.0f} µs   budget <= {LAT_BUDGET_US:g} µs: "
          f"{verdict(e_add <= LAT_BUDGET_US)}{spread(added['egressd'], '{:+.0f}')}")
    print(f"connect+first byte, haproxy added p50: {summary['lat_added_p50_us']['haproxy']:+.0f} µs"
          f"{spread(added['haproxy'], '{:+.0f}')}")
    lr = summary["lat_added_ratio_egressd_over_haproxy"]
    for s, trips in QUEUE_TRIPS.items():
        q = summary["lat_added_p50_us"][s]
        print(f"connect+first byte, {s} added p50 (floor: conntrack + {trips} queue trip{'s' if trips > 1 else ''}, "
              f"no budget): {q:+.0f} µs = {q / summary['lat_added_p50_us']['haproxy']:.2f} x haproxy's"
              f"{spread(added[s], '{:+.0f}')}; queued {summary['queue_packets_per_conn'][s]:.2f} packets per connection")
    print(f"added p50 egressd / haproxy: {lr:.3f}   budget <= {LAT_RATIO_BUDGET:g}: {verdict(lr <= LAT_RATIO_BUDGET)}"
          f"{spread(lat_ratio, '{:.3f}')}")
    for s in ("conntrack", "egressd", "haproxy"):
        t = summary["tput_ratio"][s]
        b_txt = f"   budget >= {TPUT_BUDGET:g}: {verdict(t >= TPUT_BUDGET)}" if s == "egressd" else ""
        print(f"TCP throughput {s} / no rules: {t:.3f}{b_txt}{spread(tput_ratio[s], '{:.3f}')}")
    print(f"CPU per UDP datagram of a decided flow ({a.pps} per side and round): "
          + ", ".join(f"{s} {pps_ns[s]:.0f} ns" for s in PPS_SIDES)
          + f"; egressd over conntrack alone {summary['pps_added_ns']['egressd_over_conntrack']:+.0f} ns"
          f"{spread(pps_added['egressd_over_conntrack'], '{:+.0f}')}, conntrack over no rules "
          f"{summary['pps_added_ns']['conntrack']:+.0f} ns")
    print("rate (new pinned TLS connections/s, open loop; every side with the kernel's source ports, then egressd's "
          "ladder with distinct 4-tuples):")
    for s in ("egressd_kernel_ports", "norules", "haproxy", "egressd"):
        for x in rates[s]:
            pd = x.get("pin_delta")
            pin = (f" pin +{pd['inspected']} inspected/+{pd['admitted']} admitted/+{pd['reset']} reset"
                   f"{' MISMATCH' if x['pin_mismatch'] else ''}") if pd else ""
            print(f"  {s if s != 'egressd_kernel_ports' else 'egressd':<8} target {x['target']:>6.0f}/s achieved {x['achieved']:>8.0f}/s  ok {x['ok']} "
                  f"refused {x['refused_ok']}  errors {x['errors']} (wrong admit {x['wrong_admit']}, wrong refuse "
                  f"{x['wrong_refused']}, timeouts {x['timeouts']}, connect {x['conn_err']}; 4-tuples reused "
                  f"{x['reused']}, lag max "
                  f"{x['max_lag_ms']:.1f} ms) p50 {x['p50_us']:.0f} µs p99 {x['p99_us']:.0f} µs"
                  f"{pin}{'' if x['sustained'] else '  not sustained'}")
    print(f"egressd highest sustained rate with zero errors, distinct 4-tuples: {best}/s   budget >= {RATE_BUDGET}/s: "
          f"{'not judged (--quick stops at ' + str(ladder[-1]) + '/s)' if a.quick else verdict(best >= RATE_BUDGET)}")
    kp = rates["egressd_kernel_ports"][0]
    print(f"egressd at {compare_rate}/s with the kernel's source ports: {kp['errors']} errors "
          f"({kp['reused']} 4-tuples reused in the run)   zero errors: {verdict(kp['sustained'])}")
    print(f"4-tuple reused at once (source ports {REUSE_SPORTS[0]}, {REUSE_SPORTS[1]}): bad hello after an admitted "
          f"flow {reuse['bad_after_good'][1]}, good hello after a refused flow {reuse['good_after_bad'][1]}   "
          f"decided afresh: {verdict(reuse['ok'])}")
    print(f"egressd pin counters at the end: {final_pin}")
    dp.write_json(a, machine={"cpus": os.cpu_count(), "loadavg_before": load_before}, elapsed_s=elapsed,
                  haproxy=b.haproxy_version, ready_s=b.ready_s, summary=summary,
                  per_round={"lat_added_us": added, "lat_ratio": lat_ratio, "tput_ratio": tput_ratio, "pps_added_ns": pps_added},
                  budget={"lat_added_us": LAT_BUDGET_US, "lat_ratio": LAT_RATIO_BUDGET, "tput": TPUT_BUDGET,
                          "rate": RATE_BUDGET},
                  rates=rates, rounds=rounds, pin_counts=final_pin, tuple_reuse=reuse)
    return 0


if __name__ == "__main__":
    sys.exit(main())
