"""``quant`` section: does quantization pay where it runs? Per model (the demo detector, a YOLOv8n-shaped
stand-in), side by side in one run: onnxruntime float and int8 (the QAT scales, and onnxruntime's own PTQ),
cv2.dnn float and MindSpore Lite float (the Lite lane, benchmarks/lite_lane.py), each through the agent's own
backend and preprocessing: inference ms (a filled input) and whole-frame ms at 1 and 2 threads, file bytes, and
mAP@0.5 on the QAT run's held-out split (demo) or detection agreement with onnxruntime float (stand-in).

*Whole frame* is the box's per-frame path for one frame, the same in every lane: ``BatchPreprocessor.fill`` (the
one letterbox, resizing the camera frame straight into the lane's preallocated input: uint8 BGR NHWC where the
model takes it, else the host-normalised float32 NCHW), ``Backend.infer`` (its checks and the runtime's call),
and ``postprocess.decode`` (threshold, class-aware NMS); not the box mapping or the result payload. The frames
are 1080p camera frames, 1920x1080 (:data:`benchmarks.workload.CAMERA_HW`, as in issue 28's measurement and the
other sections), letterboxed to 256x144 inside the demo's 256x256 input. Frames 1080 rows tall with the tier's
aspect (:func:`benchmarks.workload.frame_hw_for_tier`: 1080x1080 for the demo) fill the whole input, about 1.5x
that resize work: they are timed too, demo at 1 thread, and reported beside (``frame_ratio_to_float_filled``,
no target), the worst case for the int8 lane's share of host work.

The in-process lanes are timed round-robin (:func:`benchmarks.harness.compare`), so each ratio to onnxruntime
float is a median of per-round ratios; the Lite lane runs in its own interpreter, so ratios to it are ratios of
medians. Headline keys (demo, 1 thread): ``size_ratio`` (int8 bytes / float ONNX bytes),
``infer_ratio_to_float`` and ``frame_ratio_to_float`` (int8 / onnxruntime float), ``frame_ratio_to_lite``,
``frame_ratio_to_opencv``, ``map_int8`` (the int8 lane's mAP), ``map_qat_report`` (the bundle's report.json),
``frame_hw`` (the frames' height and width), ``frame_hw_filled``.
The int8 lane is the QAT one when the bundle has it, else the PTQ one (``int8_lane`` says which).
"""

import dataclasses
import json
import logging
import os
from typing import Any, Dict, List, Sequence

import numpy as np

from benchmarks.harness import compare, ratio_summary, scaled, summarize, target
from benchmarks.quant_models import STANDIN_SCENE_HW, Lane, ModelUnderTest, demo_model, standin_model
from benchmarks.report import get_path

log = logging.getLogger(__name__)

THREADS = (1, 2)
REFERENCES = {"ort_float": "float", "opencv_float": "opencv", "lite_float": "lite"}  # lane -> ratio key suffix
FRAMES = 4  # distinct camera frames cycled through the whole-frame timing
MAP_IMAGES = 300  # the QAT run's held-out split (quant/examples/shapes.yaml test_count), as its report's mAP
DEMO_DATA_SEED = 1  # quant/examples/shapes.yaml data.seed
FILLED_KEY = "threads_1_frames_filled"  # a lane's whole-frame figures on frames filling the input (demo, 1 thread)
STANDIN_AGREEMENT_FRAMES = {"quick": 2, "full": 6}
# (warm-up, timed rounds) per lane for a 640x640 model: a YOLOv8n takes 0.1-0.8 s a call on 2 shared cores
HEAVY_ROUNDS = {"quick": (1, 4), "full": (2, 15)}
HEAVY_PIXELS = 320 * 320  # tiers above this are timed with HEAVY_ROUNDS instead of the profile's
# generated scenes for PTQ (a quarter of them held out by bundle create: 8 in a full run, some 50 detections for
# the stand-in's check, where one lost detection is 2 %)
CALIBRATION = {"quick": 16, "full": 32}
TARGETS = {  # issue 28's acceptance, 1 thread, demo detector
    "size_ratio": ("<=", 0.30),
    "infer_ratio_to_float": ("<=", 0.70),
    "frame_ratio_to_float": ("<=", 0.70),
    "frame_ratio_to_lite": ("<=", 0.60),
    "frame_ratio_to_opencv": ("<=", 0.40),
    "standin_infer_ratio_to_float": ("<=", 0.55),
}


def run(context: Any) -> Dict[str, Any]:
    if tuple(context.backends) == ("mslite",):  # inside the Lite lane's interpreter: the .ms only
        return {"backends": {"mslite": lite_figures(context)}}
    calibration = CALIBRATION[context.profile.name]
    models = [demo_model(_demo_dir(context), context.work_dir, calibration),
              standin_model(context.work_dir, calibration)]
    section: Dict[str, Any] = {"threads": list(THREADS), "models": {}}
    for model in models:
        section["models"][model.key] = measure_model(model, context)
    section.update(headline(section["models"]["demo"], _demo_dir(context)))
    standin = section["models"]["yolov8n"]
    section["standin_infer_ratio_to_float"] = get_path(standin, "lanes.ort_int8_ptq.threads.1.infer_ratio_to_float")
    return section


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {key: target(section.get(key), op, threshold) for key, (op, threshold) in TARGETS.items()}


def _demo_dir(context: Any) -> str:
    from benchmarks.workload import DEMO_BUNDLE

    return context.bundle_dir if context.bundle_dir else DEMO_BUNDLE


# --- one model -------------------------------------------------------------------------------------------------

def measure_model(model: ModelUnderTest, context: Any) -> Dict[str, Any]:
    from benchmarks.workload import CAMERA_HW, camera_frames, frame_hw_for_tier

    frames = camera_frames(FRAMES, CAMERA_HW)
    filled: Dict[str, Any] = {}
    lanes: Dict[str, Dict[str, Any]] = {lane.name: {"backend": lane.backend, "precision": lane.precision,
                                                    "file": os.path.basename(lane.path),
                                                    "bytes": os.path.getsize(lane.path),
                                                    "input": "uint8 NHWC" if lane.model_input else "float32 NCHW",
                                                    "threads": {}} for lane in model.lanes}
    for threads in THREADS:
        for name, figures in time_lanes(model, frames, threads, context.profile).items():
            lanes[name]["threads"][str(threads)] = figures
    if model.key == "demo":  # frames that fill the whole input, beside the 1080p ones
        filled_frames = camera_frames(FRAMES, frame_hw_for_tier(model.tier))
        filled["frame_hw_filled"] = list(filled_frames[0].shape[:2])
        for name, figures in time_lanes(model, filled_frames, 1, context.profile).items():
            lanes[name][FILLED_KEY] = {k: v for k, v in figures.items() if k.startswith("frame_")}
        for lane in model.lanes:
            lanes[lane.name]["map50"] = demo_map(model, lane)
    else:
        agreement_frames = camera_frames(STANDIN_AGREEMENT_FRAMES[context.profile.name], STANDIN_SCENE_HW, seed=77)
        for lane in model.lanes:
            lanes[lane.name]["agreement_with_ort_float"] = agreement(model, lane, agreement_frames)
    lanes["lite_float"] = _lite_lane(model, context)
    _lite_ratios(lanes)
    return {"label": model.label, "tier": list(model.tier), "frame_hw": list(frames[0].shape[:2]), **filled,
            "task": model.task, "lanes": lanes,
            "skipped": model.skipped, "notes": model.notes}


class _Opened:
    """A lane's backend, loaded, and its preallocated input (the box's BatchPreprocessor for that input)."""

    def __init__(self, lane: Lane, model: ModelUnderTest, threads: int) -> None:
        from agent.pipeline.backends import create_backend
        from agent.pipeline.backends.base import BackendOptions, TensorSpec
        from agent.pipeline.input_batch import BatchPreprocessor

        h, w = model.tier
        if lane.model_input:
            shape, dtype = (1, h, w, 3), "uint8"
            self.batcher = BatchPreprocessor(model.spec, model.tier, 1, input_dtype="uint8", input_layout="NHWC",
                                             input_color="bgr", normalize=False)
        else:
            shape, dtype = (1, 3, h, w), "float32"
            self.batcher = BatchPreprocessor(model.spec, model.tier, 1)
        self.backend = create_backend(lane.backend, lane.path, TensorSpec(model.input_name, shape, dtype),
                                      BackendOptions(cpu_threads=threads))
        self.backend.load()
        self.model = model

    def infer(self) -> List[np.ndarray]:
        return self.backend.infer(self.batcher.batch)

    def frame(self, image: np.ndarray) -> Any:
        from agent.pipeline.postprocess import decode

        self.batcher.fill(0, image)
        return decode(self.model.task, self.infer()[0], self.model.post)


def time_lanes(model: ModelUnderTest, frames: Sequence[np.ndarray], threads: int, profile: Any
               ) -> Dict[str, Dict[str, Any]]:
    """Inference and whole-frame ms of every in-process lane at ``threads``, timed round-robin."""
    import cv2

    previous = cv2.getNumThreads()
    cv2.setNumThreads(threads)  # cv2.dnn's pool, and the letterbox's resize in every lane alike
    opened = {lane.name: _Opened(lane, model, threads) for lane in model.lanes}
    warmup, repeat = profile.warmup, profile.repeat
    if model.tier[0] * model.tier[1] > HEAVY_PIXELS:
        warmup, repeat = HEAVY_ROUNDS[profile.name]
    try:
        for one in opened.values():
            one.batcher.fill(0, frames[0])
        infer = compare({n: o.infer for n, o in opened.items()}, warmup, repeat)
        cycle = {n: _cycler(o, frames) for n, o in opened.items()}
        frame = compare(cycle, warmup, repeat)
    finally:
        for one in opened.values():
            one.backend.close()
        cv2.setNumThreads(previous)
    figures = {}
    for name in opened:
        figures[name] = {"infer_ms": scaled(summarize(infer[name]), 1e3), "frame_ms": scaled(summarize(frame[name]),
                                                                                              1e3)}
        for reference, short in REFERENCES.items():  # medians of per-round ratios: the rounds ran side by side
            if reference in opened and name != reference:
                figures[name]["infer_ratio_to_" + short] = ratio_summary(infer[name], infer[reference])["median"]
                figures[name]["frame_ratio_to_" + short] = ratio_summary(frame[name], frame[reference])["median"]
    return figures


def _cycler(opened: _Opened, frames: Sequence[np.ndarray]) -> Any:
    state = {"i": 0}

    def call() -> Any:
        state["i"] = (state["i"] + 1) % len(frames)
        return opened.frame(frames[state["i"]])

    return call


# --- accuracy ---------------------------------------------------------------------------------------------------

def _outputs(model: ModelUnderTest, lane: Lane, letterboxed: Sequence[np.ndarray]) -> np.ndarray:
    opened = _Opened(lane, model, 1)
    try:
        outputs = []
        for image in letterboxed:
            opened.batcher.fill_letterboxed(0, image)
            outputs.append(opened.infer()[0])
        return np.concatenate(outputs)
    finally:
        opened.backend.close()


def demo_map(model: ModelUnderTest, lane: Lane) -> float:
    """mAP@0.5 on the QAT run's own held-out split (the scenes its report's mAP was measured on)."""
    from quant.datasets import SHAPES_TEST_SEED_OFFSET, generate_shapes
    from quant.evaluation import detections_from_outputs, mean_average_precision

    test, _ = generate_shapes(MAP_IMAGES, DEMO_DATA_SEED + SHAPES_TEST_SEED_OFFSET, model.tier, model.spec)
    detections = detections_from_outputs(_outputs(model, lane, test.images), model.post.iou)
    return float(mean_average_precision(detections, test.boxes, test.classes, 3)["map50"])


def agreement(model: ModelUnderTest, lane: Lane, frames: Sequence[np.ndarray]) -> Dict[str, Any]:
    """Detections of ``lane`` against onnxruntime float's on the same frames, measured as ``bundle create --int8``
    measures them (agent/pipeline/agreement.py): ``kept`` the float detections reported by the lane too (same
    class, IoU >= 0.5), ``score_aware_f1`` what the check decides on."""
    from agent.pipeline.agreement import AgreementMeter
    from agent.pipeline.postprocess import decode
    from agent.pipeline.preprocess import letterbox_for

    boxed = [letterbox_for(frame, model.tier, model.spec)[0] for frame in frames]
    reference = next(x for x in model.lanes if x.name == "ort_float")
    meter = AgreementMeter(float(model.post.conf))
    low = dataclasses.replace(model.post, conf=meter.low)
    for want, got in zip(decode(model.task, _outputs(model, reference, boxed), low),
                         decode(model.task, _outputs(model, lane, boxed), low)):
        meter.add(want, got)
    report = meter.report()
    found, kept = report["reference_detections"], report["strict"]["tp"]
    return {"float_detections": found, "kept": kept, "kept_share": kept / found if found else None,
            "score_aware_f1": report["score_aware"]["f1"], "strict_f1": report["strict"]["f1"]}


# --- the Lite lane ----------------------------------------------------------------------------------------------

def _lite_lane(model: ModelUnderTest, context: Any) -> Dict[str, Any]:
    from benchmarks import lite_lane

    if "mslite" not in context.backends:
        return {"skipped": "mslite not among --backends"}
    try:
        return lite_lane.measure("quant", dataclasses.replace(context, bundle_dir=model.bundle_dir))
    except Exception as exc:  # the other lanes' figures stand without it
        log.exception("quant: the Lite lane of %s failed", model.key)
        return {"skipped": "the Lite lane failed: %s" % str(exc)[-500:]}


def _lite_ratios(lanes: Dict[str, Dict[str, Any]]) -> None:
    """Each lane's frame time over Lite's: timed side by side in the Lite interpreter for the int8 ONNX that ran
    there too (``side_by_side``), else a ratio of medians from two processes (``frame_ratio_to_lite_medians``)."""
    for threads in THREADS:
        lite = get_path(lanes, "lite_float.threads.%d.frame_ms.median" % threads)
        side = get_path(lanes, "lite_float.side_by_side.%d" % threads) or {}
        for name, lane in lanes.items():
            mine = get_path(lane, "threads.%d.frame_ms.median" % threads)
            if not (lite and mine) or name == "lite_float":
                continue
            figures = lane["threads"][str(threads)]
            figures["frame_ratio_to_lite_medians"] = mine / lite
            paired = side.get("ort_int8", {})
            if lane["precision"] == "int8" and paired.get("file") == lane["file"]:
                figures["frame_ratio_to_lite"] = paired["frame_ratio_to_lite"]
                figures["infer_ratio_to_lite"] = paired["infer_ratio_to_lite"]


def lite_figures(context: Any) -> Dict[str, Any]:
    """In the Lite interpreter: the bundle's .ms (main tier, batch 1) through the mslite backend, side by side
    with the bundle's int8 ONNX on onnxruntime when that imports here (1.14.1 on the box's Python 3.7)."""
    from agent.bundle.verify import verify_bundle
    from benchmarks.workload import CAMERA_HW, backend_available, camera_frames

    manifest = verify_bundle(context.bundle_dir).manifest
    tier = tuple(manifest.input.tiers[0])
    art = next(a for a in manifest.artifacts if a.format == "ms" and tuple(a.tier) == tier and a.batch == 1)
    lanes = [Lane("lite_float", "mslite", os.path.join(context.bundle_dir, art.file), art.precision, False)]
    int8 = next((a for a in manifest.artifacts if a.format == "onnx" and a.precision == "int8"
                 and tuple(a.tier) == tier and a.batch == 1 and a.role == "serve"), None)
    if int8 is not None and backend_available("onnxruntime") is None:
        lanes.append(Lane("ort_int8", "onnxruntime", os.path.join(context.bundle_dir, int8.file), "int8",
                          int8.normalize_on == "model"))
    model = ModelUnderTest("lite", manifest.name, context.bundle_dir, tier, manifest.task, manifest.preprocessing,
                           manifest.postprocessing, manifest.input.name, lanes, {}, [])
    frames = camera_frames(FRAMES, CAMERA_HW)
    figures: Dict[str, Any] = {"file": art.file, "bytes": os.path.getsize(lanes[0].path), "backend": "mslite",
                               "precision": art.precision, "input": "float32 NCHW", "threads": {},
                               "side_by_side": {}}
    for threads in THREADS:
        timed = time_lanes(model, frames, threads, context.profile)
        figures["threads"][str(threads)] = timed.pop("lite_float")
        figures["side_by_side"][str(threads)] = {name: dict(f, file=os.path.basename(lane.path))
                                                 for (name, f), lane in zip(timed.items(), lanes[1:])}
    return figures


# --- headline -----------------------------------------------------------------------------------------------------

def headline(demo: Dict[str, Any], bundle_dir: str) -> Dict[str, Any]:
    lanes = demo["lanes"]
    int8 = "ort_int8_qat" if "ort_int8_qat" in lanes else "ort_int8_ptq"
    one = "threads.1."
    report = os.path.join(bundle_dir, "report.json")
    qat_map = None
    if os.path.isfile(report):
        with open(report) as handle:
            qat_map = get_path(json.load(handle), "qat.map50")
    return {
        "int8_lane": int8,
        "size_ratio": lanes[int8]["bytes"] / lanes["ort_float"]["bytes"],
        "infer_ratio_to_float": get_path(lanes[int8], one + "infer_ratio_to_float"),
        "frame_ratio_to_float": get_path(lanes[int8], one + "frame_ratio_to_float"),
        "frame_ratio_to_lite": get_path(lanes[int8], one + "frame_ratio_to_lite"),
        "frame_ratio_to_opencv": get_path(lanes[int8], one + "frame_ratio_to_opencv"),
        "frame_ratio_to_float_filled": get_path(lanes[int8], FILLED_KEY + ".frame_ratio_to_float"),
        "frame_hw": demo.get("frame_hw"),
        "frame_hw_filled": demo.get("frame_hw_filled"),
        "map_int8": lanes[int8].get("map50"),
        "map_float": lanes["ort_float"].get("map50"),
        "map_qat_report": qat_map,
    }
