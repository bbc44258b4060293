"""A Docker-like embedded resolver whose forwarding leaves from ANOTHER namespace (as Docker does
when the host's resolver is on the host's loopback, e.g. systemd-resolved at 127.0.0.53 with
Docker < 25), for test_dns_integrity.py's probe tests: it listens on 127.0.0.11:<port> in the
sandbox namespace behind Docker's DNAT, and forwards every query, as received, to the lab's dnsmasq
from the internet namespace, so no copy of egressd's query ever comes back through the sandbox's
redirect. Names whose first label starts with "slow" are
forwarded after `slow` seconds (a slow resolver: egressd's query stays in flight meanwhile).
Names under .invalid get NXDOMAIN, as from a real host resolver (RFC 6761 6.4)."""
import socket
import struct
import threading
import time

from lab import DNS_V4


def _recv_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return b


def _under_invalid(msg) -> bool:
    labels, i = [], 12
    try:
        while msg[i]:
            labels.append(msg[i + 1:i + 1 + msg[i]].decode("ascii", "replace").lower())
            i += 1 + msg[i]
    except IndexError:
        return False
    return bool(labels) and labels[-1] == "invalid"


def _nxdomain(msg):
    """Header and question of `msg`, QR RD RA set, rcode NXDOMAIN, no records."""
    i = 12
    while i < len(msg) and msg[i]:
        i += 1 + msg[i]
    q = msg[12:i + 5]
    return msg[:2] + struct.pack("!HHHHH", 0x8183 | (msg[2] & 1) << 8, 1, 0, 0, 0) + q


def _first_label(msg):
    try:
        n = msg[12]
        return msg[13:13 + n].decode("ascii", "replace").lower()
    except IndexError:
        return ""


class HostSideResolver:
    def __init__(self, lab, slow=0.4, forward=DNS_V4):
        self.lab, self.slow, self.forward = lab, slow, forward
        self.log = []
        self.u = lab.sandbox.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.u.bind(("127.0.0.11", 0))
        self.port = self.u.getsockname()[1]
        self.t = lab.sandbox.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.t.bind(("127.0.0.11", self.port))
        self.t.listen(16)
        threading.Thread(target=self._udp, daemon=True).start()
        threading.Thread(target=self._tcp, daemon=True).start()
        p = self.port
        lab.nft(lab.sandbox, "-f", "-", check=True, input=f"""\
table ip dockerlike {{
  chain output {{
    type nat hook output priority -100; policy accept;
    ip daddr 127.0.0.11 udp dport 53 dnat to 127.0.0.11:{p}
    ip daddr 127.0.0.11 tcp dport 53 dnat to 127.0.0.11:{p}
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr 127.0.0.11 udp sport {p} snat to 127.0.0.11:53
    ip saddr 127.0.0.11 tcp sport {p} snat to 127.0.0.11:53
  }}
}}
""")

    def _fwd(self, msg, tcp):
        self.log.append((tcp, msg))
        if _under_invalid(msg):
            return _nxdomain(msg)
        if _first_label(msg).startswith("slow"):
            time.sleep(self.slow)
        try:
            if tcp:
                s = self.lab.internet.socket(socket.AF_INET, socket.SOCK_STREAM)
                with s:
                    s.settimeout(3)
                    s.connect((self.forward, 53))
                    s.sendall(struct.pack("!H", len(msg)) + msg)
                    n = struct.unpack("!H", _recv_exact(s, 2))[0]
                    return _recv_exact(s, n)
            s = self.lab.internet.socket(socket.AF_INET, socket.SOCK_DGRAM)
            with s:
                s.settimeout(3)
                s.sendto(msg, (self.forward, 53))
                return s.recv(65535)
        except (OSError, EOFError):
            return None

    def _udp(self):
        while True:
            try:
                msg, peer = self.u.recvfrom(65535)
            except OSError:
                return

            def one(msg=msg, peer=peer):
                out = self._fwd(msg, False)
                if out:
                    try:
                        self.u.sendto(out, peer)
                    except OSError:
                        pass
            threading.Thread(target=one, daemon=True).start()

    def _tcp(self):
        while True:
            try:
                c, _ = self.t.accept()
            except OSError:
                return

            def one(c=c):
                with c:
                    try:
                        while True:
                            n = struct.unpack("!H", _recv_exact(c, 2))[0]
                            out = self._fwd(_recv_exact(c, n), True)
                            if not out:
                                return
                            c.sendall(struct.pack("!H", len(out)) + out)
                    except (OSError, EOFError):
                        return
            threading.Thread(target=one, daemon=True).start()


# A sandbox process that asks the resolver at its real port, past Docker's DNAT of :53 (any
# process reads the port in /proc/net/udp and /proc/net/tcp: 127.0.0.11 is 0B00007F), over
# UDP and TCP, for the name in argv[1]. Prints READY, then one JSON line: per transport the
# answer's rcode, or the error.
DIRECT_QUERY = r'''
import json, socket, struct, sys
name = sys.argv[1]
def port_of(path, state):
    for line in open(path).read().splitlines()[1:]:
        f = line.split()
        ip, p = f[1].split(":")
        if ip == "0B00007F" and f[3] == state:
            return int(p, 16)
q = struct.pack("!HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
for label in name.split("."):
    q += bytes([len(label)]) + label.encode()
q += b"\0" + struct.pack("!HH", 1, 1)
out = {"udp_port": port_of("/proc/net/udp", "07"), "tcp_port": port_of("/proc/net/tcp", "0A")}
print("READY", flush=True)
for kind in ("udp", "tcp"):
    try:
        if kind == "udp":
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(2)
            s.sendto(q, ("127.0.0.11", out["udp_port"]))
            m = s.recv(4096)
        else:
            s = socket.create_connection(("127.0.0.11", out["tcp_port"]), timeout=2)
            s.sendall(struct.pack("!H", len(q)) + q)
            m = s.recv(4096)[2:]
        out[kind] = f"rcode {m[3] & 15}" if len(m) > 3 else "closed"
    except OSError as e:
        out[kind] = type(e).__name__ + ": " + (e.strerror or str(e))
print(json.dumps(out))
'''


def asked(resolver: HostSideResolver, token: str) -> list[str]:
    """The queries for names holding `token` that reached the resolver."""
    return [("tcp " if tcp else "udp ") + repr(msg) for tcp, msg in resolver.log if token.encode() in msg.lower()]
