"""The leak trend: steady memory growth over a sliding window, robust to a plateau and to a one-off step."""

import logging
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

from agent.config.daemon_config import DEFAULT_LEAK_MIN_SAMPLES, MIN_LEAK_SAMPLES

log = logging.getLogger(__name__)

WINDOW_COVERAGE = 0.9  # a trend must span 90% of window_s (sampling jitter) before it can be called a leak
MIN_FIT_R2 = 0.8  # a leak is a steady climb: the straight line must explain >= 80% of the variance

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
