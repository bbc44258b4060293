#!/usr/bin/env python3
"""Servers for test_pinning.py, run in the lab's internet namespace.

    pin_servers.py CERT KEY ADDR...

On every ADDR: TLS on 8443 (any SNI; after the handshake it answers each read with
b"tls:" + what it read, and a read of b"sni?" with b"sni=" + the server name it was sent), HTTP on 8081 (answers every request head with 200 and the Host it
saw; keep-alive when asked), and a server-speaks-first banner service on 2222 ("SSH-2.0-lab\r\n", then echo).
Prints "ready" once every socket listens. Stdlib only.
"""
import socket
import ssl
import sys
import threading


def serve(sock, handler):
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=handler, args=(conn,), daemon=True).start()


def tls_handler(ctx):
    def handle(conn):
        try:
            conn.settimeout(10)
            with ctx.wrap_socket(conn, server_side=True) as s:
                while True:
                    data = s.recv(4096)
                    if not data:
                        return
                    if data == b"sni?":
                        s.sendall(b"sni=" + getattr(s, "sni", "").encode())
                        continue
                    s.sendall(b"tls:" + data)
        except (OSError, ssl.SSLError):
            pass
    return handle


def http_handler(conn):
    """Each request: 200 with body b"host=" + its Host (and N bytes more for GET /bulk/N). Keeps the connection open for the next
    request (pipelined or not) when the request asks (`Connection: keep-alive`); reads a
    request's body by Content-Length or chunked, as a real server would, so what follows it
    is the next request."""
    try:
        conn.settimeout(10)
        buf = b""

        def need(n):
            nonlocal buf
            while len(buf) < n:
                data = conn.recv(65536)
                if not data:
                    raise EOFError
                buf += data

        def line():
            nonlocal buf
            while b"\r\n" not in buf:
                need(len(buf) + 1)
            out, buf = buf.split(b"\r\n", 1)
            return out

        while True:
            while b"\r\n\r\n" not in buf:
                need(len(buf) + 1)
            head, buf = buf.split(b"\r\n\r\n", 1)
            fields = {}
            for ln in head.lstrip(b"\r\n").split(b"\r\n")[1:]:
                name, _, value = ln.partition(b":")
                fields[name.strip().lower()] = value.strip()
            if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
                while True:
                    size = int(line().split(b";")[0], 16)
                    if size == 0:
                        while line():
                            pass
                        break
                    need(size + 2)
                    buf = buf[size + 2:]
            else:
                n = int(fields.get(b"content-length", b"0"))
                need(n)
                buf = buf[n:]
            keep = fields.get(b"connection", b"").lower() == b"keep-alive"
            body = b"host=" + fields.get(b"host", b"")
            target = head.lstrip(b"\r\n").split(b"\r\n", 1)[0].split(b" ")[1:2]
            if target and target[0].startswith(b"/bulk/"):  # a download: N more bytes
                body += b"x" * int(target[0][len(b"/bulk/"):])
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: %s\r\n\r\n%s" %
                         (len(body), b"keep-alive" if keep else b"close", body))
            if not keep:
                conn.close()
                return
    except (OSError, EOFError, ValueError):
        pass


def banner_handler(conn):
    try:
        conn.settimeout(10)
        conn.sendall(b"SSH-2.0-lab\r\n")
        while True:
            data = conn.recv(4096)
            if not data:
                return
            conn.sendall(data)
    except OSError:
        pass


def main():
    cert, key, addrs = sys.argv[1], sys.argv[2], sys.argv[3:]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    def remember_sni(sock, name, _ctx):
        sock.sni = name or ""
    ctx.sni_callback = remember_sni
    for addr in addrs:
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        for port, handler in ((8443, tls_handler(ctx)), (8081, http_handler), (2222, banner_handler)):
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            s.listen(128)
            threading.Thread(target=serve, args=(s, handler), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
