"""Watchdog: memory readers on fake /proc and /sys trees, the leak trend (real allocations and property
tests), memory alerts, progress-driven liveness, and the watchdog thread end to end against a real notify
socket."""

import logging
import mmap
import os
import subprocess
import threading
import time
from typing import Dict, List, Optional, Tuple

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agent.config.daemon_config import WatchdogConfig
from agent.health.leak import WINDOW_COVERAGE, LeakDetector
from agent.health.memory import MemorySample, MemoryWatchdog
from agent.health.npu_smi import NpuMemory, NpuSmiProbe
from agent.health.progress import ProgressMonitor
from agent.health.readers import read_cgroup_limit_mb, read_rss_mb
from agent.health.sdnotify import SystemdNotifier
from agent.health.watchdog import Watchdog
from tests.conftest import wait_for
from tests.support.clock_support import ManualClock
from tests.support.notify_support import NotifyListener

MIB = 1024 * 1024
WAIT_S = 10.0  # bound on every wait for another thread; never an assertion about speed


def touched_bytes(mib: int) -> mmap.mmap:
    """A real allocation whose every page is written, so it shows in RSS (a zeroed one might not).

    An anonymous mapping, not a bytearray: malloc may serve a bytearray from heap memory that earlier tests
    freed (glibc raises its mmap threshold after large frees), and then RSS does not grow at all.
    """
    block = mmap.mmap(-1, mib * MIB)
    block.write(b"\x5a" * (mib * MIB))
    return block


# ---------------------------------------------------------------------------------------------- readers


def vm_rss_mb() -> float:
    """Independent reference: VmRSS from /proc/self/status (read_rss_mb prefers statm)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS")


def test_rss_matches_the_kernels_status_and_sees_an_allocation():
    before = read_rss_mb()
    assert before is not None and abs(before - vm_rss_mb()) < 8
    block = touched_bytes(64)
    after = read_rss_mb()
    assert after - before > 0.9 * 64
    del block


def write_tree(root: str, files: Dict[str, str]) -> None:
    for relative, content in files.items():
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(content)


def test_rss_reader_on_fake_proc(tmp_path):
    write_tree(str(tmp_path), {"self/statm": "50000 2560 300 1 0 900 0\n"})
    assert read_rss_mb(str(tmp_path)) == 2560 * os.sysconf("SC_PAGE_SIZE") / MIB
    write_tree(str(tmp_path), {"42/status": "Name:\tx\nVmRSS:\t  204800 kB\n"})
    assert read_rss_mb(str(tmp_path), pid="42") == 200.0  # no statm: falls back to status
    assert read_rss_mb(str(tmp_path), pid="7") is None


GIB = str(1 << 30)
V1_UNLIMITED = "9223372036854771712"
SERVICE = "/system.slice/atlas-edge.service"

CGROUP_CASES = {
    "v2 service limit": (
        {"proc/self/cgroup": "0::%s\n" % SERVICE, "sys/cgroup.controllers": "cpu memory pids\n",
         "sys/system.slice/atlas-edge.service/memory.max": str(2 * (1 << 30)) + "\n",
         "sys/system.slice/memory.max": "max\n"}, 2048.0),
    "v2 tighter parent slice": (
        {"proc/self/cgroup": "0::%s\n" % SERVICE, "sys/cgroup.controllers": "memory\n",
         "sys/system.slice/atlas-edge.service/memory.max": str(2 * (1 << 30)),
         "sys/system.slice/memory.max": GIB}, 1024.0),
    "v2 unlimited": (
        {"proc/self/cgroup": "0::%s\n" % SERVICE, "sys/cgroup.controllers": "memory\n",
         "sys/system.slice/atlas-edge.service/memory.max": "max\n"}, None),
    "v2 in a cgroup namespace": (
        {"proc/self/cgroup": "0::/\n", "sys/cgroup.controllers": "memory\n", "sys/memory.max": GIB}, 1024.0),
    "v2 path not under the mount": (
        {"proc/self/cgroup": "0::/elsewhere/x.scope\n", "sys/cgroup.controllers": "memory\n",
         "sys/memory.max": str(512 * MIB)}, 512.0),
    "hybrid: v1 memory unlimited": (
        {"proc/self/cgroup": "4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
         "sys/unified/cgroup.controllers": "\n",
         "sys/memory/process_api/abc/memory.limit_in_bytes": V1_UNLIMITED,
         "sys/memory/memory.limit_in_bytes": V1_UNLIMITED}, None),
    "v1 limit": (
        {"proc/self/cgroup": "9:cpuacct,memory:%s\n" % SERVICE,
         "sys/memory/system.slice/atlas-edge.service/memory.limit_in_bytes": str(768 * MIB),
         "sys/memory/memory.limit_in_bytes": V1_UNLIMITED}, 768.0),
    "no cgroup file": ({"sys/cgroup.controllers": "memory\n", "sys/memory.max": GIB}, None),
}


@pytest.mark.parametrize("case", sorted(CGROUP_CASES))
def test_cgroup_limit_on_fake_trees(tmp_path, case):
    files, expected = CGROUP_CASES[case]
    write_tree(str(tmp_path), files)
    got = read_cgroup_limit_mb(proc_root=str(tmp_path / "proc"), cgroup_root=str(tmp_path / "sys"))
    assert got == expected


def test_cgroup_limit_of_this_machine_is_a_number_or_none():
    limit = read_cgroup_limit_mb()
    assert limit is None or limit > 0


# ---------------------------------------------------------------------------------------------- leak trend


def feed(detector: LeakDetector, points: List[Tuple[float, float]]) -> List[str]:
    verdicts = []
    for t, mb in points:
        detector.add(t, mb)
        verdicts.append(detector.verdict())
    return verdicts


def test_detector_rejects_bad_parameters():
    with pytest.raises(ValueError, match="min_samples"):
        LeakDetector(300, 50, min_samples=3)
    with pytest.raises(ValueError, match="must be > 0"):
        LeakDetector(0, 50)


def test_exact_slope_and_verdicts_on_golden_series():
    window, threshold = 300.0, 50.0
    leak = [(t * 5.0, 100 + 0.05 * t * 5.0) for t in range(61)]  # 0.05 MiB/s = 180 MiB/h
    detector = LeakDetector(window, threshold)
    verdicts = feed(detector, leak)
    assert detector.slope_mb_per_hour == pytest.approx(180.0, rel=1e-9)
    assert verdicts[10] == "insufficient"  # 50 s of a 300 s window
    assert verdicts[-1] == "leak"
    # the first "leak" comes once the samples cover 90% of the window, not before
    first = verdicts.index("leak")
    assert leak[first][0] - leak[0][0] >= WINDOW_COVERAGE * window
    # plateau: the same 150 MiB of growth, done in the first third, then flat
    plateau = [(t * 5.0, 100 + min(t * 5.0, 100.0) * 1.5) for t in range(121)]
    assert "leak" not in feed(LeakDetector(window, threshold), plateau)
    # a one-off step (a model swap) three quarters of the way in
    step = [(t * 5.0, 100 + (300 if t * 5.0 >= 225 else 0)) for t in range(61)]
    assert feed(LeakDetector(window, threshold), step)[-1] == "ok"


def test_time_going_backwards_restarts_the_window(caplog):
    detector = LeakDetector(60, 50, min_samples=6)
    feed(detector, [(t, 100.0 + t) for t in range(0, 60, 5)])
    with caplog.at_level(logging.WARNING, logger="agent.health.leak"):
        detector.add(10.0, 100.0)
    assert detector.figures()["samples"] == 1 and "backwards" in caplog.text


windows = st.floats(60, 3600)
thresholds = st.floats(10, 500)
counts = st.integers(20, 120)


@settings(max_examples=150, deadline=None)
@given(windows, thresholds, counts, st.floats(2, 20), st.floats(-5000, 5000),
       st.lists(st.floats(-1, 1), min_size=121, max_size=121))
def test_property_steady_growth_above_threshold_is_a_leak(window, threshold, n, factor, offset, noise):
    """Growth at >= 2x the threshold over a full window, with noise up to 1/16 of the total growth."""
    slope_s = factor * threshold / 3600.0
    amplitude = slope_s * window / 16
    detector = LeakDetector(window, threshold)
    for i in range(n + 1):
        t = window * i / n
        detector.add(t, offset + slope_s * t + amplitude * noise[i])
    assert detector.verdict() == "leak"


@settings(max_examples=80, deadline=None)
@given(windows, thresholds, counts, st.floats(0.0, 0.45), st.floats(0.1, 1000), st.floats(1, 2.5),
       st.lists(st.floats(-1, 1), min_size=301, max_size=301))
def test_property_growth_that_stops_within_half_a_window_is_never_a_leak(window, threshold, n, growth_part,
                                                                        growth_factor, length, noise):
    """Any growth rate for up to 45% of a window, then a plateau with noise: no verdict is ever "leak"."""
    slope_s = growth_factor * threshold / 3600.0
    amplitude = threshold / 3600.0 * window / 20
    growth_end = growth_part * window
    detector = LeakDetector(window, threshold)
    steps = min(int(n * length), 300)
    for i in range(steps + 1):
        t = window * i / n
        detector.add(t, 100 + slope_s * min(t, growth_end) + amplitude * noise[i])
        assert detector.verdict() != "leak"


@settings(max_examples=100, deadline=None)
@given(windows, thresholds, counts, st.floats(-10, 0.9), st.floats(0.05, 0.95), st.floats(-2000, 2000))
def test_property_slow_growth_or_a_single_step_is_not_a_leak(window, threshold, n, factor, step_at, step):
    """Growth below the threshold (or shrinking), plus one step of any size anywhere: not a leak."""
    slope_s = factor * threshold / 3600.0
    detector = LeakDetector(window, threshold)
    for i in range(n + 1):
        t = window * i / n
        detector.add(t, 500 + slope_s * t + (step if t >= step_at * window else 0.0))
    assert detector.verdict() == "ok"


@settings(max_examples=100, deadline=None)
@given(windows, thresholds, st.integers(1, 200), st.floats(0.0, 0.89), st.floats(0, 1e4))
def test_property_short_or_sparse_evidence_is_insufficient(window, threshold, n, coverage, slope_h):
    assume(n < 12 or coverage < WINDOW_COVERAGE)
    detector = LeakDetector(window, threshold)
    for i in range(n):
        t = coverage * window * i / max(n - 1, 1)
        detector.add(t, 100 + slope_h / 3600 * t)
    assert detector.verdict() == "insufficient"


# ---------------------------------------------------------------------------------------------- memory alerts

def first_alert(memory):
    """The most pressing new alert of one sample, or None."""
    alerts = memory.check_all()
    return alerts[0] if alerts else None


LEAK_CONFIG = WatchdogConfig(interval_s=1.0, window_s=60.0, leak_mb_per_hour=600.0)


def test_real_growing_allocation_is_a_leak_within_the_window():
    """One MiB retained per 'frame', a frame per (manual) second: 3600 MiB/h against a 600 MiB/h threshold."""
    clock = ManualClock()
    memory = MemoryWatchdog(LEAK_CONFIG, budget_mb=None, npu_probe=None, clock=clock, read_limit=lambda: None)
    retained = []
    start = read_rss_mb()
    first: Optional[int] = None
    alert = None
    for frame in range(70):
        retained.append(touched_bytes(1))
        clock.advance(1.0)
        leaks = [a for a in memory.check_all() if a.kind == "leak"]
        if leaks and first is None:
            first, alert = frame, leaks[0]
    grown = read_rss_mb() - start
    del retained
    assert grown > 0.8 * 70, "precondition: the allocation must show in RSS (grew %.1f MiB)" % grown
    assert first is not None and first <= LEAK_CONFIG.window_s
    assert alert.restart and alert.figures["scope"] == "rss"
    assert 0.7 * 3600 < alert.figures["slope_mb_per_hour"] < 1.3 * 3600
    assert alert.as_dict()["kind"] == "leak"


def test_real_allocation_that_plateaus_is_not_a_leak():
    """The same kind of growth, 60 MiB in the first 20 s, then nothing for two windows."""
    clock = ManualClock()
    memory = MemoryWatchdog(LEAK_CONFIG, budget_mb=None, npu_probe=None, clock=clock, read_limit=lambda: None)
    retained = []
    start = read_rss_mb()
    for frame in range(150):
        if frame < 20:
            retained.append(touched_bytes(3))
        clock.advance(1.0)
        assert [a for a in memory.check_all() if a.kind == "leak"] == []
    grown = read_rss_mb() - start
    del retained
    assert grown > 0.8 * 60, "precondition: the allocation must show in RSS (grew %.1f MiB)" % grown
    assert memory.rss_trend.verdict() == "ok"  # judged on a full window, not merely "insufficient"


def test_leak_settings_come_from_the_config():
    """restart_on_leak=false turns a host leak into an alert only; leak_min_samples is the detector's."""
    config = WatchdogConfig(interval_s=1.0, window_s=60.0, leak_mb_per_hour=600.0, restart_on_leak=False,
                            leak_min_samples=40)
    clock = ManualClock()
    rss = [100.0]
    memory = MemoryWatchdog(config, clock=clock, read_rss=lambda: rss[0], read_limit=lambda: None)
    assert memory.rss_trend.min_samples == 40
    leaks = []
    for _ in range(70):  # 1 MiB/s: 3600 MiB/h against 600 MiB/h
        rss[0] += 1.0
        clock.advance(1.0)
        leaks += [a for a in memory.check_all() if a.kind == "leak"]
    assert len(leaks) == 1 and leaks[0].restart is False


@pytest.mark.parametrize("soft, budget, cgroup, expected", [
    (None, None, None, (None, "")),
    (500.0, 400, None, (400.0, "device memory_budget_mb")),
    (300.0, 400, None, (300.0, "watchdog.soft_limit_mb")),
    (None, 400, 300.0, (270.0, "90% of cgroup memory.max")),
    (None, None, 2000.0, (1800.0, "90% of cgroup memory.max")),
])
def test_soft_limit_is_the_smallest_one_set(soft, budget, cgroup, expected):
    config = WatchdogConfig(soft_limit_mb=soft)
    assert MemoryWatchdog(config, budget_mb=budget).soft_limit(cgroup) == expected


def test_real_rss_over_the_budget_alerts_on_the_second_sample_then_holds():
    clock = ManualClock()
    memory = MemoryWatchdog(WatchdogConfig(), budget_mb=1, clock=clock, read_limit=lambda: None)
    assert first_alert(memory) is None  # one sample over can be a transient peak
    clock.advance(5)
    alert = first_alert(memory)
    assert alert.kind == "soft_limit" and alert.restart
    assert alert.figures["limit_source"] == "device memory_budget_mb" and alert.figures["limit_mb"] == 1
    assert abs(alert.figures["used_mb"] - vm_rss_mb()) < 20
    clock.advance(5)
    assert first_alert(memory) is None  # still over: not published again every sample


def run_checks(memory: MemoryWatchdog, clock: ManualClock, count: int) -> List[Tuple[int, str]]:
    found = []
    for i in range(count):
        clock.advance(1.0)
        found += [(i, a.kind) for a in memory.check_all()]
    return found


def test_soft_limit_alert_repeats_only_after_clearing_or_a_window():
    clock = ManualClock()
    values = iter([100, 600, 600, 100, 600, 600, 600])
    memory = MemoryWatchdog(WatchdogConfig(window_s=300), budget_mb=500, clock=clock,
                            read_rss=lambda: float(next(values)), read_limit=lambda: None)
    assert run_checks(memory, clock, 7) == [(2, "soft_limit"), (5, "soft_limit")]
    memory = MemoryWatchdog(WatchdogConfig(window_s=10), budget_mb=500, clock=clock,
                            read_rss=lambda: 600.0, read_limit=lambda: None)
    assert run_checks(memory, clock, 25) == [(1, "soft_limit"), (11, "soft_limit"), (21, "soft_limit")]


def test_cgroup_limit_bounds_the_soft_limit():
    clock = ManualClock()
    memory = MemoryWatchdog(WatchdogConfig(), clock=clock, read_rss=lambda: 950.0, read_limit=lambda: 1000.0)
    first_alert(memory)
    alert = first_alert(memory)
    assert alert.figures["limit_mb"] == 900.0
    assert "90% of cgroup memory.max" in alert.message


def test_npu_memory_over_its_budget_alerts_without_restart():
    chip = NpuMemory(0, "310P3", 1074, 21534, chip_id=0, logical_id=0)
    clock = ManualClock()
    memory = MemoryWatchdog(WatchdogConfig(), budget_mb=None, npu_probe=lambda: chip, clock=clock,
                            npu_budget_mb=1000, read_rss=lambda: 100.0, read_limit=lambda: None)
    first = memory.check_all()
    sample = memory.last_sample
    assert sample == MemorySample(rss_mb=100.0, cgroup_limit_mb=None, npu_used_mb=1074.0,
                                  npu_total_mb=21534.0)
    alerts = memory.check_all()
    assert first == []
    assert [(a.kind, a.figures["scope"], a.restart) for a in alerts] == [("soft_limit", "npu", False)]


def test_a_failing_npu_probe_leaves_npu_figures_empty(caplog):
    def broken_probe():
        raise RuntimeError("stand-in probe failure")

    memory = MemoryWatchdog(WatchdogConfig(), npu_probe=broken_probe, read_limit=lambda: None)
    with caplog.at_level(logging.ERROR, logger="agent.health.memory"):
        samples = [memory.sample() for _ in range(10)]
    assert all(s.npu_used_mb is None and s.rss_mb > 0 for s in samples)
    assert len([r for r in caplog.records if "NPU memory probe failed" in r.getMessage()]) == 1


def test_an_npu_smi_probe_object_is_accepted_as_it_is():
    """The daemon may hand over the NpuSmiProbe itself; its read() is used (runner: a canned stand-in)."""
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(tests, "fixtures", "npu_smi", "info-atlas-200i-dk-a2-310b4.txt")) as handle:
        canned = handle.read()

    def fake_npu_smi_runner(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 0, canned, "")

    memory = MemoryWatchdog(WatchdogConfig(), npu_probe=NpuSmiProbe(runner=fake_npu_smi_runner),
                            read_limit=lambda: None)
    sample = memory.sample()
    assert (sample.npu_used_mb, sample.npu_total_mb) == (2500.0, 7545.0)


# ---------------------------------------------------------------------------------------------- progress


def test_health_needs_progress_since_the_last_ping():
    clock = ManualClock()
    progress = ProgressMonitor(deadline_s=10, clock=clock)
    assert not progress.healthy_since_last_ping()
    progress.idle_tick()
    assert progress.healthy_since_last_ping()
    progress.mark_pinged()
    assert not progress.healthy_since_last_ping()
    progress.begin_inference()
    clock.advance(2)
    assert not progress.healthy_since_last_ping()  # a call in flight is not yet progress
    progress.end_inference()
    progress.frame_done(4)
    assert progress.healthy_since_last_ping() and progress.frames_total == 4


def test_a_hung_call_is_reported_once_and_restarts_at_the_second_miss():
    clock = ManualClock()
    progress = ProgressMonitor(deadline_s=10, clock=clock)
    progress.frame_done()
    progress.begin_inference()
    assert progress.check(clock.advance(9.5)) is None
    report = progress.check(clock.advance(1.0))
    assert "running for 10.5 s (deadline 10.0 s, 1 consecutive miss)" in report
    assert progress.misses == 1 and not progress.should_restart
    assert not progress.healthy_since_last_ping()  # frames were done, but the call is overdue
    assert progress.check(clock.advance(5)) is None  # once per call
    assert progress.check(clock.advance(5)) is None
    assert progress.misses == 2 and progress.should_restart


def test_slow_calls_add_up_and_a_timely_call_resets():
    clock = ManualClock()
    progress = ProgressMonitor(deadline_s=10, clock=clock)
    progress.begin_inference()
    clock.advance(12)
    progress.end_inference()  # overran and finished between two checks
    assert "took 12.0 s" in progress.check()
    assert progress.check() is None and progress.misses == 1
    progress.begin_inference()
    clock.advance(3)
    progress.end_inference()
    assert progress.misses == 0
    for _ in range(2):
        progress.begin_inference()
        clock.advance(11)
        progress.end_inference()
    assert progress.should_restart


# ---------------------------------------------------------------------------------------------- the thread


@pytest.fixture
def listener():
    owned = NotifyListener()
    yield owned
    owned.close()


def test_pings_follow_progress_stop_on_a_hang_and_resume(listener):
    """A pipeline thread calls a test backend; made to hang, the backend blocks on an Event.

    WatchdogSec is 1 s (pings due every 0.5 s), the inference deadline 0.3 s.
    """
    env = {"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    notifier = SystemdNotifier(environ=env)
    config = WatchdogConfig(interval_s=0.5, window_s=60, leak_mb_per_hour=1e6, inference_deadline_s=0.3)
    progress = ProgressMonitor(config.inference_deadline_s)
    memory = MemoryWatchdog(config, read_limit=lambda: None)
    alerts: List[dict] = []
    restarts: List[str] = []
    ticks: List[float] = []

    def clock() -> float:  # the watchdog thread's own clock: each reading is one tick of it
        ticks.append(time.monotonic())
        return ticks[-1]

    watchdog = Watchdog(config, memory, progress, notifier, on_alert=alerts.append,
                        request_restart=restarts.append, tick_s=0.05, clock=clock)
    hang, release, stop = threading.Event(), threading.Event(), threading.Event()
    hung_at: List[float] = []

    def backend(frame: int) -> int:
        if hang.is_set() and not hung_at:
            hung_at.append(time.monotonic())
            release.wait(WAIT_S * 3)
        return frame * 2

    def pipeline() -> None:
        frame = 0
        while not stop.is_set():
            progress.begin_inference()
            try:
                backend(frame)
            finally:
                progress.end_inference()
            progress.frame_done()
            frame += 1
            stop.wait(0.01)

    worker = threading.Thread(target=pipeline, daemon=True)
    assert notifier.ready()
    watchdog.start()
    worker.start()
    try:
        assert listener.wait_for("WATCHDOG=1", 3)
        assert listener.messages[0][1] == "READY=1"
        hang.set()
        assert wait_for(lambda: bool(hung_at))
        assert wait_for(lambda: bool(restarts))
        # The observation window for the negative below, kept by the watchdog's own thread (not a sleep, which a
        # loaded machine could spend without it running): it ticks on through three ping intervals of the hang.
        window_end = time.monotonic() + 3 * watchdog.ping_interval_s
        assert wait_for(lambda: ticks[-1] >= window_end), "the watchdog thread stopped ticking"
        after_hang = listener.received("WATCHDOG=1", after=hung_at[0])
        hang_alerts = [a for a in alerts if a["kind"] == "hang"]
        release.set()
        resumed = listener.wait_for("WATCHDOG=1", 1, after=time.monotonic())
    finally:
        release.set()
        stop.set()
        worker.join(WAIT_S)
        stopped = watchdog.stop(WAIT_S)
    # At most the ping owed for frames finished before the hang, plus one already on its way; a thread
    # pinging unconditionally would have sent one per 0.5 s for the whole hang (over 2 s).
    assert len(after_hang) <= 2
    assert len(hang_alerts) == 1 and "deadline 0.3 s" in hang_alerts[0]["message"]
    assert restarts == ["inference hang: 2 consecutive deadline misses (deadline 0.3 s)"]
    assert resumed, "pings must resume once frames go through again"
    assert stopped and not worker.is_alive()


def test_tick_publishes_memory_alerts_and_requests_one_restart(listener):
    clock = ManualClock()
    env = {"NOTIFY_SOCKET": listener.path}
    config = WatchdogConfig(interval_s=5)
    memory = MemoryWatchdog(config, budget_mb=500, clock=clock, read_rss=lambda: 800.0,
                            read_limit=lambda: None)
    alerts: List[dict] = []
    restarts: List[str] = []
    watchdog = Watchdog(config, memory, ProgressMonitor(10, clock=clock), SystemdNotifier(environ=env),
                        on_alert=alerts.append, request_restart=restarts.append, clock=clock)
    for _ in range(6):
        watchdog.tick(clock.advance(5))
    assert [a["kind"] for a in alerts] == ["soft_limit"]
    assert alerts[0]["restart"] is True and alerts[0]["figures"]["used_mb"] == 800.0
    assert restarts == [alerts[0]["message"]]
    assert listener.wait_for("STATUS=restarting: " + alerts[0]["message"], 1)
    assert watchdog.pings == 0  # no WATCHDOG_USEC: systemd is not watching, nothing to ping
    snapshot = watchdog.snapshot()
    assert snapshot["rss_mb"] == 800.0 and snapshot["soft_limit_mb"] == 500.0
    assert snapshot["restart_requested"] == restarts[0]


def test_failing_callbacks_are_logged_and_the_tick_goes_on(caplog):
    clock = ManualClock()
    config = WatchdogConfig(interval_s=1)

    def broken(_):
        raise RuntimeError("stand-in publisher failure")

    memory = MemoryWatchdog(config, budget_mb=10, clock=clock, read_rss=lambda: 800.0,
                            read_limit=lambda: None)
    watchdog = Watchdog(config, memory, ProgressMonitor(10, clock=clock), SystemdNotifier(environ={}),
                        on_alert=broken, request_restart=broken, clock=clock)
    with caplog.at_level(logging.ERROR, logger="agent.health.watchdog"):
        for _ in range(3):
            watchdog.tick(clock.advance(1))
    assert "publishing watchdog alert failed" in caplog.text and "restart request failed" in caplog.text
    assert watchdog.restart_reason is not None


def test_thread_without_systemd_stops_within_its_timeout():
    config = WatchdogConfig(interval_s=0.05)
    watchdog = Watchdog(config, MemoryWatchdog(config, read_limit=lambda: None), ProgressMonitor(1.0),
                        SystemdNotifier(environ={}), on_alert=lambda a: None, request_restart=lambda r: None)
    assert watchdog.ping_interval_s is None and watchdog.tick_s == 0.05
    watchdog.start()
    with pytest.raises(RuntimeError, match="already started"):
        watchdog.start()
    assert wait_for(lambda: watchdog.memory.last_sample is not None)
    assert watchdog.stop(WAIT_S)


def test_no_source_up_is_alive_without_input_not_stuck(listener):
    """Every camera stalled: the idle loop keeps turning, so pings go on, nothing restarts, and the status
    line says there is no input; it says 'serving' again once a source is up."""
    clock = ManualClock()
    env = {"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    states = {"stalled": 1, "failed": 1}
    progress = ProgressMonitor(10, clock=clock)
    restarts: List[str] = []
    watchdog = Watchdog(WatchdogConfig(), MemoryWatchdog(WatchdogConfig(), clock=clock, read_limit=lambda: None),
                        progress, SystemdNotifier(environ=env), on_alert=lambda a: None,
                        request_restart=restarts.append, clock=clock, input_states=lambda: dict(states))
    for _ in range(5):
        progress.idle_tick()
        watchdog.tick(clock.advance(1.0))
    assert watchdog.pings >= 4 and restarts == [] and watchdog.snapshot()["no_input"] is True
    assert listener.wait_for("STATUS=serving, no input: no source up (1 failed, 1 stalled)", 1)
    states.clear()
    states.update(up=1, stalled=1)
    watchdog.tick(clock.advance(1.0))
    assert listener.wait_for("STATUS=serving", 1) and watchdog.no_input is False
    states.update(up=1, stalled=0, degraded=1)  # reads frames, serves none (issue 31): not up, and said so
    watchdog.tick(clock.advance(1.0))
    assert listener.wait_for("STATUS=serving; 1 of 2 sources degraded (frames arrive, none served)", 1)
