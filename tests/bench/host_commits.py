#!/usr/bin/env python3
"""What an agent's sandboxes cost every other nftables commit and link change on the host.

The kernel hands each nftables notification, of a commit in any namespace, to a walk over
every netlink socket on the host joined to those notifications. An agent whose tamper guards
each keep such a socket in their sandbox's namespace puts N sockets in that walk; with its
event hub (`egressd agent --events shared`, the default) it puts one. The commit that pays
is anyone's: the agent's own switches and learned addresses, a sidecar's, Docker's. Link and
route changes are walked the same way past the interface watches' rtnetlink sockets: every
link a container runtime creates, configures or deletes pays.

In one run, rounds of three sides, the order rotating: N throwaway namespaces (lo only) and a
neighbour namespace where an `egressd run` sidecar switches between two phases:

  none         no agent: the floor
  shared       `egressd agent --events shared` with the N namespaces attached
  per-sandbox  `egressd agent --events per-sandbox`, the same N

(agents with --verify-interval 0: nothing of theirs runs while the neighbour switches). For
each side the neighbour makes --switches named switches paced --gap-ms apart (a commit after
idle, what a harness's switch is) and as many back to back; each switch's own time is the
reply's duration_us (batch built to the kernel's ack). Then, in the neighbour namespace, a
helper changes a veth's MTU over rtnetlink --links times paced --gap-ms apart and as many back
to back (each change one RTM_NEWLINK notification, walked past every socket joined to link
changes on the host), timing each request to its ack. (Adding and deleting links instead is
dominated by the deletion's RCU grace periods, ~20 ms a pair.) Prints per side the medians over rounds of p50 and p99,
the link time, and the ratios shared / per-sandbox and each over none.

Exits 0 when it ran (numbers are judged in docs/benchmarks.md), 1 when something failed, 77
with "SKIP: reason" when not root.

usage: host_commits.py [--quick] [--sandboxes N] [--rounds R] [--switches S] [--gap-ms G] [--links L] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dns_proxy as dp  # noqa: E402  (BenchRun, Procs, preflight, EGRESSD, ...)
from dns_proxy import lab  # noqa: E402
from switch_latency import pct  # noqa: E402
from agent import Conn, cpu_s  # noqa: E402

PREFIX = "egbhc-"

# argv: IFNAME COUNT GAP_MS. Run inside the neighbour namespace: sets IFNAME's MTU COUNT times
# paced GAP_MS apart, then COUNT times back to back, each an RTM_NEWLINK request timed to its
# ack; prints {"paced": [us...], "burst": [us...]}.
LINK_CHANGES = r"""
import json, socket, struct, sys, time
name, count, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1e3
index = socket.if_nametoindex(name)
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
s.bind((0, 0))
def change(seq):
    body = struct.pack("=BxHiII", 0, 0, index, 0, 0) + struct.pack("=HHI", 8, 4, 1400 + seq % 2)  # IFLA_MTU
    msg = struct.pack("=IHHII", 16 + len(body), 16, 5, seq, 0) + body  # RTM_NEWLINK, REQUEST|ACK
    t0 = time.perf_counter_ns()
    s.send(msg)
    while True:
        r = s.recv(65536)
        length, kind, _, rseq, _ = struct.unpack_from("=IHHII", r)
        if kind == 2 and rseq == seq:  # NLMSG_ERROR: the ack
            err = struct.unpack_from("=i", r, 16)[0]
            if err != 0:
                raise OSError(-err, "RTM_NEWLINK")
            return (time.perf_counter_ns() - t0) / 1e3
out = {"paced": [], "burst": []}
for k in range(2 * count):
    if k < count:
        t_next = time.perf_counter() + gap
        out["paced"].append(change(k + 1))
        time.sleep(max(0.0, t_next - time.perf_counter()))
    else:
        out["burst"].append(change(k + 1))
print(json.dumps(out))
"""
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
    ap.add_argument("--links", type=int, help="link changes per side and round, each way (default 200, quick 20)")
    ap.add_argument("--json", dest="json_out", metavar="FILE")
    a = ap.parse_args()
    n = a.sandboxes or (10 if a.quick else 200)
    rounds = a.rounds or (1 if a.quick else 3)
    switches = a.switches or (20 if a.quick else 200)
    links = a.links or (20 if a.quick else 200)
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

        nb.ip("link", "add", "hc0", "type", "veth", "peer", "name", "hc1")

        def link_round() -> dict:
            """Microseconds per link change (an MTU) in the neighbour namespace, request to ack."""
            cp = subprocess.run(["ip", "netns", "exec", nb.name, sys.executable, "-c", LINK_CHANGES, "hc0",
                                 str(links), str(a.gap_ms)], text=True, capture_output=True, timeout=120)
            if cp.returncode != 0:
                raise dp.BenchError(f"link changes in the neighbour namespace: {cp.stderr.strip()}")
            r = json.loads(cp.stdout)
            return {"link_paced_p50": pct(r["paced"], 50), "link_burst_p50": pct(r["burst"], 50)}

        for r in range(rounds):
            order = SIDES[r % 3:] + SIDES[:r % 3]
            for side in order:
                agent = None
                if side != "none":
                    sock = tmp / f"agent-{r}-{side}.sock"
                    agent = run.procs.spawn([dp.EGRESSD, "agent", "--socket", sock, "--events", side,
                                             "--verify-interval", "0"], home, tmp / "agent.log")
                    lab.wait_for(lambda: dp.alive_or_fail(agent, "egressd agent") or sock.exists(), 30,
                                 "the agent's socket")
                    c = Conn(sock)
                    try:
                        pong, _ = c.call({"cmd": "ping"})
                        served = (pong.get("nft_events"), pong.get("link_events"))
                        if served != (side, side):
                            raise dp.BenchError(f"the agent serves nftables and link events {served}, not {side}")
                        for i, ns in enumerate(sbs):
                            c.call({"cmd": "sandbox_add", "name": f"s{i}", "netns": ns.path, "config": str(policy)})
                    finally:
                        c.close()
                    until_idle(agent.pid)  # the adds' deferred work done
                res[side].append(switch_round())
                res[side][-1].update(link_round())
                dp.alive_or_fail(neighbour, "the neighbour sidecar")
                if agent is not None:
                    run.procs.stop(agent)  # SIGTERM: the tables stay; the next agent adopts them
        nc.close()
    if run.failed:
        return 1

    med = {s: {k: statistics.median(x[k] for x in res[s]) for k in res[s][0]} for s in SIDES}
    print(f"nftables commits beside an agent with {n} sandboxes: a neighbour sidecar's named switch, "
          f"egressd's own time (us), medians of {rounds} round(s) of {switches} switches each way")
    print(f"{'side':14} {'paced p50':>10} {'paced p99':>10} {'b2b p50':>10} {'b2b p99':>10}   "
          f"link change: {'paced p50':>10} {'b2b p50':>10}")
    for s in SIDES:
        m = med[s]
        print(f"{s:14} {m['paced_p50']:10.0f} {m['paced_p99']:10.0f} {m['burst_p50']:10.0f} {m['burst_p99']:10.0f}   "
              f"{'':12} {m['link_paced_p50']:10.0f} {m['link_burst_p50']:10.0f}")
    ratio = {k: med["shared"][k] / med["per-sandbox"][k] for k in med["shared"]}
    over_none = {s: {k: med[s][k] - med["none"][k] for k in med[s]} for s in ("shared", "per-sandbox")}
    print(f"shared / per-sandbox: paced p50 {ratio['paced_p50']:.3f}, paced p99 {ratio['paced_p99']:.3f}, "
          f"b2b p50 {ratio['burst_p50']:.3f}; link change paced p50 {ratio['link_paced_p50']:.3f}, b2b p50 "
          f"{ratio['link_burst_p50']:.3f}")
    for s in ("shared", "per-sandbox"):
        print(f"{s} over no agent: paced p50 {over_none[s]['paced_p50']:+.0f} us, b2b p50 "
              f"{over_none[s]['burst_p50']:+.0f} us; link change paced p50 {over_none[s]['link_paced_p50']:+.0f} us, "
              f"b2b p50 {over_none[s]['link_burst_p50']:+.0f} us")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"sandboxes": n, "rounds": res, "median": med,
                                                "shared_over_per_sandbox": ratio, "over_none": over_none},
                                               indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
