#!/usr/bin/env python3
"""Servers for test_pinning.py, run in the lab's internet namespace.

    pin_servers.py CERT KEY ADDR...

On every ADDR: TLS on 8443 (any SNI; after the handshake it answers each read with
b"tls:" + what it read, and a read of b"sni?" with b"sni=" + the server name it was sent), HTTP on 8081 (answers every request head with 200 and the Host it
saw; keep-alive when asked), and a server-speaks-first banner service on 2222 ("SSH-2.0-lab\r\n", then echo), and on 2223
the same greeting 0.3 s after the accept.
Prints "ready" once every socket listens. Stdlib only.
"""
import socket
import ssl
import sys
import threading
import time


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
            # RFC 9112 §2.2: a line ends at LF; a CR before it is dropped (bare LF tolerated,
            # as nginx, HAProxy, Node and CPython's http.server do).
            nonlocal buf
            while b"\n" not in buf:
                need(len(buf) + 1)
            out, buf = buf.split(b"\n", 1)
            return out[:-1] if out.endswith(b"\r") else out

        def bad_request():
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            conn.close()

        while True:
            # Empty lines before a request line are skipped (RFC 9112 §2.2); the head ends at
            # the first empty line after it.
            first = line()
            while first == b"":
                first = line()
            lines = []
            while (ln := line()) != b"":
                lines.append(ln)
            # A request line is METHOD SP target SP HTTP/1.x: anything else is refused, as a
            # real server does (this one used to ignore it and read the fields anyway).
            parts = first.split(b" ")
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[0].isalpha():
                bad_request()
                return
            fields = {}
            for ln in lines:
                name, sep, value = ln.partition(b":")
                key = name.lower()
                # No whitespace before the colon, no field without one, one Host (RFC 9112 §5.1, §3.2).
                if not sep or not name or name != name.strip() or (key == b"host" and key in fields):
                    bad_request()
                    return
                fields[key] = value.strip()
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
            target = parts[1]
            if target.startswith(b"/bulk/"):  # a download: N more bytes
                body += b"x" * int(target[len(b"/bulk/"):])
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: %s\r\n\r\n%s" %
                         (len(body), b"keep-alive" if keep else b"close", body))
            if not keep:
                conn.close()
                return
    except (OSError, EOFError, ValueError):
        pass


def banner_handler(conn, pause: float = 0.0):
    try:
        conn.settimeout(10)
        if pause:
            time.sleep(pause)  # the service's own behaviour (a server that greets late), not synchronisation
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
        for port, handler in ((8443, tls_handler(ctx)), (8081, http_handler), (2222, banner_handler),
                              (2223, lambda conn: banner_handler(conn, 0.3))):
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            s.listen(128)
            threading.Thread(target=serve, args=(s, handler), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
