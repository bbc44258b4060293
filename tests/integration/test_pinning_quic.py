"""Hostname pinning for QUIC (docs/pinning.md, issue 16 point 4) against the real kernel.

The contract: in an allowlist phase, UDP to port 443 of an address allowed only because an
allowlisted name resolved to it through egressd must start with QUIC v1/v2 Initials whose
ClientHello names a name the phase allows AND that resolved to that address. Another name, no
name, or anything that is not an Initial egressd can open is refused with ICMP
administratively prohibited (the client learns at once and can fall back to TCP), and recorded
in `denied`. UDP to other ports of such an address is decided by the address alone.

Real QUIC: Debian's ngtcp2 examples (gtlsserver in the internet namespace on 443, gtlsclient in
the sandbox), over IPv4 and IPv6; the address is learned by a query through egressd's proxy.
"""
import errno
import socket
import subprocess
import time

import pytest

import lab as labmod
from lab import wait_for
from test_pinning import HOSTS, V4, V6, learn, policy

QUIC_PORT = 443
UDP_ECHO_PORT = 9443
CLIENT_TIMEOUT = 15.0  # s: bound on one gtlsclient run (its handshake timeout is 3 s)

UDP_ECHO = """
import socket, sys, threading
def echo(addr):
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, int(sys.argv[1])))
    while True:
        data, peer = s.recvfrom(2048)
        s.sendto(b"echo:" + data, peer)
for a in sys.argv[2:]:
    threading.Thread(target=echo, args=(a,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture
def quic_servers(lab, tmp_path):
    start_quic_servers(lab, tmp_path)


def start_quic_servers(lab, tmp_path, *server_args, echo=True):
    """gtlsserver on QUIC_PORT of V4 and V6 in the internet namespace (with server_args, e.g.
    timeouts), a UDP echo beside it when echo, and the lab's DNS serving HOSTS."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-subj", "/CN=allowed.test", "-days", "1"],
                   check=True, capture_output=True, timeout=30)
    htdocs = tmp_path / "htdocs"
    htdocs.mkdir()
    (htdocs / "hello").write_text("hello over quic\n")
    for addr in (V4, V6):
        lab.spawn(["gtlsserver", "-q", *server_args, "-d", htdocs, addr, QUIC_PORT, key, cert], netns=lab.internet,
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if echo:
        p = lab.spawn(["/usr/bin/python3", "-c", UDP_ECHO, UDP_ECHO_PORT, V4, V6], netns=lab.internet,
                      stdout=subprocess.PIPE)
        assert labmod._read_line(p, 10.0, "udp echo ready").strip() == "ready"
    # gtlsserver prints nothing when quiet: wait until both sockets are bound.
    def bound():
        out = lab.internet.exec("ss", "-Hlun", f"sport = :{QUIC_PORT}").stdout
        return V4 in out and V6 in out
    wait_for(bound, 10.0, f"gtlsserver to bind {V4} and {V6} port {QUIC_PORT}")
    lab.dns.restart(hosts=HOSTS)


def quic_get(lab, tmp_path, addr, sni):
    """gtlsclient in the sandbox: GET /hello over QUIC with this SNI. (ok, seconds)."""
    out = tmp_path / f"dl-{sni}-{addr.replace(':', '_')}-{time.monotonic_ns()}"
    out.mkdir()
    # gtlsclient sends the host it is given as SNI only when it is a name: give it the name,
    # resolved to `addr` by a hosts file bind-mounted for this one command.
    hosts = tmp_path / f"hosts-{time.monotonic_ns()}"
    hosts.write_text(f"{addr} {sni}\n")
    t0 = time.monotonic()
    r = lab.sandbox.exec("unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
                         "gtlsclient", "-q", "--exit-on-all-streams-close", "--handshake-timeout=3s",
                         "--timeout=3s", f"--download={out}", sni, str(QUIC_PORT), f"https://{sni}/hello",
                         check=False, timeout=CLIENT_TIMEOUT)
    got = (out / "hello").read_text() if (out / "hello").exists() else ""
    return got == "hello over quic\n" and r.returncode == 0, time.monotonic() - t0


@pytest.fixture
def pinned(lab, egressd, quic_servers):
    d = egressd(policy())
    learn(lab)
    return d


@pytest.mark.parametrize("addr", [V4, V6])
def test_quic_with_the_learned_name_passes_and_another_name_is_refused(lab, pinned, tmp_path, addr):
    ok, _ = quic_get(lab, tmp_path, addr, "allowed.test")
    assert ok, "QUIC with the learned, allowed SNI did not get through"
    ok, secs = quic_get(lab, tmp_path, addr, "same-ip.test")
    assert not ok, "QUIC with SNI same-ip.test reached the server"
    st = pinned.status()["pin"]
    assert st["admitted"] >= 1 and st["reset"] >= 1, st
    host = f"[{addr}]" if ":" in addr else addr
    lines = [r.get("pin") for r in pinned.request({"cmd": "denied"})["records"] if r.get("pin")]
    assert f"quic sni same-ip.test to {host}:{QUIC_PORT}; address learned for allowed.test" in lines, lines


@pytest.mark.parametrize("addr", [V4, V6])
def test_udp_443_that_is_not_quic_gets_admin_prohibited_at_once(lab, pinned, addr):
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = lab.sandbox.socket(fam, socket.SOCK_DGRAM)
    s.settimeout(2.0)
    s.connect((addr, QUIC_PORT))
    t0 = time.monotonic()
    s.send(b"\x00" * 1200)  # not a long header: not an Initial
    with pytest.raises(OSError) as e:
        s.recv(100)
    # ICMP administratively prohibited reaches a connected UDP socket as EHOSTUNREACH (v4)
    # or EACCES (v6 code 1), never as a timeout.
    assert e.value.errno in (errno.EHOSTUNREACH, errno.EACCES, errno.ECONNREFUSED), e.value
    assert time.monotonic() - t0 < 1.0
    s.close()
    lines = [r.get("pin") or "" for r in pinned.request({"cmd": "denied"})["records"]]
    assert any(l.startswith("quic unparseable") for l in lines), lines


def test_other_udp_ports_of_a_learned_address_are_decided_by_the_address(lab, pinned):
    before = pinned.status()["pin"]["inspected"]
    s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3.0)
    s.connect((V4, UDP_ECHO_PORT))
    s.send(b"x")
    assert s.recv(100) == b"echo:x"
    s.close()
    assert pinned.status()["pin"]["inspected"] == before


def test_quic_is_not_inspected_with_pin_names_false(lab, egressd, quic_servers, tmp_path):
    d = egressd(policy(pin=False))
    learn(lab)
    ok, _ = quic_get(lab, tmp_path, V4, "same-ip.test")
    assert ok, "with pin_names: false the address decides"
    assert d.status()["pin"] is None


@pytest.mark.parametrize("addr", [V4, V6])
def test_quic_to_a_server_that_sends_retry_passes_for_the_learned_name_and_not_for_another(
        lab, egressd, tmp_path, addr):
    """A server that validates addresses (gtlsserver -V) answers the first Initial with a
    Retry; the client sends its hello again under the connection ID and keys the Retry chose,
    with its token. That Initial is the same connection, followed under the new keys: HTTP/3
    works for the learned name, and another name is still refused (its first Initial already)."""
    start_quic_servers(lab, tmp_path, "-V", echo=False)
    d = egressd(policy())
    learn(lab)
    ok, _ = quic_get(lab, tmp_path, addr, "allowed.test")
    assert ok, "QUIC with the learned name through a server's Retry did not get through"
    lines = [r.get("pin") or "" for r in d.request({"cmd": "denied"})["records"]]
    assert not any(l.startswith("quic") for l in lines), lines
    ok, _ = quic_get(lab, tmp_path, addr, "same-ip.test")
    assert not ok, "QUIC with SNI same-ip.test reached the server"
    host = f"[{addr}]" if ":" in addr else addr
    lines = [r.get("pin") or "" for r in d.request({"cmd": "denied"})["records"]]
    assert f"quic sni same-ip.test to {host}:{QUIC_PORT}; address learned for allowed.test" in lines, lines
