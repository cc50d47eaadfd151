"""Section ``drift``: the drift watch stays quiet on a steady scene (issue 39: no ``drift`` alert in 10 minutes of
the rig's normal stream).

The daemon (in-process, the default ``drift:`` settings of docs/configuration.md) serves the demo bundle on the
camera rig (agent/devtools/camera_rig.py): an RTSP camera playing the demo's scenes at :data:`CAMERA_FPS`. Once the
watch has learnt the source's reference and judged its first window, the source is watched for :data:`SOAK_S`
(the full profile: ten minutes): every alert the watch hands the daemon to publish is counted (``alerts``, bound
0), and its figures are read each second (the worst score Wasserstein-1 and detections-per-frame change, beside
their bounds).
"""

import logging
import os
import threading
import time
from typing import Any, Dict, List

from benchmarks.harness import RunContext, target

log = logging.getLogger(__name__)

CAMERA_FPS = 10
SIZE = (640, 360)  # the camera's (w, h)
SCENES, SCENE_SEED = 60, 23  # the clip the camera loops: six seconds of the demo's scenes
SOAK_S = {"quick": 60.0, "full": 600.0}
LEARN_TIMEOUT_S = 180.0  # reference (200 results at 10 fps) plus the first judged window, on a loaded machine


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def soak(context: RunContext, url: str, seconds: float) -> Dict[str, Any]:
    from agent.config.daemon_config import DriftConfig, parse_daemon_config
    from agent.daemon import Daemon
    from agent.devtools.broker import EmbeddedBroker

    alerts: List[Dict[str, Any]] = []
    results = [0]
    with EmbeddedBroker() as broker:
        config = parse_daemon_config({
            "device_id": "bench-drift", "state_dir": os.path.join(context.work_dir, "drift-state"),
            "model": {"bundle": context.bundle_dir, "backend": "opencv", "observation_s": 0},
            "sources": [{"name": "cam", "uri": url}], "mqtt": {"host": broker.host, "port": broker.port}})
        daemon = Daemon(config, on_result=lambda frame, payload: results.__setitem__(0, results[0] + 1))
        publish = daemon.drift.on_alert

        def counted(alert: Dict[str, Any]) -> None:
            alerts.append(alert)
            publish(alert)

        daemon.drift.on_alert = counted
        runner = threading.Thread(target=daemon.run, name="bench-drift-daemon", daemon=True)
        runner.start()
        try:
            if not _wait(lambda: daemon.drift.report().get("cam", {}).get("judged"), LEARN_TIMEOUT_S):
                raise RuntimeError("the drift watch judged no window of the camera within %.0f s: %s" % (
                    LEARN_TIMEOUT_S, daemon.drift.report()))
            worst_w1 = worst_change = 0.0
            judged, first_results, started = 0, results[0], time.monotonic()
            while time.monotonic() - started < seconds:
                time.sleep(1.0)
                figures = daemon.drift.report().get("cam", {})
                if figures.get("judged"):
                    judged += 1
                    worst_w1 = max(worst_w1, figures["score_w1"])
                    worst_change = max(worst_change, figures["detections_change"])
            served = results[0] - first_results
        finally:
            daemon.request_stop("benchmark done")
            runner.join(30)
    settings = DriftConfig()
    return {"alerts": len(alerts), "alert_kinds": sorted({a["alert"] for a in alerts}), "soak_s": seconds,
            "results_per_s": round(served / seconds, 2), "windows_read": judged,
            "worst_score_w1": round(worst_w1, 4), "score_w1_bound": settings.score_w1_bound,
            "worst_detections_change": round(worst_change, 4),
            "detections_change_bound": settings.detections_change_bound}


def run(context: RunContext) -> Dict[str, Any]:
    from agent.devtools.camera_rig import Camera, rig_missing, write_clip
    from agent.devtools.scenes import generate_scenes

    missing = rig_missing()
    if missing:
        return {"skipped": "needs the camera rig (`make camera-rig`): %s" % missing}
    clip = write_clip(os.path.join(context.work_dir, "drift-scenes.bgr"),
                      [image for image, _b, _c in generate_scenes(SCENE_SEED, SCENES, (SIZE[1], SIZE[0]))])
    with Camera(size=SIZE, fps=CAMERA_FPS, clip=clip) as camera:
        result = soak(context, camera.url(), SOAK_S[context.profile.name])
    result["camera"] = "RTSP %dx%d at %d fps looping %d of the demo's scenes" % (SIZE + (CAMERA_FPS, SCENES))
    log.info("drift: %d alert(s) in %.0f s of a steady scene; worst score W1 %.3f (bound %.2f), worst detections "
             "change %.3f (bound %.2f), %.1f results/s", result["alerts"], result["soak_s"], result["worst_score_w1"],
             result["score_w1_bound"], result["worst_detections_change"], result["detections_change_bound"],
             result["results_per_s"])
    return result


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    if "skipped" in section:
        return {}
    return {"alerts": target(section.get("alerts"), "<=", 0)}
