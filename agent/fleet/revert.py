"""Putting moved boxes back after an abort (``--rollback-on-abort``), ``fleet cancel --revert`` or ``fleet revert``.

Which boxes moved is read from the boxes themselves, never from the outcome the rollout gave them: every box
that was sent a deploy is followed until it is back or *proven unmoved*, whatever its outcome (``malformed``,
``failed``, ``timed_out``, a late ack, ``succeeded`` before its status showed the switch). A box

- whose latest status serves anything but the model it served at the plan (the new bundle pending or
  confirmed, another manifest) gets a ``rollback`` with the request id ``<rollout>.<device>.rollback``;
- whose deploy was answered ``succeeded`` after its latest status waits for a newer status (the group is asked
  to announce itself every :data:`ASK_EVERY_S`), and is rolled back when none comes within
  :data:`STATUS_WAIT_S` (half ``--revert-timeout`` if less): its own ack says it switched;
- is proven unmoved when a live, well-formed status serves its old model with nothing pending *and* its deploy
  is over: a final ack to it, or, when this run saw no ack to it at all, a word from the box read after the
  revert's barrier (:class:`agent.fleet.delivery.Barrier`: published after the box read, or lost, every
  deploy), never a clock: the operator reads seconds behind a large fleet, and a status the box published just
  before it read its deploy can arrive past the step timeout with its acks behind it. A box that acked its
  deploy (``accepted``, ``in_progress``) without a final answer is still running it, past any timeout (a late
  ack): it is followed until that answer or a status showing the switch (then rolled back), or until
  ``--revert-timeout``.

A rollback never goes to an unmoved box: with nothing pending a box's rollback restores its standby, an older
model. The rollback request is journaled before it is sent, so a re-run after a kill sends the same request id
(answered from the box's record if it already ran); one a box missed while away is sent again once it is heard
from (:mod:`agent.fleet.delivery`).
"""

from typing import Any, Callable, Dict, Optional

from agent.fleet.delivery import Barrier, Delivery
from agent.fleet.intake import Intake
from agent.fleet.journal import RolloutState
from agent.fleet.plan import request_id
from agent.fleet.records import SETTLED_REVERTS, BoxRecord, Revert, RevertState, identity
from agent.protocol.messages import FINAL_STATES, SUCCEEDED
from agent.protocol.requests import RollbackRequest
from agent.protocol.topics import announce_topic
from agent.protocol.verbs import ROLLBACK

ASK_EVERY_S = 5.0  # how often the group is asked to announce itself while a box's status is older than its ack
STATUS_WAIT_S = 10.0  # a box that said it switched and publishes no newer status is taken at its word then
Send = Callable[[str, str, Any, str], None]  # (device, verb, request, request id): one command, dated and signed


class Reverter:
    """Follows every box that was sent a deploy until it is back or proven never to have moved.

    It reads what the boxes said from the ``intake`` (as :class:`agent.fleet.judge.Judge` does) and sends
    through ``send`` (the engine's, which dates and signs each command).
    """

    def __init__(self, intake: Intake, send: Send, state: RolloutState, delivery: Delivery) -> None:
        self.intake = intake
        self.send = send
        self.state = state
        self.delivery = delivery
        self.spec = intake.spec
        self._asked = float("-inf")
        self._since: Dict[str, float] = {}  # device -> when this run began waiting for a status newer than its ack
        self.barrier = Barrier(intake)  # from when a box's word postdates every deploy sent before this pass

    def run(self) -> None:
        state, intake = self.state, self.intake
        waiting = [d for d, b in sorted(state.boxes.items()) if b.sent_at is not None and
                   (b.revert is None or b.revert.state not in SETTLED_REVERTS)]
        if not waiting:
            return
        intake.progress("following %d box(es) that were sent a deploy: each one that moved is rolled back"
                        % len(waiting))
        intake.subscribe_acks(waiting)
        self.barrier.start()  # after every deploy: no deploy is sent once the rollout stopped
        deadline = intake.monotonic() + self.spec.revert_timeout_s
        while waiting and intake.monotonic() < deadline:
            for device in list(waiting):
                if self._step(device):
                    waiting.remove(device)
            state.save()
            if waiting:
                intake.pump(state)
        for device in waiting:
            revert = state.boxes[device].revert or Revert(RevertState.UNKNOWN)
            error = "not settled within --revert-timeout %.0f s (%s)" % (self.spec.revert_timeout_s,
                                                                        self._where(device))
            state.set(device, revert=Revert(**dict(
                revert.as_dict(), state=RevertState.TIMED_OUT if revert.request_id else RevertState.UNKNOWN,
                error=error)))
            intake.progress("  %-24s revert: %s" % (device, error))
        state.save()

    def _send(self, device: str, rid: str) -> None:
        self.delivery.sent(device, rid)
        self.send(device, ROLLBACK, RollbackRequest(reason="rollout %s %s" % (self.intake.rollout_id,
                                                                          self.state.status)), rid)

    def _ask(self) -> None:
        """Ask the group to announce itself (at most every ASK_EVERY_S): a box that publishes no status of its
        own after a switch still answers this."""
        if self.intake.monotonic() - max(self._asked, self.barrier.marked) >= ASK_EVERY_S:  # a mark asks too
            self._asked = self.intake.monotonic()
            self.intake.link.publish(announce_topic(self.spec.prefix, self.spec.group),
                                     {"ts": self.intake.clock()})

    def _where(self, device: str) -> str:
        view = self.intake.view.boxes.get(device)
        if view is None:
            return "never heard"
        serving = view.serving
        return "%s, serving %s %s" % (view.state, serving.version if serving is not None else None,
                                      serving.state if serving is not None else None)

    def _step(self, device: str) -> bool:
        """One look at a box; True once it is settled (reverted, or proven never to have moved)."""
        state, intake = self.state, self.intake
        box = state.boxes[device]
        revert = box.revert
        if revert is not None and revert.state == RevertState.SENT and revert.request_id is not None:
            ack = intake.acks.get((device, revert.request_id))
            if ack is not None and ack.state in FINAL_STATES:
                return self._record(device, RevertState(ack.state), ack.error.code + ": " + str(ack.error.message)
                                    if ack.error is not None else None, ack.result)
            self._ask()  # an unanswered rollback: the box's answer to the announce shows it is there
            if not self.delivery.was_sent(device, revert.request_id) or \
                    self.delivery.unanswered(device, revert.request_id):
                if self.delivery.was_sent(device, revert.request_id):
                    intake.progress("  %-24s heard from again: rollback sent again" % device)
                self._send(device, revert.request_id)  # same request id: a box that ran it answers once
            return False
        moved = self._moved(device, box)
        if moved:
            rid = request_id(intake.rollout_id, device, ROLLBACK)
            state.set(device, revert=Revert(RevertState.SENT, request_id=rid, sent_at=intake.clock()))
            state.save()  # journaled before it is sent
            self._send(device, rid)
            return False
        if moved is None:
            return False
        view = intake.view.boxes[device]
        state.set(device, revert=Revert(RevertState.NOTHING, to=identity(view.serving or {}),
                                        note="never moved (%s)" % self._where(device)))
        return True

    def _moved(self, device: str, box: BoxRecord) -> Optional[bool]:
        """True: it serves something else than at the plan; False: proven unmoved; None: not known yet."""
        intake = self.intake
        view = intake.view.boxes.get(device)
        old = (box.old or {}).get("manifest_sha256")
        serving = view.serving if view is not None else None
        if serving is not None and serving.manifest_sha256 != old:
            return True  # its latest status (also a last will's kept slots) shows it moved
        switched = [at for (d, rid), at in intake.acked_at.items() if d == device and
                    intake.acks[(d, rid)].state == SUCCEEDED and not rid.endswith("." + ROLLBACK)]
        heard = intake.status_heard.get(device)
        if switched and (heard is None or heard < max(switched)):
            self._ask()
            since = self._since.setdefault(device, intake.monotonic())
            waited = intake.monotonic() - since
            return True if waited >= min(STATUS_WAIT_S, self.spec.revert_timeout_s / 2) else None  # or a status
        if view is None or not view.online or view.malformed or heard is None or view.pending:
            if view is not None and view.online and heard is None:
                self._ask()
            return None
        rid = box.request_id or ""
        ack = intake.acks.get((device, rid))
        if ack is not None:  # it read the deploy: it runs until its final answer, however late (never the timeout)
            return False if ack.state in FINAL_STATES else None
        return self._never_read(device, box)

    def _never_read(self, device: str, box: BoxRecord) -> Optional[bool]:
        """No word on its ack topic: False (unmoved) once it spoke after its deploy had certainly reached it.

        Not when it was heard a while after the send, nor past the step timeout: the operator reads behind the
        boxes, and a status published before the box read its deploy can be read after both with the box's
        acks still queued behind it (:class:`agent.fleet.delivery.Barrier`). Without the barrier (a broker that
        does not echo), the clocks: heard ``RESEND_AFTER_S`` after the send (``Delivery.missed``), or past the
        step timeout."""
        intake = self.intake
        since = self.barrier.since()
        if since is not None:
            if intake.heard.get(device, float("-inf")) >= since:
                return False
            self._ask()  # it missed the mark's announce (away): asked again
            return None
        if self.barrier.usable:
            return None
        rid = box.request_id or ""
        ended = self.delivery.missed(device, rid) or intake.clock() - (box.sent_at or 0.0) > self.spec.step_timeout
        return False if ended else None

    def _record(self, device: str, outcome: RevertState, error: Optional[str], result: Any) -> bool:
        model = (result or {}).get("model") if isinstance(result, dict) else None
        revert = self.state.boxes[device].revert or Revert(outcome)
        self.state.set(device, revert=Revert(**dict(
            revert.as_dict(), state=outcome, error=error, finished_at=self.intake.clock(),
            to=identity(model) if isinstance(model, dict) else None)))
        self.intake.progress("  %-24s reverted: %s%s" % (device, outcome, " " + error if error else ""))
        return True
