"""A restarted egressd pins what the one before it pinned (docs/pinning.md "Restarts").

egressd adopts its table unchanged on a restart: the addresses learned for allowed names stay
in the kernel's learned sets with their timeouts. Pinning also needs the name each address was
learned for; it is kept in the kernel too, as the element's comment, and read back at adoption.
So without any new DNS query — the lab's DNS server is stopped before the restart, so even
egressd's own pre-resolution of the phase's names gets nothing — a TLS flow naming the learned
name is admitted, another name on the same address is still reset, and `status` lists the name.

Lab as in test_pinning.py: allowed.test and same-ip.test both resolve to 203.0.113.10 /
2001:db8:3::10, TLS servers on 8443 in the internet namespace.
"""
import signal

import pytest

from test_agent import agent  # noqa: F401 (fixture)
from test_pinning import HOSTS, V4, V6, assert_reset, learn, policy, servers, tls  # noqa: F401 (fixture)


def learned(d) -> dict[str, set[str]]:
    return {e["name"]: {a["address"] for a in e["addresses"]} for e in d.status()["learned"]}


@pytest.fixture
def dns_back(lab):
    """Starts the lab's DNS server again after a test that stopped it."""
    yield
    lab.dns.restart(hosts=HOSTS)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_restart_keeps_pinning_the_learned_name_without_resolving_again(lab, egressd, servers, dns_back, how):
    d = egressd(policy())
    learn(lab)
    assert tls(lab, V4, "allowed.test") == ("ok", b"tls:ping")
    before = d.status()
    assert learned(d)["allowed.test"] == {V4, V6}, before["learned"]

    lab.dns.stop()  # from here on nothing can resolve: what pins comes from the kernel
    if how == "SIGKILL":
        d.kill()
        d.wait()
    else:
        d.stop()
    d.start()

    after = d.status()
    assert (after["phase"], after["generation"]) == (before["phase"], before["generation"]), "not adopted"
    assert learned(d).get("allowed.test") == {V4, V6}, after["learned"]
    for e in after["learned"]:
        for a in e["addresses"]:
            # The time the kernel had left, not a fresh TTL: at most what it was before.
            assert a["source"] == "dns" and 0 < a["expires_in_s"] <= 70, e
    for addr in (V4, V6):
        assert tls(lab, addr, "allowed.test") == ("ok", b"tls:ping"), f"allowed.test to {addr} after a restart"
        assert_reset(tls(lab, addr, "same-ip.test"), f"tls with sni same-ip.test to {addr} after a restart")
    assert "restored learned names pairs=2 addresses=2" in d.log(), d.log()[-2000:]


def test_a_second_name_for_the_address_is_kept_too(lab, egressd, servers, dns_back):
    """Two allowed names on one address: the element's comment is rewritten to name both."""
    d = egressd(policy().replace("allowed_hosts: [allowed.test,", "allowed_hosts: [allowed.test, same-ip.test,"))
    learn(lab, "allowed.test")
    learn(lab, "same-ip.test")
    rc, text, err = lab.nft(lab.sandbox, "list", "set", "inet", "egressd", "ph_agent_d4")
    assert rc == 0, err
    assert f'{V4} timeout' in text and 'comment "allowed.test same-ip.test"' in text, text
    lab.dns.stop()
    d.kill()
    d.wait()
    d.start()
    # Restored while starting, before the ready file: no waiting.
    assert learned(d).get("same-ip.test") == {V4, V6}, d.status()["learned"]
    assert learned(d).get("allowed.test") == {V4, V6}
    for name in ("allowed.test", "same-ip.test"):
        assert tls(lab, V4, name) == ("ok", b"tls:ping"), name
    assert_reset(tls(lab, V4, "other.test"), "tls with sni other.test after a restart")


def test_agent_mode_restart_keeps_the_learned_name(lab, agent, servers, dns_back):
    """`egressd agent --state-dir`: the same adoption, per sandbox."""
    config = lab.write_config(policy())
    agent.ok("sandbox", "add", "one", "--netns", lab.sandbox.path, "--config", config)
    learn(lab)
    assert tls(lab, V4, "allowed.test") == ("ok", b"tls:ping")
    lab.dns.stop()
    agent.stop(signal.SIGKILL)
    agent.start()
    st = agent.json("--sandbox", "one", "status")
    assert {e["name"] for e in st["learned"]} == {"allowed.test"}, st["learned"]
    assert tls(lab, V4, "allowed.test") == ("ok", b"tls:ping")
    assert_reset(tls(lab, V4, "same-ip.test"), "tls with sni same-ip.test after the agent's restart")
