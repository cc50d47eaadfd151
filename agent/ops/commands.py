"""The command protocol on MQTT: parse, check, acknowledge, run one at a time, answer retries from a record.

A command is a JSON object published to ``<prefix>/<device>/cmd/<verb>`` (or to
``<prefix>/group/<group>/cmd/<verb>`` for a group the device belongs to) with a ``request_id`` and the verb's
own fields. Acks go to ``<prefix>/<device>/ack/<request_id>`` and move ``accepted`` -> ``in_progress`` ->
``succeeded`` | ``failed``::

    {"request_id": "r1", "verb": "deploy", "state": "failed", "ts": 1700000000.0,
     "error": {"code": "invalid", "field": "bundle", "message": "...",
               "errors": [{"field": "bundle", "message": "..."}]}}

Bad input never runs anything: an unknown verb, bad JSON, a non-object, an oversize payload, too many
commands per second or a bad ``request_id`` get a failed ack with a structured error when a request id can be
recovered, and are otherwise dropped with a counted reason (:meth:`CommandDispatcher.stats`). A repeated
``request_id`` is answered from its recorded outcome and never executed twice, also across restarts (the
record is a small SQLite table with a bounded number of entries).

Threads: :meth:`CommandDispatcher.submit` runs on paho's thread and only enqueues. The intake thread checks
each message and sends ``accepted`` at once; the worker thread runs handlers one at a time, so a long deploy
does not delay the ``accepted`` of the next command. Handlers are the daemon's (status, validate, set-config,
deploy, rollback, pause, resume, snapshot, restart); this module is only the protocol.
"""

import json
import logging
import queue
import re
import sqlite3
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from agent._util.compat import Protocol
from agent._util.quarantine import state_alert
from agent._util.ratelog import LogLimiter
from agent._util.sqlite import open_recovering, transaction
from agent.config.schema import ConfigError
from agent.errors import CommandError

logger = logging.getLogger(__name__)

VERBS = ("status", "validate", "set-config", "deploy", "rollback", "pause", "resume", "snapshot", "restart")

ACCEPTED = "accepted"
IN_PROGRESS = "in_progress"
SUCCEEDED = "succeeded"
FAILED = "failed"
FINAL_STATES = (SUCCEEDED, FAILED)

# request_id ends up in a topic: a bounded, topic-safe charset (no '/', '+', '#', spaces or control bytes).
REQUEST_ID_MAX = 64
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,%d}\Z" % REQUEST_ID_MAX)
# Recover a request id from a payload we will not parse (too large, rate-limited) or cannot (bad JSON),
# looking only at its head, so that the operator still gets a failed ack instead of a timeout.
_REQUEST_ID_PEEK = re.compile(rb'"request_id"\s*:\s*"([A-Za-z0-9_.:-]{1,%d})"' % REQUEST_ID_MAX)
PEEK_BYTES = 4096

DEFAULT_MAX_PAYLOAD_BYTES = 65536  # a command is a small JSON object; bundles travel by path, not inline
DEFAULT_RATE_PER_S = 10.0  # sustained commands per second; an operator types far fewer
DEFAULT_BURST = 20  # commands accepted at once before the rate applies (a fleet script sends a few together)
DEFAULT_QUEUE_SIZE = 32  # accepted commands waiting for the worker; beyond this: failed "busy"
DEFAULT_RECORD_SIZE = 1024  # request ids remembered for idempotent retries
RECORD_ACK_MAX_BYTES = 16384  # a recorded outcome larger than this keeps its state and error, not its result
INBOX_SIZE = 4096  # raw messages waiting for the intake thread; beyond this they are dropped (counted)
STOP_POLL_S = 0.2
MESSAGE_MAX_CHARS = 300  # error messages are cut to this in acks
VERB_MAX_CHARS = 64  # an unknown verb is echoed in its failed ack cut to this
DROP_LOG_FIRST, DROP_LOG_EVERY = 10, 100  # drops are logged the first times, then once per 100 per reason

Progress = Callable[[str], None]
Handler = Callable[[Dict[str, Any], Progress], Optional[Mapping[str, Any]]]


def error_body(code: str, message: str, field: Optional[str] = None,
               errors: Optional[List[Dict[str, str]]] = None) -> Dict[str, Any]:
    """The ``error`` object of a failed ack."""
    body: Dict[str, Any] = {"code": code, "field": field, "message": message[:MESSAGE_MAX_CHARS]}
    if errors is not None:
        body["errors"] = errors
    return body


def peek_request_id(payload: bytes) -> Optional[str]:
    """A well-formed request id from the head of a payload we will not fully parse, or None."""
    match = _REQUEST_ID_PEEK.search(payload[:PEEK_BYTES])
    return match.group(1).decode("ascii") if match else None


class AckPublisher(Protocol):
    """What the dispatcher needs of the transport (:class:`agent.ops.transport.MqttTransport`)."""

    prefix: str
    device_id: str
    groups: Tuple[str, ...]

    def publish_ack(self, request_id: str, payload: Dict[str, Any]) -> str: ...


class _Job(NamedTuple):
    request_id: str
    verb: str
    fields: Dict[str, Any]


_RECORD_TABLES = {"requests": ("seq", "request_id", "verb", "state", "ack")}
_RECORD_SCHEMA = ("CREATE TABLE IF NOT EXISTS requests (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                  " request_id TEXT UNIQUE NOT NULL, verb TEXT NOT NULL, state TEXT NOT NULL, ack TEXT NOT NULL)")


class _RequestRecord:
    """request_id -> latest ack, in SQLite (WAL), bounded to the newest ``size`` entries.

    Written when a command is accepted and when it ends; an entry still open when the process stopped is
    closed as failed ``interrupted`` on the next start, so a retry is answered and never runs it again.

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
            conn.execute(_RECORD_SCHEMA)
        except BaseException:
            conn.close()
            raise

    def _close_interrupted(self) -> None:
        """Close what the last stop interrupted; bookkeeping only, so a full disk here is an alert, not an exit."""
        open_rows = self._conn.execute("SELECT request_id, verb, ack FROM requests WHERE state NOT IN (?, ?)",
                                       FINAL_STATES).fetchall()
        try:
            for request_id, verb, _ in open_rows:
                ack = {"request_id": request_id, "verb": verb, "state": FAILED, "ts": time.time(),
                       "error": error_body("interrupted", "the agent stopped before this command finished")}
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

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class _TokenBucket:
    """``rate`` per second sustained, ``burst`` at once; fed with arrival times so tests need no sleeping."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp: Optional[float] = None

    def take(self, now: float) -> bool:
        if self.stamp is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class CommandDispatcher:
    """Turns command messages into handler calls and acks; see the module docstring for the protocol.

    ``transport`` is an :class:`AckPublisher` (:class:`agent.ops.transport.MqttTransport`). Each handler is
    ``handler(fields, progress) -> dict | None``: ``fields`` is the payload without ``request_id``;
    ``progress(message)`` sends an ``in_progress`` ack; it may raise :class:`CommandError` or
    :class:`agent.config.schema.ConfigError` to fail with a structured error.
    """

    def __init__(
        self,
        transport: AckPublisher,
        handlers: Dict[str, Handler],
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        rate_per_s: float = DEFAULT_RATE_PER_S,
        burst: int = DEFAULT_BURST,
        record_path: Optional[str] = None,
        record_size: int = DEFAULT_RECORD_SIZE,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        on_alert: Optional[Callable[[Dict[str, Any]], None]] = None,
    ) -> None:
        unknown = sorted(set(handlers) - set(VERBS))
        if unknown:
            raise ValueError("handlers for unknown verbs %s (known: %s)" % (unknown, ", ".join(VERBS)))
        if rate_per_s <= 0 or burst < 1 or max_payload_bytes < 1 or record_size < 1 or queue_size < 1:
            raise ValueError("rate_per_s, burst, max_payload_bytes, record_size and queue_size must be > 0")
        self.transport = transport
        self.handlers = dict(handlers)
        self.max_payload_bytes = max_payload_bytes
        self._device_prefix = "%s/%s/cmd/" % (transport.prefix, transport.device_id)
        self._group_prefix = "%s/group/" % transport.prefix
        self._groups = frozenset(transport.groups)
        self._bucket = _TokenBucket(rate_per_s, burst)
        self._record = _RequestRecord(record_path, record_size)
        self._inbox: "queue.Queue[Tuple[str, bytes, float]]" = queue.Queue(INBOX_SIZE)
        self._jobs: "queue.Queue[_Job]" = queue.Queue(queue_size)
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._busy = threading.Event()  # the worker is inside a handler
        self._lock = threading.Lock()
        self._dropped: Dict[str, int] = {}
        self._failed: Dict[str, int] = {}
        self._counters = dict.fromkeys(("received", "accepted", "succeeded", "duplicates"), 0)
        self._drop_log = LogLimiter(logger, DROP_LOG_FIRST, DROP_LOG_EVERY)
        self._on_alert = on_alert

    # -- paho's thread ------------------------------------------------------------------------------------

    def submit(self, topic: str, payload: bytes) -> None:
        """Queue one incoming message (called on paho's thread: no parsing, no I/O here)."""
        try:
            self._inbox.put_nowait((topic, bytes(payload), time.monotonic()))
        except queue.Full:
            self._drop("inbox_full", topic)

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> "CommandDispatcher":
        """Start the intake and worker threads; first report what happened to the record at open, if anything."""
        alerts, self._record.alerts = self._record.alerts, []
        for alert in alerts:
            if self._on_alert is not None:
                self._on_alert(alert)
        if not self._threads:
            self._stop.clear()
            for name, target in (("cmd-intake", self._intake_loop), ("cmd-worker", self._worker_loop)):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking commands; a running handler gets ``timeout``, queued ones fail ``interrupted``."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("commands: thread %s did not stop within %.0f s", thread.name, timeout)
        self._threads = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            self._finish(job, FAILED, error=error_body("interrupted", "the agent stopped before running it"))

    def close(self) -> None:
        self._record.close()

    def wait_idle(self, timeout: float) -> bool:
        """True once every submitted message has been handled (tests; shutdown ordering)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._inbox.unfinished_tasks == 0 and self._jobs.unfinished_tasks == 0:
                return True
            self._stop.wait(0.01)
        return False

    # -- intake thread ------------------------------------------------------------------------------------

    def _intake_loop(self) -> None:
        while not self._stop.is_set():
            try:
                topic, payload, arrived = self._inbox.get(timeout=STOP_POLL_S)
            except queue.Empty:
                continue
            try:
                self._intake(topic, payload, arrived)
            except Exception:
                logger.exception("commands: intake failed for a message on %s", topic)
                self._drop("internal", topic)
            finally:
                self._inbox.task_done()

    def _verb_of(self, topic: str) -> Optional[str]:
        """The verb of a command topic addressed to this device or one of its groups, else None."""
        if topic.startswith(self._device_prefix):
            verb = topic[len(self._device_prefix):]
        elif topic.startswith(self._group_prefix):
            parts = topic[len(self._group_prefix):].split("/")
            if len(parts) != 3 or parts[1] != "cmd" or parts[0] not in self._groups:
                return None
            verb = parts[2]
        else:
            return None
        return verb[:VERB_MAX_CHARS] if verb and "/" not in verb else None

    def _intake(self, topic: str, payload: bytes, arrived: float) -> None:  # noqa: C901 - one check per rule
        with self._lock:
            self._counters["received"] += 1
        verb = self._verb_of(topic)
        if verb is None:
            self._drop("bad_topic", topic)
            return
        if not self._bucket.take(arrived):
            self._reject_unparsed(payload, verb, "rate_limited", "more than the allowed commands per second")
            return
        if len(payload) > self.max_payload_bytes:
            self._reject_unparsed(payload, verb, "too_large", "payload of %d bytes exceeds %d"
                                  % (len(payload), self.max_payload_bytes))
            return
        try:
            message = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            self._reject_unparsed(payload, verb, "bad_json", "payload is not JSON (UTF-8): %s" % exc)
            return
        if not isinstance(message, dict):
            self._drop("not_object", topic)
            return
        if "request_id" not in message:
            self._drop("no_request_id", topic)
            return
        request_id = message["request_id"]
        if not isinstance(request_id, str) or not REQUEST_ID_RE.match(request_id):
            self._drop("bad_request_id", topic)
            return
        recorded = self._record.get(request_id)
        if recorded is not None:
            self._answer_duplicate(recorded, request_id, verb)
            return
        if verb not in self.handlers:
            known = ", ".join(v for v in VERBS if v in self.handlers)
            self._finish(_Job(request_id, verb, {}), FAILED, error=error_body(
                "unknown_verb", "unknown verb %r (this device handles: %s)" % (verb, known), "verb"))
            return
        fields = {k: v for k, v in message.items() if k != "request_id"}
        job = _Job(request_id, verb, fields)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            # Not recorded: it never ran, so a retry once the queue has room may run it.
            self._count_failed("busy")
            self._publish(self._ack(job, FAILED, error=error_body(
                "busy", "%d commands already waiting; retry later" % self._jobs.maxsize)))
            return
        with self._lock:
            self._counters["accepted"] += 1
        ack = self._ack(job, ACCEPTED)
        self._record.save(ack)
        self._publish(ack)

    def _answer_duplicate(self, recorded: Dict[str, Any], request_id: str, verb: str) -> None:
        with self._lock:
            self._counters["duplicates"] += 1
        if recorded.get("verb") != verb:
            self._count_failed("duplicate_request_id")
            self._publish(self._ack(_Job(request_id, verb, {}), FAILED, error=error_body(
                "duplicate_request_id",
                "request_id %s was already used for %r" % (request_id, recorded.get("verb")), "request_id")))
            return
        logger.info("commands: %s %s is a retry; answering from its record (%s)", verb, request_id,
                    recorded.get("state"))
        self._publish(dict(recorded, replayed=True))

    def _reject_unparsed(self, payload: bytes, verb: str, code: str, message: str) -> None:
        """Fail a message we do not parse: ack it if its head names a request id, else count the drop."""
        request_id = peek_request_id(payload)
        if request_id is None:
            self._drop(code, verb)
            return
        self._count_failed(code)
        self._publish(self._ack(_Job(request_id, verb, {}), FAILED, error=error_body(code, message)))

    # -- worker thread ------------------------------------------------------------------------------------

    def _worker_loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=STOP_POLL_S)
            except queue.Empty:
                continue
            try:
                self._run(job)
            except Exception:  # publishing or recording failed: the dispatcher must keep going
                logger.exception("commands: could not complete %s %s", job.verb, job.request_id)
            finally:
                self._jobs.task_done()

    def _run(self, job: _Job) -> None:
        handler = self.handlers[job.verb]

        def progress(message: str) -> None:
            self._publish(self._ack(job, IN_PROGRESS, message=str(message)[:MESSAGE_MAX_CHARS]))

        started = self._ack(job, IN_PROGRESS)
        self._record.save(started)
        self._publish(started)
        self._busy.set()
        try:
            result = handler(dict(job.fields), progress)
            if result is not None and not isinstance(result, Mapping):
                raise TypeError("handler for %s returned %s, not a dict" % (job.verb, type(result).__name__))
        except CommandError as exc:
            self._finish(job, FAILED, error=error_body(exc.code, exc.message, exc.field))
            return
        except ConfigError as exc:
            errors = exc.as_list()
            field = errors[0]["field"] if len(errors) == 1 else None
            self._finish(job, FAILED, error=error_body("invalid", str(exc), field, errors))
            return
        except Exception as exc:
            logger.exception("commands: handler for %s %s raised", job.verb, job.request_id)
            self._finish(job, FAILED, error=error_body("internal", "%s: %s" % (type(exc).__name__, exc)))
            return
        finally:
            self._busy.clear()
        with self._lock:
            self._counters["succeeded"] += 1
        self._finish(job, SUCCEEDED, result=dict(result or {}))

    # -- acks and counters --------------------------------------------------------------------------------

    @staticmethod
    def _ack(job: _Job, state: str, result: Optional[Dict[str, Any]] = None,
             error: Optional[Dict[str, Any]] = None, message: Optional[str] = None) -> Dict[str, Any]:
        ack: Dict[str, Any] = {"request_id": job.request_id, "verb": job.verb, "state": state,
                               "ts": time.time()}
        if message is not None:
            ack["message"] = message
        if result is not None:
            ack["result"] = result
        if error is not None:
            ack["error"] = error
        return ack

    def _finish(self, job: _Job, state: str, result: Optional[Dict[str, Any]] = None,
                error: Optional[Dict[str, Any]] = None) -> None:
        """Record the final outcome before publishing it, so a retry after a crash is still answered."""
        if error is not None:
            self._count_failed(error["code"])
            logger.warning("commands: %s %s failed: %s: %s", job.verb, job.request_id, error["code"],
                           error["message"])
        ack = self._ack(job, state, result=result, error=error)
        self._record.save(ack)
        self._publish(ack)

    def _publish(self, ack: Dict[str, Any]) -> None:
        self.transport.publish_ack(ack["request_id"], ack)

    def _drop(self, reason: str, where: str) -> None:
        with self._lock:
            self._dropped[reason] = self._dropped.get(reason, 0) + 1
        # Counted always; logged without flooding (a hostile stream must not bury the journal).
        self._drop_log.log(logging.WARNING, reason, "commands: dropped a message on %s: %s (no request_id to "
                           "answer)", where[:120], reason)

    def _count_failed(self, code: str) -> None:
        with self._lock:
            self._failed[code] = self._failed.get(code, 0) + 1

    def stats(self) -> Dict[str, Any]:
        """received, accepted, succeeded, duplicates; failed and dropped by code/reason (for ``status``)."""
        with self._lock:
            result: Dict[str, Any] = dict(self._counters)
            result["failed"] = dict(self._failed)
            result["dropped"] = dict(self._dropped)
        result["busy"] = self._busy.is_set()
        result["queued"] = self._jobs.qsize()
        result["record_in_memory"] = self._record.in_memory
        return result
