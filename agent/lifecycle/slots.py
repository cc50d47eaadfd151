"""The A/B slot table: which bundle each slot holds, which one serves, and which one is still on probation.

It lives in ``<state_dir>/slots.json`` and is the one thing a restart trusts, so it is written atomically
(temp file in the same directory, fsync, ``os.replace``, fsync of the directory): after a crash or a power cut
the file holds the old table or the new one, never half of either. The model manager writes ``pending`` here
*before* it switches to a new model, so a process that dies during the observation window comes back on the
confirmed slot.

Slot states:

- ``confirmed``: the known-good model; it serves, or (while another slot is pending) is the rollback target.
- ``pending``: serving under observation; becomes ``confirmed`` after a healthy window, else is rolled back.
- ``standby``: the previously confirmed bundle, kept on disk for an operator's ``rollback``.
- ``empty``: nothing (never filled, or its bundle was rolled back and removed).
"""

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from agent._util.atomic import atomic_write
from agent.config.schema import ConfigError, FieldError, parse, setting, to_dict

SLOT_NAMES = ("a", "b")
STATE_FILE = "slots.json"
STATE_SCHEMA = 1
CONFIRMED, PENDING, STANDBY, EMPTY = "confirmed", "pending", "standby", "empty"
SLOT_STATES = (CONFIRMED, PENDING, STANDBY, EMPTY)


class SlotStateError(ConfigError):
    """The slot file exists but cannot be trusted; ``errors`` name the field."""


def utc_now() -> str:
    """Wall-clock time for humans (acks, status); the observation window itself runs on a monotonic clock."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Slot:
    state: str = setting(EMPTY, choices=SLOT_STATES)
    bundle: Optional[str] = setting(None, doc="bundle directory, relative to the bundle store")
    manifest_sha256: Optional[str] = setting(None, doc="sha256 of the bundle's manifest.json")
    name: Optional[str] = setting(None, doc="manifest name")
    version: Optional[str] = setting(None, doc="manifest version")
    since: Optional[str] = setting(None, doc="UTC time the slot entered its state")

    def check(self) -> List[Tuple[str, str]]:
        if self.state != EMPTY and not (self.bundle and self.manifest_sha256):
            return [("bundle", "a %s slot needs bundle and manifest_sha256" % self.state)]
        return []

    def identity(self) -> Dict[str, Any]:
        """Which model this is, as events and acks name it."""
        return {"name": self.name, "version": self.version, "manifest_sha256": self.manifest_sha256}

    def public(self) -> Dict[str, Any]:
        """The form shown in ``status`` acks (the store path is an implementation detail)."""
        return {"state": self.state, "name": self.name, "version": self.version,
                "manifest_sha256": self.manifest_sha256, "since": self.since}


@dataclass(frozen=True)
class Rejection:
    """The last model that was rolled back: kept in the table so ``status`` can say why after a restart."""

    name: Optional[str]
    version: Optional[str]
    manifest_sha256: Optional[str]
    reason: str
    at: str


@dataclass(frozen=True)
class SlotTable:
    serving: str = setting(choices=SLOT_NAMES, doc="the slot whose model serves")
    slots: Dict[str, Slot] = setting(doc="a and b")
    schema: int = setting(STATE_SCHEMA, choices=(STATE_SCHEMA,))
    last_rollback: Optional[Rejection] = None

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if sorted(self.slots) != sorted(SLOT_NAMES):
            problems.append(("slots", "must hold exactly %s (got %s)" % (
                list(SLOT_NAMES), sorted(self.slots))))
            return problems
        states = [self.slots[name].state for name in SLOT_NAMES]
        if states.count(CONFIRMED) != 1:
            problems.append(("slots", "exactly one slot must be confirmed (got %s)" % states))
        if states.count(PENDING) > 1:
            problems.append(("slots", "at most one slot may be pending"))
        serving_state = self.slots[self.serving].state
        if serving_state not in (CONFIRMED, PENDING):
            problems.append(("serving", "slot %s is %s, not confirmed or pending" % (
                self.serving, serving_state)))
        if PENDING in states and serving_state != PENDING:
            problems.append(("serving", "a pending slot must be the serving one"))
        return problems

    # --- queries ------------------------------------------------------------------------------------------

    def slot_in(self, state: str) -> Optional[str]:
        for name in SLOT_NAMES:
            if self.slots[name].state == state:
                return name
        return None

    @property
    def confirmed(self) -> str:
        name = self.slot_in(CONFIRMED)
        assert name is not None  # check() guarantees one
        return name

    @property
    def pending(self) -> Optional[str]:
        return self.slot_in(PENDING)

    def bundles(self) -> List[str]:
        """Store-relative bundle directories the table refers to (what the store must keep)."""
        return [s.bundle for s in self.slots.values() if s.bundle]

    def public(self) -> Dict[str, Any]:
        result: Dict[str, Any] = {"serving": self.serving,
                                  "slots": {name: self.slots[name].public() for name in SLOT_NAMES}}
        if self.last_rollback is not None:
            result["last_rollback"] = to_dict(self.last_rollback)
        return result

    # --- transitions (each returns a new, checked table; the caller persists it) ---------------------------

    def with_slot(self, name: str, slot: Slot) -> "SlotTable":
        return replace(self, slots={**self.slots, name: slot})


def other_slot(name: str) -> str:
    return SLOT_NAMES[1 - SLOT_NAMES.index(name)]


def filled_slot(state: str, bundle: str, manifest_sha256: str, name: str, version: str) -> Slot:
    return Slot(state=state, bundle=bundle, manifest_sha256=manifest_sha256, name=name, version=version,
                since=utc_now())


def first_table(slot: Slot) -> SlotTable:
    """The table of a first start: the configured bundle confirmed in slot a, slot b empty."""
    return SlotTable(serving=SLOT_NAMES[0], slots={SLOT_NAMES[0]: slot, SLOT_NAMES[1]: Slot()})


def with_pending(table: SlotTable, slot: str, new: Slot) -> SlotTable:
    """``slot`` takes the new bundle as pending and serves; the confirmed slot stays the rollback target."""
    if table.pending is not None:
        raise ValueError("slot %s is already pending" % table.pending)
    if slot == table.confirmed:
        raise ValueError("slot %s is the confirmed slot" % slot)
    return validated(replace(table, serving=slot).with_slot(slot, replace(new, state=PENDING)))


def with_confirmed(table: SlotTable) -> SlotTable:
    """The pending slot becomes confirmed; the old confirmed one becomes standby (the operator's way back)."""
    pending = table.pending
    if pending is None:
        raise ValueError("no slot is pending")
    old = table.confirmed
    now = utc_now()
    table = table.with_slot(old, replace(table.slots[old], state=STANDBY, since=now))
    return validated(table.with_slot(pending, replace(table.slots[pending], state=CONFIRMED, since=now)))


def with_rolled_back(table: SlotTable, reason: str) -> SlotTable:
    """Undo a pending slot: it is emptied and remembered as rejected; the confirmed slot serves again."""
    pending = table.pending
    if pending is None:
        raise ValueError("no slot is pending")
    bad = table.slots[pending]
    rejection = Rejection(name=bad.name, version=bad.version, manifest_sha256=bad.manifest_sha256,
                          reason=reason, at=utc_now())
    table = replace(table, serving=table.confirmed, last_rollback=rejection)
    return validated(table.with_slot(pending, Slot()))


def with_swapped(table: SlotTable) -> SlotTable:
    """No slot pending: the standby (previously confirmed) slot is confirmed again and serves; roles swap."""
    if table.pending is not None:
        raise ValueError("slot %s is pending" % table.pending)
    standby = table.slot_in(STANDBY)
    if standby is None:
        raise ValueError("no standby slot")
    old = table.confirmed
    now = utc_now()
    table = table.with_slot(old, replace(table.slots[old], state=STANDBY, since=now))
    table = table.with_slot(standby, replace(table.slots[standby], state=CONFIRMED, since=now))
    return validated(replace(table, serving=standby))


def with_lost(table: SlotTable, slot: str, reason: str) -> SlotTable:
    """``slot``'s bundle is gone (damaged, set aside): it is emptied; if it was confirmed, the standby takes over.

    Raises ValueError when that would leave no confirmed slot: the caller then starts from the configured bundle.
    """
    if table.slots[slot].state == CONFIRMED:
        standby = table.slot_in(STANDBY)
        if standby is None:
            raise ValueError("slot %s is confirmed and no standby slot is kept" % slot)
        now = utc_now()
        table = replace(table, serving=standby).with_slot(standby, replace(table.slots[standby], state=CONFIRMED,
                                                                           since=now))
    lost = table.slots[slot]
    rejection = Rejection(name=lost.name, version=lost.version, manifest_sha256=lost.manifest_sha256,
                          reason=reason, at=utc_now())
    return validated(replace(table, last_rollback=rejection).with_slot(slot, Slot()))


def validated(table: SlotTable) -> SlotTable:
    """Re-check a table built in code: a transition must never produce a table that a restart would reject."""
    return parse(SlotTable, to_dict(table), "slot table")


# --- persistence --------------------------------------------------------------------------------------

def load_slots(path: str) -> Optional[SlotTable]:
    """The persisted table, or None when there is none; SlotStateError naming file and field if corrupt."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise SlotStateError([FieldError("", "not valid JSON: %s" % exc)], path) from None
    try:
        return parse(SlotTable, data, path)
    except ConfigError as exc:
        raise SlotStateError(exc.errors, path) from None


def save_slots(path: str, table: SlotTable) -> None:
    """Write atomically and durably (see :mod:`agent._util.atomic`): a power cut leaves the old table or the new."""
    atomic_write(path, json.dumps(to_dict(table), indent=2, sort_keys=True) + "\n")
