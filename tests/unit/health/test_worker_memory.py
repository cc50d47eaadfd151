"""Issue 31 item 5: the camera workers are part of the box's memory. Each worker's RSS is sampled by pid and
counted in the total the soft limit is held against; a worker above ``worker_max_rss_mb`` or leaking is
recycled alone (the watchdog asks its source, cause ``memory``), never the daemon."""

import os
import subprocess
import sys
from typing import Dict, List, Tuple

from agent.config.daemon_config import WatchdogConfig
from agent.health.memory import MemoryWatchdog
from agent.health.progress import ProgressMonitor
from agent.health.readers import read_rss_mb
from agent.health.sdnotify import SystemdNotifier
from agent.health.watchdog import Watchdog
from tests.conftest import wait_for
from tests.support.clock_support import ManualClock


def watched(config: WatchdogConfig, pids: Dict[str, int], rss: Dict[int, float], daemon_mb: float = 100.0):
    clock = ManualClock()
    memory = MemoryWatchdog(config, clock=clock, read_rss=lambda: daemon_mb, read_limit=lambda: None,
                            worker_pids=lambda: dict(pids), read_rss_of=lambda pid: rss.get(pid))
    recycled: List[Tuple[str, str, str]] = []
    alerts: List[dict] = []
    restarts: List[str] = []
    watchdog = Watchdog(config, memory, ProgressMonitor(10, clock=clock), SystemdNotifier(environ={}),
                        on_alert=alerts.append, request_restart=restarts.append, tick_s=config.interval_s,
                        clock=clock, restart_worker=lambda *args: recycled.append(args))
    return clock, memory, watchdog, recycled, alerts, restarts


def test_a_workers_rss_is_read_from_proc_by_pid():
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = b'x' * (40 << 20); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        memory = MemoryWatchdog(WatchdogConfig(), read_limit=lambda: None, worker_pids=lambda: {"cam": child.pid})
        assert wait_for(lambda: memory.sample().workers_mb.get("cam", 0) > 40)  # once the child has allocated
        sample = memory.last_sample
    finally:
        child.stdin.close()
        child.wait(10)
    assert sample.workers_mb["cam"] > 40
    assert sample.total_rss_mb == sample.rss_mb + sample.workers_mb["cam"]
    figures = sample.as_dict()
    assert figures["workers_rss_mb"] == {"cam": round(sample.workers_mb["cam"], 1)}
    assert figures["total_rss_mb"] == round(sample.total_rss_mb, 1)
    assert read_rss_mb(pid=str(os.getpid())) is not None


def test_an_oversized_worker_is_recycled_alone_at_the_second_sample():
    config = WatchdogConfig(interval_s=1.0, worker_max_rss_mb=200)
    clock, memory, watchdog, recycled, alerts, restarts = watched(config, {"a": 11, "b": 12}, {11: 60.0, 12: 250.0})
    watchdog.tick(clock())
    assert recycled == []  # one sample over can be a peak
    watchdog.tick(clock.advance(1.0))
    assert [(name, cause) for name, cause, _ in recycled] == [("b", "memory")]
    assert restarts == [] and watchdog.restart_reason is None
    alert = [a for a in alerts if a["kind"] == "soft_limit"][0]
    assert alert["source"] == "b" and alert["figures"]["scope"] == "worker" and alert["figures"]["pid"] == 12
    assert alert["figures"]["used_mb"] == 250.0 and alert["figures"]["limit_mb"] == 200.0
    assert memory.last_sample.total_rss_mb == 100.0 + 60.0 + 250.0


def test_the_soft_limit_counts_the_workers():
    config = WatchdogConfig(interval_s=1.0, soft_limit_mb=300)
    clock, _memory, watchdog, recycled, _alerts, restarts = watched(config, {"a": 11, "b": 12}, {11: 120.0, 12: 120.0})
    for _ in range(2):
        watchdog.tick(clock.advance(1.0))
    assert recycled == [] and len(restarts) == 1 and "camera workers" in restarts[0]  # 100 + 240 > 300


def test_a_leaking_worker_is_recycled_and_a_new_process_starts_a_new_trend():
    config = WatchdogConfig(interval_s=1.0, window_s=20.0, leak_mb_per_hour=100.0, leak_min_samples=6)
    pids = {"cam": 21}
    rss = {21: 60.0}
    clock, _memory, watchdog, recycled, alerts, restarts = watched(config, pids, rss)
    for step in range(30):
        rss[21] = 60.0 + step * 0.5  # 1800 MiB/h
        watchdog.tick(clock.advance(1.0))
        if recycled:
            break
    assert recycled and recycled[0][:2] == ("cam", "memory") and restarts == []
    leak = [a for a in alerts if a["kind"] == "leak"][0]
    assert leak["source"] == "cam" and leak["figures"]["pid"] == 21 and leak["restart"]
    pids["cam"] = 22  # the replacement, steady
    rss[22] = 60.0
    for _ in range(30):
        watchdog.tick(clock.advance(1.0))
    assert len(recycled) == 1
