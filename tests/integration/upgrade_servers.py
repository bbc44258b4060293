"""Servers that upgrade a connection to TLS after a request in the clear, for the pinning lab,
each a front that routes by SNI (as a database proxy serving many tenants on one address does):
once in TLS, it answers b"tls:<SNI>:<what the client sent>".
  5432  PostgreSQL: an SSLRequest is answered 'S', then TLS
  5433  PostgreSQL without TLS: an SSLRequest is answered 'N'; the client's next bytes
        (its startup message, in the clear) are answered b"plain:<bytes>"
  587   SMTP: banner, then STARTTLS is answered 220, then TLS
argv: CERT KEY ADDR...; prints "ready" once listening."""
import socket
import ssl
import sys
import threading

SSL_REQUEST = b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
names = {}
ctx.sni_callback = lambda sock, name, _ctx: names.__setitem__(id(sock), name)


def read_exactly(c, n):
    got = b""
    while len(got) < n:
        chunk = c.recv(n - len(got))
        if not chunk:
            raise EOFError
        got += chunk
    return got


def in_tls(c):
    t = ctx.wrap_socket(c, server_side=True)
    data = t.recv(100)
    t.sendall(b"tls:" + (names.get(id(t)) or "none").encode() + b":" + data)
    t.close()


def postgres(c):
    if read_exactly(c, 8) != SSL_REQUEST:
        return c.sendall(b"E")
    c.sendall(b"S")
    in_tls(c)


def postgres_clear(c):
    if read_exactly(c, 8) != SSL_REQUEST:
        return c.sendall(b"E")
    c.sendall(b"N")
    c.sendall(b"plain:" + c.recv(100))


def smtp(c):
    c.sendall(b"220 lab ESMTP\r\n")
    line = b""
    while not line.endswith(b"\n"):
        line += read_exactly(c, 1)
    if line.strip().upper() != b"STARTTLS":
        return c.sendall(b"500 unrecognized\r\n")
    c.sendall(b"220 ready to start TLS\r\n")
    in_tls(c)


def serve(listener, handler):
    while True:
        c, _ = listener.accept()

        def run(c=c):
            try:
                c.settimeout(10)
                handler(c)
            except (OSError, EOFError, ssl.SSLError):
                pass
            finally:
                c.close()
        threading.Thread(target=run, daemon=True).start()


for addr in sys.argv[3:]:
    for port, handler in ((5432, postgres), (5433, postgres_clear), (587, smtp)):
        s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(16)
        threading.Thread(target=serve, args=(s, handler), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
