"""Docker helpers for tests/docker: the egressd image under Debian's docker.io, offline.

One session owns two `--internal` Docker networks on documentation subnets, and runs the
"internet" in the host namespace on their bridges (no route off the machine: internal
networks get DROP rules in FORWARD, and the only host addresses are the ones below):

    network egt-dk-<pid>-v4   198.51.100.0/24, containers from 198.51.100.128/25
      bridge br-<id[:12]>     198.51.100.1   gateway: dnsmasq (the containers' `dns:`)
                              198.51.100.10  server A: tcp echo 7, http 80, udp echo 7
                              198.51.100.11  server B: the same
    network egt-dk-<pid>-v6   --ipv6: 203.0.113.0/25 + 2001:db8:d0c::/64
      bridge                  203.0.113.1    gateway: dnsmasq
                              203.0.113.10 / 2001:db8:d0c::10   server A
                              203.0.113.11 / 2001:db8:d0c::11   server B

    dnsmasq (no upstream, logs every query; --local for the test domains):
      a.example.com -> 198.51.100.10    b.example.com -> 198.51.100.11
      wild.example.org and every name below it -> 198.51.100.11
      a.example.net -> 203.0.113.10, 2001:db8:d0c::10    b.example.net -> 203.0.113.11, 2001:db8:d0c::11

Every container gets `dns: [<gateway>]`, so Docker's embedded resolver forwards to dnsmasq
and never to the host's nameservers; `Guard` counts (nft, host namespace) and looks in
conntrack (host and task namespaces) for any packet towards them, and a test that caused
one fails.

Traffic is checked from inside a container's network namespace with the integration lab's
clients (tests/integration/lab.py: a thread setns()es into /proc/<pid>/ns/net), and from
processes inside the task container (`taskprobe.py`, run with the host's python3 through a
read-only bind mount of /usr) when the process's own view matters: its uid, its
capabilities, its /proc/net.

Everything a session creates carries its tag egt-dk-<pid> (containers, networks and
Compose projects by name, containers and networks also by the label egressd-test=<pid>, the
nft table by name); `cleanup()` removes it, also after a failure (fixture finalizers, and
the lab's atexit/SIGTERM handlers), and `sweep_stale()` removes what sessions whose process
is gone left behind. A dockerd the session had to start is stopped at the end; one that was
already running is left alone.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "integration"))

import lab as labmod  # noqa: E402  (the integration lab's clients and waits)
from lab import LabError, wait_for  # noqa: E402,F401

PREFIX = "egt-dk-"
LABEL = "egressd-test"
DOCKER = os.environ.get("DOCKER", "docker")
IMAGE = os.environ.get("EGRESSD_IMAGE", "localhost/egressd:latest")
TASK_IMAGE = "localhost/egressd-docker-task:latest"
HARBOR_READY = "/tmp/harbor-docker-egress-control-sidecar.ready"
HARBOR_SIDECAR = "harbor-docker-egress-control-sidecar"
ECHO_PORT, HTTP_PORT, SINK_PORT = 7, 80, 9
# A UDP echo port above 1024: what uid 65534 can still bind where the task container has
# net.ipv4.ip_unprivileged_port_start=1024 (container/compose.yaml sets it).
HIGH_ECHO_PORT = 7007
# Docker's embedded resolver, as every container on a user-defined network sees it.
DOCKER_DNS = "127.0.0.11"
TASK_MOUNT = "/egt"  # tests/docker inside task containers (taskprobe.py)
NOBODY = "65534:65534"


@dataclasses.dataclass(frozen=True)
class Plan:
    """One session network: its subnets and the host-side addresses on its bridge."""
    key: str
    subnet4: str
    gateway4: str
    range4: str
    server_a4: str
    server_b4: str
    subnet6: str | None = None
    gateway6: str | None = None
    range6: str | None = None
    server_a6: str | None = None
    server_b6: str | None = None

    @property
    def servers(self) -> dict[str, str]:
        """Server addresses -> server name (what their HTTP port answers)."""
        out = {self.server_a4: "server-a", self.server_b4: "server-b"}
        if self.server_a6:
            out.update({self.server_a6: "server-a", self.server_b6: "server-b"})
        return out


V4 = Plan("v4", "198.51.100.0/24", "198.51.100.1", "198.51.100.128/25", "198.51.100.10", "198.51.100.11")
V6 = Plan("v6", "203.0.113.0/25", "203.0.113.1", "203.0.113.64/26", "203.0.113.10", "203.0.113.11",
          "2001:db8:d0c::/64", "2001:db8:d0c::1", "2001:db8:d0c::8000:0/113", "2001:db8:d0c::10",
          "2001:db8:d0c::11")
PLANS = {p.key: p for p in (V4, V6)}
SERVER_A, SERVER_B = V4.server_a4, V4.server_b4
DNS_SERVER = V4.gateway4

DNS_HOSTS = {
    "a.example.com": [V4.server_a4],
    "b.example.com": [V4.server_b4],
    "a.example.net": [V6.server_a4, V6.server_a6],
    "b.example.net": [V6.server_b4, V6.server_b6],
}
DNS_WILDCARDS = {"wild.example.org": V4.server_b4}
DNS_DOMAINS = ("example.com", "example.org", "example.net")


# --- commands ------------------------------------------------------------------------------


def docker(*args, timeout: float = 60.0, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """`$DOCKER ARGS...` (the docker CLI: Debian's 20.10 or a newer one; both speak API 1.41)."""
    return labmod.run([DOCKER, *args], timeout=timeout, check=check, input=input)


def compose_command() -> list[str]:
    """How to run Compose here: `docker compose` (v2 plugin) when the CLI has it, else
    Debian's `docker-compose` (v1.29). $DOCKER_COMPOSE overrides (a command line)."""
    if os.environ.get("DOCKER_COMPOSE"):
        return os.environ["DOCKER_COMPOSE"].split()
    cp = labmod.run([DOCKER, "compose", "version"], timeout=30, check=False)
    if cp.returncode == 0:
        return [DOCKER, "compose"]
    return ["docker-compose"]


def _pdeathsig():
    # Host helpers (dnsmasq, echo servers, host egressd) die with the pytest process even if
    # it is killed outright; Popen is only ever called from the main thread here.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def host_resolvers() -> list[str]:
    """The host's nameservers (/etc/resolv.conf): nothing a test does may reach them."""
    try:
        text = Path("/etc/resolv.conf").read_text()
    except OSError:
        return []
    return re.findall(r"^\s*nameserver\s+(\S+)", text, re.M)


# --- prerequisites and the daemon ----------------------------------------------------------


def missing_prerequisites() -> list[str]:
    """Why Docker tests cannot run here (empty when they can). Does not start dockerd."""
    if os.geteuid() != 0:
        return ["not root (these tests run rootful Docker and bind host addresses)"]
    problems = []
    for tool, pkg in ((DOCKER, "docker.io"), ("dockerd", "docker.io"), ("ip", "iproute2"), ("nft", "nftables"),
                      ("dnsmasq", "dnsmasq-base"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            problems.append(f"{tool} not found (apt-get install {pkg}; scripts/setup does this)")
    if not compose_available():
        problems.append("neither `docker compose` nor docker-compose works (apt-get install docker-compose; "
                        "scripts/setup does this)")
    if not Path("/bin/busybox").exists():
        problems.append("/bin/busybox not found (apt-get install busybox-static; scripts/setup does this)")
    if not Path("/usr/bin/python3").exists():
        problems.append("/usr/bin/python3 not found (task containers run it from the host's /usr)")
    return problems


def compose_available() -> bool:
    try:
        cmd = compose_command()
    except (OSError, LabError):
        return False
    if cmd[0] != DOCKER and shutil.which(cmd[0]) is None:
        return False
    return labmod.run([*cmd, "version"], timeout=60, check=False).returncode == 0


def dockerd_cgroup() -> str | None:
    """The cgroup (v2) dockerd is in, as /proc/PID/cgroup says ("/": the root), from its pidfile
    (the default one, or --pidfile in $DOCKERD_ARGS); None if it cannot be read."""
    args = os.environ.get("DOCKERD_ARGS", "").split()
    pidfile = next((a.split("=", 1)[1] for a in args if a.startswith("--pidfile=")), None)
    if pidfile is None and "--pidfile" in args[:-1]:
        pidfile = args[args.index("--pidfile") + 1]
    try:
        pid = int(Path(pidfile or "/var/run/docker.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return labmod.cgroup_of(pid)


class Daemon:
    """The Docker daemon: the running one, or one this session starts (and then stops). One
    it starts runs in a cgroup (v2) of its own, as systemd starts it (docker.service): the
    sockets of Docker's embedded resolver are dockerd's, and egressd tells them from a
    container's by that cgroup."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.cgroup: Path | None = None

    @staticmethod
    def responding() -> bool:
        return labmod.run([DOCKER, "info", "--format", "{{.ServerVersion}}"], timeout=30, check=False).returncode == 0

    def ensure(self, timeout: float = 60.0) -> "Daemon":
        if self.responding():
            return self
        self.log = open(self.log_path, "ab")
        # Its own session: a Ctrl-C of pytest must not reach it before cleanup has used it.
        # $DOCKERD_ARGS: extra arguments for a daemon the session starts (e.g. a second,
        # isolated one: -H, --data-root, --exec-root, --pidfile), a word list.
        argv = ["dockerd", *os.environ.get("DOCKERD_ARGS", "").split()]
        mount, own = labmod.cgroup2_mount(), labmod.cgroup_of()
        if mount is not None and own is not None:
            self.cgroup = mount / own.lstrip("/") / f"egressd-test-dockerd-{os.getpid()}.service"
            self.cgroup.mkdir(exist_ok=True)
            argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs"), *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     start_new_session=True)

        def up():
            if self.proc.poll() is not None:
                raise LabError(f"dockerd exited {self.proc.returncode}: {self.tail()}")
            return self.responding()
        wait_for(up, timeout, "dockerd to answer `docker info`")
        return self

    @property
    def started_here(self) -> bool:
        return self.proc is not None

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> list[str]:
        """Stops the daemon if this session started it. Returns problems."""
        if self.proc is None or self.proc.poll() is not None:
            return self.remove_cgroup()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return [f"dockerd did not stop within {timeout:g}s after SIGTERM; killed", *self.remove_cgroup()]
        finally:
            self.log.close()
        return self.remove_cgroup()

    def remove_cgroup(self) -> list[str]:
        """Removes dockerd's cgroup; what outlived dockerd in it (containerd, a shim) is moved
        to the parent first."""
        if self.cgroup is None or not self.cgroup.exists():
            return []
        for pid in (self.cgroup / "cgroup.procs").read_text().split():
            try:
                (self.cgroup.parent / "cgroup.procs").write_text(pid)
            except ProcessLookupError:
                pass
        try:
            self.cgroup.rmdir()
        except OSError as e:
            return [f"cannot remove dockerd's cgroup {self.cgroup}: {e}"]
        return []


# --- images --------------------------------------------------------------------------------


def image_id(ref: str) -> str | None:
    cp = docker("image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return cp.stdout.strip() if cp.returncode == 0 else None


def load_egressd_image(build_dir: Path, build: bool) -> str:
    """The egressd image in Docker's store: built with scripts/build-image (Podman) unless
    `build` is False, then `podman save | docker load` when Docker lacks it or it was rebuilt.
    Returns its image id."""
    if build:
        cp = subprocess.run([str(REPO_ROOT / "scripts/build-image"), "--tag", IMAGE],
                            env={**os.environ, "BUILD_DIR": str(build_dir)}, capture_output=True, text=True,
                            timeout=900)
        if cp.returncode != 0:
            raise LabError(f"scripts/build-image failed:\n{cp.stdout}{cp.stderr}")
    if build or image_id(IMAGE) is None:
        if shutil.which("podman") is None:
            raise LabError(f"{IMAGE} is not in Docker's image store and podman is missing to load it from")
        # `podman save | docker load`, without a shell.
        save = subprocess.Popen(["podman", "save", IMAGE], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        load = subprocess.run([DOCKER, "load"], stdin=save.stdout, capture_output=True, text=True, timeout=300)
        save.stdout.close()
        save_err = save.stderr.read().decode(errors="replace")
        if save.wait(60) != 0 or load.returncode != 0:
            raise LabError(f"podman save {IMAGE} | docker load failed: {save_err}{load.stderr}")
    iid = image_id(IMAGE)
    if iid is None:
        raise LabError(f"{IMAGE} is not in Docker's image store after loading it")
    return iid


def build_task_image() -> str:
    """A FROM-scratch task image (`docker import`): Debian's static busybox and its applets,
    /lib and /lib64 as links into /usr so that the host's python3 runs when /usr is
    bind-mounted read-only, and a passwd with root and nobody. Cached once built."""
    iid = image_id(TASK_IMAGE)
    if iid:
        return iid
    with tempfile.TemporaryDirectory(prefix="egt-dk-task-") as ctx:
        tar_path = Path(ctx) / "root.tar"
        with tarfile.open(tar_path, "w") as tar:
            def add_dir(name, mode=0o755):
                ti = tarfile.TarInfo(name)
                ti.type, ti.mode = tarfile.DIRTYPE, mode
                tar.addfile(ti)

            def add_link(name, target):
                ti = tarfile.TarInfo(name)
                ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, target, 0o777
                tar.addfile(ti)

            def add_file(name, data: bytes, mode=0o644):
                import io
                ti = tarfile.TarInfo(name)
                ti.size, ti.mode = len(data), mode
                tar.addfile(ti, io.BytesIO(data))

            for d in ("bin", "usr", "etc", "proc", "sys", "dev", "run", "root"):
                add_dir(d)
            add_dir("tmp", 0o1777)
            add_file("bin/busybox", Path("/bin/busybox").read_bytes(), 0o755)
            for applet in ("sh", "nc", "httpd", "sleep", "cat", "echo", "true", "wget", "ip", "ping",
                           "nslookup", "id", "ls", "ps", "kill", "test", "grep"):
                add_link(f"bin/{applet}", "busybox")
            add_link("lib", "usr/lib")
            add_link("lib64", "usr/lib64")
            add_file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
            add_file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        docker("import", "--change", "ENV PATH=/bin:/usr/bin", "--change", 'CMD ["/bin/sh"]', str(tar_path),
               TASK_IMAGE, timeout=120)
    return image_id(TASK_IMAGE)


# --- containers ----------------------------------------------------------------------------


class Container:
    """A Docker container (by id or name)."""

    def __init__(self, ref: str, name: str | None = None):
        self.ref, self.name = ref, name or ref

    def __repr__(self):
        return f"Container({self.name})"

    def inspect(self, fmt: str) -> str:
        return docker("inspect", "--format", fmt, self.ref).stdout.strip()

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
    def ipv4(self) -> str:
        """Its IPv4 address on its (one) network."""
        return self.inspect("{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")

    @property
    def exit_code(self) -> int:
        return int(self.inspect("{{.State.ExitCode}}"))

    @property
    def health(self) -> str:
        return self.inspect("{{if .State.Health}}{{.State.Health.Status}}{{end}}")

    def netns(self) -> labmod.Netns:
        """The container's network namespace for the lab's clients, bound to its current
        process (take it again after a restart)."""
        ns = labmod.Netns(f"{self.name}-netns")
        ns.path = f"/proc/{self.pid}/ns/net"
        return ns

    def exec(self, *args, user: str | None = None, timeout: float = 30.0, check: bool = False,
             input: str | None = None) -> subprocess.CompletedProcess:
        """`docker exec [-u USER] [-i] REF ARGS...` (argv, no shell)."""
        argv = ["exec"]
        if user:
            argv += ["--user", user]
        if input is not None:
            argv.append("--interactive")
        return docker(*argv, self.ref, *args, timeout=timeout, check=check, input=input)

    def probe(self, *args, user: str | None = None, timeout: float = 60.0) -> dict:
        """Runs tests/docker/taskprobe.py inside the container (host python3 through the /usr
        bind mount) and returns its JSON result."""
        cp = self.exec("python3", f"{TASK_MOUNT}/taskprobe.py", *args, user=user, timeout=timeout)
        try:
            return json.loads(cp.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise LabError(f"taskprobe {' '.join(args)} in {self.name} (user {user or 'root'}) exited "
                           f"{cp.returncode}: {cp.stdout}{cp.stderr}") from None

    def probe_proc(self, *args, user: str | None = None) -> "Held":
        """taskprobe.py as a long-running process in the container (e.g. a squatter): its
        first stdout line is JSON; it stops when its stdin closes."""
        argv = [DOCKER, "exec", "--interactive"]
        if user:
            argv += ["--user", user]
        argv += [self.ref, "python3", f"{TASK_MOUNT}/taskprobe.py", *args]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return Held(p, f"taskprobe {' '.join(args)} in {self.name}")

    def logs(self) -> str:
        cp = docker("logs", self.ref, check=False)
        return (cp.stdout + cp.stderr).strip()

    def kill(self, signal: str = "KILL"):
        docker("kill", "--signal", signal, self.ref)

    def start(self):
        docker("start", self.ref)

    def stop(self, timeout: int = 10):
        docker("stop", "--time", str(timeout), self.ref, timeout=timeout + 30)

    def wait_exit(self, timeout: float = 10.0) -> int:
        wait_for(lambda: not self.running, timeout, f"{self.name} to exit")
        return self.exit_code

    def remove(self):
        docker("rm", "--force", "--volumes", self.ref, check=False)


class Held:
    """A process that prints one JSON line when ready and holds until its stdin closes."""

    def __init__(self, p: subprocess.Popen, what: str):
        self.p, self.what = p, what
        self.ready = json.loads(labmod._read_line(p, 30.0, what))

    def send(self, line: str):
        self.p.stdin.write(line.encode() + b"\n")
        self.p.stdin.flush()

    def result(self, timeout: float = 60.0) -> dict:
        """The next JSON line (e.g. the outcome after a `go`)."""
        return json.loads(labmod._read_line(self.p, timeout, self.what))

    def close(self) -> str:
        """Closes its stdin (it stops) and returns the rest of what it printed."""
        try:
            out, err = self.p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            out, err = self.p.communicate(timeout=5)
        out = getattr(self.p, "_lab_pending", b"") + (out or b"")
        return out.decode(errors="replace") + (err or b"").decode(errors="replace")


# --- Compose -------------------------------------------------------------------------------


class ComposeProject:
    """One Compose project (`-p NAME -f FILE...`), run with `docker compose` or docker-compose."""

    def __init__(self, session: "Session", name: str, files: list[Path], env: dict, project_dir: Path):
        self.session, self.name, self.files, self.project_dir = session, name, files, project_dir
        self.env = {**os.environ, **env}
        self.cmd = session.compose

    def __repr__(self):
        return f"ComposeProject({self.name})"

    def run(self, *args, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        argv = [*self.cmd, "--project-name", self.name, "--project-directory", str(self.project_dir)]
        for f in self.files:
            argv += ["--file", str(f)]
        argv += list(args)
        try:
            cp = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise LabError(f"{' '.join(argv)}: still running after {timeout:g}s") from None
        if check and cp.returncode != 0:
            raise LabError(f"{' '.join(argv)} exited {cp.returncode}: {cp.stdout}{cp.stderr}")
        return cp

    def up(self, timeout: float = 120.0):
        """`up -d`: Compose v1 has no --wait; it does wait for `depends_on: condition:
        service_healthy` before starting the dependent service, as v2's `up --wait` does."""
        self.run("up", "--detach", timeout=timeout)

    def exec(self, service: str, *args, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """`compose exec` without a TTY, argv and no shell: Harbor's `exec --no-TTY` (v2), `-T` in v1."""
        no_tty = "--no-TTY" if self.cmd[-1] == "compose" else "-T"
        return self.run("exec", no_tty, service, *args, timeout=timeout, check=False)

    def container(self, service: str) -> Container:
        """The service's one container (found by Compose's labels with the docker CLI: much
        faster than `compose ps` of Compose v1)."""
        cid = docker("ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={self.name}",
                     "--filter", f"label=com.docker.compose.service={service}").stdout.strip()
        if not cid or "\n" in cid:
            raise LabError(f"{self.name}: expected one container for service {service}, got {cid!r}")
        return Container(cid, f"{self.name}/{service}")

    def logs(self) -> str:
        cp = self.run("logs", "--no-color", timeout=60, check=False)
        return (cp.stdout + cp.stderr).strip()

    def down(self) -> list[str]:
        """Removes the project's containers (`compose down` would also remove networks and
        volumes; this project has neither of its own: its network is the session's). With
        the docker CLI, because Compose v1 takes seconds for it."""
        ids = docker("ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={self.name}",
                     check=False).stdout.split()
        if not ids:
            return []
        cp = docker("rm", "--force", "--volumes", *ids, check=False, timeout=120)
        return [] if cp.returncode == 0 else [f"removing project {self.name}: {cp.stderr.strip()}"]


# --- the session ---------------------------------------------------------------------------


class Network:
    """A session network: created `--internal`, its bridge, the host addresses on it."""

    def __init__(self, session: "Session", plan: Plan):
        self.plan = plan
        self.name = f"{session.tag}-{plan.key}"
        argv = ["network", "create", "--internal", "--label", session.label, "--subnet", plan.subnet4,
                "--gateway", plan.gateway4, "--ip-range", plan.range4]
        if plan.subnet6:
            argv += ["--ipv6", "--subnet", plan.subnet6, "--gateway", plan.gateway6, "--ip-range", plan.range6]
        cp = docker(*argv, self.name, check=False)
        if cp.returncode != 0:
            raise LabError(f"docker network create {self.name} ({plan.subnet4}) failed: {cp.stderr.strip()} "
                           "(another tests/docker session running? they share these subnets)")
        self.id = cp.stdout.strip()
        self.bridge = f"br-{self.id[:12]}"
        wait_for(lambda: Path(f"/sys/class/net/{self.bridge}").exists(), 10.0, f"bridge {self.bridge}")
        have = labmod.run(["ip", "-j", "addr", "show", "dev", self.bridge]).stdout
        # The gateway (DNS server) and the two servers live on the bridge, in the host namespace.
        # IPv6 ones without DAD: the bridge has no carrier until a container joins, and a
        # tentative address cannot be bound.
        for addr in (plan.gateway4, plan.server_a4, plan.server_b4):
            if f'"{addr}"' not in have:
                labmod.run(["ip", "addr", "add", f"{addr}/32", "dev", self.bridge])
        for addr in (plan.server_a6, plan.server_b6):
            if addr:
                labmod.run(["ip", "addr", "add", f"{addr}/128", "dev", self.bridge, "nodad"])
        self.mac = Path(f"/sys/class/net/{self.bridge}/address").read_text().strip()

    @property
    def dns(self) -> str:
        return self.plan.gateway4


class Session:
    """One pytest session's daemon, networks, host services and bookkeeping."""

    def __init__(self, daemon: Daemon, egressd_image: str):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.label = f"{LABEL}={os.getpid()}"
        self.daemon = daemon
        self.egressd_image = egressd_image
        self.task_image = TASK_IMAGE
        self._n = itertools.count(1)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.compose = compose_command()
        self.networks: dict[str, Network] = {}
        self.procs: list[subprocess.Popen] = []
        self.projects: list[ComposeProject] = []
        self.guard: Guard | None = None

    # lifecycle
    def start(self) -> "Session":
        labmod._live_labs.add(self)
        try:
            for plan in PLANS.values():
                self.networks[plan.key] = Network(self, plan)
            self.guard = Guard(self)
            self._start_dns()
            self._start_servers()
        except BaseException:
            self.cleanup()
            raise
        return self

    def _start_dns(self):
        self.dns_log_path = self.tmp / "dnsmasq.log"
        args = ["dnsmasq", "--keep-in-foreground", "--user=root", "--group=root", "--pid-file=", "--no-resolv",
                "--no-hosts", "--log-queries", f"--log-facility={self.dns_log_path}", "--local-ttl=60",
                "--bind-interfaces", "--except-interface=lo"]
        args += [f"--listen-address={n.plan.gateway4}" for n in self.networks.values()]
        args += [f"--host-record={n},{','.join(a)}" for n, a in DNS_HOSTS.items()]
        args += [f"--address=/{n}/{a}" for n, a in DNS_WILDCARDS.items()]
        # Answer (NXDOMAIN/NODATA) for the test domains instead of REFUSED-for-no-upstream.
        args += [f"--local=/{d}/" for d in DNS_DOMAINS]
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_pdeathsig)
        self.procs.append(p)

        def answers():
            if p.poll() is not None:
                raise LabError(f"dnsmasq exited {p.returncode}: {p.stderr.read()}")
            return all(host_dns_query("a.example.com", n.dns).rcode == "NOERROR" for n in self.networks.values())
        wait_for(answers, 10.0, "dnsmasq to answer on the gateways")

    def _start_servers(self):
        addrs = [a for n in self.networks.values() for a in n.plan.servers]
        p = subprocess.Popen([sys.executable, str(labmod.HERE / "labserver.py"), "--tcp", f"{ECHO_PORT},{HTTP_PORT}",
                              "--udp", f"{ECHO_PORT},{HIGH_ECHO_PORT}", *addrs], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, preexec_fn=_pdeathsig)
        self.procs.append(p)
        if labmod._read_line(p, 10.0, "labserver") != "READY":
            raise LabError(f"labserver did not start: {p.stderr.read().decode(errors='replace')}")

    def cleanup(self) -> list[str]:
        """Removes this session's projects, containers, networks, host services, nft table and
        image tag, and stops a daemon it started. Returns problems (empty if none)."""
        labmod._live_labs.discard(self)
        problems = []
        for proj in reversed(self.projects):
            problems += proj.down()
        self.projects.clear()
        problems += remove_session_objects(os.getpid())
        for p in self.procs:
            if p.poll() is None:
                labmod._stop_process(p)
        self.procs.clear()
        if self.guard is not None:
            problems += self.guard.remove()
            self.guard = None
        shutil.rmtree(self.tmp, ignore_errors=True)
        cp = docker("image", "rm", self.egressd_image, check=False)   # the session's tag only
        if cp.returncode != 0 and not re.search(r"No such image|not found", cp.stderr):
            problems.append(f"docker image rm {self.egressd_image}: {cp.stderr.strip()}")
        problems += self.daemon.stop()
        return problems

    def close(self):
        """For the lab's exit handlers (see start)."""
        problems = self.cleanup()
        if problems:
            raise LabError("docker cleanup: " + "; ".join(problems))

    # names
    def name(self, what: str) -> str:
        return f"{self.tag}-{what}-{next(self._n)}"

    def network(self, key: str = "v4") -> Network:
        return self.networks[key]

    def dns_log(self, since: int = 0) -> str:
        """The names dnsmasq was asked, as its log lines ("query[A] NAME from ADDR"), from
        line `since` (a dns_mark()) on."""
        try:
            lines = self.dns_log_path.read_text().splitlines()[since:]
        except OSError:
            return ""
        return "\n".join(l for l in lines if "query[" in l)

    def dns_mark(self) -> int:
        """Where dnsmasq's log ends now, for dns_log(since=...)."""
        try:
            return len(self.dns_log_path.read_text().splitlines())
        except OSError:
            return 0

    # containers
    def run(self, image: str, *cmd, name: str, network: str | None = None, caps: tuple | None = None,
            env: dict | None = None, volumes: tuple = (), entrypoint: str | None = None, dns: str | None = None,
            extra=()) -> Container:
        """`docker run -d` with this session's label. caps=None keeps Docker's default set;
        a tuple means --cap-drop ALL plus exactly these."""
        full = self.name(name)
        argv = ["run", "--detach", "--name", full, "--label", self.label]
        if network:
            argv += ["--network", network]
        if dns:
            argv += ["--dns", dns]
        if caps is not None:
            argv += ["--cap-drop", "ALL", *itertools.chain.from_iterable(("--cap-add", c) for c in caps)]
        for k, v in (env or {}).items():
            argv += ["--env", f"{k}={v}"]
        for v in volumes:
            argv += ["--volume", v]
        if entrypoint is not None:
            argv += ["--entrypoint", entrypoint]
        argv += [*extra, image, *cmd]
        cid = docker(*argv).stdout.strip()
        return Container(cid, full)

    def task(self, what: str = "task", network: str = "v4", caps: tuple | None = None) -> Container:
        """A task container owning its namespace on a session network, with Docker's default
        capabilities (as Harbor's `main`) unless `caps` says otherwise, dnsmasq as Docker's
        upstream, the host's /usr (python3) and tests/docker mounted read-only."""
        net = self.networks[network]
        return self.run(self.task_image, "sleep", "3600", name=what, network=net.name, dns=net.dns, caps=caps,
                        volumes=task_volumes())

    def project(self, what: str, files: list[Path], env: dict) -> ComposeProject:
        d = self.tmp / self.name(what)
        d.mkdir()
        proj = ComposeProject(self, d.name, files, {**env, "EGT_LABEL": self.label}, d)
        self.projects.append(proj)
        return proj


def task_volumes() -> tuple:
    return ("/usr:/usr:ro", f"{HERE}:{TASK_MOUNT}:ro")


def remove_session_objects(pid: int) -> list[str]:
    """Removes the containers (with their Compose projects' ones) and networks of session
    `pid`. Returns what could not be removed."""
    problems = []
    label, tag = f"{LABEL}={pid}", f"{PREFIX}{pid}-"
    ids = set(docker("ps", "--all", "--quiet", "--filter", f"label={label}", check=False).stdout.split())
    cp = docker("ps", "--all", "--format", "{{.ID}} {{.Label \"com.docker.compose.project\"}}", check=False)
    for line in cp.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].startswith(tag):
            ids.add(parts[0])
    if ids:
        docker("rm", "--force", "--volumes", *sorted(ids), check=False, timeout=120)
        left = [i for i in ids if docker("inspect", "--format", "{{.Id}}", i, check=False).returncode == 0]
        if left:
            problems.append(f"containers left: {' '.join(left)}")
    nets = docker("network", "ls", "--format", "{{.Name}}", "--filter", f"label={label}", check=False).stdout.split()
    nets += [n for n in docker("network", "ls", "--format", "{{.Name}}", check=False).stdout.split()
             if n.startswith(tag)]
    for n in sorted(set(nets)):
        cp = docker("network", "rm", n, check=False, timeout=60)
        if cp.returncode != 0 and not re.search(r"not found|No such network", cp.stderr):
            problems.append(f"network rm {n}: {cp.stderr.strip()}")
    return problems


def sweep_stale() -> list[int]:
    """Removes what sessions whose process is gone left behind: containers, Compose
    projects, networks (by label or egt-dk-<pid> name), nft tables egt-dk-<pid>, the
    session image tags and the session directories in the temporary directory."""
    seen = set()
    cp = docker("ps", "--all", "--format", "{{.Label \"egressd-test\"}} {{.Label \"com.docker.compose.project\"}}",
                check=False)
    for line in cp.stdout.splitlines():
        seen.update(re.findall(r"(?:^|\s)(\d+)(?:\s|$)", line))
        seen.update(re.findall(rf"{PREFIX}(\d+)-", line))
    cp = docker("network", "ls", "--format", "{{.Name}}", check=False)
    seen.update(re.findall(rf"{PREFIX}(\d+)-", cp.stdout))
    cp = labmod.run(["nft", "list", "tables"], check=False)
    seen.update(re.findall(rf"table inet {PREFIX}(\d+)\b", cp.stdout))
    cp = docker("image", "ls", "--format", "{{.Repository}}", check=False)
    seen.update(re.findall(rf"localhost/{PREFIX}(\d+)-egressd", cp.stdout))
    tmp = Path(tempfile.gettempdir())
    seen.update(m.group(1) for d in tmp.glob(f"{PREFIX}*") if (m := re.match(rf"{PREFIX}(\d+)-", d.name)))
    removed = []
    for pid in sorted(int(p) for p in seen):
        if pid == os.getpid() or labmod._pid_alive(pid):
            continue
        remove_session_objects(pid)
        labmod.run(["nft", "delete", "table", "inet", f"{PREFIX}{pid}"], check=False)
        docker("image", "rm", f"localhost/{PREFIX}{pid}-egressd:test", check=False)
        for d in tmp.glob(f"{PREFIX}{pid}-*"):
            shutil.rmtree(d, ignore_errors=True)
        removed.append(pid)
    return removed


# --- the guard: nothing may reach the host's nameservers -------------------------------------


class Guard:
    """Counts, in the host namespace, every packet from this session's bridges towards the
    host's nameservers (nft counter at prerouting, before Docker's rules can drop it), and
    looks for such flows in conntrack (host and task namespaces). `check()` returns what it
    found; a test that sends anything there fails."""

    def __init__(self, session: Session):
        self.table = session.tag
        self.resolvers = [a for a in host_resolvers() if ":" not in a]
        self.resolvers6 = [a for a in host_resolvers() if ":" in a]
        bridges = ", ".join(f'"{n.bridge}"' for n in session.networks.values())
        rules = []
        if self.resolvers:
            rules.append(f"iifname {{ {bridges} }} ip daddr {{ {', '.join(self.resolvers)} }} counter")
        if self.resolvers6:
            rules.append(f"iifname {{ {bridges} }} ip6 daddr {{ {', '.join(self.resolvers6)} }} counter")
        body = "\n".join(f"    {r}" for r in rules)
        script = (f"table inet {self.table} {{\n  chain pre {{\n    type filter hook prerouting priority -500;\n"
                  f"{body}\n  }}\n}}\n")
        labmod.run(["nft", "-f", "-"], input=script)
        self.namespaces: list[tuple[int, str]] = []   # (pid, netns link) of task namespaces
        self.counted, self.reported = 0, set()        # so each finding fails one test only

    def watch(self, container: Container):
        pid = container.pid
        self.namespaces.append((pid, os.readlink(f"/proc/{pid}/ns/net")))

    def _conntrack_files(self) -> list[str]:
        """The host's conntrack, and that of every watched task namespace still alive (a pid
        that now belongs to another namespace is not read: it could be the host's)."""
        files, alive = ["/proc/net/nf_conntrack"], []
        for pid, link in self.namespaces:
            try:
                if os.readlink(f"/proc/{pid}/ns/net") != link:
                    continue
            except OSError:
                continue
            alive.append((pid, link))
            files.append(f"/proc/{pid}/net/nf_conntrack")
        self.namespaces = alive
        return files

    def packets(self) -> int:
        cp = labmod.run(["nft", "-j", "list", "table", "inet", self.table], check=False)
        if cp.returncode != 0:
            return 0
        n = 0
        for item in json.loads(cp.stdout).get("nftables", []):
            for e in item.get("rule", {}).get("expr", []):
                if "counter" in e:
                    n += e["counter"]["packets"]
        return n

    def check(self) -> list[str]:
        """What reached for the host's nameservers since the last check."""
        found = []
        n = self.packets()
        if n > self.counted:
            found.append(f"{n - self.counted} packet(s) from a test network towards the host's nameservers "
                         f"{self.resolvers + self.resolvers6} (nft counter in table inet {self.table})")
            self.counted = n
        targets = self.resolvers + self.resolvers6
        for path in self._conntrack_files():
            try:
                text = Path(path).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if any(f"dst={a} " in line for a in targets) and (
                        path != "/proc/net/nf_conntrack" or any(f"src={p}" in line for p in _SUBNET_PREFIXES)):
                    # A flow is one finding, whatever its countdown says at each look.
                    key = (path, tuple(re.findall(r"(?:src|dst|sport|dport)=(\S+)", line)[:4]))
                    if key not in self.reported:
                        self.reported.add(key)
                        found.append(f"conntrack ({path}): {line.strip()}")
        return found

    @contextlib.contextmanager
    def holding_dns_from(self, source: str, server: str = DNS_SERVER):
        """While inside: UDP and TCP from `source` to `server`:53 are dropped where they enter the
        host namespace (silently: the sender sees no error and waits). A test holds Docker's
        resolver's forwarded query this way, so egressd's query to the resolver stays open for as
        long as the test needs (egressd's next try follows 0.5 s later)."""
        labmod.run(["nft", "add", "chain", "inet", self.table, "hold",
                    "{ type filter hook prerouting priority -400; }"])
        try:
            labmod.run(["nft", "add", "rule", "inet", self.table, "hold", "ip", "saddr", source,
                        "ip", "daddr", server, "meta", "l4proto", "{ udp, tcp }", "th", "dport", "53",
                        "counter", "drop"])
            yield
        finally:
            labmod.run(["nft", "delete", "chain", "inet", self.table, "hold"], check=False)

    def remove(self) -> list[str]:
        cp = labmod.run(["nft", "delete", "table", "inet", self.table], check=False)
        return [] if cp.returncode == 0 else [f"nft delete table inet {self.table}: {cp.stderr.strip()}"]


_SUBNET_PREFIXES = ("198.51.100.", "203.0.113.", "2001:db8:d0c:")


# --- clients -------------------------------------------------------------------------------


def host_dns_query(name: str, server: str, timeout: float = 0.5) -> labmod.DnsReply:
    """A DNS query from the host namespace (to dnsmasq on a gateway)."""
    with socket.socket(labmod.family_of(server), socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        t0 = time.monotonic()
        try:
            s.connect((server, 53))
        except OSError as e:
            return labmod.DnsReply(labmod._classify(e, t0))
        return labmod.dns_exchange(s, name, "A", timeout=timeout)


def echo(ns: labmod.Netns, addr: str, timeout: float = 1.0) -> labmod.Outcome:
    """TCP connect + echo to a server from inside `ns`: 'ok', or how it failed."""
    return ns.tcp_connect(addr, ECHO_PORT, timeout=timeout)


def reachable(ns: labmod.Netns, plan: Plan = V4) -> set[str]:
    """Which servers of `plan` answer from inside `ns` (a denied one must fail fast, reset)."""
    got = set()
    for addr in plan.servers:
        out = echo(ns, addr)
        if out == "ok":
            got.add(addr)
        elif out != "refused" or out.elapsed > 0.5:
            raise AssertionError(f"{addr} from {ns.path}: {out!r} (a denied connection must be reset at once)")
    return got


def egressctl(socket_path: Path | str, *args, timeout: float = 15.0) -> subprocess.CompletedProcess:
    """The host's egressctl against a socket."""
    return labmod.run([str(labmod.egressctl_binary()), "--socket", str(socket_path), *args], timeout=timeout,
                      check=False)
