"""MindSpore Lite backend: ``.ms`` (MINDIR_LITE) or converted ``.mindir`` files, on the CPU or the Ascend NPU.

Written to the MindSpore Lite 2.x Python API (``mindspore_lite.Context`` with ``target`` / ``cpu`` /
``ascend`` properties, ``Model.build_from_file``, ``get_inputs``, ``predict``). Run for real on the CPU with
MindSpore Lite 2.0.0 on Python 3.7 (the Lite lane, docs/backends.md); the Ascend target has not run (no NPU
here) and is tested against the stand-in (tests/fakes/fake_mslite.py). Releases before 2.0 configured devices
with ``AscendDeviceInfo`` + ``append_device_info``; they are refused with :class:`BackendUnavailable` rather
than half-supported.

The model is built once at load and its input tensors are fetched once; ``infer`` hands the batch to them
(``set_data_from_numpy`` is zero-copy in 2.0.0: the batch stays referenced until ``predict`` returns), runs
``predict`` and copies the outputs out (``get_data_to_numpy`` is a view the next ``predict`` overwrites).
"""

import logging
from typing import Any, List

import numpy as np

from agent.config.device_config import lite_precision_mode
from agent.pipeline.backends.base import Backend, BackendUnavailable

logger = logging.getLogger(__name__)

MODEL_TYPE_BY_FORMAT = {"ms": "MINDIR_LITE", "mindir": "MINDIR"}


def _dtype_name(lite_dtype: Any) -> str:
    """``DataType.FLOAT32`` -> ``float32``."""
    return str(getattr(lite_dtype, "name", lite_dtype)).split(".")[-1].lower()


class MindSporeLiteBackend(Backend):
    name = "mslite"
    runtime_module = "mindspore_lite"
    runtime_provider = ("the MindSpore Lite 2.x Python wheel or tarball for this Python and CPU "
                        "(Huawei's download server; PyPI only has 2.0.0 for CPython 3.7)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model: Any = None
        self._inputs: List[Any] = []
        self._input_nbytes = 0

    def _load(self) -> None:
        mslite = self._import_runtime()
        if not isinstance(getattr(getattr(mslite, "Context", None), "target", None), property):
            found = getattr(mslite, "__version__", "a pre-2.0 release")
            raise BackendUnavailable("backend mslite needs MindSpore Lite >= 2.0 (Context.target API); found "
                                     "%s (install %s)" % (found, self.runtime_provider))
        context = self._context(mslite)
        model_type = getattr(mslite.ModelType, MODEL_TYPE_BY_FORMAT[self.artifact_format])
        model = mslite.Model()
        try:
            model.build_from_file(self.artifact_path, model_type, context)
        except (RuntimeError, ValueError, TypeError) as err:
            hint = ""
            if self.options.target == "ascend":
                hint = (" (target ascend needs an Ascend NPU with its driver and the CANN runtime on this box: "
                        "`npu-smi info` lists it, CANN's set_env.sh puts it on the library path)")
            raise self._error("mindspore_lite build_from_file (%s, target %s) failed%s" % (
                model_type, self.options.target, hint), err) from err
        self._model = model
        self._inputs = self._bind_input(model)

    def _context(self, mslite: Any) -> Any:
        options = self.options
        context = mslite.Context()
        context.target = [options.target]  # ascend also appends cpu as the backup target
        context.cpu.thread_num = options.cpu_threads
        if options.target == "ascend":
            context.ascend.device_id = options.device_id
            if options.precision_mode:
                try:
                    context.ascend.precision_mode = lite_precision_mode(options.precision_mode)
                except ValueError as err:
                    raise self._error("options.precision_mode", err) from err
        return context

    def _bind_input(self, model: Any) -> List[Any]:
        """Fetch the input tensors once; resize only when the model's shape is not already the spec's."""
        spec = self.input_spec
        inputs = model.get_inputs()
        if len(inputs) != 1:
            raise self._error("input count", "expected 1 model input, got %d" % len(inputs))
        if tuple(inputs[0].shape) != spec.shape:
            logger.info("mslite: resizing input %r of %s from %s to %s", spec.name, self.artifact_path,
                        tuple(inputs[0].shape), spec.shape)
            try:
                model.resize(inputs, [list(spec.shape)])
            except (RuntimeError, ValueError, TypeError) as err:
                raise self._error("resize to %s failed" % (spec.shape,), err) from err
        got = _dtype_name(inputs[0].dtype)
        if got != spec.dtype:
            raise self._error("input dtype mismatch for %r" % spec.name,
                              "expected %s, got %s" % (spec.dtype, got))
        if inputs[0].data_size != spec.nbytes:
            raise self._error("input size mismatch for %r" % spec.name, "expected %d bytes, got %d" % (
                spec.nbytes, inputs[0].data_size))
        self._input_nbytes = inputs[0].data_size
        return inputs

    def _infer(self, batch: np.ndarray) -> List[np.ndarray]:
        if batch.nbytes != self._input_nbytes:
            raise self._error("input size mismatch for %r" % self.input_spec.name,
                              "expected %d bytes, got %d" % (self._input_nbytes, batch.nbytes))
        self._inputs[0].set_data_from_numpy(batch)
        outputs = self._model.predict(self._inputs)
        return [np.array(out.get_data_to_numpy(), copy=True) for out in outputs]

    def _release(self) -> None:
        # the Python API has no explicit free: dropping the last references releases the model
        self._inputs = []
        self._model = None
