"""The stem of an int8 QDQ ONNX: the convolutions that read the uint8 image input run in float, exactly.

onnxruntime's int8 convolution is slow where the input has three channels: on the demo detector (256x256, one
thread, x86) its first convolution took 450-680 us in int8 against 155-210 us for the same convolution in float,
more than half of the int8 model's time. Both int8 paths (QAT, :mod:`quant.int8_onnx`; ``bundle create --int8``,
:mod:`converters.byom.int8`) quantize the image input as exactly the uint8 pixels (scale ``s``, zero point 0;
:mod:`converters.onnx_input` then drops its QuantizeLinear), so that convolution reads ``DequantizeLinear(x) =
s * x`` with int8 weights ``w_q * s_w`` and an int32 bias ``b_q * s * s_w``, and its output goes straight to a
QuantizeLinear (``s_y``, ``z_y``) for the next layer.

**Why exactly.** The stem computes the int8 convolution's own integer sums in float: its weights are the int8
values ``w_q`` themselves and its bias ``b_q``, on the pixels cast to float. Every product (at most 255 * 127)
and every partial sum is an integer below 2**24, so float32 holds each one exactly and the result does not
depend on the order a CPU's kernel adds them in. The scale ``s * s_w`` moves into the QuantizeLinear, per output
channel: ``round(acc / (s_y / (s * s_w)))``, one IEEE division and one rounding, the same on every CPU.

An earlier stem folded the scales into float weights (``w_q * s_w * s``); its sums then depended on the summation
order, which differs between onnxruntime's x86 (NCHWc) and Arm kernels, and a sum within an ulp of a rounding
boundary quantized to the next step. In a deep network that one step spreads: on the YOLOv8n-shaped stand-in
(640x640, 62 int8 convolutions) x86 and Arm (emulated Cortex-A53 and A76, onnxruntime 1.19.2) disagreed by up to
45 px in a raw box output, and the unfused x86 path (the same sums as Arm's) moved confident detections by up
to 13.5 px and 0.074 in score, so the box's golden self-test refused the bundle on Arm (issue 38).

Only that exact pattern is rewritten: ``uint8 input -> Transpose [-> Gather] -> DequantizeLinear (scalar scale,
zero point 0) -> Conv`` readers whose weights (and bias) are DequantizeLinear outputs of initializers with zero
point 0, read only by a QuantizeLinear with a scalar scale and zero point, whose sums fit float32 exactly.
Anything else is left as it is (int8 on onnxruntime's integer kernels, exact too, slower) and
:func:`float_stem` returns 0.
"""

import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from converters.onnx_input import (
    ONNX_FLOAT,
    _axis,
    _constant,
    _dequantizer_of,
    _initializer,
    _readers_of,
    drop_unread_initializers,
)

log = logging.getLogger(__name__)

LEADING_OPS = ("Transpose", "Gather")  # what fold_input puts between the uint8 input and its DequantizeLinear
EXACT_LIMIT = 2 ** 24  # float32 holds every integer below this exactly
PIXEL_MAX = 255
# the int32 bias's scale is s * s_w rounded to float32, so b_q in units of s * s_w is b_q to within 8 float32 ulps
# of it; further off and the bias is not on the accumulator's grid
BIAS_RELATIVE_SLACK = 1e-6


@dataclass
class _StemPlan:
    """One stem convolution's rewrite: integer-valued float weights and bias, and its quantizer's new scale."""

    conv: Any
    quantize: Any
    weight: np.ndarray  # float32, the int8 values
    bias: Optional[np.ndarray]  # float32, the int32 values in units of s * s_w
    scale: np.ndarray  # float32 s_y / (s * s_w): per output channel, or a scalar
    zero_point: np.ndarray  # the quantizer's zero point, one per channel when ``scale`` is


def float_stem(model: Any) -> int:
    """Rewrite ``model``'s stem convolutions (see the module) to exact float, in place; returns how many."""
    from onnx import helper, numpy_helper

    graph = model.graph
    dq = _input_dequantizer(graph)
    if dq is None:
        return 0
    scale = float(_constant(graph, dq.input[1]))
    convs = [n for n in graph.node if dq.output[0] in n.input]
    plans = [_plan(graph, conv, scale) for conv in convs]
    if not convs or any(p is None for p in plans) or any(c.input[0] != dq.output[0] for c in convs):
        return 0
    for plan in plans:
        name = plan.conv.name or plan.conv.output[0]
        added = [(plan.weight, "/stem_weight", plan.conv, 1), (plan.bias, "/stem_bias", plan.conv, 2),
                 (plan.scale, "/stem_requant_scale", plan.quantize, 1),
                 (plan.zero_point, "/stem_requant_zero_point", plan.quantize, 2)]
        for array, suffix, node, slot in added:
            if array is not None:
                graph.initializer.append(numpy_helper.from_array(array, name + suffix))
                node.input[slot] = name + suffix
        if plan.scale.ndim:
            axis = [a for a in plan.quantize.attribute if a.name == "axis"]
            for attribute in axis:
                plan.quantize.attribute.remove(attribute)
            plan.quantize.attribute.append(helper.make_attribute("axis", 1))
    cast = helper.make_node("Cast", [dq.input[0]], [dq.output[0]], name=dq.input[0] + "/float", to=ONNX_FLOAT)
    graph.node.insert(list(graph.node).index(dq), cast)
    graph.node.remove(dq)
    _drop_unread(graph)
    log.info("float stem: %d convolution(s) on the uint8 input run in float on their int8 values, exactly",
             len(convs))
    return len(convs)


def _input_dequantizer(graph: Any) -> Optional[Any]:
    """The DequantizeLinear (scalar scale, zero point 0) the uint8 image input reaches through fold_input's
    Transpose (and Gather), or None."""
    if len(graph.input) < 1:
        return None
    tensor = graph.input[0].name
    while True:
        readers = [n for n in graph.node if tensor in n.input]
        if len(readers) != 1:
            return None
        node = readers[0]
        if node.op_type == "DequantizeLinear":
            scale, zero = _constant(graph, node.input[1]), _constant(graph, node.input[2] if len(node.input) > 2
                                                                     else "")
            if scale is None or scale.size != 1 or (zero is not None and zero.any()):
                return None
            return node
        if node.op_type not in LEADING_OPS or node.input[0] != tensor:
            return None
        tensor = node.output[0]


def _quantized_parts(graph: Any, name: str) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """(the integer values, their scale shaped to broadcast over axis 0) when ``name`` is a DequantizeLinear of an
    initializer (per-tensor, or per output channel along axis 0, zero point 0), else None."""
    dq = _dequantizer_of(graph, name)
    if dq is None or _initializer(graph, dq.input[0]) is None:
        return None
    values, scale = _constant(graph, dq.input[0]), _constant(graph, dq.input[1])
    zero = _constant(graph, dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if scale is None or (zero is not None and zero.any()) or (scale.size > 1 and _axis(dq) != 0):
        return None
    if values.dtype.kind not in "iu" or not np.all(scale > 0):
        return None
    shape = (-1,) + (1,) * (values.ndim - 1) if scale.size > 1 else ()
    return values.astype(np.int64), scale.astype(np.float64).reshape(shape)


def _only_quantizer(graph: Any, tensor: str) -> Optional[Any]:
    """The QuantizeLinear (scalar scale and zero point) that is the only reader of ``tensor``, or None."""
    readers = [n for n in graph.node if tensor in n.input]
    if len(readers) != 1 or _readers_of(graph, tensor) != 1 or readers[0].op_type != "QuantizeLinear":
        return None
    quantize = readers[0]
    scale = _constant(graph, quantize.input[1])
    zero = _constant(graph, quantize.input[2]) if len(quantize.input) > 2 and quantize.input[2] else None
    if scale is None or scale.size != 1 or zero is None or zero.size != 1:
        return None
    return quantize


def _plan(graph: Any, conv: Any, input_scale: float) -> Optional[_StemPlan]:
    """How ``conv`` runs exactly in float (see the module), or None where it cannot."""
    if conv.op_type != "Conv":
        return None
    quantize = _only_quantizer(graph, conv.output[0])
    weight = _quantized_parts(graph, conv.input[1])
    if quantize is None or weight is None:
        return None
    values, weight_scale = weight
    unit = np.float64(np.float32(input_scale)) * weight_scale.reshape(-1)  # the accumulator's unit, per channel
    bias = None
    if len(conv.input) > 2 and conv.input[2]:
        parts = _quantized_parts(graph, conv.input[2])
        if parts is None:
            return None
        bias_units = parts[0] * parts[1] / unit
        bias = np.rint(bias_units)
        if np.any(np.abs(bias_units - bias) > BIAS_RELATIVE_SLACK * np.maximum(np.abs(bias_units), 1.0)):
            return None  # a bias not on the accumulator's grid: its sum would not be an integer
    per_channel = np.abs(values).reshape(values.shape[0], -1).sum(axis=1) * PIXEL_MAX
    if np.max(per_channel + (np.abs(bias) if bias is not None else 0)) >= EXACT_LIMIT:
        return None
    output_scale = np.float64(_constant(graph, quantize.input[1]).reshape(()))
    zero = _constant(graph, quantize.input[2]).reshape(())
    scale = (output_scale / unit).astype(np.float32)
    per_output = scale.size > 1
    return _StemPlan(conv, quantize, values.astype(np.float32),
                     bias.astype(np.float32) if bias is not None else None,
                     scale if per_output else scale.reshape(()),
                     np.full(scale.shape, zero, zero.dtype) if per_output else zero)


def _drop_unread(graph: Any) -> None:
    """Remove the DequantizeLinear nodes nothing reads any more, then the initializers nothing reads."""
    unread = [n for n in graph.node if n.op_type == "DequantizeLinear" and not any(
        _readers_of(graph, out) for out in n.output)]
    for node in unread:
        graph.node.remove(node)
    drop_unread_initializers(graph)
