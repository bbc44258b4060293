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
import json
import re
import socket
import ssl
import struct
import subprocess
import time

import pytest

import lab as labmod
from lab import DEFAULT_HOSTS, DNS_V4, wait_for

V4, V6 = "203.0.113.10", "2001:db8:3::10"
IP_ENTRY_V4 = "198.51.100.10"  # allowed by an IP entry: never inspected
HOSTS = {**DEFAULT_HOSTS, "allowed.test": [V4, V6], "same-ip.test": [V4, V6]}
TLS_PORT, HTTP_PORT, BANNER_PORT = 8443, 8081, 2222
LATE_BANNER_PORT = 2223  # the banner 0.3 s after the accept (pin_servers.py)
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


# Both names of the shared address allowed, then only the first (attack review L: a flow keeps
# every name it presented, and a switch keeps it only while it keeps each).
BOTH_NAMES = f"""\
initial_phase: both
dns: {{ upstream: ["{DNS_V4}"] }}
phases:
  both:
    network_mode: allowlist
    allowed_hosts: [allowed.test, same-ip.test]
  first_only:
    network_mode: allowlist
    allowed_hosts: [allowed.test]
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


def connect(lab, addr, port, timeout=3.0, mark=None) -> socket.socket:
    """A TCP connection from the sandbox; `mark`: its SO_MARK (a process with NET_RAW may set any)."""
    s = lab.sandbox.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    if mark is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, struct.pack("I", mark))
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
        if e.errno in (errno.ECONNRESET, errno.EPIPE):  # EPIPE: a write after the reset
            return "reset", time.monotonic() - t0
        return "error", str(e)


def tls_ping(s: socket.socket, sni: str) -> bytes:
    """TLS on the connected socket s naming sni (no certificate check): sends b"ping", returns
    the first answer."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with ctx.wrap_socket(s, server_hostname=sni) as t:
        t.sendall(b"ping")
        return t.recv(100)


def tls(lab, addr, sni, port=TLS_PORT, mark=None):
    return outcome(lambda: tls_ping(connect(lab, addr, port, mark=mark), sni))


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
    # What a person reads: the text line names the refused name, not only the learned one.
    rc, out, err = pinned.ctl("denied")
    assert rc == 0, err
    assert re.search(rf"tcp {re.escape(V4)}:{TLS_PORT}  x\d+  reset by pinning: tls sni same-ip\.test to "
                     rf"{re.escape(V4)}:{TLS_PORT}; address learned for allowed\.test$", out, re.M), out


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



# A keep-alive connection whose second request names the other allowed site, its body half sent
# at the switch (attack review L: the rest went through and the server answered
# host=same-ip.test, 2 of 2). uid 65534, no capability. The client waits until the server has
# acknowledged everything sent (SIOCOUTQ 0), so the reader has judged the second head before the
# switch.
KEEPALIVE_CLIENT = r"""
import fcntl, json, socket, struct, sys, termios, time
addr, port, h1, h2 = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(5)
s.connect((addr, port))
def answer():
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = s.recv(65536)
        if not d:
            raise EOFError("closed")
        buf += d
    head, _, rest = buf.partition(b"\r\n\r\n")
    n = int([l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0])
    while len(rest) < n:
        d = s.recv(65536)
        if not d:
            raise EOFError("closed mid-body")
        rest += d
    return rest[:n].decode()
def acked():
    end = time.monotonic() + 5
    while (left := struct.unpack("i", fcntl.ioctl(s, termios.TIOCOUTQ, b"\0\0\0\0"))[0]) != 0:
        if time.monotonic() > end:
            raise TimeoutError(f"the server did not acknowledge the half request: {left} bytes left")
        time.sleep(0.005)
res = {}
try:
    s.sendall(b"GET / HTTP/1.1\r\nHost: " + h1.encode() + b"\r\nConnection: keep-alive\r\n\r\n")
    res["first"] = answer()
    s.sendall(b"POST /up HTTP/1.1\r\nHost: " + h2.encode() + b"\r\nConnection: keep-alive\r\nContent-Length: 20\r\n\r\n"
              + b"a" * 10)
    acked()
    print("HALF", flush=True)
    sys.stdin.readline()
    s.sendall(b"b" * 10)
    res["second"] = answer()
except Exception as e:
    res["error"] = repr(e)
print(json.dumps(res), flush=True)
"""


def across_a_switch(lab, d, argv, ready: str, target: str) -> dict:
    """In phase `both` (BOTH_NAMES), both names learned: `argv` runs in the sandbox until it
    prints `ready`; then `target` is applied, the client is told to go on, and its last line
    (JSON) is returned."""
    d.ctl("apply", "both")
    learn(lab, "allowed.test")
    learn(lab, "same-ip.test")
    p = lab.spawn(argv, netns=lab.sandbox, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = labmod._read_line(p, 20.0, f"the client's {ready}")
    assert line.strip() == ready, line
    rc, _, err = d.ctl("apply", target)
    assert rc == 0, err
    p.stdin.write(b"go\n")
    p.stdin.flush()
    out, _ = p.communicate(timeout=20)
    out = getattr(p, "_lab_pending", b"") + out
    return json.loads(out.decode().strip().splitlines()[-1])


def keepalive_across_a_switch(lab, d, addr, second, target) -> dict:
    argv = labmod.NOBODY + ["/usr/bin/python3", "-c", KEEPALIVE_CLIENT, addr, str(HTTP_PORT), "allowed.test", second]
    return across_a_switch(lab, d, argv, "HALF", target)

@pytest.mark.parametrize("addr", [V4, V6])
def test_a_switch_cuts_a_keepalive_connection_a_later_request_of_which_named_a_forbidden_site(
        lab, egressd, servers, addr):
    d = egressd(BOTH_NAMES)
    res = keepalive_across_a_switch(lab, d, addr, "same-ip.test", "first_only")
    assert res.get("first") == "host=allowed.test", res
    assert "second" not in res and "error" in res, f"same-ip.test's request went on after the switch: {res}"
    # The control: both requests for the allowed name, the connection survives the same switch.
    res = keepalive_across_a_switch(lab, d, addr, "allowed.test", "first_only")
    assert res == {"first": "host=allowed.test", "second": "host=allowed.test"}, res

# ---- hosts files (issue 16 point 7) ---------------------------------------------------------

HOSTS_POLICY = f"""\
initial_phase: agent
dns: {{ upstream: ["{DNS_V4}"] }}
phases:
  agent:
    network_mode: allowlist
    allowed_hosts: [allowed.test, host.docker.internal, other.test]
  elsewhere:
    network_mode: allowlist
    allowed_hosts: [b.example.com]
"""
HOSTS_FILE = f"""\
127.0.0.1 localhost
# Harbor's compose topology: extra_hosts on the sidecar
{V4} host.docker.internal
{V6} host.docker.internal
198.51.100.66 unlisted.test
169.254.169.254 allowed.test
"""


def explain_json(d, target):
    return d.ctl_json("explain", target, "--json")


@pytest.fixture
def hosts_file(lab):
    path = lab.tmp / "hosts"
    path.write_text(HOSTS_FILE)
    return path


@pytest.mark.parametrize("addr", [V4, V6])
def test_hosts_file_names_are_learned_and_pinned_without_dns(lab, egressd, servers, hosts_file, addr):
    d = egressd(HOSTS_POLICY, extra=["--hosts-file", str(hosts_file)])
    # No DNS query at all: the hosts file taught host.docker.internal -> V4, V6.
    assert tls(lab, addr, "host.docker.internal") == ("ok", b"tls:ping")
    kind, body = http(lab, addr, b"GET / HTTP/1.1\r\nHost: host.docker.internal\r\n\r\n")
    assert kind == "ok" and body.endswith(b"host=host.docker.internal"), (kind, body)
    # Pinned like a DNS-learned name: another name on the same address is reset, and so is
    # other.test, which the phase allows but which was not learned for this address.
    assert_reset(tls(lab, addr, "same-ip.test"), "tls with sni same-ip.test")
    assert_reset(tls(lab, addr, "other.test"), "tls with sni other.test (allowed, not learned for this address)")
    assert_reset(http(lab, addr, b"GET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"), "http host same-ip.test")
    learned = {l["name"]: l["addresses"] for l in d.status()["learned"]}
    assert [(a["address"], a["source"], a["expires_in_s"]) for a in learned["host.docker.internal"]] == \
        [(V4, "hosts", None), (V6, "hosts", None)], learned
    assert "unlisted.test" not in learned and "localhost" not in learned, learned


def test_hosts_file_elements_are_extended_each_time_they_are_written(lab, egressd, hosts_file):
    """A hosts-file element times out after 60 s and is written again every 20 s, and when the
    file changes. Adding an element the kernel has does not extend it, so the elements lapsed
    60 s after they were first written and the name was refused until the next refresh (up to
    20 s); each write now replaces them. A change of the file's pairs writes them at once, as
    the 20 s refresh does."""
    egressd(HOSTS_POLICY, extra=["--hosts-file", str(hosts_file)])

    def left() -> int:
        e = lab.learned_set().get(V4)
        assert e and e["timeout"] == 60, f"{V4} in ph_agent_d4 with timeout 60 s: {e}"
        return e["expires"]

    wait_for(lambda: left() <= 56, 10.0, "the element's first 3 s to pass")
    # A pair dropped from the file: the elements of those left are written at once.
    hosts_file.write_text(HOSTS_FILE.replace(f"{V6} host.docker.internal\n", ""))
    wait_for(lambda: left() >= 58, 10.0, f"the file's change to extend {V4}'s element (it still expires 60 s "
             "after it was first written)")


def test_hosts_file_guards_and_phase(lab, egressd, servers, hosts_file):
    d = egressd(HOSTS_POLICY, extra=["--hosts-file", str(hosts_file)])
    # A name the phase does not allow teaches nothing.
    j = explain_json(d, "198.51.100.66")
    assert j["allowed"] is False, j
    # The same guards as DNS answers: an allowed name pointed at the metadata address is not learned.
    j = explain_json(d, "allowed.test@169.254.169.254:443")
    assert j["allowed"] is False and j["inspected"] is False, j
    assert "169.254.169.254" not in json.dumps(d.status()["learned"])
    # A switch to a phase without the name: the flow is no longer admitted; back: it is again.
    rc, _, err = d.ctl("apply", "elsewhere")
    assert rc == 0, err
    assert explain_json(d, f"host.docker.internal@{V4}:443")["allowed"] is False
    rc, _, err = d.ctl("apply", "agent")
    assert rc == 0, err
    assert tls(lab, V4, "host.docker.internal") == ("ok", b"tls:ping")


def test_hosts_file_changes_drop_pairs_but_never_add_them(lab, egressd, servers, hosts_file):
    d = egressd(HOSTS_POLICY, extra=["--hosts-file", str(hosts_file)])
    assert tls(lab, V4, "host.docker.internal") == ("ok", b"tls:ping")
    # Dropped from the file: re-read within its poll interval, then pinning resets the name there.
    tmp = hosts_file.with_suffix(".new")
    tmp.write_text(f"{V6} host.docker.internal\n")
    tmp.rename(hosts_file)
    labmod.wait_for(lambda: explain_json(d, f"host.docker.internal@{V4}:443")["allowed"] is False, 6.0,
                    "the dropped hosts-file pair to be forgotten")
    res = tls(lab, V4, "host.docker.internal")
    assert res[0] in ("reset", "error"), f"a dropped hosts-file pair still admits its name: {res}"
    assert tls(lab, V6, "host.docker.internal") == ("ok", b"tls:ping")
    # Added after start (a sandbox that can write the file): not taken.
    tmp.write_text(f"{V6} host.docker.internal\n198.51.100.11 host.docker.internal\n")
    tmp.rename(hosts_file)
    labmod.wait_for(lambda: "not in it at start are not learned" in d.log(), 6.0, "the re-read to be logged")
    j = explain_json(d, "host.docker.internal@198.51.100.11:443")
    assert j["allowed"] is False, j


def test_hosts_file_a_restart_takes_only_the_pairs_of_the_snapshot_kept_at_start(lab, egressd, servers, hosts_file):
    """The snapshot of the file at start was kept in memory only: a restarted egressd read the
    file afresh and learned a pair the sandbox had written since. It is kept beside the state
    file (<socket>.state.hosts) and caps what a restart that adopts the table learns; missing,
    nothing is learned from the file."""
    d = egressd(HOSTS_POLICY, extra=["--hosts-file", str(hosts_file)])
    snapshot = d.socket_path.with_name(d.socket_path.name + ".state.hosts")
    with open(hosts_file, "a") as f:
        f.write("198.51.100.11 host.docker.internal\n")
    labmod.wait_for(lambda: "not in it at start are not learned" in d.log(), 6.0, "the re-read to be logged")
    assert explain_json(d, "host.docker.internal@198.51.100.11:443")["allowed"] is False
    d.restart()
    j = explain_json(d, "host.docker.internal@198.51.100.11:443")
    assert j["allowed"] is False, f"the restart learned the pair written after start: {j}"
    learned = {l["name"]: l["addresses"] for l in d.status()["learned"]}
    assert sorted(a["address"] for a in learned["host.docker.internal"]) == sorted([V4, V6]), learned
    assert tls(lab, V4, "host.docker.internal") == ("ok", b"tls:ping")
    assert f"{V4} host.docker.internal\n" in snapshot.read_text() and "198.51.100.11" not in snapshot.read_text()
    # No snapshot with an adopted table: fail closed, and the log says why.
    d.stop()
    snapshot.unlink()
    d.start()
    # (The elements the last egressd wrote stay in the adopted sets until their 60 s timeout.)
    assert [a for l in d.status()["learned"] for a in l["addresses"] if a["source"] == "hosts"] == []
    assert explain_json(d, "host.docker.internal@198.51.100.11:443")["allowed"] is False
    assert f"hosts snapshot {snapshot} does not exist" in d.log()


def test_hosts_file_named_but_missing_or_broken_refuses_to_start(lab, hosts_file):
    def run_egressd(path):
        return labmod.run([str(labmod.egressd_binary()), "run", "--socket", str(lab.tmp / "h.sock"), "--netns",
                           lab.sandbox.path, "--hosts-file", str(path)], check=False, timeout=10)
    missing = lab.tmp / "no-such-hosts"
    cp = run_egressd(missing)
    assert cp.returncode == 2, cp
    assert f"hosts file {missing} does not exist" in cp.stderr, cp.stderr
    broken = lab.tmp / "broken-hosts"
    broken.write_text("192.0.2.10 fine.test\n192.0.2.11\n")
    cp = run_egressd(broken)
    assert cp.returncode == 2, cp
    assert f"{broken}:2: address 192.0.2.11 without a name" in cp.stderr, cp.stderr
    # Nothing was installed.
    assert "egressd" not in lab.sandbox.exec("nft", "list", "tables").stdout


def test_hosts_file_dev_null_means_none(lab, egressd, servers):
    # Documented in --help and the README: /dev/null for no hosts file. It starts (a device is
    # never read as a hosts file, and this one is not refused for being one) and learns nothing.
    d = egressd(HOSTS_POLICY, extra=["--hosts-file", "/dev/null"])
    learned = d.status()["learned"]
    assert [a for l in learned for a in l["addresses"] if a["source"] == "hosts"] == [], learned
    assert "host.docker.internal" not in [l["name"] for l in learned], learned
    assert "hosts file" not in d.log(), d.log()


# ---- explain NAME@ADDRESS (issue 16 point 8) ------------------------------------------------

def test_explain_name_at_address_answers_as_the_datapath_decides(lab, pinned):
    j = explain_json(pinned, f"same-ip.test@{V4}:{TLS_PORT}")
    assert j["allowed"] is False and j["inspected"] is True, j
    assert j["pin"] == f"tls sni same-ip.test to {V4}:{TLS_PORT}; address learned for allowed.test", j
    assert_reset(tls(lab, V4, "same-ip.test"), "tls with sni same-ip.test")
    j = explain_json(pinned, f"allowed.test@[{V6}]:{TLS_PORT}")
    assert j["allowed"] is True and j["pin"] == f"tls sni allowed.test to [{V6}]:{TLS_PORT}; allowed by allowed.test"
    assert tls(lab, V6, "allowed.test") == ("ok", b"tls:ping")
    j = explain_json(pinned, f"same-ip.test@{V4}:{HTTP_PORT}")
    assert j["pin"].startswith(f"tls sni same-ip.test to {V4}:{HTTP_PORT};"), j
    # An IP entry: not inspected, any name passes.
    j = explain_json(pinned, f"same-ip.test@{IP_ENTRY_V4}:{TLS_PORT}")
    assert j["allowed"] is True and j["inspected"] is False and j["pin"] is None, j
    assert tls(lab, IP_ENTRY_V4, "same-ip.test") == ("ok", b"tls:ping")
    rc, out, _ = pinned.ctl("explain", f"same-ip.test@{V4}:{TLS_PORT}")
    assert rc == 0 and f"  pinning: tls sni same-ip.test to {V4}:{TLS_PORT}" in out, out


@pytest.mark.parametrize("target,culprit", [
    ("foo@", "no address after \"@\""),
    ("@192.0.2.10", "no name before \"@\""),
    ("bad!name@192.0.2.10", "the name \"bad!name\" before \"@\" is not a host name"),
    ("a.test@b.test", "not the hostname \"b.test\""),
    ("a.test@192.0.2.10:99999", "port 99999 is not a number"),
])
def test_explain_name_at_address_bad_input_exits_2_naming_the_culprit(lab, pinned, target, culprit):
    rc, out, err = pinned.ctl("explain", target)
    assert rc == 2 and culprit in err, (rc, out, err)
    reply = pinned.request({"cmd": "explain", "target": target})
    assert reply["ok"] is False and culprit in reply["error"]["message"], reply


# ---- a hello queued when egressd dies (issue 16 "Tests") ------------------------------------

ECHO_PORT = 443  # labserver's TCP echo on every server address: bytes come back iff they reached it


def queued_packets(lab, queue=16) -> int:
    for line in lab.sandbox.read_proc("/proc/net/netfilter/nfnetlink_queue").splitlines():
        f = line.split()
        if f and int(f[0]) == queue:
            return int(f[2])
    return 0


def client_hello(sni) -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def test_kill_with_a_hello_queued_admits_nothing_and_a_restart_adopts(lab, egressd, servers):
    d = egressd(policy())
    learn(lab)
    hello = client_hello("allowed.test")
    # The oracle: a whole hello for the allowed name is admitted and echoed back.
    with connect(lab, V4, ECHO_PORT) as s:
        s.sendall(hello)
        assert s.recv(1)[:1] == b"\x16"
    generation = d.status()["generation"]

    s = connect(lab, V4, ECHO_PORT, timeout=2.0)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(hello[:60])
    # The first segment is held by the reader (no verdict yet: the hello is incomplete).
    labmod.wait_for(lambda: queued_packets(lab) >= 1, 1.5, "the first segment to wait in queue 16")
    d.kill()
    d.wait()
    s.sendall(hello[60:])
    res = outcome(lambda: s.recv(4096) or b"")
    s.close()
    assert res[0] in ("timeout", "reset") or res == ("ok", b""), \
        f"a flow was admitted with egressd dead: {res}"

    d.start()
    st = d.status()
    assert st["generation"] == generation, f"the restart did not adopt: generation {st['generation']} != {generation}"
    assert "adopt" in d.log()
    learn(lab)
    assert tls(lab, V4, "allowed.test") == ("ok", b"tls:ping")
    assert_reset(tls(lab, V4, "same-ip.test"), "tls with sni same-ip.test after the restart")


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_large_first_write_is_judged_and_let_through(lab, pinned, addr):
    """A first write of 60 KB leaves the socket as one GSO packet, which the queue hands to the
    reader whole: judged on its first bytes, admitted, and delivered."""
    before = pinned.status()["pin"]
    # An HTTP request head and its body in one write: admitted on the head. (The lab's HTTP
    # server answers after the head and closes with the body unread, so its end resets: the
    # decision is what is checked here.)
    body = b"b" * 60000
    with connect(lab, addr, HTTP_PORT) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: pinned.status()["pin"]["admitted"] == before["admitted"] + 1, 3.0,
                 "the reader to admit the request")
    # Every byte arrives: the banner service echoes a 60 KB first write (the address decides).
    first = b"SSH-2.0-client\r\n" + body
    with connect(lab, addr, BANNER_PORT) as s:
        s.sendall(first)
        want = b"SSH-2.0-lab\r\n" + first
        got = b""
        while len(got) < len(want):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    assert got == want, (len(got), len(want))
    st = pinned.status()["pin"]
    assert st["reset"] == before["reset"] and st["admitted"] == before["admitted"] + 2, (before, st)


# ---- A client that pauses in the middle of its first bytes ----------------------------------
# The reader holds the first segment until the hello or head is whole. A client that pauses
# longer than its retransmission timeout (200 ms at least) sees that segment unacknowledged:
# its socket enters loss recovery with a window of one segment (TCP_INFO: ca_state loss, lost
# 1, retrans 0, cwnd 1), and cannot send it again while a copy of it is queued (nstat
# TcpExtTCPSpuriousRtxHostQueues counts the refusals). A rest no larger than the held segment
# then waits in the socket for the held one's transmission to complete, which never comes
# (measured: after a 36-byte head, a 36-byte rest stays, a 41-byte one goes: autocorking
# compares the new segment's memory with what is still in flight). Releasing the held segment
# (dropping it, keeping the reader's copy) does not help: the socket sends it again at once,
# which fills its one-segment window, and the rest waits for an acknowledgment (tried: five
# resends in 2 s, the rest never came). Only an acknowledgment moves the socket on, so an HTTP
# head still incomplete after 100 ms is let through as it is (the server acknowledges it and
# acts on no request before its head ends; the segment that ends it is judged before it
# leaves), as later requests' incomplete heads are (docs/pinning.md "A client that pauses").
# A TLS hello is not: a router that picks a backend by SNI might act on part of one. Found
# 2026-12-07 (the Docker suite's zero-copy test, under CI's load).

def paused_split(lab, pinned, addr, port, first: bytes, rest: bytes, pause: float):
    def run():
        before = pinned.status()["pin"]["inspected"]
        with connect(lab, addr, port) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(first)
            wait_for(lambda: pinned.status()["pin"]["inspected"] > before, 5.0, "egressd to hold the first segment")
            time.sleep(pause)  # the scenario: a client that pauses, not synchronisation
            s.sendall(rest)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
                if port == TLS_PORT:
                    return data
            return data
    return outcome(run)


HEAD = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n"


@pytest.mark.parametrize("proto", ["tls", "http"])
def test_a_client_pausing_mid_hello_past_its_retransmission_timeout_is_judged_when_the_rest_is_large(
        lab, pinned, proto):
    if proto == "tls":
        hello = client_hello("allowed.test")
        res = paused_split(lab, pinned, V4, TLS_PORT, hello[:60], hello[60:], 0.5)
        assert res[0] == "ok" and res[1][:1] == b"\x16", res
    else:
        rest = b"X-Pad: " + b"a" * 600 + b"\r\nConnection: close\r\n\r\n"
        res = paused_split(lab, pinned, V4, HTTP_PORT, HEAD, rest, 0.5)
        assert res[0] == "ok" and res[1].endswith(b"host=allowed.test"), res


@pytest.mark.parametrize("proto", [
    pytest.param("tls", marks=pytest.mark.xfail(
        strict=True, reason="a TLS hello held past the client's retransmission timeout: its small rest stays "
                            "in the client's socket (see the comment above); not fixed")),
    "http"])
def test_a_client_pausing_mid_hello_past_its_retransmission_timeout_is_judged_when_the_rest_is_small(
        lab, pinned, proto):
    if proto == "tls":
        hello = client_hello("allowed.test")
        res = paused_split(lab, pinned, V4, TLS_PORT, hello[:-20], hello[-20:], 0.5)
        assert res[0] == "ok" and res[1][:1] == b"\x16", res
    else:
        res = paused_split(lab, pinned, V4, HTTP_PORT, HEAD, b"Connection: close\r\n\r\n", 0.5)
        assert res[0] == "ok" and res[1].endswith(b"host=allowed.test"), res


def hostport(addr, port) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


# A first segment longer than the rest that ends the head (see above: the rest would go anyway).
PAUSED_HEAD = b"GET / HTTP/1.1\r\nConnection: close\r\nUser-Agent: a-client-that-pauses/1.0\r\n"


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_head_let_through_incomplete_is_judged_when_it_ends(lab, pinned, addr):
    """The head's first lines pass once the client pauses; the Host line that ends it is judged
    as a held first head is: another name is reset, and recorded as the first request's."""
    before = pinned.status()["pin"]
    res = paused_split(lab, pinned, addr, HTTP_PORT, PAUSED_HEAD, b"Host: same-ip.test\r\n\r\n", 0.5)
    assert res[0] == "reset", f"a head ending with Host: same-ip.test was answered: {res}"
    assert res[1] < 1.5, f"reset {res[1]:.2f} s after the connection: by the hold time, not judged at the end"
    st = pinned.status()["pin"]
    assert (st["inspected"], st["admitted"], st["reset"]) == \
        (before["inspected"] + 1, before["admitted"], before["reset"] + 1), (before, st)
    lines = [r.get("pin") for r in pinned.request({"cmd": "denied"})["records"]]
    assert f"http host same-ip.test to {hostport(addr, HTTP_PORT)}; address learned for allowed.test" in lines, lines
    # The allowed name after the same pause is answered, and counted once.
    res = paused_split(lab, pinned, addr, HTTP_PORT, PAUSED_HEAD, b"Host: allowed.test\r\n\r\n", 0.5)
    assert res[0] == "ok" and res[1].endswith(b"host=allowed.test"), res
    st2 = pinned.status()["pin"]
    assert (st2["inspected"], st2["admitted"], st2["reset"]) == \
        (st["inspected"] + 1, st["admitted"] + 1, st["reset"]), (st, st2)


@pytest.mark.parametrize("first,rest", [
    (b"GET http://same-ip.test/", b"\r\n"),                  # HTTP/0.9: a line, no head to end
    (b"GET / HTTP/1.1\r\nHost: allowed.test\r\n", b"\r\nGET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"),
    (PAUSED_HEAD, b"Host: allowed.test\r\nHost: same-ip.test\r\n\r\n"),
])
def test_a_head_let_through_incomplete_cannot_be_ended_into_another_request(lab, pinned, first, rest):
    """What ends a head let through incomplete is read as a held head is: a request line a
    server answers alone, a second request in the segment that ends the first (the segment is
    refused whole, so the server never gets the end of the first), two Hosts, are reset."""
    res = paused_split(lab, pinned, V4, HTTP_PORT, first, rest, 0.5)
    assert res[0] == "reset" and res[1] < 1.5, res  # judged at the end, not reset by the hold time
