"""pyACL backend: an ATC-built ``.om`` model on the Ascend NPU.

Written to the pyACL API as documented (CANN's pyACL API reference; Ascend/samples
``python/common/acllite/acllite_model.py``);
NOT run here: pyACL ships with the CANN toolkit on Ascend hosts only, so it is tested against a stand-in
(tests/fakes/fake_acl.py). Every call that returns an error code is checked; a non-zero code becomes a
:class:`BackendError` with the code and its meaning.

Lifecycle. ``acl.init`` is process-wide and done once (100002 "repeat initialize" is harmless);
``acl.finalize`` belongs at process exit (the docs say so, and it waits up to 2 s to flush device logs), so
it is :func:`shutdown_acl`, registered with ``atexit``, never part of a model swap. Per model, ``load``
does set_device → create_context → load_from_file → create_desc/get_desc → one device buffer per input and
output (``acl.rt.malloc``, ONCE) → the two datasets; each step pushes its undo on a stack, and ``close`` (or a
load that fails halfway) pops the stack, so teardown runs in exact reverse order over whatever was created.

Per batch: one host→device copy of the batch, ``acl.mdl.execute``, one device→host copy per output into host
buffers allocated at load, then a copy the caller may keep. Copies use kinds 1 (H2D) and 2 (D2H) when the
process runs on the host (a PCIe card such as the Atlas 300I Pro); when ``acl.rt.get_run_mode`` says the
process runs on the device's own CPU (Atlas 200 DK), both are device-to-device (3), as the CANN samples do.

Outputs: shape from ``get_output_dims``, dtype from ``get_output_data_type`` (float32 when an old pyACL
lacks that call: ATC's default ``--output_type`` is FP32). A static-AIPP model takes uint8 NHWC pixels:
its input size is batch*h*w*3 bytes, and the input spec must say ``uint8`` with that shape.
"""

import atexit
import itertools
import logging
import threading
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from agent.pipeline.backends.base import Backend, BackendError

logger = logging.getLogger(__name__)

ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_MEM_MALLOC_HUGE_FIRST = 0  # huge pages when available, else normal pages (the samples' policy)
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3
ACL_RUN_MODE_DEVICE = 0  # acl.rt.get_run_mode(): the process runs on the device's control CPU
ACL_RUN_MODE_HOST = 1

ACL_ERRORS: Dict[int, str] = {
    100000: "invalid parameter (ACL_ERROR_INVALID_PARAM)",
    100002: "repeat initialize (ACL_ERROR_REPEAT_INITIALIZE), harmless",
    100011: "invalid model id (ACL_ERROR_INVALID_MODEL_ID)",
    200000: "bad alloc: host memory allocation failed (ACL_ERROR_BAD_ALLOC)",
    207001: "device memory allocation failed (ACL_ERROR_RT_MEMORY_ALLOCATION)",
    207004: "no device (ACL_ERROR_RT_NO_DEVICE): check npu-smi info and the device id",
    507011: "model execute failed (ACL_ERROR_RT_MODEL_EXECUTE)",
    507014: "AI Core timeout (ACL_ERROR_RT_AICORE_TIMEOUT)",
}

# aclDataType -> numpy dtype (acl_base.h)
ACL_DTYPES: Dict[int, str] = {
    0: "float32", 1: "float16", 2: "int8", 3: "int32", 4: "uint8", 6: "int16", 7: "uint16",
    8: "uint32", 9: "int64", 10: "uint64", 11: "float64", 12: "bool",
}
DEFAULT_OUTPUT_DTYPE = "float32"  # ATC's default --output_type, used when pyACL cannot tell


def acl_error_text(code: int) -> str:
    return "error %d: %s" % (code, ACL_ERRORS.get(code, "see the CANN error code reference"))


class _AclProcess:
    """``acl.init`` once per process (per runtime module, so a stand-in in tests gets its own).

    CANN documents ``acl.init`` as once per process and a second one after ``acl.finalize`` as unsupported, so
    a module that was finalized here is refused, not initialised again; only process exit finalizes.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: Any = None
        self.finalized: List[Any] = []  # modules finalized in this process (identity, not equality)
        self.open_models = 0
        self.atexit_registered = False

    def acquire(self, acl: Any) -> None:
        with self.lock:
            if any(done is acl for done in self.finalized):
                raise BackendError("pyACL was finalized in this process (acl.finalize); CANN supports one "
                                   "acl.init per process: restart the process to use the NPU again")
            if self.module is not acl:
                ret = acl.init()
                if ret not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
                    raise BackendError("acl.init failed: %s" % acl_error_text(ret))
                self.module = acl
                self.open_models = 0
                if not self.atexit_registered:
                    atexit.register(shutdown_acl)
                    self.atexit_registered = True
            self.open_models += 1

    def release(self, acl: Any) -> None:
        with self.lock:
            if self.module is acl and self.open_models > 0:
                self.open_models -= 1


_process = _AclProcess()
_thread_binding = threading.local()  # which backend's context is current on this thread
_tokens = itertools.count(1)


def shutdown_acl() -> None:
    """``acl.finalize()`` for this process, at exit only (atexit calls it): pyACL cannot start again after it.
    Closing a model never calls it, so nothing else on the NPU (an mslite fallback) loses its device."""
    with _process.lock:
        acl, _process.module = _process.module, None
        if acl is None:
            return
        if _process.open_models:
            logger.warning("acl: finalizing with %d model(s) still loaded", _process.open_models)
        _process.open_models = 0
        _process.finalized.append(acl)
        ret = acl.finalize()
        if ret != ACL_SUCCESS:
            logger.warning("acl.finalize: %s", acl_error_text(ret))


class _HostOutput:
    """A host buffer that outputs are copied into; ``keep`` holds the memory ``ptr`` points at."""

    def __init__(self, keep: Any, ptr: int, view: np.ndarray) -> None:
        self.keep = keep
        self.ptr = ptr
        self.view = view


class AclBackend(Backend):
    name = "acl"
    runtime_module = "acl"
    runtime_provider = ("pyACL from the Ascend CANN toolkit (source <ascend-toolkit>/set_env.sh so that "
                        "acl is on PYTHONPATH)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acl: Any = None
        self._undo: List[Tuple[str, Callable[[], Any]]] = []
        self._token = 0
        self._context: Any = None
        self._model_id: Any = None
        self._input_ptr = 0
        self._input_size = 0
        self._input_dataset: Any = None
        self._output_dataset: Any = None
        self._outputs: List[Tuple[int, int, _HostOutput]] = []  # (device ptr, size, host buffer)
        self._h2d = ACL_MEMCPY_HOST_TO_DEVICE
        self._d2h = ACL_MEMCPY_DEVICE_TO_HOST
        self._bytes_to_ptr = True

    # -- load ---------------------------------------------------------------------------------------------
    def _load(self) -> None:
        acl = self._import_runtime()
        self._acl = acl
        if self.options.precision_mode:
            logger.debug("acl: precision_mode is fixed when ATC builds the .om; ignoring %s",
                         self.options.precision_mode)
        self._bytes_to_ptr = hasattr(acl.util, "bytes_to_ptr")  # older CANN: numpy_to_ptr only
        _process.acquire(acl)
        self._undo.append(("release acl", lambda: _process.release(acl)))
        device = self.options.device_id
        self._check(acl.rt.set_device(device), "acl.rt.set_device(%d)" % device)
        self._undo.append(("acl.rt.reset_device", lambda: acl.rt.reset_device(device)))
        context = self._value(acl.rt.create_context(device), "acl.rt.create_context(%d)" % device)
        self._context = context
        self._undo.append(("acl.rt.destroy_context", lambda: acl.rt.destroy_context(context)))
        self._token = next(_tokens)
        _thread_binding.token = self._token  # create_context made it current on this thread
        self._choose_copy_kinds(acl)
        model_id = self._value(acl.mdl.load_from_file(self.artifact_path), "acl.mdl.load_from_file")
        self._model_id = model_id
        self._undo.append(("acl.mdl.unload", lambda: acl.mdl.unload(model_id)))
        desc = acl.mdl.create_desc()
        if not desc:
            raise self._error("acl.mdl.create_desc", "returned no description")
        self._undo.append(("acl.mdl.destroy_desc", lambda: acl.mdl.destroy_desc(desc)))
        self._check(acl.mdl.get_desc(desc, model_id), "acl.mdl.get_desc")
        self._bind_input(acl, desc)
        self._bind_outputs(acl, desc)

    def _choose_copy_kinds(self, acl: Any) -> None:
        if not hasattr(acl.rt, "get_run_mode"):
            return
        mode = self._value(acl.rt.get_run_mode(), "acl.rt.get_run_mode")
        if mode == ACL_RUN_MODE_DEVICE:
            self._h2d = self._d2h = ACL_MEMCPY_DEVICE_TO_DEVICE

    def _bind_input(self, acl: Any, desc: Any) -> None:
        count = acl.mdl.get_num_inputs(desc)
        if count != 1:
            raise self._error("input count", "expected 1 model input, got %d" % count)
        size = acl.mdl.get_input_size_by_index(desc, 0)
        spec = self.input_spec
        if size != spec.nbytes:
            raise self._error("input size mismatch for %r" % spec.name, (
                "expected %d bytes (%s %s), got %d from the model (a static-AIPP model takes uint8 "
                "batch*h*w*3)" % (spec.nbytes, spec.shape, spec.dtype, size)))
        self._input_size = size
        self._input_ptr = self._device_buffer(acl, size, "input 0")
        self._input_dataset = self._dataset(acl, [(self._input_ptr, size)], "input")

    def _bind_outputs(self, acl: Any, desc: Any) -> None:
        buffers = []
        for index in range(acl.mdl.get_num_outputs(desc)):
            size = acl.mdl.get_output_size_by_index(desc, index)
            dims = self._value(acl.mdl.get_output_dims(desc, index), "acl.mdl.get_output_dims(%d)" % index)
            shape = tuple(int(d) for d in dims["dims"])
            dtype = DEFAULT_OUTPUT_DTYPE
            if hasattr(acl.mdl, "get_output_data_type"):
                code = acl.mdl.get_output_data_type(desc, index)
                if code not in ACL_DTYPES:
                    raise self._error("output %d" % index, "unsupported aclDataType %s" % code)
                dtype = ACL_DTYPES[code]
            expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if expected != size:
                raise self._error("output %d size mismatch" % index, "dims %s of %s need %d bytes, got %d" % (
                    shape, dtype, expected, size))
            device_ptr = self._device_buffer(acl, size, "output %d" % index)
            buffers.append((device_ptr, size))
            self._outputs.append((device_ptr, size, self._host_buffer(acl, shape, dtype)))
        self._output_dataset = self._dataset(acl, buffers, "output")

    def _device_buffer(self, acl: Any, size: int, what: str) -> int:
        ptr = self._value(acl.rt.malloc(size, ACL_MEM_MALLOC_HUGE_FIRST),
                          "acl.rt.malloc(%d) for %s" % (size, what))
        self._undo.append(("acl.rt.free", lambda: acl.rt.free(ptr)))
        return ptr

    def _dataset(self, acl: Any, buffers: List[Tuple[int, int]], what: str) -> Any:
        dataset = acl.mdl.create_dataset()
        if not dataset:
            raise self._error("acl.mdl.create_dataset for %s" % what, "returned no dataset")
        self._undo.append(("acl.mdl.destroy_dataset", lambda: acl.mdl.destroy_dataset(dataset)))
        for ptr, size in buffers:
            data_buffer = acl.create_data_buffer(ptr, size)
            if not data_buffer:
                raise self._error("acl.create_data_buffer for %s" % what, "returned no buffer")
            self._undo.append(("acl.destroy_data_buffer", lambda b=data_buffer: acl.destroy_data_buffer(b)))
            self._value(acl.mdl.add_dataset_buffer(dataset, data_buffer),
                        "acl.mdl.add_dataset_buffer (%s)" % what)
        return dataset

    def _host_buffer(self, acl: Any, shape: Tuple[int, ...], dtype: str) -> _HostOutput:
        if self._bytes_to_ptr:
            # pyACL writes through the pointer into this bytes object; the view reads it without a copy
            keep: Any = bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize)
            view = np.frombuffer(keep, dtype=dtype).reshape(shape)
            return _HostOutput(keep, acl.util.bytes_to_ptr(keep), view)
        array = np.zeros(shape, dtype=dtype)
        return _HostOutput(array, acl.util.numpy_to_ptr(array), array)

    # -- infer --------------------------------------------------------------------------------------------
    def _infer(self, batch: np.ndarray) -> List[np.ndarray]:
        acl = self._acl
        self._bind_context(acl)
        if batch.nbytes != self._input_size:
            raise self._error("input size mismatch for %r" % self.input_spec.name,
                              "expected %d bytes, got %d" % (self._input_size, batch.nbytes))
        host: Any = batch.tobytes() if self._bytes_to_ptr else batch  # referenced until the copy is done
        ptr = acl.util.bytes_to_ptr(host) if self._bytes_to_ptr else acl.util.numpy_to_ptr(host)
        self._check(acl.rt.memcpy(self._input_ptr, self._input_size, ptr, batch.nbytes, self._h2d),
                    "acl.rt.memcpy input (kind %d)" % self._h2d)
        del host
        self._check(acl.mdl.execute(self._model_id, self._input_dataset, self._output_dataset),
                    "acl.mdl.execute")
        results = []
        for index, (device_ptr, size, out) in enumerate(self._outputs):
            self._check(acl.rt.memcpy(out.ptr, size, device_ptr, size, self._d2h),
                        "acl.rt.memcpy output %d (kind %d)" % (index, self._d2h))
            results.append(out.view.copy())
        return results

    def _bind_context(self, acl: Any) -> None:
        """ACL contexts are per thread: bind ours when this thread last used another (or none)."""
        if getattr(_thread_binding, "token", None) != self._token:
            self._check(acl.rt.set_context(self._context), "acl.rt.set_context")
            _thread_binding.token = self._token

    # -- release ------------------------------------------------------------------------------------------
    def _release(self) -> None:
        acl = self._acl
        if self._context is not None and acl is not None:
            try:
                self._bind_context(acl)
            except BackendError as err:
                logger.warning("acl: %s", err)
        while self._undo:
            what, undo = self._undo.pop()
            try:
                ret = undo()
            except Exception:  # noqa: BLE001 - one failed step must not leak everything after it
                logger.exception("acl: %s for %s raised", what, self.artifact_path)
                continue
            if isinstance(ret, int) and ret != ACL_SUCCESS:
                logger.warning("acl: %s for %s: %s", what, self.artifact_path, acl_error_text(ret))
        if getattr(_thread_binding, "token", None) == self._token:
            _thread_binding.token = None
        self._outputs = []
        self._context = self._model_id = self._input_dataset = self._output_dataset = None
        self._input_ptr = self._input_size = 0

    # -- error codes --------------------------------------------------------------------------------------
    def _check(self, ret: Any, call: str) -> None:
        if ret != ACL_SUCCESS:
            raise self._error("%s failed" % call, acl_error_text(ret))

    def _value(self, result: Any, call: str) -> Any:
        """pyACL returns ``(value, ret)`` for calls that produce something."""
        value, ret = result
        self._check(ret, call)
        return value

