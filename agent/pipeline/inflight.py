"""The work in flight in the serving loop: a batch of frames and the chunks it is served in.

A batch is what the batcher handed over, served on one model and published together, in frame order; a chunk is
up to one fixed artifact batch of one tier of it, letterboxed into a preallocated input buffer. The loop
(:mod:`agent.pipeline.serving`) keeps at most one chunk being prepared, one ready and one on the backend.
"""

import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

from agent.pipeline.backend_thread import BackendCall
from agent.pipeline.model import FrameResult, LoadedModel, PreparedChunk
from agent.pipeline.sources import Frame


class Batch:
    """Frames taken together from the batcher, served on one model and published together, in order."""

    def __init__(self, frames: List[Frame], model: LoadedModel, taken: float) -> None:
        self.frames = frames
        self.model = model
        self.taken = taken
        self.results: List[Optional[FrameResult]] = [None] * len(frames)
        self.infer_s = 0.0
        self.failed = False
        self.recorded = False  # told to the model source (probation) once, as served or as failed
        # Planned by the serving loop (plan() raises for a frame the model cannot take, and that fails the batch).
        self.todo: Deque[Tuple[Any, List[int]]] = deque()
        self.chunks_left = 0

    def plan(self, model: LoadedModel) -> None:
        """(Re)plan the chunks for ``model``; the chunks not yet prepared are ``todo``."""
        self.model = model
        self.todo = deque(model.chunks([f.image for f in self.frames]))
        self.chunks_left = len(self.todo)

    def next_chunk(self) -> "Chunk":
        """Letterbox the next planned chunk into one of its tier's input buffers."""
        first = len(self.todo) == self.chunks_left
        tier, indices = self.todo.popleft()
        prepared = self.model.prepare(tier, [self.frames[i].image for i in indices])
        return Chunk(self, indices, prepared, first)


class Chunk:
    """Up to one artifact batch of one tier, letterboxed, on its way through the backend thread to its decode."""

    __slots__ = ("batch", "indices", "prepared", "first", "ready_at", "submitted_at", "call")

    def __init__(self, batch: Batch, indices: List[int], prepared: PreparedChunk, first: bool) -> None:
        self.batch = batch
        self.indices = indices
        self.prepared = prepared
        self.first = first  # the batch's first chunk: the point before it is a point between batches
        self.ready_at = time.monotonic()
        self.submitted_at = 0.0
        self.call: Optional[BackendCall] = None

    def timings(self, decode_started: float) -> Dict[str, float]:
        """Each frame's share of this chunk's letterbox, backend call and decode (ms), and its wait for the backend."""
        call, n = self.call, len(self.indices)
        assert call is not None
        return {"preprocess": self.prepared.preprocess_ms / n, "wait_backend": (call.started - self.ready_at) * 1e3,
                "infer": call.seconds * 1e3 / n, "postprocess": (time.monotonic() - decode_started) * 1e3 / n}
