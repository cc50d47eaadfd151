"""The serving loop's contract with the rest of the box, as structural types.

What others may do with the loop is :class:`ServingControl`: the daemon's commands pause and resume it (through
the handover queue, applied between batches) and read its views; nothing sets the loop's state from another
thread.

The other way, the loop publishes through a :class:`ResultSink` (the MQTT transport), marks liveness on a
:class:`ProgressSink` (the watchdog's progress monitor) and asks a :class:`ModelSource` (the model manager) for
the model of each batch. They live apart from the loop because they are the contract the daemon wires, not the
loop's mechanism: structural types, so ``pipeline`` imports none of ``ops``, ``health`` or ``lifecycle``, and
what fills them in need not import them either.
"""

from typing import Any, Dict, Optional, Tuple

from agent._util.compat import Protocol
from agent.pipeline.model import LoadedModel
from agent.pipeline.sources import Frame


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


class ShadowTap(Protocol):
    """A shadow run's intake (:class:`agent.pipeline.shadow.ShadowRun`): the serving loop decodes at ``low`` while
    one is open, hands each frame's detections over with ``offer`` (which never waits) and publishes only those
    at or above the serving threshold."""

    low: float

    def offer(self, image: Any, detections: Any, model: LoadedModel) -> None: ...


class ModelSource(Protocol):
    """The model of the next batch (the model manager), told how each batch went for its probation window, and
    the shadow run open beside it, if any."""

    @property
    def current(self) -> LoadedModel: ...

    def between_batches(self) -> None: ...

    def record_batch(self, frames: int, infer_ms_per_frame: float, failed: bool) -> None: ...

    def shadow_tap(self) -> Optional[ShadowTap]: ...


class ServingControl(Protocol):
    """What the daemon's commands may do with the serving loop (:class:`agent.pipeline.serving.ServingLoop`).

    ``pause`` and ``resume`` go through the handover queue and return once the loop applied them between
    batches (or raise :class:`~agent.pipeline.handover.HandoverTimeout`, and nothing changed); after ``pause``
    returns, no frame is taken. ``resume`` returns how many stale frames it dropped. The views are safe from
    any thread.
    """

    def pause(self, timeout: float) -> None: ...

    def resume(self, timeout: float) -> int: ...

    def status(self) -> Dict[str, Any]: ...

    def latest(self) -> Optional[Tuple[Frame, Dict[str, Any]]]: ...
