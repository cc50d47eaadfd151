"""A camera's password, in the local config file or sent over MQTT (``validate`` and ``set-config``), with a real
daemon process and a real Mosquitto: a remote change carrying one is refused whole (remote config is data: a
remotely set source gets credentials only from the local ``remote_config.credentials``), and the password of the
local file's source appears in no ack, status, telemetry, log line or state file."""

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


def test_a_camera_password_sent_over_mqtt_is_refused_and_the_files_is_in_no_ack_status_telemetry_log_or_state(
        tmp_path, mosquitto):
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=3)
    gate_uri = "rtsp://viewer:%s@127.0.0.1:%d/gate" % (SECRET, free_port())  # nothing listens: refused, retried
    cam = {"name": "cam", "uri": str(frames), "loop": True}
    gate = {"name": "gate", "uri": gate_uri}
    config = write_config(tmp_path, mosquitto, frames, loop=True, sources=[cam, gate],
                          remote_config={"source_uris": ["rtsp://10.1.2.*/gate"]})
    log_path = tmp_path / "daemon.log"
    probe = MqttProbe(mosquitto, [PREFIX + "/#"])
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", config], stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert wait_for(lambda: any(s.get("state") == "online" for s in probe.on(PREFIX + "/status")), timeout=60)
        checked = command(probe, "validate", "v1", config={"sources": [cam, gate]})  # the file's own: unchanged
        assert checked["state"] == "succeeded", checked
        assert "viewer:***@" in json.dumps(checked)
        # A password sent over MQTT, even for an allowed host: refused, naming the field, never repeating it.
        sent = {"name": "remote", "uri": "rtsp://viewer:%s@10.1.2.9/gate" % SECRET}
        for verb, request_id in (("validate", "v2"), ("set-config", "s1")):
            refused = command(probe, verb, request_id, config={"sources": [cam, gate, sent]})
            assert refused["state"] == "failed" and refused["error"]["code"] == "invalid", refused
            assert refused["error"]["field"] == "sources[2].uri", refused
        misspelt = {"name": "remote", "uri": "rtps://viewer:%s@10.1.2.9/gate" % SECRET}
        refused = command(probe, "validate", "v3", config={"sources": [cam, misspelt]})
        assert refused["state"] == "failed" and refused["error"]["field"] == "sources[1].uri", refused
        assert not os.path.exists(os.path.join(tmp_path, "state", OVERRIDES_FILE))  # nothing recorded

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
    for directory, _dirs, files in os.walk(tmp_path / "state"):
        for name in files:
            with open(os.path.join(directory, name), "rb") as handle:
                assert SECRET.encode() not in handle.read(), "password in %s" % os.path.join(directory, name)


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
