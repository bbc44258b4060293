"""The three ways tests/docker runs egressd next to a task, behind one interface (`Sandbox`),
so every check and every attack is written once and run in each:

  harbor           Harbor's Compose topology: the sidecar (egressd's image as
                   harbor-docker-egress-control-sidecar, Harbor's entrypoint and env) owns the
                   namespace, `main` joins it once the sidecar is healthy; switches are
                   `compose exec <sidecar> network-policy VERB...` (harbor/*.yaml)
  netns-pid        a task container on its own, egressd joining it as a host process with
                   `run --netns-pid <the task's pid>` and a policy file whose upstream is the
                   task's resolver, Docker's 127.0.0.11; switches are the host's egressctl
  compose-example  container/compose.yaml as shipped (plus compose-example-offline.yaml):
                   egressd owns the namespace, the task joins it once egressd is healthy;
                   switches are egressctl on ./egressd-run/egressd.sock

A sandbox starts in `public`, `allowlist` (with `allow` entries) or `no-network`.
"""
from __future__ import annotations

import json
import signal
import subprocess

import dockerlab
import lab as labmod
from dockerlab import HARBOR_SIDECAR, HERE, REPO_ROOT, LabError, wait_for

TOPOLOGIES = ("harbor", "netns-pid", "compose-example")
HARBOR_FILES = [HERE / "harbor" / f for f in ("prebuilt.yaml", "egress-control.yaml",
                                              "egress-control-services.yaml", "offline.yaml")]


class Sandbox:
    """A task and the egressd that guards it."""

    topology = ""
    can_restart = False     # egressd restarts in the same namespace (not Harbor's: the sidecar owns it)

    def __init__(self, session: dockerlab.Session, network: str):
        self.session = session
        self.net = session.network(network)
        self.plan = self.net.plan
        self.task: dockerlab.Container | None = None

    def __repr__(self):
        return f"{type(self).__name__}({self.task.name if self.task else '-'})"

    # what every topology provides
    def apply(self, mode: str, *entries: str) -> str:
        """Switches the policy; returns the tool's output once it says the kernel has it."""
        raise NotImplementedError

    def status(self) -> dict:
        raise NotImplementedError

    def logs(self) -> str:
        raise NotImplementedError

    def egressctl(self, *args) -> subprocess.CompletedProcess:
        """egressctl ARGS against this sandbox's egressd, from where its operator has it."""
        raise NotImplementedError

    def host_socket(self) -> str:
        """egressd's control socket as the host reaches it."""
        return str(self.sock)

    def host_request(self, obj: dict) -> dict:
        """One request on egressd's control socket from this process: no container and no
        process started for it. What a test that races egressd's own timers polls (a `docker
        exec` took a second under CI's load, an egressctl process hundreds of milliseconds)."""
        return labmod.unix_request(self.host_socket(), obj, 10.0, f"egressd of {self!r}")

    def restart_egressd(self, meanwhile=None) -> None:
        """Stops egressd (the policy stays in the kernel), runs meanwhile(), starts it again
        and waits until it is ready. LabError (with its log) if it does not come back."""
        raise NotImplementedError

    def close(self) -> list[str]:
        return []

    # shared
    def ns(self) -> labmod.Netns:
        return self.task.netns()

    def reachable(self) -> set[str]:
        return dockerlab.reachable(self.ns(), self.plan)

    def probe(self, *args, user: str | None = None, timeout: float = 60.0) -> dict:
        return self.task.probe(*args, user=user, timeout=timeout)


# --- Harbor ----------------------------------------------------------------------------------


class HarborSandbox(Sandbox):
    topology = "harbor"

    def __init__(self, session, network, mode, allow, helper=False):
        super().__init__(session, network)
        files = list(HARBOR_FILES)
        if helper:
            files.insert(2, HERE / "harbor" / "helper.yaml")
        self.project = session.project("harbor", files, {
            "PREBUILT_IMAGE_NAME": session.task_image,
            "EGRESS_CONTROL_SIDECAR_IMAGE_NAME": session.egressd_image,
            "EGRESS_CONTROL_INITIAL_NETWORK_MODE": mode,
            "EGRESS_CONTROL_INITIAL_ALLOWED_HOSTS": " ".join(allow),
            "EGT_DNS": self.net.dns, "EGT_NETWORK": self.net.name, "EGT_PROBE_DIR": str(HERE),
        })
        try:
            self.project.up()
        except LabError as e:
            raise LabError(f"{e}\n--- compose logs ---\n{self.project.logs()}") from None
        self.sidecar = self.project.container(HARBOR_SIDECAR)
        if self.sidecar.health != "healthy":
            raise LabError(f"{HARBOR_SIDECAR} is {self.sidecar.health!r} after up:\n{self.project.logs()}")
        self.task = self.project.container("main")
        session.guard.watch(self.task)

    def policy(self, *args) -> subprocess.CompletedProcess:
        """`compose exec <sidecar> network-policy ARGS`: Harbor's way (argv, no TTY, no shell)."""
        return self.project.exec(HARBOR_SIDECAR, "network-policy", *args)

    def apply(self, mode, *entries):
        verb = {"public": ["allow-all"], "no-network": ["deny-all"], "allowlist": ["allow", *entries]}[mode]
        cp = self.policy(*verb)
        if cp.returncode != 0:
            raise AssertionError(f"network-policy {' '.join(verb)} exited {cp.returncode}: {cp.stdout}{cp.stderr}")
        return cp.stdout

    def status(self):
        # Harbor's verbs go through `compose exec` (apply, policy); reads take the faster
        # `docker exec` of the same program in the same container.
        cp = self.sidecar.exec("network-policy", "show", "--json")
        if cp.returncode != 0:
            raise LabError(f"network-policy show --json exited {cp.returncode}: {cp.stderr}")
        return json.loads(cp.stdout)

    def logs(self):
        return self.sidecar.logs()

    def egressctl(self, *args):
        # The socket is inside the sidecar (/run/egressd/egressd.sock), so is the image's egressctl.
        return self.sidecar.exec("egressctl", *args)

    def host_socket(self):
        # The same socket, reached through the sidecar's root as the host sees it.
        return f"/proc/{self.sidecar.pid}/root/run/egressd/egressd.sock"

    def close(self):
        return self.project.down()


# --- netns-pid: a host egressd joining a running task ------------------------------------------


class NetnsPidSandbox(Sandbox):
    """egressd as a host process (the build's binary), joining the task by pid. A host
    process reads the host's /etc/resolv.conf, so its policy file names the upstream: the
    task's own resolver, Docker's 127.0.0.11 (which forwards to the session's dnsmasq)."""

    topology = "netns-pid"
    can_restart = True

    def __init__(self, session, network, mode, allow):
        super().__init__(session, network)
        self.task = session.task("task", network=network)
        session.guard.watch(self.task)
        self.dir = session.tmp / session.name("egressd")
        self.dir.mkdir()
        self.sock = self.dir / "egressd.sock"
        self.ready = self.dir / "ready"
        self.log_path = self.dir / "egressd.log"
        entries = json.dumps(list(allow))
        self.config = self.dir / "policy.yaml"
        self.config.write_text(
            "dns: { upstream: [127.0.0.11] }\n"
            "phases:\n"
            "  public: { network_mode: public }\n"
            "  no-network: { network_mode: no-network }\n"
            f"  allowlist: {{ network_mode: allowlist, allowed_hosts: {entries} }}\n")
        self.mode = mode
        self.proc: subprocess.Popen | None = None
        # In a cgroup of its own, as a systemd unit runs it: egressd tells its own sockets from
        # the task's by their cgroup (it warns own_cgroup_unverified in the hierarchy's root).
        mount, own = labmod.cgroup2_mount(), labmod.cgroup_of()
        self.cgroup = None
        if mount is not None and own is not None:
            self.cgroup = mount / own.lstrip("/") / f"egressd-test-{session.name('egressd')}.service"
            self.cgroup.mkdir()
        self._start()

    def argv(self):
        argv = [str(labmod.egressd_binary()), "run", "--netns-pid", str(self.task.pid), "--config", str(self.config),
                "--phase", self.mode, "--socket", str(self.sock), "--ready-file", str(self.ready)]
        if self.cgroup is None:
            return argv
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs"), *argv]

    def _start(self, timeout: float = 10.0):
        self.ready.unlink(missing_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     preexec_fn=dockerlab._pdeathsig)
        log.close()
        self.session.procs.append(self.proc)

        def ready():
            if self.ready.exists():
                return True
            if self.proc.poll() is not None:
                raise LabError(f"host egressd exited {self.proc.returncode} before ready: {last_line(self.logs())}")
            return False
        wait_for(ready, timeout, "host egressd's ready file")

    def apply(self, mode, *entries):
        args = ["apply", "--mode", mode] + [a for e in entries for a in ("--allow", e)]
        cp = dockerlab.egressctl(self.sock, *args)
        if cp.returncode != 0:
            raise AssertionError(f"egressctl {' '.join(args)} exited {cp.returncode}: {cp.stdout}{cp.stderr}")
        return cp.stdout

    def status(self):
        cp = dockerlab.egressctl(self.sock, "status", "--json")
        if cp.returncode != 0:
            raise LabError(f"egressctl status exited {cp.returncode}: {cp.stderr}")
        return json.loads(cp.stdout)

    def logs(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def egressctl(self, *args):
        return dockerlab.egressctl(self.sock, *args)

    def restart_egressd(self, meanwhile=None):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)
        if meanwhile:
            meanwhile()
        self._start()

    def close(self):
        if self.proc and self.proc.poll() is None:
            labmod._stop_process(self.proc)
        if self.cgroup is not None and self.cgroup.exists():
            try:
                self.cgroup.rmdir()
            except OSError as e:
                return [f"cannot remove host egressd's cgroup {self.cgroup}: {e}"]
        return []


# --- container/compose.yaml as shipped ----------------------------------------------------------


class ComposeExampleSandbox(Sandbox):
    topology = "compose-example"

    def __init__(self, session, network, mode, allow):
        super().__init__(session, network)
        self.project = session.project("example", [REPO_ROOT / "container" / "compose.yaml",
                                                   HERE / "compose-example-offline.yaml"], {
            "EGT_TASK_IMAGE": session.task_image, "EGT_EGRESSD_IMAGE": session.egressd_image,
            "EGT_DNS": self.net.dns, "EGT_NETWORK": self.net.name, "EGT_PROBE_DIR": str(HERE),
        })
        self.run_dir = self.project.project_dir / "egressd-run"   # ./egressd-run of the shipped file
        self.sock = self.run_dir / "egressd.sock"
        try:
            self.project.up()
        except LabError as e:
            raise LabError(f"{e}\n--- compose logs ---\n{self.project.logs()}") from None
        self.task = self.project.container("task")
        self.egressd = self.project.container("egressd")
        session.guard.watch(self.task)
        self.wait_ready()
        # The shipped file starts in no-network; the orchestrator switches from the host.
        if mode != "no-network":
            self.apply(mode, *allow)

    def wait_ready(self, timeout: float = 20.0):
        """The file the shipped healthcheck tests (`test -f /run/egressd/ready`), seen through
        the bind mount: what `up --wait` waits for, without the healthcheck's 2 s interval."""
        def ready():
            if (self.run_dir / "ready").exists():
                return True
            if not self.egressd.running and self.egressd.exit_code != 0:
                raise LabError(f"egressd exited {self.egressd.exit_code}:\n{self.egressd.logs()}")
            return False
        wait_for(ready, timeout, "the shipped egressd service's ready file")

    def apply(self, mode, *entries):
        args = ["apply", "--mode", mode] + [a for e in entries for a in ("--allow", e)]
        cp = dockerlab.egressctl(self.sock, *args)
        if cp.returncode != 0:
            raise AssertionError(f"egressctl {' '.join(args)} exited {cp.returncode}: {cp.stdout}{cp.stderr}")
        return cp.stdout

    def status(self):
        cp = dockerlab.egressctl(self.sock, "status", "--json")
        if cp.returncode != 0:
            raise LabError(f"egressctl status exited {cp.returncode}: {cp.stderr}")
        return json.loads(cp.stdout)

    def logs(self):
        return self.egressd.logs()

    def egressctl(self, *args):
        return dockerlab.egressctl(self.sock, *args)

    def close(self):
        return self.project.down()


def last_line(log: str) -> str:
    """The last line of a log (egressd's fatal error; the whole log is attached to a failed
    test's report)."""
    lines = log.strip().splitlines()
    return lines[-1] if lines else "(empty log)"


def make(topology: str, session, mode: str, allow=(), network: str = "v4", **kw) -> Sandbox:
    cls = {"harbor": HarborSandbox, "netns-pid": NetnsPidSandbox, "compose-example": ComposeExampleSandbox}[topology]
    return cls(session, network, mode, list(allow), **kw)
