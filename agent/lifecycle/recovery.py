"""Start-up: decide what serves after whatever the last run left behind (a crash, a power cut, damaged files).

In order: read the slot table (unusable: moved aside, ``slots_reset``, start from ``model.bundle``); undo a
model left pending by a crash (``rollback``, trigger ``restart``); verify and load the confirmed slot, else the
standby. A slot bundle whose files fail verification is moved aside and its slot emptied
(``bundle_moved_aside``); with no intact bundle left, ``model.bundle`` is imported as on a first start. The box
keeps serving whatever was damaged; only a runtime that refuses intact bundles stops the start.
"""

import logging
import os
from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple

from agent._util.quarantine import move_aside
from agent.bundle.manifest import MANIFEST, SIGNATURE, BundleError, Manifest
from agent.bundle.verify import Bundle, verify_bundle
from agent.config.schema import FieldError
from agent.lifecycle.fetch import copy_local
from agent.lifecycle.slots import (
    CONFIRMED,
    SLOT_NAMES,
    STANDBY,
    SlotStateError,
    SlotTable,
    filled_slot,
    first_table,
    load_slots,
    save_slots,
    with_lost,
    with_rolled_back,
    with_swapped,
)
from agent.lifecycle.store import BundleStore
from agent.pipeline.model import LoadedModel
from agent.protocol.events import Event, event_message

log = logging.getLogger(__name__)

TRIGGER_RESTART = "restart"  # the rollback trigger of every decision taken here


def is_damage(exc: BaseException) -> bool:
    """A store entry whose files fail verification is damaged; one that only lacks a now-required signature is
    not (the operator changed the key, the files are intact)."""
    if isinstance(exc, BundleError):
        return any(error.path != SIGNATURE for error in exc.errors)
    return isinstance(exc, OSError)


class Recovery:
    """One start-up's decisions; :meth:`run` returns the loaded model to serve and the table that says so."""

    def __init__(self, store: BundleStore, state_file: str, first_bundle: str, public_key: Optional[bytes],
                 load: Callable[[Bundle], LoadedModel], emit: Callable[[Dict[str, Any]], None],
                 on_phase: Callable[[str], None], wall_clock: Callable[[], float],
                 first_manifest: Optional[Manifest] = None) -> None:
        self.store = store
        self.state_file = state_file
        self.first_bundle = first_bundle  # model.bundle: served when nothing usable is on the box
        # model.bundle's manifest as the daemon read it (the backend was chosen by it); None: not read
        self.first_manifest = first_manifest
        self.public_key = public_key
        self.load = load
        self.emit = emit
        self.on_phase = on_phase
        self.wall_clock = wall_clock  # names set-aside files, for people

    def run(self) -> Tuple[LoadedModel, SlotTable]:
        self.store.open()
        table = self._read_table()
        if table is None:
            return self.first_start()
        if table.pending is not None:
            table = self._recover_pending(table)
        return self._load_serving(table)

    def first_start(self) -> Tuple[LoadedModel, SlotTable]:
        """Copy and verify ``model.bundle`` into slot a, load it, and only then write the table."""
        source = self.first_bundle
        with self.store.staging() as staging:
            if not os.path.exists(source):
                raise BundleError([FieldError("model.bundle", "not found: %s" % source)], source)
            root = copy_local(os.path.realpath(source), staging, source=source)
            self.on_phase("verify")
            bundle = verify_bundle(root, self.public_key)  # the copy's own manifest: what is installed
            if self.first_manifest is not None and bundle.manifest != self.first_manifest:
                raise BundleError([FieldError(MANIFEST, "model.bundle changed while the daemon started (the "
                                              "backend was chosen for another manifest); start again")], source)
            installed = self.store.install(root, SLOT_NAMES[0], bundle)
        try:
            model = self.load(replace(bundle, root=self.store.path(installed)))
            table = first_table(filled_slot(CONFIRMED, installed, model.bundle.manifest_sha256,
                                            model.manifest.name, model.manifest.version))
            save_slots(self.state_file, table)
        except BaseException:
            self.store.discard(installed)
            raise
        self.store.settled(installed)  # start() holds the operation lock: no gc runs before the table is set
        log.info("first start: %s installed in slot %s", model.label, SLOT_NAMES[0])
        return model, table

    def _read_table(self) -> Optional[SlotTable]:
        try:
            return load_slots(self.state_file)
        except SlotStateError as exc:
            # Atomic writes make this a disk fault or a hand edit; keep the evidence, start from the config.
            aside = move_aside(self.state_file, "slot table unusable", clock=self.wall_clock)
            log.error("slot table unusable, moved to %s; starting from model.bundle:\n%s", aside, exc)
            self.emit(event_message(Event.SLOTS_RESET, reason=str(exc)[:500], moved_to=aside))
            return None

    def _recover_pending(self, table: SlotTable) -> SlotTable:
        pending = table.pending
        assert pending is not None
        reason = "%s: the daemon restarted while %s %s was pending" % (
            TRIGGER_RESTART, table.slots[pending].name, table.slots[pending].version)
        after = with_rolled_back(table, reason)
        save_slots(self.state_file, after)
        log.warning("%s; serving the confirmed slot %s", reason, after.serving)
        self.emit(event_message(Event.ROLLBACK, reason=reason, trigger=TRIGGER_RESTART, slot=pending,
                                to=after.slots[after.serving].identity(), figures=None,
                                **{"from": table.slots[pending].identity()}))
        return after

    def _load_serving(self, table: SlotTable) -> Tuple[LoadedModel, SlotTable]:
        """The confirmed slot's model; if it is damaged or refused and a standby slot exists, that one."""
        confirmed, standby = table.confirmed, table.slot_in(STANDBY)
        refused: Optional[BaseException] = None
        for name in [confirmed] + ([standby] if standby else []):
            slot = table.slots[name]
            self.on_phase("verify")
            try:
                bundle = self.store.verify(slot)
            except (BundleError, OSError) as exc:
                if not is_damage(exc):
                    refused = exc
                    continue
                lost = self._set_aside(table, name, exc)
                if lost is None:
                    return self.first_start()
                table = lost
                continue
            try:
                model = self.load(bundle)
            except (BundleError, RuntimeError) as exc:  # intact files the runtime refused (golden, backend)
                log.error("slot %s (%s %s) failed to load:\n%s", name, slot.name, slot.version, exc)
                refused = exc
                continue
            if name != table.confirmed:  # the standby serves; the confirmed one failed to load (kept)
                after = with_swapped(table)
                save_slots(self.state_file, after)
                self.emit(event_message(Event.ROLLBACK, reason="%s: confirmed slot failed to load: %s" % (
                    TRIGGER_RESTART, str(refused)[:300]), trigger=TRIGGER_RESTART, slot=table.confirmed,
                    to=slot.identity(), figures=None, **{"from": table.slots[table.confirmed].identity()}))
                table = after
            return model, table
        assert refused is not None
        raise refused

    def _set_aside(self, table: SlotTable, name: str, exc: BaseException) -> Optional[SlotTable]:
        """Move a damaged slot's bundle aside, report it, empty the slot; None when no slot is left to serve."""
        slot = table.slots[name]
        assert slot.bundle is not None
        reason = "%s: slot %s (%s %s) failed verification: %s" % (
            TRIGGER_RESTART, name, slot.name, slot.version, str(exc)[:300])
        moved = self.store.set_aside(slot.bundle, "bundle failed verification")
        log.error("%s; moved to %s", reason, moved)
        self.emit(event_message(Event.BUNDLE_MOVED_ASIDE, slot=name, model=slot.identity(), reason=reason,
                                moved_to=moved))
        try:
            after = with_lost(table, name, reason)
        except ValueError:
            log.error("no intact bundle left in the store: starting from model.bundle %s", self.first_bundle)
            return None
        save_slots(self.state_file, after)
        if after.serving != table.serving:
            self.emit(event_message(Event.ROLLBACK, reason=reason, trigger=TRIGGER_RESTART, slot=name,
                                    to=after.slots[after.serving].identity(), figures=None,
                                    **{"from": slot.identity()}))
        return after
