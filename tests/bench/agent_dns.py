#!/usr/bin/env python3
"""Agent-mode DNS (issue 17): the aggregate qps of N sandboxes on one `egressd agent`, all asking
at once, against one `egressd run` sidecar, in the same run.

The client (--client): `dnsload` (default; tests/bench/dnsload.c, compiled here with cc -O2):
one process, one epoll loop, a UDP socket in each namespace, --outstanding queries in flight on
each, so the clients' own cost stays small and the same on both sides. `dnsperf`: one dnsperf
per namespace (-n 1 -c 1 -q 20 -t 1, tests/bench/dns_proxy.py's throughput settings), which on
a 2-core machine costs ~40 µs of CPU per answer for 50 of them against ~7 µs for one
(docs/benchmarks.md): with it, the two sides' clients are not the same load. Same upstream
and policy either way, as dns_proxy.py's throughput phase (whose helpers this imports):

    upstream namespace <ns>-up                     <ns>-agent (the agent's own namespace)
      lo 198.51.100.53/32 dnsmasq :53, <-veth->      eth0 192.0.2.2/30, route to 198.51.100.53
         authoritative for every name,  <-veth->    <ns>-sidecar (the sidecar's sandbox)
         no cache                                    eth0 192.0.2.6/30, route to 198.51.100.53
    <ns>-s0 .. <ns>-s<N-1>: the agent's sandboxes, lo only (the agent asks the upstream from
         its own namespace; each sandbox's proxy listens inside the sandbox)

  agent    `egressd agent` in <ns>-agent; every sandbox attached with sandbox_add (policy file,
           dns_port 53); a client in each sandbox -> 127.0.0.1:53, its own N_names names.
  sidecar  `egressd run --netns <ns>-sidecar --dns-port 53`; one client -> 127.0.0.1:53 over
           N x N_names names: the same total work (and the same number of set insertions) as
           all the agent's sandboxes together, so both windows last about as long.

Policy: upstream 198.51.100.53, phase `agent` allowlist ["*.bench.example"]. Every name is
unique in the run and has its own A address in 198.18.0.0/15 (answer data only, never a
destination), so every answer puts a new element in the answering sandbox's set ph_agent_d4.

The window (dnsperf): every dnsperf is started ahead and blocks opening its names file, a
FIFO; the window opens when this script opens them all for writing (all clients start
together, their exec and start-up left out) and closes when the last dnsperf has exited.
(dnsload): it opens its sockets and loads its names, says "ready" and waits for a byte on
stdin; the window opens when this script writes it and closes when dnsload prints its result. qps = answers / window (fixed work: the slowest sandbox closes the
agent's window). CPU per answered query = egressd's utime + stime (/proc/PID/stat, every
thread) over the window / answers; CPU % = egressd's CPU time / window (100 = one core);
the clients' CPU per answer (getrusage of the reaped children) is printed beside. Checked: every answer NOERROR, and each sandbox's
ph_agent_d4 holds one element per name answered (its probe included; a query dnsperf gave up on
but egressd answered late counts, so elements may lie between answered and sent).

Each round starts both fresh (the agent attaches every sandbox anew; the tables are deleted
between rounds); the order alternates between rounds; ratios are taken within each round,
medians printed. Budgets (issue 17): aggregate qps >= 1.0 x the sidecar's; CPU per answered
query <= 12 µs (both reported, not asserted). Defaults: 50 sandboxes x 1200 names, 3 rounds
(~1 min); --quick: 5 x 200, 1 round. Exits 0 when it ran (numbers are judged in docs), 1 when
something failed to run, 77 with "SKIP: reason" when not root.

Diagnostics: --perf FILE runs `perf record -g` on the agent during its first window (FILE) and
on the sidecar during its first (FILE.sidecar); perf's own cost lands in those windows, so
their numbers are not the measurement.

usage: agent_dns.py [--quick] [--sandboxes N] [--names N_names] [--rounds R] [--client dnsload|dnsperf]
                    [--outstanding Q] [--json FILE] [--perf FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dns_proxy as dp  # noqa: E402  (BenchRun, Topology, upstream, dnsperf, ...)
from agent import Conn  # noqa: E402
from dns_proxy import lab  # noqa: E402

PREFIX = "egbad-"
HERE = Path(__file__).resolve().parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """utime + stime of the children this process has waited for (the dnsperf clients)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of pid (/proc/PID/stat fields 14 and 15)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK


class Clients:
    """The names and query files: client k (a sandbox, or the sidecar last) has its names, a
    probe name, and a dnsperf file of its names."""

    def __init__(self, tmp: Path, n: int, per: int):
        self.files, self.probes = [], []
        next_addr = 0
        lines = []
        for k in range(n + 1):
            who = f"s{k}" if k < n else "side"
            count = per if k < n else n * per
            names = [f"{who}-{j:06d}.{dp.DOMAIN}" for j in range(count)]
            f = tmp / f"names-{who}.txt"
            f.write_text("".join(f"{x} A\n" for x in names))
            self.files.append(f)
            lines += [f"{dp.address(next_addr + j)} {x}\n" for j, x in enumerate(names)]
            next_addr += count
        for k in range(n + 1):
            probe = {"name": f"probe-{k}.{dp.DOMAIN}", "addr": dp.address(next_addr)}
            lines.append(f"{probe['addr']} {probe['name']}\n")
            self.probes.append(probe)
            next_addr += 1
        self.hosts = tmp / "hosts"
        self.hosts.write_text("".join(lines))
        self.last = self.probes[-1]


def measured(res: list[dict], window_s: float, cpu_s: float, clients_cpu_s: float) -> dict:
    """One window's figures from its clients' results (each with completed, sent, lost,
    seconds, qps), egressd's CPU over it and the clients'."""
    answered = sum(r["completed"] for r in res)
    return {"window_s": window_s, "answered": answered, "sent": sum(r["sent"] for r in res),
            "lost": sum(r["lost"] for r in res), "qps": answered / window_s,
            "cpu_s": cpu_s, "cpu_us_per_answer": cpu_s / answered * 1e6,
            "clients_cpu_s": clients_cpu_s, "clients_cpu_us_per_answer": clients_cpu_s / answered * 1e6,
            "client_seconds": [r["seconds"] for r in res], "client_qps_sum": sum(r["qps"] for r in res),
            "clients": res}


def window(run: dp.BenchRun, pid: int, clients: list[tuple[lab.Netns, Path]], a, what: str,
           perf_file: str | None = None) -> dict:
    """Runs one dnsperf per (namespace, names file) at once against 127.0.0.1:53 and measures
    the window from their common start to the last one's exit, and egressd pid's CPU over it.

    Each dnsperf reads its names from a FIFO and is started ahead: it execs, loads and blocks
    opening the FIFO (before it opens a socket or starts a thread). The window opens when this
    opens every FIFO for writing, so the exec and start-up of 50 dnsperf processes (~0.6 s on
    2 busy cores) are not in it."""
    ps, fifos = [], []
    for k, (ns, f) in enumerate(clients):
        fifo = run.tmp / f"fifo-{what}-{k}"
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo, 0o600)
        fifos.append(fifo)
        log = run.tmp / f"dnsperf-{what}-{k}.out"
        log.unlink(missing_ok=True)
        argv = dp.dnsperf_argv("127.0.0.1", 53, fifo, ["-c", str(a.clients), "-q", str(a.outstanding)], a.limit)
        ps.append(run.procs.spawn(argv, ns, log))
    data = [f.read_bytes() for _, f in clients]

    def held():
        for p in ps:
            dp.alive_or_fail(p, f"dnsperf ({what})")
            try:
                if (Path(f"/proc/{p.pid}/comm").read_text().strip() != "dnsperf"
                        or Path(f"/proc/{p.pid}/wchan").read_text() != "wait_for_partner"):
                    return False
            except FileNotFoundError:
                return False
        return True
    lab.wait_for(held, 60, f"{len(ps)} dnsperf to block opening their FIFO")
    perf = None
    if perf_file:
        perf = dp.start_perf(pid, perf_file, a.limit, run.tmp / "perf.log")

    def feed(fd: int, b: bytes):
        try:
            os.set_blocking(fd, True)
            view = memoryview(b)
            while view:
                view = view[os.write(fd, view[:65536]):]
        except BrokenPipeError:
            pass  # dnsperf died: its exit status says so
        finally:
            os.close(fd)
    try:
        cpu0, ccpu0, t0 = cpu_seconds(pid), children_cpu_seconds(), time.monotonic()
        fds = [os.open(f, os.O_WRONLY | os.O_NONBLOCK) for f in fifos]  # each wakes its dnsperf
        feeders = [threading.Thread(target=feed, args=(fd, b), daemon=True) for fd, b in zip(fds, data)]
        for t in feeders:
            t.start()
        for p in ps:
            p.wait(a.limit + 30)
        t1, cpu1, ccpu1 = time.monotonic(), cpu_seconds(pid), children_cpu_seconds()
        for t in feeders:
            t.join(5)
    finally:
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait(30)
    res = []
    for (ns, _), p in zip(clients, ps):
        run.procs.stop(p)
        r = dp.parse_dnsperf(p.log.read_text(errors="replace"), p.returncode, ns.name)
        dp.check_answers(f"{what} in {ns.name}", r, "throughput run")
        res.append(r)
    return measured(res, t1 - t0, cpu1 - cpu0, ccpu1 - ccpu0)


def window_dnsload(run: dp.BenchRun, pid: int, clients: list[tuple[lab.Netns, Path]], a, what: str,
                   perf_file: str | None = None) -> dict:
    """The same measurement with one dnsload process for every (namespace, names file)."""
    q = a.outstanding if what == "agent" else (a.sidecar_outstanding or a.outstanding)
    argv = [str(run.tmp / "dnsload"), "-q", str(q), "-s", "127.0.0.1", "-p", "53"]
    argv += [f"{ns.path}={f}" for ns, f in clients]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    perf = None
    try:
        ready = p.stdout.readline()
        if ready != b"ready\n":
            p.kill()
            raise dp.BenchError(f"dnsload ({what}) did not start: {ready!r} {p.stderr.read().decode(errors='replace')}")
        if perf_file:
            perf = dp.start_perf(pid, perf_file, a.limit, run.tmp / "perf.log")
        cpu0, ccpu0, t0 = cpu_seconds(pid), children_cpu_seconds(), time.monotonic()
        p.stdin.write(b"g")
        p.stdin.flush()
        line = p.stdout.readline()
        t1, cpu1 = time.monotonic(), cpu_seconds(pid)
        p.wait(a.limit + 30)
        ccpu1 = children_cpu_seconds()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait(30)
    if p.returncode != 0 or not line:
        raise dp.BenchError(f"dnsload ({what}) failed (exit {p.returncode}): {p.stderr.read().decode(errors='replace')}")
    out = json.loads(line)
    res = []
    for (ns, _), c in zip(clients, out["clients"]):
        r = dict(c)
        r["rcodes"] = {k: v for k, v in (("NOERROR", c["noerror"]), ("other", c["other_rcode"])) if v}
        r["seconds"] = out["window_s"]
        r["qps"] = c["completed"] / out["window_s"]
        dp.check_answers(f"{what} in {ns.name}", r, "throughput run")
        res.append(r)
    return measured(res, t1 - t0, cpu1 - cpu0, ccpu1 - ccpu0)


def check_sets(namespaces: list[lab.Netns], res: list[dict]) -> dict:
    """Each namespace's ph_agent_d4 against its client's answers (+1: its probe)."""
    elements, bad = [], []
    for ns, r in zip(namespaces, res):
        e = dp.set_count(ns, "inet", "egressd", "ph_agent_d4")
        elements.append(e)
        if not r["completed"] + 1 <= e <= r["sent"] + 1:
            bad.append(f"{ns.name}: {e} elements, {r['completed']} answered (+1 probe), {r['sent']} sent")
    return {"set_elements": sum(elements), "names_answered": sum(r["completed"] + 1 for r in res),
            "set_mismatches": bad}


def delete_tables(ns: lab.Netns):
    dp.nft(ns, "delete", "table", "inet", "egressd", check=False)
    dp.nft(ns, "delete", "table", "netdev", "egressd", check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: 5 sandboxes x 200 names, one round")
    ap.add_argument("--sandboxes", type=int, help="sandboxes on the agent (default 50, quick 5)")
    ap.add_argument("--names", type=int, help="names per sandbox (default 1200, quick 200); the sidecar "
                    "gets sandboxes x names")
    ap.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    ap.add_argument("--limit", type=float, default=60, help="dnsperf -l: at most this many seconds")
    ap.add_argument("--client", choices=("dnsload", "dnsperf"), default="dnsload",
                    help="dnsload: one process with a socket in each namespace (default); dnsperf: one each")
    ap.add_argument("--clients", type=int, default=1, help="dnsperf -c of every client")
    ap.add_argument("--outstanding", type=int, default=20, help="queries in flight per namespace (dnsperf -q)")
    ap.add_argument("--sidecar-outstanding", type=int, help="queries in flight at the sidecar (default: --outstanding)")
    ap.add_argument("--perf", metavar="FILE", help="perf record -g the agent during its first window (into "
                    "FILE) and the sidecar during its first (FILE.sidecar)")
    ap.add_argument("--json", dest="json_out", metavar="FILE")
    a = ap.parse_args()
    a.sandboxes = a.sandboxes or (5 if a.quick else 50)
    a.names = a.names or (200 if a.quick else 1200)
    a.rounds = a.rounds or (1 if a.quick else 3)
    n, total = a.sandboxes, a.sandboxes * a.names
    if 2 * total + n + 1 > 131072:
        ap.error("--sandboxes x --names: at most 65535 names each side fit 198.18.0.0/15")
    if total + 1 > dp.EGRESSD_MAX_LEARNED:
        ap.error(f"--sandboxes x --names: the sidecar would pass its {dp.EGRESSD_MAX_LEARNED} learned-address cap")
    status = dp.preflight(("dnsperf" if a.client == "dnsperf" else "cc", "dnsmasq", "nft", "ip", "setpriv"),
                          more_tools=["perf"] if a.perf else [])
    if status is not None:
        return status

    run = dp.BenchRun(PREFIX, logs=("agent.log", "sidecar.log", "upstream.log", "perf.log"))
    tmp = run.tmp
    rounds = {"agent": [], "sidecar": []}
    load_before, t_start = dp.loadavg(), time.monotonic()
    with run:
        if a.client == "dnsload":
            cp = subprocess.run(["cc", "-O2", "-o", str(tmp / "dnsload"), str(HERE / "dnsload.c")],
                                capture_output=True, text=True, timeout=60)
            if cp.returncode != 0:
                raise dp.BenchError(f"cc dnsload.c failed: {cp.stderr.strip()}")
        measure = window_dnsload if a.client == "dnsload" else window
        topo = run.topo
        topo.build(["agent", "sidecar"])
        home, side_ns = topo.clients["agent"], topo.clients["sidecar"]
        sbs = [topo.add(lab.Netns(f"{run.tag}-s{i}")) for i in range(n)]
        cl = Clients(tmp, n, a.names)
        upstream = dp.start_upstream(run.procs, topo.up, tmp, cl.hosts, cl.last)
        policy = tmp / "policy.json"
        policy.write_text(json.dumps({
            "initial_phase": "agent", "dns": {"upstream": [dp.UPSTREAM]},
            "phases": {"agent": {"network_mode": "allowlist", "allowed_hosts": [f"*.{dp.DOMAIN}"]}}}))
        sock = tmp / "agent.sock"
        perf_file = a.perf
        side_perf_file = f"{a.perf}.sidecar" if a.perf else None

        def agent_round():
            nonlocal perf_file
            p = run.procs.spawn([dp.EGRESSD, "agent", "--socket", sock], home, tmp / "agent.log")

            def up():
                dp.alive_or_fail(p, "egressd agent")
                try:
                    Conn(sock, 2).close()
                    return True
                except OSError:
                    return False
            lab.wait_for(up, 30, "the agent's socket")
            c = Conn(sock)
            try:
                for i, ns in enumerate(sbs):
                    c.call({"cmd": "sandbox_add", "name": f"s{i}", "netns": ns.path, "config": str(policy),
                            "dns_port": 53})
                for i, ns in enumerate(sbs):
                    dp.wait_answer(ns, "127.0.0.1", 53, cl.probes[i], f"the agent in s{i}", p)
                w = measure(run, p.pid, list(zip(sbs, cl.files[:n])), a, "agent", perf_file)
                perf_file = None
                dp.alive_or_fail(p, "egressd agent")
                w.update(check_sets(sbs, w["clients"]))
                for i in range(n):
                    c.call({"cmd": "sandbox_remove", "name": f"s{i}", "remove_policy": True})
            finally:
                c.close()
                run.procs.stop(p)
            for ns in sbs:  # in case a remove did not happen
                delete_tables(ns)
            return w

        def sidecar_round():
            nonlocal side_perf_file
            delete_tables(side_ns)
            (tmp / "sidecar.ready").unlink(missing_ok=True)
            p = dp.start_egressd(run.procs, side_ns, tmp, "sidecar", policy, 10, extra=["--dns-port", "53"])
            try:
                dp.wait_answer(side_ns, "127.0.0.1", 53, cl.probes[n], "the sidecar", p)
                w = measure(run, p.pid, [(side_ns, cl.files[n])], a, "sidecar", side_perf_file)
                dp.alive_or_fail(p, "the sidecar")
                w.update(check_sets([side_ns], w["clients"]))
            finally:
                run.procs.stop(p)
            side_perf_file = None
            delete_tables(side_ns)
            return w

        for r in range(a.rounds):
            dp.alive_or_fail(upstream, "the upstream dnsmasq")
            order = ["agent", "sidecar"] if r % 2 == 0 else ["sidecar", "agent"]
            for side in order:
                w = agent_round() if side == "agent" else sidecar_round()
                w["order"] = order.index(side)
                rounds[side].append(w)
    if run.failed:
        return 1

    elapsed, load_after = time.monotonic() - t_start, dp.loadavg()
    ag, sc = rounds["agent"], rounds["sidecar"]
    per_round = {"qps_ratio": [x["qps"] / y["qps"] for x, y in zip(ag, sc)],
                 "cpu_ratio": [x["cpu_us_per_answer"] / y["cpu_us_per_answer"] for x, y in zip(ag, sc)]}
    med = lambda side, k: statistics.median(w[k] for w in rounds[side])  # noqa: E731
    summary = {side: {k: med(side, k) for k in ("qps", "cpu_us_per_answer", "window_s", "client_qps_sum",
                                                 "clients_cpu_us_per_answer")}
               for side in rounds}
    ratios = {k: statistics.median(v) for k, v in per_round.items()}
    sets_ok = not any(w["set_mismatches"] for side in rounds for w in rounds[side])
    for w in ag + sc:
        for c in w["clients"]:
            c.pop("latencies", None)

    client = (f"one dnsload, {a.outstanding} in flight per namespace" if a.client == "dnsload" else
              f"dnsperf -n 1 -c {a.clients} -q {a.outstanding} per namespace")
    print(f"agent-mode DNS ({client}): {n} sandboxes on one agent, each asking "
          f"{a.names} unique names at once, against one sidecar asked {total}; a new address per "
          f"answer; {a.rounds} round(s), medians")
    print(f"machine: {os.cpu_count()} cpus, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{elapsed:.0f} s")
    print(f"{'':22} {'qps':>9} {'CPU µs/answer':>14} {'CPU %':>6} {'client µs/answer':>18} {'window s':>9} "
          f"{'client s min..max':>18}  set elements / names answered, per round")
    for side, label in (("agent", f"agent, {n} sandboxes"), ("sidecar", "one sidecar")):
        s = summary[side]
        cs = [x for w in rounds[side] for x in w["client_seconds"]]
        sets = " ".join(f"{w['set_elements']}/{w['names_answered']}" for w in rounds[side])
        lost = sum(w["lost"] for w in rounds[side])
        busy = statistics.median(w["cpu_s"] / w["window_s"] * 100 for w in rounds[side])
        print(f"{label:22} {s['qps']:>9.0f} {s['cpu_us_per_answer']:>14.1f} {busy:>6.0f} "
              f"{s['clients_cpu_us_per_answer']:>18.1f} {s['window_s']:>9.2f} "
              f"{min(cs):>8.2f}..{max(cs):<8.2f}  {sets}{f'  ({lost} lost)' if lost else ''}")
    q, c = ratios["qps_ratio"], ratios["cpu_ratio"]
    spread = lambda k: (f"  (rounds {min(per_round[k]):.2f} .. {max(per_round[k]):.2f})"  # noqa: E731
                        if len(per_round[k]) > 1 else "")
    print(f"{'agent aggregate / sidecar qps':40} {q:>8.3f}   budget >= 1.0: {'within' if q >= 1 else 'MISSED'}"
          f"{spread('qps_ratio')}")
    print(f"{'agent / sidecar CPU per answer':40} {c:>8.3f}{spread('cpu_ratio')}")
    for side in ("agent", "sidecar"):
        v = summary[side]["cpu_us_per_answer"]
        print(f"{side + ' CPU per answered query (µs)':40} {v:>8.1f}   budget <= 12: {'within' if v <= 12 else 'MISSED'}")
    for side in rounds:
        for w in rounds[side]:
            for m in w["set_mismatches"]:
                print(f"warning: {side}: set element count differs from names answered: {m}")

    dp.write_json(a, machine={"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after},
                  elapsed_s=elapsed, sandboxes=n, names_per_sandbox=a.names, summary=summary, ratios=ratios,
                  ratios_per_round=per_round, sets_ok=sets_ok,
                  budgets={"qps_ratio": {"op": ">=", "value": 1.0}, "cpu_us_per_answer": {"op": "<=", "value": 12.0}},
                  rounds=rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
