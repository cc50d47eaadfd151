"""``atlas-edge bundle create``: a bundle from a model trained elsewhere (an ONNX or MindIR file).

Importing a model is not quantization, so it has a host package of its own; it reuses the other bundle
producer's machinery (``atlas-edge qat``): :mod:`quant.bundle_writer` for the golden set, calibration set and
manifest, and the read-back runners of :mod:`quant.export` (cv2.dnn for ONNX, ``mindspore.load`` +
``nn.GraphCell`` for MindIR). The ONNX graph edits are :mod:`byom.onnx_graph`. ``converters/`` consumes
bundles; this makes them.

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

import ast
import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.bundle.manifest import TASKS as MANIFEST_TASKS
from agent.bundle.manifest import Postprocessing, Preprocessing
from agent.bundle.verify import sha256_file
from agent.config.schema import ConfigError, parse, to_dict
from agent.pipeline.postprocess import YOLOV5_LEADING_CHANNELS, YOLOV8_BOX_CHANNELS
from agent.pipeline.preprocess import PreprocessSpec, letterbox
from byom.model_file import CreateError, ModelInfo, Tier, inspect_model
from byom.onnx_graph import fixed_onnx
from quant.bundle_writer import ArtifactPlan, write_calibration, write_golden, write_manifest_for
from quant.config import CalibrationConfig, GoldenConfig
from quant.pipeline import tier_name
from quant.report import toolchain_versions

log = logging.getLogger(__name__)


TASKS = ("auto",) + MANIFEST_TASKS  # --task: the manifest's tasks, or decide from metadata and output shape
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
DEFAULT_STRIDE = 32  # YOLO's largest stride (P5) when the model does not say; P6 models say 64
YOLO_STRIDE_SETS = ((8, 16, 32), (8, 16, 32, 64))  # P3-P5 and P3-P6 heads
YOLOV5_ANCHORS_PER_CELL = 3
# A camera-like frame size for generated golden/calibration images: letterboxing it to a tier pads like a real
# source does, so the golden set exercises the box's letterbox, not only its normalisation.
GENERATED_FRAME_HW = (480, 640)
GENERATED_SEED = 2024
CALIBRATION_SEED = 7
# What Ultralytics' predictor uses unless told otherwise (ultralytics/cfg/default.yaml); an Ultralytics export
# is served with the thresholds its users validated it with.
ULTRALYTICS_POSTPROCESSING = {"conf": 0.25, "iou": 0.7, "max_det": 300}
ULTRALYTICS_TASKS = {"detect": "detect-yolov8", "classify": "classify"}


@dataclasses.dataclass
class CreateOptions:
    model: str
    out: str
    name: Optional[str] = None
    version: str = "1.0.0"
    task: str = "auto"
    labels: Optional[str] = None
    tiers: Optional[List[Tier]] = None
    color: Optional[str] = None
    mean: Optional[Tuple[float, float, float]] = None
    std: Optional[Tuple[float, float, float]] = None
    conf: Optional[float] = None
    iou: Optional[float] = None
    images: Optional[str] = None
    calibration: Optional[int] = None
    golden: Optional[int] = None


def parse_tiers(text: str) -> List[Tier]:
    """``"640x640,384x640"`` -> [(640, 640), (384, 640)] (each HxW)."""
    tiers = []
    for part in text.split(","):
        try:
            h, w = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise CreateError("--tiers: %r is not HxW (e.g. 640x640,384x640)" % part) from None
        if h <= 0 or w <= 0:
            raise CreateError("--tiers: %r: sides must be positive" % part)
        tiers.append((h, w))
    if len(set(tiers)) != len(tiers):
        raise CreateError("--tiers: %s names a tier twice" % text)
    return tiers


def _shape_text(shape: Sequence[Optional[int]]) -> str:
    return "x".join("?" if d is None else str(d) for d in shape)


def _metadata_value(info: ModelInfo, key: str) -> Any:
    """An Ultralytics metadata value (written as ``str()`` of a Python value), parsed; None when absent."""
    text = info.metadata.get(key)
    if text is None:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def model_stride(info: ModelInfo) -> int:
    stride = _metadata_value(info, "stride")
    return int(stride) if isinstance(stride, int) and stride > 0 else DEFAULT_STRIDE


def decide_tiers(info: ModelInfo, requested: Optional[List[Tier]], needs_stride: bool) -> List[Tier]:
    """The tiers to serve: the fixed input's own shape, or each requested tier for a dynamic input."""
    shape = info.input_shape
    if len(shape) != 4:
        raise CreateError("--model %s: input %s has shape %s; the agent feeds (1, 3, H, W) images" % (
            info.path, info.input_name, _shape_text(shape)))
    batch, channels, height, width = shape
    if channels != 3:
        layout = " (an NHWC input: export it channels-first)" if shape[3] == 3 else ""
        raise CreateError("--model %s: input %s has shape %s, not (1, 3, H, W)%s" % (
            info.path, info.input_name, _shape_text(shape), layout))
    if batch not in (None, 1):
        raise CreateError("--model %s: input batch is fixed at %d; export with batch 1 or a dynamic batch" % (
            info.path, batch))
    if height is not None and width is not None:
        if requested and requested != [(height, width)]:
            raise CreateError("--tiers %s does not match the model's fixed input %s: export the model at each "
                              "tier (or with dynamic axes), or leave --tiers out" % (
                                  ",".join("%dx%d" % t for t in requested), _shape_text(shape)))
        return [(height, width)]
    if info.format == "mindir":
        raise CreateError("--model %s: MindIR input %s is dynamic; MindIR shapes cannot be fixed here: export "
                          "it with a concrete input shape (mindspore.export with a Tensor of that shape)" % (
                              info.path, _shape_text(shape)))
    tiers = requested
    if not tiers:
        imgsz = _metadata_value(info, "imgsz")
        if isinstance(imgsz, (list, tuple)) and len(imgsz) == 2:
            tiers = [(int(imgsz[0]), int(imgsz[1]))]
        else:
            raise CreateError("--model %s has a dynamic input %s and names no image size: give --tiers HxW[,HxW]"
                              % (info.path, _shape_text(shape)))
    for tier in tiers:
        for side, fixed in zip(tier, (height, width)):
            if fixed is not None and side != fixed:
                raise CreateError("--tiers %dx%d does not match the model's input %s" % (
                    tier[0], tier[1], _shape_text(shape)))
    if needs_stride:
        stride = model_stride(info)
        bad = [t for t in tiers if t[0] % stride or t[1] % stride]
        if bad:
            raise CreateError("--tiers %s: not a multiple of the model stride %d (a YOLO input must divide by "
                              "its largest stride; for a classifier give --task classify)" % (
                                  ",".join("%dx%d" % t for t in bad), stride))
    return list(tiers)


def metadata_task(info: ModelInfo) -> Optional[str]:
    """The task an Ultralytics export declares, as a manifest task; CreateError for ones the agent can't serve."""
    task = info.metadata.get("task")
    if not info.from_ultralytics or task is None:
        return None
    if str(info.metadata.get("end2end", "False")) == "True":
        raise CreateError("--model %s is an end-to-end (NMS-free) Ultralytics export, output (B, max_det, 6); "
                          "export it with end2end=False for the (B, 4+nc, N) layout the agent decodes" % info.path)
    if task not in ULTRALYTICS_TASKS:
        raise CreateError("--model %s is an Ultralytics %r model; the agent serves %s" % (
            info.path, task, " and ".join(sorted(ULTRALYTICS_TASKS))))
    return ULTRALYTICS_TASKS[task]


def _anchor_counts(tier: Tier) -> Tuple[set, set]:
    """(YOLOv8 anchor counts, YOLOv5 anchor counts) a YOLO head gives at ``tier`` for each stride set."""
    h, w = tier
    v8 = {sum(-(-h // s) * -(-w // s) for s in strides) for strides in YOLO_STRIDE_SETS}
    return v8, {n * YOLOV5_ANCHORS_PER_CELL for n in v8}


def decide_task(requested: str, output_shape: Tuple[int, ...], tier: Tier, declared: Optional[str]) -> str:
    """The manifest task from the output's shape at ``tier`` (or check the requested one against it)."""
    shape = tuple(int(d) for d in output_shape)
    fits = {
        "classify": len(shape) == 2 and shape[1] >= 1,
        "detect-yolov8": len(shape) == 3 and shape[1] > 4,
        "detect-yolov5": len(shape) == 3 and shape[2] > 5,
    }
    layouts = {"classify": "(B, nc)", "detect-yolov8": "(B, 4+nc, N)", "detect-yolov5": "(B, N, 5+nc)"}
    if requested != "auto":
        if not fits[requested]:
            raise CreateError("--task %s: the model's output %s does not fit %s" % (
                requested, shape, layouts[requested]))
        return requested
    if declared is not None:
        if not fits[declared]:
            raise CreateError("the model declares task %s but its output %s does not fit %s" % (
                declared, shape, layouts[declared]))
        return declared
    if len(shape) == 2:
        return "classify"
    if len(shape) == 3:
        v8_counts, v5_counts = _anchor_counts(tier)
        is_v8 = fits["detect-yolov8"] and shape[2] in v8_counts
        is_v5 = fits["detect-yolov5"] and shape[1] in v5_counts | v8_counts
        if is_v8 != is_v5:
            return "detect-yolov8" if is_v8 else "detect-yolov5"
    raise CreateError("cannot tell the task from the output shape %s at input %dx%d (YOLOv8 %s, YOLOv5 %s, "
                      "classifier %s): give --task detect-yolov8|detect-yolov5|classify" % (
                          shape, tier[0], tier[1], layouts["detect-yolov8"], layouts["detect-yolov5"],
                          layouts["classify"]))


def class_count(task: str, output_shape: Tuple[int, ...]) -> int:
    if task == "classify":
        return int(output_shape[1])
    if task == "detect-yolov8":
        return int(output_shape[1]) - YOLOV8_BOX_CHANNELS
    return int(output_shape[2]) - YOLOV5_LEADING_CHANNELS


def read_labels_file(path: str) -> List[str]:
    """Class names from a YAML list, a YAML mapping {id: name} (or a data YAML's ``names:``), or one per line."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise CreateError("--labels %s: %s" % (path, exc)) from None
    if path.lower().endswith((".yaml", ".yml")):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CreateError("--labels %s: not valid YAML (%s)" % (path, exc)) from None
        if isinstance(data, dict) and "names" in data:
            data = data["names"]
        names = _names(data, "--labels %s" % path)
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise CreateError("--labels %s: no class names in it" % path)
    return names


def _names(data: Any, where: str) -> List[str]:
    if isinstance(data, (list, tuple)):
        return [str(n) for n in data]
    if isinstance(data, dict):
        try:
            ids = sorted(int(k) for k in data)
        except (TypeError, ValueError):
            raise CreateError("%s: class ids must be integers (got %s)" % (where, sorted(map(str, data)))) from None
        if ids != list(range(len(ids))):
            raise CreateError("%s: class ids must be 0..%d without gaps (got %s)" % (where, len(ids) - 1, ids))
        by_id = {int(k): str(v) for k, v in data.items()}
        return [by_id[i] for i in ids]
    raise CreateError("%s: expected a list or a mapping of class names, got %s" % (where, type(data).__name__))


def decide_labels(info: ModelInfo, labels_file: Optional[str], nc: int, output_shape: Tuple[int, ...]) -> List[str]:
    if labels_file:
        names, where = read_labels_file(labels_file), "--labels %s" % labels_file
    elif _metadata_value(info, "names") is not None:
        names, where = _names(_metadata_value(info, "names"), "the model's names metadata"), "the model's names"
    else:
        raise CreateError("--model %s carries no class names: give --labels FILE (%d names)" % (info.path, nc))
    if len(names) != nc:
        raise CreateError("%s: %d names, but the model's output %s has %d classes" % (
            where, len(names), tuple(output_shape), nc))
    return names


# --- preprocessing and postprocessing ---------------------------------------------------------------------------

def decide_preprocessing(info: ModelInfo, options: CreateOptions) -> Tuple[Dict[str, Any], str]:
    """(manifest preprocessing, where it came from). Defaults are Ultralytics' convention (the manifest's own
    defaults): RGB, x/255, letterbox pad 114, centred. Flags override each value."""
    data = to_dict(Preprocessing())
    flags = []
    for key in ("color", "mean", "std"):
        value = getattr(options, key)
        if value is not None:
            data[key] = list(value) if isinstance(value, tuple) else value
            flags.append("--%s" % key)
    try:
        parse(Preprocessing, data, "preprocessing")
    except ConfigError as exc:
        raise CreateError(str(exc)) from None
    convention = "Ultralytics convention (rgb, /255, letterbox pad 114, centred)"
    if info.from_ultralytics:
        origin = "%s: %s" % (info.producer, convention)
    else:
        origin = "assumed %s: the model names no exporter" % convention
    if flags:
        origin += "; %s from flags" % ", ".join(flags)
    return data, origin


def decide_postprocessing(info: ModelInfo, options: CreateOptions) -> Dict[str, Any]:
    data = to_dict(Postprocessing())
    if info.from_ultralytics:
        data.update(ULTRALYTICS_POSTPROCESSING)
    for key in ("conf", "iou"):
        if getattr(options, key) is not None:
            data[key] = getattr(options, key)
    try:
        parse(Postprocessing, data, "postprocessing")
    except ConfigError as exc:
        raise CreateError(str(exc)) from None
    return data


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
    from quant.export import run_mindir, run_onnx_opencv

    runner = run_onnx_opencv if fmt == "onnx" else run_mindir
    try:
        output = runner(path, np.zeros((1, 3) + tuple(tier), np.float32))
    except Exception as exc:  # cv2.error / RuntimeError from the runtimes: report, do not crash
        raise CreateError("%s at %dx%d does not run with %s: %s" % (
            os.path.basename(path), tier[0], tier[1], "cv2.dnn" if fmt == "onnx" else "mindspore", exc)) from None
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
    images, images_note = load_images(options.images, max(golden_cases, calibration_count))

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
    preprocessing: Dict[str, Any]
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
        artifacts.append(ArtifactPlan(file, tier, 1, info.format, "float32", "serve"))
    assert task is not None
    counts = {class_count(task, s) for s in output_shapes.values()}
    if len(counts) != 1:
        raise CreateError("the class count differs between tiers: %s" % output_shapes)
    labels = decide_labels(info, options.labels, counts.pop(), output_shapes[tiers[0]])

    spec = PreprocessSpec.from_manifest(plan.preprocessing)
    boxed = np.stack([letterbox(image, tiers[0], pad_value=spec.pad_value, scaleup=spec.scaleup,
                                center=spec.center)[0] for image in plan.images])
    calibration = write_calibration(staging, boxed, spec, plan.calibration_count, CALIBRATION_SEED)
    golden = write_golden(staging, plan.images, artifacts, spec, tiers, plan.golden_cases, plan.golden_config.atol,
                          plan.golden_config.rtol)
    name = options.name or os.path.splitext(os.path.basename(info.path))[0]
    source = {"model": os.path.basename(info.path), "sha256": sha256_file(info.path), "producer": info.producer,
              "preprocessing": plan.preprocessing_origin, "images": plan.images_note}
    return write_manifest_for(staging, name, options.version, task, labels, tiers, plan.preprocessing,
                              plan.postprocessing, artifacts, calibration, golden, toolchain_versions(),
                              source=source, input_name=info.input_name)


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
