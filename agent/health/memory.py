"""Memory checks: samples RSS, the cgroup limit and NPU memory, and turns them into alerts.

All memory figures are MiB (what systemd's ``M`` suffix and npu-smi's ``MB`` mean). The camera workers
(:mod:`agent.pipeline.sources.worker`, one process per stream) are part of the box's memory: each is sampled by
its pid, counted in the total the soft limit is held against (the cgroup's ``MemoryMax`` counts them too), and
watched on its own: a worker above ``watchdog.worker_max_rss_mb``, or leaking, is recycled alone (cause
``memory``), never the daemon.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from agent._util.compat import Protocol
from agent.config.daemon_config import WatchdogConfig
from agent.health.leak import LeakDetector
from agent.health.npu_smi import chip_figures
from agent.health.readers import read_cgroup_limit_mb, read_rss_mb

log = logging.getLogger(__name__)

# Recycle gracefully at 90% of MemoryMax, before the kernel's OOM killer does it the hard way.
CGROUP_LIMIT_FRACTION = 0.9
SOFT_LIMIT_CONSECUTIVE = 2  # one sample over the limit can be a batch's transient peak; two in a row is not


@dataclass(frozen=True)
class MemorySample:
    rss_mb: Optional[float]  # the daemon process alone
    cgroup_limit_mb: Optional[float]
    npu_used_mb: Optional[float]
    npu_total_mb: Optional[float]
    workers_mb: Mapping[str, float] = field(default_factory=dict)  # each running camera worker, by source
    npu_chip: Mapping[str, Any] = field(default_factory=dict)  # npu_smi.chip_figures: id, utilization, ...

    @property
    def total_rss_mb(self) -> Optional[float]:
        """The daemon and its workers together: what the cgroup's memory limit is held against."""
        if self.rss_mb is None:
            return None
        return self.rss_mb + sum(self.workers_mb.values())

    def as_dict(self) -> Dict[str, Any]:
        figures: Dict[str, Any] = {k: _round(getattr(self, k)) for k in (
            "rss_mb", "cgroup_limit_mb", "npu_used_mb", "npu_total_mb")}
        figures.update(workers_rss_mb={name: round(mb, 1) for name, mb in sorted(self.workers_mb.items())},
                       workers_rss_total_mb=round(sum(self.workers_mb.values()), 1),
                       total_rss_mb=_round(self.total_rss_mb))
        return figures


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 1)


@dataclass(frozen=True)
class Alert:
    """One finding: ``kind`` is ``soft_limit``, ``leak`` or ``hang``; ``restart`` says a restart follows: of the
    daemon, or of one camera worker when ``source`` names it (scope ``worker``)."""

    kind: str
    message: str
    figures: Dict[str, Any] = field(default_factory=dict)
    restart: bool = False
    source: Optional[str] = None

    def as_dict(self) -> Dict[str, Any]:
        """The JSON published on ``<prefix>/<device>/telemetry/alert`` (``ts`` is wall-clock, for people)."""
        alert = {"kind": self.kind, "message": self.message, "restart": self.restart,
                 "figures": dict(self.figures), "ts": round(time.time(), 3)}
        if self.source is not None:
            alert["source"] = self.source
        return alert


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
                 read_limit: Callable[[], Optional[float]] = read_cgroup_limit_mb,
                 worker_pids: Optional[Callable[[], Mapping[str, int]]] = None,
                 read_rss_of: Callable[[int], Optional[float]] = lambda pid: read_rss_mb(pid=str(pid))) -> None:
        """``worker_pids()`` names the running camera workers (:meth:`SourceSet.worker_pids`)."""
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
        self._active: Dict[Tuple[str, str, Optional[str]], float] = {}  # alert key -> when last emitted
        self.workers = WorkerMemory(config, worker_pids, read_rss_of)

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
            workers_mb=self.workers.sample(), npu_chip=chip_figures(npu) if npu is not None else {},
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
        found += self._limit_alert("rss", s.total_rss_mb, limit, source, restart=True)
        found += self._limit_alert("npu", s.npu_used_mb, self.npu_budget_mb, "device npu_memory_budget_mb",
                                   restart=False)
        if s.rss_mb is not None:
            self.rss_trend.add(now, s.rss_mb)
        if s.npu_used_mb is not None:
            self.npu_trend.add(now, s.npu_used_mb)
        found += self._leak_alert("rss", self.rss_trend, restart=self.restart_on_leak)
        found += self._leak_alert("npu", self.npu_trend, restart=False)
        found += self.workers.check(now, s.workers_mb, self.restart_on_leak)
        fresh = [a for a in found if self._is_new(a, now)]
        held = {_key(a) for a in found}
        for key in list(self._active):
            if key not in held:
                del self._active[key]  # condition cleared: the next occurrence is news again
        return fresh

    def _is_new(self, alert: Alert, now: float) -> bool:
        key = _key(alert)
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
        what = "RSS (the daemon and its camera workers)" if scope == "rss" else "NPU memory"
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


def _key(alert: Alert) -> Tuple[str, str, Optional[str]]:
    return alert.kind, alert.figures["scope"], alert.source


class WorkerMemory:
    """Each camera worker's RSS, sampled by pid, with its own bound and its own leak trend.

    A trend belongs to one process: a worker replaced (reopened, recycled) starts a new one. A worker above
    ``worker_max_rss_mb`` for :data:`SOFT_LIMIT_CONSECUTIVE` samples, or leaking, gets an alert naming its source
    with ``restart`` set: the watchdog recycles that worker alone.
    """

    def __init__(self, config: WatchdogConfig, pids: Optional[Callable[[], Mapping[str, int]]],
                 read_rss_of: Callable[[int], Optional[float]]) -> None:
        self.config = config
        self._pids = pids
        self._read = read_rss_of
        self._trends: Dict[str, Tuple[int, LeakDetector]] = {}
        self._over: Dict[str, int] = {}
        self._sampled: Dict[str, int] = {}  # the pid behind each figure of the last sample

    def sample(self) -> Dict[str, float]:
        if self._pids is None:
            return {}
        figures, self._sampled = {}, {}
        for name, pid in dict(self._pids()).items():
            mb = self._read(pid)
            if mb is not None:  # None: the worker ended between the listing and the read
                figures[name] = mb
                self._sampled[name] = pid
        return figures

    def check(self, now: float, workers_mb: Mapping[str, float], restart_on_leak: bool) -> List[Alert]:
        found: List[Alert] = []
        for name in list(self._trends):
            if name not in workers_mb:
                del self._trends[name]
        for name, mb in sorted(workers_mb.items()):
            pid = self._sampled.get(name, 0)
            found += self._bound(name, pid, mb)
            found += self._leak(name, pid, now, mb, restart_on_leak)
        return found

    def _bound(self, name: str, pid: int, mb: float) -> List[Alert]:
        limit = self.config.worker_max_rss_mb
        if mb <= limit:
            self._over.pop(name, None)
            return []
        over = self._over[name] = self._over.get(name, 0) + 1
        if over < SOFT_LIMIT_CONSECUTIVE:
            return []
        self._over.pop(name, None)  # it is recycled now: a new process starts a new count
        message = "camera worker of source %s (pid %d): RSS %.0f MiB above watchdog.worker_max_rss_mb %.0f MiB " \
                  "for %d samples: recycling it" % (name, pid, mb, limit, over)
        figures = {"scope": "worker", "source": name, "pid": pid, "used_mb": round(mb, 1),
                   "limit_mb": round(float(limit), 1), "limit_source": "watchdog.worker_max_rss_mb",
                   "samples_over": over}
        return [Alert("soft_limit", message, figures, restart=True, source=name)]

    def _leak(self, name: str, pid: int, now: float, mb: float, restart: bool) -> List[Alert]:
        held = self._trends.get(name)
        if held is None or held[0] != pid:
            held = self._trends[name] = (pid, LeakDetector(self.config.window_s, self.config.leak_mb_per_hour,
                                                           self.config.leak_min_samples))
        trend = held[1]
        trend.add(now, mb)
        if trend.verdict() != "leak":
            return []
        figures = dict(trend.figures(), scope="worker", source=name, pid=pid)
        del self._trends[name]  # recycled (or alerted): the next process, or the next window, starts afresh
        message = "camera worker of source %s (pid %d): RSS growing %.0f MiB/h for %.0f s (threshold %.0f MiB/h)" \
                  "%s" % (name, pid, figures["slope_mb_per_hour"], figures["span_s"], trend.leak_mb_per_hour,
                          ": recycling it" if restart else "")
        return [Alert("leak", message, figures, restart=restart, source=name)]
