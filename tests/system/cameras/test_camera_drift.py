"""Drift on the RTSP camera rig (docs/shadow.md, "Drift"): the camera plays the demo's scenes, the daemon learns
its reference, then the camera's pictures darken to 30 % (the clip it plays changes, the stream does not): the
alert ``drift`` within 60 s, naming the source and its figures; the normal pictures again: ``drift_cleared``
within 60 s. The daemon runs in-process (tests/support/camera_rig.py), alerts are read from a real Mosquitto."""

import os

import numpy as np
import pytest

from agent.cli.demo import DEMO_BUNDLE
from agent.devtools.camera_rig import write_clip
from agent.devtools.scenes import generate_scenes
from tests.conftest import MqttProbe, wait_for
from tests.support.camera_rig import Camera, CameraDaemon, require_rig

pytestmark = [
    pytest.mark.camera_rig,
    pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                       reason="examples/demo-bundle is missing (make demo-bundle)"),
]
ALERTS = "atlas-edge/cams/telemetry/alert"
DRIFT_S = 60  # the bound on raising and on clearing
SIZE = (640, 360)  # the camera's (w, h)
# Short windows so that each step takes seconds; the rules are those of the defaults.
DRIFT = {"window_s": 4.0, "reference_frames": 40, "min_frames": 10, "raise_after_s": 3.0, "clear_after_s": 3.0}


@pytest.fixture(scope="module")
def rig():
    require_rig()


def test_the_camera_going_dark_raises_drift_and_its_scene_coming_back_clears_it(rig, tmp_path, mosquitto):
    scenes = [image for image, _b, _c in generate_scenes(23, 30, (SIZE[1], SIZE[0]))]
    normal = write_clip(str(tmp_path / "normal.bgr"), scenes)
    dark = write_clip(str(tmp_path / "dark.bgr"), [(image * 0.3).astype(np.uint8) for image in scenes])
    alerts = MqttProbe(mosquitto, [ALERTS])
    with Camera(size=SIZE, fps=10, clip=normal) as camera:
        box = CameraDaemon(tmp_path, mosquitto, [{"name": "hall", "uri": camera.url()}], drift=DRIFT)
        try:
            drift = box.daemon.drift
            assert wait_for(lambda: drift.report().get("hall", {}).get("judged"), timeout=120), drift.report()
            assert not drift.report()["hall"]["drifting"]

            def said(kind):
                return [m for _t, m in alerts.json() if m.get("alert") == kind]

            camera.play(dark)
            assert wait_for(lambda: said("drift"), timeout=DRIFT_S), drift.report()
            raised = said("drift")[0]
            print("drift on the rig:", {k: raised[k] for k in ("score_w1", "detections_change", "frames")})
            assert raised["source"] == "hall" and (raised["score_w1"] > raised["score_w1_bound"] or
                                                   raised["detections_change"] > raised["detections_change_bound"])
            camera.play(normal)
            assert wait_for(lambda: said("drift_cleared"), timeout=DRIFT_S), drift.report()
            assert len(said("drift")) == 1  # raised once, cleared once: no flapping on the way
        finally:
            box.stop()
            alerts.close()
