"""``atlas-edge fleet metrics`` (issue 32, the fleet side) over a real daemon (cpu-dev) and simulated boxes on a
real Mosquitto: the bridge runs as a user runs it (``python -m agent fleet metrics`` in its own process) and is
scraped over HTTP; the text is read with prometheus_client's parser. (No Prometheus server here: the scrape is
of the exposition itself.)
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from agent.cli.ctl import EXIT_BROKER
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.devtools.broker import free_port
from tests.conftest import REPO_ROOT, MqttProbe, wait_for
from tests.support.daemon_rig import start_daemon, write_config
from tests.support.fleet_boxes import BoxFleet, random_prefix
from tests.support.prometheus import Prometheus, prometheus_problem

prometheus_parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client (the 'metrics' extra)")

pytestmark = [pytest.mark.fleet_rig,
              pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                 reason="examples/demo-bundle is missing (make demo-bundle)")]

BOUND_S = 120  # a daemon starting on a loaded machine; a bound, never asserted as a duration
BRIDGE_SECRET = "bridge-pass-7f3a"
DAEMON_SECRET = "daemon-pass-91c2"
STATES = ("online", "stale", "offline", "malformed", "unknown")
ROLLOUT_FIXTURE = os.path.join(REPO_ROOT, "tests", "fixtures", "fleet_journal", "in_progress")


class Bridge:
    """``fleet metrics`` in its own process, scraped over HTTP."""

    def __init__(self, broker, prefix, tmp_path, *extra, listen=None):
        self.port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1", BRIDGE_PASSWORD=BRIDGE_SECRET)
        self.log = open(str(tmp_path / ("bridge-%d.log" % self.port)), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "fleet", "metrics", "--broker", broker.url, "--prefix", prefix,
             "--username", "operator-metrics", "--password", "env:BRIDGE_PASSWORD",
             "--listen", listen or "127.0.0.1:%d" % self.port, "--state-dir", str(tmp_path / "rollouts"), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        assert wait_for(lambda: self.proc.poll() is not None or "serving http" in self.output(), timeout=60), \
            self.output()
        assert self.proc.poll() is None, self.output()

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def text(self):
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=10) as answer:
            return answer.read().decode()

    def samples(self):
        found = {}
        for family in prometheus_parser.text_string_to_metric_families(self.text()):
            for sample in family.samples:
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return found

    def close(self):
        self.proc.terminate()
        try:
            code = self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
        return code


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def with_device(samples, device):
    return {k: v for k, v in samples.items() if ("device", device) in k[1]}


def totals(samples):
    return {s: value(samples, "atlas_edge_fleet_boxes", state=s) for s in STATES}


def documented_series():
    """{series: label names} of docs/metrics.md's fleet bridge table: the one list of what the bridge serves."""
    with open(os.path.join(REPO_ROOT, "docs", "metrics.md"), encoding="utf-8") as handle:
        section = handle.read().split("## The fleet bridge", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `atlas_edge_fleet_")]
    return {row[0].strip("`"): set(re.findall(r"`([a-z_]+)`", row[2])) for row in rows}


def check_through_prometheus(bridge):
    """A real Prometheus scrapes the bridge: every documented series is there with its labels (one left empty,
    as sim-ok's precision, is no label at all to Prometheus: each series has a subset, together all of them)."""
    series = documented_series()
    assert len(series) >= 14, series
    with Prometheus(["127.0.0.1:%d" % bridge.port]) as prom:
        def complete():
            return all(prom.query(name) for name in series)

        assert wait_for(complete, timeout=60, interval=0.5), [n for n in series if not prom.query(n)]
        for name, labels in series.items():
            found = [set(f["metric"]) - {"__name__", "job", "instance"} for f in prom.query(name)]
            assert all(each <= labels for each in found) and set().union(*found) == labels, (name, found)
        boxes = prom.query("sum(atlas_edge_fleet_boxes)")
        assert float(boxes[0]["value"][1]) == 4


@pytest.fixture
def daemon(mosquitto, tmp_path):
    """One real cpu-dev daemon ``real-1`` in group ``real`` (telemetry every second), up once its status is."""
    prefix = random_prefix("metrics")
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=5)
    probe = MqttProbe(mosquitto, ["%s/#" % prefix])
    mqtt = {"host": mosquitto.host, "port": mosquitto.port, "reconnect_min_s": 0.1, "reconnect_max_s": 1.0,
            "prefix": prefix, "groups": ["real"], "username": "real-1", "password": DAEMON_SECRET}
    home = tmp_path / "box"
    home.mkdir()
    proc = start_daemon(write_config(home, mosquitto, frames, loop=True, device_id="real-1", mqtt=mqtt))
    try:
        assert wait_for(lambda: _telemetry(probe, prefix, "real-1"), timeout=BOUND_S, interval=0.2), proc.poll()
        yield {"prefix": prefix, "probe": probe}
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        probe.close()


def _telemetry(probe, prefix, device):
    return [json.loads(p) for t, p, _r, _q in list(probe.messages) if t == "%s/%s/telemetry" % (prefix, device)]


def _status(probe, prefix, device):
    found = [json.loads(p) for t, p, _r, _q in list(probe.messages)
             if t == "%s/%s/status" % (prefix, device) and p and json.loads(p).get("state") == "online"]
    return found[-1] if found else None


def test_series_labels_and_totals_over_a_real_daemon_and_simulated_boxes(mosquitto, daemon, tmp_path):
    prefix, probe = daemon["prefix"], daemon["probe"]
    fleet = BoxFleet(mosquitto.host, mosquitto.port, prefix, {})
    fleet.add("sim-ok", ["sim"], params={"kind": "atlas-300i"})
    fleet.add("sim-bad", ["sim"], fault="bad_slots")
    fleet.add("sim-gone", ["sim"])
    bridge = None
    try:
        fleet.start()
        fleet.call(lambda: fleet.box("sim-gone").stop())  # a clean stop: its retained status says offline
        rollouts = tmp_path / "rollouts"  # a rollout in flight, as the engine left it (snapshot and journal)
        rollouts.mkdir()
        for suffix in (".json", ".journal"):
            shutil.copy(os.path.join(ROLLOUT_FIXTURE, "ro-today" + suffix), str(rollouts))
        bridge = Bridge(mosquitto, prefix, tmp_path)

        def settled():
            ok = fleet.box("sim-ok")  # sim boxes send no telemetry of their own: it keeps sim-ok online
            fleet.call(lambda: ok.send(ok.topic("telemetry"), {"ts": time.time(), "frames": 7}))
            samples = bridge.samples()
            return totals(samples) == {"online": 2, "stale": 0, "offline": 1, "malformed": 1, "unknown": 0} and \
                value(samples, "atlas_edge_fleet_box_frames_served_total", device="real-1", group="real")

        assert wait_for(settled, timeout=BOUND_S, interval=0.5), bridge.text()[-3000:]
        samples = bridge.samples()
        status = _status(probe, prefix, "real-1")
        serving = status["slots"]["slots"][status["slots"]["serving"]]
        assert value(samples, "atlas_edge_fleet_box_info", device="real-1", group="real", kind="cpu-dev",
                     model=serving["name"], version=serving["version"], backend=status["backend"],
                     precision=status["precision"]) == 1, with_device(samples, "real-1")
        assert serving["version"] == json.load(open(os.path.join(DEMO_BUNDLE, "manifest.json")))["version"]
        served = value(samples, "atlas_edge_fleet_box_frames_served_total", device="real-1", group="real")
        assert served > 0 and served in {t["frames"] for t in _telemetry(probe, prefix, "real-1")}
        age = value(samples, "atlas_edge_fleet_box_frame_age_seconds", device="real-1", group="real", source="cam")
        assert age is not None and 0 <= age < 60
        assert value(samples, "atlas_edge_fleet_box_resident_memory_bytes", device="real-1", group="real") > 1e6
        assert 0 <= value(samples, "atlas_edge_fleet_box_backend_busy_ratio", device="real-1", group="real") <= 1
        assert value(samples, "atlas_edge_fleet_box_outbox_messages", device="real-1", group="real") >= 0
        assert value(samples, "atlas_edge_fleet_box_state", device="sim-bad", group="sim", state="malformed") == 1
        assert value(samples, "atlas_edge_fleet_box_state", device="sim-gone", group="sim", state="offline") == 1
        assert value(samples, "atlas_edge_fleet_box_info", device="sim-ok", group="sim", kind="atlas-300i",
                     model="shapes", version="1.0.0", backend="sim", precision="") == 1
        assert value(samples, "atlas_edge_fleet_bridge_connected", broker="%s:%d" % (mosquitto.host,
                                                                                     mosquitto.port)) == 1
        text = bridge.text()
        assert BRIDGE_SECRET not in text and DAEMON_SECRET not in text and "password" not in text
        assert value(samples, "atlas_edge_fleet_rollout_status", rollout="ro-today", status="running") == 1
        if prometheus_problem() is None:
            check_through_prometheus(bridge)
        assert bridge.close() == 0  # SIGTERM: a clean stop
    finally:
        if bridge is not None and bridge.proc.poll() is None:
            bridge.close()
        fleet.close()


def test_a_silent_box_turns_stale_then_is_forgotten(mosquitto, tmp_path):
    prefix = random_prefix("metrics")
    fleet = BoxFleet(mosquitto.host, mosquitto.port, prefix, {})
    fleet.add("leaver", ["sim"], params={"no_will": True})  # its connection dies and the online stays retained
    fleet.add("stayer", ["sim"])
    bridge = None
    try:
        fleet.start()
        for device in ("leaver", "stayer"):  # a status that says how often it speaks: 1 s
            box = fleet.box(device)
            fleet.call(lambda box=box: box.send(box.topic("status"), dict(box.status_body(), telemetry_interval_s=1.0),
                                                retain=True))
        bridge = Bridge(mosquitto, prefix, tmp_path, "--forget-after", "8", listen=None)
        stayer = fleet.box("stayer")

        def state_of(device):
            fleet.call(lambda: stayer.send(stayer.topic("telemetry"), {"ts": time.time()}))
            samples = bridge.samples()
            return {s for s in STATES if value(samples, "atlas_edge_fleet_box_state", device=device, group="sim",
                                                state=s) == 1}, samples

        assert wait_for(lambda: state_of("leaver")[0] == {"online"}, timeout=30, interval=0.2), bridge.text()
        fleet.call(lambda: fleet.box("leaver").drop())  # gone without a word (no will)
        assert wait_for(lambda: state_of("leaver")[0] == {"stale"}, timeout=30, interval=0.2), bridge.text()
        assert wait_for(lambda: not with_device(state_of("leaver")[1], "leaver"), timeout=60, interval=0.5), \
            bridge.text()
        _, samples = state_of("stayer")
        assert value(samples, "atlas_edge_fleet_box_state", device="stayer", group="sim", state="online") == 1
        assert value(samples, "atlas_edge_fleet_bridge_boxes_forgotten_total") == 1
        assert totals(samples) == {"online": 1, "stale": 0, "offline": 0, "malformed": 0, "unknown": 0}
    finally:
        if bridge is not None:
            bridge.close()
        fleet.close()


def test_bare_port_binds_loopback_and_a_refused_broker_is_exit_4(mosquitto, tmp_path):
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "agent", "fleet", "metrics", "--broker",
                           "mqtt://127.0.0.1:%d" % free_port(), "--listen", str(port)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_BROKER, done.stderr
    assert "Traceback" not in done.stderr
    bridge = Bridge(mosquitto, random_prefix("metrics"), tmp_path, listen=str(port))
    try:
        bridge.port = port
        assert "serving http://127.0.0.1:%d/metrics" % port in bridge.output()
        assert totals(bridge.samples()) == dict.fromkeys(STATES, 0)
    finally:
        bridge.close()


def test_the_bridge_reconnects_after_its_broker_comes_back(tmp_path):
    """One owner of reconnecting: the bridge. The broker stops (the series stay, connected says 0) and starts
    again on its port: the bridge is back, and so is what the boxes say."""
    from agent.devtools.broker import EmbeddedBroker

    prefix = random_prefix("metrics")
    with EmbeddedBroker() as broker:
        fleet = BoxFleet(broker.host, broker.port, prefix, {})
        box = fleet.add("sim-1", ["sim"])
        bridge = None
        try:
            fleet.start()
            bridge = Bridge(broker, prefix, tmp_path)
            where = "%s:%d" % (broker.host, broker.port)

            def connected():
                return value(bridge.samples(), "atlas_edge_fleet_bridge_connected", broker=where)

            assert wait_for(lambda: connected() == 1 and totals(bridge.samples())["online"] == 1, timeout=30)
            heard = value(bridge.samples(), "atlas_edge_fleet_bridge_messages_total")
            broker.kill()
            assert wait_for(lambda: connected() == 0, timeout=30), bridge.text()
            assert totals(bridge.samples())["online"] == 1  # what was heard stays served
            broker.start()  # the boxes come back on their own (their reconnect), the bridge on its own
            assert wait_for(lambda: box.connected, timeout=30)
            assert wait_for(lambda: connected() == 1, timeout=60), bridge.output()[-2000:]
            fleet.call(lambda: box.send(box.topic("telemetry"), {"ts": time.time(), "frames": 99}))
            assert wait_for(lambda: value(bridge.samples(), "atlas_edge_fleet_box_frames_served_total",
                                          device="sim-1", group="sim") == 99, timeout=30), bridge.text()
            assert value(bridge.samples(), "atlas_edge_fleet_bridge_messages_total") > heard
            assert bridge.proc.poll() is None
        finally:
            if bridge is not None:
                bridge.close()
            fleet.close()
