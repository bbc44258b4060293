"""The lab itself, without egressd: topology, servers, DNS, client helpers, cleanup.

These pass on any root Linux box with the packages of scripts/setup; if one fails, the
enforcer tests cannot be trusted either.
"""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

import lab as labmod
from lab import LOOPBACK, SERVERS, SERVERS_V4, SERVERS_V6, TCP_PORTS, UDP_PORTS, Lab, LabError, Netns

FAKE_EGRESSD = [sys.executable, str(labmod.HERE / "fake_egressd.py")]


def host_veths_into_lab() -> set[str]:
    """Host-namespace veths whose peer lives in a lab (egt-*) namespace. Other veths (a
    Podman bridge started by another suite or process) are none of the lab's business."""
    ids = json.loads(subprocess.run(["ip", "-j", "netns", "list-id"], capture_output=True, text=True,
                                    check=True).stdout or "[]")
    lab_ids = {i["nsid"] for i in ids if str(i.get("name", "")).startswith(labmod.PREFIX)}
    out = subprocess.run(["ip", "-j", "-d", "link", "show", "type", "veth"], capture_output=True, text=True,
                         check=True).stdout
    return {link["ifname"] for link in json.loads(out or "[]") if link.get("link_netnsid") in lab_ids}


def netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


# --- topology ------------------------------------------------------------------------------


def test_namespaces_are_unique_and_prefixed(lab):
    pid = os.getpid()
    assert lab.sandbox.name.startswith(f"egt-{pid}-") and lab.sandbox.name.endswith("-sb")
    assert lab.internet.name.startswith(f"egt-{pid}-") and lab.internet.name.endswith("-in")
    assert lab.sandbox.exists() and lab.internet.exists()
    with Lab() as other:
        assert {other.sandbox.name, other.internet.name}.isdisjoint({lab.sandbox.name, lab.internet.name})


def test_no_veth_end_in_host_namespace(lab):
    assert host_veths_into_lab() == set()
    # Each end reports its peer's namespace, and both are the lab's.
    sb = json.loads(lab.sandbox.ip("-j", "-d", "link", "show", "dev", labmod.SANDBOX_IF).stdout)[0]
    inet = json.loads(lab.internet.ip("-j", "-d", "link", "show", "dev", labmod.INTERNET_IF).stdout)[0]
    assert sb["linkinfo"]["info_kind"] == "veth" and inet["linkinfo"]["info_kind"] == "veth"
    assert "link_netnsid" in sb and "link_netnsid" in inet
    names = {link["ifname"] for link in json.loads(lab.sandbox.ip("-j", "link", "show").stdout)}
    assert names == {"lo", labmod.SANDBOX_IF}
    with Lab():
        assert host_veths_into_lab() == set()


def test_address_plan(lab):
    def addrs(ns, dev):
        info = json.loads(ns.ip("-j", "addr", "show", "dev", dev).stdout)[0]["addr_info"]
        for a in info:
            assert not a.get("tentative"), f"{a['local']} still tentative (DAD not disabled)"
        return {f"{a['local']}/{a['prefixlen']}" for a in info if a.get("scope") == "global"}

    assert addrs(lab.sandbox, "eth0") == {"192.0.2.2/24", "2001:db8:1::2/64"}
    assert addrs(lab.internet, "veth-sb") == {"192.0.2.1/24", "2001:db8:1::1/64"}
    assert addrs(lab.internet, "lo") == {f"{a}/32" for a in SERVERS_V4} | {f"{a}/128" for a in SERVERS_V6}
    v4 = lab.sandbox.ip("-j", "-4", "route", "show", "default").stdout
    v6 = lab.sandbox.ip("-j", "-6", "route", "show", "default").stdout
    assert json.loads(v4)[0]["gateway"] == "192.0.2.1"
    assert json.loads(v6)[0]["gateway"] == "2001:db8:1::1"
    assert lab.sandbox.exec("sysctl", "-n", "net.ipv6.conf.all.accept_dad").stdout.strip() == "0"


# --- servers and clients -------------------------------------------------------------------


@pytest.mark.parametrize("addr", SERVERS)
def test_tcp_udp_icmp_to_every_server(lab, addr):
    for port in TCP_PORTS:
        assert lab.tcp_connect(addr, port) == "ok", port
    for port in UDP_PORTS:
        assert lab.udp_exchange(addr, port) == "ok", port
    assert lab.ping(addr) == "ok"


def test_http_answer_names_the_server(lab):
    for addr in ("198.51.100.11", "2001:db8:2::11"):
        with lab.sandbox.socket(labmod.family_of(addr), socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect((addr, 80))
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        assert data.startswith(b"HTTP/1.0 200 OK")
        assert data.endswith(f"{addr}\n".encode())


def test_closed_port_is_refused(lab):
    for addr in ("198.51.100.10", "2001:db8:2::10"):
        assert lab.tcp_connect(addr, 9) == "refused"
        assert lab.udp_exchange(addr, 9) == "refused"


def test_sandbox_loopback_servers(lab):
    for addr in LOOPBACK + (labmod.SANDBOX_V4, labmod.SANDBOX_V6):
        assert lab.tcp_connect(addr, 7) == "ok"
        assert lab.udp_exchange(addr, 7) == "ok"
        assert lab.ping(addr) == "ok"


def test_internet_side_reaches_sandbox_servers(lab):
    for addr in (labmod.SANDBOX_V4, labmod.SANDBOX_V6):
        assert lab.internet.tcp_connect(addr, 7) == "ok"
        assert lab.internet.udp_exchange(addr, 7) == "ok"


def test_long_lived_flows(lab):
    flows = [lab.tcp_flow("198.51.100.10"), lab.udp_flow("198.51.100.10"),
             lab.tcp_flow("2001:db8:2::11", 443), lab.udp_flow("2001:db8:2::11", 443)]
    for _ in range(5):
        for f in flows:
            assert f.exchange() == "ok", f
    with pytest.raises(LabError):
        lab.tcp_flow("198.51.100.10", 9)


def test_clients_run_in_the_sandbox(lab):
    # The echo servers can see the client's address only through the connection itself.
    with lab.sandbox.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(("198.51.100.10", 7))
        assert s.getsockname()[0] == "192.0.2.2"
    with lab.internet.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
        s.connect(("2001:db8:2::10", 7))
        assert s.getsockname()[0] == "2001:db8:2::10"


# Rules like the ones egressd is meant to install, set with the nft CLI, so the helpers'
# reading of reject and drop is checked independently of egressd.
REJECT_RULES = """
table inet labcheck {
  chain out {
    type filter hook output priority 0; policy accept;
    oif lo accept
    ip daddr 198.51.100.10 accept
    ip6 daddr 2001:db8:2::10 accept
    meta l4proto tcp reject with tcp reset
    reject with icmpx admin-prohibited
  }
}
"""


def test_helpers_read_reject_and_drop(lab):
    cut = [lab.tcp_flow("198.51.100.11"), lab.tcp_flow("2001:db8:2::11")]
    cut_udp = [lab.udp_flow("198.51.100.11"), lab.udp_flow("2001:db8:2::11")]
    kept = [lab.tcp_flow("198.51.100.10"), lab.udp_flow("2001:db8:2::10")]
    rc, _, err = lab.nft(lab.sandbox, "-f", "-", input=REJECT_RULES)
    assert rc == 0, err

    for f in kept:
        assert f.exchange() == "ok", f
    for f in cut:
        out = f.exchange()
        assert out == "reset" and out.elapsed < 0.5, (f, out)
    for f in cut_udp:
        out = f.exchange()
        assert out == "unreachable" and out.prohibited and out.elapsed < 0.5, (f, out)
    for addr in ("198.51.100.11", "203.0.113.10", "2001:db8:2::11"):
        assert lab.tcp_connect(addr, 80) == "refused"
        udp = lab.udp_exchange(addr, 7)
        assert udp == "unreachable" and udp.prohibited, udp
        icmp = lab.ping(addr)
        assert icmp == "unreachable" and icmp.prohibited, icmp
    for addr in ("198.51.100.10", "2001:db8:2::10") + LOOPBACK:
        assert lab.tcp_connect(addr, 7) == "ok"
        assert lab.udp_exchange(addr, 7) == "ok"
        assert lab.ping(addr) == "ok"

    # A dropping rule: TCP times out, UDP/ICMP fail locally with no ICMP error.
    assert lab.nft(lab.sandbox, "flush chain inet labcheck out")[0] == 0
    assert lab.nft(lab.sandbox, "add rule inet labcheck out oif != lo drop")[0] == 0
    out = lab.tcp_connect("198.51.100.10", 7, timeout=0.3)
    assert out == "timeout" and out.detail == "no answer to the SYN", repr(out)
    udp = lab.udp_exchange("2001:db8:2::10", 7, timeout=0.3)
    assert udp in ("unreachable", "timeout") and not udp.prohibited, udp
    icmp = lab.ping("198.51.100.10", timeout=0.3)
    assert icmp in ("unreachable", "timeout") and not icmp.prohibited, icmp
    # The handshake passes, the request's segment (PSH) is dropped: a timeout that says so.
    assert lab.nft(lab.sandbox, "flush chain inet labcheck out")[0] == 0
    assert lab.nft(lab.sandbox, "add rule inet labcheck out oif != lo tcp flags & psh == psh drop")[0] == 0
    out = lab.tcp_connect("198.51.100.10", 7, timeout=0.3)
    assert out == "timeout" and out.detail.startswith("echo incomplete (0/"), repr(out)


def test_nft_helper_runs_in_the_namespace(lab):
    assert lab.nft(lab.sandbox, "add table inet labonly")[0] == 0
    rc, out, _ = lab.nft(lab.sandbox, "list", "tables")
    assert rc == 0 and "table inet labonly" in out
    rc, out, _ = lab.nft(lab.internet, "list tables")
    assert rc == 0 and "labonly" not in out
    fresh = lab.extra_netns()
    assert lab.nft(fresh, "list ruleset")[1].strip() == ""


# --- DNS -----------------------------------------------------------------------------------


@pytest.mark.parametrize("server", [labmod.DNS_V4, labmod.DNS_V6])
@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
def test_dnsmasq_answers(lab, server, tcp):
    r = lab.dns_query("a.example.com", "A", server=server, tcp=tcp)
    assert (r.outcome, r.rcode, r.addresses) == ("ok", "NOERROR", ["198.51.100.10"])
    assert r.ttl("198.51.100.10") == 60
    r = lab.dns_query("A.Example.COM", "AAAA", server=server, tcp=tcp)
    assert r.addresses == ["2001:db8:2::10"]
    r = lab.dns_query("www.example.com", "A", server=server, tcp=tcp)
    assert [(x.type, x.data) for x in r.records] == [("CNAME", "a.example.com"), ("A", "198.51.100.10")]
    r = lab.dns_query("txt.example.com", "TXT", server=server, tcp=tcp)
    assert [x.data for x in r.records] == ["egressd lab"]
    assert lab.dns_query("deep.x.wild.example.org", server=server, tcp=tcp).addresses == ["203.0.113.10"]
    assert lab.dns_query("unknown.example.com", server=server, tcp=tcp).rcode == "REFUSED"


def test_dnsmasq_logs_queries(lab):
    lab.dns_query("a.example.com")
    lab.dns_query("B.example.com", "AAAA", server=labmod.DNS_V6)
    lab.dns_query("secret-data.exfil.example.net")
    lab.dns.sync()
    assert lab.dns.query_names() == ["a.example.com", "B.example.com", "secret-data.exfil.example.net"]
    qs = lab.dns.queries()
    assert (qs[0].type, qs[0].source) == ("A", "192.0.2.2")
    assert (qs[1].type, qs[1].source) == ("AAAA", "2001:db8:1::2")


def test_dnsmasq_custom_records_and_ttl(lab):
    lab.dns.restart(hosts={"pypi.example.org": ["203.0.113.10", "2001:db8:2::11"]}, cnames={}, txt={},
                    wildcards={}, ttl=7)
    r = lab.dns_query("pypi.example.org")
    assert r.addresses == ["203.0.113.10"] and r.ttl("203.0.113.10") == 7
    assert lab.dns_query("a.example.com").rcode == "REFUSED"
    lab.dns.sync()
    assert lab.dns.query_names() == ["pypi.example.org", "a.example.com"]


# --- the Egressd helper (against a fake daemon) ----------------------------------------------


def test_egressd_helper_with_fake_daemon(lab):
    d = lab.egressd("phases: {}\n", phase="agent", binary=FAKE_EGRESSD)
    assert d.running and d.ready_path.exists()
    assert os.stat(d.socket_path).st_mode & 0o777 == 0o600
    assert d.request({"cmd": "ping"}) == {"ok": True}
    assert d.status()["phase"] == "agent"
    assert d.request("not json")["ok"] is False
    big = d.request_raw(b"x" * (3 << 20) + b"\n")
    assert big["ok"] is False and big["error"]["code"] == "too-large"
    assert "listening on" in d.log()
    d.kill(signal.SIGKILL)
    assert d.wait() == -signal.SIGKILL
    with pytest.raises(ConnectionRefusedError):
        d.request({"cmd": "ping"}, timeout=1)
    d.restart(phase="verifier")
    assert d.status()["phase"] == "verifier"
    assert d.stop() == 0
    assert d.log().count("--- ") == 2


def test_egressd_helper_reports_early_exit(lab):
    with pytest.raises(LabError, match="exited with 2 before ready"):
        lab.egressd("x", binary=[sys.executable, "-c", "import sys; print('bad flag'); sys.exit(2)"])
    with pytest.raises(LabError, match="ready file"):
        lab.egressd("x", binary=[sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)


# --- cleanup -------------------------------------------------------------------------------


def test_close_removes_namespaces_and_processes():
    lab = Lab().start()
    names = [lab.sandbox.name, lab.internet.name, lab.extra_netns().name]
    pids = [p.pid for p in lab._procs]
    flow = lab.tcp_flow("198.51.100.10")
    tmp = lab.tmp
    lab.close()
    assert netns_names().isdisjoint(names)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert flow.sock.fileno() == -1, "sockets made in the lab's namespaces are closed"
    assert not tmp.exists()
    lab.close()  # idempotent


def test_failed_start_cleans_up():
    lab = Lab(dns_options={"extra_args": ["--no-such-option"]})
    with pytest.raises(LabError, match="dnsmasq"):
        lab.start()
    assert netns_names().isdisjoint({lab.sandbox.name, lab.internet.name})


def _lab_process():
    """`lab.py up` in a child process: (Popen, sandbox name, internet name) once it is up."""
    p = subprocess.Popen([sys.executable, str(labmod.HERE / "lab.py"), "up", "--no-dns"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sb = labmod._read_line(p, 10, "lab.py up").split()[1]
    inet = labmod._read_line(p, 10, "lab.py up").split()[1]
    assert sb.startswith(f"egt-{p.pid}-") and inet.startswith(f"egt-{p.pid}-")
    labmod.wait_for(lambda: sb in netns_names() and inet in netns_names(), 5, "child lab")
    return p, sb, inet


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_cleans_up(sig):
    p, sb, inet = _lab_process()
    try:
        p.send_signal(sig)
        # The deadline is for a loaded machine (CI's ASan suite runs beside it): cleanup kills
        # the lab's servers and runs `ip netns` a dozen times; it failed once at 10 s there,
        # and once at 30 s in a lab run of its own: then the child's stacks say where it was.
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)  # lab.py: faulthandler prints every thread's stack
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            pytest.fail(f"lab.py up did not end within 30 s of {sig.name}; its stderr:\n"
                        + p.stderr.read().decode(errors="replace"))
        assert netns_names().isdisjoint({sb, inet})
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
        for name in (sb, inet):
            Netns(name).delete()


def test_sweeper_removes_stale_namespaces():
    p, sb, inet = _lab_process()
    p.kill()  # no chance to clean up: the namespaces (and its servers) stay behind
    p.wait(5)
    assert {sb, inet} <= netns_names()
    mine = Netns(f"egt-{os.getpid()}-9999-sb")
    mine.create()
    try:
        removed = labmod.sweep_stale()
        assert {sb, inet} <= set(removed)
        assert netns_names().isdisjoint({sb, inet})
        assert mine.exists(), "the sweeper must not touch namespaces of a live process"
    finally:
        mine.delete()
