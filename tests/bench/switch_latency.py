#!/usr/bin/env python3
"""Switch latency, egressd vs `nft -f`, side by side in one run (DESIGN §5).

For allowlists of each size N (N distinct set elements: addresses and /31 CIDRs of
198.18.0.0/15, the benchmarking range: no packet is sent anywhere), it measures:
  named   egressd switching between two staged named phases (request -> kernel ack, through
          the control socket, one persistent connection, no process start-up), p50/p99;
  inline  egressd applying an inline allowlist of N entries, p50/p99;
  nft -f  loading `egressd render` of the same phase with the nft CLI into an empty
          namespace (what a sidecar that shells out to nft pays), p50/p99.
Prints one table and the ratios; exits 0 (numbers are judged in docs, not here).
Defaults: sizes 100, 1000, 10000 and 100000, 200 named switches each way, 10 inline applies
and 10 nft -f loads per size (about 40 s); --quick: sizes 100 and 1000, 20 switches each way,
2 loads (a smoke test, a few seconds).

usage: switch_latency.py [--quick] [--sizes 100,1000,10000,100000] [--switches 200] [--loads 10] [--json FILE]
"""
import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EGRESSD = os.environ.get("EGRESSD", str(ROOT / "build/src/egressd"))
sys.path.insert(0, str(ROOT / "tests/integration"))
from lab import nft_loadable  # noqa: E402  (pinning's `queue num` on kernels without nft_queue)
REQUEST_MAX = 1 << 20  # the control socket's request line limit


def entries(n: int) -> list[str]:
    """n entries that are n distinct kernel set elements: 3/4 single addresses, 1/4 /31 CIDRs,
    all inside 198.18.0.0/15. No two CIDRs touch (adjacent ranges would merge into one
    interval): each sits in a block of 4 addresses whose other two are singles; the remaining
    singles follow the blocks. At most 104857 entries fit."""
    cidrs = n // 4
    singles = n - cidrs
    if singles + 2 * cidrs > 131072:
        raise ValueError(f"{n} entries do not fit 198.18.0.0/15")

    def addr(v):
        return f"198.{18 + (v >> 16)}.{(v >> 8) & 255}.{v & 255}"
    single_at = [4 * c + k for c in range(cidrs) for k in (2, 3)]
    single_at += range(4 * cidrs, 4 * cidrs + singles - len(single_at))
    out, s, c = [], 0, 0
    for i in range(n):
        if i % 4 == 3:
            out.append(addr(4 * c) + "/31")
            c += 1
        else:
            out.append(addr(single_at[s]))
            s += 1
    return out


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


class Netns:
    def __init__(self, name):
        self.name = name
        subprocess.run(["ip", "netns", "add", name], check=True)

    def delete(self):
        subprocess.run(["ip", "netns", "del", self.name], check=False)


class Ctl:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(30)
        self.s.connect(path)
        self.buf = b""

    def call(self, req) -> tuple[dict, float]:
        data = (json.dumps(req) + "\n").encode()
        t0 = time.perf_counter()
        self.s.sendall(data)
        while b"\n" not in self.buf:
            chunk = self.s.recv(65536)
            if not chunk:
                raise RuntimeError("egressd closed the socket")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        dt = time.perf_counter() - t0
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"egressd refused {req.get('phase') or req.get('mode')}: {reply}")
        return reply, dt


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)
    raise RuntimeError(f"timed out waiting for {what}")


def in_netns(name):
    """preexec_fn: join the namespace directly (ip netns exec adds its own mount work to the timing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    path = f"/run/netns/{name}"

    def enter():
        fd = os.open(path, os.O_RDONLY)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), "setns " + path)
        os.close(fd)
    return enter


def nft_load_times(ns: Netns, script: Path, loads: int) -> list[float]:
    """nft -f of the script into a namespace without the table, timed from exec to exit."""
    times = []
    for _ in range(loads):
        subprocess.run(["nft", "delete", "table", "inet", "egressd"], preexec_fn=in_netns(ns.name),
                       stderr=subprocess.DEVNULL, check=False)
        t0 = time.perf_counter()
        subprocess.run(["nft", "-f", str(script)], preexec_fn=in_netns(ns.name), check=True)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smoke test: sizes 100,1000, few switches")
    ap.add_argument("--sizes", help="allowlist sizes (default 100,1000,10000,100000; quick 100,1000)")
    ap.add_argument("--switches", type=int, help="named switches each way per size (default 200, quick 20)")
    ap.add_argument("--loads", type=int, help="inline applies and nft -f loads per size (default 10, quick 2)")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    args.sizes = args.sizes or ("100,1000" if args.quick else "100,1000,10000,100000")
    args.switches = args.switches or (20 if args.quick else 200)
    args.loads = args.loads or (2 if args.quick else 10)
    t_start = time.monotonic()
    sizes = [int(s) for s in args.sizes.split(",")]
    if os.geteuid() != 0:
        print("SKIP: needs root (network namespaces, nftables)")
        return 77

    tag = f"egb-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix="egressd-bench-"))
    results = []
    ns_d = Netns(tag + "-d")
    ns_n = Netns(tag + "-n")
    proc = None
    try:
        phases = {"idle": "public"}
        for n in sizes:
            phases[f"p{n}"] = {"network_mode": "allowlist", "allowed_hosts": entries(n)}
        policy = tmp / "policy.yaml"
        policy.write_text(json.dumps({"initial_phase": "idle", "phases": phases}))
        sock = tmp / "egressd.sock"
        ready = tmp / "ready"
        proc = subprocess.Popen([EGRESSD, "run", "--socket", str(sock), "--config", str(policy),
                                 "--netns", f"/run/netns/{ns_d.name}", "--ready-file", str(ready)],
                                stdout=subprocess.DEVNULL, stderr=open(tmp / "egressd.log", "w"))
        wait_for(ready.exists, 30, "egressd ready file")
        ctl = Ctl(str(sock))
        for n in sizes:
            named = []
            for _ in range(args.switches):
                _, dt = ctl.call({"cmd": "apply", "phase": f"p{n}"})
                named.append(dt)
                _, dt = ctl.call({"cmd": "apply", "phase": "idle"})
                named.append(dt)
            inline = []
            ents = entries(n)
            # An inline request is one line on the control socket, capped at 1 MiB
            # (docs/protocol.md): 100k entries do not fit, so that size has no inline figure.
            fits = len(json.dumps({"cmd": "apply", "mode": "allowlist", "allow": ents})) <= REQUEST_MAX
            for _ in range(args.loads if fits else 0):
                _, dt = ctl.call({"cmd": "apply", "mode": "allowlist", "allow": ents})
                inline.append(dt)
                ctl.call({"cmd": "apply", "phase": "idle"})
            # The peer loads a ruleset holding this phase alone (the daemon's render stages
            # every phase of the file, which would charge nft for the other sizes too).
            single = tmp / f"p{n}.yaml"
            single.write_text(json.dumps({"initial_phase": f"p{n}", "phases": {f"p{n}": phases[f"p{n}"]}}))
            script = tmp / f"p{n}.nft"
            script.write_text(nft_loadable(subprocess.run([EGRESSD, "render", "--config", str(single), "--phase",
                                                           f"p{n}"], check=True, capture_output=True, text=True).stdout,
                                           lambda: ns_n))
            nft = nft_load_times(ns_n, script, args.loads)
            results.append({
                "entries": n,
                "named_p50_ms": pct(named, 50) * 1e3, "named_p99_ms": pct(named, 99) * 1e3,
                "inline_p50_ms": pct(inline, 50) * 1e3 if inline else None,
                "inline_p99_ms": pct(inline, 99) * 1e3 if inline else None,
                "nft_p50_ms": pct(nft, 50) * 1e3, "nft_p99_ms": pct(nft, 99) * 1e3,
            })
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        ns_d.delete()
        ns_n.delete()

    print(f"switch latency (named: {args.switches * 2} switches; inline and nft -f: {args.loads} loads each)")
    print(f"{'entries':>8} {'named p50':>10} {'named p99':>10} {'inline p50':>11} {'nft -f p50':>11}"
          f" {'named/nft':>10} {'inline/nft':>11}")
    for r in results:
        inl = r["inline_p50_ms"]
        print(f"{r['entries']:>8} {r['named_p50_ms']:>8.3f}ms {r['named_p99_ms']:>8.3f}ms"
              + (f" {inl:>9.3f}ms" if inl is not None else f" {'> 1 MiB':>11}")
              + f" {r['nft_p50_ms']:>9.3f}ms {r['named_p99_ms'] / r['nft_p50_ms']:>10.4f}"
              + (f" {inl / r['nft_p50_ms']:>11.3f}" if inl is not None else f" {'-':>11}"))
    print("budgets (DESIGN §5): named switch p99 <= 1 ms at any size; inline 10k <= 0.25 x nft -f")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "config": {k: v for k, v in vars(args).items() if k != "json_out"},
            "machine": {"cpus": os.cpu_count(), "loadavg": Path("/proc/loadavg").read_text().split()[:3]},
            "elapsed_s": time.monotonic() - t_start,
            "budgets": {"named_p99_ms": {"op": "<=", "value": 1.0},
                        "inline_over_nft_10000": {"op": "<=", "value": 0.25}},
            "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
