"""Issue 30 items 1-3 against protocol-only boxes (``tests/support/fleet_boxes.py``) on a real Mosquitto: commands
a box missed are sent again when it is heard from, an abort or a revert puts back every box that moved whatever
its outcome, a finished rollout can still be reverted, and the final check makes the report say what each box
serves. A box's truth is its own slot table, compared with the report's ``serving``; each test failed on the
engine before these changes (see docs/fleet.md, "The simulated fleet").
"""
# ruff: noqa: F811 - the fixture box_fleet comes from tests.support.fleet_support

import json
import threading

import pytest

from agent.cli import fleet as fleet_cli
from agent.cli.ctl import EXIT_OK
from agent.fleet.link import Message
from agent.fleet.plan import RolloutSpec
from agent.fleet.records import RevertState, RolloutStatus
from agent.fleet.report import EXIT_ABORTED, EXIT_CANCELLED, EXIT_COMPLETED, EXIT_PARTIAL
from agent.fleet.rollout import Rollout
from agent.protocol.messages import FAILED, SUCCEEDED
from tests.conftest import wait_for
from tests.support.fleet_link_support import SIM_PREFIX, SIM_SHA, SimulatedLink, _ack, _online
from tests.support.fleet_support import box_fleet, sim_rollout_args  # noqa: F401 - box_fleet is a fixture

pytestmark = pytest.mark.fleet_rig  # operator-side rig: run once, in the host lane (Makefile)

OLD_CONFIRMED = {"version": "1.0.0", "state": "confirmed"}
NEW_CONFIRMED = {"version": "2.0.0", "state": "confirmed"}


def run(args, capsys):
    code = fleet_cli.main(args)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    out = captured.out
    return code, (json.loads(out[out.index("{"):]) if "{" in out else out), captured.err


def by_device(report):
    return {b["device"]: b for b in report["boxes"]}


def mismatches(report, fleet):
    """Boxes whose own slot table differs from what the report says they serve (version and slot state)."""
    said = by_device(report)
    wrong = []
    for box in fleet.boxes:
        real = fleet.call(box.serving)
        serving = said[box.device]["serving"] or {}
        if {"version": serving.get("version"), "state": serving.get("state")} != real:
            wrong.append((box.device, box.fault, said[box.device]["outcome"], serving, real))
    return wrong


def test_a_deploy_missed_without_a_last_will_is_sent_again_when_the_box_is_heard_from(box_fleet, tmp_path, capsys):
    # box-02 has no will (a RabbitMQ node that dies fires none): it vanishes as its wave is sent and is back 3 s
    # later with an online status. No 'offline' ever came, so only hearing from it can trigger the re-send.
    fleet = box_fleet(3, faults={2: (None, {"no_will": True})}).start()
    canary, away = fleet.box("box-00"), fleet.box("box-02")

    def leave_when_the_canary_starts():
        if wait_for(lambda: canary.commands, timeout=60):
            fleet.call(lambda: away.away(3.0))

    helper = threading.Thread(target=leave_when_the_canary_starts)
    helper.start()
    code, report, err = run(sim_rollout_args(fleet.url, fleet.prefix, tmp_path, "--canary", "1", "--waves", "1",
                                             "--step-timeout", "30"), capsys)
    helper.join(5)
    assert code == EXIT_COMPLETED, err
    assert "box-02                   back online: deploy sent again" in err
    assert away.deploys == 1 and fleet.call(away.serving) == NEW_CONFIRMED
    assert mismatches(report, fleet) == []


def test_the_final_check_reports_what_each_box_serves(box_fleet, tmp_path, capsys):
    # Judged before the check: box-01 confirmed (then crashed in probation, back on 1.0.0), box-02 timed out (its
    # ack comes after --step-timeout, it ends on 2.0.0), box-03 timed out (answers announces only, never
    # publishes a status), box-04 malformed (its switch's status; the next ones are good, on 2.0.0).
    faults = {1: ("crash_after_confirm", None), 2: ("late_ack", {"late_s": 5.0}), 3: ("announce_only", None),
              4: ("malformed_status", None)}
    fleet = box_fleet(6, faults=faults).start()
    code, report, err = run(sim_rollout_args(fleet.url, fleet.prefix, tmp_path, "--canary", "0", "--waves", "1",
                                             "--step-timeout", "2", "--confirm-timeout", "4"), capsys)
    result = by_device(report)
    assert code == EXIT_PARTIAL and report["status"] == "partial", err  # box-01's own rollback is a failure
    assert result["box-01"]["outcome"] == "rolled_back" and "crashed in probation" in result["box-01"]["error"]
    assert fleet.call(fleet.box("box-01").serving) == OLD_CONFIRMED
    for device, judged in (("box-02", "timed_out"), ("box-03", "timed_out"), ("box-04", "malformed")):
        assert result[device]["outcome"] == "confirmed", (device, result[device])
        assert "judged %s" % judged in result[device]["error"] and result[device]["new_version"] == "2.0.0"
        assert fleet.call(fleet.box(device).serving) == NEW_CONFIRMED
    assert report["not_reached"] == ["box-01"]
    assert mismatches(report, fleet) == []


def test_an_abort_puts_back_every_box_that_moved_whatever_its_outcome(box_fleet, tmp_path, capsys):
    # box-00 fails at once ('interrupted', no retries): the abort comes before any other box has answered.
    # Then box-01's deploy 'succeeds' with another manifest (failed), box-02's switch status is malformed,
    # box-03 never publishes a status of its own (its ack comes before any status shows the switch), box-04 is
    # away when its rollback arrives, box-05 acks late. Each one moved, each one goes back; box-00 never moved.
    faults = {0: ("interrupted_once", None), 1: ("wrong_sha", None), 2: ("malformed_status", None),
              3: ("announce_only", None), 4: ("away_on_rollback", {"away_s": 2.0}),
              5: ("late_ack", {"late_s": 3.0})}
    fleet = box_fleet(7, faults=faults, deploy_s=0.5).start()
    code, report, err = run(sim_rollout_args(fleet.url, fleet.prefix, tmp_path, "--canary", "0", "--waves", "1",
                                             "--max-failures", "0", "--retries", "0", "--rollback-on-abort",
                                             "--revert-timeout", "40"), capsys)
    assert code == EXIT_ABORTED, err
    result = by_device(report)
    for box in fleet.boxes:
        assert fleet.call(box.serving) == OLD_CONFIRMED, (box.device, box.fault, result[box.device], err)
    assert result["box-00"]["revert"]["state"] == "nothing" and fleet.box("box-00").rollbacks == 0
    for box in fleet.boxes[1:]:
        assert result[box.device]["reverted"] is True and box.rollbacks == 1, (box.device, result[box.device])
    assert "box-04                   heard from again: rollback sent again" in err
    assert mismatches(report, fleet) == []


def test_a_finished_rollout_can_still_be_reverted(box_fleet, tmp_path, capsys):
    fleet = box_fleet(3).start()
    args = sim_rollout_args(fleet.url, fleet.prefix, tmp_path, "--canary", "1", "--waves", "1", "--rollout-id",
                            "ro-done")
    code, report, err = run(args, capsys)
    assert code == EXIT_COMPLETED and all(fleet.call(b.serving) == NEW_CONFIRMED for b in fleet.boxes), err
    state = ["--rollout-id", "ro-done", "--state-dir", str(tmp_path)]
    code, out, err = run(["cancel", "--revert"] + state, capsys)
    assert code == EXIT_OK and "'fleet revert'" in out, err
    code, report, err = run(args, capsys)  # the rollout command does the reverts...
    assert code == EXIT_CANCELLED and report["cancel"]["after"] == "completed", err
    assert all(fleet.call(b.serving) == OLD_CONFIRMED and b.rollbacks == 1 for b in fleet.boxes)
    assert all(b["reverted"] and b["serving"]["version"] == "1.0.0" for b in report["boxes"])
    code, report, err = run(["revert", "--broker", fleet.url, "--prefix", fleet.prefix, "--json"] + state,
                            capsys)  # ...and 'fleet revert' again finds nothing left to do
    assert code == EXIT_CANCELLED and [b.rollbacks for b in fleet.boxes] == [1, 1, 1], err
    assert mismatches(report, fleet) == []


def test_a_deploy_acked_before_the_abort_and_answered_after_the_step_timeout_is_rolled_back(tmp_path):
    # Simulated time, no broker. box-0 fails at once (--max-failures 0 aborts). box-1 acks 'accepted', stays
    # silent past --step-timeout and answers 'succeeded' 10 s later with a status showing the switch: its deploy
    # was running all along, so the revert pass may not call it unmoved at the step timeout (the 1,000-box
    # run's 5 late-ack boxes stayed on 2.0.0 so). Failed on the engine before the fix: no rollback was sent.
    rollbacks = []
    link = None

    def answer(topic, payload):
        device, verb = topic.split("/")[1], topic.rsplit("/", 1)[1]
        if verb == "announce":  # live answers: each box was heard serving its old model
            return [status_of(d, OLD_MODEL, "a", "confirmed") for d in ("box-0", "box-1")]
        if verb == "rollback":
            rollbacks.append(device)
            body = {"request_id": payload["request_id"], "verb": "rollback", "state": SUCCEEDED,
                    "result": {"model": OLD_MODEL}}
            return [Message(topic.replace("/cmd/rollback", "/ack/" + payload["request_id"]),
                            json.dumps(body).encode(), False), status_of(device, OLD_MODEL, "a", "confirmed")]
        if verb != "deploy":
            return []
        if device == "box-0":
            return [_ack(device, payload, FAILED, error={"code": "golden_mismatch", "message": "off"})]
        link.later.append((link.mono + 10.0, _ack(device, payload, SUCCEEDED, result={"model": NEW_MODEL})))
        link.later.append((link.mono + 10.0, status_of(device, NEW_MODEL, "b", "pending")))
        return [_ack(device, payload, "accepted")]

    link = SimulatedLink({"box-0": _online("box-0"), "box-1": _online("box-1")}, answer=answer)
    spec = RolloutSpec(group="sim", bundle="b.tar.gz", sha256=SIM_SHA, prefix=SIM_PREFIX, canary=0, waves=1,
                       max_failures=0, rollback_on_abort=True, step_timeout_s=3.0, revert_timeout_s=60.0)
    state = Rollout(spec, spec.default_id(), str(tmp_path), link, progress=link.progress, clock=link.wall,
                    monotonic=lambda: link.mono, settle_s=0.3).run()
    assert state.status == RolloutStatus.ABORTED and rollbacks == ["box-1"], rollbacks
    assert state.boxes["box-1"].revert.state == RevertState.SUCCEEDED
    assert state.boxes["box-0"].revert.state == RevertState.NOTHING  # failed at once: proven unmoved


def test_a_rollback_missed_by_a_flapping_box_is_sent_again_while_it_is_there_not_when_its_will_fires(tmp_path):
    # Simulated time, no broker. box-1 flaps: 4 s connected, 1 s away, its will ('offline', published by the
    # broker) at each drop and an online status at each return. Its first rollback lands while it is away. A
    # re-send triggered by the will went out into its absence every time, and the return came too soon after it
    # to trigger another (the 1,000-box run's flapping boxes kept 2.0.0, their reverts timed out). Failed on the
    # engine before the fix: the rollback was never answered.
    rollbacks = []
    link = None
    flap = {}

    def present():
        return (link.mono - flap["t0"]) % 5.0 < 4.0

    def answer(topic, payload):
        device, verb = topic.split("/")[1], topic.rsplit("/", 1)[1]
        if verb == "announce":
            return [status_of(d, OLD_MODEL, "a", "confirmed") for d in ("box-0", "box-1")]
        if verb == "rollback" and device == "box-1":
            rollbacks.append(present())
            if not present():
                return []  # lost: a clean session drops what comes while the box is away
            link.later = [(at, m) for at, m in link.later if "/box-1/" not in m.topic]
            body = {"request_id": payload["request_id"], "verb": "rollback", "state": SUCCEEDED,
                    "result": {"model": OLD_MODEL}}
            return [Message(topic.replace("/cmd/rollback", "/ack/" + payload["request_id"]),
                            json.dumps(body).encode(), False), status_of(device, OLD_MODEL, "a", "confirmed")]
        if verb != "deploy":
            return []
        if device == "box-0":
            return [_ack(device, payload, FAILED, error={"code": "golden_mismatch", "message": "off"})]
        flap["t0"] = link.mono - 4.0  # away right after this deploy's answer (its rollback follows at once), 1 s
        will = {"state": "offline", "reason": "connection lost", "groups": ["sim"]}
        for k in range(40):
            link.later.append((flap["t0"] + 5.0 * k + 4.0, Message("%s/box-1/status" % SIM_PREFIX,
                                                                   json.dumps(will).encode(), False)))
            link.later.append((flap["t0"] + 5.0 * k + 5.0, status_of(device, NEW_MODEL, "b", "confirmed")))
        return [_ack(device, payload, SUCCEEDED, result={"model": NEW_MODEL}),
                status_of(device, NEW_MODEL, "b", "confirmed")]

    link = SimulatedLink({"box-0": _online("box-0"), "box-1": _online("box-1")}, answer=answer)
    spec = RolloutSpec(group="sim", bundle="b.tar.gz", sha256=SIM_SHA, prefix=SIM_PREFIX, canary=0, waves=1,
                       max_failures=0, rollback_on_abort=True, revert_timeout_s=60.0)
    state = Rollout(spec, spec.default_id(), str(tmp_path), link, progress=link.progress, clock=link.wall,
                    monotonic=lambda: link.mono, settle_s=0.3).run()
    assert rollbacks[0] is False and rollbacks[-1] is True, rollbacks  # the first one was lost, the last landed
    assert state.boxes["box-1"].revert.state == RevertState.SUCCEEDED, state.boxes["box-1"].revert


def test_a_deploy_whose_acks_lag_behind_an_older_status_is_not_called_unmoved(tmp_path):
    # Simulated time, no broker. Once the deploys are out, everything reaches the operator 3 s late (the 1,000-box
    # run's operator read its queue up to 3.3 s behind the boxes). box-0 fails at once (--max-failures 0 aborts).
    # box-1 came back (a status: old model) just before its deploy was sent: that status arrives 2.5 s after the
    # send, its acks and its switch 3 s after, past --step-timeout and RESEND_AFTER_S. box-2 never got its deploy
    # (it was away) and answers announces. A revert that took the stale status, or the step timeout, for proof called
    # box-1 unmoved and left it on the new model (the acceptance run's flapping box-0385). Failed on the engine
    # before the fix: no rollback was sent.
    lag = 3.0
    rollbacks = []
    serves = dict.fromkeys(("box-0", "box-1", "box-2"), (OLD_MODEL, "a", "confirmed"))
    link = None

    def late(*messages, after=0.0):
        link.later.extend((link.mono + lag + after, m) for m in messages)
        return []

    def answer(topic, payload):
        device, verb = topic.split("/")[1], topic.rsplit("/", 1)[1]
        if verb == "announce":
            statuses = [status_of(d, *serves[d]) for d in sorted(serves)]
            return late(*statuses) if link.lag else statuses
        if verb == "rollback":
            rollbacks.append(device)
            serves[device] = (OLD_MODEL, "a", "confirmed")
            body = {"request_id": payload["request_id"], "verb": "rollback", "state": SUCCEEDED,
                    "result": {"model": OLD_MODEL}}
            return late(Message(topic.replace("/cmd/rollback", "/ack/" + payload["request_id"]),
                                json.dumps(body).encode(), False), status_of(device, *serves[device]))
        if verb != "deploy":
            return []
        link.lag = lag  # the operator's own announces come back as late as the boxes' answers
        if device == "box-0":
            return [_ack(device, payload, FAILED, error={"code": "golden_mismatch", "message": "off"})]
        if device == "box-1":
            late(status_of(device, OLD_MODEL, "a", "confirmed"), after=-0.5)  # its return, just before the deploy
            late(_ack(device, payload, "accepted"))
            serves[device] = (NEW_MODEL, "b", "pending")
            late(_ack(device, payload, SUCCEEDED, result={"model": NEW_MODEL}), status_of(device, *serves[device]),
                 after=0.2)
        return []  # box-2: away, its deploy lost

    link = SimulatedLink({d: _online(d) for d in serves}, answer=answer)
    spec = RolloutSpec(group="sim", bundle="b.tar.gz", sha256=SIM_SHA, prefix=SIM_PREFIX, canary=0, waves=1,
                       max_failures=0, rollback_on_abort=True, step_timeout_s=2.0, revert_timeout_s=60.0)
    state = Rollout(spec, spec.default_id(), str(tmp_path), link, progress=link.progress, clock=link.wall,
                    monotonic=lambda: link.mono, settle_s=0.3).run()
    assert state.status == RolloutStatus.ABORTED and rollbacks == ["box-1"], (rollbacks, state.boxes["box-1"])
    assert state.boxes["box-1"].revert.state == RevertState.SUCCEEDED
    assert serves["box-1"][0] == OLD_MODEL
    for device in ("box-0", "box-2"):  # box-0 failed at once, box-2 answered after every deploy had reached it
        assert state.boxes[device].revert.state == RevertState.NOTHING, state.boxes[device].revert


OLD_MODEL = {"name": "m", "version": "1", "manifest_sha256": "a" * 64}
NEW_MODEL = {"name": "m", "version": "2", "manifest_sha256": SIM_SHA}


def status_of(device, model, slot, slot_state):
    """A live status of a simulated-link box serving ``model`` from ``slot``."""
    slots = {"a": dict(OLD_MODEL, state="confirmed" if slot == "a" else "standby")}
    if slot == "b":
        slots["b"] = dict(model, state=slot_state)
    body = {"state": "online", "groups": ["sim"], "slots": {"serving": slot, "slots": slots}}
    return Message("%s/%s/status" % (SIM_PREFIX, device), json.dumps(body).encode(), False)


# --- the acceptance fleet: 1,000 boxes, one in ten misbehaving ---------------------------------------------------

MISBEHAVIOURS = (("crash_after_confirm", None), ("late_ack", {"late_s": 6.0}), ("malformed_status", None),
                 ("flapping", {"flap_s": 4.0, "away_s": 1.0}), ("announce_only", None), ("no_announce", None),
                 ("away_on_rollback", {"away_s": 2.0}))


def test_a_thousand_boxes_one_in_ten_misbehaving_end_where_the_report_says(box_fleet, tmp_path, capsys):
    # Every tenth box has one misbehaviour (cycling through MISBEHAVIOURS); the failures they cause (late acks
    # timing out, statuses that never come, malformed ones) cross --max-failures after the canary, and the
    # abort reverts. Afterwards each box's own slot table must be what the report says it serves, and no box
    # may serve the new bundle.
    faults = {index: MISBEHAVIOURS[(index // 10) % len(MISBEHAVIOURS)] for index in range(5, 1000, 10)}
    fleet = box_fleet(1000, faults=faults, observation_s=1.0).start(timeout=120)
    code, report, err = run(sim_rollout_args(fleet.url, fleet.prefix, tmp_path, "--canary", "10", "--waves", "3",
                                             "--max-failures", "20", "--step-timeout", "3", "--confirm-timeout",
                                             "8", "--rollback-on-abort", "--revert-timeout", "90"), capsys)
    assert code == EXIT_ABORTED, err[-3000:]
    on_new = [(b.device, b.fault) for b in fleet.boxes if fleet.call(b.serving)["version"] == "2.0.0"]
    assert on_new == [], (on_new[:20], err[-3000:])
    wrong = mismatches(report, fleet)
    assert wrong == [], (wrong, [line for line in err.splitlines() if any(w[0] in line for w in wrong)],
                         [by_device(report)[w[0]] for w in wrong])
    rolled_back = sum(b.rollbacks for b in fleet.boxes)
    assert rolled_back >= 100 and rolled_back == sum(1 for b in report["boxes"] if b["reverted"]), rolled_back
