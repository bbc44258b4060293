"""Hostname pinning with curl, resolving through egressd like any program in the sandbox.

curl runs in the sandbox with a resolv.conf naming the lab's DNS server (bind-mounted for that
one command): its lookups are redirected to egressd's proxy, which learns the address for the
name. The connection that follows is judged by the name curl presents: the name it resolved
passes; the same address reached with another TLS server name (--connect-to) or HTTP Host is
reset at once (curl exits 35 or 56, not 28, a timeout).
"""
import time

import pytest

from lab import DNS_V4
from test_pinning import HTTP_PORT, TLS_PORT, pinned, servers  # noqa: F401 (fixtures)

RESET_EXITS = {35, 56}  # SSL connect error / failure receiving data: the connection was reset


def curl(lab, tmp_path, *args):
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {DNS_V4}\noptions attempts:1 timeout:2\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    t0 = time.monotonic()
    r = lab.sandbox.exec("unshare", "-m", "sh", "-c",
                         'mount --bind "$0" /etc/resolv.conf && mount --bind "$1" /etc/hosts && shift && exec "$@"',
                         str(resolv), str(hosts), "curl", "-sS", "--max-time", "5", *args,
                         check=False, timeout=15)
    return r.returncode, r.stdout, r.stderr, time.monotonic() - t0


@pytest.mark.parametrize("family", ["-4", "-6"])
def test_curl_reaches_the_name_it_resolved_and_is_reset_for_another(lab, pinned, tmp_path, family):  # noqa: F811
    rc, out, err, _ = curl(lab, tmp_path, family, f"http://allowed.test:{HTTP_PORT}/")
    assert rc == 0 and out == "host=allowed.test:8081", (rc, out, err)
    # TLS: the pin server answers "tls:" + what it read, which curl takes as HTTP/0.9, and
    # keeps the connection open (curl stops at --max-time: exit 28 with the answer read).
    rc, out, err, _ = curl(lab, tmp_path, family, "-k", "--http0.9", "--max-time", "1",
                           f"https://allowed.test:{TLS_PORT}/")
    assert rc in (0, 28) and out.startswith("tls:GET / HTTP/1.1"), (rc, out, err)

    rc, out, err, secs = curl(lab, tmp_path, family, "-H", "Host: same-ip.test", f"http://allowed.test:{HTTP_PORT}/")
    assert rc in RESET_EXITS and secs < 3, (rc, out, err, secs)
    rc, out, err, secs = curl(lab, tmp_path, family, "-k", "--http0.9",
                              "--connect-to", f"same-ip.test:{TLS_PORT}:allowed.test:{TLS_PORT}",
                              f"https://same-ip.test:{TLS_PORT}/")
    assert rc in RESET_EXITS and secs < 3, (rc, out, err, secs)
    lines = [r.get("pin") or "" for r in pinned.request({"cmd": "denied"})["records"]]
    assert any(l.startswith("tls sni same-ip.test") for l in lines), lines
    assert any(l.startswith("http host same-ip.test") for l in lines), lines
