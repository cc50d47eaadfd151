"""What a shadow run costs serving (issue 39: serving p95 latency at most 1.15x without one, no result lost).

The real :class:`agent.pipeline.serving.ServingLoop` serves camera frames that arrive at a camera's pace
(:data:`PACE_FPS`, a feeder thread putting each frame on the queue at its time, its latency counted from then),
with no shadow run and with one open at ``sample`` 1.0: every frame served is offered to a candidate, the demo
bundle's int8 beside its float serving model, both on onnxruntime. Runs come in pairs whose order alternates
(off-on, on-off, ...), in one process, so a neighbour's load falls on both sides alike.

``serving_p95_ratio``, the acceptance figure: the median over the pairs of the serving p95 latency (frame put on
the queue to result handed over) with the shadow open over without. ``frames_compared_per_s``: what the candidate
compared per second of the runs with it open (at sample 1.0 it drops the frames that arrive while it is busy:
``dropped_busy``). ``results_lost``: frames put in and not published, over every run (0 by construction: the
check that it stays so). Serving is paced, not flat out: a box's cameras deliver frames at their rate, and a
loop saturating every core leaves a nice-19 candidate nothing to run on, which would flatter the ratio.
"""

import logging
import queue
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from benchmarks import throughput
from benchmarks.harness import RunContext, summarize, target
from benchmarks.workload import backend_available, bench_device, camera_frames, load_bundle

log = logging.getLogger(__name__)

TARGET_P95_RATIO = 1.15
BACKEND = "onnxruntime"  # the only CPU runtime that runs the bundle's int8 ONNX
PACE_FPS = 15.0
FRAME_POOL = 12
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


def _serve_paced(model: Any, images: List[Any], count: int, shadow: Any = None) -> Tuple[List[float], float]:
    """``count`` frames put on the queue at :data:`PACE_FPS`; returns each result's latency and the seconds."""
    from agent.config.daemon_config import PublishConfig
    from agent.pipeline.handover import BetweenBatches
    from agent.pipeline.serving import ServingLoop
    from agent.pipeline.sources import Frame, SourceSet

    frames: "queue.Queue[Any]" = queue.Queue()
    sink = _LatencySink()
    loop = ServingLoop(frames, SourceSet([], frames), throughput._OneModel(model, shadow), sink,
                       throughput._NoProgress(), BetweenBatches(), threading.Event(), 1, 0.0,
                       PublishConfig(telemetry_interval_s=3600.0), on_event=lambda event: None)

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
    return sink.latencies_ms, time.perf_counter() - started


def measure(serving: Any, load_candidate: Any, candidate: Any, images: List[Any], count: int, pairs: int
            ) -> Dict[str, Any]:
    from agent.pipeline.shadow import ShadowRun

    ratios, p95_on, p95_off, compared, dropped, on_s = [], [], [], 0, 0, 0.0
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
            latencies, seconds = _serve_paced(serving, images, count, run)
            lost += count - len(latencies)
            p95[with_shadow] = float(np.percentile(latencies, 95))
            if run is not None:
                run.stop("bench round done", timeout=60.0)
                report = run.report()
                compared += report["frames_compared"]
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
        "results_lost": lost, "pace_fps": PACE_FPS, "frames_per_run": count, "pairs": pairs,
        "score_aware_f1_last_run": None if agreement is None else agreement["score_aware"]["f1"],
    }


def run(context: RunContext) -> Dict[str, Any]:
    from agent.pipeline.model import load_model

    problem = backend_available(BACKEND)
    if problem is not None:
        return {"skipped": "needs %s to run the int8 candidate: %s" % (BACKEND, problem)}
    bundle = load_bundle(context.bundle_dir)
    device = bench_device(context.threads, context.device)
    images = camera_frames(FRAME_POOL)
    serving = load_model(bundle, device, BACKEND, precision="float")
    try:
        candidate = serving.bundle

        def load_candidate() -> Any:
            return load_model(candidate, device, BACKEND, precision="int8")

        _serve_paced(serving, images, 10)  # warm-up
        count = int(PACE_FPS * RUN_S[context.profile.name])
        result = measure(serving, load_candidate, candidate, images, count, PAIRS[context.profile.name])
    finally:
        serving.close()
    result.update(backend=BACKEND, serving=bundle.label + " float", candidate=bundle.label + " int8")
    log.info("shadow: serving p95 %.1f ms with a shadow at sample 1.0, %.1f ms without (median ratio %.3f over %d "
             "pairs); %.1f frames compared/s, %d dropped busy, %d results lost",
             result["serving_p95_ms_with_shadow"]["median"], result["serving_p95_ms_without"]["median"],
             result["serving_p95_ratio"], result["pairs"], result["frames_compared_per_s"], result["dropped_busy"],
             result["results_lost"])
    return result


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    if "skipped" in section:
        return {}
    return {"serving_p95_ratio": target(section.get("serving_p95_ratio"), "<=", TARGET_P95_RATIO),
            "results_lost": target(section.get("results_lost"), "<=", 0)}
