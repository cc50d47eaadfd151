"""A rollout's state, typed: each box's record, its phase and outcome, its revert, the rollout's own fields
(:class:`RolloutRecord`) and status, and a box's state as the operator sees it (:class:`BoxState`).

Every state a rollout can be in is a member of one enum here, valued by the string the state file has always
held: a member *is* that string (``Outcome.CONFIRMED == "confirmed"``), so the journal's JSON stays readable
and a state file written before these types existed loads unchanged. The engine's rooms (``intake``,
``judge``, ``revert``, ``rollout``, ``report``) read and change a :class:`BoxRecord` only through
:meth:`agent.fleet.journal.RolloutState.set`, which journals the change in that same JSON form.
"""

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Callable, Dict, List, Optional

from agent.protocol import messages
from agent.protocol.status import SlotView


class Named(str, Enum):
    """A state that is its own string: written to JSON, printed and compared as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:  # 3.11 would format the member's name ("Outcome.CONFIRMED")
        return format(str(self.value), spec)


class BoxState(Named):
    """A box as the operator sees it (``fleet status``'s STATE; :class:`agent.fleet.status.BoxView`)."""

    ONLINE = messages.ONLINE  # its status says online (and it was heard lately, or its status is recent)
    OFFLINE = messages.OFFLINE  # its status says offline: stopped, or its last will
    STALE = "stale"  # said online, but not heard live and silent for a few telemetry intervals
    UNKNOWN = "unknown"  # recorded earlier (or heard of without a status), not heard from this time
    MALFORMED = "malformed"  # its status does not have the documented shape: shown with the reason


class Phase(Named):
    """Where a box is in its rollout: planned, sent a deploy, deployed (awaiting confirmation), done."""

    PLANNED = "planned"
    SENT = "sent"
    DEPLOYED = "deployed"
    DONE = "done"


class Outcome(Named):
    """How a box's rollout ended. EXECUTED ones count towards the failure rate; FAILURES are the failed ones."""

    CONFIRMED = "confirmed"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    TIMED_OUT = "timed_out"
    MALFORMED = "malformed"
    DUPLICATE = "duplicate"
    ABORTED = "aborted"
    CANCELLED = "cancelled"
    OFFLINE = "offline"
    ALREADY = "already"
    NOT_STARTED = "not_started"
    NOT_TARGETED = "not_targeted"
    UNSEEN = "unseen"
    DISAGREEMENT = "disagreement"  # a gated rollout's shadow run measured the candidate below --min-agreement
    NO_SHADOW = "no_shadow"  # a gated rollout's box does not know the shadow verb (an older agent): never deployed


FAILURES = (Outcome.FAILED, Outcome.ROLLED_BACK, Outcome.TIMED_OUT, Outcome.MALFORMED, Outcome.DUPLICATE,
            Outcome.DISAGREEMENT, Outcome.NO_SHADOW)
EXECUTED = (Outcome.CONFIRMED,) + FAILURES
REACHED = (Outcome.CONFIRMED, Outcome.ALREADY, Outcome.NOT_TARGETED)  # what a completed rollout leaves


class RevertState(Named):
    """A moved box being put back: its rollback sent, answered (the box's ack state), or why not."""

    SENT = "sent"
    SUCCEEDED = messages.SUCCEEDED  # the box's final answer to the rollback (its ack's state)
    FAILED = messages.FAILED
    NOTHING = "nothing"  # it never moved: nothing to put back
    UNKNOWN = "unknown"  # not settled by --revert-timeout, and no rollback was sent
    TIMED_OUT = "timed_out"  # a rollback was sent and not answered by --revert-timeout


SETTLED_REVERTS = (RevertState.SUCCEEDED, RevertState.FAILED, RevertState.NOTHING)  # a re-run leaves these


class RolloutStatus(Named):
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    PARTIAL = "partial"
    ABORTED = "aborted"
    CANCELLED = "cancelled"


FINISHED = (RolloutStatus.COMPLETED, RolloutStatus.PARTIAL, RolloutStatus.ABORTED, RolloutStatus.CANCELLED)


class RevertWish(Named):
    """The rollout's ``revert`` field: moved boxes are to go back (``wanted``), or have been (``done``)."""

    WANTED = "wanted"
    DONE = "done"


MODEL_KEYS = ("name", "version", "manifest_sha256")


def identity(entry: Any) -> Dict[str, Any]:
    """A model as a record keeps it: name, version and manifest (of a slot, a ``ModelId`` or their JSON form)."""
    if isinstance(entry, dict):
        return {k: entry.get(k) for k in MODEL_KEYS}
    return {k: getattr(entry, k, None) for k in MODEL_KEYS}


def _optional(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else kind(value)


@dataclass
class Revert:
    """A box's revert: the rollback's request id and state, what the box went back to, or why not."""

    state: RevertState
    request_id: Optional[str] = None
    sent_at: Optional[float] = None
    finished_at: Optional[float] = None
    to: Optional[Dict[str, Any]] = None  # the model it serves after the rollback (identity())
    error: Optional[str] = None
    note: Optional[str] = None

    @classmethod
    def from_dict(cls, data: Any) -> "Revert":
        if isinstance(data, Revert):
            return data
        if not isinstance(data, dict):
            raise ValueError("a revert is an object, not %r" % (data,))
        return cls(**dict(data, state=RevertState(data.get("state"))))

    def as_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class BoxRecord:
    """One box in the state file. ``request_id`` is its current deploy's (a retry gets a new one)."""

    wave: Optional[int] = None  # index into the plan's waves; None: not sent anything by this rollout
    phase: Phase = Phase.DONE
    outcome: Optional[Outcome] = None  # None while it is planned or in flight
    error: Optional[str] = None
    attempt: int = 0  # retries sent so far (busy, interrupted)
    old: Optional[Dict[str, Any]] = None  # what it served at the plan (identity())
    new: Optional[Dict[str, Any]] = None  # what it serves now, once deployed
    baseline_rollback: Optional[Dict[str, Any]] = None  # its last_rollback at the plan: a new one is ours
    anomalies: List[str] = field(default_factory=list)  # what it sent that did not count (latest few)
    request_id: Optional[str] = None
    sent_at: Optional[float] = None  # wall times
    deployed_at: Optional[float] = None
    finished_at: Optional[float] = None
    revert: Optional[Revert] = None
    waits: bool = False  # offline at the plan: sent once back online, within --wait-offline
    serving: Optional[Dict[str, Any]] = None  # what it serves at the end, read by the final check (final.py)
    # A gated rollout's shadow run on this box (shadow.py): request_id, sent_at, and once judged its verdict
    # ("agrees" / "disagrees") with the figures it rests on
    shadow: Optional[Dict[str, Any]] = None

    @classmethod
    def planned(cls, request: Optional[str], serving: Optional[SlotView] = None,
                last_rollback: Optional[Dict[str, Any]] = None, **changes: Any) -> "BoxRecord":
        """A box's record at the plan, from what its status says it serves and its last rollback, when known."""
        record = cls(request_id=request, old=identity(serving) if serving is not None else None,
                     baseline_rollback=last_rollback)
        record.update(**changes)
        return record

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "BoxRecord":
        """A record as the state file holds it (ValueError naming what does not fit)."""
        record = cls()
        record.update(**data)
        return record

    def update(self, **changes: Any) -> Dict[str, Any]:
        """Change fields (states given as strings become members); returns the changes in their JSON form."""
        for name, value in changes.items():
            if name not in _FIELDS:
                raise ValueError("a box record has no field %r" % name)
            setattr(self, name, _COERCE.get(name, _same)(value))
        return {name: _plain(getattr(self, name)) for name in changes}

    def as_dict(self) -> Dict[str, Any]:
        return {name: _plain(getattr(self, name)) for name in _FIELDS}


def _same(value: Any) -> Any:
    return value


def _plain(value: Any) -> Any:
    return value.as_dict() if isinstance(value, Revert) else value


_FIELDS = tuple(f.name for f in fields(BoxRecord))
_COERCE: Dict[str, Callable[[Any], Any]] = {
    "phase": Phase, "outcome": _optional(Outcome), "revert": _optional(Revert.from_dict)}


STATE_SCHEMA = 2  # the state file's version (agent/fleet/journal.py)


@dataclass
class RolloutRecord:
    """The rollout's own fields in the state file, beside its boxes (``journal.py`` keeps both).

    Loaded from the JSON the state file has always held (:meth:`from_dict`; states given as strings become
    members), changed through :meth:`update` (what :meth:`agent.fleet.journal.RolloutState.top` journals), and
    written back by :meth:`as_dict`. A key this version does not know (a newer version's) is kept in ``extra``
    and written back as it was.
    """

    rollout_id: str
    spec: Dict[str, Any]  # the RolloutSpec's fields (a re-run must ask the same)
    status: RolloutStatus = RolloutStatus.RUNNING
    waves: List[List[str]] = field(default_factory=list)  # device ids per wave, the canary first
    schema: int = STATE_SCHEMA
    runs: int = 0  # runs of the command that drove it
    started: Optional[float] = None  # wall times
    finished: Optional[float] = None
    updated: Optional[float] = None  # when the snapshot was last rewritten
    abort: Optional[Dict[str, Any]] = None  # reason, wave (index), at
    cancel: Optional[Dict[str, Any]] = None  # at, revert, after (the status a finished rollout had)
    revert: Optional[RevertWish] = None  # moved boxes are to go back, or have been
    approved: bool = False  # 'fleet resume' approved the waves after the canary
    shortfall: Optional[str] = None  # fewer boxes heard than --expect
    late_wave: Optional[int] = None  # the wave boxes that announced themselves after the plan go to
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "RolloutRecord":
        """The rollout's fields as the state file holds them (``boxes`` left out); ValueError naming what does
        not fit (a state that is not a member of its enum, a missing field)."""
        missing = [name for name in ("rollout_id", "spec") if name not in data]
        if missing:
            raise ValueError("the rollout lacks %s" % ", ".join(missing))
        record = cls(rollout_id=data["rollout_id"], spec=data["spec"])
        record.update(**{k: v for k, v in data.items() if k in _ROLLOUT_FIELDS and k != "extra"})
        record.extra = {k: v for k, v in data.items() if k not in _ROLLOUT_FIELDS and k != "boxes"}
        return record

    def update(self, **changes: Any) -> Dict[str, Any]:
        """Change fields (states given as strings become members); returns the changes in their JSON form."""
        for name, value in changes.items():
            if name not in _ROLLOUT_FIELDS or name == "extra":
                raise ValueError("a rollout has no field %r" % name)
            setattr(self, name, _ROLLOUT_COERCE.get(name, _same)(value))
        return {name: getattr(self, name) for name in changes}

    def as_dict(self) -> Dict[str, Any]:
        data = dict(self.extra)
        data.update({name: getattr(self, name) for name in _ROLLOUT_FIELDS if name != "extra"})
        return data


_ROLLOUT_FIELDS = tuple(f.name for f in fields(RolloutRecord))
_ROLLOUT_COERCE: Dict[str, Callable[[Any], Any]] = {"status": RolloutStatus, "revert": _optional(RevertWish)}
