"""The daemon end to end, as a real process, against a real Mosquitto, on the committed demo bundle.

Frames with known ground truth go in; one result per frame comes out over MQTT with boxes in original pixels;
presence is retained online and turns offline through the last will when the process is SIGKILLed; SIGTERM
loses nothing; a bad bundle is refused with its reason.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.cli.main import EXIT_CANNOT_START
from tests.conftest import WAIT_S, MqttProbe, wait_for
from tests.support.daemon_rig import SIZES, iou, start_daemon, write_config

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

def test_frames_in_results_out_with_correct_boxes_and_presence(tmp_path, mosquitto):
    frames_dir = tmp_path / "frames"
    truth = {t["name"]: t for t in write_sample_frames(str(frames_dir), sizes_hw=SIZES, seed=7)}
    results = MqttProbe(mosquitto, ["atlas-edge/e2e/results/#"])
    status = MqttProbe(mosquitto, ["atlas-edge/e2e/status"])
    proc = start_daemon(write_config(tmp_path, mosquitto, frames_dir))
    try:
        assert results.wait(lambda m: len(m) >= len(SIZES), timeout=120), proc.stdout.read() if proc.poll() else ""
        time.sleep(0.5)  # an observation window, not synchronisation: a duplicate would arrive now
        received = results.json()
        assert len(received) == len(SIZES)
        assert all(topic == "atlas-edge/e2e/results/cam" for topic, _ in received)
        assert sorted(r["frame_id"] for _, r in received) == list(range(len(SIZES)))
        matched = total = 0
        for _, result in received:
            gt = truth[result["name"]]
            assert result["image_hw"] == gt["hw"]
            assert result["model"]["name"] and set(result["timings_ms"]) >= {"preprocess", "infer", "postprocess"}
            for box, label in zip(gt["boxes"], gt["labels"]):
                total += 1
                best = max((iou(box, d["box"]) for d in result["detections"] if d["label"] == label), default=0.0)
                matched += best >= 0.5
        assert total > 0 and matched / total >= 0.9, "only %d of %d objects found with IoU >= 0.5" % (matched, total)
        assert status.wait(lambda m: any(s.get("state") == "online" for _t, s in m), timeout=10)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert status.wait(lambda m: m[-1][1].get("state") == "offline", timeout=30)
        # The retained status a newcomer sees is offline too (the last will is retained).
        late = MqttProbe(mosquitto, ["atlas-edge/e2e/status"])
        assert wait_for(lambda: late.count() >= 1, timeout=10)
        _topic, payload, retained, _dup = late.messages[-1]
        assert retained and json.loads(payload).get("state") == "offline"
        late.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        results.close()
        status.close()


def test_sigterm_loses_no_result(tmp_path, mosquitto):
    frames_dir = tmp_path / "frames"
    write_sample_frames(str(frames_dir), sizes_hw=SIZES[:4], seed=3)
    results = MqttProbe(mosquitto, ["atlas-edge/e2e/results/#"])
    proc = start_daemon(write_config(tmp_path, mosquitto, frames_dir, loop=True))
    try:
        assert results.wait(lambda m: len(m) >= 10, timeout=120)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-2000:]
        line = [ln for ln in output.splitlines() if "published" in ln and "stopped" in ln]
        assert line, output[-2000:]
        published = int(line[-1].split("published ")[1].split()[0])
        from agent.ops.outbox import Outbox

        pending = len(Outbox(str(tmp_path / "state" / "outbox.sqlite"), 1 << 26))  # fixed: the process is gone
        # What it published before exiting may still be on its way from the broker to this subscriber.
        assert wait_for(lambda: results.count() + pending == published, timeout=WAIT_S), \
            "published %d, received %d, in outbox %d" % (published, results.count(), pending)
    finally:
        if proc.poll() is None:
            proc.kill()
        results.close()


def copy_bundle(tmp_path):
    target = tmp_path / "bundle"
    shutil.copytree(DEMO_BUNDLE, target)
    return target


def run_to_exit(config_path, timeout=120):
    proc = start_daemon(config_path)
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def test_bundle_with_wrong_hash_is_refused_naming_the_file(tmp_path, mosquitto):
    bundle = copy_bundle(tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    victim = manifest["artifacts"][0]["file"]
    data = bytearray((bundle / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bundle / victim).write_bytes(bytes(data))
    code, output = run_to_exit(write_config(tmp_path, mosquitto, tmp_path, bundle=bundle))
    assert code != 0
    assert "hash mismatch for %s" % victim in output


def test_bundle_for_another_soc_is_refused_naming_both(tmp_path, mosquitto):
    from agent.bundle.verify import write_manifest

    bundle = copy_bundle(tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    for art in manifest["artifacts"]:
        if art["format"] == "onnx":
            art.update(format="om", target="ascend", soc_version="Ascend310P3")
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["format"] == "om"]
    keep = {a["file"] for a in manifest["artifacts"]}
    for case in manifest.get("golden", {}).get("cases", []):
        case["expected"] = {k: v for k, v in case["expected"].items() if k in keep}
    for art in json.loads((tmp_path / "bundle" / "manifest.json").read_text())["artifacts"]:
        if art["file"] not in keep:
            os.remove(bundle / art["file"])
    write_manifest(str(bundle), manifest)
    # what the box checks before loading, and run without pyACL (this machine): the runtime is named first
    verify = subprocess.run([sys.executable, "-m", "agent", "bundle", "verify", str(bundle), "--device",
                             "atlas-200dk"], capture_output=True, text=True, timeout=120)
    assert verify.returncode != 0
    output = verify.stdout + verify.stderr
    assert "Ascend310P3" in output and "Ascend310" in output.replace("Ascend310P3", "")
    if importlib.util.find_spec("acl") is None:
        code, output = run_to_exit(write_config(tmp_path, mosquitto, tmp_path, bundle=bundle, device="atlas-200dk"))
        assert code == 78 and "backend acl (device atlas-200dk) cannot run on this machine" in output


def test_unknown_config_key_is_refused_before_start(tmp_path, mosquitto):
    path = write_config(tmp_path, mosquitto, tmp_path)
    data = yaml.safe_load(open(path))
    data["batching"]["max_bacth"] = 4
    data["mqtt"]["port"] = "1883"
    open(path, "w").write(yaml.safe_dump(data))
    code, output = run_to_exit(path)
    assert code == EXIT_CANNOT_START  # the unit's RestartPreventExitStatus=: no restart loop on a bad file
    assert "batching.max_bacth: unknown key" in output and "mqtt.port: expected an integer" in output


def test_corrupt_frame_is_counted_and_serving_goes_on(tmp_path, mosquitto):
    frames_dir = tmp_path / "frames"
    write_sample_frames(str(frames_dir), sizes_hw=SIZES[:3], seed=5)
    (frames_dir / "frame_001b_broken.png").write_bytes(b"\x89PNG\r\n\x1a\ngarbage")
    results = MqttProbe(mosquitto, ["atlas-edge/e2e/results/#"])
    telemetry = MqttProbe(mosquitto, ["atlas-edge/e2e/telemetry"])
    proc = start_daemon(write_config(tmp_path, mosquitto, frames_dir))
    try:
        assert results.wait(lambda m: len(m) >= 3, timeout=120)
        assert telemetry.wait(lambda m: any(t["sources"]["cam"]["decode_errors"] == 1 for _topic, t in m),
                              timeout=30)
        assert proc.poll() is None  # still serving
        names = sorted(r["name"] for _, r in results.json())
        assert names == sorted(n for n in os.listdir(frames_dir) if n.startswith("frame_0") and "broken" not in n)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        results.close()
        telemetry.close()


def test_detections_numeric_sanity_on_demo_model():
    """The demo model's boxes are finite and inside the image (guards against a mis-mapped letterbox)."""
    from agent.bundle.verify import verify_bundle
    from agent.config.device_config import load_device_config
    from agent.devtools.scenes import generate_scene
    from agent.pipeline.model import load_model

    model = load_model(verify_bundle(DEMO_BUNDLE), load_device_config("cpu-dev"), "opencv")
    try:
        rng = np.random.default_rng(11)
        image, _boxes, _classes = generate_scene(rng, (1080, 1920))
        (result,) = model.infer_frames([image])
        dets = result.detections
        assert np.isfinite(dets).all()
        assert (dets[:, 0] >= 0).all() and (dets[:, 2] <= 1920).all() and (dets[:, 3] <= 1080).all()
    finally:
        model.close()
