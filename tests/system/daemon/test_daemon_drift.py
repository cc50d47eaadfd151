"""Drift through a real daemon and a real Mosquitto (docs/shadow.md, "Drift"): camera ``cam`` (a folder of the demo's
scenes read at 10 fps) is learnt as the reference, then its pictures darken to 30 % (the folder is swapped under
the same path, as a camera's picture changes under the same URL): ``drift`` on the alerts topic within 60 s,
naming the source and its figures; back to the normal pictures, ``drift_cleared`` within 60 s; the reference is
kept in the state directory."""

import json
import os
import signal

import numpy as np
import pytest

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from tests.conftest import MqttProbe, wait_for
from tests.support.daemon_rig import ctl, start_daemon, wait_status, write_config

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

ALERTS = "atlas-edge/e2e/telemetry/alert"
DRIFT_S = 60  # the bound on raising and on clearing
# Short windows so that the test sees each step in seconds; the rules are those of the defaults.
DRIFT = {"window_s": 4.0, "reference_frames": 40, "min_frames": 10, "raise_after_s": 3.0, "clear_after_s": 3.0}
SIZES = [(360, 640), (480, 480), (480, 800)] * 8


def _darkened(src, dst):
    import cv2

    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        if name.endswith(".png"):
            image = cv2.imread(os.path.join(src, name))
            cv2.imwrite(os.path.join(dst, name), (image * 0.3).astype(np.uint8))


def _point(link, target):
    """Point the camera's folder at ``target``, atomically (a new symlink renamed over the old one)."""
    fresh = str(link) + ".new"
    os.symlink(str(target), fresh)
    os.replace(fresh, str(link))


def test_a_darkened_camera_raises_drift_and_clears_it_when_the_scene_comes_back(tmp_path, mosquitto):
    normal, dark = tmp_path / "normal", tmp_path / "dark"
    write_sample_frames(str(normal), sizes_hw=SIZES, seed=17)
    _darkened(str(normal), str(dark))
    camera = tmp_path / "camera"
    _point(camera, normal)
    config = write_config(tmp_path, mosquitto, camera, drift=DRIFT,
                          sources=[{"name": "cam", "uri": str(camera), "loop": True, "max_fps": 10}],
                          model={"bundle": DEMO_BUNDLE, "observation_s": 0, "backend": "onnxruntime"})
    alerts = MqttProbe(mosquitto, [ALERTS])
    proc = start_daemon(config)
    try:
        wait_status(mosquitto)

        def drift_status():
            answer = ctl(mosquitto, "status", "--timeout", "10")
            return json.loads(answer.stdout.strip().splitlines()[-1])["result"]["drift"] or {}

        assert wait_for(lambda: drift_status().get("cam", {}).get("judged"), timeout=90, interval=1.0), \
            drift_status()
        quiet = drift_status()["cam"]
        assert not quiet["drifting"] and [m for _t, m in alerts.json() if "drift" in m.get("alert", "")] == []

        _point(camera, dark)
        assert alerts.wait(lambda ms: any(m.get("alert") == "drift" for _t, m in ms), timeout=DRIFT_S), \
            drift_status()
        raised = [m for _t, m in alerts.json() if m.get("alert") == "drift"][0]
        assert raised["source"] == "cam" and (raised["score_w1"] > raised["score_w1_bound"] or
                                              raised["detections_change"] > raised["detections_change_bound"])
        print("drift:", {k: raised[k] for k in ("score_w1", "detections_change", "detections_per_frame")})
        assert drift_status()["cam"]["drifting"]

        _point(camera, normal)
        assert alerts.wait(lambda ms: any(m.get("alert") == "drift_cleared" for _t, m in ms), timeout=DRIFT_S), \
            drift_status()
        kept = json.load(open(str(tmp_path / "state" / "drift-references.json")))
        assert kept["sources"]["cam"]["frames"] == DRIFT["reference_frames"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        alerts.close()
    assert "Traceback" not in out, out[-3000:]
