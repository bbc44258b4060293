#!/usr/bin/env python3
"""Runs every benchmark of tests/bench, prints one table against the budgets of DESIGN §5,
writes <out>/results.json and plots <out>/*.png with gnuplot. `scripts/bench` calls this.

Each benchmark runs as its own process (its namespaces and processes are its own to clean up),
one after the other, with --json into <out>/<name>.json and its output in <out>/<name>.txt.
Exit status: 0 when every benchmark ran (a budget miss is a verdict for the docs, printed as
"miss", not a failure), 1 when one failed to run, 77 when not root.

usage: run_all.py [--quick] [--out DIR] [--only switch_latency,dns_proxy,...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# name, full arguments, quick arguments, time limit (s) of the full run. The quick arguments
# keep the whole --quick run under 30 s: it is a smoke test that every benchmark runs.
BENCHES = [
    ("switch_latency", ["--loads", "6"], ["--quick"], 150),
    ("dns_proxy", ["--rounds", "3"], ["--quick", "--names", "1000", "--lat-seconds", "0.2", "--limit", "2"], 200),
    ("datapath", ["--rounds", "4"], ["--quick"], 150),
    ("memory", [], ["--quick"], 150),
    ("startup", [], ["--quick"], 60),
    ("agent", [], ["--quick"], 180),
    ("agent_dns", [], ["--quick"], 180),
    ("host_commits", [], ["--quick"], 120),
    ("pinning", [], ["--quick"], 150),
]


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "kernel": platform.release(), "cpu": cpu,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


# --- rows of the table -------------------------------------------------------------------------
# A row: metric, egressd value, peer (name and value), ratio, budget text, verdict
# ("pass", "miss" or "" when there is no budget), with the numbers kept for the JSON.


def row(metric, egressd, unit, peer_name=None, peer=None, ratio=None, budget="", verdict=""):
    return {"metric": metric, "egressd": egressd, "unit": unit, "peer_name": peer_name, "peer": peer,
            "ratio": ratio, "budget": budget, "verdict": verdict}


def verdict(ok: bool) -> str:
    return "pass" if ok else "miss"


def rows_switch(d):
    out = []
    for r in d["results"]:
        n = r["entries"]
        out.append(row(f"named switch p99, {n} entries", r["named_p99_ms"], "ms", "nft -f p50", r["nft_p50_ms"],
                       r["named_p99_ms"] / r["nft_p50_ms"], "p99 <= 1 ms", verdict(r["named_p99_ms"] <= 1.0)))
    for r in d["results"]:
        n = r["entries"]
        if r["inline_p50_ms"] is None:  # the request would exceed the socket's 1 MiB line limit
            out.append(row(f"inline apply p50, {n} entries", None, "ms", budget="request > 1 MiB"))
            continue
        ratio = r["inline_p50_ms"] / r["nft_p50_ms"]
        b = ("<= 0.25 x", verdict(ratio <= 0.25)) if n == 10000 else ("", "")
        out.append(row(f"inline apply p50, {n} entries", r["inline_p50_ms"], "ms", "nft -f p50", r["nft_p50_ms"],
                       ratio, *b))
    return out


def rows_dns(d):
    s, r = d["summary"], d["ratios"]
    out = []
    if "egressd_over_nftset_qps" in r:
        out.append(row("DNS qps, new address per answer", s["egressd"]["qps"], "qps", "dnsmasq --nftset",
                       s["nftset"]["qps"], r["egressd_over_nftset_qps"], ">= 4 x",
                       verdict(r["egressd_over_nftset_qps"] >= 4)))
    if "egressd_over_forward_qps" in r:
        out.append(row("DNS qps vs plain forwarding", s["egressd"]["qps"], "qps", "dnsmasq forward",
                       s["forward"]["qps"], r["egressd_over_forward_qps"], ">= 0.8 x",
                       verdict(r["egressd_over_forward_qps"] >= 0.8)))
    if "egressd_over_direct_qps" in r:
        out.append(row("DNS qps vs the upstream asked directly", s["egressd"]["qps"], "qps", "upstream direct",
                       s["direct"]["qps"], r["egressd_over_direct_qps"], ">= 0.9 x",
                       verdict(r["egressd_over_direct_qps"] >= 0.9)))
    if "egressd_p50_added_us" in r:
        added = r["egressd_p50_added_us"]
        out.append(row("DNS latency p50 at 1000 qps", s["egressd"]["p50_us"], "us", "upstream direct",
                       s["direct"]["p50_us"], s["egressd"]["p50_us"] / s["direct"]["p50_us"],
                       f"<= +100 us (+{added:.0f})", verdict(added <= 100)))
        out.append(row("DNS latency p99 at 1000 qps", s["egressd"]["p99_us"], "us", "upstream direct",
                       s["direct"]["p99_us"], s["egressd"]["p99_us"] / s["direct"]["p99_us"]))
    return out


def rows_datapath(d):
    s, r = d["summary"], d["ratios"]
    n = d["config"]["entries"]
    out = []
    for p in ("tcp", "udp"):
        out.append(row(f"datapath {p.upper()}, {d['set_elements']} set elements", s[f"egressd_{p}_gbps"], "Gbit/s",
                       "no rules", s[f"norules_{p}_gbps"], r[p], ">= 0.97 x", verdict(r[p] >= 0.97)))
        if f"conntrack_{p}_gbps" in s:  # diagnostic: the floor of conntrack alone, no sets
            out.append(row(f"datapath {p.upper()}, conntrack alone (floor)", s[f"conntrack_{p}_gbps"], "Gbit/s",
                           "no rules", s[f"norules_{p}_gbps"], r[f"{p}_conntrack"]))
    return out if n else []


def rows_memory(d):
    out = []
    for r in d["idle"]:
        n = r["entries"]
        b = ("<= 8 MiB", verdict(r["rss_kib"] <= 8192)) if n == 1000 else ("", "")
        out.append(row(f"RSS idle, {n} entries", r["rss_kib"] / 1024, "MiB", "nft -f peak RSS",
                       r["nft_peak_kib"] / 1024, r["rss_kib"] / r["nft_peak_kib"], *b))
    lr = d["learned"]
    out.append(row(f"RSS after {lr['names']} learned names", lr["rss_kib"] / 1024, "MiB"))
    return out


def rows_startup(d):
    return [
        row("start: exec -> ready, p50", d["ready"]["p50_ms"], "ms", "nft -f p50", d["nft"]["p50_ms"],
            d["ready"]["p50_ms"] / d["nft"]["p50_ms"], "<= 50 ms", verdict(d["ready"]["p50_ms"] <= 50)),
        row("start: exec -> ready, p99", d["ready"]["p99_ms"], "ms", "nft -f p99", d["nft"]["p99_ms"],
            d["ready"]["p99_ms"] / d["nft"]["p99_ms"]),
        row("start: exec -> first apply, p50", d["apply"]["p50_ms"], "ms", "nft -f p50", d["nft"]["p50_ms"],
            d["apply"]["p50_ms"] / d["nft"]["p50_ms"]),
    ] + ([row("start: of which install -> ready, p50", d["own"]["p50_ms"], "ms")] if "own" in d else [])


def rows_agent(d):
    n, mib = d["sandboxes"], 1024
    at200 = n >= 200
    return [
        row(f"agent RSS, {n} sandboxes", d["agent_rss_kib"] / mib, "MiB", f"{n} sidecars, sum",
            d["sidecars_rss_kib"] / mib, d["agent_rss_kib"] / d["sidecars_rss_kib"], "<= 64 MiB at 200",
            verdict(d["agent_rss_kib"] <= 64 * mib) if at200 else ""),
        row("sandbox_add -> ready, p50", d["add_p50_ms"], "ms", budget="<= 5 ms", verdict=verdict(d["add_p50_ms"] <= 5)),
        row("sandbox_add -> ready, p99", d["add_p99_ms"], "ms", budget="<= 20 ms",
            verdict=verdict(d["add_p99_ms"] <= 20)),
        row(f"named switch p99, {n} attached", d["switch_p99_ms"], "ms", "ping p99, same pacing (floor)",
            d["ping_p99_ms"], d["switch_p99_ms"] / d["ping_p99_ms"] if d["ping_p99_ms"] else None,
            budget="<= 1 ms", verdict=verdict(d["switch_p99_ms"] <= 1)),
        row(f"named switch p99, {n} attached, egressd's own time", d["switch_own_p99_ms"], "ms"),
        row(f"agent restart, {n} adopted", d["restart_s"] * 1e3, "ms", budget="<= 1 s",
            verdict=verdict(d["restart_s"] <= 1)),
    ]


def plot_agent(out: Path, d):
    pass  # a table is the picture: five numbers


def rows_host_commits(d):
    n, m = d["sandboxes"], d["median"]
    return [
        row(f"neighbour's paced switch p50 beside {n} sandboxes, shared event socket", m["shared"]["paced_p50"] / 1e3,
            "ms", "one socket per sandbox", m["per-sandbox"]["paced_p50"] / 1e3,
            d["shared_over_per_sandbox"]["paced_p50"]),
        row("neighbour's paced switch p50, no agent (floor)", m["none"]["paced_p50"] / 1e3, "ms"),
    ]


def plot_host_commits(out: Path, d):
    pass  # three numbers


def rows_agent_dns(d):
    s, r, n = d["summary"], d["ratios"], d["sandboxes"]
    judged = not d["config"]["quick"]
    a, sc = s["agent"], s["sidecar"]
    return [
        row(f"agent DNS qps, {n} sandboxes at once", a["qps"], "qps", "one sidecar", sc["qps"], r["qps_ratio"],
            ">= 1.0 x", verdict(r["qps_ratio"] >= 1) if judged else ""),
        row("agent DNS CPU per answered query", a["cpu_us_per_answer"], "us", "one sidecar",
            sc["cpu_us_per_answer"], r["cpu_ratio"], "<= 12 us",
            verdict(a["cpu_us_per_answer"] <= 12) if judged else ""),
        row("agent DNS: set elements = names answered", None, "", budget="every sandbox",
            verdict=verdict(d["sets_ok"])),
    ] + ([row(f"agent DNS: {n} dnsperf clients' CPU per answer", a["clients_cpu_us_per_answer"], "us",
              "one dnsperf", sc["clients_cpu_us_per_answer"],
              a["clients_cpu_us_per_answer"] / sc["clients_cpu_us_per_answer"])]
         if sc.get("clients_cpu_us_per_answer") else [])


def plot_agent_dns(out: Path, d):
    s, n = d["summary"], d["sandboxes"]
    with open(out / "agent_dns.dat", "w") as f:
        f.write("# side qps cpu_us_per_answer\n")
        for side, label in (("agent", f"agent, {n} sandboxes"), ("sidecar", "one sidecar")):
            f.write(f"\"{label}\" {s[side]['qps']} {s[side]['cpu_us_per_answer']}\n")
    gnuplot(out, "agent_dns", f"""set multiplot layout 1,2 title 'Agent-mode DNS: {n} sandboxes on one agent at once against one sidecar'
{HISTOGRAMS}
set boxwidth 0.9
set grid ytics
set yrange [0:*]
set title 'aggregate throughput, a new address per answer'
set ylabel 'answers per second'
plot 'agent_dns.dat' using 2:xtic(1) notitle lc rgb '#4477aa'
set title 'egressd CPU per answered query'
set ylabel 'microseconds'
plot 'agent_dns.dat' using 3:xtic(1) notitle lc rgb '#ee6677', 12 with lines dt 2 lc rgb 'gray' title 'budget 12 us'
unset multiplot
""")


def rows_pinning(d):
    s, b = d["summary"], d["budget"]
    added, p50, tput, tr = s["lat_added_p50_us"], s["lat_p50_us"], s["tput_gbps"], s["tput_ratio"]
    ratio = s["lat_added_ratio_egressd_over_haproxy"]
    best = s["rate_sustained_egressd"]
    return [
        row("pinned TLS connect+first byte p50", p50["egressd"], "us", "no rules", p50["norules"],
            p50["egressd"] / p50["norules"], f"<= +{b['lat_added_us']:g} us (+{added['egressd']:.0f})",
            verdict(added["egressd"] <= b["lat_added_us"])),
        row("pinned TLS connect+first byte p50, added", added["egressd"], "us", "haproxy req_ssl_sni, added",
            added["haproxy"], ratio, f"<= {b['lat_ratio']:g} x", verdict(ratio <= b["lat_ratio"])),
        row("TCP through a pinned address", tput["egressd"], "Gbit/s", "no rules", tput["norules"], tr["egressd"],
            f">= {b['tput']:g} x", verdict(tr["egressd"] >= b["tput"])),
        row("TCP through haproxy req_ssl_sni", tput["haproxy"], "Gbit/s", "no rules", tput["norules"],
            tr["haproxy"]),
    ] + ([row("TCP, conntrack alone (floor)", tput["conntrack"], "Gbit/s", "no rules", tput["norules"],
              tr["conntrack"])] if "conntrack" in tr else []) + [
        # The floors of a queue-based design (no budget): conntrack + 1 or 2 NFQUEUE trips per flow.
        row(f"connect+first byte added, {s_} (floor: {n} queue trip{'s' if n > 1 else ''})", added[s_], "us",
            "haproxy req_ssl_sni, added", added["haproxy"], added[s_] / added["haproxy"])
        for s_, n in (("queue1", 1), ("queue2", 2)) if s_ in added] + [
        row("new pinned TLS connections/s, 0 errors", best, "conn/s", budget=f">= {b['rate']}/s",
            verdict="" if d["config"]["quick"] else verdict(best >= b["rate"])),
        row(f"new pinned TLS at {s['rate_kernel_ports']}/s, kernel's ports: errors", s["rate_kernel_ports_errors"],
            "errors", budget="0 errors", verdict=verdict(s["rate_kernel_ports_sustained"])),
        row("pinned 4-tuple reused: decided afresh", None, "", budget="no decision error",
            verdict=verdict(s["tuple_reuse_ok"])),
    ]


def plot_pinning(out: Path, d):
    s = d["summary"]
    with open(out / "pinning.dat", "w") as f:
        f.write("# side p50_us tput_gbps\n")
        for side in ("norules", "conntrack", "egressd", "haproxy"):
            if side not in s["lat_p50_us"]:
                continue
            label = {"norules": "no rules", "conntrack": "conntrack alone", "egressd": "egressd (pinned)",
                     "haproxy": "haproxy (SNI ACL)"}[side]
            f.write(f"\"{label}\" {s['lat_p50_us'][side]} {s['tput_gbps'][side]}\n")
    gnuplot(out, "pinning", f"""set multiplot layout 1,2 title 'Hostname pinning: a TLS flow to a name-learned address'
{HISTOGRAMS}
set boxwidth 0.9
set xtics rotate by -30 nomirror
set grid ytics
set yrange [0:*]
set title 'connect + first byte, p50'
set ylabel 'microseconds'
plot 'pinning.dat' using 2:xtic(1) notitle lc rgb '#4477aa'
set title 'TCP throughput, one flow'
set ylabel 'Gbit/s'
plot 'pinning.dat' using 3:xtic(1) notitle lc rgb '#ee6677'
unset multiplot
""")


ROWS = {"switch_latency": rows_switch, "dns_proxy": rows_dns, "datapath": rows_datapath,
        "memory": rows_memory, "startup": rows_startup,
        "agent": rows_agent, "agent_dns": rows_agent_dns, "host_commits": rows_host_commits,
        "pinning": rows_pinning}


def fmt(v, unit):
    if v is None:
        return "-"
    if unit == "qps":
        return f"{v:,.0f} qps"
    if unit == "errors":
        return f"{v:.0f}"
    if unit == "conn/s":
        return f"{v:,.0f}/s"
    if unit == "us":
        return f"{v:.0f} µs"
    if unit == "ms":
        return f"{v:.3f} ms" if v < 10 else f"{v:.1f} ms"
    return f"{v:.2f} {unit}"


def table(rows, markdown=False) -> str:
    head = ["metric", "egressd", "peer", "ratio", "budget", "verdict"]
    body = []
    for r in rows:
        peer = f"{fmt(r['peer'], r['unit'])} ({r['peer_name']})" if r["peer_name"] else "-"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        body.append([r["metric"], fmt(r["egressd"], r["unit"]), peer, ratio, r["budget"] or "-", r["verdict"] or "-"])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    w = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(b)) for b in body]
    return "\n".join(lines)


# --- plots -------------------------------------------------------------------------------------

TERM = "set terminal pngcairo size 900,560 font 'sans,10'\n"
# The bar style of every histogram below (three lines of gnuplot, placed with {HISTOGRAMS}).
HISTOGRAMS = """set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1"""


def gnuplot(out: Path, name: str, script: str):
    """Runs script in out as <name>.gp, after the terminal and `set output '<name>.png'`."""
    (out / f"{name}.gp").write_text(TERM + f"set output '{name}.png'\n" + script)
    cp = subprocess.run(["gnuplot", f"{name}.gp"], cwd=out, capture_output=True, text=True, timeout=60)
    if cp.returncode != 0:
        raise RuntimeError(f"gnuplot {name}.gp: {cp.stderr.strip()}")


def plot_switch(out: Path, d):
    with open(out / "switch_latency.dat", "w") as f:
        f.write("# entries named_p50 named_p99 inline_p50 inline_p99 nft_p50 nft_p99 (ms)\n")
        for r in d["results"]:
            inl = lambda k: "NaN" if r[k] is None else r[k]  # noqa: E731
            f.write(f"{r['entries']} {r['named_p50_ms']} {r['named_p99_ms']} {inl('inline_p50_ms')} "
                    f"{inl('inline_p99_ms')} {r['nft_p50_ms']} {r['nft_p99_ms']}\n")
    gnuplot(out, "switch_latency", """set title 'Switch latency against allowlist size (request to kernel ack)'
set logscale xy
set xlabel 'allowlist entries (set elements)'
set ylabel 'milliseconds'
set key top left
set grid
plot 'switch_latency.dat' using 1:6 with linespoints lw 2 title 'nft -f of egressd render, p50', \\
     '' using 1:4 with linespoints lw 2 title 'egressd inline apply, p50', \\
     '' using 1:3 with linespoints lw 2 title 'egressd named switch, p99', \\
     '' using 1:2 with linespoints lw 2 title 'egressd named switch, p50', \\
     1 with lines dt 2 lc rgb 'gray' title 'budget: named p99 1 ms'
""")


def plot_dns(out: Path, d):
    s = d["summary"]
    with open(out / "dns_proxy.dat", "w") as f:
        f.write("# contender qps p50_us p99_us\n")
        for c in ("direct", "forward", "nftset", "egressd"):
            if c in s:
                label = {"direct": "upstream direct", "forward": "dnsmasq forward",
                         "nftset": "dnsmasq --nftset", "egressd": "egressd"}[c]
                f.write(f"\"{label}\" {s[c]['qps']} {s[c]['p50_us']} {s[c]['p99_us']}\n")
    gnuplot(out, "dns_proxy", f"""set multiplot layout 1,2 title 'DNS proxy: a new address per answer (same upstream, same names)'
{HISTOGRAMS}
set boxwidth 0.9
set xtics rotate by -30 nomirror
set grid ytics
set yrange [0:*]
set title 'throughput at saturation'
set ylabel 'answers per second'
plot 'dns_proxy.dat' using 2:xtic(1) notitle lc rgb '#4477aa'
set title 'latency at 1000 queries/s'
set ylabel 'microseconds (log scale)'
set logscale y
set yrange [10:*]
plot 'dns_proxy.dat' using 3:xtic(1) title 'p50' lc rgb '#4477aa', '' using 4 title 'p99' lc rgb '#ee6677'
unset multiplot
""")


def plot_datapath(out: Path, d):
    s = d["summary"]
    with open(out / "datapath.dat", "w") as f:
        f.write("# proto norules_gbps egressd_gbps conntrack_gbps\n")
        for p in ("tcp", "udp"):
            f.write(f"{p.upper()} {s[f'norules_{p}_gbps']} {s[f'egressd_{p}_gbps']} {s.get(f'conntrack_{p}_gbps', 'NaN')}\n")
    gnuplot(out, "datapath", f"""set title 'iperf3 through the sandbox veth: no rules vs egressd holding {d['set_elements']} set elements'
{HISTOGRAMS}
set grid ytics
set yrange [0:*]
set ylabel 'Gbit/s (TCP: received; UDP: sent at -b 0)'
plot 'datapath.dat' using 2:xtic(1) title 'no rules' lc rgb '#bbbbbb', \\
     '' using 4 title 'conntrack alone (floor of a stateful design)' lc rgb '#ccbb44', \\
     '' using 3 title 'egressd' lc rgb '#4477aa'
""")


def plot_memory(out: Path, d):
    with open(out / "memory.dat", "w") as f:
        f.write("# case egressd_rss_mib nft_peak_mib\n")
        for r in d["idle"]:
            f.write(f"\"idle, {r['entries']} entries\" {r['rss_kib'] / 1024} {r['nft_peak_kib'] / 1024}\n")
        lr = d["learned"]
        f.write(f"\"{lr['names']} learned names\" {lr['rss_kib'] / 1024} NaN\n")
    gnuplot(out, "memory", f"""set title 'Resident memory: egressd (VmRSS) and nft -f loading the same phase (peak RSS)'
{HISTOGRAMS}
set grid ytics
set logscale y
set yrange [1:*]
set ylabel 'MiB (log scale)'
plot 'memory.dat' using 2:xtic(1) title 'egressd RSS' lc rgb '#4477aa', '' using 3 title 'nft -f peak RSS' lc rgb '#bbbbbb', \\
     8 with lines dt 2 lc rgb 'gray' title 'budget: 8 MiB idle with 1k'
""")


def plot_startup(out: Path, d):
    with open(out / "startup.dat", "w") as f:
        f.write("# what p50_ms p99_ms\n")
        for k, label in (("ready", "egressd exec -> ready"), ("apply", "egressd exec -> first apply"),
                         ("nft", "nft -f of the same ruleset")):
            f.write(f"\"{label}\" {d[k]['p50_ms']} {d[k]['p99_ms']}\n")
    gnuplot(out, "startup", f"""set title 'Start-up (fresh namespace, 3 phases staged)'
{HISTOGRAMS}
set grid ytics
set yrange [0:*]
set ylabel 'milliseconds'
plot 'startup.dat' using 2:xtic(1) title 'p50' lc rgb '#4477aa', '' using 3 title 'p99' lc rgb '#ee6677', \\
     50 with lines dt 2 lc rgb 'gray' title 'budget: ready 50 ms'
""")


PLOTS = {"switch_latency": plot_switch, "dns_proxy": plot_dns, "datapath": plot_datapath,
         "memory": plot_memory, "startup": plot_startup, "agent": plot_agent,
         "agent_dns": plot_agent_dns, "host_commits": plot_host_commits,
         "pinning": plot_pinning}


def finish(run, out: Path, results: dict, rows: list, failures: list):
    """Waits for one benchmark (stopping it past its time limit), then tabulates and plots it."""
    name, args, limit, p, t, log = run
    try:
        p.wait(max(1.0, limit - (time.monotonic() - t)))
    except subprocess.TimeoutExpired:
        p.terminate()  # its own SIGTERM handler removes its namespaces
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        failures.append(f"{name}: still running after {limit} s (stopped)")
    took = time.monotonic() - t
    log.close()
    text = (out / f"{name}.txt").read_text()
    if results["mode"] == "quick":
        print(f"== {name} {' '.join(args)}")
    print(text.rstrip(), flush=True)
    js = out / f"{name}.json"
    if p.returncode != 0 or not js.exists():
        if p.returncode is not None and p.returncode >= 0:
            failures.append(f"{name}: exited {p.returncode}")
        return
    d = json.loads(js.read_text())
    if results["mode"] == "full":  # run alone: its own wall time
        d["took_s"] = took
    results["benchmarks"][name] = d
    try:
        rows += [dict(x, benchmark=name) for x in ROWS[name](d)]
        PLOTS[name](out, d)
    except (KeyError, ZeroDivisionError, RuntimeError, subprocess.SubprocessError) as e:
        failures.append(f"{name}: could not tabulate or plot: {e!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test of every benchmark (< 30 s)")
    ap.add_argument("--out", default=str(ROOT / "bench-results"), help="results directory (default bench-results)")
    ap.add_argument("--only", help="comma-separated benchmarks: " + ",".join(b[0] for b in BENCHES))
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown (for docs)")
    a = ap.parse_args()
    only = a.only.split(",") if a.only else [b[0] for b in BENCHES]
    unknown = set(only) - {b[0] for b in BENCHES}
    if unknown:
        ap.error(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}")
    if os.geteuid() != 0:
        print("SKIP: needs root (network namespaces, nftables)")
        return 77
    if shutil.which("gnuplot") is None:
        print("error: gnuplot missing (scripts/setup installs gnuplot-nox)", file=sys.stderr)
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = {"mode": "quick" if a.quick else "full", "machine": machine(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "benchmarks": {}}
    rows, failures = [], []
    todo = [(name, quick if a.quick else full, limit) for name, full, quick, limit in BENCHES if name in only]
    # Full: one after the other, so they do not disturb each other's numbers. Quick: all at
    # once (each in namespaces of its own), since a smoke test's numbers mean nothing anyway
    # and this keeps it under 30 s.
    running = []
    for name, args, limit in todo:
        js = out / f"{name}.json"
        js.unlink(missing_ok=True)
        argv = [sys.executable, str(HERE / f"{name}.py"), *args, "--json", str(js)]
        log = open(out / f"{name}.txt", "w")
        if not a.quick:
            print(f"== {name} {' '.join(args)}", flush=True)
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        running.append((name, args, limit, p, time.monotonic(), log))
        if not a.quick:
            finish(running.pop(), out, results, rows, failures)
    for r in running:
        finish(r, out, results, rows, failures)
    results["elapsed_s"] = time.monotonic() - t0
    results["rows"] = rows
    results["failures"] = failures
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    m = results["machine"]
    print()
    print(f"egressd benchmarks ({results['mode']}): {m['nproc']} cpus ({m['cpu']}), kernel {m['kernel']}, "
          f"load average {m['loadavg'][0]} at start; {results['elapsed_s']:.0f} s")
    print(table(rows))
    if a.markdown:
        print()
        print(table(rows, markdown=True))
    print(f"results: {out / 'results.json'}; plots: {', '.join(sorted(p.name for p in out.glob('*.png')))}")
    if a.quick:
        print("(--quick is a smoke test: too short for the numbers to mean anything)")
    for f in failures:
        print(f"error: {f}", file=sys.stderr)
    # One line for scripts/test: a benchmark passes when it ran and was tabulated and plotted.
    bad = {f.split(":")[0] for f in failures}
    print(f"bench: {len(todo) - len(bad)} passed, {len(bad)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
