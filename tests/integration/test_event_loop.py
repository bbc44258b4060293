"""Nothing on egressd's event loop waits (issue 15, point 1).

The contract: egressd answers DNS on the same event loop that serves `status` and verifies the
table. Reading the table back while another process commits nftables batches back to back has
to be retried (the kernel interrupts a dump at every commit); those retries wait on a timer,
never on the loop. So while another process commits as fast as it can and `status` is polled
without pause, DNS answers for allowed names stay as fast as when nothing happens:

  loaded p99 <= max(3 x idle p99, FLOOR), and no answer takes anything like a retry pause.

The p99 comparison gets a second storm when the first misses it (a busy CI machine now and
then; the retry loop it was written against, every time); the slowest answer gets none.

FLOOR (8 ms) keeps a sub-millisecond idle p99 from making the bound meaningless noise: the
round trip includes the upstream (dnsmasq) and the Python client on a shared 2-core machine,
and every commit of the storm takes the nftables mutex egressd's own learn batches need.
Measured on this VM (2026-12-02), test unchanged otherwise: the binary before issue 16's
second round gave loaded p99 2.1 / 5.3 / 3.2 ms and the one after 1.0 / 1.5 / 3.7 ms in
alternating runs, CI twice 2.5 and 5.6 ms, so 2 x max(idle, 1 ms) failed either binary at
random. What the test is for still fails: the read-retry loop it was written against gave a
loaded p99 of 14.1 ms with an idle p99 of 4.1 ms (bound 12.3 ms), and any answer waiting like
a retry pause (hundreds of ms to 2 s) breaks SLOWEST (100 ms, or 15 x the idle p99 on a
machine slow enough that idle answers already take milliseconds).
"""
import multiprocessing
import os
import subprocess
import time

import lab as labmod
from lab import DNS_V4

FLOOR = 0.008        # s, see the module docstring
QUERIES = 600        # per kind (idle, loaded), in ROUNDS blocks each
ROUNDS = 6
PACE = 0.005        # s between status polls
# s: no single answer may take this long (the old retry loop slept hundreds of ms to 2 s). 50 ms
# failed once in a CI run beside the ASan compile and the container suites: one loaded answer of
# 65.8 ms, the loaded p99 1.91 ms below the idle p99 2.39 ms (2026-12-06).
SLOWEST = 0.100
SLOWEST_ASAN = 0.100  # s: the same under ASan/UBSan, whose CPU cost is several times (50.6 ms seen on a loaded host)
NAMES = ("a.example.com", "b.example.com")

CONFIG = """\
initial_phase: agent
dns: { upstream: ["%s"] }
phases:
  agent:
    network_mode: allowlist
    allowed_hosts: [a.example.com, b.example.com]
""" % DNS_V4


def p99(samples: list[float]) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


def p50(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def measure(lab, n: int) -> list[float]:
    """n queries for allowed names on one socket in the sandbox, one after the other: their
    round-trip times (s). Every one must be answered NOERROR with addresses."""
    times = []
    s = lab.sandbox.socket(labmod.family_of(DNS_V4), labmod.socket.SOCK_DGRAM)
    with s:
        s.connect((DNS_V4, 53))
        for i in range(n):
            name = NAMES[i % len(NAMES)]
            t0 = time.monotonic()
            r = labmod.dns_exchange(s, name, "A", timeout=5.0)
            times.append(time.monotonic() - t0)
            assert r.outcome == "ok" and r.rcode == "NOERROR" and r.addresses, f"A {name}: {r.outcome!r} {r.rcode}"
    return times


# The committer's feeder and the status poller run in processes of their own, forked from the
# test: as threads of the measuring process they held its GIL (a status reply parsed, a feeder
# loop between writes) while an answer waited to be timed, in loaded blocks only, so the loaded
# tail measured Python as much as egressd. CI (2026-12-07, f2f1f5d) failed the p99 comparison on
# two storms in a row that way (26.5 ms against 18.7, then 10.3 against 9.6) with the p50s equal.
_FORK = multiprocessing.get_context("fork")


def _end(child, timeout: float):
    """Waits for a child told to stop, at most timeout s, then kills it."""
    child.join(timeout=timeout)
    if child.is_alive():
        child.kill()
        child.join()


class Committer:
    """Another process committing nftables batches back to back in a table of its own in the
    sandbox namespace: `nft -i` runs every line as its own transaction, fed by a forked child. It
    runs at nice 19, so what it costs in CPU (on a 2-core machine: a core) does not count against
    egressd; what is measured is what its commits do to egressd. Bounded: at most `limit`
    commits. Commits only while `on` is set."""

    def __init__(self, lab, limit: int = 1_000_000):
        self.proc = subprocess.Popen(["nice", "-n", "19", "ip", "netns", "exec", lab.sandbox.name, "nft", "-i"],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.limit = limit
        self._sent = _FORK.Value("q", 0)
        self.on = _FORK.Event()
        self.stop = _FORK.Event()
        self.child = _FORK.Process(target=self._feed, daemon=True)
        self.child.start()

    @property
    def sent(self) -> int:
        return self._sent.value

    def _feed(self):
        chunk = b"add table inet churn\ndelete table inet churn\n" * 10
        try:
            while not self.stop.is_set() and self._sent.value < self.limit:
                if not self.on.wait(0.1):
                    continue
                self.proc.stdin.write(chunk)
                self.proc.stdin.flush()
                with self._sent.get_lock():
                    self._sent.value += 20
        except (BrokenPipeError, ValueError):
            pass

    def close(self):
        self.stop.set()
        _end(self.child, 10)
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class StatusPoller:
    """Polls `status` over the control socket every PACE s while `on` is set (far more often
    than any orchestrator does; polled without pause, status replies themselves would be the
    loop's load, which is not what is measured), from a forked child; every reply must be ok."""

    def __init__(self, d):
        self.d = d
        self._count = _FORK.Value("q", 0)
        self._errors = _FORK.SimpleQueue()
        self.errors: list[str] = []
        self.on = _FORK.Event()
        self.stop = _FORK.Event()
        self.child = _FORK.Process(target=self._run, daemon=True)
        self.child.start()

    @property
    def count(self) -> int:
        return self._count.value

    def _run(self):
        while not self.stop.is_set():
            if not self.on.wait(0.1):
                continue
            try:
                self.d.status()
            except Exception as e:  # noqa: BLE001 - reported by the test
                # A read every attempt of which a commit spoiled gives up after 2 s and says
                # so ("ask again"): a finished poll all the same, counted in the report.
                self._errors.put(repr(e))
            with self._count.get_lock():
                self._count.value += 1
            time.sleep(PACE)  # pacing, not synchronisation

    def close(self):
        self.stop.set()
        _end(self.child, 30)
        while not self._errors.empty():
            self.errors.append(self._errors.get())


def storm(lab, d) -> dict:
    """ROUNDS idle blocks alternating with ROUNDS loaded ones (a commit storm and status polls):
    the answers' round-trip times of each kind, the polls finished and the commits sent while
    loaded blocks were measured."""
    poller = StatusPoller(d)  # forked first: it keeps no copy of the committer's pipe
    committer = Committer(lab)
    idle, loaded, polls = [], [], 0
    commits = 0
    try:
        for _ in range(ROUNDS):
            idle += measure(lab, QUERIES // ROUNDS)
            sent0, polls0 = committer.sent, poller.count
            committer.on.set()
            poller.on.set()
            # Only measure once both are in full swing.
            # (At nice 19 the committer may wait for a busy machine's other work.)
            labmod.wait_for(lambda: committer.sent - sent0 >= 200 and poller.count - polls0 >= 2, 60,
                            "commits and status polls under way")
            polls0 = poller.count
            loaded += measure(lab, QUERIES // ROUNDS)
            polls += poller.count - polls0
            committer.on.clear()
            poller.on.clear()
            commits += committer.sent - sent0
    finally:
        poller.close()
        committer.close()
    idle_p99, loaded_p99 = p99(idle), p99(loaded)
    bound = max(3 * idle_p99, FLOOR)
    report = (f"idle p99 {idle_p99 * 1e3:.2f} ms (p50 {p50(idle) * 1e3:.2f}), loaded p99 {loaded_p99 * 1e3:.2f} ms "
              f"(p50 {p50(loaded) * 1e3:.2f}, max {max(loaded) * 1e3:.2f}; bound {bound * 1e3:.2f} ms); "
              f"{polls} status polls ({len(poller.errors)} gave up) and ~{commits} commits during the "
              f"loaded blocks")
    return {"idle_p99": idle_p99, "loaded_p99": loaded_p99, "bound": bound, "loaded": loaded, "polls": polls,
            "report": report}


def test_dns_answers_do_not_wait_for_table_reads_during_a_commit_storm(lab, egressd):
    """Idle and loaded blocks alternate, so that whatever else the machine does weighs on both
    alike; each statistic is over all blocks of its kind."""
    d = egressd(CONFIG, extra=("--verify-interval", "0.2"))  # verify ticks read the table too
    measure(lab, 50)  # warm up: first answers teach addresses, sockets get created
    asan = bool(os.environ.get("ASAN_OPTIONS"))

    def check_slowest(r):
        # The single slowest answer is judged against what the machine gives an idle answer:
        # in a CI run beside a compile and the container suites the idle p99 was 6.1 ms and one
        # loaded answer took 59 ms (the idle ones had no storm to wait for). A retry wait of the
        # kind this test is for (hundreds of ms to 2 s) stays far above 15 x any idle p99 seen.
        slowest = max(SLOWEST_ASAN if asan else SLOWEST, 15 * r["idle_p99"])
        assert max(r["loaded"]) < slowest, \
            f"an answer waited like a read retry: {r['report']}; bound {slowest * 1e3:.1f} ms"

    def too_slow(r) -> bool:
        return max(r["loaded"]) >= max(SLOWEST_ASAN if asan else SLOWEST, 15 * r["idle_p99"])

    r = storm(lab, d)
    print(r["report"])
    # The slowest answer, like the p99 below, is judged on a second storm when the first misses
    # it: in a CI run beside the container suites one loaded answer of a storm took 126.9 ms
    # against a bound of 122.6 (15 x an idle p99 of 8.2 ms). The retry loop makes every storm slow.
    if too_slow(r):
        first = r["report"]
        r = storm(lab, d)
        r["report"] = f"{r['report']} (a second storm; the first: {first})"
        print(r["report"])
    check_slowest(r)
    # The p99 comparison is judged on a second storm when the first misses it: in a CI run beside
    # a compile and the container suites (idle p99 6.7 ms, 25 times a quiet machine's) one storm
    # gave 3.3 x the idle p99, where the read-retry loop this test was written against gave 3.4 x
    # on a quiet one. That loop makes every storm slow; a busy machine, one now and then.
    if not asan and r["loaded_p99"] > r["bound"]:
        first = r["report"]
        r = storm(lab, d)
        r["report"] = f"{r['report']} (a second storm; the first: {first})"
        print(r["report"])
        check_slowest(r)
    report = r["report"]
    # A status read retries while commits spoil its dumps, so on a quiet host one poll may span
    # most of a block: what matters is that reads were in flight, not how many finished.
    assert r["polls"] >= 3, f"status was hardly polled while measuring: {report}"
    # Under ASan/UBSan (scripts/test's second pass sets ASAN_OPTIONS) every status costs several
    # times its normal CPU, so the p99 comparison measures the sanitizer; the absolute bound
    # (check_slowest: no answer waits like a read retry) still holds there.
    if not asan:
        assert r["loaded_p99"] <= r["bound"], f"DNS answers waited on the event loop: {report}"
    assert d.running, "egressd died during the commit storm"
