"""QAT -> an int8 QDQ ONNX that carries the QAT-learned scales (docs/quant.md, "The int8 ONNX").

MindSpore cannot export a Golden Stick network to ONNX ("Exporting FakeQuantParam operator is not yet
supported"), so the int8 graph is built here from two things the run already has:

* the float ONNX of the same network, for its structure only (its initializer names are the network's
  parameter names), and
* :class:`QatTensors`: the QAT-trained weights and batch-norm statistics by parameter name, and each
  convolution's quantizers (input: per-tensor asymmetric uint8; weight: per-channel symmetric int8), read from
  the trained QAT network in memory by :func:`quant.int8_source.qat_tensors`.

Per quantized convolution (``Conv [-> BatchNormalization] [-> Relu]``):

* batch norm is folded: k = gamma / sqrt(var + eps); the per-channel weight scale becomes s_w * |k| and the
  int8 values are the QAT-rounded *unfolded* weights round(clip(W) / s_w) with the sign of k folded in, so the
  products equal the simulation's k * fq(W). A negative k turns a -128 into +128, which int8 cannot hold: such
  values are clipped to 127 and counted (:class:`Int8Stats`).
* the folded bias becomes int32 at scale s_in * s_w * |k| (an overflow is an error naming the layer).
* the input gets ``QuantizeLinear``/``DequantizeLinear`` with the input quantizer's scale and zero point.
* ``Relu`` is dropped when every reader of its output quantizes it with uint8 zero point 0: Q(relu(x)) = Q(x)
  there, exactly, because 0 is the smallest uint8. With another zero point the Relu stays.

A convolution with a weight quantizer and no batch norm (the detector's prediction convolutions) keeps its float
bias and has no output quantizer in QAT, so it stays a float convolution on dequantized int8 weights. Everything
else (the decode) is copied unchanged.

Once the input is folded (uint8 pixels in), the convolution reading it runs in float on its dequantized int8
weights (:mod:`converters.int8_stem`: onnxruntime's int8 kernel is slow on three input channels).

The result is upgraded to opset 13 (per-channel ``DequantizeLinear`` needs its ``axis``), written with IR
version 8 and only the opset imports its nodes use, which onnxruntime 1.14.1 (the newest for the box's
Python 3.7) loads as well as the newest.
"""

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

log = logging.getLogger(__name__)

INT8_OPSET = 13  # QuantizeLinear/DequantizeLinear with a per-channel axis
INT8_IR_VERSION = 8  # the newest IR onnxruntime 1.14.1 reads
INT32_MAX = 2**31 - 1
UINT8_RANGE = (0, 255)


class Int8ExportError(ValueError):
    """The QAT network cannot be written as this int8 graph; the message names the layer and why."""


@dataclasses.dataclass(frozen=True)
class ActivationQuant:
    """A per-tensor asymmetric uint8 quantizer (the QAT input quantizer of a layer)."""

    scale: float
    zero_point: int


@dataclasses.dataclass(frozen=True)
class ConvQuant:
    """The quantizers of one convolution, keyed in :class:`QatTensors` by its weight's parameter name."""

    input: ActivationQuant
    weight_scale: np.ndarray  # (C_out,) symmetric, zero point 0
    weight_range: Tuple[int, int] = (-128, 127)


@dataclasses.dataclass
class QatTensors:
    """What the int8 graph takes from the QAT network: parameter values by name, and per-conv quantizers."""

    params: Dict[str, np.ndarray]
    convs: Dict[str, ConvQuant]


@dataclasses.dataclass
class Int8Stats:
    """What the conversion did, for the report: counts of layers and of values it had to clip."""

    quantized_convs: int = 0
    float_convs: int = 0  # weight-quantized convs without an output quantizer (prediction convs)
    float_stem_convs: int = 0  # quantized in QAT, run in float on their int8 weights (converters/int8_stem.py)
    relu_dropped: int = 0
    negative_k_channels: int = 0
    clipped_weights: int = 0  # -128 * sign(k) = +128 clipped to 127
    weights_clipped_in_qat: int = 0  # W beyond qmax * s_w (the simulation clips them as well)

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


# --- the numbers --------------------------------------------------------------------------------------------


def check_activation(quant: ActivationQuant, layer: str) -> None:
    """A uint8 activation quantizer: positive scale, integer zero point in 0..255."""
    if not np.isfinite(quant.scale) or quant.scale <= 0:
        raise Int8ExportError("%s: input scale %r is not a positive number" % (layer, quant.scale))
    if not UINT8_RANGE[0] <= quant.zero_point <= UINT8_RANGE[1]:
        raise Int8ExportError("%s: input zero point %d is outside uint8" % (layer, quant.zero_point))


def quantize_weight(weight: np.ndarray, quant: ConvQuant, stats: Int8Stats) -> np.ndarray:
    """round(clip(W) / s_w) per output channel, as the QAT simulation computes it (int32 values)."""
    qmin, qmax = quant.weight_range
    scale = quant.weight_scale.astype(np.float32).reshape((-1,) + (1,) * (weight.ndim - 1))
    low, high = qmin * scale, qmax * scale
    stats.weights_clipped_in_qat += int(np.count_nonzero((weight < low) | (weight > high)))
    clipped = np.minimum(np.maximum(weight.astype(np.float32), low), high)
    return np.clip(np.round(clipped / scale), qmin, qmax).astype(np.int32)


def fold_batch_norm(
    q: np.ndarray, weight_scale: np.ndarray, bn: Dict[str, np.ndarray], eps: float, stats: Int8Stats,
    weight_range: Tuple[int, int] = (-128, 127), layer: str = "conv",
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold batch norm into int8 weights: (int8 values with sign(k), scale s_w |k|, float bias beta - k mean).

    ``bn`` holds gamma, beta, moving_mean, moving_variance. A channel with k = 0 has no int8 scale.
    """
    k = bn["gamma"].astype(np.float64) / np.sqrt(bn["moving_variance"].astype(np.float64) + eps)
    if np.any(k == 0):
        raise Int8ExportError("%s: batch norm scale is 0 in channel(s) %s" % (layer, np.flatnonzero(k == 0)[:8]))
    negative = k < 0
    stats.negative_k_channels += int(np.count_nonzero(negative))
    signed = q * np.where(negative, -1, 1).reshape((-1,) + (1,) * (q.ndim - 1))
    qmin, qmax = weight_range
    outside = (signed < qmin) | (signed > qmax)
    stats.clipped_weights += int(np.count_nonzero(outside))
    values = np.clip(signed, qmin, qmax).astype(np.int8)
    scale = (weight_scale.astype(np.float64) * np.abs(k)).astype(np.float32)
    bias = bn["beta"].astype(np.float64) - k * bn["moving_mean"].astype(np.float64)
    return values, scale, bias


def quantize_bias(bias: np.ndarray, input_scale: float, weight_scale: np.ndarray, layer: str) -> np.ndarray:
    """int32 bias at scale s_in * s_w (what QLinearConv adds to its int32 accumulator)."""
    step = np.float64(np.float32(input_scale)) * weight_scale.astype(np.float64)
    values = np.round(bias.astype(np.float64) / step)
    overflow = ~np.isfinite(values) | (np.abs(values) > INT32_MAX)
    if np.any(overflow):
        channel = int(np.flatnonzero(overflow)[0])
        raise Int8ExportError(
            "%s: bias %.6g at scale %.3g overflows int32 in channel %d (%d channel(s))"
            % (layer, bias[channel], step[channel], channel, int(np.count_nonzero(overflow)))
        )
    return values.astype(np.int32)


# --- the graph ----------------------------------------------------------------------------------------------


class _Builder:
    """Rewrites the float graph's nodes into a new list; quantize/dequantize pairs are made once per tensor and
    quantizer."""

    def __init__(self, graph: Any, qat: QatTensors, stats: Int8Stats) -> None:
        self.graph = graph
        self.qat = qat
        self.stats = stats
        self.nodes: List[Any] = []
        self.initializers: List[Any] = []
        self.skip: set = set()  # ids of BatchNormalization / Relu nodes folded into a conv
        self.dequantized: Dict[Tuple[str, float, int], str] = {}
        self.readers: Dict[str, List[Any]] = {}
        for node in graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.graph_outputs = {o.name for o in graph.output}

    def constant(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def dequantize(self, name: str, values: np.ndarray, scale: np.ndarray, zero_point: np.ndarray,
                   axis: Optional[int]) -> str:
        """An initializer of integers and the DequantizeLinear that reads it; returns its float output."""
        from onnx import helper

        inputs = [self.constant(name + "_quantized", values), self.constant(name + "_scale", scale),
                  self.constant(name + "_zero_point", zero_point)]
        attrs = {} if axis is None else {"axis": axis}
        self.nodes.append(helper.make_node("DequantizeLinear", inputs, [name + "_dequantized"],
                                           name=name + "_dequantize", **attrs))
        return name + "_dequantized"

    def quantized_activation(self, tensor: str, quant: ActivationQuant) -> str:
        """Q/DQ of ``tensor`` with ``quant`` (shared by every reader with the same quantizer)."""
        from onnx import helper

        key = (tensor, float(np.float32(quant.scale)), int(quant.zero_point))
        if key not in self.dequantized:
            tag = "%s_q%d" % (tensor, len(self.dequantized))
            scale = self.constant(tag + "_scale", np.array(quant.scale, np.float32))
            zero = self.constant(tag + "_zero_point", np.array(quant.zero_point, np.uint8))
            self.nodes.append(helper.make_node("QuantizeLinear", [tensor, scale, zero], [tag + "_quantized"],
                                               name=tag + "_quantize"))
            self.nodes.append(helper.make_node("DequantizeLinear", [tag + "_quantized", scale, zero],
                                               [tag + "_dequantized"], name=tag + "_dequantize"))
            self.dequantized[key] = tag + "_dequantized"
        return self.dequantized[key]

    def sole_reader(self, tensor: str, op_type: str) -> Optional[Any]:
        readers = self.readers.get(tensor, [])
        if len(readers) == 1 and readers[0].op_type == op_type and tensor not in self.graph_outputs:
            return readers[0]
        return None

    def relu_droppable(self, relu: Any) -> bool:
        """Every reader of the Relu's output quantizes it as a conv input with uint8 zero point 0."""
        output = relu.output[0]
        readers = self.readers.get(output, [])
        if not readers or output in self.graph_outputs:
            return False
        for reader in readers:
            quant = self.qat.convs.get(reader.input[1]) if reader.op_type == "Conv" else None
            if quant is None or reader.input[0] != output or quant.input.zero_point != 0:
                return False
        return True

    def param(self, name: str) -> np.ndarray:
        if name not in self.qat.params:
            raise Int8ExportError("the QAT network has no parameter %s (the float ONNX reads it)" % name)
        return self.qat.params[name]

    def conv(self, node: Any) -> None:
        from onnx import helper

        weight_name = node.input[1]
        quant = self.qat.convs[weight_name]
        layer = weight_name.rsplit(".", 1)[0]
        check_activation(quant.input, layer)
        q = quantize_weight(self.param(weight_name), quant, self.stats)
        x = self.quantized_activation(node.input[0], quant.input)
        bn = self.sole_reader(node.output[0], "BatchNormalization")
        if bn is None:  # no batch norm: a float conv on dequantized weights (no output quantizer in QAT)
            w = self.dequantize(weight_name, q.astype(np.int8), quant.weight_scale.astype(np.float32),
                                np.zeros(q.shape[0], np.int8), 0)
            inputs = [x, w] + [self.constant(n + "_qat", self.param(n).astype(np.float32)) for n in node.input[2:]]
            self.nodes.append(helper.make_node("Conv", inputs, list(node.output), name=node.name or layer,
                                               domain=node.domain))
            self.nodes[-1].attribute.extend(node.attribute)
            self.stats.float_convs += 1
            return
        stats = {key: self.param(bn.input[i]) for i, key in
                 enumerate(("gamma", "beta", "moving_mean", "moving_variance"), start=1)}
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        values, scale, bias = fold_batch_norm(q, quant.weight_scale, stats, eps, self.stats, quant.weight_range,
                                              layer)
        if len(node.input) > 2 and node.input[2]:  # a conv bias before the batch norm: k * b joins the bias
            k = stats["gamma"].astype(np.float64) / np.sqrt(stats["moving_variance"].astype(np.float64) + eps)
            bias = bias + k * self.param(node.input[2]).astype(np.float64)
        self.skip.add(id(bn))
        output = bn.output[0]
        relu = self.sole_reader(output, "Relu")
        if relu is not None and self.relu_droppable(relu):
            self.skip.add(id(relu))
            output = relu.output[0]
            self.stats.relu_dropped += 1
        w = self.dequantize(weight_name, values, scale, np.zeros(len(scale), np.int8), 0)
        b = self.dequantize(layer + ".folded_bias", quantize_bias(bias, quant.input.scale, scale, layer),
                            (np.float64(np.float32(quant.input.scale)) * scale).astype(np.float32),
                            np.zeros(len(scale), np.int32), 0)
        self.nodes.append(helper.make_node("Conv", [x, w, b], [output], name=node.name or layer))
        self.nodes[-1].attribute.extend(node.attribute)
        self.stats.quantized_convs += 1

    def run(self) -> None:
        used = set()
        for node in self.graph.node:
            if id(node) in self.skip:
                continue
            if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in self.qat.convs:
                used.add(node.input[1])
                self.conv(node)
            else:
                self.nodes.append(node)
        unused = sorted(set(self.qat.convs) - used)
        if unused:
            raise Int8ExportError("quantizers of %s match no Conv of the float ONNX" % ", ".join(unused[:8]))


def _onnx_name(name: str, onnx_names: set) -> str:
    """The float ONNX's name for a QAT parameter: the name itself, or the shortest dotted suffix the ONNX holds
    (training wraps the network, and MindSpore then prefixes some parameter names with ``network.``)."""
    parts = name.split(".")
    for start in range(len(parts)):
        candidate = ".".join(parts[start:])
        if candidate in onnx_names:
            return candidate
    return name


def align_names(qat: QatTensors, onnx_names: set) -> QatTensors:
    """``qat`` with its parameter and conv keys renamed to the float ONNX's initializer names."""
    return QatTensors({_onnx_name(k, onnx_names): v for k, v in qat.params.items()},
                      {_onnx_name(k, onnx_names): v for k, v in qat.convs.items()})


def load_qat_weights(graph: Any, params: Dict[str, np.ndarray]) -> int:
    """Replace every initializer named after a QAT parameter by its QAT value (the float ONNX holds the float
    checkpoint's); returns how many. A shape that differs means another network: an error naming it."""
    from onnx import numpy_helper

    loaded = 0
    for tensor in graph.initializer:
        if tensor.name not in params:
            continue
        value = params[tensor.name]
        if tuple(tensor.dims) != value.shape:
            raise Int8ExportError("%s: float ONNX shape %s, QAT network %s" % (tensor.name, tuple(tensor.dims),
                                                                               value.shape))
        dtype = numpy_helper.to_array(tensor).dtype
        tensor.CopyFrom(numpy_helper.from_array(value.astype(dtype), tensor.name))
        loaded += 1
    return loaded


def strip_unused_opsets(model: Any) -> None:
    """Keep only the opset imports the nodes use (onnxruntime 1.14.1 rejects some it does not know)."""
    used = {node.domain for node in model.graph.node}
    keep = [o for o in model.opset_import if o.domain in used or (o.domain == "" and "" in used)]
    del model.opset_import[:]
    model.opset_import.extend(keep)


def build_int8_model(float_model: Any, qat: QatTensors) -> Tuple[Any, Int8Stats]:
    """The int8 QDQ ModelProto (float NCHW input, as the float model's) and what the conversion counted."""
    from onnx import version_converter

    from converters.onnx_input import drop_unread_initializers

    model = version_converter.convert_version(float_model, INT8_OPSET)
    stats = Int8Stats()
    qat = align_names(qat, {t.name for t in model.graph.initializer})
    load_qat_weights(model.graph, qat.params)
    builder = _Builder(model.graph, qat, stats)
    builder.run()
    graph = model.graph
    del graph.node[:]
    graph.node.extend(builder.nodes)
    graph.initializer.extend(builder.initializers)
    drop_unread_initializers(graph)
    del graph.value_info[:]  # the version converter's shape annotations: 5 KB that no runtime needs
    strip_unused_opsets(model)
    model.ir_version = INT8_IR_VERSION  # opset 13 needs IR >= 7; onnxruntime 1.14.1 reads up to 8
    return model, stats


def write_int8_onnx(float_onnx: str, qat: QatTensors, spec: Any, out_path: str) -> Int8Stats:
    """The int8 ONNX of ``float_onnx`` with the QAT scales, taking uint8 BGR NHWC (``spec`` folded in)."""
    import onnx

    from converters.int8_stem import float_stem
    from converters.onnx_input import fold_input

    model, stats = build_int8_model(onnx.load(float_onnx), qat)
    fold_input(model, spec)
    stats.float_stem_convs = float_stem(model)
    stats.quantized_convs -= stats.float_stem_convs
    onnx.checker.check_model(model)
    onnx.save(model, out_path)
    log.info("wrote %s: %s", out_path, stats.as_dict())
    return stats
