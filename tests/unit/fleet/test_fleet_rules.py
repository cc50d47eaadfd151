"""The operator's rules on messages built here (no broker): the failure-rate rule over a minimum sample, every
unparseable status ``malformed``, duplicate device ids seen through the one retained status topic per id, and
a state file whose fields have the wrong types refused as damaged (issue 30, items 5, 6, 7 and 9)."""

import json
import os
import shutil

import pytest

from agent.fleet.journal import RolloutState
from agent.fleet.judge import abort_reason
from agent.fleet.link import Message
from agent.fleet.plan import RolloutError, RolloutSpec
from agent.fleet.records import BoxState
from agent.fleet.status import SOURCES_KEPT, FleetView, render_table
from agent.protocol.status import SlotsView, SlotView
from tests.conftest import REPO_ROOT

FIXTURE = os.path.join(REPO_ROOT, "tests", "fixtures", "fleet_journal", "in_progress")
SPEC = {"group": "g", "bundle": "b", "sha256": "a" * 64}


def test_fast_failures_after_the_canary_do_not_abort_a_fleet_whose_share_is_within_the_rate():
    # The run: a 10-box canary confirmed, then 190 sent; the first 10 outcomes are fast failures.
    spec = RolloutSpec(canary=10, max_failure_rate=0.05, **SPEC)
    assert abort_reason(spec, {"confirmed": 10, "failed": 10}, in_flight=180) is None  # 10 of 200 sent: 0.050
    reason = abort_reason(spec, {"confirmed": 10, "failed": 11}, in_flight=179)  # certainly above now
    assert reason.startswith("failure rate 0.055 above --max-failure-rate 0.050: 11 failed of 200 box(es) sent")
    assert "21 outcome(s), at least 10 needed; 179 in flight" in reason
    # Never judged on fewer outcomes than the canary's size (nor --min-executed): 9 fast failures wait.
    assert abort_reason(spec, {"failed": 9}, in_flight=0) is None
    assert abort_reason(RolloutSpec(canary=2, min_executed=12, max_failure_rate=0.05, **SPEC),
                        {"failed": 11}) is None
    assert "11 failed of 11" in abort_reason(RolloutSpec(canary=2, min_executed=11, max_failure_rate=0.05, **SPEC),
                                             {"failed": 11})


def test_an_abort_says_which_rule_fired_on_how_many_outcomes():
    count = RolloutSpec(max_failures=1, **SPEC)
    assert abort_reason(count, {"confirmed": 5, "failed": 1, "rolled_back": 1}) == \
        "--max-failures rule: 2 failure(s) of 7 outcome(s), more than --max-failures 1"
    typed = RolloutSpec(max_per_type={"timed_out": 0}, **SPEC)
    assert abort_reason(typed, {"confirmed": 5, "timed_out": 1}) == \
        "--max-per-type rule: 1 box(es) timed_out of 6 outcome(s), more than timed_out=0"


def status(device, groups, state="online", kind="cpu-dev", retain=False, **fields):
    body = dict(fields, state=state, device_id=device, device=device, device_kind=kind, ts=1.8e9, groups=groups)
    return Message("site/%s/status" % device, json.dumps(body).encode(), retain)


@pytest.mark.parametrize("payload, why", [
    (b"[1, 2]", "expected a mapping"),
    (b"{" * 33 + b"}" * 33, "nested deeper than 32"),
    (b"not json", "not JSON"),
    (json.dumps({"state": "online", "groups": "g", "slots": []}).encode(), "groups"),
    (json.dumps({"state": 5}).encode(), "state"),
    (json.dumps({"state": "rebooting"}).encode(), "'rebooting' is not online or offline"),  # parses, no groups
])
def test_every_unparseable_status_is_malformed_and_stays_in_its_recorded_group(payload, why):
    view = FleetView("site")
    view.known_groups["cam"] = ["g"]  # the operator's record lists it in g
    view.apply(Message("site/cam/status", payload, True))
    box = view.boxes["cam"]
    assert box.state == BoxState.MALFORMED and why in box.malformed, box.malformed
    assert [b.device for b in view.in_group("g")] == ["cam"]  # reported in g (malformed), never not_targeted


def test_the_view_reads_a_status_through_its_types():
    view = FleetView("site")
    slots = {"serving": "b", "slots": {"a": {"name": "m", "version": "1", "manifest_sha256": "a" * 64,
                                             "state": "standby"},
                                       "b": {"name": "m", "version": "2", "manifest_sha256": "b" * 64,
                                             "state": "pending", "shiny": "a newer box's key"}, "c": None}}
    view.apply(status("cam", ["g"], slots=slots, telemetry_interval_s=5))
    box = view.boxes["cam"]
    assert box.state is BoxState.ONLINE and box.online and box.telemetry_interval_s == 5.0
    assert type(box.slots) is SlotsView and type(box.serving) is SlotView and box.serving.version == "2"
    assert box.pending and box.holds("a" * 64) == "standby" and not box.serves_confirmed("b" * 64)
    assert box.as_dict()["state"] == "online" and box.as_dict()["serving"]["state"] == "pending"
    view.apply(status("cam", ["g"], state="offline"))  # a will without slots keeps the last table known
    assert box.state is BoxState.OFFLINE and box.serving.version == "2"
    view.apply(status("cam", ["g"], state="asleep"))  # neither online nor offline: not a state of the protocol
    assert box.state is BoxState.MALFORMED and "'asleep' is not online or offline" in box.malformed
    assert "1 malformed" in render_table([box])


def test_telemetry_keeps_each_sources_health_short_and_typed():
    view = FleetView("site")
    sources = {"cam%02d" % i: {"state": "up", "fps_in": 5.0, "frames": 10} for i in range(SOURCES_KEPT + 8)}
    sources.update({"cam00": {"state": "stalled", "fps_in": float("nan"), "last_error": {"message": "x" * 500}},
                    "cam01": "not a report", "cam02": {"state": 7, "last_error": "not an object"}})
    view.apply(Message("site/cam/telemetry", json.dumps({"ts": 1.0, "fps": 3.0, "sources": sources}).encode(), False))
    kept = view.boxes["cam"].sources
    assert len(kept) == SOURCES_KEPT - 1 and "cam01" not in kept  # the first 32, less the one that is no report
    assert kept["cam00"] == {"state": "stalled", "fps_in": None, "error": "x" * 200}
    assert kept["cam02"] == {"state": "unknown", "fps_in": None, "error": None}
    assert kept["cam03"] == {"state": "up", "fps_in": 5.0, "error": None}
    view.apply(Message("site/cam/telemetry", json.dumps({"ts": 2.0, "sources": ["not", "a", "map"]}).encode(), False))
    assert view.boxes["cam"].sources == {}


def test_two_boxes_answering_as_one_id_are_a_duplicate_shown_once_each():
    view = FleetView("site")
    view.apply(status("cam-2", ["h"], retain=True))  # the retained copy: whichever wrote last
    view.apply(status("cam-2", ["g"]))  # both answer the announce, live, on the one topic
    view.apply(status("cam-2", ["h"], broker="n2:1883"))
    view.apply(status("cam-1", ["g"]))
    assert list(view.duplicates()) == ["cam-2"]
    problem = view.duplicate_problem("g")
    assert "cam-2 answered by 2 boxes (groups g, kind cpu-dev, on ?; groups h, kind cpu-dev, on n2:1883)" in problem
    assert "--allow-duplicate-ids" in problem and view.duplicate_problem("other") is None
    rows = [(b.device, b.groups, b.duplicate) for b in view.rows()]
    assert rows == [("cam-1", ["g"], False), ("cam-2", ["g"], True), ("cam-2", ["h"], True)]
    assert [(b.device, b.groups) for b in view.rows("h")] == [("cam-2", ["h"])]
    assert [b.device for b in view.in_group("h")] == ["cam-2"]  # its latest status says g: still h's too
    assert render_table(view.rows(), now=1.8e9).count("DUPLICATE id") == 2


def test_one_box_restarting_or_its_retained_copy_is_not_a_duplicate():
    view = FleetView("site")
    view.apply(status("cam", ["old"], retain=True))  # a retained status from before a reconfiguration
    view.apply(status("cam", ["g"]))
    view.apply(status("cam", ["g"], state="offline"))  # it stops (its will or a clean stop)...
    view.apply(status("cam", ["g"], kind="atlas-200dk"))  # ...and starts again as another kind
    view.apply(status("cam", ["g"], kind="atlas-200dk"))
    assert view.duplicates() == {} and view.duplicate_problem(None) is None
    assert not view.boxes["cam"].duplicate


@pytest.mark.parametrize("damage, why", [
    (lambda d: d.update(runs="x"), "runs has the wrong type (str)"),
    (lambda d: d.update(started="noon"), "started has the wrong type (str)"),
    (lambda d: d["spec"].update(canary="1"), "canary: expected an integer"),
    (lambda d: d["boxes"]["box-1"].update(sent_at="yesterday"), "box 'box-1': 1 error sent_at: expected a number"),
    (lambda d: d["boxes"]["box-0"].update(anomalies="x"), "anomalies: expected a list"),
])
def test_a_state_file_with_wrong_typed_fields_is_damaged_not_a_traceback_later(tmp_path, damage, why):
    shutil.copy(os.path.join(FIXTURE, "ro-today.json"), str(tmp_path))
    path = str(tmp_path / "ro-today.json")
    assert RolloutState.load(path) is not None  # the fixture itself loads
    data = json.load(open(path))
    damage(data)
    with open(path, "w") as handle:
        json.dump(data, handle)
    with pytest.raises(RolloutError, match="is damaged") as caught:
        RolloutState.load(path)
    assert why in str(caught.value)
