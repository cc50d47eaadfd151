"""Dynamic batching: hand the backend up to ``max_batch`` frames, waiting at most ``max_wait_ms`` for them.

The wait starts when the first frame of a batch arrives, so a lone frame on a quiet stream is delayed by at
most ``max_wait_ms`` and a busy stream fills batches without waiting at all (Triton's max_queue_delay; the
seeds' server: 8 frames or 10 ms, whichever first).
"""

import queue
import threading
import time
from typing import Callable, Generic, List, Optional, TypeVar

T = TypeVar("T")


class Batcher(Generic[T]):
    def __init__(self, source: "queue.Queue", max_batch: int, max_wait_ms: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1 (got %r)" % max_batch)
        if max_wait_ms < 0:
            raise ValueError("max_wait_ms must be >= 0 (got %r)" % max_wait_ms)
        self.source = source
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.clock = clock

    def configure(self, max_batch: int, max_wait_ms: float) -> None:
        """Takes effect from the next batch (set-config applies between batches)."""
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0

    def next_batch(self, stop_event: threading.Event, idle_timeout_s: float = 0.1,
                   at_most: Optional[int] = None) -> List[T]:
        """One batch (of at most ``at_most`` items when given), or [] when nothing arrived within
        ``idle_timeout_s`` (so the caller's loop stays live)."""
        try:
            first = self.source.get(timeout=idle_timeout_s)
        except queue.Empty:
            return []
        batch = [first]
        max_batch = self.max_batch if at_most is None else min(self.max_batch, at_most)
        deadline = self.clock() + self.max_wait_s
        while len(batch) < max_batch and not stop_event.is_set():
            remaining = deadline - self.clock()
            try:
                batch.append(self.source.get_nowait() if remaining <= 0 else self.source.get(timeout=remaining))
            except queue.Empty:
                break
        return batch
