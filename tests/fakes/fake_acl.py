"""FakeAcl: a stand-in for pyACL (the ``acl`` module of the Ascend CANN toolkit). It is NOT pyACL.

Implements the calls agent/pipeline/backends/acl_backend.py makes, with pyACL's conventions: calls return ``ret`` or
``(value, ret)``, ``ret == 0`` is success, errors are CANN codes. Device memory is simulated: ``rt.malloc``
hands out fake pointers (outside the user address space, never dereferenced) to bytearrays; host memory is
real memory the backend registered through ``util.bytes_to_ptr`` / ``util.numpy_to_ptr``, read and written
through ctypes as pyACL would. ``rt.memcpy`` enforces the copy kinds (1 H2D, 2 D2H, 3 D2D; in device run mode
host memory counts as device memory), ``dst_max`` and buffer bounds, and refuses a host buffer that only the
fake still references (the caller dropped it before the copy). ACL contexts are per thread, as on the NPU:
calls that need one fail with 107002 on a thread that has none bound.

The "model" is a JSON toy network (:func:`tests.fakes.write_toy_model`, kind ``acl-toy``) run in
``mdl.execute`` from the input device buffer into the output device buffers. Every call is recorded in
``calls``; ``fail_on(name, code, call=n)`` makes the n-th call of ``name`` return ``code``;
``live()`` counts what is still allocated. Install it with ``monkeypatch.setitem(sys.modules, "acl", ...)``.
"""

import ctypes
import json
import os
import sys
import threading
import types
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from tests.fakes import toy_outputs

ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_INVALID_MODEL_ID = 100011
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_NO_DEVICE = 207004
ACL_DEVICE, ACL_HOST = 0, 1
H2H, H2D, D2H, D2D = 0, 1, 2, 3

DEVICE_BASE = 0xFFFF_8000_0000_0000  # kernel half of the address space: can never be a real host pointer
DEVICE_ALIGN = 0x1000
ACL_DTYPE_CODES = {"float32": 0, "float16": 1, "int8": 2, "int32": 3, "uint8": 4}


class FakeAclCall(NamedTuple):
    name: str
    args: Tuple[Any, ...]


class _Namespace(types.SimpleNamespace):
    pass


def _summary(arg: Any) -> Any:
    """What a recorded call keeps of an argument: never the host buffer itself (that would keep it alive)."""
    if isinstance(arg, bytes):
        return ("bytes", len(arg))
    if isinstance(arg, np.ndarray):
        return ("ndarray", arg.shape, str(arg.dtype))
    return arg


class FakeAcl(types.ModuleType):
    """Module-like stand-in for ``acl`` with ``rt``, ``mdl`` and ``util`` namespaces (see module docstring).

    ``run_mode``: ACL_HOST (1, a PCIe card in a server) or ACL_DEVICE (0, the Atlas 200 DK's own CPU).
    ``legacy_pointers``: old CANN (``util.numpy_to_ptr``, no ``util.bytes_to_ptr``).
    ``output_data_type``: whether ``mdl.get_output_data_type`` exists (old pyACL lacks it).
    """

    def __init__(self, run_mode: int = ACL_HOST, legacy_pointers: bool = False, output_data_type: bool = True,
                 device_count: int = 1, device_capacity: int = 64 << 20, kind_reserved: bool = False) -> None:
        super().__init__("acl", "stand-in for pyACL (tests/fakes/fake_acl.py)")
        self.run_mode = run_mode
        self.kind_reserved = kind_reserved  # CANN 8.x: memcpy's kind is reserved, the pointers say the direction
        self.device_count = device_count
        self.device_capacity = device_capacity
        self.calls: List[FakeAclCall] = []
        self.failures: Dict[str, Tuple[int, int]] = {}  # name -> (error code, which call fails)
        self.violations: List[str] = []  # why a call was refused, for assertions
        self.executions = 0
        self.initialized = False
        self.finalized = False
        self.device_refs: Dict[int, int] = {}
        self.device_memory: Dict[int, bytearray] = {}
        self.host_memory: Dict[int, Tuple[Any, int]] = {}  # real address -> (object holding it, size)
        self.contexts: Dict[int, int] = {}  # context -> device
        self.models: Dict[int, dict] = {}
        self.descs: Dict[int, Optional[int]] = {}  # desc -> model id it describes
        self.data_buffers: Dict[int, Tuple[int, int]] = {}  # handle -> (ptr, size)
        self.datasets: Dict[int, List[int]] = {}  # handle -> data buffer handles
        self._next_handle = 1
        self._next_device = DEVICE_BASE
        self._thread = threading.local()

        self.init = self._api("acl.init", self._init)
        self.finalize = self._api("acl.finalize", self._finalize)
        self.create_data_buffer = self._api("acl.create_data_buffer", self._create_data_buffer)
        self.destroy_data_buffer = self._api("acl.destroy_data_buffer", self._destroy_data_buffer)
        self.rt = _Namespace(
            set_device=self._api("acl.rt.set_device", self._set_device),
            reset_device=self._api("acl.rt.reset_device", self._reset_device),
            create_context=self._api("acl.rt.create_context", self._create_context, value=True),
            destroy_context=self._api("acl.rt.destroy_context", self._destroy_context),
            set_context=self._api("acl.rt.set_context", self._set_context),
            get_run_mode=self._api("acl.rt.get_run_mode", lambda: (self.run_mode, ACL_SUCCESS), value=True),
            malloc=self._api("acl.rt.malloc", self._malloc, value=True),
            free=self._api("acl.rt.free", self._free),
            memcpy=self._api("acl.rt.memcpy", self._memcpy),
        )
        self.mdl = _Namespace(
            load_from_file=self._api("acl.mdl.load_from_file", self._load_from_file, value=True),
            unload=self._api("acl.mdl.unload", self._unload),
            create_desc=self._api("acl.mdl.create_desc", self._create_desc),
            get_desc=self._api("acl.mdl.get_desc", self._get_desc),
            destroy_desc=self._api("acl.mdl.destroy_desc", self._destroy_desc),
            get_num_inputs=self._api("acl.mdl.get_num_inputs", lambda d: len(self._described(d)["inputs"])),
            get_num_outputs=self._api("acl.mdl.get_num_outputs",
                                      lambda d: len(self._described(d)["outputs"])),
            get_input_size_by_index=self._api("acl.mdl.get_input_size_by_index",
                                              lambda d, i: self._described(d)["input_sizes"][i]),
            get_output_size_by_index=self._api("acl.mdl.get_output_size_by_index",
                                               lambda d, i: self._described(d)["output_sizes"][i]),
            get_output_dims=self._api("acl.mdl.get_output_dims", self._get_output_dims, value=True),
            create_dataset=self._api("acl.mdl.create_dataset", self._create_dataset),
            add_dataset_buffer=self._api("acl.mdl.add_dataset_buffer", self._add_dataset_buffer, value=True),
            destroy_dataset=self._api("acl.mdl.destroy_dataset", self._destroy_dataset),
            execute=self._api("acl.mdl.execute", self._execute),
        )
        if output_data_type:
            self.mdl.get_output_data_type = self._api(
                "acl.mdl.get_output_data_type",
                lambda d, i: ACL_DTYPE_CODES[self._described(d)["outputs"][i].get("dtype", "float32")])
        if legacy_pointers:
            self.util = _Namespace(numpy_to_ptr=self._api("acl.util.numpy_to_ptr", self._numpy_to_ptr))
        else:
            self.util = _Namespace(bytes_to_ptr=self._api("acl.util.bytes_to_ptr", self._bytes_to_ptr))

    # -- recording, failure injection, accounting ---------------------------------------------------------
    def _api(self, name: str, fn: Callable[..., Any], value: bool = False) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls.append(FakeAclCall(name, tuple(_summary(a) for a in args)))
            code, which = self.failures.get(name, (0, 0))
            if code and self.count(name) == which:
                return (None, code) if value else code
            return fn(*args)

        call.__name__ = name
        return call

    def fail_on(self, name: str, code: int, call: int = 1) -> None:
        """Make the ``call``-th call (1-based, counted over the fake's life) of ``name`` return ``code``."""
        self.failures[name] = (code, call)

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c.name == name)

    def names(self) -> List[str]:
        return [c.name for c in self.calls]

    def calls_to(self, name: str) -> List[FakeAclCall]:
        return [c for c in self.calls if c.name == name]

    def live(self) -> Dict[str, int]:
        """What is still allocated; all zero after a clean teardown."""
        return {"device_memory": len(self.device_memory), "data_buffers": len(self.data_buffers),
                "datasets": len(self.datasets), "descs": len(self.descs), "models": len(self.models),
                "contexts": len(self.contexts), "device_refs": sum(self.device_refs.values())}

    def _refuse(self, code: int, why: str) -> int:
        self.violations.append(why)
        return code

    def _handle(self) -> int:
        self._next_handle += 1
        return self._next_handle

    def _current_context(self) -> Optional[int]:
        ctx = getattr(self._thread, "context", None)
        return ctx if ctx in self.contexts else None

    # -- acl / rt -----------------------------------------------------------------------------------------
    def _init(self) -> int:
        if self.finalized:  # CANN: acl.init once per process; after acl.finalize it is not supported
            return self._refuse(ACL_ERROR_INVALID_PARAM, "init after finalize in the same process")
        if self.initialized:
            return ACL_ERROR_REPEAT_INITIALIZE
        self.initialized = True
        return ACL_SUCCESS

    def _finalize(self) -> int:
        self.initialized = False
        self.finalized = True
        return ACL_SUCCESS

    def _set_device(self, device: int) -> int:
        if not self.initialized:
            return self._refuse(ACL_ERROR_UNINITIALIZE, "set_device before init")
        if not 0 <= device < self.device_count:
            return self._refuse(ACL_ERROR_RT_NO_DEVICE, "no device %d" % device)
        self.device_refs[device] = self.device_refs.get(device, 0) + 1
        return ACL_SUCCESS

    def _reset_device(self, device: int) -> int:
        if self.device_refs.get(device, 0) <= 0:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "reset_device(%d) without set_device" % device)
        self.device_refs[device] -= 1
        return ACL_SUCCESS

    def _create_context(self, device: int) -> Tuple[Optional[int], int]:
        if self.device_refs.get(device, 0) <= 0:
            return None, self._refuse(ACL_ERROR_RT_NO_DEVICE, "create_context on unset device %d" % device)
        ctx = self._handle()
        self.contexts[ctx] = device
        self._thread.context = ctx  # a new context is current on the creating thread
        return ctx, ACL_SUCCESS

    def _destroy_context(self, ctx: int) -> int:
        if ctx not in self.contexts:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "destroy unknown context %r" % ctx)
        del self.contexts[ctx]
        return ACL_SUCCESS

    def _set_context(self, ctx: int) -> int:
        if ctx not in self.contexts:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "set unknown context %r" % ctx)
        self._thread.context = ctx
        return ACL_SUCCESS

    def _malloc(self, size: int, policy: int) -> Tuple[Optional[int], int]:
        if self._current_context() is None:
            return None, self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "malloc without a context on this thread")
        if size <= 0 or policy not in (0, 1, 2):
            return None, self._refuse(ACL_ERROR_INVALID_PARAM, "malloc(%r, %r)" % (size, policy))
        if sum(len(b) for b in self.device_memory.values()) + size > self.device_capacity:
            return None, ACL_ERROR_RT_MEMORY_ALLOCATION
        ptr = self._next_device
        self._next_device += (size + DEVICE_ALIGN - 1) // DEVICE_ALIGN * DEVICE_ALIGN
        self.device_memory[ptr] = bytearray(size)
        return ptr, ACL_SUCCESS

    def _free(self, ptr: int) -> int:
        if self._current_context() is None:
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "free without a context on this thread")
        if self.device_memory.pop(ptr, None) is None:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "free of unknown pointer %#x" % ptr)
        return ACL_SUCCESS

    def _memcpy(self, dst: int, dst_max: int, src: int, count: int, kind: int) -> int:
        if self._current_context() is None:
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "memcpy without a context on this thread")
        if kind not in (H2H, H2D, D2H, D2D) or count > dst_max or count <= 0:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "memcpy count %r dst_max %r kind %r" % (
                count, dst_max, kind))
        host_is_device = self.run_mode == ACL_DEVICE
        dst_side = "device" if dst in self.device_memory else ("host" if dst in self.host_memory else None)
        src_side = "device" if src in self.device_memory else ("host" if src in self.host_memory else None)
        if dst_side is None or src_side is None:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "memcpy with an unknown pointer")
        wanted = {H2H: ("host", "host"), H2D: ("host", "device"), D2H: ("device", "host"),
                  D2D: ("device", "device")}[kind]
        sides = (src_side, dst_side)
        if host_is_device and kind == D2D:
            sides = tuple("device" for _ in sides)
        if sides != wanted and not self.kind_reserved:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "memcpy kind %d copies %s->%s, got %s->%s" % (
                kind, wanted[0], wanted[1], src_side, dst_side))
        for side, ptr in ((src_side, src), (dst_side, dst)):
            size = len(self.device_memory[ptr]) if side == "device" else self.host_memory[ptr][1]
            if count > size:
                return self._refuse(ACL_ERROR_INVALID_PARAM,
                                    "memcpy of %d bytes overruns a %d-byte buffer" % (count, size))
            # only the registry's tuple and getrefcount's own argument hold it: the caller let it go
            if side == "host" and sys.getrefcount(self.host_memory[ptr][0]) <= 2:
                return self._refuse(ACL_ERROR_INVALID_PARAM, "host buffer released before memcpy")
        if src_side == "device":
            data = bytes(self.device_memory[src][:count])
        else:
            data = ctypes.string_at(src, count)
        if dst_side == "device":
            self.device_memory[dst][:count] = data
        else:
            ctypes.memmove(dst, data, count)
        return ACL_SUCCESS

    # -- util ---------------------------------------------------------------------------------------------
    def _register_host(self, obj: Any, ptr: int, size: int) -> int:
        # forget buffers nobody but the registry holds any more (the entry's tuple and getrefcount's argument)
        for dead in [p for p, entry in self.host_memory.items() if sys.getrefcount(entry[0]) <= 2]:
            del self.host_memory[dead]
        self.host_memory[ptr] = (obj, size)
        return ptr

    def _bytes_to_ptr(self, data: bytes) -> int:
        if not isinstance(data, bytes):
            raise ValueError("bytes_to_ptr needs bytes, got %s" % type(data).__name__)  # ValueError, as pyACL
        return self._register_host(data, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, len(data))

    def _numpy_to_ptr(self, array: np.ndarray) -> int:
        if not array.flags["C_CONTIGUOUS"]:
            raise ValueError("numpy_to_ptr needs a C-contiguous array")
        return self._register_host(array, array.ctypes.data, array.nbytes)

    # -- buffers and datasets -----------------------------------------------------------------------------
    def _create_data_buffer(self, ptr: int, size: int) -> int:
        if ptr not in self.device_memory or size > len(self.device_memory[ptr]):
            self.violations.append("create_data_buffer over unknown or short memory")
            return 0
        handle = self._handle()
        self.data_buffers[handle] = (ptr, size)
        return handle

    def _destroy_data_buffer(self, handle: int) -> int:
        if self.data_buffers.pop(handle, None) is None:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "destroy unknown data buffer")
        return ACL_SUCCESS

    def _create_dataset(self) -> int:
        handle = self._handle()
        self.datasets[handle] = []
        return handle

    def _add_dataset_buffer(self, dataset: int, buffer: int) -> Tuple[Optional[int], int]:
        if dataset not in self.datasets or buffer not in self.data_buffers:
            return None, self._refuse(ACL_ERROR_INVALID_PARAM, "add_dataset_buffer with unknown handles")
        self.datasets[dataset].append(buffer)
        return dataset, ACL_SUCCESS

    def _destroy_dataset(self, dataset: int) -> int:
        if self.datasets.pop(dataset, None) is None:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "destroy unknown dataset")
        return ACL_SUCCESS

    # -- models -------------------------------------------------------------------------------------------
    def _load_from_file(self, path: str) -> Tuple[Optional[int], int]:
        if self._current_context() is None:
            return None, self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "load_from_file without a context")
        if not os.path.isfile(path):
            return None, self._refuse(ACL_ERROR_INVALID_PARAM, "no model file %s" % path)
        with open(path) as f:
            toy = json.load(f)
        if toy.get("fake_model") != "acl-toy":
            return None, self._refuse(ACL_ERROR_INVALID_PARAM, "not a fake acl model file")
        model_id = self._handle()
        probe = np.zeros(toy["inputs"][0]["shape"], dtype=toy["inputs"][0]["dtype"])
        shapes = [a.shape for a in toy_outputs(probe, toy["outputs"])]
        toy["input_sizes"] = [int(np.prod(i["shape"])) * np.dtype(i["dtype"]).itemsize for i in toy["inputs"]]
        toy["output_shapes"] = shapes
        toy["output_sizes"] = [int(np.prod(s)) * np.dtype(o.get("dtype", "float32")).itemsize
                               for s, o in zip(shapes, toy["outputs"])]
        self.models[model_id] = toy
        return model_id, ACL_SUCCESS

    def _unload(self, model_id: int) -> int:
        if self.models.pop(model_id, None) is None:
            return self._refuse(ACL_ERROR_INVALID_MODEL_ID, "unload unknown model")
        return ACL_SUCCESS

    def _create_desc(self) -> int:
        handle = self._handle()
        self.descs[handle] = None
        return handle

    def _get_desc(self, desc: int, model_id: int) -> int:
        if desc not in self.descs:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "get_desc on unknown desc")
        if model_id not in self.models:
            return self._refuse(ACL_ERROR_INVALID_MODEL_ID, "get_desc for unknown model")
        self.descs[desc] = model_id
        return ACL_SUCCESS

    def _destroy_desc(self, desc: int) -> int:
        if self.descs.pop(desc, "missing") == "missing":
            return self._refuse(ACL_ERROR_INVALID_PARAM, "destroy unknown desc")
        return ACL_SUCCESS

    def _described(self, desc: int) -> dict:
        return self.models[self.descs[desc]]

    def _get_output_dims(self, desc: int, index: int) -> Tuple[dict, int]:
        shape = self._described(desc)["output_shapes"][index]
        return {"name": "output_%d" % index, "dimCount": len(shape), "dims": list(shape)}, ACL_SUCCESS

    def _dataset_memory(self, dataset: int, sizes: List[int], what: str) -> Optional[List[bytearray]]:
        buffers = self.datasets.get(dataset)
        if buffers is None or len(buffers) != len(sizes):
            self.violations.append("execute: %s dataset has %s buffers, model needs %d" % (
                what, None if buffers is None else len(buffers), len(sizes)))
            return None
        memory = []
        for handle, size in zip(buffers, sizes):
            ptr, buffer_size = self.data_buffers[handle]
            if buffer_size != size or ptr not in self.device_memory:
                self.violations.append("execute: %s buffer of %d bytes, model needs %d" % (
                    what, buffer_size, size))
                return None
            memory.append(self.device_memory[ptr])
        return memory

    def _execute(self, model_id: int, in_dataset: int, out_dataset: int) -> int:
        if self._current_context() is None:
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "execute without a context on this thread")
        toy = self.models.get(model_id)
        if toy is None:
            return self._refuse(ACL_ERROR_INVALID_MODEL_ID, "execute unknown model")
        inputs = self._dataset_memory(in_dataset, toy["input_sizes"], "input")
        outputs = self._dataset_memory(out_dataset, toy["output_sizes"], "output")
        if inputs is None or outputs is None:
            return ACL_ERROR_INVALID_PARAM
        spec = toy["inputs"][0]
        batch = np.frombuffer(bytes(inputs[0]), dtype=spec["dtype"]).reshape(spec["shape"])
        for memory, result in zip(outputs, toy_outputs(batch, toy["outputs"])):
            memory[:] = result.tobytes()
        self.executions += 1
        return ACL_SUCCESS
