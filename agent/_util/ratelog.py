"""Logging a repeating condition without flooding: the first few occurrences, then one line per N with a count.

A fault that repeats at frame rate (a full disk, a hostile command stream) must stay visible without
becoming thousands of lines a minute that push everything else out of the journal.
"""

import logging
import threading
import time
from typing import Any, Callable, Dict, Optional


class LogLimiter:
    """Per-key counts; :meth:`log` emits the first ``first`` lines of a key, then every ``every``-th.

    Each emitted line after the first ones says how many occurrences it stands for, so the total is never lost.
    With ``window_s``, a key's count starts again once its first counted occurrence is that old: a condition
    that comes and goes (disk pressure at the edge of a full disk) is logged ``first`` times per window, not
    once per turn, and a new episode hours later is logged in full again.
    """

    def __init__(self, logger: logging.Logger, first: int = 5, every: int = 1000, window_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if first < 0 or every < 1 or (window_s is not None and window_s <= 0):
            raise ValueError("first must be >= 0, every >= 1 and window_s > 0 (got %r, %r, %r)"
                             % (first, every, window_s))
        self.logger = logger
        self.first = first
        self.every = every
        self.window_s = window_s
        self.clock = clock
        self._counts: Dict[str, int] = {}
        self._opened: Dict[str, float] = {}  # key -> when its window began
        self._lock = threading.Lock()

    def log(self, level: int, key: str, message: str, *args: Any) -> bool:
        """Count one occurrence of ``key``; returns True when a line was written."""
        with self._lock:
            if self.window_s is not None:
                now = self.clock()
                if now - self._opened.setdefault(key, now) >= self.window_s:
                    self._opened[key] = now
                    self._counts.pop(key, None)
            count = self._counts[key] = self._counts.get(key, 0) + 1
        if count <= self.first:
            self.logger.log(level, message, *args)
            return True
        if (count - self.first) % self.every == 0:
            self.logger.log(level, message + " (%d times so far; logged once per %d)", *(args + (count, self.every)))
            return True
        return False

    def count(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def reset(self, key: str) -> None:
        """The condition ended: the next occurrence is logged in full again."""
        with self._lock:
            self._counts.pop(key, None)
            self._opened.pop(key, None)
