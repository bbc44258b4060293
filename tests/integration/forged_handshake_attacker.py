"""A sandbox process with Docker's NET_RAW (test_pinning_attacks.py, "a forged handshake on a
connection whose head the server holds"). On a connection admitted for allowed.test it leaves an
incomplete later head naming same-ip.test at the server, and prints READY. On a line from stdin
it makes conntrack trade the connection's entry for a new one, all with raw sockets: an RST
and a SYN with wrong checksums (the server drops them; conntrack closes the entry, then takes
the SYN for a new connection on its addresses and ports), and the server's side of the new
handshake, a SYN-ACK written to the sandbox's own address from the server's; prints SENT. On
the next line it sends "\\r\\n" and a whole request naming allowed.test and prints one JSON line
{"answer": ..., "error": ...}. argv: ADDR PORT VIA: `output`, the SYN-ACK through a raw socket
(it crosses chain output); `lo`, as a frame through an AF_PACKET socket on `lo`, which takes it
back in as if from the wire (it never crosses output)."""
import json
import socket
import struct
import sys
import time

from rawtcp import ip, tcp

addr, port, via = sys.argv[1], int(sys.argv[2]), sys.argv[3]
V6 = ":" in addr
FAMILY = socket.AF_INET6 if V6 else socket.AF_INET


# ETH_P_ALL: a socket bound to one protocol sees only what comes in, not what goes out.
pk = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
pk.bind(("eth0", 0))
pk.settimeout(2.0)
s = socket.socket(FAMILY, socket.SOCK_STREAM)
s.settimeout(4.0)
s.connect((addr, port))
src, lport = s.getsockname()[:2]
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
req = b"GET /zero HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\n\r\n"
head = b"GET /one HTTP/1.1\r\nHost: same-ip.test\r\nConnection: close\r\nUser-Agent: pausing/1.0\r\n"
rest = b"\r\nGET /two HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
s.send(req)
got = b""
while not got.endswith(b"host=allowed.test"):
    chunk = s.recv(4096)
    assert chunk, "closed before the first answer"
    got += chunk
s.send(head)
# The sequence numbers, from the segments seen on eth0: the client's next byte (after the head)
# and the server's next byte, from its acknowledgment of the head (so that no later ACK of the
# server's moves conntrack's idea of the connection after the raw segments).
cli = srv = None
t0 = time.monotonic()
while time.monotonic() - t0 < 3 and srv is None:
    try:
        frame = pk.recv(65535)
    except socket.timeout:
        break
    if frame[12:14] != (b"\x86\xdd" if V6 else b"\x08\x00"):
        continue
    f = frame[14:]
    proto, t = (f[6], f[40:]) if V6 else (f[9], f[(f[0] & 15) * 4:])
    if proto != 6:
        continue
    sp, dp, seq, ack, off, fl = struct.unpack("!HHIIBB", t[:14])
    plen = (struct.unpack("!H", f[4:6])[0] if V6 else struct.unpack("!H", f[2:4])[0] - (f[0] & 15) * 4) - \
        (off >> 4) * 4
    if (sp, dp) == (lport, port) and plen == len(head):
        cli = (seq + plen) & 0xffffffff
    elif (sp, dp) == (port, lport) and cli is not None and ack == cli:
        srv = seq
pk.close()
assert cli is not None and srv is not None, "sequence numbers not seen"
print("READY", flush=True)
sys.stdin.readline()
raw = socket.socket(FAMILY, socket.SOCK_RAW, socket.IPPROTO_TCP)
raw.sendto(tcp(src, addr, lport, port, cli, 0, 0x04, good=False), (addr, 0))                     # RST
raw.sendto(tcp(src, addr, lport, port, (cli - 1) & 0xffffffff, 0, 0x02, good=False), (addr, 0))  # SYN
synack = ip(addr, src, tcp(addr, src, port, lport, (srv - 1) & 0xffffffff, cli, 0x12, good=True))
try:
    if via == "lo":
        lo = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        lo.bind(("lo", 0))
        lo.send(b"\0" * 12 + (b"\x86\xdd" if V6 else b"\x08\x00") + synack)
    else:
        socket.socket(FAMILY, socket.SOCK_RAW, socket.IPPROTO_RAW).sendto(synack, (src, 0))
    out = {"synack": "sent"}
except OSError as e:
    out = {"synack": repr(e)}
print("SENT", flush=True)
sys.stdin.readline()
data = b""
try:
    s.send(rest)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4:
        c = s.recv(4096)
        if not c:
            break
        data += c
except OSError as e:
    out["error"] = repr(e)
out["answer"] = data.decode(errors="replace")
print(json.dumps(out), flush=True)
