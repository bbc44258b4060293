"""A lenient HTTP/1 server for the pinning lab: CPython's http.server (as Flask's and Django's
development servers and wsgiref are), which splits a request line on any whitespace and skips
whitespace before it (RFC 9112 §3 allows both). On PORT at each ADDR; answers each request
with `host=<its Host header>`, keeping the connection open for path /ka.
argv: PORT ADDR...; prints "ready" once listening."""
import http.server
import socket
import sys
import threading


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = b"host=" + (self.headers.get("Host") or "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.close_connection = self.path != "/ka"
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server6(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


for addr in sys.argv[2:]:
    server = (Server6 if ":" in addr else http.server.ThreadingHTTPServer)((addr, int(sys.argv[1])), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
