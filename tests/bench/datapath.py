#!/usr/bin/env python3
"""Datapath throughput, no rules vs egressd holding 100k set elements, side by side (DESIGN §5).

    server namespace  <tag>-up                     three client namespaces, <tag>-norules,
      lo  198.51.100.53/32  iperf3 -s :5201  <-veth->  -conntrack, -egressd, each eth0 192.0.2.(4k+2)/30,
          203.0.113.10/32   (a denied address)         routes to the two server addresses only
                                                     (no default route, no host-namespace veth)

  norules  no nftables table at all in the client namespace
  conntrack  the floor of any stateful design, for comparison: a table with a filter and a nat
           output chain that tracks every flow and accepts on a conntrack mark
           (`ct mark 0x1 accept; ct mark set 0x1 accept`), no sets
  egressd  egressd run --netns <tag>-egressd, phase `big`: an allowlist of N literal entries
           (3/4 single addresses, 1/4 /31 CIDRs of 198.18.0.0/15, the benchmarking range,
           plus 198.51.100.53, the iperf3 server), so the kernel holds N set elements

iperf3 -c 198.51.100.53 -t S from each client namespace in turn, TCP and then UDP (-u -b 0,
no rate limit: the sender goes as fast as the path lets it), rounds that alternate the order of
the sides (a change in background load hits them alike). Throughput: TCP, what the
receiver got (sum_received); UDP, what the sender pushed through the kernel (the output hook
where the rules are, the veth and the receiving stack up to the socket run in the sending
thread's context), because at -b 0 the receiving iperf3 process, not the datapath, bounds what
arrives (the goodput and the loss are kept in the JSON). The ratio egressd / norules is taken
within each round; the median over rounds is reported with its range.

Before measuring, the egressd side is checked to enforce: 203.0.113.10 (routed like the server,
not on the allowlist) must be rejected from it and reachable from the norules side.

Defaults: N = 100000, 5 rounds of 2 s per side and protocol (about 50 s); --quick: 1000
entries, 1 round of 1 s (a smoke test, about 8 s). iperf3 takes whole seconds. Exits 0 when it ran (numbers are judged in docs), 1 when something failed
to run, 77 with "SKIP: reason" when not root.

usage: datapath.py [--quick] [--rounds R] [--seconds S] [--entries N] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dns_proxy as dp  # noqa: E402  (BenchRun, preflight, start_egressd, BenchError, ...)
from dns_proxy import lab  # noqa: E402
from switch_latency import entries  # noqa: E402

PREFIX = "egbdp-"
SERVER = dp.UPSTREAM  # 198.51.100.53 on the server namespace's lo
DENIED = "203.0.113.10"
PORT = 5201
SIDES = ("norules", "conntrack", "egressd")
CONNTRACK_TABLE = """table inet ctonly {
  chain output { type filter hook output priority filter; policy accept; ct mark 0x1 accept; ct mark set 0x1 accept; }
  chain nat { type nat hook output priority -101; policy accept; }
}
"""
BUDGET = 0.97


def iperf3(ns: lab.Netns, udp: bool, seconds: int) -> dict:
    argv = ["iperf3", "-c", SERVER, "-p", str(PORT), "-t", str(seconds), "-J"]
    if udp:
        argv += ["-u", "-b", "0"]
    try:
        cp = ns.exec(*argv, timeout=seconds + 20, check=False)
    except lab.LabError as e:
        raise dp.BenchError(str(e)) from None
    try:
        out = json.loads(cp.stdout)
    except json.JSONDecodeError:
        raise dp.BenchError(f"iperf3 in {ns.name} printed no JSON ({cp.returncode}): {cp.stderr.strip()}") from None
    if cp.returncode != 0 or "error" in out:
        raise dp.BenchError(f"iperf3 in {ns.name} failed ({cp.returncode}): {out.get('error') or cp.stderr.strip()}")
    end = out["end"]
    if udp:
        s = end["sum"]
        sent = s["bits_per_second"]
        lost = s.get("lost_percent", 0.0) / 100.0
        return {"bps": sent, "goodput_bps": sent * (1.0 - lost), "lost_percent": lost * 100.0}
    return {"bps": end["sum_received"]["bits_per_second"], "sent_bps": end["sum_sent"]["bits_per_second"],
            "retransmits": end["sum_sent"].get("retransmits", 0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: 1000 entries, 1 round of 1 s")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, quick 1)")
    ap.add_argument("--seconds", type=int, help="iperf3 -t (whole seconds) per side, protocol and round (default 2, quick 1)")
    ap.add_argument("--entries", type=int, help="allowlist entries egressd holds (default 100000, quick 1000)")
    ap.add_argument("--json", dest="json_out", metavar="FILE")
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 5)
    a.entries = a.entries or (1000 if a.quick else 100000)
    a.seconds = a.seconds or (1 if a.quick else 2)

    status = dp.preflight(("iperf3", "nft", "ip", "setpriv"))
    if status is not None:
        return status

    run = dp.BenchRun(PREFIX, ("egressd.log", "iperf3.log", "socat.log"))
    tmp, topo, procs = run.tmp, run.topo, run.procs
    rounds = []
    load_before = dp.loadavg()
    t_start = time.monotonic()
    with run:
        topo.build(SIDES)
        topo.up.ip("addr", "add", f"{DENIED}/32", "dev", "lo")
        for k, name in enumerate(SIDES):
            topo.clients[name].ip("route", "add", f"{DENIED}/32", "via", f"192.0.2.{4 * k + 1}")
        # A plain TCP listener on the denied address answers the enforcement check.
        procs.spawn(["socat", f"TCP-LISTEN:80,bind={DENIED},reuseaddr,fork", "EXEC:/bin/cat"], topo.up,
                    tmp / "socat.log")
        server = procs.spawn(["iperf3", "-s", "-B", SERVER, "-p", str(PORT)], topo.up, tmp / "iperf3.log")
        listening = lambda port, addr: f"{addr}:{port}" in topo.up.exec("ss", "-Hltn").stdout  # noqa: E731
        lab.wait_for(lambda: dp.alive_or_fail(server, "iperf3 -s") or
                     (listening(PORT, SERVER) and listening(80, DENIED)), 10, "iperf3 -s and the denied listener")

        dp.nft(topo.clients["conntrack"], "-f", "-", input=CONNTRACK_TABLE)
        ns = topo.clients["egressd"]
        policy = tmp / "policy.json"
        policy.write_text(json.dumps({
            "initial_phase": "big", "dns": {"upstream": [SERVER]},
            "phases": {"big": {"network_mode": "allowlist", "allowed_hosts": entries(a.entries - 1) + [SERVER]}}}))
        t0 = time.monotonic()
        eg = dp.start_egressd(procs, ns, tmp, "egressd", policy)
        ready_s = time.monotonic() - t0

        # The rules are in force: the denied address is rejected from the egressd side only.
        for side in SIDES:
            got = topo.clients[side].tcp_connect(DENIED, 80, timeout=2.0)
            want_ok = side != "egressd"
            if (got == "ok") != want_ok:
                raise dp.BenchError(f"{side}: tcp to {DENIED}:80 gave {got!r}, expected "
                                    f"{'ok' if want_ok else 'a rejection'}")
        elements = 0
        for s in ("ph_big_a4", "ph_big_n4"):
            elements += dp.set_count(ns, "inet", "egressd", s)

        for r in range(a.rounds):
            res = {}
            for proto in ("tcp", "udp"):
                k = (r + (proto == "udp")) % len(SIDES)
                order = SIDES[k:] + SIDES[:k]
                for side in order:
                    dp.alive_or_fail(eg, "egressd")
                    res[f"{side}_{proto}"] = iperf3(topo.clients[side], proto == "udp", a.seconds)
            rounds.append(res)
    if run.failed:
        return 1

    elapsed = time.monotonic() - t_start
    summary, ratios, per_round = {}, {}, {}
    for proto in ("tcp", "udp"):
        for side in SIDES:
            summary[f"{side}_{proto}_gbps"] = statistics.median(r[f"{side}_{proto}"]["bps"] for r in rounds) / 1e9
        per_round[proto] = [r[f"egressd_{proto}"]["bps"] / r[f"norules_{proto}"]["bps"] for r in rounds]
        ratios[proto] = statistics.median(per_round[proto])
        per_round[f"{proto}_conntrack"] = [r[f"conntrack_{proto}"]["bps"] / r[f"norules_{proto}"]["bps"] for r in rounds]
        ratios[f"{proto}_conntrack"] = statistics.median(per_round[f"{proto}_conntrack"])

    print(f"datapath: iperf3 {a.rounds} round(s) x {a.seconds:g} s per side and protocol; egressd holds "
          f"{elements} set elements ({a.entries} entries, ready in {ready_s:.2f} s)")
    print(f"machine: {os.cpu_count()} cpus, load average {load_before[0]:.2f} before, {dp.loadavg()[0]:.2f} after; "
          f"{elapsed:.0f} s")
    print(f"{'proto':<6} {'no rules':>12} {'egressd':>12} {'ratio':>7}   (conntrack floor: Gb/s, ratio to no rules)")
    for proto in ("tcp", "udp"):
        spread = (f"  (rounds {min(per_round[proto]):.3f} .. {max(per_round[proto]):.3f})"
                  if len(per_round[proto]) > 1 else "")
        ok = "within" if ratios[proto] >= BUDGET else "MISSED"
        print(f"{proto:<6} {summary[f'norules_{proto}_gbps']:>8.2f} Gb/s {summary[f'egressd_{proto}_gbps']:>7.2f} Gb/s"
              f" {ratios[proto]:>7.3f}   budget >= {BUDGET:g}: {ok}{spread}"
              f"   ({summary[f'conntrack_{proto}_gbps']:.2f} Gb/s, {ratios[f'{proto}_conntrack']:.3f})")
    dp.write_json(a, machine={"cpus": os.cpu_count(), "loadavg_before": load_before},
                  elapsed_s=elapsed, set_elements=elements, ready_s=ready_s,
                  summary=summary, ratios=ratios, ratios_per_round=per_round,
                  budget={"op": ">=", "value": BUDGET}, rounds=rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
