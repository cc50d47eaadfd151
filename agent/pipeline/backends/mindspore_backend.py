"""MindSpore backend: a MindIR file run on the CPU through ``mindspore.load`` + ``nn.GraphCell``.

Process-wide settings: MindSpore keeps the execution mode, device and CPU kernel thread count per process and
refuses to change the last two once set (``threads_num`` "can not be set repeatedly"). The first backend to
load fixes them (GRAPH_MODE, CPU, ``options.cpu_threads``); a later backend asking for another thread count
gets a warning and the first value. CPU core pinning is left to systemd (``CPUAffinity=``), not done here.

Compiled graphs are cached per process. MindSpore 2.7.1 keeps memory for every graph it compiles and runs
that no public API returns (measured here: about 0.5 MB for a 2-conv net, 10.8 MB for a 17-conv net, per
load/close cycle), so swapping models back and forth would grow RSS without bound. Compiled graphs are
therefore kept in a small LRU keyed by the file's identity (path, size, mtime, inode) and the input spec: an
A/B swap or a rollback to a model seen before reuses its compiled graph instead of compiling it again.
``close()`` drops the backend's hold; :func:`release_compiled_graphs` empties the cache.

One process-wide lock serialises every MindSpore call (load, compile, run, freeing a graph): MindSpore 2.7
raises "Nested execution during JIT execution" (or deadlocks) when one thread compiles a graph while another
runs one, which is exactly what deploying a model while the current one serves does.
"""

import gc
import logging
import os
import threading
from collections import OrderedDict
from typing import Any, List, Optional, Tuple

import numpy as np

from agent.pipeline.backends.base import Backend

logger = logging.getLogger(__name__)

# mind_ir.proto TensorProto.DataType codes of the input dtypes a bundle may declare
MINDIR_DTYPES = {1: "float32", 2: "uint8", 10: "float16"}
# the serving model and the pending one during an A/B swap; a third distinct model evicts the oldest
COMPILED_GRAPH_CACHE_SIZE = 2

# held around every MindSpore call: compiling on one thread while another runs a graph is not supported
_execution_lock = threading.RLock()
_process_threads: Optional[int] = None  # the CPU kernel thread count this process was fixed to


class _CompiledGraph:
    """A GraphCell compiled for one input shape (shared by backends serving the same file)."""

    def __init__(self, cell: Any) -> None:
        self.cell = cell


_compiled: "OrderedDict[Tuple[Any, ...], _CompiledGraph]" = OrderedDict()  # guarded by _execution_lock


def release_compiled_graphs() -> int:
    """Drop every cached compiled graph (what MindSpore still holds for them stays); returns how many."""
    with _execution_lock:
        count = len(_compiled)
        _compiled.clear()
        gc.collect()  # a GraphCell's finaliser calls into MindSpore: run it under the lock
    return count


def compiled_graph_count() -> int:
    with _execution_lock:
        return len(_compiled)


def _file_key(path: str) -> Tuple[Any, ...]:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)


def _configure_process(ms: Any, cpu_threads: int) -> None:
    """Set the process-wide mode, device and thread count once; later calls only check and warn."""
    global _process_threads
    with _execution_lock:
        if _process_threads is not None:
            if cpu_threads != _process_threads:
                logger.warning("mindspore: CPU threads are fixed per process at %d; ignoring %d",
                               _process_threads, cpu_threads)
            return
        ms.set_context(mode=ms.GRAPH_MODE)
        if hasattr(ms, "set_device"):  # 2.5+: set_device replaces set_context(device_target=...)
            try:
                ms.set_device("CPU")
            except RuntimeError as err:  # already fixed for this process (by the caller or an earlier run)
                logger.warning("mindspore: device already set for this process (%s): %s",
                               ms.get_context("device_target"), err)
        else:
            ms.set_context(device_target="CPU")
        op_tuning = getattr(getattr(getattr(ms, "device_context", None), "cpu", None), "op_tuning", None)
        if op_tuning is not None:
            try:
                op_tuning.threads_num(cpu_threads)
            except RuntimeError as err:  # set earlier in this process by someone else
                logger.warning("mindspore: CPU kernel threads already set for this process: %s", err)
        else:
            ms.set_context(runtime_num_threads=cpu_threads)  # before 2.5
        _process_threads = cpu_threads


class MindSporeBackend(Backend):
    """MindIR on the CPU. ``infer`` wraps the batch with ``Tensor.from_numpy`` (no copy)."""

    name = "mindspore"
    runtime_module = "mindspore"
    runtime_provider = "the mindspore wheel (pip install mindspore)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ms: Any = None
        self._graph: Optional[_CompiledGraph] = None

    def _load(self) -> None:
        ms = self._import_runtime()
        _configure_process(ms, self.options.cpu_threads)
        spec = self.input_spec
        key = _file_key(self.artifact_path) + (spec.shape, spec.dtype)
        with _execution_lock:
            graph = _compiled.get(key)
            if graph is not None:
                _compiled.move_to_end(key)
                logger.info("mindspore: reusing the compiled graph of %s", self.artifact_path)
            else:
                graph = self._compile(ms)
                self._store(key, graph)
        self._ms = ms
        self._graph = graph

    def _compile(self, ms: Any) -> _CompiledGraph:
        """Load the MindIR and run one zero batch, so compiling happens here and not on the first frame."""
        self._check_declared_input(ms)
        try:
            cell = ms.nn.GraphCell(ms.load(self.artifact_path))
        except (RuntimeError, ValueError, TypeError, OSError) as err:
            raise self._error("mindspore.load failed", err) from err
        graph = _CompiledGraph(cell)
        try:
            self._run(ms, graph, np.zeros(self.input_spec.shape, dtype=self.input_spec.dtype))
        except (RuntimeError, ValueError, TypeError) as err:
            raise self._error("warm-up with input %s %s failed" % (
                self.input_spec.shape, self.input_spec.dtype), err) from err
        return graph

    def _check_declared_input(self, ms: Any) -> None:
        """GraphCell silently recompiles for another shape: hold the spec to the shape the file declares."""
        if not hasattr(ms, "load_mindir"):
            return
        try:
            inputs = list(ms.load_mindir(self.artifact_path).graph.input)
        except Exception as err:  # noqa: BLE001 - protobuf and IO errors alike mean an unreadable file
            raise self._error("mindspore.load_mindir failed", err) from err
        if len(inputs) != 1:
            raise self._error("input count", "expected 1 model input, got %d" % len(inputs))
        dims = tuple(int(d) for d in inputs[0].tensor[0].dims) if inputs[0].tensor else ()
        if dims and all(d > 0 for d in dims) and dims != self.input_spec.shape:
            raise self._error("input shape mismatch for %r" % self.input_spec.name,
                              "expected %s, got %s from the MindIR" % (self.input_spec.shape, dims))
        dtype = MINDIR_DTYPES.get(inputs[0].tensor[0].data_type) if inputs[0].tensor else None
        if dtype is not None and dtype != self.input_spec.dtype:
            raise self._error("input dtype mismatch for %r" % self.input_spec.name,
                              "expected %s, got %s from the MindIR" % (self.input_spec.dtype, dtype))

    @staticmethod
    def _store(key: Tuple[Any, ...], graph: _CompiledGraph) -> None:
        """Cache ``graph``; called under the execution lock, so an evicted graph is freed under it too."""
        if COMPILED_GRAPH_CACHE_SIZE <= 0:
            return
        _compiled[key] = graph
        _compiled.move_to_end(key)
        while len(_compiled) > COMPILED_GRAPH_CACHE_SIZE:
            evicted, _ = _compiled.popitem(last=False)
            logger.info("mindspore: evicted the compiled graph of %s", evicted[0])

    @staticmethod
    def _run(ms: Any, graph: _CompiledGraph, batch: np.ndarray) -> List[np.ndarray]:
        with _execution_lock:
            result = graph.cell(ms.Tensor.from_numpy(batch))
            outputs = result if isinstance(result, (tuple, list)) else (result,)
            # asnumpy() views memory the runtime owns: copy so the caller may keep it
            return [np.array(out.asnumpy(), copy=True) for out in outputs]

    def _infer(self, batch: np.ndarray) -> List[np.ndarray]:
        return self._run(self._ms, self._graph, batch)

    def _release(self) -> None:
        with _execution_lock:  # dropping the last reference to a GraphCell calls into MindSpore
            self._graph = None
            self._ms = None
            gc.collect()
