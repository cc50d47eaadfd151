"""Serving throughput as a ratio to the backend alone: does the serving loop keep the backend busy?

Frames from memory (1920x1080 camera scenes) go through the real :class:`agent.pipeline.serving.ServingLoop`:
batcher, letterbox into the tier's input buffers, the backend on its own thread, decode, result payload built
and handed to a sink that keeps it (publishing over MQTT is measured by ``mqtt.ratio_to_paho``). Side by side
in each round, the same backend runs alone on a ready batch for the same number of calls. The ratio of the two
frame rates is 1.0 when the host's work hides completely behind the backend's; the backend's busy fraction
comes from the same serving runs (seconds inside backend calls over the run's wall time).

Backends: the paced stand-in (:mod:`benchmarks.paced_backend`, an accelerator that holds each call for 3 ms or
1 ms without using the CPU), OpenCV and, where this interpreter can import it, MindSpore Lite. A CPU backend
shares the machine's cores with the host's letterbox and decode, so its ratio is bounded by the cores, not
by the loop: see benchmarks/README.md.
"""

import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from benchmarks.harness import summarize

log = logging.getLogger(__name__)

PACED_HOLDS_MS = (3.0, 1.0)  # an NPU call of the demo model's size, and a faster one
TARGET_RATIO_PACED_3MS = 0.9  # the target: the loop hides the host's work behind a 3 ms backend call


class _KeepingSink:
    """Keeps the count of results and the last payload (a payload is built per frame, as for MQTT)."""

    def __init__(self) -> None:
        self.results = 0
        self.last: Optional[Dict[str, Any]] = None

    def publish_result(self, source: str, payload: Dict[str, Any]) -> None:
        self.results += 1
        self.last = payload

    def publish_telemetry(self, telemetry: Dict[str, Any]) -> None:
        pass


class _NoProgress:
    def begin_inference(self) -> None:
        pass

    def end_inference(self) -> None:
        pass

    def frame_done(self, count: int = 1) -> None:
        pass

    def idle_tick(self) -> None:
        pass


class _OneModel:
    """The model source of a run with no swaps: always ``model`` (and ``shadow``'s tap, when one is open)."""

    def __init__(self, model: Any, shadow: Any = None) -> None:
        self.current = model
        self.shadow = shadow

    def between_batches(self) -> None:
        pass

    def shadow_tap(self) -> Any:
        return self.shadow

    def record_batch(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None:
        pass


def serve_frames(model: Any, images: List[Any], count: int, max_batch: int = 1,
                 attach: Optional[Callable[[Any], Callable[[], None]]] = None) -> Dict[str, float]:
    """``count`` frames (cycling through ``images``) through a fresh ServingLoop; frames/s and busy fraction.
    ``attach(loop)``, when given, starts something beside the loop (the metrics endpoint and its scraper,
    benchmarks/metrics_cost.py) before the clock starts and returns what stops it after the run."""
    from agent.config.daemon_config import PublishConfig
    from agent.pipeline.handover import BetweenBatches
    from agent.pipeline.serving import ServingLoop
    from agent.pipeline.sources import Frame, SourceSet

    frames: "queue.Queue[Any]" = queue.Queue()
    now = time.monotonic()
    for index in range(count):
        frames.put(Frame(source="bench", frame_id=index, ts=time.time(), image=images[index % len(images)],
                         enqueued=now))
    sink = _KeepingSink()
    loop = ServingLoop(frames, SourceSet([], frames), _OneModel(model), sink, _NoProgress(), BetweenBatches(),
                       threading.Event(), max_batch, 0.0, PublishConfig(telemetry_interval_s=3600.0),
                       on_event=lambda event: None)
    detach = attach(loop) if attach is not None else None
    started = time.perf_counter()
    try:
        loop.serve(max_frames=count)
    finally:
        elapsed = time.perf_counter() - started
        if detach is not None:
            detach()
    if sink.results != count:
        raise RuntimeError("the serving loop published %d of %d frames" % (sink.results, count))
    return {"fps": count / elapsed, "busy_fraction": loop.backend.busy_s / elapsed}


def backend_alone(model: Any, image: Any, count: int) -> float:
    """Frames per second of ``count`` backend calls on one ready batch of ``image`` (batch 1)."""
    chunk = model.prepare(model.tier_for(image.shape[:2]), [image])
    started = time.perf_counter()
    for _ in range(count):
        model.run(chunk)
    return count / (time.perf_counter() - started)


def measure(model: Any, images: List[Any], frames_per_round: int, rounds: int, warmup: int = 1
            ) -> Dict[str, Any]:
    """Serving and backend-alone runs side by side, alternating which goes first; per-round ratios."""
    for _ in range(warmup):
        serve_frames(model, images, frames_per_round)
        backend_alone(model, images[0], frames_per_round)
    ratios, busy, serving_fps, alone_fps = [], [], [], []
    for index in range(rounds):
        if index % 2:
            alone = backend_alone(model, images[0], frames_per_round)
            served = serve_frames(model, images, frames_per_round)
        else:
            served = serve_frames(model, images, frames_per_round)
            alone = backend_alone(model, images[0], frames_per_round)
        ratios.append(served["fps"] / alone)
        busy.append(served["busy_fraction"])
        serving_fps.append(served["fps"])
        alone_fps.append(alone)
    return {"ratio_to_backend": summarize(ratios), "backend_busy_fraction": summarize(busy),
            "serving_fps": summarize(serving_fps), "backend_alone_fps": summarize(alone_fps),
            "frames_per_round": frames_per_round, "rounds": rounds}


# Rounds per profile; each round serves about ROUND_BACKEND_S of backend time and runs the backend alone as long.
ROUNDS = {"quick": 5, "full": 15}
ROUND_BACKEND_S = {"quick": 0.6, "full": 1.0}
MIN_FRAMES, MAX_FRAMES = 20, 300  # per round: enough calls to amortise the loop's start, few on a slow backend


def frames_per_round(call_ms: float, profile_name: str) -> int:
    """Frames per round for a backend whose call takes ``call_ms``."""
    wanted = int(round(ROUND_BACKEND_S[profile_name] * 1e3 / max(call_ms, 1e-3)))
    return max(MIN_FRAMES, min(MAX_FRAMES, wanted))


def measure_backend(model: Any, images: List[Any], call_ms: float, profile_name: str) -> Dict[str, Any]:
    """:func:`measure` sized for this backend; the headline figures are the medians."""
    result = measure(model, images, frames_per_round(call_ms, profile_name), ROUNDS[profile_name])
    result["throughput_ratio_to_backend"] = result["ratio_to_backend"]["median"]
    result["backend_busy_fraction_median"] = result["backend_busy_fraction"]["median"]
    return result


def paced(bundle: Any, device: Any, images: List[Any], profile_name: str) -> Dict[str, Any]:
    """The paced stand-in at each of :data:`PACED_HOLDS_MS`, keyed ``paced_standin_3ms`` etc."""
    from agent.pipeline.model import LoadedModel
    from benchmarks.paced_backend import freeze, paced_factory

    out: Dict[str, Any] = {}
    for hold_ms in PACED_HOLDS_MS:
        made: List[Any] = []
        model = LoadedModel(bundle, device, "opencv", 1, backend_factory=paced_factory(hold_ms / 1e3, made))
        model.load()
        try:
            model.warm_up()
            model.infer_frames([images[0]])  # a real call on a real frame: the outputs the stand-in returns
            freeze(made)
            result = measure_backend(model, images, hold_ms, profile_name)
        finally:
            model.close()
        result["hold_ms"] = hold_ms
        out["paced_standin_%gms" % hold_ms] = result
        log.info("throughput paced stand-in %g ms: %.3f of the backend alone, busy %.3f", hold_ms,
                 result["throughput_ratio_to_backend"], result["backend_busy_fraction_median"])
    return out
