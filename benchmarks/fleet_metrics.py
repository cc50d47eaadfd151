"""``fleet_metrics`` section: ``atlas-edge fleet metrics`` over 1,000 simulated boxes, its CPU per scrape and RSS.

The boxes are the protocol-only ones of ``tests/support/fleet_boxes.py`` (one thread, one epoll loop), each with a
retained status and one telemetry message shaped as a daemon's (counters, busy fraction, RSS, outbox, two
sources with frame ages). The bridge runs as a user runs it (``python -m agent fleet metrics`` in its own
process, as ``benchmarks/fleet.py`` runs the operator), so its CPU time and RSS are its own, read from
``/proc/<pid>``. Once every box is folded in, the fleet is quiet and the bridge is scraped ``SCRAPES`` times;
the CPU it spent over those scrapes, less what it spends idle over as long, divided by ``SCRAPES``, is
``scrape_cpu_s``. ``rss_mb`` is its RSS then, ``rss_empty_mb`` before any box was heard, and their difference
per box is ``rss_kib_per_box``.
"""

import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, Tuple

from benchmarks.harness import RunContext, target

log = logging.getLogger(__name__)

BOXES = 1000  # the fleet
SCRAPES = 20
PREFIX = "bench-metrics"
START_TIMEOUT_S = 120.0
RSS_BOUND_MB = 64.0  # the bound stated for the bridge at 1,000 boxes (36 MiB measured, 27 of it empty)
TARGETS = {"scrape_cpu_s": ("<", 1.0), "rss_mb": ("<=", RSS_BOUND_MB)}


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of ``pid`` so far (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open("/proc/%d/stat" % pid, encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / float(os.sysconf("SC_CLK_TCK"))


def _rss_mb(pid: int, key: str = "VmRSS:") -> float:
    with open("/proc/%d/status" % pid, encoding="ascii") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _telemetry(index: int) -> Dict[str, Any]:
    """A daemon's telemetry, trimmed to what the bridge reads plus the bulk a real one carries."""
    sources = {"cam%d" % s: {"uri": "rtsp://10.0.%d.%d/stream" % (index // 250, index % 250), "state": "up",
                             "fps_in": 10.0, "fps_out": 10.0, "frames": 36000 + s, "frame_age_ms": {
                                 "p50": 80.0 + s, "max": 140.0}} for s in range(2)}
    return {"ts": time.time(), "fps": 20.0, "frames": 72000 + index, "latency_ms": {"p50": 12.0, "p99": 30.0},
            "backend_busy_fraction": 0.4, "rss_mb": 180.0, "total_rss_mb": 290.0, "sources": sources,
            "mqtt": {"published": 72000, "acked": 72000, "outbox_messages": index % 7, "outbox_bytes": 0,
                     "connected": True, "broker": "broker:1883"},
            "model": {"name": "shapes", "version": "1.0.0", "backend": "acl", "precision": "int8"}}


def _scrape(url: str) -> Tuple[bytes, float]:
    began = time.monotonic()
    with urllib.request.urlopen(url, timeout=60) as answer:
        body = answer.read()
    return body, time.monotonic() - began


def _boxes_seen(body: bytes) -> int:
    total = 0
    for line in body.decode().splitlines():
        if line.startswith("atlas_edge_fleet_boxes{"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def run(context: RunContext) -> Dict[str, Any]:
    from agent.devtools.broker import EmbeddedBroker, free_port
    from tests.support.fleet_boxes import BoxFleet

    broker = EmbeddedBroker().start()
    port = free_port()
    url = "http://127.0.0.1:%d/metrics" % port
    fleet = BoxFleet(broker.host, broker.port, PREFIX, {})
    for index in range(BOXES):
        fleet.add("box-%04d" % index, ["sim"] if index % 2 else ["sim", "north"])
    env = dict(os.environ, PYTHONPATH=context.root)
    bridge = subprocess.Popen([sys.executable, "-m", "agent", "fleet", "metrics", "--broker", broker.url,
                               "--prefix", PREFIX, "--listen", "127.0.0.1:%d" % port,
                               "--state-dir", os.path.join(context.work_dir, "fleet-metrics")],
                              env=env, cwd=context.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        empty = None
        while empty is None and time.monotonic() < deadline and bridge.poll() is None:
            try:
                empty = _scrape(url)[0]
            except OSError:
                time.sleep(0.2)
        if empty is None:
            raise RuntimeError("fleet metrics did not serve (exit %s)" % bridge.poll())
        rss_empty = _rss_mb(bridge.pid)
        fleet.start(timeout=START_TIMEOUT_S)
        fleet.call(lambda: [box.send(box.topic("telemetry"), _telemetry(i)) for i, box in enumerate(fleet.boxes)])
        body = b""
        while time.monotonic() < deadline and _boxes_seen(body) < BOXES:
            time.sleep(0.5)
            body = _scrape(url)[0]
        if _boxes_seen(body) < BOXES:
            raise RuntimeError("the bridge folded %d of %d boxes" % (_boxes_seen(body), BOXES))
        time.sleep(2.0)  # the last telemetry folded in: the fleet is quiet from here
        cpu_before, walls = _cpu_s(bridge.pid), []
        for _ in range(SCRAPES):
            body, wall = _scrape(url)
            walls.append(wall)
        cpu_after = _cpu_s(bridge.pid)
        time.sleep(sum(walls))  # as long again without a scrape: what the bridge spends idle
        cpu_scrapes, idle = cpu_after - cpu_before, _cpu_s(bridge.pid) - cpu_after
        rss, peak = _rss_mb(bridge.pid), _rss_mb(bridge.pid, "VmHWM:")
        log.info("fleet metrics: %d boxes, %.3f CPU s per scrape, RSS %.1f MiB (empty %.1f)",
                 BOXES, cpu_scrapes / SCRAPES, rss, rss_empty)
    finally:
        bridge.terminate()
        try:
            bridge.wait(30)
        except subprocess.TimeoutExpired:
            bridge.kill()
        fleet.close()
        broker.close()
    walls.sort()
    samples = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    return {
        "boxes": BOXES, "scrapes": SCRAPES,
        "scrape_cpu_s": round(max(0.0, cpu_scrapes - idle) / SCRAPES, 4),
        "scrape_cpu_s_raw": round(cpu_scrapes / SCRAPES, 4), "idle_cpu_s": round(idle, 3),
        "scrape_wall_s_median": round(walls[len(walls) // 2], 4), "scrape_bytes": len(body), "samples": samples,
        "rss_mb": round(rss, 1), "rss_peak_mb": round(peak, 1), "rss_empty_mb": round(rss_empty, 1),
        "rss_kib_per_box": round((rss - rss_empty) * 1024.0 / BOXES, 2), "rss_bound_mb": RSS_BOUND_MB,
        "environment": {"boxes_process": "one thread, one epoll loop, %d paho clients" % BOXES,
                        "bridge_process": "python -m agent fleet metrics", "broker": "one mosquitto",
                        "telemetry_bytes_per_box": len(json.dumps(_telemetry(0))),
                        "cpus": os.cpu_count()},
    }


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {key: target(section.get(key), op, threshold) for key, (op, threshold) in TARGETS.items()}
