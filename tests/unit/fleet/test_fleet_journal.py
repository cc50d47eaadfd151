"""State files written before a box's record was typed still load, resume and finish their revert.

The files under ``tests/fixtures/fleet_journal/`` were written by the engine as of commit b965d60 (plain dicts,
string states; ``make_fixture.py`` there says how), each by a run that lost its broker in the middle: a
snapshot plus a journal. No broker here: the simulated link of ``fleet_link_support.py`` stands in for the boxes.
"""

import json
import os
import shutil

import pytest

from agent.fleet.journal import RolloutState
from agent.fleet.link import Message
from agent.fleet.plan import RolloutError, RolloutSpec
from agent.fleet.records import (
    BoxRecord,
    Outcome,
    Phase,
    Revert,
    RevertState,
    RevertWish,
    RolloutRecord,
    RolloutStatus,
)
from agent.fleet.report import report
from agent.fleet.rollout import Rollout
from tests.conftest import REPO_ROOT
from tests.support.fleet_link_support import SIM_PREFIX, SIM_SHA, SimulatedLink, _online

FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures", "fleet_journal")
ROLLOUT_ID = "ro-today"
NEW = {"name": "m", "version": "2", "manifest_sha256": SIM_SHA}
OLD = {"name": "m", "version": "1", "manifest_sha256": "a" * 64}


def _copy(name, directory):
    """The fixture's snapshot and journal in a fresh state directory (a run appends to them)."""
    os.makedirs(str(directory), exist_ok=True)
    for suffix in (".json", ".journal"):
        shutil.copy(os.path.join(FIXTURES, name, ROLLOUT_ID + suffix), str(directory))
    return os.path.join(str(directory), ROLLOUT_ID + ".json")


def _spec(**changes):
    """The spec the fixtures were started with (a resume must ask the same)."""
    return RolloutSpec(group="sim", bundle="b.tar.gz", sha256=SIM_SHA, prefix=SIM_PREFIX, canary=1, waves=2,
                       confirm_timeout_s=300.0, **changes)


def _serving(entry, state="confirmed"):
    return {"state": "online", "groups": ["sim"], "slots": {"serving": "b", "slots": {
        "a": dict(OLD, state="standby"), "b": dict(entry, state=state)}}}


class Boxes:
    """What the boxes answer: a deploy is confirmed at once, a rollback puts the old model back."""

    def __init__(self):
        self.sent = []  # (device, verb, request id) of every command

    def __call__(self, topic, payload):
        device, verb = topic.split("/")[1], topic.rsplit("/", 1)[1]
        if verb not in ("deploy", "rollback"):
            return []  # the announce: the statuses are already queued
        rid = payload["request_id"]
        self.sent.append((device, verb, rid))
        model = NEW if verb == "deploy" else OLD
        ack = {"request_id": rid, "verb": verb, "state": "succeeded", "result": {"model": model}}
        status = _serving(NEW) if verb == "deploy" else _online(device)
        return [Message("%s/%s/ack/%s" % (SIM_PREFIX, device, rid), json.dumps(ack).encode(), False),
                Message("%s/%s/status" % (SIM_PREFIX, device), json.dumps(status).encode(), True)]


def test_state_files_of_the_untyped_engine_load_as_typed_records(tmp_path):
    state = RolloutState.load(_copy("in_progress", tmp_path))
    assert all(type(box) is BoxRecord for box in state.boxes.values())
    assert state.status is RolloutStatus.RUNNING and state.revert is None and state.journaled == 10
    confirmed, deployed, retried, late = (state.boxes[d] for d in ("box-0", "box-1", "box-2", "box-6"))
    assert confirmed.outcome is Outcome.CONFIRMED and confirmed.phase is Phase.DONE and confirmed.new == NEW
    assert deployed.phase is Phase.DEPLOYED and deployed.outcome is None and deployed.deployed_at is not None
    assert (retried.phase, retried.attempt, retried.request_id) == (Phase.SENT, 1, "ro-today.box-2.deploy-r1")
    assert (late.wave, late.phase, late.old) == (3, Phase.PLANNED, OLD)  # journaled whole, after the plan
    assert state.boxes["box-5"].outcome is Outcome.NOT_TARGETED and state.boxes["box-9"].outcome is Outcome.UNSEEN
    # the rollout's own fields, typed too (the journal's {"t": ...} lines replayed onto them)
    record = state.record
    assert type(record) is RolloutRecord and record.rollout_id == ROLLOUT_ID and record.runs == 1
    assert record.waves == [["box-0"], ["box-1", "box-2"], ["box-3", "box-4"], ["box-6"]] and record.late_wave == 3
    assert (record.started, record.finished, record.abort, record.approved) == (1800000000.3, None, None, False)

    reverting = RolloutState.load(_copy("reverting", tmp_path / "reverting"))
    assert reverting.status is RolloutStatus.ABORTED and reverting.revert is RevertWish.WANTED
    assert reverting.record.abort["wave"] == 1 and reverting.record.finished == 1800000002.5
    assert reverting.boxes["box-1"].revert == Revert(RevertState.SENT, request_id="ro-today.box-1.rollback",
                                                     sent_at=reverting.boxes["box-1"].revert.sent_at)
    nothing = reverting.boxes["box-2"].revert
    assert nothing.state is RevertState.NOTHING and nothing.note.startswith("never moved")

    state.compact()  # written back in the typed engine's own form: the same strings, readable, and equal
    snapshot = json.load(open(state.path, encoding="utf-8"))
    assert snapshot["status"] == "running" and snapshot["boxes"]["box-2"]["phase"] == "sent"
    assert snapshot["late_wave"] == 3 and snapshot["waves"][-1] == ["box-6"] and snapshot["runs"] == 1
    again = RolloutState.load(state.path)
    assert again.boxes == state.boxes and again.record == state.record


def test_a_field_of_a_newer_version_is_kept_and_a_change_to_an_unknown_field_refused(tmp_path):
    path = _copy("in_progress", tmp_path)
    data = json.load(open(path, encoding="utf-8"))
    data["gate"] = {"window_s": 60}  # written by a later version
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    state = RolloutState.load(path)
    assert state.record.extra == {"gate": {"window_s": 60}}
    state.compact()
    assert json.load(open(path, encoding="utf-8"))["gate"] == {"window_s": 60}
    with pytest.raises(ValueError, match="no field 'gate'"):
        state.top(gate=None)
    state.top(status="aborted")  # a state given as its string becomes the member, journaled as the string
    assert state.status is RolloutStatus.ABORTED
    state.save()
    assert RolloutState.load(path).status is RolloutStatus.ABORTED


def test_an_in_progress_rollout_of_the_untyped_engine_resumes_where_it_stopped(tmp_path):
    path = _copy("in_progress", tmp_path)
    statuses = {"box-%d" % i: _online("box-%d" % i) for i in (1, 2, 3, 4, 6)}
    statuses["box-0"] = _serving(NEW)
    statuses["box-5"] = dict(_online("box-5"), groups=["other"])
    boxes = Boxes()
    link = SimulatedLink(statuses, answer=boxes, start=5000.0, offset=60.0 - 5000.0)  # a new process, later
    state = Rollout(_spec(), ROLLOUT_ID, str(tmp_path), link, clock=link.wall, monotonic=lambda: link.mono,
                    settle_s=0.3, inventory=["box-9"]).run()

    # the deploys still owed, under the request ids the first run journaled; the confirmed canary not again
    assert sorted(boxes.sent) == [("box-1", "deploy", "ro-today.box-1.deploy"),
                                  ("box-2", "deploy", "ro-today.box-2.deploy-r1"),
                                  ("box-3", "deploy", "ro-today.box-3.deploy"),
                                  ("box-4", "deploy", "ro-today.box-4.deploy"),
                                  ("box-6", "deploy", "ro-today.box-6.deploy")]
    assert state.status is RolloutStatus.PARTIAL and state.record.runs == 2  # box-9 was never heard
    assert state.outcomes() == {Outcome.CONFIRMED: 6, Outcome.NOT_TARGETED: 1, Outcome.UNSEEN: 1}
    result = report(RolloutState.load(path))
    assert result["status"] == "partial" and result["not_reached"] == ["box-9"]
    assert {b["device"]: b["attempts"] for b in result["boxes"] if b["outcome"] == "confirmed"}["box-2"] == 2


def test_a_revert_left_by_the_untyped_engine_is_finished_with_its_request_ids(tmp_path):
    _copy("reverting", tmp_path)
    statuses = {"box-%d" % i: _online("box-%d" % i) for i in (2, 3, 4, 6)}
    statuses.update({"box-0": _serving(NEW), "box-1": _serving(NEW, state="pending")})
    boxes = Boxes()
    link = SimulatedLink(statuses, answer=boxes, start=5000.0, offset=80.0 - 5000.0)
    state = Rollout(_spec(max_failures=0, rollback_on_abort=True), ROLLOUT_ID, str(tmp_path), link,
                    clock=link.wall, monotonic=lambda: link.mono, settle_s=0.3).run()

    assert sorted(boxes.sent) == [("box-0", "rollback", "ro-today.box-0.rollback"),
                                  ("box-1", "rollback", "ro-today.box-1.rollback")]  # no deploy after the abort
    assert state.status is RolloutStatus.ABORTED and state.revert is RevertWish.DONE
    for device in ("box-0", "box-1"):
        revert = state.boxes[device].revert
        assert revert.state is RevertState.SUCCEEDED and revert.to == OLD and revert.finished_at is not None
    assert state.boxes["box-2"].revert.state is RevertState.NOTHING  # settled by the first run: left alone
    reverted = {b["device"]: b["reverted"] for b in report(state)["boxes"]}
    assert reverted == {"box-0": True, "box-1": True, "box-2": None, "box-3": None, "box-4": None,
                        "box-5": None, "box-6": None}


@pytest.mark.parametrize("line, names", [
    ('{"b": "box-3", "f": {"phase": "flying"}}', "box 'box-3': 'flying' is not a valid Phase"),
    ('{"b": "box-3", "f": {"revert": {"state": "gone"}}}', "box 'box-3': 'gone' is not a valid RevertState"),
    ('{"b": "box-3", "f": {"colour": "red"}}', "box 'box-3': a box record has no field 'colour'"),
    ('{"t": {"status": "dancing"}}', "'dancing' is not a valid RolloutStatus"),
])
def test_a_state_no_enum_knows_is_a_damaged_file_named_with_the_box(tmp_path, line, names):
    path = _copy("in_progress", tmp_path)
    with open(path[:-len(".json")] + ".journal", "a", encoding="utf-8") as handle:
        handle.write(line + "\n" + '{"t": {"runs": 1}}\n')  # not the last line: not taken for a torn write
    with pytest.raises(RolloutError, match="is damaged") as caught:
        RolloutState.load(path)
    assert names in str(caught.value)
