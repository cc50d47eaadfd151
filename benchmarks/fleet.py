"""``fleet`` section: a rollout to 100 simulated boxes on one real Mosquitto, timed and counted.

The boxes are real daemons in this process (``benchmarks/fleet_sim.py``: transport, dispatcher, model manager,
the stand-in backend); the operator is ``atlas-edge fleet rollout`` in its own process, as a user runs it, so
its peak RSS is its own. A probe subscribed to the prefix counts every message the broker delivered during
the rollout, by kind. Wall time is dominated by the observation window times the number of waves: it is
reported with both, not compared to anything.
"""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict

from benchmarks.harness import RunContext, target

log = logging.getLogger(__name__)

BOXES = 100  # the simulated fleet
OBSERVATION_S = 2.0  # each box's observation window: short enough to run, long enough to judge 10+ batches
CANARY, WAVES = 5, 3
ROLLOUT_TIMEOUT_S = 600.0
RSS_POLL_S = 0.1
PREFIX = "bench-fleet"
TARGETS = {"confirmed_fraction": (">=", 1.0)}
ROLLOUT_KINDS = ("cmd", "ack", "status", "events")  # the rollout's own traffic; results and telemetry are serving


def _peak_rss_mb(pid: int) -> float:
    """VmHWM of a live process (its peak RSS so far) in MiB, or 0 once it is gone."""
    try:
        with open("/proc/%d/status" % pid, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _current_rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


class _Counter:
    """Counts the messages under the prefix by kind (status, cmd, ack, events, results, telemetry)."""

    def __init__(self, host: str, port: int) -> None:
        import paho.mqtt.client as mqtt

        self.counts: Dict[str, int] = {}
        self.counting = False
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-fleet-counter")
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(PREFIX + "/#", qos=1)
        self.client.on_subscribe = lambda c, u, mid, codes, p: self._ready.set()
        self.client.on_message = self._count
        self.client.connect(host, port)
        self.client.loop_start()
        if not self._ready.wait(10.0):
            raise RuntimeError("bench fleet: the counting probe could not subscribe")

    def _count(self, client: Any, userdata: Any, message: Any) -> None:
        if not self.counting or message.retain:  # retained replays at subscribe time are not traffic
            return
        parts = message.topic.split("/")
        kind = parts[3] if parts[1] == "group" and len(parts) > 3 else (parts[2] if len(parts) > 2 else "?")
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def run(context: RunContext) -> Dict[str, Any]:
    from agent.bundle.verify import sha256_file
    from agent.devtools.broker import EmbeddedBroker
    from benchmarks.fleet_sim import BundleServer, SimulatedFleet, build_bundles

    root = os.path.join(context.work_dir, "fleet")
    v1, archive, sha = build_bundles(os.path.join(root, "bundles"))
    server = BundleServer(os.path.dirname(archive))
    broker = EmbeddedBroker().start()
    rss_before = _current_rss_mb()
    fleet = SimulatedFleet(os.path.join(root, "boxes"), broker.host, broker.port, v1, BOXES,
                           observation_s=OBSERVATION_S, prefix=PREFIX)
    counter = None
    try:
        started = time.monotonic()
        fleet.start()
        start_s = time.monotonic() - started
        boxes_rss = _current_rss_mb() - rss_before
        counter = _Counter(broker.host, broker.port)
        time.sleep(1.0)  # every box has served a few batches: a latency baseline for its window
        report_path = os.path.join(root, "report.json")
        command = [sys.executable, "-m", "agent", "fleet", "rollout", "--broker", broker.url, "--prefix", PREFIX,
                   "--group", "sim", "--bundle", server.url(os.path.basename(archive)), "--sha256", sha,
                   "--archive-sha256", sha256_file(archive),
                   "--canary", str(CANARY), "--waves", str(WAVES), "--max-failure-rate", "0.05",
                   "--confirm-timeout", "300", "--state-dir", os.path.join(root, "rollouts"),
                   "--report", report_path]
        env = dict(os.environ, PYTHONPATH=context.root)
        counter.counting = True
        began = time.monotonic()
        process = subprocess.Popen(command, env=env, cwd=context.root, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE)
        operator_peak = 0.0
        while process.poll() is None and time.monotonic() - began < ROLLOUT_TIMEOUT_S:
            operator_peak = max(operator_peak, _peak_rss_mb(process.pid))
            time.sleep(RSS_POLL_S)
        if process.poll() is None:
            process.kill()
        _out, err = process.communicate(timeout=30)
        wall_s = time.monotonic() - began
        time.sleep(0.5)  # the last acks and status still in flight to the counter
        counter.counting = False
        if process.returncode not in (0, 1, 5):  # completed, aborted, partial: a report in each case
            raise RuntimeError("fleet rollout exited %s: %s" % (process.returncode, err.decode()[-1000:]))
        with open(report_path, encoding="utf-8") as handle:
            report = json.load(handle)
        counts = dict(counter.counts)
    finally:
        if counter is not None:
            counter.close()
        fleet.close()
        broker.close()
        server.close()
    total = sum(counts.values())
    confirmed = report["counts"].get("confirmed", 0)
    confirm_s = sorted(b["confirm_s"] for b in report["boxes"] if b["confirm_s"] is not None)
    log.info("fleet: %d boxes, rollout %.1f s, %.1f msgs/box, operator peak RSS %.0f MiB",
             BOXES, wall_s, total / BOXES, operator_peak)
    return {
        "boxes": BOXES,
        "observation_s": OBSERVATION_S,
        "canary": CANARY,
        "waves": len(report["waves"]),
        "rollout_wall_s": round(wall_s, 2),
        "rollout_engine_s": report["wall_s"],
        "confirmed_fraction": confirmed / BOXES,
        "outcomes": report["counts"],
        "box_confirm_s_median": confirm_s[len(confirm_s) // 2] if confirm_s else None,
        "msgs_per_box": round(total / BOXES, 2),
        "msgs_per_box_by_kind": {k: round(v / BOXES, 2) for k, v in sorted(counts.items())},
        "rollout_msgs_per_box": round(sum(counts.get(k, 0) for k in ROLLOUT_KINDS) / BOXES, 2),
        "operator_messages": report.get("broker_messages"),
        "operator_peak_rss_mb": round(operator_peak, 1),
        "simulated_boxes_rss_mb": round(boxes_rss, 1),
        "simulated_box_start_s": round(start_s, 2),
        "environment": {"boxes_process": "one Python process, %d daemons, one serving thread each" % BOXES,
                        "operator_process": "python -m agent fleet rollout", "broker": "one mosquitto",
                        "backend": "FleetStandinBackend (OpenCV ONNX inference, no faults)",
                        "frame_hz_per_box": fleet.frame_hz, "cpus": os.cpu_count()},
    }


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {key: target(section.get(key), op, threshold) for key, (op, threshold) in TARGETS.items()}
