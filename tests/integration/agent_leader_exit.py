"""Sandbox process for test_agent.py (uid 65534, no capability, no user namespace): ends its
main thread only (SYS_exit, not exit_group) and lives on in a second thread, in the sandbox's
namespace. /proc/PID/ns/net can then no longer be opened (the leader is a zombie), and the pidfd
reports no exit (the thread group is not empty). Reads commands from stdin:
  exitmain            end the main thread (answers "main-exiting")
  connect ADDR PORT   one TCP connection from the worker thread (answers "ok" or "fail ...")
"""
import ctypes
import socket
import sys
import threading

libc = ctypes.CDLL(None, use_errno=True)
go = threading.Event()


def worker():
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "exitmain":
            go.set()
            print("main-exiting", flush=True)
        elif parts[0] == "connect":
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect((parts[1], int(parts[2])))
                print("ok", flush=True)
            except OSError as e:
                print("fail", e, flush=True)
            finally:
                s.close()


threading.Thread(target=worker).start()
print("ready", flush=True)
go.wait()
libc.syscall(60, 0)  # SYS_exit on x86_64: this thread only
