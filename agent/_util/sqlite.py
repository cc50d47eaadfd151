"""SQLite in WAL mode with explicit transactions, as the outbox and the command record use it.

``isolation_level=None`` turns off the sqlite3 module's implicit transactions so that ``transaction()`` owns
BEGIN IMMEDIATE / COMMIT / ROLLBACK: a write and its bookkeeping are one atomic step, and a failed COMMIT
(disk full) is rolled back only when a transaction is still open, so the real cause is the one raised.
"""

import contextlib
import logging
import os
import sqlite3
from typing import Iterator

logger = logging.getLogger(__name__)


def open_wal(path: str, synchronous: str = "NORMAL", timeout: float = 10.0) -> sqlite3.Connection:
    """Open (creating its directory) a connection in WAL mode; raises sqlite3.Error / OSError as they come."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            logger.warning("%s: journal mode is %s, not WAL (file system without shared memory?)", path, mode)
        conn.execute("PRAGMA synchronous=%s" % synchronous)
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any error; the original error is the one that propagates."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # a failed COMMIT may already have ended it; ROLLBACK would hide the cause
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error as exc:
                logger.debug("rollback after a failed transaction: %s", exc)
        raise
