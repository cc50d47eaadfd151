"""Issue 31 on the camera rig: a config change touches only the sources it changes, the workers' memory is
watched (and one worker recycled alone), a resolution change costs well under 1.5 s, a killed worker says
`killed`, and a flapping camera keeps the log quiet. The daemon runs in-process (tests/support/camera_rig.py),
commands go through a real Mosquitto with ``atlas-edge ctl``.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from agent.cli.demo import DEMO_BUNDLE
from tests.conftest import MqttProbe, wait_for
from tests.support.camera_rig import Camera, CameraDaemon, require_rig

pytestmark = [
    pytest.mark.camera_rig,
    pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                       reason="examples/demo-bundle is missing (make demo-bundle)"),
]
ALERTS = "atlas-edge/cams/telemetry/alert"
RESIZE_BOUND_S = 1.5  # the acceptance, with OpenCV honouring FFmpeg's probing options (4.14: the box's)


@pytest.fixture(scope="module")
def rig():
    require_rig()


def set_sources(broker, sources):
    cmd = [sys.executable, "-m", "agent", "ctl", "--broker", "mqtt://%s:%d" % (broker.host, broker.port), "cams",
           "set-config", "--json", json.dumps({"config": {"sources": sources}})]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def pid_of(box, source):
    reader = box.daemon.loop.sources.readers.get(source)
    return None if reader is None else reader.worker_pid()


def new_size_at(box, since, width, height):
    """When the first result at ``width`` x ``height`` since ``since`` was published (None: none yet)."""
    return min((t for t, _a, p, _c in box.of("hall", since=since) if p["image_hw"] == [height, width]),
               default=None)


def resize_and_time(box, camera, width, height):
    """Seconds from the camera's resize to the first published result at the new size."""
    settled = time.time() + 1.0
    assert wait_for(lambda: box.of("hall", since=settled), timeout=10)  # serving at the old size
    changed = time.time()
    camera.resize(width, height)
    assert wait_for(lambda: new_size_at(box, changed, width, height), timeout=10)
    return new_size_at(box, changed, width, height) - changed


def longest_gap(times):
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def retained_configs(broker):
    """The Home Assistant discovery configs the broker holds now (a new subscriber gets the retained ones)."""
    probe = MqttProbe(broker, ["homeassistant/sensor/atlas-edge-cams/#"])
    try:
        wait_for(lambda: probe.count() >= 7, timeout=5)  # 6 telemetry sensors + at least one source
        with probe._lock:
            return {topic for topic, payload, retained, _d in probe.messages if retained and payload}
    finally:
        probe.close()


def test_set_config_edits_and_removes_one_source_and_the_other_worker_is_untouched(rig, tmp_path, mosquitto):
    with Camera(fps=10) as one, Camera(fps=10) as two:
        keep = {"name": "keep", "uri": one.url()}
        drop = {"name": "drop", "uri": two.url()}
        box = CameraDaemon(tmp_path, mosquitto, [keep, drop],
                           mqtt={"host": mosquitto.host, "port": mosquitto.port, "homeassistant_discovery": True})
        try:
            assert wait_for(lambda: box.of("keep") and box.of("drop"), timeout=60)
            kept_pid, dropped_pid = pid_of(box, "keep"), pid_of(box, "drop")
            ghost = "homeassistant/sensor/atlas-edge-cams/source_drop/config"
            assert wait_for(lambda: ghost in retained_configs(mosquitto), timeout=10)
            began = time.time()
            set_sources(mosquitto, [keep, dict(drop, max_fps=2)])  # edit one
            assert wait_for(lambda: pid_of(box, "drop") not in (None, dropped_pid), timeout=30)
            edited = time.time()
            assert wait_for(lambda: box.of("drop", since=edited), timeout=30)
            set_sources(mosquitto, [keep])  # remove it
            assert wait_for(lambda: "drop" not in box.daemon.loop.sources.readers, timeout=30)
            removed_at = time.time()
            assert wait_for(lambda: box.of("keep", since=removed_at + 2.0), timeout=10)
            ended = time.time()
            configs = retained_configs(mosquitto)
            health = box.health("keep")
        finally:
            box.stop()
    assert pid_of(box, "keep") is None  # stopped with the daemon; while it ran:
    assert kept_pid is not None and health["reopens"] == 0, health
    times = [t for t, _a, _p, _c in box.of("keep", since=began) if t <= ended]
    gap = longest_gap(times)
    print("\nkeep: %d results across both changes, longest gap %.2f s" % (len(times), gap))
    assert gap <= 1.0, "the untouched camera's results had a %.2f s gap" % gap
    assert ghost not in configs, "the removed source's discovery config is still retained"
    assert "homeassistant/sensor/atlas-edge-cams/source_keep/config" in configs


def test_worker_memory_is_reported_and_an_oversized_worker_is_recycled_alone(rig, tmp_path, mosquitto):
    telemetry = MqttProbe(mosquitto, ["atlas-edge/cams/telemetry", ALERTS])
    with Camera(fps=10) as camera:
        box = CameraDaemon(tmp_path, mosquitto, [{"name": "cam", "uri": camera.url()}],
                           watchdog={"interval_s": 0.5})
        try:
            assert wait_for(lambda: box.of("cam"), timeout=60)  # the worker decodes: OpenCV is loaded
            seen = len(telemetry.on("atlas-edge/cams/telemetry"))
            assert wait_for(lambda: len(telemetry.on("atlas-edge/cams/telemetry")) >= seen + 2, timeout=10)
            sample = telemetry.on("atlas-edge/cams/telemetry")[-1]
        finally:
            box.stop()
    worker_mb = sample["workers_rss_mb"]["cam"]
    print("\nworker RSS %.1f MiB, daemon %.1f MiB, total %.1f MiB" % (worker_mb, sample["rss_mb"],
                                                                       sample["total_rss_mb"]))
    assert 10 < worker_mb < 256
    assert sample["total_rss_mb"] >= sample["rss_mb"] + worker_mb - 1.0
    assert sample["watchdog"]["workers_rss_total_mb"] == pytest.approx(worker_mb, abs=0.1)

    bound = round(worker_mb / 2)  # below what the worker needs: recycled at every second sample
    with Camera(fps=10) as camera:
        box = CameraDaemon(tmp_path / "small", mosquitto, [{"name": "cam", "uri": camera.url()}],
                           watchdog={"interval_s": 0.5, "worker_max_rss_mb": bound})
        try:
            assert wait_for(lambda: pid_of(box, "cam") is not None, timeout=60)
            first = pid_of(box, "cam")
            assert wait_for(lambda: any(a.get("source") == "cam" and a["kind"] == "soft_limit"
                                        for a in telemetry.on(ALERTS)), timeout=30)
            assert wait_for(lambda: pid_of(box, "cam") not in (None, first), timeout=30)
            assert wait_for(lambda: any(a["kind"] == "source_down" and a["figures"]["cause"] == "memory"
                                        for a in telemetry.on(ALERTS)), timeout=10)
            restart = box.daemon.watchdog.restart_reason
            alive = box.thread.is_alive()
        finally:
            box.stop()
            telemetry.close()
    limit = [a for a in telemetry.on(ALERTS) if a["kind"] == "soft_limit"][0]
    assert limit["figures"]["scope"] == "worker" and limit["figures"]["limit_mb"] == bound and limit["restart"]
    assert restart is None and alive, "the daemon itself was restarted for one worker's memory"


def test_a_resolution_change_takes_under_1_5_s_and_a_killed_worker_says_killed(rig, tmp_path, mosquitto):
    import cv2

    honours = not cv2.__version__.startswith("4.11.")  # 4.11.0 discards OPENCV_FFMPEG_CAPTURE_OPTIONS
    with Camera(size=(640, 360), fps=10) as camera:  # 10 fps: FFmpeg's frame-rate probing would take 2 s
        box = CameraDaemon(tmp_path, mosquitto, [{"name": "hall", "uri": camera.url(), "reopen_min_s": 0.1}])
        try:
            assert wait_for(lambda: box.of("hall"), timeout=60)
            took = [resize_and_time(box, camera, w, h) for w, h in ((480, 480), (640, 360), (480, 480))]
            pid = pid_of(box, "hall")
            os.kill(pid, signal.SIGKILL)  # as the OOM killer does
            assert wait_for(lambda: box.health("hall")["last_error"] is not None, timeout=10)
            error = box.health("hall")["last_error"]
            assert wait_for(lambda: box.health("hall")["state"] == "up" and pid_of(box, "hall") != pid, timeout=30)
        finally:
            box.stop()
    print("\nresolution changes to the new size in %s s (OpenCV %s)" % (
        ", ".join("%.2f" % t for t in took), cv2.__version__))
    assert error["cause"] == "killed" and "SIGKILL" in error["message"], error
    assert "jitter" not in error["message"] and "Reinit" not in error["message"], error  # no lines from the open
    # OpenCV 4.11.0 (excluded by pyproject.toml) discards FFmpeg's options: there the reopen in place still
    # waits for the frame-rate probe, and only the old bound (the stall timeout) holds.
    assert max(took) <= (RESIZE_BOUND_S if honours else 5.0), took


def test_a_flapping_camera_keeps_the_log_under_400_lines_a_minute(rig, tmp_path, mosquitto, caplog):
    caplog.set_level(logging.INFO)
    window_s = 30.0  # scaled: 400 lines a minute is 200 in 30 s
    with Camera(fps=25) as camera:
        box = CameraDaemon(tmp_path, mosquitto, [{"name": "flap", "uri": camera.url(), "reopen_min_s": 0.1,
                                                  "reopen_max_s": 1.0}])
        try:
            assert wait_for(lambda: box.of("flap"), timeout=60)
            start = time.monotonic()
            counted_from = len(caplog.records)
            flaps = 0
            while time.monotonic() - start < window_s:  # the camera's rhythm: down 2 s, up 4 s
                camera.kill()
                time.sleep(2.0)
                camera.start()
                flaps += 1
                time.sleep(4.0)
            lines = [r.getMessage() for r in caplog.records[counted_from:]]
            served = len(box.of("flap"))
            health = box.health("flap")
        finally:
            box.stop()
    print("\n%d log lines in %.0f s with the camera down %d times, %d results" % (len(lines), window_s, flaps, served))
    assert health["reopens"] >= flaps, health
    assert sum("source flap up" in line for line in lines) >= 2, "\n".join(lines)  # it did come back, each time
    assert len(lines) <= 400 * window_s / 60.0, "\n".join(lines[:80])
