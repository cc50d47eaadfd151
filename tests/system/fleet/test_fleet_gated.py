"""Gated rollouts (``fleet rollout --shadow-frames``, docs/shadow.md) over three REAL daemons on a real Mosquitto:
each box shadows the candidate on its own live frames before it is deployed. A candidate whose labels are shifted
by one is caught in the canary (``disagreement``), no box is ever sent a deploy and every box still serves the old
model by its own status; the demo bundle's int8 beside its float serving model agrees and is promoted on every box.
Then the gate's other outcomes against protocol-only simulated boxes: an old agent, a disagreeing box in a wave,
a resumed rollout.
"""
# ruff: noqa: F811 - the fixture box_fleet comes from tests.support.fleet_support

import json
import os
import signal
import subprocess
import sys

import pytest

try:  # first: MindSpore fixes protobuf's implementation before onnx may (converters/byom/model_file.py); the
    import mindspore  # noqa: F401 - YOLOv8 fleet's bundle create needs it, the scales-x4 candidate imports onnx
except ImportError:  # the Lite lane collects this module too (its fleet_rig tests do not run there)
    pass

from agent.cli import fleet as fleet_cli
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.devtools.scenes import generate_scenes
from agent.fleet.journal import RolloutState
from agent.fleet.plan import RolloutError
from agent.fleet.report import EXIT_ABORTED, EXIT_COMPLETED, EXIT_PARTIAL, EXIT_PAUSED
from tests.conftest import REPO_ROOT, wait_for
from tests.support.fleet_boxes import random_prefix
from tests.support.fleet_support import box_fleet, sim_rollout_args  # noqa: F401 - box_fleet is a fixture
from tests.support.golden_damage import damaged_bundle, scales_x4
from tests.support.shadow_support import (
    candidate_bundle,
    gated_bundles,
    gated_daemons,
    gated_rollout,
    outcomes,
    serving_versions,
)

pytestmark = [pytest.mark.fleet_rig,
              pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                 reason="examples/demo-bundle is missing (make demo-bundle)")]

DEVICES = ("gate-1", "gate-2", "gate-3")
YOLO_DEVICES = ("yolo-1", "yolo-2", "yolo-3")
# the demo detector trained 2 epochs instead of 18 (tests/data/build_undertrained_bundle.py): mAP@0.5 0.17, not 0.98
UNDERTRAINED = os.path.join(os.path.dirname(__file__), "..", "..", "data", "shapes-undertrained")
YOLOV8T = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "byom", "yolov8t.onnx")
ANSWER_S = 180  # a bound for three daemons starting on a loaded machine; never asserted as a duration
CAMERA_SIZES = [(480, 640), (480, 480), (480, 800)]


@pytest.fixture(scope="module")
def gated_fleet(tmp_path_factory, request):
    mosquitto = request.getfixturevalue("mosquitto")
    root = tmp_path_factory.mktemp("gated-fleet")
    prefix = random_prefix("gate")
    frames = root / "frames"
    write_sample_frames(str(frames), sizes_hw=CAMERA_SIZES * 8, seed=33)
    def broken(incoming, shas):
        shas["shifted"] = candidate_bundle(DEMO_BUNDLE, str(incoming / "shifted"), "1.2.0", shift_labels=True)
        shas["undertrained"] = candidate_bundle(UNDERTRAINED, str(incoming / "undertrained"), "1.4.0", serve="float")
        damaged_bundle(DEMO_BUNDLE, str(incoming / "x4"), scales_x4)
        shas["scales-x4"] = candidate_bundle(str(incoming / "x4"), str(incoming / "scales-x4"), "1.3.0")

    serving, shas = gated_bundles(root, len(DEVICES), more=broken)
    yield from _fleet(mosquitto, root, prefix, serving, frames, shas, DEVICES)


def _fleet(mosquitto, root, prefix, serving, frames, shas, devices):
    """The real daemons ``devices`` (group ``g``) reading ``frames`` in a loop: tests/support/shadow_support.py."""
    sources = [{"name": "cam", "uri": str(frames), "loop": True}]
    yield from gated_daemons(mosquitto, root, prefix, serving, shas, devices, [sources] * len(devices), ANSWER_S)


def _deploys_sent(probe, prefix):
    return [t for t, _, _, _ in list(probe.messages) if t.startswith(prefix + "/") and t.endswith("/cmd/deploy")]


@pytest.fixture(scope="module")
def yolo_fleet(tmp_path_factory, request):
    """Three daemons serving the tests' weakly trained YOLOv8 (tests/fixtures/byom/yolov8t.onnx, float), with its
    int8 made by ``bundle create --int8`` in each store; they read its kind of scenes at the bundle's conf 0.25."""
    pytest.importorskip("mindspore")  # bundle create's converters (imported first, at the top of this module)
    pytest.importorskip("onnxruntime.quantization")
    import cv2

    from agent.cli.main import main as cli_main

    mosquitto = request.getfixturevalue("mosquitto")
    root = tmp_path_factory.mktemp("yolo-fleet")
    calibration, frames = root / "calibration", root / "frames"
    for folder, seed, count in ((calibration, 31, 40), (frames, 57, 30)):
        folder.mkdir()
        for index, (image, _b, _c) in enumerate(generate_scenes(seed, count, (256, 256))):
            cv2.imwrite(str(folder / ("scene%02d.png" % index)), image)
    made = str(root / "made")
    assert cli_main(["bundle", "create", "--out", made, "--model", YOLOV8T, "--images", str(calibration),
                     "--int8"]) == 0
    serving, shas = gated_bundles(root, len(DEVICES), source=made)
    yield from _fleet(mosquitto, root, random_prefix("yolo"), serving, frames, shas, YOLO_DEVICES)


@pytest.mark.parametrize("broken, outcome", [("shifted", "disagreement"), ("undertrained", "disagreement"),
                                             ("scales-x4", "failed")])
def test_a_broken_candidate_is_caught_in_the_canary_and_no_box_serves_it(gated_fleet, capsys, broken, outcome):
    """``shifted``: the demo's labels rotated by one (the same network, a label file from another version): its
    shadow run disagrees. ``undertrained``: the same detector trained for 2 epochs instead of 18 (its own golden
    set passes): its shadow run disagrees. ``scales-x4``: its int8 with every activation scale four times too
    large: the canary's golden self-test refuses it before the run starts. (With a golden set made by that same
    wrong model it would pass the self-test, and its detections still agree with the float model's: score-aware
    F1 0.98 on 72 scenes, the coarser steps cost this detector little; a gate on agreement lets that one
    through.)"""
    code, report, err = gated_rollout(gated_fleet, broken, capsys)
    boxes = {b["device"]: b for b in report["boxes"]}
    assert code == EXIT_ABORTED and report["status"] == "aborted", err
    caught = [b for b in boxes.values() if b.get("outcome") == outcome]
    assert len(caught) == 1 and caught[0]["wave"] == 0, boxes  # the canary, alone
    print(broken, "canary:", caught[0]["error"])
    if outcome == "disagreement":
        assert "score-aware F1" in caught[0]["error"] and caught[0]["shadow"]["f1"] < 0.5
    else:
        assert "golden" in caught[0]["error"], caught[0]["error"]
    assert _deploys_sent(gated_fleet["probe"], gated_fleet["prefix"]) == []  # no box was ever sent the deploy
    assert serving_versions(gated_fleet["probe"], gated_fleet["prefix"]) == dict.fromkeys(DEVICES, "1.0.0")


def test_a_healthy_int8_candidate_is_promoted_on_every_box(gated_fleet, capsys):
    code, report, err = gated_rollout(gated_fleet, "int8", capsys)
    boxes = {b["device"]: b for b in report["boxes"]}
    assert code == EXIT_COMPLETED and report["status"] == "completed", outcomes(err, boxes)
    for device in DEVICES:
        shadow = boxes[device]["shadow"]
        assert boxes[device]["outcome"] == "confirmed" and shadow["verdict"] == "agrees", boxes[device]
        assert shadow["f1"] >= 0.95 and shadow["frames"] >= 20
        print(device, "score-aware F1", shadow["f1"], "strict", shadow["strict_f1"], "on", shadow["detections"],
              "detections")
    assert wait_for(lambda: serving_versions(gated_fleet["probe"], gated_fleet["prefix"]) ==
                    dict.fromkeys(DEVICES, "1.1.0"), timeout=60)
    # fleet status shows each box's last shadow run, from its retained report
    figures = capsys.readouterr().out  # the figures printed above, kept apart from the JSON below
    code = fleet_cli.main(["status", "--broker", gated_fleet["broker"].url, "--prefix", gated_fleet["prefix"],
                           "--json", "--listen", "2", "--state-dir", str(gated_fleet["root"] / "rollouts")])
    shown = {b["device"]: b["shadow"] for b in json.loads(capsys.readouterr().out)["boxes"]}
    print(figures)
    assert code == EXIT_COMPLETED and set(shown) == set(DEVICES), shown
    assert all(s["candidate"] == "1.1.0" and s["state"] == "finished" and s["f1"] >= 0.95 for s in shown.values())


def test_a_healthy_int8_of_a_weakly_trained_yolov8_is_promoted_on_score_aware_agreement(yolo_fleet, capsys):
    """Its int8 keeps the float model's findings but moves marginal detections across conf: the strict reading
    is lower than the score-aware one that the gate judges by (both printed), and every box is promoted."""
    code, report, err = gated_rollout(yolo_fleet, "int8", capsys, "--shadow-frames", "30")
    boxes = {b["device"]: b for b in report["boxes"]}
    assert code == EXIT_COMPLETED and report["status"] == "completed", outcomes(err, boxes)
    for device in YOLO_DEVICES:
        shadow = boxes[device]["shadow"]
        print("yolov8t %s: score-aware F1 %s, strict F1 %s on %s frames, %s detections" % (
            device, shadow["f1"], shadow["strict_f1"], shadow["frames"], shadow["detections"]))
        assert boxes[device]["outcome"] == "confirmed" and shadow["f1"] >= 0.95
        assert shadow["strict_f1"] <= shadow["f1"]
    assert any(boxes[d]["shadow"]["strict_f1"] < boxes[d]["shadow"]["f1"] for d in YOLO_DEVICES)


# --- the gate's outcomes, against protocol-only simulated boxes (tests/support/fleet_boxes.py) --------------------

def _sim_rollout(fleet, tmp_path, capsys, *extra):
    code = fleet_cli.main(sim_rollout_args(fleet.url, fleet.prefix, tmp_path, "--shadow-frames", "50",
                                           "--shadow-timeout", "60", *extra))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, {b["device"]: b for b in json.loads(captured.out)["boxes"]}, captured.err


def test_an_old_agent_and_a_disagreeing_box_are_never_deployed_the_others_are(box_fleet, tmp_path, capsys):
    """box-02 predates shadow runs (answers unknown_verb), box-04 measures F1 0.60: neither is sent a deploy, both
    are counted failures (the rollout ends partial, not completed); the four others agree and confirm."""
    fleet = box_fleet(6, faults={2: ("no_shadow", None), 4: ("disagree", {"f1": 0.60})}).start()
    code, boxes, err = _sim_rollout(fleet, tmp_path, capsys, "--canary", "1", "--waves", "1")
    assert code == EXIT_PARTIAL, err
    assert boxes["box-02"]["outcome"] == "no_shadow" and "older agent" in boxes["box-02"]["error"]
    assert boxes["box-04"]["outcome"] == "disagreement" and "0.600 below --min-agreement 0.950" in \
        boxes["box-04"]["error"]
    assert fleet.box("box-02").deploys == 0 and fleet.box("box-04").deploys == 0
    for device in ("box-00", "box-01", "box-03", "box-05"):
        assert boxes[device]["outcome"] == "confirmed" and boxes[device]["shadow"]["verdict"] == "agrees"
    # the disagreeing box was told to discard its candidate; its answer to that is its own: no anomaly
    assert ("shadow-stop", True) in [(verb, body.get("discard")) for verb, body in fleet.box("box-04").commands]
    assert all(b["anomalies"] == [] for b in boxes.values()), boxes


def test_a_canary_that_disagrees_aborts_before_any_deploy(box_fleet, tmp_path, capsys):
    fleet = box_fleet(4, faults={0: ("disagree", None)}).start()
    code, boxes, err = _sim_rollout(fleet, tmp_path, capsys, "--canary", "1", "--waves", "1")
    assert code == EXIT_ABORTED and "the canary failed (box-00 disagreement)" in err, err
    assert sum(box.deploys for box in fleet.boxes) == 0
    assert [d for d, b in boxes.items() if b["shadow"]] == ["box-00"]  # the others were not even shadowed


def test_a_run_that_ran_out_of_time_is_judged_by_its_own_report_and_a_lost_command_times_out(
        box_fleet, tmp_path, capsys):
    """--shadow-timeout 3: box-01 answers its shadow command 1 s late (its candidate loading) and its run, too slow
    for 50 frames, ends at the command's max_s from then with 7 compared: its own report decides (failed, too few
    frames), not the operator's clock. box-02's command is lost: timed_out once the bound passed unanswered."""
    fleet = box_fleet(3, faults={1: ("slow_shadow", {"load_s": 1.0, "run_s": 20.0}),
                                 2: ("mute_shadow", None)}).start()
    code, boxes, err = _sim_rollout(fleet, tmp_path, capsys, "--waves", "1", "--shadow-timeout", "3")
    assert code == EXIT_PARTIAL, err
    assert boxes["box-00"]["outcome"] == "confirmed", boxes["box-00"]
    slow = boxes["box-01"]
    assert slow["outcome"] == "failed" and slow["shadow"]["frames"] == 7, slow
    assert "compared 7 of 50 frame(s) (max_s (3 s) reached after 7 frames): too few to judge" in slow["error"], slow
    lost = boxes["box-02"]
    assert lost["outcome"] == "timed_out" and "no answer to the shadow command within --shadow-timeout 3 s" in \
        lost["error"], lost
    assert fleet.box("box-01").deploys == 0 and fleet.box("box-02").deploys == 0
    # the boxes' answers to the shadow-stop sent on each refusal are their own: no anomaly
    assert all(b["anomalies"] == [] for b in boxes.values()), boxes


def test_a_rerun_reads_the_verdicts_it_recorded_and_shadows_no_box_twice(box_fleet, tmp_path, capsys):
    """Paused after its canary, the rollout is resumed: the canary's recorded verdict stands (no second shadow
    command), the other boxes are shadowed once each."""
    fleet = box_fleet(3).start()
    code, boxes, err = _sim_rollout(fleet, tmp_path, capsys, "--canary", "1", "--waves", "1",
                                    "--pause-after-canary", "--rollout-id", "gated-resume")
    assert code == EXIT_PAUSED and boxes["box-00"]["shadow"]["verdict"] == "agrees", err
    code = fleet_cli.main(["resume", "--broker", fleet.url, "--prefix", fleet.prefix, "--state-dir", str(tmp_path),
                           "--rollout-id", "gated-resume"])
    assert code == EXIT_COMPLETED, capsys.readouterr().err
    shadows = {box.device: [v for v, _ in box.commands].count("shadow") for box in fleet.boxes}
    assert shadows == dict.fromkeys(("box-00", "box-01", "box-02"), 1)
    assert all(box.deploys == 1 for box in fleet.boxes)


def test_killed_while_a_wave_is_shadowed_a_rerun_judges_the_same_runs_and_deploys_each_box_once(box_fleet, tmp_path):
    """The operator is killed (SIGKILL) after its canary was sent ``shadow`` and before that run's report came: the
    re-run sends the same request id (the box answers from its record: no second run), reads the report the box
    kept retained, and the rollout completes with one shadow run and one deploy per box."""
    fleet = box_fleet(4, shadow_s=8.0).start()
    args = [sys.executable, "-m", "agent", "fleet"] + sim_rollout_args(
        fleet.url, fleet.prefix, tmp_path, "--shadow-frames", "50", "--shadow-timeout", "90", "--canary", "1",
        "--waves", "1", "--rollout-id", "gated-kill")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    state_file = str(tmp_path / "gated-kill.json")
    first = subprocess.Popen(args, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def mid_gate():
        try:
            state = RolloutState.load(state_file)
        except RolloutError:
            return False  # read in the middle of a snapshot's rename
        return state is not None and any((b.shadow or {}).get("request_id") and "verdict" not in b.shadow
                                         for b in state.boxes.values())

    assert wait_for(mid_gate, timeout=60), first.stderr.read().decode() if first.poll() is not None else ""
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert sum(box.deploys for box in fleet.boxes) == 0  # killed in the gate: nothing deployed yet

    second = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, timeout=180)
    assert second.returncode == EXIT_COMPLETED, second.stderr.decode()[-2000:]
    report = json.loads(second.stdout)
    assert report["runs"] == 2 and report["counts"] == {"confirmed": 4}
    runs = {box.device: {body["request_id"] for verb, body in box.commands if verb == "shadow"}
            for box in fleet.boxes}
    assert {device: len(ids) for device, ids in runs.items()} == dict.fromkeys(runs, 1), runs
    assert all(box.deploys == 1 for box in fleet.boxes)
    assert all(b["shadow"]["verdict"] == "agrees" for b in report["boxes"])
