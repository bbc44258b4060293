"""Metrics and the live ruleset (issue 18, items 3 and 4), through the public interfaces only.

  egressctl metrics      the Prometheus text exposition (read here by prometheus_client's own
                         parser, python3-prometheus-client), counters that move with traffic,
                         switches, DNS answers and control requests
  egressd run --metrics-file PATH [--metrics-interval S]
                         the same text, rewritten atomically for node_exporter's textfile
                         collector; nothing listens on a port for it
  egressctl rules / network-policy rules
                         egressd's tables as nft text with counters, equal to `nft list table`
                         of the same namespace
"""
import os
import re
import subprocess

import pytest

import lab as labmod
from test_enforcer import nft_loadable

parser = pytest.importorskip("prometheus_client.parser", reason="python3-prometheus-client (scripts/setup)")

POLICY = """\
initial_phase: agent
dns: { upstream: ["192.0.2.1"] }
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: ["a.example.com", "198.51.100.10", "2001:db8:2::/64"]
  verifier: { network_mode: no-network }
"""
ALLOWED_V4, DENIED_V4 = "198.51.100.10", "203.0.113.10"
ALLOWED_V6 = "2001:db8:2::10"


def families(text: str) -> dict:
    """name -> Metric, parsed by the reference Prometheus text parser (which raises on
    anything malformed)."""
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str | None = None, /, **labels) -> float:
    """The one sample of `family` named `sample` (default: the family's own name, or name_total
    for a counter) with exactly these labels (a histogram bucket: le=...)."""
    f = fams[family]
    names = {sample} if sample else {family, family + "_total"}
    found = [s.value for s in f.samples if s.name in names and s.labels == labels]
    assert len(found) == 1, f"{family} {sample} {labels}: {found} in {f.samples}"
    return found[0]


def metrics(d) -> dict:
    rc, out, err = d.ctl("metrics")
    assert rc == 0, err
    return families(out)


def test_metrics_move_with_switches_traffic_dns_and_requests(lab, egressd):
    d = egressd(POLICY)
    m0 = metrics(d)
    # Types as a scraper sees them.
    kinds = {name: f.type for name, f in m0.items()}
    for name, kind in {"egressd_switches": "counter", "egressd_switch_failures": "counter",
                       "egressd_generation": "gauge", "egressd_phase_info": "gauge",
                       "egressd_packets": "counter", "egressd_bytes": "counter",
                       "egressd_dns_queries": "counter", "egressd_dns_inflight": "gauge",
                       "egressd_dns_upstream_sockets": "gauge",
                       "egressd_dns_descriptor_denied": "counter",
                       "egressd_dns_answer_duration_seconds": "histogram",
                       "egressd_learned_addresses": "gauge", "egressd_tamper_detected": "counter",
                       "egressd_tamper_restores": "counter", "egressd_control_requests": "counter",
                       "egressd_pin_flows": "counter"}.items():
        assert kinds.get(name) == kind, f"{name}: {kinds.get(name)}, want {kind}"
    # Hostname pinning (docs/pinning.md): nothing inspected yet.
    assert value(m0, "egressd_pin_flows", result="inspected") == 0
    assert value(m0, "egressd_generation") == 1
    assert value(m0, "egressd_phase_info", phase="agent", mode="allowlist") == 1

    # A switch: counted, generation and phase follow.
    assert d.ctl("apply", "verifier")[0] == 0
    m1 = metrics(d)
    assert value(m1, "egressd_switches") == value(m0, "egressd_switches") + 1
    assert value(m1, "egressd_generation") == 2
    assert value(m1, "egressd_phase_info", phase="verifier", mode="no-network") == 1
    assert "agent" not in {s.labels.get("phase") for s in m1["egressd_phase_info"].samples}
    assert d.ctl("apply", "agent")[0] == 0

    # Traffic, by family: a denied IPv4 connect moves the IPv4 denied counters, an allowed
    # IPv4 one the IPv4 allowed ones, an allowed IPv6 exchange the IPv6 allowed ones.
    def packets(m, verdict, family):
        return value(m, "egressd_packets", verdict=verdict, family=family)

    def octets(m, verdict, family):
        return value(m, "egressd_bytes", verdict=verdict, family=family)

    m2 = metrics(d)
    assert lab.tcp_connect(DENIED_V4, 80) == "refused"
    m3 = metrics(d)
    assert packets(m3, "denied", "ipv4") >= packets(m2, "denied", "ipv4") + 1
    assert octets(m3, "denied", "ipv4") > octets(m2, "denied", "ipv4")
    assert packets(m3, "allowed", "ipv4") == packets(m2, "allowed", "ipv4")
    assert lab.tcp_connect(ALLOWED_V4, 80) == "ok"
    # The connection's last ACK leaves once the server's FIN is in, after the client closed:
    # counted before m4, not in the IPv6 step's delta (a CI run read it there).
    labmod.wait_for(lambda: all(ln.split()[0] == "TIME-WAIT" for ln in
                                lab.sandbox.exec("ss", "-tanH", "dst", ALLOWED_V4).stdout.splitlines() if ln.strip()),
                    5, f"the connection to {ALLOWED_V4} to finish closing")
    m4 = metrics(d)
    assert packets(m4, "allowed", "ipv4") > packets(m3, "allowed", "ipv4")
    assert octets(m4, "allowed", "ipv4") > octets(m3, "allowed", "ipv4")
    assert packets(m4, "denied", "ipv4") == packets(m3, "denied", "ipv4")
    assert packets(m4, "allowed", "ipv6") == packets(m3, "allowed", "ipv6")
    assert lab.tcp_connect(ALLOWED_V6, 80) == "ok"
    m4b = metrics(d)
    # SYN, ACK, the payload, FIN at least: each a packet the policy decided.
    assert packets(m4b, "allowed", "ipv6") >= packets(m4, "allowed", "ipv6") + 3
    assert octets(m4b, "allowed", "ipv6") > octets(m4, "allowed", "ipv6")
    assert packets(m4b, "allowed", "ipv4") == packets(m4, "allowed", "ipv4")
    assert packets(m4b, "denied", "ipv4") == packets(m4, "denied", "ipv4")
    # status keeps its totals, the sum of the families, and has the same split (the sandbox
    # is idle between the two reads; only the kernel's own MLD reports, IPv6 denied, may come).
    st = d.request({"cmd": "status"})
    m4c = metrics(d)
    assert st["counters"]["allowed_packets"] == sum(packets(m4c, "allowed", f) for f in ("ipv4", "ipv6"))
    assert st["counters"]["allowed_bytes"] == sum(octets(m4c, "allowed", f) for f in ("ipv4", "ipv6"))
    for verdict in ("allowed", "denied"):
        assert st["counters_by_family"]["ipv4"][f"{verdict}_packets"] == packets(m4c, verdict, "ipv4")
        assert st["counters_by_family"]["ipv4"][f"{verdict}_bytes"] == octets(m4c, verdict, "ipv4")
    assert st["counters_by_family"]["ipv6"]["allowed_packets"] == packets(m4c, "allowed", "ipv6")

    # DNS: a refused name, then an allowed one (forwarded, answered, its addresses learned).
    r = lab.dns_query("c.example.net")
    assert r.outcome == "ok" and r.rcode == "REFUSED", r
    m5 = metrics(d)
    assert value(m5, "egressd_dns_queries", result="refused") == value(m4, "egressd_dns_queries", result="refused") + 1
    assert value(m5, "egressd_dns_queries", result="forwarded") == value(m4, "egressd_dns_queries", result="forwarded")
    hist = "egressd_dns_answer_duration_seconds"
    count_before = value(m5, hist, hist + "_count")
    r = lab.dns_query("a.example.com")
    assert r.outcome == "ok" and ALLOWED_V4 in r.addresses, r
    m6 = metrics(d)
    assert value(m6, "egressd_dns_queries", result="forwarded") == value(m5, "egressd_dns_queries", result="forwarded") + 1
    assert value(m6, hist, hist + "_count") == count_before + 1
    assert value(m6, hist, hist + "_sum") > 0
    buckets = sorted(((float(s.labels["le"]), s.value) for s in m6[hist].samples if s.name == hist + "_bucket"))
    assert buckets[-1] == (float("inf"), value(m6, hist, hist + "_count")), buckets
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), f"buckets not cumulative: {buckets}"
    assert value(m6, "egressd_learned_addresses") >= 1

    # Control requests by command and result; an invented command is not a new label value.
    assert d.request({"cmd": "frobnicate"})["ok"] is False
    assert d.ctl("apply", "no-such-phase")[0] == 2
    m7 = metrics(d)
    assert value(m7, "egressd_control_requests", command="apply", result="ok") == 2
    assert value(m7, "egressd_control_requests", command="apply", result="unknown_phase") == 1
    assert value(m7, "egressd_control_requests", command="unknown", result="unknown_command") == 1
    assert value(m7, "egressd_control_requests", command="metrics", result="ok") == 9  # m0..m6, m4b, m4c
    assert "frobnicate" not in str(m7["egressd_control_requests"].samples)

    # Tampering: seen and restored.
    assert value(m7, "egressd_tamper_restores") == 0
    rc, _, err = lab.nft(lab.sandbox, "delete", "table", "inet", "egressd")
    assert rc == 0, err
    labmod.wait_for(lambda: value(metrics(d), "egressd_tamper_restores") >= 1, 5.0, "a tamper restore in the metrics")
    assert value(metrics(d), "egressd_tamper_detected") >= 1


def listening(lab, pid: int) -> list[str]:
    """Listening TCP and bound UDP sockets of process `pid` in the sandbox: 'proto addr:port'."""
    cp = lab.sandbox.exec("ss", "-Hlntup")
    out = []
    for line in cp.stdout.splitlines():
        if f"pid={pid}," not in line:
            continue
        f = line.split()
        out.append(f"{f[0]} {f[4]}")
    return sorted(out)


def test_metrics_file_is_written_atomically_and_updated(lab, egressd):
    path = lab.tmp / "metrics" / "egressd.prom"
    path.parent.mkdir()
    d = egressd(POLICY, extra=["--metrics-file", str(path), "--metrics-interval", "0.2"])
    # There once egressd is ready, parsed by the reference parser.
    first = families(path.read_text())
    assert value(first, "egressd_generation") == 1
    assert value(first, "egressd_switches") == 0
    # It follows a switch within a few intervals.
    assert d.ctl("apply", "environment")[0] == 0

    def switched():
        m = families(path.read_text())
        return value(m, "egressd_switches") == 1 and value(m, "egressd_phase_info", phase="environment",
                                                            mode="public") == 1
    labmod.wait_for(switched, 5.0, "the metrics file to show the switch")
    # Only the file and, between a write and its rename, its temp file: nothing a collector
    # globbing *.prom would read half-written.
    assert {p.name for p in path.parent.iterdir()} <= {"egressd.prom", "egressd.prom.tmp"}
    # The same text as egressctl metrics (the same names).
    assert set(families(path.read_text())) == set(metrics(d))
    # Nothing listens for metrics: egressd's only sockets in the sandbox are its DNS proxy's.
    socks = listening(lab, d.pid)
    assert socks, "ss shows no socket of egressd at all (the DNS proxy's should be there)"
    assert all(re.fullmatch(r"(tcp|udp) (127\.0\.0\.1|\[::1\]):53", s) for s in socks), socks


@pytest.mark.parametrize("bad", ["missing-dir/egressd.prom", "a-directory", "a-directory/"])
def test_metrics_file_bad_path_is_refused_before_anything_changes(lab, egressd, bad):
    (lab.tmp / "a-directory").mkdir(exist_ok=True)
    path = f"{lab.tmp}/{bad}"
    d = egressd(POLICY, extra=["--metrics-file", path], start=False)
    cp = subprocess.run(d.argv(), capture_output=True, text=True, timeout=10)
    assert cp.returncode == 2, cp
    assert "--metrics-file" in cp.stderr and path.rstrip("/") in cp.stderr, cp.stderr
    rc, _, _ = lab.nft(lab.sandbox, "list", "table", "inet", "egressd")
    assert rc != 0, "a refused start installed a table"


def normalize(text: str) -> str:
    """nft text without what differs between two reads: handles, element expiry (it counts
    down), counter values (compared apart), and whitespace (line wrapping of element lists)."""
    text = re.sub(r"\s*# handle \d+", "", text)
    text = re.sub(r" expires [0-9dhms]+", "", text)
    text = re.sub(r"counter packets \d+ bytes \d+", "counter packets N bytes N", text)
    # A cgroup: egressd prints its id; nft prints the path instead when it finds one under
    # /sys/fs/cgroup (a cgroup v2 host), the id otherwise (this lab's hybrid hosts).
    text = re.sub(r'socket cgroupv2 level (\d+) (\d+|"[^"]*")', r"socket cgroupv2 level \1 CGROUP", text)
    return " ".join(text.split())


def counters(text: str) -> list[tuple[int, int]]:
    return [(int(p), int(b)) for p, b in re.findall(r"counter packets (\d+) bytes (\d+)", text)]


def listing(lab) -> str:
    out = []
    for family in ("inet", "netdev"):
        rc, text, err = lab.nft(lab.sandbox, "list", "table", family, "egressd")
        assert rc == 0, f"nft list table {family} egressd: {err}"
        out.append(text)
    return "".join(out)


def preresolved(lab):
    """Waits for the initial phase's pre-resolution, which egressd runs once it is ready: until
    its elements are in the kernel, two reads of the table may straddle their arrival."""
    labmod.wait_for(lambda: ALLOWED_V4 in lab.learned_set(4) and ALLOWED_V6 in lab.learned_set(6), 5.0,
                    "the pre-resolution of a.example.com in the learned sets")


def check_rules_equal_kernel(lab, d):
    rc, ours, err = d.ctl("rules")
    assert rc == 0, err
    theirs = listing(lab)
    assert normalize(ours) == normalize(theirs), f"egressctl rules:\n{ours}\nnft list:\n{theirs}"
    # Counters are the kernel's: read first, so never ahead of nft's later read.
    mine, kernel = counters(ours), counters(theirs)
    assert len(mine) == len(kernel)
    assert all(m[0] <= k[0] and m[1] <= k[1] for m, k in zip(mine, kernel)), (mine, kernel)
    return ours


def test_rules_are_the_kernels_tables_with_counters(lab, egressd):
    d = egressd(POLICY)
    preresolved(lab)
    # A learned name (elements with timeouts), a denied connect (a counter that moved).
    r = lab.dns_query("a.example.com")
    assert r.outcome == "ok" and ALLOWED_V4 in r.addresses, r
    assert lab.tcp_connect(DENIED_V4, 80) == "refused"
    text = check_rules_equal_kernel(lab, d)
    assert "table inet egressd" in text and "table netdev egressd" in text
    assert re.search(r"meta l4proto tcp counter packets [1-9]\d* bytes \d+ reject with tcp reset", text), text
    assert re.search(r"elements = \{[^}]*198\.51\.100\.10 timeout \d", text), text
    # The learned element names what it was learned for, as nft lists it (docs/pinning.md "Restarts").
    assert re.search(r'198\.51\.100\.10 timeout [0-9dhms]+ comment "a\.example\.com"', text), text
    # It is nft text: it loads as it is.
    fresh = lab.extra_netns("rules")
    # (A kernel without nft_queue cannot load pinning's `queue num 16` from text: see
    # test_enforcer.nft_loadable.)
    # nft -f names a cgroup only by its path under /sys/fs/cgroup, never by the id egressd lists:
    # chains own_sockets and own_input (egressd's own cgroup) are emptied, and the jumps to
    # own_sockets go.
    loadable = re.sub(r"\n\s*meta mark (!= )?0x[0-9a-f]{8} jump own_(sockets|nat)", "", text)
    loadable = re.sub(r"(chain own_(sockets|input|nat) \{)[^}]*\}", r"\1 }", loadable)
    rc, _, err = lab.nft(fresh, "-f", "-", input=nft_loadable(lab, loadable))
    assert rc == 0, f"nft -f of egressctl rules failed: {err}\n{loadable}"
    # Every mode, an inline policy (chains the kernel lists after the staged ones), and back.
    for args in (["verifier"], ["environment"], ["--mode", "allowlist", "--allow", "203.0.113.10"], ["agent"]):
        assert d.ctl("apply", *args)[0] == 0, args
        check_rules_equal_kernel(lab, d)


def test_network_policy_rules_prints_the_same_text(lab, egressd):
    d = egressd(POLICY)
    preresolved(lab)
    binary = labmod.egressd_binary().parent / "network-policy"
    env = dict(os.environ, EGRESSD_SOCKET=str(d.socket_path))
    cp = subprocess.run([str(binary), "rules"], capture_output=True, text=True, timeout=10, env=env)
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr == ""
    rc, ours, _ = d.ctl("rules")
    assert rc == 0
    assert normalize(cp.stdout) == normalize(ours)
    assert normalize(cp.stdout) == normalize(listing(lab))


def test_rules_refuses_while_the_table_differs(lab, egressd):
    """A table someone changed is never printed as if it were egressd's: until the tamper
    guard has put it back, `rules` fails naming the difference; after, it prints the table."""
    d = egressd(POLICY)
    preresolved(lab)
    rc, _, err = lab.nft(lab.sandbox, "add", "chain", "inet", "egressd", "intruder")
    assert rc == 0, err

    def answered():
        rc, out, err = d.ctl("rules")
        # Either the guard restored it already (equal to the kernel), or the reply says why not.
        if rc == 0:
            return "intruder" not in out
        assert rc == 1 and "differ" in err and "intruder" in err, (rc, err)
        return False
    labmod.wait_for(answered, 5.0, "rules once the tamper guard restored the table")
    check_rules_equal_kernel(lab, d)
