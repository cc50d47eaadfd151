"""The inference backend contract: one small interface that every runtime sits behind.

A backend is cheap to build (no runtime import, nothing loaded), does its heavy work exactly once in
:meth:`Backend.load` (runtime context, model, device buffers), serves :meth:`Backend.infer` on batches of the
model's one fixed input shape, and gives everything back in :meth:`Backend.close`. Subclasses implement
``_load``/``_infer``/``_release``; this class owns the checks every backend must make the same way
(artifact file and format, batch shape and dtype, lifecycle state), so a bad batch gets the same error from
every runtime.

Runtimes are imported inside ``load()`` only: importing a backend module never fails on a box that lacks its
runtime, and a missing runtime surfaces as :class:`BackendUnavailable` naming the module and what provides it.
"""

import abc
import importlib
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar, List, Optional, Tuple

import numpy as np

from agent.config.device_config import BACKEND_FORMATS, OnnxRuntimeSettings

logger = logging.getLogger(__name__)

TARGETS = ("cpu", "ascend")
# artifact file suffix -> bundle artifact format (docs/bundle.md)
FORMAT_BY_SUFFIX = {".mindir": "mindir", ".ms": "ms", ".om": "om", ".onnx": "onnx"}
# input dtypes a bundle may declare (docs/bundle.md: float32 networks, uint8 for AIPP models), plus float16
INPUT_DTYPES = ("float32", "float16", "uint8")


class BackendUnavailable(RuntimeError):
    """The backend's runtime is not installed here; the message names the module and what provides it."""


class BackendError(RuntimeError):
    """Loading or running the model failed; the message names the artifact file."""


@dataclass(frozen=True)
class BackendOptions:
    """How a backend uses the box; built from the device config by :meth:`for_device`."""

    device_id: int = 0  # NPU index (acl, mslite on ascend)
    cpu_threads: int = 2  # inference threads on CPU runtimes
    precision_mode: Optional[str] = None  # ATC or MindSpore Lite name; read at run time by mslite on ascend
    target: str = "cpu"  # where the artifact runs: the bundle artifact's `target` (mslite reads it)
    onnxruntime: OnnxRuntimeSettings = field(default_factory=OnnxRuntimeSettings)  # session options (onnxruntime)

    def __post_init__(self) -> None:
        if not isinstance(self.device_id, int) or self.device_id < 0:
            raise ValueError("BackendOptions.device_id must be an int >= 0 (got %r)" % (self.device_id,))
        if not isinstance(self.cpu_threads, int) or self.cpu_threads < 1:
            raise ValueError("BackendOptions.cpu_threads must be an int >= 1 (got %r)" % (self.cpu_threads,))
        if self.target not in TARGETS:
            raise ValueError("BackendOptions.target must be one of %s (got %r)" % (
                list(TARGETS), self.target))

    @classmethod
    def for_device(cls, device: Any, target: Optional[str] = None) -> "BackendOptions":
        """Options from a :class:`agent.config.device_config.DeviceConfig` (``target`` defaults to the box's)."""
        return cls(
            device_id=device.device_id,
            cpu_threads=device.cpu_threads,
            precision_mode=device.precision_mode,
            target=target or device.target,
            onnxruntime=device.onnxruntime,
        )


@dataclass(frozen=True)
class TensorSpec:
    """The model's one input, fixed: ``TensorSpec("images", (1, 3, 256, 256), "float32")``."""

    name: str
    shape: Tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not shape or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0
                                for d in shape):
            raise ValueError("TensorSpec.shape must be fixed positive ints (got %r)" % (self.shape,))
        if self.dtype not in INPUT_DTYPES:
            raise ValueError("TensorSpec.dtype must be one of %s (got %r)" % (list(INPUT_DTYPES), self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def artifact_format(path: str) -> str:
    """``model.onnx`` -> ``onnx``; an unknown suffix is a :class:`BackendError` naming the file."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMAT_BY_SUFFIX:
        raise BackendError("%s: unknown artifact suffix %r (known: %s)" % (
            path, suffix, ", ".join(sorted(FORMAT_BY_SUFFIX))))
    return FORMAT_BY_SUFFIX[suffix]


def module_status(module: str, provider: str) -> str:
    """``"ok"`` when ``module`` can be imported, else why not; never imports it (find_spec only)."""
    if sys.modules.get(module) is not None:
        return "ok"
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return "ok" if found else "module %r not found (provided by %s)" % (module, provider)


class Backend(abc.ABC):
    """One model on one runtime. Not shared between processes; one lock serialises infer against close."""

    name: ClassVar[str]  # a key of BACKEND_FORMATS, the one declaration of backends and the formats they read
    formats: ClassVar[Tuple[str, ...]]  # set from BACKEND_FORMATS[name] when the subclass is defined
    runtime_module: ClassVar[str]  # imported lazily in load()
    runtime_provider: ClassVar[str]  # the package that provides it, for error messages

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a concrete backend: its formats are the table's, never a second list
            if cls.name not in BACKEND_FORMATS:
                raise TypeError("backend %s: name %r is not in BACKEND_FORMATS (%s)" % (
                    cls.__name__, cls.name, ", ".join(BACKEND_FORMATS)))
            cls.formats = BACKEND_FORMATS[cls.name]

    def __init__(self, artifact_path: str, input_spec: TensorSpec, options: Optional[BackendOptions] = None
                 ) -> None:
        fmt = artifact_format(artifact_path)
        if fmt not in self.formats:
            raise BackendError("%s: backend %s reads %s artifacts, not %s" % (
                artifact_path, self.name, "/".join(self.formats), fmt))
        self.artifact_path = artifact_path
        self.artifact_format = fmt
        self.input_spec = input_spec
        self.options = options or BackendOptions()
        self._lock = threading.Lock()
        self._loaded = False
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("loaded" if self._loaded else "new")
        return "<%s %s %s %s>" % (type(self).__name__, self.artifact_path, self.input_spec.shape, state)

    @property
    def loaded(self) -> bool:
        return self._loaded and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    @classmethod
    def runtime_status(cls) -> str:
        """``"ok"`` or why this backend's runtime is missing, without importing it."""
        return module_status(cls.runtime_module, cls.runtime_provider)

    def load(self) -> None:
        """Do the heavy work once. A failure releases whatever was created before it, then raises."""
        with self._lock:
            if self._closed:
                raise BackendError("%s: backend %s is closed; create a new one" % (
                    self.artifact_path, self.name))
            if self._loaded:
                return
            if not os.path.isfile(self.artifact_path):
                raise BackendError("%s: artifact file not found" % self.artifact_path)
            try:
                self._load()
            except BaseException as err:
                self._release_quietly()
                if isinstance(err, (BackendError, BackendUnavailable)) or not isinstance(err, Exception):
                    raise
                raise BackendError("%s: %s load failed: %s" % (self.artifact_path, self.name, err)) from err
            self._loaded = True
            logger.info("backend %s loaded %s input %s %s", self.name, self.artifact_path,
                        self.input_spec.shape, self.input_spec.dtype)

    def infer(self, batch: np.ndarray) -> List[np.ndarray]:
        """Run one batch of exactly ``input_spec.shape``; return the raw outputs as arrays the caller owns."""
        with self._lock:
            if self._closed:
                raise BackendError("%s: backend %s is closed" % (self.artifact_path, self.name))
            if not self._loaded:
                raise BackendError("%s: backend %s is not loaded; call load() first" % (
                    self.artifact_path, self.name))
            batch = self._checked_batch(batch)
            try:
                outputs = self._infer(batch)
            except BackendError:
                raise
            except Exception as err:
                raise BackendError("%s: %s inference failed: %s" % (
                    self.artifact_path, self.name, err)) from err
            return outputs

    def close(self) -> None:
        """Free the runtime's memory for this model. Idempotent; ``infer`` raises afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._loaded = False
            self._release_quietly()
            logger.info("backend %s closed %s", self.name, self.artifact_path)

    def __enter__(self) -> "Backend":
        self.load()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _checked_batch(self, batch: Any) -> np.ndarray:
        spec = self.input_spec
        if not isinstance(batch, np.ndarray):
            raise BackendError("%s: batch must be a numpy array, got %s" % (
                self.artifact_path, type(batch).__name__))
        if batch.shape != spec.shape:
            raise BackendError("%s: batch shape mismatch for input %r: expected %s, got %s" % (
                self.artifact_path, spec.name, spec.shape, batch.shape))
        if batch.dtype != np.dtype(spec.dtype):
            raise BackendError("%s: batch dtype mismatch for input %r: expected %s, got %s" % (
                self.artifact_path, spec.name, spec.dtype, batch.dtype))
        return np.ascontiguousarray(batch)

    def _release_quietly(self) -> None:
        """Release tolerating partial state; a failure to free is logged, never raised over the real error."""
        try:
            self._release()
        except Exception:  # noqa: BLE001 - teardown must finish; the cause is logged with its traceback
            logger.exception("backend %s: releasing %s failed", self.name, self.artifact_path)

    def _import_runtime(self, module: Optional[str] = None) -> ModuleType:
        """Import the runtime now (never at module import), or say exactly what is missing."""
        module = module or self.runtime_module
        try:
            return importlib.import_module(module)
        except ImportError as err:
            raise BackendUnavailable("backend %s needs Python module %r, provided by %s: %s" % (
                self.name, module, self.runtime_provider, err)) from err

    def _error(self, what: str, detail: Any) -> BackendError:
        return BackendError("%s: %s: %s" % (self.artifact_path, what, detail))

    @abc.abstractmethod
    def _load(self) -> None:
        """Create the runtime state; called once, under the lock."""

    @abc.abstractmethod
    def _infer(self, batch: np.ndarray) -> List[np.ndarray]:
        """Run a checked, C-contiguous batch; return copies the caller may keep."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Free whatever ``_load`` created, in reverse order; must tolerate a partial load."""
