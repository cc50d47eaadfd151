"""Durable on-disk queue of MQTT messages that could not be handed to the broker.

Results wait here while the broker is away and are replayed in order once it is back (see
:mod:`agent.ops.transport`). The queue is one SQLite file in WAL mode: a committed ``put`` survives the process
being killed (``kill -9``, OOM killer, watchdog restart). Ids come from ``AUTOINCREMENT`` so they are never
reused and id order is insertion order, even after the queue has been emptied.

The queue has a byte budget (topic + payload bytes of the stored messages). When a new message does not
fit, the oldest messages are dropped to make room, and every drop is counted in ``dropped_oldest``; a message
larger than the whole budget is refused and counted in ``rejected_too_large``. The counters are lifetime
totals kept in the same file, so a drop is still visible after a restart.

Only the standard library is used (``sqlite3``), so the box needs nothing extra and it runs on Python 3.8.
"""

import logging
import sqlite3
import threading
import time
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from agent._util.sqlite import open_wal, transaction

logger = logging.getLogger(__name__)

# NORMAL in WAL mode: a commit survives a process kill; only a power cut may lose the last few commits (the
# file stays consistent). FULL would fsync every put, which costs milliseconds per frame on SD cards.
DEFAULT_SYNCHRONOUS = "NORMAL"
SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")
# Counters kept in the file; see the module docstring.
COUNTER_NAMES = ("stored", "replayed", "dropped_oldest", "rejected_too_large")
# SQLite's limit on bound parameters is 999 on older builds (the box's Python may link an old SQLite).
_SQL_CHUNK = 500

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS messages ("
    " id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, payload BLOB NOT NULL,"
    " qos INTEGER NOT NULL, retain INTEGER NOT NULL, size INTEGER NOT NULL, created REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)


class OutboxError(RuntimeError):
    """The outbox file cannot be opened or used; the message names the file."""


class OutboxMessage(NamedTuple):
    id: int
    topic: str
    payload: bytes
    qos: int
    retain: bool


def message_size(topic: str, payload: bytes) -> int:
    """Bytes a message counts against the budget: its topic (UTF-8) and payload."""
    return len(topic.encode("utf-8")) + len(payload)


class Outbox:
    """FIFO of unsent messages in one SQLite file, bounded by ``max_bytes`` with a counted drop-oldest policy.

    Thread-safe: one connection guarded by a lock. It sits on the slow path only (broker away, replay), so
    the lock is not contended by the connected fast path.
    """

    def __init__(self, path: str, max_bytes: int, synchronous: str = DEFAULT_SYNCHRONOUS) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError("outbox max_bytes must be a positive integer (got %r)" % (max_bytes,))
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError("outbox synchronous must be one of %s (got %r)"
                             % (SYNCHRONOUS_MODES, synchronous))
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._conn = self._open(path, synchronous)
        try:
            row = self._conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM messages").fetchone()
            self._count, self._bytes = int(row[0]), int(row[1])
            self._counters = dict.fromkeys(COUNTER_NAMES, 0)
            for name, value in self._conn.execute("SELECT name, value FROM counters"):
                if name in self._counters:
                    self._counters[name] = int(value)
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise OutboxError("outbox %s: unreadable (%s); move the file away to start empty"
                              % (path, exc)) from exc
        if self._count:
            logger.info("outbox %s: %d message(s), %d bytes waiting from an earlier run", path, self._count,
                        self._bytes)

    @staticmethod
    def _open(path: str, synchronous: str) -> sqlite3.Connection:
        try:
            conn = open_wal(path, synchronous)
        except (OSError, sqlite3.Error) as exc:
            raise OutboxError("outbox %s: cannot open (%s)" % (path, exc)) from exc
        try:
            for statement in _SCHEMA:
                conn.execute(statement)
            # Rows made up front so updates need no UPSERT (SQLite < 3.24 on Ubuntu 18.04 based boxes).
            conn.executemany("INSERT OR IGNORE INTO counters (name, value) VALUES (?, 0)",
                             [(name,) for name in COUNTER_NAMES])
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise OutboxError("outbox %s: not a usable SQLite file (%s); move it away to start empty"
                              % (path, exc)) from exc
        return conn

    # -- writing ------------------------------------------------------------------------------------------

    def put(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> Optional[int]:
        """Append one message; returns its id, or None when it is larger than the whole budget (counted)."""
        stored = self.put_many([(topic, payload, qos, retain)])
        return stored[0] if stored else None

    def put_many(self, messages: Iterable[Tuple[str, bytes, int, bool]]) -> List[int]:
        """Append messages in order in one transaction; returns the ids of those stored.

        Dropping the oldest to make room happens in the same transaction, so a crash never leaves the budget
        exceeded or a drop uncounted.
        """
        batch = [(topic, bytes(payload), int(qos), bool(retain)) for topic, payload, qos, retain in messages]
        if not batch:
            return []
        ids: List[int] = []
        with self._lock:
            counts = dict.fromkeys(COUNTER_NAMES, 0)
            count, total = self._count, self._bytes
            conn = self._conn
            with transaction(conn):
                now = time.time()
                for topic, payload, qos, retain in batch:
                    size = message_size(topic, payload)
                    if size > self.max_bytes:
                        counts["rejected_too_large"] += 1
                        logger.warning("outbox: refused a %d-byte message on %s (budget %d bytes)", size,
                                       topic, self.max_bytes)
                        continue
                    if total + size > self.max_bytes:
                        freed, dropped = self._drop_oldest(total + size - self.max_bytes)
                        total -= freed
                        count -= dropped
                        counts["dropped_oldest"] += dropped
                    cursor = conn.execute(
                        "INSERT INTO messages (topic, payload, qos, retain, size, created)"
                        " VALUES (?,?,?,?,?,?)",
                        (topic, payload, qos, int(retain), size, now))
                    ids.append(int(cursor.lastrowid))
                    total += size
                    count += 1
                    counts["stored"] += 1
                self._bump(counts)
            self._count, self._bytes = count, total
            self._add_counts(counts)
        if counts["dropped_oldest"]:
            logger.warning("outbox: byte budget %d reached, dropped the %d oldest message(s)", self.max_bytes,
                           counts["dropped_oldest"])
        return ids

    def _drop_oldest(self, need: int) -> Tuple[int, int]:
        """Delete the oldest messages until at least ``need`` bytes are freed; returns (bytes, count)."""
        freed = dropped = 0
        last_id = None
        for row_id, size in self._conn.execute("SELECT id, size FROM messages ORDER BY id"):
            freed += int(size)
            dropped += 1
            last_id = row_id
            if freed >= need:
                break
        if last_id is not None:
            self._conn.execute("DELETE FROM messages WHERE id <= ?", (last_id,))
        return freed, dropped

    def remove(self, ids: Sequence[int]) -> int:
        """Delete delivered messages; ids already gone (dropped meanwhile) are ignored. Returns the count."""
        unique = sorted({int(i) for i in ids})
        if not unique:
            return 0
        with self._lock:
            conn = self._conn
            with transaction(conn):
                removed = freed = 0
                for start in range(0, len(unique), _SQL_CHUNK):
                    chunk = unique[start:start + _SQL_CHUNK]
                    marks = ",".join("?" * len(chunk))
                    row = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM messages"
                                       " WHERE id IN (%s)" % marks, chunk).fetchone()
                    removed += int(row[0])
                    freed += int(row[1])
                    conn.execute("DELETE FROM messages WHERE id IN (%s)" % marks, chunk)
                self._bump({"replayed": removed})
            self._count -= removed
            self._bytes -= freed
            self._add_counts({"replayed": removed})
        return removed

    def _bump(self, counts: Dict[str, int]) -> None:
        for name, value in counts.items():
            if value:
                self._conn.execute("UPDATE counters SET value = value + ? WHERE name = ?", (value, name))

    def _add_counts(self, counts: Dict[str, int]) -> None:
        for name, value in counts.items():
            self._counters[name] += value

    # -- reading ------------------------------------------------------------------------------------------

    def peek(self, n: int, after_id: int = 0) -> List[OutboxMessage]:
        """The oldest ``n`` messages with an id above ``after_id``, oldest first; nothing is removed."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, topic, payload, qos, retain FROM messages WHERE id > ? ORDER BY id LIMIT ?",
                (int(after_id), int(n))).fetchall()
        return [OutboxMessage(int(r[0]), r[1], bytes(r[2]), int(r[3]), bool(r[4])) for r in rows]

    def __len__(self) -> int:
        return self._count

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
        """Messages dropped to keep within the byte budget (lifetime)."""
        return self._counters["dropped_oldest"]

    @property
    def rejected_too_large(self) -> int:
        """Messages refused because they alone exceed the budget (lifetime)."""
        return self._counters["rejected_too_large"]

    def counters(self) -> Dict[str, int]:
        """Lifetime counters plus the current depth, for telemetry."""
        result = dict(self._counters)
        result.update(messages=self._count, bytes=self._bytes, max_bytes=self.max_bytes)
        return result

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> "Outbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
