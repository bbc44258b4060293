"""egressd agent as a container (container/kubernetes/egressd-agent-daemonset.yaml's shape:
the host's pid namespace, the agent socket on a host directory) attaching real Podman task
containers by the pid Podman reports, as a CRI would:

    podman run -d --pid host --network NET --cap-drop all --cap-add NET_ADMIN,NET_BIND_SERVICE,NET_BROADCAST,SYS_ADMIN,SYS_PTRACE \
        -v HOSTDIR:/run/egressd localhost/egressd:latest agent --socket /run/egressd/agent.sock
    egressctl --socket HOSTDIR/agent.sock sandbox add task --netns-pid $(podman inspect -f '{{.State.Pid}}' task) ...
"""
import json
import subprocess

import podlab
from podlab import DNS_SERVER, SERVER_A, SERVER_B, egressctl, reachable, wait_for
from lab import AGENT_CAPS, agent_policy


def start_agent(pods, scratch):
    (scratch / "policy.yaml").write_text(agent_policy(DNS_SERVER))
    c = pods.run(podlab.IMAGE, "agent", "--socket", "/run/egressd/agent.sock", name="agent",
                 network=pods.session.network, caps=AGENT_CAPS, volumes=(f"{scratch}:/run/egressd",),
                 extra=["--pid", "host"])
    sock = scratch / "agent.sock"

    def up():
        if not c.running:
            raise AssertionError(f"the agent exited {c.exit_code}:\n{c.logs()}")
        return sock.exists() and egressctl(sock, "ping").returncode == 0
    wait_for(up, 15, "the agent's socket")
    return c, sock


def ok(sock, *args):
    cp = egressctl(sock, *args)
    assert cp.returncode == 0, f"egressctl {' '.join(map(str, args))}: {cp.stderr}"
    return cp.stdout


def listing(sock):
    return {e["name"]: e for e in json.loads(ok(sock, "sandbox", "list", "--json"))["sandboxes"]}


def test_agent_attaches_podman_tasks_by_pid(pods, scratch):
    agent, sock = start_agent(pods, scratch)
    one, two = pods.task("one"), pods.task("two")
    ok(sock, "sandbox", "add", "one", "--netns-pid", one.pid, "--config", "/run/egressd/policy.yaml")
    ok(sock, "sandbox", "add", "two", "--netns-pid", two.pid, "--mode", "allowlist", "--allow", SERVER_B)

    # Each task under its own policy, from the host's view and from inside the container.
    assert reachable(one.netns()) == {SERVER_A}
    assert reachable(two.netns()) == {SERVER_B}
    r = one.netns().dns_query("a.example.com", server=DNS_SERVER)
    assert (r.rcode, r.addresses) == ("NOERROR", [SERVER_A]), r
    assert one.netns().dns_query("b.example.com", server=DNS_SERVER).rcode == "REFUSED"
    out = one.exec("busybox", "nslookup", "-type=a", "a.example.com").stdout
    assert SERVER_A in out, out
    # Upstream DNS left from the agent's own namespace (its address on the network), never the task's.
    agent_ip = agent.inspect("{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
    one_ip = one.inspect("{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
    log = pods.session.dns_log()
    assert agent_ip and one_ip and agent_ip != one_ip
    assert f"a.example.com from {agent_ip}" in log and f"from {one_ip}" not in log, log

    # One socket in the agent's namespace hears both tasks' nftables changes (NET_BROADCAST):
    # one's table deleted from the host is put back at once.
    assert "nftables events: one socket for every sandbox; interface changes: one socket for every sandbox" in agent.logs()
    in_one = ["nsenter", f"--net=/proc/{one.pid}/ns/net", "nft"]
    subprocess.run([*in_one, "delete", "table", "inet", "egressd"], check=True, timeout=10)
    wait_for(lambda: subprocess.run([*in_one, "list", "table", "inet", "egressd"], capture_output=True,
                                    timeout=10).returncode == 0, 5, "one's table to be restored")
    assert reachable(one.netns()) == {SERVER_A}

    ok(sock, "--sandbox", "one", "apply", "verifier")
    assert reachable(one.netns()) == set()
    assert reachable(two.netns()) == {SERVER_B}
    assert set(listing(sock)) == {"one", "two"}

    # The task's process exits: its sandbox goes (pidfd), the other stays.
    two.kill()
    wait_for(lambda: set(listing(sock)) == {"one"}, 10, "sandbox two to go with its container")
    assert json.loads(ok(sock, "--sandbox", "one", "status", "--json"))["phase"] == "verifier"
