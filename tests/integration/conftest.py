"""pytest fixtures for the egressd lab (see README.md and lab.py).

`lab`     a started Lab (sandbox + internet namespaces, echo servers, dnsmasq); closed after
          the test whatever happened.
`cgroups` a factory: cgroups(tag) -> a new cgroup (v2) below the test's own, removed after.
`egressd` a factory: egressd(config_text, phase=None, extra=()) -> lab.Egressd, started; it
          fails the test (never skips) when the binaries are missing.

With CI=true a skipped test is reported as a failure: CI installs everything, so a skip there
means something is broken.
"""
import os
from pathlib import Path

import pytest

import lab as labmod

IN_CI = os.environ.get("CI") == "true"


def pytest_configure(config):
    labmod.install_cleanup_handlers()


@pytest.fixture(scope="session", autouse=True)
def lab_host():
    """The machine can run the lab; stale egt-* namespaces of dead runs are removed first."""
    problems = labmod.missing_prerequisites()
    if problems:
        pytest.skip("lab unavailable: " + "; ".join(problems))
    labmod.sweep_stale()
    yield
    labmod.cleanup_all()


@pytest.fixture
def lab(tmp_path):
    with labmod.Lab(tmp_path) as the_lab:
        yield the_lab


@pytest.fixture(scope="session")
def egressd_binaries():
    missing = [str(p) for p in (labmod.egressd_binary(), labmod.egressctl_binary()) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail("egressd binaries not built (set EGRESSD/EGRESSCTL or run scripts/test): " + ", ".join(missing),
                    pytrace=False)


@pytest.fixture
def egressd(lab, egressd_binaries):
    def start(config: str, phase: str | None = None, extra=(), **kw) -> labmod.Egressd:
        return lab.egressd(config, phase=phase, extra=extra, **kw)
    return start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and rep.when == "call":
        the_lab = item.funcargs.get("lab")
        if isinstance(the_lab, labmod.Lab):
            rep.sections.append(("lab logs", the_lab.logs()))
    if IN_CI and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped, and nothing may be skipped in CI (CI=true): {reason}"


@pytest.fixture
def cgroups():
    """child(tag): a new cgroup (v2) below the test's own; every one is removed afterwards, the
    processes still in it moved back to the test's cgroup first."""
    mount = labmod.cgroup2_mount()
    if mount is None:
        raise labmod.LabError("no cgroup2 mount: the lab needs the cgroup v2 hierarchy (unified or hybrid)")
    parent = mount / labmod.cgroup_of().lstrip("/")
    made = []

    def child(tag: str) -> Path:
        cg = parent / f"egt-{tag}-{os.urandom(5).hex()}"
        cg.mkdir()
        made.append(cg)
        return cg

    yield child
    for cg in reversed(made):
        def emptied():
            for pid in (cg / "cgroup.procs").read_text().split():
                try:
                    (parent / "cgroup.procs").write_text(pid)
                except ProcessLookupError:
                    pass
            return not (cg / "cgroup.procs").read_text().strip() or None
        labmod.wait_for(emptied, 10.0, f"cgroup {cg.name} to empty")
        cg.rmdir()
