"""Ack states, request ids, the error body, and typed readers for what an operator receives.

An ack (on ``<prefix>/<device>/ack/<request_id>``) moves ``accepted`` -> ``in_progress`` -> ``succeeded`` |
``failed``::

    {"request_id": "r1", "verb": "deploy", "state": "failed", "ts": 1700000000.0,
     "error": {"code": "invalid", "field": "bundle", "message": "...",
               "errors": [{"field": "bundle", "message": "..."}]}}

:func:`parse_ack` (and :func:`agent.protocol.status.parse_status`) turn a received JSON body into
:class:`Ack` (:class:`~agent.protocol.status.BoxStatus`) or raise :class:`ProtocolError` naming the field, so
an operator's tool reports a malformed message instead of crashing on it. Both ignore keys they do not know: a
newer box may add fields, and an older tool must still read the ones it knows.
"""

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from agent._util.redact import redact
from agent.config.schema import ConfigError, parse, setting

ACCEPTED = "accepted"
IN_PROGRESS = "in_progress"
SUCCEEDED = "succeeded"
FAILED = "failed"
ACK_STATES = (ACCEPTED, IN_PROGRESS, SUCCEEDED, FAILED)
FINAL_STATES = (SUCCEEDED, FAILED)

ONLINE, OFFLINE = "online", "offline"

# request_id ends up in a topic: a bounded, topic-safe charset (no '/', '+', '#', spaces or control bytes).
REQUEST_ID_MAX = 64
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,%d}\Z" % REQUEST_ID_MAX)
REQUEST_ID_RULE = "1-%d characters of A-Z a-z 0-9 _ . : -" % REQUEST_ID_MAX
# Recover a request id from a payload we will not parse (too large, rate-limited) or cannot (bad JSON),
# looking only at its head, so that the operator still gets a failed ack instead of a timeout.
_REQUEST_ID_PEEK = re.compile(rb'"request_id"\s*:\s*"([A-Za-z0-9_.:-]{1,%d})"' % REQUEST_ID_MAX)
PEEK_BYTES = 4096
MESSAGE_MAX_CHARS = 300  # error messages are cut to this in acks
ERRORS_MAX = 10  # entries of error.errors in an ack (and so in the request record); the rest are counted


# Nesting deeper than this is refused before parsing: Python's parser recurses per level, and its limit is the
# interpreter's (1000 by default, 10000 once MindSpore is imported), so a deep payload would otherwise be a
# RecursionError in one process and a parsed structure for later code to recurse on in another.
JSON_DEPTH_MAX = 32
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def decode_json(payload: bytes) -> Any:
    """A message body parsed as UTF-8 JSON; ValueError (UnicodeDecodeError is one) when it is not, or when it
    nests deeper than ``JSON_DEPTH_MAX`` (judged before the parser runs, outside strings)."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', payload)):
        depth += 1 if bracket.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    if deepest > JSON_DEPTH_MAX:
        raise ValueError("JSON nested %d levels deep; at most %d are accepted" % (deepest, JSON_DEPTH_MAX))
    return json.loads(payload.decode("utf-8"))


def is_request_id(value: Any) -> bool:
    return isinstance(value, str) and REQUEST_ID_RE.match(value) is not None


def peek_request_id(payload: bytes) -> Optional[str]:
    """A well-formed request id from the head of a payload we will not fully parse, or None."""
    match = _REQUEST_ID_PEEK.search(payload[:PEEK_BYTES])
    return match.group(1).decode("ascii") if match else None


def error_body(code: str, message: str, field: Optional[str] = None,
               errors: Optional[List[Dict[str, str]]] = None) -> Dict[str, Any]:
    """The ``error`` object of a failed ack.

    ``errors`` keeps its first :data:`ERRORS_MAX` entries (each message cut short) and one that counts the rest:
    a refusal's size must not grow with the input (an archive of 200,000 unlisted files made a 3.45 MB ack,
    stored whole in the request record).
    """
    # Redacted here, the one way into acks, the request record and the log line of a failure: a refused value
    # (a URI in a number's place) is repeated by the schema's message.
    body: Dict[str, Any] = {"code": code, "field": field, "message": redact(message)[:MESSAGE_MAX_CHARS]}
    if errors is not None:
        kept = [{"field": str(e.get("field"))[:MESSAGE_MAX_CHARS], "message": redact(str(e.get("message")))[
            :MESSAGE_MAX_CHARS]} for e in errors[:ERRORS_MAX]]
        if len(errors) > ERRORS_MAX:
            kept.append({"field": kept[-1]["field"], "message": "and %d more" % (len(errors) - ERRORS_MAX)})
        body["errors"] = kept
    return body


def invalid_body(exc: ConfigError) -> Dict[str, Any]:
    """The ``invalid`` error of a payload the schema refused: every bad field, and the field when only one."""
    errors = exc.as_list()
    field = errors[0]["field"] if len(errors) == 1 else None
    return error_body("invalid", str(exc), field, errors)


def ack_message(request_id: str, verb: str, state: str, result: Optional[Dict[str, Any]] = None,
                error: Optional[Dict[str, Any]] = None, message: Optional[str] = None) -> Dict[str, Any]:
    """One ack as the box publishes it."""
    ack: Dict[str, Any] = {"request_id": request_id, "verb": verb, "state": state, "ts": time.time()}
    if message is not None:
        ack["message"] = message
    if result is not None:
        ack["result"] = result
    if error is not None:
        ack["error"] = error
    return ack


class ProtocolError(ValueError):
    """A received message that does not have the protocol's shape; ``field`` names the first bad one."""

    def __init__(self, what: str, exc: ConfigError) -> None:
        errors = exc.as_list()
        self.field = errors[0]["field"] if errors else None
        self.errors = errors
        details = "; ".join("%s: %s" % (e["field"] or "<root>", e["message"]) for e in errors)
        super().__init__("malformed %s: %s" % (what, details))


@dataclass(frozen=True)
class FieldProblem:
    field: Optional[str] = None
    message: str = ""


@dataclass(frozen=True)
class AckError:
    code: str = setting(doc="machine-readable reason (docs/mqtt.md lists them)")
    message: str = ""
    field: Optional[str] = None
    errors: Optional[List[FieldProblem]] = None


@dataclass(frozen=True)
class Ack:
    request_id: str
    verb: str
    state: str = setting(choices=ACK_STATES)
    ts: Optional[float] = None
    message: Optional[str] = None
    result: Optional[Dict[str, Any]] = None
    error: Optional[AckError] = None
    replayed: bool = False

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if not is_request_id(self.request_id):
            problems.append(("request_id", "must be %s" % REQUEST_ID_RULE))
        if self.state == FAILED and self.error is None:
            problems.append(("error", "required in a failed ack"))
        return problems

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def error_text(self) -> str:
        """``code: message`` of a failed ack, for a report line."""
        return "%s: %s" % (self.error.code, self.error.message) if self.error is not None else ""


def parse_ack(body: Any) -> Ack:
    """An ack from its decoded JSON; raises :class:`ProtocolError` naming the field when it is malformed."""
    try:
        return parse(Ack, body, "ack", unknown="ignore")
    except ConfigError as exc:
        raise ProtocolError("ack", exc) from None


@dataclass(frozen=True)
class ModelId:
    """Which model: what a deploy's or rollback's result, a slot and a rollback name."""

    name: Optional[str] = None
    version: Optional[str] = None
    manifest_sha256: Optional[str] = None


@dataclass(frozen=True)
class DeployResult:
    """The ``result`` of a succeeded ``deploy`` or ``rollback``: the model the box now serves."""

    model: ModelId
    slot: Optional[str] = None
    state: Optional[str] = None


def parse_deploy_result(ack: Ack) -> DeployResult:
    """A succeeded deploy's or rollback's result; :class:`ProtocolError` naming the field when it has none."""
    try:
        return parse(DeployResult, ack.result if ack.result is not None else {}, "result", unknown="ignore")
    except ConfigError as exc:
        raise ProtocolError("%s result" % ack.verb, exc) from None
