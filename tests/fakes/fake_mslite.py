"""FakeMindSporeLite: a stand-in for the ``mindspore_lite`` 2.x Python package. It is NOT MindSpore Lite.

Implements the slice of the API in mindspore-lite/python/api (context.py, model.py, tensor.py) that
agent/pipeline/backends/mslite_backend.py uses, with the same argument checks and error types as the real package
(TypeError for wrong argument types, RuntimeError for failed builds and for ``set_data_from_numpy`` dtype or
size mismatches), and records every call in ``calls``. Like 2.0.0 (measured), ``set_data_from_numpy`` is
zero-copy (predict reads the caller's array, which must still exist) and ``get_data_to_numpy`` returns a view
that the next ``predict`` overwrites. Its model files are JSON toy networks written by
:func:`tests.fakes.write_toy_model` (kind ``mslite-toy``). Install it with
``monkeypatch.setitem(sys.modules, "mindspore_lite", FakeMindSporeLite())``.
"""

import enum
import json
import os
import types
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from tests.fakes import toy_outputs

TARGETS = ("cpu", "gpu", "ascend")
ASCEND_PRECISION_MODES = (
    "enforce_fp32", "preferred_fp32", "enforce_fp16", "enforce_origin", "preferred_optimal")


class FakeDataType(enum.Enum):
    """Same members and values as mindspore_lite.DataType."""

    UNKNOWN = 0
    BOOL = 30
    INT8 = 32
    INT16 = 33
    INT32 = 34
    INT64 = 35
    UINT8 = 37
    UINT16 = 38
    UINT32 = 39
    UINT64 = 40
    FLOAT16 = 42
    FLOAT32 = 43
    FLOAT64 = 44


class FakeModelType(enum.Enum):
    """Same members and values as mindspore_lite.ModelType."""

    MINDIR = 0
    MINDIR_LITE = 4


class FakeFormat(enum.Enum):
    DEFAULT = -1
    NCHW = 0
    NHWC = 1


_NUMPY_TO_LITE = {np.dtype(name): FakeDataType[name.upper()] for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
    "float64")}
_LITE_TO_NUMPY = {v: k for k, v in _NUMPY_TO_LITE.items()}


class FakeMindSporeLite(types.ModuleType):
    """Module-like stand-in: ``Context``, ``Model``, ``ModelType``, ``DataType``, ``Format``, ``Tensor``.

    ``api="1.x"`` gives a pre-2.0 shaped module (``Context`` without the ``target`` property).
    ``fail(name, exc)`` makes the named call (``"Model.build_from_file"``, ``"Model.predict"``) raise ``exc``.
    """

    def __init__(self, api: str = "2.x", version: str = "2.3.1") -> None:
        super().__init__("mindspore_lite", "stand-in for mindspore_lite (tests/fakes/fake_mslite.py)")
        self.__version__ = version if api == "2.x" else "1.9.0"
        self.calls: List[Tuple[Any, ...]] = []
        self.failures: Dict[str, BaseException] = {}
        self.models: List[Any] = []
        self.ModelType = FakeModelType
        self.DataType = FakeDataType
        self.Format = FakeFormat
        self.Tensor = _FakeTensor
        context_base = _FakeContext if api == "2.x" else _FakeOldContext
        self.Context = type("Context", (context_base,), {"_fake": self})
        self.Model = type("Model", (_FakeModel,), {"_fake": self})

    def record(self, *call: Any) -> None:
        self.calls.append(call)
        exc = self.failures.get(call[0])
        if exc is not None:
            raise exc

    def fail(self, name: str, exc: BaseException) -> None:
        self.failures[name] = exc

    def names(self) -> List[str]:
        return [c[0] for c in self.calls]


class _FakeDeviceInfo:
    """``context.cpu`` / ``context.ascend``: attribute writes are checked and recorded."""

    _checks = {
        "thread_num": lambda v: isinstance(v, int) and v >= 0,
        "device_id": lambda v: isinstance(v, int) and v >= 0,
        "precision_mode": lambda v: v in ASCEND_PRECISION_MODES,
    }

    def __init__(self, fake: FakeMindSporeLite, device: str) -> None:
        object.__setattr__(self, "_fake", fake)
        object.__setattr__(self, "_device", device)

    def __setattr__(self, key: str, value: Any) -> None:
        check = self._checks.get(key)
        if check is None:
            raise AttributeError("fake mindspore_lite: context.%s has no attribute %r" % (self._device, key))
        if not check(value):
            raise ValueError("fake mindspore_lite: bad context.%s.%s %r" % (self._device, key, value))
        self._fake.record("Context.%s.%s" % (self._device, key), value)
        object.__setattr__(self, key, value)


class _FakeContext:
    _fake: FakeMindSporeLite

    def __init__(self) -> None:
        self._fake.record("Context()")
        self.cpu = _FakeDeviceInfo(self._fake, "cpu")
        self.gpu = _FakeDeviceInfo(self._fake, "gpu")
        self.ascend = _FakeDeviceInfo(self._fake, "ascend")
        self._target = ["cpu"]

    @property
    def target(self) -> List[str]:
        return self._target

    @target.setter
    def target(self, target: List[str]) -> None:
        if not isinstance(target, list) or not all(isinstance(t, str) for t in target):
            raise TypeError("target must be list of str, but got %r" % (target,))
        for t in target:
            if t.lower() not in TARGETS:
                raise ValueError("target elements must be in %s, but got %s." % (list(TARGETS), t))
        self._fake.record("Context.target", list(target))
        self._target = target


class _FakeOldContext:
    """Pre-2.0 shape: devices were appended as DeviceInfo objects, there is no ``target`` property."""

    _fake: FakeMindSporeLite

    def __init__(self, thread_num: int = 0) -> None:
        self._fake.record("Context()")
        self.device_list: List[Any] = []

    def append_device_info(self, info: Any) -> None:
        self.device_list.append(info)


class _FakeTensor:
    """A tensor of the toy model; same checks as mindspore_lite.Tensor.set_data_from_numpy."""

    def __init__(self, fake: FakeMindSporeLite, name: str, shape: List[int], dtype: FakeDataType) -> None:
        self._fake = fake
        self.name = name
        self._shape = list(shape)
        self._dtype = dtype
        self._data: Optional[np.ndarray] = None  # an output's buffer, reused by every predict
        self._source: Optional["weakref.ref[np.ndarray]"] = None  # an input's caller-owned array

    @property
    def shape(self) -> List[int]:
        return list(self._shape)

    @property
    def dtype(self) -> FakeDataType:
        return self._dtype

    @property
    def format(self) -> FakeFormat:
        return FakeFormat.NCHW

    @property
    def element_num(self) -> int:
        return int(np.prod(self._shape))

    @property
    def data_size(self) -> int:
        return self.element_num * _LITE_TO_NUMPY[self._dtype].itemsize

    def set_data_from_numpy(self, numpy_obj: np.ndarray) -> None:
        if not isinstance(numpy_obj, np.ndarray):
            raise TypeError("numpy_obj must be numpy.ndarray, but got %s." % type(numpy_obj))
        self._fake.record("Tensor.set_data_from_numpy", self.name, numpy_obj.shape, str(numpy_obj.dtype),
                          numpy_obj.nbytes)
        if _NUMPY_TO_LITE.get(numpy_obj.dtype) != self._dtype:
            raise RuntimeError("data type not equal! Numpy type: %s, Tensor type: %s" % (
                numpy_obj.dtype.type, self._dtype))
        if numpy_obj.nbytes != self.data_size:
            raise RuntimeError("data size not equal! Numpy size: %d, Tensor size: %d" % (
                numpy_obj.nbytes, self.data_size))
        # zero-copy, as in MindSpore Lite 2.0.0: the tensor points at the caller's memory (a weak reference
        # here), so predict reads whatever the array holds then, and fails if the caller let it go
        self._data = None
        self._source = weakref.ref(numpy_obj)

    def _input_data(self) -> np.ndarray:
        source = self._source() if self._source is not None else None
        if source is None:
            raise RuntimeError("fake mindspore_lite: the array given to set_data_from_numpy for %s was freed "
                               "before predict (it is not copied: keep it alive)" % self.name)
        return source.reshape(self._shape)

    def get_data_to_numpy(self) -> np.ndarray:
        """A view into the tensor's buffer, as in 2.0.0 (owndata False): the next predict overwrites it."""
        self._fake.record("Tensor.get_data_to_numpy", self.name)
        if self._data is None:
            raise RuntimeError("fake mindspore_lite: tensor %s has no data" % self.name)
        return self._data.view()


class _FakeModel:
    _fake: FakeMindSporeLite

    def __init__(self) -> None:
        self._fake.record("Model()")
        self._fake.models.append(self)
        self._inputs: List[_FakeTensor] = []
        self._outputs: List[Dict[str, str]] = []
        self.predictions = 0
        self._output_tensors: List[_FakeTensor] = []

    def build_from_file(self, model_path: str, model_type: Any, context: Any = None, config_path: str = "",
                        config_dict: Optional[dict] = None) -> None:
        if not isinstance(model_path, str):
            raise TypeError("model_path must be str, but got %s." % type(model_path))
        if not isinstance(model_type, FakeModelType):
            raise TypeError("model_type must be ModelType, but got %s." % type(model_type))
        if context is not None and not isinstance(context, _FakeContext):
            raise TypeError("context must be Context, but got %s." % type(context))
        self._fake.record("Model.build_from_file", model_path, model_type,
                          list(context.target) if context is not None else ["cpu"])
        if not os.path.exists(model_path):
            raise RuntimeError("build_from_file failed, model_path does not exist!")
        expected_type = FakeModelType.MINDIR_LITE if model_path.endswith(".ms") else FakeModelType.MINDIR
        if model_type is not expected_type:
            raise RuntimeError("build_from_file failed! Error is model type %s does not fit %s" % (
                model_type, model_path))
        with open(model_path) as f:
            try:
                toy = json.load(f)
            except ValueError as err:
                raise RuntimeError("build_from_file failed! Error is bad model file: %s" % err) from err
        if toy.get("fake_model") != "mslite-toy":
            raise RuntimeError("build_from_file failed! Error is not a fake mindspore_lite model file")
        self._inputs = [_FakeTensor(self._fake, i["name"], i["shape"], FakeDataType[i["dtype"].upper()])
                        for i in toy["inputs"]]
        self._outputs = toy["outputs"]

    def get_inputs(self) -> List[_FakeTensor]:
        self._fake.record("Model.get_inputs")
        return list(self._inputs)

    def resize(self, inputs: List[_FakeTensor], dims: List[List[int]]) -> None:
        if not isinstance(inputs, list) or not isinstance(dims, list) or len(inputs) != len(dims):
            raise TypeError("resize needs a list of inputs and a list of dims of the same length")
        self._fake.record("Model.resize", [list(d) for d in dims])
        for tensor, shape in zip(inputs, dims):
            tensor._shape = list(shape)

    def predict(self, inputs: List[_FakeTensor], outputs: Any = None) -> List[_FakeTensor]:
        if not isinstance(inputs, list) or not all(isinstance(t, _FakeTensor) for t in inputs):
            raise TypeError("inputs must be list of Tensor")
        self._fake.record("Model.predict", len(inputs))
        if any(t._source is None for t in inputs):
            raise RuntimeError("predict failed: an input has no data")
        self.predictions += 1
        arrays = toy_outputs(inputs[0]._input_data(), self._outputs)
        if len(self._output_tensors) != len(arrays):  # allocated by the first predict, then reused
            self._output_tensors = [
                _FakeTensor(self._fake, "output_%d" % i, list(a.shape), _NUMPY_TO_LITE[a.dtype])
                for i, a in enumerate(arrays)]
        for tensor, array in zip(self._output_tensors, arrays):
            if tensor._data is None or tensor._data.shape != array.shape:
                tensor._data = np.empty_like(array)
            tensor._data[...] = array  # in place: earlier get_data_to_numpy views see the new values
        return list(self._output_tensors)
