"""The serving loop: frame queue → batcher → model → result payloads → a result sink.

One thread serves; it is the only one that runs inference, so a model switch between batches needs no lock.
Everything that changes what the next batch sees (a config change, a swap, a rollback) reaches it through
:class:`~agent.pipeline.handover.BetweenBatches`, which the loop drains before each batch.

The loop knows nothing of MQTT or systemd: it publishes through a :class:`ResultSink` (the daemon passes the
MQTT transport), marks liveness on a :class:`ProgressSink` (the daemon passes the watchdog's progress monitor)
and asks a :class:`ModelSource` (the model manager) for the model of each batch. Those are structural types, so
``pipeline`` imports neither ``ops`` nor ``health``.
"""

import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent._util.compat import Protocol
from agent.config.daemon_config import PublishConfig
from agent.pipeline.batcher import Batcher
from agent.pipeline.handover import BetweenBatches
from agent.pipeline.model import LoadedModel
from agent.pipeline.results import SequenceCounter, result_payload
from agent.pipeline.sources import Frame, SourceSet
from agent.pipeline.stats import StageStats

log = logging.getLogger(__name__)

# While paused the loop only turns this often: fast enough that resume, stop and handover items are prompt.
PAUSED_POLL_S = 0.05
# Characters of a backend's error message carried in an ``inference_error`` event (a traceback can be huge).
EVENT_ERROR_CHARS = 200

ResultCallback = Callable[[Frame, Dict[str, Any]], None]


class ResultSink(Protocol):
    """Where results and telemetry go (the MQTT transport, which falls back to its outbox)."""

    def publish_result(self, source: str, payload: Dict[str, Any]) -> None: ...

    def publish_telemetry(self, telemetry: Dict[str, Any]) -> None: ...


class ProgressSink(Protocol):
    """Liveness marks (the watchdog's progress monitor): around each backend call and per finished frame."""

    def begin_inference(self) -> None: ...

    def end_inference(self) -> None: ...

    def frame_done(self, count: int = 1) -> None: ...

    def idle_tick(self) -> None: ...


class ModelSource(Protocol):
    """The model of the next batch (the model manager), told how each batch went for its probation window."""

    @property
    def current(self) -> LoadedModel: ...

    def between_batches(self) -> None: ...

    def record_batch(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None: ...


class ServingLoop:
    """Serve batches until stopped; owns the batcher, the stage statistics and the serving counters.

    ``on_event(dict)`` receives an ``inference_error`` event for a failed batch; ``telemetry_extras()`` adds the
    daemon's own figures (memory, MQTT) to each telemetry message; ``on_result(frame, payload)`` sees every
    result, published or rate-limited (the demo's console view).
    """

    def __init__(self, frames: "queue.Queue[Frame]", sources: SourceSet, models: ModelSource, sink: ResultSink,
                 progress: ProgressSink, handover: BetweenBatches, stop_event: threading.Event,
                 max_batch: int, max_wait_ms: float, publish: PublishConfig,
                 on_event: Callable[[Dict[str, Any]], None],
                 telemetry_extras: Callable[[], Dict[str, Any]] = dict,
                 on_result: Optional[ResultCallback] = None,
                 numbering: Optional[SequenceCounter] = None) -> None:
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
        self.stats = StageStats()
        self.published = 0
        self.inference_errors = 0
        self.paused = False
        self.dropped_on_resume = 0
        self.latest: Optional[Tuple[Frame, Dict[str, Any]]] = None  # replaced whole: readers see a matched pair
        self._last_telemetry = 0.0
        self._last_publish: Dict[str, float] = {}

    def configure(self, max_batch: int, max_wait_ms: float, publish: PublishConfig) -> None:
        """Serving thread only (a handover item): batching and publishing take effect from the next batch."""
        self.batcher.configure(max_batch, max_wait_ms)
        self.publish = publish

    def serve(self, max_frames: Optional[int] = None, until_sources_end: bool = False) -> Optional[str]:
        """Serve until the stop event is set; returns why the loop stopped on its own (None when told to)."""
        while not self.stop_event.is_set():
            self.handover.run_pending()
            self.models.between_batches()
            if self.paused:
                self.progress.idle_tick()  # paused on purpose is not a hang
                self._maybe_telemetry()
                self.stop_event.wait(PAUSED_POLL_S)
                continue
            batch = self.batcher.next_batch(self.stop_event)
            if batch:
                self.serve_batch(batch)
            else:
                self.progress.idle_tick()
                if until_sources_end and self.sources.all_finished() and self.frames.empty():
                    return "sources finished"
            self._maybe_telemetry()
            if max_frames is not None and self.stats.frames >= max_frames:
                return "%d frames done" % max_frames
        return None

    def set_paused(self, paused: bool) -> int:
        """Pause stops inference at once; frames queued meanwhile are stale on resume, so they are dropped.

        Returns how many were dropped. Any thread may call it (the flag is read once per loop turn).
        """
        self.sources.pause(paused)
        stale = 0
        if not paused:
            while True:
                try:
                    self.frames.get_nowait()
                    stale += 1
                except queue.Empty:
                    break
            self.dropped_on_resume += stale
        self.paused = paused
        return stale

    # --- one batch ----------------------------------------------------------------------------------------

    def serve_batch(self, batch: List[Frame]) -> None:
        model = self.models.current
        started = time.monotonic()
        self.progress.begin_inference()
        try:
            results = model.infer_frames([f.image for f in batch])
        except Exception as exc:  # a failing model must be reported and counted, and serving goes on
            self.inference_errors += 1
            self.stats.error()
            self.models.record_batch(len(batch), 0.0, failed=True)
            log.exception("inference failed on a batch of %d", len(batch))
            self.on_event({"event": "inference_error", "error": str(exc)[:EVENT_ERROR_CHARS]})
            return
        finally:
            self.progress.end_inference()
        infer_ms = results[0].timings_ms.get("infer", 0.0) if results else 0.0
        self.models.record_batch(len(batch), infer_ms, failed=False)
        identity = {"name": model.manifest.name, "version": model.manifest.version}
        labels = model.manifest.labels
        for frame, result in zip(batch, results):
            timings = dict(result.timings_ms)
            timings["queue"] = (started - frame.enqueued) * 1e3
            timings["total"] = (time.monotonic() - frame.enqueued) * 1e3
            payload = result_payload(frame, result, identity, labels, timings,
                                     seq=self.numbering.next(frame.source))
            self.stats.add(timings)
            self.latest = (frame, payload)
            if self._rate_allows(frame.source):
                self.sink.publish_result(frame.source, payload)
                self.published += 1
            if self.on_result is not None:
                self.on_result(frame, payload)
        self.stats.frame_done(len(batch))
        self.progress.frame_done(len(batch))

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
        """The periodic telemetry message: the pipeline's figures plus the daemon's ``telemetry_extras``."""
        info: Dict[str, Any] = {
            "ts": time.time(),
            "fps": round(self.stats.fps(), 2),
            "frames": self.stats.frames,
            "latency_ms": self.stats.percentiles(),
            "queue_depth": self.frames.qsize(),
            "inference_errors": self.inference_errors,
            "dropped_on_resume": self.dropped_on_resume,
            "sources": self.sources.counters(),
        }
        info.update(self.telemetry_extras())
        return info
