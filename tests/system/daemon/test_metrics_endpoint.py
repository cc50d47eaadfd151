"""The box's Prometheus endpoint (issue 32) scraped by a real Prometheus every second, on a real daemon serving the
demo bundle from a folder of frames, against a real Mosquitto: every series docs/metrics.md lists as ``always``
exists through Prometheus' API with exactly its documented labels; frames served equals the results received over
MQTT once the folder is done; model info names the backend and precision of the retained status; a camera
password and the MQTT password appear nowhere in the scrape; a bare port binds loopback."""

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.devtools.broker import free_port
from tests.conftest import MqttProbe, wait_for
from tests.support.daemon_rig import write_config
from tests.support.prometheus import Prometheus, require_prometheus

pytestmark = [
    pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                       reason="examples/demo-bundle is missing (make demo-bundle)"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("prometheus_client") is None,
                       reason="needs prometheus_client (pip install 'atlas-edge[metrics]')"),
]

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "metrics.md")
CAMERA_SECRET = "Cam-Secret-4711"
MQTT_SECRET = "Mqtt-Secret-0815"
PREFIX = "atlas-edge/e2e"
FRAMES = 6
PROMETHEUS_LABELS = {"job", "instance", "device"}


def documented_series():
    """(name, type, labels) of each docs/metrics.md row whose ``When`` is ``always``."""
    rows = []
    for line in open(DOCS):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`atlas_edge_") and cells[3] == "always":
            rows.append((cells[0].strip("`"), cells[1], set(re.findall(r"`([a-z_]+)`", cells[2]))))
    return rows


def listening_addresses(port):
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def test_a_real_prometheus_scrapes_every_documented_series_without_a_secret(tmp_path, mosquitto):
    require_prometheus()
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),) * FRAMES, seed=11)
    port = free_port()
    gate = {"name": "gate", "uri": "rtsp://viewer:%s@127.0.0.1:%d/gate" % (CAMERA_SECRET, free_port())}
    mqtt = {"host": mosquitto.host, "port": mosquitto.port, "username": "e2e", "password": MQTT_SECRET,
            "reconnect_min_s": 0.1, "reconnect_max_s": 1.0}
    config = write_config(tmp_path, mosquitto, frames, sources=[{"name": "cam", "uri": str(frames)}, gate],
                          mqtt=mqtt, metrics={"listen": str(port)})
    probe = MqttProbe(mosquitto, [PREFIX + "/#"])
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", config], stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        with Prometheus(["127.0.0.1:%d" % port]) as prometheus:
            results = lambda: [m for t, m in probe.json(PREFIX + "/results/")]  # noqa: E731
            served = wait_for(lambda: len(results()) >= FRAMES or proc.poll() is not None, timeout=120)
            assert served and proc.poll() is None, log_path.read_text()[-3000:]
            probe.publish(PREFIX + "/cmd/status", json.dumps({"request_id": "m1"}).encode())
            assert wait_for(lambda: any(a["state"] == "succeeded" for a in probe.on(PREFIX + "/ack/m1")), 30)

            def value(expr):
                found = prometheus.query(expr)
                return float(found[0]["value"][1]) if found else None

            # A quiet moment: the folder is done; what Prometheus last scraped is what MQTT carried.
            assert wait_for(lambda: value('atlas_edge_frames_served_total{source="cam"}') == len(results()),
                            timeout=30), (value('atlas_edge_frames_served_total{source="cam"}'), len(results()))
            assert len(results()) == FRAMES
            assert wait_for(lambda: value('atlas_edge_commands_total{verb="status",outcome="succeeded"}') == 1, 30)
            _check_documented_series(prometheus)
            _check_values(prometheus, value, probe)
            scraped = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read().decode()
            stored = json.dumps(prometheus.api("series", **{"match[]": '{job="atlas-edge"}'}))
            for secret in (CAMERA_SECRET, MQTT_SECRET, "viewer"):
                assert secret not in scraped and secret not in stored, secret
            assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, as /proc/net/tcp writes it
    finally:
        proc.terminate()
        proc.wait(60)
        probe.close()
    assert proc.returncode == 0, log_path.read_text()[-3000:]


def _check_documented_series(prometheus):
    rows = documented_series()
    assert len(rows) >= 18, rows  # the table was read
    for name, kind, labels in rows:
        exposed = name + "_count" if kind == "histogram" else name
        found = prometheus.query(exposed)
        assert found, "%s: no series in Prometheus" % name
        for series in found:
            assert set(series["metric"]) - {"__name__"} == PROMETHEUS_LABELS | labels, (name, series["metric"])
            assert series["metric"]["device"] == "e2e"


def _check_values(prometheus, value, probe):
    status = [s for s in probe.on(PREFIX + "/status") if s.get("state") == "online"][-1]
    info = prometheus.query("atlas_edge_model_info")
    assert {(i["metric"]["backend"], i["metric"]["precision"]) for i in info} == {
        (status["backend"], status["precision"])}
    assert all(i["metric"]["slot"] in ("a", "b") and i["metric"]["artifact"] for i in info)
    assert value('atlas_edge_stage_seconds_count{stage="infer"}') == FRAMES
    assert value("atlas_edge_batch_size_sum") == FRAMES
    assert value("atlas_edge_results_published_total") == FRAMES
    assert value('atlas_edge_frames_read_total{source="cam"}') == FRAMES
    assert 0 < value('atlas_edge_frame_age_seconds{source="cam"}') < 60
    assert 0 < value('histogram_quantile(0.5, atlas_edge_stage_seconds_bucket{stage="infer"})') < 10
    for source in ("cam", "gate"):
        assert value('sum(atlas_edge_source_state{source="%s"})' % source) == 1
    assert value('atlas_edge_source_state{source="gate",state="up"}') == 0  # nothing listens there
    assert value("atlas_edge_broker_connected") == 1
    assert value('atlas_edge_resident_memory_bytes{process="daemon"}') > 20 * 1024 * 1024
    assert value("atlas_edge_collect_ok") == 1
    assert value("sum(atlas_edge_watchdog_state)") == 1


def test_a_listen_address_already_taken_stops_the_start_naming_the_field(tmp_path, mosquitto):
    import socket

    from agent.cli.main import EXIT_CANNOT_START

    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=3)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        config = write_config(tmp_path, mosquitto, frames, metrics={"listen": "127.0.0.1:%d" % port})
        done = subprocess.run([sys.executable, "-m", "agent", "run", "--config", config], capture_output=True,
                              text=True, timeout=120)
    finally:
        taken.close()
    assert done.returncode == EXIT_CANNOT_START, done.stdout + done.stderr
    assert "metrics.listen: cannot listen on 127.0.0.1:%d" % port in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
