"""Every query of the shipped Grafana dashboard (deploy/monitoring/grafana-dashboard.json, issue 32) returns data
from a real Prometheus scraping a real daemon's endpoint (cpu-dev, a looping folder of frames, ``metrics.listen``),
``atlas-edge fleet metrics`` over that daemon's MQTT (with a rollout in flight in its ``--state-dir``) and a
stand-in for Huawei's npu-exporter (fixed text in npu-exporter's format: no NPU here). Each panel's targets are read
from the JSON, the template variables replaced by the running box and camera, and run through the HTTP API; the
``device`` and ``source`` variables' own queries are run too."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.devtools.broker import free_port
from tests.conftest import REPO_ROOT, wait_for
from tests.support.daemon_rig import start_daemon, write_config
from tests.support.fleet_boxes import random_prefix
from tests.support.prometheus import Prometheus, require_prometheus

pytestmark = [
    pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                       reason="examples/demo-bundle is missing (make demo-bundle)"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("prometheus_client") is None,
                       reason="needs prometheus_client (pip install 'atlas-edge[metrics]')"),
]

DASHBOARD = os.path.join(REPO_ROOT, "deploy", "monitoring", "grafana-dashboard.json")
ROLLOUT_FIXTURE = os.path.join(REPO_ROOT, "tests", "fixtures", "fleet_journal", "in_progress")
DEVICE, SOURCE = "mon-1", "cam"
BOUND_S = 120  # a daemon and three scrapers starting on a loaded machine; a bound, never asserted as a duration
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval becomes at a 1 s scrape over a short range
# npu-exporter's text (its names, units and `id` label, docs/metrics.md); `device` is the label prometheus.yml's
# npu-exporter job gives each target, written into the text here because the test's Prometheus has one job.
NPU_EXPORTER_TEXT = "".join(
    "# TYPE %s gauge\n%s{device=\"%s\",id=\"0\",model_name=\"310P3\"} %s\n" % (name, name, DEVICE, value)
    for name, value in (("npu_chip_info_utilization", 37), ("npu_chip_info_temperature", 52),
                        ("npu_chip_info_power", 14.5), ("npu_chip_info_used_memory", 3120),
                        ("npu_chip_info_total_memory", 21534))).encode()


class NpuExporterStandIn:
    """A loopback HTTP server answering /metrics with fixed npu-exporter text."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(NPU_EXPORTER_TEXT)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = "127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def dashboard_queries():
    """(panel title, expr) of every target, and {variable: label_values(...) query} of the query variables."""
    with open(DASHBOARD) as handle:
        dashboard = json.load(handle)
    targets = [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    variables = {v["name"]: v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}
    return targets, variables


def substitute(expr: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$device", DEVICE)
            .replace("$source", SOURCE))


def start_bridge(mosquitto, prefix, state_dir, log_path):
    port = free_port()
    log = open(str(log_path), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "agent", "fleet", "metrics", "--broker", mosquitto.url,
                             "--prefix", prefix, "--listen", "127.0.0.1:%d" % port, "--state-dir", str(state_dir)],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log.close()
    return proc, "127.0.0.1:%d" % port


def stop(proc):
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path, mosquitto):
    require_prometheus()
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),) * 3, seed=3)
    prefix = random_prefix("monitoring")
    rollouts = tmp_path / "rollouts"  # a rollout in flight, as the engine left it (snapshot and journal)
    rollouts.mkdir()
    for suffix in (".json", ".journal"):
        shutil.copy(os.path.join(ROLLOUT_FIXTURE, "ro-today" + suffix), str(rollouts))
    box_port = free_port()
    mqtt = {"host": mosquitto.host, "port": mosquitto.port, "reconnect_min_s": 0.1, "reconnect_max_s": 1.0,
            "prefix": prefix, "groups": ["lab"]}
    # The leak detector's trend after 6 samples at 0.2 s (alert only), so its growth gauge has data too.
    watchdog = {"interval_s": 0.2, "leak_min_samples": 6, "restart_on_leak": False}
    config = write_config(tmp_path, mosquitto, frames, loop=True, device_id=DEVICE, mqtt=mqtt, watchdog=watchdog,
                          metrics={"listen": str(box_port)})
    daemon = bridge = None
    npu = NpuExporterStandIn()
    try:
        daemon = start_daemon(config)
        bridge, bridge_address = start_bridge(mosquitto, prefix, rollouts, tmp_path / "bridge.log")
        with Prometheus(["127.0.0.1:%d" % box_port, bridge_address, npu.address]) as prometheus:
            targets, variables = dashboard_queries()
            assert len(targets) >= 20, targets

            def empty():
                assert daemon.poll() is None and bridge.poll() is None, (daemon.poll(), bridge.poll())
                return [(title, expr) for title, expr in targets if not prometheus.query(substitute(expr))]

            assert wait_for(lambda: not empty(), timeout=BOUND_S, interval=1.0), (empty(), prometheus.log_tail())
            for name, query in variables.items():
                selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", query).groups()
                values = prometheus.api("label/%s/values" % label, **{"match[]": substitute(selector)})
                assert {"device": DEVICE, "source": SOURCE}[name] in values, (name, values)
            # the same box through both paths: its endpoint and the bridge's mirror of its telemetry
            info = prometheus.query('atlas_edge_fleet_box_info{device="%s"}' % DEVICE)
            assert info and info[0]["metric"]["group"] == "lab", info
    finally:
        stop(daemon)
        stop(bridge)
        npu.close()
