"""The request record: request_id -> latest ack, so a retry is answered and never runs twice, across restarts;
and the dated ids still within their validity, so a captured command is not replayed after a restart either."""

import json
import logging
import sqlite3
import threading
from typing import Any, Dict, List, Optional

from agent._util.quarantine import state_alert
from agent._util.sqlite import open_recovering, transaction
from agent.protocol.messages import FAILED, FINAL_STATES, ack_message, error_body

logger = logging.getLogger(__name__)

RECORD_ACK_MAX_BYTES = 16384  # a recorded outcome larger than this keeps its state and error, not its result

_RECORD_TABLES = {"requests": ("seq", "request_id", "verb", "state", "ack"), "dated": ("request_id", "expires")}
_RECORD_SCHEMA = ("CREATE TABLE IF NOT EXISTS requests (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                  " request_id TEXT UNIQUE NOT NULL, verb TEXT NOT NULL, state TEXT NOT NULL, ack TEXT NOT NULL)",
                  # expires: the forward clock's time (agent.commands.freshness) after which the id may be reused
                  "CREATE TABLE IF NOT EXISTS dated (request_id TEXT PRIMARY KEY, expires REAL NOT NULL)",
                  "CREATE INDEX IF NOT EXISTS dated_expires ON dated (expires)")


class RequestRecord:
    """request_id -> latest ack, in SQLite (WAL), bounded to the newest ``size`` entries.

    Written when a command is accepted and when it ends; an entry still open when the process stopped is
    closed as failed ``interrupted`` on the next start, so a retry is answered and never runs it again.
    With a command key, only commands whose signature checked out are written here (the dispatcher refuses the
    rest without recording them), so junk can neither pre-empt an operator's id nor push its entries out.

    Beside it, the dated ids (:meth:`claim_dated`, the :class:`agent.commands.freshness.IdStore`): kept until
    their command expires, not bounded by ``size`` (the rate limit bounds them: rate x the longest ttl).

    A damaged file (not SQLite, truncated, another schema) is moved aside and the record starts empty; if it
    cannot be moved, the record lives in memory. Either way :attr:`alerts` says what was lost, and the box
    keeps serving: forgetting past request ids only means a retry of an old command could run again.
    """

    def __init__(self, path: Optional[str], size: int) -> None:
        self.size = size
        self.path = path
        self.in_memory = not path
        self.alerts: List[Dict[str, Any]] = []
        if path:
            opened = open_recovering(path, _RECORD_TABLES, self._prepare, "command record",
                                     "the outcomes of earlier request ids are forgotten (a retry of one would run "
                                     "again)", "record_in_memory")
            self._conn, self.in_memory, self.alerts = opened.conn, opened.in_memory, opened.alerts
        else:
            self._conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            self._prepare(self._conn)
        self._lock = threading.Lock()
        self._close_interrupted()

    @staticmethod
    def _prepare(conn: sqlite3.Connection) -> None:
        try:
            for statement in _RECORD_SCHEMA:
                conn.execute(statement)
        except BaseException:
            conn.close()
            raise

    def _close_interrupted(self) -> None:
        """Close what the last stop interrupted; bookkeeping only, so a full disk here is an alert, not an exit."""
        open_rows = self._conn.execute("SELECT request_id, verb, ack FROM requests WHERE state NOT IN (?, ?)",
                                       FINAL_STATES).fetchall()
        try:
            for request_id, verb, _ in open_rows:
                ack = ack_message(request_id, verb, FAILED, error=error_body(
                    "interrupted", "the agent stopped before this command finished"))
                self.save(ack)
        except sqlite3.Error as exc:
            reason = "%s: %s" % (type(exc).__name__, exc)
            logger.error("commands: could not close %d interrupted command(s) in %s: %s", len(open_rows),
                         self.path, reason)
            self.alerts.append(state_alert("record_not_written", "command record %s: %d interrupted command(s) "
                                           "could not be closed (%s); they stay open in the record"
                                           % (self.path, len(open_rows), reason), file=self.path, reason=reason))
            return
        if open_rows:
            logger.warning("commands: %d command(s) were interrupted by the last stop: %s", len(open_rows),
                           ", ".join(r[0] for r in open_rows))

    def get(self, request_id: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            row = self._conn.execute("SELECT ack FROM requests WHERE request_id = ?",
                                     (request_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def save(self, ack: Dict[str, Any]) -> None:
        text = json.dumps(ack, separators=(",", ":"), default=str)
        if len(text) > RECORD_ACK_MAX_BYTES:
            kept = {k: v for k, v in ack.items() if k != "result"}
            kept["result"] = {"note": "result too large to keep; send a new request_id to run it again"}
            text = json.dumps(kept, separators=(",", ":"), default=str)
        with self._lock:
            conn = self._conn
            with transaction(conn):
                updated = conn.execute("UPDATE requests SET state = ?, ack = ? WHERE request_id = ?",
                                       (ack["state"], text, ack["request_id"])).rowcount
                if not updated:
                    cursor = conn.execute(
                        "INSERT INTO requests (request_id, verb, state, ack) VALUES (?,?,?,?)",
                        (ack["request_id"], ack["verb"], ack["state"], text))
                    conn.execute("DELETE FROM requests WHERE seq <= ?", (int(cursor.lastrowid) - self.size,))

    def claim_dated(self, request_id: str, expires: float, now: float) -> bool:
        """Keep ``request_id`` until ``expires``; False when it is kept already. Ids expired by ``now`` go first."""
        with self._lock:
            conn = self._conn
            with transaction(conn):
                conn.execute("DELETE FROM dated WHERE expires < ?", (now,))
                claimed = conn.execute("INSERT OR IGNORE INTO dated (request_id, expires) VALUES (?, ?)",
                                       (request_id, expires)).rowcount
        return bool(claimed)

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
