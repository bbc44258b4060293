"""Hostname pinning and a TLS 1.3 HelloRetryRequest (docs/pinning.md, "A second ClientHello").

A server that cannot use the client's key shares answers the first ClientHello with a
HelloRetryRequest and takes a second one, and OpenSSL (the lab's server is Python's ssl) takes
the server name from the second hello again. The reader used to judge the first hello only,
so a client whose first hello named allowed.test and offered no key share, and whose second
named same-ip.test, completed its handshake with same-ip.test (no capability needed; found in
an attack review). Now every ClientHello of the flow is judged: the flow stays followed until
an encrypted record starts after the server answered, and a first hello offering early data,
whose records a server skips after a HelloRetryRequest, is refused.

The client (tls13_hrr_client.py) is a small TLS 1.3 client of its own: Python's ssl cannot
be made to send a hello without key shares.
"""
import json
import subprocess
import sys

import pytest

import lab as labmod
from test_pinning import TLS_PORT, V4, V6, learn, servers  # noqa: F401 (fixtures)
from test_pinning import pinned  # noqa: F401 (fixture)

CLIENT = str(labmod.HERE / "tls13_hrr_client.py")
MODES = ["ccs", "noccs", "split", "ahead"]


def hrr(lab, addr, first, second, mode, nobody=False) -> dict:
    argv = [sys.executable, CLIENT, addr, str(TLS_PORT), first, second, mode]
    if nobody:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--"] + argv
    p = lab.spawn(argv, netns=lab.sandbox, stdout=subprocess.PIPE)
    out, _ = p.communicate(timeout=20)
    return json.loads(out.decode().strip().splitlines()[-1])


def pin_records(d) -> list:
    reply = d.request({"cmd": "denied"})
    assert reply.get("ok") is True, reply
    return [r.get("pin") or "" for r in reply["records"]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("addr", [V4, V6])
def test_the_allowed_name_twice_completes_its_handshake(lab, pinned, addr, mode):  # noqa: F811
    """The control: the server really asks for a second hello, and the flow, judged twice, passes."""
    assert hrr(lab, addr, "allowed.test", "allowed.test", mode) == {"step": "done", "answer": "sni=allowed.test"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("addr", [V4, V6])
def test_a_second_hello_naming_another_site_is_refused(lab, pinned, addr, mode):  # noqa: F811
    res = hrr(lab, addr, "allowed.test", "same-ip.test", mode)
    assert res.get("answer") != "sni=same-ip.test", "the server completed a handshake for same-ip.test"
    assert "ConnectionResetError" in res.get("error", ""), res
    host = f"[{addr}]" if ":" in addr else addr
    want = f"a second ClientHello on the connection: tls sni same-ip.test to {host}:{TLS_PORT}"
    assert any(r.startswith(want) for r in pin_records(pinned)), pin_records(pinned)


def test_a_sandbox_process_without_privileges_cannot_name_another_site_in_its_second_hello(lab, pinned):  # noqa: F811
    res = hrr(lab, V4, "allowed.test", "same-ip.test", "ccs", nobody=True)
    assert res.get("answer") != "sni=same-ip.test", "the server completed a handshake for same-ip.test"
    assert "ConnectionResetError" in res.get("error", ""), res


def test_a_first_hello_offering_early_data_is_refused(lab, pinned):  # noqa: F811
    res = hrr(lab, V4, "allowed.test", "same-ip.test", "early")
    assert "ConnectionResetError" in res.get("error", ""), res
    assert any(r.startswith("tls early data (0-RTT) offered on a pinned flow") for r in pin_records(pinned))


# The end of the handshake read, then lost: with Docker's NET_RAW the client forges a pure ACK on
# its own flow whose TCP timestamp runs 2 s ahead; the server's stack takes it, and then drops
# the client's real segments as too old (PAWS) until their timestamps catch up. Meanwhile the
# client sends, by sendfile(), an application data record as long as its second hello: the
# reader read it as the end of the handshake and let the flow onto the fast path, the server
# dropped it, and the retransmission came from the rewritten page: the second hello naming
# same-ip.test, unread, and the server completed the handshake for it (found in an attack
# review; the review's reproducer, made to wait on conditions). Now the flow stays followed
# until the server has spoken after that segment, and the retransmission leaves as read.
PAWS_ATTACKER = r'''
import os, socket, struct, sys, time
sys.path.insert(0, sys.argv[3])
import tls13_hrr_client as t

addr, port = sys.argv[1], int(sys.argv[2])
tap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
tap.bind(("eth0", 0))
print("READY", flush=True)
s = socket.create_connection((addr, port), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)  # the ACK of the HelloRetryRequest at once
c = t.Conn(s)
sid = os.urandom(32)
ch1 = t.client_hello("allowed.test", sid, None)
priv = t.X25519PrivateKey.generate()
pub = priv.public_key().public_bytes(t.serialization.Encoding.Raw, t.serialization.PublicFormat.Raw)
ch2 = t.client_hello("same-ip.test", sid, pub)
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
'''


def test_the_segment_that_ends_the_handshake_cannot_be_lost_and_resent_as_a_second_hello(lab, pinned):  # noqa: F811
    from test_dns_integrity import DOCKER_CAPS, attacker, attacker_result
    from test_pinning_attacks import _queue
    before = _queue(lab, 18)[1]
    p = attacker(lab, PAWS_ATTACKER, V4, TLS_PORT, labmod.HERE, caps=DOCKER_CAPS)
    line = labmod._read_line(p, 15.0, "the attacker's fake record")
    assert line == "SENT", line
    # The reader has read the fake record (handed over and answered) before the page changes.
    labmod.wait_for(lambda: _queue(lab, 18)[1] > before and _queue(lab, 18)[0] == 0, 5.0,
                    "the reader to read the record that ends the handshake")
    p.stdin.write(b"go\n")
    p.stdin.flush()
    res = attacker_result(p, timeout=30.0)
    assert res.get("answer") is None, f"the server took a second hello naming same-ip.test: {res}"
