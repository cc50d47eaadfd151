"""Durable on-disk queue of MQTT messages that could not be handed to the broker.

Results wait here while the broker is away and are replayed in order once it is back (see
:mod:`agent.ops.replay`). The queue is one SQLite file in WAL mode: a committed ``put`` survives the process
being killed (``kill -9``, OOM killer, watchdog restart). Ids come from ``AUTOINCREMENT`` so they are never
reused and id order is insertion order, even after the queue has been emptied.

**Budget.** The stored bytes are bounded by ``max_bytes`` and by the disk; when a new message does not fit,
the oldest are dropped, counted by reason, and a full disk is a state with alerts: :mod:`agent.ops.outbox_budget`.
Alerts are queued and taken by :meth:`Outbox.take_alerts` on a thread that holds no transport lock (a publish
from inside ``put`` could deadlock).

**Delivered is an in-memory mark first.** :meth:`Outbox.remove` marks rows delivered at once (they are never
peeked, counted or replayed again) and deletes them; a delete the disk refuses is retried later
(:meth:`Outbox.retry_deletes`), never turned into a second delivery.

**A damaged file never stops the box.** A file that is not SQLite, is truncated or holds another schema is
moved aside (``<file>.corrupt-<time>``) and the outbox starts empty; if it cannot be moved, the outbox lives in
memory (bounded by :data:`MEMORY_MAX_BYTES`). Either way an alert says what was lost.

Only the standard library is used (``sqlite3``), so the box needs nothing extra.
"""

import logging
import sqlite3
import threading
import time
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from agent._util.disk import RESERVE_BYTES
from agent._util.quarantine import state_alert
from agent._util.ratelog import LogLimiter
from agent._util.sqlite import is_disk_full, open_recovering, transaction
from agent.ops.outbox_budget import (
    DISK_FULL,
    MIN_RESERVE_BYTES,
    WAL_AUTOCHECKPOINT_PAGES,
    WAL_LIMIT_BYTES,
    DiskPressure,
    message_size,
)

logger = logging.getLogger(__name__)

# NORMAL in WAL mode: a commit survives a process kill; only a power cut may lose the last few commits (the
# file stays consistent). FULL would fsync every put, which costs milliseconds per frame on SD cards.
DEFAULT_SYNCHRONOUS = "NORMAL"
SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")
# Counters kept in the file; the drop reasons are agent.ops.outbox_budget's.
COUNTER_NAMES = ("stored", "replayed", "dropped_oldest", "disk_full", "rejected_too_large")
DROP_REASONS = ("dropped_oldest", "disk_full", "rejected_too_large")
# SQLite's limit on bound parameters is 999 on older builds (the box's Python may link an old SQLite).
_SQL_CHUNK = 500

# An outbox that fell back to memory (its file unusable) holds at most this much: RAM is scarcer than disk.
MEMORY_MAX_BYTES = 8 * 1024 * 1024

_TABLES = {
    "messages": ("id", "topic", "payload", "qos", "retain", "size", "created"),
    "counters": ("name", "value"),
}
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS messages ("
    " id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, payload BLOB NOT NULL,"
    " qos INTEGER NOT NULL, retain INTEGER NOT NULL, size INTEGER NOT NULL, created REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)


class OutboxMessage(NamedTuple):
    id: int
    topic: str
    payload: bytes
    qos: int
    retain: bool


class Outbox:
    """FIFO of unsent messages in one SQLite file, bounded by bytes and disk, with counted drop-oldest.

    Thread-safe: one connection guarded by a lock. It sits on the slow path only (broker away, replay), so
    the lock is not contended by the connected fast path (which reads :meth:`pending_for` without it).
    """

    def __init__(self, path: str, max_bytes: int, synchronous: str = DEFAULT_SYNCHRONOUS,
                 reserve_bytes: int = RESERVE_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError("outbox max_bytes must be a positive integer (got %r)" % (max_bytes,))
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError("outbox synchronous must be one of %s (got %r)"
                             % (SYNCHRONOUS_MODES, synchronous))
        if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < MIN_RESERVE_BYTES:
            raise ValueError("outbox reserve_bytes must be an integer >= %d, room for the outbox to drain (got %r)"
                             % (MIN_RESERVE_BYTES, reserve_bytes))
        self.path = path
        self.max_bytes = max_bytes
        self.reserve_bytes = reserve_bytes
        self.in_memory = False
        self._lock = threading.Lock()
        self._closed = False  # close() ran: figures read after a stop must not touch the closed file
        self._alerts: List[Dict[str, Any]] = []
        self._log = LogLimiter(logger)
        self._acked: Set[int] = set()  # delivered, delete pending (the disk refused it so far)
        self._topics: Dict[str, int] = {}  # undelivered messages per topic
        self._pressure = DiskPressure(path, reserve_bytes, self._log, self._alert)
        opened = open_recovering(path, _TABLES, self._load, "outbox", "the messages waiting in it were not sent",
                                 "outbox_in_memory", synchronous)
        self._conn = opened.conn
        self._alerts.extend(opened.alerts)
        if opened.in_memory:
            self.in_memory = True
            self.max_bytes = min(self.max_bytes, MEMORY_MAX_BYTES)  # RAM is scarcer than disk

    # -- opening (agent._util.sqlite.open_recovering: a damaged file is moved aside, else memory) ------------

    def _load(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        """Create what is missing, read the depth and counters; closes ``conn`` on error (checked read-only before)."""
        try:
            conn.execute("PRAGMA wal_autocheckpoint=%d" % WAL_AUTOCHECKPOINT_PAGES)
            conn.execute("PRAGMA journal_size_limit=%d" % WAL_LIMIT_BYTES)
            for statement in _SCHEMA:
                conn.execute(statement)
            # Rows made up front so updates need no UPSERT (SQLite < 3.24 on Ubuntu 18.04 based boxes).
            conn.executemany("INSERT OR IGNORE INTO counters (name, value) VALUES (?, 0)",
                             [(name,) for name in COUNTER_NAMES])
            row = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM messages").fetchone()
            self._count, self._bytes = int(row[0]), int(row[1])
            self._topics = {topic: int(n) for topic, n in
                            conn.execute("SELECT topic, COUNT(*) FROM messages GROUP BY topic")}
            self._counters = dict.fromkeys(COUNTER_NAMES, 0)
            for name, value in conn.execute("SELECT name, value FROM counters"):
                if name in self._counters:
                    self._counters[name] = int(value)
        except BaseException:
            conn.close()
            raise
        if self._count:
            logger.info("outbox %s: %d message(s), %d bytes waiting from an earlier run", self.path,
                        self._count, self._bytes)
        return conn

    # -- the budget and disk pressure -----------------------------------------------------------------------

    def check_space(self) -> None:
        """Re-evaluate disk pressure (the replay loop calls this; it may end with no message being put)."""
        if self.in_memory:
            return
        with self._lock:
            self._pressure.maybe_end(self.max_bytes, self._bytes)

    @property
    def disk_pressure(self) -> bool:
        return self._pressure.active

    def _alert(self, kind: str, message: str, **figures: Any) -> None:
        self._alerts.append(state_alert(kind, message, **figures))

    def take_alerts(self) -> List[Dict[str, Any]]:
        """Alerts raised since the last call (damaged file, in-memory fallback, disk pressure started/ended)."""
        with self._lock:
            alerts, self._alerts = self._alerts, []
        return alerts

    # -- writing ------------------------------------------------------------------------------------------

    def put(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> Optional[int]:
        """Append one message; returns its id, or None when it could not be kept (counted by reason)."""
        stored = self.put_many([(topic, payload, qos, retain)])
        return stored[0] if stored else None

    def put_many(self, messages: Iterable[Tuple[str, bytes, int, bool]]) -> List[int]:
        """Append messages in order in one transaction; returns the ids of those stored.

        Dropping the oldest to make room happens in the same transaction, so a crash never leaves the budget
        exceeded or a drop uncounted. Raises ``sqlite3.Error`` only for faults other than a full disk.
        """
        batch = [(topic, bytes(payload), int(qos), bool(retain)) for topic, payload, qos, retain in messages]
        if not batch:
            return []
        with self._lock:
            budget, reason = self._pressure.budget(self.max_bytes, self.in_memory)
            try:
                return self._insert(batch, budget, reason)
            except sqlite3.Error as exc:
                if not is_disk_full(exc):
                    raise
                cause = "%s: %s" % (type(exc).__name__, exc)
            # The estimate was too generous (another writer filled the disk): learn the cap and retry once.
            self._pressure.refused(cause, self._bytes)
            try:
                return self._insert(batch, self._pressure.cap, DISK_FULL)
            except sqlite3.Error as exc:
                if not is_disk_full(exc):
                    raise
                self._counters[DISK_FULL] += len(batch)  # not persisted: the disk refuses even that
                self._pressure.drops += len(batch)
                self._log.log(logging.WARNING, DISK_FULL, "outbox %s: disk full (%s): %d new message(s) "
                              "dropped", self.path, exc, len(batch))
                return []

    def _insert(self, batch: List[Tuple[str, bytes, int, bool]], budget: int, reason: str) -> List[int]:
        """Insert with drop-oldest to ``budget``; memory state changes only after the COMMIT succeeded."""
        ids: List[int] = []
        counts = dict.fromkeys(COUNTER_NAMES, 0)
        count, total = self._count, self._bytes
        dropped_rows: List[Tuple[int, str]] = []
        added: Dict[str, int] = {}
        conn = self._conn
        with transaction(conn):
            now = time.time()
            for topic, payload, qos, retain in batch:
                size = message_size(topic, payload)
                if size > self.max_bytes:
                    counts["rejected_too_large"] += 1
                    self._log.log(logging.WARNING, "too_large", "outbox: refused a %d-byte message on %s "
                                  "(budget %d bytes)", size, topic, self.max_bytes)
                    continue
                if size > budget:
                    counts[reason] += 1  # the disk budget cannot hold even this one message
                    continue
                if total + size > budget:
                    freed, rows = self._drop_oldest(total + size - budget)
                    total -= freed
                    count -= len(rows)
                    dropped_rows.extend(rows)
                    counts[reason] += sum(1 for row_id, _ in rows if row_id not in self._acked)
                cursor = conn.execute(
                    "INSERT INTO messages (topic, payload, qos, retain, size, created) VALUES (?,?,?,?,?,?)",
                    (topic, payload, qos, int(retain), size, now))
                ids.append(int(cursor.lastrowid))
                added[topic] = added.get(topic, 0) + 1
                total += size
                count += 1
                counts["stored"] += 1
            self._bump(counts)
        self._count, self._bytes = count, total
        for row_id, topic in dropped_rows:
            if row_id in self._acked:
                self._acked.discard(row_id)  # delivered already: its deletion is not a drop
            else:
                self._topic_done(topic)
        for topic, n in added.items():
            self._topics[topic] = self._topics.get(topic, 0) + n
        for name, value in counts.items():
            self._counters[name] += value
        self._pressure.report_drops(counts, reason, budget, self.max_bytes, self._bytes)
        return ids

    def _drop_oldest(self, need: int) -> Tuple[int, List[Tuple[int, str]]]:
        """Delete the oldest messages until at least ``need`` bytes are freed; returns (bytes, [(id, topic)])."""
        freed = 0
        rows: List[Tuple[int, str]] = []
        for row_id, size, topic in self._conn.execute("SELECT id, size, topic FROM messages ORDER BY id"):
            freed += int(size)
            rows.append((int(row_id), topic))
            if freed >= need:
                break
        if rows:
            self._conn.execute("DELETE FROM messages WHERE id <= ?", (rows[-1][0],))
        return freed, rows

    def _topic_done(self, topic: str) -> None:
        left = self._topics.get(topic, 0) - 1
        if left > 0:
            self._topics[topic] = left
        else:
            self._topics.pop(topic, None)

    def remove(self, ids: Sequence[int]) -> int:
        """Mark messages delivered and delete them; returns how many rows were deleted now.

        Marked rows are never peeked or counted again, even when the delete fails (a full disk): the delete
        is retried by the next :meth:`remove` or :meth:`retry_deletes`. Unknown ids (dropped meanwhile) are
        ignored.
        """
        with self._lock:
            fresh = sorted({int(i) for i in ids} - self._acked)
            for start in range(0, len(fresh), _SQL_CHUNK):
                chunk = fresh[start:start + _SQL_CHUNK]
                rows = self._conn.execute("SELECT id, topic FROM messages WHERE id IN (%s)"
                                          % ",".join("?" * len(chunk)), chunk).fetchall()
                for row_id, topic in rows:
                    self._acked.add(int(row_id))
                    self._topic_done(topic)
            return self._delete_acked()

    def retry_deletes(self) -> int:
        """Delete rows marked delivered whose delete failed before; returns how many were deleted."""
        with self._lock:
            return self._delete_acked() if self._acked else 0

    def _delete_acked(self) -> int:
        if not self._acked:
            return 0
        unique = sorted(self._acked)
        conn = self._conn
        removed = freed = 0
        try:
            with transaction(conn):
                for start in range(0, len(unique), _SQL_CHUNK):
                    chunk = unique[start:start + _SQL_CHUNK]
                    marks = ",".join("?" * len(chunk))
                    row = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM messages WHERE id IN (%s)"
                                       % marks, chunk).fetchone()
                    removed += int(row[0])
                    freed += int(row[1])
                    conn.execute("DELETE FROM messages WHERE id IN (%s)" % marks, chunk)
                self._bump({"replayed": removed})
        except sqlite3.Error as exc:
            self._log.log(logging.WARNING, "delete", "outbox %s: could not delete %d delivered message(s) "
                          "(%s: %s); retrying later, they are not sent again", self.path, len(unique),
                          type(exc).__name__, exc)
            if is_disk_full(exc):
                self._pressure.refused("%s: %s" % (type(exc).__name__, exc), self._bytes)
            return 0
        self._acked.clear()
        self._count -= removed
        self._bytes -= freed
        self._counters["replayed"] += removed
        self._pressure.maybe_end(self.max_bytes, self._bytes)
        return removed

    def _bump(self, counts: Dict[str, int]) -> None:
        for name, value in counts.items():
            if value:
                self._conn.execute("UPDATE counters SET value = value + ? WHERE name = ?", (value, name))

    # -- reading ------------------------------------------------------------------------------------------

    def peek(self, n: int, after_id: int = 0) -> List[OutboxMessage]:
        """The oldest ``n`` undelivered messages with an id above ``after_id``, oldest first; none removed."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, topic, payload, qos, retain FROM messages WHERE id > ? ORDER BY id LIMIT ?",
                (int(after_id), int(n) + len(self._acked))).fetchall()
            acked = set(self._acked)
        found = [OutboxMessage(int(r[0]), r[1], bytes(r[2]), int(r[3]), bool(r[4])) for r in rows]
        return [m for m in found if m.id not in acked][:int(n)]

    def oldest_age_s(self, now: Optional[float] = None) -> float:
        """Seconds since the oldest undelivered message was put (its ``created`` column, wall clock: kept across
        restarts); 0 when none waits, the clock went back or the outbox is closed (stats read after a stop).
        One indexed read of a few rows, under the lock."""
        if len(self) == 0:
            return 0.0
        with self._lock:
            if self._closed:
                return 0.0
            acked = set(self._acked)
            rows = self._conn.execute("SELECT id, created FROM messages ORDER BY id LIMIT ?",
                                      (len(acked) + 1,)).fetchall()
        created = next((float(c) for row_id, c in rows if int(row_id) not in acked), None)
        return 0.0 if created is None else max(0.0, (time.time() if now is None else now) - created)

    def pending_for(self, topic: str) -> int:
        """Undelivered messages on ``topic``: while any wait, newer ones on it must queue behind them.

        Read without the lock (one dict lookup) so that the connected fast path never waits for SQLite.
        """
        return self._topics.get(topic, 0)

    def __len__(self) -> int:
        """Undelivered messages (rows marked delivered but not yet deleted are not counted)."""
        return self._count - len(self._acked)

    @property
    def bytes(self) -> int:
        """Topic + payload bytes currently stored (what the budget counts)."""
        return self._bytes

    @property
    def stored(self) -> int:
        """Messages ever put (lifetime, survives restarts)."""
        return self._counters["stored"]

    @property
    def replayed(self) -> int:
        """Messages removed after delivery (lifetime)."""
        return self._counters["replayed"]

    @property
    def dropped_oldest(self) -> int:
        """Messages dropped to keep within the configured byte budget (lifetime)."""
        return self._counters["dropped_oldest"]

    @property
    def dropped_disk_full(self) -> int:
        """Messages dropped because the disk could not hold them (lifetime, oldest first)."""
        return self._counters[DISK_FULL]

    @property
    def rejected_too_large(self) -> int:
        """Messages refused because they alone exceed the budget (lifetime)."""
        return self._counters["rejected_too_large"]

    def drops(self) -> Dict[str, int]:
        """Lifetime drops by reason: ``dropped_oldest``, ``disk_full``, ``rejected_too_large``."""
        return {name: self._counters[name] for name in DROP_REASONS}

    def counters(self) -> Dict[str, Any]:
        """Lifetime counters plus the current depth and state, for telemetry and status."""
        result: Dict[str, Any] = dict(self._counters)
        result.update(messages=len(self), bytes=self._bytes, max_bytes=self.max_bytes,
                      disk_pressure=self.disk_pressure, in_memory=self.in_memory)
        return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()

    def __enter__(self) -> "Outbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
