"""Two model slots, a hot swap between batches, and automatic rollback while a new model is on probation.

Threads and who does what (the daemon's serving loop is the only thread that runs inference):

- the command worker runs :meth:`ModelManager.deploy` and :meth:`ModelManager.rollback`: fetch, verify,
  load, warm up and self-test the new model *off* the serving thread, write the slot table, then hand the
  ready model over and wait (bounded) until the serving loop has taken it;
- the serving loop calls :meth:`ModelManager.between_batches` before each batch (it swaps the reference and
  judges the observation window) and :meth:`ModelManager.record_batch` after it. A batch therefore runs on one
  model from start to end, and a half-loaded model is never reachable.

Order that makes crashes safe: the table saying "slot b pending" is on disk before the serving loop switches
to b, so a process that dies at any later point comes back on the confirmed slot and reports a rollback.

Memory: the confirmed model stays loaded while a new one is pending. Both are loaded at once anyway at the
moment of a switch without downtime, so keeping the old one for the window does not raise the peak (on a 310
board the deploy fails cleanly at load time if the two do not fit, and the serving model is untouched); in
return a rollback is a reference swap that cannot fail on a reload.
"""

import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from agent._util.quarantine import move_aside
from agent.config.daemon_config import DaemonConfig, ThresholdsConfig
from agent.config.device_config import DeviceConfig
from agent.config.schema import ConfigError, FieldError, parse, setting
from agent.errors import CommandError
from agent.lifecycle.bundle import (
    MANIFEST,
    Bundle,
    BundleError,
    load_public_key,
    select_artifacts,
    sha256_file,
    verify_bundle,
)
from agent.lifecycle.fetch import copy_local, fetch_bundle, redact
from agent.lifecycle.slots import (
    CONFIRMED,
    SLOT_NAMES,
    STANDBY,
    STATE_FILE,
    Slot,
    SlotStateError,
    SlotTable,
    filled_slot,
    first_table,
    load_slots,
    other_slot,
    save_slots,
    with_confirmed,
    with_pending,
    with_rolled_back,
    with_swapped,
)
from agent.pipeline.model import LoadedModel, load_model

log = logging.getLogger(__name__)

SLOTS_DIR = "slots"  # <store>/slots/<slot>-<sha12>: the bundles the slot table refers to, nothing else
STAGING_DIR = ".staging"  # <store>/.staging/<tmp>: fetches in progress; anything left there is from a crash
# The serving loop calls between_batches at least once per batch wait (milliseconds) or per inference; 30 s
# covers a long first batch on a slow box without leaving an operator's command hanging for minutes.
DEFAULT_SWITCH_TIMEOUT_S = 30.0
BASELINE_BATCHES = 200  # latency samples of the confirmed model kept for its baseline
MIN_BASELINE_BATCHES = 5  # fewer samples than this are not a baseline: the latency rule is skipped
MIN_JUDGE_BATCHES = 10  # one slow batch is noise; judge a pending model's latency on at least this many
MIN_JUDGE_FRAMES = 10  # likewise its error rate, before the window ends
MIN_CONFIRM_FRAMES = 1  # a model that served nothing has shown nothing: it stays pending
ENVELOPE_KEYS = ("request_id",)  # command envelope fields the dispatcher may leave in the payload

# Rollback triggers, as reported in events and acks.
TRIGGER_LATENCY = "latency"
TRIGGER_ERRORS = "errors"
TRIGGER_OPERATOR = "operator"
TRIGGER_RESTART = "restart"


def _command_error(code: str, message: str, field_name: Optional[str] = None) -> CommandError:
    return CommandError(code, message, field=field_name)


@dataclass(frozen=True)
class DeployRequest:
    bundle: str = setting(doc="bundle directory or .tar/.tar.gz inside the store, or an http(s) URL")
    sha256: str = setting(doc="sha256 (hex) of the bundle's manifest.json, as printed by 'bundle verify'")

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if not self.bundle:
            problems.append(("bundle", "must not be empty"))
        if len(self.sha256) != 64 or any(c not in "0123456789abcdefABCDEF" for c in self.sha256):
            problems.append(("sha256", "must be 64 hex digits (got %r)" % self.sha256[:80]))
        return problems


@dataclass
class _Handover:
    """A model made ready off the serving thread, waiting for between_batches to put it in place."""

    model: LoadedModel
    slot: str
    opens_window: bool  # a deploy's model is pending; a restored previous model is confirmed at once
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False


@dataclass
class _RollbackRequest:
    reason: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Optional[Dict[str, Any]] = None


@dataclass
class _Window:
    """What a pending model has shown since it started serving."""

    slot: str
    started: float
    baseline_ms: Optional[float]
    baseline_samples: List[float]
    latencies: Deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_BATCHES))
    batches: int = 0
    frames: int = 0
    failed_frames: int = 0

    def add(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None:
        self.batches += 1
        self.frames += frames
        if failed:
            self.failed_frames += frames
        else:
            self.latencies.append(infer_ms_per_frame)

    def p50(self) -> Optional[float]:
        return statistics.median(self.latencies) if self.latencies else None

    def verdict(self, now: float, observation_s: float, latency_factor: float, max_error_rate: float
                ) -> Tuple[Optional[str], str, Dict[str, Any]]:
        """(None | "rollback" | "confirm", reason, figures). Failures are judged before the window ends."""
        elapsed = now - self.started
        ended = elapsed >= observation_s
        figures = self.figures(now)
        if self.frames and (self.frames >= MIN_JUDGE_FRAMES or ended):
            rate = self.failed_frames / self.frames
            if rate > max_error_rate:
                return "rollback", "%s: error rate %.3f (%d of %d frames) above max_error_rate %.3f" % (
                    TRIGGER_ERRORS, rate, self.failed_frames, self.frames, max_error_rate), figures
        p50 = self.p50()
        # Latency is judged on enough batches even when the window is short: the first batch after a switch
        # can be slow for reasons that are not the model's (a busy core, a cold cache), and one sample would
        # roll back a good model. Until then the model stays pending.
        latency_judged = self.baseline_ms is None or len(self.latencies) >= MIN_JUDGE_BATCHES
        if self.baseline_ms is not None and p50 is not None and latency_judged:
            limit = latency_factor * self.baseline_ms
            if p50 > limit:
                return "rollback", "%s: median inference %.2f ms/frame exceeds %.1f x baseline %.2f ms" % (
                    TRIGGER_LATENCY, p50, latency_factor, self.baseline_ms), figures
        if ended and self.frames >= MIN_CONFIRM_FRAMES and latency_judged:
            return "confirm", "healthy for %.1f s" % elapsed, figures
        return None, "", figures

    def figures(self, now: float) -> Dict[str, Any]:
        p50 = self.p50()
        return {"observed_s": round(now - self.started, 3), "frames": self.frames,
                "failed_frames": self.failed_frames, "batches": self.batches,
                "p50_ms": None if p50 is None else round(p50, 3),
                "baseline_ms": None if self.baseline_ms is None else round(self.baseline_ms, 3)}


def _identity(model: Optional[LoadedModel]) -> Optional[Dict[str, Any]]:
    if model is None:
        return None
    return {"name": model.manifest.name, "version": model.manifest.version,
            "manifest_sha256": model.bundle.manifest_sha256}


def _slot_identity(slot: Slot) -> Dict[str, Any]:
    return {"name": slot.name, "version": slot.version, "manifest_sha256": slot.manifest_sha256}


class ModelManager:
    """The serving model, its A/B slots, deploys, the observation window and rollbacks (see module doc)."""

    def __init__(self, config: DaemonConfig, device: DeviceConfig, backend: str,
                 on_event: Callable[[Dict[str, Any]], None], clock: Callable[[], float] = time.monotonic,
                 switch_timeout_s: float = DEFAULT_SWITCH_TIMEOUT_S,
                 on_phase: Optional[Callable[[str], None]] = None) -> None:
        self.config = config
        # Called as each loading step begins ("verify", "load", "warm-up", "golden check"): the daemon extends
        # systemd's start-up timeout per step.
        self.on_phase: Callable[[str], None] = on_phase or (lambda name: None)
        self.device = device
        self.backend = backend
        self.on_event = on_event
        self.clock = clock
        self.switch_timeout_s = switch_timeout_s
        self.store = os.path.abspath(config.state_path(config.model.store))
        self.state_file = config.state_path(STATE_FILE)
        self.public_key = _public_key(config.model.public_key)
        self._thresholds: ThresholdsConfig = config.thresholds
        self._lock = threading.Lock()  # table, handover, rollback request, window, fallback, in-flight dirs
        self._operation = threading.Lock()  # one deploy or rollback command at a time
        self._table: Optional[SlotTable] = None
        self._current: Optional[LoadedModel] = None
        self._fallback: Optional[LoadedModel] = None  # the confirmed model, kept loaded while one is pending
        self._handover: Optional[_Handover] = None
        self._rollback_request: Optional[_RollbackRequest] = None
        self._window: Optional[_Window] = None
        self._baseline: Deque[float] = deque(maxlen=BASELINE_BATCHES)
        self._in_flight: Set[str] = set()  # slot dirs being filled by a deploy: not garbage yet
        self._closed = False

    # --- start and the serving loop's side ----------------------------------------------------------------

    def start(self) -> LoadedModel:
        """Serve the confirmed slot; undo a model left pending by a crash; on first start, import one."""
        with self._operation:
            os.makedirs(os.path.join(self.store, SLOTS_DIR), exist_ok=True)
            shutil.rmtree(os.path.join(self.store, STAGING_DIR), ignore_errors=True)  # a crash's leftovers
            table = self._read_table()
            if table is None:
                model, table = self._first_start()
            else:
                if table.pending is not None:
                    table = self._recover_pending(table)
                model, table = self._load_confirmed(table)
            with self._lock:
                self._table = table
                self._current = model
            self._gc()
            log.info("serving %s from slot %s", model.label, table.serving)
            return model

    @property
    def current(self) -> LoadedModel:
        """The model for the next batch; read it after :meth:`between_batches`, once per batch."""
        model = self._current
        if model is None:
            raise RuntimeError("ModelManager.start() has not run")
        return model

    def between_batches(self) -> None:
        """Serving thread only: put a prepared model in place, then judge the pending model's window."""
        if self._handover is None and self._window is None:
            return  # the common case costs two attribute reads
        handover = self._handover
        if handover is not None:
            self._take(handover)
        if self._window is not None:
            try:
                self._evaluate()
            except Exception:  # a full disk must not stop serving; the window is judged again next batch
                log.exception("judging the pending model failed")

    def record_batch(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None:
        """Serving thread only, after each batch, for the model that :attr:`current` returned for it."""
        with self._lock:
            window = self._window
            if window is not None:
                window.add(frames, infer_ms_per_frame, failed)
            elif not failed:
                self._baseline.append(infer_ms_per_frame)

    def set_thresholds(self, thresholds: ThresholdsConfig) -> None:
        """Post-processing overrides from the config, for the models in memory and every one loaded later."""
        self._thresholds = thresholds
        for model in (self._current, self._fallback):
            if model is not None:
                self._apply_thresholds(model)

    # --- commands (command worker thread) ------------------------------------------------------------------

    def deploy(self, payload: Dict[str, Any], progress: Callable[[str], None]) -> Dict[str, Any]:
        """Fetch, verify, load and self-test a bundle into the standby slot, then switch to it as pending.

        Raises CommandError / BundleError / ConfigError with the reason; the serving model is untouched then.
        """
        request = parse(DeployRequest, {k: v for k, v in dict(payload).items() if k not in ENVELOPE_KEYS},
                        "deploy")
        expected_sha = request.sha256.lower()
        if not self._operation.acquire(blocking=False):
            raise _command_error("busy", "another deploy or rollback is running")
        try:
            table = self._started_table()
            if table.pending is not None:
                pending = table.slots[table.pending]
                raise _command_error("busy", "%s %s is pending in slot %s: wait for its observation window "
                                     "or roll it back first" % (pending.name, pending.version, table.pending))
            serving = table.slots[table.serving]
            if serving.manifest_sha256 == expected_sha:
                raise _command_error("already_serving", "%s %s (manifest %s) is already serving" % (
                    serving.name, serving.version, expected_sha[:12]), "sha256")
            slot = other_slot(table.serving)
            model, new_slot = self._prepare(request.bundle, expected_sha, slot, progress)
            try:
                progress("switching to %s in slot %s" % (model.label, slot))
                self._switch(model, slot, lambda t: with_pending(t, slot, new_slot), opens_window=True)
            finally:
                self._forget_in_flight(new_slot.bundle)  # recorded in the table now, or garbage
        finally:
            self._operation.release()
            self._gc()
        return {"slot": slot, "state": "pending", "model": _identity(model),
                "previous": _slot_identity(table.slots[table.serving]),
                "observation_s": self.config.model.observation_s}

    def rollback(self, reason: str = TRIGGER_OPERATOR) -> Dict[str, Any]:
        """Back to the confirmed model; with nothing pending, to the previously confirmed (standby) one."""
        if not self._operation.acquire(blocking=False):
            raise _command_error("busy", "another deploy or rollback is running")
        try:
            detail = "rollback command" if reason == TRIGGER_OPERATOR else reason
            request = _RollbackRequest(reason="%s: %s" % (TRIGGER_OPERATOR, detail))
            with self._lock:
                table = self._started_table()
                if table.pending is not None:
                    self._rollback_request = request  # served by between_batches, like an automatic one
            if table.pending is not None:
                return self._await_rollback(request)
            return self._restore_standby(table, request.reason)
        finally:
            self._operation.release()

    def status(self) -> Dict[str, Any]:
        with self._lock:
            table, window = self._table, self._window
        if table is None:
            return {"serving": None, "slots": {}}
        result = table.public()
        if window is not None:
            result["pending"] = dict(window.figures(self.clock()), slot=window.slot,
                                     observation_s=self.config.model.observation_s)
        return result

    def close(self) -> None:
        """Release every model; a deploy still waiting for its switch fails with 'shutting_down'."""
        with self._lock:
            self._closed = True
            handover, self._handover = self._handover, None
            request, self._rollback_request = self._rollback_request, None
            models = [self._current, self._fallback]
            self._current = self._fallback = None
            self._window = None
        if handover is not None:
            handover.done.set()  # not taken: the waiting deploy closes its model and reports why
        if request is not None:
            request.done.set()
        for model in models:
            if model is not None:
                model.close()

    # --- deploy steps ------------------------------------------------------------------------------------

    def _prepare(self, source: str, expected_sha: str, slot: str, progress: Callable[[str], None]
                 ) -> Tuple[LoadedModel, Slot]:
        """Fetch into staging, check the pinned hash, verify, install into the store, load and self-test."""
        staging_root = os.path.join(self.store, STAGING_DIR)
        os.makedirs(staging_root, exist_ok=True)
        staging = tempfile.mkdtemp(dir=staging_root)
        installed: Optional[str] = None
        shown = redact(source)
        try:
            progress("fetching %s" % shown)
            root = fetch_bundle(source, self.store, staging)
            manifest_path = os.path.join(root, MANIFEST)
            actual = sha256_file(manifest_path) if os.path.isfile(manifest_path) else None
            if actual != expected_sha:
                raise _command_error("sha256_mismatch", "the bundle's manifest.json has sha256 %s, the "
                                     "command pinned %s" % (actual or "(none)", expected_sha), "sha256")
            progress("verifying %s" % shown)
            bundle = verify_bundle(root, self.public_key)
            select_artifacts(bundle, self.device, self.backend, batch=self.config.batching.max_batch)
            installed = self._install(root, slot, bundle)
            bundle = replace(bundle, root=installed)
            progress("loading %s with %s (warm-up and golden self-test)" % (bundle.label, self.backend))
            try:
                model = self._load(bundle)
            except RuntimeError as exc:  # BackendError / BackendUnavailable: the runtime refused the model
                raise _command_error("load_failed", "%s: %s" % (bundle.label, exc)) from exc
        except BaseException:
            if installed is not None:
                shutil.rmtree(installed, ignore_errors=True)
                self._forget_in_flight(self._relative(installed))
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return model, filled_slot(CONFIRMED, self._relative(installed), bundle.manifest_sha256,
                                  bundle.manifest.name, bundle.manifest.version)

    def _switch(self, model: LoadedModel, slot: str, transition: Callable[[SlotTable], SlotTable],
                opens_window: bool) -> None:
        """Persist the new table, hand ``model`` to the serving loop and wait until it took it.

        The table goes to disk first: from then on a crash comes back on the confirmed slot. If the loop does
        not take the model in time, the hand-over is withdrawn and the old table written back.
        """
        handover = _Handover(model=model, slot=slot, opens_window=opens_window)
        try:
            with self._lock:
                if self._closed:
                    raise _command_error("shutting_down", "the daemon is stopping")
                before = self._table
                assert before is not None
                after = transition(before)
                save_slots(self.state_file, after)
                self._table = after
                self._handover = handover
            if not handover.done.wait(self.switch_timeout_s):
                with self._lock:
                    withdrawn = self._handover is handover
                    if withdrawn:
                        self._handover = None
                        save_slots(self.state_file, before)
                        self._table = before
                if withdrawn:
                    raise _command_error("switch_timeout", "the serving loop did not take the new model "
                                         "within %.0f s; still serving the old one" % self.switch_timeout_s)
                handover.done.wait()  # taken in the same instant: between_batches sets done right away
            if not handover.taken:
                raise _command_error("shutting_down", "the daemon stopped before the switch")
        except BaseException:
            if not handover.taken:
                model.close()
            raise

    def _take(self, handover: _Handover) -> None:
        """Serving thread: the swap itself. The outgoing model is closed only after the reference moved."""
        retired: Optional[LoadedModel] = None
        with self._lock:
            if self._handover is not handover:
                return  # withdrawn by a timed-out deploy, or by close()
            self._handover = None
            previous = self._current
            self._current = handover.model
            if handover.opens_window:
                baseline = list(self._baseline)
                enough = len(baseline) >= MIN_BASELINE_BATCHES
                self._fallback = previous
                self._window = _Window(slot=handover.slot, started=self.clock(), baseline_samples=baseline,
                                       baseline_ms=statistics.median(baseline) if enough else None)
            else:
                retired = previous
            self._baseline.clear()  # samples belong to the model that produced them
            handover.taken = True
            handover.done.set()
        if retired is not None:
            retired.close()
        self._emit({"event": "switched", "slot": handover.slot, "model": _identity(handover.model),
                    "state": "pending" if handover.opens_window else "confirmed",
                    "observation_s": self.config.model.observation_s if handover.opens_window else None})

    def _evaluate(self) -> None:
        """Serving thread: roll back (asked to, or unhealthy) or confirm the pending model, under the lock."""
        now = self.clock()
        model_cfg = self.config.model
        with self._lock:
            window = self._window
            if window is None:
                return
            request = self._rollback_request
            if request is not None:
                decision, reason, figures = "rollback", request.reason, window.figures(now)
            else:
                decision, reason, figures = window.verdict(
                    now, model_cfg.observation_s, model_cfg.latency_regression, model_cfg.max_error_rate)
            if decision is None:
                return
            table = self._table
            assert table is not None
            pending_slot = table.slots[window.slot]
            if decision == "rollback":
                retired, self._current = self._current, self._fallback
                after = with_rolled_back(table, reason)
                self._baseline.extend(window.baseline_samples)
            else:
                retired = self._fallback
                after = with_confirmed(table)
                self._baseline.extend(window.latencies)
            self._fallback = None
            self._window = None
            self._rollback_request = None
            self._table = after
            try:
                save_slots(self.state_file, after)
            except OSError:  # serving goes on; a restart would see 'pending' and come back on the confirmed
                log.exception("could not persist the slot table after %s", decision)
        if retired is not None:
            retired.close()
        if decision == "rollback":
            event = {"event": "rollback", "reason": reason, "trigger": reason.split(":", 1)[0],
                     "slot": window.slot, "from": _slot_identity(pending_slot),
                     "to": _identity(self._current), "figures": figures}
        else:
            event = {"event": "confirmed", "slot": window.slot, "model": _slot_identity(pending_slot),
                     "figures": figures}
        log.info("%s: %s", event["event"], reason)
        self._gc()
        self._emit(event)
        if request is not None:
            request.result = {"slot": after.serving, "state": CONFIRMED, "model": _identity(self._current),
                              "rolled_back": _slot_identity(pending_slot), "reason": reason}
            request.done.set()

    def _await_rollback(self, request: _RollbackRequest) -> Dict[str, Any]:
        if request.done.wait(self.switch_timeout_s) and request.result is not None:
            return request.result
        with self._lock:
            if self._rollback_request is request:
                self._rollback_request = None
        if request.result is not None:
            return request.result
        if request.done.is_set():
            raise _command_error("shutting_down", "the daemon stopped before the rollback")
        raise _command_error("switch_timeout", "the serving loop did not roll back within %.0f s" %
                             self.switch_timeout_s)

    def _restore_standby(self, table: SlotTable, reason: str) -> Dict[str, Any]:
        """Nothing pending: reload the previously confirmed bundle and make it the confirmed, serving one."""
        standby = table.slot_in(STANDBY)
        if standby is None:
            raise _command_error("nothing_to_roll_back", "no model is pending and no previous model is kept")
        kept = table.slots[standby]
        model = self._load(self._verified_slot(kept))
        current = table.slots[table.serving]
        self._switch(model, standby, with_swapped, opens_window=False)
        self._gc()
        self._emit({"event": "rollback", "reason": reason, "trigger": TRIGGER_OPERATOR, "slot": table.serving,
                    "from": _slot_identity(current), "to": _slot_identity(kept), "figures": None})
        return {"slot": standby, "state": CONFIRMED, "model": _slot_identity(kept),
                "rolled_back": _slot_identity(current), "reason": reason}

    # --- start steps -------------------------------------------------------------------------------------

    def _read_table(self) -> Optional[SlotTable]:
        try:
            return load_slots(self.state_file)
        except SlotStateError as exc:
            # Atomic writes make this a disk fault or a hand edit; keep the evidence, start from the config.
            aside = move_aside(self.state_file, "slot table unusable")
            log.error("slot table unusable, moved to %s; starting from model.bundle:\n%s", aside, exc)
            self._emit({"event": "slots_reset", "reason": str(exc)[:500], "moved_to": aside})
            return None

    def _first_start(self) -> Tuple[LoadedModel, SlotTable]:
        """Copy and verify ``model.bundle`` into slot a, load it, and only then write the table."""
        source = self.config.model.bundle
        staging_root = os.path.join(self.store, STAGING_DIR)
        os.makedirs(staging_root, exist_ok=True)
        staging = tempfile.mkdtemp(dir=staging_root)
        slot = SLOT_NAMES[0]
        installed = None
        try:
            if not os.path.exists(source):
                raise BundleError([FieldError("model.bundle", "not found: %s" % source)], source)
            root = copy_local(os.path.realpath(source), staging, source=source)
            self.on_phase("verify")
            bundle = verify_bundle(root, self.public_key)
            installed = self._install(root, slot, bundle)
            model = self._load(replace(bundle, root=installed))
        except BaseException:
            if installed is not None:
                shutil.rmtree(installed, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            self._in_flight.clear()
        table = first_table(filled_slot(CONFIRMED, self._relative(installed), model.bundle.manifest_sha256,
                                        model.manifest.name, model.manifest.version))
        save_slots(self.state_file, table)
        log.info("first start: %s installed in slot %s", model.label, slot)
        return model, table

    def _recover_pending(self, table: SlotTable) -> SlotTable:
        pending = table.pending
        assert pending is not None
        reason = "%s: the daemon restarted while %s %s was pending" % (
            TRIGGER_RESTART, table.slots[pending].name, table.slots[pending].version)
        after = with_rolled_back(table, reason)
        save_slots(self.state_file, after)
        log.warning("%s; serving the confirmed slot %s", reason, after.serving)
        self._emit({"event": "rollback", "reason": reason, "trigger": TRIGGER_RESTART, "slot": pending,
                    "from": _slot_identity(table.slots[pending]),
                    "to": _slot_identity(after.slots[after.serving]), "figures": None})
        return after

    def _load_confirmed(self, table: SlotTable) -> Tuple[LoadedModel, SlotTable]:
        """The confirmed slot's model; if it is damaged and a standby slot exists, that one (reported)."""
        try:
            return self._load(self._verified_slot(table.slots[table.confirmed])), table
        except (BundleError, OSError, RuntimeError) as exc:  # damaged on disk, or the runtime refused it
            standby = table.slot_in(STANDBY)
            if standby is None:
                raise
            after = with_swapped(table)
            model = self._load(self._verified_slot(table.slots[standby]))
            save_slots(self.state_file, after)
            log.error("confirmed slot %s failed to load, serving standby slot %s:\n%s", table.confirmed,
                      standby, exc)
            self._emit({"event": "rollback", "reason": "%s: confirmed slot failed to load: %s" % (
                TRIGGER_RESTART, str(exc)[:300]), "trigger": TRIGGER_RESTART, "slot": table.confirmed,
                "from": _slot_identity(table.slots[table.confirmed]),
                "to": _slot_identity(table.slots[standby]), "figures": None})
            return model, after

    # --- helpers -------------------------------------------------------------------------------------------

    def _started_table(self) -> SlotTable:
        table = self._table
        if table is None:
            raise _command_error("not_started", "the model manager has not started")
        return table

    def _verified_slot(self, slot: Slot) -> Bundle:
        """Re-verify a slot's bundle from disk (hashes and signature): the store may have been altered."""
        assert slot.bundle is not None
        self.on_phase("verify")
        bundle = verify_bundle(os.path.join(self.store, slot.bundle), self.public_key)
        if bundle.manifest_sha256 != slot.manifest_sha256:
            raise BundleError([FieldError(MANIFEST, "changed on disk: sha256 %s, slot table says %s" % (
                bundle.manifest_sha256, slot.manifest_sha256))], bundle.root)
        return bundle

    def _load(self, bundle: Bundle) -> LoadedModel:
        model = load_model(bundle, self.device, self.backend, max_batch=self.config.batching.max_batch,
                           on_phase=self.on_phase)
        self._apply_thresholds(model)
        return model

    def _apply_thresholds(self, model: LoadedModel) -> None:
        th = self._thresholds
        model.set_thresholds(conf=th.conf, iou=th.iou, max_det=th.max_det, top_k=th.top_k)

    def _install(self, root: str, slot: str, bundle: Bundle) -> str:
        """Move a verified staging copy into ``slots/`` under a fresh name, safe from gc until recorded."""
        base = "%s-%s" % (slot, bundle.manifest_sha256[:12])
        with self._lock:
            name, count = base, 1
            while os.path.exists(os.path.join(self.store, SLOTS_DIR, name)):
                count += 1
                name = "%s-%d" % (base, count)
            path = os.path.join(self.store, SLOTS_DIR, name)
            self._in_flight.add(self._relative(path))
        os.rename(root, path)  # same filesystem (both under the store): atomic, no second copy
        return path

    def _forget_in_flight(self, relative: Optional[str]) -> None:
        with self._lock:
            self._in_flight.discard(relative or "")

    def _relative(self, path: str) -> str:
        return os.path.relpath(path, self.store).replace(os.sep, "/")

    def _gc(self) -> None:
        """Delete bundles under ``slots/`` that the table no longer names: the store keeps two at most."""
        slots_dir = os.path.join(self.store, SLOTS_DIR)
        with self._lock:
            table = self._table
            if table is None:  # before start() nothing is known to be garbage
                return
            keep = set(table.bundles()) | self._in_flight
            names = sorted(os.listdir(slots_dir)) if os.path.isdir(slots_dir) else []
            doomed = [n for n in names if "%s/%s" % (SLOTS_DIR, n) not in keep]
        for name in doomed:
            log.info("removing bundle %s from the store (no slot refers to it)", name)
            shutil.rmtree(os.path.join(slots_dir, name), ignore_errors=True)

    def _emit(self, event: Dict[str, Any]) -> None:
        try:
            self.on_event(event)
        except Exception:  # the publisher's failure must not undo a switch or a rollback already made
            log.exception("on_event failed for %s", event.get("event"))


def _public_key(text: Optional[str]) -> Optional[bytes]:
    if not text:
        return None
    try:
        return load_public_key(text)
    except (ValueError, OSError) as exc:
        raise ConfigError([FieldError("model.public_key", str(exc))]) from None
