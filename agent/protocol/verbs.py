"""The verb table: every command the box takes, in one place.

One :class:`Verb` per command names its request type (:mod:`agent.protocol.requests`), whether it runs on the
control worker, whether a group topic may carry it by default, the method of the daemon's handlers that runs it
(:class:`agent.commands.handlers.CommandHandlers`) and a line of help. Everything else is derived from here: the
dispatcher's checks and workers, the handlers' registration (:func:`agent.commands.dispatcher.handlers_of`),
the check of ``commands.group_verbs`` (:func:`check_group_verbs`, run by ``atlas-edge validate`` and at start)
and ``atlas-edge ctl``'s choices and help. Adding a verb is one entry here plus its handler method.

The config layer sits below this one (the schema engine lives there), so ``commands.group_verbs`` cannot name
its choices itself: an unset value means :func:`default_group_verbs`, and a set one is judged by
:func:`check_group_verbs` wherever a daemon config is about to be used.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from agent.config.schema import ConfigError, FieldError, parse
from agent.protocol.requests import (
    ENVELOPE_KEYS,
    ConfigRequest,
    DeployRequest,
    NoFields,
    RollbackRequest,
    ShadowRequest,
    ShadowStopRequest,
    request_fields,
)

GROUP_VERBS_FIELD = "commands.group_verbs"

# The verbs' names: the last level of their command topics. Code on either side names a verb by these constants,
# never by a literal (tests/project/test_protocol_literals.py).
STATUS, VALIDATE, SET_CONFIG, DEPLOY, ROLLBACK = "status", "validate", "set-config", "deploy", "rollback"
PAUSE, RESUME, SNAPSHOT, RESTART, CANCEL = "pause", "resume", "snapshot", "restart", "cancel"
SHADOW, SHADOW_STOP = "shadow", "shadow-stop"


@dataclass(frozen=True)
class Verb:
    name: str  # the last level of its command topic, ``.../cmd/<name>``
    request: Type[Any]  # what its payload may hold, parsed before the command is accepted
    handler: str  # the method of the daemon's handlers that runs it: ``method(request, progress) -> dict``
    help: str  # one line, for ``ctl --help``
    control: bool = False  # on the control worker: answered (and can cancel) while a deploy runs
    long: bool = False  # on a worker of its own: its download and unpack never hold the verbs behind it
    group_safe: bool = False  # in commands.group_verbs by default: safe on every box of a group at once


def _table(*verbs: Verb) -> "OrderedDict[str, Verb]":
    return OrderedDict((verb.name, verb) for verb in verbs)


VERB_TABLE: "OrderedDict[str, Verb]" = _table(
    Verb(STATUS, NoFields, "status_command", "the box's live status (model, slots, counters)",
         control=True, group_safe=True),
    Verb(VALIDATE, ConfigRequest, "validate", "check a partial config against the running one; nothing changes"),
    Verb(SET_CONFIG, ConfigRequest, "set_config", "change live sections (thresholds, batching, publish, "
         "sources), kept across restarts"),
    Verb(DEPLOY, DeployRequest, "deploy", "verify, load and switch to a bundle (A/B slots, probation)",
         long=True),
    Verb(ROLLBACK, RollbackRequest, "rollback", "go back to the other slot's model", control=True),
    Verb(PAUSE, NoFields, "pause_command", "stop serving frames (stale ones are dropped)",
         control=True, group_safe=True),
    Verb(RESUME, NoFields, "resume_command", "serve frames again", control=True, group_safe=True),
    Verb(SNAPSHOT, NoFields, "snapshot", "publish the latest frame, annotated, as a JPEG"),
    Verb(RESTART, NoFields, "restart", "restart the daemon (systemd brings it back)"),
    Verb(CANCEL, NoFields, "cancel", "stop a running deploy at its next check", control=True, group_safe=True),
    Verb(SHADOW, ShadowRequest, "shadow", "run a candidate bundle beside the serving model on live frames and "
         "report their agreement; nothing is published or switched", long=True),
    Verb(SHADOW_STOP, ShadowStopRequest, "shadow_stop", "end a shadow run now (its final report), or discard a "
         "finished run's candidate", control=True),
)


def verb_names() -> Tuple[str, ...]:
    """Every verb, in the table's order (read at call time: a verb added to the table is known at once)."""
    return tuple(VERB_TABLE)


def control_verbs() -> Tuple[str, ...]:
    return tuple(name for name, verb in VERB_TABLE.items() if verb.control)


def long_verbs() -> Tuple[str, ...]:
    return tuple(name for name, verb in VERB_TABLE.items() if verb.long)


def default_group_verbs() -> Tuple[str, ...]:
    """What a group topic carries when ``commands.group_verbs`` is not set."""
    return tuple(name for name, verb in VERB_TABLE.items() if verb.group_safe)


def check_group_verbs(names: Optional[Sequence[str]]) -> Tuple[str, ...]:
    """``commands.group_verbs`` resolved (None: the default); ConfigError naming the field for an unknown verb."""
    if names is None:
        return default_group_verbs()
    errors = [FieldError("%s[%d]" % (GROUP_VERBS_FIELD, i), "unknown verb %r (known: %s)" % (
        name, ", ".join(verb_names()))) for i, name in enumerate(names) if name not in VERB_TABLE]
    if errors:
        raise ConfigError(errors)
    return tuple(names)


def verbs_help() -> str:
    """One line per verb (``ctl --help``)."""
    width = max(len(name) for name in VERB_TABLE)
    lines = ["verbs ([control]: answered while a deploy runs; [group]: allowed on a group topic by default):"]
    for verb in VERB_TABLE.values():
        where = ", ".join(w for w, on in (("control", verb.control), ("group", verb.group_safe)) if on)
        lines.append("  %-*s  %s%s" % (width, verb.name, verb.help, " [%s]" % where if where else ""))
    return "\n".join(lines)


def parse_request(verb: str, payload: Mapping[str, Any]) -> Any:
    """The typed request of ``verb`` from a command's payload (envelope keys left out).

    Raises :class:`agent.config.schema.ConfigError` naming every bad field; KeyError for an unknown verb.
    """
    fields = {k: v for k, v in payload.items() if k not in ENVELOPE_KEYS}
    return parse(VERB_TABLE[verb].request, fields, verb)


def command_payload(verb: str, request: Any, request_id: str) -> Dict[str, Any]:
    """The JSON body of command ``verb`` carrying ``request`` (an instance of the verb's request type).

    The operator's side builds every command through here, so what it sends is what :func:`parse_request` on
    the box reads back; a request of another verb's type is a TypeError on the operator's machine.
    """
    expected = VERB_TABLE[verb].request
    if type(request) is not expected:
        raise TypeError("verb %r takes a %s, not a %s" % (verb, expected.__name__, type(request).__name__))
    body = request_fields(request)
    body["request_id"] = request_id
    return body


def request_types() -> Dict[str, Type[Any]]:
    """Verb -> its request type."""
    return {name: verb.request for name, verb in VERB_TABLE.items()}


def missing_handlers(target: Any) -> List[str]:
    """The verbs whose handler method ``target`` lacks (a handler object must run every verb of the table)."""
    return [name for name, verb in VERB_TABLE.items() if not callable(getattr(target, verb.handler, None))]
