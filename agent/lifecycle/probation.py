"""The probation window: what a newly deployed model has shown since it started serving, and the verdict.

Pure bookkeeping, no threads and no clock of its own: the caller passes ``now`` from a monotonic clock (the
model manager's injectable ``clock``), so a wall-clock step (NTP, a box without a battery-backed clock) can
neither end a window early nor keep it open forever.
"""

import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Deque, Dict, List, Optional, Tuple

BASELINE_BATCHES = 200  # latency samples of the confirmed model kept for its baseline
MIN_BASELINE_BATCHES = 5  # fewer samples than this are not a baseline: the latency rule is skipped
MIN_JUDGE_BATCHES = 10  # one slow batch is noise; judge a pending model's latency on at least this many
MIN_JUDGE_FRAMES = 10  # likewise its error rate, before the window ends
MIN_CONFIRM_FRAMES = 1  # a model that served nothing has shown nothing: it stays pending

# Rollback triggers, as reported in events and acks (the text before the first ':' of a reason).
TRIGGER_LATENCY = "latency"
TRIGGER_ERRORS = "errors"


class Verdict(Enum):
    """How a window ends; the events that follow name it in the protocol's words (agent.protocol.events)."""

    ROLLBACK = "roll back"
    CONFIRM = "confirm"

    def __str__(self) -> str:
        return str(self.value)


ROLLBACK, CONFIRM = Verdict.ROLLBACK, Verdict.CONFIRM


@dataclass
class Window:
    """What a pending model has shown since it started serving (``started`` on the monotonic clock)."""

    slot: str
    started: float
    baseline_ms: Optional[float]
    baseline_samples: List[float]
    latencies: Deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_BATCHES))
    batches: int = 0
    frames: int = 0
    failed_frames: int = 0

    def add(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None:
        self.batches += 1
        self.frames += frames
        if failed:
            self.failed_frames += frames
        else:
            self.latencies.append(infer_ms_per_frame)

    def p50(self) -> Optional[float]:
        return statistics.median(self.latencies) if self.latencies else None

    def verdict(self, now: float, observation_s: float, latency_factor: float, max_error_rate: float
                ) -> Tuple[Optional[Verdict], str, Dict[str, Any]]:
        """(None | ROLLBACK | CONFIRM, reason, figures). Failures are judged before the window ends."""
        elapsed = now - self.started
        ended = elapsed >= observation_s
        figures = self.figures(now)
        if self.frames and (self.frames >= MIN_JUDGE_FRAMES or ended):
            rate = self.failed_frames / self.frames
            if rate > max_error_rate:
                return ROLLBACK, "%s: error rate %.3f (%d of %d frames) above max_error_rate %.3f" % (
                    TRIGGER_ERRORS, rate, self.failed_frames, self.frames, max_error_rate), figures
        p50 = self.p50()
        # Latency is judged on enough batches even when the window is short: the first batch after a switch
        # can be slow for reasons that are not the model's (a busy core, a cold cache), and one sample would
        # roll back a good model. Until then the model stays pending.
        latency_judged = self.baseline_ms is None or len(self.latencies) >= MIN_JUDGE_BATCHES
        if self.baseline_ms is not None and p50 is not None and latency_judged:
            limit = latency_factor * self.baseline_ms
            if p50 > limit:
                return ROLLBACK, "%s: median inference %.2f ms/frame exceeds %.1f x baseline %.2f ms" % (
                    TRIGGER_LATENCY, p50, latency_factor, self.baseline_ms), figures
        if ended and self.frames >= MIN_CONFIRM_FRAMES and latency_judged:
            return CONFIRM, "healthy for %.1f s" % elapsed, figures
        return None, "", figures

    def figures(self, now: float) -> Dict[str, Any]:
        p50 = self.p50()
        return {"observed_s": round(now - self.started, 3), "frames": self.frames,
                "failed_frames": self.failed_frames, "batches": self.batches,
                "p50_ms": None if p50 is None else round(p50, 3),
                "baseline_ms": None if self.baseline_ms is None else round(self.baseline_ms, 3)}


class Probation:
    """The confirmed model's latency baseline and, while a model is pending, its window.

    Not thread-safe on its own: the model manager calls it under its lock.
    """

    def __init__(self) -> None:
        self.baseline: Deque[float] = deque(maxlen=BASELINE_BATCHES)
        self.window: Optional[Window] = None

    def record(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None:
        """One batch of the serving model: into the window while one is open, else into the baseline."""
        if self.window is not None:
            self.window.add(frames, infer_ms_per_frame, failed)
        elif not failed:
            self.baseline.append(infer_ms_per_frame)

    def open(self, slot: str, now: float) -> Window:
        """A pending model starts serving: judge it against the baseline of the model it replaced."""
        samples = list(self.baseline)
        enough = len(samples) >= MIN_BASELINE_BATCHES
        self.window = Window(slot=slot, started=now, baseline_samples=samples,
                             baseline_ms=statistics.median(samples) if enough else None)
        self.baseline.clear()  # samples belong to the model that produced them
        return self.window

    def reset(self) -> None:
        """A confirmed model replaced another without a window: start its baseline afresh."""
        self.window = None
        self.baseline.clear()

    def close(self, decision: Verdict) -> Window:
        """End the window: the baseline continues with the samples of the model that stays."""
        window = self.window
        assert window is not None
        self.baseline.extend(window.latencies if decision == CONFIRM else window.baseline_samples)
        self.window = None
        return window
