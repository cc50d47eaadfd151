"""Running statistics for telemetry and the console: per-stage latency percentiles, fps, counters.

Fixed-size ring buffers (no growth over a long run): the last ``window`` samples per stage. Beside them,
cumulative histograms (fixed buckets, never reset) of each stage's latency and of batch sizes: what the Prometheus
endpoint (agent/ops/metrics.py) reads at scrape time, so a scrape costs the serving loop nothing but this lock.
"""

import bisect
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, Iterable, Optional

import numpy as np

DEFAULT_WINDOW = 512  # about 20 s of a 25 fps stream: recent enough to show a regression quickly
# Upper bounds (ms) of the latency histograms: 0.5 ms (a letterbox on a small frame) to 10 s (the watchdog's hang).
LATENCY_BUCKETS_MS = (0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the config's max_batch is 1-64


class Histogram:
    """Cumulative counts per bucket (the last one is +Inf), their sum and count: Prometheus' histogram, kept by
    the writer under its owner's lock."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not yet cumulative: one increment per sample
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> Dict[str, Any]:
        """``{"buckets": [(upper bound, cumulative count), ...], "sum": s, "count": n}``, +Inf last."""
        running, buckets = 0, []
        for bound, count in zip(tuple(self.bounds) + (float("inf"),), self.counts):
            running += count
            buckets.append((bound, running))
        return {"buckets": buckets, "sum": self.total, "count": self.count}


class StageStats:
    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self._samples: Dict[str, Deque[float]] = {}
        self._frame_times: Deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._histograms: Dict[str, Histogram] = {}  # per stage, ms; cumulative over the process's life
        self._batches = Histogram(BATCH_BUCKETS)
        self.frames = 0
        self.errors = 0

    def add(self, timings_ms: Dict[str, float]) -> None:
        with self._lock:
            for stage, value in timings_ms.items():
                ring = self._samples.get(stage)
                if ring is None:
                    ring = self._samples[stage] = deque(maxlen=self.window)
                ring.append(value)
                histogram = self._histograms.get(stage)
                if histogram is None:
                    histogram = self._histograms[stage] = Histogram(LATENCY_BUCKETS_MS)
                histogram.observe(value)

    def frame_done(self, count: int = 1, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.frames += count
            self._batches.observe(count)  # the serving loop calls this once per batch, with its size
            for _ in range(count):
                self._frame_times.append(now)

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def fps(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            times = [t for t in self._frame_times if now - t <= 5.0]
        if len(times) < 2:
            return 0.0
        span = max(times[-1] - times[0], 1e-6)
        return (len(times) - 1) / span

    def percentiles(self, stages: Optional[Iterable[str]] = None, qs=(50, 90, 99)) -> Dict[str, Dict[str, float]]:
        with self._lock:
            snapshot = {k: list(v) for k, v in self._samples.items() if stages is None or k in stages}
        out = {}
        for stage, values in snapshot.items():
            if values:
                points = np.percentile(np.asarray(values), qs)
                out[stage] = {"p%d" % q: round(float(p), 3) for q, p in zip(qs, points)}
        return out

    def median(self, stage: str) -> Optional[float]:
        with self._lock:
            values = list(self._samples.get(stage, ()))
        return float(np.median(values)) if values else None

    def histograms(self) -> Dict[str, Any]:
        """Cumulative latency histograms by stage (ms) and the batch-size histogram (``"batch"``), any thread."""
        with self._lock:
            stages = {stage: h.snapshot() for stage, h in self._histograms.items()}
            return {"stages_ms": stages, "batch": self._batches.snapshot()}

    def reset(self) -> None:
        with self._lock:
            self._samples.clear()
            self._frame_times.clear()
            self.frames = 0
            self.errors = 0
