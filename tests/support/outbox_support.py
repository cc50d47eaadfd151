"""The outbox's faults and what reached the broker (a helper module, not a test module): shared by the outbox,
transport, disk-full and command tests instead of one importing another."""

import errno
import json
import sqlite3
from typing import Any, Dict, List, Tuple


class RefusingCommit:
    """Wraps an outbox's SQLite connection: every COMMIT fails as SQLite's does on a full disk (reads and BEGIN
    still work, as they do on a full disk)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.refused = 0

    def execute(self, sql: str, *args):
        if sql == "COMMIT":
            self.refused += 1
            raise sqlite3.OperationalError("database or disk is full")
        return self.conn.execute(sql, *args)

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction


def read_only_fs(src, dst):
    """In place of os.replace: what rename(2) says on a file system remounted read-only."""
    raise OSError(errno.EROFS, "Read-only file system", src)


def distinct_deliveries(probe) -> List[Tuple[str, Dict[str, Any]]]:
    """(topic, message) as the probe got them, without the broker's own DUP redeliveries to the probe.

    A broker restarted under a persistent-session subscriber resends, flagged DUP, what it had in flight to
    that subscriber: a DUP copy of a payload the probe already has is that leg repeating itself, not the
    transport; a DUP copy of something not yet seen is the only copy and is kept.
    """
    with probe._lock:
        copies = list(probe.messages)
    seen, kept = set(), []
    for topic, payload, _, dup in copies:
        if not (dup and (topic, payload) in seen):
            kept.append((topic, json.loads(payload)))
        seen.add((topic, payload))
    return kept
