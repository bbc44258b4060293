"""egressd under real Docker, in each topology (topologies.py): the policy a task sees in
allowlist and no-network, switches that return once the kernel has them, the topology's
own plumbing. All of this holds on today's tree.

Checked from the task's namespace with the lab's clients (exact outcomes: a denied TCP
connection is reset within 0.5 s) and from processes in the task (busybox nc, taskprobe.py).
"""
import os
import time

import pytest

import dockerlab
from dockerlab import DOCKER_DNS, DNS_SERVER, NOBODY, SERVER_A, SERVER_B, V6
from topologies import TOPOLOGIES


def secret_name(what: str) -> str:
    """A name unique to this test run: if the upstream's log ever shows it, it leaked."""
    return f"{what}-{os.getpid()}-{time.monotonic_ns() % 10**9}.example.com"


def nc_echo(task, addr: str, user: str | None = None) -> bool:
    """Does `nc` inside the task get its line echoed by ADDR:7?"""
    cp = task.exec("sh", "-c", f"echo hello-{os.getpid()} | nc -w 2 {addr} 7", user=user)
    return f"hello-{os.getpid()}" in cp.stdout


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_allowlist(sandboxes, session, topology):
    """An allowed address connects, another is reset at once; a name that is not allowed is
    refused locally, from any resolver address, and never reaches the upstream."""
    sb = sandboxes(topology, "allowlist", [SERVER_A])
    ns = sb.ns()
    assert sb.reachable() == {SERVER_A}
    assert nc_echo(sb.task, SERVER_A) and not nc_echo(sb.task, SERVER_B)
    assert nc_echo(sb.task, SERVER_A, user=NOBODY)
    assert ns.ping(SERVER_B).prohibited

    secret = secret_name("allowlist")
    for server in (DOCKER_DNS, DNS_SERVER, SERVER_B):
        r = ns.dns_query(secret, server=server)
        assert r.rcode == "REFUSED" and r.outcome.elapsed < 0.5, (server, r)
    r = sb.probe("query", secret, DOCKER_DNS, user=NOBODY)   # the task's resolv.conf resolver
    assert r["rcode"] == "REFUSED", r
    r = sb.probe("query", secret, DOCKER_DNS, "--tcp")
    assert r["rcode"] == "REFUSED", r
    assert secret not in session.dns_log()
    st = sb.status()
    assert st["mode"] == "allowlist" and [e["entry"] for e in st["entries"]] == [SERVER_A], st


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_no_network(sandboxes, session, topology):
    sb = sandboxes(topology, "no-network")
    ns = sb.ns()
    assert sb.reachable() == set()
    assert not nc_echo(sb.task, SERVER_A)
    assert ns.ping(SERVER_A).prohibited
    secret = secret_name("no-network")
    for name in ("a.example.com", secret):
        assert ns.dns_query(name, server=DOCKER_DNS).rcode == "REFUSED"
        assert sb.probe("query", name, DOCKER_DNS, user=NOBODY)["rcode"] == "REFUSED"
    assert secret not in session.dns_log()
    # Loopback stays open.
    assert ns.dns_query("a.example.com", server="127.0.0.1").rcode == "REFUSED"
    assert sb.status()["mode"] == "no-network"


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_switches_return_once_the_kernel_has_them(sandboxes, topology):
    """Each switch is checked right after the tool returned: no wait, no retry."""
    sb = sandboxes(topology, "no-network")
    ns = sb.ns()
    assert sb.reachable() == set()
    sb.apply("public")
    assert sb.reachable() == {SERVER_A, SERVER_B}
    sb.apply("allowlist", SERVER_B)
    assert sb.reachable() == {SERVER_B}
    flow = ns.tcp_flow(SERVER_B, dockerlab.ECHO_PORT)
    try:
        sb.apply("allowlist", SERVER_A)
        assert flow.exchange() == "reset"     # the open flow is cut by the switch
    finally:
        flow.close()
    # With a hostname entry the flow reaper keeps every peer (an address learned later may
    # allow it): the deny's reset, back over lo, is what tells the client at once.
    sb.apply("allowlist", SERVER_B)
    flow = ns.tcp_flow(SERVER_B, dockerlab.ECHO_PORT)
    try:
        sb.apply("allowlist", "a.example.com")  # resolves to SERVER_A
        out = flow.exchange(timeout=2.0)
        assert out == "reset" and out.elapsed < 0.5, f"a flow a named allowlist cuts: {out!r}"
    finally:
        flow.close()
    assert sb.reachable() == {SERVER_A}
    sb.apply("allowlist")
    assert sb.reachable() == set()            # no entries: all egress denied
    sb.apply("no-network")
    assert sb.reachable() == set()
    assert sb.status()["mode"] == "no-network"


def test_harbor_topology(sandboxes, session):
    """Harbor's layout as Harbor builds it: `main` in the sidecar's namespace, started once
    the sidecar is healthy, with Docker's default capabilities; the host-gateway entry and
    resolv.conf shared; every network-policy verb through `compose exec`."""
    sb = sandboxes("harbor", "allowlist", [SERVER_A, "*.wild.example.org"])
    main, sidecar = sb.task, sb.sidecar
    assert main.inspect("{{.HostConfig.NetworkMode}}") == f"container:{sidecar.inspect('{{.Id}}')}"
    assert os.readlink(f"/proc/{main.pid}/ns/net") == os.readlink(f"/proc/{sidecar.pid}/ns/net")
    assert sidecar.health == "healthy"
    assert sidecar.exec("test", "-f", dockerlab.HARBOR_READY).returncode == 0   # what the healthcheck runs
    assert sidecar.inspect("{{.HostConfig.Init}}") == "true"
    # main started only after the sidecar's healthcheck passed (depends_on: service_healthy).
    assert main.inspect("{{.State.StartedAt}}") > sidecar.inspect("{{(index .State.Health.Log 0).End}}")
    hosts = main.exec("cat", "/etc/hosts").stdout
    assert "host.docker.internal" in hosts, hosts
    assert main.exec("cat", "/etc/resolv.conf").stdout.split()[:2] == ["nameserver", DOCKER_DNS]
    cap_eff = int(next(l for l in main.exec("cat", "/proc/self/status").stdout.splitlines()
                       if l.startswith("CapEff:")).split()[1], 16)
    assert cap_eff & (1 << 13), "main should hold Docker's default NET_RAW"          # CAP_NET_RAW
    assert not cap_eff & (1 << 12), "main must not hold NET_ADMIN"                    # CAP_NET_ADMIN
    assert "dns_port=53 " in sb.logs(), sb.logs()

    assert sb.reachable() == {SERVER_A}
    out = sb.policy("deny-all")
    assert out.returncode == 0 and out.stdout.startswith("egress policy: no-network (generation 2"), out
    assert sb.reachable() == set()
    out = sb.policy("allow", SERVER_B)
    assert out.returncode == 0 and out.stdout.startswith("egress policy: allowlist, 1 entry"), out
    assert sb.reachable() == {SERVER_B}
    out = sb.policy("allow")
    assert out.returncode == 0 and "no entries: all egress denied" in out.stdout, out
    assert sb.reachable() == set()
    out = sb.policy("allow-all")
    assert out.returncode == 0 and out.stdout.startswith("egress policy: public"), out
    assert sb.reachable() == {SERVER_A, SERVER_B}
    out = sb.policy("show")
    assert out.returncode == 0 and "mode:        public" in out.stdout, out
    assert sb.status()["generation"] == 5
    out = sb.policy("rules")
    assert out.returncode == 0 and "table inet egressd" in out.stdout, out
    out = sb.policy("allow", "pypi.org:443")
    assert out.returncode == 2 and "pypi.org:443" in out.stderr, out
    assert sb.status()["generation"] == 5


def test_netns_pid_topology(sandboxes, session):
    """A host egressd joining a running task by pid: it enforces there, not on the host,
    and asks Docker's resolver of the task (its policy file's upstream)."""
    sb = sandboxes("netns-pid", "allowlist", [SERVER_A])
    assert f"upstream={DOCKER_DNS}" in sb.logs(), sb.logs()
    assert sb.reachable() == {SERVER_A}
    assert "table inet egressd" not in dockerlab.labmod.run(["nft", "list", "tables"]).stdout
    # The task's processes keep Docker's default capabilities, NET_RAW among them. A host
    # egressd sees the cgroup v2 hierarchy, finds the cgroup of Docker's resolver (dockerd's)
    # and so stops answers forged from the resolver's own port (test_attacks.py): nothing to
    # warn about (the warning when it cannot: tests/integration/test_dns_integrity.py).
    cap_eff = sb.task.exec("grep", "CapEff", "/proc/self/status").stdout.split()[1]
    assert int(cap_eff, 16) & (1 << 13), cap_eff
    found = [line for line in sb.logs().splitlines() if f"upstream {DOCKER_DNS} answers from cgroup id" in line]
    assert len(found) == 1, sb.logs()
    assert not [line for line in sb.logs().splitlines() if "may use raw sockets" in line], sb.logs()


def test_compose_example_as_shipped(sandboxes):
    """container/compose.yaml: healthy once the policy is in the kernel, closed from the
    start, the socket in ./egressd-run on the host; the shipped task holds no capability and
    runs in egressd's namespace."""
    sb = sandboxes("compose-example", "no-network")
    dockerlab.wait_for(lambda: sb.egressd.health == "healthy", 15.0, "the shipped healthcheck to pass")
    assert sb.egressd.inspect("{{.HostConfig.RestartPolicy.Name}}") == "unless-stopped"
    assert sb.status()["mode"] == "no-network"
    assert sb.reachable() == set()
    cap_eff = sb.task.exec("grep", "CapEff", "/proc/self/status").stdout.split()[1]
    assert int(cap_eff, 16) == 0, cap_eff
    assert (sb.run_dir / "egressd.sock").is_socket()
    assert os.stat(f"/proc/{sb.task.pid}/ns/net").st_ino == os.stat(f"/proc/{sb.egressd.pid}/ns/net").st_ino


@pytest.mark.parametrize("topology", ["compose-example", "harbor"])
def test_a_restarted_task_comes_back_into_egressds_namespace_and_policy(sandboxes, topology):
    """Docker gives a restarted container a new network namespace. Where the task owned it, a
    restarted task came back with no policy at all while egressd, left in the old one, stayed
    healthy (attack review 11). Where egressd owns it, the task joins it again, policy and all."""
    sb = sandboxes(topology, "allowlist", [SERVER_A])
    assert sb.reachable() == {SERVER_A}
    dockerlab.docker("restart", "--time", "1", sb.task.ref, timeout=60)
    dockerlab.wait_for(lambda: sb.task.running, 20.0, "the restarted task")
    assert sb.reachable() == {SERVER_A}
    assert sb.status()["mode"] == "allowlist"


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_ipv6_network(sandboxes, topology):
    """On a dual-stack network (docker network create --ipv6): IPv6 is enforced like IPv4."""
    sb = sandboxes(topology, "allowlist", [V6.server_a4, V6.server_a6], network="v6")
    assert sb.reachable() == {V6.server_a4, V6.server_a6}
    assert sb.ns().ping(V6.server_b6).prohibited
    sb.apply("no-network")
    assert sb.reachable() == set()
