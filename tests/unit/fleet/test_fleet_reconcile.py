"""The final check's reconciliation (agent/fleet/final.py), no broker: what a box's latest status says it serves
decides the outcome the report gives it."""

import pytest

from agent.fleet.final import reconcile
from agent.fleet.records import BoxRecord, BoxState, Outcome
from agent.fleet.status import BoxView, slots_view

NEW, OLD, OTHER = "2" * 64, "1" * 64, "e" * 64


def view(sha, state="confirmed", rollback=None, malformed=None):
    slots = {"serving": "a", "slots": {"a": {"name": "m", "version": {NEW: "2", OLD: "1"}.get(sha, "6"),
                                             "manifest_sha256": sha, "state": state}}}
    if rollback is not None:
        slots["last_rollback"] = rollback
    return BoxView("box", state=BoxState.ONLINE, slots=slots_view(slots), malformed=malformed)


def box(outcome):
    return BoxRecord(outcome=outcome, old={"name": "m", "version": "1", "manifest_sha256": OLD}, sent_at=1.0)


BACK = {"name": "m", "version": "2", "manifest_sha256": NEW, "reason": "crashed in probation"}


@pytest.mark.parametrize("outcome,seen,becomes", [
    (Outcome.CONFIRMED, view(OLD, rollback=BACK), Outcome.ROLLED_BACK),  # confirmed, crashed back
    (Outcome.CONFIRMED, view(OLD), Outcome.ROLLED_BACK),  # back on the old model, whatever the reason
    (Outcome.TIMED_OUT, view(NEW), Outcome.CONFIRMED),  # a late ack: it confirmed after all
    (Outcome.MALFORMED, view(NEW), Outcome.CONFIRMED),  # its next statuses were good
    (Outcome.FAILED, view(NEW), Outcome.CONFIRMED),  # reported failed, serves the new bundle
    (Outcome.TIMED_OUT, view(OLD, rollback=BACK), Outcome.ROLLED_BACK),  # it rolled back on its own
    (Outcome.CONFIRMED, view(OTHER), Outcome.FAILED),  # another manifest
    (Outcome.CONFIRMED, view(NEW), None),  # as judged
    (Outcome.FAILED, view(OLD), None),  # a failed deploy changed nothing
    (Outcome.TIMED_OUT, view(NEW, state="pending"), None),  # still in probation: not judged again
    (Outcome.TIMED_OUT, view(NEW, malformed="slots: not an object"), None),  # a malformed status says nothing
])
def test_the_final_check_gives_a_box_the_outcome_of_what_it_serves(outcome, seen, becomes):
    changes = reconcile(box(outcome), seen, NEW)
    assert (changes or {}).get("outcome") == becomes
    if becomes is not None:
        assert "judged %s" % outcome in changes["error"]
