"""The box's events (``<prefix>/<device>/events``): every name an event's ``event`` field can hold, in one enum.

The lifecycle (swap, recovery, the model manager), the serving loop, the daemon (which republishes its retained
status after a slot event) and the metrics endpoint (which counts swaps and rollbacks) all name an event by a
member of :class:`Event`, never by a literal (tests/project/test_protocol_literals.py). A member *is* its string
(``Event.SWITCHED == "switched"``); :func:`event_message` writes the plain value into the message, so the JSON
on the wire, the log lines and a reader's comparisons are what they were before the enum existed.
"""

from enum import Enum
from typing import Any, Dict

EVENT_KEY = "event"  # the field of an event message that names it


class Event(str, Enum):
    """What happened, as an event message's ``event`` field says it (docs/mqtt.md, "Events")."""

    SWITCHED = "switched"  # a model started serving (state pending: its observation window opened)
    CONFIRMED = "confirmed"  # the pending model passed its window
    ROLLBACK = "rollback"  # back to the confirmed model (trigger: operator, latency, errors, restart)
    SLOTS_RESET = "slots_reset"  # the slot table was unusable at start: moved aside, started from model.bundle
    BUNDLE_MOVED_ASIDE = "bundle_moved_aside"  # a slot's bundle failed verification at start: set aside
    INFERENCE_ERROR = "inference_error"  # a backend call failed (the serving loop goes on)

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:  # 3.11 would format the member's name ("Event.SWITCHED")
        return format(str(self.value), spec)


# After these the daemon republishes its retained status: they change what the slots say.
SLOT_EVENTS = (Event.SWITCHED, Event.CONFIRMED, Event.ROLLBACK)


def event_message(event: Event, **fields: Any) -> Dict[str, Any]:
    """An event message: ``{"event": <name>, **fields}`` with the name as a plain string (the daemon adds ``ts``)."""
    if not isinstance(event, Event):
        raise TypeError("an event is named by agent.protocol.events.Event, not %r" % (event,))
    message: Dict[str, Any] = {EVENT_KEY: event.value}
    message.update(fields)
    return message


def event_of(message: Dict[str, Any]) -> Any:
    """The :class:`Event` an event message names, or None (a name this version does not know, no name)."""
    try:
        return Event(message.get(EVENT_KEY))
    except ValueError:
        return None
