"""The operator's own record of every box ever seen, and the liveness rule that does not trust a will.

A broker's retained store is not an inventory: RabbitMQ sends no retained message to a wildcard subscription,
and across a cluster each node keeps its own copies (an operator on node 3 finds none; node 1 keeps stale
ones). A node that stops fires no will, so its boxes look online for the 20-30 s the others take to notice. So:

* every box answers an **announce** request with its live status (``fleet status`` and ``rollout`` send one
  once subscribed, see :mod:`agent.fleet.status`), and retained statuses stay a fast path;
* the operator keeps a **record** (a JSON file per prefix in its state directory) of each box it has heard:
  when, in which state, serving what. A recorded box not heard this time is listed as ``unknown`` with its
  last sighting, never silently absent;
* a box whose ``online`` status was not confirmed by anything heard live during this run and is older than
  a few of its telemetry intervals is shown ``stale``, not ``online`` (:meth:`FleetView.judge_stale`);
  rollouts treat both like offline (only ``online`` is online).

Ages compare a box's timestamps with the operator's clock: a box whose clock is ahead by more than that
window looks fresh for that long (docs/fleet.md says so).
"""

import json
import logging
import os
import time
from typing import Any, Dict, List, Optional
from urllib.parse import quote

from agent._util.atomic import atomic_write
from agent.fleet.records import BoxState
from agent.fleet.status import BoxView, FleetView, slots_json, slots_view

log = logging.getLogger(__name__)

RECORD_SCHEMA = 1


def record_path(state_dir: str, prefix: str) -> str:
    """One record per topic prefix: ``<state_dir>/inventory-<prefix, quoted>.json``."""
    return os.path.join(state_dir, "inventory-%s.json" % quote(prefix, safe=""))


class Inventory:
    """The record file for one prefix: load, fold a view in, fill a view with the boxes it did not hear."""

    def __init__(self, path: str, prefix: str) -> None:
        self.path = path
        self.prefix = prefix
        self.boxes: Dict[str, Dict[str, Any]] = {}
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:  # a damaged record costs the history, not the command
            log.warning("inventory %s unreadable (%s): starting a new one", self.path, exc)
            return
        if isinstance(data, dict) and data.get("prefix") == self.prefix and isinstance(data.get("boxes"), dict):
            self.boxes = {str(d): entry for d, entry in data["boxes"].items() if isinstance(entry, dict)}

    def fold(self, view: FleetView, now: Optional[float] = None) -> None:
        """Record every box the view heard from (state, groups, slots, broker, when), keeping older entries."""
        now = time.time() if now is None else now
        for device in view.cleared:  # decommissioned: its retained status was cleared on purpose
            self.boxes.pop(device, None)
        for device, box in view.boxes.items():
            if box.state == BoxState.UNKNOWN and box.status_ts is None and not box.heard_live:
                continue  # only filled in from this record, or heard of without a status: nothing new
            entry = self.boxes.setdefault(device, {})
            # A malformed status that names no groups (or slots) keeps the recorded ones: the box is still that
            # group's, reported malformed there, never dropped from it by the record.
            keep = box.malformed is not None
            entry.update(state=box.state.value, groups=box.groups or (entry.get("groups", []) if keep else []),
                         slots=slots_json(box.slots) or (entry.get("slots", {}) if keep else {}), broker=box.broker,
                         last_seen=now if box.heard_live else (box.last_seen or entry.get("last_seen")),
                         telemetry_interval_s=box.telemetry_interval_s)

    def known_groups(self) -> Dict[str, List[str]]:
        """Device -> the groups its last readable status named: what keeps a box whose status turns unreadable
        in its group (:attr:`FleetView.known_groups`)."""
        return {d: [str(g) for g in entry["groups"]] for d, entry in self.boxes.items()
                if isinstance(entry.get("groups"), list) and entry["groups"]}

    def devices(self, group: str) -> List[str]:
        """The recorded boxes whose last status named ``group``."""
        return sorted(d for d, entry in self.boxes.items() if group in (entry.get("groups") or []))

    def fill(self, view: FleetView, now: Optional[float] = None) -> int:
        """Add each recorded box the view lacks as ``unknown``, with its last sighting; returns how many."""
        now = time.time() if now is None else now
        added = 0
        for device, entry in self.boxes.items():
            if device in view.boxes:
                continue
            groups = entry.get("groups")
            box = BoxView(device, state=BoxState.UNKNOWN, groups=list(groups) if isinstance(groups, list) else [],
                          slots=slots_view(entry.get("slots")),
                          broker=entry.get("broker"))
            last = entry.get("last_seen")
            box.last_seen = last if isinstance(last, (int, float)) else None
            box.reason = "not heard this time; last seen %s ago, %s" % (_age(now, box.last_seen),
                                                                       entry.get("state", "?"))
            view.boxes[device] = box
            added += 1
        return added

    def save(self) -> bool:
        """Write the record (atomically; the directory is made when missing); False, logged, when it cannot."""
        data = {"schema": RECORD_SCHEMA, "prefix": self.prefix, "boxes": self.boxes}
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n", durable=False)
        except OSError as exc:  # the view is still printed; only the history is not kept this time
            log.warning("inventory %s not written: %s", self.path, exc)
            return False
        return True


def _age(now: float, then: Optional[float]) -> str:
    return "?" if then is None else "%.0f s" % max(0.0, now - then)
