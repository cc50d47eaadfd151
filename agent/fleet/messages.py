"""What a box sends the operator, parsed by the schema engine: a retained status and a command ack.

Anything a box publishes is input from the network: a box with a bug, an old or a hostile firmware can put
any JSON there. The fleet tools read it only through :func:`parse_status` and :func:`parse_ack`, which return
typed records or raise :class:`Malformed` naming the field, so one bad box is reported as ``malformed`` and
never stops the tools for the fleet. Keys this side does not read are ignored (a newer box may say more);
the keys it reads must have the documented types (docs/mqtt.md, docs/fleet.md).
"""

import math
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type, TypeVar

from agent.config.schema import ConfigError, parse, setting
from agent.protocol.messages import ACCEPTED, FAILED, IN_PROGRESS, REQUEST_ID_MAX, SUCCEEDED

T = TypeVar("T")
ACK_STATES = (ACCEPTED, IN_PROGRESS, SUCCEEDED, FAILED)
SLOT_STATES = ("empty", "pending", "confirmed", "standby")
ONLINE, OFFLINE = "online", "offline"


class Malformed(ValueError):
    """A box's message does not have the documented shape; the text names the field and what is wrong."""


def _finite(value: Optional[float]) -> bool:
    return value is None or math.isfinite(value)


@dataclass(frozen=True)
class ModelId:
    """Which model: what acks, slot entries and rollbacks name."""

    name: Optional[str] = None
    version: Optional[str] = None
    manifest_sha256: Optional[str] = None


@dataclass(frozen=True)
class SlotEntry:
    state: str = setting(choices=SLOT_STATES)
    name: Optional[str] = None
    version: Optional[str] = None
    manifest_sha256: Optional[str] = None
    since: Optional[str] = None


@dataclass(frozen=True)
class Rollback:
    """The box's last rollback: which model it rejected, why and when."""

    reason: str
    name: Optional[str] = None
    version: Optional[str] = None
    manifest_sha256: Optional[str] = None
    at: Optional[str] = None


@dataclass(frozen=True)
class Slots:
    """The box's slot table as its status shows it (``ModelManager.status()``)."""

    serving: Optional[str] = None
    slots: Dict[str, SlotEntry] = setting(factory=dict)
    last_rollback: Optional[Rollback] = None
    pending: Optional[Dict[str, Any]] = None

    def check(self) -> List[Tuple[str, str]]:
        if self.serving is not None and self.serving not in self.slots:
            return [("serving", "names slot %r, which the table does not hold" % self.serving)]
        return []


@dataclass(frozen=True)
class Status:
    """A box's retained status: online with its slot table, or offline (its last will, or a clean stop)."""

    state: str = setting(choices=(ONLINE, OFFLINE))
    groups: List[str] = setting(factory=list)
    device: Optional[str] = None
    model: Optional[str] = None
    backend: Optional[str] = None
    ts: Optional[float] = None
    reason: Optional[str] = None
    slots: Optional[Slots] = None

    def check(self) -> List[Tuple[str, str]]:
        return [] if _finite(self.ts) else [("ts", "must be a finite number")]


@dataclass(frozen=True)
class AckError:
    code: str
    message: Optional[str] = None
    field: Optional[str] = None


@dataclass(frozen=True)
class Ack:
    """One ack of a command; ``result`` is the verb's own (``deploy_model`` reads a deploy's or rollback's)."""

    request_id: str = setting(min_len=1)
    state: str = setting(choices=ACK_STATES)
    verb: Optional[str] = None
    ts: Optional[float] = None
    message: Optional[str] = None
    error: Optional[AckError] = None
    result: Optional[Dict[str, Any]] = None

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if len(self.request_id) > REQUEST_ID_MAX:
            problems.append(("request_id", "longer than %d characters" % REQUEST_ID_MAX))
        if self.state == FAILED and self.error is None:
            problems.append(("error", "required when state is failed"))
        if not _finite(self.ts):
            problems.append(("ts", "must be a finite number"))
        return problems


@dataclass(frozen=True)
class DeployResult:
    """What a successful ``deploy`` (or ``rollback``) says it now serves."""

    model: ModelId
    slot: Optional[str] = None
    state: Optional[str] = None


def _known(cls: Type[Any], raw: Any) -> Any:
    """``raw`` with only the keys ``cls`` declares, at every level the operator reads; other shapes unchanged."""
    if not (is_dataclass(cls) and isinstance(raw, Mapping)):
        return raw
    nested = {"slots": Slots, "last_rollback": Rollback, "error": AckError, "model": ModelId}
    kept = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if cls is Slots and f.name == "slots" and isinstance(value, Mapping):
            value = {k: _known(SlotEntry, v) for k, v in value.items()}
        elif f.name in nested and not (cls is Status and f.name == "model"):
            value = _known(nested[f.name], value)
        kept[f.name] = value
    return kept


def _parse(cls: Type[T], body: Any, what: str) -> T:
    try:
        return parse(cls, _known(cls, body), what)
    except ConfigError as exc:
        raise Malformed("; ".join(str(e) for e in exc.errors)) from None


def parse_status(body: Any) -> Status:
    """A status payload (decoded JSON) as :class:`Status`, or :class:`Malformed` naming the bad field."""
    return _parse(Status, body, "status")


def parse_ack(body: Any) -> Ack:
    """An ack payload (decoded JSON) as :class:`Ack`, or :class:`Malformed` naming the bad field."""
    return _parse(Ack, body, "ack")


def deploy_model(ack: Ack) -> ModelId:
    """The model a succeeded deploy or rollback ack says is now serving; :class:`Malformed` if it says none."""
    result = _parse(DeployResult, ack.result if ack.result is not None else {}, "result")
    return result.model
