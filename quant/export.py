"""Exports (MindIR, ONNX) at fixed shapes, and the read-back checks that make them trustworthy.

Each artifact is exported at one fixed input shape (batch, 3, h, w): the NPU runs fixed shapes only. After
writing, an artifact is read back by the runtime that will consume it (``mindspore.load`` + ``nn.GraphCell``
for MindIR, OpenCV's ``cv2.dnn`` for ONNX) and compared to the network it came from, so a bundle never holds a
file that does not reproduce its network. Deploy MindIRs (``FakeQuantParam`` nodes) cannot run on CPU; their
quantization parameters are read back from the protobuf instead (:func:`read_fake_quant_params`).
"""

import logging
import os
from typing import Dict, List, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn

from converters.bundle_writer import INPUT_NAME  # the input name every manifest records: exports use it
from converters.runtimes import run_on_host

log = logging.getLogger(__name__)

OUTPUT_NAME = "output0"
# Read-back tolerance of an export against its source network (float32, same ops, another runtime): box
# coordinates of a few hundred pixels carry float32 rounding of ~3e-5.
EXPORT_ATOL = 1e-4
EXPORT_RTOL = 1e-5


def export_mindir(network: nn.Cell, input_shape: Tuple[int, ...], path: str) -> str:
    """Write ``network`` at ``input_shape`` to ``path`` (must end in .mindir); returns the path."""
    if not path.endswith(".mindir"):
        raise ValueError("MindIR path must end in .mindir: %s" % path)
    network.set_train(False)
    dummy = ms.Tensor(np.zeros(input_shape, np.float32))
    ms.export(network, dummy, file_name=path[: -len(".mindir")], file_format="MINDIR")
    if not os.path.isfile(path):
        raise RuntimeError("mindspore.export did not write %s" % path)
    os.chmod(path, 0o644)  # MindSpore writes 0400; a bundle is copied, served and replaced by other users
    return path


def export_onnx(network: nn.Cell, input_shape: Tuple[int, ...], path: str) -> str:
    """Write ``network`` at ``input_shape`` as ONNX with input ``images`` and output ``output0``."""
    if not path.endswith(".onnx"):
        raise ValueError("ONNX path must end in .onnx: %s" % path)
    network.set_train(False)
    dummy = ms.Tensor(np.zeros(input_shape, np.float32))
    ms.onnx.export(network, dummy, file_name=path, input_names=[INPUT_NAME], output_names=[OUTPUT_NAME])
    if not os.path.isfile(path):
        raise RuntimeError("mindspore.onnx.export did not write %s" % path)
    return path


def check_export(path: str, inputs: np.ndarray, expected: np.ndarray, atol: float = EXPORT_ATOL) -> float:
    """Run an exported artifact on ``inputs``, compare with ``expected``; returns the max abs difference."""
    got = run_on_host(path, "onnx" if path.endswith(".onnx") else "mindir", inputs)
    if got.shape != expected.shape:
        raise RuntimeError("%s: output shape %s, network gives %s" % (path, got.shape, expected.shape))
    error = np.abs(got - expected)
    difference = float(np.max(error))
    if not np.all(error <= atol + EXPORT_RTOL * np.abs(expected)):
        raise RuntimeError(
            "%s: output differs from the network by up to %.3g (tolerance %.3g + %.1g x |value|)"
            % (path, difference, atol, EXPORT_RTOL)
        )
    log.info("checked %s: max |diff| %.2g", os.path.basename(path), difference)
    return difference


def read_fake_quant_params(path: str) -> List[Dict[str, object]]:
    """Every ``FakeQuantParam`` primitive in a MindIR file with its attributes (min, max, linear_quant_scale,
    linear_quant_zero_point as float lists; is_per_channel, symmetric, narrow_range as bools; num_bits)."""
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as handle:
        model.ParseFromString(handle.read())
    used = {node.op_type for node in model.graph.node}
    found = []
    for primitive in model.primitives:
        if primitive.op_type != "FakeQuantParam" or "REF::" + primitive.name not in used:
            continue
        attrs: Dict[str, object] = {"name": primitive.name}
        for attr in primitive.attribute:
            if attr.name in ("min", "max", "linear_quant_scale", "linear_quant_zero_point"):
                attrs[attr.name] = [float(v.floats[0]) if len(v.floats) else float(v.f) for v in attr.values]
            elif attr.name in ("is_per_channel", "symmetric", "narrow_range", "signed"):
                attrs[attr.name] = bool(attr.i)
            elif attr.name in ("num_bits", "channel_axis"):
                attrs[attr.name] = int(attr.i)
        found.append(attrs)
    return found


def mindir_operators(path: str) -> Dict[str, int]:
    """Operator type -> count in a MindIR's main graph (e.g. to check a deploy graph holds FakeQuantParam)."""
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as handle:
        model.ParseFromString(handle.read())
    counts: Dict[str, int] = {}
    for node in model.graph.node:
        op = node.op_type.split("::")[-1].split(":")[0]
        counts[op] = counts.get(op, 0) + 1
    return counts
