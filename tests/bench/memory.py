#!/usr/bin/env python3
"""Memory: egressd's resident set, idle and after learning, beside nft -f's peak (DESIGN §5).

Every egressd here is a fresh process in a throwaway namespace (no table to adopt), reading a
policy with one phase, so nothing else is staged:
  idle-1k      an allowlist of 1000 literal entries (3/4 addresses, 1/4 /31 CIDRs of
               198.18.0.0/15, the benchmarking range);
  idle-100k    the same with 100000 entries;
  learned      allowlist ["*.bench.example"] with an upstream dnsmasq (tests/bench/dns_proxy.py's
               topology) authoritative for N names, each with its own address in
               198.18.0.0/15; dnsperf asks every name once (-q 20), so egressd learns N
               addresses (it remembers at most 65536 of them; the kernel set takes every one).
VmRSS (resident now) and VmHWM (peak) are read from /proc/<pid>/status once the ready file
exists, a status request over the control socket has been answered (learned: after dnsperf
finished and the set holds an element per name answered) and VmRSS has then held still for
1 s (idle: egressd hands the heap a policy install freed back to the kernel once idle).
Beside them: the peak RSS (getrusage ru_maxrss, through /usr/bin/time -f %M) of `nft -f` loading
`egressd render` of the same 1k and 100k phases into an empty namespace: what a sidecar that
shells out to nft needs for the same work.

Defaults: idle with 1000 and 100000 entries, N = 100000 learned names; --quick: 1000 and
10000 entries, 2000 names (a smoke test). Exits 0 when it ran (numbers are judged
in docs), 1 when something failed to run, 77 with "SKIP: reason" when not root.

usage: memory.py [--quick] [--sizes 1000,100000] [--names N] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dns_proxy as dp  # noqa: E402  (BenchRun, preflight, start_egressd, Bench, dnsperf, ...)
from dns_proxy import lab  # noqa: E402
from switch_latency import entries  # noqa: E402

PREFIX = "egbmem-"
BUDGET_IDLE_1K_KIB = 8 * 1024


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of pid, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0])
    return out


def status_request(sock: Path):
    """One status request answered: the daemon is past start-up and serving."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(b'{"cmd":"status"}\n')
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise dp.BenchError("egressd closed the control socket")
            buf += chunk
        if not json.loads(buf.split(b"\n", 1)[0]).get("ok"):
            raise dp.BenchError(f"egressd status failed: {buf[:200]!r}")


def settled_status(pid: int, still_s: float = 1.0, deadline_s: float = 10.0) -> dict[str, int]:
    """/proc status once VmRSS has not changed for still_s (sampled every 0.1 s), or at the
    deadline (then the last sample: a daemon that never settles is measured as it is)."""
    end = time.monotonic() + deadline_s
    st = proc_status(pid)
    since = time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.1)  # sampling interval, not synchronisation
        now = proc_status(pid)
        if now["VmRSS"] != st["VmRSS"]:
            since = time.monotonic()
        st = now
        if time.monotonic() - since >= still_s:
            break
    return st


def nft_peak_kib(ns: lab.Netns, script: Path) -> int:
    """Peak RSS of `nft -f script` in ns (an empty table first). /usr/bin/time forks nft from a
    small process, so the figure is nft's own and not this interpreter's."""
    dp.nft(ns, "delete", "table", "inet", "egressd", check=False)
    cp = lab.run(["/usr/bin/time", "-f", "maxrss=%M", "ip", "netns", "exec", ns.name, "nft", "-f", script],
                 timeout=120)
    dp.nft(ns, "delete", "table", "inet", "egressd", check=False)
    for line in cp.stderr.splitlines():
        if line.startswith("maxrss="):
            return int(line.split("=")[1])
    raise dp.BenchError(f"/usr/bin/time printed no maxrss: {cp.stderr.strip()}")


def idle_run(ns: lab.Netns, tmp: Path, procs: dp.Procs, n: int) -> dict:
    name = f"idle{n}"
    policy = tmp / f"{name}.json"
    policy.write_text(json.dumps({"initial_phase": "p", "dns": {"upstream": [dp.UPSTREAM]},
                                  "phases": {"p": {"network_mode": "allowlist", "allowed_hosts": entries(n)}}}))
    dp.nft(ns, "delete", "table", "inet", "egressd", check=False)
    p = dp.start_egressd(procs, ns, tmp, name, policy)
    status_request(tmp / f"{name}.sock")
    st = settled_status(p.pid)
    procs.stop(p)
    # The peer: nft -f of the same phase, rendered by egressd.
    script = tmp / f"{name}.nft"
    script.write_text(lab.nft_loadable(lab.run([dp.EGRESSD, "render", "--config", policy, "--phase", "p"],
                                               timeout=60).stdout, lambda: ns))
    dp.nft(ns, "delete", "table", "inet", "egressd", check=False)
    return {"entries": n, "rss_kib": st["VmRSS"], "hwm_kib": st["VmHWM"], "nft_peak_kib": nft_peak_kib(ns, script)}


def learned_run(topo: dp.Topology, tmp: Path, procs: dp.Procs, names: int) -> dict:
    # dns_proxy's Bench: the hosts file, the upstream dnsmasq and egressd (allowlist
    # *.bench.example, set ph_agent_d4), exactly as its throughput run uses them.
    args = types.SimpleNamespace(slices=1, lat_names=1, names=names)
    bench = dp.Bench(args, tmp, topo, procs)
    bench.write_data()
    bench.start_upstream()
    ns = topo.clients["egressd"]
    server, port, p, counter = bench.start_contender("egressd")
    try:
        before = proc_status(p.pid)
        r = dp.dnsperf(ns, server, port, bench.tput_file, ["-c", "1", "-q", "20"], 120)
        dp.check_answers("egressd", r, "learning run")
        dp.alive_or_fail(p, "egressd")
        status_request(tmp / "egressd.sock")
        st = settled_status(p.pid)
        elements = counter()
    finally:
        bench.stop_contender("egressd", p)
    return {"names": names, "answered": r["completed"], "set_elements": elements, "qps": r["qps"],
            "rss_before_kib": before["VmRSS"], "rss_kib": st["VmRSS"], "hwm_kib": st["VmHWM"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: sizes 1000,10000, 2000 learned names")
    ap.add_argument("--sizes", help="idle allowlist sizes (default 1000,100000; quick 1000,10000)")
    ap.add_argument("--names", type=int, help="learned names (default 100000, quick 2000)")
    ap.add_argument("--json", dest="json_out", metavar="FILE")
    a = ap.parse_args()
    a.names = a.names or (2000 if a.quick else 100000)
    a.sizes = [int(x) for x in (a.sizes or ("1000,10000" if a.quick else "1000,100000")).split(",")]
    if a.names + 1 > 131072:
        ap.error("--names: at most 131071 names fit 198.18.0.0/15")
    status = dp.preflight(("dnsperf", "dnsmasq", "nft", "ip", "setpriv", "/usr/bin/time"))
    if status is not None:
        return status

    run = dp.BenchRun(PREFIX, [f"idle{n}.log" for n in a.sizes] + ["egressd.log", "upstream.log"])
    idle, learned = [], None
    t_start = time.monotonic()
    with run:
        run.topo.build(["egressd"])
        ns = run.topo.clients["egressd"]
        for n in a.sizes:
            idle.append(idle_run(ns, run.tmp, run.procs, n))
        learned = learned_run(run.topo, run.tmp, run.procs, a.names)
    if run.failed:
        return 1

    elapsed = time.monotonic() - t_start
    mib = lambda k: k / 1024  # noqa: E731
    print(f"memory (MiB): egressd VmRSS / VmHWM, and the peak RSS of nft -f of the same phase; {elapsed:.0f} s")
    print(f"{'case':<22} {'egressd RSS':>12} {'peak':>8} {'nft -f peak':>12}")
    for r in idle:
        print(f"{'idle, %d entries' % r['entries']:<22} {mib(r['rss_kib']):>12.2f} {mib(r['hwm_kib']):>8.2f}"
              f" {mib(r['nft_peak_kib']):>12.2f}")
    print(f"{'learned %d names' % learned['names']:<22} {mib(learned['rss_kib']):>12.2f} {mib(learned['hwm_kib']):>8.2f}"
          f" {'':>12}  (set {learned['set_elements']}/{learned['answered']} answered)")
    ok = idle[0]["entries"] == 1000 and idle[0]["rss_kib"] <= BUDGET_IDLE_1K_KIB
    print(f"budget (DESIGN §5): RSS <= 8 MiB idle with 1k entries: {'within' if ok else 'MISSED'}")
    dp.write_json(a, elapsed_s=elapsed, idle=idle, learned=learned,
                  budget={"idle_1k_rss_kib": {"op": "<=", "value": BUDGET_IDLE_1K_KIB}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
