"""Hostname pinning against a sender that rewrites its bytes after the reader read them.

A socket can send from pages the process keeps writing to: MSG_ZEROCOPY sends from its own
memory, sendfile() from a file's page cache. The packet in the queue points at those pages
until it leaves the sandbox. The reader used to judge its copy and let the queued packet
itself go on (NF_REPEAT): a process that rewrote the page while the reader held the first
segment (waiting for the rest of the hello) had the server receive the rewritten bytes, on an
address learned for another name. Now every packet the reader lets leave goes back with the
bytes it judged (NFQA_PAYLOAD), so the server gets exactly those.

No capability is needed for any of this (the lab's sockets are the test process's; none of the
calls below needs a privilege). A judged segment lost on the way is sent again by the socket,
from its pages: that retransmission, too, must reach the server as judged (the tests at the end).
"""
import mmap
import os
import socket
import ssl
import time

import pytest

import quic_initial as qi
from lab import wait_for
from test_pinning import HTTP_PORT, TLS_PORT, V4, V6, connect, learn, servers  # noqa: F401 (fixtures)
from test_pinning import pinned  # noqa: F401 (fixture)

SO_ZEROCOPY = 60
MSG_ZEROCOPY = 0x4000000
SO_NO_CHECK = 11


def held(pinned, before):
    """Waits until the reader holds a new flow's first bytes (it counts it as inspected)."""
    wait_for(lambda: pinned.status()["pin"]["inspected"] > before, 3.0, "the reader to hold the first segment")


def read_all(s) -> bytes:
    data = b""
    s.settimeout(3.0)
    try:
        while chunk := s.recv(4096):
            data += chunk
    except OSError as e:
        data += f"<{e!r}>".encode()
    return data


def http_rewritten(lab, pinned, addr, how, tmp_path, pause: float = 0.0) -> bytes:
    """Sends a request head naming allowed.test (without its last line end) from a page, waits
    until the reader holds it, rewrites the page to name same-ip.test, and ends the head
    (`pause` seconds later: the reader lets a head incomplete for 100 ms through)."""
    head = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n"
    at = head.index(b"allowed.test")
    before = pinned.status()["pin"]["inspected"]
    s = connect(lab, addr, HTTP_PORT)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if how == "zerocopy":
        page = mmap.mmap(-1, 4096)
        page[:len(head)] = head
        s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
        assert s.send(memoryview(page)[:len(head)], MSG_ZEROCOPY) == len(head)
        held(pinned, before)
        page[at:at + 12] = b"same-ip.test"
    else:
        path = tmp_path / "request"
        path.write_bytes(head)
        fd = os.open(path, os.O_RDWR)
        try:
            assert os.sendfile(s.fileno(), fd, 0, len(head)) == len(head)
            held(pinned, before)
            os.pwrite(fd, b"same-ip.test", at)
        finally:
            os.close(fd)
    time.sleep(pause)  # the scenario: a client that pauses before it ends its head
    s.send(b"\r\n")
    with s:
        return read_all(s)


@pytest.mark.parametrize("how", ["zerocopy", "sendfile"])
@pytest.mark.parametrize("addr", [V4, V6])
def test_a_request_rewritten_in_its_pages_reaches_the_server_as_judged(lab, pinned, addr, how, tmp_path):  # noqa: F811
    answer = http_rewritten(lab, pinned, addr, how, tmp_path)
    # The lab's HTTP server answers with the Host it received.
    assert answer.endswith(b"host=allowed.test"), answer


def hello_rewritten(lab, pinned, addr) -> str:
    """The client's TLS sends a hello naming same-ip.test; the page shows the reader one naming
    allowed.test until the reader holds it (all but its last byte). Returns how the client's
    handshake ended."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(inc, out, server_hostname="same-ip.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = out.read()
    shown = hello.replace(b"same-ip.test", b"allowed.test")
    page = mmap.mmap(-1, 8192)
    page[:len(shown)] = shown
    before = pinned.status()["pin"]["inspected"]
    s = connect(lab, addr, TLS_PORT)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
    assert s.send(memoryview(page)[:len(shown) - 1], MSG_ZEROCOPY) == len(shown) - 1
    held(pinned, before)
    page[:len(hello)] = hello
    s.send(hello[-1:])
    s.settimeout(3.0)
    outcome = None
    try:
        while outcome is None:
            try:
                tls.do_handshake()
                outcome = "handshake completed"
            except ssl.SSLWantReadError:
                if data := out.read():
                    s.sendall(data)
                chunk = s.recv(65536)
                if not chunk:
                    outcome = "closed"
                inc.write(chunk)
    except ssl.SSLError as e:
        outcome = f"tls error: {e.reason}"
    except OSError as e:
        outcome = f"{e!r}"
    s.close()
    return outcome


def test_a_client_hello_rewritten_in_its_pages_reaches_the_server_as_judged(lab, pinned, addr=V4):  # noqa: F811
    """The server must get the hello that was judged, so the client's handshake (whose
    transcript has the other hello) fails instead of reaching same-ip.test."""
    outcome = hello_rewritten(lab, pinned, addr)
    # The server read the judged hello: the two ends' transcripts differ.
    assert outcome != "handshake completed", "the server took the rewritten hello"
    assert pinned.status()["pin"]["admitted"] >= 1


def test_a_quic_initial_rewritten_in_its_pages_reaches_the_server_as_judged(lab, pinned, tmp_path):  # noqa: F811
    """The hello in two Initials; the first sent with sendfile() and no UDP checksum (SO_NO_CHECK:
    nothing reads the pages before the packet leaves), rewritten to name same-ip.test while the
    reader waits for the second. The lab's UDP echo server on 443 echoes what it received."""
    a = qi.client_hello("allowed.test")
    b = a.replace(b"allowed.test", b"same-ip.test")
    cut = a.index(b"allowed.test") + 40
    dcid = os.urandom(8)
    first_a, first_b = qi.initial(dcid, a[:cut]), qi.initial(dcid, b[:cut])
    assert len(first_a) == len(first_b)
    second = qi.initial(dcid, a[cut:], pn=1, offset=cut)
    path = tmp_path / "datagram"
    path.write_bytes(first_a)
    fd = os.open(path, os.O_RDWR)
    before = pinned.status()["pin"]["inspected"]
    s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
    s.connect((V4, 443))
    s.settimeout(2.0)
    try:
        assert os.sendfile(s.fileno(), fd, 0, len(first_a)) == len(first_a)
        held(pinned, before)
        os.pwrite(fd, first_b, 0)
    finally:
        os.close(fd)
    s.send(second)
    echoes = [s.recv(65536), s.recv(65536)]
    s.close()
    assert first_b not in echoes, "the server received the rewritten Initial"
    assert sorted(echoes) == sorted([first_a, second]), "the server did not get the judged Initials"


# The HTTP attack as a sandbox process runs it: its own socket, its own page. Sends the head
# without its last line end, says HELD, waits for a line on stdin (the reader holds the
# segment), rewrites the page, ends the head and prints the answer as JSON.
ZEROCOPY_ATTACKER = r'''
import json, mmap, socket, sys
addr, port = sys.argv[1], int(sys.argv[2])
head = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n"
page = mmap.mmap(-1, 4096)
page[:len(head)] = head
s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(3.0)
s.connect((addr, port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.setsockopt(socket.SOL_SOCKET, 60, 1)  # SO_ZEROCOPY
print("READY", flush=True)
assert s.send(memoryview(page)[:len(head)], 0x4000000) == len(head)  # MSG_ZEROCOPY
sys.stdin.readline()
at = head.index(b"allowed.test")
page[at:at + 12] = b"same-ip.test"
s.send(b"\r\n")
data = b""
try:
    while chunk := s.recv(4096):
        data += chunk
except OSError as e:
    data += repr(e).encode()
print(json.dumps({"answer": data.decode(errors="replace")}))
'''


@pytest.mark.parametrize("who", ["uid 65534", "docker caps"])
def test_a_sandbox_process_rewriting_its_zero_copy_page_reaches_the_server_as_judged(lab, pinned, who):  # noqa: F811
    from test_dns_integrity import DOCKER_CAPS, attacker, attacker_result
    before = pinned.status()["pin"]["inspected"]
    p = attacker(lab, ZEROCOPY_ATTACKER, V4, HTTP_PORT, uid=who == "uid 65534",
                 caps="-all" if who == "uid 65534" else DOCKER_CAPS)
    held(pinned, before)
    p.stdin.write(b"go\n")
    p.stdin.flush()
    res = attacker_result(p)
    assert res["answer"].endswith("host=allowed.test"), res


# ---- A judged segment lost on the way -------------------------------------------------------
#
# The server's namespace drops the first segment with bytes of every connection to the pinned
# servers, once: the judged copy never arrives, the byte after it does, and the client's socket
# sends the first segment again from its pages, which the process rewrote meanwhile. The
# retransmission used to leave unread (a TLS flow's on the fast path, a followed HTTP
# connection's as "bytes already read"); now the reader keeps a flow's judged bytes until the
# server has answered and sends them in place of whatever a retransmission carries.

LOSSY = """\
table inet egressd_test_lossy {
  chain prerouting {
    type filter hook prerouting priority 0; policy accept;
    tcp dport { %d, %d } meta length > 80 ct mark 0 ct mark set 1 counter drop
  }
}
"""


@pytest.fixture
def lossy(lab):
    """Loses the first segment with bytes (longer than a bare ACK or SYN with options) of every
    new connection to the TLS and HTTP servers, in the server's namespace."""
    lab.internet.exec("nft", "-f", "-", input=LOSSY % (TLS_PORT, HTTP_PORT))
    yield
    lab.internet.exec("nft", "delete", "table", "inet", "egressd_test_lossy", check=False)


def lost(lab) -> int:
    out = lab.internet.exec("nft", "list", "table", "inet", "egressd_test_lossy").stdout
    return int(out.split("packets ")[1].split()[0])


@pytest.mark.parametrize("how", ["zerocopy", "sendfile"])
@pytest.mark.parametrize("addr", [V4, V6])
def test_a_lost_request_sent_again_from_rewritten_pages_reaches_the_server_as_judged(
        lab, pinned, lossy, addr, how, tmp_path):  # noqa: F811
    answer = http_rewritten(lab, pinned, addr, how, tmp_path)
    assert lost(lab) == 1, "the server's namespace did not lose the judged segment"
    assert answer.endswith(b"host=allowed.test"), answer


def sent_from_page(s, how, data: bytes, tmp_path):
    """Sends data from a page (MSG_ZEROCOPY from an anonymous mapping, or sendfile from a file)
    and returns a function that rewrites the page from its start, the send still unacknowledged."""
    if how == "zerocopy":
        page = mmap.mmap(-1, 4096)
        page[:len(data)] = data
        s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
        assert s.send(memoryview(page)[:len(data)], MSG_ZEROCOPY) == len(data)

        def rewrite(new: bytes):
            page[:len(new)] = new
        return rewrite
    path = tmp_path / "page"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.sendfile(s.fileno(), fd, 0, len(data)) == len(data)
    except BaseException:
        os.close(fd)
        raise

    def rewrite(new: bytes):
        try:
            os.pwrite(fd, new, 0)
        finally:
            os.close(fd)
    return rewrite


@pytest.mark.parametrize("how", ["zerocopy", "sendfile"])
@pytest.mark.parametrize("addr", [V4, V6])
def test_lost_other_bytes_sent_again_from_rewritten_pages_reach_the_server_as_judged(
        lab, pinned, lossy, addr, how, tmp_path):  # noqa: F811
    """An attack review (2026-12-07), no capability needed: first bytes that are neither TLS nor
    HTTP let the flow through by its address, and it took the fast path at once. Lost on the
    way after the verdict, they were sent again from pages rewritten to a request naming
    same-ip.test, unread, and the server answered for it (a hello for it, the same way, and with
    NET_RAW a forged timestamp that has the server drop the judged bytes, PAWS). Such a flow is
    now followed until its server has spoken after them: the retransmission leaves as judged."""
    bad = b"GET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"
    other = b"(" + b"x" * (len(bad) - 2) + b"\n"
    before = pinned.status()["pin"]["admitted"]
    s = connect(lab, addr, HTTP_PORT)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rewrite = sent_from_page(s, how, other, tmp_path)
    wait_for(lambda: pinned.status()["pin"]["admitted"] > before, 3.0, "the reader to admit the other bytes")
    rewrite(bad)
    with s:
        answer = read_all(s)
    assert lost(lab) == 1, "the server's namespace did not lose the judged segment"
    assert b"same-ip.test" not in answer, f"the server answered a request for same-ip.test: {answer!r}"


@pytest.mark.parametrize("lose", [False, True], ids=["kept", "lost"])
@pytest.mark.parametrize("how", ["zerocopy", "sendfile"])
def test_a_head_let_through_incomplete_then_rewritten_in_its_pages_reaches_the_server_as_judged(
        lab, pinned, how, lose, tmp_path):  # noqa: F811
    """The client pauses past 100 ms before it ends its head, so the reader lets the first
    segment through as read; lost on the way (`lost`), the socket sends it again from the
    rewritten page, which the followed connection patches with the bytes read."""
    if lose:
        lab.internet.exec("nft", "-f", "-", input=LOSSY % (TLS_PORT, HTTP_PORT))
    try:
        answer = http_rewritten(lab, pinned, V4, how, tmp_path, pause=0.5)
        if lose:
            assert lost(lab) == 1, "the server's namespace did not lose the segment let through"
    finally:
        lab.internet.exec("nft", "delete", "table", "inet", "egressd_test_lossy", check=False)
    assert answer.endswith(b"host=allowed.test"), answer


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_lost_client_hello_sent_again_from_rewritten_pages_reaches_the_server_as_judged(
        lab, pinned, lossy, addr):  # noqa: F811
    outcome = hello_rewritten(lab, pinned, addr)
    assert lost(lab) == 1, "the server's namespace did not lose the judged segment"
    assert outcome != "handshake completed", "the server took the rewritten hello"


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_tls_flow_takes_the_fast_path_once_its_server_answered(lab, pinned, addr):  # noqa: F811
    """A TLS flow stays followed through its handshake, until the server has spoken after the
    record that ended it. 100 exchanges after the handshake must add at most those few trips
    (queue 18), and the flow then carries the phase's ct mark, not the follow mark."""
    from test_pinning_attacks import _queue_trips
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    before = _queue_trips(lab, 18)
    s = connect(lab, addr, TLS_PORT)
    sport = s.getsockname()[1]
    with ctx.wrap_socket(s, server_hostname="allowed.test") as t:
        for i in range(100):
            t.sendall(b"ping%d" % i)
            assert t.recv(100) == b"tls:ping%d" % i
        trips = _queue_trips(lab, 18) - before
        flows = [line for line in lab.sandbox.read_proc("/proc/net/nf_conntrack").splitlines()
                 if f" sport={sport} dport={TLS_PORT} " in line]
    # The client's Finished, and its next one or two records (the first whose ACK shows the
    # server spoke after the Finished arrived).
    assert 1 <= trips <= 3, f"{trips} packets of the TLS flow went through the reader after its hello"
    assert len(flows) == 1, flows
    mark = int(flows[0].split("mark=")[1].split()[0])
    assert mark not in (0, 0x7ffffffc), f"the flow's ct mark is {mark:#x}: not the phase's"
