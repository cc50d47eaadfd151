"""A camera's password sent over MQTT (``validate`` and ``set-config``) to a real daemon process and a real
Mosquitto: it appears in no ack, status, telemetry, log line or state file, except the overrides file that
keeps a set-config across restarts, which is not readable by others."""

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from agent._util.atomic import default_mode
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.config.overrides import OVERRIDES_FILE, Overrides
from agent.devtools.broker import free_port
from tests.conftest import MqttProbe, wait_for
from tests.support.daemon_rig import write_config

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

SECRET = "Pa55-camera-Secret"
PREFIX = "atlas-edge/e2e"


def command(probe, verb, request_id, **fields):
    """Send one command and return its final ack (succeeded or failed)."""
    probe.publish("%s/cmd/%s" % (PREFIX, verb), json.dumps(dict(fields, request_id=request_id)).encode())
    topic = "%s/ack/%s" % (PREFIX, request_id)
    assert wait_for(lambda: any(a["state"] in ("succeeded", "failed") for a in probe.on(topic)), timeout=30), \
        "no final ack for %s: %s" % (request_id, probe.on(topic))
    return [a for a in probe.on(topic) if a["state"] in ("succeeded", "failed")][-1]


def test_a_camera_password_sent_over_mqtt_is_in_no_ack_status_telemetry_log_or_state_file(tmp_path, mosquitto):
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=3)
    gate = "rtsp://viewer:%s@127.0.0.1:%d/gate" % (SECRET, free_port())  # nothing listens: refused, retried
    config = write_config(tmp_path, mosquitto, frames, loop=True,
                          remote_config={"source_uris": ["rtsp://viewer:*@127.0.0.1:*/gate"]})
    cam = {"name": "cam", "uri": str(frames), "loop": True}
    log_path = tmp_path / "daemon.log"
    probe = MqttProbe(mosquitto, [PREFIX + "/#"])
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", config], stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert wait_for(lambda: any(s.get("state") == "online" for s in probe.on(PREFIX + "/status")), timeout=60)
        checked = command(probe, "validate", "v1", config={"sources": [cam, {"name": "gate", "uri": gate}]})
        assert checked["state"] == "succeeded", checked
        assert "viewer:***@" in json.dumps(checked)
        # A refused one names the field; its message must not carry the URI it refuses.
        misspelt = {"name": "gate", "uri": "rtps" + gate[4:]}  # rtps://viewer:<password>@...
        refused = command(probe, "validate", "v2", config={"sources": [cam, misspelt]})
        assert refused["state"] == "failed" and refused["error"]["code"] == "invalid", refused
        assert refused["error"]["field"] == "sources[1].uri", refused
        assert not os.path.exists(os.path.join(tmp_path, "state", OVERRIDES_FILE))  # validate changes nothing

        applied = command(probe, "set-config", "s1", config={"sources": [cam, {"name": "gate", "uri": gate}]})
        assert applied["state"] == "succeeded", applied

        def gate_failed_in_telemetry():
            for t in probe.on(PREFIX + "/telemetry"):
                source = t.get("sources", {}).get("gate") or {}
                if source.get("last_error"):
                    return True
            return False

        assert wait_for(gate_failed_in_telemetry, timeout=60), "the gate source never reported its error"
        status = command(probe, "status", "st1")
        assert status["state"] == "succeeded" and "gate" in json.dumps(status["result"]), status
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            probe.close()
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    with probe._lock:
        published = [(t, p.decode("utf-8", "replace")) for t, p, _r, _d in probe.messages if "/cmd/" not in t]
    assert any("viewer:***@" in p for _t, p in published)  # the URI is there, shown redacted
    assert [t for t, p in published if SECRET in p] == [], "password in these MQTT messages"
    daemon_log = log_path.read_text()
    assert "gate down: cannot open rtsp://viewer:***@" in daemon_log  # logged, redacted
    assert SECRET not in daemon_log, "password in the daemon's log"
    state = tmp_path / "state"
    overrides = state / OVERRIDES_FILE
    assert SECRET in overrides.read_text()  # how a set-config survives a restart: the one place it is kept
    assert stat.S_IMODE(os.stat(overrides).st_mode) & 0o007 == 0, "overrides.json readable by others"
    for directory, _dirs, files in os.walk(state):
        for name in files:
            path = os.path.join(directory, name)
            if path != str(overrides):
                with open(path, "rb") as handle:
                    assert SECRET.encode() not in handle.read(), "password in %s" % path


def test_the_overrides_file_is_never_readable_by_others(tmp_path):
    """Whatever the umask (022 outside the unit), overrides.json keeps no bit for others: it can hold a
    stream's password from a remote set-config. Other files keep the mode ``open`` would give them."""
    path = tmp_path / OVERRIDES_FILE
    path.write_text('{"version": 1, "changes": {}}\n')
    os.chmod(path, 0o644)  # as an older version left it
    Overrides.load(str(path)).record({"thresholds": {"conf": 0.4}})
    assert stat.S_IMODE(os.stat(path).st_mode) == default_mode() & ~0o007
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o607 == 0o600
    assert json.loads(path.read_text())["changes"] == {"thresholds": {"conf": 0.4}}
