"""The ONNX graph edits ``bundle create`` makes so the box's runtimes can run an outside export: fixed shapes per
tier, a final softmax dropped, default pool dilations dropped, a DFL's arange Conv as a MatMul, and shape
subgraphs folded into constants."""

import logging
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from converters.byom.model_file import CreateError, ModelInfo, Tier, dims, import_onnx

log = logging.getLogger(__name__)


def fixed_onnx(info: ModelInfo, tier: Tier, path: str) -> None:
    """Write the model with its input fixed at (1, 3, h, w): the input's dims are set and shapes re-inferred.

    A fixed-shape model already at ``tier`` keeps its graph apart from what the converters refuse: every model
    loses the default-valued attributes (:func:`drop_default_pool_dilations`) and gets a YOLOv8 DFL's expectation
    as a MatMul (:func:`dfl_conv_as_matmul`), and a classifier loses its final softmax (:func:`drop_final_softmax`).
    """
    onnx = import_onnx()
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
    if len(producers) != 1 or producers[0].op_type != "Softmax" or len(dims(output)) != 2:
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
    one (outputs equal to the Conv's within float rounding, tests/unit/converters/test_byom.py). Adjacent
    Transposes are merged.
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
    import_onnx()
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    opsets = list(model.opset_import)  # each op is evaluated at the model's own opset version
    static = {}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        shape = dims(value)
        if shape and all(d is not None for d in shape):
            static[value.name] = shape
    known = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    kept = []
    for node in graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.input[0] in static:
            attrs = {a.name: a.i for a in node.attribute}
            shape = static[node.input[0]][attrs.get("start", 0):attrs.get("end", None)]
            known[node.output[0]] = np.array(shape, np.int64)
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


def _single_node_model(node: Any, known: Dict[str, np.ndarray], opsets: List[Any]) -> Any:
    from onnx import helper

    def value(name: str, array: Optional[np.ndarray] = None) -> Any:
        if array is None:
            return helper.make_empty_tensor_value_info(name)
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), array.shape)

    graph = helper.make_graph([node], "fold", [value(n, known[n]) for n in node.input if n],
                              [value(n) for n in node.output if n])
    return helper.make_model(graph, opset_imports=opsets)
