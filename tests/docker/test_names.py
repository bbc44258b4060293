"""Issue 14, "Allowlisted names do not resolve under Docker's user-defined networks".

On a user-defined network (what Compose creates) the task's resolver is Docker's
127.0.0.11, so egressd forwards allowed names there; Docker's resolver forwards them on from
inside the task's namespace, where egressd's port-53 redirect sends them straight back to
egressd: a loop until egressd's in-flight limit, and the task gets SERVFAIL. The fix lets
allowed names (and Compose service names, which only Docker's resolver knows) resolve
through Docker's resolver with no loop.

These tests FAIL on today's tree (SERVFAIL, `reason=inflight_limit` in egressd's log); they
pass once the fix lands. Nothing here is marked xfail on purpose: the suite must turn green
by the fix, not by an edit.
"""
import pytest

import dockerlab
from dockerlab import DOCKER_DNS, NOBODY, SERVER_A, SERVER_B
from topologies import TOPOLOGIES


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_allowlisted_names_resolve_and_connect(sandboxes, session, topology):
    mark = session.dns_mark()
    sb = sandboxes(topology, "allowlist", ["a.example.com"])
    # A task process asks its resolver (resolv.conf: Docker's 127.0.0.11), as any program does.
    r = sb.probe("query", "a.example.com", DOCKER_DNS, user=NOBODY)
    assert (r["rcode"], r["addresses"]) == ("NOERROR", [SERVER_A]), \
        f"allowed a.example.com through Docker's resolver: {r}"
    assert sb.reachable() == {SERVER_A}
    # Another name is refused, never forwarded, and its address stays closed.
    assert sb.probe("query", "b.example.com", DOCKER_DNS)["rcode"] == "REFUSED"
    assert "b.example.com" not in session.dns_log(since=mark)
    assert "inflight_limit" not in sb.logs()

    # A switch to a name not resolved before pre-resolves it: open the moment the tool returns.
    sb.apply("allowlist", "b.example.com")
    assert sb.reachable() == {SERVER_B}, "b.example.com allowed by a switch: its address is not open"

    # A wildcard opens what its names resolve to, once resolved.
    sb.apply("allowlist", "*.wild.example.org")
    assert sb.reachable() == set()
    r = sb.probe("query", "deep.x.wild.example.org", DOCKER_DNS)
    assert (r["rcode"], r["addresses"]) == ("NOERROR", [SERVER_B]), \
        f"allowed deep.x.wild.example.org (by *.wild.example.org): {r}"
    assert sb.reachable() == {SERVER_B}


def test_compose_service_names_resolve_when_allowed(sandboxes):
    """A service of the task's compose file on the project network (Harbor leaves services
    that declare `networks` there): `main` reaches it by its service name when the name is
    allowed, and not when it is not."""
    sb = sandboxes("harbor", "allowlist", ["helper"], helper=True)
    helper = sb.project.container("helper")
    addr = helper.inspect("{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
    ns = sb.ns()
    r = sb.probe("query", "helper", DOCKER_DNS, user=NOBODY)
    assert (r["rcode"], r["addresses"]) == ("NOERROR", [addr]), f"allowed service name helper ({addr}): {r}"
    assert ns.tcp_connect(addr, dockerlab.ECHO_PORT) == "ok"
    sb.apply("allowlist", SERVER_A)
    assert sb.probe("query", "helper", DOCKER_DNS)["rcode"] == "REFUSED"
    out = ns.tcp_connect(addr, dockerlab.ECHO_PORT)
    assert out == "refused" and out.elapsed < 0.5, out
