"""How many bytes the outbox may keep, and the disk-pressure state that follows from it.

**Budget.** The stored topic + payload bytes are bounded by ``max_bytes`` and by the space the file system
actually has: (outbox files + free space - the reserve) / :data:`DISK_OVERHEAD`. The reserve (the box-wide
:data:`agent._util.disk.RESERVE_BYTES` by default) keeps room for the WAL and for the deletes and commits that
drain the queue, so a full disk never stops the outbox from draining.
When a new message does not fit, the oldest messages are dropped to make room, counted by reason:
``dropped_oldest`` (the configured budget) or ``disk_full`` (the disk); a message larger than the whole budget
is refused (``rejected_too_large``). The counters are lifetime totals kept in the same file.

**Disk pressure is a state.** The first ``disk_full`` drop starts it (one alert, one WARNING); further drops are
logged rate-limited with the real cause; it ends (one alert) once the disk no longer limits the budget, or the
stored bytes are back under half a disk budget of at least :data:`PRESSURE_EXIT_MIN_BYTES` (a budget of nothing,
with nothing stored, is a full disk, not the end of one: it used to end and start again every second). The
start and end lines go through a rate limiter of their own (:data:`PRESSURE_LINES_FIRST` per
:data:`PRESSURE_LINES_WINDOW_S`), so a disk at the edge cannot flood the log even if it does turn often.

This is apart from :mod:`agent.ops.outbox` because it is arithmetic about the file system and a small state
machine, not the queue: it reads no row and writes none. The outbox calls it under its own lock and hands it the
figures it needs (the configured budget, the bytes stored), so it keeps no copy of the queue's state.
"""

import logging
import os
import time
from typing import Callable, Dict, Optional, Tuple

from agent._util.disk import free_bytes
from agent._util.ratelog import LogLimiter

logger = logging.getLogger(__name__)

# The WAL is checkpointed every 128 pages (512 KiB at 4 KiB pages) and truncated back to this size afterwards,
# so the WAL's share of the disk is bounded and known (SQLite's defaults let it grow to 4 MiB and stay there).
WAL_AUTOCHECKPOINT_PAGES = 128
WAL_LIMIT_BYTES = 512 * 1024
# The least free space that still lets the outbox drain: room for its WAL to reach the limit once more plus a
# drain's deletes and commit. The daemon keeps the box-wide reserve (agent._util.disk.RESERVE_BYTES), which is
# far larger; tests on a 3 MB file system use this one.
MIN_RESERVE_BYTES = 2 * WAL_LIMIT_BYTES
# Disk bytes per stored topic + payload byte: B-tree pages are not full and rows carry headers. Measured
# about 1.15 for 300-byte results; 1.5 keeps the estimate on the safe side for small messages.
DISK_OVERHEAD = 1.5
# Disk pressure ends when the stored bytes are down to this share of the disk budget (hysteresis: a box at
# the edge of its disk raises one alert pair, not one per message).
PRESSURE_EXIT_SHARE = 0.5
# ... and the disk budget must be at least this (room for a few hundred results) for pressure to end at all.
PRESSURE_EXIT_MIN_BYTES = 64 * 1024
# Start and end lines: this many per window (two episodes an hour), then one line per PRESSURE_LINES_EVERY with
# the count; the alerts still mark every start and end.
PRESSURE_LINES_FIRST = 4
PRESSURE_LINES_EVERY = 100
PRESSURE_LINES_WINDOW_S = 3600.0
PRESSURE = "disk_pressure"
# After SQLite itself reported a full disk, the budget is cut to this share of what was stored then.
FULL_SHRINK = 0.9
DISK_FULL = "disk_full"


def message_size(topic: str, payload: bytes) -> int:
    """Bytes a message counts against the budget: its topic (UTF-8) and payload."""
    return len(topic.encode("utf-8")) + len(payload)


class DiskPressure:
    """The outbox's disk budget and its pressure state (started by a ``disk_full`` drop, ended by hysteresis).

    Not locked: the outbox calls every method under its own lock. ``alert(kind, message, **figures)`` queues an
    alert on the outbox; ``log`` is the outbox's rate limiter, shared so that one ``disk_full`` count covers
    every line about the disk.
    """

    def __init__(self, path: str, reserve_bytes: int, log: LogLimiter, alert: Callable[..., None]) -> None:
        self.path = path
        self.reserve_bytes = reserve_bytes
        self._log = log
        self._alert = alert
        self.cap: Optional[int] = None  # learned from SQLITE_FULL; cleared when pressure ends
        self.since: Optional[float] = None  # monotonic
        self.drops = 0
        self.cause = ""
        self._turns = LogLimiter(logger, PRESSURE_LINES_FIRST, PRESSURE_LINES_EVERY, PRESSURE_LINES_WINDOW_S)

    @property
    def active(self) -> bool:
        return self.since is not None

    def budget(self, max_bytes: int, in_memory: bool) -> Tuple[int, str]:
        """(bytes the stored messages may take, the drop reason when that is what limits them)."""
        if in_memory:
            return max_bytes, "dropped_oldest"
        disk = self.disk_budget(max_bytes)
        if disk < max_bytes:
            return disk, DISK_FULL
        return max_bytes, "dropped_oldest"

    def disk_budget(self, max_bytes: int) -> int:
        directory = os.path.dirname(os.path.abspath(self.path))
        files = 0
        for name in (self.path, self.path + "-wal"):
            try:
                files += os.path.getsize(name)
            except OSError:
                pass
        try:
            free = free_bytes(directory)
        except OSError:
            return max_bytes  # cannot tell: the configured budget and SQLITE_FULL handling remain
        budget = max(0, int((files + free - self.reserve_bytes) / DISK_OVERHEAD))
        if self.cap is not None:
            budget = min(budget, self.cap)
        return budget

    def enter(self, cause: str, budget: int) -> None:
        if self.since is not None:
            return
        self.since = time.monotonic()
        self.drops = 0
        self.cause = cause
        self._turns.log(logging.WARNING, PRESSURE, "outbox %s: disk pressure (%s): keeping at most %d bytes of "
                        "messages, dropping the oldest (counted as disk_full)", self.path, cause, budget)
        self._alert(DISK_FULL, "outbox %s: the disk is nearly full (%s); the oldest unsent messages are "
                    "dropped to keep %d bytes" % (self.path, cause, budget), state="started", file=self.path,
                    budget_bytes=budget, reserve_bytes=self.reserve_bytes, cause=cause)

    def refused(self, cause: str, stored_bytes: int) -> None:
        """SQLite reported a full disk: cap the budget below what is stored now, and say so once."""
        self.cap = int(stored_bytes * FULL_SHRINK)
        self.enter(cause, self.cap)

    def maybe_end(self, max_bytes: int, stored_bytes: int) -> None:
        if self.since is None:
            return
        disk = self._disk_budget_uncapped(max_bytes)
        if disk < max_bytes and (disk < PRESSURE_EXIT_MIN_BYTES or stored_bytes > disk * PRESSURE_EXIT_SHARE):
            return
        duration = time.monotonic() - self.since
        self._turns.log(logging.WARNING, PRESSURE, "outbox %s: disk pressure ended after %.1f s; %d message(s) "
                        "were dropped as disk_full (%d log line(s) stood for them)", self.path, duration,
                        self.drops, self._log.count(DISK_FULL))
        self._alert(DISK_FULL, "outbox %s: disk pressure ended after %.0f s; %d message(s) were dropped"
                    % (self.path, duration, self.drops), state="ended", file=self.path,
                    dropped=self.drops, duration_s=round(duration, 3), cause=self.cause)
        self.since = None
        self.cap = None
        self._log.reset(DISK_FULL)

    def _disk_budget_uncapped(self, max_bytes: int) -> int:
        cap, self.cap = self.cap, None
        try:
            return self.disk_budget(max_bytes)
        finally:
            self.cap = cap

    def report_drops(self, counts: Dict[str, int], reason: str, budget: int, max_bytes: int,
                     stored_bytes: int) -> None:
        """Log the drops one insert made (rate-limited): a ``disk_full`` drop starts pressure, an insert that
        dropped nothing may end it."""
        drops = counts[reason] if reason != "rejected_too_large" else 0
        if reason == DISK_FULL and drops:
            self.enter("free space below the %d-byte reserve" % self.reserve_bytes, budget)
            self.drops += drops
            self._log.log(logging.WARNING, DISK_FULL, "outbox %s: disk budget %d bytes reached, dropped the %d "
                          "oldest message(s) (disk_full)", self.path, budget, drops)
        elif drops:
            self._log.log(logging.WARNING, "dropped_oldest", "outbox %s: byte budget %d reached, dropped the %d "
                          "oldest message(s)", self.path, budget, drops)
        if not drops:
            self.maybe_end(max_bytes, stored_bytes)
