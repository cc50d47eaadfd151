"""set-config on a running daemon (a real process and broker): kept across a restart in the state directory's
overrides file, shown by status, the operator's file untouched; a damaged overrides file never stops a start."""

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.config.overrides import OVERRIDES_FILE
from tests.conftest import MqttProbe, wait_for

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

DEVICE = "ovr"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def write_config(tmp_path, broker):
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=8)
    path = tmp_path / "config.yaml"
    path.write_text("# operator's comment: kept\n" + yaml.safe_dump({
        "device_id": DEVICE, "state_dir": "state",
        "model": {"bundle": DEMO_BUNDLE, "backend": "opencv"},
        "sources": [{"name": "cam", "uri": str(frames), "loop": True, "max_fps": 10}],
        "mqtt": {"host": broker.host, "port": broker.port},
        "thresholds": {"iou": 0.6},
    }))
    return path


def start(config_path, broker):
    """The daemon as systemd runs it; returns once its results flow (it then also takes commands)."""
    results = MqttProbe(broker, ["atlas-edge/%s/results/#" % DEVICE])
    proc = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(config_path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert results.wait(lambda m: len(m) >= 2, timeout=120), "the daemon does not serve"
    except BaseException:
        proc.kill()
        raise
    finally:
        results.close()
    return proc


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return err


def ctl(broker, verb, *args):
    result = subprocess.run([sys.executable, "-m", "agent", "ctl", "--broker", broker.url, DEVICE, verb, *args,
                             "--timeout", "90"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    ack = json.loads(result.stdout.strip().splitlines()[-1]) if result.stdout.strip() else {}
    return result.returncode, ack


def thresholds(broker):
    """The running daemon's thresholds, as its validate verb merges them."""
    code, checked = ctl(broker, "validate", "--json", '{"config": {"thresholds": {}}}')
    assert code == 0, checked
    return checked["result"]["config"]["thresholds"]


def test_set_config_survives_a_restart_and_status_shows_where_values_come_from(tmp_path, mosquitto):
    path = write_config(tmp_path, mosquitto)
    before = path.read_bytes()
    proc = start(path, mosquitto)
    try:
        code, ack = ctl(mosquitto, "set-config", "--json", '{"config": {"thresholds": {"conf": 0.42}}}')
        assert code == 0, ack
        code, status = ctl(mosquitto, "status")
        assert status["result"]["overrides"]["values"] == {"thresholds.conf": 0.42}
        # The operator edits the file and reloads: the file's change applies, the override stays over it.
        edited = before.replace(b"iou: 0.6", b"iou: 0.55")
        path.write_bytes(edited)
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: thresholds(mosquitto)["iou"] == 0.55), thresholds(mosquitto)
        assert thresholds(mosquitto)["conf"] == 0.42
    finally:
        stop(proc)
    assert path.read_bytes() == edited  # the daemon never wrote the operator's file
    stored = json.loads((tmp_path / "state" / OVERRIDES_FILE).read_text())
    assert stored["changes"] == {"thresholds": {"conf": 0.42}}

    proc = start(path, mosquitto)  # what systemd does after a restart
    try:
        code, status = ctl(mosquitto, "status")
        assert code == 0, status
        assert status["result"]["overrides"]["values"] == {"thresholds.conf": 0.42}
        assert thresholds(mosquitto) == {"conf": 0.42, "iou": 0.55, "max_det": None, "top_k": None}
    finally:
        stop(proc)


@pytest.mark.parametrize("damage", [b'{"version": 1, "chan', bytes(range(256))[::-3],
                                    b'{"thresholds": {"conf": 0.4}}'],
                         ids=["truncated", "random-bytes", "valid-json-wrong-schema"])
def test_a_damaged_overrides_file_is_moved_aside_and_the_daemon_serves(tmp_path, mosquitto, damage):
    path = write_config(tmp_path, mosquitto)
    (tmp_path / "state").mkdir()
    target = tmp_path / "state" / OVERRIDES_FILE
    target.write_bytes(damage)
    alerts = MqttProbe(mosquitto, ["atlas-edge/%s/telemetry/alert" % DEVICE])
    proc = start(path, mosquitto)  # starts and serves
    try:
        assert alerts.wait(lambda m: any(a["kind"] == "state_file_damaged" for _t, a in m), timeout=30)
        alert = [a for _t, a in alerts.json() if a["kind"] == "state_file_damaged"][0]
        assert alert["figures"]["file"] == str(target) and alert["figures"]["moved_to"]
        code, status = ctl(mosquitto, "status")
        report = status["result"]["overrides"]
        assert report["damaged"] and report["moved_to"].startswith(str(target) + ".corrupt-")
        assert open(report["moved_to"], "rb").read() == damage and not target.exists()
        code, ack = ctl(mosquitto, "set-config", "--json", '{"config": {"thresholds": {"conf": 0.3}}}')
        assert code == 0, ack  # and a fresh overrides file takes changes again
    finally:
        err = stop(proc)
        alerts.close()
    assert err.count("overrides %s are damaged" % target) == 1  # said once
