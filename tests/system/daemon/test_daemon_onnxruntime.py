"""The daemon serving on onnxruntime (cpu-dev prefers it when it imports), in both lanes: results flow over a
real MQTT broker, and results, telemetry and the retained status name the backend and precision that ran; a
``model.precision`` the bundle cannot serve stops the start, naming the field.
"""

import json
import os
import shutil
import signal

import pytest

from agent.bundle.verify import verify_bundle, write_manifest
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.cli.main import EXIT_CANNOT_START
from agent.config.device_config import load_device_config
from agent.pipeline.artifacts import select_artifacts
from tests.conftest import MqttProbe
from tests.support.daemon_rig import SIZES, start_daemon, write_config

pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install 'atlas-edge[ort]')")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")
MAX_BATCH = 2  # daemon_rig's batching.max_batch


def expected_precision() -> str:
    """What auto serves from the demo bundle on onnxruntime: int8 once the bundle carries an int8 ONNX."""
    chosen = select_artifacts(verify_bundle(DEMO_BUNDLE), load_device_config("cpu-dev"), "onnxruntime",
                              batch=MAX_BATCH)
    return "+".join(sorted({art.precision for art in chosen.values()}))


def test_the_daemon_serves_on_onnxruntime_and_says_so_in_results_telemetry_and_status(tmp_path, mosquitto):
    frames_dir = tmp_path / "frames"
    write_sample_frames(str(frames_dir), sizes_hw=SIZES[:4], seed=11)
    results = MqttProbe(mosquitto, ["atlas-edge/e2e/results/#"])
    telemetry = MqttProbe(mosquitto, ["atlas-edge/e2e/telemetry"])
    status = MqttProbe(mosquitto, ["atlas-edge/e2e/status"])
    proc = start_daemon(write_config(tmp_path, mosquitto, frames_dir))  # no model.backend: the device's order
    precision = expected_precision()
    assert precision == "int8", "the demo bundle carries qat's int8 ONNX for every tier: auto serves it here"
    try:
        assert results.wait(lambda m: len(m) >= 4, timeout=120), proc.stdout.read() if proc.poll() else ""
        received = [payload for _topic, payload in results.json()]
        assert sorted(r["frame_id"] for r in received) == [0, 1, 2, 3]
        assert {json.dumps(r["model"], sort_keys=True) for r in received} == {json.dumps(
            {"name": received[0]["model"]["name"], "version": received[0]["model"]["version"],
             "backend": "onnxruntime", "precision": precision}, sort_keys=True)}
        assert sum(len(r["detections"]) for r in received) > 0
        # a telemetry message after the frames: what ran, and the backend thread's busy share (0..1]
        assert telemetry.wait(lambda m: any(t.get("frames", 0) >= 4 for _t, t in m), timeout=30)
        served = [t for _t, t in telemetry.json() if t.get("frames", 0) >= 4][0]  # the first: within 5 s of them
        assert (served["model"]["backend"], served["model"]["precision"]) == ("onnxruntime", precision)
        assert 0 < served["backend_busy_fraction"] <= 1
        assert status.wait(lambda m: any(s.get("state") == "online" for _t, s in m), timeout=30)
        online = [s for _t, s in status.json() if s.get("state") == "online"][-1]
        assert (online["backend"], online["precision"]) == ("onnxruntime", precision)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
        for probe in (results, telemetry, status):
            probe.close()
    assert proc.returncode == 0, output[-3000:]


def test_an_int8_precision_the_bundle_lacks_stops_the_start_naming_model_precision(tmp_path, mosquitto):
    bundle = tmp_path / "bundle"
    shutil.copytree(DEMO_BUNDLE, str(bundle))
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["precision"] != "int8" or a["role"] != "serve"]
    kept = {a["file"] for a in manifest["artifacts"]}
    for case in manifest["golden"]["cases"]:
        case["expected"] = {k: v for k, v in case["expected"].items() if k in kept}
    for art in json.loads((tmp_path / "bundle" / "manifest.json").read_text())["artifacts"]:
        if art["file"] not in kept:
            os.remove(str(bundle / art["file"]))
    write_manifest(str(bundle), manifest)
    config = write_config(tmp_path, mosquitto, tmp_path, bundle=bundle,
                          model={"bundle": str(bundle), "observation_s": 0, "precision": "int8"})
    proc = start_daemon(config)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_CANNOT_START, output[-3000:]
    assert "model.precision" in output and "no int8 serve artifact for backend onnxruntime" in output
