"""Memory and liveness checks, and the one place that pings systemd's watchdog.

Four small parts, each testable alone, tied together by :class:`Watchdog`:

* readers: :func:`read_rss_mb` (this process's resident memory) and :func:`read_cgroup_limit_mb` (the
  ``MemoryMax=`` systemd put on our cgroup, v2 or v1);
* :class:`LeakDetector`: a growth *trend* over a sliding window, robust to a plateau (growth that stops)
  and to a one-off step (a model load);
* :class:`MemoryWatchdog`: samples RSS, the cgroup limit and NPU memory, and turns them into alerts;
* :class:`ProgressMonitor`: the pipeline marks each backend call and each finished frame, so liveness comes
  from progress: ``WATCHDOG=1`` is sent only when frames went through (or the idle loop proved it is
  turning), and never while an inference call overruns its deadline.

Alive with no input is not stuck: when no source is up (every camera stalled, down or failed) the loop still
turns, pings go on, and the service status says "serving, no input" with the sources' states; restarting
the daemon does not fix a camera (each source alerts and reopens on its own, docs/sources.md). Only a loop
that stops turning, or an overrunning inference call, costs the pings and so the process.

All memory figures are MiB (what systemd's ``M`` suffix and npu-smi's ``MB`` mean).
"""

import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, Union

from agent._util.compat import Protocol
from agent.config.daemon_config import DEFAULT_LEAK_MIN_SAMPLES, MIN_LEAK_SAMPLES, WatchdogConfig

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# Recycle gracefully at 90% of MemoryMax, before the kernel's OOM killer does it the hard way.
CGROUP_LIMIT_FRACTION = 0.9
# cgroup v1 writes "unlimited" as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages): no box
# has 1 EiB, so anything at or above it means no limit.
V1_UNLIMITED_BYTES = 1 << 60
SOFT_LIMIT_CONSECUTIVE = 2  # one sample over the limit can be a batch's transient peak; two in a row is not
WINDOW_COVERAGE = 0.9  # a trend must span 90% of window_s (sampling jitter) before it can be called a leak
MIN_FIT_R2 = 0.8  # a leak is a steady climb: the straight line must explain >= 80% of the variance
HANG_MISSES_FOR_RESTART = 2  # one overrun can be a slow first call after a model load; two in a row is a hang


# ---------------------------------------------------------------------------------------------- readers


def read_rss_mb(proc_root: str = "/proc", pid: str = "self") -> Optional[float]:
    """Resident memory of a process in MiB, from ``statm`` (cheap), else ``status`` VmRSS; None off Linux."""
    base = os.path.join(proc_root, str(pid))
    try:
        with open(os.path.join(base, "statm")) as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(os.path.join(base, "status")) as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_paths(proc_root: str, pid: str) -> Tuple[Optional[str], Optional[str]]:
    """(v2 path, v1 memory-controller path) of a process, from ``/proc/<pid>/cgroup``."""
    v2 = v1 = None
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup")) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _read_limit_file(path: str, unlimited_word: str) -> Optional[int]:
    """Bytes in a cgroup limit file; None when absent, unreadable or unlimited."""
    try:
        with open(path) as handle:
            raw = handle.read().strip()
    except OSError:
        return None
    if raw == unlimited_word:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value < V1_UNLIMITED_BYTES else None


def _walk_limits(mount: str, cgroup_path: str, filename: str, unlimited_word: str) -> List[int]:
    """Limits from our cgroup up to the mount's root: the tightest one is what the kernel enforces."""
    relative = cgroup_path.strip("/")
    directory = os.path.join(mount, relative) if relative else mount
    if not os.path.isdir(directory):
        # In a cgroup namespace (a container) /proc shows "/" or a path the mount does not have: the mount's
        # root is then our own cgroup.
        directory = mount
    limits = []
    while True:
        value = _read_limit_file(os.path.join(directory, filename), unlimited_word)
        if value is not None:
            limits.append(value)
        if os.path.normpath(directory) == os.path.normpath(mount):
            return limits
        directory = os.path.dirname(directory)


def read_cgroup_limit_mb(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                         pid: str = "self") -> Optional[float]:
    """This process's cgroup memory limit in MiB (v2 ``memory.max``, v1 ``memory.limit_in_bytes``).

    None when there is no limit or no cgroup filesystem. On a hybrid host the v2 tree is mounted at
    ``<cgroup_root>/unified`` and usually has no memory controller, so the v1 tree answers.
    """
    v2_path, v1_path = _cgroup_paths(proc_root, pid)
    limits: List[int] = []
    if v2_path is not None:
        for mount in (cgroup_root, os.path.join(cgroup_root, "unified")):
            if os.path.exists(os.path.join(mount, "cgroup.controllers")):
                limits += _walk_limits(mount, v2_path, "memory.max", "max")
                break
    if v1_path is not None:
        mount = os.path.join(cgroup_root, "memory")
        if os.path.isdir(mount):
            limits += _walk_limits(mount, v1_path, "memory.limit_in_bytes", "")
    return min(limits) / MIB if limits else None


# ---------------------------------------------------------------------------------------------- leak trend


Point = Tuple[float, float]  # (monotonic seconds, MiB)


def _fit(points: List[Point]) -> Tuple[float, float]:
    """Least-squares slope (units per second) and R² of (t, value) points."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    s_tt = sum((t - mean_t) ** 2 for t, _ in points)
    s_tv = sum((t - mean_t) * (v - mean_v) for t, v in points)
    s_vv = sum((v - mean_v) ** 2 for _, v in points)
    if s_tt <= 0:
        return 0.0, 0.0
    slope = s_tv / s_tt
    r2 = (s_tv * s_tv) / (s_tt * s_vv) if s_vv > 0 else 0.0
    return slope, r2


class LeakDetector:
    """Calls a leak only for steady growth sustained over a whole window.

    A leak needs all of: samples spanning at least 90% of ``window_s`` (and ``min_samples`` of them); the
    least-squares slope over the window, over its first half *and* over its second half each above
    ``leak_mb_per_hour``; and a straight line explaining at least 80% of the variance (R²). Growth that stops
    within half a window (a plateau, e.g. caches warming) leaves the second half flat; a one-off step (a model
    swap) lies in one half only and leaves the other flat; neither is a leak.
    """

    def __init__(self, window_s: float, leak_mb_per_hour: float,
                 min_samples: int = DEFAULT_LEAK_MIN_SAMPLES) -> None:
        if window_s <= 0 or leak_mb_per_hour <= 0:
            raise ValueError("window_s and leak_mb_per_hour must be > 0 (got %s, %s)" % (
                window_s, leak_mb_per_hour))
        if min_samples < MIN_LEAK_SAMPLES:
            raise ValueError("min_samples must be >= %d (got %d)" % (MIN_LEAK_SAMPLES, min_samples))
        self.window_s = float(window_s)
        self.leak_mb_per_hour = float(leak_mb_per_hour)
        self.min_samples = min_samples
        self._samples: Deque[Point] = deque()

    def add(self, t: float, mb: float) -> None:
        """Add one sample (monotonic seconds, MiB); samples older than the window fall out."""
        if self._samples and t < self._samples[-1][0]:
            log.warning("leak window reset: time went backwards (%.3f after %.3f)", t, self._samples[-1][0])
            self._samples.clear()
        self._samples.append((float(t), float(mb)))
        while self._samples and self._samples[0][0] < t - self.window_s:
            self._samples.popleft()

    @property
    def span_s(self) -> float:
        return self._samples[-1][0] - self._samples[0][0] if self._samples else 0.0

    @property
    def slope_mb_per_hour(self) -> Optional[float]:
        """Growth over the current window (None with fewer than two samples)."""
        if len(self._samples) < 2:
            return None
        return _fit(list(self._samples))[0] * 3600.0

    def figures(self) -> Dict[str, Any]:
        """The numbers behind :meth:`verdict`, for alerts and logs."""
        points = list(self._samples)
        result: Dict[str, Any] = {"samples": len(points), "span_s": round(self.span_s, 1),
                                  "window_s": self.window_s, "threshold_mb_per_hour": self.leak_mb_per_hour}
        if len(points) >= 2:
            slope, r2 = _fit(points)
            early, late = self._halves(points)
            result.update(slope_mb_per_hour=round(slope * 3600, 2), r2=round(r2, 3),
                          first_mb=round(points[0][1], 1), last_mb=round(points[-1][1], 1))
            if len(early) >= 3 and len(late) >= 3:
                result.update(early_slope_mb_per_hour=round(_fit(early)[0] * 3600, 2),
                              late_slope_mb_per_hour=round(_fit(late)[0] * 3600, 2))
        return result

    @staticmethod
    def _halves(points: List[Point]) -> Tuple[List[Point], List[Point]]:
        middle = (points[0][0] + points[-1][0]) / 2
        return [p for p in points if p[0] <= middle], [p for p in points if p[0] >= middle]

    def verdict(self) -> str:
        """``"insufficient"`` (not enough evidence yet), ``"leak"`` or ``"ok"``."""
        points = list(self._samples)
        if len(points) < self.min_samples or self.span_s < WINDOW_COVERAGE * self.window_s:
            return "insufficient"
        early, late = self._halves(points)
        if len(early) < 3 or len(late) < 3:
            return "insufficient"
        threshold = self.leak_mb_per_hour / 3600.0
        slope, r2 = _fit(points)
        steady = slope > threshold and _fit(early)[0] > threshold and _fit(late)[0] > threshold
        return "leak" if steady and r2 >= MIN_FIT_R2 else "ok"


# ---------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemorySample:
    rss_mb: Optional[float]
    cgroup_limit_mb: Optional[float]
    npu_used_mb: Optional[float]
    npu_total_mb: Optional[float]

    def as_dict(self) -> Dict[str, Optional[float]]:
        return {k: (None if v is None else round(v, 1)) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Alert:
    """One finding: ``kind`` is ``soft_limit``, ``leak`` or ``hang``; ``restart`` says a restart follows."""

    kind: str
    message: str
    figures: Dict[str, Any] = field(default_factory=dict)
    restart: bool = False

    def as_dict(self) -> Dict[str, Any]:
        """The JSON published on ``<prefix>/<device>/telemetry/alert`` (``ts`` is wall-clock, for people)."""
        return {"kind": self.kind, "message": self.message, "restart": self.restart,
                "figures": dict(self.figures), "ts": round(time.time(), 3)}


class NpuReading(Protocol):
    """One NPU memory reading: :class:`agent.health.npu_smi.NpuMemory`, or a backend's own."""

    @property
    def device_used_mb(self) -> float: ...

    @property
    def device_total_mb(self) -> float: ...


class NpuProbe(Protocol):
    """Reads the NPU's memory (:class:`agent.health.npu_smi.NpuSmiProbe`); None when there is no reading."""

    def read(self) -> Optional[NpuReading]: ...


# A probe's read() alone also does (tests and backends that read their own figures pass a function).
NpuRead = Callable[[], Optional[NpuReading]]


class Notifier(Protocol):
    """The service manager's watchdog and status line (:class:`agent.health.sdnotify.SystemdNotifier`)."""

    @property
    def enabled(self) -> bool: ...

    def watchdog_interval_s(self) -> Optional[float]: ...

    def watchdog(self) -> bool: ...

    def status(self, text: str) -> bool: ...


class MemoryWatchdog:
    """Turns memory samples into alerts.

    Host RSS (this process alone) may restart the daemon: above the soft limit, or leaking when
    ``restart_on_leak``. NPU memory only raises alerts: npu-smi reports a whole chip (on 310/310B boards, DDR
    shared with the host OS), so other processes move it and recycling us would not be a cure.

    The soft limit is the smallest of ``config.soft_limit_mb``, ``budget_mb`` (the device config's
    ``memory_budget_mb``) and 90% of the cgroup's ``memory.max``, whichever are set.
    """

    def __init__(self, config: WatchdogConfig, budget_mb: Optional[float] = None,
                 npu_probe: Union[NpuProbe, NpuRead, None] = None,
                 clock: Callable[[], float] = time.monotonic, *, npu_budget_mb: Optional[float] = None,
                 read_rss: Callable[[], Optional[float]] = read_rss_mb,
                 read_limit: Callable[[], Optional[float]] = read_cgroup_limit_mb) -> None:
        self.config = config
        self.budget_mb = budget_mb
        self.npu_budget_mb = npu_budget_mb
        self.npu_probe = npu_probe
        self._read_npu: Optional[NpuRead] = getattr(npu_probe, "read", npu_probe)
        self._npu_error = ""
        self.clock = clock
        self.restart_on_leak = config.restart_on_leak
        self.rss_trend = LeakDetector(config.window_s, config.leak_mb_per_hour, config.leak_min_samples)
        self.npu_trend = LeakDetector(config.window_s, config.leak_mb_per_hour, config.leak_min_samples)
        self.last_sample: Optional[MemorySample] = None
        self._read_rss = read_rss
        self._read_limit = read_limit
        self._over: Dict[str, int] = {"rss": 0, "npu": 0}
        self._active: Dict[Tuple[str, str], float] = {}  # alert key -> when last emitted

    def soft_limit(self, cgroup_limit_mb: Optional[float]) -> Tuple[Optional[float], str]:
        """(limit in MiB, where it came from); (None, "") when nothing bounds us."""
        candidates = []
        if self.config.soft_limit_mb is not None:
            candidates.append((float(self.config.soft_limit_mb), "watchdog.soft_limit_mb"))
        if self.budget_mb is not None:
            candidates.append((float(self.budget_mb), "device memory_budget_mb"))
        if cgroup_limit_mb is not None:
            candidates.append((cgroup_limit_mb * CGROUP_LIMIT_FRACTION, "90% of cgroup memory.max"))
        if not candidates:
            return None, ""
        return min(candidates)

    def sample(self) -> MemorySample:
        npu = None
        if self._read_npu is not None:
            try:
                npu = self._read_npu()
                self._npu_error = ""
            except Exception as exc:  # a probe is outside code (a tool, a backend): it must not stop checks
                text = "%s: %s" % (type(exc).__name__, exc)
                if text != self._npu_error:  # once per distinct failure, not every sample
                    log.exception("NPU memory probe failed")
                    self._npu_error = text
        result = MemorySample(
            rss_mb=self._read_rss(), cgroup_limit_mb=self._read_limit(),
            npu_used_mb=float(npu.device_used_mb) if npu is not None else None,
            npu_total_mb=float(npu.device_total_mb) if npu is not None else None,
        )
        self.last_sample = result
        return result

    def check_all(self, sample: Optional[MemorySample] = None) -> List[Alert]:
        """Every new alert, most pressing first (soft limits before leaks, host before NPU).

        An alert is raised once while its condition holds and again only after it has cleared or a whole
        window has passed, so a box sitting at its limit does not publish an alert every few seconds.
        """
        now = self.clock()
        s = sample if sample is not None else self.sample()
        found: List[Alert] = []
        limit, source = self.soft_limit(s.cgroup_limit_mb)
        found += self._limit_alert("rss", s.rss_mb, limit, source, restart=True)
        found += self._limit_alert("npu", s.npu_used_mb, self.npu_budget_mb, "device npu_memory_budget_mb",
                                   restart=False)
        if s.rss_mb is not None:
            self.rss_trend.add(now, s.rss_mb)
        if s.npu_used_mb is not None:
            self.npu_trend.add(now, s.npu_used_mb)
        found += self._leak_alert("rss", self.rss_trend, restart=self.restart_on_leak)
        found += self._leak_alert("npu", self.npu_trend, restart=False)
        fresh = [a for a in found if self._is_new(a, now)]
        held = {(a.kind, a.figures["scope"]) for a in found}
        for key in list(self._active):
            if key not in held:
                del self._active[key]  # condition cleared: the next occurrence is news again
        return fresh

    def _is_new(self, alert: Alert, now: float) -> bool:
        key = (alert.kind, alert.figures["scope"])
        last = self._active.get(key)
        if last is not None and now - last < self.config.window_s:
            return False
        self._active[key] = now
        return True

    def _limit_alert(self, scope: str, used: Optional[float], limit: Optional[float], source: str,
                     restart: bool) -> List[Alert]:
        if used is None or limit is None or used <= limit:
            self._over[scope] = 0
            return []
        self._over[scope] += 1
        if self._over[scope] < SOFT_LIMIT_CONSECUTIVE:
            return []
        what = "RSS" if scope == "rss" else "NPU memory"
        message = "%s %.0f MiB above soft limit %.0f MiB (%s) for %d samples" % (
            what, used, limit, source, self._over[scope])
        figures = {"scope": scope, "used_mb": round(used, 1), "limit_mb": round(limit, 1),
                   "limit_source": source, "samples_over": self._over[scope]}
        return [Alert("soft_limit", message, figures, restart=restart)]

    @staticmethod
    def _leak_alert(scope: str, trend: LeakDetector, restart: bool) -> List[Alert]:
        if trend.verdict() != "leak":
            return []
        figures = trend.figures()
        figures["scope"] = scope
        what = "RSS" if scope == "rss" else "NPU memory"
        message = "%s growing %.0f MiB/h for %.0f s (threshold %.0f MiB/h): %.0f -> %.0f MiB" % (
            what, figures["slope_mb_per_hour"], figures["span_s"], trend.leak_mb_per_hour,
            figures["first_mb"], figures["last_mb"])
        return [Alert("leak", message, figures, restart=restart)]


# ---------------------------------------------------------------------------------------------- progress


class ProgressMonitor:
    """Liveness from progress, shared by the pipeline thread (marks) and the watchdog thread (checks).

    The pipeline calls :meth:`begin_inference` / :meth:`end_inference` around each backend call,
    :meth:`frame_done` once results are handed over (publisher or outbox), and :meth:`idle_tick` each time
    its input wait times out with nothing to do. A *miss* is each ``deadline_s`` an inference call overruns;
    misses add up across consecutive slow calls and reset when a call finishes in time;
    :attr:`should_restart` after the second. ``end_inference`` must run in a ``finally``.
    """

    def __init__(self, deadline_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if deadline_s <= 0:
            raise ValueError("deadline_s must be > 0 (got %s)" % deadline_s)
        self.deadline_s = float(deadline_s)
        self.clock = clock
        self.frames_total = 0
        self._lock = threading.Lock()
        self._call = 0
        self._started: Optional[float] = None
        self._periods_counted = 0  # deadline periods of the current call already counted as misses
        self._reported = False
        self._pending_report: Optional[str] = None
        self._misses = 0
        self._frames_since_ping = 0
        self._idle_since_ping = 0

    def begin_inference(self) -> None:
        with self._lock:
            self._call += 1
            self._started = self.clock()
            self._periods_counted = 0
            self._reported = False

    def end_inference(self) -> None:
        with self._lock:
            if self._started is None:
                return
            elapsed = self.clock() - self._started
            self._started = None
            if elapsed <= self.deadline_s:
                self._misses = 0
                return
            # Overran but finished between two checks: count what check() did not see, report it once.
            periods = int(elapsed // self.deadline_s)
            self._misses += max(0, periods - self._periods_counted)
            if not self._reported:
                self._pending_report = self._overrun_text(self._call, elapsed, finished=True)

    def frame_done(self, count: int = 1) -> None:
        with self._lock:
            self.frames_total += count
            self._frames_since_ping += count

    def idle_tick(self) -> None:
        """The pipeline loop turned with no input: it is responsive, just idle."""
        with self._lock:
            self._idle_since_ping += 1

    def _overrun_text(self, call: int, elapsed: float, finished: bool) -> str:
        state = "took" if finished else "running for"
        return "inference call #%d %s %.1f s (deadline %.1f s, %d consecutive miss%s)" % (
            call, state, elapsed, self.deadline_s, self._misses, "" if self._misses == 1 else "es")

    def check(self, now: Optional[float] = None) -> Optional[str]:
        """A report of an overrunning inference call, once per call; counts misses as deadlines pass."""
        now = self.clock() if now is None else now
        with self._lock:
            if self._pending_report is not None:
                report, self._pending_report = self._pending_report, None
                return report
            if self._started is None:
                return None
            elapsed = now - self._started
            periods = int(elapsed // self.deadline_s)
            if periods > self._periods_counted:
                self._misses += periods - self._periods_counted
                self._periods_counted = periods
            if periods >= 1 and not self._reported:
                self._reported = True
                return self._overrun_text(self._call, elapsed, finished=False)
            return None

    @property
    def misses(self) -> int:
        with self._lock:
            return self._misses

    @property
    def should_restart(self) -> bool:
        return self.misses >= HANG_MISSES_FOR_RESTART

    def inference_elapsed_s(self, now: Optional[float] = None) -> Optional[float]:
        now = self.clock() if now is None else now
        with self._lock:
            return None if self._started is None else now - self._started

    def healthy_since_last_ping(self, now: Optional[float] = None) -> bool:
        """True when a ``WATCHDOG=1`` is deserved now: frames were completed, or the idle loop turned, since
        the last ping, and no inference call is past its deadline.

        A call merely in flight is not progress: with ``inference_deadline_s`` below half of WatchdogSec a
        healthy pipeline completes a frame within every ping interval anyway.
        """
        now = self.clock() if now is None else now
        with self._lock:
            if self._started is not None and now - self._started > self.deadline_s:
                return False
            return self._frames_since_ping > 0 or self._idle_since_ping > 0

    def mark_pinged(self) -> None:
        """A ping was sent: progress is counted afresh from here."""
        with self._lock:
            self._frames_since_ping = 0
            self._idle_since_ping = 0

    def snapshot(self, now: Optional[float] = None) -> Dict[str, Any]:
        elapsed = self.inference_elapsed_s(now)
        with self._lock:
            return {"frames_total": self.frames_total, "misses": self._misses,
                    "inference_elapsed_s": None if elapsed is None else round(elapsed, 3)}


# ---------------------------------------------------------------------------------------------- the thread


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
                 input_states: Optional[Callable[[], Dict[str, int]]] = None) -> None:
        """``input_states()`` counts the running sources by state (:meth:`SourceSet.summary`)."""
        self.memory = memory
        self.input_states = input_states
        self.no_input = False
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
                if alert.restart:
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
        if no_input == self.no_input:
            return
        self.no_input = no_input
        if no_input:
            text = "serving, no input: no source up (%s)" % ", ".join(
                "%d %s" % (n, state) for state, n in sorted(states.items()))
            log.warning("%s; alive and pinging (a restart does not fix a camera)", text)
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
