#!/usr/bin/env python3
"""DNS proxy throughput and added latency, egressd vs dnsmasq, side by side in one run (DESIGN §5).

Every contender answers the same unique names from the same upstream, measured with dnsperf
from its own client namespace, so the path is identical and nothing is shared:

    upstream namespace  <ns>-up                 one client namespace per contender, <ns>-<name>
      lo   198.51.100.53/32  dnsmasq :53,  <-veth->  eth0 192.0.2.(4k+2)/30
           authoritative for every name               route 198.51.100.53/32 via 192.0.2.(4k+1)
      c<k> 192.0.2.(4k+1)/30 (one veth per client)     (no default route, no host-namespace veth)

  direct   dnsperf -> 198.51.100.53:53 (the upstream itself, no proxy)
  forward  dnsmasq --cache-size=0 --no-resolv --server=198.51.100.53 on 127.0.0.1:5301
  floor    (--only) udpfwd.c on 127.0.0.1:5303: forwards, nothing else (see EXTRA_CONTENDERS)
  nftset   the same plus --nftset=/bench.example/4#inet#benchtbl#learned (set created first:
           table inet benchtbl { set learned { type ipv4_addr; flags timeout; } }), 127.0.0.1:5302
  egressd  egressd run --netns <ns>-egressd --dns-port 53, policy: upstream 198.51.100.53,
           phase `agent` allowlist ["*.bench.example"]; dnsperf -> 127.0.0.1:53. egressd's nat
           redirect takes every port-53 query of its namespace, which is why each contender
           has a namespace of its own.

Names: l<i>.bench.example (latency file) and t<i>.bench.example (throughput file), each with its
own A address in 198.18.0.0/15, the benchmarking range (answer data only: no client namespace
has a route to it, and the upstream namespace has no route anywhere). TTL 300.

Per round, every contender is started fresh (empty set, empty cache, egressd with no table;
they live in separate namespaces, and an idle one costs nothing), then:
  latency     dnsperf -Q 1000 -n 1 -c 1 -v over latency names, 2 s per contender in 4 slices of
              0.5 s that alternate between the contenders (so a change in background load hits
              them alike); at that rate practically never more than one query is in flight.
              -v prints every answer with its latency (µs resolution), from which p50/p99 are
              taken (dnsperf 2.10 has no percentile output);
  throughput  one contender after the other, dnsperf -n 1 -c 1 -q 20 -t 1 -l 10 over the
              throughput names: every name exactly once (fixed work; qps = answers / run time),
              so every answer carries a new address for the set contenders. -q 20 saturates
              every contender here (more outstanding queries only queue) and stays under
              dnsmasq's --dns-forward-max of 150.
Every answer must be NOERROR (a contender that refuses would be fast and wrong), and afterwards
the set of each set contender is counted: egressd's ph_agent_d4 and dnsmasq's benchtbl/learned
must hold one element per name answered (printed as elements/answered, per round).
The order of the contenders rotates from round to round. The table shows medians over
rounds; each ratio is taken within a round (same background load) and the median over rounds
is reported, with its range. Defaults: 5 rounds of 40000 names (about 90 s); --quick: 1 round of 10000 names, 1 s
of latency (about 10 s). The names stay below egressd's cap of 65536 learned addresses, past
which it slows down sharply (--names 100000 shows it).

Prints one table and the ratios against the budgets: egressd/nftset qps (>= 4),
egressd/forward qps (>= 0.8), egressd p50 over direct (<= 100 µs), and the machine's load
average (the numbers swing with it on a small machine shared with other work).
Exits 0 when it ran (the numbers are judged in docs, not by the exit code), 1 when something
failed to run, 77 with "SKIP: reason" when not root.

Diagnostics: --only egressd,egressd-public adds egressd in public mode (forwards and
observes, inserts nothing), which isolates the cost of the set insertion; --perf FILE runs
`perf record -g` on egressd during its first throughput run.

The other benchmarks here but switch_latency.py import this module for what they share with it:
preflight, BenchRun (set-up and clean-up of a run), Topology, Procs, start_egressd, write_json,
start_upstream, wait_answer, dnsperf_argv and parse_dnsperf.

usage: dns_proxy.py [--quick] [--rounds R] [--names N] [--only LIST] [--json FILE] [--perf FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/integration"))
import lab  # noqa: E402  (namespace helpers: Netns, wait_for, run, dns_query)

EGRESSD = Path(os.environ.get("EGRESSD", str(ROOT / "build/src/egressd")))
PREFIX = "egbdns-"
UPSTREAM = "198.51.100.53"
DOMAIN = "bench.example"
TTL = 300
FWD_PORT, NFTSET_PORT, FLOOR_PORT = 5301, 5302, 5303
# egressd keeps at most this many learned addresses in memory (sandbox.h max_learned); the
# default name count stays below it so the benchmark measures the per-answer path.
EGRESSD_MAX_LEARNED = 65536
CONTENDERS = ("direct", "forward", "nftset", "egressd")
# Diagnostic, only with --only: egressd in public mode forwards and observes but inserts nothing
# into a set, which isolates the cost of the set insertion; floor is udpfwd.c, a forwarder that
# does nothing but forward (batched, one upstream port), the most any proxy hop gets here.
EXTRA_CONTENDERS = ("egressd-public", "floor")


class BenchError(Exception):
    """Something failed to run (not a verdict about the numbers)."""


class Interrupted(BaseException):
    pass


def _on_signal(signum, _frame):
    raise Interrupted(signum)


def address(i: int) -> str:
    """The i-th address of 198.18.0.0/15."""
    if not 0 <= i < 131072:
        raise ValueError("more names than addresses in 198.18.0.0/15")
    return f"198.{18 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}"


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# --- processes -------------------------------------------------------------------------------


def stop_process(p: subprocess.Popen, grace: float = 3):
    """SIGTERM, then SIGKILL if p is still running grace s later."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


class Procs:
    """Processes this run started, stopped by pid (SIGTERM, then SIGKILL)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args, ns: lab.Netns | None, log: Path) -> subprocess.Popen:
        # pdeathsig: if this script dies without cleaning up, its children die with it.
        argv = ["setpriv", "--pdeathsig", "KILL", "--"]
        if ns is not None:
            argv += ["ip", "netns", "exec", ns.name]
        argv += [str(a) for a in args]
        with open(log, "ab") as f:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        p.log = log
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen):
        stop_process(p)
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self):
        for p in list(reversed(self.procs)):
            try:
                self.stop(p)
            except Exception as e:  # keep going: the namespaces must go regardless
                print(f"cleanup: pid {p.pid}: {e}", file=sys.stderr)


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return ""


def alive_or_fail(p: subprocess.Popen, what: str):
    if p.poll() is not None:
        raise BenchError(f"{what} exited with {p.returncode}:\n{tail(p.log)}")


def start_egressd(procs: Procs, ns: lab.Netns, tmp: Path, name: str, policy: Path, timeout: float = 60,
                  extra=()) -> subprocess.Popen:
    """`egressd run --netns ns` with policy, its socket, ready file and log at tmp/<name>.sock,
    .ready and .log; returns once the ready file exists (BenchError with the log's tail when it
    exits first or takes longer than timeout s). extra: more options of `egressd run`."""
    ready = tmp / f"{name}.ready"
    p = procs.spawn([EGRESSD, "run", "--netns", ns.path, "--socket", tmp / f"{name}.sock", "--config", policy,
                     *extra, "--ready-file", ready], None, tmp / f"{name}.log")
    try:
        lab.wait_for(lambda: alive_or_fail(p, name) or ready.exists(), timeout, f"{name}'s ready file")
    except lab.LabError as e:
        raise BenchError(f"{e}\n{tail(p.log)}") from None
    return p


# --- the namespaces --------------------------------------------------------------------------


class Topology:
    def __init__(self, tag: str):
        self.tag = tag
        self.up = lab.Netns(f"{tag}-up")
        self.clients: dict[str, lab.Netns] = {}
        self.created: list[lab.Netns] = []

    def add(self, ns: lab.Netns) -> lab.Netns:
        """Creates ns with lo up; delete() removes it with the others."""
        self.created.append(ns)  # registered first: delete() removes it even if setup fails next
        ns.create()
        ns.ip("link", "set", "lo", "up")
        return ns

    def build(self, names):
        self.add(self.up)
        self.up.ip("addr", "add", f"{UPSTREAM}/32", "dev", "lo")
        for k, name in enumerate(names):
            ns = lab.Netns(f"{self.tag}-{name}")
            self.add(ns)
            gw, me = f"192.0.2.{4 * k + 1}", f"192.0.2.{4 * k + 2}"
            # Both ends are created inside namespaces; none ever exists in the host's.
            ns.ip("link", "add", "eth0", "type", "veth", "peer", "name", f"c{k}", "netns", self.up.name)
            ns.ip_batch([f"addr add {me}/30 dev eth0", "link set eth0 up"])
            self.up.ip_batch([f"addr add {gw}/30 dev c{k}", f"link set c{k} up"])
            self.clients[name] = ns
        for k, (name, ns) in enumerate(self.clients.items()):
            lab.wait_for(lambda: ns.operstate("eth0") == "UP" and self.up.operstate(f"c{k}") == "UP", 5.0,
                         f"veth of {name} to come up")
            ns.ip("route", "add", f"{UPSTREAM}/32", "via", f"192.0.2.{4 * k + 1}")

    def delete(self):
        for ns in reversed(self.created):
            try:
                kill_all(ns)
                lab.wait_for(lambda: not ns.pids(), 5.0, f"processes in {ns.name} to exit")
                ns.delete()
            except Exception as e:
                print(f"cleanup: {ns.name}: {e}", file=sys.stderr)


def kill_all(ns: lab.Netns):
    """SIGKILL to every process in ns."""
    for pid in ns.pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sweep_stale(prefix: str = PREFIX):
    """Removes <prefix><pid>-* namespaces and temporary directories whose process is gone (a
    run killed with SIGKILL; its children died with it, through pdeathsig)."""
    tmp = Path(tempfile.gettempdir())
    for d in tmp.glob(f"{prefix}*-*"):
        m = re.match(re.escape(prefix) + r"(\d+)-", d.name)
        if m and d.is_dir() and not lab._pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return
    for name in names:
        m = re.match(re.escape(prefix) + r"(\d+)-", name)
        if m and not lab._pid_alive(int(m.group(1))):
            ns = lab.Netns(name)
            kill_all(ns)
            ns.delete()


def nft(ns: lab.Netns, *args, input: str | None = None, check=True) -> str:
    return ns.exec("nft", *args, input=input, check=check, timeout=60).stdout


def set_count(ns: lab.Netns, family: str, table: str, name: str) -> int:
    out = nft(ns, "-j", "list", "set", family, table, name)
    for obj in json.loads(out)["nftables"]:
        if "set" in obj:
            return len(obj["set"].get("elem", []))
    raise BenchError(f"no set {family} {table} {name} in {ns.name}")


# --- a benchmark's run (every script here but switch_latency.py) -----------------------------


def preflight(tools, need_egressd: bool = True, more_tools=()) -> int | None:
    """None when the benchmark can run; otherwise prints why not and returns the exit status:
    77 ("SKIP: ...") when not root, 1 when one of tools, the egressd binary (when need_egressd)
    or one of more_tools is missing (named in that order)."""
    if os.geteuid() != 0:
        print("SKIP: needs root (network namespaces, nftables)")
        return 77
    missing = [t for t in tools if shutil.which(t) is None]
    if need_egressd and not EGRESSD.exists():
        missing.append(f"{EGRESSD} (build first: meson setup build && ninja -C build)")
    missing += [t for t in more_tools if shutil.which(t) is None]
    if missing:
        print(f"error: missing {', '.join(missing)} (scripts/setup installs the packages)", file=sys.stderr)
        return 1
    return None


SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class BenchRun:
    """One run of a benchmark, `with BenchRun(PREFIX, logs) as run:` around its measurements.

    On creation: SIGTERM, SIGHUP and SIGINT raise Interrupted, what a killed run of the same
    benchmark left is swept, and run.tag (<prefix><pid>), run.tmp (a fresh temporary directory),
    run.topo (a Topology, nothing built yet) and run.procs are set. A failure to run inside the
    block (BenchError, LabError, a subprocess error, OSError, a signal) ends it and is kept in
    run.failed. Either way the processes are stopped and the namespaces deleted; on a failure the
    tail of each of logs (names in run.tmp) and "error: <failure>" go to stderr; then run.tmp
    is removed. Any other exception (a bug) propagates after the same clean-up."""

    def __init__(self, prefix: str, logs=()):
        for sig in SIGNALS:
            signal.signal(sig, _on_signal)
        sweep_stale(prefix)
        self.tag = f"{prefix}{os.getpid()}"
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.topo, self.procs = Topology(self.tag), Procs()
        self.logs = logs
        self.failed: str | None = None

    def __enter__(self):
        return self

    def __exit__(self, _type, e, _tb):
        if isinstance(e, (BenchError, lab.LabError, subprocess.SubprocessError, OSError)):
            self.failed = str(e)
        elif isinstance(e, Interrupted):
            self.failed = f"interrupted by signal {e.args[0]}"
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        self.procs.stop_all()
        self.topo.delete()
        if self.failed:
            for f in self.logs:
                t = tail(self.tmp / f)
                if t:
                    print(f"--- {f}\n{t}", file=sys.stderr)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.failed:
            print(f"error: {self.failed}", file=sys.stderr)
        return self.failed is not None


def write_json(a: argparse.Namespace, **fields):
    """With --json FILE (a.json_out): the options but that one as "config", then fields."""
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({
            "config": {k: v for k, v in vars(a).items() if k != "json_out"}, **fields}, indent=2) + "\n")


# --- dnsperf ---------------------------------------------------------------------------------


def dnsperf_argv(server: str, port: int, datafile: Path, args: list[str], limit: float,
                 verbose: bool = False) -> list[str]:
    """dnsperf over datafile once (-n 1), for at most limit s, with a 1 s query timeout."""
    return ["dnsperf", "-s", server, "-p", str(port), "-d", str(datafile), "-n", "1", "-l", f"{limit:g}",
            "-t", "1", *args] + (["-v"] if verbose else [])


def parse_dnsperf(out: str, returncode: int, where: str, stderr: str = "", verbose: bool = False) -> dict:
    """dnsperf's report as sent, completed, lost, seconds, qps, rcodes (and with verbose, every
    answer's latency); BenchError when it failed or printed no report."""
    m = {k: re.search(rf"{k}:\s+([0-9.]+)", out) for k in
         ("Queries sent", "Queries completed", "Queries lost", "Run time \\(s\\)", "Queries per second")}
    if returncode != 0 or not all(m.values()):
        raise BenchError(f"dnsperf in {where} failed ({returncode}): {stderr.strip()}\n{out[-2000:]}")
    codes = dict((c, int(n)) for c, n in re.findall(r"(\b[A-Z]+) (\d+) \([0-9.]+%\)", out.split("Response codes:")[1]
                                                   .split("\n")[0])) if "Response codes:" in out else {}
    r = {"sent": int(m["Queries sent"].group(1)), "completed": int(m["Queries completed"].group(1)),
         "lost": int(m["Queries lost"].group(1)), "seconds": float(m["Run time \\(s\\)"].group(1)),
         "qps": float(m["Queries per second"].group(1)), "rcodes": codes}
    if verbose:
        r["latencies"] = [float(x) for x in re.findall(r"^> NOERROR \S+ A ([0-9.]+)$", out, re.M)]
    return r


def dnsperf(ns: lab.Netns, server: str, port: int, datafile: Path, args: list[str], limit: float,
            verbose: bool = False) -> dict:
    argv = dnsperf_argv(server, port, datafile, args, limit, verbose)
    try:
        cp = ns.exec(*argv, timeout=limit + 30, check=False)
    except lab.LabError as e:
        raise BenchError(str(e)) from None
    return parse_dnsperf(cp.stdout, cp.returncode, ns.name, cp.stderr, verbose)


def check_answers(name: str, r: dict, what: str):
    """Every answer must be NOERROR: a contender that refuses is fast and wrong."""
    bad = {c: n for c, n in r["rcodes"].items() if c != "NOERROR"}
    if bad or r["completed"] == 0:
        raise BenchError(f"{name} {what}: answers {r['rcodes'] or 'none'} (expected NOERROR only)")


def start_upstream(procs: Procs, up: lab.Netns, tmp: Path, hosts: Path, probe: dict) -> subprocess.Popen:
    """The upstream: dnsmasq on UPSTREAM:53 in up, authoritative for every name of hosts (no
    cache), logging to tmp/upstream.log; returns once probe ({"name", "addr"}, the last name of
    hosts) answers (loading 100k names takes a while)."""
    p = procs.spawn(
        ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
         f"--addn-hosts={hosts}", f"--local-ttl={TTL}", "--cache-size=0", "--bind-interfaces",
         f"--listen-address={UPSTREAM}", "--port=53", "--pid-file=", "--user=root", "--group=root",
         f"--log-facility={tmp / 'upstream.log'}"], up, tmp / "upstream.out")
    wait_answer(up, UPSTREAM, 53, probe, "the upstream", p, 60)
    return p


def start_perf(pid: int, out: str, seconds: float, log_path: Path) -> subprocess.Popen:
    """`perf record -g` on pid for at most `seconds`, returned once it samples: its perf_event
    descriptors are open. Stop it with SIGINT and wait, so it writes its file."""
    p = subprocess.Popen(["perf", "record", "-g", "-p", str(pid), "-o", out, "--", "sleep", f"{seconds:g}"],
                         stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))

    def attached() -> bool:
        if p.poll() is not None:
            raise BenchError(f"perf record exited {p.returncode} (see {log_path})")
        try:
            fds = os.listdir(f"/proc/{p.pid}/fd")
        except FileNotFoundError:
            return False
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p.pid}/fd/{fd}") == "anon_inode:[perf_event]":
                    return True
            except OSError:
                pass
        return False
    lab.wait_for(attached, 10, "perf record to attach")
    return p


def wait_answer(ns: lab.Netns, server: str, port: int, probe: dict, what: str, proc: subprocess.Popen,
                timeout: float = 10.0):
    """Waits until server:port, asked from ns, answers probe["name"] with probe["addr"] alone
    (BenchError when proc exits, the answer is another, or timeout s pass)."""
    def answered():
        alive_or_fail(proc, what)
        rep = ns.dns_query(probe["name"], server=server, port=port, timeout=0.5)
        if rep.outcome != "ok":
            return False
        if rep.rcode != "NOERROR" or rep.addresses != [probe["addr"]]:
            raise BenchError(f"{what} answered {probe['name']} with {rep.rcode} {rep.addresses}, "
                             f"expected {probe['addr']}")
        return True
    try:
        lab.wait_for(answered, timeout, f"{what} to answer {probe['name']}")
    except lab.LabError as e:
        raise BenchError(f"{e}\n{tail(proc.log)}") from None


# --- the bench -------------------------------------------------------------------------------


class Bench:
    def __init__(self, args, tmp: Path, topo: Topology, procs: Procs):
        self.a, self.tmp, self.topo, self.procs = args, tmp, topo, procs
        self.lat_files = [tmp / f"latency{j}.txt" for j in range(args.slices)]
        self.tput_file = tmp / "throughput.txt"
        self.hosts = tmp / "hosts"
        self.perf_done = False

    def write_data(self):
        lat = [f"l{i:05d}.{DOMAIN}" for i in range(self.a.lat_names)]
        tput = [f"t{i:06d}.{DOMAIN}" for i in range(self.a.names)]
        self.first = {"name": lat[0], "addr": address(0)}
        with open(self.hosts, "w") as h:
            for i, n in enumerate(lat + tput):
                h.write(f"{address(i)} {n}\n")
        per = len(lat) // self.a.slices
        for j, f in enumerate(self.lat_files):
            f.write_text("".join(f"{n} A\n" for n in lat[j * per:(j + 1) * per]))
        self.tput_file.write_text("".join(f"{n} A\n" for n in tput))
        self.last = {"name": tput[-1], "addr": address(len(lat) + len(tput) - 1)}

    def start_upstream(self):
        self.upstream = start_upstream(self.procs, self.topo.up, self.tmp, self.hosts, self.last)

    def wait_answer(self, ns, server, port, probe, what, proc, timeout=10.0):
        wait_answer(ns, server, port, probe, what, proc, timeout)

    # contenders: start() returns (server, port, process or None, set counter or None)
    def start_contender(self, name: str):
        ns = self.topo.clients[name]
        if name == "direct":
            return UPSTREAM, 53, None, None
        if name in ("forward", "nftset"):
            port = FWD_PORT if name == "forward" else NFTSET_PORT
            extra = []
            counter = None
            if name == "nftset":
                nft(ns, "delete", "table", "inet", "benchtbl", check=False)
                nft(ns, "-f", "-", input="table inet benchtbl {\n"
                    "  set learned { type ipv4_addr; flags timeout; }\n}\n")
                extra = [f"--nftset=/{DOMAIN}/4#inet#benchtbl#learned"]
                counter = lambda: set_count(ns, "inet", "benchtbl", "learned")  # noqa: E731
            p = self.procs.spawn(
                ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
                 "--cache-size=0", f"--server={UPSTREAM}", "--bind-interfaces", "--listen-address=127.0.0.1",
                 f"--port={port}", "--pid-file=", "--user=root", "--group=root",
                 f"--log-facility={self.tmp / (name + '.log')}", *extra], ns, self.tmp / f"{name}.out")
            self.wait_answer(ns, "127.0.0.1", port, self.first, f"dnsmasq ({name})", p)
            return "127.0.0.1", port, p, counter
        if name == "floor":
            binary = self.tmp / "udpfwd"
            if not binary.exists():
                cp = subprocess.run(["cc", "-O2", "-o", str(binary), str(Path(__file__).resolve().parent / "udpfwd.c")],
                                    capture_output=True, text=True)
                if cp.returncode != 0:
                    raise BenchError(f"cc udpfwd.c failed: {cp.stderr.strip()}")
            p = self.procs.spawn([binary, "127.0.0.1", str(FLOOR_PORT), UPSTREAM, "53"], ns, self.tmp / "floor.out")
            self.wait_answer(ns, "127.0.0.1", FLOOR_PORT, self.first, "udpfwd (floor)", p)
            return "127.0.0.1", FLOOR_PORT, p, None
        if name in ("egressd", "egressd-public"):
            nft(ns, "delete", "table", "inet", "egressd", check=False)  # a fresh start, not an adoption
            nft(ns, "delete", "table", "netdev", "egressd", check=False)  # its egress chains (policy drop)
            policy = self.tmp / f"{name}.yaml"
            policy.write_text(json.dumps({
                "initial_phase": "agent", "dns": {"upstream": [UPSTREAM]},
                "phases": {"agent": {"network_mode": "allowlist", "allowed_hosts": [f"*.{DOMAIN}"]}
                           if name == "egressd" else "public"}}))
            (self.tmp / f"{name}.ready").unlink(missing_ok=True)  # left by the previous round
            p = start_egressd(self.procs, ns, self.tmp, name, policy, 10, extra=["--dns-port", "53"])
            self.wait_answer(ns, "127.0.0.1", 53, self.first, name, p)
            counter = lambda: set_count(ns, "inet", "egressd", "ph_agent_d4")  # noqa: E731
            return "127.0.0.1", 53, p, counter if name == "egressd" else None
        raise ValueError(name)

    def stop_contender(self, name: str, p):
        if p is None:
            return
        self.procs.stop(p)
        ns = self.topo.clients[name]
        table = {"nftset": "benchtbl", "egressd": "egressd", "egressd-public": "egressd"}.get(name)
        if table:
            nft(ns, "delete", "table", "inet", table, check=False)
        if table == "egressd":
            nft(ns, "delete", "table", "netdev", "egressd", check=False)

    def run_round(self, order: list[str]) -> dict[str, dict]:
        """Starts every contender fresh, measures them, stops them. Latency is measured in
        slices that alternate between the contenders (so a change in background load hits them
        alike), then throughput one contender after the other, in `order`."""
        a = self.a
        started = {}
        try:
            for c in order:
                started[c] = self.start_contender(c)
            lat = {c: [] for c in order}
            lat_answered = {c: 0 for c in order}
            lat_lost = {c: 0 for c in order}
            for j, f in enumerate(self.lat_files):
                for c in order[j % len(order):] + order[:j % len(order)]:
                    server, port, p, _ = started[c]
                    r = dnsperf(self.topo.clients[c], server, port, f, ["-Q", str(a.lat_rate), "-c", "1", "-q", "10"],
                                a.lat_seconds / a.slices, verbose=True)
                    check_answers(c, r, "latency run")
                    lat[c] += r["latencies"]
                    lat_answered[c] += r["completed"]
                    lat_lost[c] += r["lost"]
            out = {}
            for c in order:
                server, port, p, counter = started[c]
                if p is not None:
                    alive_or_fail(p, c)
                perf = None
                if a.perf and c == "egressd" and not self.perf_done:
                    perf = start_perf(p.pid, a.perf, a.limit, self.tmp / "perf.log")
                    self.perf_done = True
                tput = dnsperf(self.topo.clients[c], server, port, self.tput_file,
                               ["-c", str(a.clients), "-q", str(a.outstanding)], a.limit)
                if perf is not None:
                    perf.send_signal(signal.SIGINT)
                    perf.wait(30)
                check_answers(c, tput, "throughput run")
                if p is not None:
                    alive_or_fail(p, c)
                res = {
                    "qps": tput["qps"], "completed": tput["completed"], "lost": tput["lost"],
                    "seconds": tput["seconds"],
                    "p50_us": pct(lat[c], 50) * 1e6, "p99_us": pct(lat[c], 99) * 1e6,
                    "lat_samples": len(lat[c]), "lat_lost": lat_lost[c],
                }
                if counter is not None:
                    # One element per distinct name answered (latency and throughput names are
                    # disjoint, each name is asked once per round, one address each).
                    res["set_elements"] = counter()
                    res["names_answered"] = lat_answered[c] + tput["completed"]
                out[c] = res
            return out
        finally:
            for c, (_, _, p, _) in started.items():
                self.stop_contender(c, p)


def median_of(rounds: list[dict], key: str):
    vals = [r[key] for r in rounds if key in r]
    return statistics.median(vals) if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: fewer names, one round (< 30 s)")
    ap.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    ap.add_argument("--names", type=int, help="throughput names (default 60000, quick 10000)")
    ap.add_argument("--lat-rate", type=int, default=1000, help="latency run: queries per second")
    ap.add_argument("--lat-seconds", type=float, help="latency run: seconds per contender and round (default 2, quick 1)")
    ap.add_argument("--slices", type=int, default=4, help="latency run: alternating slices per round")
    ap.add_argument("--limit", type=float, help="throughput run: at most this many seconds (default 10, quick 5)")
    ap.add_argument("--clients", type=int, default=1, help="dnsperf -c in the throughput run")
    ap.add_argument("--outstanding", type=int, default=20,
                    help="dnsperf -q in the throughput run (keep it under dnsmasq's --dns-forward-max, 150)")
    ap.add_argument("--only", help="comma-separated contenders (default: all)")
    ap.add_argument("--perf", metavar="FILE", help="perf record -g egressd during its first throughput run")
    ap.add_argument("--json", dest="json_out", metavar="FILE")
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 5)
    a.names = a.names or (10000 if a.quick else 40000)
    a.lat_seconds = a.lat_seconds or (1.0 if a.quick else 2.0)
    a.limit = a.limit or (5.0 if a.quick else 10.0)
    # Every slice gets names enough for its share of the run, plus 10 %.
    a.lat_names = a.slices * (int(a.lat_rate * a.lat_seconds / a.slices * 1.1) + 1)
    contenders = [c.strip() for c in a.only.split(",")] if a.only else list(CONTENDERS)
    if any(c not in CONTENDERS + EXTRA_CONTENDERS for c in contenders):
        ap.error(f"--only: contenders are {', '.join(CONTENDERS + EXTRA_CONTENDERS)}")
    if a.names + a.lat_names > 131072:
        ap.error("--names: at most 131072 names in total fit 198.18.0.0/15")

    status = preflight(("dnsperf", "dnsmasq", "nft", "ip", "setpriv"),
                       need_egressd=any(c.startswith("egressd") for c in contenders),
                       more_tools=["perf"] if a.perf else [])
    if status is not None:
        return status
    if "egressd" in contenders and a.names + a.lat_names > EGRESSD_MAX_LEARNED:
        print(f"note: {a.names + a.lat_names} names > egressd's {EGRESSD_MAX_LEARNED} learned-address cap; "
              "past it, every answer makes egressd scan its whole learned map")

    run = BenchRun(PREFIX, ("egressd.log", "egressd-public.log", "nftset.log", "forward.log", "upstream.log",
                            "perf.log"))
    rounds = {c: [] for c in contenders}
    load_before = loadavg()
    t_start = time.monotonic()
    with run:
        run.topo.build(contenders)
        bench = Bench(a, run.tmp, run.topo, run.procs)
        bench.write_data()
        bench.start_upstream()
        for r in range(a.rounds):
            alive_or_fail(bench.upstream, "the upstream dnsmasq")
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for c, res in bench.run_round(order).items():
                rounds[c].append(res)
    if run.failed:
        return 1

    elapsed = time.monotonic() - t_start
    load_after = loadavg()
    summary = {}
    for c in contenders:
        summary[c] = {k: median_of(rounds[c], k) for k in ("qps", "p50_us", "p99_us")}
        for k in ("set_elements", "names_answered"):
            if rounds[c] and k in rounds[c][-1]:
                summary[c][k] = [r[k] for r in rounds[c]]
        summary[c]["lost"] = sum(r["lost"] + r["lat_lost"] for r in rounds[c])

    print(f"DNS proxy, a new address per answer: {a.names} throughput names (dnsperf -n 1 -c {a.clients} "
          f"-q {a.outstanding}), latency at {a.lat_rate} qps for {a.lat_seconds:g} s; "
          f"{a.rounds} round(s), medians")
    print(f"machine: {os.cpu_count()} cpus, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{elapsed:.0f} s")
    print(f"{'contender':<14} {'qps':>9} {'p50 µs':>8} {'p99 µs':>8}  set elements / names answered, per round")
    for c in contenders:
        s = summary[c]
        sets = ""
        if "set_elements" in s:
            sets = "  " + " ".join(f"{e}/{n}" for e, n in zip(s["set_elements"], s["names_answered"]))
        lost = f"  ({s['lost']} lost)" if s["lost"] else ""
        print(f"{c:<14} {s['qps']:>9.0f} {s['p50_us']:>8.0f} {s['p99_us']:>8.0f}{sets}{lost}")

    # Ratios are taken within each round (the contenders of a round ran seconds apart, under the
    # same background load) and the median over rounds is reported, with the range.
    per_round = {}
    if "egressd" in rounds:
        e = rounds["egressd"]
        if "nftset" in rounds:
            per_round["egressd_over_nftset_qps"] = [x["qps"] / y["qps"] for x, y in zip(e, rounds["nftset"])]
        if "forward" in rounds:
            per_round["egressd_over_forward_qps"] = [x["qps"] / y["qps"] for x, y in zip(e, rounds["forward"])]
        if "direct" in rounds:
            per_round["egressd_p50_added_us"] = [x["p50_us"] - y["p50_us"] for x, y in zip(e, rounds["direct"])]
            per_round["egressd_over_direct_qps"] = [x["qps"] / y["qps"] for x, y in zip(e, rounds["direct"])]
        if "floor" in rounds:
            per_round["egressd_over_floor_qps"] = [x["qps"] / y["qps"] for x, y in zip(e, rounds["floor"])]
    if "floor" in rounds and "direct" in rounds:
        per_round["floor_over_direct_qps"] = [x["qps"] / y["qps"] for x, y in zip(rounds["floor"], rounds["direct"])]
    ratios = {k: statistics.median(v) for k, v in per_round.items()}
    budgets = {"egressd_over_nftset_qps": (">=", 4.0), "egressd_over_forward_qps": (">=", 0.8),
               "egressd_p50_added_us": ("<=", 100.0), "egressd_over_direct_qps": (">=", 0.9)}
    labels = {"egressd_over_nftset_qps": "egressd / dnsmasq --nftset qps",
              "egressd_over_forward_qps": "egressd / dnsmasq forward qps",
              "egressd_p50_added_us": "egressd p50 over upstream direct (µs)",
              "egressd_over_direct_qps": "egressd / upstream direct qps (issue 17)",
              "egressd_over_floor_qps": "egressd / floor (udpfwd.c) qps",
              "floor_over_direct_qps": "floor / upstream direct qps"}
    for k, v in ratios.items():
        spread = f"  (rounds {min(per_round[k]):.2f} .. {max(per_round[k]):.2f})" if len(per_round[k]) > 1 else ""
        if k not in budgets:
            print(f"{labels[k]:<40} {v:>8.2f}   (no budget){spread}")
            continue
        op, b = budgets[k]
        ok = v >= b if op == ">=" else v <= b
        print(f"{labels[k]:<40} {v:>8.2f}   budget {op} {b:g}: {'within' if ok else 'MISSED'}{spread}")
    set_problems = [c for c in contenders for r in rounds[c]
                    if "set_elements" in r and abs(r["set_elements"] - r["names_answered"]) > 0.01 * r["names_answered"]]
    if set_problems:
        print(f"warning: set element count differs from names answered by > 1% for {', '.join(set_problems)}")

    write_json(a, machine={"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after},
               elapsed_s=elapsed, summary=summary, ratios=ratios, ratios_per_round=per_round,
               budgets={k: {"op": op, "value": b} for k, (op, b) in budgets.items()}, rounds=rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
