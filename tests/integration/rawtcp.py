"""Raw TCP for the attacker scripts (*_attacker.py): the Internet checksum, a TCP segment with its
checksum right, wrong or left to the kernel, an IP header in front of one, and a connection's
SYN-ACK read off an AF_PACKET socket. Addresses are strings; IPv6 if they hold a ":".

The scripts run in the sandbox as `python3 -c SCRIPT`, where attacker() (test_dns_integrity.py)
puts this directory on PYTHONPATH, or by their path, which puts it on sys.path."""
import socket
import struct
import time


def csum(b: bytes) -> int:
    """The Internet checksum (RFC 1071) of b."""
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xffff) + (s >> 16)
    return (~s) & 0xffff


def _packed(a: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6, a) if ":" in a else socket.inet_aton(a)


def tcp(src: str, dst: str, sport: int, dport: int, seq: int, ack: int, flags: int, *, good: bool | None,
        win: int = 64240, payload: bytes = b"") -> bytes:
    """A TCP segment from src:sport to dst:dport: a 20-byte header (no options), then payload.
    Its checksum: good=True the right one; False a wrong one, the right one ^ 0x5a5a (the
    receiver drops the segment; conntrack, on the way, takes it); None 0, for a socket whose
    kernel fills it in (IPV6_CHECKSUM)."""
    h = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, win, 0, 0) + payload
    if good is None:
        return h
    if ":" in src:
        ph = _packed(src) + _packed(dst) + struct.pack("!IxxxB", len(h), 6)
    else:
        ph = _packed(src) + _packed(dst) + struct.pack("!BBH", 0, 6, len(h))
    c = csum(ph + h)
    return h[:16] + struct.pack("!H", c if good else c ^ 0x5a5a) + h[18:]


def ip(src: str, dst: str, seg: bytes) -> bytes:
    """The TCP segment seg behind an IP header from src to dst: IPv6 (hop limit 64) or IPv4
    (TTL 64, DF, id 0, its checksum right)."""
    if ":" in src:
        return struct.pack("!IHBB", 6 << 28, len(seg), 6, 64) + _packed(src) + _packed(dst) + seg
    h = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(seg), 0, 0x4000, 64, 6, 0, _packed(src), _packed(dst))
    return h[:10] + struct.pack("!H", csum(h)) + h[12:] + seg


def sniffer(v6: bool, ifname: str = "eth0", timeout: float = 2.0) -> socket.socket:
    """An AF_PACKET socket on ifname for the IPv6 (v6) or IPv4 frames that come in (bound to
    one protocol, it sees none that go out); each read waits at most `timeout` s. Open it before
    connect() to see the SYN-ACK."""
    pk = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x86dd if v6 else 0x0800))
    pk.bind((ifname, 0))
    pk.settimeout(timeout)
    return pk


def synack(pk: socket.socket, v6: bool, sport: int, dport: int, seconds: float = 2.0) -> tuple[int, int] | None:
    """(seq, ack) of the first SYN-ACK from port sport to port dport that the sniffer() pk reads
    (the server's initial sequence number and the client's next one), or None if none comes
    within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            f = pk.recv(65535)[14:]
        except socket.timeout:
            return None
        proto, t = (f[6], f[40:]) if v6 else (f[9], f[(f[0] & 15) * 4:])
        if proto != 6:
            continue
        sp, dp, seq, ack, _off, fl = struct.unpack("!HHIIBB", t[:14])
        if (sp, dp) == (sport, dport) and fl & 0x12 == 0x12:
            return seq, ack
    return None
