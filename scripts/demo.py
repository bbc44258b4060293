#!/usr/bin/env python3
"""The scripts/demo walkthrough: egressd in a throwaway lab (see tests/integration/lab.py)."""
import os
import time
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/integration"))
import lab as labmod  # noqa: E402

EGRESSD = os.environ.get("EGRESSD", str(ROOT / "build/src/egressd"))
BOLD, GREEN, RED, DIM, OFF = ("\033[1m", "\033[32m", "\033[31m", "\033[2m", "\033[0m") if sys.stdout.isatty() \
    else ("", "", "", "", "")

POLICY = """\
initial_phase: environment
dns: { upstream: [192.0.2.1] }     # the lab's DNS server (dnsmasq in the 'internet' namespace)
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: [a.example.com, "*.wild.example.org", "2001:db8:2::/64"]
  verifier: no-network
"""

TARGETS = [("198.51.100.10", "tcp"), ("198.51.100.11", "tcp"), ("203.0.113.10", "tcp"),
           ("2001:db8:2::11", "tcp"), ("2001:db8:3::10", "tcp"), ("198.51.100.10", "udp"),
           ("203.0.113.10", "icmp")]


def title(text):
    print(f"\n{BOLD}== {text}{OFF}")


def shell(cmd, **kw):
    print(f"{DIM}$ {' '.join(cmd)}{OFF}")
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    sys.stdout.write(out.stdout)
    sys.stdout.write(out.stderr)
    return out


def probe(lab, addr, proto):
    if proto == "tcp":
        return lab.tcp_connect(addr, 80, timeout=1.0)
    if proto == "udp":
        return lab.udp_exchange(addr, 7, timeout=1.0)
    return lab.ping(addr, timeout=1.0)


def reachability(lab, phases_seen):
    """One column per phase seen so far: the same requests, side by side."""
    header = f"  {'request':<28}" + "".join(f"{p:<30}" for p, _ in phases_seen)
    print(header)
    for i, (addr, proto) in enumerate(TARGETS):
        row = f"  {proto + ' ' + addr:<28}"
        for _, results in phases_seen:
            out = results[i]
            mark = f"{GREEN}allowed{OFF}" if out == "ok" else f"{RED}blocked{OFF} ({out} {out.elapsed * 1e3:.0f} ms)"
            pad = 30 + (len(mark) - len(mark.replace(GREEN, "").replace(RED, "").replace(OFF, "")))
            row += f"{mark:<{pad}}"
        print(row)


def main():
    title("1. Validate a policy and see the nft script it compiles to")
    path = ROOT / "examples/policy.yaml"
    shell([EGRESSD, "check", "--config", str(path)])
    shell([EGRESSD, "check", "--allow", " PyPI.org. ", "--allow", "2001:DB8::1", "--allow", "*.Example.com"])
    shell([EGRESSD, "check", "--allow", "pypi.org:443"])
    out = subprocess.run([EGRESSD, "render", "--config", str(path), "--phase", "agent"], capture_output=True,
                         text=True, check=True).stdout
    print(f"{DIM}$ egressd render --config examples/policy.yaml --phase agent   (chains only){OFF}")
    keep = False
    for line in out.splitlines():
        keep = keep or line.strip().startswith("chain ")
        if keep:
            print("  " + line)

    with labmod.Lab() as lab:
        title("2. A throwaway lab: sandbox namespace -> veth -> 'internet' namespace with servers")
        print(f"  sandbox {lab.sandbox.name}, internet {lab.internet.name}; servers "
              + ", ".join(labmod.SERVERS))
        d = lab.egressd(POLICY)
        print(f"  egressd run --netns /run/netns/{lab.sandbox.name} --socket {d.socket_path} (ready: initial phase in force)")
        seen = []

        title("3. Phase 'environment' (public): everything leaves")
        seen.append(("environment", [probe(lab, a, p) for a, p in TARGETS]))
        reachability(lab, seen)
        flow = lab.tcp_flow("203.0.113.10")
        print(f"  opened a long-lived TCP connection to 203.0.113.10: {flow.exchange()}")

        title("4. Switch to 'agent' (allowlist): one kernel transaction, acknowledged in microseconds")
        print("  " + POLICY.split("agent:")[1].split("verifier")[0].strip().replace("\n", "\n  "))
        shell([os.environ.get("EGRESSCTL", str(ROOT / "build/src/egressctl")), "--socket", str(d.socket_path),
               "apply", "agent"])
        out = flow.exchange()
        print(f"  the connection opened under 'environment' is cut on its next packet: {out} "
              f"({out.elapsed * 1e3:.1f} ms)")
        seen.append(("agent", [probe(lab, a, p) for a, p in TARGETS]))
        reachability(lab, seen)
        print("  198.51.100.10 is allowed because a.example.com was pre-resolved at apply time.")

        title("5. DNS in 'agent': allowed names answered, others refused inside the sandbox")
        for name in ("a.example.com", "c.example.net", "x.wild.example.org", "wild.example.org"):
            r = lab.dns_query(name)
            answer = ", ".join(r.addresses) if r.rcode == "NOERROR" else r.rcode or str(r.outcome)
            print(f"  dig {name:<22} -> {answer}")
        out = lab.tcp_connect("203.0.113.10", 80, timeout=1.0)
        print(f"  tcp 203.0.113.10 after x.wild.example.org resolved to it: "
              f"{GREEN + 'allowed' + OFF if out == 'ok' else RED + str(out) + OFF}")
        r = lab.dns_query("c.example.net", server="198.51.100.53")
        print(f"  a query sent to another resolver (198.51.100.53) is intercepted too: {r.rcode or r.outcome}")
        lab.dns.sync()
        names = sorted({n.lower() for n in lab.dns.query_names()})
        print(f"  names the upstream DNS server ever saw: {', '.join(names)}")
        print("  (c.example.net never left the sandbox: that is what stops DNS exfiltration)")

        title("6. Switch to 'verifier' (no-network): only loopback")
        d.ctl("apply", "verifier")
        seen.append(("verifier", [probe(lab, a, p) for a, p in TARGETS]))
        reachability(lab, seen)
        print(f"  loopback inside the sandbox still works: {lab.tcp_connect('127.0.0.1', 7, timeout=1.0)}")

        title("7. Status: phase, generation, counters, learned names")
        shell([os.environ.get("EGRESSCTL", str(ROOT / "build/src/egressctl")), "--socket", str(d.socket_path), "status"])

        title("8. Fail closed: kill -9 egressd; the policy stays; a restart adopts it")
        d.kill()
        d.wait()
        print(f"  egressd killed; tcp 198.51.100.10 is still {probe(lab, '198.51.100.10', 'tcp')}")
        d.restart()
        st = d.status()
        print(f"  restarted: adopted phase={st['phase']} generation={st['generation']}")

        title("9. The daemon's log (one structured line per switch)")
        for line in d.log().splitlines():
            if "switch" in line or "adopted" in line or "installed" in line:
                print("  " + line.split(" ", 1)[1])
        title("10. Why was this blocked? denied records and explain")
        ctl = [os.environ.get("EGRESSCTL", str(ROOT / "build/src/egressctl")), "--socket", str(d.socket_path)]
        # Back to 'agent' (shown: the records below name the phase they were made in).
        if shell(ctl + ["apply", "agent"]).returncode != 0:
            raise SystemExit("demo: apply agent failed")
        r = lab.dns_query("c.example.net")
        print(f"  dig c.example.net -> {r.rcode or r.outcome}")
        print(f"  tcp 198.51.100.11 -> {probe(lab, '198.51.100.11', 'tcp')}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # NFLOG delivers asynchronously: wait for the record
            out = subprocess.run(ctl + ["denied", "--json"], capture_output=True, text=True).stdout
            if '"packet"' in out:
                break
        shell(ctl + ["denied"])
        shell(ctl + ["explain", "198.51.100.11:443"])
        shell(ctl + ["explain", "c.example.net"])
        shell(ctl + ["explain", "x.wild.example.org"])
    print(f"\n{BOLD}Lab removed.{OFF} Next: README.md (policy format, egressctl, guarantees).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
