"""Hostname pinning across switches (docs/pinning.md "Switches", issue 16 point 6).

A flow admitted because it presented name N is cut when the phase switched to does not allow
N, even when that phase still allows the flow's address through another name (a shared CDN
address): the address alone would let it on. A phase that allows N too keeps it.

Lab as test_pinning.py: allowed.test and same-ip.test both resolve to 203.0.113.10 /
2001:db8:3::10; a TLS echo server on 8443 in the internet namespace.
"""
import ssl

import pytest

from lab import DNS_V4
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
