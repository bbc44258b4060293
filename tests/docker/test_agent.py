"""egressd agent as a Docker container (container/kubernetes/egressd-agent-daemonset.yaml's
shape: the host's pid namespace, the agent socket on a host directory, only the capabilities
the manifest grants) attaching real Docker task containers by the pid Docker reports, as an
orchestrator on the host would (README "Agent mode"; the Podman version is
tests/container/test_agent.py):

    docker run -d --pid host --network NET --dns GATEWAY --cap-drop ALL \\
        --cap-add NET_ADMIN --cap-add NET_BIND_SERVICE --cap-add NET_BROADCAST --cap-add SYS_ADMIN \\
        --cap-add SYS_PTRACE \\
        -v HOSTDIR:/run/egressd EGRESSD_IMAGE agent --socket /run/egressd/agent.sock
    egressctl --socket HOSTDIR/agent.sock sandbox add task \\
        --netns-pid $(docker inspect -f '{{.State.Pid}}' task) ...

The tasks are the suite's task containers (Docker's default capabilities, resolv.conf naming
Docker's embedded resolver 127.0.0.11, which forwards to the session's dnsmasq).
"""
import json

from dockerlab import DNS_SERVER, DOCKER_DNS, SERVER_A, SERVER_B, egressctl, reachable, wait_for
from lab import AGENT_CAPS, agent_policy

AGENT_SOCKET = "/run/egressd/agent.sock"   # in the agent container; a host directory is mounted there


def start_agent(session, containers):
    scratch = session.tmp / session.name("agent-run")
    scratch.mkdir()
    # The agent asks upstream from its own namespace: the session's dnsmasq on the gateway
    # (in the DaemonSet that is cluster DNS).
    (scratch / "policy.yaml").write_text(agent_policy(DNS_SERVER))
    net = session.network("v4")
    c = containers.run(session.egressd_image, "agent", "--socket", AGENT_SOCKET, name="agent", network=net.name,
                       dns=net.dns, caps=AGENT_CAPS, volumes=(f"{scratch}:/run/egressd",), extra=["--pid", "host"],
                       logs=True)
    sock = scratch / "agent.sock"

    def up():
        if not c.running:
            raise AssertionError(f"the agent exited {c.exit_code}:\n{c.logs()}")
        return sock.exists() and egressctl(sock, "ping").returncode == 0
    wait_for(up, 15, "the agent's socket")
    return c, sock


def ok(sock, *args):
    cp = egressctl(sock, *map(str, args))
    assert cp.returncode == 0, f"egressctl {' '.join(map(str, args))} exited {cp.returncode}: {cp.stdout}{cp.stderr}"
    return cp.stdout


def listing(sock):
    return {e["name"]: e for e in json.loads(ok(sock, "sandbox", "list", "--json"))["sandboxes"]}


def status(sock, name):
    return json.loads(ok(sock, "--sandbox", name, "status", "--json"))


def test_agent_container_attaches_docker_tasks_by_pid(session, containers):
    agent, sock = start_agent(session, containers)
    one, two = containers.task("one"), containers.task("two")
    ok(sock, "sandbox", "add", "one", "--netns-pid", one.pid, "--config", "/run/egressd/policy.yaml")
    ok(sock, "sandbox", "add", "two", "--netns-pid", two.pid, "--mode", "allowlist", "--allow", SERVER_B)
    assert {n: (e["pid"], e["phase"]) for n, e in listing(sock).items()} == {
        "one": (one.pid, "agent"), "two": (two.pid, "allowlist")}

    # Each task under its own policy: one reaches only the name it may resolve, two only its IP entry.
    assert reachable(one.netns()) == {SERVER_A}
    assert reachable(two.netns()) == {SERVER_B}
    # One socket in the agent's namespace hears both tasks' nftables changes (NET_BROADCAST).
    assert "nftables events: one socket for every sandbox; interface changes: one socket for every sandbox" in agent.logs()

    # A task process resolves as Docker set it up (resolv.conf: Docker's resolver, 127.0.0.11):
    # the agent answers in the task's namespace, by the task's policy.
    mark = session.dns_mark()
    r = one.probe("query", "a.example.com", DOCKER_DNS)
    assert (r["rcode"], r["addresses"]) == ("NOERROR", [SERVER_A]), r
    r = one.probe("query", "b.example.com", DOCKER_DNS)
    assert r["rcode"] == "REFUSED", r
    r = two.probe("query", "a.example.com", DOCKER_DNS)
    assert r["rcode"] == "REFUSED", r
    # The upstream exchange left from the agent's own namespace (its address on the network),
    # never from the task's: no task address appears in the upstream's log.
    agent_ip, one_ip, two_ip = agent.ipv4, one.ipv4, two.ipv4
    assert len({agent_ip, one_ip, two_ip}) == 3 and all((agent_ip, one_ip, two_ip)), (agent_ip, one_ip, two_ip)
    log = session.dns_log(since=mark).lower()   # egressd asks in 0x20 mixed case
    assert f"a.example.com from {agent_ip}" in log, log
    assert f"from {one_ip}" not in log and f"from {two_ip}" not in log, log
    assert "b.example.com" not in log, log   # refused by the proxy, never asked upstream

    # A named switch changes that sandbox only.
    before = status(sock, "two")
    ok(sock, "--sandbox", "one", "apply", "verifier")
    assert reachable(one.netns()) == set()
    assert reachable(two.netns()) == {SERVER_B}
    after = status(sock, "two")
    assert (after["phase"], after["generation"]) == (before["phase"], before["generation"]), (before, after)
    assert status(sock, "one")["phase"] == "verifier"

    # The task container is killed: its sandbox goes from the agent's list, the other stays.
    two.kill()
    wait_for(lambda: set(listing(sock)) == {"one"}, 10, "sandbox two to go with its container")
    assert status(sock, "one")["phase"] == "verifier"
    assert reachable(one.netns()) == set()
