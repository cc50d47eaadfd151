"""The float stem of an int8 QDQ ONNX: the convolutions that read the uint8 image input run in float.

onnxruntime's int8 convolution is slow where the input has three channels: on the demo detector (256x256, one
thread, x86) its first convolution took 450-680 us in int8 against 155-210 us for the same convolution in float,
more than half of the int8 model's time. Both int8 paths (QAT, :mod:`quant.int8_onnx`; ``bundle create --int8``,
:mod:`converters.byom.int8`) quantize the image input as exactly the uint8 pixels (scale ``s``, zero point 0;
:mod:`converters.onnx_input` then drops its QuantizeLinear), so that convolution reads ``DequantizeLinear(x) =
s * x`` with int8 weights ``w_q * s_w``. Written as a float convolution on the pixels cast to float, with the
weights ``w_q * s_w * s`` and the bias dequantized, it computes the same sums (up to float32 rounding) and its
output is quantized for the next layer as before. The weights stay the quantized values: the model is the same
int8 model, a little larger (216 bytes on the demo detector: 432 float weights in place of 432 int8 ones).

Measured on the demo detector (one thread, a cache-cold call as in the bench): the int8 model's inference
0.76-0.83x with the float stem on onnxruntime 1.32, 0.94-0.98x on 1.14.1 (the Python 3.7 wheel, whose reorder
out of its blocked float layout eats most of the gain). docs/quant.md, "The int8 ONNX", has the figures.

Only that exact pattern is rewritten: ``uint8 input -> Transpose [-> Gather] -> DequantizeLinear (scalar scale,
zero point 0) -> Conv`` readers whose weights (and bias) are DequantizeLinear outputs of initializers. Anything
else is left as it is and :func:`float_stem` returns 0.
"""

import logging
from typing import Any, List, Optional

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


def float_stem(model: Any) -> int:
    """Rewrite ``model``'s stem convolutions (see the module) to float, in place; returns how many."""
    from onnx import helper, numpy_helper

    graph = model.graph
    dq = _input_dequantizer(graph)
    if dq is None:
        return 0
    scale = float(_constant(graph, dq.input[1]))
    convs = [n for n in graph.node if dq.output[0] in n.input]
    plans = [_stem_weights(graph, conv, scale) for conv in convs]
    if not convs or any(p is None for p in plans) or any(c.input[0] != dq.output[0] for c in convs):
        return 0
    for conv, (weight, bias) in zip(convs, plans):
        name = conv.name or conv.output[0]
        graph.initializer.append(numpy_helper.from_array(weight, name + "/stem_weight"))
        conv.input[1] = name + "/stem_weight"
        if bias is not None:
            graph.initializer.append(numpy_helper.from_array(bias, name + "/stem_bias"))
            conv.input[2] = name + "/stem_bias"
    cast = helper.make_node("Cast", [dq.input[0]], [dq.output[0]], name=dq.input[0] + "/float", to=ONNX_FLOAT)
    graph.node.insert(list(graph.node).index(dq), cast)
    graph.node.remove(dq)
    _drop_unread(graph)
    log.info("float stem: %d convolution(s) on the uint8 input run in float on their dequantized weights",
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


def _dequantized(graph: Any, name: str) -> Optional[np.ndarray]:
    """The float value of ``name`` when it is a DequantizeLinear of an initializer (per-tensor, or per output
    channel along axis 0, zero point 0), else None."""
    dq = _dequantizer_of(graph, name)
    if dq is None or _initializer(graph, dq.input[0]) is None:
        return None
    values, scale = _constant(graph, dq.input[0]), _constant(graph, dq.input[1])
    zero = _constant(graph, dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if scale is None or (zero is not None and zero.any()) or (scale.size > 1 and _axis(dq) != 0):
        return None
    shape = (-1,) + (1,) * (values.ndim - 1) if scale.size > 1 else ()
    return values.astype(np.float64) * scale.astype(np.float64).reshape(shape)


def _stem_weights(graph: Any, conv: Any, input_scale: float) -> Optional[List[Any]]:
    """(float32 weights with the input scale folded in, float32 bias or None) of a stem Conv, or None."""
    if conv.op_type != "Conv":
        return None
    weight = _dequantized(graph, conv.input[1])
    if weight is None:
        return None
    bias = None
    if len(conv.input) > 2 and conv.input[2]:
        bias = _dequantized(graph, conv.input[2])
        if bias is None:
            return None
        bias = bias.astype(np.float32)
    return [(weight * np.float64(np.float32(input_scale))).astype(np.float32), bias]


def _drop_unread(graph: Any) -> None:
    """Remove the DequantizeLinear nodes nothing reads any more, then the initializers nothing reads."""
    unread = [n for n in graph.node if n.op_type == "DequantizeLinear" and not any(
        _readers_of(graph, out) for out in n.output)]
    for node in unread:
        graph.node.remove(node)
    drop_unread_initializers(graph)
