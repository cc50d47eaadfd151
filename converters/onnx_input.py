"""Fold the box's input convention into an ONNX graph: the model takes the letterboxed frame as it is, uint8 BGR
NHWC, and does the cast, the layout change, the colour order and the normalisation itself.

The host then writes each frame straight into the input tensor (one copy, no float pass), and the runtime's
graph optimiser fuses the work into the first convolution where it can. What is folded where:

* ``Cast`` uint8 -> float and ``Transpose`` NHWC -> NCHW: always two nodes at the input.
* The colour order (BGR -> the network's RGB): a permutation of the first convolutions' input-channel weights
  when every reader of the input is such a Conv (exact: the same products, summed in another order), else a
  ``Gather`` on the channel axis. In a QDQ int8 graph the int8 weights are permuted the same way (exact too:
  their scales are per output channel).
* ``(pixel - mean) / std``: in a float graph whose readers are Convs, ``1/std`` scales the weights' input
  channels (exact with zero padding: a padded zero stays zero) and the mean is subtracted from the pixels first
  (an ``Add`` of ``-mean``; folded into the bias instead when the Conv has no padding, where that is exact).
  Otherwise a ``Mul`` by ``1/std`` and an ``Add`` of ``-mean/std``: the host's own float32 constants
  (:class:`agent.pipeline.input_batch.BatchPreprocessor`), so the values equal the host-normalised ones bit for
  bit. In a QDQ graph whose input ``QuantizeLinear`` is exactly ``x/255`` (scale 1/255, zero point 0, uint8)
  and whose normalisation is ``x/255``, that ``QuantizeLinear`` is the identity on 0..255 pixels and goes: the
  uint8 pixels feed its ``DequantizeLinear`` directly.

Only opset-1 operators are added and the model's opset and IR version are kept, so an artifact that loaded in
onnxruntime 1.14.1 (the newest for the box's Python 3.7) still does. :data:`MODEL_INPUT` is what a manifest
artifact entry says about such a model.
"""

import logging
from typing import Any, List, Optional, Sequence

import numpy as np

from agent.pipeline.preprocess import PreprocessSpec
from converters.byom.model_file import import_onnx

log = logging.getLogger(__name__)

# The manifest fields of an artifact made by fold_input (docs/bundle.md): what the box feeds it.
MODEL_INPUT = {"input_dtype": "uint8", "input_layout": "NHWC", "input_color": "bgr", "normalize_on": "model"}
SOURCE_COLOR = "bgr"  # what the letterbox writes (OpenCV's order)
ONNX_FLOAT, ONNX_UINT8 = 1, 2  # onnx.TensorProto.FLOAT / UINT8
NHWC_TO_NCHW = [0, 3, 1, 2]
UNIT_SCALE_TOLERANCE = 1e-6  # |scale * 255 - 1| below this: a QuantizeLinear of x/255 is the identity on uint8


class InputFoldError(ValueError):
    """A graph whose input is not one float (N, 3, H, W) image tensor."""


def fold_input(model: Any, spec: PreprocessSpec) -> Any:
    """Make ``model`` (a float-input ONNX ModelProto, float or QDQ int8) take uint8 BGR NHWC; edits in place and
    returns it. ``spec`` is the network's own convention (colour order, mean and std on 0..255 pixels)."""
    import_onnx()  # MindSpore first, whenever onnx is used in a host process (model_file.py)
    from onnx import helper

    graph = model.graph
    value = _image_input(graph)
    name = value.name
    readers = [n for n in graph.node if name in n.input]
    # network channel k reads source (BGR) channel src[k]; src is its own inverse (a swap or the identity)
    src = [SOURCE_COLOR.index(c) for c in spec.color]
    mean = np.array([spec.mean[k] for k in src], np.float64)  # indexed by source channel j = src[k]
    std = np.array([spec.std[k] for k in src], np.float64)

    nchw = name + "/nchw"
    nodes = [helper.make_node("Cast", [name], [name + "/float"], name=name + "/cast", to=ONNX_FLOAT),
             helper.make_node("Transpose", [name + "/float"], [nchw], name=name + "/nchw", perm=NHWC_TO_NCHW)]
    how = _fold_qdq_input(graph, name, readers, src, mean, std, nodes) or \
        _fold_into_convs(graph, name, readers, nchw, src, mean, std, nodes)
    if how is None:
        how = _generic(graph, readers, nchw, src, mean, std, nodes)
        _rewire(readers, name, nodes[-1].output[0])
    for offset, node in enumerate(nodes):
        graph.node.insert(offset, node)
    _set_uint8_nhwc(value)
    log.info("input %s folded (uint8 BGR NHWC in): %s", name, how)
    return model


def fold_input_file(src_path: str, dst_path: str, spec: PreprocessSpec) -> None:
    """:func:`fold_input` from one file to another (the ``onnx`` package loads and checks it)."""
    onnx = import_onnx()
    model = fold_input(onnx.load(src_path), spec)
    onnx.checker.check_model(model)
    onnx.save(model, dst_path)


# --- the three ways -----------------------------------------------------------------------------------------

def _fold_qdq_input(graph: Any, name: str, readers: List[Any], src: List[int], mean: np.ndarray,
                    std: np.ndarray, nodes: List[Any]) -> Optional[str]:
    """The input read by exactly one QuantizeLinear of x/255 and the normalisation x/255: drop the Q."""
    if len(readers) != 1 or readers[0].op_type != "QuantizeLinear":
        return None
    quantize = readers[0]
    scale, zero = _constant(graph, quantize.input[1]), _constant(graph, _at(quantize.input, 2))
    unit = scale is not None and scale.size == 1 and abs(float(scale) * 255.0 - 1.0) < UNIT_SCALE_TOLERANCE
    if not (unit and zero is not None and zero.dtype == np.uint8 and not zero.any()
            and not mean.any() and np.all(std == 255.0)):
        return None
    dequantizers = [n for n in graph.node if quantize.output[0] in n.input]
    if not dequantizers or any(n.op_type != "DequantizeLinear" for n in dequantizers):
        return None
    nodes[:] = nodes[1:]  # no Cast: the uint8 pixels are the quantized values
    nodes[0].input[0] = name
    flipped = "no colour swap"
    if src != [0, 1, 2]:
        if _permute_after_quantize(graph, quantize, src):
            flipped = "BGR->RGB in the first convolutions' int8 weights"
        else:
            nodes.append(_gather(graph, nodes[-1].output[0], src))
            flipped = "BGR->RGB by a Gather"
    graph.node.remove(quantize)
    for dq in dequantizers:
        dq.input[0] = nodes[-1].output[0]
    return "uint8 pixels are the input QuantizeLinear's values (scale 1/255, zero point 0); " + flipped


def _fold_into_convs(graph: Any, name: str, readers: List[Any], nchw: str, src: List[int], mean: np.ndarray,
                     std: np.ndarray, nodes: List[Any]) -> Optional[str]:
    """Every reader a Conv with float initializer weights: colour order and 1/std into the weights."""
    if not readers or any(n.op_type != "Conv" or n.input[0] != name or _float_weight(graph, n) is None
                          for n in readers):
        return None
    if len({n.input[1] for n in readers}) != len(readers) or any(_readers_of(graph, n.input[1]) != 1
                                                                 for n in readers):
        return None
    from onnx import numpy_helper

    tensor = nchw
    mean_in_bias = mean.any() and all(_unpadded(n) for n in readers)
    if mean.any() and not mean_in_bias:
        tensor = _add_constant(graph, nodes, tensor, -mean, "mean")
    for conv in readers:
        weights = _initializer(graph, conv.input[1])
        w = numpy_helper.to_array(weights).astype(np.float64)
        w = w[:, src] / std[None, :, None, None]  # (O, 3, kh, kw): input channel j <- network channel src[j]
        weights.CopyFrom(numpy_helper.from_array(w.astype(np.float32), weights.name))
        if mean_in_bias:
            _fold_mean_into_bias(graph, conv, w, mean)
        conv.input[0] = tensor
    return "Cast, Transpose%s; BGR->RGB and 1/std in the first convolutions' weights%s" % (
        ", Add -mean" if tensor != nchw else "", "; the mean in their bias" if mean_in_bias else "")


def _generic(graph: Any, readers: List[Any], nchw: str, src: List[int], mean: np.ndarray, std: np.ndarray,
             nodes: List[Any]) -> str:
    """The colour order in the int8 weights behind an input QuantizeLinear, else by a Gather; then the host's
    own ``x * (1/std) + (-mean/std)`` in float32."""
    steps = ["Cast", "Transpose"]
    tensor = nchw
    if src != [0, 1, 2] and len(readers) == 1 and readers[0].op_type == "QuantizeLinear" and \
            _permute_after_quantize(graph, readers[0], src):
        steps.append("BGR->RGB in the first convolutions' int8 weights")
    elif src != [0, 1, 2]:
        nodes.append(_gather(graph, tensor, src))
        tensor = nodes[-1].output[0]
        steps.append("Gather BGR->RGB")
        mean, std = mean[src], std[src]  # the tensor is in the network's order now
    scale, shift = (1.0 / std).astype(np.float32), (-mean / std).astype(np.float32)
    if np.any(scale != 1.0):
        tensor = _binary_constant(graph, nodes, "Mul", tensor, scale, "scale")
        steps.append("Mul 1/std")
    if np.any(shift != 0.0):
        tensor = _binary_constant(graph, nodes, "Add", tensor, shift, "shift")
        steps.append("Add -mean/std")
    return ", ".join(steps)


# --- pieces -------------------------------------------------------------------------------------------------

def _image_input(graph: Any) -> Any:
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise InputFoldError("the model has %d inputs; folding needs one image input" % len(inputs))
    value = inputs[0]
    tensor_type = value.type.tensor_type
    shape = tensor_type.shape.dim
    if tensor_type.elem_type != ONNX_FLOAT or len(shape) != 4 or shape[1].dim_value != 3:
        raise InputFoldError("input %s is not a float (N, 3, H, W) tensor" % value.name)
    return value


def _set_uint8_nhwc(value: Any) -> None:
    tensor_type = value.type.tensor_type
    dims = [_copy_dim(d) for d in tensor_type.shape.dim]
    tensor_type.elem_type = ONNX_UINT8
    del tensor_type.shape.dim[:]
    for d in (dims[0], dims[2], dims[3], dims[1]):  # (N, 3, H, W) -> (N, H, W, 3)
        tensor_type.shape.dim.add().CopyFrom(d)


def _copy_dim(dim: Any) -> Any:
    from onnx import TensorShapeProto

    copy = TensorShapeProto.Dimension()
    copy.CopyFrom(dim)
    return copy


def _at(names: Sequence[str], index: int) -> str:
    return names[index] if len(names) > index else ""


def _initializer(graph: Any, name: str) -> Optional[Any]:
    return next((t for t in graph.initializer if t.name == name), None)


def _constant(graph: Any, name: str) -> Optional[np.ndarray]:
    from onnx import numpy_helper

    if not name:
        return None
    tensor = _initializer(graph, name)
    if tensor is not None:
        return numpy_helper.to_array(tensor)
    node = next((n for n in graph.node if n.op_type == "Constant" and name in n.output), None)
    if node is None:
        return None
    attribute = next((a for a in node.attribute if a.name == "value"), None)
    return numpy_helper.to_array(attribute.t) if attribute is not None else None


def _readers_of(graph: Any, name: str) -> int:
    return sum(list(n.input).count(name) for n in graph.node) + sum(o.name == name for o in graph.output)


def _dequantizer_of(graph: Any, name: str) -> Optional[Any]:
    """The DequantizeLinear node whose output is ``name``, or None."""
    return next((n for n in graph.node if n.op_type == "DequantizeLinear" and name in n.output), None)


def _axis(dequantize: Any) -> int:
    """A DequantizeLinear's ``axis`` (ONNX's default 1 when it has none)."""
    return next((a.i for a in dequantize.attribute if a.name == "axis"), 1)


def _float_weight(graph: Any, conv: Any) -> Optional[Any]:
    tensor = _initializer(graph, conv.input[1])
    if tensor is None or tensor.data_type != ONNX_FLOAT or len(tensor.dims) != 4 or tensor.dims[1] != 3:
        return None
    group = next((a.i for a in conv.attribute if a.name == "group"), 1)
    return tensor if group == 1 else None


def _unpadded(conv: Any) -> bool:
    attrs = {a.name: a for a in conv.attribute}
    pads = all(v == 0 for v in attrs["pads"].ints) if "pads" in attrs else True
    auto_pad = attrs["auto_pad"].s in (b"", b"NOTSET", b"VALID") if "auto_pad" in attrs else True
    return pads and auto_pad


def _fold_mean_into_bias(graph: Any, conv: Any, folded_w: np.ndarray, mean: np.ndarray) -> None:
    """b' = b - sum over (j, kh, kw) of w'[o, j] * mean[j]: exact when no padding reads a zero."""
    from onnx import numpy_helper

    shift = -(folded_w * mean[None, :, None, None]).sum(axis=(1, 2, 3))
    bias = _initializer(graph, _at(conv.input, 2))
    if bias is not None:
        shift = shift + numpy_helper.to_array(bias).astype(np.float64)
        bias.CopyFrom(numpy_helper.from_array(shift.astype(np.float32), bias.name))
        return
    name = (conv.name or conv.output[0]) + "/folded_bias"
    graph.initializer.append(numpy_helper.from_array(shift.astype(np.float32), name))
    if len(conv.input) == 2:
        conv.input.append(name)
    else:
        conv.input[2] = name


def _permute_conv_inputs(graph: Any, convs: List[Any], tensors: List[str], src: List[int]) -> bool:
    """Permute the input channels of each Conv's weights (float initializer, or DequantizeLinear of one with
    per-output-channel or per-tensor scales) reading one of ``tensors``; False (nothing changed) if any can't."""
    from onnx import numpy_helper

    weights = []
    for conv in convs:
        if conv.op_type != "Conv" or conv.input[0] not in tensors:
            return False
        tensor = _initializer(graph, conv.input[1])
        if tensor is None:
            dq = _dequantizer_of(graph, conv.input[1])
            axis = _axis(dq) if dq is not None else None
            scale = _constant(graph, dq.input[1]) if dq is not None else None
            if dq is None or scale is None or (scale.size > 1 and axis != 0):
                return False
            tensor = _initializer(graph, dq.input[0])
        if tensor is None or len(tensor.dims) != 4 or tensor.dims[1] != 3 or _readers_of(graph, tensor.name) != 1:
            return False
        weights.append(tensor)
    for tensor in weights:
        w = numpy_helper.to_array(tensor)
        tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w[:, src]), tensor.name))
    return bool(weights)


def _permute_after_quantize(graph: Any, quantize: Any, src: List[int]) -> bool:
    """Permute the weights of the Convs behind ``quantize``'s DequantizeLinear readers (False if any can't)."""
    dequantizers = [n for n in graph.node if quantize.output[0] in n.input]
    if not dequantizers or any(n.op_type != "DequantizeLinear" for n in dequantizers):
        return False
    tensors = [d.output[0] for d in dequantizers]
    convs = [n for n in graph.node if any(t in n.input for t in tensors)]
    return _permute_conv_inputs(graph, convs, tensors, src)


def _gather(graph: Any, tensor: str, src: List[int]) -> Any:
    from onnx import helper, numpy_helper

    indices = tensor + "/channel_order"
    graph.initializer.append(numpy_helper.from_array(np.array(src, np.int64), indices))
    return helper.make_node("Gather", [tensor, indices], [tensor + "/rgb"], name=tensor + "/rgb", axis=1)


def _binary_constant(graph: Any, nodes: List[Any], op: str, tensor: str, per_channel: np.ndarray,
                     what: str) -> str:
    from onnx import helper, numpy_helper

    constant = "%s/%s" % (tensor, what)
    graph.initializer.append(numpy_helper.from_array(per_channel.astype(np.float32).reshape(1, 3, 1, 1), constant))
    output = constant + "ed"
    nodes.append(helper.make_node(op, [tensor, constant], [output], name=output))
    return output


def _add_constant(graph: Any, nodes: List[Any], tensor: str, per_channel: np.ndarray, what: str) -> str:
    return _binary_constant(graph, nodes, "Add", tensor, per_channel, what)


def _rewire(readers: List[Any], old: str, new: str) -> None:
    for node in readers:
        node.input[:] = [new if n == old else n for n in node.input]

def drop_unread_initializers(graph: Any) -> None:
    """Remove the initializers no node reads and no graph output names (and their graph inputs, where an old
    IR lists them): what a rewrite replaced."""
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in read]
    dropped = {t.name for t in graph.initializer} - {t.name for t in keep}
    del graph.initializer[:]
    graph.initializer.extend(keep)
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)



def normalised_input(frames_bgr: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """The host-normalised float NCHW tensor of uint8 BGR NHWC frames (what the unfolded model takes), through
    the box's own preprocessing constants: a reference for checks and tests."""
    src = [SOURCE_COLOR.index(c) for c in spec.color]
    pixels = frames_bgr[..., src].astype(np.float32)  # (N, H, W, 3) in the network's colour order
    scale = (1.0 / np.array(spec.std, np.float64)).astype(np.float32)
    shift = (-np.array(spec.mean, np.float64) / np.array(spec.std, np.float64)).astype(np.float32)
    return np.ascontiguousarray((pixels * scale + shift).transpose(NHWC_TO_NCHW))
