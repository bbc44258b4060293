"""Issue 14's Docker-specific attacks, performed from inside the task container the way a
sandboxed process would: as root with Docker's default capabilities (NET_RAW,
NET_BIND_SERVICE; `ip_unprivileged_port_start=0`), and as uid 65534 with none. Each test
asserts the promise of issue 14 and DESIGN §1 (threat model); on today's tree they FAIL,
and they pass once the fixes land. Nothing here is xfail on purpose.

  class 4   Docker's embedded resolver reached directly on its real random port
  class 3   127.0.0.11:53 taken by a task process; egressd's upstream query delivered to it
  class 10  port 53 squatted while egressd restarts
  class 1   forged "inbound" flows (IPv6 FREEBIND, no capability; IPv4 IP_TRANSPARENT, NET_RAW)
            on Docker's networks, IPv6 included (`docker network create --ipv6`)
  class 5   raw frames (AF_PACKET, Docker's default NET_RAW) to a denied host

The attack code is tests/docker/taskprobe.py, run in the task with the host's python3.
Tests marked "shared" reuse one sandbox per (topology, mode): they change no policy.
"""
import os
import re
import socket
import threading
import time

import pytest

import dockerlab
from dockerlab import DOCKER_DNS, NOBODY, SERVER_A, SERVER_B, SINK_PORT, V6, LabError, wait_for
from topologies import TOPOLOGIES

MODES = ("allowlist", "no-network")
# The shipped compose example's task drops every capability: NET_RAW attacks are moot there.
NET_RAW_TOPOLOGIES = ("harbor", "netns-pid")
# Restarting egressd in the same namespace: not where egressd's container owns the namespace
# (Harbor's and the shipped compose example's: a restart of it is a new namespace).
RESTART_TOPOLOGIES = ("netns-pid",)
WHO = {None: "root", NOBODY: "uid 65534"}


def shared(sandboxes, topology, mode, network="v4"):
    allow = []
    if mode == "allowlist":
        allow = [SERVER_A] if network == "v4" else [V6.server_a4, V6.server_a6]
    return sandboxes(topology, mode, allow, network, shared=True)


def secret_name(what: str) -> str:
    return f"{what}-{os.getpid()}-{time.monotonic_ns() % 10**9}.example.com"


# --- class 4 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_dockers_resolver_is_not_reachable_on_its_real_port(sandboxes, session, topology, mode):
    """Docker's resolver listens on 127.0.0.11:<random> (udp and tcp) behind its DNAT of :53.
    No process but egressd may reach it, on any port: a task process that reads the ports
    from /proc/net/udp and /proc/net/tcp and queries them directly gets no answer."""
    sb = shared(sandboxes, topology, mode)
    secret = secret_name("resolver-port")
    answered = []
    for user in (None, NOBODY):
        r = sb.probe("resolver-ports", secret, user=user)
        assert r["udp_ports"] and r["tcp_ports"], f"no socket of Docker's resolver in the task's /proc/net: {r}"
        answered += [f"{WHO[user]} {proto} 127.0.0.11:{x['port']} -> {x['rcode']} {x['addresses']}"
                     for proto in ("udp", "tcp") for x in r[proto] if x["outcome"] == "ok"]
    assert not answered, f"Docker's resolver answered task processes directly: {answered}"
    assert secret not in session.dns_log()


@pytest.mark.parametrize("topology", NET_RAW_TOPOLOGIES)
def test_a_guessed_own_mark_takes_no_query_past_the_proxy(sandboxes, session, topology):
    """egressd's own mark (SO_MARK of its upstream sockets) is a 32-bit secret, and a task
    process with Docker's default NET_RAW can set any mark and tell a right guess from a wrong
    one: hours of searching. Here it has found it (the test reads it from the table) and asks
    Docker's resolver for a denied name with it, past the proxy's redirect. egressd (a sidecar
    container, or on the host with --netns-pid in a unit's cgroup) is in a cgroup of its own,
    the task in its container's: the packet loses the mark and is redirected to the proxy like
    a wrong guess (REFUSED, nothing that tells the guess was right), the name never reaches
    the upstream, and egressd's own queries still pass."""
    sb = sandboxes(topology, "allowlist", ["*.wild.example.org"])
    logs = sb.logs()
    assert "egressd's sockets are in cgroup id" in logs or '"own_cgroup"' in logs, logs
    assert "own cgroup is unknown" not in logs and "own_cgroup_unverified" not in logs, logs
    table = dockerlab.labmod.run(["nsenter", "-t", str(sb.task.pid), "-n", "nft", "list", "table", "inet",
                                  "egressd"]).stdout
    own = re.search(r" mark=(0x[0-9a-f]{8})", table)[1]
    assert "meta mark != 0x00000000 jump own_sockets" in table, table
    secret = secret_name("own-mark")
    r = sb.probe("marked-query", secret, DOCKER_DNS, own)
    wrong = sb.probe("marked-query", secret_name("wrong-mark"), DOCKER_DNS, hex(int(own, 16) ^ 1))
    print(f"\n{topology}: a query with egressd's own mark {own}: {r}; with a wrong one: {wrong}")
    assert (r["outcome"], r["rcode"]) == ("ok", "REFUSED") == (wrong["outcome"], wrong["rcode"]), (r, wrong)
    assert secret not in session.dns_log()
    ok = sb.probe("query", f"ok-{os.getpid()}.wild.example.org", DOCKER_DNS)
    assert ok["outcome"] == "ok" and ok["rcode"] == "NOERROR", ok


# --- class 3 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_loopback_upstream_port_is_held_by_egressd(sandboxes, topology, mode):
    """127.0.0.11 is egressd's upstream (Docker's resolver, from resolv.conf or the policy
    file); egressd owns 127.0.0.11:53 (udp and tcp) before it serves, so no task process,
    privileged or not, can take it."""
    sb = shared(sandboxes, topology, mode)
    took = []
    for user in (None, NOBODY):
        r = sb.probe("bind", DOCKER_DNS, "53", user=user)
        took += [f"{WHO[user]} bound 127.0.0.11:53/{proto}" for proto in ("udp", "tcp") if r[proto] == "ok"]
    assert not took, f"egressd does not hold its loopback upstream's port: {took}"


def namespace_ipv4(sb) -> str:
    """The IPv4 address of the task's namespace on its Docker network."""
    out = dockerlab.labmod.run(["nsenter", "-t", str(sb.task.pid), "-n", "ip", "-4", "-o", "addr", "show",
                                "scope", "global"]).stdout
    found = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    assert len(found) == 1, f"the task's namespace has not one IPv4 address: {out}"
    return found[0]


def conntrack_lines(sb, *needles) -> list[str]:
    try:
        text = open(f"/proc/{sb.task.pid}/net/nf_conntrack").read()
    except OSError:
        return []
    return [l for l in text.splitlines() if all(n in l for n in needles)]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_loopback_upstream_cannot_be_hijacked(sandboxes, session, topology):
    """The attack itself (uid 65534, no capability): take 127.0.0.11:53, wait until egressd's
    upstream flow has been idle for the conntrack UDP timeout, send one datagram from
    127.0.0.11:53 to egressd's upstream port, then ask for a fresh allowed name: egressd's
    query rides the task's flow as its reply direction, escapes Docker's DNAT and lands on
    the task's socket, which answers with SERVER_A. egressd must not learn it.

    The harness shortens the task namespace's conntrack UDP timeouts (30 s / 120 s) to 1 s
    beforehand: it stands in for the idle time, which the suite cannot spend; the attacker
    needs no privilege for anything it does."""
    sb = sandboxes(topology, "allowlist", ["*.wild.example.org"])
    ns = sb.ns()
    ns.sysctl("net.netfilter.nf_conntrack_udp_timeout", 1)
    ns.sysctl("net.netfilter.nf_conntrack_udp_timeout_stream", 1)
    attacker = sb.task.probe_proc("hijack-upstream", "wild.example.org", SERVER_A, user=NOBODY)
    try:
        ports = attacker.ready["upstream_ports"]
        # egressd's flow to 127.0.0.11:53 gone from conntrack: the idle time has passed.
        for p in ports:
            wait_for(lambda: not conntrack_lines(sb, "dst=127.0.0.11 ", f"sport={p} ", "dport=53 "), 15.0,
                     f"egressd's upstream flow (port {p}) to expire from conntrack")
        attacker.send("go")
        res = attacker.result(timeout=30.0)
    finally:
        attacker.close()
    got = res["victim"] or {}
    assert not res["poisoned"] and SERVER_A not in got.get("addresses", []), (
        f"egressd's upstream query reached the task's socket on 127.0.0.11:53 (bind {attacker.ready['bind']}, "
        f"egressd's port {ports}, it asked for {res['queries_seen']}) and the client got {got}")
    assert SERVER_A not in sb.reachable(), "the forged address was learned: SERVER_A is open"


@pytest.mark.parametrize("topology", NET_RAW_TOPOLOGIES)
def test_answers_from_the_resolvers_own_port(sandboxes, session, topology):
    """Root in the task with Docker's default NET_RAW sniffs egressd's queries to Docker's
    resolver on lo (after Docker's DNAT they show its real port) and answers each from
    127.0.0.11:<that port> over a raw socket with SERVER_A, ID and case copied. egressd finds
    the resolver's cgroup (dockerd's; it logs resolver_cgroup) by its id, on the host and in a
    sidecar that does not see the host's cgroup hierarchy alike, and chain output drops every
    such answer: the raw socket is in the container's cgroup. Only when dockerd is in the
    hierarchy's root and egressd cannot see that root (a sidecar) can it not tell the task's
    sockets from the resolver's: then it must say so at start (resolver_unverified). Either way
    the names still resolve through Docker's resolver."""
    sb = sandboxes(topology, "allowlist", ["*.wild.example.org"])
    logs = sb.logs()
    found = "resolver_cgroup" in logs or "answers from cgroup id" in logs
    dockerd_in = dockerlab.dockerd_cgroup()
    assert dockerd_in is not None, "dockerd's cgroup cannot be read"
    if topology == "netns-pid" or dockerd_in != "/":
        assert found, f"dockerd in cgroup {dockerd_in}: {logs}"
    else:
        assert "root of the cgroup v2 hierarchy" in logs, logs
    # Docker's resolver answers in a few milliseconds, often before a forger under load gets its
    # packet out. So the lab holds the resolver's forwarded query (dropped where it enters the
    # host), and egressd's query stays open until the attacker has tried: each forgery races
    # an open query, as a faster attacker's would. Released, egressd's next try is answered.
    attacker = sb.task.probe_proc("sniff-answer", SERVER_A, "60", "--armed")
    source = namespace_ipv4(sb)
    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**9}"
    answers, tries = [], []
    try:
        assert attacker.ready["uid"] == 0, attacker.ready
        for i in range(3):
            attacker.send("arm")
            box = {}
            with session.guard.holding_dns_from(source):
                t = threading.Thread(target=lambda: box.update(
                    a=sb.probe("query", f"q{i}-{tag}.wild.example.org", DOCKER_DNS)))
                t.start()
                tries.append(attacker.result(timeout=15.0))
            t.join(timeout=30.0)
            assert not t.is_alive() and "a" in box, f"query {i}: no answer after the hold ended"
            answers.append(box["a"])
        attacker.send("done")
        res = attacker.result(timeout=15.0)
    finally:
        attacker.close()
    said = [l for l in logs.splitlines() if "cgroup" in l and ("resolver" in l or "answers from" in l)]
    print(f"\n{topology}: {said}; attacker {res} {tries}; answers {answers}")
    assert res["tried"] == 3, f"the attacker did not see each of egressd's queries to the resolver: {res}"
    assert all(a["outcome"] == "ok" and a["rcode"] == "NOERROR" and a["addresses"] for a in answers), answers
    if not found:
        return
    # Every forgery, each made while egressd's query was open, is refused (EPERM).
    assert res["errors"] == ["EPERM"] and res["sent"] == 0, (res, tries)
    assert all(SERVER_A not in a["addresses"] for a in answers), answers
    assert SERVER_A not in sb.reachable(), "the forged address was learned: SERVER_A is open"
    table = dockerlab.labmod.run(["nsenter", "-t", str(sb.task.pid), "-n", "nft", "list", "table", "inet",
                                  "egressd"]).stdout
    dropped = [int(n) for n in re.findall(r"socket cgroupv2 level \d+ .*counter packets (\d+)", table)]
    assert sum(dropped) >= res["tried"], table


# --- class 10 --------------------------------------------------------------------------------


@pytest.mark.parametrize("topology", RESTART_TOPOLOGIES)
def test_port_53_squatted_across_a_restart(sandboxes, session, topology):
    """While egressd is down, any uid of a Docker task can bind 127.0.0.1:53 and [::1]:53
    (ip_unprivileged_port_start=0). The restarted egressd must still come up, enforce, answer
    its socket and own the task's DNS: the squatter gets no query."""
    sb = sandboxes(topology, "allowlist", [SERVER_A])
    squatter, tail = None, ""

    def squat():
        nonlocal squatter
        squatter = sb.task.probe_proc("squat", "127.0.0.1", "::1", "--port", "53", user=NOBODY)

    try:
        failure = None
        try:
            sb.restart_egressd(meanwhile=squat)
        except LabError as e:
            failure = (f"egressd did not come back while a task process held port 53 "
                       f"({squatter.ready['binds'] if squatter else '?'}): {e}")
        if failure:
            pytest.fail(failure, pytrace=False)
        st = sb.status()
        assert (st["mode"], [e["entry"] for e in st["entries"]]) == ("allowlist", [SERVER_A]), st
        assert sb.reachable() == {SERVER_A}
        secret = secret_name("squat")
        r = sb.probe("query", secret, DOCKER_DNS)
        assert r["rcode"] == "REFUSED" and squatter.ready["forged"] not in r["addresses"], r
        r = sb.ns().dns_query(secret, server=SERVER_B)
        assert r.rcode == "REFUSED", r
    finally:
        if squatter:
            tail = squatter.close()
    assert '"queries": 0' in tail, f"the squatter answered the task's queries: {tail}"


# --- class 1 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_ipv6_forged_inbound_flow(sandboxes, topology, mode):
    """On an IPv6 network (docker network create --ipv6), uid 65534 binds a UDP socket to a
    denied server's address with IPV6_FREEBIND (no capability needed) and sends itself one
    datagram over loopback; conntrack then takes what the task sends to that server for the
    reply direction of an inbound flow. No two-way UDP may follow. The server's port is above
    1024, so the attack starts in every topology, also where the task's unprivileged ports
    begin at 1024 (container/compose.yaml)."""
    sb = shared(sandboxes, topology, mode, network="v6")
    # The server does echo on that port (so "no echo" below means egressd stopped it).
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
        s.settimeout(2.0)
        s.sendto(b"ping", (V6.server_b6, dockerlab.HIGH_ECHO_PORT))
        assert s.recv(64) == b"ping", "the lab's echo server did not answer on the high port"
    r = sb.probe("forged-flow", V6.server_b6, str(dockerlab.HIGH_ECHO_PORT), user=NOBODY)
    assert r.get("forge") is None, f"the attack could not even start: {r}"
    assert not r["echo"], \
        f"uid 65534 exchanged UDP with denied [{V6.server_b6}]:{dockerlab.HIGH_ECHO_PORT} in {mode}: {r}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("topology", NET_RAW_TOPOLOGIES)
def test_ipv4_forged_inbound_flow(sandboxes, topology, mode):
    """The same over IPv4 with IP_TRANSPARENT, which Docker's default NET_RAW allows root."""
    sb = shared(sandboxes, topology, mode)
    r = sb.probe("forged-flow", SERVER_B, str(dockerlab.ECHO_PORT))
    assert r.get("forge") is None, f"the attack could not even start: {r}"
    assert not r["echo"], f"root (Docker's default capabilities) exchanged UDP with denied {SERVER_B}:7 in {mode}: {r}"


# --- class 5 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("topology", NET_RAW_TOPOLOGIES)
def test_raw_frames_do_not_leave(sandboxes, session, topology, mode):
    """Root with Docker's default NET_RAW writes Ethernet frames with AF_PACKET (plain and
    with PACKET_QDISC_BYPASS): UDP to the denied SERVER_B, whose port the host listens on.
    Nothing may arrive."""
    sb = shared(sandboxes, topology, mode)
    token = f"raw-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind((SERVER_B, SINK_PORT))
        r = sb.probe("raw-frame", sb.net.mac, SERVER_B, str(SINK_PORT), token)
        assert r["socket"] == "ok", f"no AF_PACKET socket for root in the task: {r}"
        arrived = []
        # Frames that leave arrive within microseconds over the bridge; a second is generous.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and len(arrived) < 2:
            sink.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                data, peer = sink.recvfrom(2048)
            except TimeoutError:
                break
            if data.startswith(token.encode()):
                arrived.append(data.decode())
    assert not arrived, f"raw frames from the task reached denied {SERVER_B} in {mode}: {arrived} (send: {r})"
