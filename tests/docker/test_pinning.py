"""Hostname pinning (issue 16, docs/pinning.md) under Docker, in Harbor's sidecar topology
and the suite's other two (topologies.py): a task process resolves an allowlisted name
through Docker's resolver and egressd, and may then use the address it got for that name
only, not for another site behind the same address (a shared CDN address).

The lab's dnsmasq already has two such names: b.example.com (allowed here) and
wild.example.org (not) both resolve to server B, 198.51.100.11. On that address, in the host
namespace, tests/integration/pin_servers.py serves TLS on 8443 (any SNI, self-signed
certificate made at test time) and HTTP on 8081 (answers with the Host it saw).

Each reset check fails with `enforce.pin_names: false` (the flow then passes by address);
the allowed-name checks are the control that the server answers at all.
"""
import json
import os
import subprocess
import sys
import time

from pathlib import Path

import pytest

import dockerlab
import lab as labmod
from dockerlab import DOCKER_DNS, NOBODY, SERVER_B, V4, host_dns_query
from lab import wait_for

ALLOWED, OTHER = "b.example.com", "wild.example.org"   # one address, two names
TLS_PORT, HTTP_PORT = 8443, 8081                       # pin_servers.py's
RESET_MS = 1000   # a reset comes in milliseconds; a dropped flow would run into the probe's 3 s


@pytest.fixture(scope="module")
def pin_servers(session):
    for name in (ALLOWED, OTHER):
        r = host_dns_query(name, V4.gateway4)
        assert r.addresses == [SERVER_B], f"the lab's dnsmasq: {name} -> {r} (both names must share one address)"
    cert, key = session.tmp / "pin-cert.pem", session.tmp / "pin-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-subj", f"/CN={ALLOWED}", "-days", "1"], check=True, capture_output=True, timeout=60)
    p = subprocess.Popen([sys.executable, str(labmod.HERE / "pin_servers.py"), str(cert), str(key), SERVER_B],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=dockerlab._pdeathsig)
    session.procs.append(p)
    try:
        line = labmod._read_line(p, 10.0, "pin_servers.py ready")
        assert line.strip() == "ready", line
        yield p
    finally:
        labmod._stop_process(p)


@pytest.fixture(params=["harbor", "netns-pid", "compose-example"])
def sb(sandboxes, pin_servers, request):
    """A sandbox (Harbor's sidecar, and the other topologies) in an allowlist phase of ALLOWED;
    the task has just resolved ALLOWED (through Docker's resolver, as its resolv.conf says),
    so egressd has learned its address."""
    sb = sandboxes(request.param, "allowlist", [ALLOWED], shared=True)
    r = sb.probe("query", ALLOWED, DOCKER_DNS)
    assert (r["rcode"], r["addresses"]) == ("NOERROR", [SERVER_B]), r
    return sb


def assert_reset(r, what):
    assert r["outcome"] == "ECONNRESET", f"{what}: expected a TCP reset, got {r}"
    assert r["ms"] < RESET_MS, f"{what}: the reset took {r['ms']} ms"


def test_tls_and_http_with_the_allowed_name_pass(sb):
    r = sb.probe("tls", SERVER_B, str(TLS_PORT), ALLOWED)
    assert (r["outcome"], r["reply"]) == ("ok", "tls:ping"), r
    r = sb.probe("http", SERVER_B, str(HTTP_PORT), ALLOWED)
    assert r["outcome"] == "ok" and r["reply"].startswith("HTTP/1.1 200 ") and r["reply"].endswith(f"host={ALLOWED}"), r


def test_tls_with_another_name_on_the_same_address_is_reset(sb):
    assert_reset(sb.probe("tls", SERVER_B, str(TLS_PORT), OTHER), f"TLS with SNI {OTHER} to {SERVER_B}")


def test_http_with_another_host_on_the_same_address_is_reset(sb):
    assert_reset(sb.probe("http", SERVER_B, str(HTTP_PORT), OTHER), f"HTTP with Host {OTHER} to {SERVER_B}")


def test_denied_records_the_presented_and_the_learned_name(sb):
    """What the operator asks after a reset: the record names the name the flow presented and
    the name the address was learned for."""
    assert_reset(sb.probe("tls", SERVER_B, str(TLS_PORT), OTHER), f"TLS with SNI {OTHER} to {SERVER_B}")
    want = f"tls sni {OTHER} to {SERVER_B}:{TLS_PORT}; address learned for {ALLOWED}"
    cp = sb.egressctl("denied", "--json")
    assert cp.returncode == 0, f"egressctl denied --json exited {cp.returncode}: {cp.stdout}{cp.stderr}"
    records = json.loads(cp.stdout)["records"]
    assert want in [r.get("pin") for r in records if r.get("port") == TLS_PORT and r.get("dst") == SERVER_B], records


@pytest.mark.parametrize("user", [NOBODY, None], ids=["uid 65534", "root with Docker's capabilities"])
def test_a_request_rewritten_in_its_pages_after_the_read_reaches_the_server_as_judged(sb, user):
    """The task process sends a head naming the allowed name from a page (MSG_ZEROCOPY: no
    capability needed) without its last line end, waits until egressd holds it, rewrites the
    page to name the other site on the same address, and ends the head. The server must get
    the head egressd judged (docs/pinning.md "Bytes the server never takes")."""
    other = "w" + ALLOWED[1:]   # another name of ALLOWED's length; the server answers with the Host it got
    def inspected():
        # From this process: under CI's load a `docker exec` into Harbor's sidecar per poll
        # took over a second.
        reply = sb.host_request({"cmd": "status"})
        assert reply.get("ok") is True, reply
        return reply["pin"]["inspected"]
    before = inspected()
    # The go is a file in the task's read-only mount of this directory (a `docker exec`'s stdin
    # took over a second under CI's load).
    go = Path(dockerlab.HERE) / f".go-{os.getpid()}-{time.monotonic_ns()}"
    attacker = sb.task.probe_proc("zerocopy-http", SERVER_B, str(HTTP_PORT), ALLOWED, other,
                                  f"{dockerlab.TASK_MOUNT}/{go.name}", user=user)
    try:
        wait_for(lambda: inspected() > before, 10.0, "egressd to hold the first segment")
        go.touch()
        res = attacker.result(timeout=30.0)
    finally:
        attacker.close()
        go.unlink(missing_ok=True)
    # However late the go comes: before 100 ms the reader still holds the head, after it the
    # head went through as read (docs/pinning.md "A client that pauses"); the end is judged.
    assert res["outcome"] == "ok" and res["reply"].endswith(f"host={ALLOWED}"), \
        f"the server got another head than the one egressd judged, or none: {res}"


HRR_CLIENT = labmod.HERE / "tls13_hrr_client.py"   # tests/integration's TLS 1.3 client of its own


def hrr(sb, first: str, second: str, mode: str, user: str | None) -> dict:
    """tls13_hrr_client.py run by the task container's python3, its program read from stdin
    (the container mounts tests/docker only): a first ClientHello naming FIRST with no key
    share, so the server asks for a second one, which names SECOND."""
    cp = sb.task.exec("python3", "-", SERVER_B, str(TLS_PORT), first, second, mode, user=user,
                      input=HRR_CLIENT.read_text(), timeout=30.0)
    try:
        return json.loads(cp.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise AssertionError(f"tls13_hrr_client.py exited {cp.returncode}: {cp.stdout}{cp.stderr}") from None


@pytest.mark.parametrize("user", [NOBODY, None], ids=["uid 65534", "root with Docker's capabilities"])
def test_a_second_hello_after_a_retry_request_cannot_name_another_site(sb, user):
    """docs/pinning.md "A second ClientHello", from a real task container: the first hello
    names the allowed name and offers no key share, the server answers with a
    HelloRetryRequest, and the second hello names the other site on the same address.
    OpenSSL takes the name from the second hello, so it must never reach the server. The
    control, the allowed name in both hellos, shows the server really asks again and the
    flow, judged twice, passes."""
    assert hrr(sb, ALLOWED, ALLOWED, "ccs", user) == {"step": "done", "answer": f"sni={ALLOWED}"}
    for mode in ("ccs", "noccs"):
        res = hrr(sb, ALLOWED, OTHER, mode, user)
        assert res.get("answer") != f"sni={OTHER}", f"{mode}: the server completed a handshake for {OTHER}"
        assert "ConnectionResetError" in res.get("error", ""), f"{mode}: {res}"


PAWS_ATTACKER = labmod.HERE / "tls13_paws_attacker.py"


def _queue_handed(sb, queue: int) -> tuple[int, int]:
    """(packets waiting, packets handed over so far) of pinning queue `queue` in the task's
    namespace."""
    for line in sb.task.netns().read_proc("/proc/net/netfilter/nfnetlink_queue").splitlines():
        f = line.split()
        if f and int(f[0]) == queue:
            return int(f[2]), int(f[7])
    raise AssertionError(f"queue {queue} is not bound in {sb.task.name}'s namespace")


# The two topologies whose task keeps Docker's default capabilities (NET_RAW among them); the
# shipped compose example drops them all from its task (container/compose.yaml).
@pytest.mark.parametrize("sb", ["harbor", "netns-pid"], indirect=True)
def test_the_record_that_ends_the_handshake_cannot_be_dropped_and_resent_as_a_second_hello(sb):
    """docs/pinning.md "A second ClientHello", the forged-timestamp variant, as root with
    Docker's default capabilities (NET_RAW) in a real task container: after the
    HelloRetryRequest a raw ACK with a timestamp 2 s ahead makes the server drop the client's
    next segment, an application-data record as long as the second hello, sent from a file's
    page; once egressd has read it, the page is rewritten to a second hello naming the other
    site, and the stack's retransmission carries it. The server must never take that hello."""
    for f in (HRR_CLIENT, PAWS_ATTACKER):
        cp = sb.task.exec("sh", "-c", f"cat > /tmp/{f.name}", input=f.read_text())
        assert cp.returncode == 0, cp.stdout + cp.stderr
    before = _queue_handed(sb, 18)[1]
    p = subprocess.Popen([dockerlab.DOCKER, "exec", "--interactive", sb.task.ref, "python3", f"/tmp/{PAWS_ATTACKER.name}",
                          SERVER_B, str(TLS_PORT), "/tmp", ALLOWED, OTHER],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for want in ("READY", "SENT"):
            line = labmod._read_line(p, 15.0, f"the attacker's {want}")
            assert line == want, line
        # The reader has read the fake record (handed over and answered) before the page changes.
        wait_for(lambda: _queue_handed(sb, 18)[1] > before and _queue_handed(sb, 18)[0] == 0, 5.0,
                 "egressd to read the record that ends the handshake")
        p.stdin.write(b"go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=30.0)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err.decode(errors="replace")
    res = json.loads((getattr(p, "_lab_pending", b"") + out).decode().strip().splitlines()[-1])
    assert res.get("answer") is None, f"the server took a second hello naming {OTHER}: {res}"
