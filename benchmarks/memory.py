"""Memory: resident set size over many frames and over many model load/close cycles.

Frames: RSS is sampled every so many frames through ``LoadedModel.infer_frames`` (batch 1, 1080p frames); a
straight line is fitted to the samples after the warm-up share (allocators and caches grow at first), and its
slope, scaled to 10,000 frames, is the figure. A leak of a small buffer per frame shows up as a steady slope.

Swaps: a model is loaded, run on one frame and closed, again and again (as hot swaps and rollbacks do), with
RSS sampled after each cycle; the slope per cycle after the first two is reported. Triton users report about
1 GB per 50 such cycles; the number here says whether the agent (and its runtimes) do the same.
"""

import gc
import logging
from typing import Any, Dict, List

from benchmarks import lite_lane
from benchmarks.harness import RunContext, linear_slope, target
from benchmarks.workload import backend_available, bench_device, camera_frames, load_bundle, open_model

log = logging.getLogger(__name__)

TARGET_MB_PER_10K_FRAMES = 1.0  # the target: less than 1 MB of growth per 10,000 frames
FRAMES_PER_SAMPLE_TARGET = 40  # samples per run: enough points for a steady fit at any run length
WARMUP_SHARE = 0.2  # the first 20% of frames are excluded from the fit
SWAP_WARMUP_CYCLES = 2  # first cycles fill caches (compiled-graph cache, allocator pools)
FRAME_POOL = 8
HEADLINE_BACKEND = "mindspore"  # full runs: cpu-dev's preferred backend
QUICK_BACKEND = "opencv"  # quick runs: the faster CPU backend (about 2.5x on the demo model)

TARGETS = {"rss_mb_per_10k_frames": ("<", TARGET_MB_PER_10K_FRAMES)}


def rss_mb() -> float:
    from agent.health.readers import read_rss_mb

    value = read_rss_mb()
    if value is None:
        raise RuntimeError(
            "RSS is not readable here (/proc/self/statm missing): the memory section needs Linux"
        )
    return value


def frames_slope(model: Any, frames: List[Any], count: int) -> Dict[str, Any]:
    """RSS samples over ``count`` frames and the fitted growth per 10,000 frames after the warm-up share."""
    every = max(1, count // FRAMES_PER_SAMPLE_TARGET)
    xs: List[int] = [0]
    ys: List[float] = [rss_mb()]
    for index in range(1, count + 1):
        model.infer_frames([frames[index % len(frames)]])
        if index % every == 0:
            xs.append(index)
            ys.append(rss_mb())
    start = next(i for i, x in enumerate(xs) if x >= count * WARMUP_SHARE)
    fit = linear_slope(xs[start:], ys[start:])
    return {
        "frames": count,
        "sample_every": every,
        "warmup_frames": xs[start],
        "rss_mb_start": ys[0],
        "rss_mb_end": ys[-1],
        "rss_mb_per_10k_frames": fit["slope"] * 10000,
        "fit": fit,
        "samples": {"frames": xs, "rss_mb": [round(y, 3) for y in ys]},
    }


def swaps_slope(bundle: Any, device: Any, backend: str, frame: Any, cycles: int) -> Dict[str, Any]:
    """RSS after each of ``cycles`` load / infer / close cycles, and the growth per cycle after warm-up."""
    from agent.pipeline.model import LoadedModel

    rss = [rss_mb()]
    for _ in range(cycles):
        model = LoadedModel(bundle, device, backend)
        model.load()
        try:
            model.infer_frames([frame])
        finally:
            model.close()
        gc.collect()
        rss.append(rss_mb())
    result: Dict[str, Any] = {
        "cycles": cycles,
        "rss_mb": [round(v, 3) for v in rss],
        "growth_mb": rss[-1] - rss[0],
    }
    fitted = list(range(len(rss)))[SWAP_WARMUP_CYCLES:]
    if len(fitted) >= 2:
        fit = linear_slope(fitted, rss[SWAP_WARMUP_CYCLES:])
        result.update(rss_mb_per_swap=fit["slope"], fit=fit)
    return result


def run(context: RunContext) -> Dict[str, Any]:
    profile = context.profile
    bundle = load_bundle(context.bundle_dir)
    device = bench_device(context.threads, context.device)
    frames = camera_frames(FRAME_POOL)
    backends = [b for b in context.backends if backend_available(b) is None]
    if not backends:
        raise RuntimeError(
            "no backend can run here: %s" % {b: backend_available(b) for b in context.backends}
        )
    if profile.name == "quick":  # one backend, the fastest, keeps the quick run in its 2-minute budget
        backends = [QUICK_BACKEND] if QUICK_BACKEND in backends else backends[:1]
    per_backend: Dict[str, Any] = {}
    for backend in backends:
        model = open_model(bundle, device, backend, 1)
        try:
            frames_result = frames_slope(model, frames, profile.memory_frames)
        finally:
            model.close()
        swaps = swaps_slope(bundle, device, backend, frames[0], profile.memory_swaps)
        per_backend[backend] = {"frames": frames_result, "swaps": swaps}
        log.info(
            "memory %s: %.3f MB per 10k frames, %.3f MB per swap",
            backend,
            frames_result["rss_mb_per_10k_frames"],
            swaps.get("rss_mb_per_swap", float("nan")),
        )
    if lite_lane.delegated(context):  # mslite runs in the Lite venv's Python 3.7 (benchmarks/lite_lane.py)
        per_backend[lite_lane.BACKEND] = lite_lane.measure("memory", context)
    headline_backend = HEADLINE_BACKEND if HEADLINE_BACKEND in per_backend else backends[0]
    headline = per_backend[headline_backend]
    return {
        "rss_mb_per_10k_frames": headline["frames"]["rss_mb_per_10k_frames"],
        "rss_mb_per_swap": headline["swaps"].get("rss_mb_per_swap"),
        "headline_backend": headline_backend,
        "bundle": bundle.label,
        "backends": per_backend,
    }


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {key: target(section.get(key), op, threshold) for key, (op, threshold) in TARGETS.items()}
