"""SQLite in WAL mode with explicit transactions, as the outbox and the command record use it.

``isolation_level=None`` turns off the sqlite3 module's implicit transactions so that ``transaction()`` owns
BEGIN IMMEDIATE / COMMIT / ROLLBACK: a write and its bookkeeping are one atomic step, and a failed COMMIT
(disk full) is rolled back only when a transaction is still open, so the real cause is the one raised.
"""

import contextlib
import logging
import os
import sqlite3
import urllib.parse
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple

from agent._util.quarantine import move_aside, state_alert

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


class SchemaMismatch(sqlite3.DatabaseError):
    """A readable SQLite file whose tables are not the ones its owner writes (another program's file)."""


DISK_FULL_CODE = 13  # SQLITE_FULL


def is_disk_full(exc: BaseException) -> bool:
    """SQLITE_FULL (or ENOSPC from the OS): the disk, not the data, is at fault."""
    if getattr(exc, "sqlite_errorcode", None) == DISK_FULL_CODE:  # Python >= 3.11
        return True
    if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC
        return True
    return "database or disk is full" in str(exc)


def verify_schema(conn: sqlite3.Connection, tables: Dict[str, Iterable[str]]) -> None:
    """Raise (a ``sqlite3.DatabaseError``) unless the file holds only ``tables`` with those columns and is intact.

    Run once at open: ``quick_check`` reads every page, so a truncated or overwritten file is found here and
    not in the middle of serving. Tables not yet created are fine (a new, empty file).
    """
    found = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    found.discard("sqlite_sequence")  # SQLite's own table behind AUTOINCREMENT
    foreign = sorted(found - set(tables))
    if foreign:
        raise SchemaMismatch("unexpected table(s) %s: not this program's file" % ", ".join(foreign))
    for name in sorted(found):
        columns = {row[1] for row in conn.execute("PRAGMA table_info(%s)" % name)}
        if columns != set(tables[name]):
            raise SchemaMismatch("table %s has columns %s, expected %s"
                                 % (name, sorted(columns), sorted(tables[name])))
    verdict = [row[0] for row in conn.execute("PRAGMA quick_check")]
    if verdict != ["ok"]:
        raise sqlite3.DatabaseError("integrity check failed: %s" % "; ".join(str(v) for v in verdict[:3]))


def check_read_only(path: str, tables: Dict[str, Iterable[str]]) -> None:
    """:func:`verify_schema` on an existing file opened read-only, before anything (WAL mode) changes it.

    A damaged file is then moved aside exactly as it was found. A missing or empty file passes (new store).
    """
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    conn = sqlite3.connect("file:%s?mode=ro" % urllib.parse.quote(os.path.abspath(path)), uri=True)
    try:
        verify_schema(conn, tables)
    finally:
        conn.close()


class Opened(NamedTuple):
    conn: sqlite3.Connection
    in_memory: bool
    alerts: List[Dict[str, Any]]  # what happened to a damaged file, for the owner to publish


def open_recovering(path: str, tables: Dict[str, Iterable[str]], prepare: Callable[[sqlite3.Connection], Any],
                    what: str, lost: str, memory_kind: str, synchronous: str = "NORMAL") -> Opened:
    """Open a state database the box must never crash over: check it, else move it aside, else use memory.

    ``prepare(conn)`` creates the schema and reads what the owner needs (it must close ``conn`` when it raises).
    A file that is damaged (:func:`is_damage`: fails :func:`check_read_only` or ``prepare`` for its content) is
    moved aside (evidence, unchanged) and a new one is made, with a ``state_file_damaged`` alert saying ``lost``;
    when it cannot be moved or no file can be made, or the open failed for a reason outside the file (a full
    disk, a lock), an in-memory database is used, with a ``memory_kind`` alert, and the file is left for a
    later start. Never raises for the file's state.
    """
    alerts: List[Dict[str, Any]] = []
    try:
        check_read_only(path, tables)
        conn = open_wal(path, synchronous)
        prepare(conn)
        return Opened(conn, False, alerts)
    except (OSError, sqlite3.Error) as exc:
        reason = "%s: %s" % (type(exc).__name__, exc)
        damaged = is_damage(exc)
    if not damaged:  # a full disk, a lock, an I/O error: the file may be fine, so it is kept for a later start
        return _in_memory(path, prepare, what, memory_kind, reason, alerts,
                          "it could not be opened (%s) and was left as it is" % reason)
    aside = move_aside(path, reason) if os.path.exists(path) else None
    if aside is not None:
        alerts.append(state_alert("state_file_damaged", "%s %s was unusable (%s) and was moved to %s; %s; "
                                  "starting empty" % (what, path, reason, aside, lost),
                                  file=path, moved_to=aside, reason=reason, lost=lost))
        try:
            conn = open_wal(path, synchronous)
            prepare(conn)
            return Opened(conn, False, alerts)
        except (OSError, sqlite3.Error) as exc:
            reason = "%s: %s" % (type(exc).__name__, exc)
    return _in_memory(path, prepare, what, memory_kind, reason, alerts, "it is unusable (%s)" % reason)


def is_damage(exc: BaseException) -> bool:
    """True for what the file itself is to blame for: not a database, malformed, failed integrity, wrong schema.

    ``sqlite3.OperationalError`` (full disk, locked, I/O error, cannot open) and ``OSError`` say nothing about
    the file's content; moving such a file aside would throw away unsent results that a later start can read.
    """
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)


def _in_memory(path: str, prepare: Callable[[sqlite3.Connection], Any], what: str, memory_kind: str,
               reason: str, alerts: List[Dict[str, Any]], why: str) -> Opened:
    logger.error("%s %s: %s; kept in memory until the agent restarts", what, path, why)
    alerts.append(state_alert(memory_kind, "%s %s: %s; it is kept in memory only, lost at restart" % (what, path, why),
                              file=path, reason=reason))
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    prepare(conn)
    return Opened(conn, True, alerts)
