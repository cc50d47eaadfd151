"""onnxruntime backend: an ONNX file (float, or int8 QDQ) run by onnxruntime's CPU execution provider.

The CPU path that makes quantization pay (issue 28): on the demo detector the int8 QDQ model runs at
0.53-0.58x the float model's time (benchmarks/README.md), where cv2.dnn only simulates QDQ in float.
onnxruntime 1.14.1 is the newest wheel for CPython 3.7 (x86_64 and aarch64, the Atlas boxes' CPUs); inference
needs numpy only, so the box installs it with ``pip install --no-deps`` (docs/backends.md).

One ``InferenceSession`` per model, built once at load with the device config's session options
(:class:`agent.config.device_config.OnnxRuntimeSettings`): ``intra_op_num_threads = cpu_threads``, sequential
execution, full graph optimisation, no spinning. Unlike ``cv2.setNumThreads`` these are per session, so two
models on one box do not change each other's threads. ``run`` returns new arrays on every call (checked in
tests), which the caller owns.
"""

import logging
from typing import Any, List, Optional

import numpy as np

from agent.pipeline.backends.base import Backend

logger = logging.getLogger(__name__)

PROVIDERS = ["CPUExecutionProvider"]
# ONNX element type strings (NodeArg.type) -> numpy dtype names the TensorSpec uses
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(uint8)": "uint8"}
GRAPH_OPTIMIZATION = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
                      "all": "ORT_ENABLE_ALL"}
EXECUTION_MODE = {"sequential": "ORT_SEQUENTIAL", "parallel": "ORT_PARALLEL"}
LOG_ERRORS_ONLY = 3  # ORT's severity: 0 verbose .. 4 fatal; its warnings (unused initializers) are noise here


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    runtime_module = "onnxruntime"
    runtime_provider = ("the onnxruntime wheel (pip install --no-deps onnxruntime==1.14.1 on Python 3.7, "
                        "onnxruntime>=1.16 on 3.8+; or the project's extra: pip install 'atlas-edge[ort]')")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session: Any = None
        self._input_name = ""
        self.version: Optional[str] = None  # the runtime's version, once loaded (status, logs)

    def _load(self) -> None:
        ort = self._import_runtime()
        self.version = getattr(ort, "__version__", None)
        try:
            session = ort.InferenceSession(self.artifact_path, sess_options=self._session_options(ort),
                                           providers=PROVIDERS)
        except Exception as err:  # noqa: BLE001 - ORT raises its own pybind11 types (Fail, InvalidGraph, ...)
            raise self._error("onnxruntime could not load the model", err) from err
        self._session = session
        self._bind_input(session)
        self._infer(np.zeros(self.input_spec.shape, dtype=self.input_spec.dtype))  # warm-up: allocations, kernels
        logger.info("onnxruntime %s: %s on %d thread(s), %s, spinning %s", self.version, self.artifact_path,
                    self.options.cpu_threads, self.options.onnxruntime.execution_mode,
                    "on" if self.options.onnxruntime.allow_spinning else "off")

    def _session_options(self, ort: Any) -> Any:
        settings = self.options.onnxruntime
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.options.cpu_threads
        options.inter_op_num_threads = settings.inter_op_threads
        options.execution_mode = getattr(ort.ExecutionMode, EXECUTION_MODE[settings.execution_mode])
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                                   GRAPH_OPTIMIZATION[settings.graph_optimization])
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.allow_spinning else "0")
        options.log_severity_level = LOG_ERRORS_ONLY
        return options

    def _bind_input(self, session: Any) -> None:
        """The model's one input must take the spec's dtype and (where its dims are fixed) its shape."""
        spec = self.input_spec
        inputs = session.get_inputs()
        if len(inputs) != 1:
            raise self._error("input count", "expected 1 model input, got %d" % len(inputs))
        model_input = inputs[0]
        if model_input.name != spec.name:
            logger.info("onnxruntime: %s has no input named %r; feeding its input %r", self.artifact_path,
                        spec.name, model_input.name)
        got = ORT_TYPES.get(model_input.type, model_input.type)
        if got != spec.dtype:
            raise self._error("input dtype mismatch for %r" % model_input.name,
                              "expected %s, got %s" % (spec.dtype, got))
        dims = list(model_input.shape)
        fixed_ok = len(dims) == len(spec.shape) and all(
            not isinstance(d, int) or d == want for d, want in zip(dims, spec.shape))
        if not fixed_ok:
            raise self._error("input shape mismatch for %r" % model_input.name,
                              "expected %s, got %s" % (spec.shape, tuple(dims)))
        self._input_name = model_input.name

    def _infer(self, batch: np.ndarray) -> List[np.ndarray]:
        outputs = self._session.run(None, {self._input_name: batch})
        return [np.asarray(out) for out in outputs]

    def _release(self) -> None:
        # InferenceSession has no close(): dropping the last reference frees its arena
        self._session = None
