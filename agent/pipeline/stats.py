"""Running statistics for telemetry and the console: per-stage latency percentiles, fps, counters.

Fixed-size ring buffers (no growth over a long run): the last ``window`` samples per stage.
"""

import threading
import time
from collections import deque
from typing import Deque, Dict, Iterable, Optional

import numpy as np

DEFAULT_WINDOW = 512  # about 20 s of a 25 fps stream: recent enough to show a regression quickly


class StageStats:
    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self._samples: Dict[str, Deque[float]] = {}
        self._frame_times: Deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.frames = 0
        self.errors = 0

    def add(self, timings_ms: Dict[str, float]) -> None:
        with self._lock:
            for stage, value in timings_ms.items():
                ring = self._samples.get(stage)
                if ring is None:
                    ring = self._samples[stage] = deque(maxlen=self.window)
                ring.append(value)

    def frame_done(self, count: int = 1, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.frames += count
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

    def reset(self) -> None:
        with self._lock:
            self._samples.clear()
            self._frame_times.clear()
            self.frames = 0
            self.errors = 0
