"""Topic names (docs/mqtt.md): built here and nowhere else, and read back here for what arrives.

``<prefix>/<device>/status`` (retained), ``.../results/<source>``, ``.../telemetry`` (``.../telemetry/alert``),
``.../events``, ``.../snapshot/<source>``, ``.../ack/<request_id>``; commands on ``<prefix>/<device>/cmd/<verb>``
and ``<prefix>/group/<group>/cmd/<verb>``; the announce request on ``<prefix>/announce`` (every box) or a
group's ``cmd/announce``.
"""

from typing import Iterable, List, Optional, Sequence, Tuple

from agent.config.names import name_problem

GROUP = "group"  # the level that marks a group's topics: a device id cannot be this
CMD, ACK, STATUS, TELEMETRY, ALERT = "cmd", "ack", "status", "telemetry", "alert"
# An operator's request that boxes publish their live status now (the inventory of agent/fleet): not a verb of
# the command protocol (no request id, no ack), so the broker's retained store is never needed to find a box.
ANNOUNCE = "announce"

__all__ = ["name_problem", "check_topic_names", "device_topic", "status_topic", "ack_topic",
           "command_topic", "announce_topic", "command_subscriptions", "fleet_subscriptions", "split_device_topic",
           "command_verb"]


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
    """What a fleet view subscribes to: every box's retained status, then telemetry and alerts."""
    topics = [device_topic(prefix, "+", STATUS)]
    if not status_only:
        topics += [device_topic(prefix, "+", TELEMETRY), device_topic(prefix, "+", TELEMETRY, ALERT)]
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


def command_verb(prefix: str, device: str, groups: Iterable[str], topic: str) -> Optional[str]:
    """The verb of a command topic addressed to ``device`` or one of its ``groups`` (or :data:`ANNOUNCE` for the
    fleet's announce topic), else None."""
    if topic == announce_topic(prefix):
        return ANNOUNCE
    own = "%s/%s/%s/" % (prefix, device, CMD)
    group_head = "%s/%s/" % (prefix, GROUP)
    if topic.startswith(own):
        verb = topic[len(own):]
    elif topic.startswith(group_head):
        parts = topic[len(group_head):].split("/")
        if len(parts) != 3 or parts[1] != CMD or parts[0] not in set(groups):
            return None
        verb = parts[2]
    else:
        return None
    return verb if verb and "/" not in verb else None
