"""The command dispatcher: check, parse, acknowledge, run one at a time, answer retries from the record.

The protocol (topics, verbs, ack states, request ids, one request type per verb) is :mod:`agent.protocol`;
docs/mqtt.md describes it. Bad input never runs anything: an unknown verb, bad JSON, a non-object, an
oversize payload, too many commands per second, a bad ``request_id`` or a payload its verb's request type
refuses (``invalid``, naming the field) get a failed ack with a structured error when a request id can be
recovered, and are otherwise dropped with a counted reason (:meth:`CommandDispatcher.stats`). A repeated
``request_id`` is answered from its recorded outcome and never executed twice, also across restarts
(:mod:`agent.commands.record`).

An operator's announce request (``<prefix>/announce``, or ``announce`` on a group's or the box's command topic)
is no command: the intake thread answers it at once with the box's live status (``on_announce``), without
request id, ack or record, so that a box is found even while a long deploy runs on the worker.

Before a command is accepted it must also be fresh (:mod:`agent.commands.freshness`: dated commands judged
on their ``issued_at``/``ttl_s``, ids kept while valid, signatures when a command key is set), must not be a
retained message (a retained command would run again at every reconnect), and on a group topic must be one of
the ``group_verbs`` (one publish reaches every box of the group).

With a command key, the signature is checked as soon as the request id is read, before the record is looked up
or written; a failure is answered unrecorded, so a sender without the key can neither take an operator's id
first nor push the record's entries out. Then the rate limit per sender class (verified commands have their
own bucket: junk cannot use up the operator's tokens), the record (a signed retry is answered from it), the
queue's room, group verbs and the date (dated ids live in the record's file: no replay after a restart).

Threads: :meth:`CommandDispatcher.submit` runs on paho's thread and only enqueues. The intake thread checks
and parses each message and sends ``accepted`` at once. Three workers run handlers: the control worker runs the
verb table's control verbs (status, pause, resume, rollback, cancel), the long worker its long verbs (deploy),
the third everything else one at a time: the operator is answered, can ``cancel`` or ``rollback``, and a
set-config or restart runs, while a deploy downloads and unpacks. Handlers are the daemon's
(:mod:`agent.commands.handlers`), found by the verb table's method names (:func:`handlers_of`); every ack is
recorded, published and counted by :mod:`agent.commands.answers`.
"""

import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from agent._util.compat import Protocol
from agent.commands.answers import AckSink, Answers, Job
from agent.commands.freshness import Freshness
from agent.commands.ratelimit import OTHER, SIGNED, ClassBuckets
from agent.commands.record import RequestRecord
from agent.config.schema import ConfigError
from agent.errors import CommandError
from agent.protocol.messages import (
    ACCEPTED,
    FAILED,
    IN_PROGRESS,
    MESSAGE_MAX_CHARS,
    SUCCEEDED,
    decode_json,
    error_body,
    invalid_body,
    is_request_id,
)
from agent.protocol.topics import ANNOUNCE, CommandTopic, read_command_topic
from agent.protocol.verbs import (
    VERB_TABLE,
    check_group_verbs,
    control_verbs,
    long_verbs,
    missing_handlers,
    parse_request,
    verb_names,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD_BYTES = 65536  # a command is a small JSON object; bundles travel by path, not inline
DEFAULT_RATE_PER_S = 10.0  # sustained commands per second; an operator types far fewer
DEFAULT_BURST = 20  # commands accepted at once before the rate applies (a fleet script sends a few together)
DEFAULT_QUEUE_SIZE = 32  # accepted commands waiting for the worker; beyond this: failed "busy"
DEFAULT_RECORD_SIZE = 1024  # request ids remembered for idempotent retries
INBOX_SIZE = 4096  # raw messages waiting for the intake thread; beyond this they are dropped (counted)
STOP_POLL_S = 0.2
VERB_MAX_CHARS = 64  # an unknown verb is echoed in its failed ack cut to this

Progress = Callable[[str], None]
# handler(request, progress): ``request`` is the verb's request type (agent.protocol.verbs).
Handler = Callable[[Any, Progress], Optional[Mapping[str, Any]]]


def handlers_of(target: Any) -> Dict[str, Handler]:
    """Verb -> ``target``'s method named by the verb table; TypeError naming every verb it cannot run."""
    missing = missing_handlers(target)
    if missing:
        raise TypeError("%s has no handler for %s (the verb table names %s)" % (
            type(target).__name__, ", ".join(missing), ", ".join(VERB_TABLE[v].handler for v in missing)))
    return {name: getattr(target, verb.handler) for name, verb in VERB_TABLE.items()}


class AckPublisher(AckSink, Protocol):
    """What the dispatcher needs of the transport (:class:`agent.ops.transport.MqttTransport`)."""

    prefix: str
    device_id: str
    groups: Tuple[str, ...]


class CommandDispatcher:
    """Turns command messages into handler calls and acks; see the module docstring for the protocol.

    ``transport`` is an :class:`AckPublisher` (:class:`agent.ops.transport.MqttTransport`). Each handler is
    ``handler(request, progress) -> dict | None``: ``request`` is the payload parsed into the verb's request
    type (:mod:`agent.protocol.verbs`); ``progress(message)`` sends an ``in_progress`` ack; it
    may raise :class:`CommandError` or :class:`agent.config.schema.ConfigError` to fail with a structured
    error.
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
        on_announce: Optional[Callable[[], None]] = None,
        freshness: Optional[Freshness] = None,
        group_verbs: Optional[Sequence[str]] = None,
    ) -> None:
        """``group_verbs`` None: the verb table's group-safe verbs; an unknown one is a ConfigError naming
        ``commands.group_verbs`` (the daemon then exits 78), as ``atlas-edge validate`` reports it."""
        unknown = sorted(set(handlers) - set(verb_names()))
        if unknown:
            raise ValueError("handlers for unknown verbs %s (known: %s)" % (unknown, ", ".join(verb_names())))
        if rate_per_s <= 0 or burst < 1 or max_payload_bytes < 1 or record_size < 1 or queue_size < 1:
            raise ValueError("rate_per_s, burst, max_payload_bytes, record_size and queue_size must be > 0")
        self.transport = transport
        self.handlers = dict(handlers)
        self.max_payload_bytes = max_payload_bytes
        self._groups = frozenset(transport.groups)
        self._buckets = ClassBuckets(rate_per_s, burst)
        self._record = RequestRecord(record_path, record_size)
        self._inbox: "queue.Queue[Tuple[str, bytes, float, bool]]" = queue.Queue(INBOX_SIZE)
        self._jobs: "queue.Queue[Job]" = queue.Queue(queue_size)
        self._control: "queue.Queue[Job]" = queue.Queue(queue_size)
        self._long: "queue.Queue[Job]" = queue.Queue(queue_size)  # deploys: set-config never waits on a download
        self._freshness = freshness or Freshness()
        self._freshness.keep_ids_in(self._record)  # dated ids outlive a restart
        self._group_verbs = frozenset(check_group_verbs(group_verbs))
        self._control_verbs = frozenset(control_verbs())
        self._long_verbs = frozenset(long_verbs())
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._busy = threading.Event()  # the worker is inside a handler
        self._deploying = threading.Event()  # the long worker is
        self._answers = Answers(transport, self._record)
        self._on_alert = on_alert
        self._on_announce = on_announce

    # -- paho's thread ------------------------------------------------------------------------------------

    def submit(self, topic: str, payload: bytes, retained: bool = False) -> None:
        """Queue one incoming message (called on paho's thread: no parsing, no I/O here)."""
        try:
            self._inbox.put_nowait((topic, bytes(payload), time.monotonic(), retained))
        except queue.Full:
            self._answers.drop("inbox_full", topic)

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> "CommandDispatcher":
        """Start the intake and worker threads; first report what happened to the record at open, if anything."""
        alerts, self._record.alerts = self._record.alerts, []
        for alert in alerts:
            if self._on_alert is not None:
                self._on_alert(alert)
        if not self._threads:
            self._stop.clear()
            for name, target, args in (("cmd-intake", self._intake_loop, ()),
                                       ("cmd-worker", self._worker_loop, (self._jobs, self._busy)),
                                       ("cmd-control", self._worker_loop, (self._control,)),
                                       ("cmd-long", self._worker_loop, (self._long, self._deploying))):
                thread = threading.Thread(target=target, args=args, name=name, daemon=True)
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
        for jobs in (self._jobs, self._control, self._long):
            while True:
                try:
                    job = jobs.get_nowait()
                except queue.Empty:
                    break
                self._answers.finish(job, FAILED,
                                     error=error_body("interrupted", "the agent stopped before running it"))

    def close(self) -> None:
        self._record.close()

    def wait_idle(self, timeout: float) -> bool:
        """True once every submitted message has been handled (tests; shutdown ordering)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._inbox.unfinished_tasks == 0 and all(
                    q.unfinished_tasks == 0 for q in (self._jobs, self._control, self._long)):
                return True
            self._stop.wait(0.01)
        return False

    # -- intake thread ------------------------------------------------------------------------------------

    def _intake_loop(self) -> None:
        while not self._stop.is_set():
            try:
                topic, payload, arrived, retained = self._inbox.get(timeout=STOP_POLL_S)
            except queue.Empty:
                continue
            try:
                self._intake(topic, payload, arrived, retained)
            except Exception:
                logger.exception("commands: intake failed for a message on %s", topic)
                self._answers.drop("internal", topic)
            finally:
                self._inbox.task_done()

    def _command_of(self, topic: str) -> Optional[CommandTopic]:
        """What a command topic addressed to this device or one of its groups says (its verb cut to
        :data:`VERB_MAX_CHARS`), else None."""
        command = read_command_topic(self.transport.prefix, self.transport.device_id, self._groups, topic)
        return None if command is None else CommandTopic(command.verb[:VERB_MAX_CHARS], command.group)

    def _intake(self, topic: str, payload: bytes, arrived: float, retained: bool = False) -> None:
        """The checks on the raw message, in order, up to a request id to answer; then :meth:`_admit`."""
        answers = self._answers
        answers.count("received")
        command = self._command_of(topic)
        if command is None:
            answers.drop("bad_topic", topic)
            return
        verb = command.verb
        if verb == ANNOUNCE:
            if not self._buckets.take(OTHER, arrived):
                answers.drop("rate_limited", topic)
                return
            self._announce(topic)
            return
        if len(payload) > self.max_payload_bytes:
            answers.reject_unparsed(payload, verb, "too_large", "payload of %d bytes exceeds %d"
                                    % (len(payload), self.max_payload_bytes))
            return
        try:
            message = decode_json(payload)
        except ValueError as exc:  # not UTF-8, not JSON, or nested too deep
            answers.reject_unparsed(payload, verb, "bad_json", "payload is not JSON (UTF-8): %s" % exc)
            return
        if retained:  # a retained command would run again at every reconnect of every box that reads it
            answers.reject_unparsed(payload, verb, "retained", "retained command messages are refused; publish "
                                    "commands without the retain flag")
            return
        if not isinstance(message, dict):
            answers.drop("not_object", topic)
            return
        if "request_id" not in message:
            answers.drop("no_request_id", topic)
            return
        request_id = message["request_id"]
        if not is_request_id(request_id):
            answers.drop("bad_request_id", topic)
            return
        try:  # before anything is looked up or written under this id
            signed = self._freshness.authenticate(command.target(self.transport.device_id), verb, message)
        except CommandError as exc:  # not recorded: the id stays free for the operator's signed command
            answers.refuse(Job(request_id, verb, None), error_body(exc.code, exc.message, exc.field))
            return
        if not self._buckets.take(SIGNED if signed else OTHER, arrived):
            answers.refuse(Job(request_id, verb, None), error_body(
                "rate_limited", "more than the allowed commands per second"))
            return
        self._admit(command, request_id, message)

    def _admit(self, command: CommandTopic, request_id: str, message: Dict[str, Any]) -> None:
        """A command with a request id: answer a retry from its record, refuse it, or queue it and accept it."""
        answers = self._answers
        verb = command.verb
        recorded = self._record.get(request_id)
        if recorded is not None:
            answers.answer_duplicate(recorded, request_id, verb)
            return
        if verb not in self.handlers:
            known = ", ".join(v for v in verb_names() if v in self.handlers)
            answers.finish(Job(request_id, verb, None), FAILED, error=error_body(
                "unknown_verb", "unknown verb %r (this device handles: %s)" % (verb, known), "verb"))
            return
        jobs = self._control if verb in self._control_verbs else (
            self._long if verb in self._long_verbs else self._jobs)
        if jobs.full():
            # Not recorded, and before the date check keeps a dated id: it never ran, so a retry (the same
            # signed message) once the queue has room may run it.
            answers.refuse(Job(request_id, verb, None), error_body(
                "busy", "%d commands already waiting; retry later" % jobs.maxsize))
            return
        refusal = self._refusal(command, message)
        if refusal is not None:  # nothing ran: recorded as failed, so a retry gets the same answer
            answers.finish(Job(request_id, verb, None), FAILED, error=refusal)
            return
        try:
            request = parse_request(verb, message)
        except ConfigError as exc:  # nothing ran: recorded as failed, so a retry gets the same answer
            answers.finish(Job(request_id, verb, None), FAILED, error=invalid_body(exc))
            return
        job = Job(request_id, verb, request)
        answers.count("accepted")
        ack = answers.ack(job, ACCEPTED)
        self._record.save(ack)
        answers.publish(ack)
        # Queued only once "accepted" is out, so a worker's in_progress never overtakes it. This thread is the
        # queues' only producer: the room checked above is still there.
        jobs.put_nowait(job)

    def _announce(self, topic: str) -> None:
        """Answer an operator's announce request at once (here, not behind a running deploy on the worker).

        Not a command: no request id, no ack, nothing recorded; the answer is the box's live status.
        """
        if self._on_announce is None:
            self._answers.drop("no_announce", topic)
            return
        self._answers.count("announced")
        self._on_announce()

    def _refusal(self, command: CommandTopic, message: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Why a well-formed command must not run here (a group verb not allowed, not fresh), else None."""
        verb = command.verb
        if command.group is not None and verb not in self._group_verbs:
            return error_body("not_for_group", "%s is not allowed on a group topic (commands.group_verbs: %s); "
                              "send it to each box" % (verb, ", ".join(sorted(self._group_verbs))), "verb")
        try:
            self._freshness.check_date(message)
        except CommandError as exc:
            return error_body(exc.code, exc.message, exc.field)
        return None

    # -- worker thread ------------------------------------------------------------------------------------

    def _worker_loop(self, jobs: "queue.Queue[Job]", busy: Optional[threading.Event] = None) -> None:
        """Run ``jobs`` one at a time; ``busy`` (the status's ``busy``) is set while a handler runs."""
        while not self._stop.is_set():
            try:
                job = jobs.get(timeout=STOP_POLL_S)
            except queue.Empty:
                continue
            if busy is not None:
                busy.set()
            try:
                self._run(job)
            except Exception:  # publishing or recording failed: the dispatcher must keep going
                logger.exception("commands: could not complete %s %s", job.verb, job.request_id)
            finally:
                if busy is not None:
                    busy.clear()
                jobs.task_done()

    def _run(self, job: Job) -> None:
        handler = self.handlers[job.verb]

        def progress(message: str) -> None:
            self._answers.publish(self._answers.ack(job, IN_PROGRESS, message=str(message)[:MESSAGE_MAX_CHARS]))

        started = self._answers.ack(job, IN_PROGRESS)
        self._record.save(started)
        self._answers.publish(started)
        try:
            result = handler(job.request, progress)
            if result is not None and not isinstance(result, Mapping):
                raise TypeError("handler for %s returned %s, not a dict" % (job.verb, type(result).__name__))
        except CommandError as exc:
            self._answers.finish(job, FAILED, error=error_body(exc.code, exc.message, exc.field))
            return
        except ConfigError as exc:
            self._answers.finish(job, FAILED, error=invalid_body(exc))
            return
        except Exception as exc:
            logger.exception("commands: handler for %s %s raised", job.verb, job.request_id)
            self._answers.finish(job, FAILED, error=error_body("internal", "%s: %s" % (type(exc).__name__, exc)))
            return
        self._answers.count("succeeded")
        self._answers.finish(job, SUCCEEDED, result=dict(result or {}))

    def stats(self) -> Dict[str, Any]:
        """received, accepted, succeeded, duplicates; failed and dropped by code/reason (for ``status``)."""
        result = self._answers.counts()
        result["busy"] = self._busy.is_set() or self._deploying.is_set()
        result["queued"] = self._jobs.qsize() + self._control.qsize() + self._long.qsize()
        result["record_in_memory"] = self._record.in_memory
        return result

    def acks(self) -> Dict[Tuple[str, str], int]:
        """Acks published by (verb, state), for the metrics endpoint."""
        return self._answers.acks()
