"""The watchdog thread: the one place that pings systemd's watchdog, tying the health checks together.

Four parts, each in its own module and testable alone, tied together by :class:`Watchdog`:

* :mod:`agent.health.readers`: :func:`read_rss_mb` (the resident memory of this process or of a camera worker) and
  :func:`read_cgroup_limit_mb` (the ``MemoryMax=`` systemd put on our cgroup, v2 or v1);
* :mod:`agent.health.leak`: :class:`LeakDetector`, a growth *trend* over a sliding window, robust to a plateau
  (growth that stops) and to a one-off step (a model load);
* :mod:`agent.health.memory`: :class:`MemoryWatchdog` samples RSS (the daemon's and each camera worker's), the
  cgroup limit and NPU memory, and turns them into alerts; a worker's own alert recycles that worker alone;
* :mod:`agent.health.progress`: :class:`ProgressMonitor`, where the pipeline marks each backend call and each
  finished frame, so liveness comes from progress: ``WATCHDOG=1`` is sent only when frames went through (or
  the idle loop proved it is turning), and never while an inference call overruns its deadline.

Alive with no input is not stuck: when no source is up (every camera stalled, down or failed) the loop still
turns, pings go on, and the service status says "serving, no input" with the sources' states; restarting
the daemon does not fix a camera (each source alerts and reopens on its own, docs/sources.md). Only a loop
that stops turning, or an overrunning inference call, costs the pings and so the process.
"""

import logging
import math
import threading
import time
from typing import Any, Callable, Dict, Optional

from agent._util.compat import Protocol
from agent.config.daemon_config import WatchdogConfig
from agent.health.memory import Alert, MemoryWatchdog
from agent.health.progress import ProgressMonitor

log = logging.getLogger(__name__)


class Notifier(Protocol):
    """The service manager's watchdog and status line (:class:`agent.health.sdnotify.SystemdNotifier`)."""

    @property
    def enabled(self) -> bool: ...

    def watchdog_interval_s(self) -> Optional[float]: ...

    def watchdog(self) -> bool: ...

    def status(self, text: str) -> bool: ...


class Watchdog:
    """The watchdog thread: checks progress, pings systemd when deserved, samples memory, raises alerts.

    Order inside one tick matters: progress is checked first so a hang found now withholds this tick's ping;
    the ping goes before the memory sample because npu-smi can take seconds. ``on_alert(dict)`` receives
    :meth:`Alert.as_dict` (the daemon publishes it on ``telemetry/alert``); ``request_restart(reason)`` is
    called once, and the daemon then drains, flushes and exits non-zero so ``Restart=on-failure`` brings it
    back. Both callbacks run on this thread, wrapped so an exception in them is logged and the loop goes on.
    """

    def __init__(self, config: WatchdogConfig, memory: MemoryWatchdog, progress: ProgressMonitor,
                 notifier: Notifier, on_alert: Callable[[Dict[str, Any]], None],
                 request_restart: Callable[[str], None], tick_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic,
                 input_states: Optional[Callable[[], Dict[str, int]]] = None,
                 restart_worker: Optional[Callable[[str, str, str], None]] = None) -> None:
        """``input_states()`` counts the running sources by state (:meth:`SourceSet.summary`);
        ``restart_worker(source, cause, message)`` recycles one camera worker (:meth:`SourceSet.recycle`)."""
        self.restart_worker = restart_worker
        self.memory = memory
        self.input_states = input_states
        self.no_input = False
        self.degraded = 0  # sources whose frames arrive and none is served (a camera's clock): said in the status
        self.progress = progress
        self.notifier = notifier
        self.on_alert = on_alert
        self.request_restart = request_restart
        self.clock = clock
        self.ping_interval_s: Optional[float] = notifier.watchdog_interval_s() if notifier.enabled else None
        self.memory_interval_s = config.interval_s
        if tick_s is None:
            # Half the ping interval keeps pings at most 1.5 intervals (0.75 WatchdogSec) apart; half the
            # deadline finds an overrun within 1.5 deadlines.
            candidates = [self.memory_interval_s, progress.deadline_s / 2]
            if self.ping_interval_s is not None:
                candidates.append(self.ping_interval_s / 2)
            tick_s = min(candidates)
        self.tick_s = tick_s
        if self.ping_interval_s is not None and progress.deadline_s >= self.ping_interval_s:
            log.warning("inference_deadline_s %.1f s is not below WatchdogSec/2 (%.1f s): systemd may kill a "
                        "slow call before the watchdog reports it", progress.deadline_s, self.ping_interval_s)
        self.pings = 0
        self.restart_reason: Optional[str] = None
        self._last_ping: Optional[float] = None
        self._next_memory: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("watchdog already started")
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the loop; True when the thread ended within ``timeout_s``."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick(self.clock())
            except Exception:  # the loop must outlive one bad iteration (if it died, pings would stop too)
                log.exception("watchdog tick failed")
            self._stop.wait(self.tick_s)

    def tick(self, now: float) -> None:
        """One iteration (the thread calls this every ``tick_s``; tests call it directly)."""
        report = self.progress.check(now)
        if report is not None:
            elapsed = self.progress.inference_elapsed_s(now)
            figures = {"scope": "inference", "deadline_s": self.progress.deadline_s,
                       "misses": self.progress.misses,
                       "elapsed_s": None if elapsed is None else round(elapsed, 3)}
            self._emit(Alert("hang", report, figures, restart=self.progress.should_restart))
        if self.progress.should_restart:
            self._restart("inference hang: %d consecutive deadline misses (deadline %.1f s)" % (
                self.progress.misses, self.progress.deadline_s))
        self._maybe_ping(now)
        self._check_input()
        if self._next_memory is None or now >= self._next_memory:
            self._next_memory = now + self.memory_interval_s
            for alert in self.memory.check_all():
                self._emit(alert)
                if alert.restart and alert.source is not None:
                    self._recycle_worker(alert)
                elif alert.restart:
                    self._restart(alert.message)

    def _maybe_ping(self, now: float) -> None:
        if self.ping_interval_s is None:
            return
        if self._last_ping is not None and now - self._last_ping < self.ping_interval_s:
            return
        if not self.progress.healthy_since_last_ping(now):
            return
        if self.notifier.watchdog():
            self.pings += 1
        self.progress.mark_pinged()
        self._last_ping = now

    def _check_input(self) -> None:
        """Say in the service status when no source is up, and when input is back (each once)."""
        if self.input_states is None:
            return
        states = self.input_states()
        total = sum(states.values())
        no_input = total > 0 and not states.get("up")
        degraded = states.get("degraded", 0)
        if (no_input, degraded) == (self.no_input, self.degraded):
            return
        self.no_input, self.degraded = no_input, degraded
        if no_input:
            text = "serving, no input: no source up (%s)" % ", ".join(
                "%d %s" % (n, state) for state, n in sorted(states.items()))
            log.warning("%s; alive and pinging (a restart does not fix a camera)", text)
        elif degraded:
            text = "serving; %d of %d sources degraded (frames arrive, none served)" % (degraded, total)
            log.warning("%s", text)
        else:
            text = "serving"
            log.info("input is back: %d of %d sources up", states.get("up", 0), total)
        self.notifier.status(text)

    def _emit(self, alert: Alert) -> None:
        log.warning("watchdog alert %s: %s", alert.kind, alert.message)
        try:
            self.on_alert(alert.as_dict())
        except Exception:
            log.exception("publishing watchdog alert failed")

    def _recycle_worker(self, alert: Alert) -> None:
        """One camera worker's memory: that worker is replaced (its source says cause ``memory``), not the daemon."""
        if self.restart_worker is None or alert.source is None:
            return
        try:
            self.restart_worker(alert.source, "memory", alert.message)
        except Exception:
            log.exception("recycling the worker of source %s failed", alert.source)

    def _restart(self, reason: str) -> None:
        if self.restart_reason is not None:
            return
        self.restart_reason = reason
        log.error("watchdog requests a restart: %s", reason)
        self.notifier.status("restarting: " + reason)
        try:
            self.request_restart(reason)
        except Exception:
            log.exception("restart request failed")

    def snapshot(self) -> Dict[str, Any]:
        """Figures for the periodic telemetry message."""
        sample = self.memory.last_sample
        limit, source = self.memory.soft_limit(sample.cgroup_limit_mb if sample else None)
        result: Dict[str, Any] = dict(sample.as_dict()) if sample else {}
        result.update(soft_limit_mb=None if limit is None else round(limit, 1), soft_limit_source=source,
                      rss_slope_mb_per_hour=_rounded(self.memory.rss_trend.slope_mb_per_hour),
                      watchdog_pings=self.pings, restart_requested=self.restart_reason, no_input=self.no_input)
        result.update(self.progress.snapshot())
        return result


def _rounded(value: Optional[float]) -> Optional[float]:
    return None if value is None or math.isnan(value) else round(value, 2)
