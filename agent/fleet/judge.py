"""Judging one box in flight from what it said: its acks (deployed, failed, retry) and its status; timeouts.

Outcomes are read from the box's own word only (the intake keeps acks by device and request id). A success
naming another manifest fails at once (``wrong_bundle``), as does a status serving one after the deploy;
``busy`` and ``interrupted`` are retried with backoff under a new request id; silence for the step timeout
(progress restarts it) or no confirmation within ``--confirm-timeout`` of the deploy is ``timed_out``.

The abort rules (:func:`abort_reason`) judge the outcomes so far. The failure rate is not judged on the outcomes
alone: failures come first (a refused download answers in seconds, a confirmation waits out the observation
window), so the first outcomes of a wave are mostly failures whatever the fleet's real share. The rate is
failures over every box sent a deploy (boxes in flight included): the lowest rate the boxes sent so far can
end with, so it fires only when the limit is certainly exceeded. And it is judged only on a minimum sample of
outcomes: ``--min-executed``, and never fewer than the canary's size.
"""

from dataclasses import asdict
from typing import Any, Dict, Optional

from agent.fleet.intake import Intake, one_line
from agent.fleet.journal import RolloutState
from agent.fleet.plan import RETRY_BASE_S, RETRYABLE, RolloutSpec, deploy_verb, request_id
from agent.fleet.records import EXECUTED, FAILURES, Outcome, Phase, identity
from agent.fleet.status import SLOT_PENDING
from agent.protocol.messages import FINAL_STATES, SUCCEEDED, Ack, ProtocolError, parse_deploy_result

ALREADY_SERVING = "already_serving"  # the box's error code for a deploy of what it serves


def abort_reason(spec: RolloutSpec, outcomes: Dict[Outcome, int], in_flight: int = 0) -> Optional[str]:
    """Why the rollout must stop now, or None: which rule fired, on how many outcomes (see the module doc).

    AWS IoT Jobs' abort criteria, per failure type and overall; ``in_flight``: boxes sent a deploy and not
    judged yet.
    """
    executed = sum(n for o, n in outcomes.items() if o in EXECUTED)
    failures = sum(n for o, n in outcomes.items() if o in FAILURES)
    for outcome, limit in sorted(spec.max_per_type.items()):
        if outcomes.get(outcome, 0) > limit:
            return "--max-per-type rule: %d box(es) %s of %d outcome(s), more than %s=%d" % (
                outcomes[outcome], outcome, executed, outcome, limit)
    if spec.max_failures is not None and failures > spec.max_failures:
        return "--max-failures rule: %d failure(s) of %d outcome(s), more than --max-failures %d" % (
            failures, executed, spec.max_failures)
    sample = max(spec.min_executed, spec.canary, 1)
    if spec.max_failure_rate is not None and executed >= sample:
        rate = failures / (executed + in_flight)
        if rate > spec.max_failure_rate:
            return "failure rate %.3f above --max-failure-rate %.3f: %d failed of %d box(es) sent a deploy " \
                   "(%d outcome(s), at least %d needed; %d in flight counted as not failed)" % (
                       rate, spec.max_failure_rate, failures, executed + in_flight, executed, sample, in_flight)
    return None


class Judge:
    """Advances boxes in flight; the intake holds what they said and the clocks their steps run on."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake
        self.spec = intake.spec
        self.sha = intake.spec.sha256.lower()

    def judge(self, state: RolloutState, device: str) -> bool:
        """Advance one box from what its acks and status say; True once it has an outcome."""
        box = state.boxes[device]
        if box.phase == Phase.DONE:
            return True
        ack = self.intake.acks.get((device, box.request_id or ""))
        if ack is not None and box.phase == Phase.SENT and ack.state in FINAL_STATES:
            done = self._ack(state, device, ack)
            if done is not None:
                return done
        view = self.intake.view.boxes.get(device)
        if view is not None and view.malformed:
            return self.intake.finish(state, device, Outcome.MALFORMED, view.malformed)
        if view is not None and box.phase in (Phase.SENT, Phase.DEPLOYED):
            serving = view.serving
            on = serving.manifest_sha256 if serving is not None else None
            if view.serves_confirmed(self.sha):
                return self.intake.finish(state, device, Outcome.CONFIRMED, None, new=box.new or identity(serving))
            rollback = view.last_rollback
            if rollback and rollback != box.baseline_rollback and rollback.get("manifest_sha256") == self.sha:
                return self.intake.finish(state, device, Outcome.ROLLED_BACK, one_line(rollback.get("reason")))
            old = (box.old or {}).get("manifest_sha256")
            if box.phase == Phase.DEPLOYED and view.online and on not in (self.sha, old):
                return self.intake.finish(state, device, Outcome.FAILED, "wrong_bundle: its status serves manifest "
                                          "%s, not %s" % (on, self.sha))
        return self._timed_out(state, device, view)

    def _ack(self, state: RolloutState, device: str, ack: Ack) -> Optional[bool]:
        """A final deploy ack: deployed (None: judge on), failed, retried, or malformed."""
        box = state.boxes[device]
        if ack.state == SUCCEEDED:
            try:
                model = parse_deploy_result(ack).model
            except ProtocolError as exc:
                return self.intake.finish(state, device, Outcome.MALFORMED, "deploy ack: %s" % exc)
            if model.manifest_sha256 not in (None, self.sha):
                return self.intake.finish(state, device, Outcome.FAILED, "wrong_bundle: its ack names manifest "
                                          "%s, not %s" % (model.manifest_sha256, self.sha))
            state.set(device, phase=Phase.DEPLOYED, deployed_at=self.intake.clock(), new=asdict(model))
            self.intake.anchor[device] = self.intake.monotonic()
            return None
        error = ack.error
        code = error.code if error is not None else "?"
        if code == ALREADY_SERVING:  # a retry after the box confirmed: judged by its status
            return None
        if code in RETRYABLE and box.attempt < self.spec.retries:
            attempt = box.attempt + 1
            backoff = RETRY_BASE_S * 2 ** (attempt - 1)
            rid = request_id(self.intake.rollout_id, device, deploy_verb(attempt))
            state.set(device, attempt=attempt, request_id=rid,
                      error="%s; retry %d in %.0f s" % (code, attempt, backoff))
            self.intake.subscribe_acks([device])
            self.intake.retry_at[device] = self.intake.monotonic() + backoff
            self.intake.anchor[device] = self.intake.monotonic() + backoff
            self.intake.progress("  %-24s %s: retry %d/%d in %.0f s" % (device, code, attempt,
                                                                        self.spec.retries, backoff))
            return False
        return self.intake.finish(state, device, Outcome.FAILED, one_line("%s: %s" % (
            code, error.message if error is not None else "")))

    def _timed_out(self, state: RolloutState, device: str, view: Any) -> bool:
        box = state.boxes[device]
        if box.sent_at is None:
            return False
        anchor = self.intake.anchor.get(device)
        if anchor is None:  # sent by an earlier run: only its wall time is known, read once
            since = box.deployed_at if box.phase == Phase.DEPLOYED and box.deployed_at else box.sent_at
            anchor = self.intake.monotonic() - max(0.0, self.intake.clock() - since)
            self.intake.anchor[device] = anchor
        limit = self.spec.confirm_timeout_s if box.phase == Phase.DEPLOYED else self.spec.step_timeout
        if self.intake.monotonic() - anchor <= limit:
            return False
        where = "offline" if view is not None and not view.online else (
            "pending" if view is not None and view.holds(self.sha) == SLOT_PENDING else box.phase)
        step = "confirmed" if box.phase == Phase.DEPLOYED else "heard from"
        return self.intake.finish(state, device, Outcome.TIMED_OUT, "not %s within %.0f s (last seen: %s)" % (
            step, limit, where))
