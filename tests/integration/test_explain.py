"""`egressctl explain TARGET [--phase NAME] [--json]` against the real daemon, kernel and DNS.

The contract (docs/protocol.md "explain", DESIGN §2): for a hostname, IP or IP:port, say whether
the phase in force (or --phase NAME) allows it, by which entry (an IP entry, a CIDR entry, an
exact hostname or a wildcard) or learned name, or why not with a hint; JSON has allowed, reason,
entry (plus target, phase, mode, learned_name, names, hint); exit 0 whether allowed or denied, 2
for a bad target or an unknown phase. Every verdict is checked against what the kernel and the
DNS proxy really do with the same target, so explain cannot drift from enforcement unnoticed.
"""
import random

from lab import DEFAULT_CNAMES, DEFAULT_HOSTS, DEFAULT_WILDCARDS

CDN_V6 = "2001:db8:3::10"     # outside every IP entry: reachable only as a learned address
A_V4 = DEFAULT_HOSTS["a.example.com"][0]   # 198.51.100.10, not allowlisted in agent
POLICY = """\
initial_phase: agent
dns: { upstream: ["192.0.2.1"] }
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: [198.51.100.11, 203.0.113.0/24, "2001:db8:2::/64", b.example.com, "*.cdn.example.net"]
  verifier: { network_mode: no-network }
"""
JSON_KEYS = {"target", "phase", "mode", "allowed", "reason", "entry", "learned_name", "names", "hint", "guard",
             "inspected", "pin"}
DASH = "\u2014"


def tok() -> str:
    return f"t{random.getrandbits(48):012x}"


def start(lab, egressd, phase=None):
    """dnsmasq with cdn.example.net (and every name below it) -> CDN_V6, then egressd."""
    lab.dns.restart(hosts=DEFAULT_HOSTS, cnames=DEFAULT_CNAMES,
                    wildcards={**DEFAULT_WILDCARDS, "cdn.example.net": [CDN_V6]})
    return egressd(POLICY, phase=phase)


def explain(d, *args):
    """Runs explain in both forms: (human output lines, JSON reply). Both must exit 0."""
    rc, out, err = d.ctl("explain", *args)
    assert rc == 0, f"explain {args} exited {rc}: {err}"
    j = d.ctl_json("explain", *args, "--json")
    assert set(j) == JSON_KEYS, f"explain --json keys: {sorted(j)}"
    lines = out.splitlines()
    assert lines and lines[1].startswith("  reason: ") and lines[1][len("  reason: "):] == j["reason"], out
    return lines, j


def test_explain_ip_and_cidr_entries(lab, egressd):
    d = start(lab, egressd)
    lines, j = explain(d, "198.51.100.11:443")
    assert (j["allowed"], j["entry"], j["learned_name"], j["hint"]) == (True, "198.51.100.11", None, None)
    assert (j["target"], j["phase"], j["mode"]) == ("198.51.100.11:443", "agent", "allowlist")
    assert "any port" in j["reason"]
    assert lines[0] == "allowed: 198.51.100.11:443 by entry 198.51.100.11 (phase agent, allowlist)"
    assert lab.tcp_connect("198.51.100.11", 443) == "ok"

    lines, j = explain(d, "203.0.113.10")
    assert (j["allowed"], j["entry"]) == (True, "203.0.113.0/24")
    assert lines[0] == "allowed: 203.0.113.10 by entry 203.0.113.0/24 (phase agent, allowlist)"
    assert lab.tcp_connect("203.0.113.10", 80) == "ok"

    lines, j = explain(d, "[2001:DB8:2::10]:80")
    assert (j["allowed"], j["entry"], j["target"]) == (True, "2001:db8:2::/64", "[2001:db8:2::10]:80")
    assert lines[0] == "allowed: [2001:db8:2::10]:80 by entry 2001:db8:2::/64 (phase agent, allowlist)"
    assert lab.tcp_connect("2001:db8:2::10", 80) == "ok"


def test_explain_wildcard_learned_address(lab, egressd):
    d = start(lab, egressd)
    name = f"{tok()}.cdn.example.net"
    # Nothing learned yet: denied, and so is a real connection.
    lines, j = explain(d, CDN_V6)
    assert (j["allowed"], j["entry"], j["names"]) == (False, None, [])
    assert j["hint"] == f"add {CDN_V6}, or a CIDR such as 2001:db8:3::/64"
    assert lines[0] == f"denied: {CDN_V6} (phase agent, allowlist) {DASH} hint: {j['hint']}"
    assert lab.tcp_connect(CDN_V6, 80) == "refused"

    r = lab.dns_query(name, "AAAA")
    assert r.rcode == "NOERROR" and r.addresses == [CDN_V6], f"{name}: {r.rcode} {r.records}"
    lines, j = explain(d, f"[{CDN_V6}]:443")
    assert (j["allowed"], j["entry"], j["learned_name"]) == (True, "*.cdn.example.net", name)
    assert j["names"] == [name]
    assert lines[0] == (f"allowed: [{CDN_V6}]:443 by entry *.cdn.example.net via learned name {name} "
                        f"(phase agent, allowlist)")
    assert f"  names that resolved to it: {name}" in lines
    assert lab.tcp_connect(CDN_V6, 443) == "ok"


def test_explain_denied_address_names_the_hostname(lab, egressd):
    d = start(lab, egressd, phase="environment")
    r = lab.dns_query("a.example.com", "A")
    assert r.rcode == "NOERROR" and r.addresses == [A_V4], r.records
    lines, j = explain(d, A_V4)
    assert (j["allowed"], j["entry"], j["mode"], j["names"]) == (True, None, "public", ["a.example.com"])
    assert lines[0] == f"allowed: {A_V4} (phase environment, public)"

    assert d.ctl("apply", "agent")[0] == 0
    lines, j = explain(d, f"{A_V4}:443")
    assert (j["allowed"], j["entry"], j["learned_name"]) == (False, None, None)
    assert j["names"] == ["a.example.com"]
    assert j["hint"] == "add a.example.com"
    assert lines[0] == f"denied: {A_V4}:443 (phase agent, allowlist) {DASH} hint: add a.example.com"
    assert "  names that resolved to it: a.example.com" in lines
    assert lab.tcp_connect(A_V4, 443) == "refused"


def test_explain_hostnames(lab, egressd):
    d = start(lab, egressd)
    lines, j = explain(d, "B.Example.com.")
    assert (j["allowed"], j["entry"], j["target"], j["names"]) == (True, "b.example.com", "b.example.com", [])
    assert "pre-resolved" in j["reason"]
    assert lines[0] == "allowed: b.example.com by entry b.example.com (phase agent, allowlist)"
    assert lab.dns_query("b.example.com").rcode == "NOERROR"

    name = f"{tok()}.cdn.example.net"
    lines, j = explain(d, f"{name}:443")
    assert (j["allowed"], j["entry"], j["target"]) == (True, "*.cdn.example.net", f"{name}:443")
    assert lines[0] == f"allowed: {name}:443 by entry *.cdn.example.net (phase agent, allowlist)"
    assert lab.dns_query(name, "AAAA").rcode == "NOERROR"

    # A wildcard never allows its apex, and explain says that is why.
    lines, j = explain(d, "cdn.example.net")
    assert (j["allowed"], j["entry"]) == (False, None)
    assert "*.cdn.example.net matches only names below cdn.example.net" in j["reason"]
    assert j["hint"] == "add cdn.example.net"
    assert lab.dns_query("cdn.example.net").rcode == "REFUSED"

    lines, j = explain(d, "a.example.com")
    assert (j["allowed"], j["entry"], j["hint"]) == (False, None, "add a.example.com")
    assert lines[0] == f"denied: a.example.com (phase agent, allowlist) {DASH} hint: add a.example.com"
    assert lab.dns_query("a.example.com").rcode == "REFUSED"


def test_explain_named_phase_changes_nothing(lab, egressd):
    d = start(lab, egressd)
    before = d.status()
    lines, j = explain(d, A_V4, "--phase", "environment")
    assert (j["allowed"], j["phase"], j["mode"], j["entry"]) == (True, "environment", "public", None)
    assert lines[0] == f"allowed: {A_V4} (phase environment, public)"

    lines, j = explain(d, "198.51.100.11", "--phase", "verifier")
    assert (j["allowed"], j["phase"], j["mode"]) == (False, "verifier", "no-network")
    assert j["hint"].startswith("switch to a phase")
    assert "no-network" in j["reason"]

    lines, j = explain(d, "pypi.org", "--phase", "agent")
    assert (j["allowed"], j["phase"]) == (False, "agent")

    rc, out, err = d.ctl("explain", A_V4, "--phase", "nope")
    assert rc == 2 and out == "" and 'unknown phase "nope"' in err, (rc, out, err)

    after = d.status()
    assert (after["phase"], after["generation"]) == (before["phase"], before["generation"])
    # The phase in force is still enforced as before.
    assert lab.tcp_connect(A_V4, 80) == "refused"
    assert lab.tcp_connect("198.51.100.11", 80) == "ok"


def test_explain_bad_targets_exit_2(lab, egressd):
    d = start(lab, egressd)
    for target in ("192.0.2.300", "[2001:db8::1]443", "*.example.com", "https://pypi.org/simple",
                   "198.51.100.11:70000", "2001:db8::zz", "192.0.2.0/24", "bad_name.example"):
        rc, out, err = d.ctl("explain", target)
        assert rc == 2 and out == "", f"{target}: rc {rc}, stdout {out!r}"
        assert f'target "{target}"' in err, f"{target}: {err!r}"
        rc, out, err = d.ctl("explain", target, "--json")
        assert rc == 2 and out == "", f"{target} --json: rc {rc}, stdout {out!r}"
    rc, out, err = d.ctl("explain")
    assert rc == 2 and "TARGET" in err, err

    # The daemon checks too (other clients than egressctl), and names the target.
    reply = d.request({"cmd": "explain", "target": "*.example.com"})
    assert reply["ok"] is False and reply["error"]["code"] == "invalid_request", reply
    assert 'target "*.example.com"' in reply["error"]["message"]
    for bad in ({"cmd": "explain"}, {"cmd": "explain", "target": 7},
                {"cmd": "explain", "target": "192.0.2.1", "port": 1},
                {"cmd": "explain", "target": "192.0.2.1", "phase": 1}):
        reply = d.request(bad)
        assert reply["ok"] is False and reply["error"]["code"] == "invalid_request", (bad, reply)
    assert d.request({"cmd": "explain", "target": "192.0.2.1", "phase": "nope"})["error"]["code"] == "unknown_phase"
