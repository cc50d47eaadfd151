"""STAND-IN, not a runtime: a backend that holds each call for a fixed time without using the CPU.

An NPU computes while the host's cores are free; on a CPU-only machine a real backend competes with the
host's letterbox and decode for the same cores, so it cannot show whether the serving loop keeps an
accelerator busy. :class:`PacedStandinBackend` can: each call sleeps for ``hold_s`` (measured from the call's
start, so it holds that long however the sleep is scheduled) and returns the outputs the real OpenCV model
gave for a real frame, so decoding costs what it costs on real detections.

Use: build a :class:`~agent.pipeline.model.LoadedModel` with :func:`paced_factory`, run one real frame through
it (the calls run the real model until :func:`freeze`), then freeze: from then on every call is paced.
"""

import time
from typing import Any, List, Optional

import numpy as np

from agent.pipeline.backends.opencv_backend import OpenCvBackend


class PacedStandinBackend(OpenCvBackend):
    """STAND-IN: the real OpenCV model until frozen, then ``hold_s`` of sleep returning the last real outputs."""

    def __init__(self, *args: Any, hold_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold_s = hold_s
        self.frozen: Optional[List[np.ndarray]] = None
        self._last: List[np.ndarray] = []

    def freeze(self) -> None:
        """From now on return the outputs of the last real call (read-only: the caller must not change them)."""
        if not self._last:
            raise RuntimeError("%s: freeze() before any real call" % self.artifact_path)
        for output in self._last:
            output.flags.writeable = False
        self.frozen = self._last

    def _infer(self, batch: np.ndarray) -> List[np.ndarray]:
        if self.frozen is None:
            self._last = super()._infer(batch)
            return [output.copy() for output in self._last]
        deadline = time.perf_counter() + self.hold_s
        while True:  # sleep, not spin: the point is that the host's cores stay free
            left = deadline - time.perf_counter()
            if left <= 0:
                return self.frozen
            time.sleep(left)


def paced_factory(hold_s: float, made: List[PacedStandinBackend]) -> Any:
    """A ``LoadedModel`` backend factory for ONNX artifacts; every backend it builds is appended to ``made``."""

    def factory(name: str, path: str, spec: Any, options: Any) -> PacedStandinBackend:
        backend = PacedStandinBackend(path, spec, options, hold_s=hold_s)
        made.append(backend)
        return backend

    return factory


def freeze(made: List[PacedStandinBackend]) -> None:
    for backend in made:
        backend.freeze()
