#!/usr/bin/env python3
"""Small DNS servers for the egressd lab, run inside a namespace (`ip netns exec`).

    dnsserver.py docker  --addr 127.0.0.11 --forward 192.0.2.1 [--service NAME=ADDR]... [--slow LABEL=MS]
                         [--truncate LABEL] [--log FILE]
    dnsserver.py record  --addr 198.51.100.53 --answer 203.0.113.10 [--ttl S] --log FILE

docker   Docker's embedded resolver as Docker 20.10 runs it on a user-defined network: it listens
         on ADDR at a random port, UDP and TCP (the test adds the DNAT from ADDR:53, as Docker
         does), answers the names given with --service itself (A only; AAAA gets an empty
         NOERROR), and forwards every other query as it received it (same bytes: ID, flags,
         question case, records) to FORWARD:53 from this namespace, over the transport the
         query came on, relaying the answer back unchanged. Names whose first label starts with
         LABEL (--slow) are forwarded after MS milliseconds (an upstream that is slow to answer);
         over UDP, names whose first label starts with --truncate's LABEL get an empty answer
         with TC set at once, so the client asks again over TCP.
record   A name server that answers every A query with ANSWER (AAAA: empty NOERROR) and
         appends every query it receives, as hex, to FILE (one JSON object per line: transport,
         hex, peer), so a test sees exactly what reached the upstream.

Prints "READY <port>" on stdout once every socket is bound; exits when stdin closes.
Stdlib only.
"""
import argparse
import json
import os
import socket
import struct
import sys
import threading
import time

_log_lock = threading.Lock()
_log_path = None


def log(**fields):
    if _log_path is None:
        return
    with _log_lock, open(_log_path, "a") as f:
        f.write(json.dumps(fields) + "\n")
        f.flush()


def question(msg: bytes):
    """(name lower-case, qtype, offset past the question) of an uncompressed query; None if bad."""
    try:
        off, labels = 12, []
        while True:
            n = msg[off]
            if n == 0:
                off += 1
                break
            if n & 0xC0:
                return None
            labels.append(msg[off + 1:off + 1 + n].decode("ascii", "replace"))
            off += 1 + n
        qtype = struct.unpack_from("!H", msg, off)[0]
        return ".".join(labels).lower(), qtype, off + 4
    except (IndexError, struct.error):
        return None


def local_answer(msg: bytes, q, addr: str | None, ttl: int) -> bytes:
    """The answer to `msg` with its question bytes copied as they came; one A record when
    addr is given and the query is for A, else no records (NOERROR)."""
    name, qtype, end = q
    qid = struct.unpack_from("!H", msg)[0]
    rd = struct.unpack_from("!H", msg, 2)[0] & 0x0100
    records = b""
    if addr and qtype == 1:
        records = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, ttl, 4) + socket.inet_aton(addr)
    head = struct.pack("!HHHHHH", qid, 0x8080 | rd, 1, 1 if records else 0, 0, 0)
    return head + msg[12:end] + records


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


class Server:
    def __init__(self, args):
        self.args = args
        self.services = dict(s.split("=", 1) for s in args.service)
        self.slow = {k: int(v) / 1000 for k, v in (s.split("=", 1) for s in args.slow)}

    def respond(self, msg: bytes, transport: str, peer) -> bytes | None:
        q = question(msg)
        if q is None:
            return None
        name = q[0]
        log(kind="query", name=name, qtype=q[1], transport=transport, hex=msg.hex(), peer=str(peer))
        a = self.args
        if a.mode == "record":
            return local_answer(msg, q, a.answer, a.ttl)
        first = name.split(".", 1)[0]
        if transport == "udp" and a.truncate and first.startswith(a.truncate):
            log(kind="truncated", name=name)
            return msg[:2] + bytes([0x82 | (msg[2] & 0x01), 0x80]) + b"\x00\x01\x00\x00\x00\x00\x00\x00" + msg[12:q[2]]
        if name in self.services:
            log(kind="service", name=name, transport=transport)
            return local_answer(msg, q, self.services[name], 600)
        first = name.split(".", 1)[0]
        for label, delay in self.slow.items():
            if first.startswith(label):
                time.sleep(delay)  # the emulated upstream is slow, not a synchronisation
        log(kind="forward", name=name, transport=transport)
        try:
            if transport == "udp":
                with socket.socket(socket.AF_INET6 if ":" in a.forward else socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.settimeout(3)
                    s.sendto(msg, (a.forward, 53))
                    data = s.recv(65535)
            else:
                with socket.create_connection((a.forward, 53), timeout=3) as s:
                    s.sendall(struct.pack("!H", len(msg)) + msg)
                    n = struct.unpack("!H", recv_exact(s, 2))[0]
                    data = recv_exact(s, n)
        except (OSError, EOFError) as e:
            log(kind="forward_failed", name=name, transport=transport, error=str(e))
            return None
        log(kind="answer", name=name, transport=transport, hex=data.hex())
        return data

    def serve_udp(self, sock):
        while True:
            try:
                msg, peer = sock.recvfrom(65535)
            except OSError:
                return

            def one(msg=msg, peer=peer):
                out = self.respond(msg, "udp", peer)
                if out is not None:
                    try:
                        sock.sendto(out, peer)
                    except OSError:
                        pass

            threading.Thread(target=one, daemon=True).start()

    def serve_tcp_conn(self, conn, peer):
        with conn:
            try:
                while True:
                    n = struct.unpack("!H", recv_exact(conn, 2))[0]
                    msg = recv_exact(conn, n)
                    out = self.respond(msg, "tcp", peer)
                    if out is None:
                        return
                    conn.sendall(struct.pack("!H", len(out)) + out)
            except (OSError, EOFError):
                return

    def serve_tcp(self, listener):
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            threading.Thread(target=self.serve_tcp_conn, args=(conn, peer), daemon=True).start()


def bind_pair(addr: str, port: int):
    """A UDP and a TCP socket on addr, the same port (random when 0)."""
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    for _ in range(50):
        u = socket.socket(fam, socket.SOCK_DGRAM)
        u.bind((addr, port))
        p = u.getsockname()[1]
        t = socket.socket(fam, socket.SOCK_STREAM)
        t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            t.bind((addr, p))
        except OSError:
            u.close()
            t.close()
            if port:
                raise
            continue
        t.listen(64)
        return u, t, p
    raise OSError("no port free for UDP and TCP at once")


def main():
    global _log_path
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["docker", "record"])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--forward", default="192.0.2.1")
    ap.add_argument("--service", action="append", default=[])
    ap.add_argument("--slow", action="append", default=[])
    ap.add_argument("--truncate")
    ap.add_argument("--answer", default="203.0.113.10")
    ap.add_argument("--ttl", type=int, default=60)
    ap.add_argument("--log")
    args = ap.parse_args()
    _log_path = args.log
    srv = Server(args)
    u, t, port = bind_pair(args.addr, args.port)
    threading.Thread(target=srv.serve_udp, args=(u,), daemon=True).start()
    threading.Thread(target=srv.serve_tcp, args=(t,), daemon=True).start()
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
