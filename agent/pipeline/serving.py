"""The serving loop: frame queue → batcher → letterbox → backend → decode → result payloads → a result sink.

The stages overlap. One backend thread (:mod:`agent.pipeline.backend_thread`) makes every backend call, in
order, one at a time; the serving thread letterboxes the next chunk into the tier's other preallocated input
buffer while the backend runs the current one, and decodes and publishes the previous one meanwhile. A batch
from the batcher is one or more chunks (:mod:`agent.pipeline.inflight`); its results are published together,
in frame order, so each source's frames keep their order.

Between two batches, with nothing on the backend, the loop runs the
:class:`~agent.pipeline.handover.BetweenBatches` queue and the model source's ``between_batches``: a config
change, a swap, a rollback, a pause or a resume lands there, so a batch runs on one model from its letterbox
to its decode. Shutdown and pause stop taking frames and finish everything already taken.

Others use the loop through :class:`~agent.pipeline.seams.ServingControl` (pause, resume, its views) and, the
daemon, its lifecycle and the between-batches changes (configure, replace the sources). It knows nothing of
MQTT or systemd: it publishes through a :class:`~agent.pipeline.seams.ResultSink`, marks liveness on a
:class:`~agent.pipeline.seams.ProgressSink` and asks a :class:`~agent.pipeline.seams.ModelSource` for the
model of each batch, structural types the daemon fills in.
"""

import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent._util.ratelog import LogLimiter
from agent.config.daemon_config import PublishConfig, SourceConfig
from agent.pipeline.backend_thread import BackendThread
from agent.pipeline.batcher import Batcher
from agent.pipeline.drift import DriftWatch
from agent.pipeline.handover import BetweenBatches
from agent.pipeline.inflight import Batch, Chunk
from agent.pipeline.model import LoadedModel
from agent.pipeline.results import SequenceCounter, result_payload
from agent.pipeline.seams import ModelSource, ProgressSink, ResultSink
from agent.pipeline.sources import Frame, SourceSet
from agent.pipeline.stats import StageStats
from agent.protocol.events import Event, event_message

log = logging.getLogger(__name__)

# While paused the loop only turns this often: fast enough that resume, stop and handover items are prompt.
PAUSED_POLL_S = 0.05
# Characters of a backend's error message carried in an ``inference_error`` event (a traceback can be huge).
EVENT_ERROR_CHARS = 200
# How long the batcher waits for a first frame when nothing is in flight (keeps stop, pause and handover prompt).
IDLE_WAIT_S = 0.1
# Bound on stopping every source reader together: a reader notices stop within a poll (0.1 s) and its camera's
# worker process gets 0.5 s to exit before it is killed.
SOURCES_STOP_S = 2.0

ResultCallback = Callable[[Frame, Dict[str, Any]], None]


class ServingLoop:
    """Serve batches until stopped; owns the batcher, the backend thread and its counters, and drives the sources
    and statistics it is given (their maker keeps its own references).

    ``on_event(dict)`` receives an ``inference_error`` event; ``telemetry_extras()`` adds the daemon's figures
    (memory, MQTT) to telemetry; ``on_result(frame, payload)`` sees every result (the demo's console view)."""

    def __init__(self, frames: "queue.Queue[Frame]", sources: SourceSet, models: ModelSource, sink: ResultSink,
                 progress: ProgressSink, handover: BetweenBatches, stop_event: threading.Event,
                 max_batch: int, max_wait_ms: float, publish: PublishConfig,
                 on_event: Callable[[Dict[str, Any]], None],
                 telemetry_extras: Callable[[], Dict[str, Any]] = dict,
                 on_result: Optional[ResultCallback] = None,
                 numbering: Optional[SequenceCounter] = None, stats: Optional[StageStats] = None,
                 drift: Optional[DriftWatch] = None) -> None:
        """``sources``, ``stats`` and ``drift`` are the caller's: the daemon keeps its own references to them (its
        watchdog recycles a source's worker, its metrics endpoint reads the histograms, its status the drift)
        instead of reaching in here; the loop feeds ``drift`` every result and judges it once per turn."""
        self.frames = frames
        self.sources = sources
        self.models = models
        self.sink = sink
        self.progress = progress
        self.handover = handover
        self.stop_event = stop_event
        self.batcher: Batcher[Frame] = Batcher(frames, max_batch, max_wait_ms)
        self.publish = publish
        self.on_event = on_event
        self.telemetry_extras = telemetry_extras
        self.on_result = on_result
        self.numbering = numbering or SequenceCounter()  # per-source `seq` in each result (in memory if not given)
        self.backend = BackendThread(progress)
        self.stats = stats if stats is not None else StageStats()
        self.drift = drift
        self.taken = 0  # frames taken from the queue; every one ends published, rate-limited or failed
        self.published = 0
        self.inference_errors = 0
        self.publish_errors = 0  # results the sink or the result callback raised on: counted, serving goes on
        self._publish_log = LogLimiter(log)
        self.failed_frames = 0
        self._paused = False  # changed on the serving thread only, through the handover queue
        self.dropped_on_resume = 0
        self._latest: Optional[Tuple[Frame, Dict[str, Any]]] = None  # replaced whole: readers see a matched pair
        self._serving_thread: Optional[threading.Thread] = None  # while serve() runs
        self._last_telemetry = 0.0
        self._last_publish: Dict[str, float] = {}
        self._preparing: Optional[Batch] = None  # the batch whose chunks are being prepared
        self._ready: Optional[Chunk] = None  # prepared, not yet on the backend
        self._running: Optional[Chunk] = None  # on the backend

    def configure(self, max_batch: int, max_wait_ms: float, publish: PublishConfig) -> None:
        """Between batches only (a handover item): batching and publishing take effect from the next batch."""
        self._between_batches_only("the batching and publishing change")
        self.batcher.configure(max_batch, max_wait_ms)
        self.publish = publish

    def serve(self, max_frames: Optional[int] = None, until_sources_end: bool = False) -> Optional[str]:
        """Serve until the stop event is set; returns why the loop stopped on its own (None when told to).
        Either way, every frame already taken from the queue is served before it returns."""
        self._serving_thread = threading.current_thread()
        self.backend.start()
        reason: Optional[str] = None
        try:
            while not self.stop_event.is_set() and reason is None:
                reason = self._turn(max_frames, until_sources_end)
            while self._in_flight():  # drain: shutdown loses no frame it took
                self._turn(None, False, taking=False)
        finally:
            self.backend.stop()
            self._serving_thread = None
        return reason

    def _in_flight(self) -> bool:
        return self._running is not None or self._ready is not None or (
            self._preparing is not None and bool(self._preparing.todo))

    # --- what the daemon and its commands use (seams.ServingControl) ----------------------------------------

    def pause(self, timeout: float) -> None:
        """Stop taking frames. Returns once the loop applied it between batches: no frame is taken after that,
        and what was taken before is still served. Any thread but the serving one; raises
        :class:`~agent.pipeline.handover.HandoverTimeout` (nothing changed) when the loop did not get to it."""
        self.handover.submit(lambda: self._set_paused(True), timeout, what="pause")

    def resume(self, timeout: float) -> int:
        """Take frames again from the next batch on; returns how many frames queued before it were dropped as
        stale. As :meth:`pause`: through the handover queue, applied between batches."""
        return self.handover.submit(lambda: self._set_paused(False), timeout, what="resume")

    def status(self, windows: bool = True) -> Dict[str, Any]:
        """The loop's own view (any thread): its figures, counters and whether it is paused. Telemetry and the
        daemon's ``status`` answer are built on it; it holds nothing of the daemon's (memory, MQTT).
        ``windows=False`` leaves out ``fps`` and ``latency_ms`` (copying and sorting each stage's recent samples
        under the lock the serving thread takes per frame): the Prometheus endpoint's scrape exports histograms."""
        busy = self.backend.busy_fraction()
        info = {
            "ts": time.time(),
            "frames": self.stats.frames,
            "backend_busy_fraction": None if busy is None else round(busy, 3),
            "queue_depth": self.frames.qsize(),
            "published": self.published,
            "inference_errors": self.inference_errors,
            "publish_errors": self.publish_errors,
            "dropped_on_resume": self.dropped_on_resume,
            "paused": self._paused,
            "sources": self.sources.counters(),
        }
        if windows:
            info.update(fps=round(self.stats.fps(), 2), latency_ms=self.stats.percentiles())
        return info

    @property
    def paused(self) -> bool:
        return self._paused

    def latest(self) -> Optional[Tuple[Frame, Dict[str, Any]]]:
        """The last frame served and its result payload (a snapshot's picture), or None; any thread."""
        return self._latest

    def start_sources(self) -> None:  # the daemon's start; stop_sources is its shutdown's first step
        self.sources.start()

    def stop_sources(self, timeout: float = SOURCES_STOP_S) -> bool:
        return self.sources.stop(timeout)

    def replace_sources(self, configs: List[SourceConfig]) -> Tuple[List[str], List[str]]:
        """Between batches only (a handover item, as the daemon's config switch): stop the sources removed or
        changed and start the added or changed ones (the others keep their workers), paused when the loop is.
        Returns (names removed, names started)."""
        self._between_batches_only("replacing the sources")
        changes = self.sources.update(list(configs), timeout=SOURCES_STOP_S)
        self.sources.pause(self._paused)  # a frame read before this is stale at resume, and dropped then
        return changes

    def _set_paused(self, paused: bool) -> int:
        """Serving thread (a handover item); resume drops the frames queued before it and returns how many."""
        stale = 0
        while not paused:
            try:
                self.frames.get_nowait()
                stale += 1
            except queue.Empty:
                break
        self.dropped_on_resume += stale
        self.sources.pause(paused)
        self._paused = paused
        return stale

    def _between_batches_only(self, what: str) -> None:
        serving = self._serving_thread
        if serving is not None and serving is not threading.current_thread():
            raise RuntimeError("%s changes what the next batch sees: hand it to the serving loop through the "
                               "handover queue" % what)

    # --- one turn of the pipeline ---------------------------------------------------------------------------

    def _turn(self, max_frames: Optional[int], until_sources_end: bool, taking: bool = True) -> Optional[str]:
        """Prepare the next chunk, collect the running one, pass a point between batches, submit, publish."""
        room = None if max_frames is None else max(0, max_frames - self.taken)  # `--frames N` takes N, no more
        if self._ready is None:
            self._ready = self._prepare_next(taking and not self._paused and room != 0, room)
        finished = self._collect()
        if self._ready is None or self._ready.first:  # nothing on the backend, no batch half-served
            self.handover.run_pending()
            self.models.between_batches()
            if self._ready is not None and self._ready.batch.model is not self.models.current:
                self._replan(self._ready)
        if self._ready is not None:
            self._submit(self._ready)
            self._ready = None
        if finished is not None:
            self._decode(finished)
        reason = None
        if finished is None and self._running is None and self._ready is None:
            self.progress.idle_tick()  # nothing to do, on purpose or for want of frames: not a hang
            if self._paused and taking:
                self.stop_event.wait(PAUSED_POLL_S)
            elif until_sources_end and self.sources.all_finished() and self.frames.empty():
                reason = "sources finished"
        self._maybe_telemetry()
        if self.drift is not None:
            self.drift.tick()
        if room == 0 and not self._in_flight():  # each frame taken ends published, rate-limited or failed
            reason = "%d frames done" % max_frames
        return reason

    def _prepare_next(self, taking: bool, at_most: Optional[int] = None) -> Optional[Chunk]:
        """Letterbox the next chunk: the rest of the batch being prepared, else a new batch from the batcher."""
        batch = self._preparing
        if batch is None or not batch.todo:
            self._preparing = batch = None
            if not taking:
                return None
            # With a chunk on the backend, only take frames that are already waiting: its results must not
            # wait for the next frame to arrive.
            frames = self.batcher.next_batch(self.stop_event, 0.0 if self._running is not None else IDLE_WAIT_S,
                                             at_most)
            if not frames:
                return None
            self.taken += len(frames)
            batch = self._preparing = Batch(frames, self.models.current, time.monotonic())
            return self._letterbox(batch, plan_for=batch.model)
        return self._letterbox(batch)

    def _letterbox(self, batch: Batch, plan_for: Optional[LoadedModel] = None) -> Optional[Chunk]:
        """Letterbox the batch's next chunk, after planning its chunks for ``plan_for`` when given.

        A frame the model cannot take (no tier fits it, the letterbox raises) fails its batch, not the loop.
        """
        try:
            if plan_for is not None:
                batch.plan(plan_for)
            return batch.next_chunk()
        except Exception as exc:
            self._fail(batch, exc)
            return None

    def _replan(self, chunk: Chunk) -> None:
        """The model changed between batches: letterbox the new batch again, for the model that serves it."""
        self._ready = self._letterbox(chunk.batch, plan_for=self.models.current)

    def _submit(self, chunk: Chunk) -> None:
        chunk.submitted_at = time.monotonic()
        model, prepared = chunk.batch.model, chunk.prepared
        chunk.call = self.backend.submit(lambda: model.run(prepared))
        self._running = chunk

    def _collect(self) -> Optional[Chunk]:
        """Wait for the chunk on the backend and account its call; a failed call fails its batch."""
        chunk = self._running
        if chunk is None:
            return None
        assert chunk.call is not None
        chunk.call.done.wait()
        self._running = None
        batch = chunk.batch
        batch.chunks_left -= 1
        batch.infer_s += chunk.call.seconds
        if chunk.call.error is not None:
            self._fail(batch, chunk.call.error)
        return chunk

    def _record(self, batch: Batch) -> None:
        """Tell the model source how the batch went, once: as failed, or as served once its last chunk decoded.

        Not when the model source has moved on from the batch's model meanwhile (a swap or a rollback between
        its last backend call and its decode): the window it belonged to is closed, and the record would count
        against the model that replaced it.
        """
        if batch.recorded:
            return
        batch.recorded = True
        if batch.model is not self.models.current:
            return
        per_frame_ms = 0.0 if batch.failed else batch.infer_s * 1e3 / len(batch.frames)
        self.models.record_batch(len(batch.frames), per_frame_ms, failed=batch.failed)

    def _fail(self, batch: Batch, error: BaseException) -> None:
        """A failing model is reported and counted; the batch's other chunks are dropped, serving goes on."""
        if batch.failed:
            return
        batch.failed = True
        self._record(batch)
        batch.todo.clear()
        if self._ready is not None and self._ready.batch is batch:
            self._ready = None
        if self._preparing is batch:
            self._preparing = None
        self.inference_errors += 1
        self.failed_frames += len(batch.frames)
        self.stats.error()
        log.error("inference failed on a batch of %d: %s", len(batch.frames), error, exc_info=error)
        self.on_event(event_message(Event.INFERENCE_ERROR, error=str(error)[:EVENT_ERROR_CHARS]))

    def _decode(self, chunk: Chunk) -> None:
        batch = chunk.batch
        if batch.failed:
            return
        call = chunk.call
        assert call is not None
        started = time.monotonic()
        shadow = self.models.shadow_tap()
        try:
            decoded = batch.model.decode(chunk.prepared, call.outputs,
                                         floor=None if shadow is None else shadow.low)
        except Exception as exc:  # outputs the decoder cannot read fail the batch, as a backend error does
            self._fail(batch, exc)
            return
        timings = chunk.timings(started)
        for index, result in zip(chunk.indices, decoded):
            result.timings_ms.update(timings)
            if shadow is not None and result.detections is not None:
                # the run sees what serving found down to its low threshold; results carry what they always did
                shadow.offer(batch.frames[index].image, result.detections, batch.model)
                result.detections = result.detections[result.detections[:, 4] >= batch.model.thresholds.conf]
            batch.results[index] = result
        if batch.chunks_left == 0:
            self._record(batch)
            self._publish(batch)

    def _publish(self, batch: Batch) -> None:
        manifest = batch.model.manifest
        identity = batch.model.identity()  # name, version, backend, precision
        for frame, result in zip(batch.frames, batch.results):
            assert result is not None
            timings = dict(result.timings_ms)
            timings["queue"] = (batch.taken - frame.enqueued) * 1e3
            started = time.monotonic()
            timings["total"] = (started - frame.enqueued) * 1e3  # up to the hand-over to the sink
            age_ms = (time.time() - frame.ts) * 1e3  # capture to hand-over, on the wall clock the capture used
            self.sources.published(frame, age_ms)
            payload = result_payload(frame, result, identity, manifest.labels, timings,
                                     seq=self.numbering.next(frame.source), frame_age_ms=age_ms)
            if self._rate_allows(frame.source):
                if self._hand_over(frame, self.sink.publish_result, frame.source, payload):
                    self.published += 1
            timings["publish"] = (time.monotonic() - started) * 1e3  # in the statistics, not in the payload
            self.stats.add(timings)
            if self.drift is not None and result.detections is not None:
                self.drift.observe(frame.source, result.detections[:, 4])
            self._latest = (frame, payload)
            if self.on_result is not None:
                self._hand_over(frame, self.on_result, frame, payload)
        self.stats.frame_done(len(batch.frames))
        self.progress.frame_done(len(batch.frames))

    def _hand_over(self, frame: Frame, deliver: Callable[..., Any], *args: Any) -> bool:
        """Give one result away; a sink that raises (a state database fault, a callback's bug) costs that result,
        counted and logged with its cause, never the loop and the frames behind it."""
        try:
            deliver(*args)
            return True
        except Exception as exc:
            self.publish_errors += 1
            self._publish_log.log(logging.ERROR, "publish", "result of %s frame %s not handed over: %s: %s",
                                  frame.source, frame.frame_id, type(exc).__name__, exc)
            return False

    def _rate_allows(self, source: str) -> bool:
        limit = self.publish.max_rate_hz
        if limit <= 0:
            return True
        now = time.monotonic()
        if now - self._last_publish.get(source, 0.0) < 1.0 / limit:
            return False
        self._last_publish[source] = now
        return True

    # --- telemetry ----------------------------------------------------------------------------------------

    def _maybe_telemetry(self) -> None:
        now = time.monotonic()
        if now - self._last_telemetry >= self.publish.telemetry_interval_s:
            self._last_telemetry = now
            self.sink.publish_telemetry(self.telemetry())

    def telemetry(self) -> Dict[str, Any]:
        """The periodic telemetry message: the loop's :meth:`status` plus the daemon's ``telemetry_extras``."""
        info = self.status()
        info["model"] = self.models.current.identity()  # name, version, backend, precision
        info.update(self.telemetry_extras())
        return info
