"""Commands a box missed while it was away are sent again, under the same request id, once it is heard from.

A clean session loses what was published while the box was disconnected, and a broker node that dies fires no
last will (RabbitMQ), so an ``offline`` status cannot be what triggers the re-send. The trigger is the box
itself: a command that got no word at all on its ack topic (a box acks ``accepted`` the moment it reads a
command) while the box was heard from (a live status other than ``offline``, which a last will also is, an
answer to an announce, telemetry) at least
:data:`RESEND_AFTER_S` after the send was not received. It goes out again, dated and signed afresh by the
engine's ``send``; the request id keeps a box that did receive it from running it twice (it answers from its
record). Deploys (``rollout.py``) and rollbacks (``revert.py``) both go through :meth:`Delivery.missed`.
"""

from typing import Dict, Tuple

from agent.fleet.intake import Intake
from agent.protocol.messages import FINAL_STATES

# A box acks a command within milliseconds of reading it; a box heard this long after the send without a word
# on its ack topic did not read it. Generous for a loaded broker: a needless re-send costs one message.
RESEND_AFTER_S = 2.0


class Delivery:
    """When each (device, request id) was last published this run, and whether it was missed since."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake
        self._sent: Dict[Tuple[str, str], float] = {}  # monotonic time of the last publish this run

    def sent(self, device: str, rid: str) -> None:
        self._sent[(device, rid)] = self.intake.monotonic()

    def was_sent(self, device: str, rid: str) -> bool:
        return (device, rid) in self._sent

    def unanswered(self, device: str, rid: str) -> bool:
        """Sent this run, no *final* ack since, and the box heard from :data:`RESEND_AFTER_S` after the send: for a
        rollback, whose answer (or the status after it) a broker may drop on the way to a slow operator
        (Mosquitto's ``max_queued_messages``); sent again, the box answers from its record."""
        at = self._sent.get((device, rid))
        ack = self.intake.acks.get((device, rid))
        if at is None or (ack is not None and ack.state in FINAL_STATES):
            return False
        heard = self.intake.heard.get(device)
        return heard is not None and heard - at >= RESEND_AFTER_S

    def missed(self, device: str, rid: str) -> bool:
        """Sent this run, no ack of any state since, and the box heard from :data:`RESEND_AFTER_S` after."""
        at = self._sent.get((device, rid))
        if at is None or (device, rid) in self.intake.acks:
            return False
        heard = self.intake.heard.get(device)
        return heard is not None and heard - at >= RESEND_AFTER_S
