"""What the serving loop needs from the rest of the box, as structural types the daemon fills in.

The loop publishes through a :class:`ResultSink` (the MQTT transport), marks liveness on a :class:`ProgressSink`
(the watchdog's progress monitor) and asks a :class:`ModelSource` (the model manager) for the model of each
batch. They live apart from the loop because they are the contract the daemon wires, not the loop's mechanism:
structural types, so ``pipeline`` imports none of ``ops``, ``health`` or ``lifecycle``, and what fills them in
need not import them either.
"""

from typing import Any, Dict

from agent._util.compat import Protocol
from agent.pipeline.model import LoadedModel


class ResultSink(Protocol):
    """Where results and telemetry go (the MQTT transport, which falls back to its outbox)."""

    def publish_result(self, source: str, payload: Dict[str, Any]) -> None: ...

    def publish_telemetry(self, telemetry: Dict[str, Any]) -> None: ...


class ProgressSink(Protocol):
    """Liveness marks (the watchdog's progress monitor): around each backend call and per finished frame."""

    def begin_inference(self) -> None: ...

    def end_inference(self) -> None: ...

    def frame_done(self, count: int = 1) -> None: ...

    def idle_tick(self) -> None: ...


class ModelSource(Protocol):
    """The model of the next batch (the model manager), told how each batch went for its probation window."""

    @property
    def current(self) -> LoadedModel: ...

    def between_batches(self) -> None: ...

    def record_batch(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None: ...
