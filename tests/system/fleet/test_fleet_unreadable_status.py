"""A box the operator's record knows in a group whose status then turns unreadable, on a real Mosquitto.

The boxes are ``tests/support/fleet_boxes.py``'s protocol-only boxes, speaking today's protocol until one of them
publishes its status as a JSON list, or with a field nested past ``JSON_DEPTH_MAX`` (retained, and again in
answer to each announce, as a box with such a bug would). An operator who ran ``fleet status`` while the boxes
were well, runs it again (``--group``), then rolls the group out: the box stays in its group's view, listed
``malformed``, and the rollout reports it ``malformed`` and does not exit 0 as ``completed`` while it still
serves the old model. Before: ``fleet status`` listed it nowhere (the second run recorded it in no group) and
the rollout reported it ``not_targeted`` and ended ``completed``, exit 0.
"""

import pytest

from agent.cli.ctl import EXIT_OK
from agent.fleet.report import EXIT_PARTIAL
from agent.protocol.messages import JSON_DEPTH_MAX
from tests.support.fleet_boxes import UNREADABLE
from tests.support.fleet_support import box_fleet, run_cli, sim_rollout_args  # noqa: F401 - box_fleet: fixture

pytestmark = pytest.mark.fleet_rig  # operator-side rig: run once, in the host lane (Makefile)


@pytest.mark.parametrize("shape, why", [("list", "expected a mapping"),
                                        ("deep", "nested deeper than %d" % JSON_DEPTH_MAX)])
def test_a_known_box_whose_status_turns_unreadable_stays_in_its_group_as_malformed(
        shape, why, box_fleet, mosquitto, tmp_path, capsys):  # noqa: F811 - box_fleet: the fixture
    assert shape in UNREADABLE
    fleet = box_fleet(3).start()
    state_dir = str(tmp_path / "state")
    table_args = ["status", "--broker", mosquitto.url, "--prefix", fleet.prefix, "--listen", "0",
                  "--state-dir", state_dir]
    status = table_args + ["--json"]
    code, shown = run_cli(status, capsys)  # the operator's record now lists the three boxes in group sim
    assert code == EXIT_OK
    assert {b["device"]: (b["state"], b["groups"]) for b in shown["boxes"]} == {
        d: ("online", ["sim"]) for d in ("box-00", "box-01", "box-02")}

    fleet.call(lambda: fleet.box("box-01").make_unreadable(shape))

    for _ in range(2):  # the record a first run writes must not lose the box for the second one
        code, shown = run_cli(status + ["--group", "sim"], capsys)
        assert code == EXIT_OK
        listed = {b["device"]: b for b in shown["boxes"]}
        assert sorted(listed) == ["box-00", "box-01", "box-02"], shown
        assert listed["box-01"]["state"] == "malformed" and why in listed["box-01"]["reason"], listed["box-01"]
        assert listed["box-01"]["groups"] == ["sim"]
    code, table = run_cli(table_args + ["--group", "sim"], capsys)
    assert code == EXIT_OK and "box-01" in table and "malformed" in table, table

    code, report = run_cli(sim_rollout_args(mosquitto.url, fleet.prefix, state_dir, "--canary", "1", "--waves",
                                            "1", "--no-preflight"), capsys)
    outcomes = {b["device"]: (b["outcome"], b["error"]) for b in report["boxes"]}
    assert outcomes["box-01"][0] == "malformed" and why in outcomes["box-01"][1], outcomes
    assert outcomes["box-00"][0] == outcomes["box-02"][0] == "confirmed", outcomes
    assert (code, report["status"]) == (EXIT_PARTIAL, "partial")  # never exit 0 'completed'
    assert "box-01" in report["not_reached"]
    # The box's own truth: it was sent nothing and serves the old model.
    assert fleet.box("box-01").deploys == 0 and fleet.box("box-01").serving()["version"] == "1.0.0"
