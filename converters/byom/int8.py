"""``bundle create --int8``: a calibrated int8 ONNX of a brought model, and the check that it still finds what
the float model finds.

* **What is quantized**: every op except the model's decode. The decode is found from the graph: the nodes from
  which no ``Conv`` can be reached (:func:`decode_nodes`), i.e. what follows the last convolution of each head.
  For a YOLOv8 Detect head that is the Reshape/Concat/Split, the DFL's Softmax and expectation (a MatMul once
  :func:`converters.byom.onnx_graph.dfl_conv_as_matmul` has run), the anchor arithmetic (Sub/Add/Div/Mul) and the
  class Sigmoid; for YOLOv5 the Sigmoid and grid arithmetic; for a classifier its pooling and fully connected
  tail. Quantizing that arithmetic (box coordinates in pixels next to scores in 0..1 in one tensor) is what
  loses every detection with onnxruntime's default op list (issue 28: 0 of 53 kept on a YOLOv8n).
* **How**: onnxruntime's quantization pre-processing (BatchNorm folded into its Conv), then its static
  quantization, QDQ format, uint8 activations and per-channel int8 weights, MinMax calibration on the
  calibration images through the box's own letterbox and normalisation
  (:class:`agent.pipeline.input_batch.BatchPreprocessor`). A network normalised as ``x/255`` gets its input
  quantized as exactly ``x/255`` (scale 1/255, zero point 0), so that once the input is folded
  (:mod:`converters.onnx_input`) the uint8 frame *is* the quantized input and its QuantizeLinear disappears;
  the convolutions reading it then run in float on their dequantized int8 weights (:mod:`converters.int8_stem`).
* **The check** (:func:`check_int8`): on held-out images (never calibrated on) the int8 model, fed uint8 as the box
  feeds it, against the float model on the host-normalised frames, both on onnxruntime and decoded with the
  bundle's own postprocessing, the same ``conf``, NMS and ``max_det`` for both. A float detection is *kept* when
  the box would report it at int8 too: an int8 detection (so scoring at least ``conf``) of the same class overlaps
  it with IoU >= :data:`MATCH_IOU` (the mean score and box differences of the pairs, and the int8 detections
  that match none, are reported beside it); a classification is kept when its top-1 class is the same. Fewer
  than :data:`KEEP_THRESHOLD` kept and the int8 model is refused (``--force`` writes it anyway, saying so).
"""

import dataclasses
import logging
import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.postprocess import decode
from agent.pipeline.preprocess import PreprocessSpec
from converters.byom.model_file import CreateError, Tier, import_onnx
from converters.int8_stem import float_stem
from converters.onnx_input import MODEL_INPUT, fold_input

log = logging.getLogger(__name__)

KEEP_THRESHOLD = 0.95  # share of the float model's detections the int8 one must keep (docs/converters.md)
# a float detection is kept by an int8 detection (at the bundle's conf, as the box reports it) of the same class
# overlapping it this much: PASCAL VOC's (and mAP@0.5's) rule for "the same object"
MATCH_IOU = 0.5
HELD_OUT_SHARE = 0.25  # of --images, checked and never calibrated on (at least one image)
MIN_IMAGES = 4  # calibration needs a few images, and the check at least one more
QDQ_OPSET = 13  # per-channel QuantizeLinear/DequantizeLinear (axis) need opset 13
MAX_OPSET, MAX_IR_VERSION = 18, 8  # what onnxruntime 1.14.1 reads (the newest for the box's Python 3.7)
UNIT_SCALE = np.float32(1.0 / 255.0)


@dataclasses.dataclass
class Int8Check:
    """The int8 model against the float one on held-out images."""

    images: int
    float_found: int  # float detections (or classifications)
    kept: int  # found again by the int8 model: an int8 detection (score >= conf) of its class, IoU >= MATCH_IOU
    int8_extra: int  # int8 detections that match no float one (new boxes the float model did not report)
    mean_score_diff: float  # over kept detections
    mean_box_diff_px: float  # mean absolute corner difference, in input pixels, over kept detections

    @property
    def kept_share(self) -> float:
        return self.kept / self.float_found if self.float_found else 1.0

    def refusal(self) -> Optional[str]:
        """Why this int8 model must not be written unchecked, or None. Held-out images on which the float model
        finds nothing check nothing: that is a refusal too, not a pass."""
        if self.float_found == 0:
            return "the float model found nothing on the %d held-out image(s), so nothing was checked" % self.images
        if self.kept_share < KEEP_THRESHOLD:
            return "it keeps too few detections: %s" % self.summary()
        return None

    def as_dict(self) -> Dict[str, Any]:
        return {"images": self.images, "float_detections": self.float_found, "kept": self.kept,
                "int8_extra": self.int8_extra, "match_iou": MATCH_IOU,
                "kept_share": round(self.kept_share, 4), "threshold": KEEP_THRESHOLD,
                "mean_score_diff": round(self.mean_score_diff, 6),
                "mean_box_diff_px": round(self.mean_box_diff_px, 4)}

    def summary(self) -> str:
        return "%d of %d float detections kept (%.1f%%, threshold %.0f%%; same class, IoU >= %.2g, int8 score >= " \
               "conf) on %d held-out image(s), %d int8 detection(s) matching none; mean score difference %.4f, " \
               "mean box difference %.2f px" % (
                   self.kept, self.float_found, 100 * self.kept_share, 100 * KEEP_THRESHOLD, MATCH_IOU, self.images,
                   self.int8_extra, self.mean_score_diff, self.mean_box_diff_px)


def split_images(images: Sequence[np.ndarray]) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """(calibration, held-out): every 1/HELD_OUT_SHARE-th image is held out, the rest calibrate."""
    if len(images) < MIN_IMAGES:
        raise CreateError("--int8 needs at least %d images (calibration and a held-out check), got %d: give "
                          "--images DIR with frames like the box's" % (MIN_IMAGES, len(images)))
    every = max(2, int(round(1 / HELD_OUT_SHARE)))
    held = [image for i, image in enumerate(images) if i % every == every - 1]
    calibration = [image for i, image in enumerate(images) if i % every != every - 1]
    return calibration, held


def decode_nodes(model: Any) -> List[Any]:
    """The nodes from which no Conv is reachable (the decode after each head's last convolution), in graph
    order. ONNX keeps nodes topologically sorted, so one backward pass decides each node from its readers.
    Run on the bundle's graph, where a YOLOv8 DFL's arange Conv is already a MatMul (fixed_onnx)."""
    readers: Dict[str, List[int]] = {}
    nodes = list(model.graph.node)
    for index, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(index)
    reaches_conv = [False] * len(nodes)
    for index in range(len(nodes) - 1, -1, -1):
        later = [j for name in nodes[index].output for j in readers.get(name, [])]
        reaches_conv[index] = any(nodes[j].op_type == "Conv" or reaches_conv[j] for j in later)
    return [n for n, reaches in zip(nodes, reaches_conv) if not reaches and n.op_type != "Conv"]


def host_inputs(images: Sequence[np.ndarray], spec: PreprocessSpec, tier: Tier, model_input: bool) -> np.ndarray:
    """The box's input tensors for ``images`` at ``tier`` (N, ...): uint8 BGR NHWC for a folded model, else
    float NCHW normalised on the host; both through the box's one letterbox."""
    if model_input:
        batcher = BatchPreprocessor(spec, tier, max_batch=1, input_dtype=MODEL_INPUT["input_dtype"],
                                    input_layout=MODEL_INPUT["input_layout"],
                                    input_color=MODEL_INPUT["input_color"], normalize=False)
    else:
        batcher = BatchPreprocessor(spec, tier, max_batch=1)
    tensors = []
    for image in images:
        batcher.fill(0, image)
        tensors.append(batcher.batch[0].copy())
    return np.stack(tensors)


def quantize_int8(float_path: str, out_path: str, spec: PreprocessSpec, tier: Tier,
                  calibration: Sequence[np.ndarray]) -> List[str]:
    """Write the int8 QDQ model of ``float_path`` (float NCHW input) to ``out_path`` with the input folded
    (uint8 BGR NHWC in); returns the names of the decode nodes left in float."""
    onnx = import_onnx()
    try:
        from onnxruntime import quantization
    except ImportError:
        raise CreateError("--int8 needs onnxruntime's quantization tools: pip install 'onnxruntime>=1.16'") from None
    model = _preprocessed(onnx, float_path)
    if _opset(model) < QDQ_OPSET:
        model = onnx.version_converter.convert_version(model, QDQ_OPSET)
    for index, node in enumerate(model.graph.node):  # nodes_to_exclude goes by name
        if not node.name:
            node.name = "%s_%d" % (node.op_type, index)
    excluded = [n.name for n in decode_nodes(model)]
    input_name = model.graph.input[0].name
    unit_input = not any(spec.mean) and all(s == 255.0 for s in spec.std)
    options: Dict[str, Any] = {"ActivationSymmetric": False, "WeightSymmetric": True}
    if unit_input:  # the uint8 pixel is the quantized input value (converters/onnx_input.py drops the Q)
        unit = {"scale": np.array(UNIT_SCALE), "zero_point": np.array(0, np.uint8)}
        options["TensorQuantOverrides"] = {input_name: [unit]}
    samples = host_inputs(calibration, spec, tier, model_input=False)

    class _Reader(quantization.CalibrationDataReader):
        def __init__(self) -> None:
            self._next = iter(samples)

        def get_next(self) -> Any:
            sample = next(self._next, None)
            return None if sample is None else {input_name: sample[None]}

    with tempfile.TemporaryDirectory(prefix="atlas-edge-int8-") as work:
        named, quantized = os.path.join(work, "float.onnx"), os.path.join(work, "int8.onnx")
        onnx.save(model, named)
        quantization.quantize_static(
            named, quantized, _Reader(), quant_format=quantization.QuantFormat.QDQ,
            activation_type=quantization.QuantType.QUInt8, weight_type=quantization.QuantType.QInt8,
            per_channel=True, calibrate_method=quantization.CalibrationMethod.MinMax, nodes_to_exclude=excluded,
            extra_options=options)
        int8 = onnx.load(quantized)
    fold_input(int8, spec)
    stem = float_stem(int8)
    _loadable_by_old_runtimes(int8)
    onnx.checker.check_model(int8)
    onnx.save(int8, out_path)
    log.info("%s: int8 QDQ, %d decode node(s) left in float, %d stem convolution(s) in float",
             os.path.basename(out_path), len(excluded), stem)
    return excluded


def _preprocessed(onnx: Any, float_path: str) -> Any:
    """The float model after onnxruntime's quantization pre-processing (its basic graph optimisations: BatchNorm
    folded into the Conv, constants folded; shapes inferred): a BatchNormalization left between a Conv and its
    QuantizeLinear keeps the pair from fusing into one int8 kernel (the demo detector's PTQ model ran no faster
    than float without it). The model as given when the pre-processing fails."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(prefix="atlas-edge-int8-pre-") as work:
        out = os.path.join(work, "pre.onnx")
        try:
            quant_pre_process(float_path, out, skip_symbolic_shape=True)
            return onnx.load(out)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types; quantizing without it still works
            log.warning("%s: onnxruntime's quantization pre-processing failed (%s); quantizing the model as given",
                        float_path, exc)
            return onnx.load(float_path)


def _loadable_by_old_runtimes(model: Any) -> None:
    """Keep the int8 model loadable by onnxruntime 1.14.1: opset <= 18 (the quantizer may raise it), IR <= 8."""
    from onnx import version_converter

    if _opset(model) > MAX_OPSET:
        converted = version_converter.convert_version(model, MAX_OPSET)
        model.CopyFrom(converted)
    used = {n.domain for n in model.graph.node}
    kept = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def check_int8(float_path: str, int8_path: str, spec: PreprocessSpec, tier: Tier, task: str,
               postprocessing: Dict[str, Any], held_out: Sequence[np.ndarray]) -> Int8Check:
    """The int8 model (uint8 in) against the float model (host-normalised in) on ``held_out``, both on
    onnxruntime, decoded with the bundle's ``postprocessing``."""
    float_out = _outputs(float_path, host_inputs(held_out, spec, tier, False))
    int8_out = _outputs(int8_path, host_inputs(held_out, spec, tier, True))
    if task == "classify":
        same = [int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(float_out, int8_out)]
        return Int8Check(len(held_out), len(same), sum(same), 0, 0.0, 0.0)
    found = kept = extra = 0
    score_diffs: List[float] = []
    box_diffs: List[float] = []
    for a, b in zip(float_out, int8_out):
        want, got = decode(task, a, postprocessing)[0], decode(task, b, postprocessing)[0]
        pairs = match_detections(want, got)
        found += len(want)
        kept += len(pairs)
        extra += len(got) - len(pairs)
        score_diffs += [abs(float(want[i, 4]) - float(got[j, 4])) for i, j in pairs]
        box_diffs += [float(np.abs(want[i, :4] - got[j, :4]).mean()) for i, j in pairs]
    return Int8Check(len(held_out), found, kept, extra, float(np.mean(score_diffs)) if score_diffs else 0.0,
                     float(np.mean(box_diffs)) if box_diffs else 0.0)


def _outputs(path: str, inputs: np.ndarray) -> List[np.ndarray]:
    """Output 0 of ``path`` on onnxruntime for each of ``inputs`` (batch 1), one session for all."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return [session.run(None, {name: x[None]})[0] for x in inputs]


def match_detections(want: np.ndarray, got: np.ndarray) -> List[Tuple[int, int]]:
    """Greedy pairs (i, j): each of ``want``'s rows (x1, y1, x2, y2, score, class), best score first, with the
    unused row of ``got`` of its class that overlaps it most, if that IoU reaches MATCH_IOU."""
    used = set()
    pairs = []
    for i in np.argsort(-want[:, 4], kind="stable") if len(want) else []:
        best, best_iou = -1, MATCH_IOU
        for j in range(len(got)):
            if j in used or got[j, 5] != want[i, 5]:
                continue
            overlap = iou(want[i, :4], got[j, :4])
            if overlap >= best_iou:
                best, best_iou = j, overlap
        if best >= 0:
            used.add(best)
            pairs.append((int(i), best))
    return pairs


def iou(a: np.ndarray, b: np.ndarray) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0
