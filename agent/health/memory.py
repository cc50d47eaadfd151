"""Memory checks: samples RSS, the cgroup limit and NPU memory, and turns them into alerts.

All memory figures are MiB (what systemd's ``M`` suffix and npu-smi's ``MB`` mean).
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from agent._util.compat import Protocol
from agent.config.daemon_config import WatchdogConfig
from agent.health.leak import LeakDetector
from agent.health.readers import read_cgroup_limit_mb, read_rss_mb

log = logging.getLogger(__name__)

# Recycle gracefully at 90% of MemoryMax, before the kernel's OOM killer does it the hard way.
CGROUP_LIMIT_FRACTION = 0.9
SOFT_LIMIT_CONSECUTIVE = 2  # one sample over the limit can be a batch's transient peak; two in a row is not


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
