"""``atlas-edge bundle create``: a bundle from a model trained elsewhere (an ONNX or MindIR file).

It lives in ``quant/`` beside the other bundle producer (``atlas-edge qat``) because it reuses exactly that
machinery: :mod:`quant.bundle_writer` for the golden set, calibration set and manifest, and the read-back runners
of :mod:`quant.export` (cv2.dnn for ONNX, ``mindspore.load`` + ``nn.GraphCell`` for MindIR). ``converters/``
consumes bundles; this makes them.

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
from quant.bundle_writer import ArtifactPlan, write_calibration, write_golden, write_manifest_for
from quant.config import CalibrationConfig, GoldenConfig
from quant.pipeline import tier_name
from quant.report import toolchain_versions

log = logging.getLogger(__name__)

Tier = Tuple[int, int]

TASKS = ("auto",) + MANIFEST_TASKS  # --task: the manifest's tasks, or decide from metadata and output shape
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
ONNX_FLOAT = 1  # onnx.TensorProto.FLOAT
MINDIR_FLOAT = 1  # mind_ir DataType FLOAT32
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


class CreateError(ValueError):
    """Input that cannot become a bundle; the message names the cause and, where one exists, the flag to fix it."""


@dataclasses.dataclass
class ModelInfo:
    """What the model file says about itself, read without running it."""

    path: str
    format: str  # onnx | mindir
    input_name: str
    input_shape: List[Optional[int]]  # None: a dynamic axis
    output_names: List[str]
    metadata: Dict[str, str]
    producer: str

    @property
    def dynamic(self) -> bool:
        return any(d is None for d in self.input_shape)

    @property
    def from_ultralytics(self) -> bool:
        return self.metadata.get("author", "").startswith("Ultralytics")


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


# --- reading the model -------------------------------------------------------------------------------------

def _import_onnx() -> Any:
    # MindSpore selects the pure-Python protobuf when it is imported (its generated code needs it); importing onnx
    # first would fix the C implementation for the whole process and break MindSpore ("Descriptors cannot be
    # created directly"). So MindSpore goes first, whenever onnx is used in a host process.
    import mindspore  # noqa: F401

    try:
        import onnx
    except ImportError:
        raise CreateError("reading an ONNX model needs the onnx package: pip install 'atlas-edge[host]'") from None
    return onnx


def inspect_model(path: str) -> ModelInfo:
    """Read inputs, outputs and exporter metadata of an ONNX or MindIR file; CreateError if it is neither."""
    if not os.path.isfile(path):
        raise CreateError("--model %s: no such file" % path)
    if path.lower().endswith(".mindir"):
        return _inspect_mindir(path)
    try:
        return _inspect_onnx(path)
    except CreateError as onnx_error:
        if path.lower().endswith(".onnx"):
            raise
        try:
            return _inspect_mindir(path)
        except CreateError:
            raise CreateError("--model %s: not an ONNX or MindIR model (%s)" % (path, onnx_error)) from None


def _dims(value_info: Any) -> List[Optional[int]]:
    shape = value_info.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in shape.dim]


def _inspect_onnx(path: str) -> ModelInfo:
    onnx = _import_onnx()
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(path, load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise CreateError("--model %s: not an ONNX model (%s)" % (path, str(exc) or type(exc).__name__)) from None
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if not graph.node or not inputs or not graph.output:
        raise CreateError("--model %s: not an ONNX model (no graph: %d nodes, %d inputs, %d outputs)" % (
            path, len(graph.node), len(inputs), len(graph.output)))
    if len(inputs) != 1:
        raise CreateError("--model %s has %d inputs (%s); the agent feeds one image tensor" % (
            path, len(inputs), ", ".join(i.name for i in inputs)))
    elem_type = inputs[0].type.tensor_type.elem_type
    if elem_type != ONNX_FLOAT:
        raise CreateError("--model %s: input %s is %s, the agent feeds float32 (export without half/int8)" % (
            path, inputs[0].name, onnx.TensorProto.DataType.Name(elem_type)))
    info = ModelInfo(path=path, format="onnx", input_name=inputs[0].name, input_shape=_dims(inputs[0]),
                     output_names=[o.name for o in graph.output],
                     metadata={p.key: p.value for p in model.metadata_props},
                     producer=" ".join(x for x in (model.producer_name, model.producer_version) if x) or "unknown")
    if info.from_ultralytics:  # the exporter, not the framework underneath it ("pytorch 2.x")
        info.producer = "Ultralytics %s" % info.metadata.get("version", "?")
    return info


def _inspect_mindir(path: str) -> ModelInfo:
    from google.protobuf.message import DecodeError
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    try:
        with open(path, "rb") as handle:
            model.ParseFromString(handle.read())
    except DecodeError as exc:
        raise CreateError("--model %s: not a MindIR model (%s)" % (path, exc)) from None
    graph = model.graph
    if not graph.node or not graph.input or not graph.output:
        raise CreateError("--model %s: not a MindIR model (no graph)" % path)
    if len(graph.input) != 1:
        raise CreateError("--model %s has %d inputs (%s); the agent feeds one image tensor" % (
            path, len(graph.input), ", ".join(i.name for i in graph.input)))
    tensor = graph.input[0].tensor[0]
    if tensor.data_type != MINDIR_FLOAT:
        raise CreateError("--model %s: input %s is not float32 (MindIR data type %d)" % (
            path, graph.input[0].name, tensor.data_type))
    producer = " ".join(x for x in (model.producer_name, model.producer_version) if x) or "unknown"
    return ModelInfo(path=path, format="mindir", input_name=graph.input[0].name,
                     input_shape=[d if d > 0 else None for d in tensor.dims],
                     output_names=[o.name for o in graph.output], metadata={}, producer=producer)


# --- deciding tiers, task and labels ------------------------------------------------------------------------

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

def fixed_onnx(info: ModelInfo, tier: Tier, path: str) -> None:
    """Write the model with its input fixed at (1, 3, h, w): the input's dims are set and shapes re-inferred.

    A fixed-shape model already at ``tier`` keeps its graph apart from what the converters refuse: every model
    loses the default-valued attributes (:func:`drop_default_pool_dilations`) and gets a YOLOv8 DFL's expectation
    as a MatMul (:func:`dfl_conv_as_matmul`), and a classifier loses its final softmax (:func:`drop_final_softmax`).
    """
    onnx = _import_onnx()
    model = onnx.load(info.path)
    drop_default_pool_dilations(model)
    if dfl_conv_as_matmul(model):
        log.info("%s: the DFL's 1x1 Conv is computed as a MatMul (MindSpore Lite's converter refuses the Conv)",
                 info.path)
    if drop_final_softmax(model):
        log.info("%s ends in a softmax: the artifact outputs its logits (the agent applies the softmax)", info.path)
    if not info.dynamic:
        onnx.save(model, path)
        return
    graph = model.graph
    graph_input = next(i for i in graph.input if i.name == info.input_name)
    for dim, value in zip(graph_input.type.tensor_type.shape.dim, (1, 3) + tuple(tier)):
        dim.Clear()
        dim.dim_value = value
    del graph.value_info[:]  # intermediate shapes were inferred for the symbolic input: stale now
    for output in graph.output:  # symbolic output dims ("anchors") become unknown, for inference to fill in
        for dim in output.type.tensor_type.shape.dim:
            dim.Clear()
    try:
        model = onnx.shape_inference.infer_shapes(model)
        model = fold_shape_constants(model)
        model = onnx.shape_inference.infer_shapes(model)
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise CreateError("--model %s: fixing the input at %dx%d failed: %s" % (
            info.path, tier[0], tier[1], exc)) from None
    onnx.save(model, path)


def drop_final_softmax(model: Any) -> bool:
    """Make a classifier that ends in ``Softmax`` over its class axis output the logits instead; True if it did.

    The agent's classify decoding applies the softmax itself (postprocess.classify_topk), so a network that already
    ends in one (Ultralytics' classify exports do) would report the softmax of probabilities: the right order, but
    flattened scores. Removing the last node gives exactly the network's probabilities again on the box.
    """
    graph = model.graph
    if len(graph.output) != 1:
        return False
    output = graph.output[0]
    producers = [n for n in graph.node if output.name in n.output]
    if len(producers) != 1 or producers[0].op_type != "Softmax" or len(_dims(output)) != 2:
        return False
    softmax = producers[0]
    axis = next((a.i for a in softmax.attribute if a.name == "axis"), -1 if _opset(model) >= 13 else 1)
    if axis not in (1, -1) or any(softmax.output[0] in n.input for n in graph.node):
        return False
    logits = softmax.input[0]
    for node in graph.node:  # the logits tensor takes the graph output's name, so the output keeps its name
        node.output[:] = [output.name if name == logits else name for name in node.output]
        node.input[:] = [output.name if name == logits else name for name in node.input]
    graph.node.remove(softmax)
    return True


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def drop_default_pool_dilations(model: Any) -> int:
    """Remove ``dilations`` of all ones (the ONNX default) from pooling nodes; returns how many were removed.

    torch's exporter writes them on every MaxPool (Ultralytics' SPPF has three), and MindSpore Lite 2.0.0's
    converter refuses any pooling node that carries the attribute ("pooling op not support dilations now",
    measured), so a bundle that keeps them cannot be converted to .ms. Dropping a default changes nothing else.
    """
    removed = 0
    for node in model.graph.node:
        if node.op_type not in ("MaxPool", "AveragePool"):
            continue
        for attribute in list(node.attribute):
            if attribute.name == "dilations" and all(v == 1 for v in attribute.ints):
                node.attribute.remove(attribute)
                removed += 1
    return removed


CHANNELS_LAST = [0, 2, 3, 1]  # NCHW -> NHWC: the 1x1 Conv's channel axis last, where MatMul contracts
CHANNELS_FIRST = [0, 3, 1, 2]  # and back


def dfl_conv_as_matmul(model: Any) -> int:
    """Compute each DFL expectation Conv (1x1, one output channel, no bias, weights ``arange(reg_max)``) as
    ``Transpose -> MatMul -> Transpose``; returns how many were rewritten.

    Ultralytics' YOLOv8 head decodes each box side as the expectation of a softmax over ``reg_max`` bins with
    such a Conv on a Transpose's output. MindSpore Lite 2.0.0's converter cannot infer that Conv's shape ("Unexpected
    input format 0" -> ``InferShape failed, name: /model.22/dfl/conv/Conv``, measured): its layout pass expects a
    Conv's input in the layout it assigns itself. A MatMul has no layout, and the sum over the bins is the same
    one (outputs equal to the Conv's within float rounding, tests/test_byom.py). Adjacent Transposes are merged.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    replaced, rewritten = set(), 0
    for conv in [n for n in graph.node if n.op_type == "Conv" and n.domain in ("", "ai.onnx")]:
        if len(conv.input) != 2 or conv.input[1] not in weights or not _is_pointwise(conv):
            continue
        weight = numpy_helper.to_array(weights[conv.input[1]])
        if weight.shape[0] != 1 or weight.shape[2:] != (1, 1) or \
                not np.array_equal(weight.ravel(), np.arange(weight.shape[1])):
            continue
        name = conv.name or conv.output[0]
        bins = graph.initializer.add()
        bins.CopyFrom(numpy_helper.from_array(weight.reshape(1, -1).T.copy(), name + "/bins"))
        source, perm = _absorb_transpose(graph, conv.input[0], CHANNELS_LAST)
        nodes = [helper.make_node("Transpose", [source], [name + "/channels_last"], name=name + "/channels_last",
                                  perm=perm),
                 helper.make_node("MatMul", [name + "/channels_last", bins.name], [name + "/expectation"],
                                  name=name + "/expectation"),
                 helper.make_node("Transpose", [name + "/expectation"], [conv.output[0]],
                                  name=name + "/channels_first", perm=CHANNELS_FIRST)]
        at = list(graph.node).index(conv)
        graph.node.remove(conv)
        for offset, node in enumerate(nodes):
            graph.node.insert(at + offset, node)
        replaced.add(conv.input[1])
        rewritten += 1
    used = {name for node in graph.node for name in node.input}
    for tensor in [t for t in graph.initializer if t.name in replaced and t.name not in used]:
        graph.initializer.remove(tensor)
    return rewritten


def _is_pointwise(conv: Any) -> bool:
    """A Conv with a 1x1 kernel, unit strides and dilations, no padding and one group: a per-pixel dot product."""
    attrs = {a.name: a for a in conv.attribute}
    ones = all(all(v == 1 for v in attrs[k].ints) for k in ("kernel_shape", "strides", "dilations") if k in attrs)
    pads = all(v == 0 for v in attrs["pads"].ints) if "pads" in attrs else True
    auto_pad = attrs["auto_pad"].s in (b"", b"NOTSET", b"VALID") if "auto_pad" in attrs else True
    group = attrs["group"].i == 1 if "group" in attrs else True
    return ones and pads and auto_pad and group


def _absorb_transpose(graph: Any, tensor: str, perm: List[int]) -> Tuple[str, List[int]]:
    """``Transpose(tensor, perm)`` as ``(source, perm)``: when ``tensor`` is itself a Transpose's output that nothing
    else reads, that Transpose is removed and the two permutations composed (x.transpose(p).transpose(q) is
    x.transpose([p[i] for i in q]))."""
    producer = next((n for n in graph.node if tensor in n.output), None)
    readers = [n for n in graph.node if tensor in n.input]
    if producer is None or producer.op_type != "Transpose" or len(readers) != 1 or \
            any(o.name == tensor for o in graph.output):
        return tensor, perm
    inner = next((list(a.ints) for a in producer.attribute if a.name == "perm"), None)
    if inner is None or len(inner) != len(perm):
        return tensor, perm
    graph.node.remove(producer)
    return producer.input[0], [inner[i] for i in perm]


def fold_shape_constants(model: Any) -> Any:
    """Evaluate, once, every node whose value no longer depends on the image: ``Shape`` of a tensor whose shape
    is now static, and any node whose inputs are all constants (the anchor grids a dynamic YOLO export computes
    from its input size at run time). Runtimes such as cv2.dnn cannot run those shape subgraphs; the folded graph
    computes the same outputs. Evaluation is the ``onnx`` package's own reference implementation."""
    _import_onnx()
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    opsets = list(model.opset_import)  # each op is evaluated at the model's own opset version
    static = {}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = _dims(value)
        if dims and all(d is not None for d in dims):
            static[value.name] = dims
    known = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    kept = []
    for node in graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.input[0] in static:
            attrs = {a.name: a.i for a in node.attribute}
            dims = static[node.input[0]][attrs.get("start", 0):attrs.get("end", None)]
            known[node.output[0]] = np.array(dims, np.int64)
        elif node.domain in ("", "ai.onnx") and all(name in known for name in inputs) and \
                not node.op_type.startswith("Random"):
            results = ReferenceEvaluator(_single_node_model(node, known, opsets)).run(
                None, {name: known[name] for name in inputs})
            known.update(zip(node.output, results))
        else:
            kept.append(node)
    used = {name for node in kept for name in node.input} | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(numpy_helper.from_array(np.asarray(known[name]), name)
                             for name in sorted(used) if name in known)
    del graph.value_info[:]
    return model


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


def _single_node_model(node: Any, known: Dict[str, np.ndarray], opsets: List[Any]) -> Any:
    from onnx import helper

    def value(name: str, array: Optional[np.ndarray] = None) -> Any:
        if array is None:
            return helper.make_empty_tensor_value_info(name)
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), array.shape)

    graph = helper.make_graph([node], "fold", [value(n, known[n]) for n in node.input if n],
                              [value(n) for n in node.output if n])
    return helper.make_model(graph, opset_imports=opsets)


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
