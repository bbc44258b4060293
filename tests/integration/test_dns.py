"""egressd's DNS proxy against the real kernel and a real upstream (the lab's dnsmasq).

The contract (DESIGN §1 "DNS proxy", README "Policy file"):
  every udp/tcp port-53 packet from the sandbox, to any address, is answered by egressd's
  proxy (nat chain dns_redirect); public: forwarded; no-network: REFUSED locally; allowlist:
  allowed names (exact, or `*.suffix` below the suffix at any depth, never the apex;
  case-insensitive) forwarded, others REFUSED (NXDOMAIN with dns.deny_answer: nxdomain)
  locally, and the upstream never sees a query for them;
  for an allowed answer every A/AAAA at the end of the CNAME chain is in the phase's set
  ph_<phase>_d4 / _d6 with timeout max(TTL, dns.min_ttl) + 10 s before the answer is
  released; loopback, link-local and metadata answers are never inserted;
  a flow to a learned address outlives its element; a new connection needs a fresh answer;
  a dead upstream gives SERVFAIL within 2 s; malformed queries get FORMERR/NOTIMP or are
  dropped, and the proxy keeps serving;
  apply pre-resolves the phase's exact hostnames (reply: `unresolved`); status --json has
  `learned` and `dns` counters {forwarded, refused, failed, malformed}.

Every name a test asks about carries a random label of its own, so what the upstream's
query log shows (or must not show) is exact.
"""
import json
import re
import random
import subprocess
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import lab as labmod
from lab import DEFAULT_CNAMES, DEFAULT_HOSTS, DNS_V4, DNS_V6

# Extra dnsmasq data: wildcards answer the domain and every name below it.
WILDCARDS = {
    "wild.example.org": ["203.0.113.10", "2001:db8:3::10"],      # allowlisted as *.wild.example.org
    "denied.example.net": ["198.51.100.11", "2001:db8:2::11"],   # known upstream, never allowlisted
}
AGENT_HOSTS = ["a.example.com", "*.wild.example.org", "*.site.example.com", "*.fresh.example.org",
               "*.rebind.example.org"]
WILD_V4, WILD_V6 = WILDCARDS["wild.example.org"]
FAST = 0.5  # s: a locally answered query or a rejected connect takes milliseconds
NOT_DELIVERED = ("the sandbox's query never reached egressd's proxy (a query redirected by dns_redirect must "
                 "get through the output filter chain)")


def policy(*, upstream: str = DNS_V4, dns: str = "", agent=AGENT_HOSTS, extra: str = "") -> str:
    keys = f'upstream: ["{upstream}"]' + (f", {dns}" if dns else "")
    hosts = ", ".join(json.dumps(h) for h in agent)
    return f"""\
initial_phase: agent
dns: {{ {keys} }}
phases:
  environment: public
  agent:
    network_mode: allowlist
    allowed_hosts: [{hosts}]
  verifier: {{ network_mode: no-network }}
{extra}"""


def tok(prefix: str = "t") -> str:
    """A label no other test (or run) uses."""
    return f"{prefix}{random.getrandbits(48):012x}"


def serve(lab, hosts=None, cnames=None, wildcards=None, **kw):
    """Restarts the lab's dnsmasq with the default data, WILDCARDS and these additions."""
    lab.dns.restart(hosts={**DEFAULT_HOSTS, **(hosts or {})}, cnames={**DEFAULT_CNAMES, **(cnames or {})},
                    wildcards={**WILDCARDS, **(wildcards or {})}, **kw)


def asked(lab, token: str) -> list:
    """Queries the upstream received whose name contains token (any case), after sync(), with
    their names lower-cased: egressd sends every name in random case (0x20)."""
    lab.dns.sync()
    return [labmod.DnsQuery(q.type, q.name.lower(), q.source) for q in lab.dns.queries()
            if token.lower() in q.name.lower()]


def check_answer(r, rcode: str, what: str):
    assert r.outcome == "ok", f"{what}: no DNS answer ({r.outcome!r}); {NOT_DELIVERED}"
    assert r.rcode == rcode, f"{what}: rcode {r.rcode}, want {rcode}; records {r.records}"


def resolve(lab, name: str, qtype: str = "A", **kw) -> list[str]:
    r = lab.dns_query(name, qtype, **kw)
    check_answer(r, "NOERROR", f"{qtype} {name}")
    assert r.addresses, f"{qtype} {name}: no addresses in {r.records}"
    return r.addresses


def learned_names(d) -> dict:
    """name -> {address: expires_in_s} from status --json."""
    st = d.ctl_json("status", "--json")
    return {entry["name"]: {a["address"]: a["expires_in_s"] for a in entry["addresses"]} for entry in st["learned"]}


def dns_counters(d) -> dict:
    c = d.status().get("dns")
    assert isinstance(c, dict), f"status has no dns counters: {c!r}"
    return c


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("forwarded", "refused", "failed", "malformed")}


def rejected(out) -> bool:
    return out == "refused" and out.elapsed < FAST


# --- names the policy does not allow never leave -------------------------------------------


DENY_QTYPES = ("A", "AAAA", "TXT", "MX", "HTTPS", "ANY")


def denied_names(t: str) -> list[str]:
    return [
        f"{t}.denied.example.net",              # dnsmasq knows it: a leak would come back NOERROR
        f"{t}.example.com",
        f"{t}.a.example.com",                   # below an exact entry: exact means exact
        f"{t}wild.example.org",                 # not below wild.example.org (label boundary)
        f"wild.example.org.{t}.example.net",    # an allowed suffix inside, not at the end
        f"{t}.wild.example.org.denied.example.net",
    ]


@pytest.mark.parametrize("deny_answer", ["refused", "nxdomain"])
def test_denied_names_never_reach_upstream(lab, egressd, deny_answer):
    serve(lab)
    d = egressd(policy(dns=f"deny_answer: {deny_answer}"))
    want = deny_answer.upper()
    t = tok()
    before = dns_counters(d)
    wrong = []
    n = 0
    for name in denied_names(t):
        for qtype in DENY_QTYPES:
            for server, tcp in ((DNS_V4, False), (DNS_V6, False), (DNS_V4, True)):
                r = lab.dns_query(name, qtype, server=server, tcp=tcp)
                n += 1
                if r.outcome != "ok" or r.rcode != want or r.outcome.elapsed >= FAST:
                    wrong.append(f"{qtype} {name} via {'tcp' if tcp else 'udp'} {server}: {r.outcome!r} {r.rcode}")
    assert not wrong, f"want {want} from the proxy at once:\n" + "\n".join(wrong)
    assert asked(lab, t) == [], "the upstream saw queries for names the policy does not allow"
    assert delta(before, dns_counters(d))["refused"] == n
    # The control: an allowed name does reach the upstream, so the log check above can fail.
    name = f"{t}.wild.example.org"
    assert resolve(lab, name) == [WILD_V4]
    assert [q.name for q in asked(lab, t)] == [name]


def test_no_network_answers_refused_and_forwards_nothing(lab, egressd):
    serve(lab)
    d = egressd(policy())
    assert d.ctl("apply", "verifier")[0] == 0
    t = tok()
    before = dns_counters(d)
    wrong = []
    # Names that are allowed under `agent`, and one that is never allowed.
    for name in (f"{t}.wild.example.org", "a.example.com", f"{t}.denied.example.net"):
        for qtype in ("A", "AAAA", "TXT"):
            for server, tcp in ((DNS_V4, False), (DNS_V6, False), (DNS_V4, True), (DNS_V6, True)):
                r = lab.dns_query(name, qtype, server=server, tcp=tcp)
                if r.outcome != "ok" or r.rcode != "REFUSED" or r.outcome.elapsed >= FAST:
                    wrong.append(f"{qtype} {name} via {'tcp' if tcp else 'udp'} {server}: {r.outcome!r} {r.rcode}")
    assert not wrong, "want REFUSED from the proxy at once:\n" + "\n".join(wrong)
    assert asked(lab, t) == [], "no-network forwarded queries upstream"
    assert delta(before, dns_counters(d))["forwarded"] == 0
    # public forwards everything, the otherwise-denied name included.
    assert d.ctl("apply", "environment")[0] == 0
    assert resolve(lab, f"{t}.denied.example.net") == [WILDCARDS["denied.example.net"][0]]
    assert [q.name for q in asked(lab, t)] == [f"{t}.denied.example.net"]


def test_a_lookup_in_flight_at_a_switch_is_answered_not_aborted(lab, egressd):
    """A switch aborts the sockets of flows the new phase cuts (sock_diag), but every port-53
    flow goes to egressd's proxy: a client that holds a UDP socket and a TCP connection to the
    DNS server across a switch to no-network gets REFUSED on them, never ECONNABORTED."""
    serve(lab)
    d = egressd(policy(), phase="environment")
    t = tok()

    held = []
    for tcp in (False, True):
        s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM)
        s.settimeout(2.0)
        s.connect((DNS_V4, 53))
        r = labmod.dns_exchange(s, f"{t}.wild.example.org", tcp=tcp)
        assert (r.outcome, r.rcode) == ("ok", "NOERROR"), f"public forwards: {r.outcome!r} {r.rcode}"
        held.append((s, tcp))
    # A flow no-network cuts: its abort is what shows the reaper has run.
    aborted = labmod.switch_and_wait_for_reaper(d, lab.udp_flow(labmod.SERVERS_V4[0]), "verifier")
    got = {}
    for s, tcp in held:
        r = labmod.dns_exchange(s, f"{t}.wild.example.org", tcp=tcp)
        got["tcp" if tcp else "udp"] = f"{r.outcome!r} {r.rcode}" if r.outcome != "ok" else r.rcode
    assert got == {"udp": "REFUSED", "tcp": "REFUSED"}, f"sockets held across the switch: {got}"
    assert aborted == 1, "the reaper aborted more than the canary"
    for s, _ in held:
        s.close()


# --- matching -------------------------------------------------------------------------------


def test_wildcard_matches_below_suffix_never_apex(lab, egressd):
    serve(lab)
    d = egressd(policy())
    t = tok()
    assert rejected(lab.tcp_connect(WILD_V4, 80)), "nothing learned yet"

    r = lab.dns_query("wild.example.org")
    check_answer(r, "REFUSED", "the apex of *.wild.example.org")
    r = lab.dns_query(f"{t}wild.example.org")
    check_answer(r, "REFUSED", "a name that only ends in the suffix's text")
    lab.dns.sync()
    leaked = [q for q in lab.dns.queries() if q.name.lower() in ("wild.example.org", f"{t}wild.example.org")]
    assert leaked == [], "refused names were forwarded"
    assert rejected(lab.tcp_connect(WILD_V4, 80)), "a refused name taught egressd an address"

    one = f"{t}.wild.example.org"
    deep = f"a.b.c.{t}.wild.example.org"
    assert resolve(lab, one) == [WILD_V4]
    assert lab.tcp_connect(WILD_V4, 80) == "ok"
    assert resolve(lab, deep, "AAAA") == [WILD_V6]
    assert lab.tcp_connect(WILD_V6, 80) == "ok"
    assert sorted(q.name for q in asked(lab, t)) == sorted([one, deep])
    names = learned_names(d)
    assert WILD_V4 in names.get(one, {}) and WILD_V6 in names.get(deep, {}), names


def test_matching_is_case_insensitive(lab, egressd):
    serve(lab, hosts={"pypi.example.com": ["198.51.100.11"]})
    d = egressd(policy(agent=["PyPI.Example.COM", "*.Wild.Example.ORG"]))
    t = tok("T")
    assert resolve(lab, "pYpI.eXaMpLe.CoM") == ["198.51.100.11"]
    assert rejected(lab.tcp_connect(WILD_V4, 80))
    name = f"{t}.wILD.EXAMPLE.org"
    assert resolve(lab, name) == [WILD_V4]
    assert lab.tcp_connect(WILD_V4, 80) == "ok"
    # Still case-insensitive on the deny side.
    check_answer(lab.dns_query(f"{t}.PyPI.Example.COM"), "REFUSED", "below an exact entry, mixed case")
    assert [q.name.lower() for q in asked(lab, t)] == [name.lower()]
    assert name.lower() in learned_names(d), "learned names are kept lower-case"


# --- what an allowed answer makes reachable ---------------------------------------------------


def test_cname_chain_to_unlisted_cdn_is_reachable(lab, egressd):
    t = tok()
    alias = f"{t}.site.example.com"
    serve(lab, hosts={"edge.cdn.example.net": ["203.0.113.10", "2001:db8:3::10"]},
          cnames={alias: "mid.cdn.example.net", "mid.cdn.example.net": "edge.cdn.example.net"})
    egressd(policy())
    for addr in ("203.0.113.10", "2001:db8:3::10"):
        assert rejected(lab.tcp_connect(addr, 443)), addr
    # The CDN name itself is not allowlisted.
    check_answer(lab.dns_query("edge.cdn.example.net"), "REFUSED", "the CDN name asked directly")

    r = lab.dns_query(alias)
    check_answer(r, "NOERROR", alias)
    chain = [(rec.type, rec.name, rec.data) for rec in r.records]
    assert chain == [("CNAME", alias, "mid.cdn.example.net"), ("CNAME", "mid.cdn.example.net", "edge.cdn.example.net"),
                     ("A", "edge.cdn.example.net", "203.0.113.10")], chain
    assert lab.tcp_connect("203.0.113.10", 443) == "ok"
    assert rejected(lab.tcp_connect("2001:db8:3::10", 443)), "an A query taught an IPv6 address"
    assert resolve(lab, alias, "AAAA") == ["2001:db8:3::10"]
    assert lab.tcp_connect("2001:db8:3::10", 443) == "ok"
    lab.dns.sync()
    assert "edge.cdn.example.net" not in [q.name.lower() for q in lab.dns.queries()]


def test_aaaa_then_ipv6_connect(lab, egressd):
    serve(lab)
    egressd(policy())
    assert rejected(lab.tcp_connect(WILD_V6, 80))
    name = f"{tok()}.wild.example.org"
    assert resolve(lab, name, "AAAA", server=DNS_V6) == [WILD_V6]
    assert WILD_V6 in lab.learned_set(6)
    assert lab.tcp_connect(WILD_V6, 80) == "ok"
    # UDP too (port 7: UDP 443 of a name-learned address must be QUIC, test_pinning_quic.py).
    assert lab.udp_exchange(WILD_V6, 7) == "ok"
    # Only what was answered: the A record of the same name was never asked.
    assert WILD_V4 not in lab.learned_set(4)
    assert rejected(lab.tcp_connect(WILD_V4, 80))


def test_negative_answer_passes_through_and_teaches_nothing(lab, egressd):
    """The upstream's NXDOMAIN for an allowed name reaches the client as it is."""
    serve(lab, extra_args=["--address=/nx.site.example.com/"])  # no address: NXDOMAIN below it
    d = egressd(policy())
    name = f"{tok()}.nx.site.example.com"
    r = lab.dns_query(name)
    check_answer(r, "NXDOMAIN", name)
    assert r.records == []
    assert name not in learned_names(d)


def test_learned_addresses_follow_the_names_across_switches(lab, egressd):
    """A switch carries learned addresses into a phase that allows their name (no re-query),
    and not into one that does not."""
    serve(lab)
    d = egressd(policy(extra="""\
  agent2: { network_mode: allowlist, allowed_hosts: ["*.WILD.example.org"] }
  other: { network_mode: allowlist, allowed_hosts: ["*.site.example.com"] }
"""))
    name = f"{tok()}.wild.example.org"
    assert resolve(lab, name) == [WILD_V4]
    flow = lab.tcp_flow(WILD_V4)
    assert d.ctl("apply", "agent2")[0] == 0
    assert WILD_V4 in lab.learned_set(chain="ph_agent2")
    assert lab.tcp_connect(WILD_V4, 80) == "ok", "learned under agent, allowed by name in agent2"
    assert flow.exchange() == "ok"
    assert d.ctl("apply", "other")[0] == 0
    assert WILD_V4 not in lab.learned_set(chain="ph_other")
    assert rejected(lab.tcp_connect(WILD_V4, 80)), "phase other does not allow the name"
    assert flow.exchange() != "ok", "a flow the new phase does not allow is cut"
    assert d.ctl("apply", "agent2")[0] == 0
    assert lab.tcp_connect(WILD_V4, 80) == "ok"


# --- transports and interception ---------------------------------------------------------------


def recv_exact(s: socket.socket, n: int, deadline: float) -> bytes:
    buf = b""
    while len(buf) < n:
        s.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise AssertionError(f"the proxy closed the connection after {len(buf)}/{n} bytes")
        buf += chunk
    return buf


def tcp_pipeline(lab, queries: list[tuple[str, str]], server: str = DNS_V4, timeout: float = 2.0) -> dict:
    """Sends every (name, qtype) on ONE TCP connection before reading; returns id -> rcode."""
    ids = random.sample(range(1, 0x10000), len(queries))
    s = lab.sandbox.socket(labmod.family_of(server), socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout
    answers = {}
    with s:
        s.settimeout(timeout)
        try:
            s.connect((server, 53))
        except OSError as e:
            raise AssertionError(f"TCP connect to [{server}]:53: {e}; {NOT_DELIVERED}") from None
        wire = b""
        for qid, (name, qtype) in zip(ids, queries):
            q = labmod.dns_build_query(name, qtype, qid)
            wire += struct.pack("!H", len(q)) + q
        s.sendall(wire)
        while len(answers) < len(queries):
            n = struct.unpack("!H", recv_exact(s, 2, deadline))[0]
            rid, rcode, _ = labmod.dns_parse_reply(recv_exact(s, n, deadline))
            answers[rid] = rcode
    return {qid: answers.get(qid) for qid in ids}


def test_dns_over_tcp(lab, egressd):
    serve(lab)
    egressd(policy())
    t = tok()
    assert rejected(lab.tcp_connect(WILD_V4, 80))
    assert resolve(lab, f"{t}.wild.example.org", tcp=True) == [WILD_V4]
    assert lab.tcp_connect(WILD_V4, 80) == "ok"
    assert resolve(lab, f"v6.{t}.wild.example.org", "AAAA", server=DNS_V6, tcp=True) == [WILD_V6]
    assert lab.tcp_connect(WILD_V6, 80) == "ok"
    for server in (DNS_V4, DNS_V6):
        check_answer(lab.dns_query(f"{t}.denied.example.net", tcp=True, server=server), "REFUSED",
                     f"denied name over TCP to {server}")
    # RFC 7766: several queries on one connection, all answered.
    got = tcp_pipeline(lab, [(f"p1.{t}.wild.example.org", "A"), (f"p2.{t}.denied.example.net", "A"),
                             (f"p3.{t}.wild.example.org", "AAAA")])
    assert list(got.values()) == ["NOERROR", "REFUSED", "NOERROR"], got
    assert sorted(q.name for q in asked(lab, t)) == sorted(
        [f"{t}.wild.example.org", f"v6.{t}.wild.example.org", f"p1.{t}.wild.example.org", f"p3.{t}.wild.example.org"])


OTHER_RESOLVERS = ("203.0.113.53", "198.51.100.53", "2001:db8:3::53", "127.0.0.11")


@pytest.mark.parametrize("phase", ["agent", "environment"], ids=["allowlist", "public"])
def test_queries_to_any_resolver_address_are_intercepted(lab, egressd, phase):
    """Nothing listens on these addresses (127.0.0.11 is Docker's embedded resolver): only the
    proxy can answer, and the answer still teaches egressd the address."""
    serve(lab)
    d = egressd(policy(), phase=phase)
    t = tok()
    for i, server in enumerate(OTHER_RESOLVERS):
        for tcp in (False, True):
            name = f"r{i}{'t' if tcp else 'u'}.{t}.wild.example.org"
            r = lab.dns_query(name, "AAAA" if ":" in server else "A", server=server, tcp=tcp)
            check_answer(r, "NOERROR", f"{name} via {'tcp' if tcp else 'udp'} {server}")
            r = lab.dns_query(f"{t}.denied.example.net", server=server, tcp=tcp)
            check_answer(r, "REFUSED" if phase == "agent" else "NOERROR",
                         f"denied name via {'tcp' if tcp else 'udp'} {server}")
    if phase == "agent":
        assert lab.tcp_connect(WILD_V4, 80) == "ok" and lab.tcp_connect(WILD_V6, 80) == "ok"
        assert not [q for q in asked(lab, t) if "denied" in q.name], "a denied name was forwarded"
    else:
        assert any(n.endswith(f"{t}.wild.example.org") for n in learned_names(d)), "public mode observes names"


# A sandbox process that is not root but has CAP_NET_RAW (Docker grants it by default; since
# Linux 5.17 it is enough for SO_MARK) puts egressd's own mark on its sockets. Prints JSON.
FORGED_MARK_CLIENT = r"""
import json, socket, struct, sys
name, mark, dns, tcp_addr = sys.argv[1], int(sys.argv[2], 0), sys.argv[3], sys.argv[4]
out = {}
q = struct.pack("!HHHHHH", 0x4d4b, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0" + struct.pack("!HH", 1, 1)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, struct.pack("I", mark))
    out["mark_set"] = True
except OSError as e:
    out["mark_set"] = str(e)
u.settimeout(1.0)
try:
    u.sendto(q, (dns, 53))
    out["udp"] = "rcode %d" % (u.recv(512)[3] & 0xF)
except OSError as e:
    out["udp"] = str(e)
# A socket of its own with the mark, and a datagram to it over lo: does it arrive?
r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
r.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, struct.pack("I", mark))
r.bind(("127.0.0.1", 0))
r.settimeout(1.0)
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"self", r.getsockname())
try:
    out["self"] = r.recv(16).decode()
except OSError as e:
    out["self"] = str(e)
t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
t.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, struct.pack("I", mark))
t.settimeout(1.0)
try:
    t.connect((tcp_addr, 53))
    t.sendall(b"tunnel\n")
    out["tcp"] = "echo" if t.recv(64) == b"tunnel\n" else "no echo"
except OSError as e:
    out["tcp"] = str(e)
print(json.dumps(out))
"""
OWN_MARK = 0x65677264  # egressd's SO_MARK on its upstream sockets (nft::kOwnTrafficMark)


def test_forged_upstream_mark_does_not_bypass_the_proxy(lab, egressd):
    """DESIGN: egressd's own traffic is exempt and nothing else is; non-allowed names never leave
    the sandbox. A sandbox process that sets egressd's SO_MARK must neither reach the upstream
    with a denied name nor open a TCP connection to some server's port 53."""
    serve(lab)
    lab.add_servers(["203.0.113.53"], tcp=(53,))  # an echo server on port 53: a would-be tunnel
    egressd(policy())
    t = tok()
    cp = lab.sandbox.exec("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          "--inh-caps=-all,+net_raw", "--ambient-caps=-all,+net_raw", "--bounding-set=-all,+net_raw",
                          sys.executable, "-c", FORGED_MARK_CLIENT, f"{t}.denied.example.net", hex(OWN_MARK), DNS_V4,
                          "203.0.113.53", check=False)
    assert cp.returncode == 0, cp.stderr
    out = json.loads(cp.stdout)
    assert out["mark_set"] is True, f"the client could not set SO_MARK: {out}"
    leaked = asked(lab, t)
    assert not leaked, (f"a sandbox process with only CAP_NET_RAW set egressd's mark {OWN_MARK:#x} and its query for "
                        f"a denied name reached the upstream ({out}): the output chain's `meta mark {OWN_MARK:#x} "
                        f"udp/tcp dport 53 accept` and dns_redirect's `meta mark != {OWN_MARK:#x}` trust a mark the "
                        f"sandbox can forge")
    assert out["tcp"] != "echo", f"a forged mark opened a TCP tunnel to 203.0.113.53:53 ({out})"


# argv: the DNS proxy's port, mark. A raw socket with the mark (SO_MARK: NET_RAW) writes a UDP
# datagram from the proxy's address and port on `lo` to a socket of the script's own, as a forged
# proxy answer would go to Docker's resolver relaying egressd's query, and one from another port.
# Prints {"proxy_port"|"other_port": [sent (True or the error), delivered]}.
FORGED_PROXY_ANSWER = r"""
import json, socket, struct, sys
port, mark = int(sys.argv[1]), int(sys.argv[2], 16)
rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rx.bind(("127.0.0.1", 0))
rx.settimeout(1.0)
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
raw.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, struct.pack("I", mark))
raw.bind(("127.0.0.1", 0))
out = {}
for key, sport in (("proxy_port", port), ("other_port", 40999)):
    body = key.encode()
    try:
        raw.sendto(struct.pack("!HHHH", sport, rx.getsockname()[1], 8 + len(body), 0) + body, ("127.0.0.1", 0))
        sent = True
    except OSError as e:
        sent = e.strerror
    try:
        delivered = rx.recv(64) == body
    except OSError as e:
        delivered = str(e)
    out[key] = [sent, delivered]
print(json.dumps(out))
"""


@pytest.mark.parametrize("which", ["own", "proxy"])
def test_a_guessed_secret_mark_buys_nothing_outside_egressds_cgroup(lab, egressd, cgroups, which):
    """The own mark (egressd's upstream sockets) and the proxy mark (its DNS proxy's) are 32-bit
    secrets, and a NET_RAW process can set any SO_MARK: an attack review searched at 0.3-0.4 M
    guesses a second, each answered (the upstream answered rather than the proxy; the proxy's
    address and port passed `lo`). Here the sandbox process has guessed right (the test reads
    the mark from the table). egressd runs in a cgroup of its own, as a sidecar or the agent
    does. From any other socket a packet loses either mark in chain own_sockets and goes on as
    if the guess were wrong: the query for a denied name is redirected to the proxy (REFUSED),
    the forged answer is dropped, and every outcome equals a wrong guess's (a drop would have
    told them apart: EPERM, found by the review). egressd's own queries still pass."""
    serve(lab)
    lab.add_servers(["203.0.113.53"], tcp=(53,))  # an echo server on port 53: a would-be tunnel
    own_cg = cgroups("egressd")
    d = egressd(policy(), extra=["--log-format", "json"], binary=in_cgroup(own_cg))
    rc, text, err = lab.nft(lab.sandbox, "list", "table", "inet", "egressd")
    assert rc == 0, err
    own, proxy = (re.search(rf" {k}=(0x[0-9a-f]{{8}})", text)[1] for k in ("mark", "proxy"))
    port = re.search(r'oif "lo" ip saddr 127\.0\.0\.1 udp sport (\d+) meta mark !=', text)[1]
    assert "meta mark != 0x00000000 jump own_sockets" in text and "chain own_foreign" in text, text
    seen = [json.loads(line) for line in d.log().splitlines() if line.startswith("{") and '"own_cgroup"' in line]
    assert [e.get("cgroup_id") for e in seen] == [own_cg.stat().st_ino], d.log()
    atk = cgroups("atk")
    t = tok()

    def attack(mark: str, name: str) -> dict:
        script, args = ((FORGED_MARK_CLIENT, [name, mark, DNS_V4, "203.0.113.53"]) if which == "own"
                        else (FORGED_PROXY_ANSWER, [port, mark]))
        caps = "-all,+net_raw,+net_bind_service"
        # Into the cgroup first: `ip netns exec` mounts a sysfs of the namespace's own, without it.
        cp = subprocess.run(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(atk / "cgroup.procs"), "ip", "netns",
                             "exec", lab.sandbox.name, "setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}",
                             sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=20)
        assert cp.returncode == 0, cp.stderr
        return json.loads(cp.stdout)

    mark = own if which == "own" else proxy
    right = attack(mark, f"{t}.denied.example.net")
    wrong = attack(hex(int(mark, 16) ^ 1), f"w{t}.denied.example.net")
    print(f"\n{which} mark from cgroup {atk.name}: right {right}, wrong {wrong}")
    if which == "own":
        assert right["mark_set"] is True, right
        assert not asked(lab, t), f"a sandbox process with egressd's own mark reached the upstream: {right}"
        assert right["udp"] == "rcode 5", right  # the proxy's REFUSED
        assert right["tcp"] != "echo", f"egressd's own mark opened a TCP tunnel to 203.0.113.53:53 ({right})"
        assert right["self"] == "self", right
        del right["mark_set"], wrong["mark_set"]
    else:
        assert right["proxy_port"] == ["Operation not permitted", "timed out"], right
        assert right["other_port"] == [True, True], right
    assert right == wrong, "a right guess is told from a wrong one"
    # The ladder took the mark off, and egressd's own marked traffic still passes.
    unmarked = re.findall(r"counter packets (\d+) bytes",
                          lab.nft(lab.sandbox, "list", "chain", "inet", "egressd", "own_foreign")[1])
    assert sum(map(int, unmarked)) >= 1
    assert resolve(lab, f"ok.{t}.wild.example.org") == [WILD_V4]


HOLD_PORTS = r"""
import socket, sys
held = []
for port in range(int(sys.argv[1]), int(sys.argv[2]) + 1):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)  # dual-stack: IPv4's port too
    s.bind(("::", port))
    held.append(s)
print("READY", flush=True)
sys.stdin.read()
"""


def test_egressd_learns_its_cgroup_while_the_sandbox_holds_every_free_port(lab, egressd, cgroups):
    """Found by an attack review: egressd learned its cgroup from a UDP socket bound to a free
    port of the sandbox's namespace, so a process with no capability that held every ephemeral
    port made the lookup fail at egressd's start or restart, and egressd ran without the cgroup
    check (its table restaged without it, the old marks kept). It now learns it from a raw
    socket, which takes no port. Here the namespace's ephemeral range is 16 ports, all held by
    uid 65534."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40015")
    holder = lab.spawn(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                        "--bounding-set=-all", sys.executable, "-c", HOLD_PORTS, "40000", "40015"],
                       netns=lab.sandbox, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert labmod._read_line(holder, 10.0, "the port holder") == "READY"
    own_cg = cgroups("egressd")
    d = egressd(policy(), extra=["--log-format", "json"], binary=in_cgroup(own_cg))
    events = [json.loads(line) for line in d.log().splitlines() if line.startswith("{") and "own_cgroup" in line]
    assert [(e.get("event"), e.get("cgroup_id")) for e in events] == [("own_cgroup", own_cg.stat().st_ino)], d.log()
    rc, text, _ = lab.nft(lab.sandbox, "list", "table", "inet", "egressd")
    assert "jump own_sockets" in text


def test_egressd_in_the_root_cgroup_says_it_cannot_tell_its_sockets_from_the_sandboxs(lab, egressd):
    """Found by an attack review: egressd in the cgroup v2 hierarchy's root counted that as its
    own cgroup, but the root is where every process nobody placed is: a sandbox's started
    beside it (the lab's processes, on a host without systemd), every process of a cgroup v1
    host. A sandbox
    process there passed the check with a guessed mark. egressd now says it cannot tell them
    apart (warning own_cgroup_unverified, with the reason) and keeps the marks alone."""
    serve(lab)
    d = egressd(policy(), extra=["--log-format", "json"], binary=in_cgroup(labmod.cgroup2_mount()))
    events = [json.loads(line) for line in d.log().splitlines() if line.startswith("{") and "own_cgroup" in line]
    assert [e.get("event") for e in events] == ["own_cgroup_unverified"], d.log()
    assert "root of the cgroup v2 hierarchy" in events[0]["reason"], events
    assert events[0]["level"] == "warning"
    rc, text, _ = lab.nft(lab.sandbox, "list", "table", "inet", "egressd")
    assert "own_sockets" not in text and "own_input" not in text


# argv: upstream, first port, last port. From each port in turn, one query to the upstream's
# port 53 (redirected to the proxy: conntrack keeps the redirect for that port), then the port
# is let go. No capability.
PORT_TRAP = r"""
import socket, struct, sys
up, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
q = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"\x04trap\x07example\x03net\x00" + struct.pack("!HH", 1, 1)
for port in range(lo, hi + 1):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("0.0.0.0", port))
        s.sendto(q, (up, 53))
"""


def test_a_redirect_left_in_conntrack_never_loops_egressds_own_queries(lab, egressd):
    """Found by an attack review: a process with no capability sends one query to the upstream
    from each ephemeral port and lets the port go; conntrack keeps each flow's redirect to the
    proxy. A query of egressd's that later leaves from such a port follows the stored redirect
    (nat sees new flows only) back to egressd's own proxy, which forwards it again: in a loop,
    hundreds of copies per query to the proxy and the upstream. egressd's own queries to its
    proxy are now dropped, nothing loops; and the trapped port's stale entry is then deleted and
    the query sent again, so it is answered all the same (it failed, SERVFAIL, until 79ec9ff).
    Here the namespace's ephemeral range is 16 ports, every one of them trapped."""
    serve(lab)
    lab.sandbox.sysctl("net.ipv4.ip_local_port_range", "40000 40015")
    d = egressd(policy())
    cp = lab.sandbox.exec("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                          "--bounding-set=-all", sys.executable, "-c", PORT_TRAP, DNS_V4, "40000", "40015",
                          check=False)
    assert cp.returncode == 0, cp.stderr
    before = d.status()["dns"]["forwarded"]
    t = tok()
    answers = [lab.dns_query(f"q{i}.{t}.wild.example.org", timeout=3.0) for i in range(4)]
    forwarded = d.status()["dns"]["forwarded"] - before
    print(f"\n{[(r.outcome, r.rcode) for r in answers]}; forwarded {forwarded}; asked {len(asked(lab, t))}")
    assert forwarded <= 2 * len(answers), f"{forwarded} queries forwarded for {len(answers)}: egressd's queries loop"
    assert len(asked(lab, t)) <= len(answers)
    assert all((r.outcome, r.rcode) == ("ok", "NOERROR") for r in answers), answers
    dropped = re.findall(r"meta mark 0x[0-9a-f]{8} ip daddr 127\.0\.0\.1 udp dport 53 counter packets (\d+)",
                         lab.nft(lab.sandbox, "list", "chain", "inet", "egressd", "output")[1])
    assert dropped and int(dropped[0]) >= 1, "no query of egressd's followed a stored redirect: the trap did not work"


# argv: upstream, denied name, seconds. Watches /proc/net/udp for sockets connected to the
# upstream's port 53 (egressd's) and, from each one's port, writes the name's query to the
# upstream with a raw socket (NET_RAW). Prints {"fired": [port, ...]}.
RAW_RIDE = r"""
import json, socket, struct, sys, time
up, name, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
q = struct.pack("!HHHHHH", 0x4343, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\x00" + struct.pack("!HH", 1, 1)
rem = "%08X:0035" % struct.unpack("<I", socket.inet_aton(up))[0]
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
print("READY", flush=True)
end, seen, fired = time.time() + secs, set(), []
while time.time() < end and len(fired) < 20:
    for line in open("/proc/net/udp").read().splitlines()[1:]:
        f = line.split()
        port = int(f[1].split(":")[1], 16)
        if f[2] != rem or port in seen:
            continue
        seen.add(port)
        try:
            raw.sendto(struct.pack("!HHHH", port, 53, 8 + len(q), 0) + q, (up, 0))
            fired.append(port)
        except OSError as e:
            fired.append([port, e.strerror])
print(json.dumps({"fired": fired}))
"""


def test_a_raw_packet_on_egressds_own_flow_takes_no_query_past_the_proxy(lab, egressd):
    """Found by an attack review: egressd's upstream sockets are listed in /proc/net/udp, and a
    datagram a raw socket (NET_RAW) writes from one's port to the upstream belongs to egressd's
    flow: the redirect (new flows only) never sees it, it carries no own mark, and where the
    phase allows the upstream's address it passed, a query for a denied name past the proxy
    (9 of 20 tries). Nothing but egressd's own marked packets goes out on its flows now."""
    serve(lab)
    egressd(policy(agent=list(AGENT_HOSTS) + ["192.0.2.0/24"]))
    def denied() -> int:
        n = re.findall(r"ct direction original ct mark 0x7ffffffe counter packets (\d+)",
                       lab.nft(lab.sandbox, "list", "chain", "inet", "egressd", "output")[1])
        assert n, "no deny rule for egressd's own flows"
        return int(n[0])
    # Rounds until a datagram met a flow still open (under load every query may be answered,
    # and its flow forgotten, before the rider writes: then it starts a flow of its own,
    # which the redirect takes to the proxy). Every round must leak nothing.
    for _ in range(4):
        t = tok()
        p = lab.spawn(["setpriv", "--inh-caps=-all,+net_raw", "--bounding-set=-all,+net_raw", sys.executable, "-c",
                       RAW_RIDE, DNS_V4, f"{t}.denied.example.net", "6"], netns=lab.sandbox, stdout=subprocess.PIPE)
        assert labmod._read_line(p, 10.0, "the rider") == "READY"
        for i in range(150):  # egressd's upstream queries, for the rider to find
            lab.dns_query(f"r{i}.{tok()}.wild.example.org", timeout=2.0)
            if p.poll() is not None:
                break
        out, _ = p.communicate(timeout=30)
        fired = json.loads((getattr(p, "_lab_pending", b"") + out).decode().strip().splitlines()[-1])["fired"]
        print(f"\nrode {len(fired)} of egressd's flows: {fired}")
        assert fired, "the rider found none of egressd's upstream sockets"
        assert not asked(lab, t), f"a raw datagram on egressd's own flow reached the upstream: {fired}"
        if denied() >= 1:
            break
    assert denied() >= 1, "no datagram of the rider's met one of egressd's flows while it was open"


# argv: marks (hex). An AF_PACKET socket on lo with SO_RCVMARK reads the mark of each frame
# that leaves lo; a datagram to a socket of the script's own is sent with each mark in turn.
# Prints {mark: the mark its frame left with (hex), or "none"}.
LO_TAP = r"""
import json, socket, struct, sys, time
ps = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0003))
ps.bind(("lo", 0))
ps.setsockopt(socket.SOL_SOCKET, 75, 1)  # SO_RCVMARK
ps.settimeout(0.5)
rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rx.bind(("127.0.0.1", 0))
out = {}
for m in sys.argv[1:]:
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, struct.pack("I", int(m, 16)))
    tag = b"tap" + m.encode()
    tx.sendto(tag, rx.getsockname())
    out[m] = "none"
    end = time.time() + 1.0
    while time.time() < end:
        try:
            data, anc, _, addr = ps.recvmsg(2048, 64)
        except socket.timeout:
            break
        if addr[2] == socket.PACKET_OUTGOING and data.endswith(tag):
            out[m] = next((hex(struct.unpack("I", d[:4])[0]) for l, t, d in anc if l == socket.SOL_SOCKET and t == 36),
                          "no mark")
            break
print(json.dumps(out))
"""


def test_no_tap_on_lo_tells_a_secret_mark_by_what_leaves(lab, egressd, cgroups):
    """Found by an attack review: chain own_sockets takes the own and the proxy mark off a
    sandbox's packet and leaves any other mark, and an AF_PACKET socket on lo reads the mark of
    each frame that leaves (SO_RCVMARK, NET_RAW): a right guess showed as 0, a wrong one as
    itself (170k guesses a second). Every frame now leaves lo without a mark."""
    serve(lab)
    own_cg = cgroups("egressd")
    egressd(policy(), binary=in_cgroup(own_cg))
    rc, text, err = lab.nft(lab.sandbox, "list", "table", "inet", "egressd")
    assert rc == 0, err
    own, proxy = (re.search(rf" {k}=(0x[0-9a-f]{{8}})", text)[1] for k in ("mark", "proxy"))
    marks = [own, proxy, hex(int(own, 16) ^ 1), "0x12345678"]
    atk = cgroups("atk")
    caps = "-all,+net_raw"
    cp = subprocess.run(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(atk / "cgroup.procs"), "ip", "netns", "exec",
                         lab.sandbox.name, "setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", sys.executable,
                         "-c", LO_TAP, *marks], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    seen = json.loads(cp.stdout)
    print(f"\nmarks on lo: {seen}")
    assert set(seen.values()) == {"0x0"}, f"a frame left lo with a mark a tap can read: {seen}"


def in_cgroup(cg) -> list[str]:
    """An egressd command line that runs it in cgroup `cg`, as a sidecar's container or a
    systemd unit does."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg / "cgroup.procs"), str(labmod.egressd_binary())]


def test_egressd_restarted_in_another_cgroup_adopts_the_table_and_still_resolves(lab, egressd, cgroups):
    """A sidecar container that restarts comes back in a new cgroup (a new id, even at the same
    path). Its restart adopts the table unchanged (same config, no window) and re-fills chain
    own_sockets with the new cgroup in the same batch: its own upstream queries pass again, and
    the old cgroup's id is gone from the rules."""
    serve(lab)
    first, second = cgroups("first"), cgroups("second")
    d = egressd(policy(), binary=in_cgroup(first), extra=["--log-format", "json"])
    t = tok()
    assert resolve(lab, f"a.{t}.wild.example.org") == [WILD_V4]

    def ladder():
        return lab.nft(lab.sandbox, "list", "chain", "inet", "egressd", "own_sockets")[1]
    assert f"socket cgroupv2 level 1 {first.stat().st_ino} return" in ladder()
    d.restart(binary=in_cgroup(second))
    adopted = [json.loads(line) for line in d.log().splitlines() if line.startswith("{") and '"adoption"' in line]
    assert [e.get("restaged") for e in adopted] == [False], d.log()
    assert f"socket cgroupv2 level 1 {second.stat().st_ino} return" in ladder()
    assert str(first.stat().st_ino) not in ladder()
    assert resolve(lab, f"b.{t}.wild.example.org") == [WILD_V4]


# argv: upstream, port, denied name. Bound to `port`, one query for the name to the upstream's
# port 53 (an unprivileged process: no capability).
QUERY_FROM_PORT = r"""
import json, socket, struct, sys
up, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
q = struct.pack("!HHHHHH", 0x1d1d, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0" + struct.pack("!HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", port))
s.settimeout(2.0)
try:
    s.sendto(q, (up, 53))
    print(json.dumps({"rcode": s.recv(512)[3] & 0xF}))
except OSError as e:
    print(json.dumps({"error": str(e)}))
"""


def test_a_late_answer_from_the_upstream_opens_no_way_past_the_proxy(lab, egressd):
    """Found by an attack review: an upstream's late or repeated answer, arriving after egressd has
    given up the query's socket and deleted its flow, started a new flow from upstream:53 to that
    port, which chain input marked inbound. A sandbox process that bound the port (one datagram
    from each port finds it) could then send the upstream any query as a reply on that flow, not
    redirected to the proxy: a denied name reached the upstream. Chain input now drops a new flow
    from an upstream's port 53. Here the upstream's datagram is written from its address with a
    raw socket, to a port the test picks."""
    serve(lab)
    egressd(policy())
    port = 45671
    raw = lab.internet.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    with raw:
        raw.bind((DNS_V4, 0))
        late = b"late answer"
        raw.sendto(struct.pack("!HHHH", 53, port, 8 + len(late), 0) + late, (labmod.SANDBOX_V4, 0))
    # The ping follows the datagram on the veth: its answer means the datagram went through the
    # sandbox's input chain (nothing listens on the port).
    assert lab.internet.ping(labmod.SANDBOX_V4, timeout=3.0) == "ok"
    t = tok()
    cp = lab.sandbox.exec("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                          "--bounding-set=-all", sys.executable, "-c", QUERY_FROM_PORT, DNS_V4, str(port),
                          f"{t}.denied.example.net", check=False)
    assert cp.returncode == 0, cp.stderr
    out = json.loads(cp.stdout)
    print(f"\n{out}")
    assert not asked(lab, t), f"a query from the port of a late upstream answer reached the upstream: {out}"
    assert out == {"rcode": 5}, out  # redirected to the proxy like any query: REFUSED


# --- no race between the answer and the set -------------------------------------------------------


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "all-at-once"])
def test_fresh_names_connect_at_once(lab, egressd, together):
    """50 names never seen before, each with an address of its own that is not in any set
    yet: the connect right after the answer must never be refused."""
    n = 50
    t = tok()
    addrs = [f"198.51.100.{100 + i}" for i in range(n // 2)] + [f"2001:db8:2::{100 + i:x}" for i in range(n - n // 2)]
    names = [f"n{i}.{t}.fresh.example.org" for i in range(n)]
    lab.add_servers(addrs, tcp=(labmod.ECHO_PORT,))
    serve(lab, hosts=dict(zip(names, ([a] for a in addrs))))
    egressd(policy())
    assert all(rejected(lab.tcp_connect(a, labmod.ECHO_PORT)) for a in addrs), "some address allowed before its answer"

    def one(i):
        qtype = "AAAA" if ":" in addrs[i] else "A"
        r = lab.dns_query(names[i], qtype)
        if r.outcome != "ok" or r.rcode != "NOERROR" or r.addresses != [addrs[i]]:
            return f"{qtype} {names[i]}: {r.outcome!r} {r.rcode} {r.records}"
        out = lab.tcp_connect(addrs[i], labmod.ECHO_PORT)
        return None if out == "ok" else f"connect {addrs[i]} right after the answer for {names[i]}: {out!r}"

    if together:
        barrier = threading.Barrier(n, timeout=10)

        def at_once(i):
            barrier.wait()
            return one(i)

        with ThreadPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(at_once, range(n)))
    else:
        results = [one(i) for i in range(n)]
    failures = [r for r in results if r]
    assert not failures, f"{len(failures)}/{n} failed:\n" + "\n".join(failures)


# --- expiry -----------------------------------------------------------------------------------


def test_expired_address_keeps_flow_refuses_new_connection(lab, egressd):
    """TTL 1 s and min_ttl 1s: the element lives 1 + 10 s (grace). After that a flow opened
    before keeps working (conntrack mark), a new connection is refused, and a fresh answer
    lets it in again."""
    serve(lab, ttl=1)
    d = egressd(policy(dns="min_ttl: 1s"))
    name = f"{tok()}.wild.example.org"
    assert rejected(lab.tcp_connect(WILD_V4, labmod.ECHO_PORT))
    r = lab.dns_query(name)
    check_answer(r, "NOERROR", name)
    assert r.ttl(WILD_V4) == 1, r.records
    elem = lab.learned_set().get(WILD_V4)
    assert elem and elem["timeout"] == 11, f"timeout max(1, 1) + 10 = 11 s, got {elem}"
    flow = lab.tcp_flow(WILD_V4)
    t0 = time.monotonic()
    labmod.wait_for(lambda: WILD_V4 not in lab.learned_set(), 15.0, f"{WILD_V4} to expire from ph_agent_d4")
    assert time.monotonic() - t0 > 9.0, "the element left the set long before its timeout"
    assert flow.exchange() == "ok", "a live flow to an expired address was cut"
    out = lab.tcp_connect(WILD_V4, labmod.ECHO_PORT)
    assert rejected(out), f"a new connection to an expired address: {out!r}, want refused"
    labmod.wait_for(lambda: name not in learned_names(d), 2.0, f"{name} to leave status' learned list")
    assert flow.exchange() == "ok"
    assert resolve(lab, name) == [WILD_V4]
    assert lab.tcp_connect(WILD_V4, labmod.ECHO_PORT) == "ok", "a fresh answer lets new connections in again"
    flow.close()


@pytest.mark.parametrize("ttl,min_ttl,want", [(60, "30s", 70), (5, "30s", 40), (20, "1m", 70)],
                         ids=["ttl-wins", "min_ttl-wins", "min_ttl-minutes"])
def test_learned_timeout_is_max_ttl_min_ttl_plus_grace(lab, egressd, ttl, min_ttl, want):
    serve(lab, ttl=ttl)
    d = egressd(policy(dns=f"min_ttl: {min_ttl}"))
    name = f"{tok()}.wild.example.org"
    resolve(lab, name)
    resolve(lab, name, "AAAA")
    assert lab.learned_set(4)[WILD_V4]["timeout"] == want
    assert lab.learned_set(6)[WILD_V6]["timeout"] == want
    left = learned_names(d)[name]
    assert all(want - 3 <= s <= want for s in left.values()), left


def test_a_name_answered_again_keeps_its_address_for_the_new_answer(lab, egressd):
    """A client that asks again when its answer's TTL runs out gets a new answer, good for
    another TTL: the address's element must live that long too. Re-adding an element the
    kernel has does not extend it (6.18 changes it only for a different timeout; kernels before
    6.10 never), so egressd's add of it again changed nothing and the element lapsed TTL + grace after the first
    answer: the client was refused while it held a valid answer (this test, before the fix:
    63 s left after the answer at 6 s, where 70 s are due). Answers within 5 s (half the grace)
    of the element's last write find it outliving their TTL by 5 s or more and cost no commit
    (a name asked again and again: a package index, an API), so they never wait on the nftables
    commit lock. nft shows whole seconds left, rounded down."""
    serve(lab, ttl=60)
    egressd(policy())
    name = f"{tok()}.wild.example.org"
    assert resolve(lab, name) == [WILD_V4]

    def left() -> float:
        e = lab.learned_set().get(WILD_V4)
        assert e and e["timeout"] == 70, f"timeout 60 + 10 s, got {e}"
        return e["expires"]

    labmod.wait_for(lambda: left() <= 68, 10.0, "the element's first 2 s to pass")  # < 5 s still
    for _ in range(20):
        assert resolve(lab, name) == [WILD_V4]
    assert left() <= 68, "an answer within 5 s of the insertion committed the element again"
    # nft shows whole seconds left, rounded down: 63 is more than 6 s after the insertion.
    labmod.wait_for(lambda: left() <= 63, 10.0, "6 s after the insertion to pass")
    assert resolve(lab, name) == [WILD_V4]
    assert left() >= 68, ("the answer 6 s after the first did not extend the element: its clients are refused "
                          "70 s after the first answer, 6 s before their new answer runs out")


# --- upstream failures ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["stopped", "on-link-silent", "routed-silent"])
def test_upstream_down_gives_servfail_fast(lab, egressd, how):
    """stopped: dnsmasq gone, ICMP port unreachable comes back; on-link-silent: 192.0.2.99 on
    the veth's subnet, neighbour discovery never answers; routed-silent: 198.51.100.99 routed to
    the internet namespace, which drops it."""
    upstream = {"stopped": DNS_V4, "on-link-silent": "192.0.2.99", "routed-silent": "198.51.100.99"}[how]
    serve(lab)
    d = egressd(policy(upstream=upstream))
    if how == "stopped":
        lab.dns.stop()
    t = tok()
    before = dns_counters(d)
    for name, qtype, tcp in ((f"u.{t}.wild.example.org", "A", False), (f"v.{t}.wild.example.org", "AAAA", False),
                             (f"w.{t}.wild.example.org", "A", True)):
        r = lab.dns_query(name, qtype, tcp=tcp, timeout=5.0)
        check_answer(r, "SERVFAIL", f"{qtype} {name} with the upstream {how}")
        assert r.outcome.elapsed < 2.0, f"SERVFAIL after {r.outcome.elapsed:.2f} s, want < 2 s"
    # Denied names do not wait for the upstream at all.
    r = lab.dns_query(f"{t}.denied.example.net")
    check_answer(r, "REFUSED", "denied name with the upstream down")
    assert r.outcome.elapsed < FAST
    assert delta(before, dns_counters(d))["failed"] == 3
    assert rejected(lab.tcp_connect(WILD_V4, 80)), "a failed query taught an address"
    if how == "stopped":
        lab.dns.start()
        assert resolve(lab, f"back.{t}.wild.example.org") == [WILD_V4], "the proxy recovers with the upstream"


# --- malformed queries --------------------------------------------------------------------------

BAD_ID = 0xBAD0


def _header(flags=0x0100, qd=1, an=0, ns=0, ar=0, qid=BAD_ID) -> bytes:
    return struct.pack("!HHHHHH", qid, flags, qd, an, ns, ar)


def _question(name: str, qtype: int = 1) -> bytes:
    return labmod.dns_build_query(name, qtype, 0)[12:]


def malformed_packets(t: str) -> dict:
    allowed = f"{t}.wild.example.org"
    a_record = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(WILD_V4)
    return {
        "random-bytes": struct.pack("!H", BAD_ID) + random.Random(53).randbytes(46),
        "empty": b"",
        "truncated-header": _header()[:7],
        "header-only": _header(),
        "question-cut": _header() + _question(allowed)[:-3],
        "label-past-end": _header() + b"\x3fabc",
        "pointer-loop": _header() + b"\xc0\x0c" + struct.pack("!HH", 1, 1),
        "pointer-pair-loop": _header() + b"\xc0\x0e\xc0\x0c" + struct.pack("!HH", 1, 1),
        "qdcount-2": _header(qd=2) + _question(allowed) + _question(f"{t}.denied.example.net"),
        "qdcount-0": _header(qd=0),
        "answer-in-query": _header(an=1) + _question(allowed) + a_record,
        "name-too-long": _header() + b"".join(b"\x3f" + b"x" * 63 for _ in range(5)) + b"\0" + struct.pack("!HH", 1, 1),
        "trailing-bytes": _header() + _question(allowed) + b"\x00\x01junk",
        "opcode-update": _header(flags=5 << 11) + _question(allowed),
        "response-bit": _header(flags=0x8180) + _question(allowed),
    }


MALFORMED = list(malformed_packets("x"))


def bad_then_good(lab, bad: bytes, good: str, timeout: float = 2.0):
    """Sends `bad`, then an A query for `good`, on one UDP socket. One flow, one proxy socket:
    the proxy reads them in that order and answers the bad one (if at all) at once, before
    the good one's upstream answer. Returns (replies before the good answer, good answer)."""
    qid = BAD_ID ^ 0x5A5A
    s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_DGRAM)
    deadline = time.monotonic() + timeout
    before = []
    with s:
        s.connect((DNS_V4, 53))
        try:
            s.send(bad)
            s.send(labmod.dns_build_query(good, "A", qid))
        except OSError as e:
            raise AssertionError(f"send to {DNS_V4}:53: {e}; {NOT_DELIVERED}") from None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return before, None
            s.settimeout(remaining)
            try:
                msg = s.recv(65536)
            except TimeoutError:
                return before, None
            if len(msg) >= 12 and struct.unpack_from("!H", msg)[0] == qid:
                return before, labmod.dns_parse_reply(msg)
            before.append(msg)


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_query_is_answered_or_dropped(lab, egressd, kind):
    serve(lab)
    d = egressd(policy())
    t = tok()
    bad = malformed_packets(t)[kind]
    c0 = dns_counters(d)
    replies, good = bad_then_good(lab, bad, f"ok.{t}.wild.example.org")
    assert good is not None, f"no answer to a valid query sent after the {kind} packet: the proxy stopped serving"
    assert good[1] == "NOERROR" and [r.data for r in good[2]] == [WILD_V4], good
    assert len(replies) <= 1, replies
    for msg in replies:
        assert len(msg) >= 12, f"{kind}: a reply shorter than a header: {msg!r}"
        rid, flags = struct.unpack_from("!HH", msg)
        rcode = labmod.RCODES.get(flags & 0xF, str(flags & 0xF))
        assert flags & 0x8000 and rcode in ("FORMERR", "NOTIMP"), f"{kind}: reply {rcode} flags {flags:#06x}"
        assert rid == struct.unpack_from("!H", bad)[0], f"{kind}: reply id {rid:#06x} is not the query's"
        assert struct.unpack_from("!H", msg, 6)[0] == 0, f"{kind}: a FORMERR/NOTIMP with answers: {msg!r}"
    if kind == "response-bit":
        assert replies == [], "a response must never be answered (that is how reflection loops start)"
    assert [q.name for q in asked(lab, t)] == [f"ok.{t}.wild.example.org"], f"{kind}: something else was forwarded"
    assert delta(c0, dns_counters(d)) == {"forwarded": 1, "refused": 0, "failed": 0, "malformed": 1}
    assert d.request({"cmd": "ping"}).get("ok") is True


def test_malformed_tcp_frames_do_not_stop_the_proxy(lab, egressd):
    serve(lab)
    egressd(policy())
    t = tok()
    frames = {
        "zero-length": b"\x00\x00",
        "garbage": b"\x00\x05" + b"\xff" * 5,
        "pointer-loop": struct.pack("!H", 18) + _header() + b"\xc0\x0c" + struct.pack("!HH", 1, 1),
        "short-then-close": b"\x00\x40" + b"\x00" * 10,    # promises 64 bytes, sends 10, closes
    }
    for kind, data in frames.items():
        s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_STREAM)
        with s:
            s.settimeout(2.0)
            try:
                s.connect((DNS_V4, 53))
            except OSError as e:
                pytest.fail(f"TCP connect to {DNS_V4}:53: {e}; {NOT_DELIVERED}")
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 2.0
            got = b""
            try:
                while time.monotonic() < deadline:  # until the proxy answers and/or closes
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                else:
                    pytest.fail(f"{kind}: the proxy kept the connection open 2 s after the client's FIN")
            except ConnectionResetError:
                pass
            except TimeoutError:
                pytest.fail(f"{kind}: the proxy kept the connection open 2 s after the client's FIN")
        if len(got) >= 6:
            flags = struct.unpack_from("!H", got, 4)[0]
            assert flags & 0xF in (1, 4), f"{kind}: answered {got!r}, want FORMERR/NOTIMP or nothing"
        assert resolve(lab, f"{kind}.{t}.wild.example.org", tcp=True) == [WILD_V4], f"after {kind}"
    assert asked(lab, t) and all(q.name.startswith(tuple(frames)) for q in asked(lab, t))


# --- pre-resolution -------------------------------------------------------------------------------


def preresolve_policy(unknown: str) -> str:
    return policy(extra=f"""\
  tools:
    network_mode: allowlist
    allowed_hosts: [b.example.com, c.example.net, {unknown}]
""")


def test_apply_preresolves_exact_hostnames(lab, egressd):
    serve(lab)
    unknown = f"{tok('nosuch')}.example.com"
    d = egressd(preresolve_policy(unknown))
    reachable = ("198.51.100.11", "2001:db8:2::11", "203.0.113.10")
    for addr in reachable:
        assert rejected(lab.tcp_connect(addr, 80)), f"{addr} before the switch"
    c0 = dns_counters(d)

    reply = d.request({"cmd": "apply", "phase": "tools"})
    assert reply.get("ok") is True, reply
    assert reply.get("unresolved") == [unknown], reply
    # No query from the sandbox: the addresses are in the phase's sets with the switch.
    wrong = [f"{a}: {out!r}" for a in reachable if (out := lab.tcp_connect(a, 80)) != "ok"]
    assert not wrong, "pre-resolved addresses not reachable right after apply:\n" + "\n".join(wrong)
    assert delta(c0, dns_counters(d))["forwarded"] == 0, "the test itself sent no query"
    assert rejected(lab.tcp_connect("198.51.100.10", 80)), "a.example.com is not in phase tools"
    st = d.ctl_json("status", "--json")
    states = {e["entry"]: e["state"] for e in st["entries"]}
    assert states == {"b.example.com": "resolved", "c.example.net": "resolved", unknown: "unresolved"}, states
    names = learned_names(d)
    assert set(names.get("b.example.com", {})) == {"198.51.100.11", "2001:db8:2::11"}, names
    assert set(names.get("c.example.net", {})) == {"203.0.113.10"}, names
    assert unknown not in names

    # egressctl says which names did not resolve.
    assert d.ctl("apply", "agent")[0] == 0
    rc, out, err = d.ctl("apply", "tools")
    assert rc == 0, err
    line = next((ln for ln in out.splitlines() if "not resolved" in ln), "")
    listed = line.partition(":")[2].partition("(")[0]
    assert [n.strip() for n in listed.split(",")] == [unknown], out


# An upstream whose answers a test scripts: name -> [address, delay s], re-read from a file at every
# query (so an address can change), each query logged (monotonic time, name, type).
SCRIPTED_UPSTREAM = r"""
import json, socket, struct, sys, threading, time
addr, mapfile = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((addr, 53))
print("READY", flush=True)
while True:
    msg, peer = s.recvfrom(65536)
    i, labels = 12, []
    while i < len(msg) and msg[i]:
        labels.append(msg[i + 1:i + 1 + msg[i]].decode(errors="replace")); i += 1 + msg[i]
    if i + 5 > len(msg):
        continue
    name, question, qtype = ".".join(labels).lower(), msg[12:i + 5], struct.unpack_from("!H", msg, i + 1)[0]
    m = json.load(open(mapfile))
    if name not in m:
        continue
    a, delay = m[name]
    with open(mapfile + ".log", "a") as f:
        f.write(f"{name} {qtype}\n")
    an = 1 if qtype == 1 else 0
    out = struct.pack("!HHHHHH", struct.unpack_from("!H", msg)[0], 0x8180, 1, an, 0, 0) + question
    if an:
        out += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(a)
    threading.Timer(delay, lambda d=out, p=peer: s.sendto(d, p)).start()  # an upstream slow to answer
"""


def test_an_answer_during_a_switchs_pre_resolution_is_in_the_phase_in_force(lab, egressd):
    """A switch pre-resolves its names while the old phase is still in force. It used to put
    what it found in the learned store at once; an answer to the sandbox for a name both phases
    allow, carrying such an address, then looked already written (the store skips re-writing a
    pair whose element outlives the answer) and was released although the old phase's set did
    not have the address: the client's connection was refused until the switch landed (found
    by an attack review). Now the pre-resolved pairs are remembered with the switch itself."""
    upstream, old, new = "198.51.100.53", "198.51.100.10", "198.51.100.11"
    mapfile = lab.tmp / "upstream.json"
    mapfile.write_text(json.dumps({"fast.example.org": [old, 0], "slow.example.org": [old, 2.0]}))
    lab.internet.ip("addr", "add", f"{upstream}/32", "dev", "lo")
    p = lab.spawn([sys.executable, "-c", SCRIPTED_UPSTREAM, upstream, str(mapfile)], netns=lab.internet,
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert labmod._read_line(p, 10.0, "the scripted upstream") == "READY"
    d = egressd(f"""\
initial_phase: a
dns: {{ upstream: ["{upstream}"] }}
phases:
  a: {{ network_mode: allowlist, allowed_hosts: ["fast.example.org"] }}
  b: {{ network_mode: allowlist, allowed_hosts: ["fast.example.org", "slow.example.org"] }}
""")
    labmod.wait_for(lambda: old in lab.learned_set(4, "ph_a"), 5.0, "the start's pre-resolution of fast.example.org")
    # The name's address moves (a CDN, a failover); phase b's pre-resolution finds the new one,
    # and waits 2 s for slow.example.org.
    mapfile.write_text(json.dumps({"fast.example.org": [new, 0], "slow.example.org": [old, 2.0]}))
    log = Path(str(mapfile) + ".log")

    def fast_asked() -> int:
        return sum(1 for ln in log.read_text().splitlines() if ln == "fast.example.org 1") if log.exists() else 0

    before = fast_asked()
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    c.connect(str(d.socket_path))
    with c:
        c.sendall(json.dumps({"cmd": "apply", "phase": "b"}).encode() + b"\n")
        labmod.wait_for(lambda: fast_asked() > before, 3.0, "the switch's pre-resolution of fast.example.org")
        r = lab.dns_query("fast.example.org", timeout=3.0)
        assert (r.outcome, r.rcode, r.addresses) == ("ok", "NOERROR", [new]), r
        assert d.status()["phase"] == "a", "the switch landed before the answer: the test proves nothing"
        assert new in lab.learned_set(4, "ph_a"), "the answer was released with its address in no set of phase a"
        assert lab.udp_exchange(new, labmod.ECHO_PORT) == "ok"
        reply = b""
        while b"\n" not in reply:
            chunk = c.recv(65536)
            assert chunk, "the switch's reply"
            reply += chunk
    assert json.loads(reply.split(b"\n", 1)[0]).get("ok") is True, reply
    assert new in lab.learned_set(4, "ph_b")


def test_start_preresolves_initial_phase(lab, egressd):
    serve(lab)
    unknown = f"{tok('nosuch')}.example.com"
    d = egressd(preresolve_policy(unknown), phase="tools")

    def resolved():
        states = {e["entry"]: e["state"] for e in d.ctl_json("status", "--json")["entries"]}
        return states.get("b.example.com") == "resolved" and states.get("c.example.net") == "resolved"

    labmod.wait_for(resolved, 3.0, "b.example.com and c.example.net to be pre-resolved at start")
    for addr in ("198.51.100.11", "2001:db8:2::11", "203.0.113.10"):
        assert lab.tcp_connect(addr, 80) == "ok", addr
    states = {e["entry"]: e["state"] for e in d.ctl_json("status", "--json")["entries"]}
    assert states[unknown] == "unresolved", states


# --- status ---------------------------------------------------------------------------------------


def test_status_shows_learned_and_dns_counters(lab, egressd):
    serve(lab)
    d = egressd(policy())
    st = d.ctl_json("status", "--json")
    assert set(st["dns"]) >= {"forwarded", "refused", "failed", "malformed"}, st["dns"]
    assert isinstance(st["learned"], list)
    c0 = st["dns"]
    t = tok()
    name = f"{t}.wild.example.org"

    resolve(lab, name)                                                       # forwarded
    check_answer(lab.dns_query(f"{t}.denied.example.net"), "REFUSED", "denied")  # refused
    _, good = bad_then_good(lab, _header()[:5], f"x.{name}")                  # malformed + forwarded
    assert good is not None and good[1] == "NOERROR", good
    lab.dns.stop()
    check_answer(lab.dns_query(f"y.{name}"), "SERVFAIL", "upstream stopped")  # forwarded + failed
    st = d.ctl_json("status", "--json")
    assert delta(c0, st["dns"]) == {"forwarded": 3, "refused": 1, "failed": 1, "malformed": 1}, st["dns"]

    learned = {e["name"]: e["addresses"] for e in st["learned"]}
    assert [a["address"] for a in learned.get(name, [])] == [WILD_V4], st["learned"]
    assert 60 <= learned[name][0]["expires_in_s"] <= 70, "dnsmasq's TTL 60 + 10 s grace"
    assert f"y.{name}" not in learned
    labmod.wait_for(lambda: "a.example.com" in learned_names(d), 3.0, "a.example.com pre-resolved at start")
    entries = {e["entry"]: e for e in d.ctl_json("status", "--json")["entries"]}
    assert entries["a.example.com"]["state"] == "resolved"
    assert entries["*.wild.example.org"]["kind"] == "wildcard"

    rc, out, err = d.ctl("status")
    assert rc == 0, err
    assert name in out and WILD_V4 in out, out
    assert "1 refused" in out and "1 malformed" in out and "1 failed" in out, out


# --- rebinding guard ------------------------------------------------------------------------------


def test_rebinding_answers_are_not_learned(lab, egressd):
    t = tok()
    hosts = {
        f"lo.{t}.rebind.example.org": ["127.0.0.1", "::1"],
        f"meta.{t}.rebind.example.org": ["169.254.169.254", "fd00:ec2::254"],
        f"ll.{t}.rebind.example.org": ["169.254.10.1", "fe80::1"],
        f"ok.{t}.rebind.example.org": ["203.0.113.10", "2001:db8:3::10"],
    }
    serve(lab, hosts=hosts)
    d = egressd(policy(agent=["*.rebind.example.org"]))  # no exact names: nothing pre-resolved
    for name in hosts:
        for qtype in ("A", "AAAA"):
            r = lab.dns_query(name, qtype)
            assert r.outcome == "ok", f"{qtype} {name}: no DNS answer ({r.outcome!r}); {NOT_DELIVERED}"
    assert set(lab.learned_set(4)) == {"203.0.113.10"}, lab.learned_set(4)
    assert set(lab.learned_set(6)) == {"2001:db8:3::10"}, lab.learned_set(6)
    names = learned_names(d)
    assert not [n for n in names if t in n and not n.startswith("ok.")], names
    assert rejected(lab.tcp_connect("169.254.169.254", 80)), "the metadata address must stay denied"


def test_rebinding_answers_observed_in_public_are_not_carried_into_an_allowlist(lab, egressd):
    # public records every answer (for attribution); a switch carries remembered addresses of
    # names the new phase allows into its sets. The rebinding guard must hold on that path too.
    t = tok()
    hosts = {
        f"meta.{t}.rebind.example.org": ["169.254.169.254", "fd00:ec2::254"],
        f"ll.{t}.rebind.example.org": ["169.254.10.1", "fe80::1"],
        f"ok.{t}.rebind.example.org": ["203.0.113.10", "2001:db8:3::10"],
    }
    serve(lab, hosts=hosts)
    d = egressd(policy(agent=["*.rebind.example.org"]), phase="environment")
    for name in hosts:
        for qtype in ("A", "AAAA"):
            r = lab.dns_query(name, qtype)
            assert r.outcome == "ok" and r.rcode == "NOERROR", f"{qtype} {name}: {r.outcome!r} {r.rcode}"
    assert d.ctl("apply", "agent")[0] == 0
    assert set(lab.learned_set(4)) == {"203.0.113.10"}, lab.learned_set(4)
    assert set(lab.learned_set(6)) == {"2001:db8:3::10"}, lab.learned_set(6)
    assert rejected(lab.tcp_connect("169.254.169.254", 80)), "the metadata address must stay denied"


def test_an_answer_with_hundreds_of_addresses_teaches_only_the_first_64(lab, egressd):
    """A zone under an allowed name (a wildcard's, which whoever runs it controls) answered 2,000
    addresses per query, and one sandbox grew its learned set to 478,000 elements in 6 s, slowing
    every other sandbox of its agent (attack review 9). At most 64 addresses of an answer are
    learned now; the rest are not, and the answer is logged. (A name's addresses are bounded
    too, at 1,024, and a sandbox's at max_learned: unit cases.)"""
    name = f"{tok()}.wild.example.org"
    many = [f"2001:db8:77::{i:x}" for i in range(1, 201)]
    serve(lab, extra_args=[f"--host-record={name},{a}" for a in many])  # one record each
    d = egressd(policy())
    r = lab.dns_query(name, "AAAA", tcp=True)
    check_answer(r, "NOERROR", f"AAAA {name}")
    assert len(r.addresses) == 200, r.addresses  # the whole answer reaches the client
    learned = [a for a in lab.learned_set(6) if a.startswith("2001:db8:77::")]
    assert len(learned) == 64, (len(learned), learned[:5])
    assert set(learned) <= set(many)
    assert f"answer for {name} carried 200 addresses; only the first 64 are learned" in d.log(), d.log()[-2000:]
    # One of the others is denied, and says so.
    assert lab.tcp_connect(next(a for a in many if a not in learned), 80) != "ok"


# An upstream for the next test: over UDP every answer is truncated (TC, no records); over TCP
# every query gets one TXT record of 240 strings of 250 bytes (~60 KB). argv: address.
BIG_TXT_UPSTREAM = r'''
import socket, struct, sys, threading
addr = sys.argv[1]
def answer(q, tc):
    i = 12
    while q[i]:
        i += 1 + q[i]
    head = q[:2] + (b"\x83\x80" if tc else b"\x81\x80") + b"\x00\x01" + (b"\x00\x00" if tc else b"\x00\x01") + b"\x00\x00\x00\x00"
    if tc:
        return head + q[12:i + 5]
    rdata = (bytes([250]) + b"x" * 250) * 240
    return head + q[12:i + 5] + b"\xc0\x0c" + struct.pack("!HHIH", 16, 1, 60, len(rdata)) + rdata
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind((addr, 53))
t = socket.socket()
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind((addr, 53))
t.listen(64)
def udp():
    while True:
        q, peer = u.recvfrom(4096)
        u.sendto(answer(q, True), peer)
def conn(c):
    with c:
        while True:
            n = c.recv(2)
            if len(n) < 2:
                return
            q = b""
            while len(q) < struct.unpack("!H", n)[0]:
                q += c.recv(struct.unpack("!H", n)[0] - len(q))
            a = answer(q, False)
            c.sendall(struct.pack("!H", len(a)) + a)
threading.Thread(target=udp, daemon=True).start()
print("READY", flush=True)
while True:
    threading.Thread(target=conn, args=(t.accept()[0],), daemon=True).start()
'''


def test_a_sandbox_whose_tcp_clients_leave_answers_unread_holds_at_most_a_mib_of_them(lab, egressd):
    """64 TCP connections of one sandbox, 16 queries pipelined on each, their ~60 KB answers left
    unread behind a 2 KiB receive buffer, held 37 MiB of an agent's memory as long as the client
    liked (attack review 9). Past 1 MiB of answers queued for a sandbox's TCP clients, a
    connection that already has one waiting is closed; the others are served, and so is the
    next client."""
    upstream = "198.51.100.96"
    lab.internet.ip("addr", "add", f"{upstream}/32", "dev", "lo")
    big = lab.spawn([sys.executable, "-c", BIG_TXT_UPSTREAM, upstream], netns=lab.internet, stdout=subprocess.PIPE)
    assert labmod._read_line(big, 10.0, "the TXT upstream") == "READY"
    d = egressd(policy(upstream=upstream), phase="environment")  # public: every name is forwarded
    t = tok()
    conns = []
    try:
        for c in range(8):
            s = lab.sandbox.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            s.settimeout(10.0)
            s.connect((DNS_V4, 53))
            s.sendall(b"".join(struct.pack("!H", len(q)) + q for q in
                               (labmod.dns_build_query(f"q{c}-{i}.{t}.example.org", "TXT", i) for i in range(16))))
            conns.append(s)
        labmod.wait_for(lambda: "event=tcp_backlog_close" in d.log(), 20.0, "a connection closed for its backlog")
        # What each connection still delivers: whole answers, then EOF for the ones closed.
        answers = 0
        for s in conns:
            s.settimeout(3.0)
            buf = b""
            try:
                while len(buf) < 16 * 60000 and (chunk := s.recv(65536)):
                    buf += chunk
            except (TimeoutError, ConnectionResetError):
                pass
            answers += len(buf) // 60000
        assert answers < 8 * 16, answers
    finally:
        for s in conns:
            s.close()
    # Another client is served as before.
    r = lab.dns_query(f"after.{t}.example.org", "TXT", tcp=True, timeout=5.0)
    assert r.outcome == "ok" and r.rcode == "NOERROR", r
