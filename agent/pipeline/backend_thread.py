"""The backend thread: the one thread that makes every backend call, in submission order, one at a time.

An accelerator runs one model call at a time anyway; one thread keeps the calls in order and lets the serving
thread letterbox and decode around them. It is separate from the loop because it is a mechanism of its own (a
thread, a call queue, and the busy-time accounting behind ``backend_busy_fraction``) that the loop only submits
to and waits on.
"""

import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

from agent.pipeline.seams import ProgressSink

# The backend's busy fraction is reported over this trailing window (the same span as the fps figure).
BUSY_WINDOW_S = 5.0
# Backend calls remembered for the busy fraction: a 5 s window of 1 ms calls, with room to spare.
BUSY_HISTORY = 8192


class BackendCall:
    """One backend call handed to the backend thread; ``done`` is set when it returned or raised."""

    __slots__ = ("fn", "done", "outputs", "error", "started", "ended")

    def __init__(self, fn: Callable[[], List[Any]]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.outputs: List[Any] = []
        self.error: Optional[BaseException] = None
        self.started = 0.0
        self.ended = 0.0

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class BackendThread:
    """The one thread that calls the backend: calls run in submission order, one at a time.

    It marks each call on the progress sink (the watchdog's hang check) and keeps the calls' start and end
    times, from which :meth:`busy_fraction` says how much of the trailing window the backend was working.
    """

    def __init__(self, progress: ProgressSink, clock: Callable[[], float] = time.monotonic) -> None:
        self.progress = progress
        self.clock = clock
        self.busy_s = 0.0  # total seconds in backend calls (benchmarks difference it over a run)
        self._calls: "queue.Queue[Optional[BackendCall]]" = queue.Queue()
        self._history: Deque[Tuple[float, float]] = deque(maxlen=BUSY_HISTORY)
        self._running: Optional[BackendCall] = None
        self._first_start: Optional[float] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="backend", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish the calls already submitted, then end the thread."""
        if self._thread is not None:
            self._calls.put(None)
            self._thread.join()
            self._thread = None

    def submit(self, fn: Callable[[], List[Any]]) -> BackendCall:
        call = BackendCall(fn)
        self._calls.put(call)
        return call

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            self.progress.begin_inference()
            call.started = self.clock()
            with self._lock:
                self._running = call
                if self._first_start is None:
                    self._first_start = call.started
            try:
                call.outputs = call.fn()
            except Exception as exc:  # handed to the serving thread, which reports it
                call.error = exc
            finally:
                call.ended = self.clock()
                self.progress.end_inference()
                with self._lock:
                    self._running = None
                    self._history.append((call.started, call.ended))
                    self.busy_s += call.ended - call.started
                call.done.set()

    def busy_fraction(self, now: Optional[float] = None) -> Optional[float]:
        """Share of the last :data:`BUSY_WINDOW_S` seconds spent in backend calls; None before the first call."""
        now = self.clock() if now is None else now
        with self._lock:
            if self._first_start is None:
                return None
            spans = list(self._history)
            if self._running is not None:
                spans.append((self._running.started, now))
        since = max(now - BUSY_WINDOW_S, self._first_start)
        if now <= since:
            return None
        busy = sum(min(end, now) - max(start, since) for start, end in spans if end > since)
        return min(1.0, busy / (now - since))
