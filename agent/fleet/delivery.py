"""Commands a box missed while it was away are sent again, under the same request id, once it is heard from.

A clean session loses what was published while the box was disconnected, and a broker node that dies fires no
last will (RabbitMQ), so an ``offline`` status cannot be what triggers the re-send. The trigger is the box
itself: a command that got no word at all on its ack topic (a box acks ``accepted`` the moment it reads a
command) while the box was heard from (a live status other than ``offline``, which a last will also is, an
answer to an announce, telemetry) at least
:data:`RESEND_AFTER_S` after the send was not received. It goes out again, dated and signed afresh by the
engine's ``send``; the request id keeps a box that did receive it from running it twice (it answers from its
record). Deploys (``rollout.py``) and rollbacks (``revert.py``) both go through :meth:`Delivery.missed`.

Hearing a box "after the send" is a reading of the operator's clock when the message is *read*, and the
operator reads behind the boxes: a 1,000-box run's operator was up to 3.3 s behind. A status a box published
before it read a command can be read seconds after the send, with the box's acks still queued behind it. That
is harmless for a re-send (the request id answers it); it is no proof that the box never read the command.
:class:`Barrier` gives that proof from the broker's own order instead of the clocks.
"""

import os
from typing import Dict, List, Optional, Tuple

from agent.fleet.intake import Intake
from agent.fleet.link import LinkError
from agent.protocol.messages import FINAL_STATES
from agent.protocol.topics import announce_topic

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


ECHO_WAIT_S = 30.0  # a broker that does not send the operator's own announce back by then: the clocks decide


class Barrier:
    """The moment from which anything read from a box was published after it read (or lost) every command sent
    before :meth:`start`.

    Two marked announces to the group, on a topic the operator also subscribes to. A broker passes messages on
    in the order it got them, and one connection's messages in the order they were sent: when the first mark
    comes back, every earlier command has been passed on to its box (or lost, the box away); the second mark is
    published :data:`RESEND_AFTER_S` later (time for a box to read what its socket holds) and each box answers it
    with its status. Whatever a box says that is read after the second mark came back was published after it
    read the commands (its ``accepted`` ack comes first), and the mark's answers make sure it says something.
    A broker that refuses the subscription or sends nothing back within :data:`ECHO_WAIT_S` leaves
    :attr:`usable` False: the caller falls back on the clocks.
    """

    def __init__(self, intake: Intake) -> None:
        self.intake = intake
        self.topic = announce_topic(intake.spec.prefix, intake.spec.group)
        self.usable = True
        self.marked = float("-inf")  # monotonic time of the last mark (an announce: the group answers it)
        self._marks: List[Tuple[str, float]] = []  # (mark, monotonic time published)

    def start(self) -> None:
        try:
            self.intake.watch_echo(self.topic)
        except LinkError as exc:
            self._give_up("cannot read back the group's announce topic (%s)" % exc)
            return
        self._mark()

    def since(self) -> Optional[float]:
        """When the second mark came back (monotonic), or None while it has not (the marks go on here)."""
        if not self.usable or not self._marks:
            return None
        mark, at = self._marks[-1]
        echoed = self.intake.echoed.get(mark)
        now = self.intake.monotonic()
        if echoed is None:
            if now - at > ECHO_WAIT_S:
                self._give_up("the broker did not send the operator's own announce back within %.0f s" % ECHO_WAIT_S)
            return None
        if len(self._marks) == 2:
            return echoed
        if now - echoed >= RESEND_AFTER_S:
            self._mark()
        return None

    def _mark(self) -> None:
        mark = "%s.mark.%s" % (self.intake.rollout_id, os.urandom(4).hex())
        self.marked = self.intake.monotonic()
        self._marks.append((mark, self.marked))
        self.intake.link.publish(self.topic, {"ts": self.intake.clock(), "mark": mark})

    def _give_up(self, why: str) -> None:
        self.usable = False
        self.intake.progress("  %s: a box that never acked its deploy is judged by the clocks" % why)
