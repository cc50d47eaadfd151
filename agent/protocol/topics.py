"""Topic names (docs/mqtt.md): built here and nowhere else, and read back here for what arrives.

``<prefix>/<device>/status`` (retained), ``.../results/<source>``, ``.../telemetry`` (``.../telemetry/alert``),
``.../events``, ``.../snapshot/<source>``, ``.../shadow`` (retained: the shadow run's report),
``.../ack/<request_id>``; commands on ``<prefix>/<device>/cmd/<verb>``
and ``<prefix>/group/<group>/cmd/<verb>``; the announce request on ``<prefix>/announce`` (every box) or a
group's ``cmd/announce``. Home Assistant's discovery topics (its birth topic, a sensor's config) are written here
too: a topic is built in this module whoever defined it.

Every other module builds a topic with a function of this module and reads a command topic with
:func:`read_command_topic`; no topic level is spelled anywhere else (tests/project/test_protocol_literals.py).
"""

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from agent.config.names import name_problem
from agent.protocol.envelope import group_target

GROUP = "group"  # the level that marks a group's topics: a device id cannot be this
CMD, ACK, STATUS, TELEMETRY, ALERT = "cmd", "ack", "status", "telemetry", "alert"
RESULTS, EVENTS, SNAPSHOT, SHADOW = "results", "events", "snapshot", "shadow"
# An operator's request that boxes publish their live status now (the inventory of agent/fleet): not a verb of
# the command protocol (no request id, no ack), so the broker's retained store is never needed to find a box.
ANNOUNCE = "announce"

# Home Assistant's MQTT discovery (agent.ops.discovery): its prefix, its birth topic and what it says there.
HA_PREFIX = "homeassistant"
HA_STATUS_TOPIC = HA_PREFIX + "/" + STATUS
HA_ONLINE = b"online"

__all__ = ["name_problem", "check_topic_names", "device_topic", "status_topic", "ack_topic", "result_topic",
           "telemetry_topic", "alert_topic", "events_topic", "snapshot_topic", "shadow_topic", "command_topic",
           "announce_topic",
           "command_subscriptions", "fleet_subscriptions", "split_device_topic", "CommandTopic",
           "read_command_topic", "command_verb", "ha_config_topic"]


def check_topic_names(names: Iterable[Tuple[str, Optional[str], bool]]) -> None:
    """Raise ValueError naming the first bad one of ``(label, value, levels)``; a None value is skipped."""
    for label, value, levels in names:
        if value is None:
            continue
        problem = name_problem(value, levels=levels)
        if problem is not None:
            raise ValueError("%s %s" % (label, problem))


def device_topic(prefix: str, device: str, *parts: str) -> str:
    """``<prefix>/<device>/<parts...>``."""
    return "/".join((prefix, device) + parts)


def status_topic(prefix: str, device: str) -> str:
    return device_topic(prefix, device, STATUS)


def ack_topic(prefix: str, device: str, request_id: str) -> str:
    return device_topic(prefix, device, ACK, request_id)


def result_topic(prefix: str, device: str, source: str) -> str:
    """Where a source's results go: ``<prefix>/<device>/results/<source>``."""
    return device_topic(prefix, device, RESULTS, source)


def telemetry_topic(prefix: str, device: str) -> str:
    return device_topic(prefix, device, TELEMETRY)


def alert_topic(prefix: str, device: str) -> str:
    """``<prefix>/<device>/telemetry/alert``: under telemetry, so one ``telemetry/#`` grant covers both."""
    return device_topic(prefix, device, TELEMETRY, ALERT)


def events_topic(prefix: str, device: str) -> str:
    return device_topic(prefix, device, EVENTS)


def snapshot_topic(prefix: str, device: str, source: str) -> str:
    """Where a ``snapshot`` command's JPEG of ``source`` goes: ``<prefix>/<device>/snapshot/<source>``."""
    return device_topic(prefix, device, SNAPSHOT, source)


def shadow_topic(prefix: str, device: str) -> str:
    """Where a shadow run's report goes (retained: progress while it runs, then its final report)."""
    return device_topic(prefix, device, SHADOW)


def command_topic(prefix: str, verb: str, device: Optional[str] = None, group: Optional[str] = None) -> str:
    """A command for one device, or for every device of ``group`` (exactly one of the two)."""
    if (device is None) == (group is None):
        raise ValueError("a command topic names a device or a group, not %s" % (
            "both" if device is not None else "neither"))
    if group is not None:
        return "/".join((prefix, GROUP, group, CMD, verb))
    return device_topic(prefix, str(device), CMD, verb)


def announce_topic(prefix: str, group: Optional[str] = None) -> str:
    """Where an operator asks for the boxes' live status: ``<prefix>/announce`` for every box (one level under
    the prefix: no device or group topic has that shape), or the ``announce`` command topic of ``group``."""
    return command_topic(prefix, ANNOUNCE, group=group) if group is not None else "/".join((prefix, ANNOUNCE))


def command_subscriptions(prefix: str, device: str, groups: Sequence[str]) -> List[str]:
    """What a box subscribes to: its own commands, those of each group it belongs to, the fleet's announce."""
    return ([device_topic(prefix, device, CMD, "#")] + ["/".join((prefix, GROUP, g, CMD, "#")) for g in groups]
            + [announce_topic(prefix)])


def fleet_subscriptions(prefix: str, status_only: bool = False) -> List[str]:
    """What a fleet view subscribes to: every box's retained status, then telemetry, alerts and its retained
    shadow report."""
    topics = [status_topic(prefix, "+")]
    if not status_only:
        topics += [telemetry_topic(prefix, "+"), alert_topic(prefix, "+"), shadow_topic(prefix, "+")]
    return topics


def split_device_topic(prefix: str, topic: str) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """``(device, rest)`` of a topic under ``<prefix>/<device>/``, or None (another prefix, a group topic)."""
    head = prefix.split("/")
    parts = topic.split("/")
    if parts[:len(head)] != head or len(parts) < len(head) + 2:
        return None
    device = parts[len(head)]
    if device == GROUP or not device:
        return None
    return device, tuple(parts[len(head) + 1:])


@dataclass(frozen=True)
class CommandTopic:
    """What a command topic says: the verb, and the group whose topic carried it (None: the box's own topic, or
    the fleet's announce)."""

    verb: str
    group: Optional[str] = None

    def target(self, device: str) -> str:
        """What a signature of this command names: the device, or ``group/<name>`` on a group's topic
        (:func:`agent.protocol.envelope.group_target`)."""
        return device if self.group is None else group_target(self.group)


def read_command_topic(prefix: str, device: str, groups: Iterable[str], topic: str) -> Optional[CommandTopic]:
    """The command a topic carries for ``device`` (``<prefix>/<device>/cmd/<verb>``), for one of its ``groups``
    (``<prefix>/group/<group>/cmd/<verb>``) or for every box (``<prefix>/announce``: verb :data:`ANNOUNCE`);
    None for any other topic (another device, a group it is not in, a verb with a ``/`` or none)."""
    if topic == announce_topic(prefix):
        return CommandTopic(ANNOUNCE)
    head = prefix.split("/")
    parts = topic.split("/")
    if parts[:len(head)] != head:
        return None
    rest = parts[len(head):]
    group: Optional[str] = None
    if len(rest) == 3 and rest[0] == device and rest[1] == CMD:
        verb = rest[2]
    elif len(rest) == 4 and rest[0] == GROUP and rest[2] == CMD and rest[1] in set(groups):
        verb, group = rest[3], rest[1]
    else:
        return None
    return CommandTopic(verb, group) if verb else None


def command_verb(prefix: str, device: str, groups: Iterable[str], topic: str) -> Optional[str]:
    """The verb of a command topic addressed to ``device`` or one of its ``groups`` (or :data:`ANNOUNCE` for the
    fleet's announce topic), else None (:func:`read_command_topic`'s verb)."""
    command = read_command_topic(prefix, device, groups, topic)
    return None if command is None else command.verb


def ha_config_topic(device: str, object_id: str) -> str:
    """The retained Home Assistant discovery topic of one sensor of box ``device``."""
    return "/".join((HA_PREFIX, "sensor", "atlas-edge-%s" % device, object_id, "config"))
