"""The final check: what each box serves once the rollout (and its revert) is over, read from the boxes.

Outcomes are judged as answers arrive, and a box can change after its wave was judged: it crashes in its
probation and comes back on the old model, rolls back on its own, confirms after a late ack, corrects a
malformed status. So before a rollout reports, it waits until :data:`GRACE_S` has passed since the last
outcome, asks the group to announce itself, and reads, for up to :data:`WAIT_S`, until each box that was sent
a command has been heard from since (an answer, a status of its own, telemetry) and is settled: no deploy of
its still running (an ack short of final: a late one) and nothing pending in its slot table. Every box's record
then gets ``serving``: what its latest status says it serves (``version``, ``manifest_sha256``, slot ``state``,
the box's ``state``, ``heard``: whether it spoke after the check began, and ``settled``). An executed box that
was not reverted has its outcome reconciled with it (:func:`reconcile`); the rollout's status and exit code
follow.
"""

from typing import Any, Dict, Optional

from agent.fleet.intake import Intake
from agent.fleet.journal import RolloutState
from agent.fleet.records import FAILURES, BoxRecord, Outcome, RevertState, identity
from agent.fleet.status import SLOT_CONFIRMED, BoxView
from agent.protocol.messages import FINAL_STATES
from agent.protocol.topics import announce_topic

GRACE_S = 2.0  # after the last outcome: a box that confirmed and crashed in probation is back by then
WAIT_S = 15.0  # the most the check waits for the boxes that were sent a command to speak again and settle
# Outcomes the final check may correct; not ``duplicate``: two boxes answer as that id, its status is either's
JUDGED_AGAIN = tuple(o for o in FAILURES if o != Outcome.DUPLICATE) + (Outcome.CONFIRMED, Outcome.ABORTED,
                                                                      Outcome.CANCELLED)


def serving_now(view: Optional[BoxView], heard: bool, settled: bool) -> Optional[Dict[str, Any]]:
    """What a box serves according to its latest status (None: never heard, or no slot table known)."""
    serving = view.serving if view is not None else None
    if view is None or serving is None:
        return None
    return dict(identity(serving), state=serving.state, box=view.state.value, heard=heard, settled=settled)


def reconcile(box: BoxRecord, view: BoxView, sha: str) -> Optional[Dict[str, Any]]:
    """The changes that make an executed box's outcome say what it serves; None when it already does."""
    serving = view.serving
    if view.malformed is not None or serving is None:
        return None
    on = serving.manifest_sha256
    old = (box.old or {}).get("manifest_sha256")
    was = box.outcome
    if on == sha and serving.state == SLOT_CONFIRMED and was != Outcome.CONFIRMED:
        return {"outcome": Outcome.CONFIRMED, "new": identity(serving),
                "error": "judged %s, serves the new bundle confirmed at the final check (%s)" % (was, box.error)}
    rollback = view.last_rollback or {}
    if on != sha and on == old and (was == Outcome.CONFIRMED or (
            rollback.get("manifest_sha256") == sha and rollback != box.baseline_rollback and was in
            (Outcome.TIMED_OUT, Outcome.MALFORMED, Outcome.ABORTED, Outcome.CANCELLED))):
        why = rollback.get("reason") if rollback != box.baseline_rollback else None
        return {"outcome": Outcome.ROLLED_BACK, "error": "judged %s, serves %s again at the final check%s" % (
            was, serving.version, ": %s" % why if why else "")}
    if on not in (sha, old) and was != Outcome.FAILED:
        return {"outcome": Outcome.FAILED, "error": "wrong_bundle: judged %s, serves manifest %s at the final "
                "check" % (was, on)}
    return None


class FinalCheck:
    """Reads every box once more at the end; see the module docstring."""

    def __init__(self, intake: Intake, state: RolloutState) -> None:
        self.intake = intake
        self.state = state
        self.sha = intake.spec.sha256.lower()

    def run(self) -> None:
        state, intake = self.state, self.intake
        sent = [d for d, b in state.boxes.items() if b.sent_at is not None]
        if sent:
            last = max(state.boxes[d].finished_at or 0.0 for d in sent)
            settle = intake.monotonic() + max(0.0, min(GRACE_S, GRACE_S - (intake.clock() - last)))
            while intake.monotonic() < settle:
                intake.pump(state)
            start = intake.monotonic()
            intake.link.publish(announce_topic(intake.spec.prefix, intake.spec.group), {"ts": intake.clock()})
            quiet = set(sent)
            while quiet and intake.monotonic() - start < WAIT_S:
                intake.pump(state)
                quiet = {d for d in quiet if not self._settled(d, start)}
            if quiet:
                intake.progress("final check: %d box(es) not heard or not settled within %.0f s (their last status "
                                "is reported): %s" % (len(quiet), WAIT_S, ", ".join(sorted(quiet)[:10])))
        else:
            quiet, start = set(), intake.monotonic()
        for device, box in state.boxes.items():
            view = intake.view.boxes.get(device)
            changes: Dict[str, Any] = {}
            reverted = box.revert is not None and box.revert.state != RevertState.NOTHING
            if view is not None and box.sent_at is not None and box.outcome in JUDGED_AGAIN and not reverted:
                changes = reconcile(box, view, self.sha) or {}
                if changes:
                    intake.progress("  %-24s final check: %s" % (device, changes["error"]))
            serving = serving_now(view, intake.heard.get(device, float("-inf")) >= start, device not in quiet)
            serving = self._rolled_back_since(device, box, serving) or serving
            if changes or serving != box.serving:
                state.set(device, serving=serving, **changes)
        state.save()

    def _rolled_back_since(self, device: str, box: BoxRecord, serving: Optional[Dict[str, Any]]
                           ) -> Optional[Dict[str, Any]]:
        """What a box went back to, when its rollback's success came after its latest status: the status it
        published after the rollback was lost (a broker drops QoS 1 messages past a slow subscriber's queue:
        Mosquitto's max_queued_messages), and a box that does not answer an announce sends no other. A
        rollback leaves the model it restores confirmed."""
        revert = box.revert
        if revert is None or revert.state != RevertState.SUCCEEDED or not revert.to or serving is None:
            return None
        acked = self.intake.acked_at.get((device, revert.request_id or ""))
        if acked is None or self.intake.status_heard.get(device, float("-inf")) > acked:
            return None
        return dict(serving, **dict(identity(revert.to), state=SLOT_CONFIRMED))

    def _settled(self, device: str, start: float) -> bool:
        """Heard since the check began, no deploy of its running, nothing pending in its slot table."""
        intake = self.intake
        if intake.heard.get(device, float("-inf")) < start:
            return False
        box = self.state.boxes[device]
        ack = intake.acks.get((device, box.request_id or ""))
        if ack is not None and ack.state not in FINAL_STATES:
            return False
        view = intake.view.boxes.get(device)
        return view is None or not view.pending
