"""Sandbox process for test_agent.py (uid 65534, no capability): makes TCP sockets in the
sandbox's namespace, then moves itself (keeping its pid) into a user and network namespace of
its own, so that no thread is left in the sandbox's namespace while the namespace lives on, held
by those sockets. Answers "moved", then on each stdin line "connect ADDR PORT" connects one held
socket and answers "ok" or "fail ...".
"""
import ctypes
import socket
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
held = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(8)]
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
    print("unshare failed", ctypes.get_errno(), flush=True)
    sys.exit(1)
print("moved", flush=True)
for line in sys.stdin:
    parts = line.split()
    if parts and parts[0] == "connect":
        s = held.pop()
        s.settimeout(2)
        try:
            s.connect((parts[1], int(parts[2])))
            print("ok", flush=True)
        except OSError as e:
            print("fail", e, flush=True)
