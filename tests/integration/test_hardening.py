"""egressd under hostile or careless input, against the real kernel (issue 8; docs/security.md).

  - 1,000 generated malformed control messages each get an error reply with the right code,
    in order; the generation does not move, the daemon lives, traffic follows the policy;
  - clients that stall half-way through a line, vanish mid-request or stop reading their
    replies do not block anybody else; 100 concurrent clients are all answered;
  - a DNS flood from the sandbox (20k queries in about 5 s, allowed, refused and garbage
    mixed) leaves `status` responsive (p99 printed and bounded), lets a phase switch
    complete, sends no refused name upstream, and the daemon's RSS comes back near its
    baseline; 100 idle TCP connections to port 53 cannot starve the proxy;
  - the sandbox cannot change the rules without CAP_NET_ADMIN, and egressd's socket mark buys
    a sandbox that can set it (CAP_NET_ADMIN, or CAP_NET_RAW on newer kernels) DNS ports only;
  - DNS answers that point into loopback, link-local or cloud metadata are never learned;
  - CAP_NET_RAW gives AF_PACKET sockets, whose frames never meet nftables' inet hooks; the
    netdev egress chains drop them (issue 14; this test used to document the bypass).

Measurements (status p99, switch time, RSS) are printed; run with -s to see them.
Every load loop is bounded in count and in time.
"""
import errno
import json
import os
import random
import re
import select
import shlex
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import lab as labmod
from lab import NOBODY

POLICY = """\
initial_phase: agent
dns: { upstream: ["192.0.2.1"], min_ttl: 30s }
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: ["198.51.100.10", "2001:db8:2::10", "a.example.com", "www.example.com", "*.wild.example.org"]
  flood2:
    network_mode: allowlist
    allowed_hosts: ["b.example.com"]
  verifier: { network_mode: no-network }
"""

ERROR_CODES = {"invalid_request", "request_too_large", "unknown_command", "unknown_phase", "invalid_policy"}
MAX_LINE = 1 << 20  # kMaxRequestBytes


# --- helpers -------------------------------------------------------------------------------


def fast_reject(out) -> bool:
    return out.elapsed < 0.5 and (out == "refused" or (out == "unreachable" and out.prohibited))


def check_agent_policy(lab):
    """What the agent phase allows by address, and a few things it must not."""
    assert lab.tcp_connect("198.51.100.10", 80) == "ok"
    assert lab.tcp_connect("2001:db8:2::10", 80) == "ok"
    for addr in ("198.51.100.11", "203.0.113.10", "2001:db8:3::10"):
        out = lab.tcp_connect(addr, 80, timeout=1.0)
        assert fast_reject(out), (addr, out)
    out = lab.udp_verdict("198.51.100.11", 443, timeout=1.0)
    assert fast_reject(out), out


def wait_preresolved(d, timeout: float = 10.0):
    """Start-up pre-resolution runs after the ready file: wait until every hostname entry
    has learned addresses, so the ruleset stops changing."""
    labmod.wait_for(lambda: all(e["state"] == "resolved" for e in d.status()["entries"] if e["kind"] == "hostname"),
                    timeout, "start-up pre-resolution")


def same_state(a: dict, b: dict) -> bool:
    return (a["phase"], a["mode"], a["generation"]) == (b["phase"], b["mode"], b["generation"])


def pipeline(d, lines: list[bytes], timeout: float = 60.0) -> list[dict]:
    """Writes every line on one connection (from a writer thread, so replies never back up
    into our writes) and reads one reply line per request line, in order."""
    with d.connect(timeout) as s:
        data = b"".join(lines)
        writer = threading.Thread(target=labmod._send_ignoring_close, args=(s, data), daemon=True)
        writer.start()
        buf, replies = b"", []
        deadline = time.monotonic() + timeout
        while len(replies) < len(lines):
            while b"\n" in buf and len(replies) < len(lines):
                line, buf = buf.split(b"\n", 1)
                replies.append(json.loads(line))
            if len(replies) == len(lines):
                break
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{len(replies)} of {len(lines)} replies within {timeout}s"
            s.settimeout(remaining)
            chunk = s.recv(1 << 16)
            assert chunk, f"connection closed after {len(replies)} of {len(lines)} replies"
            buf += chunk
        writer.join(timeout)
        assert buf == b"", f"more replies than requests: {buf[:200]!r}"
    return replies


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1))


def is_sanitized(pid: int) -> bool:
    """ASan in the process: g++ links libasan.so, clang links its runtime into the program."""
    with open(f"/proc/{pid}/maps") as f:
        if "libasan" in f.read():
            return True
    with open(f"/proc/{pid}/exe", "rb") as f:
        return b"__asan_init" in f.read()


# --- 1,000 malformed control messages ------------------------------------------------------

VALID = [
    {"cmd": "ping"},
    {"cmd": "status"},
    {"cmd": "capabilities"},
    {"cmd": "apply", "phase": "environment"},
    {"cmd": "apply", "phase": "verifier"},
    {"cmd": "apply", "mode": "public"},
    {"cmd": "apply", "mode": "allowlist", "allow": ["198.51.100.0/24", "*.example.com"]},
]


def _compact(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _truncated(rng):
    text = _compact(rng.choice(VALID))
    return text[:rng.randrange(1, len(text))].encode(), "invalid_request"


def _wrong_type(rng):
    odd = rng.choice([0, -1, 3.5, True, False, None, [], ["ping"], {}, {"cmd": "ping"}])
    shape = rng.randrange(7)
    if shape == 0:
        obj = {"cmd": odd}
    elif shape == 1:
        obj = {"cmd": "apply", "phase": odd}
    elif shape == 2:
        obj = {"cmd": "apply", "mode": odd}
    elif shape == 3:
        obj = {"cmd": "apply", "mode": "allowlist", "allow": rng.choice(["198.51.100.11", 7, {"a": 1}, True])}
    elif shape == 4:
        obj = {"cmd": "apply", "mode": "allowlist", "allow": ["198.51.100.11", odd]}
    elif shape == 5:
        return _compact(rng.choice([["apply", "verifier"], "status", 42, True, None])).encode(), "invalid_request"
    else:
        obj = {"phase": "verifier", "mode": "public"}  # no cmd at all
    return _compact(obj).encode(), "invalid_request"


def _huge_number(rng):
    big = rng.choice(["1e400", "-1e400", "1" * 400, "-" + "9" * 310, "123456789012345678901234567890",
                      "18446744073709551616", "1e-400", "0." + "0" * 500 + "1", "4e308"])
    shape = rng.randrange(4)
    if shape == 0:
        text = '{"cmd":%s}' % big
    elif shape == 1:
        text = '{"cmd":"apply","phase":%s}' % big
    elif shape == 2:
        text = '{"cmd":"ping","n":%s}' % big  # overflow, or else an unknown field
    else:
        text = '{"cmd":"apply","mode":"allowlist","allow":[%s]}' % big
    return text.encode(), "invalid_request"


def _deep(rng):
    depth = rng.choice([65, 66, 100, 1000, 10000, 100000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    inner = opener * depth + "1" + closer * depth
    if rng.random() < 0.5:
        return inner.encode(), "invalid_request"
    return ('{"cmd":"apply","phase":' + inner + "}").encode(), "invalid_request"


BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80\x80",
            b"\xf4\x90\x80\x80", b"ag\xe2\x82ent"]


def _bad_utf8(rng):
    bad = rng.choice(BAD_UTF8)
    shape = rng.randrange(5)
    if shape == 0:
        text = b'{"cmd":"' + bad + b'"}'
    elif shape == 1:
        text = b'{"cmd":"apply","phase":"agent' + bad + b'"}'
    elif shape == 2:
        text = b'{"cmd":"apply","mode":"allowlist","allow":["' + bad + b'.example.com"]}'
    elif shape == 3:
        text = b'{"' + bad + b'":1,"cmd":"ping"}'
    else:
        text = bad + b'{"cmd":"ping"}'
    return text, "invalid_request"


def _escaped_oddity(rng):
    """Valid JSON whose strings hold escapes that are not what they seem."""
    shape = rng.randrange(4)
    if shape == 0:
        return b'{"cmd":"apply","phase":"\\ud800"}', "invalid_request"  # lone surrogate
    if shape == 1:
        return b'{"cmd":"apply","phase":"agent\\u0000"}', "unknown_phase"
    if shape == 2:
        return b'{"cmd":"ping\\u0000"}', "unknown_command"
    return b'{"cmd":"apply","mode":"allowlist","allow":["a.example.com\\u0000.evil"]}', "invalid_policy"


def _unknown_field(rng):
    base = dict(rng.choice(VALID))
    base[rng.choice(["force", "x", "id", "Phase", "generation", "", "cmd2", "\u00e9"])] = rng.choice(
        [1, True, "agent", None, [], {"phase": "environment"}])
    return _compact(base).encode(), "invalid_request"


def _bad_values(rng):
    shape = rng.randrange(6)
    if shape == 0:
        return _compact({"cmd": rng.choice(["APPLY", "Status", "reboot", "", " ping", "apply "])}).encode(), \
            "unknown_command"
    if shape == 1:
        return _compact({"cmd": "apply", "phase": rng.choice(["nosuch", "Agent", "", "agent ", "../agent"])}).encode(), \
            "unknown_phase"
    if shape == 2:
        return _compact({"cmd": "apply", "mode": rng.choice(["Allowlist", "everything", "", "no_network"])}).encode(), \
            "invalid_policy"
    if shape == 3:
        entry = rng.choice(["pypi.org:443", "https://pypi.org", "api.*.example.org", "*", "192.0.2.1/24",
                            "fe80::1%eth0", "[2001:db8::1]", "", "a..b", "x" * 300])
        return _compact({"cmd": "apply", "mode": "allowlist", "allow": ["198.51.100.11", entry]}).encode(), \
            "invalid_policy"
    if shape == 4:
        return _compact({"cmd": "apply", "mode": "public", "allow": ["198.51.100.11"]}).encode(), "invalid_policy"
    return _compact({"cmd": "apply", "phase": "verifier", "mode": "no-network"}).encode(), "invalid_request"


def _oversized(rng):
    # A valid request that would switch to public, padded past the limit: must change nothing.
    pad = "x" * (MAX_LINE + rng.randrange(1, 4096))
    return _compact({"cmd": "apply", "phase": "environment", "pad": pad}).encode(), "request_too_large"


GENERATORS = [(_truncated, 150), (_wrong_type, 170), (_huge_number, 110), (_deep, 100), (_bad_utf8, 150),
              (_escaped_oddity, 40), (_unknown_field, 120), (_bad_values, 152), (_oversized, 8)]
assert sum(n for _, n in GENERATORS) == 1000


def malformed_messages(seed: int) -> list[tuple[bytes, str, str]]:
    rng = random.Random(seed)
    out = []
    for gen, n in GENERATORS:
        for _ in range(n):
            line, code = gen(rng)
            assert b"\n" not in line and line.strip(b" \t"), line[:80]
            out.append((line, code, gen.__name__.strip("_")))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("bad", ["socket-served", "socket-not-a-socket", "ready-file-no-directory"])
def test_a_socket_or_ready_file_egressd_cannot_use_is_refused_before_anything_changes(lab, egressd, bad):
    """egressd binds its control socket and writes its ready file last (a client that finds
    either finds the policy in force); a path it cannot take must still be refused before
    anything is installed, not after (the sandbox would be left with a table nobody serves)."""
    d = egressd(POLICY, start=False)
    served = None
    if bad == "socket-served":
        served = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        served.bind(str(d.socket_path))
        served.listen()
        culprit = f"--socket: another egressd is serving {d.socket_path}"
    elif bad == "socket-not-a-socket":
        d.socket_path.write_text("not a socket\n")
        culprit = f"--socket: control socket path {d.socket_path} exists and is not a socket"
    else:
        d.ready_path = lab.tmp / "no-such-dir" / "egressd.ready"
        culprit = f"--ready-file {d.ready_path}: no directory {d.ready_path.parent}"
    try:
        cp = subprocess.run(d.argv(), capture_output=True, text=True, timeout=10)
    finally:
        if served:
            served.close()
    assert cp.returncode == 2, cp
    assert culprit in cp.stderr, cp.stderr
    assert lab.nft(lab.sandbox, "list", "tables")[1].strip() == "", "a refused start installed a table"
    if bad == "socket-not-a-socket":
        assert d.socket_path.read_text() == "not a socket\n"


@pytest.mark.parametrize("how", ["netns-pid", "netns-path"])
def test_a_namespace_owned_by_another_user_namespace_is_refused_before_anything_changes(lab, egressd, how):
    """Finding D, the sidecar: the task's init (uid 65534, no capability) leaves a worker in the
    sandbox and moves itself into a user and network namespace of its own, where it holds
    CAP_NET_ADMIN. `egressd run --netns-pid PID` (or --netns /proc/PID/ns/net) exits 2 naming
    the namespace and why, and installs nothing, neither in the decoy nor in the sandbox."""
    p = lab.spawn_decoy_container(lab.sandbox)
    path = f"/proc/{p.pid}/ns/net"
    d = egressd(POLICY, start=False, netns_pid=p.pid if how == "netns-pid" else None)
    argv = d.argv()
    if how == "netns-path":
        argv[argv.index("--netns") + 1] = path  # instead of the lab's sandbox
    print(shlex.join(argv))
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    print(cp.stderr.strip())
    assert cp.returncode == 2, cp
    assert f"{path} is owned by another user namespace than egressd's" in cp.stderr, cp.stderr
    assert "attach a namespace the container runtime created" in cp.stderr, cp.stderr
    decoy = labmod.run(["nsenter", "-t", str(p.pid), "-n", "nft", "list", "tables"]).stdout
    assert decoy.strip() == "", "a refused start installed a table in the decoy"
    assert lab.nft(lab.sandbox, "list", "tables")[1].strip() == "", "a refused start installed a table"
    assert not d.ready_path.exists() and not d.socket_path.exists()


def test_a_sidecar_restarted_after_its_netns_pid_process_ended_its_main_thread_joins_the_same_namespace(
        lab, egressd):
    """The --netns-pid process (uid 65534, no capability) ends its main thread and lives on in
    another, in the sandbox: /proc/PID/ns/net and /proc/PID/root are gone (a zombie leader).
    A sidecar restarted then (a crash, an upgrade) could not join and exited, leaving the
    namespace in its phase with no one to switch it or answer its DNS. It joins through a
    thread of that process still in the namespace, and switches it as before."""
    script = Path(__file__).with_name("agent_leader_exit.py")
    p = lab.spawn([*NOBODY, "/usr/bin/python3", str(script)], netns=lab.sandbox, stdin=subprocess.PIPE,
                  stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"ready"
    d = egressd(POLICY, phase="environment", netns_pid=p.pid)

    def worker_connects() -> str:
        p.stdin.write(f"connect 198.51.100.11 {labmod.ECHO_PORT}\n".encode())
        p.stdin.flush()
        return p.stdout.readline().decode().strip()

    p.stdin.write(b"exitmain\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == b"main-exiting"
    labmod.wait_for(lambda: not os.path.exists(f"/proc/{p.pid}/ns/net"), 5.0, "the main thread to end")
    assert worker_connects() == "ok"  # public
    d.restart()
    assert "joined the network namespace of process" in d.log(), d.log()
    # Its hosts file too, through the same thread (the leader has no /proc/PID/root).
    assert re.search(rf"hosts_file names=\d+ ok=true pairs=\d+ path=/proc/{p.pid}/task/\d+/root/etc/hosts", d.log()), d.log()
    assert d.ctl("apply", "verifier")[0] == 0
    assert worker_connects().startswith("fail")
    assert d.status()["phase"] == "verifier"


def test_1000_malformed_control_messages(lab, egressd):
    d = egressd(POLICY)
    before = d.status()
    msgs = malformed_messages(seed=8)
    assert len(msgs) == 1000
    # Ten connections at once, 100 requests pipelined on each.
    results = [None] * 10

    def client(i):
        chunk = msgs[i::10]
        try:
            results[i] = (chunk, pipeline(d, [m + b"\n" for m, _, _ in chunk], timeout=120))
        except Exception as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    elapsed = time.monotonic() - t0
    wrong = []
    for r in results:
        assert not isinstance(r, Exception) and r is not None, r
        for (line, code, kind), reply in zip(*r):
            err = reply.get("error") or {}
            if reply.get("ok") is not False or err.get("code") != code or not isinstance(err.get("message"), str):
                wrong.append(f"{kind}: {line[:120]!r}: want {code}, got {json.dumps(reply)[:300]}")
    assert not wrong, f"{len(wrong)} wrong replies:\n" + "\n".join(wrong[:20])
    print(f"\n1000 malformed messages answered in {elapsed:.2f} s")

    assert d.running, d.log()
    after = d.status()
    assert same_state(before, after), (before, after)
    check_agent_policy(lab)
    # And it still does its job over the socket.
    assert d.request({"cmd": "apply", "phase": "verifier"})["generation"] == before["generation"] + 1


# --- clients that misbehave ----------------------------------------------------------------


def test_stalled_and_vanishing_clients_do_not_block_others(lab, egressd):
    d = egressd(POLICY)
    gen = d.status()["generation"]
    stalled = d.connect()
    stalled.sendall(b'{"cmd":"sta')  # half a line, then nothing
    big = d.connect()
    big.sendall(b'{"cmd":"ping","pad":"' + b"x" * 500_000)  # half of a big line, then nothing
    # A client that never reads: its replies fill its socket buffer and the server's writes
    # to it block. Bounded: 20k pings.
    deaf = d.connect()
    deaf.setblocking(False)
    pings = b'{"cmd":"ping"}\n' * 20_000
    off = 0
    try:
        while off < len(pings):
            off += deaf.send(pings[off:])
    except BlockingIOError:
        pass
    sent = pings[:off].count(b"\n")  # a final partial line gets no reply
    assert 0 < sent < 20_000, sent  # the server stopped reading it: its replies back up
    # Clients that leave in the middle: half a line, a whole request, a switch.
    for data in (b'{"cmd":"apply","pha', b'{"cmd":"status"}\n', b'{"cmd":"apply","phase":"verifier"}\n'):
        s = d.connect()
        s.sendall(data)
        s.close()
    # A client that resets (SO_LINGER 0) right after a request.
    s = d.connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.sendall(b'{"cmd":"status"}\n')
    s.close()

    # Everybody else is served at once.
    worst = 0.0
    for _ in range(20):
        t0 = time.monotonic()
        assert d.request({"cmd": "ping"}, timeout=2)["ok"] is True
        worst = max(worst, time.monotonic() - t0)
    rc, _, err = d.ctl("apply", "agent", timeout=5)
    assert rc == 0, err
    st = d.status()
    # The abandoned switch to verifier may or may not have run before its client left
    # (the server reads a request only once it is whole); ours ran after it.
    assert st["phase"] == "agent" and st["generation"] in (gen + 1, gen + 2), st
    check_agent_policy(lab)
    print(f"\nping worst {worst * 1000:.1f} ms with a stalled, a half-big and a deaf client ({sent} unread pings)")
    assert worst < 1.0

    # The deaf client gets all its replies once it reads.
    deaf.setblocking(True)
    deaf.settimeout(10)
    got = 0
    buf = b""
    while got < sent:
        chunk = deaf.recv(1 << 16)
        assert chunk, f"deaf client: {got} of {sent} replies"
        buf += chunk
        got = buf.count(b"\n")
    assert got == sent
    for s in (stalled, big, deaf):
        s.close()
    assert d.request({"cmd": "ping"})["ok"] is True


def test_100_concurrent_clients_are_all_answered(lab, egressd):
    d = egressd(POLICY)
    n = 100
    barrier = threading.Barrier(n, timeout=20)
    replies = [None] * n

    def client(i):
        try:
            with d.connect(timeout=20) as s:
                barrier.wait()
                reqs = [{"cmd": "ping"}, {"cmd": "status"}, {"cmd": "apply", "phase": "nosuch"}]
                s.sendall(b"".join(json.dumps(r).encode() + b"\n" for r in reqs))
                buf = b""
                while buf.count(b"\n") < len(reqs):
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        break
                    buf += chunk
                replies[i] = [json.loads(x) for x in buf.splitlines()]
        except Exception as e:  # reported below
            replies[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    bad = [r for r in replies if not (isinstance(r, list) and len(r) == 3)]
    assert not bad, bad[:5]
    for r in replies:
        assert r[0] == {"ok": True}
        assert r[1]["ok"] is True and r[1]["phase"] == "agent"
        assert r[2]["ok"] is False and r[2]["error"]["code"] == "unknown_phase"
    print(f"\n100 concurrent clients x 3 requests answered in {elapsed:.2f} s")
    assert d.running


# --- DNS flood -----------------------------------------------------------------------------

# Runs inside the sandbox namespace: sends `count` queries to 192.0.2.1:53 (redirected to the
# proxy) at an even pace over `seconds`, on 8 UDP sockets, and prints a JSON summary. Names:
# ~45% allowed (a fixed set, so what egressd learns is bounded), ~50% refused (unique random
# names under exfil.example, as a DNS exfiltration channel would use), ~5% garbage packets.
FLOOD_SENDER = textwrap.dedent(r'''
    import json, os, random, select, socket, struct, sys, time
    count, seconds, seed = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    allowed = ["a.example.com", "www.example.com", "A.Example.COM"] + [f"w{i}.wild.example.org" for i in range(32)]
    def name_wire(n):
        return b"".join(bytes([len(l)]) + l.encode() for l in n.split(".")) + b"\0"
    def query(qid, name, qtype):
        return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + name_wire(name) + struct.pack("!HH", qtype, 1)
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(8)]
    for s in socks:
        s.connect(("192.0.2.1", 53)); s.setblocking(False)
    by_fd = {s.fileno(): s for s in socks}
    sent = {}
    refused_names = []
    rcodes = {}
    lat = []
    garbage = 0
    def drain(timeout):
        r, _, _ = select.select(socks, [], [], timeout)
        for s in r:
            while True:
                try:
                    msg = s.recv(4096)
                except BlockingIOError:
                    break
                if len(msg) < 12:
                    continue
                key = (s.fileno(), struct.unpack_from("!H", msg)[0])
                t = sent.pop(key, None)
                if t is None:
                    continue
                rc = msg[3] & 0xF
                rcodes[rc] = rcodes.get(rc, 0) + 1
                lat.append(time.monotonic() - t)
    t0 = time.monotonic()
    hard_stop = t0 + seconds + 10
    for i in range(count):
        due = t0 + seconds * i / count
        while time.monotonic() < due:
            drain(max(0.0, due - time.monotonic()))
        s = socks[i % 8]
        qid = (i // 8) & 0xFFFF
        r = rng.random()
        if r < 0.05:
            garbage += 1
            kind = rng.randrange(4)
            if kind == 0:
                pkt = os.urandom(rng.randrange(1, 64))
            elif kind == 1:
                pkt = query(qid, "a.example.com", 1)[:rng.randrange(1, 28)]
            elif kind == 2:  # a response, not a query: must never be answered
                pkt = struct.pack("!HHHHHH", qid, 0x8180, 1, 0, 0, 0) + name_wire("a.example.com") + b"\0\1\0\1"
            else:  # a compression pointer loop in the question
                pkt = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c\0\1\0\1"
            try:
                s.send(pkt)
            except OSError:
                pass
            continue
        if r < 0.55:
            name = f"x{rng.getrandbits(64):016x}.exfil.example"
            refused_names.append(name)
        else:
            name = rng.choice(allowed)
        try:
            s.send(query(qid, name, rng.choice([1, 28])))
            sent[(s.fileno(), qid)] = time.monotonic()
        except OSError:
            pass
        if time.monotonic() > hard_stop:
            break
    send_done = time.monotonic() - t0
    quiet_until = time.monotonic() + 2.0
    while sent and time.monotonic() < min(quiet_until, hard_stop):
        drain(0.05)
    lat.sort()
    pct = lambda p: round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) if lat else None
    print(json.dumps({"queries": count - garbage, "garbage": garbage, "answered": len(lat),
                      "unanswered": len(sent), "rcodes": rcodes, "send_seconds": round(send_done, 2),
                      "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
                      "refused_sample": refused_names[:200], "refused_total": len(refused_names)}))
''')


def run_flood(lab, count: int, seconds: float, seed: int) -> subprocess.Popen:
    return lab.spawn([sys.executable, "-c", FLOOD_SENDER, count, seconds, seed], netns=lab.sandbox,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def flood_result(p: subprocess.Popen, timeout: float) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err.decode(errors="replace")
    return json.loads(out)


def settle_dns(d, timeout: float = 15.0):
    """Waits until the proxy's counters have not moved for 0.3 s (the flood's stragglers,
    upstream timeouts included, are done). A quiescence check: it polls, it does not rely
    on the sleep for correctness."""
    deadline = time.monotonic() + timeout
    last, stable_since = None, time.monotonic()
    while True:
        now = d.status()["dns"]
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= 0.3:
            return
        assert time.monotonic() < deadline, f"DNS counters still moving after {timeout}s: {now}"
        time.sleep(0.05)


def test_dns_flood_keeps_control_responsive_and_memory_bounded(lab, egressd):
    # AAAA for the wildcard names too: without it dnsmasq (no upstream) answers REFUSED,
    # which egressd turns into SERVFAIL, and real failures would hide among those.
    lab.dns.restart(wildcards={"wild.example.org": ["203.0.113.10", "2001:db8:2::10"]})
    d = egressd(POLICY)
    # Warm up with the same mix, so allocator pools and the learned set exist at baseline.
    flood_result(run_flood(lab, 1000, 1.0, seed=1), timeout=30)
    settle_dns(d)
    rss_base = vm_rss_kib(d.pid)
    dns_before = d.status()["dns"]

    # The same 20,000 packets either way; an ASan+UBSan build (-O0) gets them over 10 s. At
    # 4,000/s it is at its capacity on a 2-core machine (86 % of a core in `perf`, the binary
    # before issue 16 included: 87-100 % answered from run to run), so the answered share
    # measured the build's speed, not whether the proxy sheds load with an answer.
    sanitized = is_sanitized(d.pid)
    count, seconds = 20_000, (10.0 if sanitized else 5.0)
    flood = run_flood(lab, count, seconds, seed=2)
    lat, switch_s, switch_reply = [], None, None
    t0 = time.monotonic()
    # status every ~20 ms while the flood runs; one phase switch in the middle.
    while flood.poll() is None and time.monotonic() - t0 < seconds + 15:
        ts = time.monotonic()
        st = d.status()
        lat.append(time.monotonic() - ts)
        assert st["ok"] is True
        if switch_s is None and ts - t0 > seconds / 2:
            ts = time.monotonic()
            switch_reply = d.request({"cmd": "apply", "phase": "flood2"}, timeout=10)
            switch_s = time.monotonic() - ts
        time.sleep(0.02)  # pacing of the probe, not synchronisation
    res = flood_result(flood, timeout=30)
    settle_dns(d)
    dns_after = d.status()["dns"]

    lat.sort()
    p50 = lat[len(lat) // 2] * 1000
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000
    rss_after = vm_rss_kib(d.pid)
    delta = {k: dns_after[k] - dns_before[k] for k in dns_after}
    print(f"\nflood: {res['queries']} queries + {res['garbage']} garbage packets sent in {res['send_seconds']} s; "
          f"answered {res['answered']}, unanswered {res['unanswered']}, rcodes {res['rcodes']}, "
          f"client latency {res['latency_ms']}; proxy counters {delta}")
    print(f"status during flood: {len(lat)} calls, p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {lat[-1] * 1000:.1f} ms")
    print(f"switch to flood2 during flood: {switch_s * 1000 if switch_s else -1:.1f} ms, reply {switch_reply}")
    print(f"RSS: baseline {rss_base} KiB, after {rss_after} KiB ({'ASan build' if sanitized else 'release build'})")

    assert res["send_seconds"] < seconds + 5, res  # the sender kept its pace
    assert switch_reply and switch_reply.get("ok") is True, switch_reply
    assert switch_s < 5.0
    # p95, not p99: about 150 calls make p99 the second slowest, which two scheduler stalls of the
    # 2-core machine running three lab workers decide (CI: 117 ms with p50 8.5 ms); the slowest
    # call is bounded on its own.
    p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] * 1000
    assert p95 < (500 if sanitized else 100), f"status p95 {p95:.1f} ms (p99 {p99:.1f} ms)"
    assert lat[-1] * 1000 < 2000, f"slowest status {lat[-1] * 1000:.1f} ms"
    # Most queries are answered (UDP on loopback: losses only if the proxy sheds load, which
    # it does with SERVFAIL beyond its in-flight bound, still an answer).
    assert res["answered"] >= 0.95 * res["queries"], res
    assert res["rcodes"].get("2", 0) < 0.01 * res["queries"], res  # SERVFAIL: shed load or upstream trouble
    assert res["rcodes"].get("5", 0) >= res["refused_total"] * 0.95, res  # REFUSED for the exfil names
    assert delta["malformed"] > 0

    # No refused name ever reached the upstream (DNS exfiltration).
    lab.dns.sync()
    upstream = {n.lower() for n in lab.dns.query_names()}
    leaked = [n for n in upstream if n.endswith("exfil.example")]
    assert not leaked, leaked[:10]

    # Memory returns near its baseline: nothing per query is kept.
    bound = 256 * 1024 if sanitized else 16 * 1024
    assert rss_after - rss_base < bound, (rss_base, rss_after)

    # Still alive, still enforcing the phase in force (flood2 allows b.example.com only).
    assert d.running, d.log()
    st = d.status()
    assert st["phase"] == "flood2"
    assert lab.dns_query("b.example.com").addresses
    assert lab.dns_query("a.example.com").rcode == "REFUSED"
    assert lab.tcp_connect("198.51.100.11", 80) == "ok"
    out = lab.tcp_connect("198.51.100.10", 80, timeout=1.0)
    assert fast_reject(out), out


def test_dns_tcp_connections_from_the_sandbox_are_bounded(lab, egressd):
    """Idle TCP connections to port 53 (a slowloris) cannot starve the proxy: beyond its
    limit (64) new ones are closed at once, UDP keeps working, and TCP works again once
    they are gone."""
    d = egressd(POLICY)
    idle = []
    for _ in range(100):  # bounded: 100 connections
        s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2.0)
        s.connect(("192.0.2.1", 53))
        idle.append(s)
    # Connections beyond the limit are closed by the proxy at once: they turn readable (EOF
    # or a reset) within moments, long before the 10 s idle timeout.
    closed = set()
    t0 = time.monotonic()
    deadline = t0 + 3.0
    while time.monotonic() < deadline:
        if len(closed) >= 36 and time.monotonic() - t0 > 0.3:
            break
        ready, _, _ = select.select([s for s in idle if s not in closed], [], [],
                                    max(0.0, min(0.1, deadline - time.monotonic())))
        for s in ready:
            try:
                s.recv(1)
            except OSError:
                pass
            closed.add(s)
    closed = len(closed)
    print(f"\n100 idle TCP connections to port 53: {closed} closed at once by the proxy")
    assert 30 <= closed <= 40, closed  # 64 kept (give or take connections mid-close)
    assert lab.dns_query("a.example.com").addresses
    assert lab.dns_query("evil.example").rcode == "REFUSED"
    t0 = time.monotonic()
    assert d.status()["ok"] is True
    assert time.monotonic() - t0 < 1.0
    for s in idle:
        s.close()
    labmod.wait_for(lambda: lab.dns_query("a.example.com", tcp=True, timeout=0.5).addresses, 5.0,
                    "DNS over TCP once the idle connections are gone")


# --- the sandbox cannot talk its way around ------------------------------------------------

MARK_PROBE = textwrap.dedent(r'''
    import json, socket, struct, sys
    SO_MARK = 36
    mark, = (int(sys.argv[1], 0),)
    out = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
        out["mark"] = "set"
    except OSError as e:
        out["mark"] = e.strerror
        print(json.dumps(out)); sys.exit(0)
    s.settimeout(1.0)
    try:
        s.connect(("198.51.100.11", 80)); out["tcp80"] = "ok"
    except OSError as e:
        out["tcp80"] = type(e).__name__
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
    u.settimeout(1.0)
    q = struct.pack("!HHHHHH", 77, 0x0100, 1, 0, 0, 0) + b"\x05mark1\x0bexfil-probe\x07example\x00\x00\x01\x00\x01"
    try:
        u.sendto(q, ("192.0.2.1", 53))
        msg = u.recv(4096)
        out["dns"] = "rcode %d" % (msg[3] & 0xF)
    except OSError as e:
        out["dns"] = type(e).__name__
    print(json.dumps(out))
''')

OWN_MARK = 0x65677264  # nft::kOwnTrafficMark


def run_in_sandbox(lab, caps: str, script: str, *args) -> dict:
    """Runs a python script in the sandbox as root with only the capabilities `caps` (a
    setpriv list such as "-all" or "-all,+net_raw")."""
    cp = lab.sandbox.exec("setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--",
                          sys.executable, "-c", script, *map(str, args), timeout=20)
    return json.loads(cp.stdout)


def test_sandbox_without_net_admin_cannot_change_the_rules(lab, egressd):
    d = egressd(POLICY)
    wait_preresolved(d)
    rc0, before, _ = lab.nft(lab.sandbox, "list table inet egressd")
    assert rc0 == 0
    for caps in ("-all", "-all,+net_raw,+net_bind_service,+setuid,+sys_admin"):
        for cmd in ("flush ruleset", "delete table inet egressd", "add rule inet egressd output accept",
                    "flush chain inet egressd active"):
            cp = lab.sandbox.exec("setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--",
                                  "nft", cmd, check=False)
            assert cp.returncode != 0 and "Operation not permitted" in cp.stderr, (caps, cmd, cp.stderr)
    # nobody (uid 65534) cannot either.
    cp = lab.sandbox.exec("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "nft",
                          "flush ruleset", check=False)
    assert cp.returncode != 0, cp.stderr
    rc1, after, _ = lab.nft(lab.sandbox, "list table inet egressd")
    # Learned elements count down their timeouts and counters count (the kernel's own IPv6
    # chatter is denied too); everything else must be identical.
    expiry = re.compile(r" expires \S+|packets \d+ bytes \d+")
    assert rc1 == 0 and expiry.sub("", after) == expiry.sub("", before)
    check_agent_policy(lab)
    assert d.running


# Docker's default capability set, all of it.
DOCKER_DEFAULT_CAPS = ("-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,+net_bind_service,"
                       "+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap")

# Binds, then unbinds, nfnetlink_queue 19 (egressd's claim on the namespace, daemon/netns_claim.h)
# over a raw netlink socket; prints the kernel's errno for each (0: done).
CLAIM_QUEUE = textwrap.dedent("""
    import json, socket, struct
    def command(s, cmd):
        attr = struct.pack("=HHBBH", 8, 1, cmd, 0, 0)  # NFQA_CFG_CMD {command, pad, pf}
        body = struct.pack("=BBH", 0, 0, socket.htons(19)) + attr  # nfgenmsg, queue 19
        s.send(struct.pack("=IHHII", 16 + len(body), (3 << 8) | 2, 1 | 4, 1, 0) + body)  # CONFIG, ack
        reply = s.recv(4096)
        assert struct.unpack_from("=H", reply, 4)[0] == 2, reply  # NLMSG_ERROR: the ack
        return -struct.unpack_from("=i", reply, 16)[0]
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
    s.bind((0, 0))
    print(json.dumps({"bind": command(s, 1), "unbind": command(s, 2)}))
""")


def test_a_sandbox_process_cannot_take_or_free_egressds_claim_on_its_namespace(lab, egressd):
    """egressd claims its namespace by binding nfnetlink_queue 19 (a second egressd there stops).
    A task that took the claim while egressd is down would keep egressd from coming back; one
    that freed it would let a second egressd in. Neither works without CAP_NET_ADMIN, with
    Docker's whole default set or as root."""
    d = egressd(POLICY)
    eperm = {"bind": errno.EPERM, "unbind": errno.EPERM}
    assert run_in_sandbox(lab, DOCKER_DEFAULT_CAPS, CLAIM_QUEUE) == eperm
    d.stop()
    assert run_in_sandbox(lab, DOCKER_DEFAULT_CAPS, CLAIM_QUEUE) == eperm
    assert run_in_sandbox(lab, "-all", CLAIM_QUEUE) == eperm
    d.start()
    check_agent_policy(lab)
    assert run_in_sandbox(lab, DOCKER_DEFAULT_CAPS, CLAIM_QUEUE) == eperm
    second = lab.egressd(POLICY, name="second", start=False)
    with pytest.raises(labmod.LabError, match="second exited with 1 before ready"):
        second.start()
    assert f"pid {d.pid} (egressd)" in second.log()
    # The test's own probe does bind it with CAP_NET_ADMIN, once no egressd holds it.
    d.stop()
    cp = lab.sandbox.exec(sys.executable, "-c", CLAIM_QUEUE, timeout=20)
    assert json.loads(cp.stdout) == {"bind": 0, "unbind": 0}


def test_socket_mark_needs_privileges_and_buys_dns_ports_only(lab, egressd):
    egressd(POLICY)
    # Without CAP_NET_ADMIN / CAP_NET_RAW a process cannot set SO_MARK at all.
    res = run_in_sandbox(lab, "-all", MARK_PROBE, OWN_MARK)
    assert res["mark"] == "Operation not permitted", res
    # With CAP_NET_RAW alone (Docker's default set has it) newer kernels (>= 5.17) allow
    # SO_MARK. The daemon's own mark is drawn at random per table and is not readable without
    # CAP_NET_ADMIN, so a process that sets the well-known default mark gains nothing: its
    # query still goes through the proxy (refused, never forwarded) and port 80 stays rejected.
    res = run_in_sandbox(lab, "-all,+net_raw", MARK_PROBE, OWN_MARK)
    print(f"\nSO_MARK with CAP_NET_RAW only: {res}")
    if res["mark"] == "set":
        assert res["tcp80"] in ("ConnectionRefusedError", "PermissionError", "TimeoutError"), res
        lab.dns.sync()
        assert "mark1.exfil-probe.example" not in [n.lower() for n in lab.dns.query_names()], res
    else:
        assert res["mark"] == "Operation not permitted", res
    # With CAP_NET_ADMIN the same: DNS ports only.
    res = run_in_sandbox(lab, "-all,+net_admin", MARK_PROBE, OWN_MARK)
    assert res["mark"] == "set" and res["tcp80"] in ("ConnectionRefusedError", "PermissionError"), res


def test_dns_answers_into_loopback_link_local_or_metadata_are_not_learned(lab, egressd):
    # dnsmasq serves one address per family and name, so each bad target gets its own name.
    lab.dns.restart(hosts={
        "a.example.com": ["198.51.100.10"],
        "www.example.com": ["127.0.0.1", "2001:db8:2::11"],
        "meta.wild.example.org": ["169.254.169.254", "fd00:ec2::254"],
        "ll.wild.example.org": ["169.254.1.1", "fe80::1"],
        "mix.wild.example.org": ["198.51.100.11", "::1"],
        "mapped.wild.example.org": ["0.0.0.0", "::ffff:127.0.0.1"],
    }, cnames={}, wildcards={})
    d = egressd(POLICY)
    want = {"www.example.com": ["2001:db8:2::11"], "mix.wild.example.org": ["198.51.100.11"]}
    for name in ("www.example.com", "meta.wild.example.org", "ll.wild.example.org", "mix.wild.example.org",
                 "mapped.wild.example.org"):
        for qtype in ("A", "AAAA"):
            r = lab.dns_query(name, qtype)
            assert r.rcode == "NOERROR" and len(r.addresses) == 1, (name, qtype, r)  # the sandbox gets the answer
    learned = {n["name"]: sorted(a["address"] for a in n["addresses"]) for n in d.status()["learned"]}
    for name in want:
        assert learned.get(name) == want[name], learned
    for name in ("meta.wild.example.org", "ll.wild.example.org", "mapped.wild.example.org"):
        assert name not in learned, learned
    # Every set's elements (the rules name 127.0.0.1 and ::1 themselves: the DNS proxy's address).
    _, listing, _ = lab.nft(lab.sandbox, "list sets inet")
    assert "set ph_agent_d4" in listing, listing
    # (Whole addresses: lo_upstream4 holds Docker's 127.0.0.11.)
    for bad in ("169.254.169.254", "169.254.1.1", "127.0.0.1", "0.0.0.0", "fd00:ec2::254", "fe80::1", "::ffff:127"):
        assert not re.search(r"(?<![0-9a-f.:])" + re.escape(bad) + r"(?![0-9a-f])", listing), bad
    assert "198.51.100.11" in listing and "2001:db8:2::11" in listing
    # The learned public addresses work; one never answered does not.
    assert lab.tcp_connect("198.51.100.11", 80) == "ok"
    assert lab.tcp_connect("2001:db8:2::11", 80) == "ok"
    assert fast_reject(lab.tcp_connect("203.0.113.10", 80, timeout=1.0))


# Sends one UDP datagram to 198.51.100.11:7 (the echo server, denied in phase agent) as a
# raw Ethernet frame on an AF_PACKET socket, and waits for the echo on an ordinary UDP socket.
PACKET_PROBE = textwrap.dedent(r'''
    import json, socket, struct, sys
    gw_mac, src_ip, dst_ip = bytes.fromhex(sys.argv[1].replace(":", "")), sys.argv[2], sys.argv[3]
    out = {}
    try:
        ps = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    except OSError as e:
        print(json.dumps({"packet_socket": e.strerror})); sys.exit(0)
    out["packet_socket"] = "open"
    ps.bind(("eth0", 0))
    my_mac = ps.getsockname()[4]
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind((src_ip, 0))
    rx.settimeout(2.0)
    sport = rx.getsockname()[1]
    payload = b"raw frame past nftables"
    udp = struct.pack("!HHHH", sport, 7, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                     socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    s = sum(struct.unpack("!10H", ip))
    s = (s & 0xFFFF) + (s >> 16); s = (s & 0xFFFF) + (s >> 16)
    ip = ip[:10] + struct.pack("!H", ~s & 0xFFFF) + ip[12:]
    if len(sys.argv) > 4:  # PACKET_QDISC_BYPASS: straight to the driver, no qdisc
        ps.setsockopt(263, 20, 1)
    try:
        ps.send(gw_mac + my_mac + b"\x08\x00" + ip + udp)
    except OSError as e:
        out["echo"] = "send: " + e.strerror
        print(json.dumps(out)); sys.exit(0)
    try:
        data, peer = rx.recvfrom(2048)
        out["echo"] = "ok" if data == payload else "wrong"
        out["from"] = peer[0]
    except OSError as e:
        out["echo"] = type(e).__name__
    print(json.dumps(out))
''')


def test_net_raw_packet_sockets_do_not_bypass_the_policy(lab, egressd):
    """CAP_NET_RAW (in Docker's default set) opens AF_PACKET sockets, whose frames go straight
    to the device below every inet hook. They used to reach a denied destination; since issue
    14 the netdev egress chain of every interface lets a frame out only if the inet chains
    signed it, so the frame is dropped (the send fails with ENOBUFS, with or without
    PACKET_QDISC_BYPASS) and nothing answers. Without the capability the socket cannot be
    opened at all. test_integrity.py covers the rest (IPv6, no-network, interfaces moved in)."""
    egressd(POLICY)
    assert fast_reject(lab.udp_exchange("198.51.100.11", 7, timeout=1.0))
    gw_mac = json.loads(lab.internet.ip("-j", "link", "show", "dev", labmod.INTERNET_IF).stdout)[0]["address"]
    args = (gw_mac, labmod.SANDBOX_V4, "198.51.100.11")
    res = run_in_sandbox(lab, "-all", PACKET_PROBE, *args)
    assert res == {"packet_socket": "Operation not permitted"}, res
    for extra in ((), ("bypass",)):
        res = run_in_sandbox(lab, "-all,+net_raw", PACKET_PROBE, *args, *extra)
        print(f"\nAF_PACKET with CAP_NET_RAW only{' (PACKET_QDISC_BYPASS)' if extra else ''}: {res}")
        assert res["packet_socket"] == "open", res
        assert res["echo"] != "ok", f"an AF_PACKET frame reached a denied host: {res}"
        assert res["echo"] in ("send: No buffer space available", "TimeoutError"), res
    # The policy itself is untouched: ordinary sockets are still denied.
    assert fast_reject(lab.udp_exchange("198.51.100.11", 7, timeout=1.0))


def test_egressds_log_holds_none_of_the_tables_secret_marks(lab, egressd):
    """The own-traffic, pass and proxy marks are drawn at random so that a sandbox process with
    NET_RAW cannot guess them (docs/security.md). egressd's log is read by more people than the
    table (an orchestrator's log collector); the proxy's start line printed the own mark (found
    by an attack review). None of the table's secrets may appear in the log."""
    d = egressd(POLICY)
    d.request({"cmd": "apply", "phase": "agent"})
    rc, out, err = lab.nft(lab.sandbox, "list", "table", "inet", "egressd")
    assert rc == 0, err
    secrets = set(re.findall(r"(?:mark|pass|proxy|salt)=0x([0-9a-f]+)", " ".join(
        line for line in out.splitlines() if "comment" in line and "egressd v" in line)))
    assert secrets, out[:2000]
    log = d.log().lower()
    leaked = [s for s in secrets if int(s, 16) != 0 and (f"0x{s}" in log or f"0x{int(s, 16):x}" in log)]
    assert not leaked, leaked


# ---- The resolv.conf egressd shares with the sandbox ----------------------------------------------
# Docker's `network_mode: service:X` and a pod give the containers of one namespace one
# resolv.conf, writable by any of them as root (no capability needed). Read afresh at every
# start, a sandbox's server became egressd's upstream after a restart and answered an allowed
# name with an address of its choosing, which egressd then opened; an emptied file stopped
# egressd from starting again (attack review 11). egressd keeps the file it first read and uses
# that for as long as the file lives, in the same namespace or a new one (attack review L).

def test_a_restart_in_the_same_namespace_keeps_the_resolv_conf_egressd_first_read(lab, egressd):
    shared = lab.tmp / "shared-resolv.conf"
    shared.write_text(f"nameserver {labmod.DNS_V4}\n")
    wrapped = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(shared),
               str(labmod.egressd_binary())]
    d = egressd("initial_phase: agent\nphases:\n  agent: { network_mode: allowlist, "
                "allowed_hosts: [\"a.example.com\"] }\n", binary=wrapped)
    assert f"upstream={labmod.DNS_V4} " in d.log(), d.log()[-2000:]
    for written in ("nameserver 203.0.113.66\n", ""):  # the sandbox's server; nothing at all
        shared.write_text(written)
        d.restart()
        last = d.log().rsplit("--- ", 1)[-1]
        assert f"upstream={labmod.DNS_V4} " in last, last[-2000:]
        assert "event=resolv_conf_changed" in last, last[-2000:]
        assert lab.dns_query("a.example.com", "A", timeout=5.0).rcode == "NOERROR"



def test_a_restart_in_a_new_namespace_keeps_the_resolv_conf_first_read_from_the_same_file(lab, egressd):
    """Attack review L: Docker and Podman give a restarted container a new namespace, and the
    same resolv.conf, which the task that shares it may have written meanwhile. The first read is
    kept for as long as the file lives, whatever the namespace; a new file (another container's)
    is read afresh. Each start joins a namespace of its own (--netns-pid of a process made in a
    new one)."""
    def holder():
        p = lab.spawn(["unshare", "-n", "sh", "-c", "ip link set lo up && echo ready && exec sleep 300"],
                      stdout=subprocess.PIPE)
        assert labmod._read_line(p, 10.0, "a process in a new namespace") == "ready"
        return p
    shared = lab.tmp / "shared-resolv.conf"
    shared.write_text(f"nameserver {labmod.DNS_V4}\n")
    wrapped = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(shared),
               str(labmod.egressd_binary())]
    first = holder()
    d = egressd("initial_phase: agent\nphases:\n  agent: { network_mode: allowlist, "
                "allowed_hosts: [\"a.example.com\"] }\n", binary=wrapped, netns_pid=first.pid)
    assert f"upstream={labmod.DNS_V4} " in d.log(), d.log()[-2000:]
    namespaces = {os.readlink(f"/proc/{first.pid}/ns/net")}
    for written, fresh, want in ((b"nameserver 203.0.113.66\n", False, labmod.DNS_V4),
                                 (b"nameserver 203.0.113.67\n", True, "203.0.113.67")):
        if fresh:
            shared.unlink()  # a new file
        shared.write_bytes(written)  # else in place: the same file
        nxt = holder()
        namespaces.add(os.readlink(f"/proc/{nxt.pid}/ns/net"))
        d.netns_pid = nxt.pid
        d.restart()
        last = d.log().rsplit("--- ", 1)[-1]
        assert "adopted" not in last, f"not a new namespace: {last[-2000:]}"
        assert f"upstream={want} " in last, last[-2000:]
        assert ("event=resolv_conf_changed" in last) == (not fresh), last[-2000:]
    assert len(namespaces) == 3

# ---- A namespace every interface left ----------------------------------------------------------
# Docker and Podman give a restarted container a new network namespace. With egressd joined to
# the task's (`network_mode: service:task`), the restarted task ran in a namespace with no policy
# while egressd, left in the old one, stayed healthy and acknowledged every switch (attack review
# 11). egressd now exits (3) when every interface has left its namespace, ready file removed, so
# the orchestrator's next request fails and a restart policy starts egressd in the new namespace.

def test_egressd_exits_when_every_interface_has_left_its_namespace(lab, egressd):
    d = egressd(POLICY, phase="verifier")
    ifaces = [l.split(":")[1].strip().split("@")[0] for l in lab.sandbox.ip("-o", "link", "show").stdout.splitlines()]
    others = [i for i in ifaces if i != "lo"]
    assert others, ifaces
    for i in others:
        lab.sandbox.ip("link", "del", i)
    assert d.wait(5.0) == 3, d.log()[-2000:]
    assert "event=namespace_abandoned" in d.log()
    assert not d.ready_path.exists()
    # The policy stays in the namespace (fail closed).
    assert lab.nft(lab.sandbox, "list", "table", "inet", "egressd")[0] == 0
