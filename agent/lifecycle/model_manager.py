"""Two model slots, a hot swap between batches, and automatic rollback while a new model is on probation.

The orchestrator: the bundle store (:mod:`agent.lifecycle.store`) holds the files, the probation window
(:mod:`agent.lifecycle.probation`) judges a new model, the slot table (:mod:`agent.lifecycle.slots`) records
the decisions, start-up (:mod:`agent.lifecycle.recovery`) undoes what a crash or damage left, the swap
(:mod:`agent.lifecycle.swap`) changes what serves, with the table, under one lock, and the serving loop's one
handover queue (:class:`agent.pipeline.handover.BetweenBatches`) makes every change of the serving model happen
between two batches.

Threads and who does what (the daemon's serving loop is the only thread that runs inference):

- the command dispatcher's long worker runs :meth:`ModelManager.deploy` and its control worker
  :meth:`ModelManager.rollback` and :meth:`ModelManager.cancel` (a rollback cancels a running deploy first, waits
  for it to stop, then rolls back; a deploy honours a cancel within 2 s while it downloads or unpacks): fetch, verify,
  load, warm up and self-test the new model *off* the serving thread, write the slot table, then submit the
  swap to the handover queue and wait, with the caller's timeout; a swap the loop did not take in time is
  withdrawn (it never happens), the old table is written back and the new model released;
- the serving loop runs the handover queue and then :meth:`ModelManager.between_batches` before each batch
  (an automatic rollback or confirmation is decided and applied right there, on the serving thread), and
  :meth:`ModelManager.record_batch` after it. A batch therefore runs on one model from start to end, and a
  half-loaded model is never reachable.

Order that makes crashes safe: the table saying "slot b pending" is on disk before the serving loop switches
to b, so a process that dies at any later point comes back on the confirmed slot and reports a rollback.

Memory: the confirmed model stays loaded while a new one is pending. Both are loaded at once anyway at the
moment of a switch without downtime, so keeping the old one for the window does not raise the peak (on a 310
board the deploy fails cleanly at load time if the two do not fit, and the serving model is untouched); in
return a rollback is a reference swap that cannot fail on a reload.

Clocks: windows run on ``clock`` (monotonic by default, injectable for tests); wall time appears only in the
slot table's ``since``/``at`` fields and in the names of set-aside store entries, both for people.
"""

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Optional, Tuple

from agent._util.redact import redact
from agent.bundle.manifest import MANIFEST, Manifest
from agent.bundle.signing import load_public_key
from agent.bundle.verify import Bundle, sha256_file, verify_bundle
from agent.config.daemon_config import DaemonConfig
from agent.config.device_config import DeviceConfig
from agent.config.schema import ConfigError, FieldError
from agent.errors import CommandError
from agent.lifecycle.fetch import fetch_bundle
from agent.lifecycle.fetch_policy import FetchPolicy
from agent.lifecycle.recovery import Recovery
from agent.lifecycle.slots import (
    CONFIRMED,
    STANDBY,
    STATE_FILE,
    Slot,
    SlotTable,
    filled_slot,
    other_slot,
    with_pending,
    with_swapped,
)
from agent.lifecycle.store import BundleStore
from agent.lifecycle.swap import ModelSwap, identity
from agent.lifecycle.unpack import Pin, Scan, check_manifest_pin
from agent.pipeline.artifacts import select_artifacts
from agent.pipeline.handover import BetweenBatches, HandoverTimeout
from agent.pipeline.model import LoadedModel, load_model
from agent.pipeline.shadow import ShadowRun
from agent.protocol.events import EVENT_KEY, Event, event_message
from agent.protocol.requests import DeployRequest, ShadowRequest
from agent.protocol.verbs import ROLLBACK, SHADOW_STOP

log = logging.getLogger(__name__)

# The serving loop runs the handover queue at least once per batch wait (milliseconds) or per inference; 30 s
# covers a long first batch on a slow box without leaving an operator's command hanging for minutes.
DEFAULT_SWITCH_TIMEOUT_S = 30.0
# How long a stopping daemon waits for a shadow candidate to end its frame: a hung runtime call must not hold the
# stop past systemd's TimeoutStopSec (the candidate's thread is a daemon thread and ends with the process).
SHADOW_STOP_S = 10.0

# The rollback trigger decided here, as reported in events and acks (the window's own are in probation.py,
# start-up's in recovery.py).
TRIGGER_OPERATOR = "operator"


def release_key(version: str) -> Optional[Tuple[int, ...]]:
    """The order of a manifest version: its leading dotted numbers (``2.10.0-rc1`` -> (2, 10, 0)), or None."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else None


def check_succession(serving: Slot, manifest: Manifest, request: DeployRequest) -> None:
    """Refuse another model, or an older release than the confirmed one, unless the command allows it.

    Both facts come from the manifest, which the command pinned by hash (and a configured key signed): a
    captured old deploy, or a validly signed bundle of another model, does not silently replace this one.
    """
    if serving.name and manifest.name != serving.name and not request.allow_model_change:
        raise CommandError("model_change", "the bundle is model %r, this box serves %r: send "
                           "allow_model_change: true to replace it" % (manifest.name, serving.name),
                           field="allow_model_change")
    if not serving.version or request.allow_downgrade or manifest.version == serving.version:
        return
    new, old = release_key(manifest.version), release_key(serving.version or "")
    if new is None or old is None or new < old:
        why = ("is older than" if new is not None and old is not None
               else "cannot be ordered against (versions compare as dotted numbers)")
        raise CommandError("downgrade", "release %s %s the confirmed %s: send allow_downgrade: true to deploy "
                           "it anyway" % (manifest.version, why, serving.version), field="allow_downgrade")


@dataclass
class _Candidate:
    """A shadow run's candidate (docs/shadow.md): the run, and the bundle's store entry, installed for the
    inactive slot and kept out of gc until a deploy of it takes it into the table or it is discarded. A
    restart forgets it: the start's gc deletes the entry, which no slot names."""

    run: ShadowRun
    installed: str  # store-relative
    bundle: Bundle


class ModelManager:
    """The serving model, its A/B slots, deploys, the probation window and rollbacks, and shadow runs (see
    module doc)."""

    def __init__(self, config: Callable[[], DaemonConfig], device: DeviceConfig, backend: str,
                 on_event: Callable[[Dict[str, Any]], None], handover: BetweenBatches,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 switch_timeout_s: float = DEFAULT_SWITCH_TIMEOUT_S,
                 on_phase: Optional[Callable[[str], None]] = None, manifest: Optional[Manifest] = None,
                 on_shadow_report: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        """``config`` returns the daemon's config each time it is called: the daemon owns the live config
        (set-config and SIGHUP replace it between batches), so a deploy or a rollback reads the batching and
        thresholds in effect then. The store, the key and the fetch policy are restart-only: read here once.

        ``manifest`` is ``model.bundle``'s manifest as the daemon read it (and chose the backend by): a first
        start installs that bundle only if the copy it verifies still has that manifest.

        ``on_shadow_report(report)`` gets each report of a shadow run (the daemon publishes it, retained)."""
        self._config = config
        start = config()
        # Called as each loading step begins ("verify", "load", "warm-up", "golden check"): the daemon extends
        # systemd's start-up timeout per step.
        self.on_phase: Callable[[str], None] = on_phase or (lambda name: None)
        self.device = device
        self.backend = backend
        self.on_event = on_event
        self.handover = handover
        self.clock = clock
        self.switch_timeout_s = switch_timeout_s
        self.manifest = manifest
        self.public_key = _public_key(start.model.public_key)
        self.fetch_policy = FetchPolicy.from_config(start.fetch)
        self.store = BundleStore(start.state_path(start.model.store), self.public_key, wall_clock=wall_clock)
        self.state_file = start.state_path(STATE_FILE)
        self.wall_clock = wall_clock
        self._operation = threading.Lock()  # one deploy or standby restore at a time
        self._cancel = threading.Event()  # set by cancel(): the running deploy stops at its next check
        self.on_shadow_report: Callable[[Dict[str, Any]], None] = on_shadow_report or (lambda report: None)
        self._candidate: Optional[_Candidate] = None  # changed under _operation only
        # What serves, the table and the window (agent/lifecycle/swap.py): changed only by a swap or a window's end.
        self._swap = ModelSwap(self.state_file, clock, handover, config, self._emit, self._gc)

    # --- start and the serving loop's side ----------------------------------------------------------------

    def start(self) -> LoadedModel:
        """Serve the confirmed slot; undo a model left pending by a crash; on first start, import one."""
        with self._operation:
            model, table = Recovery(self.store, self.state_file, self.config.model.bundle, self.public_key,
                                    self._load, self._emit, self.on_phase, self.wall_clock,
                                    first_manifest=self.manifest).run()
            with self._swap.lock:
                self._swap.table = table
                self._swap.current = model
            self._gc()
            log.info("serving %s from slot %s", model.label, table.serving)
            return model

    @property
    def current(self) -> LoadedModel:
        """The model for the next batch; read it after the handover queue ran, once per batch."""
        model = self._swap.current
        if model is None:
            raise RuntimeError("ModelManager.start() has not run")
        return model

    def between_batches(self) -> None:
        """Serving thread only: judge the pending model's window, and roll back or confirm it right here."""
        if self._swap.probation.window is None:
            return  # the common case costs one attribute read
        try:
            self._swap.evaluate()
        except Exception:  # a full disk must not stop serving; the window is judged again next batch
            log.exception("judging the pending model failed")

    def record_batch(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None:
        """Serving thread only, after each batch, for the model that :attr:`current` returned for it."""
        self._swap.record_batch(frames, infer_ms_per_frame, failed)

    @property
    def config(self) -> DaemonConfig:
        """The daemon's config now (see ``__init__``)."""
        return self._config()

    def apply_thresholds(self) -> None:
        """The live config's post-processing overrides, to the models in memory (a model loaded later reads
        them at load); the daemon calls it after it switched the live config."""
        for model in (self._swap.current, self._swap.fallback):
            if model is not None:
                self._apply_thresholds(model)

    # --- commands (command worker thread) ------------------------------------------------------------------

    def deploy(self, request: DeployRequest, progress: Callable[[str], None],
               timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Fetch, verify, load and self-test a bundle into the standby slot, then switch to it as pending.

        ``timeout_s`` (default ``switch_timeout_s``) bounds the wait for the serving loop to take the model.
        Raises CommandError / BundleError / ConfigError with the reason; the serving model is untouched then.
        """
        expected_sha = request.sha256.lower()
        if not self._operation.acquire(blocking=False):
            raise CommandError("busy", "another deploy or rollback is running")
        self._cancel.clear()
        try:
            table = self._started_table()
            if table.pending is not None:
                pending = table.slots[table.pending]
                raise CommandError("busy", "%s %s is pending in slot %s: wait for its observation window "
                                   "or roll it back first" % (pending.name, pending.version, table.pending))
            serving = table.slots[table.serving]
            if serving.manifest_sha256 == expected_sha:
                raise CommandError("already_serving", "%s %s (manifest %s) is already serving" % (
                    serving.name, serving.version, expected_sha[:12]), field="sha256")
            slot = other_slot(table.serving)
            candidate = self._candidate
            if candidate is not None and candidate.bundle.manifest_sha256 == expected_sha:
                model, new_slot = self._promote(candidate, serving, request, progress)
            else:
                if candidate is not None and candidate.run.running:
                    raise CommandError("busy", "a shadow run of %s is running: end it first (%s) or deploy "
                                       "that bundle" % (candidate.bundle.label, SHADOW_STOP))
                self._drop_candidate("a deploy of another bundle")
                model, new_slot = self._prepare(request, serving, slot, progress)
            try:
                if self._cancel.is_set():  # a rollback preempts a deploy up to its switch
                    model.close()
                    raise CommandError("cancelled", "the deploy was cancelled after loading; nothing changed")
                progress("switching to %s in slot %s" % (model.label, slot))
                self._swap.switch(model, slot, lambda t: with_pending(t, slot, new_slot), opens_window=True,
                                  timeout=self.switch_timeout_s if timeout_s is None else timeout_s)
            finally:
                self.store.settled(new_slot.bundle)  # recorded in the table now, or garbage
        finally:
            self._operation.release()
            self._gc()
        return {"slot": slot, "state": "pending", "model": identity(model),
                "previous": table.slots[table.serving].identity(),
                "observation_s": self.config.model.observation_s}

    def rollback(self, reason: str = TRIGGER_OPERATOR, timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Back to the confirmed model; with nothing pending, to the previously confirmed (standby) one.

        A pending model's rollback goes through the handover queue behind anything already there (a deploy's
        swap included: the swap happens, then is undone); ``timeout_s`` (default ``switch_timeout_s``) bounds
        the wait, and a rollback the loop did not take in time is withdrawn.
        """
        detail = "rollback command" if reason == TRIGGER_OPERATOR else reason
        text = "%s: %s" % (TRIGGER_OPERATOR, detail)
        timeout = self.switch_timeout_s if timeout_s is None else timeout_s
        if not self._pending():
            self._take_operation(timeout)
            try:
                if not self._pending():  # else the preempted deploy had switched already: undo it below
                    return self._restore_standby(self._started_table(), text, timeout)
            finally:
                self._operation.release()
        try:
            return self.handover.submit(lambda: self._swap.rollback_pending(text), timeout, what=ROLLBACK)
        except HandoverTimeout:
            raise CommandError("switch_timeout", "the serving loop did not roll back within %.1f s; "
                               "nothing changed" % timeout) from None

    def _pending(self) -> bool:
        """A model on probation, or a deploy's swap queued for the serving loop."""
        with self._swap.lock:
            self._started_table()
            return self._swap.probation.window is not None or self._swap.swap_queued

    def _take_operation(self, timeout_s: float) -> None:
        """The operation lock for a rollback: a running deploy is cancelled first and waited for (it stops at
        its next check: within 2 s while downloading or unpacking, after the load while loading)."""
        if self._operation.acquire(blocking=False):
            return
        self._cancel.set()
        log.info("rollback: cancelling the running deploy first")
        if not self._operation.acquire(timeout=timeout_s):
            raise CommandError("busy", "the running deploy did not stop within %.1f s of its cancel; nothing "
                               "changed" % timeout_s)

    def cancel(self) -> Dict[str, Any]:
        """Stop a running deploy at its next check (the download's watch, each gunzip step or archive read, before
        and after loading); it then fails ``cancelled`` and nothing changes. Once its switch is submitted it is
        no longer cancelled: roll it back."""
        running = self._operation.locked()
        if running:
            self._cancel.set()
        return {"cancelled": running}

    def status(self) -> Dict[str, Any]:
        with self._swap.lock:
            table, window = self._swap.table, self._swap.probation.window
        if table is None:
            return {"serving": None, "slots": {}}
        result = table.public()
        if window is not None:
            result["pending"] = dict(window.figures(self.clock()), slot=window.slot,
                                     observation_s=self.config.model.observation_s)
        return result

    def close(self) -> None:
        """Release every model; a swap still queued fails with 'shutting_down' when (if ever) the loop runs it, and
        a running deploy stops at its next check, a shadow run at its next frame."""
        self._cancel.set()
        candidate = self._candidate
        if candidate is not None and not candidate.run.stop("the daemon is stopping", timeout=SHADOW_STOP_S):
            log.warning("the shadow candidate did not stop within %.0f s (a call into its runtime still runs); "
                        "the daemon stops without it", SHADOW_STOP_S)
        self._swap.close()

    # --- shadow runs (docs/shadow.md) ----------------------------------------------------------------------

    def shadow(self, request: ShadowRequest, progress: Callable[[str], None]) -> Dict[str, Any]:
        """Fetch, verify and install a candidate as a deploy would, load and self-test it beside the serving
        model, and start comparing them on live frames; answers once it runs. Nothing serves it, and nothing
        changes on the box until a ``deploy`` of the same bundle (which then needs no download)."""
        expected_sha = request.sha256.lower()
        if not self._operation.acquire(blocking=False):
            raise CommandError("busy", "a deploy or rollback is running")
        self._cancel.clear()
        try:
            table = self._started_table()
            if table.pending is not None or self._swap.probation.window is not None:
                raise CommandError("busy", "a model is pending in slot %s: wait for its observation window or "
                                   "roll it back first" % table.pending)
            serving = table.slots[table.serving]
            if serving.manifest_sha256 == expected_sha:
                raise CommandError("already_serving", "%s %s (manifest %s) is the serving model" % (
                    serving.name, serving.version, expected_sha[:12]), field="sha256")
            reference = self.current
            if reference.manifest.task == "classify":
                raise CommandError("unsupported", "a shadow run compares detections; %s is a classifier"
                                   % reference.label)
            self._drop_candidate("a new shadow run")
            slot = other_slot(table.serving)
            bundle, installed = self._fetch_install(request, slot, progress, self._select)
            progress("loading %s beside %s (warm-up and golden self-test)" % (bundle.label, reference.label))
            run = ShadowRun(lambda: self._load(bundle), reference, _bundle_identity(bundle),
                            list(bundle.manifest.labels), request.sample, request.frames, request.max_s,
                            self._shadow_report, nice=self.config.model.shadow_nice)
            try:
                run.start()
            except RuntimeError as exc:  # the runtime refused the model
                self.store.discard(installed)
                raise CommandError("load_failed", "%s: %s" % (bundle.label, exc)) from exc
            except BaseException:
                self.store.discard(installed)
                raise
            self._candidate = _Candidate(run, installed, bundle)
        finally:
            self._operation.release()
        log.info("shadow run: %s beside %s, sample %g, %d frames, at most %g s", bundle.label, reference.label,
                 request.sample, request.frames, request.max_s)
        return {"state": run.state, "slot": slot, "candidate": run.candidate_identity,
                "reference": identity(reference), "conf": run.conf, "low": round(run.low, 6),
                "sample": request.sample, "frames": request.frames, "max_s": request.max_s}

    def shadow_stop(self, discard: bool) -> Dict[str, Any]:
        """End the shadow run now (its final report is published), and with ``discard`` delete its candidate."""
        candidate = self._candidate
        if candidate is None:
            raise CommandError("no_shadow", "no shadow run is open, and no candidate is kept")
        was_running = candidate.run.running
        candidate.run.stop("stopped by the operator")
        if discard:
            if not self._operation.acquire(blocking=False):
                raise CommandError("busy", "a deploy or shadow command is running: discard after it")
            try:
                self._drop_candidate("discarded by the operator")
            finally:
                self._operation.release()
        return {"stopped": was_running, "discarded": discard, "report": candidate.run.report()}

    def shadow_tap(self) -> Optional[ShadowRun]:
        """The open shadow run, for the serving loop (seams.ShadowTap); None when none runs."""
        candidate = self._candidate
        return candidate.run if candidate is not None and candidate.run.running else None

    def shadow_report(self) -> Optional[Dict[str, Any]]:
        """The last shadow run's report as it stands (running or ended), or None."""
        candidate = self._candidate
        return candidate.run.report() if candidate is not None else None

    def _shadow_report(self, report: Dict[str, Any]) -> None:
        self.on_shadow_report(report)

    def _promote(self, candidate: _Candidate, serving: Slot, request: DeployRequest,
                 progress: Callable[[str], None]) -> Tuple[LoadedModel, Slot]:
        """A deploy of the shadow run's candidate: its installed copy, verified again, loaded for serving (the
        run's own copy ran at the lowest CPU priority), without a second download."""
        candidate.run.stop("promoted: a deploy of the candidate")
        self._candidate = None  # its store entry is the deploy's now: in the table, or discarded below
        progress("verifying %s (the shadow run's candidate, already on the box)" % candidate.bundle.label)
        try:
            bundle = verify_bundle(self.store.path(candidate.installed), self.public_key)
            if bundle.manifest_sha256 != candidate.bundle.manifest_sha256:
                raise CommandError("bundle_changed", "the candidate's manifest changed on disk since its shadow "
                                   "run; send the deploy again to fetch it anew", field="sha256")
            check_succession(serving, bundle.manifest, request)
            self._select(bundle)
        except BaseException:
            self.store.discard(candidate.installed)
            raise
        return self._load_installed(bundle, candidate.installed, progress)

    def _drop_candidate(self, why: str) -> None:
        """Under the operation lock: end the kept candidate's run and delete its store entry."""
        candidate, self._candidate = self._candidate, None
        if candidate is None:
            return
        candidate.run.stop("replaced: %s" % why)
        self.store.discard(candidate.installed)
        log.info("shadow candidate %s discarded: %s", candidate.bundle.label, why)

    # --- deploy steps ------------------------------------------------------------------------------------

    def _prepare(self, request: DeployRequest, serving: Slot, slot: str, progress: Callable[[str], None]
                 ) -> Tuple[LoadedModel, Slot]:
        """Fetch into staging (an archive authenticated before it is unpacked), check the pinned hash, verify,
        refuse a silent downgrade or model change, install into the store, load and self-test."""

        def deployable(bundle: Bundle) -> None:
            check_succession(serving, bundle.manifest, request)
            self._select(bundle)

        bundle, installed = self._fetch_install(request, slot, progress, deployable)
        return self._load_installed(bundle, installed, progress)

    def _fetch_install(self, request: Any, slot: str, progress: Callable[[str], None],
                       judge: Callable[[Bundle], None]) -> Tuple[Bundle, str]:
        """A deploy's or a shadow run's bundle (``request``: bundle, sha256, archive_sha256), fetched, pinned,
        verified, judged (``judge`` raises to refuse it) and installed in the store for ``slot``; returns it
        and its store-relative directory, safe from gc until settled or discarded."""
        shown = redact(request.bundle)
        expected_sha = request.sha256.lower()
        pin, pinned = Pin(expected_sha, self.public_key), []

        def check(seen: Scan) -> None:
            pin(seen)
            pinned.append(True)

        with self.store.staging() as staging:
            progress("fetching %s" % shown)
            root = fetch_bundle(request.bundle, self.store.root, staging, self.fetch_policy, check,
                                request.archive_sha256, self._cancel.is_set)
            manifest_path = os.path.join(root, MANIFEST)
            check_manifest_pin(sha256_file(manifest_path) if os.path.isfile(manifest_path) else None, expected_sha)
            progress("verifying %s" % shown)
            # An archive's files were hashed by both passes against the pinned manifest: not a third time (that
            # re-read of up to 1 GiB could not be cancelled). A directory copied from the store is hashed here.
            bundle = verify_bundle(root, self.public_key, check_hashes=not pinned)
            judge(bundle)
            if self._cancel.is_set():
                raise CommandError("cancelled", "cancelled before loading; nothing changed")
            installed = self.store.install(root, slot, bundle)
        return replace(bundle, root=self.store.path(installed)), installed

    def _select(self, bundle: Bundle) -> None:
        """Refuse a bundle with nothing this box's backend can run (raises naming what is missing)."""
        select_artifacts(bundle, self.device, self.backend, batch=self.config.batching.max_batch,
                         precision=self.config.model.precision)

    def _load_installed(self, bundle: Bundle, installed: str, progress: Callable[[str], None]
                        ) -> Tuple[LoadedModel, Slot]:
        """Load and self-test an installed bundle; on failure its store entry goes and the error names it."""
        progress("loading %s with %s (warm-up and golden self-test)" % (bundle.label, self.backend))
        try:
            model = self._load(bundle)
        except RuntimeError as exc:  # BackendError / BackendUnavailable: the runtime refused the model
            self.store.discard(installed)
            raise CommandError("load_failed", "%s: %s" % (bundle.label, exc)) from exc
        except BaseException:
            self.store.discard(installed)
            raise
        return model, filled_slot(CONFIRMED, installed, bundle.manifest_sha256, bundle.manifest.name,
                                  bundle.manifest.version)

    def _restore_standby(self, table: SlotTable, reason: str, timeout_s: float) -> Dict[str, Any]:
        """Nothing pending: reload the previously confirmed bundle and make it the confirmed, serving one."""
        standby = table.slot_in(STANDBY)
        if standby is None:
            raise CommandError("nothing_to_roll_back", "no model is pending and no previous model is kept")
        kept = table.slots[standby]
        model = self._load(self.store.verify(kept))
        current = table.slots[table.serving]
        self._swap.switch(model, standby, with_swapped, opens_window=False, timeout=timeout_s)
        self._gc()
        self._emit(event_message(Event.ROLLBACK, reason=reason, trigger=TRIGGER_OPERATOR, slot=table.serving,
                                 to=kept.identity(), figures=None, **{"from": current.identity()}))
        return {"slot": standby, "state": CONFIRMED, "model": kept.identity(),
                "rolled_back": current.identity(), "reason": reason}

    # --- helpers -------------------------------------------------------------------------------------------

    def _started_table(self) -> SlotTable:
        table = self._swap.table
        if table is None:
            raise CommandError("not_started", "the model manager has not started")
        return table

    def _load(self, bundle: Bundle) -> LoadedModel:
        model = load_model(bundle, self.device, self.backend, max_batch=self.config.batching.max_batch,
                           on_phase=self.on_phase, precision=self.config.model.precision)
        self._apply_thresholds(model)
        return model

    def _apply_thresholds(self, model: LoadedModel) -> None:
        th = self.config.thresholds
        model.set_thresholds(conf=th.conf, iou=th.iou, max_det=th.max_det, top_k=th.top_k)

    def _gc(self) -> None:
        """Delete store entries the table no longer names: the store keeps two bundles at most."""
        if self._swap.table is None:  # before start() nothing is known to be garbage
            return
        self.store.gc(lambda: self._swap.table.bundles() if self._swap.table is not None else [])

    def _emit(self, event: Dict[str, Any]) -> None:
        try:
            self.on_event(event)
        except Exception:  # the publisher's failure must not undo a switch or a rollback already made
            log.exception("on_event failed for %s", event.get(EVENT_KEY))


def _bundle_identity(bundle: Bundle) -> Dict[str, Any]:
    """A bundle as events and acks name a model."""
    return {"name": bundle.manifest.name, "version": bundle.manifest.version,
            "manifest_sha256": bundle.manifest_sha256}


def _public_key(text: Optional[str]) -> Optional[bytes]:
    if not text:
        return None
    try:
        return load_public_key(text)
    except (ValueError, OSError) as exc:
        raise ConfigError([FieldError("model.public_key", str(exc))]) from None
