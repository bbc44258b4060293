#!/usr/bin/env python3
"""Servers for test_pinning.py, run in the lab's internet namespace.

    pin_servers.py CERT KEY ADDR...

On every ADDR: TLS on 8443 (any SNI; after the handshake it answers each read with
b"tls:" + what it read), HTTP on 8081 (answers every request head with 200 and the Host it
saw), and a server-speaks-first banner service on 2222 ("SSH-2.0-lab\r\n", then echo).
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
                    s.sendall(b"tls:" + data)
        except (OSError, ssl.SSLError):
            pass
    return handle


def http_handler(conn):
    try:
        conn.settimeout(10)
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = conn.recv(4096)
            if not data:
                return
            buf += data
        host = b""
        for line in buf.split(b"\r\n")[1:]:
            if line.lower().startswith(b"host:"):
                host = line[5:].strip()
        body = b"host=" + host
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        conn.close()
    except OSError:
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
