"""The server outside for the inbound-revival attack (test_enforcer.py, inbound_revive_attacker.py):
accepts one TCP connection on ADDR:PORT and sends its next segment only when told, so the test
decides when it meets the ruleset (an ordinary server's heartbeat or zero-window probe, without
the timing). Bounded: exits after 60 s whatever happens.

Usage: inbound_revive_server.py ADDR PORT
stdout, one line each: READY (listening), ACCEPT, RX <hex> (bytes received), SENT (after "send"
on stdin: "HB\\n" sent), EOF or ERR <text>. Answers a line starting SECRET- with "GOT\\n".
stdin: "send", or "quit" (or EOF) to exit."""
import select, socket, sys, time

addr, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port))
s.listen(1)
print("READY", flush=True)
conn = None
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    rd = [sys.stdin, s] if conn is None else [sys.stdin, conn]
    ready = select.select(rd, [], [], max(0.0, deadline - time.monotonic()))[0]
    if sys.stdin in ready:
        cmd = sys.stdin.readline().strip()
        if cmd in ("", "quit"):
            break
        if cmd == "send" and conn is None:
            print("NOCONN", flush=True)
        elif cmd == "send":
            try:
                conn.send(b"HB\n")
                print("SENT", flush=True)
            except OSError as e:
                print(f"ERR {e!r}", flush=True)
    if s in ready and conn is None:
        conn, _ = s.accept()
        print("ACCEPT", flush=True)
    elif conn is not None and conn in ready:
        try:
            d = conn.recv(4096)
        except OSError as e:
            print(f"ERR {e!r}", flush=True)
            conn.close()
            conn = None
            continue
        if not d:
            print("EOF", flush=True)
            conn.close()
            conn = None
            continue
        print("RX " + d.hex(), flush=True)
        if b"SECRET-" in d:
            try:
                conn.send(b"GOT\n")
            except OSError as e:
                print(f"ERR {e!r}", flush=True)
