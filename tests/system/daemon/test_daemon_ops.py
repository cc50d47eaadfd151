"""Operating a running daemon: ctl commands over a real broker, deploy and rollback over MQTT, results queued
across a SIGKILL while the broker is away, and a leak that makes the watchdog restart the daemon cleanly."""

import json
import mmap
import os
import signal
import threading
import time

import pytest

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from tests.conftest import WAIT_S, MqttProbe, wait_for
from tests.support.daemon_rig import (
    SIZES,
    ctl,
    new_version,
    outbox_rows,
    start_daemon,
    wait_status,
    write_config,
)
from tests.support.lifecycle_support import NOISE_PROOF_FACTOR

RESULTS_TOPICS = "atlas-edge/e2e/results/%"
# The latency rule is not under test here: on two loaded cores a median can double and roll a deployed model
# back before the test looks at it (seen: 37 ms against a 17 ms baseline, then "nothing to roll back").
STEADY_MODEL = {"bundle": DEMO_BUNDLE, "observation_s": 0, "latency_regression": NOISE_PROOF_FACTOR}

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")


def test_ctl_status_config_and_deploy_against_the_daemon(tmp_path, mosquitto):
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=SIZES[:3], seed=9)
    config = write_config(tmp_path, mosquitto, frames, loop=True, model=STEADY_MODEL)
    results = MqttProbe(mosquitto, ["atlas-edge/e2e/results/#"])
    events = MqttProbe(mosquitto, ["atlas-edge/e2e/events"])
    proc = start_daemon(config)
    try:
        status = json.loads(wait_status(mosquitto).stdout.strip().splitlines()[-1])
        assert status["state"] == "succeeded"
        assert status["result"]["model_info"]["version"] == "1.0.0" and status["result"]["slots"]["serving"] == "a"
        # one meaning of "model": the serving model's label, in the answer as in the retained status
        assert status["result"]["model"] == "%s 1.0.0" % status["result"]["model_info"]["name"]

        bad = ctl(mosquitto, "set-config", "--json", '{"config": {"thresholds": {"conf": 7}}}')
        assert bad.returncode == 1 and "thresholds.conf" in bad.stdout + bad.stderr
        good = ctl(mosquitto, "set-config", "--json", '{"config": {"thresholds": {"conf": 0.5}}}')
        assert good.returncode == 0, good.stdout + good.stderr

        store = str(tmp_path / "state" / "bundles")
        source, sha = new_version(tmp_path, store, "1.1.0")
        wrong = ctl(mosquitto, "deploy", "--json", json.dumps({"bundle": source, "sha256": "0" * 64}))
        assert wrong.returncode == 1 and "sha256" in wrong.stdout + wrong.stderr
        outside = ctl(mosquitto, "deploy", "--json", json.dumps({"bundle": str(tmp_path), "sha256": sha}))
        assert outside.returncode == 1 and "outside the bundle store" in outside.stdout + outside.stderr
        deployed = ctl(mosquitto, "deploy", "--json", json.dumps({"bundle": source, "sha256": sha}), "--timeout",
                       "120", timeout=120)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert results.wait(lambda m: m[-1][1]["model"]["version"] == "1.1.0", timeout=60)
        # After the switch every result has a confidence of at least the new threshold.
        newest = [r for _t, r in results.json()[-3:]]
        assert all(d["score"] >= 0.5 for r in newest for d in r["detections"])

        rolled = ctl(mosquitto, "rollback", "--json", '{"reason": "test"}')
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr + str(events.json())
        assert results.wait(lambda m: m[-1][1]["model"]["version"] == "1.0.0", timeout=60)
        serving = json.loads(ctl(mosquitto, "status").stdout.strip().splitlines()[-1])["result"]
        assert 0 < serving["backend_busy_fraction"] <= 1  # the backend thread's share of the last 5 s
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        results.close()
        events.close()


def _status(broker):
    return json.loads(ctl(broker, "status").stdout.strip().splitlines()[-1])["result"]


def test_set_config_batching_reaches_the_next_deploy(tmp_path, mosquitto):
    """The daemon owns the live config and the model manager reads it through the daemon: after set-config
    changes ``batching.max_batch``, the next deploy loads the artifacts built for the new batch."""
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=SIZES[:2], seed=5)
    config = write_config(tmp_path, mosquitto, frames, loop=True,
                          model=dict(STEADY_MODEL, backend="opencv"))
    proc = start_daemon(config)
    try:
        wait_status(mosquitto)
        # max_batch 2 at start: the demo bundle has no batch-2 ONNX, so the smallest batch (1) serves
        assert _status(mosquitto)["model_info"]["artifacts"]["256x256"] == "model_256x256.onnx"
        changed = ctl(mosquitto, "set-config", "--json", '{"config": {"batching": {"max_batch": 4}}}')
        assert changed.returncode == 0, changed.stdout + changed.stderr
        source, sha = new_version(tmp_path, str(tmp_path / "state" / "bundles"), "1.1.0")
        deployed = ctl(mosquitto, "deploy", "--json", json.dumps({"bundle": source, "sha256": sha}), "--timeout",
                       "120", timeout=120)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        model = _status(mosquitto)["model_info"]
        assert model["version"] == "1.1.0" and model["artifacts"]["256x256"] == "model_256x256_b4.onnx"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_results_queued_while_broker_is_away_survive_sigkill(tmp_path, fresh_broker):
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=SIZES[:4], seed=13)
    config = write_config(tmp_path, fresh_broker, frames)
    fresh_broker.stop()
    proc = start_daemon(config)
    outbox = str(tmp_path / "state" / "outbox.sqlite")
    # Count the results only: telemetry is queued too, and under load four telemetry rows can come first.
    queued = wait_for(lambda: outbox_rows(outbox, RESULTS_TOPICS) >= 4, timeout=120)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert queued, "results did not reach the outbox while the broker was away: %d queued" % outbox_rows(
        outbox, RESULTS_TOPICS)

    fresh_broker.start()
    results = MqttProbe(fresh_broker, ["atlas-edge/e2e/results/#"])
    proc = start_daemon(config)
    try:
        assert results.wait(lambda m: sum(r.get("historical", False) for _t, r in m) >= 4, timeout=120)
        replayed = [r for _t, r in results.json() if r.get("historical")]
        assert sorted(r["frame_id"] for r in replayed[:4]) == [0, 1, 2, 3]
        assert all(r["source"] == "cam" for r in replayed)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        results.close()


class LeakyBackendForTests:
    """Wraps a real backend and keeps 4 MiB of touched memory per inference: an injected leak (tests only)."""

    def __init__(self, inner):
        self.inner = inner
        self.kept = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def infer(self, batch):
        block = mmap.mmap(-1, 4 << 20)
        block.write(b"\x5a" * (4 << 20))
        self.kept.append(block)
        return self.inner.infer(batch)


def run_daemon_in_thread(tmp_path, broker, leak, monkeypatch):
    import agent.pipeline.model as model_module
    from agent.config.daemon_config import parse_daemon_config
    from agent.daemon import Daemon

    if leak:
        real_create = model_module.create_backend
        monkeypatch.setattr(model_module, "create_backend",
                            lambda *a, **k: LeakyBackendForTests(real_create(*a, **k)))
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=1)
    # The daemon runs inside pytest, whose RSS after the rest of the suite can already exceed cpu-dev's 1 GiB
    # budget; a box kind with a large budget keeps this test about the leak trend, not the soft limit.
    device = tmp_path / "cpu-roomy.yaml"
    device.write_text("name: cpu-roomy\ntarget: cpu\nbackend: opencv\nartifact_format: onnx\n"
                      "memory_budget_mb: 1000000\n")
    config = parse_daemon_config({
        "device_id": "e2e", "device": str(device), "state_dir": str(tmp_path / "state"),
        "model": {"bundle": DEMO_BUNDLE, "backend": "opencv"},
        "sources": [{"name": "cam", "uri": str(frames), "loop": True, "max_fps": 40}],
        "mqtt": {"host": broker.host, "port": broker.port},
        "watchdog": {"interval_s": 0.1, "window_s": 3.0, "leak_mb_per_hour": 20000.0, "leak_min_samples": 12},
    })
    daemon = Daemon(config)
    # what the daemon made it keeps, and what it read it hands on: nothing is reached for inside the serving loop
    assert daemon.loop.sources is daemon.sources and daemon.loop.stats is daemon.stats
    assert daemon.models.manifest is daemon.manifest and daemon.manifest.name  # read once, for both
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("code", daemon.run()), daemon=True)
    thread.start()
    return daemon, thread, outcome


@pytest.mark.parametrize("leak", [True, False], ids=["leaking-backend", "healthy-backend"])
def test_leak_restarts_the_daemon_cleanly_and_a_plateau_does_not(tmp_path, mosquitto, monkeypatch, leak):
    alerts = MqttProbe(mosquitto, ["atlas-edge/e2e/telemetry/alert"])
    results = MqttProbe(mosquitto, ["atlas-edge/e2e/results/#"])
    daemon, thread, outcome = run_daemon_in_thread(tmp_path, mosquitto, leak, monkeypatch)
    try:
        thread.join(20 if leak else 8)
        if leak:
            assert not thread.is_alive(), "the leak was not acted on within the window"
            assert outcome["code"] == 3  # non-zero: systemd's Restart=on-failure brings it back
            assert alerts.wait(lambda m: any(a["kind"] == "leak" for _t, a in m), timeout=10)
            from agent.ops.outbox import Outbox

            pending = len(Outbox(str(tmp_path / "state" / "outbox.sqlite"), 1 << 26))  # fixed: the daemon ended
            published = daemon.loop.published
            # What it published before ending may still be on its way from the broker to this subscriber.
            assert published > 0 and wait_for(lambda: results.count() + pending == published, timeout=WAIT_S), \
                "published %d, received %d, in outbox %d" % (published, results.count(), pending)
        else:
            assert thread.is_alive(), "a healthy daemon stopped: %r" % daemon.stop_reason
            assert not any(a["kind"] == "leak" for _t, a in alerts.json())
    finally:
        daemon.request_stop("test over")
        thread.join(30)
        alerts.close()
        results.close()


def _paused_and_drained(broker, results, seen):
    """Paused, no inference running, as many results received as the daemon says it served, and so on two status
    answers in a row with the same count (one answer could fall between two chunks of a batch)."""
    status = _status(broker)
    drained = (status["paused"] and status["watchdog"]["inference_elapsed_s"] is None
               and results.count() == status["frames"])
    settled = drained and seen.get("drained") and seen.get("frames") == status["frames"]
    seen.update(status, drained=drained)
    return bool(settled)


def _reading_since(telemetry, since):
    """Telemetry sent after ``since`` (wall clock) while the camera source was still reading frames."""
    return [t for _topic, t in telemetry if t["ts"] > since and t["sources"]["cam"]["fps_in"] > 0]


def test_pause_resume_snapshot_and_restart_through_ctl(tmp_path, mosquitto):
    import cv2
    import numpy as np

    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=SIZES[:2], seed=4)
    results = MqttProbe(mosquitto, ["atlas-edge/e2e/results/#"])
    snapshots = MqttProbe(mosquitto, ["atlas-edge/e2e/snapshot/#"])
    telemetry = MqttProbe(mosquitto, ["atlas-edge/e2e/telemetry"])
    proc = start_daemon(write_config(tmp_path, mosquitto, frames, loop=True))
    try:
        wait_status(mosquitto)
        assert ctl(mosquitto, "pause").returncode == 0
        # Drained: no inference in flight and every frame served so far has arrived here.
        drained = {}
        assert wait_for(lambda: _paused_and_drained(mosquitto, results, drained), timeout=60), \
            "the paused daemon never showed a drained pipeline: %r" % drained
        count, settled_at = results.count(), time.time()
        # The loop turned twice more (two telemetry messages) while the source kept reading frames: an unpaused
        # pipeline would have served some. The count must not have moved.
        assert telemetry.wait(lambda m: len(_reading_since(m, settled_at)) >= 2, timeout=30), \
            "no telemetry showed the paused daemon turning with frames arriving"
        assert results.count() == count, "results kept coming while paused"
        assert all(t["frames"] == drained["frames"] for t in _reading_since(telemetry.json(), settled_at))
        assert ctl(mosquitto, "resume").returncode == 0
        assert wait_for(lambda: results.count() > count + 2, timeout=30)

        shot = ctl(mosquitto, "snapshot")
        assert shot.returncode == 0, shot.stdout + shot.stderr
        assert wait_for(lambda: snapshots.count() >= 1, timeout=10)  # a JPEG: counted, not decoded
        picture = cv2.imdecode(np.frombuffer(snapshots.messages[0][1], np.uint8), cv2.IMREAD_COLOR)
        assert picture is not None and picture.shape[:2] in [tuple(h) for h in SIZES[:2]]

        restart = ctl(mosquitto, "restart")
        assert restart.returncode == 0
        proc.wait(60)
        assert proc.returncode == 3  # non-zero on purpose: systemd's Restart=on-failure starts it again
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        results.close()
        snapshots.close()
        telemetry.close()


def test_home_assistant_discovery_is_retained_and_republished_on_ha_birth(tmp_path, mosquitto):
    import paho.mqtt.publish as publish

    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=SIZES[:1], seed=2)
    config = write_config(tmp_path, mosquitto, frames, loop=True)
    import yaml

    data = yaml.safe_load(open(config))
    data["mqtt"]["homeassistant_discovery"] = True
    open(config, "w").write(yaml.safe_dump(data))
    configs = MqttProbe(mosquitto, ["homeassistant/sensor/atlas-edge-e2e/#"])
    proc = start_daemon(config)
    try:
        assert wait_for(lambda: configs.count() >= 7, timeout=90)  # 6 of the box, 1 per source
        first = configs.count()
        fps = [c for t, c in configs.json() if t.endswith("/fps/config")][0]
        assert fps["state_topic"] == "atlas-edge/e2e/telemetry" and fps["availability"][0]["topic"].endswith(
            "/e2e/status")
        cam = [c for t, c in configs.json() if t.endswith("/source_cam/config")][0]
        assert cam["state_topic"] == fps["state_topic"] and 'sources["cam"].state' in cam["value_template"]
        publish.single("homeassistant/status", "online", hostname=mosquitto.host, port=mosquitto.port)
        assert wait_for(lambda: configs.count() >= first + 7, timeout=30), "not republished after HA's birth"
        late = MqttProbe(mosquitto, ["homeassistant/sensor/atlas-edge-e2e/#"])
        assert wait_for(lambda: late.count() >= 7, timeout=10)
        assert all(retained for _t, _p, retained, _d in late.messages)  # the retained copies, as a newcomer sees
        late.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        configs.close()
