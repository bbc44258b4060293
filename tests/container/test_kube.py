"""The Kubernetes examples: egressd-pod.yaml under `podman kube play` (the policy is in the
kernel before the task starts, and egressd serves it), and the native-sidecar manifest
(Kubernetes >= 1.29, which Podman cannot play) checked for the same contract."""
import json
from pathlib import Path

import pytest
import yaml

import podlab
from podlab import SERVER_A, SERVER_B, reachable, request

KUBE = podlab.REPO_ROOT / "container" / "kubernetes"
POD_NAME = "egressd-example"
TASK_IMAGE = "docker.io/library/busybox:stable"
READY = "/run/egressd/ready"


def load(name):
    return yaml.safe_load((KUBE / name).read_text())


def by_name(containers):
    return {c["name"]: c for c in containers}


@pytest.fixture
def task_image(podman_host):
    """The manifests name the real busybox; offline, the session's busybox image stands in."""
    if podlab.podman("image", "exists", TASK_IMAGE, check=False).returncode == 0:
        yield TASK_IMAGE
        return
    podlab.podman("tag", podlab.BUSYBOX_IMAGE, TASK_IMAGE)
    yield TASK_IMAGE
    podlab.podman("untag", podlab.BUSYBOX_IMAGE, TASK_IMAGE, check=False)


@pytest.fixture
def played(session, task_image):
    manifest = KUBE / "egressd-pod.yaml"
    if podlab.podman("pod", "exists", POD_NAME, check=False).returncode == 0:
        pytest.fail(f"a pod named {POD_NAME} already exists; not touching it (podman kube down {manifest})")
    if podlab.podman("volume", "exists", "egressd-run", check=False).returncode == 0:
        pytest.fail("a volume named egressd-run already exists; not touching it")
    try:
        podlab.podman("kube", "play", "--network", session.network, str(manifest), timeout=120)
        yield manifest
    finally:
        podlab.podman("kube", "down", str(manifest), check=False, timeout=120)
        podlab.podman("pod", "rm", "--force", "--time", "0", POD_NAME, check=False)
        podlab.podman("volume", "rm", "--force", "egressd-run", check=False)


def test_kube_play_pod_enforces_from_the_start(played):
    egressd = podlab.Container(None, f"{POD_NAME}-egressd", [])
    task = podlab.Container(None, f"{POD_NAME}-task", [])
    podlab.wait_for(lambda: egressd.exec("test", "-f", READY).returncode == 0, 15.0, "egressd ready in the pod")
    # The init container installed the policy and left; egressd found it in the kernel.
    assert "adopted phase=no-network" in egressd.logs(), egressd.logs()
    ns = task.netns()
    assert reachable(ns) == set()

    cp = egressd.exec("network-policy", "allow", SERVER_A)
    assert cp.returncode == 0, cp.stderr
    assert reachable(ns) == {SERVER_A}

    # The orchestrator on the host reaches the socket through the emptyDir's volume.
    mountpoint = podlab.podman("volume", "inspect", "--format", "{{.Mountpoint}}", "egressd-run").stdout.strip()
    st = request(Path(mountpoint) / "egressd.sock", {"cmd": "status"})
    assert st["ok"] and st["mode"] == "allowlist" and st["generation"] == 2, st
    reply = request(Path(mountpoint) / "egressd.sock", {"cmd": "apply", "mode": "public"})
    assert reply["ok"], reply
    assert reachable(ns) == {SERVER_A, SERVER_B}

    cp = egressd.exec("egressctl", "status", "--json")
    assert json.loads(cp.stdout)["mode"] == "public"


def egressd_contract(c, *, init=False):
    """What every egressd container of the examples must have."""
    assert c["image"] == "localhost/egressd:latest"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_BIND_SERVICE"]}
    if not init:
        args = c["args"]
        assert args[0] == "run" and args[args.index("--ready-file") + 1] == READY
        assert {"name": "egressd-run", "mountPath": "/run/egressd"} in c["volumeMounts"]


@pytest.mark.host
def test_native_sidecar_manifest():
    pod = load("egressd-sidecar.yaml")
    spec = pod["spec"]
    sidecar = by_name(spec["initContainers"])["egressd"]
    egressd_contract(sidecar)
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["exec"]["command"] == ["test", "-f", READY]
    task = by_name(spec["containers"])["task"]
    assert task["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"name": "egressd-run", "emptyDir": {}} in spec["volumes"]


@pytest.mark.host
def test_podman_pod_manifest_matches_the_sidecar_one():
    native = by_name(load("egressd-sidecar.yaml")["spec"]["initContainers"])["egressd"]
    spec = load("egressd-pod.yaml")["spec"]
    init = by_name(spec["initContainers"])["egressd-init"]
    egressd = by_name(spec["containers"])["egressd"]
    egressd_contract(init, init=True)
    egressd_contract(egressd)
    assert egressd["args"] == native["args"]
    # The init container installs the same first policy the long-running egressd adopts.
    phase = egressd["args"][egressd["args"].index("--phase") + 1]
    assert init["args"] == ["--phase", phase]
    assert spec["restartPolicy"] == "OnFailure"


@pytest.mark.host
def test_compose_example():
    doc = yaml.safe_load((podlab.REPO_ROOT / "container" / "compose.yaml").read_text())
    task, egressd = doc["services"]["task"], doc["services"]["egressd"]
    # egressd owns the namespace: a restarted task joins it again (a task that owned it would
    # come back in a new one, with no policy).
    assert task["network_mode"] == "service:egressd" and "network_mode" not in egressd
    assert task["depends_on"] == {"egressd": {"condition": "service_healthy"}}
    assert egressd["sysctls"] == {"net.ipv4.ip_unprivileged_port_start": 1024}
    assert egressd["cap_drop"] == ["ALL"] and egressd["cap_add"] == ["NET_ADMIN", "NET_BIND_SERVICE"]
    assert task["cap_drop"] == ["ALL"] and "volumes" not in task
    cmd = egressd["command"]
    ready = cmd[cmd.index("--ready-file") + 1]
    assert egressd["healthcheck"]["test"] == ["CMD", "test", "-f", ready]
    assert any(v.endswith(":/run/egressd") for v in egressd["volumes"])


@pytest.mark.host
def test_agent_daemonset_manifest(tmp_path):
    """The DaemonSet runs the agent as tests/container/test_agent.py does under Podman: the
    host's pids, the same capabilities, the socket and state on host paths; its example
    policy is valid."""
    import test_agent
    docs = list(yaml.safe_load_all((KUBE / "egressd-agent-daemonset.yaml").read_text()))
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and not spec.get("hostNetwork")
    # One agent per state directory: an update must stop the old pod before it starts the new.
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    agent = by_name(spec["containers"])["agent"]
    caps = agent["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"] and sorted(caps["add"]) == sorted(test_agent.AGENT_CAPS)
    args = agent["args"]
    assert args[0] == "agent"
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    sock, state = args[args.index("--socket") + 1], args[args.index("--state-dir") + 1]
    assert str(Path(sock).parent) == mounts["run"] and volumes["run"]["hostPath"]["path"] == "/run/egressd"
    assert state == mounts["state"] and "hostPath" in volumes["state"]
    assert agent["readinessProbe"]["exec"]["command"] == ["egressctl", "--socket", sock, "ping"]
    policy = tmp_path / "policy.yaml"
    policy.write_text(cm["data"]["policy.yaml"])
    cp = podlab.labmod.run([str(podlab.labmod.egressd_binary()), "check", "--config", str(policy)], check=False)
    assert cp.returncode == 0, cp.stderr
