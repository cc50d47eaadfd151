"""The final report of a rollout: every box the fleet knows, with its outcome, and the counts; the exit code."""

from typing import Any, Dict, List

from agent.fleet.journal import RolloutState
from agent.fleet.records import REACHED, Outcome, RevertState, RolloutStatus

# Exit codes of 'fleet rollout' (and 'fleet resume'), one per way a rollout can end (docs/fleet.md).
EXIT_COMPLETED = 0  # every box of the group confirmed (or already there)
EXIT_ABORTED = 1  # a threshold or the canary stopped it
EXIT_PARTIAL = 5  # it ran to its end, but some box failed, was offline, unseen or otherwise not reached
EXIT_PAUSED = 6  # paused after its canary, waiting for 'fleet resume'
EXIT_CANCELLED = 7  # stopped by 'fleet cancel'
EXIT_BY_STATUS = {RolloutStatus.COMPLETED: EXIT_COMPLETED, RolloutStatus.ABORTED: EXIT_ABORTED,
                  RolloutStatus.PARTIAL: EXIT_PARTIAL, RolloutStatus.PAUSED: EXIT_PAUSED,
                  RolloutStatus.CANCELLED: EXIT_CANCELLED}


def exit_code(status: str) -> int:
    return EXIT_BY_STATUS.get(status, EXIT_PARTIAL)


def report(state: RolloutState) -> Dict[str, Any]:
    """The JSON report: counts, the abort, and per box old/new version, outcome, timings, revert, what it serves
    at the end (``serving``), a gated rollout's shadow verdict (``shadow``), anomalies.

    States are given as their plain strings (what the state file holds).
    """
    record = state.record
    executed, failures = state.executed_and_failures()
    counts: Dict[str, int] = {}
    boxes: List[Dict[str, Any]] = []
    for device in sorted(state.boxes):
        box = state.boxes[device]
        outcome = box.outcome.value if box.outcome is not None else None
        counts[outcome or "in_flight"] = counts.get(outcome or "in_flight", 0) + 1
        sent = box.sent_at
        revert = box.revert
        boxes.append({
            "device": device, "wave": box.wave, "outcome": outcome, "error": box.error,
            "old_version": (box.old or {}).get("version"), "new_version": (box.new or {}).get("version"),
            "request_id": box.request_id if sent is not None else None,
            "attempts": box.attempt + 1 if sent is not None else 0,
            "deploy_s": round(box.deployed_at - sent, 3) if sent and box.deployed_at else None,
            "confirm_s": round((box.finished_at or sent) - sent, 3) if sent and box.outcome == Outcome.CONFIRMED
            else None,
            "reverted": revert.state == RevertState.SUCCEEDED if revert and revert.request_id else None,
            "revert": dict(revert.as_dict(), state=revert.state.value) if revert else None,
            "serving": box.serving,  # what it serves at the end, read by the final check (agent/fleet/final.py)
            "shadow": box.shadow,  # a gated rollout's shadow verdict and the figures it rests on (gate.py)
            "anomalies": list(box.anomalies)})
    not_reached = [b["device"] for b in boxes if b["outcome"] not in REACHED]
    return {"rollout_id": record.rollout_id, "spec": record.spec, "status": state.status.value,
            "abort": record.abort, "cancel": record.cancel, "started": record.started,
            "finished": record.finished, "shortfall": record.shortfall,
            "wall_s": round(record.finished - record.started, 3) if record.finished and record.started is not None
            else None,
            "runs": record.runs, "waves": record.waves, "counts": counts, "executed": executed,
            "failures": failures, "failure_rate": round(failures / executed, 4) if executed else 0.0,
            "not_reached": not_reached, "state_bytes_written": state.bytes_written, "boxes": boxes}
