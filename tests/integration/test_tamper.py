"""Tamper detection and the JSON audit log, against the real kernel (DESIGN §1 "Fail closed",
README "Tampering", docs/security.md "Tampering").

The contract:
  when anyone but egressd flushes the ruleset, deletes table inet egressd, or changes its chains,
  rules, sets or elements, egressd puts the phase in force back (same generation, learned
  addresses included) within 100 ms of the change reaching it, and logs a `tamper` event:
  {"event":"tamper","what":...,"by_pid":...,"by_comm":...,"restored":true,"restore_us":...};
  egressd's own switches and DNS-learned inserts, and changes to other tables, are not tampering;
  when the event socket overflows (ENOBUFS) it re-dumps the table and restores it if it differs
  (`monitor_overrun` event, "redumped": true);
  --log-format json: every line is one JSON object; audit events startup, adoption, switch,
  tamper, rebinding_guard, shutdown carry their fields at the top level.

The tamperer is the nft CLI run inside the sandbox namespace (as root, i.e. with NET_ADMIN: the
sandbox must never have it, see docs/security.md).
"""
import datetime
import json
import re
import signal
import time

import pytest

import lab as labmod

ALLOWED_IP = "198.51.100.11"   # an address entry: set ph_agent_a4
LEARNED_IP = "198.51.100.10"   # a.example.com, learned from DNS: set ph_agent_d4
DENIED_IP = "203.0.113.10"

POLICY = """\
initial_phase: agent
dns: { upstream: ["192.0.2.1"] }
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: ["198.51.100.11", "a.example.com", "*.rebind.example.org"]
  verifier: { network_mode: no-network }
"""

# DESIGN: restored within 100 ms. A sanitizer build (the lab in scripts/test) gets twice that:
# under CI's load it once took 121 ms (2026-12-07); the release smoke test holds the shipped
# binary to 100 ms with the same test.
RESTORE_BUDGET_US = 100_000 * (2 if labmod.sanitized_binary() else 1)
NO_VERIFY = ["--verify-interval", "0"]   # only the event path may restore


def log_lines(d) -> list[dict]:
    """Every line egressd wrote, parsed; a line that is not a JSON object fails the test."""
    out = []
    for line in d.log().splitlines():
        if line.startswith("--- ") or not line.strip():
            continue  # the lab's own header before each start
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise AssertionError(f"log line is not JSON ({e}): {line!r}") from None
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def parse_time(t: str) -> datetime.datetime:
    return datetime.datetime.strptime(t, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)


def events(d, name: str) -> list[dict]:
    return [e for e in log_lines(d) if e.get("event") == name]


def wait_event(d, name: str, count: int, timeout: float = 3.0) -> list[dict]:
    """Waits until at least count `name` events were logged; returns them all."""
    return labmod.wait_for(lambda: (lambda ev: ev if len(ev) >= count else None)(events(d, name)), timeout,
                           f"{count} {name} event(s) in the log")


def wait_barrier(d, chain: str) -> list[dict]:
    """Waits for the monitor's report of a rule inserted into `chain` as a barrier: once the
    monitor has reported it, every notification before it was read. The periodic verifier may
    find the same rule first (and restore): that report is accepted beside it, nothing else.
    Returns all tamper events."""
    by_event = f"rule added to chain {chain}"
    by_verification = re.compile(rf"chain {chain}: (\d+) rules, (\d+) expected")

    def seen():
        ev = events(d, "tamper")
        return ev if any(e["found_by"] == "event" and e["what"] == by_event for e in ev) else None

    ev = labmod.wait_for(seen, 3.0, f"the monitor's tamper event for {by_event}")
    def barrier(e):
        if e["found_by"] == "event":
            return e["what"] == by_event
        m = by_verification.fullmatch(e["what"])
        return e["found_by"] == "verification" and m is not None and int(m[1]) == int(m[2]) + 1

    assert all(barrier(e) for e in ev), ev
    return ev


def start(egressd, extra=()):
    return egressd(POLICY, extra=["--log-format", "json", *extra])


def denied(out) -> bool:
    return out == "refused" and out.elapsed < 0.5


def normalized_table(lab) -> str:
    """nft list table inet egressd without what changes by itself: counters, element timeouts."""
    rc, out, err = lab.nft(lab.sandbox, "list", "table", "inet", "egressd")
    assert rc == 0, err
    out = re.sub(r"counter packets \d+ bytes \d+", "counter", out)
    out = re.sub(r" expires \S+", "", out)
    out = re.sub(r"(\d) timeout \S+", r"\1", out)  # a restore carries learned elements with what is left
    return out


def learn(lab):
    r = lab.dns_query("a.example.com", "A")
    assert r.outcome == "ok" and LEARNED_IP in r.addresses, r
    assert lab.tcp_connect(LEARNED_IP, 80) == "ok"


def tamper(lab, d, command: str, *, restored_table: str):
    """Runs `nft COMMAND` in the sandbox and checks egressd's answer: a new tamper event that
    says it restored within the budget, denied egress denied again, and the table as before."""
    before = len(events(d, "tamper"))
    rc, _, err = lab.nft(lab.sandbox, command)
    assert rc == 0, f"nft {command}: {err}"
    t0 = time.monotonic()
    # Denied again: polled with a deadline (the restore normally lands before the first probe).
    labmod.wait_for(lambda: denied(lab.tcp_connect(DENIED_IP, 80, timeout=0.5)), 2.0,
                    f"{DENIED_IP} to be denied again after `nft {command}`")
    seen_denied_s = time.monotonic() - t0
    ev = wait_event(d, "tamper", before + 1)[before]
    assert ev["restored"] is True, ev
    assert ev["found_by"] == "event", ev
    assert 0 < ev["restore_us"] <= RESTORE_BUDGET_US, ev
    assert ev["by_comm"] == "nft", ev
    assert isinstance(ev["by_pid"], int) and ev["by_pid"] > 0, ev
    assert ev["phase"] == "agent" and ev["generation"] == d.status()["generation"], ev
    assert normalized_table(lab) == restored_table
    print(f"nft {command}: restore_us={ev['restore_us']} denied again {seen_denied_s * 1000:.1f} ms after nft "
          f"returned; what={ev['what']!r}")
    return ev


# --- the event path ---------------------------------------------------------------------------


@pytest.mark.parametrize("command,what", [
    ("flush ruleset", r"^(table inet egressd deleted|ruleset flushed \(table inet egressd and \d+ other tables? deleted\))$"),
    ("delete table inet egressd", r"^table inet egressd deleted$"),
    ("insert rule inet egressd output accept", r"^rule added to chain output$"),
    ("insert rule inet egressd active accept", r"^rule added to chain active$"),
    ("add rule inet egressd ph_agent ip daddr 203.0.113.10 accept", r"^rule added to chain ph_agent$"),
    # The address sets are sized to their entries (the kernel refuses one more); the learned set is not.
    ("add element inet egressd ph_agent_d4 { 203.0.113.10 timeout 1h }", r"^element added to set ph_agent_d4$"),
    ("add table inet egressd { flags dormant; }", r"^table inet egressd changed$"),
], ids=["flush-ruleset", "delete-table", "accept-in-output", "accept-in-active", "accept-in-phase",
        "add-element", "dormant"])
def test_tampering_is_undone_and_logged(lab, egressd, command, what):
    d = start(egressd, NO_VERIFY)
    learn(lab)
    table = normalized_table(lab)
    ev = tamper(lab, d, command, restored_table=table)
    assert re.match(what, ev["what"]), ev
    # Allowed traffic still flows, the learned address included (carried into the restore).
    assert lab.tcp_connect(ALLOWED_IP, 80) == "ok"
    assert lab.tcp_connect(LEARNED_IP, 80) == "ok"


@pytest.mark.parametrize("command,what", [
    ("flush set inet egressd ph_agent_d4", r"^element deleted from set ph_agent_d4$"),
    ("delete element inet egressd ph_agent_a4 { 198.51.100.11 }", r"^element deleted from set ph_agent_a4$"),
    ("delete rule inet egressd output handle OUTPUT_FIRST", r"^rule deleted from chain output$"),
], ids=["flush-learned-set", "delete-element", "delete-rule"])
def test_deletions_are_undone_and_logged(lab, egressd, command, what):
    d = start(egressd, NO_VERIFY)
    learn(lab)
    table = normalized_table(lab)
    if "OUTPUT_FIRST" in command:
        rc, out, err = lab.nft(lab.sandbox, "-a", "list", "chain", "inet", "egressd", "output")
        assert rc == 0, err
        rules = [line for line in out.splitlines()
                 if "# handle" in line and not line.strip().startswith(("table ", "chain "))]
        command = command.replace("OUTPUT_FIRST", re.search(r"# handle (\d+)", rules[0]).group(1))
    ev = tamper(lab, d, command, restored_table=table)
    assert re.match(what, ev["what"]), ev
    assert lab.tcp_connect(ALLOWED_IP, 80) == "ok"
    assert lab.tcp_connect(LEARNED_IP, 80) == "ok", "the learned address must come back with the restore"


def netdev_listing(lab) -> str:
    rc, out, err = lab.nft(lab.sandbox, "list", "table", "netdev", "egressd")
    assert rc == 0, err
    return re.sub(r"counter packets \d+ bytes \d+", "counter", out)


@pytest.mark.parametrize("command,what", [
    ("delete table netdev egressd", r"^table netdev egressd deleted$"),
    ("flush chain netdev egressd egress_check", r"^3 rules deleted from chain egress_check of table netdev egressd$"),
    ("delete chain netdev egressd eg_eth0", r"chain eg_eth0 of table netdev egressd deleted"),
    ("insert rule netdev egressd egress_check accept", r"^rule added to chain egress_check of table netdev egressd$"),
    ("add table netdev egressd { flags dormant; }", r"^table netdev egressd changed$"),
], ids=["delete-table", "flush-egress-check", "delete-egress-chain", "accept-in-egress-check", "dormant"])
def test_netdev_tampering_is_undone_and_logged(lab, egressd, command, what):
    """Table netdev egressd (the egress chains that hold AF_PACKET frames to the policy) is
    watched and restored like the inet table."""
    d = start(egressd, NO_VERIFY)
    before = netdev_listing(lab)
    assert "chain eg_eth0" in before
    n = len(events(d, "tamper"))
    rc, _, err = lab.nft(lab.sandbox, command)
    assert rc == 0, f"nft {command}: {err}"
    ev = wait_event(d, "tamper", n + 1)[n]
    assert ev["restored"] is True and ev["found_by"] == "event", ev
    assert 0 < ev["restore_us"] <= RESTORE_BUDGET_US, ev
    assert re.search(what, ev["what"]), ev
    assert netdev_listing(lab) == before  # logged after the restore's ack
    assert lab.tcp_connect(ALLOWED_IP, 80) == "ok"


def test_own_switches_and_learned_names_are_not_tampering(lab, egressd):
    # The verifier runs every 50 ms throughout: it must find egressd's own state right too.
    d = start(egressd, ["--verify-interval", "0.05"])
    for step in ("environment", "agent", "verifier", "agent"):
        rc, _, err = d.ctl("apply", step)
        assert rc == 0, err
    rc, _, err = d.ctl("apply", "--mode", "allowlist", "--allow", "a.example.com", "--allow", "203.0.113.0/24")
    assert rc == 0, err
    for name in ("a.example.com", "b.example.com", "c.example.net"):
        r = lab.dns_query(name, "A")
        assert r.outcome == "ok", r
    rc, _, err = d.ctl("apply", "agent")
    assert rc == 0, err
    for i in range(20):  # learned inserts (each answer re-inserts with a fresh timeout)
        assert lab.dns_query("a.example.com", "A" if i % 2 else "AAAA").outcome == "ok"
    learn(lab)
    assert events(d, "tamper") == []
    # A foreign change as a barrier: once it is reported, everything before it was read.
    rc, _, err = lab.nft(lab.sandbox, "insert rule inet egressd output accept")
    assert rc == 0, err
    wait_barrier(d, "output")
    assert len(events(d, "switch")) == 6
    assert events(d, "monitor_overrun") == []


def test_changes_to_other_tables_are_ignored(lab, egressd):
    d = start(egressd, ["--verify-interval", "0.05"])
    other = """\
table inet user {
  set s { type ipv4_addr; }
  chain out { type filter hook output priority -10; policy accept; ip daddr @s accept; }
}
table ip egressd {
  chain out { type filter hook output priority 10; policy accept; }
}
"""
    rc, _, err = lab.nft(lab.sandbox, "-f", "-", input=other)
    assert rc == 0, err
    for cmd in ("add element inet user s { 203.0.113.10 }", "add rule inet user out accept",
                "add rule ip egressd out accept", "delete table ip egressd"):
        rc, _, err = lab.nft(lab.sandbox, cmd)
        assert rc == 0, f"{cmd}: {err}"
    # An accept in another table's chain does not let anything past egressd's own chain.
    assert denied(lab.tcp_connect(DENIED_IP, 80))
    rc, _, err = lab.nft(lab.sandbox, "insert rule inet egressd active accept")  # the barrier
    assert rc == 0, err
    wait_barrier(d, "active")
    # egressd left the other table alone.
    rc, out, err = lab.nft(lab.sandbox, "list", "set", "inet", "user", "s")
    assert rc == 0 and "203.0.113.10" in out, (out, err)


def test_event_socket_overrun_redumps_and_restores(lab, egressd):
    # A tiny receive buffer (fixed: it does not grow) so that a burst overflows it for sure.
    d = start(egressd, ["--monitor-rcvbuf", "2048", *NO_VERIFY])
    # The learned element in place before the snapshot, as in the tests above: start-up
    # pre-resolution adds it on its own time, and a restore carries it.
    learn(lab)
    table = normalized_table(lab)
    # One transaction: 3,000 element notifications for another table, then an accept rule at
    # the top of egressd's output chain. The kernel drops what does not fit (its NEWGEN
    # included), so only the re-dump can find the rule.
    elems = ", ".join(f"10.{i // 250}.{i % 250}.1" for i in range(3000))
    script = ("table inet flood {\n  set s { type ipv4_addr; }\n}\n"
              f"add element inet flood s {{ {elems} }}\n"
              "insert rule inet egressd output accept\n")
    flood_at = datetime.datetime.now(datetime.timezone.utc)
    rc, _, err = lab.nft(lab.sandbox, "-f", "-", input=script)
    assert rc == 0, err

    def redumped_after_flood():
        # Any overrun logged after the flood started is the flood's (egressd's own start-up
        # batch may have overrun the tiny buffer too, before).
        return [e for e in events(d, "monitor_overrun")
                if e["redumped"] is True and "error" not in e and parse_time(e["time"]) >= flood_at]
    ev = labmod.wait_for(redumped_after_flood, 3.0, "a monitor_overrun event after the flood")
    labmod.wait_for(lambda: normalized_table(lab) == table, 2.0, "the accept rule to be removed")
    assert denied(lab.tcp_connect(DENIED_IP, 80))
    # Repaired by the re-dump, unless the rule's own notification squeezed through (the daemon
    # reads on the other core while the kernel delivers) and the event path repaired it first.
    by_redump = [e for e in ev if e["restored"] is True and any("chain output" in x for x in e["differences"])]
    by_event = [e for e in events(d, "tamper") if e["what"] == "rule added to chain output"]
    assert by_redump or by_event, (ev, events(d, "tamper"))
    print(f"overrun: repaired by {'re-dump' if by_redump else 'event'}: {(by_redump or by_event)[0]}")
    # The daemon keeps watching: a later tamper is still caught (by the event or by a re-dump).
    rc, _, err = lab.nft(lab.sandbox, "delete table inet egressd")
    assert rc == 0, err
    labmod.wait_for(lambda: denied(lab.tcp_connect(DENIED_IP, 80, timeout=0.5)), 2.0, "the table to come back")
    assert normalized_table(lab) == table


def test_a_tamper_loop_is_undone_every_time_and_logs_stay_bounded(lab, egressd):
    d = start(egressd, NO_VERIFY)
    learn(lab)
    table = normalized_table(lab)
    n = 40
    script = "".join("flush ruleset\n" if i % 2 else "insert rule inet egressd output accept\n" for i in range(n))
    # Each line its own transaction (nft -f runs one batch per file, so use separate runs).
    for line in script.splitlines():
        lab.nft(lab.sandbox, line)  # may fail when the table is momentarily gone: that is fine
    labmod.wait_for(lambda: denied(lab.tcp_connect(DENIED_IP, 80, timeout=0.5)), 2.0, "the table to come back")
    labmod.wait_for(lambda: normalized_table(lab) == table, 2.0, "the table to be restored exactly")
    logged = events(d, "tamper")
    # At most the burst (10) plus about one per second of the loop's runtime is logged.
    assert 1 <= len(logged) <= 10 + 30, len(logged)
    assert d.running


def test_a_second_egressd_in_the_namespace_refuses_to_start_and_changes_nothing(lab, egressd):
    """Two egressd in one namespace take the table from each other for as long as both run, each
    putting its own phase back, so a switch made through one is undone by the other (a harness
    that retries a sidecar's start, an update that starts the new one before the old one stops).
    The second must stop before it changes anything, and say which process serves the namespace;
    once that one is gone, even killed, the namespace is free and its table is adopted."""
    d = start(egressd)
    learn(lab)
    rc, _, err = d.ctl("apply", "verifier")
    assert rc == 0, err
    table = normalized_table(lab)
    second = egressd(POLICY, name="second", start=False, extra=["--log-format", "json"])
    with pytest.raises(labmod.LabError, match="second exited with 1 before ready"):
        second.start()
    said = second.log()
    # --log-format json: the start-up error is a JSON line too, as every line of the run.
    first_run = [json.loads(ln) for ln in said.split("\n--- ")[0].splitlines()[1:] if ln.strip()]
    failed = [e for e in first_run if e.get("event") == "startup_failed"]
    assert len(failed) == 1 and failed[0]["exit"] == 1 and failed[0]["level"] == "error", said
    assert "another egressd already serves this network namespace" in failed[0]["error"], said
    assert f"pid {d.pid} (egressd)" in failed[0]["error"], said
    assert normalized_table(lab) == table
    assert denied(lab.tcp_connect(LEARNED_IP, 80, timeout=0.5)), "the verifier phase must still be in force"
    # A foreign change as a barrier: once it is reported, everything before it was read, and the
    # second one's start was never taken for tampering (nor did it change anything to restore).
    rc, _, err = lab.nft(lab.sandbox, "insert rule inet egressd output accept")
    assert rc == 0, err
    wait_barrier(d, "output")
    d.kill()
    d.wait()
    second.start()
    last_run = second.log().rsplit("\n--- ", 1)[1].splitlines()[1:]
    adopted = [e for e in map(json.loads, filter(str.strip, last_run)) if e.get("event") == "adoption"]
    assert [(e["phase"], e["restaged"]) for e in adopted] == [("verifier", False)], adopted
    assert denied(lab.tcp_connect(LEARNED_IP, 80, timeout=0.5))


# --- the JSON audit log ----------------------------------------------------------------------


def test_json_audit_log(lab, egressd):
    lab.dns.restart(hosts={**labmod.DEFAULT_HOSTS, "lo.rebind.example.org": ["127.0.0.1"],
                           "ok.rebind.example.org": ["203.0.113.10"]},
                    cnames=labmod.DEFAULT_CNAMES, wildcards=labmod.DEFAULT_WILDCARDS)
    d = start(egressd)
    rc, _, err = d.ctl("apply", "verifier")
    assert rc == 0, err
    rc, _, err = d.ctl("apply", "agent")
    assert rc == 0, err
    assert lab.dns_query("lo.rebind.example.org", "A").outcome == "ok"
    rc, _, err = lab.nft(lab.sandbox, "delete table inet egressd")
    assert rc == 0, err
    wait_event(d, "tamper", 1)
    wait_event(d, "rebinding_guard", 1)
    assert d.stop() == 0
    d.restart()  # adoption
    assert d.stop() == 0

    lines = log_lines(d)  # every line parses
    for e in lines:
        assert isinstance(e.get("time"), str) and re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$", e["time"]), e
        assert e.get("level") in ("trace", "debug", "info", "warning", "error", "critical"), e
        assert "event" in e or isinstance(e.get("message"), str), e

    startup = [e for e in lines if e.get("event") == "startup"]
    assert len(startup) == 2, startup
    s = startup[0]
    assert s["version"] and s["netns"] == lab.sandbox.path and s["phase"] == "agent", s
    assert s["generation"] == 1 and s["mode"] == "allowlist", s
    assert s["capabilities"]["network_allowlist"] is True, s

    switches = [e for e in lines if e.get("event") == "switch"]
    assert [(e["from"], e["to"]) for e in switches] == [("agent", "verifier"), ("verifier", "agent")], switches
    sw = switches[0]
    assert sw["mode"] == "no-network" and sw["generation"] == 2, sw
    assert isinstance(sw["entries"], dict) and isinstance(sw["duration_us"], int), sw
    assert switches[1]["entries"]["hostname"] == 1 and switches[1]["entries"]["wildcard"] == 1, switches[1]

    t = [e for e in lines if e.get("event") == "tamper"][0]
    assert t["what"] == "table inet egressd deleted" and t["by_comm"] == "nft" and t["restored"] is True, t
    assert t["generation"] == 3 and t["phase"] == "agent", t

    rb = [e for e in lines if e.get("event") == "rebinding_guard"]
    assert {"name": "lo.rebind.example.org", "address": "127.0.0.1"}.items() <= rb[0].items(), rb

    adoption = [e for e in lines if e.get("event") == "adoption"]
    assert len(adoption) == 1 and adoption[0]["phase"] == "agent" and adoption[0]["generation"] == 3, adoption

    shutdown = [e for e in lines if e.get("event") == "shutdown"]
    assert len(shutdown) == 2 and shutdown[0]["signal"] == signal.SIGTERM and shutdown[0]["policy"] == "stays", shutdown
    assert shutdown[0]["tampers"] == 1 and shutdown[0]["restores"] == 1, shutdown


def test_text_log_names_the_tamperer(lab, egressd):
    d = egressd(POLICY, extra=NO_VERIFY)
    rc, _, err = lab.nft(lab.sandbox, "delete table inet egressd")
    assert rc == 0, err
    line = labmod.wait_for(lambda: re.search(r"^.* warning audit: tamper: table inet egressd deleted by pid \d+ "
                                             r"\(nft\); restored phase=agent in \d+ us$", d.log(), re.M),
                           3.0, "the tamper line").group(0)
    print(line)
