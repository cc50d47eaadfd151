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
  quantization, QDQ format, uint8 activations and per-channel int8 weights in 7 bits (``reduce_range``: on an x86
  CPU without VNNI, onnxruntime's u8s8 kernels add two uint8 x int8 products in 16 bits, which saturates with
  8-bit weights; with 7 no sum can, so every CPU computes the same integers), MinMax calibration on the
  calibration images through the box's own letterbox and normalisation
  (:class:`agent.pipeline.input_batch.BatchPreprocessor`). A network normalised as ``x/255`` gets its input
  quantized as exactly ``x/255`` (scale 1/255, zero point 0), so that once the input is folded
  (:mod:`converters.onnx_input`) the uint8 frame *is* the quantized input and its QuantizeLinear disappears;
  the convolutions reading it then run in float on their int8 values, exactly (:mod:`converters.int8_stem`).
* **The check** (:func:`check_int8`): on held-out images (never calibrated on: at least :data:`HELD_OUT_MIN`
  when there are images enough, every image beyond :data:`MAX_CALIBRATION_IMAGES` calibrating ones) the int8
  model, fed uint8 as the box feeds it, against the float model on the host-normalised frames, both on
  onnxruntime and decoded with the bundle's own postprocessing, measured by the project's one agreement measure
  (:mod:`agent.pipeline.agreement`, the one a box's shadow run uses): same class, IoU >= :data:`MATCH_IOU`, strict
  and score-aware F1 with a 95 % interval, the score distance and the box offset. A score-aware F1 below
  :data:`KEEP_THRESHOLD` and the int8 model is refused (``--force`` writes it anyway, saying so); a sample too
  small to mean much is said plainly. A classifier is checked by its top-1 classes.
"""

import dataclasses
import logging
import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.pipeline.agreement import MATCH_IOU, AgreementMeter
from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.postprocess import decode
from agent.pipeline.preprocess import PreprocessSpec
from converters.byom.model_file import CreateError, Tier, import_onnx
from converters.int8_stem import float_stem
from converters.onnx_input import MODEL_INPUT, fold_input

log = logging.getLogger(__name__)

KEEP_THRESHOLD = 0.95  # the score-aware F1 of int8 against float that --int8 requires (docs/converters.md)
HELD_OUT_MIN = 16  # held-out images by default: fewer and the check proves little (agent.pipeline.agreement)
MAX_CALIBRATION_IMAGES = 64  # MinMax ranges settle well before this; every image beyond calibrates nothing
MIN_CALIBRATION_IMAGES = 8  # fewer and the 16 held out would starve the calibration: split 3:1 instead
FALLBACK_HELD_OUT_SHARE = 0.25
MIN_IMAGES = 4  # calibration needs a few images, and the check at least one more
QDQ_OPSET = 13  # per-channel QuantizeLinear/DequantizeLinear (axis) need opset 13
MAX_OPSET, MAX_IR_VERSION = 18, 8  # what onnxruntime 1.14.1 reads (the newest for the box's Python 3.7)
UNIT_SCALE = np.float32(1.0 / 255.0)


@dataclasses.dataclass
class Int8Check:
    """The int8 model against the float one on held-out images: for detections the agreement report
    (:class:`agent.pipeline.agreement.AgreementMeter`, float the reference, int8 the candidate), for a classifier
    the top-1 classes."""

    images: int
    float_found: int  # float detections reported (score >= conf), or classifications
    kept: int  # strict: reported by int8 too (same class, IoU >= MATCH_IOU, int8 score >= conf), or same top-1
    int8_extra: int  # strict: int8 detections reported that match no reported float one
    agreement: Dict[str, Any] = dataclasses.field(default_factory=dict)  # detections only

    @property
    def kept_share(self) -> float:
        return self.kept / self.float_found if self.float_found else 1.0

    @property
    def score_aware_f1(self) -> float:
        """What the check decides on: threshold noise (a detection scored just under conf on one side) is not a
        disagreement, a lost, moved or reclassified detection is. A classifier: the top-1 share."""
        return float(self.agreement["score_aware"]["f1"]) if self.agreement else self.kept_share

    def refusal(self) -> Optional[str]:
        """Why this int8 model must not be written unchecked, or None. Held-out images on which the float model
        finds nothing check nothing: that is a refusal too, not a pass."""
        if self.float_found == 0:
            return "the float model found nothing on the %d held-out image(s), so nothing was checked" % self.images
        if self.score_aware_f1 < KEEP_THRESHOLD:
            return "it agrees too little with the float model: %s" % self.summary()
        return None

    def warning(self) -> Optional[str]:
        return self.agreement.get("warning")

    def as_dict(self) -> Dict[str, Any]:
        return {"images": self.images, "float_detections": self.float_found, "kept": self.kept,
                "int8_extra": self.int8_extra, "match_iou": MATCH_IOU, "kept_share": round(self.kept_share, 4),
                "score_aware_f1": round(self.score_aware_f1, 4), "threshold": KEEP_THRESHOLD,
                "mean_box_diff_px": self.agreement.get("mean_box_offset_px", 0.0), "agreement": self.agreement}

    def summary(self) -> str:
        if not self.agreement:
            return "%d of %d top-1 classes the same (%.1f%%, threshold %.0f%%) on %d held-out image(s)" % (
                self.kept, self.float_found, 100 * self.kept_share, 100 * KEEP_THRESHOLD, self.images)
        aware, strict = self.agreement["score_aware"], self.agreement["strict"]
        return ("score-aware F1 %.3f (95%% interval %.3f-%.3f; threshold %.2f), strict F1 %.3f: %d of %d float "
                "detections reported at int8 too (same class, IoU >= %.2g), %d int8 detection(s) matching none, on "
                "%d held-out image(s); score distance (W1) %.4f, mean box difference %.2f px%s" % (
                    aware["f1"], aware["f1_interval"][0], aware["f1_interval"][1], KEEP_THRESHOLD, strict["f1"],
                    self.kept, self.float_found, MATCH_IOU, self.int8_extra, self.images,
                    self.agreement["score_wasserstein1"], self.agreement["mean_box_offset_px"],
                    "; " + self.warning() if self.warning() else ""))


def split_images(images: Sequence[np.ndarray]) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """(calibration, held-out): at most MAX_CALIBRATION_IMAGES calibrate and every other image is held out, at
    least HELD_OUT_MIN of them; with too few images for that, a quarter is held out (the check then warns that
    its sample is small). The held-out images are spread over the folder's order, never calibrated on."""
    count = len(images)
    if count < MIN_IMAGES:
        raise CreateError("--int8 needs at least %d images (calibration and a held-out check), got %d: give "
                          "--images DIR with frames like the box's" % (MIN_IMAGES, count))
    if count - HELD_OUT_MIN >= MIN_CALIBRATION_IMAGES:
        held_count = count - min(MAX_CALIBRATION_IMAGES, count - HELD_OUT_MIN)
    else:
        held_count = max(1, int(count * FALLBACK_HELD_OUT_SHARE))
    held_at = {i * count // held_count for i in range(held_count)}
    held = [image for i, image in enumerate(images) if i in held_at]
    calibration = [image for i, image in enumerate(images) if i not in held_at]
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
            per_channel=True, reduce_range=True, calibrate_method=quantization.CalibrationMethod.MinMax,
            nodes_to_exclude=excluded, extra_options=options)
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
               postprocessing: Dict[str, Any], held_out: Sequence[np.ndarray],
               labels: Optional[Sequence[str]] = None) -> Int8Check:
    """The int8 model (uint8 in) against the float model (host-normalised in) on ``held_out``, both on
    onnxruntime, decoded with the bundle's ``postprocessing`` at the agreement's low threshold; ``labels`` (the
    bundle's) name the per-class figures."""
    float_out = _outputs(float_path, host_inputs(held_out, spec, tier, False))
    int8_out = _outputs(int8_path, host_inputs(held_out, spec, tier, True))
    if task == "classify":
        same = [int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(float_out, int8_out)]
        return Int8Check(len(held_out), len(same), sum(same), 0)
    meter = AgreementMeter(float(postprocessing["conf"]), reference_labels=labels, candidate_labels=labels)
    low = dict(postprocessing, conf=meter.low)
    for a, b in zip(float_out, int8_out):
        meter.add(decode(task, a, low)[0], decode(task, b, low)[0])
    report = meter.report()
    strict = report["strict"]
    return Int8Check(len(held_out), report["reference_detections"], strict["tp"], strict["fp"], report)


def _outputs(path: str, inputs: np.ndarray) -> List[np.ndarray]:
    """Output 0 of ``path`` on onnxruntime for each of ``inputs`` (batch 1), one session for all."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return [session.run(None, {name: x[None]})[0] for x in inputs]
