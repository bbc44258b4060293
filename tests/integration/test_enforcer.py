"""egressd's enforcer against the real kernel, through its public interfaces only.

The contract (DESIGN §1, §2):
  egressd run --socket PATH --config FILE [--phase NAME] --netns PATH --ready-file PATH
              [--cleanup-on-exit]
  egressd render --config FILE --phase NAME
  egressctl --socket PATH apply PHASE | apply --mode MODE [--allow ENTRY]... |
            status --json | capabilities --json          exit 0 ok, 1 runtime, 2 invalid input
  socket: one JSON object per line each way; replies {"ok":true,...} or
          {"ok":false,"error":{"code":...,"message":...}}
  denied packets are rejected: TCP with a reset (connect -> refused), UDP and ICMP with
  ICMP(v6) administratively prohibited; nft table `inet egressd`.
"""
import contextlib
import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

import lab as labmod
from lab import LOOPBACK, SERVERS, SERVERS_V4, SERVERS_V6

POLICY = """\
initial_phase: environment
dns: { upstream: ["192.0.2.1"] }
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: ["198.51.100.10", "2001:db8:2::/64"]
  verifier: { network_mode: no-network }
  empty: { network_mode: allowlist, allowed_hosts: [] }
"""

PHASE_MODE = {"environment": "public", "agent": "allowlist", "verifier": "no-network", "empty": "allowlist"}
REACHABLE = {
    "environment": set(SERVERS),
    "agent": {"198.51.100.10", "2001:db8:2::10", "2001:db8:2::11"},
    "verifier": set(),
    "empty": set(),
}
PROTOS = ("tcp", "udp", "icmp")
FAST = 0.5  # s: a rejected packet is answered at once; anything slower means it was dropped


def probe(lab, addr, proto, timeout=1.0):
    if proto == "tcp":
        return lab.tcp_connect(addr, 80, timeout=timeout)
    if proto == "udp":
        return lab.udp_verdict(addr, 443, timeout=timeout)
    return lab.ping(addr, timeout=timeout)


def rejected(out, proto) -> bool:
    """The way DESIGN says a denied packet fails: quickly, with RST or admin-prohibited."""
    if out.elapsed >= FAST:
        return False
    return out == "refused" if proto == "tcp" else (out == "unreachable" and out.prohibited)


def check_reachability(lab, allowed, addrs=SERVERS, protos=PROTOS):
    """Every (proto, addr) is 'ok' if addr is in allowed, else rejected; all mismatches listed."""
    wrong = []
    for addr in addrs:
        for proto in protos:
            out = probe(lab, addr, proto)
            good = out == "ok" if addr in allowed else rejected(out, proto)
            if not good:
                want = "ok" if addr in allowed else ("TCP reset" if proto == "tcp" else "ICMP admin-prohibited")
                wrong.append(f"{proto} {addr}: got {out!r}, want {want}")
    assert not wrong, "\n".join(wrong)


def check_loopback(lab):
    for addr in LOOPBACK:
        assert lab.tcp_connect(addr, 7) == "ok", addr
        assert lab.udp_exchange(addr, 7) == "ok", addr
        assert lab.ping(addr) == "ok", addr


def assert_error_reply(reply, *words):
    assert reply.get("ok") is False, reply
    err = reply.get("error")
    assert isinstance(err, dict) and err.get("code") and err.get("message"), reply
    for w in words:
        assert w in err["message"], reply


def table_exists(lab) -> bool:
    return lab.nft(lab.sandbox, "list", "table", "inet", "egressd")[0] == 0


# --- modes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", [4, 6], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("phase", ["environment", "agent", "verifier"],
                         ids=["public", "allowlist", "no-network"])
def test_mode(lab, egressd, phase, family):
    d = egressd(POLICY, phase=phase)
    st = d.status()
    assert (st["phase"], st["mode"]) == (phase, PHASE_MODE[phase])
    check_reachability(lab, REACHABLE[phase], addrs=SERVERS_V4 if family == 4 else SERVERS_V6)
    check_loopback(lab)


def test_empty_allowlist_denies_everything(lab, egressd):
    d = egressd(POLICY, phase="empty")
    assert d.status()["mode"] == "allowlist"
    check_reachability(lab, set())
    check_loopback(lab)
    rc, _, err = d.ctl("apply", "--mode", "allowlist")  # inline, no entries
    assert rc == 0, err
    check_reachability(lab, set())


def test_initial_phase_from_config(lab, egressd):
    d = egressd(POLICY)
    st = d.status()
    assert (st["phase"], st["mode"]) == ("environment", "public")
    check_reachability(lab, set(SERVERS))
    assert table_exists(lab)


def test_connections_from_outside_are_answered(lab, egressd):
    """Replies to connections the internet side opened into the sandbox pass by default."""
    egressd(POLICY, phase="verifier")
    for addr in (labmod.SANDBOX_V4, labmod.SANDBOX_V6):
        assert lab.internet.tcp_connect(addr, 7) == "ok", addr
        assert lab.internet.udp_exchange(addr, 7) == "ok", addr
    check_reachability(lab, set(), addrs=("198.51.100.10", "2001:db8:2::10"))


# --- switching -----------------------------------------------------------------------------


def test_switch_matrix(lab, egressd):
    d = egressd(POLICY)
    gen = d.status()["generation"]
    assert isinstance(gen, int)
    check_reachability(lab, REACHABLE["environment"])
    for step, phase in enumerate(["agent", "verifier", "environment"], start=1):
        rc, _, err = d.ctl("apply", phase)
        assert rc == 0, f"apply {phase}: {err}"
        st = d.ctl_json("status", "--json")
        assert (st["phase"], st["mode"], st["generation"]) == (phase, PHASE_MODE[phase], gen + step)
        check_reachability(lab, REACHABLE[phase])
        check_loopback(lab)


def test_switch_over_the_socket(lab, egressd):
    d = egressd(POLICY)
    gen = d.status()["generation"]
    reply = d.request({"cmd": "apply", "phase": "agent"})
    assert reply.get("ok") is True, reply
    assert reply.get("generation") == gen + 1, reply
    check_reachability(lab, REACHABLE["agent"])
    assert d.request({"cmd": "ping"}).get("ok") is True


def test_inline_policies(lab, egressd):
    d = egressd(POLICY)
    gen = d.status()["generation"]

    rc, _, err = d.ctl("apply", "--mode", "allowlist", "--allow", "203.0.113.10", "--allow", "2001:db8:2::11")
    assert rc == 0, err
    st = d.ctl_json("status", "--json")
    assert (st["mode"], st["generation"]) == ("allowlist", gen + 1)
    assert {(e["entry"], e["kind"]) for e in st["entries"]} == {("203.0.113.10", "ipv4"), ("2001:db8:2::11", "ipv6")}
    check_reachability(lab, {"203.0.113.10", "2001:db8:2::11"})

    reply = d.request({"cmd": "apply", "mode": "allowlist", "allow": ["198.51.100.0/24"]})
    assert reply.get("ok") is True, reply
    assert d.status()["generation"] == gen + 2
    check_reachability(lab, {"198.51.100.10", "198.51.100.11"})

    assert d.ctl("apply", "--mode", "no-network")[0] == 0
    check_reachability(lab, set())
    check_loopback(lab)
    assert d.ctl("apply", "--mode", "public")[0] == 0
    assert d.status()["generation"] == gen + 4
    check_reachability(lab, set(SERVERS))


def test_switch_cuts_established_flows(lab, egressd):
    d = egressd(POLICY, phase="environment")
    tcp = [lab.tcp_flow(a) for a in ("198.51.100.11", "2001:db8:2::11")]
    udp = [lab.udp_flow(a) for a in ("198.51.100.11", "2001:db8:2::11")]
    assert d.ctl("apply", "verifier")[0] == 0
    wrong = []
    for f in tcp:
        out = f.exchange(timeout=2.0)
        if out != "reset" or out.elapsed >= 1.0:
            wrong.append(f"{f}: {out!r}, want reset within 1 s")
    for f in udp:
        out = f.exchange(timeout=2.0)
        if out not in ("unreachable", "reset") or out.elapsed >= 1.0:
            wrong.append(f"{f}: {out!r}, want ICMP error / abort within 1 s")
    assert not wrong, "\n".join(wrong)


NAMED = """\
initial_phase: environment
dns: { upstream: ["192.0.2.1"] }
phases:
  environment: public
  named: { network_mode: allowlist, allowed_hosts: [a.example.com] }
"""


@pytest.mark.parametrize("family", [4, 6])
def test_a_flow_a_switch_to_a_named_allowlist_cuts_is_reset_at_once(lab, egressd, family):
    """A phase with hostname entries makes the flow reaper keep every peer (a learned address
    may allow it), so what tells the client is the rules: the deny answers the flow's next
    packet with a TCP reset, which comes from the server's address over `lo`. That reset used
    to meet the forged-source check, and the client retransmitted into the rejects until its
    own timeout (seen as "timeout" in scripts/demo). ECONNRESET, not ECONNABORTED: the rules'
    reset, not the reaper's abort."""
    d = egressd(NAMED, phase="environment")
    server = SERVERS_V4[1] if family == 4 else SERVERS_V6[1]  # not a.example.com's address
    flow, udp = lab.tcp_flow(server), lab.udp_flow(server)
    try:
        assert d.ctl("apply", "named")[0] == 0
        out = flow.exchange(timeout=2.0)
        assert out == "reset" and out.detail == "ECONNRESET" and out.elapsed < FAST, \
            f"{flow}: {out!r}, want the deny's reset (ECONNRESET) within {FAST} s"
        # A connected UDP socket the reaper keeps too: the deny's ICMP error (from a local
        # address, so no exemption is needed) fails its next send.
        out = udp.exchange(timeout=2.0)
        assert out == "unreachable" and out.prohibited and out.elapsed < FAST, \
            f"{udp}: {out!r}, want admin-prohibited within {FAST} s"
    finally:
        flow.close()
        udp.close()
    assert "aborted sockets=1" not in d.log(), "the reaper aborted the flow: this test no longer sees the rules' reset"
    # The name's own address (resolved by the switch) goes on working in the same phase.
    assert lab.tcp_connect(SERVERS_V4[0] if family == 4 else SERVERS_V6[0], 80, timeout=1.0) == "ok"


@pytest.mark.parametrize("family", [4, 6])
def test_a_connection_opened_from_outside_survives_a_switch_to_no_network(lab, egressd, family):
    """enforce.inbound_replies (default on): a connection a remote host opened to a server in
    the sandbox keeps working after the switch to no-network that cuts the sandbox's own flows;
    the flow reaper, which runs after the switch, tells the two apart by the listening port."""
    d = egressd(POLICY, phase="environment")
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    addr = labmod.SANDBOX_V4 if family == 4 else labmod.SANDBOX_V6
    srv = lab.sandbox.socket(af, socket.SOCK_STREAM)
    srv.bind((addr, 0))
    srv.listen(1)
    srv.settimeout(5.0)
    remote = lab.internet.socket(af, socket.SOCK_STREAM)
    remote.settimeout(5.0)
    remote.connect(srv.getsockname()[:2])
    conn, _ = srv.accept()
    conn.settimeout(5.0)
    try:
        remote.sendall(b"before")
        assert conn.recv(16) == b"before"
        # The sandbox's own flow no-network cuts: its abort is what shows the reaper has run.
        canary = lab.udp_flow(SERVERS_V4[0] if family == 4 else SERVERS_V6[0])
        aborted = labmod.switch_and_wait_for_reaper(d, canary, "verifier")
        assert aborted == 1, "the reaper aborted more than the canary"
        remote.sendall(b"after")
        assert conn.recv(16) == b"after", "the connection opened from outside was cut"
        conn.sendall(b"reply")
        assert remote.recv(16) == b"reply", "the reply to the connection opened from outside was dropped"
    finally:
        for s in (conn, remote, srv):
            s.close()


# A sandbox process that opens and closes sockets as fast as it can: TCP listeners ("listen")
# or bound UDP sockets ("udp"). It tries to make the flow reaper take the namespace for one
# without flows (issue 17's attack view on the reaper's shortcut). argv: kind, address family
# (4 or 6), bind address. Prints "ready" once churning.
_SOCKET_CHURN = """
import socket, sys
fam = socket.AF_INET if sys.argv[2] == "4" else socket.AF_INET6
udp = sys.argv[1] == "udp"
print("ready", flush=True)
while True:
    s = socket.socket(fam, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
    s.bind((sys.argv[3], 0))
    if not udp:
        s.listen(1)
    s.close()
"""


@contextlib.contextmanager
def socket_churn(lab, kind: str, family: int):
    """_SOCKET_CHURN running in the sandbox for the duration of the block."""
    addr = labmod.SANDBOX_V4 if family == 4 else labmod.SANDBOX_V6
    churn = subprocess.Popen(["ip", "netns", "exec", lab.sandbox.name, "python3", "-c", _SOCKET_CHURN, kind,
                              str(family), addr], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert labmod._read_line(churn, 5.0, f"the {kind} socket churn to start").strip() == "ready"
        yield
    finally:
        labmod._stop_process(churn)


_TCP_CLOSE = 7  # <netinet/tcp.h> TCP_CLOSE: the state of a socket the reaper aborted


@pytest.mark.parametrize("family", [4, 6])
def test_listener_churn_does_not_hide_a_flow_from_the_reaper(lab, egressd, family):
    """The reaper skips the costly dump of TCP flows when the namespace holds no TCP socket but
    egressd's own listeners. A sandbox process that opens and closes listeners without pause
    while it holds an outbound flow must not make that shortcut keep its flow: at every switch
    to no-network the flow is aborted (its socket closed, not only its packets rejected), and
    its bytes never reach the server."""
    d = egressd(POLICY, phase="environment")
    servers = SERVERS_V4 if family == 4 else SERVERS_V6
    with socket_churn(lab, "listen", family):
        for round_ in range(40):
            flow = lab.tcp_flow(servers[0])
            # A connected UDP socket: the reaper lists UDP after TCP, so its abort (the log
            # line) shows the reaper has decided about the TCP flow.
            canary = lab.udp_flow(servers[1])
            assert d.ctl("apply", "verifier")[0] == 0
            gen = d.status()["generation"]
            reaped = re.compile(rf"aborted sockets=(\d+) gen={gen} ")
            labmod.wait_for(lambda: reaped.search(d.log()), 5.0, f"round {round_}: the reaper to abort the canary")
            state = flow.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
            assert state == _TCP_CLOSE, f"round {round_}: the flow survived the reaper (tcp state {state})"
            assert flow.exchange(timeout=1.0) != "ok"
            flow.close()
            canary.close()
            assert d.ctl("apply", "environment")[0] == 0


@pytest.mark.parametrize("family", [4, 6])
def test_udp_socket_churn_does_not_hide_a_udp_flow_from_the_reaper(lab, egressd, family):
    """The reaper skips the dump of UDP sockets (a walk of the host's whole UDP hash) when the
    namespace's only UDP sockets are egressd's own DNS listeners. A sandbox process that binds
    and closes UDP sockets without pause while it holds a connected UDP socket must not make
    that shortcut keep its flow: at every switch to no-network the socket is aborted."""
    d = egressd(POLICY, phase="environment")
    servers = SERVERS_V4 if family == 4 else SERVERS_V6
    with socket_churn(lab, "udp", family):
        for round_ in range(20):
            flow = lab.udp_flow(servers[1])
            assert d.ctl("apply", "verifier")[0] == 0
            gen = d.status()["generation"]
            reaped = re.compile(rf"aborted sockets=(\d+) gen={gen} ")
            labmod.wait_for(lambda: reaped.search(d.log()), 5.0, f"round {round_}: the reaper to abort the udp flow")
            err = flow.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            assert err == errno.ECONNABORTED, f"round {round_}: the udp socket was not aborted (SO_ERROR {err})"
            flow.close()
            assert d.ctl("apply", "environment")[0] == 0


@pytest.mark.parametrize("family", [4, 6])
def test_an_outbound_flow_dressed_as_inbound_is_still_cut(lab, egressd, family):
    """The flow reaper takes a TCP socket for inbound (kept with enforce.inbound_replies) when
    its local port is a listening port. A sandbox process can give its own outbound flow that
    port: a listener and the flow's socket share it with SO_REUSEPORT. The reaper is fooled and
    keeps the socket; the rules are not: the flow's next bytes are denied, and the deny's reset
    (from the server's address over `lo`, related to the flow) tears it down at once."""
    d = egressd(POLICY, phase="environment")
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    addr = labmod.SANDBOX_V4 if family == 4 else labmod.SANDBOX_V6
    servers = SERVERS_V4 if family == 4 else SERVERS_V6
    wildcard = "0.0.0.0" if family == 4 else "::"
    srv = lab.sandbox.socket(af, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    srv.bind((wildcard, 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    s = lab.sandbox.socket(af, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((addr, port))
    s.settimeout(2.0)
    s.connect((servers[0], labmod.ECHO_PORT))
    flow = labmod.TcpFlow(s, servers[0], labmod.ECHO_PORT)
    canary = None
    try:
        assert flow.exchange() == "ok"
        canary = lab.udp_flow(servers[1])  # a socket the reaper does abort: its log line says it ran
        assert d.ctl("apply", "verifier")[0] == 0
        gen = d.status()["generation"]
        reaped = re.compile(rf"aborted sockets=(\d+) gen={gen} ")
        labmod.wait_for(lambda: reaped.search(d.log()), 5.0, "the reaper to abort the canary")
        state = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        assert state == 1, f"tcp state {state}: the reaper aborted the flow (update this test: it is not fooled now)"
        before = d.status()["counters"]["denied_packets"]
        out = flow.exchange(timeout=1.0)
        assert out == "reset" and out.detail == "ECONNRESET" and out.elapsed < FAST, \
            f"a flow no-network cut: {out!r}, want the deny's reset within {FAST} s"
        # Its packets met the deny (and were not merely lost on the way).
        assert d.status()["counters"]["denied_packets"] > before
    finally:
        flow.close()
        if canary is not None:
            canary.close()
        srv.close()


# The phases of the inbound-revival tests: an allowlist by address and one by name (the flow
# reaper spares every flow there, a name's addresses being unknown to it).
REVIVE_POLICY = """\
initial_phase: environment
dns: { upstream: ["192.0.2.1"] }
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: ["198.51.100.10", "2001:db8:2::/64"]
  verifier: { network_mode: no-network }
  named:
    network_mode: allowlist
    allowed_hosts: ["a.example.com"]
"""
REVIVE_PORT = 9000
DOCKER_CAPS = "-all,+net_raw,+net_bind_service"


def _lines_until(p: subprocess.Popen, want: str, timeout: float, what: str) -> list[str]:
    """p's stdout lines up to and including the first that starts with one of `want`'s
    |-separated words (LabError after timeout s)."""
    deadline = time.monotonic() + timeout
    lines = []
    while True:
        line = labmod._read_line(p, max(0.01, deadline - time.monotonic()), what)
        lines.append(line)
        if any(line.startswith(w) for w in want.split("|")):
            return lines


def revive(lab, egressd, phase: str, family: int, mode: str, listener: str, inbound: bool = True) -> dict:
    """inbound_revive_attacker.py against inbound_revive_server.py across a switch from public to
    `phase`. Returns the attacker's result with "leaked" (the server received the bytes the
    sandbox sent after the switch) and "server" (what the server printed)."""
    config = REVIVE_POLICY if inbound else REVIVE_POLICY.replace("phases:", "enforce: { inbound_replies: false }\nphases:")
    d = egressd(config, phase="environment")
    remote = SERVERS_V4[2] if family == 4 else SERVERS_V6[2]
    canary_addr = SERVERS_V4[1] if family == 4 else SERVERS_V6[2]  # cut by every phase here
    srv = lab.spawn([sys.executable, labmod.HERE / "inbound_revive_server.py", remote, REVIVE_PORT],
                    netns=lab.internet, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert labmod._read_line(srv, 10.0, "the revive server") == "READY"
    token = os.urandom(6).hex()
    att = lab.spawn(["setpriv", f"--inh-caps={DOCKER_CAPS}", f"--bounding-set={DOCKER_CAPS}", "--",
                     sys.executable, labmod.HERE / "inbound_revive_attacker.py", remote, REVIVE_PORT, mode, listener,
                     token],
                    netns=lab.sandbox, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert labmod._read_line(att, 10.0, "the attacker") == "READY"
    server = _lines_until(srv, "RX", 5.0, "the revive server to receive the hello")
    if phase == "named":
        # An allowlist by name: the reaper aborts nothing (no canary's abort to wait for).
        assert d.ctl("apply", phase)[0] == 0
    else:
        canary = lab.udp_flow(canary_addr)
        try:
            labmod.switch_and_wait_for_reaper(d, canary, phase)
        finally:
            canary.close()
    att.stdin.write(b"go\n")
    att.stdin.flush()
    assert labmod._read_line(att, 10.0, "the attacker to forge") == "FORGED"
    # Conntrack has taken the raw segments (sendto returned): the server's next segment now.
    srv.stdin.write(b"send\n")
    srv.stdin.flush()
    server += _lines_until(srv, "SENT|NOCONN|ERR", 5.0, "the revive server to send")
    out, err = att.communicate(timeout=30)
    assert att.returncode == 0, err.decode(errors="replace")
    res = json.loads((getattr(att, "_lab_pending", b"") + out).decode().strip().splitlines()[-1])
    srv.stdin.write(b"quit\n")
    srv.stdin.flush()
    rest, _ = srv.communicate(timeout=10)
    server += (getattr(srv, "_lab_pending", b"") + rest).decode().splitlines()
    received = b"".join(bytes.fromhex(line[3:]) for line in server if line.startswith("RX "))
    res["leaked"] = f"SECRET-{token}".encode() in received
    res["server"] = server
    # The phase in force refuses a fresh connection to the server.
    assert lab.tcp_connect(remote, labmod.ECHO_PORT, timeout=1.0) != "ok"
    return res


@pytest.mark.parametrize("phase,family", [("verifier", 4), ("verifier", 6), ("agent", 4), ("named", 4)])
def test_an_outbound_flow_forgotten_by_conntrack_does_not_come_back_as_inbound(lab, egressd, phase, family):
    """Found in an attack review (NET_RAW, enforce.inbound_replies): a sandbox process kept a TCP
    connection it opened under public alive after a switch. Its listener shares the flow's port
    (SO_REUSEPORT), so the flow reaper takes the flow for an accepted one and spares it (in an
    allowlist by name it spares every flow). After the switch it sends an in-window RST and a
    SYN on the flow's tuple from a raw socket: both denied, but conntrack took them first and
    forgot the flow. The server's next segment then started a new conntrack entry mid-stream,
    `ct state new` from outside, which chain input marked INBOUND, and every packet of the
    sandbox on the connection left as a reply to an inbound flow. A TCP flow is inbound now
    only if it began with a SYN from outside: the sandbox's answer is judged by the phase and
    refused, and its bytes never reach the server."""
    listener = "nolistener" if phase == "named" else "listener"
    res = revive(lab, egressd, phase, family, "rst_syn", listener)
    assert res["forge_errors"] == ["Operation not permitted"] * 2, res
    assert any(line == "SENT" for line in res["server"]), res
    assert not res["leaked"], f"the sandbox's bytes reached the server after the switch to {phase}: {res}"
    assert "GOT" not in res.get("answer", ""), res
    # The server's segment reached the socket as before; the socket's answer (its ACK, or the
    # secret it carries) met the deny, whose reset ended the connection.
    assert res["got"] == "HB\n", res
    assert "Connection reset by peer" in (res.get("secret"), res.get("answer")), res


@pytest.mark.parametrize("mode,listener,inbound", [("none", "listener", True), ("rst_syn", "nolistener", True),
                                                   ("rst_syn", "listener", False)])
def test_revival_controls_hold(lab, egressd, mode, listener, inbound):
    """The controls of the attack above, which held before its fix too: without the raw
    segments the flow keeps its entry and the switch cuts it; without the listener the reaper
    aborts the socket; without enforce.inbound_replies nothing is marked INBOUND."""
    res = revive(lab, egressd, "verifier", 4, mode, listener, inbound)
    assert not res["leaked"], res
    assert "GOT" not in res.get("answer", ""), res


def test_switch_keeps_allowed_flows(lab, egressd):
    d = egressd(POLICY, phase="environment")
    keep = [lab.tcp_flow("198.51.100.10"), lab.udp_flow("198.51.100.10"),
            lab.tcp_flow("2001:db8:2::10", 443), lab.udp_flow("2001:db8:2::11", 443)]
    cut = [lab.tcp_flow("203.0.113.10"), lab.udp_flow("198.51.100.11")]
    assert d.ctl("apply", "agent")[0] == 0
    for f in keep:
        assert f.exchange() == "ok", f
    for f in cut:
        assert f.exchange() != "ok", f
    # allowlist -> another allowlist that still has 198.51.100.10
    assert d.ctl("apply", "--mode", "allowlist", "--allow", "198.51.100.0/24")[0] == 0
    assert keep[0].exchange() == "ok" and keep[1].exchange() == "ok"
    assert keep[2].exchange() != "ok"


# --- bad input -----------------------------------------------------------------------------


def _garbage(d):
    assert_error_reply(d.request(b"this is not json"))


def _huge(d):
    pad = "x" * (3 << 20)
    line = json.dumps({"cmd": "apply", "mode": "no-network", "pad": pad}).encode() + b"\n"
    assert len(line) > 3_000_000
    assert_error_reply(d.request_raw(line, timeout=10))


def _unknown_command(d):
    assert_error_reply(d.request({"cmd": "frobnicate"}))


def _not_an_object(d):
    assert_error_reply(d.request(b'["apply", "verifier"]'))


def _unknown_phase(d):
    rc, _, err = d.ctl("apply", "nosuch")
    assert rc == 2 and "nosuch" in err, (rc, err)
    assert_error_reply(d.request({"cmd": "apply", "phase": "nosuch"}), "nosuch")


def _invalid_entry(d):
    rc, _, err = d.ctl("apply", "--mode", "allowlist", "--allow", "198.51.100.11", "--allow", "pypi.org:443")
    assert rc == 2 and "pypi.org:443" in err, (rc, err)
    reply = d.request({"cmd": "apply", "mode": "allowlist", "allow": ["198.51.100.11", "api.*.example.org"]})
    assert_error_reply(reply, "api.*.example.org")


def _invalid_mode(d):
    rc, _, err = d.ctl("apply", "--mode", "everything")
    assert rc == 2, (rc, err)
    assert_error_reply(d.request({"cmd": "apply", "mode": "public", "allow": ["198.51.100.11"]}))


BAD_INPUTS = [_garbage, _huge, _unknown_command, _not_an_object, _unknown_phase, _invalid_entry, _invalid_mode]


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=lambda f: f.__name__.strip("_"))
def test_bad_input_changes_nothing(lab, egressd, bad):
    d = egressd(POLICY, phase="agent")
    before = d.status()
    bad(d)
    after = d.status()
    assert (after["phase"], after["mode"], after["generation"]) == \
        (before["phase"], before["mode"], before["generation"])
    check_reachability(lab, REACHABLE["agent"], addrs=("198.51.100.10", "198.51.100.11", "2001:db8:2::10"))
    assert d.request({"cmd": "ping"}).get("ok") is True


# --- lifecycle -----------------------------------------------------------------------------


def test_kill9_fails_closed_and_restart_adopts(lab, egressd):
    d = egressd(POLICY)
    assert d.ctl("apply", "agent")[0] == 0
    st = d.status()
    d.kill(signal.SIGKILL)
    assert d.wait() == -signal.SIGKILL
    assert table_exists(lab)
    check_reachability(lab, REACHABLE["agent"])
    d.restart()  # same arguments: no --phase, the file's initial phase is `environment`
    again = d.status()
    assert (again["phase"], again["mode"], again["generation"]) == (st["phase"], st["mode"], st["generation"])
    check_reachability(lab, REACHABLE["agent"])
    reply = d.request({"cmd": "apply", "phase": "verifier"})
    assert reply.get("ok") is True and d.status()["generation"] == st["generation"] + 1, reply


def test_sigterm_leaves_policy_in_force(lab, egressd):
    d = egressd(POLICY, phase="agent")
    assert d.stop(signal.SIGTERM) == 0
    assert table_exists(lab)
    check_reachability(lab, REACHABLE["agent"])


def test_cleanup_on_exit_removes_table(lab, egressd):
    d = egressd(POLICY, phase="verifier", extra=["--cleanup-on-exit"])
    assert table_exists(lab)
    assert d.stop(signal.SIGTERM) == 0
    assert not table_exists(lab)
    check_reachability(lab, set(SERVERS))


# --- control socket ------------------------------------------------------------------------


def test_socket_is_private_and_not_abstract(lab, egressd):
    d = egressd(POLICY, phase="agent")
    st = os.stat(d.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(stat.S_IMODE(st.st_mode))
    unix = lab.sandbox.read_proc("/proc/net/unix").splitlines()[1:]
    abstract = [line for line in unix if len(line.split()) >= 8 and line.split()[7].startswith("@")]
    assert not abstract, "abstract unix sockets visible in the sandbox:\n" + "\n".join(abstract)
    ss = lab.sandbox.exec("ss", "-xlpn").stdout
    assert not [line for line in ss.splitlines() if "@" in line and "egressd" in line], ss


def test_concurrent_clients(lab, egressd):
    d = egressd(POLICY, phase="agent")
    idle = [d.connect() for _ in range(3)]  # clients that never send must not block others
    n = 20
    barrier = threading.Barrier(n, timeout=10)
    replies = [None] * n

    def client(i):
        barrier.wait()
        try:
            replies[i] = d.request({"cmd": "status"} if i % 2 else {"cmd": "ping"}, timeout=10)
        except Exception as e:  # reported below with the others
            replies[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(isinstance(r, dict) and r.get("ok") is True for r in replies), replies
    assert all(r["generation"] == replies[1]["generation"] for r in replies[1::2])

    procs = [subprocess.Popen([str(labmod.egressctl_binary()), "--socket", str(d.socket_path), "status", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [p.communicate(timeout=20) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, outs
    assert all(json.loads(o)["phase"] == "agent" for o, _ in outs)
    for s in idle:
        s.close()


def test_status_json_shape(lab, egressd):
    d = egressd(POLICY, phase="agent")
    st = d.ctl_json("status", "--json")
    for key in ("phase", "mode", "generation", "entries", "counters"):
        assert key in st, key
    assert (st["phase"], st["mode"]) == ("agent", "allowlist")
    assert isinstance(st["generation"], int) and isinstance(st["counters"], dict)
    assert all({"entry", "kind", "state"} <= e.keys() for e in st["entries"]), st["entries"]
    assert {(e["entry"], e["kind"]) for e in st["entries"]} == {("198.51.100.10", "ipv4"),
                                                                ("2001:db8:2::/64", "ipv6-cidr")}


def test_capabilities(lab, egressd):
    d = egressd(POLICY)
    caps = d.ctl_json("capabilities", "--json")
    assert isinstance(caps, dict) and caps
    reply = d.request({"cmd": "capabilities"})
    assert reply.get("ok") is True, reply
    # This kernel (>= 5.16) has the netdev egress hook, fib and socket matching: egressd
    # claims raw-frame blocking here, and only where the probe found the hook.
    got = reply["capabilities"]
    assert got["block_raw_frames"] is True and got["fib_match"] is True and got["socket_match"] is True, got


def test_egressctl_exit_code_without_daemon(tmp_path, egressd_binaries):
    cp = labmod.run([labmod.egressctl_binary(), "--socket", tmp_path / "nothing-here.sock", "status", "--json"],
                    check=False)
    assert cp.returncode == 1, cp
    assert cp.stderr.strip(), "a runtime failure explains itself on stderr"


# --- render == kernel ----------------------------------------------------------------------


def normalize_ruleset(text: str) -> str:
    """nft listing without what legitimately differs between two namespaces: handles, counter
    values, element expiry times, and the table's secrets (the daemon draws its own mark, pass
    signature and mark salt per table; `render` prints the defaults), so also the phase marks
    derived from the salt; and the elements of set onlink6 (below). The fixed ct marks (INBOUND 0x7fffffff, egressd's own flows
    0x7ffffffe) are kept: they are the same everywhere."""
    # Hostname pinning's queue rule: netlink sends xtables' NFQUEUE target (nft_compat, any
    # kernel with xt_NFQUEUE), which nft lists as `queue num N` after a warning line; see
    # nft_loadable for kernels without nft_queue.
    text = re.sub(r"^# Warning: table \S+ \S+ is managed by iptables-nft, do not touch!\n", "", text, flags=re.M)
    text = re.sub(r'drop comment "pin-queue (\d+)"', r"queue num \1", text)
    text = re.sub(r"\s*# handle \d+", "", text)
    text = re.sub(r"(meta mark|socket mark) (!= |set )?0x[0-9a-f]{8}", r"\1 \2SECRET", text)
    text = re.sub(r"meta priority (!= |set )?[0-9a-f]+:[0-9a-f]+", r"meta priority \1SECRET", text)
    text = re.sub(r"ct mark (set )?0x(?!7ffffff[ef])[0-9a-f]{8}", r"ct mark \1PHASE", text)
    text = re.sub(r"mark=0x[0-9a-f]{8}", "mark=M", text)
    # The table comment: the digest covers the staged rules, secrets excluded.
    text = re.sub(r"digest=[0-9a-f]{16} mark=M pass=0x[0-9a-f]{8}:0x[0-9a-f]{8} salt=0x[0-9a-f]{8} proxy=0x[0-9a-f]{8} pin=0x[0-9a-f]{8}\"",
                  'digest=D mark=M pass=P salt=S proxy=Q pin=N"', text)
    text = re.sub(r"counter packets \d+ bytes \d+", "counter packets 0 bytes 0", text)
    # egressd's own cgroup (chains own_sockets and own_input, the jumps to them): known to the
    # daemon at run time by id, which nft -f cannot load (it names a cgroup by path); render
    # leaves them out and prints input's drops as without them (the lab runs egressd in the
    # hierarchy's root, where it goes without them too).
    text = re.sub(r"\n\s*meta mark (!= )?SECRET jump own_(sockets|nat)", "", text)
    text = re.sub(r"\n\s*chain own_(sockets|input|foreign|input_own|nat|nat_own) \{[^}]*\}\n", "\n", text)
    text = re.sub(r"\n(\s*)(udp|tcp) dport 53 redirect", r"\n\1meta mark != SECRET \2 dport 53 redirect", text)
    text = text.replace("ct direction original socket mark != SECRET jump own_input",
                        "ct direction original socket mark SECRET drop")
    text = text.replace("ct state invalid socket mark != SECRET jump own_input",
                        "ct state invalid socket mark SECRET counter packets 0 bytes 0 drop")
    text = re.sub(r" expires [0-9hms.]+", "", text)
    # The namespace's on-link IPv6 prefixes (the lab's 2001:db8:1::/64), kept up to date from
    # rtnetlink like the egress chains; render has no namespace to read them from.
    text = re.sub(r"(set onlink6 \{\s*type ipv6_addr\s*flags interval)\s*elements = \{[^}]*\}", r"\1", text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def nft_loadable(lab, text: str) -> str:
    """`text` as nft -f loads it on this kernel (see lab.nft_loadable)."""
    return labmod.nft_loadable(text, lambda: lab.extra_netns("q"))


def listing(lab, ns) -> str:
    """Both of egressd's tables as nft lists them."""
    out = []
    for family in ("inet", "netdev"):
        rc, text, err = lab.nft(ns, "list", "table", family, "egressd")
        assert rc == 0, f"nft list table {family} egressd: {err}"
        out.append(text)
    return "".join(out)


@pytest.mark.parametrize("phase", ["environment", "agent", "verifier", "empty"])
def test_render_equals_kernel(lab, egressd, phase):
    """`egressd render` loads with nft -f, and both tables list exactly as the daemon programs
    them over netlink (the lab's sandbox has one interface, eth0)."""
    d = egressd(POLICY, phase=phase)
    live = listing(lab, lab.sandbox)
    cp = labmod.run([str(labmod.egressd_binary()), "render", "--config", str(d.config), "--phase", phase,
                     "--interface", labmod.SANDBOX_IF], check=False)
    assert cp.returncode == 0, cp.stderr
    fresh = lab.extra_netns("render")
    rc, _, err = lab.nft(fresh, "-f", "-", input=nft_loadable(lab, cp.stdout))
    assert rc == 0, f"nft -f of the rendered script failed: {err}\n{cp.stdout}"
    loaded = listing(lab, fresh)
    assert normalize_ruleset(live) == normalize_ruleset(loaded)
    # The daemon's secrets are its own, not the defaults render prints.
    assert "0x65677264" not in live and "0x70617373" not in live and "6567:7264" not in live
    assert "0x70727879" not in live and "0x70696e21" not in live


def _golden_policies():
    found = sorted((labmod.REPO_ROOT / "rules" / "policies").glob("*.yaml"))
    # An empty list would make pytest skip the test; a missing set of goldens is a failure.
    return found or [labmod.REPO_ROOT / "rules" / "policies" / "(none found)"]


@pytest.mark.parametrize("policy", _golden_policies(), ids=lambda p: p.stem)
def test_golden_equals_kernel(lab, egressd, policy):
    """rules/<name>.nft (the reviewed golden of `egressd render`, with an egress chain for
    eth0) is exactly what the daemon programs over netlink when started on
    rules/policies/<name>.yaml in the lab's sandbox, whose one interface is eth0."""
    golden = policy.parent.parent / f"{policy.stem}.nft"
    assert policy.exists(), "no reference policies in rules/policies/"
    assert golden.exists(), f"{golden.relative_to(labmod.REPO_ROOT)} missing: run scripts/update-goldens"
    egressd(policy)
    live = listing(lab, lab.sandbox)
    fresh = lab.extra_netns("golden")
    rc, _, err = lab.nft(fresh, "-f", "-", input=nft_loadable(lab, golden.read_text()))
    assert rc == 0, f"nft -f {golden} failed: {err}"
    loaded = listing(lab, fresh)
    assert normalize_ruleset(live) == normalize_ruleset(loaded)
