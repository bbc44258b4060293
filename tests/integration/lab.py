#!/usr/bin/env python3
"""The egressd integration lab: throwaway network namespaces with real servers.

One Lab is two namespaces joined by one veth pair, and nothing else:

    sandbox  (egt-<pid>-<n>-sb)                  internet  (egt-<pid>-<n>-in)
      eth0  192.0.2.2/24  2001:db8:1::2/64  <->    veth-sb  192.0.2.1/24  2001:db8:1::1/64
      lo    127.0.0.1 ::1                          lo       198.51.100.10 198.51.100.11 203.0.113.10
      default via 192.0.2.1 / 2001:db8:1::1                 2001:db8:2::10 2001:db8:2::11 2001:db8:3::10
      loopback echo servers (tcp/udp 7)                     echo servers on every server address
                                                            dnsmasq on 192.0.2.1 / 2001:db8:1::1 :53

No interface lives in the host namespace and only documentation addresses are used, so no
packet a test sends can leave the machine. egressd runs as a host process that joins the
sandbox namespace (--netns /run/netns/<sandbox>); clients run inside the sandbox.

Client helpers run in-process: a short-lived thread setns()es into the namespace, creates the
socket and exits. A socket belongs to the namespace it was created in for its whole life, so
the test then uses it from any thread, with no helper process and no pickling of results.

Every wait has a deadline; nothing sleeps as synchronisation. Cleanup (processes, sockets,
namespaces) runs from fixture finalizers, atexit and SIGTERM/SIGHUP, and sweep_stale()
removes egt-* namespaces left by a process that no longer exists.

Stdlib only (Python 3.11). Needs root, iproute2, nftables, dnsmasq-base, util-linux (setpriv).
"""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import errno
import itertools
import json
import os
import random
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

# --- address plan --------------------------------------------------------------------------

PREFIX = "egt-"
SANDBOX_IF = "eth0"
INTERNET_IF = "veth-sb"
SANDBOX_V4, SANDBOX_V6 = "192.0.2.2", "2001:db8:1::2"
GATEWAY_V4, GATEWAY_V6 = "192.0.2.1", "2001:db8:1::1"
DNS_V4, DNS_V6 = GATEWAY_V4, GATEWAY_V6
SERVERS_V4 = ("198.51.100.10", "198.51.100.11", "203.0.113.10")
SERVERS_V6 = ("2001:db8:2::10", "2001:db8:2::11", "2001:db8:3::10")
SERVERS = SERVERS_V4 + SERVERS_V6
TCP_PORTS = (7, 80, 443, 8080)
UDP_PORTS = (7, 443, 5353)
ECHO_PORT = 7
LOOPBACK = ("127.0.0.1", "::1")
# argv prefix: the rest runs as uid 65534 with no capability, not even in its bounding set
# (a sandbox's unprivileged process).
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
          "--"]

# Default DNS data served by the lab's dnsmasq (names from the documentation domains).
DEFAULT_HOSTS = {
    "a.example.com": ["198.51.100.10", "2001:db8:2::10"],
    "b.example.com": ["198.51.100.11", "2001:db8:2::11"],
    "c.example.net": ["203.0.113.10"],
    "v6.example.org": ["2001:db8:2::11"],
}
DEFAULT_CNAMES = {"www.example.com": "a.example.com"}
DEFAULT_TXT = {"txt.example.com": "egressd lab"}
# address=/domain/...: the domain and every name below it.
DEFAULT_WILDCARDS = {"wild.example.org": ["203.0.113.10"]}

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def egressd_binary() -> Path:
    return Path(os.environ.get("EGRESSD") or REPO_ROOT / "build/src/egressd").resolve()


_sanitized: dict[Path, bool] = {}


def sanitized_binary() -> bool:
    """Whether the egressd under test is a sanitizer build (scripts/test runs the lab on
    build-fuzz/: ASan + UBSan, -O1), whose work takes a few times as long as the shipped one's.
    Timing budgets of DESIGN §5 hold for the shipped binary; a test may allow such a build twice
    its budget, and the release smoke test holds the shipped binary to the budget itself."""
    path = egressd_binary()
    if path not in _sanitized:
        try:
            _sanitized[path] = b"AddressSanitizer" in path.read_bytes()
        except OSError:
            _sanitized[path] = False
    return _sanitized[path]


def egressctl_binary() -> Path:
    return Path(os.environ.get("EGRESSCTL") or REPO_ROOT / "build/src/egressctl").resolve()


class LabError(Exception):
    """The lab itself could not do something (not a verdict about egressd)."""


# --- small utilities -----------------------------------------------------------------------


def wait_for(cond, timeout: float, what: str):
    """Polls cond() until it returns something truthy and returns that; LabError after timeout s."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        value = cond()
        if value:
            return value
        now = time.monotonic()
        if now >= deadline:
            raise LabError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.05)


def switch_and_wait_for_reaper(d, canary: "UdpFlow", phase: str) -> int:
    """Switches egressd `d` to `phase` and waits until its flow reaper has aborted `canary`, a
    connected UDP socket of the sandbox that the phase cuts: the abort is what shows the reaper
    ran for this switch (it lists a family's UDP sockets after its TCP ones, so every TCP flow
    of that family has been decided too). Returns how many sockets the reaper aborted.

    Not a TCP flow: its own delayed ACK, sent just after the switch, meets the deny, and the
    deny's reset closes the socket before the reaper lists it; nothing is aborted, no line is
    logged. A UDP socket sends nothing unless told to."""
    assert isinstance(canary, UdpFlow), "the canary must be a UDP flow (see above)"
    assert canary.exchange() == "ok"
    assert d.ctl("apply", phase)[0] == 0
    gen = d.status()["generation"]
    reaped = re.compile(rf"aborted sockets=(\d+) gen={gen} ")
    wait_for(lambda: reaped.search(d.log()), 5.0, "the reaper to abort the canary flow")
    assert canary.exchange() == "reset"
    return int(reaped.search(d.log()).group(1))


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted from its root (unified or hybrid host), or None."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        if post.split()[0] == "cgroup2" and pre.split()[3] == "/":
            return Path(pre.split()[4])
    return None


def cgroup_of(pid: int | str = "self") -> str | None:
    """The cgroup (v2) of a process, as /proc/PID/cgroup says ("/": the root); None if unreadable."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((l[3:] for l in lines if l.startswith("0::")), None)


def run(args, *, timeout: float = 10.0, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """Runs a command to completion, output captured as text. LabError on timeout, or on a
    non-zero exit when check."""
    args = [str(a) for a in args]
    try:
        cp = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input,
                            stdin=subprocess.DEVNULL if input is None else None)
    except subprocess.TimeoutExpired:
        raise LabError(f"{shlex.join(args)}: still running after {timeout:g}s") from None
    if check and cp.returncode != 0:
        raise LabError(f"{shlex.join(args)} exited {cp.returncode}: {cp.stderr.strip()}")
    return cp


def family_of(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def same_addr(a: str, b: str) -> bool:
    fa, fb = family_of(a), family_of(b)
    return fa == fb and socket.inet_pton(fa, a.split("%")[0]) == socket.inet_pton(fb, b.split("%")[0])


_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def call_in_netns(path: str, fn, *args):
    """Runs fn(*args) on a fresh thread that has joined the network namespace at `path` and
    returns its result (or raises its exception). Only that thread changes namespace; the
    thread ends right after, so no other code ever runs in the wrong namespace."""
    box = {}

    def body():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({path}): {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=body, name=f"netns {path}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _write_file(path: str, text: str):
    with open(path, "w") as f:
        f.write(text)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- client outcomes -----------------------------------------------------------------------


class Outcome(str):
    """What a client saw: 'ok' | 'refused' | 'reset' | 'unreachable' | 'timeout'.

    refused      ECONNREFUSED: a TCP RST answered the SYN, or ICMP port unreachable (UDP)
    reset        an established flow was torn down: ECONNRESET, ECONNABORTED (sock_diag
                 destroy), EPIPE, or EOF where an echo was expected
    unreachable  EHOSTUNREACH / ENETUNREACH / EACCES / EPERM: an ICMP(v6) destination
                 unreachable (admin-prohibited included) or a local drop
    timeout      nothing came back before the deadline (a silent drop)

    Compares equal to its plain string; .detail (errno name or ICMP type/code), .elapsed
    (seconds) and .icmp ((type, code) for ping errors) say more, and show in repr().
    """

    detail: str
    elapsed: float
    icmp: tuple | None

    def __new__(cls, value: str, detail: str = "", elapsed: float = 0.0, icmp=None):
        o = super().__new__(cls, value)
        o.detail, o.elapsed, o.icmp = detail, elapsed, icmp
        return o

    @property
    def prohibited(self) -> bool:
        """True when an ICMP(v6) administratively-prohibited error came back."""
        return self.icmp in _ICMP_PROHIBITED

    def __repr__(self):
        extra = f" {self.detail}" if self.detail else ""
        return f"<{str(self)}{extra} after {self.elapsed * 1000:.1f} ms>"


# (type, code): IPv4 net/host/communication administratively prohibited; ICMPv6 code 1.
_ICMP_PROHIBITED = {(3, 9), (3, 10), (3, 13), (1, 1)}


_ERRNO_OUTCOME = {
    errno.ECONNREFUSED: "refused",
    errno.ECONNRESET: "reset",
    errno.ECONNABORTED: "reset",
    errno.EPIPE: "reset",
    # sock_diag SOCK_DESTROY of a connected UDP socket disconnects it: the
    # flow was aborted by egressd after a switch.
    errno.EDESTADDRREQ: "reset",
    errno.EHOSTUNREACH: "unreachable",
    errno.ENETUNREACH: "unreachable",
    errno.EHOSTDOWN: "unreachable",
    errno.EACCES: "unreachable",
    errno.EPERM: "unreachable",
    errno.ETIMEDOUT: "timeout",
}


def _classify(exc: OSError, t0: float) -> Outcome:
    elapsed = time.monotonic() - t0
    if isinstance(exc, TimeoutError) and exc.errno is None:  # socket.timeout
        return Outcome("timeout", "no answer", elapsed)
    kind = _ERRNO_OUTCOME.get(exc.errno)
    if kind is None:
        raise exc
    return Outcome(kind, errno.errorcode.get(exc.errno, str(exc.errno)), elapsed)


def _token() -> bytes:
    return f"lab-{random.getrandbits(64):016x}\n".encode()


def _recv_exact_echo(sock: socket.socket, payload: bytes, t0: float, deadline: float) -> Outcome:
    got = b""

    def incomplete() -> Outcome:  # connected, so the SYN was answered: what is missing is the echo
        return Outcome("timeout", f"echo incomplete ({len(got)}/{len(payload)} bytes)", time.monotonic() - t0)

    while len(got) < len(payload):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return incomplete()
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(len(payload) - len(got))
        except TimeoutError as e:
            if e.errno is not None:
                raise
            return incomplete()
        if not chunk:
            return Outcome("reset", "EOF", time.monotonic() - t0)
        got += chunk
    if got != payload:
        raise LabError(f"echo mismatch: sent {payload!r}, got {got!r}")
    return Outcome("ok", "", time.monotonic() - t0)


class TcpFlow:
    """A long-lived TCP connection to an echo server; exchange() sends on it later."""

    def __init__(self, sock: socket.socket, addr: str, port: int):
        self.sock, self.addr, self.port = sock, addr, port
        self.closed = False

    def exchange(self, payload: bytes | None = None, timeout: float = 2.0) -> Outcome:
        """Sends payload and waits for its echo: 'ok', or how the flow failed."""
        payload = payload or _token()
        t0 = time.monotonic()
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(payload)
            return _recv_exact_echo(self.sock, payload, t0, t0 + timeout)
        except OSError as e:
            return _classify(e, t0)

    def close(self):
        self.closed = True
        self.sock.close()

    def __repr__(self):
        return f"TcpFlow({self.addr}:{self.port})"


_IP_RECVERR, _IPV6_RECVERR = 11, 25  # <linux/in.h>, <linux/in6.h>; not in Python's socket module
_ICMP_ERROR_WAIT = 0.3  # s to wait for the ICMP error that follows a local EPERM


class UdpFlow:
    """A long-lived connected UDP socket (same 5-tuple throughout) to an echo server.

    IP_RECVERR is on, so an ICMP error is read from the error queue with its type and code
    (Outcome.icmp): a rejecting nftables rule in the output path makes send() fail with EPERM
    at once and queues the ICMP error it generated right after; a dropping rule gives EPERM
    and no ICMP error."""

    def __init__(self, sock: socket.socket, addr: str, port: int):
        self.sock, self.addr, self.port = sock, addr, port
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_RECVERR, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IP, _IP_RECVERR, 1)

    def exchange(self, payload: bytes | None = None, timeout: float = 2.0) -> Outcome:
        payload = payload or _token()
        t0 = time.monotonic()
        deadline = t0 + timeout
        try:
            self.sock.send(payload)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return Outcome("timeout", "no echo", time.monotonic() - t0)
                self.sock.settimeout(remaining)
                if self.sock.recv(65536) == payload:  # older echoes are skipped
                    return Outcome("ok", "", time.monotonic() - t0)
        except OSError as e:
            out = _classify(e, t0)
            icmp = self._icmp_error(min(deadline, time.monotonic() + _ICMP_ERROR_WAIT))
            if icmp is None:
                return out
            return Outcome(out, f"{out.detail}; {_icmp_text(icmp, self.sock.family == socket.AF_INET6)}",
                           out.elapsed, icmp)

    def _icmp_error(self, deadline: float):
        """(type, code) of the next ICMP error in the socket's error queue, waiting until
        deadline for one to arrive; None if none does."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLERR)
        while True:
            try:
                _, ancdata, _, _ = self.sock.recvmsg(0, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                ancdata = None
            except OSError:
                return None
            for level, typ, data in ancdata or ():
                if (level, typ) in ((socket.IPPROTO_IP, _IP_RECVERR), (socket.IPPROTO_IPV6, _IPV6_RECVERR)):
                    # struct sock_extended_err: u32 errno; u8 origin, type, code, pad; u32 info, data
                    _errno, origin, icmp_type, icmp_code = struct.unpack_from("=IBBB", data)
                    if origin in (2, 3):  # SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6
                        return icmp_type, icmp_code
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            poller.poll(remaining * 1000)

    def close(self):
        self.sock.close()

    def __repr__(self):
        return f"UdpFlow({self.addr}:{self.port})"


# --- DNS wire format (just enough for tests) ------------------------------------------------

QTYPES = {"A": 1, "NS": 2, "CNAME": 5, "SOA": 6, "PTR": 12, "MX": 15, "TXT": 16, "AAAA": 28, "SRV": 33,
          "HTTPS": 65, "ANY": 255}
QTYPE_NAMES = {v: k for k, v in QTYPES.items()}
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}


@dataclasses.dataclass
class DnsRecord:
    name: str
    type: str
    ttl: int
    data: str


@dataclasses.dataclass
class DnsReply:
    """outcome is 'ok' when a reply arrived (then rcode is 'NOERROR', 'NXDOMAIN', 'REFUSED'...),
    else how the exchange failed and rcode is None."""
    outcome: Outcome
    rcode: str | None = None
    records: list = dataclasses.field(default_factory=list)

    @property
    def addresses(self) -> list[str]:
        return [r.data for r in self.records if r.type in ("A", "AAAA")]

    def ttl(self, data: str) -> int | None:
        return next((r.ttl for r in self.records if r.data == data), None)


def dns_build_query(name: str, qtype: str | int, qid: int) -> bytes:
    code = QTYPES[qtype.upper()] if isinstance(qtype, str) else qtype
    wire = b""
    for label in name.rstrip(".").split("."):
        raw = label.encode()
        if not 0 < len(raw) < 64:
            raise ValueError(f"bad DNS label in {name!r}")
        wire += bytes([len(raw)]) + raw
    # RD set, one question, class IN.
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + wire + b"\0" + struct.pack("!HH", code, 1)


def _dns_name(msg: bytes, off: int) -> tuple[str, int]:
    labels, end, jumps = [], None, 0
    while True:
        n = msg[off]
        if n & 0xC0 == 0xC0:
            if jumps > 32:
                raise ValueError("DNS compression loop")
            jumps += 1
            if end is None:
                end = off + 2
            off = ((n & 0x3F) << 8) | msg[off + 1]
            continue
        off += 1
        if n == 0:
            return ".".join(labels), (end if end is not None else off)
        labels.append(msg[off:off + n].decode("ascii", "replace"))
        off += n


def dns_parse_reply(msg: bytes) -> tuple[int, str, list[DnsRecord]]:
    """Returns (id, rcode name, answer records). Raises ValueError on a malformed message."""
    qid, flags, qd, an, _ns, _ar = struct.unpack_from("!HHHHHH", msg, 0)
    off = 12
    for _ in range(qd):
        _, off = _dns_name(msg, off)
        off += 4
    records = []
    for _ in range(an):
        name, off = _dns_name(msg, off)
        rtype, _cls, ttl, rdlen = struct.unpack_from("!HHIH", msg, off)
        off += 10
        rdata = msg[off:off + rdlen]
        if rtype == 1:
            data = socket.inet_ntop(socket.AF_INET, rdata)
        elif rtype == 28:
            data = socket.inet_ntop(socket.AF_INET6, rdata)
        elif rtype in (2, 5, 12):
            data, _ = _dns_name(msg, off)
        elif rtype == 16:
            parts, i = [], 0
            while i < len(rdata):
                parts.append(rdata[i + 1:i + 1 + rdata[i]].decode("utf-8", "replace"))
                i += 1 + rdata[i]
            data = "".join(parts)
        else:
            data = rdata.hex()
        records.append(DnsRecord(name.lower(), QTYPE_NAMES.get(rtype, str(rtype)), ttl, data))
        off += rdlen
    return qid, RCODES.get(flags & 0xF, str(flags & 0xF)), records


# --- namespaces ----------------------------------------------------------------------------


_NFT_QUEUE: list[bool] = []


def nft_loadable(text: str, scratch) -> str:
    """`text` (an `egressd render` script) as nft -f can load it on this kernel. Without
    nft_queue (CONFIG_NFT_QUEUE) nft cannot load pinning's `queue num 16` (17, 18; egressd sends the
    xtables NFQUEUE target instead, which nft lists the same way but cannot parse), so the
    rule becomes a commented drop: same rule count, and test_enforcer.normalize_ruleset turns
    it back. `scratch()` gives a namespace for the one probe (nft -c: nothing is loaded); it
    is called on the first use only."""
    if not _NFT_QUEUE:
        cp = run(["ip", "netns", "exec", scratch().name, "nft", "-c", "-f", "-"], check=False,
                 input="table inet egressd_probe { chain c { queue num 16 } }\n")
        _NFT_QUEUE.append(cp.returncode == 0)
    return text if _NFT_QUEUE[0] else re.sub(r"queue num (\d+)", r'drop comment "pin-queue \1"', text)


class Netns:
    """A named network namespace (/run/netns/<name>) and client helpers that run inside it."""

    def __init__(self, name: str):
        self.name = name
        self.path = f"/run/netns/{name}"
        self._sockets = weakref.WeakSet()

    def __repr__(self):
        return f"Netns({self.name})"

    # management
    def create(self):
        run(["ip", "netns", "add", self.name])

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def ip(self, *args, check=True) -> subprocess.CompletedProcess:
        return run(["ip", "-n", self.name, *args], check=check)

    def ip_batch(self, lines):
        run(["ip", "-n", self.name, "-batch", "-"], input="\n".join(lines) + "\n")

    def exec(self, *args, timeout: float = 10.0, check: bool = True, input: str | None = None):
        """Runs a command inside the namespace (ip netns exec); CompletedProcess with text output."""
        return run(["ip", "netns", "exec", self.name, *args], timeout=timeout, check=check, input=input)

    def sysctl(self, key: str, value):
        call_in_netns(self.path, _write_file, "/proc/sys/" + key.replace(".", "/"), str(value))

    def read_proc(self, path: str) -> str:
        """Reads e.g. /proc/net/unix as seen from inside the namespace."""
        def read():
            # /proc/self/net follows the thread group leader; thread-self follows this thread.
            with open(path.replace("/proc/net/", "/proc/thread-self/net/", 1)) as f:
                return f.read()
        return call_in_netns(self.path, read)

    def operstate(self, ifname: str) -> str:
        out = self.ip("-j", "link", "show", "dev", ifname).stdout
        return json.loads(out)[0].get("operstate", "")

    def pids(self) -> list[int]:
        if not self.exists():
            return []
        cp = run(["ip", "netns", "pids", self.name], check=False)
        return [int(p) for p in cp.stdout.split()]

    def socket(self, family: int, type: int, proto: int = 0) -> socket.socket:
        """A socket created inside this namespace (it stays there for its whole life)."""
        s = call_in_netns(self.path, socket.socket, family, type, proto)
        self._sockets.add(s)
        return s

    def close_sockets(self):
        for s in list(self._sockets):
            try:
                s.close()
            except OSError:
                pass

    def delete(self):
        if self.exists():
            run(["ip", "netns", "del", self.name], check=False)

    # clients
    def tcp_connect(self, addr: str, port: int, timeout: float = 2.0, payload: bytes | None = None) -> Outcome:
        """Connects, sends payload (a random line by default) and waits for its echo."""
        payload = payload or _token()
        t0 = time.monotonic()
        with self.socket(family_of(addr), socket.SOCK_STREAM) as s:
            try:
                s.settimeout(timeout)
                try:
                    s.connect((addr, port))
                except TimeoutError as e:
                    if e.errno is not None:
                        raise
                    return Outcome("timeout", "no answer to the SYN", time.monotonic() - t0)
                s.sendall(payload)
                return _recv_exact_echo(s, payload, t0, t0 + timeout)
            except OSError as e:
                return _classify(e, t0)

    def udp_exchange(self, addr: str, port: int, payload: bytes | None = None, timeout: float = 2.0) -> Outcome:
        """One datagram on a fresh connected socket, waiting for its echo."""
        s = self.socket(family_of(addr), socket.SOCK_DGRAM)
        t0 = time.monotonic()
        try:
            s.connect((addr, port))
        except OSError as e:
            s.close()
            return _classify(e, t0)
        flow = UdpFlow(s, addr, port)
        try:
            return flow.exchange(payload, timeout)
        finally:
            s.close()

    def udp_verdict(self, addr: str, port: int, timeout: float = 2.0) -> Outcome:
        """udp_exchange right after a switch: how the kernel now answers a new socket.

        The flow reaper runs after a switch returns and aborts sockets connected to
        destinations the new phase denies, a probe's included when it was made before the
        reaper listed sockets: its send fails (EDESTADDRREQ, "reset"), or the abort lands
        between the send's EPERM and the ICMP error the rejecting rule queued, which the
        disconnected socket no longer matches (EPERM, no ICMP). Those are retried on a new
        socket; a phase that drops instead of rejecting gives EPERM without ICMP on every try.
        Bounded: the reaper runs once per switch."""
        for _ in range(3):
            out = self.udp_exchange(addr, port, timeout=timeout)
            if out != "reset" and not (out == "unreachable" and out.icmp is None):
                break
        return out

    def tcp_flow(self, addr: str, port: int = ECHO_PORT, timeout: float = 2.0) -> TcpFlow:
        """An open, verified TCP connection to an echo server; LabError if it cannot be made."""
        s = self.socket(family_of(addr), socket.SOCK_STREAM)
        t0 = time.monotonic()
        try:
            s.settimeout(timeout)
            s.connect((addr, port))
        except OSError as e:
            s.close()
            raise LabError(f"tcp flow to [{addr}]:{port} from {self.name}: {_classify(e, t0)!r}") from None
        flow = TcpFlow(s, addr, port)
        first = flow.exchange(timeout=timeout)
        if first != "ok":
            flow.close()
            raise LabError(f"tcp flow to [{addr}]:{port} from {self.name}: first echo {first!r}")
        return flow

    def udp_flow(self, addr: str, port: int = ECHO_PORT, timeout: float = 2.0) -> UdpFlow:
        """An open, verified connected UDP socket to an echo server; LabError if no echo."""
        s = self.socket(family_of(addr), socket.SOCK_DGRAM)
        s.connect((addr, port))
        flow = UdpFlow(s, addr, port)
        first = flow.exchange(timeout=timeout)
        if first != "ok":
            flow.close()
            raise LabError(f"udp flow to [{addr}]:{port} from {self.name}: first echo {first!r}")
        return flow

    def ping(self, addr: str, timeout: float = 2.0) -> Outcome:
        """One ICMP/ICMPv6 echo over a raw socket. 'ok' on the matching reply; 'unreachable'
        with .icmp=(type, code) when an ICMP error quoting our request comes back (detail
        names admin-prohibited); 'unreachable' with EPERM when the send is dropped locally."""
        v6 = ":" in addr
        ident, seq = random.randrange(1, 0xFFFF), random.randrange(1, 0xFFFF)
        body = os.urandom(16)
        if v6:
            s = self.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
            packet = struct.pack("!BBHHH", 128, 0, 0, ident, seq) + body  # kernel fills the checksum
        else:
            s = self.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
            head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            packet = struct.pack("!BBHHH", 8, 0, _inet_checksum(head + body), ident, seq) + body
        t0 = time.monotonic()
        deadline = t0 + timeout
        local_error = None
        with s:
            try:
                s.sendto(packet, (addr, 0))
            except OSError as e:
                # A rejecting output rule fails the send (EPERM) and sends its ICMP error
                # right after; keep listening briefly to tell reject from drop.
                local_error = _classify(e, t0)
                deadline = min(deadline, time.monotonic() + _ICMP_ERROR_WAIT)
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    s.settimeout(remaining)
                    data, src = s.recvfrom(65536)
                    verdict = _match_icmp(data, src[0], addr, v6, ident, seq)
                    if verdict is not None:
                        kind, detail, icmp = verdict
                        if local_error is not None:
                            detail = f"{local_error.detail}; {detail}"
                        return Outcome(kind, detail, time.monotonic() - t0, icmp)
            except TimeoutError:
                pass
            except OSError as e:
                return _classify(e, t0)
            if local_error is not None:
                return Outcome(local_error, f"{local_error.detail} (no ICMP error)", local_error.elapsed)
            return Outcome("timeout", "no echo reply", time.monotonic() - t0)

    def dns_query(self, name: str, qtype: str = "A", server: str = DNS_V4, port: int = 53, tcp: bool = False,
                  timeout: float = 2.0) -> DnsReply:
        """One DNS query from inside the namespace (RD set), on a socket of its own; see DnsReply."""
        t0 = time.monotonic()
        s = self.socket(family_of(server), socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM)
        with s:
            try:
                s.settimeout(timeout)
                s.connect((server, port))
            except OSError as e:
                return DnsReply(_classify(e, t0))
            return dns_exchange(s, name, qtype, tcp=tcp, timeout=timeout - (time.monotonic() - t0))


def dns_exchange(s: socket.socket, name: str, qtype: str = "A", *, tcp: bool = False,
                 timeout: float = 2.0) -> DnsReply:
    """One DNS query (RD set) on `s`, a socket already connected to a DNS server (TCP: with
    the length prefix), and its reply; see DnsReply. A socket may carry many queries."""
    qid = random.randrange(0, 0x10000)
    query = dns_build_query(name, qtype, qid)
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        if tcp:
            s.settimeout(max(timeout, 0.001))
            s.sendall(struct.pack("!H", len(query)) + query)
            n = struct.unpack("!H", _recv_n(s, 2, deadline))[0]
            msg = _recv_n(s, n, deadline)
        else:
            s.send(query)
            while True:
                s.settimeout(max(deadline - time.monotonic(), 0.001))
                msg = s.recv(65536)
                if len(msg) >= 2 and struct.unpack_from("!H", msg)[0] == qid:
                    break
    except OSError as e:
        return DnsReply(_classify(e, t0))
    except EOFError:
        return DnsReply(Outcome("reset", "EOF", time.monotonic() - t0))
    rid, rcode, records = dns_parse_reply(msg)
    if rid != qid:
        raise LabError(f"DNS reply id {rid} for query id {qid}")
    return DnsReply(Outcome("ok", "", time.monotonic() - t0), rcode, records)


def _recv_n(s: socket.socket, n: int, deadline: float) -> bytes:
    buf = b""
    while len(buf) < n:
        s.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _inet_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


_ICMP4_UNREACH = {0: "net-unreachable", 1: "host-unreachable", 3: "port-unreachable", 9: "net-prohibited",
                  10: "host-prohibited", 13: "admin-prohibited"}
_ICMP6_UNREACH = {0: "no-route", 1: "admin-prohibited", 3: "addr-unreachable", 4: "port-unreachable",
                  5: "policy-fail", 6: "reject-route"}


def _match_icmp(data: bytes, src: str, dst: str, v6: bool, ident: int, seq: int):
    """(outcome, detail, (type, code)) if `data` answers our echo request, else None."""
    if not v6:
        data = data[(data[0] & 0x0F) * 4:]  # raw IPv4 sockets deliver the IP header too
    if len(data) < 8:
        return None
    typ, code = data[0], data[1]
    reply, request, errors = (129, 128, (1, 2, 3, 4)) if v6 else (0, 8, (3, 11, 12))
    if typ == reply:
        rid, rseq = struct.unpack_from("!HH", data, 4)
        if (rid, rseq) == (ident, seq) and same_addr(src, dst):
            return "ok", "", (typ, code)
        return None
    if typ not in errors:
        return None
    inner = data[8:]
    if v6:
        if len(inner) < 48 or inner[6] != 58:
            return None
        inner_dst = socket.inet_ntop(socket.AF_INET6, inner[24:40])
        quoted = inner[40:]
    else:
        if len(inner) < 20 or inner[9] != 1:
            return None
        inner_dst = socket.inet_ntop(socket.AF_INET, inner[16:20])
        quoted = inner[(inner[0] & 0x0F) * 4:]
    if len(quoted) < 8 or quoted[0] != request or struct.unpack_from("!HH", quoted, 4) != (ident, seq):
        return None
    if not same_addr(inner_dst, dst):
        return None
    return "unreachable", _icmp_text((typ, code), v6), (typ, code)


def _icmp_text(icmp: tuple, v6: bool) -> str:
    typ, code = icmp
    names = _ICMP6_UNREACH if v6 else _ICMP4_UNREACH
    text = f"icmp{'v6' if v6 else ''} type {typ} code {code}"
    if typ == (1 if v6 else 3) and code in names:
        text += f" ({names[code]})"
    return text


# --- processes -----------------------------------------------------------------------------


def _stop_process(p: subprocess.Popen, sig=signal.SIGTERM, grace: float = 3.0):
    if p.poll() is not None:
        return
    try:
        p.send_signal(sig)
        p.wait(grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)
    except ProcessLookupError:
        pass


def _read_line(p: subprocess.Popen, timeout: float, what: str) -> str:
    """The next line of p's stdout within timeout; LabError (with what it said) otherwise.
    Bytes after the line are kept for the next call."""
    deadline = time.monotonic() + timeout
    fd = p.stdout.fileno()
    buf = getattr(p, "_lab_pending", b"")
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LabError(f"{what}: no line on stdout within {timeout:g}s (got {buf!r})")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                err = p.stderr.read().decode(errors="replace") if p.stderr else ""
                raise LabError(f"{what}: exited {p.wait(5)} before it was ready: {err.strip()}")
            buf += chunk
    line, p._lab_pending = buf.split(b"\n", 1)
    return line.decode()


# --- dnsmasq -------------------------------------------------------------------------------


@dataclasses.dataclass
class DnsQuery:
    type: str
    name: str
    source: str


class Dnsmasq:
    """dnsmasq in the internet namespace on 192.0.2.1 and 2001:db8:1::1 port 53, no upstream.

    hosts:     {name: [addresses]}        (--host-record; A and/or AAAA)
    cnames:    {alias: target}            (--cname)
    txt:       {name: text}               (--txt-record)
    wildcards: {domain: [addresses]}      (--address=/domain/addr: the domain and all below it)
    ttl:       TTL of all local answers   (--local-ttl; dnsmasq's own default is 0)
    auth_ttl:  --auth-ttl, if given
    Names it has no data for get REFUSED (it has no upstream).
    """

    PROBE_SUFFIX = ".lab-probe.invalid"

    def __init__(self, lab: "Lab", hosts=None, cnames=None, txt=None, wildcards=None, ttl: int = 60,
                 auth_ttl: int | None = None, extra_args=()):
        self.lab = lab
        self.hosts = DEFAULT_HOSTS if hosts is None else hosts
        self.cnames = DEFAULT_CNAMES if cnames is None else cnames
        self.txt = DEFAULT_TXT if txt is None else txt
        self.wildcards = DEFAULT_WILDCARDS if wildcards is None else wildcards
        self.ttl, self.auth_ttl, self.extra_args = ttl, auth_ttl, list(extra_args)
        self.log_path = lab.tmp / f"dnsmasq-{next(_counter)}.log"
        self.proc: subprocess.Popen | None = None
        self._probes = itertools.count(1)

    def argv(self) -> list[str]:
        a = ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
             "--no-poll", "--bind-interfaces", f"--listen-address={DNS_V4}", f"--listen-address={DNS_V6}",
             "--except-interface=lo", "--port=53", "--cache-size=0", "--log-queries",
             f"--log-facility={self.log_path}", "--pid-file=", "--user=root", "--group=root",
             f"--local-ttl={self.ttl}"]
        if self.auth_ttl is not None:
            a.append(f"--auth-ttl={self.auth_ttl}")
        for name, addrs in self.hosts.items():
            a.append(f"--host-record={name}," + ",".join(addrs))
        for alias, target in self.cnames.items():
            a.append(f"--cname={alias},{target}")
        for name, text in self.txt.items():
            a.append(f"--txt-record={name},{text}")
        for domain, addrs in self.wildcards.items():
            a.extend(f"--address=/{domain}/{addr}" for addr in addrs)
        return a + self.extra_args

    def start(self, timeout: float = 5.0):
        self.proc = self.lab.spawn(self.argv(), netns=self.lab.internet, stdout=subprocess.DEVNULL,
                                   stderr=open(self.lab.tmp / "dnsmasq.stderr", "ab"))
        try:
            self.sync(timeout)
        except LabError as e:
            raise LabError(f"dnsmasq did not come up: {e}; stderr: "
                           f"{(self.lab.tmp / 'dnsmasq.stderr').read_text(errors='replace').strip()}") from None

    def stop(self):
        if self.proc:
            _stop_process(self.proc)

    def restart(self, **changes):
        """Stops dnsmasq and starts it again, with any constructor argument changed."""
        self.stop()
        for k, v in changes.items():
            if not hasattr(self, k):
                raise TypeError(k)
            setattr(self, k, v)
        self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def queries(self) -> list[DnsQuery]:
        """Every query dnsmasq logged, oldest first (the lab's own probes left out)."""
        out = []
        for m in re.finditer(r"\bquery\[(\w+)\] (\S+) from (\S+)$", self.log(), re.M):
            if not m.group(2).lower().endswith(self.PROBE_SUFFIX):
                out.append(DnsQuery(m.group(1), m.group(2), m.group(3)))
        return out

    def query_names(self) -> list[str]:
        """Names of the queries dnsmasq received (as sent, case kept)."""
        return [q.name for q in self.queries()]

    def sync(self, timeout: float = 5.0):
        """Returns once dnsmasq answers and has logged every query it received before now:
        a probe query from the internet side must be answered and show up in the log. Use it
        before asserting that some name was NOT queried."""
        name = f"p{next(self._probes)}{self.PROBE_SUFFIX}"

        def answered():
            if self.proc.poll() is not None:
                raise LabError(f"dnsmasq exited with {self.proc.returncode}")
            return self.lab.internet.dns_query(name, server=DNS_V4, timeout=0.2).outcome == "ok"

        wait_for(answered, timeout, "dnsmasq to answer")
        wait_for(lambda: name in self.log(), timeout, f"dnsmasq to log {name}")


# --- egressd -------------------------------------------------------------------------------


class Egressd:
    """One egressd daemon for a lab's sandbox, plus its clients (egressctl and the raw socket).

    argv: $EGRESSD run --socket <tmp>/<name>.sock --config FILE [--phase P] --netns
          /run/netns/<sandbox> --ready-file <tmp>/<name>.ready [extra...]
    stdout and stderr go to <tmp>/<name>.log (kept across restarts) for failure messages.
    """

    def __init__(self, lab: "Lab", config: Path, *, phase: str | None = None, extra=(), name: str = "egressd",
                 binary: list[str] | None = None, netns_pid: int | None = None):
        self.lab, self.config, self.phase, self.extra, self.name = lab, Path(config), phase, list(extra), name
        # --netns-pid PID instead of --netns: the sandbox is that process's namespace.
        self.netns_pid = netns_pid
        # argv prefix that stands for `egressd` (tests of the lab itself substitute a fake).
        self.binary = list(binary) if binary else [str(egressd_binary())]
        self.socket_path = lab.tmp / f"{name}.sock"
        self.ready_path = lab.tmp / f"{name}.ready"
        self.log_path = lab.tmp / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        a = [*self.binary, "run", "--socket", str(self.socket_path), "--config", str(self.config)]
        if self.phase:
            a += ["--phase", self.phase]
        a += ["--netns-pid", str(self.netns_pid)] if self.netns_pid else ["--netns", self.lab.sandbox.path]
        a += ["--ready-file", str(self.ready_path)]
        return a + self.extra

    def start(self, timeout: float = 5.0) -> "Egressd":
        """Starts the daemon and waits for its ready file; LabError (with its log) otherwise."""
        if self.running:
            raise LabError(f"{self.name} already running")
        self.ready_path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {shlex.join(self.argv())}\n".encode())
            log.flush()
            self.proc = self.lab.spawn(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def ready():
            if self.ready_path.exists():
                return True
            if self.proc.poll() is not None:
                raise LabError(f"{self.name} exited with {self.proc.returncode} before ready")
            return False

        try:
            wait_for(ready, timeout, f"{self.name} ready file {self.ready_path}")
        except LabError as e:
            if self.proc.poll() is None:
                _stop_process(self.proc, signal.SIGKILL)
            raise LabError(f"{e}\n--- {self.name} log:\n{self.log()}") from None
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, sig=signal.SIGKILL):
        """Sends sig (SIGKILL by default) without waiting."""
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 5.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise LabError(f"{self.name} still running {timeout:g}s later") from None

    def stop(self, sig=signal.SIGTERM, timeout: float = 5.0) -> int:
        """Sends sig and waits for the exit; returns the exit status (-N for signal N)."""
        if not self.running:
            return self.proc.returncode if self.proc else 0
        self.kill(sig)
        return self.wait(timeout)

    def restart(self, timeout: float = 5.0, **changes) -> "Egressd":
        """SIGTERM (if running) and start again; phase=, extra=, config= may be changed."""
        if self.running:
            self.stop()
        for k, v in changes.items():
            setattr(self, k, Path(v) if k == "config" else v)
        return self.start(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def ctl(self, *args, timeout: float = 10.0) -> tuple[int, str, str]:
        """egressctl --socket <sock> ARGS...: (exit code, stdout, stderr)."""
        cp = run([str(egressctl_binary()), "--socket", str(self.socket_path), *args], timeout=timeout, check=False)
        return cp.returncode, cp.stdout, cp.stderr

    def ctl_json(self, *args, timeout: float = 10.0):
        """Runs egressctl, requires exit 0 and returns its stdout parsed as JSON."""
        rc, out, err = self.ctl(*args, timeout=timeout)
        if rc != 0:
            raise LabError(f"egressctl {shlex.join(args)} exited {rc}: {err.strip()}")
        try:
            return json.loads(out)
        except json.JSONDecodeError as e:
            raise LabError(f"egressctl {shlex.join(args)}: stdout is not JSON ({e}): {out!r}") from None

    def connect(self, timeout: float = 5.0) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(str(self.socket_path))
        return s

    def request(self, obj, timeout: float = 5.0) -> dict:
        """Sends one request line (obj: a dict, or str/bytes sent as is) and returns the reply."""
        return unix_request(self.socket_path, obj, timeout, self.name)

    def request_raw(self, data: bytes, timeout: float = 5.0) -> dict:
        """Writes data (any bytes) on a new connection and returns the first reply line parsed."""
        return unix_request(self.socket_path, data, timeout, self.name, raw=True)

    def status(self) -> dict:
        """{"cmd":"status"} over the socket; LabError unless ok."""
        reply = self.request({"cmd": "status"})
        if reply.get("ok") is not True:
            raise LabError(f"status failed: {reply}")
        return reply


def unix_request(path, obj, timeout: float = 5.0, name: str = "egressd", raw: bool = False) -> dict:
    """One request on a control socket (egressd's, or the agent's): obj is a dict, or str/bytes
    sent as is (a newline added unless raw); returns the first reply line parsed. The write runs
    on its own thread, so a daemon that answers and hangs up in the middle of a huge request is
    still read."""
    if isinstance(obj, dict):
        data = json.dumps(obj).encode()
    else:
        data = obj.encode() if isinstance(obj, str) else obj
    if not raw and not data.endswith(b"\n"):
        data += b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        writer = threading.Thread(target=_send_ignoring_close, args=(s, data), daemon=True)
        writer.start()
        buf = b""
        deadline = time.monotonic() + timeout
        try:
            while b"\n" not in buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LabError(f"no reply from {name} within {timeout:g}s (got {buf[:200]!r})")
                s.settimeout(remaining)
                chunk = s.recv(65536)
                if not chunk:
                    raise LabError(f"{name} closed the connection without a reply line (got {buf[:200]!r})")
                buf += chunk
        except ConnectionResetError:
            raise LabError(f"{name} reset the connection without a reply line (got {buf[:200]!r})") from None
        finally:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            writer.join(timeout)
    line = buf.split(b"\n", 1)[0]
    try:
        reply = json.loads(line)
    except json.JSONDecodeError as e:
        raise LabError(f"reply is not JSON ({e}): {line[:200]!r}") from None
    if not isinstance(reply, dict):
        raise LabError(f"reply is not a JSON object: {line[:200]!r}")
    return reply


def _send_ignoring_close(s: socket.socket, data: bytes):
    try:
        s.sendall(data)
    except OSError:
        pass  # the daemon may legitimately hang up on a bad request


# --- egressd agent in a container (tests/container, tests/docker) ---------------------------

# What `egressd agent` needs in a container: setns SYS_ADMIN, opening another process's
# /proc/PID/ns/net SYS_PTRACE, nftables and sock_diag NET_ADMIN, each sandbox's DNS proxy on
# port 53 NET_BIND_SERVICE, one socket hearing every sandbox's nftables changes NET_BROADCAST
# (without it: a socket in each sandbox). The DaemonSet grants the same
# (tests/container/test_kube.py).
AGENT_CAPS = ("NET_ADMIN", "NET_BIND_SERVICE", "NET_BROADCAST", "SYS_ADMIN", "SYS_PTRACE")


def agent_policy(upstream: str) -> str:
    """The container agent tests' policy file: setup public, agent allows a.example.com,
    verifier no-network; the agent asks `upstream` from its own namespace."""
    return f"""\
initial_phase: agent
dns: {{ upstream: ["{upstream}"] }}
phases:
  setup: public
  agent: {{ network_mode: allowlist, allowed_hosts: ["a.example.com"] }}
  verifier: {{ network_mode: no-network }}
"""


# --- the lab -------------------------------------------------------------------------------

_counter = itertools.count(1)
_live_labs: "weakref.WeakSet[Lab]" = weakref.WeakSet()


class Lab:
    """A sandbox and an internet namespace with servers. start() builds it, close() removes
    everything it made (idempotent, also after a failed start). Usable as a context manager."""

    def __init__(self, tmpdir: str | Path | None = None, *, dns: bool = True, dns_options: dict | None = None):
        n = next(_counter)
        self.tag = f"{PREFIX}{os.getpid()}-{n}"
        self.sandbox = Netns(f"{self.tag}-sb")
        self.internet = Netns(f"{self.tag}-in")
        self._own_tmp = tmpdir is None
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.tag}-")) if tmpdir is None else Path(tmpdir)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._want_dns, self._dns_options = dns, dns_options or {}
        self.dns: Dnsmasq | None = None
        self.daemons: list[Egressd] = []
        self._procs: list[subprocess.Popen] = []
        self._netns: list[Netns] = []
        self._extra = itertools.count(1)
        self._closed = False

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # building
    def start(self) -> "Lab":
        _live_labs.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _new_netns(self, ns: Netns):
        self._netns.append(ns)  # registered first: close() removes it even if setup fails next
        ns.create()
        # No duplicate address detection: addresses are usable the moment they are added.
        ns.sysctl("net.ipv6.conf.all.accept_dad", 0)
        ns.sysctl("net.ipv6.conf.default.accept_dad", 0)
        ns.ip("link", "set", "lo", "up")

    def _build(self):
        sb, inet = self.sandbox, self.internet
        self._new_netns(sb)
        self._new_netns(inet)
        # Both ends are created directly in their namespaces; none ever exists in the host's.
        sb.ip("link", "add", SANDBOX_IF, "type", "veth", "peer", "name", INTERNET_IF, "netns", inet.name)
        sb.ip_batch([f"addr add {SANDBOX_V4}/24 dev {SANDBOX_IF}",
                     f"addr add {SANDBOX_V6}/64 dev {SANDBOX_IF} nodad",
                     f"link set {SANDBOX_IF} up"])
        inet.ip_batch([f"addr add {GATEWAY_V4}/24 dev {INTERNET_IF}",
                       f"addr add {GATEWAY_V6}/64 dev {INTERNET_IF} nodad",
                       *(f"addr add {a}/32 dev lo" for a in SERVERS_V4),
                       *(f"addr add {a}/128 dev lo nodad" for a in SERVERS_V6),
                       f"link set {INTERNET_IF} up"])
        # Until the link watcher has run, a veth has no qdisc and drops what it is given.
        wait_for(lambda: sb.operstate(SANDBOX_IF) == "UP" and inet.operstate(INTERNET_IF) == "UP", 5.0,
                 "the veth pair to come up")
        sb.ip_batch([f"route add default via {GATEWAY_V4}", f"route add ::/0 via {GATEWAY_V6}"])

        self.servers = self._start_servers(inet, TCP_PORTS, UDP_PORTS, SERVERS)
        self.loopback_servers = self._start_servers(sb, (ECHO_PORT,), (ECHO_PORT,),
                                                    LOOPBACK + (SANDBOX_V4, SANDBOX_V6))
        if self._want_dns:
            self.dns = Dnsmasq(self, **self._dns_options)
            self.dns.start()
        # End to end once per family: routes, neighbour discovery and servers all work.
        for addr in (SERVERS_V4[0], SERVERS_V6[0]):
            wait_for(lambda: sb.tcp_connect(addr, ECHO_PORT, timeout=0.5) == "ok", 5.0,
                     f"the sandbox to reach [{addr}]:{ECHO_PORT}")

    def _start_servers(self, ns: Netns, tcp, udp, addrs) -> subprocess.Popen:
        p = self.spawn([sys.executable, str(HERE / "labserver.py"), "--tcp", ",".join(map(str, tcp)),
                        "--udp", ",".join(map(str, udp)), *addrs],
                       netns=ns, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = _read_line(p, 10.0, f"echo servers in {ns.name}")
        if line != "READY":
            raise LabError(f"echo servers in {ns.name} said {line!r}")
        return p

    def add_servers(self, addrs, tcp=(ECHO_PORT,), udp=()) -> subprocess.Popen:
        """More server addresses on the internet namespace's lo (beyond SERVERS), with echo
        servers on them, ready when this returns; close() stops them with the rest. For tests
        that need many distinct reachable addresses (documentation ranges only)."""
        addrs = list(addrs)
        self.internet.ip_batch([f"addr add {a}/128 dev lo nodad" if ":" in a else f"addr add {a}/32 dev lo"
                                for a in addrs])
        return self._start_servers(self.internet, tcp, udp, addrs)

    def spawn(self, args, *, netns: Netns | None = None, stdin=subprocess.DEVNULL, stdout=None,
              stderr=None) -> subprocess.Popen:
        """Starts a process (in netns if given) that close() will kill. It gets SIGKILL if the
        thread that spawned it dies (pdeathsig), so spawn from the main thread."""
        argv = ["setpriv", "--pdeathsig", "KILL", "--"]
        if netns is not None:
            argv += ["ip", "netns", "exec", netns.name]
        argv += [str(a) for a in args]
        p = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True)
        self._procs.append(p)
        return p

    def spawn_decoy_container(self, ns: Netns) -> subprocess.Popen:
        """A container's init that moved itself out before it is attached (docs/security.md,
        "Attaching a namespace"): as uid 65534 with no capability it leaves a worker (`sleep 122`)
        in `ns`, the namespace its runtime made, and execs into a user and network namespace of
        its own (`unshare -Urn sleep 123`), keeping its pid. Returns once it has moved, with the
        worker's pid as `.worker`; skips
        the test when unprivileged user namespaces are not allowed here."""
        probe = run([*NOBODY, "unshare", "-Urn", "true"], check=False)
        if probe.returncode != 0:
            import pytest  # here only: the lab runs without pytest too
            pytest.skip("unprivileged user namespaces are not allowed here: " + probe.stderr.strip())
        real = os.stat(ns.path).st_ino
        p = self.spawn([*NOBODY, "sh", "-c", "sleep 122 & exec unshare -Urn sleep 123"], netns=ns)

        def moved():
            try:
                return Path(f"/proc/{p.pid}/cmdline").read_bytes() == b"sleep\x00123\x00" and \
                    os.stat(f"/proc/{p.pid}/ns/net").st_ino != real
            except OSError:
                return False
        wait_for(moved, 5.0, "the container's init to move itself into a namespace of its own")

        def worker():
            for pid in ns.pids():
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00122\x00":
                        return pid
                except OSError:
                    pass
            return None
        p.worker = wait_for(worker, 5.0, "the worker to run in the container's namespace")
        return p

    def extra_netns(self, tag: str = "x") -> Netns:
        """A further empty namespace (lo up) that close() removes with the others."""
        ns = Netns(f"{self.tag}-{tag}{next(self._extra)}")
        self._new_netns(ns)
        return ns

    def write_config(self, text: str, name: str = "policy.yaml") -> Path:
        path = self.tmp / name
        path.write_text(text)
        return path

    def egressd(self, config: str | Path, *, phase: str | None = None, extra=(), start: bool = True,
                name: str | None = None, timeout: float = 5.0, binary: list[str] | None = None,
                netns_pid: int | None = None) -> Egressd:
        """An Egressd for this lab's sandbox; config is a path or the policy text itself. With
        netns_pid, egressd joins the sandbox through that process (--netns-pid)."""
        if not isinstance(config, Path):
            config = self.write_config(config, f"policy-{len(self.daemons) + 1}.yaml")
        d = Egressd(self, config, phase=phase, extra=extra, name=name or f"egressd{len(self.daemons) or ''}",
                    binary=binary, netns_pid=netns_pid)
        self.daemons.append(d)
        return d.start(timeout) if start else d

    def nft(self, ns: Netns | str, *args, input: str | None = None, check: bool = False, timeout: float = 10.0):
        """The nft CLI inside a namespace: (exit code, stdout, stderr). A single string argument
        is split like a shell would; input goes to stdin (use `-f -`)."""
        if len(args) == 1 and " " in args[0]:
            args = tuple(shlex.split(args[0]))
        name = ns.name if isinstance(ns, Netns) else ns
        cp = run(["ip", "netns", "exec", name, "nft", *args], check=check, input=input, timeout=timeout)
        return cp.returncode, cp.stdout, cp.stderr

    def learned_set(self, family: int = 4, chain: str = "ph_agent") -> dict:
        """address -> {"timeout": s, "expires": s} of a phase's learned-address set in the sandbox
        (nft shows whole seconds, rounded down)."""
        rc, out, err = self.nft(self.sandbox, "-j", "list", "set", "inet", "egressd", f"{chain}_d{family}")
        assert rc == 0, err
        for obj in json.loads(out)["nftables"]:
            if "set" in obj:
                elems = {}
                for e in obj["set"].get("elem", []):
                    if isinstance(e, dict) and "elem" in e:
                        elems[e["elem"]["val"]] = e["elem"]
                    else:
                        elems[str(e)] = {}
                return elems
        raise AssertionError(f"no set {chain}_d{family} in {out}")

    # clients in the sandbox (shortcuts)
    def tcp_connect(self, *a, **kw) -> Outcome:
        return self.sandbox.tcp_connect(*a, **kw)

    def udp_exchange(self, *a, **kw) -> Outcome:
        return self.sandbox.udp_exchange(*a, **kw)

    def udp_verdict(self, *a, **kw) -> Outcome:
        return self.sandbox.udp_verdict(*a, **kw)

    def ping(self, *a, **kw) -> Outcome:
        return self.sandbox.ping(*a, **kw)

    def tcp_flow(self, *a, **kw) -> TcpFlow:
        return self.sandbox.tcp_flow(*a, **kw)

    def udp_flow(self, *a, **kw) -> UdpFlow:
        return self.sandbox.udp_flow(*a, **kw)

    def dns_query(self, *a, **kw) -> DnsReply:
        return self.sandbox.dns_query(*a, **kw)

    def logs(self) -> str:
        """Everything worth reading after a failure: daemon logs and the DNS query log."""
        parts = []
        for d in self.daemons:
            parts.append(f"--- {d.log_path}\n{d.log()}")
        if self.dns:
            parts.append(f"--- {self.dns.log_path} (queries)\n" +
                         "\n".join(f"{q.type} {q.name} from {q.source}" for q in self.dns.queries()))
        return "\n".join(parts)

    # teardown
    def close(self):
        """Kills every process, closes every socket and deletes every namespace it made.
        Idempotent; raises LabError at the end if something could not be removed."""
        if self._closed:
            return
        self._closed = True
        problems = []
        for p in reversed(self._procs):
            try:
                if p.stdin:
                    p.stdin.close()
                _stop_process(p, signal.SIGKILL)
                for f in (p.stdout, p.stderr):
                    if f:
                        f.close()
            except Exception as e:  # keep going: the namespaces must go regardless
                problems.append(f"pid {p.pid}: {e}")
        for ns in self._netns:
            ns.close_sockets()
        for ns in self._netns:
            try:
                _kill_netns_processes(ns)
                ns.delete()
                if ns.exists():
                    problems.append(f"{ns.name} still exists")
            except Exception as e:
                problems.append(f"{ns.name}: {e}")
        _live_labs.discard(self)
        if self._own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if problems:
            raise LabError("lab cleanup: " + "; ".join(problems))


def _kill_netns_processes(ns: Netns, timeout: float = 5.0):
    pids = ns.pids()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if pids:
        wait_for(lambda: not ns.pids(), timeout, f"processes in {ns.name} to exit")


def cleanup_all():
    """Closes every lab of this process that is still open (atexit / signal path)."""
    for lab in list(_live_labs):
        try:
            lab.close()
        except Exception as e:
            print(f"lab cleanup: {e}", file=sys.stderr)


_handlers_installed = False


def install_cleanup_handlers():
    """atexit, SIGTERM and SIGHUP clean up every open lab. SIGINT stays Python's
    KeyboardInterrupt, which unwinds through fixture finalizers and then atexit."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(cleanup_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _on_fatal_signal)


def _on_fatal_signal(signum, _frame):
    cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Deletes <prefix><pid>-* namespaces whose creating process is gone (and kills what still
    runs inside them). Returns the names removed."""
    removed = []
    try:
        names = sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        return removed
    for name in names:
        m = re.match(re.escape(prefix) + r"(\d+)-", name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        ns = Netns(name)
        _kill_netns_processes(ns)
        ns.delete()
        removed.append(name)
    return removed


def missing_prerequisites() -> list[str]:
    """Why the lab cannot run here (empty when it can)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root (the lab creates network namespaces)")
    for tool, pkg in (("ip", "iproute2"), ("nft", "nftables"), ("dnsmasq", "dnsmasq-base"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            problems.append(f"{tool} not found (apt-get install {pkg}; scripts/setup does this)")
    if not os.path.isdir("/proc/sys/net/ipv6"):
        problems.append("kernel without IPv6")
    return problems


install_cleanup_handlers()


# --- by hand -------------------------------------------------------------------------------


def _main(argv):
    import argparse
    import faulthandler
    # SIGUSR1 prints every thread's stack to stderr: test_lab.py asks for it when `up` does
    # not end within its deadline after a signal, to say where it was.
    faulthandler.register(signal.SIGUSR1)
    ap = argparse.ArgumentParser(description="Build an egressd lab by hand, or sweep stale ones.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a lab, print its names, keep it until Enter or Ctrl-C")
    up.add_argument("--no-dns", action="store_true", help="do not start dnsmasq")
    sub.add_parser("sweep", help="remove egt-* namespaces whose process is gone")
    args = ap.parse_args(argv)
    if args.cmd == "sweep":
        for name in sweep_stale():
            print(f"removed {name}")
        return 0
    problems = missing_prerequisites()
    if problems:
        print("cannot build a lab: " + "; ".join(problems), file=sys.stderr)
        return 1
    with Lab(dns=not args.no_dns) as lab:
        print(f"sandbox   {lab.sandbox.name}   ({lab.sandbox.path})")
        print(f"internet  {lab.internet.name}")
        print(f"tmp       {lab.tmp}")
        print(f"servers   {' '.join(SERVERS)}  tcp {TCP_PORTS} udp {UDP_PORTS}")
        if lab.dns:
            print(f"dns       {DNS_V4} {DNS_V6} port 53, log {lab.dns.log_path}")
        print(f"try:      ip netns exec {lab.sandbox.name} ping -c1 {SERVERS_V4[0]}")
        print("press Enter (or Ctrl-C) to tear it down")
        try:
            # Waits in short selects, not one blocking read: a signal that comes just before the
            # read starts has its Python handler (cleanup, install_cleanup_handlers) run only
            # when the read returns, so `up` waited for Enter (CI run 9, SIGHUP, under load).
            while not select.select([sys.stdin], [], [], 0.2)[0]:
                pass
            sys.stdin.readline()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
