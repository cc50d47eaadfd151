"""OpenCV backend: an ONNX file run by ``cv2.dnn`` on the CPU (the portable fallback on any Linux box).

``cv2.setNumThreads`` is process-global: it sets the thread pool of every OpenCV call in the process,
the letterbox resize included, not only this network. The backend sets it at load when it differs from
``options.cpu_threads``, so the last backend loaded decides; keep ``cpu_threads`` equal across a box's config.

``cv2.dnn`` accepts any input shape without complaint, so the fixed-shape check in the base class is the only
guard against a wrong batch; a warm-up run at load catches an artifact whose shape disagrees with the spec.
"""

import logging
from typing import Any, List, Tuple

import numpy as np

from agent.pipeline.backends.base import Backend

logger = logging.getLogger(__name__)

FIRST_INPUT = ""  # cv2.dnn: an empty input name means the network's first input


class OpenCvBackend(Backend):
    name = "opencv"
    runtime_module = "cv2"
    runtime_provider = "opencv-python or opencv-python-headless (pip), with the dnn module"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._net: Any = None
        self._input_name = FIRST_INPUT
        self._output_names: Tuple[str, ...] = ()

    def _load(self) -> None:
        cv2 = self._import_runtime()
        if not hasattr(cv2, "dnn"):
            raise self._error("opencv has no dnn module", getattr(cv2, "__version__", "?"))
        threads = self.options.cpu_threads
        if cv2.getNumThreads() != threads:
            logger.info("opencv: setting the process-wide thread count to %d (was %d)",
                        threads, cv2.getNumThreads())
            cv2.setNumThreads(threads)
        try:
            net = cv2.dnn.readNetFromONNX(self.artifact_path)
        except cv2.error as err:
            raise self._error("cv2.dnn.readNetFromONNX failed", err) from err
        net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
        # layer 0 is the network's input layer; its outputs are the ONNX graph inputs
        if net.getLayer(0).outputNameToIndex(self.input_spec.name) >= 0:
            self._input_name = self.input_spec.name
        else:
            logger.info("opencv: %s has no input named %r; feeding its first input", self.artifact_path,
                        self.input_spec.name)
        self._output_names = tuple(net.getUnconnectedOutLayersNames())
        self._net = net
        try:
            self._infer(np.zeros(self.input_spec.shape, dtype=self.input_spec.dtype))
        except cv2.error as err:
            raise self._error("warm-up with input %s %s failed" % (
                self.input_spec.shape, self.input_spec.dtype), err) from err

    def _infer(self, batch: np.ndarray) -> List[np.ndarray]:
        self._net.setInput(batch, self._input_name)
        outputs = self._net.forward(self._output_names)
        # forward() hands back new arrays on each call (checked in tests): no extra copy needed
        return [np.asarray(out) for out in outputs]

    def _release(self) -> None:
        self._net = None
