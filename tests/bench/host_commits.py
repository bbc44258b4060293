#!/usr/bin/env python3
"""What an agent's sandboxes cost every other nftables commit on the host.

The kernel hands each nftables notification, of a commit in any namespace, to a walk over
every netlink socket on the host joined to those notifications. An agent whose tamper guards
each keep such a socket in their sandbox's namespace puts N sockets in that walk; with its
event hub (`egressd agent --nft-events shared`, the default) it puts one. The commit that pays
is anyone's: the agent's own switches and learned addresses, a sidecar's, Docker's.

In one run, rounds of three sides, the order rotating: N throwaway namespaces (lo only) and a
neighbour namespace where an `egressd run` sidecar switches between two phases:

  none         no agent: the floor
  shared       `egressd agent --nft-events shared` with the N namespaces attached
  per-sandbox  `egressd agent --nft-events per-sandbox`, the same N

(agents with --verify-interval 0: nothing of theirs runs while the neighbour switches). For
each side the neighbour makes --switches named switches paced --gap-ms apart (a commit after
idle, what a harness's switch is) and as many back to back; each switch's own time is the
reply's duration_us (batch built to the kernel's ack). Prints per side the medians over
rounds of p50 and p99, and the ratios shared / per-sandbox and each over none.

Exits 0 when it ran (numbers are judged in docs/benchmarks.md), 1 when something failed, 77
with "SKIP: reason" when not root.

usage: host_commits.py [--quick] [--sandboxes N] [--rounds R] [--switches S] [--gap-ms G] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dns_proxy as dp  # noqa: E402  (BenchRun, Procs, preflight, EGRESSD, ...)
from dns_proxy import lab  # noqa: E402
from switch_latency import pct  # noqa: E402
from agent import Conn, cpu_s  # noqa: E402

PREFIX = "egbhc-"
SIDES = ("none", "shared", "per-sandbox")


def until_idle(pid: int, still_s: float = 0.4, limit_s: float = 15.0):
    """Returns once pid's CPU time (every thread) has not moved for still_s: longer than the
    agent's idle heap trim (300 ms after the last add) waits."""
    last = {"cpu": cpu_s(pid), "at": time.monotonic()}

    def still():
        c = cpu_s(pid)
        if c != last["cpu"]:
            last.update(cpu=c, at=time.monotonic())
        return time.monotonic() - last["at"] >= still_s
    lab.wait_for(still, limit_s, f"pid {pid} to go idle")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: 10 sandboxes, 1 round, 20 switches")
    ap.add_argument("--sandboxes", type=int, help="namespaces attached to the agent (default 200, quick 10)")
    ap.add_argument("--rounds", type=int, help="rounds of the three sides (default 3, quick 1)")
    ap.add_argument("--switches", type=int, help="neighbour switches per side and round, each way (default 200)")
    ap.add_argument("--gap-ms", type=float, default=10, help="pause between paced switches (default 10)")
    ap.add_argument("--json", dest="json_out", metavar="FILE")
    a = ap.parse_args()
    n = a.sandboxes or (10 if a.quick else 200)
    rounds = a.rounds or (1 if a.quick else 3)
    switches = a.switches or (20 if a.quick else 200)
    status = dp.preflight(("ip", "nft"))
    if status is not None:
        return status

    run = dp.BenchRun(PREFIX, logs=("agent.log", "neighbour.log"))
    tmp = run.tmp
    res = {s: [] for s in SIDES}
    with run:
        policy = tmp / "policy.json"
        policy.write_text(json.dumps({
            "initial_phase": "agent", "dns": {"upstream": ["192.0.2.53"]},
            "phases": {"agent": {"network_mode": "allowlist", "allowed_hosts": ["198.18.0.1", "*.bench.example"]},
                       "verifier": {"network_mode": "no-network"}}}))
        home = run.topo.add(lab.Netns(f"{run.tag}-home"))
        nb = run.topo.add(lab.Netns(f"{run.tag}-nb"))
        sbs = [run.topo.add(lab.Netns(f"{run.tag}-s{i}")) for i in range(n)]
        neighbour = dp.start_egressd(run.procs, nb, tmp, "neighbour", policy)
        nc = Conn(tmp / "neighbour.sock")

        def switch_round() -> dict:
            paced, burst = [], []
            for k in range(2 * switches):
                phase = "verifier" if k % 2 == 0 else "agent"
                t_next = time.perf_counter() + a.gap_ms / 1e3
                reply, _ = nc.call({"cmd": "apply", "phase": phase})
                if k < switches:
                    paced.append(reply["duration_us"])
                    time.sleep(max(0.0, t_next - time.perf_counter()))
                else:
                    burst.append(reply["duration_us"])
            return {"paced_p50": pct(paced, 50), "paced_p99": pct(paced, 99),
                    "burst_p50": pct(burst, 50), "burst_p99": pct(burst, 99)}

        for r in range(rounds):
            order = SIDES[r % 3:] + SIDES[:r % 3]
            for side in order:
                agent = None
                if side != "none":
                    sock = tmp / f"agent-{r}-{side}.sock"
                    agent = run.procs.spawn([dp.EGRESSD, "agent", "--socket", sock, "--nft-events", side,
                                             "--verify-interval", "0"], home, tmp / "agent.log")
                    lab.wait_for(lambda: dp.alive_or_fail(agent, "egressd agent") or sock.exists(), 30,
                                 "the agent's socket")
                    c = Conn(sock)
                    try:
                        pong, _ = c.call({"cmd": "ping"})
                        if pong.get("nft_events") != side:
                            raise dp.BenchError(f"the agent serves nftables events {pong.get('nft_events')}, "
                                                f"not {side}")
                        for i, ns in enumerate(sbs):
                            c.call({"cmd": "sandbox_add", "name": f"s{i}", "netns": ns.path, "config": str(policy)})
                    finally:
                        c.close()
                    until_idle(agent.pid)  # the adds' deferred work done
                res[side].append(switch_round())
                dp.alive_or_fail(neighbour, "the neighbour sidecar")
                if agent is not None:
                    run.procs.stop(agent)  # SIGTERM: the tables stay; the next agent adopts them
        nc.close()
    if run.failed:
        return 1

    med = {s: {k: statistics.median(x[k] for x in res[s]) for k in res[s][0]} for s in SIDES}
    print(f"nftables commits beside an agent with {n} sandboxes: a neighbour sidecar's named switch, "
          f"egressd's own time (us), medians of {rounds} round(s) of {switches} switches each way")
    print(f"{'side':14} {'paced p50':>10} {'paced p99':>10} {'b2b p50':>10} {'b2b p99':>10}")
    for s in SIDES:
        m = med[s]
        print(f"{s:14} {m['paced_p50']:10.0f} {m['paced_p99']:10.0f} {m['burst_p50']:10.0f} {m['burst_p99']:10.0f}")
    ratio = {k: med["shared"][k] / med["per-sandbox"][k] for k in med["shared"]}
    over_none = {s: {k: med[s][k] - med["none"][k] for k in med[s]} for s in ("shared", "per-sandbox")}
    print(f"shared / per-sandbox: paced p50 {ratio['paced_p50']:.3f}, paced p99 {ratio['paced_p99']:.3f}, "
          f"b2b p50 {ratio['burst_p50']:.3f}")
    for s in ("shared", "per-sandbox"):
        print(f"{s} over no agent: paced p50 {over_none[s]['paced_p50']:+.0f} us, b2b p50 "
              f"{over_none[s]['burst_p50']:+.0f} us")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"sandboxes": n, "rounds": res, "median": med,
                                                "shared_over_per_sandbox": ratio, "over_none": over_none},
                                               indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
