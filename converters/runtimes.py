"""Output 0 of an artifact on this host, through the runtime that consumes it on a box without an NPU.

``cv2.dnn`` for ONNX (the box's CPU fallback backend), ``mindspore.load`` + ``nn.GraphCell`` for MindIR. Every
bundle producer reads its artifacts back through these: ``qat``'s export checks (:mod:`quant.export`), the
golden set (:mod:`converters.bundle_writer`) and ``bundle create`` (:mod:`converters.byom.create`), through
:func:`run_on_host`, which picks the runtime by format. MindSpore is imported inside the function that runs a
MindIR, so importing this module never needs it.
"""

from typing import Callable, Dict

import numpy as np


def run_mindir(path: str, inputs: np.ndarray) -> np.ndarray:
    """Output 0 of a MindIR file on ``inputs`` through ``mindspore.load`` + ``nn.GraphCell``."""
    import mindspore as ms
    from mindspore import nn

    graph = nn.GraphCell(ms.load(path))
    result = graph(ms.Tensor(inputs))
    if isinstance(result, (tuple, list)):
        result = result[0]
    return result.asnumpy()


def run_onnx_opencv(path: str, inputs: np.ndarray) -> np.ndarray:
    """Output 0 of an ONNX file on ``inputs`` through OpenCV's DNN module (the box's CPU fallback backend)."""
    import cv2

    net = cv2.dnn.readNetFromONNX(path)
    net.setInput(inputs)
    return net.forward()


def run_onnxruntime(path: str, inputs: np.ndarray) -> np.ndarray:
    """Output 0 of an ONNX file on ``inputs`` through onnxruntime's CPU provider (the box's int8 backend)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: inputs})[0]


RUNTIME_NAMES = {"onnx": "cv2.dnn", "mindir": "mindspore"}


def run_on_host(path: str, fmt: str, inputs: np.ndarray, precision: str = "float32") -> np.ndarray:
    """Output 0 of an artifact of format ``fmt`` ("onnx" or "mindir") on ``inputs``, by the runtime for it.
    An int8 ONNX runs on onnxruntime: cv2.dnn only simulates its QDQ nodes in float."""
    if fmt == "onnx" and precision == "int8":
        return run_onnxruntime(path, inputs)
    runners: Dict[str, Callable[[str, np.ndarray], np.ndarray]] = {"onnx": run_onnx_opencv, "mindir": run_mindir}
    if fmt not in runners:
        raise ValueError("no host runtime for %s artifacts (%s): only onnx and mindir run here" % (fmt, path))
    return runners[fmt](path, inputs)
