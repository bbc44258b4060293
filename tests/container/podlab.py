"""Podman helpers for tests/container: the egressd image under real Podman, offline.

One session has one `--internal` Podman network on a documentation subnet with two server
containers on it (the "internet"); tests start task and egressd containers on it and check
what a task can reach. Nothing routes off the machine: the network is internal (no gateway,
no NAT) and the host has no address on its bridge.

    network egt-ct-<pid>   203.0.113.128/26, --internal
      server A   203.0.113.140   busybox: tcp echo on 7 (nc -ll -e cat), httpd on 80 ("server-a")
      server B   203.0.113.141   the same ("server-b")
      dns        203.0.113.150   dnsmasq, no upstream: a.example.com -> A, b.example.com -> B,
                                 wild.example.org and every name below it -> B; logs queries
      task / egressd / sidecar containers of each test (resolv.conf: the dns container)

Traffic is checked from inside a container's network namespace with the lab's own clients
(tests/integration/lab.py: a thread setns()es into /proc/<pid>/ns/net), so outcomes carry
the same detail (refused = TCP reset, .prohibited, .elapsed); `Container.exec` shows the
same from a process inside the container when a test wants that view.

Every container, pod and network a session makes carries the label egressd-test=<pid>;
`cleanup()` removes them, also after a failure, and `sweep_stale()` removes those of sessions
whose process is gone. Images stay cached.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "integration"))

import lab as labmod  # noqa: E402  (the integration lab's clients and waits)
from lab import LabError, wait_for  # noqa: E402,F401

PREFIX = "egt-ct-"
LABEL = "egressd-test"
SUBNET = "203.0.113.128/26"
SERVER_A, SERVER_B = "203.0.113.140", "203.0.113.141"
SERVERS = {SERVER_A: "server-a", SERVER_B: "server-b"}
DNS_SERVER = "203.0.113.150"
# dnsmasq's data: exact names, and a domain with every name below it.
DNS_HOSTS = {"a.example.com": SERVER_A, "b.example.com": SERVER_B}
DNS_WILDCARDS = {"wild.example.org": SERVER_B}
ECHO_PORT, HTTP_PORT = 7, 80
IMAGE = os.environ.get("EGRESSD_IMAGE", "localhost/egressd:latest")
BUSYBOX_IMAGE = "localhost/egressd-busybox:latest"
DNSMASQ_IMAGE = "localhost/egressd-dnsmasq-test:latest"
# The egressd containers' capabilities: NET_ADMIN for nftables and sock_diag,
# NET_BIND_SERVICE for the DNS proxy on port 53.
EGRESSD_CAPS = ("NET_ADMIN", "NET_BIND_SERVICE")
HARBOR_READY = "/tmp/harbor-docker-egress-control-sidecar.ready"
MAX_IMAGE_BYTES = 10 * 1024 * 1024


def podman(*args, timeout: float = 60.0, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """Runs `podman ARGS...` with output captured as text; LabError on timeout or (check) failure."""
    return labmod.run(["podman", *args], timeout=timeout, check=check, input=input)


def missing_prerequisites() -> list[str]:
    """Why Podman containers cannot run here (empty when they can)."""
    problems = []
    if os.geteuid() != 0:
        return ["not root (these tests run rootful Podman)"]
    for tool, pkg in (("podman", "podman"), ("runc", "runc"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            problems.append(f"{tool} not found (apt-get install {pkg}; scripts/setup does this)")
    if not Path("/bin/busybox").exists():
        problems.append("/bin/busybox not found (apt-get install busybox-static; scripts/setup does this)")
    if problems:
        return problems
    cp = labmod.run([str(REPO_ROOT / "scripts/podman-setup"), "--check"], timeout=180, check=False)
    if cp.returncode != 0:
        problems.append((cp.stderr or cp.stdout).strip() + " (scripts/podman-setup installs the runc wrapper "
                        "this machine needs, if that is the problem)")
    return problems


class Container:
    """A container this session started (by name)."""

    def __init__(self, session: "Session", name: str, argv: list[str]):
        self.session, self.name, self.argv = session, name, argv

    def __repr__(self):
        return f"Container({self.name})"

    def inspect(self, fmt: str) -> str:
        return podman("inspect", "--format", fmt, self.name).stdout.strip()

    @property
    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"

    @property
    def pid(self) -> int:
        pid = int(self.inspect("{{.State.Pid}}"))
        if pid <= 0:
            raise LabError(f"{self.name} is not running")
        return pid

    @property
    def exit_code(self) -> int:
        return int(self.inspect("{{.State.ExitCode}}"))

    def netns(self) -> labmod.Netns:
        """The container's network namespace, for the lab's clients (tcp_connect, ping, ...).
        Bound to the current process of the container: take it again after a restart."""
        ns = labmod.Netns(f"{self.name}-netns")
        ns.path = f"/proc/{self.pid}/ns/net"
        return ns

    def exec(self, *args, timeout: float = 30.0, check: bool = False) -> subprocess.CompletedProcess:
        """`podman exec NAME ARGS...` (no shell involved)."""
        return podman("exec", self.name, *args, timeout=timeout, check=check)

    def logs(self) -> str:
        cp = podman("logs", self.name, check=False)
        return (cp.stdout + cp.stderr).strip()

    def kill(self, signal: str = "KILL"):
        podman("kill", "--signal", signal, self.name)

    def start(self):
        podman("start", self.name)

    def stop(self, timeout: int = 10):
        podman("stop", "--time", str(timeout), self.name, timeout=timeout + 30)

    def wait_exit(self, timeout: float = 10.0) -> int:
        wait_for(lambda: not self.running, timeout, f"{self.name} to exit")
        return self.exit_code

    def wait_running(self, timeout: float = 10.0):
        wait_for(lambda: self.running, timeout, f"{self.name} to run")

    def remove(self):
        podman("rm", "--force", "--depend", "--time", "0", self.name, check=False)


class Session:
    """One pytest session's network, servers and bookkeeping."""

    def __init__(self):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.label = f"{LABEL}={os.getpid()}"
        self.network = self.tag
        self._n = itertools.count(1)
        self.servers: dict[str, Container] = {}

    # lifecycle
    def start(self) -> "Session":
        # The lab's atexit and SIGTERM/SIGHUP handlers close everything in _live_labs: let them
        # remove this session's containers too if pytest is killed before its finalizers run.
        labmod._live_labs.add(self)
        try:
            podman("network", "create", "--internal", "--subnet", SUBNET, "--label", self.label, self.network)
            for addr, name in SERVERS.items():
                # httpd serves /www and detaches; nc -ll keeps echoing on 7 as PID 1.
                script = (f"echo {name} > /www/index.html && httpd -p {HTTP_PORT} -h /www && "
                          f"exec nc -ll -p {ECHO_PORT} -e /bin/cat")
                c = self.run(BUSYBOX_IMAGE, "sh", "-c", script, name=name, network=self.network,
                             caps=("NET_BIND_SERVICE",), extra=["--ip", addr])
                self.servers[addr] = c
            build_dnsmasq_image()
            args = ["--keep-in-foreground", "--user=root", "--group=root", "--pid-file=", "--no-resolv",
                    "--no-hosts", "--log-queries", "--log-facility=-", "--local-ttl=60"]
            args += [f"--host-record={n},{a}" for n, a in DNS_HOSTS.items()]
            args += [f"--address=/{n}/{a}" for n, a in DNS_WILDCARDS.items()]
            self.dns = self.run(DNSMASQ_IMAGE, *args, name="dns", network=self.network,
                                caps=("NET_BIND_SERVICE", "SETUID", "SETGID"), extra=["--ip", DNS_SERVER])
            for addr, c in self.servers.items():
                if not c.running:
                    raise LabError(f"server {c.name} exited {c.exit_code}: {c.logs()}")
                # Listening, seen from the server's own namespace (the host has no route to it).
                ns = c.netns()
                wait_for(lambda: ns.tcp_connect("127.0.0.1", ECHO_PORT, timeout=0.5) == "ok", 10.0,
                         f"{c.name} to echo on {ECHO_PORT}")
            dns_ns = self.dns.netns()
            wait_for(lambda: dns_ns.dns_query("a.example.com", server="127.0.0.1", timeout=0.5).rcode == "NOERROR",
                     10.0, "dnsmasq to answer")
        except BaseException:
            self.cleanup()
            raise
        return self

    def cleanup(self) -> list[str]:
        """Removes this session's pods, containers and network. Returns problems (empty if none)."""
        labmod._live_labs.discard(self)
        return remove_labelled(self.label)

    def close(self):
        """For the lab's exit handlers (see start)."""
        problems = self.cleanup()
        if problems:
            raise LabError("podman cleanup: " + "; ".join(problems))

    # containers
    def name(self, what: str) -> str:
        return f"{self.tag}-{what}-{next(self._n)}"

    def run(self, image: str, *cmd, name: str, network: str | None = None, caps: tuple = (),
            env: dict | None = None, volumes: tuple = (), entrypoint: str | None = None, extra=()) -> Container:
        """`podman run -d` with this session's label; `caps` are added after --cap-drop all
        when given. Returns once podman has started it."""
        full = self.name(name)
        argv = ["run", "--detach", "--name", full, "--label", self.label]
        if network:
            argv += ["--network", network]
        if caps:
            argv += ["--cap-drop", "all", *itertools.chain.from_iterable(("--cap-add", c) for c in caps)]
        for k, v in (env or {}).items():
            argv += ["--env", f"{k}={v}"]
        for v in volumes:
            argv += ["--volume", v]
        if entrypoint is not None:
            argv += ["--entrypoint", entrypoint]
        argv += [*extra, image, *cmd]
        podman(*argv)
        return Container(self, full, argv)

    def task(self, what: str = "task", network: str | None = None) -> Container:
        """A busybox task container that owns its network namespace on the session network,
        with the session's dnsmasq as its (and so egressd's) resolver."""
        return self.run(BUSYBOX_IMAGE, "sleep", "3600", name=what, network=network or self.network,
                        extra=["--cap-drop", "all", "--dns", DNS_SERVER])

    def dns_log(self) -> str:
        """The names dnsmasq was asked, as its log lines ("query[A] NAME from ADDR"), lower-cased:
        egressd sends every name upstream in random letter case (0x20), so a name is checked
        for (present or absent) case-insensitively."""
        return "\n".join(l for l in self.dns.logs().splitlines() if "query[" in l).lower()


def build_dnsmasq_image():
    """Debian's dnsmasq with its ldd closure, FROM scratch (cached once built)."""
    if podman("image", "exists", DNSMASQ_IMAGE, check=False).returncode == 0:
        return
    import tempfile
    with tempfile.TemporaryDirectory(prefix="egt-ct-dnsmasq-") as ctx:
        root = Path(ctx) / "rootfs"
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        files = [binary]
        for line in labmod.run(["ldd", binary]).stdout.splitlines():
            m = re.search(r"(?:=> )?(/\S+) \(0x", line)
            if m:
                files.append(m.group(1))
        for f in files:
            dest = root / f.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)  # follows symlinks
        (root / "etc").mkdir(exist_ok=True)
        (root / "etc/passwd").write_text("root:x:0:0:root:/:/nonexistent\n")
        (root / "etc/group").write_text("root:x:0:\n")
        (Path(ctx) / "Containerfile").write_text(
            f"FROM scratch\nCOPY rootfs/ /\nENTRYPOINT [\"{binary}\"]\n")
        podman("build", "--quiet", "--network", "none", "--tag", DNSMASQ_IMAGE, ctx, timeout=120)


def remove_labelled(label: str) -> list[str]:
    """Removes pods, containers and networks carrying `label`; returns what could not be removed."""
    problems = []
    pods = podman("pod", "ps", "--quiet", "--filter", f"label={label}", check=False).stdout.split()
    if pods:
        cp = podman("pod", "rm", "--force", "--time", "0", *pods, check=False, timeout=120)
        if cp.returncode != 0:
            problems.append(f"pod rm: {cp.stderr.strip()}")
    ids = podman("ps", "--all", "--quiet", "--filter", f"label={label}", check=False).stdout.split()
    if ids:
        # One at a time, with --depend: a container in another's namespace must go first, and
        # a single `podman rm` of several refuses the lot when one of them has a dependent.
        for cid in ids:
            podman("rm", "--force", "--depend", "--time", "0", cid, check=False, timeout=120)
        left = podman("ps", "--all", "--quiet", "--filter", f"label={label}", check=False).stdout.split()
        if left:
            problems.append(f"containers left: {' '.join(left)}")
    nets = podman("network", "ls", "--quiet", "--filter", f"label={label}", check=False).stdout.split()
    if nets:
        cp = podman("network", "rm", "--force", *nets, check=False, timeout=120)
        if cp.returncode != 0:
            problems.append(f"network rm: {cp.stderr.strip()}")
    return problems


def sweep_stale() -> list[str]:
    """Removes what sessions whose process is gone left behind (labels egressd-test=<pid>)."""
    seen = set()
    for kind in (["ps", "--all"], ["pod", "ps"], ["network", "ls"]):
        cp = podman(*kind, "--format", "{{.Labels}}", check=False)
        seen.update(re.findall(rf"{LABEL}:(\d+)", cp.stdout))
    removed = []
    for pid in sorted(seen):
        if int(pid) == os.getpid() or labmod._pid_alive(int(pid)):
            continue
        remove_labelled(f"{LABEL}={pid}")
        removed.append(pid)
    return removed


# --- clients -------------------------------------------------------------------------------


def echo(ns: labmod.Netns, addr: str, timeout: float = 1.0) -> labmod.Outcome:
    """TCP connect + echo to a server from inside `ns`: 'ok', or how it failed."""
    return ns.tcp_connect(addr, ECHO_PORT, timeout=timeout)


def reachable(ns: labmod.Netns) -> set[str]:
    """Which servers answer from inside `ns` (each denied one must fail fast, with a reset)."""
    got = set()
    for addr in SERVERS:
        out = echo(ns, addr)
        if out == "ok":
            got.add(addr)
        elif out != "refused" or out.elapsed > 0.5:
            raise AssertionError(f"{addr} from {ns.path}: {out!r} (a denied connection must be reset at once)")
    return got


def http_from(container: Container, addr: str) -> str:
    """What `nc` inside the container gets for GET / from a server ('' if it could not connect)."""
    cp = container.exec("sh", "-c", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {addr} {HTTP_PORT}")
    return cp.stdout if cp.returncode == 0 else ""


def egressctl(socket_path: Path | str, *args, timeout: float = 15.0) -> subprocess.CompletedProcess:
    """The host's egressctl against a bind-mounted socket."""
    return labmod.run([str(labmod.egressctl_binary()), "--socket", str(socket_path), *args], timeout=timeout,
                      check=False)


def request(socket_path: Path | str, obj: dict, timeout: float = 10.0) -> dict:
    """One JSON line to the socket and one back: what an orchestrator does."""
    import socket as socketmod
    with socketmod.socket(socketmod.AF_UNIX, socketmod.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(socket_path))
        s.sendall(json.dumps(obj).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise LabError(f"egressd closed the connection without a reply (got {buf!r})")
            buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])


def wait_path(path: Path, timeout: float = 10.0, what: str = "") -> None:
    wait_for(lambda: Path(path).exists(), timeout, what or f"{path} to appear")
