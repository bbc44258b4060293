"""Hostname pinning and QUIC's HelloRetryRequest (docs/pinning.md, "A second ClientHello").

A server that cannot use the client's key shares answers the first ClientHello with a
HelloRetryRequest and reads a second one from the same CRYPTO stream, and takes the server name
from it (GnuTLS and OpenSSL alike). An attack review found three ways to get a second hello
naming same-ip.test past a reader that judged only the first, each as uid 65534 with no
capability, each completing the handshake with the lab's real QUIC server (Debian's gtlsserver,
ngtcp2 with GnuTLS):
  - both hellos in the first Initial's stream (or the second sent ahead of the first);
  - an Initial the server discards (a datagram under 1200 bytes) read by egressd, so the next
    Initial's short packet number decoded differently here, did not open, was taken for another
    connection's and judged afresh: a hello at offset 0 naming allowed.test whose tail, past what
    the server already held, was the second hello;
  - the same hello-with-a-tail after 300 other flows had pushed this one out of the reader's
    followed flows.
Now every ClientHello of the stream is judged (a second one only after the first was decided,
as a server's HelloRetryRequest makes a client send it), an Initial in a datagram under 1200
bytes is refused, one under the connection's own id that does not open is refused, and an
Initial on a flow the kernel passed before whose assembler egressd no longer holds is refused.

The client (quic_hrr_client.py) is a QUIC client of its own: gtlsclient cannot be made to send a
hello without key shares. It completes the handshake and checks the server's Finished against
the transcript of the second hello.
"""
import json

import pytest

import lab as labmod
from test_dns_integrity import attacker, attacker_result
from test_pinning import BOTH_NAMES, V4, V6, learn, policy
from test_pinning_quic import quic_servers, start_quic_servers  # noqa: F401 (fixture: gtlsserver on 443 of the shared address)

CLIENT = (labmod.HERE / "quic_hrr_client.py").read_text()


@pytest.fixture
def pinned(lab, egressd, quic_servers):  # noqa: F811
    d = egressd(policy())
    learn(lab)
    return d


def run_client(lab, addr, sni1, sni2, mode) -> dict:
    """The client as uid 65534 with no capability: its JSON result."""
    return attacker_result(attacker(lab, CLIENT, addr, 443, sni1, sni2, mode, uid=True), timeout=60.0)


def pin_records(d) -> list:
    return [r.get("pin") for r in d.request({"cmd": "denied"})["records"] if r.get("pin")]


def assert_refused(res, what):
    assert res.get("step") == "refused", f"{what}: {res}"
    assert res.get("step") != "handshake-done" and not res.get("server_finished_verifies_over_ch2_transcript"), res


@pytest.mark.parametrize("mode", ["onepacket", "ahead"])
@pytest.mark.parametrize("addr", [V4, V6])
def test_a_second_hello_in_the_stream_of_the_first_is_refused(lab, pinned, addr, mode):
    res = run_client(lab, addr, "allowed.test", "same-ip.test", mode)
    assert_refused(res, "both hellos in the first flight")
    assert any("quic CRYPTO data after the ClientHello" in r for r in pin_records(pinned)), pin_records(pinned)


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_second_hello_after_a_retry_request_is_judged_like_the_first(lab, pinned, addr):
    """The control: a well-behaved client whose second hello, sent after the server's
    HelloRetryRequest, names the allowed name completes its handshake (refused before this
    change, whatever it named). Naming the other site, it is refused."""
    res = run_client(lab, addr, "allowed.test", "allowed.test", "sequential")
    assert res.get("hrr") is True, res
    assert res.get("step") == "handshake-done" and res.get("server_finished_verifies_over_ch2_transcript"), res
    res = run_client(lab, addr, "allowed.test", "same-ip.test", "sequential")
    assert res.get("hrr") is True, res
    assert_refused(res, "a second hello naming same-ip.test after the HelloRetryRequest")
    host = f"[{addr}]" if ":" in addr else addr
    want = f"a second ClientHello on the connection: quic sni same-ip.test to {host}:443"
    assert any(r.startswith(want) for r in pin_records(pinned)), pin_records(pinned)


@pytest.mark.parametrize("addr", [V4, V6])
def test_an_initial_the_server_discards_cannot_shift_the_reader_off_the_servers_packet_numbers(lab, pinned, addr):
    res = run_client(lab, addr, "allowed.test", "same-ip.test", "diverge")
    assert res.get("hrr") is True, res
    assert_refused(res, "a hello-with-a-tail after an Initial the server discards")
    assert any("quic Initial in a datagram under 1200 bytes" in r for r in pin_records(pinned)), pin_records(pinned)


def test_a_flow_pushed_out_of_the_followed_ones_is_refused_not_judged_afresh(lab, pinned):
    res = run_client(lab, V4, "allowed.test", "same-ip.test", "evict")
    assert res.get("hrr") is True, res
    assert_refused(res, "a hello-with-a-tail after 300 other flows")
    want = "quic Initial on a flow admitted earlier whose judged ClientHello egressd no longer holds"
    assert want in pin_records(pinned), pin_records(pinned)


@pytest.mark.parametrize("mode", ["detour", "detour_scid", "detour_v2"])
@pytest.mark.parametrize("addr", [V4, V6])
def test_another_connections_initial_cannot_make_the_first_one_judged_afresh(lab, pinned, addr, mode):
    """Found in a second review of the fixes above: after the HelloRetryRequest, one datagram
    the current assembler cannot open and that is not under the connection's id (another
    connection's first Initial, or one under the server's own id, or a v2 Initial) made the
    reader drop the first connection's assembler for a new one; the first connection's next
    Initial then was "another connection" too, judged from offset 0 (the hello-with-a-tail).
    Now a second connection on the four-tuple is refused, and the flow with it."""
    res = run_client(lab, addr, "allowed.test", "same-ip.test", mode)
    assert res.get("hrr") is True, res
    assert_refused(res, f"{mode}: the first connection's hello-with-a-tail")
    want = "quic Initial of another connection on the four-tuple of an admitted one"
    assert any(r.startswith(want) for r in pin_records(pinned)), pin_records(pinned)


# --- the connection's ID, whatever the four-tuple -------------------------------------------------
# Found by an attack review: after the server's HelloRetryRequest, an Initial under the first
# connection's ID and keys whose hello names allowed.test at offset 0 and carries, from the offset
# the server waits at, a second hello naming same-ip.test, sent on a flow egressd never admitted:
# from a new source port (migrate_ack), or on the same four-tuple after 34 s of silence, when
# conntrack and egressd's followed assembler had forgotten it (expire). Judged from offset 0 it was
# admitted; a server that finds the connection by its ID reads only the tail. With a server whose
# handshake outlives that silence (gtlsserver --handshake-timeout=120s) the handshake for
# same-ip.test completed. egressd now remembers admitted connections' IDs (10 minutes).


@pytest.mark.parametrize("addr", [V4, V6])
def test_an_initial_under_an_admitted_connections_id_from_a_new_source_port_is_refused(lab, pinned, addr):
    res = run_client(lab, addr, "allowed.test", "same-ip.test", "migrate_ack")
    assert res.get("hrr") is True, res
    assert res.get("new_sport") and res.get("new_sport") != res.get("old_sport"), res
    reasons = [p.get("reason", "") if isinstance(p, dict) else str(p) for p in pin_records(pinned)]
    assert any("connection ID of a connection admitted on another flow" in r for r in reasons), (res, reasons)
    assert not res.get("server_finished_verifies_over_ch2_transcript"), res



@pytest.mark.parametrize("addr", [V4, V6])
def test_an_initial_after_a_retry_cannot_move_a_flow_onto_an_admitted_connections_id(lab, pinned, addr):
    """Attack review L: from a new source port, a fresh connection admitted on a longer hello
    for allowed.test, then an Initial 'after a Retry' under the first connection's ID: egressd
    followed it as the fresh connection's, with that hello as its stream, and it left (2 of 2);
    the server, holding the first connection's stream, reads a hello naming same-ip.test there.
    A Retry's ID is new: one an admitted connection has is refused."""
    res = run_client(lab, addr, "allowed.test", "same-ip.test", "retry_adopt")
    assert res.get("hrr") is True and res.get("d2_answered") is True, res
    reasons = pin_records(pinned)
    assert any(r.startswith("quic Initial under the connection ID of a connection admitted on another flow")
               for r in reasons), (res, reasons)
    assert not res.get("server_finished_verifies_over_ch2_transcript"), res

@pytest.fixture
def slow_quic_servers(lab, tmp_path):
    """gtlsserver on 443 of the shared address whose handshake and idle timeouts (120 s) outlive
    conntrack's 30 s for an unanswered UDP flow (a server setting: nginx's QUIC idle timeout is 60 s)."""
    start_quic_servers(lab, tmp_path, "--timeout=120s", "--handshake-timeout=120s", echo=False)


def test_an_initial_under_an_admitted_connections_id_after_conntrack_forgot_the_flow_is_refused(
        lab, egressd, slow_quic_servers):
    """The same four-tuple after 34 s of silence (the client's own wait: conntrack's 30 s for an
    unanswered flow, and egressd's followed assembler's 30 s, must pass; no sleep of the test's)."""
    d = egressd(policy())
    learn(lab)
    p = attacker(lab, CLIENT, V4, 443, "allowed.test", "same-ip.test", "expire", uid=True)
    res = attacker_result(p, timeout=90.0)
    assert res.get("hrr") is True, res
    assert res.get("waited", 0) >= 34, res
    assert res.get("kick", "").startswith(("ConnectionRefusedError", "OSError")), \
        f"the datagram that runs the reader's expiry was not refused: {res}"
    assert not (res.get("step") == "handshake-done" or res.get("server_finished_verifies_over_ch2_transcript")), \
        f"the server completed a handshake for same-ip.test: {res}"
    reasons = [p.get("reason", "") if isinstance(p, dict) else str(p) for p in pin_records(d)]
    assert any("connection ID of a connection admitted on another flow" in r for r in reasons), (res, reasons)


# Attack review L: both names allowed, a second hello (after the HelloRetryRequest) naming
# same-ip.test was judged and admitted, but the flow stayed recorded under the first name, so a
# switch to a phase allowing only allowed.test kept the connection whose handshake was
# same-ip.test's (5 of 5 PINGs acknowledged after the switch, IPv4 and IPv6).
def held_client(lab, d, monkeypatch, addr, second, target) -> dict:
    d.ctl("apply", "both")
    learn(lab, "allowed.test")
    learn(lab, "same-ip.test")
    monkeypatch.setenv("HOLD", "1")
    p = attacker(lab, CLIENT, addr, 443, "allowed.test", second, "sequential", uid=True)
    line = labmod._read_line(p, 30.0, "the handshake")
    assert line.startswith("HS "), line
    hs = json.loads(line[3:])
    assert hs.get("server_finished_verifies_over_ch2_transcript"), hs
    rc, _, err = d.ctl("apply", target)
    assert rc == 0, err
    p.stdin.write(b"go\n")
    p.stdin.flush()
    return attacker_result(p, timeout=60.0)


@pytest.mark.parametrize("addr", [V4, V6])
def test_a_switch_cuts_a_connection_whose_second_hello_named_a_site_the_new_phase_forbids(
        lab, egressd, quic_servers, monkeypatch, addr):  # noqa: F811
    d = egressd(BOTH_NAMES)
    res = held_client(lab, d, monkeypatch, addr, "same-ip.test", "first_only")
    assert res.get("after_switch_acks") == 0, f"same-ip.test's connection survived the switch: {res}"
    # The control: the first name twice keeps its connection across the same switch.
    res = held_client(lab, d, monkeypatch, addr, "allowed.test", "first_only")
    assert res.get("after_switch_acks", 0) > 0 and not res.get("after_switch_errs"), res
