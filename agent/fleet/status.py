"""The fleet at a glance: each box's retained status (online/offline, groups, slots) and what it said lately.

A box publishes ``<prefix>/<device>/status`` retained: ``online`` with its model, groups and slot table when it
starts and after every switch, confirm and rollback; ``offline`` (with its groups) when it stops or its
connection dies (the broker's last will). So one subscription tells an operator every box that has announced
itself, without asking any of them. Telemetry (fps) and alerts are not retained: they show up only for boxes
heard while listening; a box heard live (an announce answer, a status or its telemetry) is alive, whatever the
age of its retained status.

**One device id, two boxes.** Every box has one retained status topic, ``<prefix>/<device id>/status``. Two boxes
configured with the same id (a cloned SD card, a copied config) share it: each one's status overwrites the
other's, so the retained store shows one box. Both answer an announce, though, live and on that one topic: the
view keeps each distinct identity (groups and device kind) heard live per id, and an id with more than one is a
duplicate (:meth:`FleetView.duplicates`), shown as one row per identity. Two clones with the same groups and
kind cannot be told apart by their statuses; their answers to one request id can (``duplicate`` outcome).
"""

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from agent.config.schema import ConfigError, parse, to_dict
from agent.fleet.link import FleetLink, Message
from agent.fleet.records import BoxState
from agent.protocol.messages import JSON_DEPTH_MAX, ProtocolError
from agent.protocol.status import BoxStatus, SlotsView, SlotView, parse_status
from agent.protocol.topics import (
    ALERT,
    SHADOW,
    STATUS,
    TELEMETRY,
    announce_topic,
    fleet_subscriptions,
    split_device_topic,
)

STALE_INTERVALS = 3.0  # telemetry intervals without a word before an "online" status is not believed
DEFAULT_TELEMETRY_INTERVAL_S = 10.0  # a box's publish.telemetry_interval_s default, for statuses without it
SOURCES_KEPT = 32  # cameras per box kept from its telemetry (a box with more is shown with its first 32)
DEFAULT_LISTEN_S = 2.0  # long enough for the retained burst of a few thousand boxes and some telemetry
# The retained burst is over once no new box has appeared for this long after the SUBACK. A link that
# stalls (a congested uplink, a bridge catching up) pauses the burst for a moment: a window of a fraction of
# a second took the pause for the end and left every box behind it out of the rollout.
SETTLE_S = 2.0
# An "online" status too old to believe, from a box that did not answer the announce (one that predates it):
# its telemetry is awaited for this many of its intervals (one, and room for jitter), at most
# LIVENESS_WAIT_MAX_S, before it is judged stale.
LIVENESS_INTERVALS = 1.5
LIVENESS_WAIT_MAX_S = 15.0
ALERTS_KEPT = 5  # most recent alerts shown per box
# A slot's states as the box's slot table names them (agent/lifecycle/slots.py; docs/mqtt.md): the two the
# operator judges by.
SLOT_CONFIRMED, SLOT_PENDING = "confirmed", "pending"


@dataclass(frozen=True)
class _Groups:
    """The one part of a status that does not parse as a whole which is still read: the groups it names."""

    groups: List[str] = field(default_factory=list)


def slots_view(data: Any) -> Optional[SlotsView]:
    """A slot table as the operator's record keeps it (its JSON form), typed; None when it does not parse."""
    if not data:
        return None
    try:
        return parse(SlotsView, data, "slots", unknown="ignore")
    except ConfigError:
        return None


def slots_json(slots: Optional[SlotsView]) -> Dict[str, Any]:
    """A slot table's JSON form ({} when unknown): what ``--json`` prints and the record keeps."""
    return to_dict(slots) if slots is not None else {}


@dataclass
class BoxView:
    """One box as the operator sees it; ``slots`` is the box's slot table as its status types it (None: unknown)."""

    device: str
    state: BoxState = BoxState.UNKNOWN
    groups: List[str] = field(default_factory=list)
    model: Optional[str] = None
    backend: Optional[str] = None
    slots: Optional[SlotsView] = None
    status_ts: Optional[float] = None
    last_seen: Optional[float] = None
    fps: Optional[float] = None
    alerts: List[Dict[str, Any]] = field(default_factory=list)
    reason: Optional[str] = None
    malformed: Optional[str] = None  # why its last status was refused; its last good slot table is kept
    broker: Optional[str] = None  # the broker (of mqtt.hosts) the box said it is on
    telemetry_interval_s: Optional[float] = None
    heard_live: bool = False  # a message from it arrived live during this run (not a retained copy)
    kind: Optional[str] = None  # its device kind (the status's ``device_kind``: a device_configs/ name)
    precision: Optional[str] = None  # of the serving model's artifacts (the status's ``precision``: int8, float32)
    duplicate: bool = False  # another box answers as this device id (a row per identity: FleetView.rows)
    shadow: Optional[Dict[str, Any]] = None  # its last shadow run (docs/shadow.md), as shadow_summary() reads it
    sources: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # its cameras' health, as source_health() reads

    @property
    def online(self) -> bool:
        return self.state == BoxState.ONLINE

    def slot(self, name: Optional[str]) -> Optional[SlotView]:
        return self.slots.slots.get(name or "") if self.slots is not None else None

    @property
    def serving(self) -> Optional[SlotView]:
        """The serving slot (name, version, manifest_sha256, state), or None when unknown."""
        return self.slot(self.slots.serving) if self.slots is not None else None

    @property
    def serving_slot(self) -> Optional[str]:
        """The serving slot's name (``a``, ``b``), or None when unknown."""
        return self.slots.serving if self.slots is not None else None

    def entries(self) -> Dict[str, SlotView]:
        """Every slot the table fills, by name."""
        return {name: entry for name, entry in (self.slots.slots if self.slots is not None else {}).items()
                if entry is not None}

    @property
    def pending(self) -> bool:
        """A slot of its table is pending: a deploy in its probation."""
        return any(entry.state == SLOT_PENDING for entry in self.entries().values())

    @property
    def last_rollback(self) -> Optional[Dict[str, Any]]:
        return self.slots.last_rollback if self.slots is not None else None

    def holds(self, sha256: str) -> Optional[str]:
        """The state (confirmed, pending, standby) of the slot holding manifest ``sha256``, else None."""
        for entry in self.entries().values():
            if entry.manifest_sha256 == sha256:
                return str(entry.state)
        return None

    def serves_confirmed(self, sha256: str) -> bool:
        serving = self.serving
        return serving is not None and serving.manifest_sha256 == sha256 and serving.state == SLOT_CONFIRMED

    def as_dict(self) -> Dict[str, Any]:
        serving = self.serving
        return {"device": self.device, "state": self.state.value, "groups": self.groups, "model": self.model,
                "backend": self.backend, "serving": to_dict(serving) if serving is not None else None,
                "slots": slots_json(self.slots), "last_seen": self.last_seen, "fps": self.fps,
                "alerts": self.alerts, "reason": self.reason, "broker": self.broker, "heard_live": self.heard_live,
                "kind": self.kind, "duplicate": self.duplicate, "shadow": self.shadow, "sources": self.sources}


class FleetView:
    """Boxes by device id, updated from status, telemetry and alert messages."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.boxes: Dict[str, BoxView] = {}
        self.updates = 0  # status messages applied; the rollout engine re-judges boxes when it moves
        self.cleared: Set[str] = set()  # boxes whose retained status was cleared (decommissioned)
        # device -> (groups, kind) -> that box as its own live statuses show it: more than one is a duplicate id
        self.identities: Dict[str, Dict[Tuple[Tuple[str, ...], Optional[str]], BoxView]] = {}
        # device -> the groups the operator's record last saw it in: a status too malformed to name its groups
        # keeps the box listed there (reported malformed in a rollout, never left out as not targeted)
        self.known_groups: Dict[str, List[str]] = {}

    def apply(self, message: Message) -> Optional[str]:
        """Fold one message in; returns the device it was about (None: not a fleet topic)."""
        parts = split_device_topic(self.prefix, message.topic)
        if parts is None:
            return None
        device, kind = parts
        body = message.json()
        if not message.retain and kind in ((STATUS,), (TELEMETRY,)) and isinstance(body, dict):
            self.boxes.setdefault(device, BoxView(device)).heard_live = True
        if kind == (STATUS,):
            if not message.payload:  # a cleared retained status: the box was decommissioned
                self.boxes.pop(device, None)
                self.cleared.add(device)
                return device
            self.cleared.discard(device)
            self._status(device, body, live=not message.retain)
            return device
        elif kind == (TELEMETRY,) and isinstance(body, dict):
            box = self.boxes.setdefault(device, BoxView(device))
            if box.state == BoxState.STALE and not message.retain:  # judged stale, heard again: it is alive
                box.state, box.reason = BoxState.ONLINE, None
            fps = body.get("fps")
            box.fps = fps if isinstance(fps, (int, float)) and math.isfinite(fps) else None
            box.sources = source_health(body.get("sources"))
            box.last_seen = _latest(box.last_seen, body.get("ts"))
            return device
        elif kind == (SHADOW,) and isinstance(body, dict):
            self.boxes.setdefault(device, BoxView(device)).shadow = shadow_summary(body)
            return device
        elif kind == (TELEMETRY, ALERT) and isinstance(body, dict):
            box = self.boxes.setdefault(device, BoxView(device))
            box.alerts = (box.alerts + [body])[-ALERTS_KEPT:]
            box.last_seen = _latest(box.last_seen, body.get("ts"))
            return device
        return None

    def _keep_recorded_groups(self, box: BoxView) -> None:
        """A malformed box whose status names no groups stays in those the operator's record knows for it: it
        is reported there as malformed, never dropped from a rollout of its group as not targeted."""
        if not box.groups:
            box.groups = list(self.known_groups.get(box.device, []))

    def _status(self, device: str, body: Any, live: bool = False) -> None:
        box = self.boxes.setdefault(device, BoxView(device))
        self.updates += 1
        try:
            status = parse_status(body)
        except ProtocolError as exc:
            # body None: the payload is not UTF-8 JSON or nests deeper than JSON_DEPTH_MAX (Message.json)
            why = str(exc) if body is not None else "status: not JSON, or nested deeper than %d levels" % (
                JSON_DEPTH_MAX)
            box.state, box.malformed, box.reason = BoxState.MALFORMED, why, why
            box.groups = _named_groups(body) or box.groups  # still listed in its group: reported, never sent
            self._keep_recorded_groups(box)
            return
        _fill(box, status)
        if box.malformed:  # parsed, but no documented state: a box that names no groups stays in its recorded ones
            self._keep_recorded_groups(box)
        if live and not box.online:  # that box stopped (or its will fired): a later start is not a second box
            for key in [k for k in self.identities.get(device, {}) if k[0] == tuple(sorted(box.groups))]:
                del self.identities[device][key]
        if live and box.online:
            key = (tuple(sorted(box.groups)), box.kind)
            twin = self.identities.setdefault(device, {}).setdefault(key, BoxView(device))
            _fill(twin, status)
            twin.heard_live = True
            if len(self.identities[device]) > 1:
                for each in [box] + list(self.identities[device].values()):
                    each.duplicate = True

    def duplicates(self) -> Dict[str, List[BoxView]]:
        """Device ids heard live from more than one box (groups or kind differ): each identity's view."""
        return {d: [ids[k] for k in sorted(ids, key=repr)] for d, ids in sorted(self.identities.items())
                if len(ids) > 1}

    def duplicate_problem(self, group: Optional[str]) -> Optional[str]:
        """The duplicate ids among ``group``'s boxes, each box named by its groups and kind; None when none."""
        found = ["%s answered by %d boxes (%s)" % (device, len(twins), "; ".join(
            "groups %s, kind %s, on %s" % (",".join(t.groups) or "-", t.kind or "?", t.broker or "?") for t in twins))
            for device, twins in self.duplicates().items() if group is None or any(group in t.groups for t in twins)]
        if not found:
            return None
        return "duplicate device ids: %s. A command to such an id reaches every box answering as it: give each box " \
               "its own device_id (--allow-duplicate-ids goes on regardless)" % " | ".join(found[:10])

    def rows(self, group: Optional[str] = None) -> List[BoxView]:
        """What ``fleet status`` lists: :meth:`in_group`, with a duplicate id shown once per identity."""
        twins = self.duplicates()
        rows: List[BoxView] = []
        for box in self.in_group(group):
            rows += [t for t in twins[box.device] if group is None or group in t.groups] \
                if box.device in twins else [box]
        return rows

    def unconfirmed(self, now: float) -> List[BoxView]:
        """Online boxes not heard live whose status is old enough that :meth:`judge_stale` would mark them."""
        return [box for box in self.boxes.values() if box.state == BoxState.ONLINE and not box.heard_live and
                too_quiet(box.last_seen, box.telemetry_interval_s, now)]

    def judge_stale(self, now: Optional[float] = None) -> int:
        """Mark ``stale`` each online box not heard live whose newest word is too old; returns how many.

        Too old: more than :data:`STALE_INTERVALS` of its telemetry interval (a box whose broker node stopped
        fires no will, and the retained ``online`` it left can be read from another node for a long time).
        """
        now = time.time() if now is None else now
        stale = self.unconfirmed(now)  # a status without "ts" (no last_seen) is never judged stale
        for box in stale:
            interval = box.telemetry_interval_s or DEFAULT_TELEMETRY_INTERVAL_S
            box.state = BoxState.STALE
            box.reason = "online %.0f s ago and not heard since (%.0f x its %.0f s telemetry interval)" % (
                now - (box.last_seen or now), STALE_INTERVALS, interval)
        return len(stale)

    def in_group(self, group: Optional[str]) -> List[BoxView]:
        """Boxes of ``group`` (all boxes when None; a duplicate id when any of its boxes is), sorted by id."""
        return [self.boxes[d] for d in sorted(self.boxes) if group is None or group in self.boxes[d].groups or
                any(group in twin.groups for twin in self.identities.get(d, {}).values())]


def shadow_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """What ``fleet status`` shows of a box's retained shadow report: the candidate, how the run stands and its
    agreement (anything the report lacks or types otherwise is None)."""
    def field(data: Any, *path: str) -> Any:
        for key in path:
            data = data.get(key) if isinstance(data, dict) else None
        return data if isinstance(data, (str, int, float)) and not isinstance(data, bool) else None

    return {"candidate": field(report, "candidate", "version"), "name": field(report, "candidate", "name"),
            "state": field(report, "state"), "frames": field(report, "frames_compared"),
            "f1": field(report, "agreement", "score_aware", "f1"),
            "strict_f1": field(report, "agreement", "strict", "f1")}


def source_health(sources: Any) -> Dict[str, Dict[str, Any]]:
    """Each camera's health from a box's telemetry (``sources``: the daemon's per-source report), kept short:
    its state (up, connecting, degraded, stalled, failed, finished), input fps and last error's message. At most
    :data:`SOURCES_KEPT` sources; anything typed otherwise is left out, a name or text cut to a line's length."""
    if not isinstance(sources, dict):
        return {}
    kept: Dict[str, Dict[str, Any]] = {}
    for name, report in list(sources.items())[:SOURCES_KEPT]:
        if not isinstance(report, dict):
            continue
        state, fps_in, error = report.get("state"), report.get("fps_in"), report.get("last_error")
        message = error.get("message") if isinstance(error, dict) else None
        kept[str(name)[:64]] = {
            "state": state[:20] if isinstance(state, str) else "unknown",
            "fps_in": fps_in if isinstance(fps_in, (int, float)) and math.isfinite(fps_in) else None,
            "error": message[:200] if isinstance(message, str) else None}
    return kept


def too_quiet(last_word: Optional[float], interval_s: Optional[float], now: float) -> bool:
    """The stale rule: silent for more than :data:`STALE_INTERVALS` of the box's telemetry interval since
    ``last_word`` (its newest time; None, a status without ``ts``, is never judged). ``fleet metrics`` asks it
    of every online box at each scrape."""
    return last_word is not None and now - last_word > STALE_INTERVALS * (
        interval_s or DEFAULT_TELEMETRY_INTERVAL_S)


def _named_groups(body: Any) -> List[str]:
    """The groups a status that does not parse still names (a list of strings under ``groups``), else []."""
    try:
        return list(parse(_Groups, body, "status", unknown="ignore").groups)
    except ConfigError:
        return []


def _state(status: BoxStatus) -> Tuple[BoxState, Optional[str]]:
    """The box's state from a parsed status, and why it is malformed when its ``state`` is neither online nor
    offline (docs/mqtt.md: those two are the status's states)."""
    if status.state in (BoxState.ONLINE, BoxState.OFFLINE):
        return BoxState(status.state), None
    return BoxState.MALFORMED, "malformed status: state: %r is not %s or %s" % (
        status.state[:40], BoxState.ONLINE, BoxState.OFFLINE)


def _fill(box: BoxView, status: BoxStatus) -> None:
    """Fold a status that parsed into ``box``."""
    box.state, box.malformed = _state(status)
    if status.groups or box.state != BoxState.OFFLINE:  # a will that names no groups keeps the box in its own
        box.groups = list(status.groups)
    if box.online or status.slots is not None:  # an offline will carries no slots: keep the last ones known
        box.model = status.model if status.model is not None else box.model
        box.backend = status.backend if status.backend is not None else box.backend
        box.kind = status.device_kind or box.kind
        box.precision = status.precision or box.precision
        if status.slots is not None:
            box.slots = status.slots
    box.reason = box.malformed or status.reason
    box.broker = status.broker if status.broker is not None else box.broker
    if status.telemetry_interval_s is not None:
        box.telemetry_interval_s = float(status.telemetry_interval_s)
    box.status_ts = status.ts
    box.last_seen = _latest(box.last_seen, box.status_ts)


def _latest(current: Optional[float], new: Any) -> Optional[float]:
    if isinstance(new, bool) or not isinstance(new, (int, float)) or not math.isfinite(new):
        return current
    return new if current is None else max(current, float(new))


def collect(link: FleetLink, view: FleetView, listen_s: float, status_only: bool = False,
            settle_s: float = SETTLE_S, monotonic: Callable[[], float] = time.monotonic,
            group: Optional[str] = None) -> FleetView:
    """Subscribe, ask every box (of ``group``) to announce itself, and fold messages in for ``listen_s``, and at
    least until the set settles.

    Retained statuses are the fast path (where the broker sends them to a wildcard subscription: RabbitMQ does
    not); the boxes' answers to the announce are what make a box ``online`` on any broker. Judge liveness
    afterwards (:meth:`FleetView.judge_stale`).

    The set of boxes has settled once no new box has appeared for ``settle_s`` (:data:`SETTLE_S`): a small
    fleet does not wait for the whole ``listen_s``, and a link that pauses in the middle of the retained burst
    does not cut it short. ``status_only`` leaves telemetry and alerts out (a large fleet's telemetry is most
    of its traffic); with them, a box whose ``online`` status is too old to believe and that did not answer the
    announce (a box from before the announce) is given about one telemetry interval (at most
    :data:`LIVENESS_WAIT_MAX_S`) to be heard: its telemetry is liveness, as a status is.
    """
    link.subscribe(fleet_subscriptions(view.prefix, status_only=status_only))
    link.publish(announce_topic(view.prefix, group), {"ts": time.time()})  # after the SUBACK: no answer missed
    start = monotonic()
    grew, known = start, len(view.boxes)
    while True:
        now = monotonic()
        if len(view.boxes) != known:
            grew, known = now, len(view.boxes)
        wait = max(start + listen_s, grew + settle_s) - now
        if wait <= 0:
            break
        message = link.get(wait)
        if message is not None:
            view.apply(message)
    silent = [] if status_only else view.unconfirmed(time.time())
    deadline = monotonic() + min(LIVENESS_WAIT_MAX_S, LIVENESS_INTERVALS * max([0.0] + [
        b.telemetry_interval_s or DEFAULT_TELEMETRY_INTERVAL_S for b in silent]))
    while any(not box.heard_live for box in silent) and monotonic() < deadline:
        message = link.get(max(0.0, deadline - monotonic()))
        if message is not None:
            view.apply(message)
    return view


def render_table(boxes: Sequence[BoxView], now: Optional[float] = None) -> str:
    """A table for people: one line per box; the JSON form (``--json``) has every field."""
    now = time.time() if now is None else now
    header = "%-20s %-8s %-34s %-12s %-9s %6s %9s %-21s  %s" % (
        "DEVICE", "STATE", "MODEL (SERVING)", "SLOT", "OTHER", "FPS", "SEEN", "BROKER", "ALERTS / NOTE")
    lines = [header]
    for box in boxes:
        serving = box.serving
        name = "%s %s" % (serving.name or "?", serving.version or "") if serving is not None else (box.model or "?")
        slot = "%s:%s" % (box.serving_slot or "?", serving.state or "?") if serving is not None else "?"
        other = "/".join(str(v.state) for k, v in box.entries().items() if k != box.serving_slot) or "-"
        fps = "%.1f" % box.fps if isinstance(box.fps, (int, float)) else "-"
        seen = "%.0fs ago" % max(0.0, now - box.last_seen) if box.last_seen else "-"
        note = ", ".join(str(a.get("kind", "alert")) for a in box.alerts)
        if not box.online and box.reason:
            note = (note + "; " if note else "") + str(box.reason)
        if box.duplicate:
            note = "DUPLICATE id: this one in groups %s, kind %s%s" % (",".join(box.groups) or "-", box.kind or "?",
                                                                     "; " + note if note else "")
        if box.last_rollback:
            note = (note + "; " if note else "") + "rolled back %s %s" % (
                box.last_rollback.get("version"), box.last_rollback.get("at"))
        if box.shadow:
            f1 = box.shadow.get("f1")
            note = (note + "; " if note else "") + "shadow %s %s: F1 %s" % (
                box.shadow.get("candidate"), box.shadow.get("state"), "%.3f" % f1 if f1 is not None else "-")
        lines.append("%-20s %-8s %-34s %-12s %-9s %6s %9s %-21s  %s" % (
            box.device[:20], box.state.value[:8], name[:34], slot[:12], other[:9], fps, seen,
            (box.broker or "-")[:21], note[:80]))
    lines.append(totals_line(boxes))
    return "\n".join(lines)


def totals_line(boxes: Sequence[BoxView]) -> str:
    """``N box(es): a online, b offline`` and each other state that occurs (stale, unknown, ...), as it is."""
    counts: Dict[BoxState, int] = {BoxState.ONLINE: 0, BoxState.OFFLINE: 0}
    for box in boxes:
        counts[box.state] = counts.get(box.state, 0) + 1
    return "%d box(es): %s" % (len(boxes), ", ".join("%d %s" % (n, state) for state, n in counts.items()))
