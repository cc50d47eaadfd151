"""What ``bundle create`` decides before writing anything: tiers, task, labels, preprocessing, postprocessing.

Each decision comes from what the model file says (its input shape, exporter metadata, and the output shape
of a trial run at a tier) and the flags (:class:`CreateOptions`), and a contradiction between them is a
:class:`CreateError` naming both.
"""

import ast
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.bundle.manifest import TASKS as MANIFEST_TASKS
from agent.bundle.manifest import Postprocessing, Preprocessing
from agent.config.schema import ConfigError, parse, to_dict
from agent.pipeline.postprocess import YOLOV5_LEADING_CHANNELS, YOLOV8_BOX_CHANNELS
from converters.byom.model_file import CreateError, ModelInfo, Tier

TASKS = ("auto",) + MANIFEST_TASKS  # --task: the manifest's tasks, or decide from metadata and output shape
DEFAULT_STRIDE = 32  # YOLO's largest stride (P5) when the model does not say; P6 models say 64
YOLO_STRIDE_SETS = ((8, 16, 32), (8, 16, 32, 64))  # P3-P5 and P3-P6 heads
YOLOV5_ANCHORS_PER_CELL = 3
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
    int8: bool = False  # also an int8 ONNX, calibrated on --images (converters/byom/int8.py)
    force: bool = False  # write the int8 ONNX even when its check fails (too few kept, or nothing to check)


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

def decide_preprocessing(info: ModelInfo, options: CreateOptions) -> Tuple[Preprocessing, str]:
    """(manifest preprocessing, where it came from). Defaults are Ultralytics' convention (the manifest's own
    defaults): RGB, x/255, letterbox pad 114, centred. Flags override each value."""
    data: Dict[str, Any] = {}  # what the flags set; the schema's defaults fill the rest
    flags = []
    for key in ("color", "mean", "std"):
        value = getattr(options, key)
        if value is not None:
            data[key] = list(value) if isinstance(value, tuple) else value
            flags.append("--%s" % key)
    try:
        preprocessing = parse(Preprocessing, data, "preprocessing")
    except ConfigError as exc:
        raise CreateError(str(exc)) from None
    convention = "Ultralytics convention (rgb, /255, letterbox pad 114, centred)"
    if info.from_ultralytics:
        origin = "%s: %s" % (info.producer, convention)
    else:
        origin = "assumed %s: the model names no exporter" % convention
    if flags:
        origin += "; %s from flags" % ", ".join(flags)
    return preprocessing, origin


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
