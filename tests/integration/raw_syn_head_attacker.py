"""A sandbox process with Docker's NET_RAW (test_pinning_attacks.py, "a raw SYN on a connection
whose head the server holds"). Connects to ADDR:PORT, reads the connection's sequence numbers
from the SYN-ACK (AF_PACKET), and leaves an incomplete head naming same-ip.test at the server:
KIND first: a first head without its end (egressd lets it through after 100 ms); later: the same
as the second request of a connection admitted for allowed.test (a later head passes as it
comes); body: an admitted POST whose body is a request naming allowed.test whose own body is a
request naming same-ip.test. Prints READY. On a line MODE from stdin: a raw SYN with a wrong
checksum (the server drops it) on the connection's four-tuple, `syn` a bare one, `synp` one
that copies the connection's first segment as egressd sent it back (its sequence number and
bytes); prints SENT. On the next line: sends "\\r\\n" and a whole request naming allowed.test
(KIND body: the announced body) and prints one JSON line, {"answer": ..., "error": ...}.
argv: ADDR PORT KIND"""
import json
import socket
import sys
import time

from rawtcp import sniffer, synack, tcp

addr, port, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
V6 = ":" in addr


pk = sniffer(V6)
s = socket.socket(socket.AF_INET6 if V6 else socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(4.0)
s.connect((addr, port))
lport = s.getsockname()[1]
got = synack(pk, V6, port, lport)
cli = got[1] if got else None  # the SYN-ACK's acknowledgment: the client's next sequence number
pk.close()
assert cli is not None, "no SYN-ACK seen"
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
src = s.getsockname()[0]
head = b"GET /one HTTP/1.1\r\nHost: same-ip.test\r\nConnection: close\r\nUser-Agent: pausing/1.0\r\n"
rest = b"\r\nGET /two HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
first = head
if kind == "later":
    first = b"GET /zero HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\n\r\n"
    s.send(first)
    got = b""
    while not got.endswith(b"host=allowed.test"):
        got += s.recv(4096)
    s.send(head)
elif kind == "body":
    inner = b"GET / HTTP/1.1\r\nHost: same-ip.test\r\nConnection: close\r\n\r\n"
    pad = b"a" * 10
    body = (b"POST / HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n"
            % (len(pad) + len(inner)) + pad)
    first = (b"POST / HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n"
             % len(body))
    rest = body + inner
    s.send(first)
else:
    s.send(head)
print("READY", flush=True)
mode = sys.stdin.readline().strip()
raw = socket.socket(socket.AF_INET6 if V6 else socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
if mode == "syn":
    raw.sendto(tcp(src, addr, lport, port, 12345678, 0, 0x02, good=False), (addr, 0))
else:
    raw.sendto(tcp(src, addr, lport, port, cli, 0, 0x02, good=False, payload=first), (addr, 0))
print("SENT", flush=True)
sys.stdin.readline()
out = {}
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
