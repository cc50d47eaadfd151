"""``atlas-edge fleet``: status and staged rollouts against a simulated fleet of real daemons on a real Mosquitto.

Each box is a real :class:`agent.daemon.Daemon` (transport, dispatcher with its request record, model manager
with slots, fetch over HTTP, verify, golden self-test and observation window); the backend is the simulation's
stand-in (OpenCV inference plus injected faults), see ``benchmarks/fleet_sim.py``. A box's truth in the
assertions is its own slot table and its own count of deploy and rollback commands run, never what the
operator reported.
"""

# ruff: noqa: F811 - the fixtures bundles and make_fleet come from tests.support.fleet_support
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from agent.cli import fleet as fleet_cli
from agent.cli.ctl import EXIT_OK, EXIT_USAGE
from agent.devtools.broker import EmbeddedBroker
from agent.errors import CommandError
from agent.fleet.intake import POLL_S
from agent.fleet.journal import RolloutState
from agent.fleet.judge import abort_reason
from agent.fleet.link import Message
from agent.fleet.plan import (
    DEFAULT_REVERT_TIMEOUT_S,
    RolloutError,
    RolloutSpec,
    plan_waves,
    request_id,
)
from agent.fleet.records import Outcome, Phase, RevertState, RolloutStatus
from agent.fleet.report import EXIT_ABORTED, EXIT_PARTIAL
from agent.fleet.rollout import Rollout
from agent.fleet.status import FleetView, render_table
from agent.protocol.messages import FAILED, REQUEST_ID_RE, SUCCEEDED
from benchmarks.fleet_sim import GOLDEN, SLOW
from tests.conftest import REPO_ROOT, wait_for
from tests.support.fleet_link_support import (
    SIM_PREFIX,
    SIM_SHA,
    STEP_AT_S,
    WALL0,
    LostBroker,
    SimulatedLink,
    _ack,
    _online,
)
from tests.support.fleet_support import (  # noqa: F401 - bundles and make_fleet are fixtures
    bundles,
    make_fleet,
    rollout_args,
    run_cli,
    truth,
)
from tests.support.needs import needs_cryptography

pytestmark = pytest.mark.fleet_rig  # operator-side rig: run once, in the host lane (Makefile)

CI_BOXES = 20  # the test-size fleet; the benchmark runs 100


# --- plan, abort rule, ids (no broker) ----------------------------------------------------------------------

def test_plan_puts_the_canary_first_then_even_waves_or_fixed_sizes():
    devices = ["d%02d" % i for i in range(10)]
    assert plan_waves(devices, 1, 3, None) == [["d00"], ["d01", "d02", "d03"], ["d04", "d05", "d06"],
                                               ["d07", "d08", "d09"]]
    assert plan_waves(devices, 2, 3, 4) == [["d00", "d01"], ["d02", "d03", "d04", "d05"],
                                            ["d06", "d07", "d08", "d09"]]
    assert plan_waves(devices[:2], 0, 5, None) == [["d00"], ["d01"]]
    assert plan_waves([], 1, 3, None) == []


def test_abort_rule_counts_failures_over_executed_boxes_after_the_minimum():
    rate = RolloutSpec(group="g", bundle="b", sha256="a" * 64, max_failure_rate=0.05, min_executed=5)
    assert abort_reason(rate, {"confirmed": 3, "failed": 1}) is None  # fewer than --min-executed: one waits
    assert "failure rate 0.200" in abort_reason(rate, {"confirmed": 4, "timed_out": 1})
    assert abort_reason(rate, {"confirmed": 19, "failed": 1}) is None  # exactly 5 % is not above 5 %
    count = RolloutSpec(group="g", bundle="b", sha256="a" * 64, max_failures=1)
    assert abort_reason(count, {"confirmed": 2, "failed": 1}) is None
    assert "more than --max-failures 1" in abort_reason(count, {"confirmed": 1, "failed": 1, "rolled_back": 1})
    typed = RolloutSpec(group="g", bundle="b", sha256="a" * 64, max_per_type={"timed_out": 0})
    assert abort_reason(typed, {"confirmed": 5, "failed": 3}) is None  # only timeouts are limited here
    assert "timed_out=0" in abort_reason(typed, {"confirmed": 5, "timed_out": 1})


def test_request_ids_are_derived_valid_and_distinct_per_device():
    assert request_id("ro-1", "cam-01", "deploy") == "ro-1.cam-01.deploy"
    long_a, long_b = request_id("ro-1", "x" * 80, "deploy"), request_id("ro-1", "x" * 79 + "y", "deploy")
    odd = request_id("ro-1", "cam 01 (hall)", "rollback")
    for rid in (long_a, long_b, odd):
        assert REQUEST_ID_RE.match(rid), rid
    assert long_a != long_b and long_a == request_id("ro-1", "x" * 80, "deploy")


@pytest.mark.parametrize("field,value,message", [
    ("sha256", "abc", "--sha256 must be 64 hex digits"),
    ("group", "a/b", "--group"),
    ("max_failure_rate", 1.5, "--max-failure-rate"),
    ("waves", 0, "--waves"),
])
def test_bad_rollout_arguments_are_refused_naming_the_option(field, value, message):
    spec = {"group": "g", "bundle": "b", "sha256": "a" * 64}
    spec[field] = value
    with pytest.raises(RolloutError, match=message):
        RolloutSpec(**spec).check()


# --- clocks: deadlines run on the monotonic clock, the wall clock only stamps (no broker) -------------------

STEPS = [-3600.0, 86400.0]  # the laptop's clock stepped back an hour / forward a day


def _rollout(link, tmp_path, **spec):
    spec = RolloutSpec(group="sim", bundle="b.tar.gz", sha256=SIM_SHA, prefix=SIM_PREFIX, **spec)
    return Rollout(spec, spec.default_id(), str(tmp_path), link, progress=link.progress,
                   clock=link.wall, monotonic=lambda: link.mono, settle_s=0.3)


def _sent(link, verb):
    return [at for at, topic in link.published if topic.endswith("/cmd/" + verb)]


@pytest.mark.parametrize("step", STEPS)
def test_confirm_timeout_runs_on_the_monotonic_clock_through_a_wall_clock_step(tmp_path, step):
    link = SimulatedLink({"box-0": _online("box-0")}, step=step)  # the box never answers
    state = _rollout(link, tmp_path, confirm_timeout_s=100.0).run()
    assert state.boxes["box-0"].outcome == Outcome.TIMED_OUT
    [sent] = _sent(link, "deploy")
    assert 100.0 < link.marks["timed_out"] - sent <= 100.0 + 2 * POLL_S  # as if the clock had not moved
    assert state.boxes["box-0"].sent_at == WALL0 + sent  # the state file keeps wall time


@pytest.mark.parametrize("step", STEPS)
def test_wait_offline_runs_on_the_monotonic_clock_through_a_wall_clock_step(tmp_path, step):
    link = SimulatedLink({"box-0": {"state": "offline", "groups": ["sim"], "reason": "lost"}}, step=step)
    state = _rollout(link, tmp_path, wait_offline_s=50.0).run()
    assert state.boxes["box-0"].outcome == Outcome.OFFLINE and _sent(link, "deploy") == []
    assert 50.0 <= link.mono - link.marks["wait"] <= 50.0 + 2 * POLL_S


@pytest.mark.parametrize("step", STEPS)
def test_the_revert_wait_runs_on_the_monotonic_clock_through_a_wall_clock_step(tmp_path, step):
    def answer(topic, payload):  # box-0 fails its deploy, box-1 deploys; neither answers a rollback
        device, verb = topic.split("/")[1], topic.rsplit("/", 1)[1]
        if verb != "deploy":
            return []
        if device == "box-0":
            return [_ack(device, payload, FAILED, error={"code": "golden_mismatch", "message": "off"})]
        switched = dict(_online(device), slots={"serving": "b", "slots": {"b": {
            "name": "m", "version": "2", "manifest_sha256": SIM_SHA, "state": "pending"}}})
        return [_ack(device, payload, SUCCEEDED, result={"model": {"name": "m", "version": "2"}}),
                Message("%s/%s/status" % (SIM_PREFIX, device), json.dumps(switched).encode(), False)]

    link = SimulatedLink({"box-0": _online("box-0"), "box-1": _online("box-1")}, answer=answer, step=step)
    state = _rollout(link, tmp_path, canary=0, waves=1, max_failures=0, rollback_on_abort=True).run()
    assert state.status == RolloutStatus.ABORTED and state.boxes["box-1"].outcome == Outcome.ABORTED
    assert state.boxes["box-1"].revert.state == RevertState.TIMED_OUT
    [sent] = _sent(link, "rollback")
    assert sent < STEP_AT_S  # the step came while the wait ran
    assert DEFAULT_REVERT_TIMEOUT_S <= link.marks["revert: not settled"] - sent <= DEFAULT_REVERT_TIMEOUT_S + 2 * POLL_S


@pytest.mark.parametrize("gap_s", [
    20.0,  # 20 s passed between the runs: charged with the time already run plus the gap
    -3600.0,  # the wall clock went back past sent_at: nothing is charged, the full timeout runs again
])
def test_a_resumed_rollout_charges_the_wall_time_since_sent_once(tmp_path, gap_s):
    first = SimulatedLink({"box-0": _online("box-0")}, lose_at=40.0)
    with pytest.raises(LostBroker):
        _rollout(first, tmp_path, confirm_timeout_s=100.0).run()
    [sent] = _sent(first, "deploy")
    # A new process: its monotonic clock has another origin; the wall clock moved on by the gap.
    second = SimulatedLink({"box-0": _online("box-0")}, start=5000.0, offset=first.mono + gap_s - 5000.0)
    state = _rollout(second, tmp_path, confirm_timeout_s=100.0).run()
    assert state.boxes["box-0"].outcome == Outcome.TIMED_OUT and state.record.runs == 2
    left = 100.0 - max(0.0, first.mono - sent + gap_s)
    assert left < second.marks["timed_out"] - second.start <= left + 1.0 + 2 * POLL_S  # 1.0: the re-run's start-up


def test_cli_refuses_a_bad_sha_before_connecting(capsys):
    code = fleet_cli.main(["rollout", "--broker", "mqtt://127.0.0.1:1", "--group", "g", "--bundle", "b",
                           "--sha256", "nothex"])
    assert code == EXIT_USAGE
    assert "--sha256 must be 64 hex digits" in capsys.readouterr().err


def test_fleet_view_folds_status_will_telemetry_and_cleared_topics():
    view = FleetView("site/a")
    slots = {"serving": "b", "slots": {"a": {"state": "standby", "version": "1"},
                                       "b": {"state": "confirmed", "version": "2", "manifest_sha256": "f" * 64}}}
    online = {"state": "online", "groups": ["g1"], "model": "m 2", "slots": slots, "ts": 100.0}
    assert view.apply(Message("site/a/cam-1/status", json.dumps(online).encode(), True)) == "cam-1"
    box = view.boxes["cam-1"]
    assert box.online and box.serving.version == "2" and box.serves_confirmed("f" * 64)
    # the last will: offline, groups only; the slot table last seen is kept
    will = {"state": "offline", "device": "cam-1", "reason": "connection lost", "groups": ["g1"]}
    view.apply(Message("site/a/cam-1/status", json.dumps(will).encode(), True))
    assert not box.online and box.reason == "connection lost" and box.serving.version == "2"
    assert [b.device for b in view.in_group("g1")] == ["cam-1"] and view.in_group("g2") == []
    view.apply(Message("site/a/cam-1/telemetry", json.dumps({"fps": 12.5, "ts": 130.0}).encode(), False))
    view.apply(Message("site/a/cam-1/telemetry/alert", json.dumps({"kind": "rss_leak", "ts": 140.0}).encode(),
                       False))
    assert box.fps == 12.5 and box.last_seen == 140.0 and box.alerts[0]["kind"] == "rss_leak"
    assert "rss_leak" in render_table([box], now=150.0) and "10s ago" in render_table([box], now=150.0)
    for ignored in ("site/a/group/g1/cmd/status", "other/cam-2/status", "site/a/cam-2/status/x"):
        assert view.apply(Message(ignored, b'{"state": "online"}', True)) is None
    assert view.apply(Message("site/a/cam-1/status", b"", True)) == "cam-1"  # cleared: decommissioned
    assert view.boxes == {}


# --- against the simulated fleet ----------------------------------------------------------------------------

def test_good_bundle_reaches_every_online_box_and_offline_is_reported_not_failed(
        make_fleet, mosquitto, bundles, tmp_path, capsys):
    fleet = make_fleet(CI_BOXES)
    offline = fleet.boxes[5]
    offline.stop()  # announced itself, then went away: its retained status says offline
    code, status = run_cli(["status", "--broker", mosquitto.url, "--prefix", fleet.prefix, "--group", "sim",
                            "--json", "--listen", "0"], capsys)
    assert code == EXIT_OK
    seen = {b["device"]: b for b in status["boxes"]}
    assert len(seen) == CI_BOXES
    assert seen[offline.device_id]["state"] == "offline"
    assert all(b["state"] == "online" and b["serving"]["version"] == "1.0.0" and b["serving"]["state"] ==
               "confirmed" for d, b in seen.items() if d != offline.device_id)

    code, report = run_cli(rollout_args(mosquitto, fleet, bundles, tmp_path, "--canary", "2", "--waves", "3",
                                        "--max-failure-rate", "0.05"), capsys)
    # An offline box is not a failure, but the rollout did not reach it: partial, never completed.
    assert code == EXIT_PARTIAL, report
    assert report["status"] == RolloutStatus.PARTIAL and report["failures"] == 0
    assert report["not_reached"] == [offline.device_id]
    assert report["counts"] == {"confirmed": CI_BOXES - 1, "offline": 1}
    by_device = {b["device"]: b for b in report["boxes"]}
    assert by_device[offline.device_id]["outcome"] == "offline" and by_device[offline.device_id]["wave"] is None
    actual = truth(fleet)
    for box in fleet.boxes:
        entry = by_device[box.device_id]
        if box is offline:
            assert box.deploys == 0
            continue
        assert entry["outcome"] == "confirmed" and entry["old_version"] == "1.0.0"
        assert entry["new_version"] == "2.0.0" == actual[box.device_id]["version"]
        assert actual[box.device_id]["state"] == "confirmed"
        assert box.deploys == 1
    assert [len(w) for w in report["waves"]] == [2, 6, 6, 5]

    # The table for people: one row per box with its serving model and slot, and the totals.
    code, table = run_cli(["status", "--broker", mosquitto.url, "--prefix", fleet.prefix, "--listen", "0"], capsys)
    rows = {line.split()[0]: line for line in table.splitlines()[1:-1]}
    assert code == EXIT_OK and table.splitlines()[-1] == "%d box(es): %d online, 1 offline" % (CI_BOXES,
                                                                                              CI_BOXES - 1)
    assert "fleet-standin-classifier 2.0.0" in rows[fleet.boxes[0].device_id]
    assert "b:confirmed" in rows[fleet.boxes[0].device_id] and "standby" in rows[fleet.boxes[0].device_id]
    assert "offline" in rows[offline.device_id] and "stopped" in rows[offline.device_id]

    # The same command again: the rollout is finished, nothing is sent, the report is the same.
    code, again = run_cli(rollout_args(mosquitto, fleet, bundles, tmp_path, "--canary", "2", "--waves", "3",
                                       "--max-failure-rate", "0.05"), capsys)
    assert code == EXIT_PARTIAL and again["counts"] == report["counts"]
    assert all(box.deploys == (0 if box is offline else 1) for box in fleet.boxes)


def test_failure_rate_aborts_in_its_wave_touches_nothing_after_and_rolls_moved_boxes_back(
        make_fleet, mosquitto, bundles, tmp_path, capsys):
    # 10 % of the boxes fail: box 6 with a golden mismatch (deploy fails), box 8 slow (its window would
    # roll it back). Waves of 5 after a canary of 1: box 6 and 8 are in the third wave (index 2).
    faults = {6: (GOLDEN, bundles["sha"]), 8: (SLOW, bundles["sha"])}
    fleet = make_fleet(CI_BOXES, faults=faults)
    code, report = run_cli(rollout_args(mosquitto, fleet, bundles, tmp_path, "--canary", "1", "--wave-size", "5",
                                        "--max-failure-rate", "0.05", "--rollback-on-abort"), capsys)
    assert code == EXIT_ABORTED
    assert report["status"] == RolloutStatus.ABORTED
    assert report["abort"]["wave"] == 2, report["abort"]
    by_device = {b["device"]: b for b in report["boxes"]}
    waves = report["waves"]
    assert [len(w) for w in waves] == [1, 5, 5, 5, 4]
    golden = fleet.boxes[6].device_id
    assert by_device[golden]["outcome"] == "failed" and "golden" in by_device[golden]["error"]
    untouched = [d for wave in waves[3:] for d in wave]
    for device in untouched:
        assert by_device[device]["outcome"] == "not_started" and by_device[device]["request_id"] is None
        assert fleet.box(device).deploys == 0 and fleet.box(device).rollbacks == 0
    moved = [b["device"] for b in report["boxes"] if b["reverted"] is not None]
    assert set(moved) == {d for wave in waves[:3] for d in wave} - {golden}
    assert all(by_device[d]["reverted"] for d in moved), [by_device[d]["revert"] for d in moved]
    actual = truth(fleet)
    # Every box serves 1.0.0 again, confirmed: moved ones by the rollback, the others never left it.
    assert all(actual[d] == {"version": "1.0.0", "state": "confirmed"} for d in actual), actual
    for box in fleet.boxes:
        assert box.rollbacks == (1 if box.device_id in moved else 0)
        assert box.deploys == (0 if box.device_id in untouched else 1)


def test_a_box_that_rolls_back_in_its_window_is_a_failure_and_the_rest_go_on(
        make_fleet, mosquitto, bundles, tmp_path, capsys):
    fleet = make_fleet(5, faults={2: (SLOW, bundles["sha"])})
    code, report = run_cli(rollout_args(mosquitto, fleet, bundles, tmp_path, "--canary", "1", "--waves", "1",
                                        "--max-failures", "1"), capsys)
    assert code == EXIT_PARTIAL and report["status"] == RolloutStatus.PARTIAL
    slow = {b["device"]: b for b in report["boxes"]}[fleet.boxes[2].device_id]
    assert slow["outcome"] == "rolled_back" and "latency" in slow["error"]
    assert report["counts"] == {"confirmed": 4, "rolled_back": 1}
    assert truth(fleet)[fleet.boxes[2].device_id] == {"version": "1.0.0", "state": "confirmed"}


def test_killed_mid_wave_and_rerun_finishes_with_no_box_deployed_twice(make_fleet, mosquitto, bundles, tmp_path):
    fleet = make_fleet(CI_BOXES)
    args = [sys.executable, "-m", "agent", "fleet"] + rollout_args(
        mosquitto, fleet, bundles, tmp_path, "--canary", "2", "--wave-size", "6")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    state_file = str(tmp_path / "rollouts" / "ro-x.json")
    first = subprocess.Popen(args + ["--rollout-id", "ro-x"], env=env, cwd=REPO_ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def mid_wave():
        try:
            state = RolloutState.load(state_file)  # the snapshot and its journal, as a re-run reads them
        except RolloutError:
            return False  # read in the middle of the first snapshot's rename
        return state is not None and any(b.wave == 1 and b.phase != Phase.PLANNED for b in state.boxes.values())

    assert wait_for(mid_wave, timeout=60), first.stderr.read().decode() if first.poll() is not None else ""
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    left = RolloutState.load(state_file)
    assert left.status == RolloutStatus.RUNNING
    assert any(b.phase != Phase.DONE for b in left.boxes.values())  # killed with work in flight

    second = subprocess.run(args + ["--rollout-id", "ro-x"], env=env, cwd=REPO_ROOT, capture_output=True,
                            timeout=180)
    assert second.returncode == EXIT_OK, second.stderr.decode()[-2000:]
    report = json.loads(second.stdout)
    assert report["status"] == RolloutStatus.COMPLETED and report["runs"] == 2
    assert report["counts"] == {"confirmed": CI_BOXES}
    assert fleet.deploys() == {box.device_id: 1 for box in fleet.boxes}
    assert all(s == {"version": "2.0.0", "state": "confirmed"} for s in truth(fleet).values())


def test_wait_offline_sends_to_a_box_that_comes_back_and_reports_the_one_that_does_not(
        make_fleet, mosquitto, bundles, tmp_path, capsys):
    fleet = make_fleet(5)
    back, gone = fleet.boxes[1], fleet.boxes[3]
    back.stop()
    gone.stop()
    result = {}
    runner = threading.Thread(target=lambda: result.update(zip(("code", "report"), run_cli(rollout_args(
        mosquitto, fleet, bundles, tmp_path, "--canary", "1", "--waves", "1", "--wait-offline", "8",
        "--rollout-id", "ro-w"), capsys))))
    runner.start()
    assert wait_for(lambda: os.path.exists(str(tmp_path / "rollouts" / "ro-w.json")))  # planned: both offline
    back.start()  # comes back while the rollout runs; 'gone' stays away
    runner.join(120)
    assert not runner.is_alive()
    report = result["report"]
    assert result["code"] == EXIT_PARTIAL, report
    by_device = {b["device"]: b for b in report["boxes"]}
    assert report["waves"][-1] == [back.device_id, gone.device_id]  # the last wave: those offline at the start
    assert by_device[back.device_id]["outcome"] == "confirmed" and back.deploys == 1
    assert by_device[gone.device_id]["outcome"] == "offline" and gone.deploys == 0
    assert report["counts"] == {"confirmed": 4, "offline": 1} and report["failures"] == 0


def test_a_rerun_with_different_arguments_is_refused_and_sends_nothing(make_fleet, mosquitto, bundles, tmp_path,
                                                                       capsys):
    fleet = make_fleet(3)
    code, _ = run_cli(rollout_args(mosquitto, fleet, bundles, tmp_path, "--rollout-id", "ro-y", "--canary", "0",
                                   "--waves", "1"), capsys)
    assert code == EXIT_OK
    code = fleet_cli.main(rollout_args(mosquitto, fleet, bundles, tmp_path, "--rollout-id", "ro-y", "--canary",
                                       "1", "--waves", "1"))
    assert code == EXIT_USAGE
    assert "different canary" in capsys.readouterr().err
    assert fleet.deploys() == {box.device_id: 1 for box in fleet.boxes}


# --- signed commands: boxes with a command key ---------------------------------------------------------------

@needs_cryptography
def test_with_a_command_key_boxes_confirm_a_signed_rollout_and_refuse_an_unsigned_one(
        make_fleet, mosquitto, bundles, tmp_path, capsys):
    from agent.cli.bundle import make_key_pair

    private_pem, _public_pem, public_hex = make_key_pair()
    key_file = tmp_path / "operator.pem"
    key_file.write_bytes(private_pem)
    fleet = make_fleet(2, commands={"public_key": public_hex})
    one_wave = ("--canary", "0", "--waves", "1")
    for bad in (["--ttl", "nan"], ["--ttl", "-5"], ["--ttl", "0"], ["--command-key", str(tmp_path / "none.pem")],
                ["--command-key", str(tmp_path / "operator.pem"), "--ttl", "inf"]):
        code = fleet_cli.main(rollout_args(mosquitto, fleet, bundles, tmp_path, "--rollout-id", "ro-bad", *one_wave,
                                           *bad))
        assert code == EXIT_USAGE, bad
        assert ("--ttl" if "--ttl" in bad else "--command-key") in capsys.readouterr().err, bad
    assert not (tmp_path / "rollouts" / "ro-bad.json").exists()  # refused before anything was planned or sent

    # Unsigned: every box refuses with its own code, at once (not a timeout), and runs nothing.
    code, report = run_cli(rollout_args(mosquitto, fleet, bundles, tmp_path, "--rollout-id", "ro-unsigned",
                                        *one_wave), capsys)
    assert code == EXIT_PARTIAL, report
    assert report["counts"] == {"failed": 2}
    assert all(b["outcome"] == "failed" and b["error"].startswith("unsigned:") for b in report["boxes"]), report
    assert fleet.deploys() == {box.device_id: 0 for box in fleet.boxes}
    assert all(s["version"] == "1.0.0" for s in truth(fleet).values())

    # Signed with the operator's key (dated with the default ttl): every box confirms.
    code, report = run_cli(rollout_args(mosquitto, fleet, bundles, tmp_path, "--rollout-id", "ro-signed",
                                        "--command-key", str(key_file), *one_wave), capsys)
    assert code == EXIT_OK, report
    assert report["counts"] == {"confirmed": 2}
    assert fleet.deploys() == {box.device_id: 1 for box in fleet.boxes}
    assert all(s["version"] == "2.0.0" and s["state"] == "confirmed" for s in truth(fleet).values())


@needs_cryptography
def test_a_deploy_sent_again_to_a_box_back_after_its_ttl_is_dated_and_signed_again(tmp_path):
    from agent.cli.bundle import make_key_pair
    from agent.commands.freshness import ForwardClock, Freshness
    from agent.protocol.envelope import CommandEnvelope

    private_pem, _public_pem, public_hex = make_key_pair()
    deploys = []
    link = None

    def answer(topic, payload):  # the box drops off as the deploy goes out and is back 600 s later
        if not topic.endswith("/cmd/deploy"):
            return []
        deploys.append(payload)
        if len(deploys) == 1:
            link.later.append((link.mono + 600.0, Message("%s/box-0/status" % SIM_PREFIX, json.dumps(
                _online("box-0")).encode(), True)))
            return [Message("%s/box-0/status" % SIM_PREFIX, json.dumps(
                {"state": "offline", "groups": ["sim"], "reason": "lost"}).encode(), True)]
        return [_ack("box-0", payload, FAILED, error={"code": "golden_mismatch", "message": "ends the test"})]

    link = SimulatedLink({"box-0": _online("box-0")}, answer=answer)
    spec = RolloutSpec(group="sim", bundle="b.tar.gz", sha256=SIM_SHA, prefix=SIM_PREFIX, canary=0, waves=1,
                       confirm_timeout_s=3600.0)
    Rollout(spec, spec.default_id(), str(tmp_path), link, progress=link.progress, clock=link.wall,
            monotonic=lambda: link.mono, settle_s=0.3,
            envelope=CommandEnvelope(60.0, private_pem, clock=link.wall)).run()
    first, again = deploys
    assert again["request_id"] == first["request_id"]  # the same command: the box's record keeps it once
    assert again["issued_at"] - first["issued_at"] >= 600.0 and again["signature"] != first["signature"]
    box = Freshness(bytes.fromhex(public_hex), clock=ForwardClock(wall=link.wall, mono=lambda: link.mono))
    with pytest.raises(CommandError, match="expired"):
        box.check("box-0", "deploy", first)  # what was sent first is stale by the time the box is back
    box.check("box-0", "deploy", again)  # the send of now is fresh and signed for this box


@needs_cryptography
def test_an_abort_rolls_back_with_signed_dated_rollbacks(tmp_path):
    from agent.cli.bundle import make_key_pair
    from agent.commands.freshness import ForwardClock, Freshness
    from agent.protocol.envelope import CommandEnvelope

    private_pem, _public_pem, public_hex = make_key_pair()
    rollbacks = []

    def answer(topic, payload):  # box-0 fails its deploy, box-1 deploys; the rollback is only recorded
        device, verb = topic.split("/")[1], topic.rsplit("/", 1)[1]
        if verb == "rollback":
            rollbacks.append((device, payload))
        if verb != "deploy":
            return []
        if device == "box-0":
            return [_ack(device, payload, FAILED, error={"code": "golden_mismatch", "message": "off"})]
        return [_ack(device, payload, SUCCEEDED, result={"model": {"name": "m", "version": "2"}})]

    link = SimulatedLink({"box-0": _online("box-0"), "box-1": _online("box-1")}, answer=answer)
    spec = RolloutSpec(group="sim", bundle="b.tar.gz", sha256=SIM_SHA, prefix=SIM_PREFIX, canary=0, waves=1,
                       max_failures=0, rollback_on_abort=True, revert_timeout_s=5.0)
    Rollout(spec, spec.default_id(), str(tmp_path), link, progress=link.progress, clock=link.wall,
            monotonic=lambda: link.mono, settle_s=0.3,
            envelope=CommandEnvelope(None, private_pem, clock=link.wall)).run()
    [(device, message)] = rollbacks
    assert device == "box-1" and message["ttl_s"] == 300.0  # a key without --ttl dates with the default
    box = Freshness(bytes.fromhex(public_hex), clock=ForwardClock(wall=link.wall, mono=lambda: link.mono))
    box.check("box-1", "rollback", message)
    with pytest.raises(CommandError, match="signature"):
        box.check("box-0", "rollback", message)  # signed for box-1 only


# --- across a bridge ----------------------------------------------------------------------------------------

def bridge_config(central, prefix):
    """The site (box side) broker's bridge to the central (operator side) one: what goes up, what comes down."""
    return [
        "connection site-to-central",
        "address %s:%d" % (central.host, central.port),
        "remote_clientid bridge-site-a",
        "cleansession true",
        "restart_timeout 1",
        "bridge_protocol_version mqttv311",
        "try_private true",
        "notifications false",
        # up: what boxes say (retained status keeps its retain flag across the bridge)
        "topic %s/+/status out 1" % prefix,
        "topic %s/+/ack/# out 1" % prefix,
        "topic %s/+/events out 1" % prefix,
        "topic %s/+/telemetry/# out 0" % prefix,
        "topic %s/+/results/# out 1" % prefix,
        # down: commands to one box, and to the groups this site's boxes belong to
        "topic %s/+/cmd/# in 1" % prefix,
        "topic %s/group/sim/cmd/# in 1" % prefix,
        "topic %s/announce in 1" % prefix,  # the operator's announce request: every box answers
    ]


def test_status_and_rollout_work_across_a_mosquitto_bridge(tmp_path, make_fleet, bundles, capsys):
    prefix = "fleet-bridge-%s" % os.urandom(3).hex()
    with EmbeddedBroker() as central, EmbeddedBroker(extra_config=bridge_config(central, prefix)) as site:
        fleet = make_fleet(5, broker=site, prefix=prefix)  # boxes know only the site broker

        def all_seen():
            code, status = run_cli(["status", "--broker", central.url, "--prefix", prefix, "--json", "--listen",
                                    "0"], capsys)
            # heard live: each box's answer to the announce crossed the bridge both ways
            return code == EXIT_OK and sum(b["state"] == "online" and b["heard_live"] for b in status["boxes"]) == 5

        assert wait_for(all_seen, timeout=30), central.log_tail() + site.log_tail()
        code, report = run_cli(rollout_args(central, fleet, bundles, tmp_path, "--canary", "1", "--waves", "1",
                                            "--max-failures", "0"), capsys)
        assert code == EXIT_OK, report
        assert report["counts"] == {"confirmed": 5}
        assert fleet.deploys() == {box.device_id: 1 for box in fleet.boxes}
        assert all(s == {"version": "2.0.0", "state": "confirmed"} for s in truth(fleet).values())


def test_state_writes_grow_with_the_changes_not_with_the_fleet(tmp_path):
    """5,000 boxes through a simulated link: a few MB written in all (6.9 MB here), where every outcome used to
    rewrite and fsync the whole file (about 15 GB per rollout)."""
    count = 5000
    new = {"name": "m", "version": "2", "manifest_sha256": SIM_SHA}

    def answer(topic, payload):
        if not topic.endswith("/cmd/deploy"):  # the announce request: the statuses are already queued
            return []
        device = topic.split("/")[1]
        confirmed = dict(_online(device), slots={"serving": "b", "slots": {
            "a": {"state": "standby", "name": "m", "version": "1", "manifest_sha256": "a" * 64},
            "b": dict(new, state="confirmed")}})
        return [_ack(device, payload, SUCCEEDED, result={"model": new}),
                Message("%s/%s/status" % (SIM_PREFIX, device), json.dumps(confirmed).encode(), True)]

    link = SimulatedLink({"box-%04d" % i: _online("box-%04d" % i) for i in range(count)}, answer=answer)
    state = _rollout(link, tmp_path, canary=10, waves=4).run()
    assert state.status == RolloutStatus.COMPLETED and state.outcomes() == {"confirmed": count}
    assert state.bytes_written < 10 * 1024 * 1024, state.bytes_written
    reloaded = RolloutState.load(state.path)
    assert reloaded.boxes == state.boxes  # what was written is the whole state


def test_max_per_minute_spreads_the_deploys(tmp_path):
    def answer(topic, payload):
        if not topic.endswith("/cmd/deploy"):
            return []  # the announce
        return [_ack(topic.split("/")[1], payload, FAILED, error={"code": "invalid", "message": "no"})]

    link = SimulatedLink({"box-%d" % i: _online("box-%d" % i) for i in range(5)}, answer=answer)
    state = _rollout(link, tmp_path, canary=0, waves=1, max_per_minute=2).run()
    sent = _sent(link, "deploy")
    assert len(sent) == 5 and state.outcomes() == {"failed": 5}
    assert all(sum(1 for t in sent if start <= t < start + 60.0) <= 2 for start in sent)
    assert sent[-1] - sent[0] >= 120.0  # 5 deploys at 2 a minute: the fifth waits two minutes


def test_progress_acks_extend_the_step_timeout(tmp_path):
    """A slow download that keeps saying it is working is not timed out; a silent one is."""
    def answer(topic, payload):
        if not topic.endswith("/cmd/deploy"):
            return []  # the announce
        device = topic.split("/")[1]
        now = link.mono
        for offset in (40.0, 80.0, 120.0):  # progress every 40 s, under the 60 s step timeout
            link.later.append((now + offset, _ack(device, payload, "in_progress", message="fetching")))
        confirmed = dict(_online(device), slots={"serving": "b", "slots": {
            "a": {"state": "standby", "name": "m", "version": "1", "manifest_sha256": "a" * 64},
            "b": {"state": "confirmed", "name": "m", "version": "2", "manifest_sha256": SIM_SHA}}})
        link.later.append((now + 150.0, _ack(device, payload, SUCCEEDED, result={"model": {
            "name": "m", "version": "2", "manifest_sha256": SIM_SHA}})))
        link.later.append((now + 151.0, Message("%s/%s/status" % (SIM_PREFIX, device),
                                                json.dumps(confirmed).encode(), True)))
        return [_ack(device, payload, "accepted")]

    link = SimulatedLink({"box-0": _online("box-0")}, answer=answer)
    state = _rollout(link, tmp_path / "talks", step_timeout_s=60.0, confirm_timeout_s=100.0).run()
    assert state.boxes["box-0"].outcome == "confirmed"
    quiet = SimulatedLink({"box-0": _online("box-0")}, answer=lambda topic, payload: [])
    state = _rollout(quiet, tmp_path / "silent", step_timeout_s=60.0, confirm_timeout_s=100.0).run()
    assert state.boxes["box-0"].outcome == Outcome.TIMED_OUT and "within 60 s" in state.boxes["box-0"].error
