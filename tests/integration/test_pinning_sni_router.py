"""Hostname pinning in front of an SNI router: HAProxy (Debian's, `mode tcp`, `req.ssl_sni`),
the usual way to put several TLS origins behind one address without terminating TLS, which
picks the origin by the name it reads in the hello's bytes as they come.

A hello cut into two TLS records inside an extension of the client's own was read record by
record by egressd (allowed.test) and as one run of bytes by HAProxy, which then found
same-ip.test: the handshake completed with same-ip.test's origin (an attack review, IPv4 and
IPv6, no capability). egressd now refuses any hello split over records."""
import json
import socket
import subprocess
import sys

import pytest

import lab as labmod
from lab import wait_for
from test_pinning import V4, V6, assert_reset, learn, pinned, servers, tls  # noqa: F401 (fixtures)

ROUTER_PORT, ORIGIN_A, ORIGIN_B = 9443, 19001, 19002

ORIGINS = r"""
import socket, ssl, sys, threading
# Two TLS origins on 127.0.0.1 (allowed, same-ip): each answers any data with
# b"backend=<name> sni=<the name OpenSSL read>". argv: cert, key, port A, port B.
cert, key, pa, pb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def serve(port, name):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    seen = {}
    ctx.sni_callback = lambda sock, sni, _c: seen.__setitem__(id(sock), sni or "")
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(64)
    def handle(c):
        try:
            with ctx.wrap_socket(c, server_side=True) as s:
                s.settimeout(5)
                s.recv(100)
                s.sendall(f"backend={name} sni={seen.get(id(s), '?')}".encode())
        except Exception:
            pass
    while True:
        c, _ = ls.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()
for port, name in ((pa, "allowed"), (pb, "same-ip")):
    threading.Thread(target=serve, args=(port, name), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

HAPROXY_CFG = f"""\
global
    log stderr format short local0 info
defaults
    mode tcp
    timeout connect 3s
    timeout client 10s
    timeout server 10s
frontend sni_router
    bind {V4}:{ROUTER_PORT}
    bind [{V6}]:{ROUTER_PORT}
    tcp-request inspect-delay 5s
    tcp-request content accept if {{ req.ssl_hello_type 1 }}
    use_backend same_ip if {{ req.ssl_sni -i same-ip.test }}
    use_backend allowed if {{ req.ssl_sni -i allowed.test }}
backend allowed
    server a 127.0.0.1:{ORIGIN_A}
backend same_ip
    server b 127.0.0.1:{ORIGIN_B}
"""


@pytest.fixture
def sni_router(lab, pinned, tmp_path):  # noqa: F811
    # The certificate the servers fixture made (pinned depends on it).
    p = lab.spawn([sys.executable, "-c", ORIGINS, tmp_path / "cert.pem", tmp_path / "key.pem", ORIGIN_A, ORIGIN_B],
                  netns=lab.internet, stdout=subprocess.PIPE)
    assert labmod._read_line(p, 10.0, "the origins").strip() == "ready"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG)
    lab.spawn(["haproxy", "-db", "-f", cfg], netns=lab.internet, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        for addr in (V4, V6):
            with lab.internet.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                if s.connect_ex((addr, ROUTER_PORT)) != 0:
                    return False
        return True
    wait_for(listening, 10.0, "haproxy to listen")
    return pinned


def client(lab, addr: str, mode: str, ext_type: str = "0xfafa", nobody: bool = False) -> dict:
    argv = [sys.executable, str(labmod.HERE / "tls_split_client.py"), addr, str(ROUTER_PORT), mode, ext_type]
    if nobody:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--", *argv]
    p = lab.spawn(argv, netns=lab.sandbox, stdout=subprocess.PIPE)
    out, _ = p.communicate(timeout=20)
    return json.loads(out.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("addr", [V4, V6])
def test_the_router_takes_the_allowed_name_to_its_origin_and_egressd_refuses_the_other(lab, sni_router, addr):
    assert client(lab, addr, "plain") == {"step": "done", "answer": "backend=allowed sni=allowed.test"}
    assert_reset(tls(lab, addr, "same-ip.test", port=ROUTER_PORT), "sni same-ip.test to the router")


@pytest.mark.parametrize("ext_type", ["0xfafa", "0x0015"], ids=["grease", "padding"])
@pytest.mark.parametrize("nobody", [False, True], ids=["root", "uid 65534"])
@pytest.mark.parametrize("addr", [V4, V6])
def test_a_hello_cut_across_records_never_reaches_another_origin_behind_an_sni_router(lab, sni_router, addr, nobody,
                                                                                      ext_type):
    res = client(lab, addr, "split", ext_type, nobody=nobody)
    assert not res.get("answer", "").startswith("backend=same-ip"), \
        f"a TLS handshake completed with same-ip.test's origin through the pinned address: {res}"
    assert "answer" not in res, f"a hello split over records was let through: {res}"
    assert any("ClientHello split over TLS records" in line for line in sni_router.log().splitlines()), \
        sni_router.log()
