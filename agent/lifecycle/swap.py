"""What serves now, and the one way it changes: a swap between batches, and the end of a probation window.

The serving model, the confirmed model kept loaded while a new one is pending, the slot table (in memory and on
disk) and the pending model's window change together, under one lock. A switch writes the table before the
serving loop takes the model (from then on a crash comes back on the confirmed slot), and is withdrawn, the old
table written back, when the loop does not take it in time; a window ends in a confirmation or a rollback,
decided and applied on the serving thread. Separate from the model manager
(:mod:`agent.lifecycle.model_manager`), which decides what to switch to (start-up, fetch, verify, load, the
operator's commands): nothing here fetches or loads, and everything here is a reference swap and a table write
that cannot fail halfway.
"""

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from agent.config.daemon_config import DaemonConfig
from agent.errors import CommandError
from agent.lifecycle.probation import CONFIRM, ROLLBACK, Probation, Verdict
from agent.lifecycle.slots import CONFIRMED, PENDING, SlotTable, save_slots, with_confirmed, with_rolled_back
from agent.pipeline.handover import BetweenBatches, HandoverTimeout
from agent.pipeline.model import LoadedModel
from agent.protocol.events import EVENT_KEY, Event, event_message

log = logging.getLogger(__name__)


@dataclass
class _Ended:
    """A window that just ended, and what is left to do outside the lock."""

    retired: Optional[LoadedModel]
    event: Dict[str, Any]
    result: Dict[str, Any]


def identity(model: Optional[LoadedModel]) -> Optional[Dict[str, Any]]:
    """A model as events and acks name it."""
    if model is None:
        return None
    return {"name": model.manifest.name, "version": model.manifest.version,
            "manifest_sha256": model.bundle.manifest_sha256}


class ModelSwap:
    """The models in memory, the slot table and the window; ``lock`` guards them all (see module doc).

    ``emit(event)`` publishes an event, ``gc()`` deletes store entries the table no longer names, ``config()``
    is the daemon's live config (the observation window's settings).
    """

    def __init__(self, state_file: str, clock: Callable[[], float], handover: BetweenBatches,
                 config: Callable[[], DaemonConfig], emit: Callable[[Dict[str, Any]], None],
                 gc: Callable[[], None]) -> None:
        self.state_file = state_file
        self.clock = clock
        self.handover = handover
        self.config = config
        self.emit = emit
        self.gc = gc
        self.lock = threading.Lock()  # table, current/fallback models, probation, swap_queued, closed
        self.table: Optional[SlotTable] = None
        self.current: Optional[LoadedModel] = None
        self.fallback: Optional[LoadedModel] = None  # the confirmed model, kept loaded while one is pending
        self.probation = Probation()
        self.swap_queued = False  # a deploy's swap waits in the handover queue: a rollback may follow it there
        self.closed = False

    def record_batch(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None:
        with self.lock:
            self.probation.record(frames, infer_ms_per_frame, failed)

    def close(self) -> None:
        """Release every model; a swap still queued fails with 'shutting_down' when (if ever) the loop runs it."""
        with self.lock:
            self.closed = True
            models: List[Optional[LoadedModel]] = [self.current, self.fallback]
            self.current = self.fallback = None
            self.probation.reset()
        for model in models:
            if model is not None:
                model.close()

    # --- the switch ----------------------------------------------------------------------------------------

    def switch(self, model: LoadedModel, slot: str, transition: Callable[[SlotTable], SlotTable],
               opens_window: bool, timeout: float) -> None:
        """Persist the new table, submit the swap to the serving loop and wait until it ran.

        The table goes to disk first: from then on a crash comes back on the confirmed slot. If it cannot be
        written, or the loop does not take the swap within the timeout, the table in memory stays (or goes
        back to) the one that serves, and ``model`` is closed: whatever fails, it holds no device memory.
        """
        taken = []

        def swap() -> None:  # serving thread
            self._take(model, slot, opens_window)
            taken.append(True)

        try:
            with self.lock:
                if self.closed:
                    raise CommandError("shutting_down", "the daemon is stopping")
                before = self.table
                assert before is not None
                after = transition(before)
                try:
                    save_slots(self.state_file, after)
                except OSError as exc:
                    raise CommandError("storage", "could not write the slot table %s: %s; still serving the "
                                       "old model" % (self.state_file, exc)) from exc
                self.table = after
                self.swap_queued = opens_window
            try:
                self.handover.submit(swap, timeout, what="switch to %s" % model.label)
            except HandoverTimeout:
                raise self._withdrawn(before, timeout) from None
        finally:
            with self.lock:
                self.swap_queued = False
            if not taken:
                model.close()

    def _withdrawn(self, before: SlotTable, timeout: float) -> CommandError:
        """The loop did not take the swap: the old table again, in memory always and on disk if it can be."""
        message = "the serving loop did not take the new model within %.1f s; still serving the old one" % timeout
        with self.lock:
            self.table = before
            try:
                save_slots(self.state_file, before)
            except OSError as exc:  # the disk keeps 'pending': a restart undoes it, as after a crash
                log.error("could not write the slot table %s back after a withdrawn switch: %s",
                          self.state_file, exc)
                message += ("; the slot table %s could not be written back (%s), a restart will report the "
                            "withdrawn model as rolled back" % (self.state_file, exc))
        return CommandError("switch_timeout", message)

    def _take(self, model: LoadedModel, slot: str, opens_window: bool) -> None:
        """Serving thread: the swap itself. The outgoing model is closed only after the reference moved."""
        retired: Optional[LoadedModel] = None
        with self.lock:
            if self.closed:
                raise CommandError("shutting_down", "the daemon stopped before the switch")
            previous = self.current
            self.current = model
            if opens_window:
                self.fallback = previous
                self.probation.open(slot, self.clock())
            else:
                retired = previous
                self.probation.reset()
        if retired is not None:
            retired.close()
        self.emit(event_message(Event.SWITCHED, slot=slot, model=identity(model),
                                state=PENDING if opens_window else CONFIRMED,
                                observation_s=self.config().model.observation_s if opens_window else None))

    # --- the end of a window -------------------------------------------------------------------------------

    def evaluate(self) -> None:
        """Serving thread: confirm the pending model, or roll it back if unhealthy (decided on this thread)."""
        now = self.clock()
        model_cfg = self.config().model
        with self.lock:
            window = self.probation.window
            if window is None:
                return
            decision, reason, figures = window.verdict(
                now, model_cfg.observation_s, model_cfg.latency_regression, model_cfg.max_error_rate)
            if decision is None:
                return
            ended = self._end_window(decision, reason, figures)
        self._after_window(ended)

    def rollback_pending(self, reason: str) -> Dict[str, Any]:
        """Serving thread (through the handover queue): an operator's rollback of the pending model."""
        with self.lock:
            window = self.probation.window
            if window is None:
                raise CommandError("nothing_to_roll_back", "no model is pending any more (its switch was "
                                   "withdrawn or its window ended); send rollback again for the previous model")
            ended = self._end_window(ROLLBACK, reason, window.figures(self.clock()))
        self._after_window(ended)
        return ended.result

    def _end_window(self, decision: Verdict, reason: str, figures: Dict[str, Any]) -> _Ended:
        """Under the lock: move the references and the table; the caller finishes with :meth:`_after_window`."""
        table = self.table
        assert table is not None
        window = self.probation.close(decision)
        pending_slot = table.slots[window.slot]
        if decision == ROLLBACK:
            retired, self.current = self.current, self.fallback
            after = with_rolled_back(table, reason)
            event = event_message(Event.ROLLBACK, reason=reason, trigger=reason.split(":", 1)[0],
                                  slot=window.slot, to=identity(self.current), figures=figures,
                                  **{"from": pending_slot.identity()})
        else:
            assert decision == CONFIRM
            retired = self.fallback
            after = with_confirmed(table)
            event = event_message(Event.CONFIRMED, slot=window.slot, model=pending_slot.identity(),
                                  figures=figures)
        self.fallback = None
        self.table = after
        try:
            save_slots(self.state_file, after)
        except OSError:  # serving goes on; a restart would see 'pending' and come back on the confirmed
            log.exception("could not persist the slot table after %s", decision)
        result = {"slot": after.serving, "state": CONFIRMED, "model": identity(self.current),
                  "rolled_back": pending_slot.identity(), "reason": reason}
        return _Ended(retired, event, result)

    def _after_window(self, ended: _Ended) -> None:
        if ended.retired is not None:
            ended.retired.close()
        log.info("%s: %s", ended.event[EVENT_KEY], ended.event.get("reason", ended.event.get("figures")))
        self.gc()
        self.emit(ended.event)
