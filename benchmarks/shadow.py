"""What a shadow run costs serving (issue 39: serving p95 latency at most 1.15x without one, no result lost).

The real :class:`agent.pipeline.serving.ServingLoop` serves camera frames that arrive at a camera's pace, with no
shadow run and with one open at ``sample`` 1.0: every frame served is offered to a candidate, the demo bundle's
int8 beside its float serving model, both on onnxruntime. The frames come from the camera rig
(agent/devtools/camera_rig.py): an RTSP camera playing the demo's scenes at :data:`PACE_FPS`, read by the daemon's
own RTSP source (a fresh one per run), each frame's latency counted from the moment the source queued it. Where the
rig cannot run, a feeder thread puts in-process frames on the queue at the same pace (``frames_from`` says which,
and why). Runs come in pairs whose order alternates (off-on, on-off, ...), in one process, so a neighbour's load
falls on both sides alike.

``serving_p95_ratio``, the acceptance figure: the median over the pairs of the serving p95 latency (frame put on
the queue to result handed over) with the shadow open over without. ``frames_compared_per_s``: what the candidate
compared per second of the runs with it open (at sample 1.0 it drops the frames that arrive while it is busy:
``dropped_busy``). ``results_lost``: frames queued and not published, plus frames the source dropped because the
queue was full, over every run: 0 is the bound. Serving is paced, not flat out: a box's cameras deliver frames at
their rate, and a loop saturating every core leaves a nice-19 candidate nothing to run on, which would flatter the
ratio.
"""

import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from benchmarks import throughput
from benchmarks.harness import RunContext, summarize, target
from benchmarks.workload import backend_available, bench_device, camera_frames, load_bundle

log = logging.getLogger(__name__)

TARGET_P95_RATIO = 1.15
BACKEND = "onnxruntime"  # the only CPU runtime that runs the bundle's int8 ONNX
PACE_FPS = 15.0
FRAME_POOL = 12
RIG_SIZE = (640, 360)  # the rig camera's (w, h): a camera's sub-stream; its encoder shares the cores
RUN_S = {"quick": 6.0, "full": 12.0}  # serving time per run: its p95 rests on 90 or 180 frames
PAIRS = {"quick": 4, "full": 8}


class _LatencySink:
    """Keeps each result's queue-to-hand-over latency (the payload's ``timings_ms.total``)."""

    def __init__(self) -> None:
        self.latencies_ms: List[float] = []

    def publish_result(self, source: str, payload: Dict[str, Any]) -> None:
        self.latencies_ms.append(float(payload["timings_ms"]["total"]))

    def publish_telemetry(self, telemetry: Dict[str, Any]) -> None:
        pass


def _serving_loop(model: Any, frames: "queue.Queue[Any]", sources: Any, shadow: Any) -> Tuple[Any, _LatencySink]:
    from agent.config.daemon_config import PublishConfig
    from agent.pipeline.handover import BetweenBatches
    from agent.pipeline.serving import ServingLoop

    sink = _LatencySink()
    loop = ServingLoop(frames, sources, throughput._OneModel(model, shadow), sink, throughput._NoProgress(),
                       BetweenBatches(), threading.Event(), 1, 0.0, PublishConfig(telemetry_interval_s=3600.0),
                       on_event=lambda event: None)
    return loop, sink


def _serve_paced(model: Any, images: List[Any], count: int, shadow: Any = None) -> Tuple[List[float], float, int]:
    """``count`` in-process frames put on the queue at :data:`PACE_FPS`; each result's latency, the seconds, and
    the frames lost (none can be dropped before the loop here)."""
    from agent.pipeline.sources import Frame, SourceSet

    frames: "queue.Queue[Any]" = queue.Queue()
    loop, sink = _serving_loop(model, frames, SourceSet([], frames), shadow)

    def feed() -> None:
        start = time.monotonic()
        for index in range(count):
            delay = start + index / PACE_FPS - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            frames.put(Frame(source="cam", frame_id=index, ts=time.time(), image=images[index % len(images)],
                             enqueued=time.monotonic()))

    feeder = threading.Thread(target=feed, name="bench-camera", daemon=True)
    started = time.perf_counter()
    feeder.start()
    loop.serve(max_frames=count)
    feeder.join()
    return sink.latencies_ms, time.perf_counter() - started, count - len(sink.latencies_ms)


def _serve_rig(url: str) -> Callable[..., Tuple[List[float], float, int]]:
    """A serve function reading ``url`` (the rig's camera) with the daemon's RTSP source, a fresh one per run, into
    a queue of the daemon's default size: frames lost are those queued and not published plus those the source
    dropped on a full queue."""
    from agent.config.daemon_config import BatchingConfig, SourceConfig
    from agent.pipeline.sources import SourceSet

    def serve(model: Any, images: List[Any], count: int, shadow: Any = None) -> Tuple[List[float], float, int]:
        frames: "queue.Queue[Any]" = queue.Queue(maxsize=BatchingConfig().queue_size)
        sources = SourceSet([SourceConfig(name="cam", uri=url)], frames)
        loop, sink = _serving_loop(model, frames, sources, shadow)
        sources.start()
        try:
            started = time.perf_counter()
            loop.serve(max_frames=count)
            seconds = time.perf_counter() - started
            dropped = sources.counters()["cam"]["dropped_queue_full"]
        finally:
            sources.stop(timeout=10.0)
        return sink.latencies_ms, seconds, count - len(sink.latencies_ms) + dropped

    return serve


def measure(serving: Any, load_candidate: Any, candidate: Any, images: List[Any], count: int, pairs: int,
            serve: Callable[..., Tuple[List[float], float, int]] = _serve_paced) -> Dict[str, Any]:
    from agent.pipeline.shadow import ShadowRun

    ratios, p95_on, p95_off, compared, dropped, offered, on_s = [], [], [], 0, 0, 0, 0.0
    lost = 0
    agreement: Optional[Dict[str, Any]] = None
    for index in range(pairs):
        p95 = {}
        for with_shadow in ((True, False) if index % 2 else (False, True)):
            run = None
            if with_shadow:
                run = ShadowRun(load_candidate, serving, {"name": candidate.manifest.name,
                                                         "version": candidate.manifest.version},
                                list(candidate.manifest.labels), 1.0, 10 ** 5, 3600.0, lambda report: None)
                run.start()
            latencies, seconds, run_lost = serve(serving, images, count, run)
            lost += run_lost
            p95[with_shadow] = float(np.percentile(latencies, 95))
            if run is not None:
                run.stop("bench round done", timeout=60.0)
                report = run.report()
                compared += report["frames_compared"]
                offered += report["frames_offered"]
                dropped += report["dropped_busy"]
                on_s += seconds
                agreement = report["agreement"]
        ratios.append(p95[True] / p95[False])
        p95_on.append(p95[True])
        p95_off.append(p95[False])
    ratio = summarize(ratios)
    return {
        "serving_p95_ratio": ratio["median"], "serving_p95_ratio_per_pair": ratio,
        "serving_p95_ms_with_shadow": summarize(p95_on), "serving_p95_ms_without": summarize(p95_off),
        "frames_compared_per_s": compared / on_s if on_s else 0.0, "dropped_busy": dropped,
        "frames_offered": offered, "results_lost": lost, "pace_fps": PACE_FPS, "frames_per_run": count, "pairs": pairs,
        "score_aware_f1_last_run": None if agreement is None else agreement["score_aware"]["f1"],
    }


def run(context: RunContext) -> Dict[str, Any]:
    from agent.devtools.camera_rig import Camera, rig_missing, write_clip
    from agent.pipeline.model import load_model

    problem = backend_available(BACKEND)
    if problem is not None:
        return {"skipped": "needs %s to run the int8 candidate: %s" % (BACKEND, problem)}
    bundle = load_bundle(context.bundle_dir)
    device = bench_device(context.threads, context.device)
    serving = load_model(bundle, device, BACKEND, precision="float")
    camera = None
    try:
        candidate = serving.bundle

        def load_candidate() -> Any:
            return load_model(candidate, device, BACKEND, precision="int8")

        missing = rig_missing()
        if missing:
            images, serve = camera_frames(FRAME_POOL), _serve_paced
            frames_from = "in-process frames at %g fps (the camera rig cannot run here: %s)" % (PACE_FPS, missing)
        else:
            images = camera_frames(FRAME_POOL, hw=(RIG_SIZE[1], RIG_SIZE[0]))
            clip = write_clip(os.path.join(context.work_dir, "shadow-scenes.bgr"), images)
            camera = Camera(size=RIG_SIZE, fps=int(PACE_FPS), clip=clip)
            serve = _serve_rig(camera.url())
            frames_from = "the camera rig: RTSP %dx%d at %g fps playing %d scenes, read by the daemon's source" % (
                RIG_SIZE + (PACE_FPS, FRAME_POOL))
        serve(serving, images, 10)  # warm-up (and, on the rig, a first open of the stream)
        count = int(PACE_FPS * RUN_S[context.profile.name])
        result = measure(serving, load_candidate, candidate, images, count, PAIRS[context.profile.name], serve)
    finally:
        if camera is not None:
            camera.close()
        serving.close()
    result.update(backend=BACKEND, serving=bundle.label + " float", candidate=bundle.label + " int8",
                  frames_from=frames_from)
    log.info("shadow: serving p95 %.1f ms with a shadow at sample 1.0, %.1f ms without (median ratio %.3f over %d "
             "pairs); %.1f frames compared/s, %d dropped busy, %d results lost; frames from %s",
             result["serving_p95_ms_with_shadow"]["median"], result["serving_p95_ms_without"]["median"],
             result["serving_p95_ratio"], result["pairs"], result["frames_compared_per_s"], result["dropped_busy"],
             result["results_lost"], frames_from)
    return result


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    if "skipped" in section:
        return {}
    return {"serving_p95_ratio": target(section.get("serving_p95_ratio"), "<=", TARGET_P95_RATIO),
            "results_lost": target(section.get("results_lost"), "<=", 0)}
