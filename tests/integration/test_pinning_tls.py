"""Hostname pinning and a TLS 1.3 HelloRetryRequest (docs/pinning.md, "A second ClientHello").

A server that cannot use the client's key shares answers the first ClientHello with a
HelloRetryRequest and takes a second one, and OpenSSL (the lab's server is Python's ssl) takes
the server name from the second hello again. The reader used to judge the first hello only,
so a client whose first hello named allowed.test and offered no key share, and whose second
named same-ip.test, completed its handshake with same-ip.test (no capability needed; found in
an attack review). Now every ClientHello of the flow is judged: the flow stays followed until
an encrypted record starts after the server answered, and a first hello offering early data,
whose records a server skips after a HelloRetryRequest, is refused.

The client (tls13_hrr_client.py) is a small TLS 1.3 client of its own: Python's ssl cannot
be made to send a hello without key shares.
"""
import json
import subprocess
import sys

import pytest

import lab as labmod
from test_pinning import BOTH_NAMES, TLS_PORT, V4, V6, across_a_switch, learn, servers  # noqa: F401 (fixtures)
from test_pinning import pinned  # noqa: F401 (fixture)

CLIENT = str(labmod.HERE / "tls13_hrr_client.py")
MODES = ["ccs", "noccs", "split", "ahead"]


def hrr(lab, addr, first, second, mode, nobody=False) -> dict:
    argv = [sys.executable, CLIENT, addr, str(TLS_PORT), first, second, mode]
    if nobody:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--"] + argv
    p = lab.spawn(argv, netns=lab.sandbox, stdout=subprocess.PIPE)
    out, _ = p.communicate(timeout=20)
    return json.loads(out.decode().strip().splitlines()[-1])


def pin_records(d) -> list:
    reply = d.request({"cmd": "denied"})
    assert reply.get("ok") is True, reply
    return [r.get("pin") or "" for r in reply["records"]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("addr", [V4, V6])
def test_the_allowed_name_twice_completes_its_handshake(lab, pinned, addr, mode):  # noqa: F811
    """The control: the server really asks for a second hello, and the flow, judged twice, passes."""
    assert hrr(lab, addr, "allowed.test", "allowed.test", mode) == {"step": "done", "answer": "sni=allowed.test"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("addr", [V4, V6])
def test_a_second_hello_naming_another_site_is_refused(lab, pinned, addr, mode):  # noqa: F811
    res = hrr(lab, addr, "allowed.test", "same-ip.test", mode)
    assert res.get("answer") != "sni=same-ip.test", "the server completed a handshake for same-ip.test"
    assert "ConnectionResetError" in res.get("error", ""), res
    host = f"[{addr}]" if ":" in addr else addr
    want = f"a second ClientHello on the connection: tls sni same-ip.test to {host}:{TLS_PORT}"
    assert any(r.startswith(want) for r in pin_records(pinned)), pin_records(pinned)


def test_a_sandbox_process_without_privileges_cannot_name_another_site_in_its_second_hello(lab, pinned):  # noqa: F811
    res = hrr(lab, V4, "allowed.test", "same-ip.test", "ccs", nobody=True)
    assert res.get("answer") != "sni=same-ip.test", "the server completed a handshake for same-ip.test"
    assert "ConnectionResetError" in res.get("error", ""), res


def test_a_first_hello_offering_early_data_is_refused(lab, pinned):  # noqa: F811
    res = hrr(lab, V4, "allowed.test", "same-ip.test", "early")
    assert "ConnectionResetError" in res.get("error", ""), res
    assert any(r.startswith("tls early data (0-RTT) offered on a pinned flow") for r in pin_records(pinned))


# The end of the handshake read, then lost: with Docker's NET_RAW the client forges a pure ACK on
# its own flow whose TCP timestamp runs 2 s ahead; the server's stack takes it, and then drops
# the client's real segments as too old (PAWS) until their timestamps catch up. Meanwhile the
# client sends, by sendfile(), an application data record as long as its second hello: the
# reader read it as the end of the handshake and let the flow onto the fast path, the server
# dropped it, and the retransmission came from the rewritten page: the second hello naming
# same-ip.test, unread, and the server completed the handshake for it (found in an attack
# review; the review's reproducer, made to wait on conditions). Now the flow stays followed
# until the server has spoken after that segment, and the retransmission leaves as read. Since
# attack review 5 (2026-12-07) the reader also drops the raw ACK itself, so this test now stops
# the attack at that first step; the retransmission leaving as read is exercised without a raw
# ACK by test_pinning_zerocopy.py (the server's namespace loses the first segment).
PAWS_ATTACKER = (labmod.HERE / "tls13_paws_attacker.py").read_text()


def test_the_segment_that_ends_the_handshake_cannot_be_lost_and_resent_as_a_second_hello(lab, pinned):  # noqa: F811
    from test_dns_integrity import DOCKER_CAPS, attacker, attacker_result
    from test_pinning_attacks import _queue
    before = _queue(lab, 18)[1]
    p = attacker(lab, PAWS_ATTACKER, V4, TLS_PORT, labmod.HERE, caps=DOCKER_CAPS)
    line = labmod._read_line(p, 15.0, "the attacker's fake record")
    assert line == "SENT", line
    # The reader has read the fake record (handed over and answered) before the page changes.
    labmod.wait_for(lambda: _queue(lab, 18)[1] > before and _queue(lab, 18)[0] == 0, 5.0,
                    "the reader to read the record that ends the handshake")
    p.stdin.write(b"go\n")
    p.stdin.flush()
    res = attacker_result(p, timeout=30.0)
    assert res.get("answer") is None, f"the server took a second hello naming same-ip.test: {res}"


# Attack review L: both names allowed, the second hello's name was judged and admitted but never
# recorded for the flow, so a switch to a phase that allowed only the first name kept the
# connection, whose session is the second name's (the server answered `sni=same-ip.test` after
# the switch, 4 of 4). A switch now keeps a flow only while it keeps every name the flow was
# admitted for.


def held_hrr(lab, d, addr, second, target):
    """The HelloRetryRequest client (uid 65534, no capability) completes its handshake in phase
    `both`; then `target` is applied and the client asks the server which name it serves."""
    argv = ["env", "HOLD=1"] + labmod.NOBODY + [sys.executable, CLIENT, addr, str(TLS_PORT), "allowed.test", second,
                                                "noccs"]
    return across_a_switch(lab, d, argv, "HS", target)


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_switch_cuts_a_flow_whose_second_hello_named_a_site_the_new_phase_forbids(lab, egressd, servers, addr):  # noqa: F811
    d = egressd(BOTH_NAMES)
    res = held_hrr(lab, d, addr, "same-ip.test", "first_only")
    assert res.get("answer") != "sni=same-ip.test", f"same-ip.test's session survived the switch: {res}"
    assert "error" in res, res
    # The control: the first name twice keeps its connection across the same switch.
    assert held_hrr(lab, d, addr, "allowed.test", "first_only") == {"step": "done", "answer": "sni=allowed.test"}
