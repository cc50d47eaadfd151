"""A box's retained status (``<prefix>/<device>/status``): one type, one builder, one reader.

:class:`BoxStatus` is the message. :func:`status_message` is the only code that builds one: the daemon's
``online`` (through the transport, which adds the state, the time and the broker), the transport's ``offline``
at a clean stop and the broker's last will (:mod:`agent.ops.connection`) all go through it, and it refuses a key
:class:`BoxStatus` does not have, so a new field is added to the type first and every reader knows it.
:func:`parse_status` is the operator's reader (``fleet``).

The device is named twice on purpose: ``device_id`` (the config's ``device_id``, also the topic's level) and
``device_kind`` (its ``device_configs/`` name, e.g. ``atlas-200dk``), which the fleet's pre-flight needs to
judge whether a bundle runs there. ``device`` is the id again, for readers from before ``device_id`` existed
(the wire has always carried the id there).
"""

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from agent.config.schema import ConfigError, parse, setting
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


STATUS_FIELDS = frozenset(f.name for f in dataclasses.fields(BoxStatus))


def status_message(state: str, device_id: str, **fields: Any) -> Dict[str, Any]:
    """The retained status of ``device_id`` in ``state`` (``online``/``offline``), as JSON-ready dict.

    ``fields`` are :class:`BoxStatus`'s other fields (``device_kind``, ``model``, ``groups``, ``slots``...);
    a name it does not have is a TypeError here, on the box, rather than a key no reader knows. ``ts`` defaults
    to now; ``device`` is always the id.
    """
    unknown = sorted(set(fields) - STATUS_FIELDS)
    if unknown:
        raise TypeError("not fields of a status (agent.protocol.status.BoxStatus): %s" % ", ".join(unknown))
    message = dict(fields)
    message.update(state=state, device_id=device_id, device=device_id)
    if message.get("ts") is None:
        message["ts"] = time.time()
    return message


def parse_status(body: Any) -> BoxStatus:
    """A retained status from its decoded JSON; raises :class:`ProtocolError` naming the field when malformed."""
    try:
        return parse(BoxStatus, body, "status", unknown="ignore")
    except ConfigError as exc:
        raise ProtocolError("status", exc) from None
