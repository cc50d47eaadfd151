"""The one way to hand work to the serving loop: a queue of callables it runs between batches.

A config change, a model swap and a rollback all change what the next batch sees, so they must not happen
while a batch is in flight. Any thread may :meth:`BetweenBatches.submit` a callable and wait for it; the
serving thread calls :meth:`BetweenBatches.run_pending` between batches and runs everything queued, in the
order it was submitted. The timeout belongs to the caller: when it passes before the serving loop took the
item, the item is withdrawn (it never runs) and :class:`HandoverTimeout` is raised; once taken, an item runs
to completion and the caller gets its result, since a half-applied change is worse than a late answer.
"""

import logging
import queue
import threading
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


class HandoverTimeout(TimeoutError):
    """The serving loop did not take the item within the caller's timeout; the item was withdrawn."""


class _Item:
    __slots__ = ("fn", "what", "waited", "taken", "withdrawn", "done", "result", "error", "lock")

    def __init__(self, fn: Callable[[], Any], what: str, waited: bool = True) -> None:
        self.fn = fn
        self.what = what
        self.waited = waited  # a caller waits for the outcome (submit), or nobody does (post)
        self.lock = threading.Lock()
        self.taken = False
        self.withdrawn = False
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None


class BetweenBatches:
    """Work queued for the serving thread; see the module docstring for the ordering and timeout rules."""

    def __init__(self) -> None:
        self._items: "queue.SimpleQueue[_Item]" = queue.SimpleQueue()

    def submit(self, fn: Callable[[], Any], timeout: float, what: str = "change") -> Any:
        """Queue ``fn``, wait until the serving loop ran it, return its result or raise its exception.

        Raises :class:`HandoverTimeout` (and ``fn`` never runs) when the loop did not take it within ``timeout``.
        """
        item = _Item(fn, what)
        self._items.put(item)
        if item.done.wait(timeout):
            return self._outcome(item)
        with item.lock:
            if not item.taken:
                item.withdrawn = True
        if item.withdrawn:
            raise HandoverTimeout("the serving loop did not apply the %s within %.1f s; withdrawn" % (what, timeout))
        item.done.wait()  # taken in the same instant: it is running now and will finish
        return self._outcome(item)

    def post(self, fn: Callable[[], Any], what: str = "change") -> None:
        """Queue ``fn`` without waiting (for callers that must not block, such as the SIGHUP reload)."""
        self._items.put(_Item(fn, what, waited=False))

    def run_pending(self) -> int:
        """Run every queued item in submission order (serving thread only); returns how many ran."""
        ran = 0
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return ran
            with item.lock:
                if item.withdrawn:
                    continue
                item.taken = True
            try:
                item.result = item.fn()
            except BaseException as exc:  # handed back to a waiting caller too; a posted item has no other report
                item.error = exc
                logger.warning("between batches: the %s failed: %s: %s", item.what, type(exc).__name__, exc,
                               exc_info=not item.waited)
            finally:
                item.done.set()
            ran += 1

    def pending(self) -> int:
        """How many items wait (withdrawn ones included until the loop passes them)."""
        return self._items.qsize()

    @staticmethod
    def _outcome(item: _Item) -> Any:
        if item.error is not None:
            raise item.error
        return item.result
