"""Hostname pinning in the datapath (docs/pinning.md, issue 16) against the real kernel.

The contract: in an allowlist phase, a TCP flow to an address allowed only because an
allowlisted name resolved to it through egressd must start with a TLS ClientHello whose SNI,
or an HTTP/1.x request whose Host, is a name the phase allows AND that resolved to that
address; anything else that is TLS or HTTP (another name, no name, the h2c preface) is reset
at once (the client sees ECONNRESET, not a timeout). Other protocols (server speaks first,
SSH-like) and addresses allowed by an IP entry are not inspected. `enforce.pin_names: false`
turns it off. A refused flow is a `denied` record carrying the decision line; `status` counts
inspected/admitted/reset flows.

Lab: `allowed.test` and `same-ip.test` both resolve to 203.0.113.10 / 2001:db8:3::10 (a
shared CDN address); servers in the internet namespace (pin_servers.py) speak TLS on 8443
(self-signed certificate made by `openssl req` at test time), HTTP on 8081 and an SSH-like
banner on 2222.
"""
import errno
import socket
import ssl
import subprocess
import time

import pytest

import lab as labmod
from lab import DEFAULT_HOSTS, DNS_V4

V4, V6 = "203.0.113.10", "2001:db8:3::10"
IP_ENTRY_V4 = "198.51.100.10"  # allowed by an IP entry: never inspected
HOSTS = {**DEFAULT_HOSTS, "allowed.test": [V4, V6], "same-ip.test": [V4, V6]}
TLS_PORT, HTTP_PORT, BANNER_PORT = 8443, 8081, 2222
RESET_DEADLINE = 1.0  # s: a reset arrives in milliseconds; a timeout would take the full 3 s


def policy(pin: bool | None = None) -> str:
    enforce = "" if pin is None else f"enforce: {{ pin_names: {'true' if pin else 'false'} }}\n"
    return f"""\
initial_phase: agent
dns: {{ upstream: ["{DNS_V4}"] }}
{enforce}phases:
  agent:
    network_mode: allowlist
    allowed_hosts: [allowed.test, {IP_ENTRY_V4}]
  elsewhere:
    network_mode: allowlist
    allowed_hosts: [b.example.com]
"""


@pytest.fixture
def servers(lab, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=allowed.test", "-days", "1"],
                   check=True, capture_output=True, timeout=30)
    p = lab.spawn(["/usr/bin/python3", str(labmod.HERE / "pin_servers.py"), cert, key, V4, V6, IP_ENTRY_V4],
                  netns=lab.internet, stdout=subprocess.PIPE)
    line = labmod._read_line(p, 10.0, "pin_servers.py ready")
    assert line.strip() == "ready", line
    lab.dns.restart(hosts=HOSTS)
    return p


def learn(lab, name="allowed.test"):
    for qtype in ("A", "AAAA"):
        r = lab.sandbox.dns_query(name, qtype)
        assert r.addresses, f"{name} {qtype} did not resolve through egressd: {r}"


def connect(lab, addr, port, timeout=3.0) -> socket.socket:
    s = lab.sandbox.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect((addr, port))
    return s


def outcome(fn):
    """('ok', value) | ('reset', seconds) | ('timeout', seconds) | ('error', text)"""
    t0 = time.monotonic()
    try:
        return "ok", fn()
    except ConnectionResetError:
        return "reset", time.monotonic() - t0
    except (socket.timeout, TimeoutError):
        return "timeout", time.monotonic() - t0
    except ssl.SSLError as e:
        # A reset in the middle of the handshake surfaces as an SSL EOF/syscall error.
        if "EOF" in str(e) or "reset" in str(e).lower():
            return "reset", time.monotonic() - t0
        return "error", str(e)
    except OSError as e:
        if e.errno == errno.ECONNRESET:
            return "reset", time.monotonic() - t0
        return "error", str(e)


def tls(lab, addr, sni, port=TLS_PORT):
    def run():
        s = connect(lab, addr, port)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with ctx.wrap_socket(s, server_hostname=sni) as t:
            t.sendall(b"ping")
            return t.recv(100)
    return outcome(run)


def http(lab, addr, request: bytes, port=HTTP_PORT):
    def run():
        with connect(lab, addr, port) as s:
            s.sendall(request)
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    return data
                data += chunk
    return outcome(run)


def split_hello(lab, addr, sni, cut: int):
    """A ClientHello made by Python's ssl, sent in two segments (TCP_NODELAY, two sends);
    returns the outcome of reading the server's first answer."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    hello = out.read()
    assert len(hello) > cut

    def run():
        with connect(lab, addr, TLS_PORT) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(hello[:cut])
            time.sleep(0.05)  # not synchronisation: keeps the two sends in two segments
            s.sendall(hello[cut:])
            data = s.recv(4096)
            if not data:
                raise ConnectionResetError
            return data
    return outcome(run)


def assert_reset(res, what):
    kind, value = res
    assert kind == "reset", f"{what}: expected a TCP reset, got {res}"
    assert value < RESET_DEADLINE, f"{what}: the reset took {value:.2f} s"


@pytest.fixture
def pinned(lab, egressd, servers):
    d = egressd(policy())
    learn(lab)
    return d


@pytest.mark.parametrize("addr", [V4, V6])
def test_allowed_sni_passes_and_another_name_on_the_same_address_is_reset(lab, pinned, addr):
    assert tls(lab, addr, "allowed.test") == ("ok", b"tls:ping")
    assert_reset(tls(lab, addr, "same-ip.test"), "tls with sni same-ip.test")
    assert_reset(tls(lab, addr, None), "tls without sni")
    st = pinned.status()
    assert st["pin"]["inspected"] >= 3 and st["pin"]["admitted"] >= 1 and st["pin"]["reset"] >= 2, st["pin"]


def test_denied_records_the_pin_decision(lab, pinned):
    assert_reset(tls(lab, V4, "same-ip.test"), "tls with sni same-ip.test")
    reply = pinned.request({"cmd": "denied"})
    assert reply.get("ok") is True, reply
    recs = reply["records"]
    lines = [r.get("pin") for r in recs if r.get("pin")]
    assert f"tls sni same-ip.test to {V4}:{TLS_PORT}; address learned for allowed.test" in lines, recs


@pytest.mark.parametrize("addr", [V4, V6])
def test_http_host_is_pinned(lab, pinned, addr):
    kind, body = http(lab, addr, b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    assert kind == "ok" and body.endswith(b"host=allowed.test"), (kind, body)
    assert_reset(http(lab, addr, b"GET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"), "http host same-ip.test")
    assert_reset(http(lab, addr, b"\r\n\r\nGET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"),
                 "leading-CRLF request with host same-ip.test")
    assert_reset(http(lab, addr, b"GET / HTTP/1.1\r\n\r\n"), "http without host")
    assert_reset(http(lab, addr, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), "h2c preface")


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_hello_in_two_segments_is_judged_whole(lab, pinned, addr):
    kind, data = split_hello(lab, addr, "allowed.test", 60)
    assert kind == "ok" and data[:1] == b"\x16", (kind, data)
    assert_reset(split_hello(lab, addr, "same-ip.test", 60), "split hello with sni same-ip.test")


def test_ip_entries_and_server_speaks_first_protocols_are_not_inspected(lab, pinned):
    # An IP entry: any SNI passes.
    assert tls(lab, IP_ENTRY_V4, "same-ip.test") == ("ok", b"tls:ping")
    before = pinned.status()["pin"]["inspected"]

    def banner():
        with connect(lab, V4, BANNER_PORT) as s:
            first = s.recv(100)
            s.sendall(b"SSH-2.0-client\r\n")
            return first, s.recv(100)
    assert outcome(banner) == ("ok", (b"SSH-2.0-lab\r\n", b"SSH-2.0-client\r\n"))
    # The banner flow's first client bytes were inspected (classified as another protocol)
    # and admitted; the IP-entry flow was not.
    st = pinned.status()["pin"]
    assert st["inspected"] == before + 1 and st["reset"] == 0, st


def test_pin_names_false_admits_another_sni(lab, egressd, servers):
    d = egressd(policy(pin=False))
    learn(lab)
    assert tls(lab, V4, "same-ip.test") == ("ok", b"tls:ping")
    assert d.status()["pin"] is None


def test_no_reader_fails_closed_and_a_restart_decides_new_flows(lab, egressd, servers):
    d = egressd(policy())
    learn(lab)
    d.kill()  # SIGKILL: the table stays, its queue has no reader
    d.wait()
    res = tls(lab, V4, "allowed.test")
    assert res[0] in ("timeout", "reset"), f"a flow passed with no reader: {res}"
    d.start()
    learn(lab)
    assert tls(lab, V4, "allowed.test") == ("ok", b"tls:ping")
    assert_reset(tls(lab, V4, "same-ip.test"), "tls with sni same-ip.test after a restart")


def test_a_switch_to_a_phase_without_the_name_cuts_the_admitted_flow(lab, pinned):
    s = connect(lab, V4, TLS_PORT)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    t = ctx.wrap_socket(s, server_hostname="allowed.test")
    t.sendall(b"one")
    assert t.recv(100) == b"tls:one"
    rc, _, err = pinned.ctl("apply", "elsewhere")
    assert rc == 0, err

    def more():
        t.sendall(b"two")
        data = t.recv(100)
        if not data:
            raise ConnectionResetError
        return data
    kind, _ = outcome(more)
    assert kind != "ok", "the admitted flow survived a switch to a phase that does not allow its name"
    t.close()
