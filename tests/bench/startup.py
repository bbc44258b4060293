#!/usr/bin/env python3
"""Start-up: exec to ready file, and exec to the first successful apply (DESIGN §5).

N fresh starts of `egressd run --netns <ns> --config policy --ready-file F` into a throwaway
namespace with no table (each start installs the policy; nothing is adopted). The policy is a
typical harness file: environment (public), agent (an allowlist of --entries literal entries:
3/4 addresses, 1/4 /31 CIDRs of 198.18.0.0/15, the benchmarking range, plus a wildcard, so no
name is pre-resolved) and verifier (no-network); every phase is staged at start.
From the moment before exec, this process polls (about every 0.2 ms) for
  ready   the ready file exists (the initial phase is in the kernel);
  apply   a request {"cmd":"apply","phase":"agent"} on a fresh connection to the control
          socket got {"ok":true} (connection attempts start at exec and repeat until one is
          accepted, so this is the first moment an orchestrator could switch).
Also egressd's own startup_us from its ready log line (installing the initial policy ->
ready: the exec, the loader, reading the policy and probing the kernel come before it).
Beside them, the peer: `nft -f` of `egressd render` of the initial phase (the same ruleset
with every phase staged) into the empty namespace, timed from exec to exit, N times.
p50/p99 over N starts. Defaults: N = 30; --quick: 3.

Exits 0 when it ran (numbers are judged in docs), 1 when something failed to run, 77 with
"SKIP: reason" when not root.

usage: startup.py [--quick] [--starts N] [--entries E] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dns_proxy as dp  # noqa: E402  (BenchRun, preflight, nft, ...)
from dns_proxy import lab  # noqa: E402
from switch_latency import entries, in_netns, pct  # noqa: E402

PREFIX = "egbst-"
BUDGET_READY_MS = 50.0
POLL_S = 0.0002
APPLY = b'{"cmd":"apply","phase":"agent"}\n'


def try_apply(sock: Path):
    """True once an apply on a fresh connection was acknowledged; False while the socket is not
    there or not accepting yet."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        s.settimeout(10)
        s.sendall(APPLY)
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                return False
            buf += chunk
    reply = json.loads(buf.split(b"\n", 1)[0])
    if not reply.get("ok"):
        raise dp.BenchError(f"apply refused: {reply}")
    return True


def one_start(ns: lab.Netns, tmp: Path, policy: Path, i: int) -> tuple[float, float]:
    ready, sock = tmp / f"ready{i}", tmp / f"egressd{i}.sock"
    log = open(tmp / "egressd.log", "ab")
    argv = [str(dp.EGRESSD), "run", "--netns", ns.path, "--socket", str(sock), "--config", str(policy),
            "--ready-file", str(ready)]
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    t_ready = t_apply = None
    deadline = time.monotonic() + 10
    try:
        while t_ready is None or t_apply is None:
            if t_ready is None and ready.exists():
                t_ready = time.perf_counter() - t0
            if t_apply is None and try_apply(sock):
                t_apply = time.perf_counter() - t0
            if p.poll() is not None:
                raise dp.BenchError(f"egressd exited with {p.returncode}:\n{dp.tail(tmp / 'egressd.log')}")
            if time.monotonic() > deadline:
                raise dp.BenchError("egressd: no ready file or no apply within 10 s")
            time.sleep(POLL_S)
    finally:
        dp.stop_process(p, 5)
        log.close()
        dp.nft(ns, "delete", "table", "inet", "egressd", check=False)
        for f in (ready, sock, Path(str(sock) + ".state")):
            f.unlink(missing_ok=True)
    return t_ready, t_apply


def nft_time(ns: lab.Netns, script: Path) -> float:
    dp.nft(ns, "delete", "table", "inet", "egressd", check=False)
    t0 = time.perf_counter()
    subprocess.run(["nft", "-f", str(script)], preexec_fn=in_netns(ns.name), check=True)
    dt = time.perf_counter() - t0
    dp.nft(ns, "delete", "table", "inet", "egressd", check=False)
    return dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: 3 starts")
    ap.add_argument("--starts", type=int, help="starts (default 30, quick 3)")
    ap.add_argument("--entries", type=int, default=20, help="literal entries of the agent phase")
    ap.add_argument("--json", dest="json_out", metavar="FILE")
    a = ap.parse_args()
    a.starts = a.starts or (3 if a.quick else 30)
    status = dp.preflight(("nft", "ip"))
    if status is not None:
        return status

    run = dp.BenchRun(PREFIX)
    tmp = run.tmp
    ready, apply, nft, own = [], [], [], []
    with run:
        ns = run.topo.add(lab.Netns(f"{run.tag}-sb"))
        policy = tmp / "policy.json"
        policy.write_text(json.dumps({
            "initial_phase": "environment", "dns": {"upstream": [dp.UPSTREAM]},
            "phases": {"environment": "public",
                       "agent": {"network_mode": "allowlist", "allowed_hosts": entries(a.entries) + ["*.bench.example"]},
                       "verifier": {"network_mode": "no-network"}}}))
        script = tmp / "environment.nft"
        script.write_text(lab.nft_loadable(
            lab.run([dp.EGRESSD, "render", "--config", policy, "--phase", "environment"]).stdout, lambda: ns))
        # Alternate: egressd start, nft -f, so both see the same background load.
        for i in range(a.starts):
            r, ap_ = one_start(ns, tmp, policy, i)
            ready.append(r)
            apply.append(ap_)
            nft.append(nft_time(ns, script))
        # egressd's startup_us (its `ready` log line): from installing the initial policy
        # to ready, i.e. without exec, the loader, reading the policy and joining the netns.
        own = [int(x) / 1e6 for x in re.findall(r"startup_us=(\d+)", (tmp / "egressd.log").read_text())]
    if run.failed:
        return 1

    res = {k: {"p50_ms": pct(v, 50) * 1e3, "p99_ms": pct(v, 99) * 1e3, "samples_ms": [x * 1e3 for x in v]}
           for k, v in (("ready", ready), ("apply", apply), ("nft", nft), ("own", own)) if v}
    print(f"start-up: {a.starts} fresh starts, policy of 3 phases ({a.entries + 1} allowlist entries)")
    print(f"{'':<28} {'p50':>9} {'p99':>9}")
    for k, label in (("ready", "egressd exec -> ready file"), ("apply", "egressd exec -> first apply"),
                     ("own", "of which install -> ready"), ("nft", "nft -f of the same ruleset")):
        if k in res:
            print(f"{label:<28} {res[k]['p50_ms']:>7.2f}ms {res[k]['p99_ms']:>7.2f}ms")
    ok = res["ready"]["p99_ms"] <= BUDGET_READY_MS
    print(f"budget (DESIGN §5): start to ready <= {BUDGET_READY_MS:g} ms: {'within' if ok else 'MISSED'} (p99)")
    dp.write_json(a, **res, budget={"ready_ms": {"op": "<=", "value": BUDGET_READY_MS}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
