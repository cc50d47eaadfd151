"""Putting moved boxes back after an abort (``--rollback-on-abort``) or ``fleet cancel --revert``.

Which boxes moved is read from the boxes themselves, not from what the rollout believed when it stopped: every
box that was sent a deploy is followed until it settles. One seen serving the new bundle (pending or
confirmed, also one that timed out and confirmed late, or came back from offline on it) gets a ``rollback``
with the request id ``<rollout>.<device>.rollback``; one seen serving something else whose deploy has ended
needs nothing. The rollback request is journaled before it is sent, so a re-run after a kill sends the same
request id (answered from the box's record if it already ran) and finishes the job.
"""

from typing import TYPE_CHECKING, Any, Dict, Set

from agent.fleet.journal import RolloutState
from agent.fleet.plan import FAILED_OUTCOME, MALFORMED, ROLLED_BACK, request_id
from agent.protocol.messages import FAILED, FINAL_STATES, SUCCEEDED

if TYPE_CHECKING:  # the engine hands itself in; no import cycle at run time
    from agent.fleet.rollout import Rollout

SENT_STATE = "sent"
SETTLED_OUTCOMES = (FAILED_OUTCOME, ROLLED_BACK, MALFORMED)  # their deploy ended without moving the box


class Reverter:
    """Follows every box that was sent a deploy until it is back or known never to have moved."""

    def __init__(self, rollout: "Rollout", state: RolloutState) -> None:
        self.rollout = rollout
        self.state = state
        self.sha = rollout.sha
        self._sent: Set[str] = set()  # rollbacks this run has published

    def run(self) -> None:
        state, engine = self.state, self.rollout
        waiting = [d for d, b in sorted(state.boxes.items()) if b["sent_at"] is not None and
                   (b["revert"] or {}).get("state") not in (SUCCEEDED, FAILED, "nothing")]
        if not waiting:
            return
        engine.progress("following %d box(es) that were sent a deploy: each one on the new bundle is rolled back"
                        % len(waiting))
        engine._subscribe_acks(waiting)
        deadline = engine.monotonic() + engine.spec.revert_timeout_s
        while waiting and engine.monotonic() < deadline:
            for device in list(waiting):
                if self._step(device):
                    waiting.remove(device)
            state.save()
            if waiting:
                engine._pump(state)
        for device in waiting:
            revert = dict(state.boxes[device]["revert"] or {})
            revert.update(state="unknown" if not revert.get("request_id") else "timed_out",
                          error="not settled within --revert-timeout %.0f s (%s)" % (
                              engine.spec.revert_timeout_s, self._where(device)))
            state.set(device, revert=revert)
            engine.progress("  %-24s revert: %s" % (device, revert["error"]))
        state.save()

    def _send(self, device: str, rid: str) -> None:
        engine = self.rollout
        self._sent.add(device)
        engine.send(device, "rollback", {"request_id": rid,
                                         "reason": "rollout %s %s" % (engine.rollout_id, self.state.status)})

    def _where(self, device: str) -> str:
        view = self.rollout.view.boxes.get(device)
        if view is None:
            return "never heard"
        serving = view.serving
        return "%s, serving %s %s" % (view.state, serving.get("version"), serving.get("state"))

    def _step(self, device: str) -> bool:
        """One look at a box; True once it is settled (reverted, or never moved)."""
        state, engine = self.state, self.rollout
        box = state.boxes[device]
        revert = box["revert"] or {}
        view = engine.view.boxes.get(device)
        on_new = view is not None and view.online and view.serving.get("manifest_sha256") == self.sha
        if revert.get("state") == SENT_STATE:
            ack = engine.acks.get((device, revert["request_id"]))
            if ack is not None and ack.state in FINAL_STATES:
                return self._record(device, ack.state, ack.error.code + ": " + str(ack.error.message)
                                    if ack.error is not None else None, ack.result)
            if device not in self._sent:  # sent by a run that was killed: same request id, answered once
                self._send(device, revert["request_id"])
            return False
        deployed = box.get("deployed_at") is not None and box["outcome"] not in SETTLED_OUTCOMES
        if on_new or deployed:
            rid = request_id(engine.rollout_id, device, "rollback")
            state.set(device, revert={"request_id": rid, "state": SENT_STATE, "sent_at": engine.clock(),
                                      "to": None, "error": None})
            state.save()  # journaled before it is sent
            self._send(device, rid)
            return False
        if view is None or not view.online:
            return False  # may come back on the new model: followed until the deadline
        ended = box["outcome"] in SETTLED_OUTCOMES or any(
            ack.state in FINAL_STATES for (d, rid), ack in engine.acks.items() if d == device and
            rid == box["request_id"])
        if ended or engine.clock() - box["sent_at"] > engine.spec.step_timeout:
            state.set(device, revert={"request_id": None, "state": "nothing", "to": None,
                                      "error": None, "note": "never moved (%s)" % self._where(device)})
            return True
        return False

    def _record(self, device: str, outcome: str, error: Any, result: Any) -> bool:
        revert = dict(self.state.boxes[device]["revert"])
        model: Dict[str, Any] = (result or {}).get("model") if isinstance(result, dict) else None
        revert.update(state=outcome, error=error, finished_at=self.rollout.clock(),
                      to={k: model.get(k) for k in ("name", "version", "manifest_sha256")}
                      if isinstance(model, dict) else None)
        self.state.set(device, revert=revert)
        self.rollout.progress("  %-24s reverted: %s%s" % (device, outcome, " " + error if error else ""))
        return True

