"""How the box answers commands: each outcome an ack, recorded before it is published; what gets no ack, counted.

A final ack is saved in the request record (:mod:`agent.commands.record`) before it is published, so a retry
after a crash is answered from the record; a refusal that must not bind its request id (rate limited, busy,
not signed by the command key) is published unrecorded (:meth:`Answers.refuse`); a message without a request
id to answer is dropped, counted by reason and logged without flooding. Separate from the dispatcher
(:mod:`agent.commands.dispatcher`), which decides what happens to a message (intake checks, queues, workers):
the intake and both workers answer through this one object, so a refusal, a retry and a handler's outcome are
recorded, published and counted alike."""

import logging
import threading
from typing import Any, Dict, NamedTuple, Optional, Tuple

from agent._util.compat import Protocol
from agent._util.ratelog import LogLimiter
from agent.commands.record import RequestRecord
from agent.protocol.messages import FAILED, ack_message, error_body, peek_request_id

logger = logging.getLogger(__name__)

DROP_LOG_FIRST, DROP_LOG_EVERY = 10, 100  # drops are logged the first times, then once per 100 per reason
COUNTERS = ("received", "accepted", "succeeded", "duplicates", "announced")


class AckSink(Protocol):
    """Where acks go (:class:`agent.ops.transport.MqttTransport`)."""

    def publish_ack(self, request_id: str, payload: Dict[str, Any]) -> str: ...


class Job(NamedTuple):
    request_id: str
    verb: str
    request: Any


class Answers:
    """Acks built, recorded and published for ``transport``; counters of what happened (see module doc)."""

    def __init__(self, transport: AckSink, record: RequestRecord) -> None:
        self.transport = transport
        self.record = record
        self._lock = threading.Lock()
        self._dropped: Dict[str, int] = {}
        self._failed: Dict[str, int] = {}
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._acks: Dict[Tuple[str, str], int] = {}  # (verb, ack state) -> acks published (the metrics endpoint)
        self._drop_log = LogLimiter(logger, DROP_LOG_FIRST, DROP_LOG_EVERY)

    @staticmethod
    def ack(job: Job, state: str, result: Optional[Dict[str, Any]] = None,
            error: Optional[Dict[str, Any]] = None, message: Optional[str] = None) -> Dict[str, Any]:
        return ack_message(job.request_id, job.verb, state, result=result, error=error, message=message)

    def finish(self, job: Job, state: str, result: Optional[Dict[str, Any]] = None,
               error: Optional[Dict[str, Any]] = None) -> None:
        """Record the final outcome before publishing it, so a retry after a crash is still answered."""
        if error is not None:
            self.count_failed(error["code"])
            logger.warning("commands: %s %s failed: %s: %s", job.verb, job.request_id, error["code"],
                           error["message"])
        ack = self.ack(job, state, result=result, error=error)
        self.record.save(ack)
        self.publish(ack)

    def refuse(self, job: Job, error: Dict[str, Any]) -> None:
        """Fail a command WITHOUT recording it: the same request id may still run later (a retry once there is
        room or tokens; the operator's signed command after an unsigned one took its id). Logged without
        flooding: a hostile stream of these must not bury the journal."""
        self.count_failed(error["code"])
        self._drop_log.log(logging.WARNING, "refused:" + error["code"], "commands: %s %s refused (not recorded): "
                           "%s: %s", job.verb, job.request_id, error["code"], error["message"])
        self.publish(self.ack(job, FAILED, error=error))

    def publish(self, ack: Dict[str, Any]) -> None:
        key = (str(ack.get("verb")), str(ack.get("state")))
        with self._lock:
            self._acks[key] = self._acks.get(key, 0) + 1
        self.transport.publish_ack(ack["request_id"], ack)

    def answer_duplicate(self, recorded: Dict[str, Any], request_id: str, verb: str) -> None:
        self.count("duplicates")
        if recorded.get("verb") != verb:
            self.count_failed("duplicate_request_id")
            self.publish(self.ack(Job(request_id, verb, None), FAILED, error=error_body(
                "duplicate_request_id",
                "request_id %s was already used for %r" % (request_id, recorded.get("verb")), "request_id")))
            return
        logger.info("commands: %s %s is a retry; answering from its record (%s)", verb, request_id,
                    recorded.get("state"))
        self.publish(dict(recorded, replayed=True))

    def reject_unparsed(self, payload: bytes, verb: str, code: str, message: str) -> None:
        """Fail a message we do not parse: ack it if its head names a request id, else count the drop."""
        request_id = peek_request_id(payload)
        if request_id is None:
            self.drop(code, verb)
            return
        self.count_failed(code)
        self.publish(self.ack(Job(request_id, verb, None), FAILED, error=error_body(code, message)))

    # -- counters -------------------------------------------------------------------------------------------

    def count(self, name: str) -> None:
        """One more of :data:`COUNTERS`."""
        with self._lock:
            self._counters[name] += 1

    def drop(self, reason: str, where: str) -> None:
        with self._lock:
            self._dropped[reason] = self._dropped.get(reason, 0) + 1
        # Counted always; logged without flooding (a hostile stream must not bury the journal).
        self._drop_log.log(logging.WARNING, reason, "commands: dropped a message on %s: %s (no request_id to "
                           "answer)", where[:120], reason)

    def count_failed(self, code: str) -> None:
        with self._lock:
            self._failed[code] = self._failed.get(code, 0) + 1

    def counts(self) -> Dict[str, Any]:
        """The counters; failed and dropped by code/reason."""
        with self._lock:
            result: Dict[str, Any] = dict(self._counters)
            result["failed"] = dict(self._failed)
            result["dropped"] = dict(self._dropped)
        return result

    def acks(self) -> Dict[Tuple[str, str], int]:
        """Acks published, by (verb, state): accepted, succeeded, failed... (the metrics endpoint's commands)."""
        with self._lock:
            return dict(self._acks)
