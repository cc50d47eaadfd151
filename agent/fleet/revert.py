"""Putting moved boxes back after an abort (``--rollback-on-abort``) or ``fleet cancel --revert``.

Which boxes moved is read from the boxes themselves, not from what the rollout believed when it stopped: every
box that was sent a deploy is followed until it settles. One seen serving the new bundle (pending or
confirmed, also one that timed out and confirmed late, or came back from offline on it) gets a ``rollback``
with the request id ``<rollout>.<device>.rollback``; one seen serving something else whose deploy has ended
needs nothing. The rollback request is journaled before it is sent, so a re-run after a kill sends the same
request id (answered from the box's record if it already ran) and finishes the job.
"""

from typing import Any, Callable, Dict, Optional, Set

from agent.fleet.intake import Intake
from agent.fleet.journal import RolloutState
from agent.fleet.plan import request_id
from agent.fleet.records import SETTLED_REVERTS, Outcome, Revert, RevertState, identity
from agent.protocol.messages import FINAL_STATES

SETTLED_OUTCOMES = (Outcome.FAILED, Outcome.ROLLED_BACK, Outcome.MALFORMED)  # their deploy ended, box unmoved
Send = Callable[[str, str, Dict[str, Any]], None]  # (device, verb, fields): one command, dated and signed


class Reverter:
    """Follows every box that was sent a deploy until it is back or known never to have moved.

    It reads what the boxes said from the ``intake`` (as :class:`agent.fleet.judge.Judge` does) and sends
    through ``send`` (the engine's, which dates and signs each command).
    """

    def __init__(self, intake: Intake, send: Send, state: RolloutState) -> None:
        self.intake = intake
        self.send = send
        self.state = state
        self.spec = intake.spec
        self.sha = intake.spec.sha256.lower()
        self._sent: Set[str] = set()  # rollbacks this run has published

    def run(self) -> None:
        state, intake = self.state, self.intake
        waiting = [d for d, b in sorted(state.boxes.items()) if b.sent_at is not None and
                   (b.revert is None or b.revert.state not in SETTLED_REVERTS)]
        if not waiting:
            return
        intake.progress("following %d box(es) that were sent a deploy: each one on the new bundle is rolled back"
                        % len(waiting))
        intake.subscribe_acks(waiting)
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
        self._sent.add(device)
        self.send(device, "rollback", {"request_id": rid,
                                       "reason": "rollout %s %s" % (self.intake.rollout_id, self.state.status)})

    def _where(self, device: str) -> str:
        view = self.intake.view.boxes.get(device)
        if view is None:
            return "never heard"
        serving = view.serving
        return "%s, serving %s %s" % (view.state, serving.get("version"), serving.get("state"))

    def _step(self, device: str) -> bool:
        """One look at a box; True once it is settled (reverted, or never moved)."""
        state, intake = self.state, self.intake
        box = state.boxes[device]
        revert = box.revert
        view = intake.view.boxes.get(device)
        on_new = view is not None and view.online and view.serving.get("manifest_sha256") == self.sha
        if revert is not None and revert.state == RevertState.SENT and revert.request_id is not None:
            ack = intake.acks.get((device, revert.request_id))
            if ack is not None and ack.state in FINAL_STATES:
                return self._record(device, RevertState(ack.state), ack.error.code + ": " + str(ack.error.message)
                                    if ack.error is not None else None, ack.result)
            if device not in self._sent:  # sent by a run that was killed: same request id, answered once
                self._send(device, revert.request_id)
            return False
        deployed = box.deployed_at is not None and box.outcome not in SETTLED_OUTCOMES
        if on_new or deployed:
            rid = request_id(intake.rollout_id, device, "rollback")
            state.set(device, revert=Revert(RevertState.SENT, request_id=rid, sent_at=intake.clock()))
            state.save()  # journaled before it is sent
            self._send(device, rid)
            return False
        if view is None or not view.online:
            return False  # may come back on the new model: followed until the deadline
        ended = box.outcome in SETTLED_OUTCOMES or any(
            ack.state in FINAL_STATES for (d, rid), ack in intake.acks.items() if d == device and
            rid == box.request_id)
        if ended or intake.clock() - (box.sent_at or 0.0) > self.spec.step_timeout:
            state.set(device, revert=Revert(RevertState.NOTHING, note="never moved (%s)" % self._where(device)))
            return True
        return False

    def _record(self, device: str, outcome: RevertState, error: Optional[str], result: Any) -> bool:
        model = (result or {}).get("model") if isinstance(result, dict) else None
        revert = self.state.boxes[device].revert or Revert(outcome)
        self.state.set(device, revert=Revert(**dict(
            revert.as_dict(), state=outcome, error=error, finished_at=self.intake.clock(),
            to=identity(model) if isinstance(model, dict) else None)))
        self.intake.progress("  %-24s reverted: %s%s" % (device, outcome, " " + error if error else ""))
        return True
