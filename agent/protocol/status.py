"""A box's retained status (``<prefix>/<device>/status``) and the ``status`` verb's answer: their types, builders
and readers.

:class:`BoxStatus` is the retained message. :func:`status_message` is the only code that builds one: the daemon's
``online`` (through the transport, which adds the state, the time and the broker), the transport's ``offline``
at a clean stop and the broker's last will (:mod:`agent.ops.connection`) all go through it. It constructs a
:class:`BoxStatus` (a name the type does not have is a TypeError) and checks the message it writes with the
same parse the operator runs (a value of the wrong type is a ConfigError naming the field), so a new field is
added to the type first and every reader knows it. :func:`parse_status` is the operator's reader (``fleet``).

:class:`StatusAnswer` is the ``status`` verb's ``result``: every field of :class:`BoxStatus`, with the same
meaning (``model`` is the serving model's label, ``<name> <version>``, in both), plus what only a live answer has:
the serving model in detail (``model_info``, a :class:`ModelInfo`), the serving loop's figures and the daemon's
(as in telemetry). :func:`status_answer` builds it, :func:`parse_status_answer` reads it; a status answer also
reads as a :class:`BoxStatus`.

The device is named twice on purpose: ``device_id`` (the config's ``device_id``, also the topic's level) and
``device_kind`` (its ``device_configs/`` name, e.g. ``atlas-200dk``), which the fleet's pre-flight needs to
judge whether a bundle runs there. ``device`` is the id again, for readers from before ``device_id`` existed
(the wire has always carried the id there).
"""

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from agent.config.schema import ConfigError, parse, setting, to_dict
from agent.protocol.messages import ONLINE, ProtocolError


@dataclass(frozen=True)
class SlotView:
    """One A/B slot as the box reports it (``SlotTable.public()``)."""

    state: Optional[str] = None
    name: Optional[str] = None
    version: Optional[str] = None
    manifest_sha256: Optional[str] = None
    since: Optional[str] = None


@dataclass(frozen=True)
class SlotsView:
    serving: Optional[str] = None
    slots: Dict[str, Optional[SlotView]] = setting(factory=dict)
    last_rollback: Optional[Dict[str, Any]] = None
    pending: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class BoxStatus:
    """A box's retained status: ``online`` from the daemon, ``offline`` from its stop or its last will."""

    state: str
    device_id: Optional[str] = None  # the config's device_id (the topic's <device>)
    device_kind: Optional[str] = None  # its device_configs/ name: what the fleet's pre-flight judges bundles by
    device: Optional[str] = None  # the device id again, for readers from before device_id
    ts: Optional[float] = None
    groups: List[str] = setting(factory=list)
    model: Optional[str] = None
    backend: Optional[str] = None
    precision: Optional[str] = None  # of the serving model's artifacts: int8, float32 (model.precision)
    slots: Optional[SlotsView] = None
    reason: Optional[str] = None
    connected_at: Optional[float] = None
    broker: Optional[str] = None  # which of the box's mqtt.hosts it is on
    telemetry_interval_s: Optional[float] = setting(None, gt=0)  # how often it speaks: judges staleness

    @property
    def online(self) -> bool:
        return self.state == ONLINE


def status_message(state: str, device_id: str, **fields: Any) -> Dict[str, Any]:
    """The retained status of ``device_id`` in ``state`` (``online``/``offline``), as JSON-ready dict.

    Built through :class:`BoxStatus`: ``fields`` are its other fields (``device_kind``, ``model``, ``groups``,
    ``slots``...); a name it does not have is a TypeError here, on the box, rather than a key no reader knows,
    and a value :func:`parse_status` would refuse is a ConfigError naming the field. ``ts`` defaults to now;
    ``device`` is always the id. Only the fields given are written, and not those given as None: a reader keeps
    what it knew of the others.
    """
    if fields.get("ts") is None:
        fields["ts"] = time.time()
    fields.update(state=state, device_id=device_id, device=device_id)
    status = BoxStatus(**fields)
    message = {name: value for name, value in to_dict(status).items() if name in fields and value is not None}
    parse(BoxStatus, message, "status")  # what the operator's reader accepts, checked before it is sent
    return message


@dataclass(frozen=True)
class ModelInfo:
    """The serving model in detail (the status answer's ``model_info``): which model, as a deploy's result names
    it (name, version, manifest), and how it runs (task, backend, precision, input tiers, one artifact per tier)."""

    name: Optional[str] = None
    version: Optional[str] = None
    manifest_sha256: Optional[str] = None
    task: Optional[str] = None
    backend: Optional[str] = None
    precision: Optional[str] = None  # int8, float32; tiers that differ: float32+int8
    tiers: List[List[int]] = setting(factory=list)  # [[h, w], ...]
    artifacts: Dict[str, str] = setting(factory=dict)  # "HxW" -> file


@dataclass(frozen=True)
class StatusAnswer(BoxStatus):
    """The ``status`` verb's result: the retained status's fields (same names, same meanings) and the live view.

    Every key is always present (null when unknown), as the answer has always been written.
    """

    model_info: Optional[ModelInfo] = None  # the serving model in detail (``model`` is its label)
    uptime_s: Optional[float] = None  # since the daemon announced ready (monotonic: a clock step does not move it)
    overrides: Optional[Dict[str, Any]] = None  # set-config's overrides file: values, path, problems (redacted)
    # The serving loop's view (agent.pipeline.serving.ServingLoop.status); fps and latency_ms only with windows.
    frames: Optional[int] = None
    fps: Optional[float] = None
    latency_ms: Optional[Dict[str, Any]] = None
    backend_busy_fraction: Optional[float] = None
    queue_depth: Optional[int] = None
    published: Optional[int] = None
    inference_errors: Optional[int] = None
    publish_errors: Optional[int] = None
    dropped_on_resume: Optional[int] = None
    paused: Optional[bool] = None
    sources: Optional[Dict[str, Any]] = None  # per source: state and counters
    # The daemon's figures, as in telemetry (agent.daemon.Daemon._telemetry_extras).
    rss_mb: Optional[float] = None
    workers_rss_mb: Optional[Dict[str, Any]] = None
    total_rss_mb: Optional[float] = None
    npu_memory_mb: Optional[Dict[str, Any]] = None
    npu_chip: Optional[Dict[str, Any]] = None
    mqtt: Optional[Dict[str, Any]] = None
    commands: Optional[Dict[str, Any]] = None
    watchdog: Optional[Dict[str, Any]] = None
    # The last shadow run's report as it stands (agent.pipeline.shadow.ShadowRun.report), null when none.
    shadow: Optional[Dict[str, Any]] = None
    # Per source: its drift figures against its reference (agent.pipeline.drift.DriftWatch.report), null when off.
    drift: Optional[Dict[str, Any]] = None


def status_answer(device_id: str, **fields: Any) -> Dict[str, Any]:
    """The ``status`` verb's result for ``device_id`` (always ``online``: a box that answers is), as JSON-ready
    dict, built through :class:`StatusAnswer`: a name it does not have is a TypeError on the box. ``model_info``
    may be given as the dict :meth:`agent.pipeline.model.LoadedModel.describe` returns (read into a
    :class:`ModelInfo`: a key it lacks is a TypeError too)."""
    info = fields.get("model_info")
    if isinstance(info, dict):
        fields["model_info"] = ModelInfo(**info)
    if fields.get("ts") is None:
        fields["ts"] = time.time()
    fields.update(state=ONLINE, device_id=device_id, device=device_id)
    return to_dict(StatusAnswer(**fields))


def parse_status(body: Any) -> BoxStatus:
    """A retained status from its decoded JSON; raises :class:`ProtocolError` naming the field when malformed."""
    try:
        return parse(BoxStatus, body, "status", unknown="ignore")
    except ConfigError as exc:
        raise ProtocolError("status", exc) from None


def parse_status_answer(body: Any) -> StatusAnswer:
    """A ``status`` verb's result from its decoded JSON; :class:`ProtocolError` naming the field when malformed."""
    try:
        return parse(StatusAnswer, body, "status answer", unknown="ignore")
    except ConfigError as exc:
        raise ProtocolError("status answer", exc) from None
