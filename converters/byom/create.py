"""``atlas-edge bundle create``: a bundle from a model trained elsewhere (an ONNX or MindIR file).

It shares the other bundle producer's (``atlas-edge qat``) machinery: :mod:`converters.bundle_writer` for the
golden set, calibration set and manifest, and the read-back runners of :mod:`converters.runtimes` (cv2.dnn for
ONNX, ``mindspore.load`` + ``nn.GraphCell`` for MindIR). What to make is decided in
:mod:`converters.byom.decide`; the ONNX graph edits are :mod:`converters.byom.onnx_graph`.

Order matters:

* What the file itself says is checked before anything is written: a model with one float NCHW 3-channel input
  and one output, tiers that fit the input (fixed shapes must equal ``--tiers``, dynamic sides must be multiples
  of the stride), a readable labels file and images, ``--out`` empty or a bundle.
* Each tier's artifact is then made in a staging directory beside ``--out`` (a dynamic ONNX is re-written with
  fixed shapes by the ``onnx`` package) and *run* by the runtime that will consume it; the output it gives decides
  or checks the task's layout and the class count the labels must match. Any failure removes the staging
  directory: ``--out`` is untouched.
* The manifest is written last (it hashes every file), then the staging directory replaces ``--out``.
"""

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from agent.bundle.manifest import Preprocessing
from agent.bundle.verify import sha256_file
from agent.pipeline.preprocess import letterbox_for
from converters.bundle_writer import (
    ArtifactPlan,
    CalibrationConfig,
    GoldenConfig,
    tier_name,
    write_calibration,
    write_golden,
    write_manifest_for,
)
from converters.byom.decide import (
    TASKS,
    CreateOptions,
    class_count,
    decide_labels,
    decide_postprocessing,
    decide_preprocessing,
    decide_task,
    decide_tiers,
    metadata_task,
    read_labels_file,
)
from converters.byom.int8 import check_int8, quantize_int8, split_images
from converters.byom.model_file import CreateError, ModelInfo, Tier, inspect_model
from converters.byom.onnx_graph import fixed_onnx
from converters.onnx_input import MODEL_INPUT, fold_input_file
from converters.runtimes import RUNTIME_NAMES, run_on_host
from converters.toolrun import toolchain_versions

log = logging.getLogger(__name__)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
# A camera-like frame size for generated golden/calibration images: letterboxing it to a tier pads like a real
# source does, so the golden set exercises the box's letterbox, not only its normalisation.
GENERATED_FRAME_HW = (480, 640)
GENERATED_SEED = 2024
CALIBRATION_SEED = 7
NCHW_ONNX_SUFFIX = "nchw.onnx"  # the float ONNX normalised on the host: the converters' input
INT8_CHECK_FILE = "int8_check.json"  # --int8: the int8 model against the float one, per artifact


# --- images -----------------------------------------------------------------------------------------------------

def load_images(directory: Optional[str], count: int) -> Tuple[List[np.ndarray], str]:
    """(BGR images, manifest note): every image in ``directory`` (sorted by name), else ``count`` generated
    scenes of a camera-like size."""
    import cv2

    if directory is None:
        from agent.devtools.scenes import generate_scenes

        scenes = generate_scenes(GENERATED_SEED, count, GENERATED_FRAME_HW)
        note = "generated: %d synthetic %dx%d scenes (agent.devtools.scenes, seed %d); give --images DIR " \
               "for frames like the ones the box will see" % (count, GENERATED_FRAME_HW[0], GENERATED_FRAME_HW[1],
                                                                GENERATED_SEED)
        return [image for image, _boxes, _classes in scenes], note
    if not os.path.isdir(directory):
        raise CreateError("--images %s: not a directory" % directory)
    names = sorted(n for n in os.listdir(directory) if n.lower().endswith(IMAGE_SUFFIXES))
    if not names:
        raise CreateError("--images %s: no %s files" % (directory, "/".join(IMAGE_SUFFIXES)))
    images = []
    for name in names:
        image = cv2.imread(os.path.join(directory, name), cv2.IMREAD_COLOR)
        if image is None:
            raise CreateError("--images %s: cannot decode %s" % (directory, name))
        images.append(image)
    return images, "--images %s: %d image(s)" % (os.path.basename(os.path.normpath(directory)), len(images))


# --- artifacts ----------------------------------------------------------------------------------------------

def run_artifact(path: str, fmt: str, tier: Tier) -> Tuple[int, ...]:
    """Output 0's shape at ``tier`` through the runtime that will consume the artifact."""
    try:
        output = run_on_host(path, fmt, np.zeros((1, 3) + tuple(tier), np.float32))
    except Exception as exc:  # cv2.error / RuntimeError from the runtimes: report, do not crash
        raise CreateError("%s at %dx%d does not run with %s: %s" % (
            os.path.basename(path), tier[0], tier[1], RUNTIME_NAMES.get(fmt, fmt), exc)) from None
    if not np.issubdtype(output.dtype, np.floating):
        raise CreateError("%s: output 0 is %s, not float" % (os.path.basename(path), output.dtype))
    return tuple(output.shape)


# --- the command ------------------------------------------------------------------------------------------------

def check_out_dir(out: str) -> None:
    """An existing --out must be a bundle (or empty): never replace an unrelated directory."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise CreateError("--out %s exists and is not a directory" % out)
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "manifest.json")):
        raise CreateError("--out %s exists, is not empty and is not a bundle; refusing to replace it" % out)


def create_bundle(options: CreateOptions) -> Dict[str, Any]:
    """Make the bundle; returns the written manifest. CreateError (nothing written) on bad input."""
    if options.task not in TASKS:
        raise CreateError("--task must be one of %s (got %r)" % ("|".join(TASKS), options.task))
    check_out_dir(options.out)
    info = inspect_model(options.model)
    if len(info.output_names) != 1:
        raise CreateError("--model %s has %d outputs (%s); the agent decodes one (YOLO detection or "
                          "classification)" % (info.path, len(info.output_names), ", ".join(info.output_names)))
    declared = metadata_task(info)
    maybe_detector = (options.task if options.task != "auto" else declared) != "classify"
    tiers = decide_tiers(info, options.tiers, needs_stride=maybe_detector and info.dynamic)
    preprocessing, preprocessing_origin = decide_preprocessing(info, options)
    postprocessing = decide_postprocessing(info, options)
    golden_config, calibration_config = GoldenConfig(), CalibrationConfig()
    golden_cases = options.golden or golden_config.cases_per_tier
    calibration_count = options.calibration or calibration_config.count
    if options.labels:
        read_labels_file(options.labels)  # a broken file fails before any work; counts are checked below
    if options.int8 and not options.images:
        raise CreateError("--int8 calibrates on frames like the box's: give --images DIR")
    images, images_note = load_images(options.images, max(golden_cases, calibration_count))
    if options.int8:
        split_images(images)  # enough images for calibration and a held-out check, before any work

    out = os.path.abspath(options.out)
    parent = os.path.dirname(out)
    created_parents = _missing_parents(parent)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".%s.partial-" % os.path.basename(out), dir=parent)
    try:
        plan = _Plan(info, options, tiers, declared, preprocessing, preprocessing_origin, postprocessing,
                     images, images_note, golden_cases, calibration_count, golden_config)
        manifest = _produce(staging, plan)
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for directory in reversed(created_parents):
            try:
                os.rmdir(directory)
            except OSError:
                break
        raise
    log.info("bundle written to %s", out)
    return manifest


@dataclasses.dataclass
class _Plan:
    """Everything decided (and checked) before the first file is written."""

    info: ModelInfo
    options: CreateOptions
    tiers: List[Tier]
    declared_task: Optional[str]
    preprocessing: Preprocessing
    preprocessing_origin: str
    postprocessing: Dict[str, Any]
    images: List[np.ndarray]
    images_note: str
    golden_cases: int
    calibration_count: int
    golden_config: GoldenConfig


def _produce(staging: str, plan: _Plan) -> Dict[str, Any]:
    """Artifacts (each run once by its runtime), labels, calibration and golden sets, manifest: into staging."""
    info, options, tiers = plan.info, plan.options, plan.tiers
    artifacts = []
    task: Optional[str] = None
    output_shapes: Dict[Tier, Tuple[int, ...]] = {}
    for tier in tiers:
        file = "model_%s.%s" % (tier_name(tier), info.format)
        path = os.path.join(staging, file)
        if info.format == "onnx":
            file = "model_%s.%s" % (tier_name(tier), NCHW_ONNX_SUFFIX)
            path = os.path.join(staging, file)
            fixed_onnx(info, tier, path)
        else:
            shutil.copyfile(info.path, path)
        os.chmod(path, 0o644)
        shape = run_artifact(path, info.format, tier)
        tier_task = decide_task(options.task, shape, tier, plan.declared_task)
        if task is not None and tier_task != task:
            raise CreateError("output %s at %dx%d reads as %s, but as %s at another tier" % (
                shape, tier[0], tier[1], tier_task, task))
        task = tier_task
        output_shapes[tier] = shape
        if info.format == "onnx":
            artifacts += _folded_onnx(staging, path, tier, plan.preprocessing)
        else:
            artifacts.append(ArtifactPlan(file, tier, 1, info.format, "float32", "serve"))
    assert task is not None
    counts = {class_count(task, s) for s in output_shapes.values()}
    if len(counts) != 1:
        raise CreateError("the class count differs between tiers: %s" % output_shapes)
    labels = decide_labels(info, options.labels, counts.pop(), output_shapes[tiers[0]])

    spec = plan.preprocessing
    if options.int8:
        artifacts += _int8_onnx(staging, plan, task, labels)
    boxed = np.stack([letterbox_for(image, tiers[0], spec)[0] for image in plan.images])
    calibration = write_calibration(staging, boxed, spec, plan.calibration_count, CALIBRATION_SEED)
    golden = write_golden(staging, plan.images, artifacts, spec, tiers, plan.golden_cases, plan.golden_config.atol,
                          plan.golden_config.rtol, roles=("serve", "convert"))
    name = options.name or os.path.splitext(os.path.basename(info.path))[0]
    source = {"model": os.path.basename(info.path), "sha256": sha256_file(info.path), "producer": info.producer,
              "preprocessing": plan.preprocessing_origin, "images": plan.images_note}
    return write_manifest_for(staging, name, options.version, task, labels, tiers, plan.preprocessing,
                              plan.postprocessing, artifacts, calibration, golden, toolchain_versions(),
                              source=source, input_name=info.input_name)


def _folded_onnx(staging: str, nchw_path: str, tier: Tier, spec: Any) -> List[ArtifactPlan]:
    """The served float ONNX takes the letterboxed uint8 BGR NHWC frame (the input convention folded in,
    converters/onnx_input.py); the float NCHW one it was made from stays as the converters' input (role convert:
    converter_lite and ATC's AIPP want the plain network)."""
    file = "model_%s.onnx" % tier_name(tier)
    fold_input_file(nchw_path, os.path.join(staging, file), spec)
    os.chmod(os.path.join(staging, file), 0o644)
    return [ArtifactPlan(file, tier, 1, "onnx", "float32", "serve", model_input=dict(MODEL_INPUT)),
            ArtifactPlan(os.path.basename(nchw_path), tier, 1, "onnx", "float32", "convert")]


def _int8_onnx(staging: str, plan: _Plan, task: str, labels: List[str]) -> List[ArtifactPlan]:
    """``--int8``: per tier, the calibrated int8 ONNX (converters/byom/int8.py), refused (CreateError) when it
    agrees too little with the float model on the held-out images (score-aware F1), unless ``--force``."""
    calibration, held_out = split_images(plan.images)
    artifacts, checks = [], {}
    for tier in plan.tiers:
        nchw = os.path.join(staging, "model_%s.%s" % (tier_name(tier), NCHW_ONNX_SUFFIX))
        file = "model_%s.int8.onnx" % tier_name(tier)
        path = os.path.join(staging, file)
        quantize_int8(nchw, path, plan.preprocessing, tier, calibration)
        os.chmod(path, 0o644)
        check = check_int8(nchw, path, plan.preprocessing, tier, task, plan.postprocessing, held_out, labels)
        log.info("%s: %s", file, check.summary())
        if check.warning():
            log.warning("--int8: %s: the check's sample is small (%s): give --images more frames like the box's",
                        file, check.warning())
        refusal = check.refusal()
        if refusal is not None:
            if not plan.options.force:
                raise CreateError("--int8: %s at %dx%d: %s; calibrate on more frames like the box's (--images), "
                                  "leave --int8 out, or --force to write it anyway" % (file, tier[0], tier[1], refusal))
            log.warning("--force: writing %s although %s", file, refusal)
        checks[file] = dict(check.as_dict(), forced=refusal is not None)
        artifacts.append(ArtifactPlan(file, tier, 1, "onnx", "int8", "serve", model_input=dict(MODEL_INPUT)))
    with open(os.path.join(staging, INT8_CHECK_FILE), "w") as handle:
        json.dump({"calibration_images": len(calibration), "checks": checks}, handle, indent=2, sort_keys=True)
    return artifacts


def _missing_parents(directory: str) -> List[str]:
    missing = []
    while directory and not os.path.exists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    return list(reversed(missing))


def _publish(staging: str, out: str) -> None:
    """Swap the finished staging directory in for --out (an existing bundle there is replaced)."""
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(staging, out)
