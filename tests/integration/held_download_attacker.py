"""A sandbox process with Docker's NET_RAW (test_pinning_attacks.py, "the reader made to forget
a connection whose head the server holds"). On a connection admitted for allowed.test it asks
for a download of BULK bytes it does not read yet (a small receive buffer: the server's data
waits at a zero window), then leaves an incomplete later head naming same-ip.test at the
server. Prints READY. On a line MODE from stdin:
  syn          a raw SYN with a wrong checksum on the four-tuple (the server drops it);
  evict N      first N connections that each leave 20 KB of heads for allowed.test and close
               with a reset (they push this one out of the connections egressd follows), then
               the raw SYN;
  rst          a raw RST with a wrong checksum at the connection's next byte (conntrack closes
               the entry and, once no packet comes for its CLOSE timeout, forgets it);
prints SENT. On the next line: reads the download (the socket's window updates are bytes-less
packets), sends "\\r\\n" and a whole request naming allowed.test, and prints one JSON line
{"download": N, "answer": ..., "error": ...}. argv: ADDR PORT BULK"""
import json
import socket
import struct
import sys
import time

from rawtcp import sniffer, synack, tcp

addr, port, bulk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
V6 = ":" in addr
FAMILY = socket.AF_INET6 if V6 else socket.AF_INET


pk = sniffer(V6)
s = socket.socket(FAMILY, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
s.settimeout(6.0)
s.connect((addr, port))
src, lport = s.getsockname()[:2]
got = synack(pk, V6, port, lport)
cli = got[1] if got else None  # the SYN-ACK's acknowledgment: the client's next sequence number
pk.close()
assert cli is not None, "no SYN-ACK seen"
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
req = b"GET /bulk/%d HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\n\r\n" % bulk
head = b"GET /one HTTP/1.1\r\nHost: same-ip.test\r\nConnection: close\r\nUser-Agent: pausing/1.0\r\n"
rest = b"\r\nGET /two HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
s.send(req)
s.send(head)
print("READY", flush=True)
mode = sys.stdin.readline().split()
raw = socket.socket(FAMILY, socket.SOCK_RAW, socket.IPPROTO_TCP)
if mode[0] == "evict":
    heads = b"".join(b"GET /e HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\nX-Pad: %s\r\n\r\n"
                     % (b"a" * 4000) for _ in range(5))
    for _ in range(int(mode[1])):
        e = socket.socket(FAMILY, socket.SOCK_STREAM)
        e.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        e.settimeout(3.0)
        e.connect((addr, port))
        e.sendall(heads)
        got = b""
        while got.count(b"host=allowed.test") < 5:
            chunk = e.recv(65536)
            if not chunk:
                break
            got += chunk
        e.close()
    mode = ["syn"]
if mode[0] == "syn":
    raw.sendto(tcp(src, addr, lport, port, 12345678, 0, 0x02, good=False), (addr, 0))
elif mode[0] == "rst":
    raw.sendto(tcp(src, addr, lport, port, (cli + len(req) + len(head)) & 0xffffffff, 0, 0x04, good=False),
               (addr, 0))
print("SENT", flush=True)
sys.stdin.readline()
out = {}
data = b""
try:
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionResetError("closed before the download")
        data += chunk
    hdr, body = data.split(b"\r\n\r\n", 1)
    n = int([ln.split(b":")[1] for ln in hdr.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
    while len(body) < n:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionResetError("closed during the download")
        body += chunk
    out["download"] = len(body)
    s.send(rest)
    data = b""
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
