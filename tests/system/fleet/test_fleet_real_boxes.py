"""``fleet rollout`` and ``fleet status`` against REAL daemons (``python -m agent run``, cpu-dev), not simulated
boxes: what a real box puts in its status is what the operator's checks must read (issue 30, items 4 and 5).

Three daemons on one prefix: ``cam-1`` and ``cam-2`` in group ``g``, and a second ``cam-2`` in group ``h`` (its
own MQTT client id, as a cloned box's config would have): two boxes answering as one device id, each one's
status overwriting the other's on the one retained topic ``<prefix>/cam-2/status``.
"""

import json
import os
import shutil

import pytest

from agent.bundle.verify import sha256_file, write_manifest
from agent.cli import fleet as fleet_cli
from agent.cli.ctl import EXIT_OK, EXIT_USAGE
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from benchmarks.fleet_sim import build_bundle
from tests.conftest import MqttProbe, wait_for
from tests.support.daemon_rig import start_daemon, stop_daemons, write_config
from tests.support.fleet_boxes import random_prefix

pytestmark = [pytest.mark.fleet_rig,
              pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                 reason="examples/demo-bundle is missing (make demo-bundle)")]

BOXES = (("cam-1", ["g"], None), ("cam-2", ["g"], None), ("cam-2", ["h"], "cam-2-clone"))
ANSWER_S = 120  # a bound for three daemons starting on a loaded machine; never asserted as a duration


@pytest.fixture(scope="module")
def real_fleet(tmp_path_factory, request):
    mosquitto = request.getfixturevalue("mosquitto")
    root = tmp_path_factory.mktemp("real-fleet")
    prefix = random_prefix("real")
    frames = root / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=3)
    probe = MqttProbe(mosquitto, ["%s/#" % prefix])
    procs = []
    try:
        for index, (device, groups, client_id) in enumerate(BOXES):
            home = root / ("box%d" % index)
            home.mkdir()
            mqtt = {"host": mosquitto.host, "port": mosquitto.port, "reconnect_min_s": 0.1, "reconnect_max_s": 1.0,
                    "prefix": prefix, "groups": groups}
            if client_id:
                mqtt["client_id"] = client_id
            procs.append(start_daemon(write_config(home, mosquitto, frames, device_id=device, mqtt=mqtt)))
        # Up once each has published an online status with its slots (the clone's and cam-2's share a topic).
        assert wait_for(lambda: _online_statuses(probe, prefix) >= {("cam-1", "g"), ("cam-2", "g"), ("cam-2", "h")},
                        timeout=ANSWER_S, interval=0.2), [p.poll() for p in procs]
        yield {"broker": mosquitto, "prefix": prefix, "probe": probe, "root": root}
    finally:
        stop_daemons(procs)
        probe.close()


def _online_statuses(probe, prefix):
    seen = set()
    for topic, payload, _retain, _qos in list(probe.messages):
        if topic.startswith(prefix + "/") and topic.endswith("/status") and payload:
            body = json.loads(payload)
            if body.get("state") == "online" and body.get("slots"):
                seen |= {(body["device_id"], g) for g in body.get("groups", [])}
    return seen


def _commands_sent(probe, prefix):
    return [t for t, _, _, _ in list(probe.messages) if t.startswith(prefix + "/") and "/cmd/" in t
            and not t.endswith("/announce")]


def run_cli(args, capsys):
    code = fleet_cli.main(args)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    out = captured.out
    return code, (json.loads(out) if out.strip().startswith("{") else out), captured.err


def ascend_only_bundle(root):
    """A bundle whose only artifact is an .om for an Ascend 310: nothing a cpu-dev box can serve."""
    bundle = build_bundle(str(root / "ascend-only"), "2.0.0")
    manifest = json.load(open(os.path.join(bundle, "manifest.json")))
    artifact = manifest["artifacts"][0]
    shutil.move(os.path.join(bundle, artifact["file"]), os.path.join(bundle, "model_16x16.om"))
    artifact.update(file="model_16x16.om", format="om", target="ascend", soc_version="Ascend310", sha256="", size=0)
    manifest["golden"] = None
    os.remove(os.path.join(bundle, "golden", "case0.model_16x16.onnx.npy"))
    write_manifest(bundle, manifest)
    return bundle, sha256_file(os.path.join(bundle, "manifest.json"))


def rollout(fleet, bundle, sha, *extra):
    return ["rollout", "--broker", fleet["broker"].url, "--prefix", fleet["prefix"], "--group", "g",
            "--bundle", bundle, "--sha256", sha, "--state-dir", str(fleet["root"] / "rollouts"), "--listen", "2",
            "--canary", "1", "--json"] + list(extra)


def test_preflight_reads_real_daemons_kinds_and_refuses_an_ascend_only_bundle(real_fleet, capsys):
    bundle, sha = ascend_only_bundle(real_fleet["root"])
    code, _, err = run_cli(rollout(real_fleet, bundle, sha, "--allow-duplicate-ids"), capsys)
    assert code == EXIT_USAGE
    assert "device kind not checked" not in err  # each real daemon said its kind
    assert "cam-1 (cpu-dev, onnxruntime)" in err and "the bundle has nothing" in err, err
    assert _commands_sent(real_fleet["probe"], real_fleet["prefix"]) == []  # refused before anything was sent


def test_a_device_id_in_two_groups_is_refused_and_fleet_status_shows_both(real_fleet, capsys):
    prefix = real_fleet["prefix"]
    code, _, err = run_cli(rollout(real_fleet, DEMO_BUNDLE, sha256_file(os.path.join(DEMO_BUNDLE, "manifest.json")),
                              "--no-preflight"), capsys)
    assert code == EXIT_USAGE
    assert "cam-2" in err and "groups g" in err and "groups h" in err and "--allow-duplicate-ids" in err, err
    assert _commands_sent(real_fleet["probe"], prefix) == []

    code, shown, _ = run_cli(["status", "--broker", real_fleet["broker"].url, "--prefix", prefix, "--json",
                           "--listen", "2", "--state-dir", str(real_fleet["root"] / "rollouts")], capsys)
    assert code == EXIT_OK
    rows = [(b["device"], sorted(b["groups"])) for b in shown["boxes"]]
    assert sorted(rows) == [("cam-1", ["g"]), ("cam-2", ["g"]), ("cam-2", ["h"])], rows
    assert all(b["duplicate"] for b in shown["boxes"] if b["device"] == "cam-2")
