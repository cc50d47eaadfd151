"""A real Prometheus for the tests (Debian's ``prometheus`` package, installed by ``make prometheus``): a temporary
config scraping the given targets every second, its TSDB in a temporary directory, its web API on a free
loopback port, queried over HTTP. A helper module (not a test module).

Tests that need it skip only where the binary is absent and cannot be installed here (the reason names which).
"""

import json
import os
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional, Sequence

import pytest
import yaml

from agent.devtools.broker import free_port
from tests.conftest import wait_for

PROMETHEUS = "/usr/bin/prometheus"
SCRAPE_INTERVAL = "1s"  # the acceptance test's "scraped every second"
START_S = 60.0  # a cold start replays an empty WAL and opens its web port in about a second; generous on a busy box


def prometheus_problem() -> Optional[str]:
    """Why no Prometheus can run here (None when one can): the binary, and whether apt-get could install it."""
    if os.access(PROMETHEUS, os.X_OK):
        return None
    if shutil.which("apt-get") is None:
        return "%s is absent and there is no apt-get to install Debian's prometheus package" % PROMETHEUS
    if os.geteuid() != 0 and shutil.which("sudo") is None:
        return "%s is absent; `make prometheus` needs root or sudo to install it" % PROMETHEUS
    return "%s is absent: run `make prometheus` (apt-get install prometheus)" % PROMETHEUS


def require_prometheus() -> None:
    problem = prometheus_problem()
    if problem is not None:
        pytest.skip("needs a real Prometheus: %s" % problem)


class Prometheus:
    """One Prometheus process scraping ``targets`` (``host:port``) under job ``atlas-edge``; stop() ends it."""

    def __init__(self, targets: Sequence[str], interval: str = SCRAPE_INTERVAL) -> None:
        self.dir = tempfile.mkdtemp(prefix="prometheus-")
        self.port = free_port()
        config = {"global": {"scrape_interval": interval, "scrape_timeout": interval},
                  "scrape_configs": [{"job_name": "atlas-edge", "static_configs": [{"targets": list(targets)}]}]}
        path = os.path.join(self.dir, "prometheus.yml")
        with open(path, "w") as handle:
            yaml.safe_dump(config, handle)
        self.log = open(os.path.join(self.dir, "prometheus.log"), "w")
        cmd = [PROMETHEUS, "--config.file=%s" % path,
               "--storage.tsdb.path=%s" % os.path.join(self.dir, "data"),
               "--web.listen-address=127.0.0.1:%d" % self.port]
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_for(self._ready, timeout=START_S, interval=0.2):
            self.stop()
            raise AssertionError("Prometheus did not become ready: %s" % self.log_tail())

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError("Prometheus exited (%s): %s" % (self.process.returncode, self.log_tail()))
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % self.port, timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>: the ``data`` of a successful answer."""
        url = "http://127.0.0.1:%d/api/v1/%s?%s" % (self.port, path, urllib.parse.urlencode(params))
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.loads(answer.read().decode("utf-8"))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> List[Dict[str, Any]]:
        """An instant query's vector: [{"metric": {labels}, "value": [ts, "v"]}, ...]."""
        return self.api("query", query=expr)["result"]

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def scrapes(self) -> float:
        """Successful scrapes so far of every target together (Prometheus' own ``up`` samples)."""
        found = self.query("sum(count_over_time(up[1h]))")
        return float(found[0]["value"][1]) if found else 0.0

    def log_tail(self, chars: int = 2000) -> str:
        self.log.flush()
        with open(self.log.name) as handle:
            return handle.read()[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
