"""Remote config is data, never a capability (issue 29 items 1-2, issue 31 item 4), end to end: a real daemon
(subprocess) with a secret in its systemd credentials and environment, a real Mosquitto, and the attacker's
servers on loopback that record every connection and every byte.

- ``rtsp://10.1.2.*/stream1`` once matched ``rtsp://10.1.2.9:cred:mqtt-password@127.0.0.1:PORT/stream1``: the
  box sent its MQTT password to that server. Now refused, and nothing connects.
- ``input_options: {"http_proxy": ...}`` on an unchanged http source once sent the box's request to a loopback
  port with the default ``source_uris: []``. Now refused, and nothing connects.
- A raw password with '/' and '@' (``Pa/ss@w0rd``) was in the log, MQTT, the request record and ``validate
  --probe``. Now nowhere, and the camera still gets it right (percent-encoded on the wire, decoded by FFmpeg).
- ``last_error`` says "connection refused", never FFmpeg's text with hosts and ports.
"""

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.config.overrides import OVERRIDES_FILE
from agent.devtools.broker import free_port
from tests.conftest import MqttProbe, wait_for
from tests.support.daemon_rig import write_config

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

PREFIX = "atlas-edge/e2e"
SECRET = "box-mqtt-Secret-7Hq"  # the box's own broker password: a credential and an environment variable
PASSWORD = "Pa/ss@w0rd"  # a camera password written raw, with '/' and '@'
ANSWER_S = 60.0  # a deadline for polls on a loaded machine, not a speed claim
POLL_S = 0.5  # between status commands sent as polls: 2 a second, under the daemon's default rate_per_s 10
WINDOW_S = 3.0  # how long a refused change is watched for a connection it must not make


class Attacker:
    """A TCP server on loopback that records each connection's bytes; ``rtsp_401`` answers every RTSP request
    with 401 Basic, so a client that has a password sends it (what a camera asking for one sees)."""

    def __init__(self, rtsp_401=False):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.rtsp_401 = rtsp_401
        self.received = []  # bytes of each connection
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.received.append(b"")
            threading.Thread(target=self._talk, args=(conn, len(self.received) - 1), daemon=True).start()

    def _talk(self, conn, index):
        conn.settimeout(2.0)
        with conn:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                self.received[index] += chunk
                for cseq in re.findall(rb"CSeq:\s*(\d+)", chunk) if self.rtsp_401 else []:
                    conn.sendall(b"RTSP/1.0 401 Unauthorized\r\nCSeq: %s\r\nWWW-Authenticate: Basic realm=\"cam\"\r\n"
                                 b"Content-Length: 0\r\n\r\n" % cseq)

    def everything(self):
        return b"".join(self.received)

    def close(self):
        self._stop.set()
        self.sock.close()
        self._thread.join(5)


class Box:
    """A daemon process with ``SECRET`` in its credentials directory and environment, logging to a file."""

    def __init__(self, tmp_path, mosquitto, more_sources=(), **extra):
        frames = tmp_path / "frames"
        write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=3)
        self.cam = {"name": "cam", "uri": str(frames), "loop": True}
        credentials = tmp_path / "credentials"
        credentials.mkdir()
        (credentials / "mqtt-password").write_text(SECRET + "\n")
        self.sources = [self.cam, *more_sources]
        self.config = write_config(tmp_path, mosquitto, frames, loop=True, sources=self.sources, **extra)
        self.state = tmp_path / "state"
        self.log_path = tmp_path / "daemon.log"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", CREDENTIALS_DIRECTORY=str(credentials),
                        MQTT_PASSWORD=SECRET)
        self.probe = MqttProbe(mosquitto, [PREFIX + "/#"])
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", self.config],
                                         stdout=log, stderr=subprocess.STDOUT, env=self.env)
        assert wait_for(lambda: any(s.get("state") == "online" for s in self.probe.on(PREFIX + "/status")),
                        timeout=ANSWER_S), self.log_path.read_text()[-3000:]

    def command(self, verb, request_id, **fields):
        """Send one command and return its final ack."""
        self.probe.publish("%s/cmd/%s" % (PREFIX, verb), json.dumps(dict(fields, request_id=request_id)).encode())
        topic = "%s/ack/%s" % (PREFIX, request_id)
        assert wait_for(lambda: any(a["state"] in ("succeeded", "failed") for a in self.probe.on(topic)),
                        timeout=ANSWER_S), "no final ack for %s: %s" % (request_id, self.probe.on(topic))
        return [a for a in self.probe.on(topic) if a["state"] in ("succeeded", "failed")][-1]

    def refused(self, request_id, sources):
        """A set-config that must be refused whole: its ack (failed, invalid), nothing recorded."""
        ack = self.command("set-config", request_id, config={"sources": sources})
        assert ack["state"] == "failed" and ack["error"]["code"] == "invalid", ack
        assert not os.path.exists(os.path.join(self.state, OVERRIDES_FILE)), "a refused change was recorded"
        return ack

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.probe.close()
        assert self.proc.returncode == 0, self.log_path.read_text()[-3000:]

    def published(self):
        with self.probe._lock:
            return [(t, p.decode("utf-8", "replace")) for t, p, _r, _d in self.probe.messages if "/cmd/" not in t]

    def state_files(self):
        """(path, bytes) of every file in the state directory: the request record, the outbox, slots."""
        for directory, _dirs, files in os.walk(self.state):
            for name in files:
                with open(os.path.join(directory, name), "rb") as handle:
                    yield os.path.join(directory, name), handle.read()


def test_a_remote_uri_cannot_carry_the_boxs_secret_or_reach_its_loopback(tmp_path, mosquitto):
    attacker = Attacker(rtsp_401=True)
    box = Box(tmp_path, mosquitto, remote_config={"source_uris": ["rtsp://10.1.2.*/stream1"]})
    try:
        for request_id, uri in (("s1", "rtsp://10.1.2.9:cred:mqtt-password@127.0.0.1:%d/stream1"),
                                ("s2", "rtsp://10.1.2.9:env:MQTT_PASSWORD@127.0.0.1:%d/stream1"),
                                ("s3", "rtsp://10.1.2.9@127.0.0.1:%d/stream1"),
                                ("s4", "rtsp://10.1.2.9:%d/stream1")):  # pattern has no port: 554 only
            ack = box.refused(request_id, [box.cam, {"name": "gate", "uri": uri % attacker.port}])
            assert ack["error"]["field"] == "sources[1].uri", ack
            assert "127.0.0.1" not in json.dumps(ack)  # the refusal never repeats the URI
        status = box.command("status", "st1")
        assert status["state"] == "succeeded" and list(status["result"]["sources"]) == ["cam"], status
        assert not wait_for(lambda: attacker.received, timeout=WINDOW_S), "the box connected to the attacker"
    finally:
        box.stop()
        attacker.close()
    assert SECRET.encode() not in attacker.everything()
    assert [t for t, p in box.published() if SECRET in p] == []


def test_input_options_that_make_ffmpeg_connect_are_refused_with_the_default_policy(tmp_path, mosquitto):
    """An http source of the local file, its URI unchanged: only its options change remotely."""
    attacker = Attacker()
    web = {"name": "web", "uri": "http://127.0.0.1:%d/snap.mjpg" % free_port(), "reopen_max_s": 1.0}
    box = Box(tmp_path, mosquitto, more_sources=[web])  # the default remote_config: source_uris: []
    proxy = "http://127.0.0.1:%d/" % attacker.port
    try:
        for request_id, options in (("p1", {"http_proxy": proxy}), ("p2", {"protocol_whitelist": "file,http,tcp"}),
                                    ("p3", {"rtsp_flags": "listen"}), ("p4", {"stimeout": "1|http_proxy;" + proxy})):
            ack = box.refused(request_id, [box.cam, dict(web, input_options=options)])
            assert ack["error"]["field"] == "sources[1].input_options.%s" % next(iter(options)), ack

        polls = iter(range(10 ** 6))  # a new request id per poll: the count of messages seen may not have moved

        def web_refused():
            ack = box.command("status", "st-%d" % next(polls))
            assert "result" in ack, ack
            web_status = ack["result"]["sources"]["web"]
            return web_status if (web_status["last_error"] or {}).get("cause") == "refused" else None

        # Each poll is a command: polled back to back, a refusal slow to come spent the daemon's token bucket.
        assert wait_for(web_refused, timeout=ANSWER_S, interval=POLL_S), \
            "the web source never reported its refused connection"
        # In the project's words, not FFmpeg's text with hosts and ports (a port-scan oracle).
        assert web_refused()["last_error"]["message"] == "connection refused"
        assert not wait_for(lambda: attacker.received, timeout=WINDOW_S), "the box connected through the proxy"
    finally:
        box.stop()
        attacker.close()
    alerts = [json.loads(p) for t, p in box.published() if t.endswith("/telemetry/alert")]
    assert any(a.get("source") == "web" for a in alerts) and not [a for a in alerts if "127.0.0.1" in a["message"]]
    assert "cannot open http://127.0.0.1:" in box.log_path.read_text()  # the detail stays in the local log


def test_a_raw_password_with_slash_and_at_is_nowhere_and_reaches_the_camera_intact(tmp_path, mosquitto):
    camera = Attacker(rtsp_401=True)  # here the camera itself: it asks for the password
    uri = "rtsp://viewer:%s@127.0.0.1:%d/cam" % (PASSWORD, camera.port)
    gate = {"name": "gate", "uri": uri, "reopen_min_s": 0.5, "reopen_max_s": 2.0}
    box = Box(tmp_path, mosquitto, more_sources=[gate])
    pieces = [p for p in re.split(r"[@/]", PASSWORD) if len(p) > 2]  # "Pa", "ss" are too common to look for
    try:
        assert wait_for(lambda: b"Authorization: Basic" in camera.everything(), timeout=ANSWER_S), \
            camera.everything()[-500:]
        sent = re.search(rb"Authorization: Basic (\S+)", camera.everything()).group(1)
        assert base64.b64decode(sent).decode() == "viewer:" + PASSWORD  # percent-encoded, decoded by FFmpeg

        def gate_auth():
            for t in box.probe.on(PREFIX + "/telemetry"):
                error = t.get("sources", {}).get("gate", {}).get("last_error") or {}
                if error.get("cause") == "auth":
                    return error
            return None

        assert wait_for(gate_auth, timeout=ANSWER_S)
        assert gate_auth()["message"] == "authentication failed"
        checked = box.command("validate", "v1", config={"sources": box.sources})
        assert checked["state"] == "succeeded" and "viewer:***@127.0.0.1" in json.dumps(checked), checked
        ambiguous = dict(gate, uri=uri + "/a@b")  # reads two ways: refused, saying what to do
        ack = box.refused("s1", [box.cam, ambiguous])
        assert ack["error"]["field"] == "sources[1].uri" and "percent-encode" in ack["error"]["message"], ack
        misplaced = box.refused("s2", [dict(box.cam, max_fps=uri)])  # the schema repeats a value it refuses
        assert misplaced["error"]["field"] == "sources[0].max_fps" and "viewer:***@" in json.dumps(misplaced)
        probed = subprocess.run([sys.executable, "-m", "agent", "validate", box.config, "--probe"],
                                capture_output=True, text=True, env=box.env, timeout=120)
    finally:
        box.stop()
        camera.close()
    assert probed.returncode == 1 and "probe gate: FAILED [auth]" in probed.stdout, probed.stdout + probed.stderr
    assert "viewer:***@127.0.0.1" in probed.stdout
    daemon_log = box.log_path.read_text()
    assert "gate failed: cannot open rtsp://viewer:***@127.0.0.1" in daemon_log
    for where, text in [("validate --probe", probed.stdout + probed.stderr), ("the daemon's log", daemon_log)] + [
            ("MQTT " + t, p) for t, p in box.published()] + [
            (path, data.decode("utf-8", "replace")) for path, data in box.state_files()]:
        assert not [p for p in pieces if p in text], "the password is in %s" % where
