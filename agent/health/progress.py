"""Liveness from progress: the pipeline marks each backend call and each finished frame."""

import threading
import time
from typing import Any, Callable, Dict, Optional

HANG_MISSES_FOR_RESTART = 2  # one overrun can be a slow first call after a model load; two in a row is a hang


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
