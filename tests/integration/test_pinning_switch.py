"""Hostname pinning across switches (docs/pinning.md "Switches", issue 16 point 6).

A flow admitted because it presented name N is cut when the phase switched to does not allow
N, even when that phase still allows the flow's address through another name (a shared CDN
address): the address alone would let it on. A phase that allows N too keeps it.

Lab as test_pinning.py: allowed.test and same-ip.test both resolve to 203.0.113.10 /
2001:db8:3::10; a TLS echo server on 8443 in the internet namespace.
"""
import socket
import ssl

import pytest

from lab import DNS_V4
from test_agent import agent  # noqa: F401 (fixture)
from test_pinning_attacks import tls_from_port
from test_pinning import TLS_PORT, V4, V6, assert_reset, connect, learn, outcome, servers  # noqa: F401 (fixture)

POLICY = f"""\
initial_phase: agent
dns: {{ upstream: ["{DNS_V4}"] }}
phases:
  agent:
    network_mode: allowlist
    allowed_hosts: [allowed.test]
  sibling:
    network_mode: allowlist
    allowed_hosts: [same-ip.test]
  both:
    network_mode: allowlist
    allowed_hosts: [allowed.test, same-ip.test]
  by_address:
    network_mode: allowlist
    allowed_hosts: [same-ip.test, 203.0.113.10, "2001:db8:3::10"]
  open: public
"""


def open_tls(lab, addr, sni):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    t = ctx.wrap_socket(connect(lab, addr, TLS_PORT), server_hostname=sni)
    t.sendall(b"one")
    assert t.recv(100) == b"tls:one"
    return t


def exchange(t, what=b"two"):
    def run():
        t.sendall(what)
        data = t.recv(100)
        if not data:
            raise ConnectionResetError
        return data
    return outcome(run)


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_flow_admitted_for_a_name_is_cut_when_the_new_phase_allows_its_address_only_by_another(
        lab, egressd, servers, addr):  # noqa: F811
    d = egressd(POLICY)
    learn(lab, "allowed.test")
    t = open_tls(lab, addr, "allowed.test")
    rc, _, err = d.ctl("apply", "sibling")
    assert rc == 0, err
    # The address is allowed in sibling, through same-ip.test.
    learn(lab, "same-ip.test")
    kind, value = exchange(t)
    assert kind != "ok", f"a flow admitted for allowed.test survived a switch to a phase that allows only " \
                         f"same-ip.test on the same address: {value!r}"
    assert_reset((kind, value), "the cut flow")  # the deny's reset, not a client left waiting
    t.close()
    assert "pin: cut flows=1" in d.log()
    # The address itself still works in sibling, for its own name.
    open_tls(lab, addr, "same-ip.test").close()


def test_a_flow_admitted_for_a_name_the_new_phase_allows_too_goes_on(lab, egressd, servers):  # noqa: F811
    d = egressd(POLICY)
    learn(lab, "allowed.test")
    t = open_tls(lab, V4, "allowed.test")
    rc, _, err = d.ctl("apply", "both")
    assert rc == 0, err
    assert exchange(t) == ("ok", b"tls:two")
    # And back to a phase that does not allow it: now it is cut.
    rc, _, err = d.ctl("apply", "sibling")
    assert rc == 0, err
    learn(lab, "same-ip.test")
    assert_reset(exchange(t, b"three"), "the flow cut by the switch back")
    t.close()


@pytest.mark.parametrize("addr", [V4, V6])
def test_the_port_of_a_cut_flow_serves_a_new_connection_judged_afresh(lab, egressd, servers, addr):  # noqa: F811
    """The deny's reset of a cut flow reaches the client only: conntrack keeps the entry with
    the cut mark, and the client's port is free for its next connection. A new connection from
    that port to the same server (the kernel hands freed ports out again) is a new connection,
    judged by the phase in force on its own hello, not refused for good on the old one's mark,
    nor admitted on it."""
    d = egressd(POLICY)
    learn(lab, "allowed.test")
    sport = 47031 if addr == V4 else 47032
    s = lab.sandbox.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.settimeout(3.0)
    s.bind(("::" if ":" in addr else "0.0.0.0", sport))
    s.connect((addr, TLS_PORT))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    t = ctx.wrap_socket(s, server_hostname="allowed.test")
    assert exchange(t, b"one") == ("ok", b"tls:one")
    assert d.ctl("apply", "sibling")[0] == 0
    learn(lab, "same-ip.test")
    assert_reset(exchange(t), "the cut flow")
    t.close()
    # sibling allows the address through same-ip.test: a new connection from the cut flow's
    # port presenting same-ip.test is admitted, one presenting allowed.test is reset.
    assert tls_from_port(lab, addr, "same-ip.test", sport) == ("ok", b"tls:ping")
    assert_reset(tls_from_port(lab, addr, "allowed.test", sport), "allowed.test in sibling on the cut flow's port")
    assert d.ctl("apply", "agent")[0] == 0
    assert tls_from_port(lab, addr, "allowed.test", sport) == ("ok", b"tls:ping")


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_flow_admitted_before_a_restart_is_cut_by_a_later_switch(lab, egressd, servers, addr):  # noqa: F811
    """The reader knows the flows it admitted, in memory: a restarted egressd (the table and its
    marks adopted) knew none, so a switch cut nothing and the new phase's chain re-marked the
    flow by its address (allowed there through same-ip.test), and the flow admitted for
    allowed.test went on (found by an attack review). Now the flows conntrack holds with the
    adopted phase's mark are adopted at start, their name unknown: a switch keeps them only
    where an address entry, or a public phase, allows them."""
    d = egressd(POLICY)
    learn(lab, "allowed.test")
    t = open_tls(lab, addr, "allowed.test")
    d.restart()  # SIGTERM, same config: the table (phase agent, its marks) is adopted
    assert "pin: adopted flows=1" in d.log(), d.log()
    assert exchange(t, b"mid") == ("ok", b"tls:mid")  # the restart itself cuts nothing
    assert d.ctl("apply", "sibling")[0] == 0
    learn(lab, "same-ip.test")  # the address is allowed in sibling, only through same-ip.test
    assert_reset(exchange(t), "a flow admitted for allowed.test before the restart, after the switch to sibling")
    t.close()


@pytest.mark.parametrize("phase", ["by_address", "open"])
def test_a_flow_admitted_before_a_restart_goes_on_where_the_address_alone_decides(
        lab, egressd, servers, phase):  # noqa: F811
    d = egressd(POLICY)
    learn(lab, "allowed.test")
    t = open_tls(lab, V4, "allowed.test")
    d.restart()
    assert d.ctl("apply", phase)[0] == 0
    assert exchange(t) == ("ok", b"tls:two")
    t.close()


def test_agent_mode_a_flow_admitted_before_the_agents_restart_is_cut_by_a_later_switch(
        lab, agent, servers):  # noqa: F811
    """The same in agent mode: the agent re-attaches the sandbox from its state dir and adopts
    its table, and with it the flows conntrack holds under the phase in force."""
    import signal
    agent.ok("sandbox", "add", "one", "--netns", lab.sandbox.path, "--config", lab.write_config(POLICY))
    learn(lab, "allowed.test")
    t = open_tls(lab, V4, "allowed.test")
    agent.stop(signal.SIGKILL)
    agent.start()
    assert exchange(t, b"mid") == ("ok", b"tls:mid")
    agent.ok("--sandbox", "one", "apply", "sibling")
    learn(lab, "same-ip.test")
    assert_reset(exchange(t), "a flow admitted for allowed.test before the agent's restart, after the switch to sibling")
    t.close()


# ---- connections the phase in force never judged by name (docs/pinning.md "Switches") ----------
# Found in an attack review (2026-12-06), as uid 65534 with no capability: a connection opened
# under a phase that passes by address (public, or an IP entry) went on in the pinned phase
# switched to, re-marked by its address, and its next request named another site on the same
# address; and a followed HTTP connection lost its following after a round trip through such a
# phase. Now such a flow's next packet goes to the reader, which admits it again only if it
# judged the connection by name before (and no longer follows it), and refuses it otherwise.

FOREIGN = "a connection the phase in force never judged by name"


@pytest.mark.parametrize("start", ["open", "by_address"])
def test_a_connection_opened_under_a_phase_that_passes_by_address_is_refused_in_a_pinned_one(
        lab, egressd, servers, start):  # noqa: F811
    from test_pinning import HTTP_PORT
    from test_pinning_attacks import _pin_lines, _req, _responses
    d = egressd(POLICY)
    assert d.ctl("apply", start)[0] == 0
    learn(lab, "same-ip.test")
    s = connect(lab, V4, HTTP_PORT, timeout=5)
    s.sendall(_req("same-ip.test"))
    assert _responses(s, 1) == [b"host=same-ip.test"], f"the request under {start}"
    rc, _, err = d.ctl("apply", "agent")
    assert rc == 0, err
    learn(lab, "allowed.test")

    def next_request():
        s.sendall(_req("same-ip.test"))
        return _responses(s, 1)
    assert_reset(outcome(next_request), f"a connection opened under {start}, its next request in agent")
    s.close()
    assert any(line.startswith(FOREIGN) for line in _pin_lines(d)), _pin_lines(d)
    # A new connection is judged on its own request, as ever.
    t = connect(lab, V4, HTTP_PORT, timeout=5)
    t.sendall(_req("allowed.test"))
    assert _responses(t, 1) == [b"host=allowed.test"]
    t.close()


@pytest.mark.parametrize("via", ["open", "by_address"])
def test_a_followed_connection_is_refused_after_a_round_trip_through_a_phase_that_passes_by_address(
        lab, egressd, servers, via):  # noqa: F811
    from test_pinning import HTTP_PORT
    from test_pinning_attacks import _pin_lines, _req, _responses
    d = egressd(POLICY)
    learn(lab, "allowed.test")
    s = connect(lab, V4, HTTP_PORT, timeout=5)
    s.sendall(_req("allowed.test"))
    assert _responses(s, 1) == [b"host=allowed.test"]
    assert d.ctl("apply", via)[0] == 0
    s.sendall(_req("allowed.test"))
    assert _responses(s, 1) == [b"host=allowed.test"], f"the connection under {via}"
    assert d.ctl("apply", "agent")[0] == 0
    learn(lab, "allowed.test")

    def next_request():
        s.sendall(_req("same-ip.test"))
        return _responses(s, 1)
    assert_reset(outcome(next_request), f"a followed connection back from {via}, naming same-ip.test")
    s.close()
    assert any(line.startswith(FOREIGN) for line in _pin_lines(d)), _pin_lines(d)


def test_a_tls_flow_kept_by_two_switches_goes_on_with_one_trip_through_the_reader(lab, egressd, servers):  # noqa: F811
    """The control: a flow admitted by name under agent, kept by a switch to a phase that allows
    the name too and back, goes on; each switch costs it one trip through the reader (its next
    packet carries the other phase's mark), not one per packet."""
    from test_pinning_attacks import _queue_trips
    d = egressd(POLICY)
    learn(lab, "allowed.test")
    t = open_tls(lab, V4, "allowed.test")
    for phase in ("both", "agent"):
        # Counted from before the switch: a delayed ACK of the flow's that leaves right after it
        # makes the trip before the count (CI, under ASan: 0 trips counted after it).
        before = _queue_trips(lab, 20)
        assert d.ctl("apply", phase)[0] == 0
        for i in range(5):
            assert exchange(t, b"x%d" % i) == ("ok", b"tls:x%d" % i), f"the kept flow under {phase}"
        assert 1 <= _queue_trips(lab, 20) - before <= 2, "one trip (two if an ACK crossed first)"
    t.close()


def test_a_quic_flow_opened_under_a_public_phase_is_refused_in_a_pinned_one(lab, egressd, servers):  # noqa: F811
    """QUIC too: a flow the kernel passed under the public phase is refused (ICMP) once the
    pinned phase takes over, its short-header datagrams as much as an Initial. The lab's UDP
    echo server on 443 of the shared address answers each datagram with itself."""
    import errno
    from test_pinning_attacks import _pin_lines, _quic_socket, _short_header
    d = egressd(POLICY)
    assert d.ctl("apply", "open")[0] == 0
    s = _quic_socket(lab, V4)
    datagram = _short_header(1200)
    s.send(datagram)
    assert s.recv(4096) == datagram, "the echo under the public phase"
    assert d.ctl("apply", "agent")[0] == 0
    learn(lab, "allowed.test")
    s.send(_short_header(1200))
    try:
        echo = s.recv(4096)
        raise AssertionError(f"a short-header datagram of a flow opened under open reached the server: {echo[:8]!r}")
    except OSError as e:
        assert e.errno in (errno.EHOSTUNREACH, errno.ECONNREFUSED), e
    assert any(line.startswith(FOREIGN) for line in _pin_lines(d)), _pin_lines(d)


def test_a_flow_idle_since_a_switch_is_one_a_restarted_egressd_never_judged(lab, egressd, servers):  # noqa: F811
    """Admitted by name under agent, kept by a switch to both, idle since (it still carries
    agent's mark): a restarted egressd adopts only flows with the mark in force, never judged
    this one, and refuses its next packet (fail closed)."""
    from test_pinning_attacks import _pin_lines
    d = egressd(POLICY)
    learn(lab, "allowed.test")
    t = open_tls(lab, V4, "allowed.test")
    assert d.ctl("apply", "both")[0] == 0
    d.restart()
    assert_reset(exchange(t), "a flow idle since the switch, after the restart")
    t.close()
    # Never judged by this egressd; on a slow machine the TLS flow may still have been followed
    # (its server had not spoken after the handshake yet), which a restarted reader refuses too.
    followed = "connection followed before egressd restarted"
    assert any(line.startswith((FOREIGN, followed)) for line in _pin_lines(d)), _pin_lines(d)
