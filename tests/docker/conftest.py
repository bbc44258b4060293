"""pytest fixtures for tests/docker (see README.md, dockerlab.py and topologies.py).

`docker_host` (session)           Docker can run here (a dockerd is started if none answers
                                  and stopped at the end), else every test skips with the
                                  exact reason; the egressd image is built and loaded (or
                                  taken from $EGRESSD_IMAGE), the task image imported; stale
                                  leftovers of dead sessions go.
`session`                         the two internal networks, dnsmasq and the servers, the guard.
`sandboxes`                       per test: (topology, mode, allow, network, shared=False) ->
                                  Sandbox, removed after the test, pass or fail (shared=True: one
                                  per module for tests that change nothing); after every test the
                                  guard is checked: nothing went to the host's nameservers.
`containers`                      per test: containers the test runs itself (`run`, `task`,
                                  as Session's), removed after the test, pass or fail; the
                                  guard is checked as for `sandboxes`; the logs of those run
                                  with logs=True go into a failed test's report.

With CI=true a skipped test is reported as a failure: CI installs everything, so a skip there
means something is broken.
"""
import os
from pathlib import Path

import pytest

import dockerlab
import topologies

IN_CI = os.environ.get("CI") == "true"


def build_dir() -> Path:
    if os.environ.get("BUILD_DIR"):
        return (dockerlab.REPO_ROOT / os.environ["BUILD_DIR"]).resolve()
    if os.environ.get("EGRESSD"):
        return Path(os.environ["EGRESSD"]).resolve().parents[1]
    return dockerlab.REPO_ROOT / "build"


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory):
    problems = dockerlab.missing_prerequisites()
    if problems:
        pytest.skip("Docker cannot run containers here: " + "; ".join(problems))
    daemon = dockerlab.Daemon(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    try:
        daemon.ensure()
    except dockerlab.LabError as e:
        daemon.stop()
        pytest.skip(f"Docker cannot run containers here: no dockerd answers and starting one failed: {e}")
    try:
        dockerlab.sweep_stale()
        image = dockerlab.load_egressd_image(build_dir(), build=not os.environ.get("EGRESSD_IMAGE"))
        # A tag of this session's own: a concurrent build elsewhere cannot swap the image
        # under a running test. Removed by the session's cleanup.
        tag = f"localhost/{dockerlab.PREFIX}{os.getpid()}-egressd:test"
        dockerlab.docker("tag", image, tag)
        dockerlab.build_task_image()
    except BaseException:
        dockerlab.docker("image", "rm", f"localhost/{dockerlab.PREFIX}{os.getpid()}-egressd:test", check=False)
        daemon.stop()
        raise
    yield daemon, tag


@pytest.fixture(scope="session")
def session(docker_host):
    daemon, tag = docker_host
    s = dockerlab.Session(daemon, tag).start()
    yield s
    problems = s.cleanup()
    if problems:
        pytest.fail("cleanup: " + "; ".join(problems), pytrace=False)


class Shared:
    """Sandboxes several tests of a module use as they are (they change no policy and leave
    nothing behind): made on first use, removed when the module's tests are done."""

    def __init__(self, session):
        self.session = session
        self.cache: dict = {}

    def get(self, topology, mode, allow, network, **kw) -> topologies.Sandbox:
        key = (topology, mode, tuple(allow), network, tuple(sorted(kw.items())))
        if key not in self.cache:
            self.cache[key] = topologies.make(topology, self.session, mode, allow, network, **kw)
        return self.cache[key]

    def close(self) -> list[str]:
        problems = []
        for sb in self.cache.values():
            problems += sb.close()
        self.cache.clear()
        return problems


class Scope:
    """A test's sandboxes: its own ones are closed after it, pass or fail; shared ones are
    only listed (for their logs when the test fails)."""

    def __init__(self, session, shared: Shared):
        self.session, self.shared = session, shared
        self.made: list[topologies.Sandbox] = []
        self.used: list[topologies.Sandbox] = []

    def __call__(self, topology: str, mode: str, allow=(), network: str = "v4", shared: bool = False,
                 **kw) -> topologies.Sandbox:
        if shared:
            sb = self.shared.get(topology, mode, allow, network, **kw)
        else:
            sb = topologies.make(topology, self.session, mode, allow, network, **kw)
            self.made.append(sb)
        self.used.append(sb)
        return sb

    def close(self) -> list[str]:
        problems = []
        for sb in reversed(self.made):
            problems += sb.close()
            if getattr(sb, "project", None) in self.session.projects:
                self.session.projects.remove(sb.project)
        return problems


@pytest.fixture(scope="module")
def _shared(session):
    shared = Shared(session)
    yield shared
    problems = shared.close()
    if problems:
        pytest.fail("cleanup: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def sandboxes(session, _shared, request):
    scope = Scope(session, _shared)
    request.node._egt_scope = scope
    yield scope
    problems = scope.close()
    # Projects whose `up` failed never became sandboxes: remove them too.
    live = {id(sb.project) for sb in _shared.cache.values() if hasattr(sb, "project")}
    for proj in [p for p in session.projects if id(p) not in live]:
        problems += proj.down()
        session.projects.remove(proj)
    leaks = session.guard.check()
    if leaks:
        pytest.fail("traffic towards the host's nameservers: " + "; ".join(leaks), pytrace=False)
    if problems:
        pytest.fail("cleanup: " + "; ".join(problems), pytrace=False)


class Containers:
    """A test's own containers, outside the topologies (e.g. an egressd agent and the tasks it
    attaches): removed after the test, pass or fail."""

    def __init__(self, session):
        self.session = session
        self.made: list[dockerlab.Container] = []
        self.logged: list[dockerlab.Container] = []

    def run(self, image: str, *cmd, logs: bool = False, **kw) -> dockerlab.Container:
        c = self.session.run(image, *cmd, **kw)
        self.made.append(c)
        if logs:
            self.logged.append(c)
        return c

    def task(self, what: str = "task", **kw) -> dockerlab.Container:
        c = self.session.task(what, **kw)
        self.made.append(c)
        self.session.guard.watch(c)
        return c

    def close(self) -> list[str]:
        for c in reversed(self.made):
            c.remove()
        left = [c.name for c in self.made
                if dockerlab.docker("inspect", "--format", "{{.Id}}", c.ref, check=False).returncode == 0]
        self.made.clear()
        return [f"containers left: {' '.join(left)}"] if left else []


@pytest.fixture
def containers(session, request):
    scope = Containers(session)
    request.node._egt_containers = scope
    yield scope
    problems = scope.close()
    leaks = session.guard.check()
    if leaks:
        pytest.fail("traffic towards the host's nameservers: " + "; ".join(leaks), pytrace=False)
    if problems:
        pytest.fail("cleanup: " + "; ".join(problems), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and rep.when == "call":
        scope = getattr(item, "_egt_scope", None)
        for sb in scope.used if scope else []:
            rep.sections.append((f"egressd log ({sb.topology})", sb.logs()[-6000:]))
        own = getattr(item, "_egt_containers", None)
        for c in own.logged if own else []:
            rep.sections.append((f"log of {c.name}", c.logs()[-6000:]))
    if IN_CI and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped, and nothing may be skipped in CI (CI=true): {reason}"
