"""egressd as a container in a task container's network namespace, driven from the host
through the bind-mounted socket (container/podman.md: the task owns the namespace):

    podman run -d --name task --network NET <task image>
    podman run -d --network container:task --cap-drop all --cap-add NET_ADMIN \
        -v HOSTDIR:/run/egressd localhost/egressd:latest run --phase P --ready-file /run/egressd/ready
    egressctl --socket HOSTDIR/egressd.sock ...      (or one JSON line on the socket)
"""
import json
import os
import time

import pytest

import podlab
from podlab import DNS_SERVER, SERVER_A, SERVER_B, echo, egressctl, reachable, request, wait_for


def start_egressd(pods, task, sockdir, *args, ready=True):
    """egressd in `task`'s namespace with NET_ADMIN only; waits for its ready file."""
    (sockdir / "ready").unlink(missing_ok=True)
    c = pods.run(podlab.IMAGE, "run", *args, "--ready-file", "/run/egressd/ready", name="egressd",
                 network=f"container:{task.name}", caps=podlab.EGRESSD_CAPS, volumes=(f"{sockdir}:/run/egressd",))
    if ready:
        wait_ready(c, sockdir)
    return c


def wait_ready(c, sockdir, timeout=10.0):
    def ready():
        if (sockdir / "ready").exists():
            return True
        if not c.running:
            raise AssertionError(f"{c.name} exited {c.exit_code} before ready:\n{c.logs()}")
        return False
    wait_for(ready, timeout, f"{c.name} ready file")


def status(sock):
    cp = egressctl(sock, "status", "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def test_task_sees_the_policy_the_host_sets(pods, scratch):
    task = pods.task()
    start_egressd(pods, task, scratch, "--phase", "allowlist", "--allow", SERVER_A)
    sock = scratch / "egressd.sock"
    ns = task.netns()

    assert reachable(ns) == {SERVER_A}
    # The same from a process inside the task container.
    assert "server-a" in podlab.http_from(task, SERVER_A)
    assert podlab.http_from(task, SERVER_B) == ""
    assert ns.ping(SERVER_B).prohibited
    st = status(sock)
    assert (st["phase"], st["mode"], st["generation"]) == ("allowlist", "allowlist", 1)
    assert [(e["entry"], e["state"]) for e in st["entries"]] == [(SERVER_A, "active")]

    # One JSON line on the socket, one back: the orchestrator's way.
    reply = request(sock, {"cmd": "apply", "mode": "no-network"})
    assert reply["ok"] is True and reply["mode"] == "no-network" and reply["generation"] == 2, reply
    assert reachable(ns) == set()

    cp = egressctl(sock, "apply", "--mode", "public")
    assert cp.returncode == 0, cp.stderr
    assert reachable(ns) == {SERVER_A, SERVER_B}

    cp = egressctl(sock, "apply", "--mode", "allowlist", "--allow", SERVER_B)
    assert cp.returncode == 0, cp.stderr
    assert reachable(ns) == {SERVER_B}

    # Back to the named phase the daemon staged at start.
    cp = egressctl(sock, "apply", "allowlist")
    assert cp.returncode == 0, cp.stderr
    assert reachable(ns) == {SERVER_A}
    assert status(sock)["generation"] == 5

    # An invalid request changes nothing.
    cp = egressctl(sock, "apply", "--mode", "allowlist", "--allow", "203.0.113.140/24")
    assert cp.returncode == 2 and "203.0.113.140/24" in cp.stderr
    assert status(sock)["generation"] == 5
    assert reachable(ns) == {SERVER_A}


def test_switch_cuts_an_open_flow(pods, scratch):
    """A switch cuts the flows its phase does not allow, and the client learns it at once: with
    an allowlist of addresses the flow reaper aborts the socket; with a hostname entry it keeps
    every peer (an address learned later may allow it), and the flow's next packet gets the
    deny's reset, which must get back to the client over `lo` (it once hung until its own
    timeout, dropped as a forged source)."""
    task = pods.task()
    start_egressd(pods, task, scratch, "--phase", "public")
    ns = task.netns()
    sock = scratch / "egressd.sock"
    for allow in ([SERVER_A], ["a.example.com"]):  # a.example.com resolves to SERVER_A
        assert egressctl(sock, "apply", "--mode", "public").returncode == 0
        flow = ns.tcp_flow(SERVER_B, podlab.ECHO_PORT)
        try:
            assert flow.exchange() == "ok"
            cp = egressctl(sock, "apply", "--mode", "allowlist", *(a for e in allow for a in ("--allow", e)))
            assert cp.returncode == 0, cp.stderr
            out = flow.exchange(timeout=2.0)
            assert out == "reset" and out.elapsed < 0.5, f"allow {allow}: the cut flow got {out!r}"
            assert echo(ns, SERVER_A) == "ok"
            assert echo(ns, SERVER_B) != "ok"
        finally:
            flow.close()


def test_restart_keeps_the_policy_and_adopts_it(pods, scratch):
    task = pods.task()
    ed = start_egressd(pods, task, scratch, "--phase", "public")
    sock = scratch / "egressd.sock"
    ns = task.netns()
    cp = egressctl(sock, "apply", "--mode", "allowlist", "--allow", SERVER_B)
    assert cp.returncode == 0, cp.stderr
    assert reachable(ns) == {SERVER_B}

    # Killed: nothing reverts, nothing opens (fail closed), and nobody answers the socket.
    ed.kill("KILL")
    ed.wait_exit()
    assert reachable(ns) == {SERVER_B}
    cp = egressctl(sock, "status")
    assert cp.returncode == 1 and "cannot reach egressd" in cp.stderr

    # The same container started again adopts the inline policy at the same generation
    # (its --phase public only applies to a fresh start).
    (scratch / "ready").unlink(missing_ok=True)
    ed.start()
    wait_ready(ed, scratch)
    st = status(sock)
    assert (st["mode"], st["generation"]) == ("allowlist", 2), st
    assert [e["entry"] for e in st["entries"]] == [SERVER_B]
    assert reachable(ns) == {SERVER_B}

    # A graceful stop leaves it in force too, and a new container of the image adopts it.
    ed.stop()
    assert ed.exit_code == 0, ed.logs()
    assert reachable(ns) == {SERVER_B}
    ed.remove()
    ed2 = start_egressd(pods, task, scratch, "--phase", "no-network")
    st = status(sock)
    assert (st["mode"], st["generation"]) == ("allowlist", 2), st
    assert "adopted" in ed2.logs()
    cp = egressctl(sock, "apply", "--mode", "public")
    assert cp.returncode == 0, cp.stderr
    assert status(sock)["generation"] == 3
    assert reachable(ns) == {SERVER_A, SERVER_B}


def test_needs_net_admin_and_says_so(pods, scratch):
    task = pods.task()
    c = pods.run(podlab.IMAGE, "run", "--phase", "no-network", name="egressd-nocap",
                 network=f"container:{task.name}", caps=("NET_BIND_SERVICE", "NET_RAW"),
                 volumes=(f"{scratch}:/run/egressd",))
    code = c.wait_exit()
    assert code == 1, c.logs()
    assert c.logs().startswith("error: "), c.logs()
    # Nothing was installed: the task is as open as before.
    assert reachable(task.netns()) == {SERVER_A, SERVER_B}
    assert "NET_ADMIN" in c.logs(), c.logs()


def test_names_allowed_and_refused(pods, scratch, session):
    """The DNS proxy in the task's namespace: allowlisted names resolve and open their
    addresses, other names are refused at once and never reach the upstream."""
    task = pods.task()
    ed = start_egressd(pods, task, scratch, "--phase", "allowlist", "--allow", "a.example.com",
                       "--allow", "*.wild.example.org")
    assert f"upstream={DNS_SERVER}" in ed.logs()
    ns = task.netns()
    # a.example.com was resolved when the phase was installed: reachable before any lookup.
    assert reachable(ns) == {SERVER_A}

    r = ns.dns_query("a.example.com", server=DNS_SERVER)
    assert (r.rcode, r.addresses) == ("NOERROR", [SERVER_A]), r
    r = ns.dns_query("b.example.com", server=DNS_SERVER)
    assert r.rcode == "REFUSED" and r.outcome.elapsed < 0.5, r
    assert reachable(ns) == {SERVER_A}
    # A name that would carry data out (unique to this test, so the upstream's log is clear).
    secret = f"c2VjcmV0-{os.getpid()}-{int(time.monotonic() * 1000)}.example.com"
    assert ns.dns_query(secret, server=DNS_SERVER).rcode == "REFUSED"

    # A wildcard entry opens what its names resolve to, once resolved through egressd.
    r = ns.dns_query("deep.x.wild.example.org", server=DNS_SERVER)
    assert (r.rcode, r.addresses) == ("NOERROR", [SERVER_B]), r
    assert reachable(ns) == {SERVER_A, SERVER_B}
    assert ns.dns_query("wild.example.org", server=DNS_SERVER).rcode == "REFUSED"  # not the apex

    # Every resolver address is intercepted, over UDP and TCP: a query to a server that runs
    # no DNS at all is answered by egressd.
    assert ns.dns_query("a.example.com", server=SERVER_A).addresses == [SERVER_A]
    assert ns.dns_query("b.example.com", server=SERVER_A, tcp=True).rcode == "REFUSED"

    # The same from a process in the task.
    out = task.exec("busybox", "nslookup", "-type=a", "b.example.com").stdout
    assert "REFUSED" in out, out
    out = task.exec("busybox", "nslookup", "-type=a", "a.example.com").stdout
    assert SERVER_A in out, out

    # The upstream saw the allowed names and never the refused one.
    log = session.dns_log()
    assert "a.example.com" in log and "deep.x.wild.example.org" in log
    assert secret not in log

    # no-network refuses every name, locally.
    cp = egressctl(scratch / "egressd.sock", "apply", "--mode", "no-network")
    assert cp.returncode == 0, cp.stderr
    assert ns.dns_query("a.example.com", server=DNS_SERVER).rcode == "REFUSED"


def test_orchestrator_guide_works_as_written(pods, scratch):
    """The Python in container/orchestrator.md, run against a live egressd."""
    import contextlib
    import io
    import re

    text = (podlab.REPO_ROOT / "container" / "orchestrator.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    task = pods.task()
    start_egressd(pods, task, scratch, "--phase", "no-network")
    code = code.replace("/run/egressd-task/egressd.sock", str(scratch / "egressd.sock"))
    out = io.StringIO()
    scope = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "orchestrator.md", "exec"), scope)
    assert out.getvalue() == "4\n"
    assert reachable(task.netns()) == set()
    # The same function reports an error reply as such, and nothing changes.
    with pytest.raises(ValueError, match="invalid_policy"):
        scope["egressd_request"](str(scratch / "egressd.sock"), {"cmd": "apply", "mode": "allowlist",
                                                                 "allow": ["pypi.org:443"]})
    assert status(scratch / "egressd.sock")["generation"] == 4
