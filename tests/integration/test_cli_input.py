"""What users type reaches egressd's validators as typed, and the harnesses' policy files are
read as the harnesses read them (issue 18, items 1, 2 and 5), through the real binaries.

- Every --allow (egressd check and run, egressctl apply, network-policy allow) arrives at the
  entry validator exactly as typed: no argument-parser list expansion ("[a,b]"), no dropped
  pieces. egressctl's documented comma form still splits, keeping empty pieces.
- egressd check prints the plan of a Harbor task.toml or AgentCompass env-params file
  (format, then per phase: mode, where it came from, every entry); render and run take them.

egressctl and network-policy send their entries to the daemon, whose validator is the one
that judges them; here a stand-in socket records the request they send, so what is checked
is the text that leaves the client. The run test uses the lab (a real egressd in a namespace).
"""
import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

import lab as labmod

DATA = labmod.REPO_ROOT / "tests/unit/data"


def egressd(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(labmod.egressd_binary()), *args], capture_output=True, text=True, timeout=30,
                          env=env)


def network_policy_binary() -> Path:
    return labmod.egressd_binary().parent / "network-policy"


class RecordingSocket:
    """A Unix socket that answers every request line with a canned apply reply and keeps the
    requests it got, as parsed JSON."""

    def __init__(self, path: Path):
        self.path = path
        self.requests = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                if b"\n" not in buf:
                    continue
                self.requests.append(json.loads(buf.split(b"\n", 1)[0]))
                reply = {"ok": True, "phase": "inline", "mode": "allowlist", "generation": 2, "entries": {},
                         "unresolved": [], "duration_us": 10}
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self):
        self.sock.close()


@pytest.fixture
def recorder(tmp_path):
    r = RecordingSocket(tmp_path / "egressd.sock")
    yield r
    r.close()


# --- item 5: --allow verbatim ----------------------------------------------------------------

@pytest.mark.parametrize("raw", ["[2001:db8::1]", "[a.com,b.com]", "[]"])
def test_egressd_check_allow_rejects_brackets_as_typed(raw):
    cp = egressd("check", "--allow", raw)
    assert cp.returncode == 2, cp.stdout
    assert cp.stdout == ""
    assert cp.stderr == f'error: entry "{raw}": brackets are not allowed: write IPv6 addresses bare ' \
                        f"(e.g. 2001:db8::1), without a port\n"


@pytest.mark.parametrize("raw,reason", [
    ("", "the entry is empty"),
    ("a.com,b.com", 'contains ","'),
    ("{}", 'contains "{"'),
    ("%%", 'contains "%"'),
])
def test_egressd_check_allow_other_raw_forms_reach_the_validator(raw, reason):
    cp = egressd("check", "--allow", raw)
    assert cp.returncode == 2
    assert cp.stderr.startswith(f'error: entry "{raw}": ') and reason in cp.stderr, cp.stderr


def test_egressd_check_allow_normalizes_what_it_accepts():
    cp = egressd("check", "--allow", " PyPI.org. ", "--allow", "2001:DB8::1", "--allow=-x.org")
    assert cp.returncode == 2  # "-x.org" reached the validator: a label may not start with "-"
    assert 'entry "-x.org"' in cp.stderr
    cp = egressd("check", "--allow", " PyPI.org. ", "--allow", "2001:DB8::1", "--allow", "*.Example.com")
    assert (cp.returncode, cp.stdout) == (0, "pypi.org\n2001:db8::1\n*.example.com\n")


def test_egressd_check_allow_takes_one_value_each():
    cp = egressd("check", "--allow", "a.org", "b.org")
    assert cp.returncode == 2
    assert "b.org" in cp.stderr


def test_egressd_run_allow_rejects_brackets_before_touching_anything(tmp_path):
    sock = tmp_path / "egressd.sock"
    cp = egressd("run", "--socket", str(sock), "--phase", "allowlist", "--allow", "[2001:db8::1]",
                 "--ready-file", str(tmp_path / "ready"))
    assert cp.returncode == 2
    assert 'entry "[2001:db8::1]": brackets are not allowed' in cp.stderr
    assert not sock.exists() and not (tmp_path / "ready").exists()


def test_egressctl_apply_allow_sends_entries_as_typed(recorder):
    ctl = str(labmod.egressctl_binary())
    cp = subprocess.run([ctl, "--socket", str(recorder.path), "apply", "--mode", "allowlist",
                         "--allow", "[2001:db8::1]", "--allow", "[a.com,b.com]", "--allow", " PyPI.org. "],
                        capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    # The documented comma form splits "[a.com,b.com]" into two pieces, each as typed: the
    # daemon's validator then refuses both for their brackets.
    assert recorder.requests[-1]["allow"] == ["[2001:db8::1]", "[a.com", "b.com]", " PyPI.org. "]


def test_egressctl_apply_allow_keeps_empty_comma_pieces(recorder):
    ctl = str(labmod.egressctl_binary())
    cp = subprocess.run([ctl, "--socket", str(recorder.path), "apply", "--mode", "allowlist",
                         "--allow", "a.org,,b.org", "--allow", ""], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert recorder.requests[-1]["allow"] == ["a.org", "", "b.org", ""]


def test_network_policy_allow_sends_targets_as_typed(recorder):
    env = dict(os.environ, EGRESSD_SOCKET=str(recorder.path))
    cp = subprocess.run([str(network_policy_binary()), "allow", "[2001:db8::1]", "[a.com,b.com]", "-x.org"],
                        capture_output=True, text=True, timeout=30, env=env)
    assert cp.returncode == 0, cp.stderr
    assert recorder.requests[-1] == {"cmd": "apply", "mode": "allowlist",
                                     "allow": ["[2001:db8::1]", "[a.com,b.com]", "-x.org"]}


# --- items 1 and 2: the harnesses' files ------------------------------------------------------

def test_check_prints_the_plan_of_a_harbor_task():
    cp = egressd("check", "--config", str(DATA / "harbor/network-policy-docs.toml"))
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == (
        "format: Harbor task.toml\n"
        "phase environment: public  <- [environment]\n"
        "phase agent: allowlist, 2 entries (2 hostname)  <- [agent]\n"
        "    pypi.org\n"
        "    api.openai.com\n"
        "phase verifier: no-network  <- [verifier]\n"
        "initial phase: environment\n")


def test_check_prints_the_plan_of_env_params():
    cp = egressd("check", "--config", str(DATA / "env-params/setup-only.json"))
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == (
        "format: AgentCompass env-params\n"
        "phase setup: allowlist, 1 entry (1 hostname)  <- network_policy\n"
        "    pypi.org\n"
        "phase run: allowlist, 1 entry (1 hostname)  <- inherits setup (network_policy)\n"
        "    pypi.org\n"
        "phase verifier: allowlist, 1 entry (1 hostname)  <- inherits setup (network_policy)\n"
        "    pypi.org\n"
        "initial phase: setup\n")


def test_check_reports_a_harbor_error_with_its_position(tmp_path):
    task = tmp_path / "task.toml"
    task.write_text('[agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org:443"]\n')
    cp = egressd("check", "--config", str(task))
    assert cp.returncode == 2
    assert cp.stderr == f'error: {task}:3:18: entry "pypi.org:443": ports are not allowed: use the host alone\n'


# Attack review 10, F6 and F5: harness files that came out more open than written (each
# printed "public" for the phase its author closed, exit 0). Offline: check only.
MISNAMED_TABLES = {
    "enviroment.toml": ('[enviroment]\nnetwork_mode = "no-network"\n', "2:1", "[enviroment]", "[environment]"),
    "Agent.toml": ('[environment]\nnetwork_mode = "public"\n[Agent]\nnetwork_mode = "no-network"\n', "4:1",
                   "[Agent]", "[agent]"),
    "agents.toml": ('[environment]\nnetwork_mode = "public"\n[agents]\nnetwork_mode = "no-network"\n', "4:1",
                    "[agents]", "[agent]"),
    "verifer.toml": ('[environment]\nnetwork_mode = "public"\n[verifer]\nnetwork_mode = "no-network"\n', "4:1",
                     "[verifer]", "[verifier]"),
    "step.toml": ('[environment]\nnetwork_mode = "public"\n[[step]]\nname = "x"\n[step.agent]\n'
                  'network_mode = "no-network"\n', "6:1", "[step.agent]", "[steps.agent]"),
    "task.environment.toml": ('[task.environment]\nnetwork_mode = "no-network"\n', "2:1", "[task.environment]",
                              "[environment]"),
    "steps.agnet.toml": ('[environment]\nnetwork_mode = "public"\n[[steps]]\nname = "s"\n[steps.agnet]\n'
                         'network_mode = "no-network"\n', "6:1", "[steps.agnet]", "[steps.agent]"),
    "steps.environment.toml": ('[environment]\nnetwork_mode = "public"\n[[steps]]\nname = "s"\n'
                               '[steps.environment]\nnetwork_mode = "no-network"\n', "6:1", "[steps.environment]",
                               None),
}


@pytest.mark.parametrize("name", sorted(MISNAMED_TABLES))
def test_check_refuses_network_keys_in_a_misnamed_harbor_table(tmp_path, name):
    text, where, table, meant = MISNAMED_TABLES[name]
    f = tmp_path / name
    f.write_text(text)
    cp = egressd("check", "--config", str(f))
    assert cp.returncode == 2, f"{name} accepted:\n{cp.stdout}"
    assert cp.stderr.startswith(f"error: {f}:{where}: network_mode in {table} would be ignored: "), cp.stderr
    if meant:
        assert cp.stderr.endswith(f"(did you mean {meant}?)\n"), cp.stderr
    assert cp.stdout == ""


MISTYPED = {
    "agent-mode.toml": ('[environment]\nnetwork_mode = "public"\n[agent]\nmode = "no-network"\n',
                        ':4:1: unknown network key "mode" in [agent]'),
    "agent-net_mode.toml": ('[environment]\nnetwork_mode = "public"\n[agent]\nnet_mode = "no-network"\n',
                            ':4:1: unknown network key "net_mode" in [agent]'),
    "verifier-policy.toml": ('[environment]\nnetwork_mode = "public"\n[verifier]\npolicy = "no-network"\n',
                             ':4:1: unknown network key "policy" in [verifier]'),
    "verifier_policy.json": ('{"network_policy": "public", "verifier_policy": "no-network"}',
                             ':1:30: unknown network key "verifier_policy" in env-params'),
    "run_policy.json": ('{"network_policy": "public", "run_policy": {"network_mode": "no-network"}}',
                        ':1:45: "network_mode" in "run_policy" is not read'),
    "params.json": ('{"network_policy": "public", "params": {"run_network_policy": "no-network"}}',
                    ':1:41: "run_network_policy" in "params" is not read'),
}


@pytest.mark.parametrize("name", sorted(MISTYPED))
def test_check_refuses_a_mistyped_network_key_in_a_harness_file(tmp_path, name):
    text, culprit = MISTYPED[name]
    f = tmp_path / name
    f.write_text(text)
    cp = egressd("check", "--config", str(f))
    assert cp.returncode == 2, f"{name} accepted:\n{cp.stdout}"
    assert cp.stderr.startswith(f"error: {f}{culprit}"), cp.stderr


# Attack review 10, F4: addresses written another way were kept as host names (or as an IPv6
# entry no packet matches), allowing nothing the author meant.
@pytest.mark.parametrize("entry,hint", [
    ("192.000.002.001", "write 192.0.2.1"),
    ("010.000.000.001", "write 10.0.0.1 (inet_aton(3) would read it as 8.0.0.1)"),
    ("127.1", "e.g. 127.0.0.1"),
    ("0x7f.1", "e.g. 127.0.0.1"),
    ("1.2.3", "e.g. 1.2.0.3"),
    ("::ffff:192.0.2.1", "write 192.0.2.1"),
    ("::ffff:0:0/96", "write 0.0.0.0/0"),
])
def test_check_refuses_an_address_written_another_way(entry, hint):
    cp = egressd("check", "--allow", entry)
    assert cp.returncode == 2, cp.stdout
    assert cp.stderr.startswith(f'error: entry "{entry}": ') and cp.stderr.endswith(hint + "\n"), cp.stderr


def test_check_refuses_an_address_written_another_way_in_a_harbor_file(tmp_path):
    task = tmp_path / "task.toml"
    task.write_text('[agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org", "192.000.002.001"]\n')
    cp = egressd("check", "--config", str(task))
    assert cp.returncode == 2
    assert cp.stderr == (f'error: {task}:3:30: entry "192.000.002.001": an IPv4 address with leading zeros is '
                         f"not accepted: write 192.0.2.1\n")


def test_render_takes_a_harbor_step_phase():
    cp = egressd("render", "--config", str(DATA / "harbor/multi-step-docs.toml"), "--phase", "step-implement-agent")
    assert cp.returncode == 0, cp.stderr
    assert "table inet egressd" in cp.stdout


def test_run_enforces_a_harbor_task(lab, egressd_binaries):
    """`egressd run --config task.toml`: the phases of the task, switched by name, enforced."""
    allowed, other = labmod.SERVERS_V4[0], labmod.SERVERS_V4[1]
    task = lab.write_config('[environment]\nnetwork_mode = "public"\n'
                            '[agent]\nnetwork_mode = "allowlist"\n'
                            f'allowed_hosts = ["{allowed}"]\n'
                            '[verifier]\nnetwork_mode = "no-network"\n', "task.toml")
    d = lab.egressd(task)
    assert d.status()["phase"] == "environment"
    assert lab.tcp_connect(other, 7) == "ok"
    assert d.ctl("apply", "agent")[0] == 0
    assert (d.status()["phase"], d.status()["mode"]) == ("agent", "allowlist")
    assert lab.tcp_connect(allowed, 7) == "ok"
    assert lab.tcp_connect(other, 7) != "ok"
    assert d.ctl("apply", "verifier")[0] == 0
    assert d.status()["mode"] == "no-network"
    assert lab.tcp_connect(allowed, 7) != "ok"
