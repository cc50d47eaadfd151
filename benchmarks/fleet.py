"""``fleet`` section: a rollout to 100 simulated boxes on one real Mosquitto, then to 1,000 light ones, timed.

The boxes are real daemons in this process (``benchmarks/fleet_sim.py``: transport, dispatcher, model manager,
the stand-in backend); the operator is ``atlas-edge fleet rollout`` in its own process, as a user runs it, so
its peak RSS is its own. A probe subscribed to the prefix counts every message the broker delivered during
the rollout, by kind. Wall time is dominated by the observation window times the number of waves: it is
reported with both, not compared to anything. ``light``: the same operator against 1,000 protocol-only boxes
(``tests/support/fleet_boxes.py``), for the operator's own costs at ten times the size, state bytes written included.
``light_gated``: the same 1,000 boxes in a gated rollout (``--shadow-frames``, docs/shadow.md), each answering its
shadow command with a final report :data:`LIGHT_SHADOW_S` later; ``gate_decision_s_max`` is, over the waves, the
time from the last shadow report of a wave to the first deploy of that wave (target <= 60 s), beside the operator's
peak RSS (target <= 64 MiB).
"""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Tuple

from benchmarks.harness import RunContext, target

log = logging.getLogger(__name__)

BOXES = 100  # the simulated fleet
OBSERVATION_S = 2.0  # each box's observation window: short enough to run, long enough to judge 10+ batches
CANARY, WAVES = 5, 3
ROLLOUT_TIMEOUT_S = 600.0
RSS_POLL_S = 0.1
PREFIX = "bench-fleet"
TARGETS = {"confirmed_fraction": (">=", 1.0)}
GATED_TARGETS = {"gate_decision_s_max": ("<=", 60.0), "operator_peak_rss_mb": ("<=", 64.0),
                 "confirmed_fraction": (">=", 1.0)}
LIGHT_SHADOW_S = 1.0  # a simulated box's shadow run, command to final report
LIGHT_SHADOW_FRAMES = 50
LIGHT_BOXES = 1000  # protocol-only boxes (tests/support/fleet_boxes.py): the operator's side at ten times the size
LIGHT_OBSERVATION_S = 2.0
LIGHT_CANARY = 10
LIGHT_PREFIX = "bench-fleet-light"
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

    def __init__(self, host: str, port: int, prefix: str = PREFIX) -> None:
        import paho.mqtt.client as mqtt

        self.counts: Dict[str, int] = {}
        self.counting = False
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-fleet-counter-" + prefix)
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(prefix + "/#", qos=1)
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


def _operator(context: RunContext, command: List[str], report_path: str) -> Tuple[float, float, Dict[str, Any]]:
    """Run ``fleet rollout`` as its own process: wall time, its peak RSS (polled VmHWM) and its report."""
    env = dict(os.environ, PYTHONPATH=context.root)
    began = time.monotonic()
    # Progress (a line per box) goes to a file: a pipe read only at the end fills up and stalls the operator.
    with open(report_path + ".progress", "w+b") as progress:
        process = subprocess.Popen(command, env=env, cwd=context.root, stdout=subprocess.DEVNULL, stderr=progress)
        operator_peak = 0.0
        while process.poll() is None and time.monotonic() - began < ROLLOUT_TIMEOUT_S:
            operator_peak = max(operator_peak, _peak_rss_mb(process.pid))
            time.sleep(RSS_POLL_S)
        if process.poll() is None:
            process.kill()
        process.wait(30)
        wall_s = time.monotonic() - began
        progress.seek(0)
        err = progress.read()
    if process.returncode not in (0, 1, 5):  # completed, aborted, partial: a report in each case
        raise RuntimeError("fleet rollout exited %s: %s" % (process.returncode, err.decode()[-1000:]))
    with open(report_path, encoding="utf-8") as handle:
        return wall_s, operator_peak, json.load(handle)


def run_light(context: RunContext, broker: Any, gated: bool = False) -> Dict[str, Any]:
    """A rollout to LIGHT_BOXES protocol-only simulated boxes (``tests/support/fleet_boxes.py``, one thread for all).

    The boxes answer as the protocol says (accepted, in_progress, succeeded, status pending, then confirmed
    after LIGHT_OBSERVATION_S) without serving anything, so the figures are the operator's and the broker's:
    rollout time, broker messages per box, the operator's peak RSS and what it wrote to its state files.
    ``gated``: with ``--shadow-frames``, each box first answering its shadow command (see the module doc).
    """
    from tests.support.fleet_boxes import BoxFleet, model

    name = "fleet-light-gated" if gated else "fleet-light"
    prefix = LIGHT_PREFIX + ("-gated" if gated else "")
    root = os.path.join(context.work_dir, name)
    os.makedirs(root, exist_ok=True)
    sha = "2" * 64
    fleet = BoxFleet(broker.host, broker.port, prefix, {"shapes-2.tar.gz": model("2.0.0", sha)},
                     observation_s=LIGHT_OBSERVATION_S, deploy_s=0.5, shadow_s=LIGHT_SHADOW_S)
    for index in range(LIGHT_BOXES):
        fleet.add("box-%04d" % index)
    counter = None
    try:
        fleet.start(timeout=120.0)
        counter = _Counter(broker.host, broker.port, prefix)
        report_path = os.path.join(root, "report.json")
        command = [sys.executable, "-m", "agent", "fleet", "rollout", "--broker", broker.url, "--prefix",
                   prefix, "--group", "sim", "--bundle", "shapes-2.tar.gz", "--sha256", sha, "--canary",
                   str(LIGHT_CANARY), "--waves", str(WAVES), "--state-dir", os.path.join(root, "rollouts"),
                   "--report", report_path]
        if gated:
            command += ["--shadow-frames", str(LIGHT_SHADOW_FRAMES)]
        counter.counting = True
        wall_s, operator_peak, report = _operator(context, command, report_path)
        time.sleep(0.5)
        counter.counting = False
        counts = dict(counter.counts)
        decisions = _gate_decisions(fleet, report["waves"]) if gated else []
    finally:
        if counter is not None:
            counter.close()
        fleet.close()
    log.info("%s: %d boxes, rollout %.1f s, operator peak RSS %.0f MiB, state %d bytes%s", name,
             LIGHT_BOXES, wall_s, operator_peak, report["state_bytes_written"],
             ", gate decided within %.2f s of a wave's last report" % max(decisions) if decisions else "")
    result = {
        "boxes": LIGHT_BOXES, "observation_s": LIGHT_OBSERVATION_S, "canary": LIGHT_CANARY,
        "waves": len(report["waves"]), "rollout_wall_s": round(wall_s, 2), "rollout_engine_s": report["wall_s"],
        "confirmed_fraction": report["counts"].get("confirmed", 0) / LIGHT_BOXES, "outcomes": report["counts"],
        "msgs_per_box": round(sum(counts.values()) / LIGHT_BOXES, 2),
        "msgs_per_box_by_kind": {k: round(v / LIGHT_BOXES, 2) for k, v in sorted(counts.items())},
        "operator_messages": report.get("broker_messages"),
        "operator_peak_rss_mb": round(operator_peak, 1),
        "state_bytes_written": report["state_bytes_written"],
        "environment": {"boxes_process": "one thread, one epoll loop, %d paho clients" % LIGHT_BOXES,
                        "operator_process": "python -m agent fleet rollout", "broker": "one mosquitto"},
    }
    if gated:
        result.update(shadow_frames=LIGHT_SHADOW_FRAMES, shadow_s=LIGHT_SHADOW_S,
                      gate_decision_s_max=round(max(decisions), 3) if decisions else None,
                      gate_decision_s_per_wave=[round(d, 3) for d in decisions])
    return result


def _gate_decisions(fleet: Any, waves: List[List[str]]) -> List[float]:
    """Per wave: from the last shadow report of its boxes to the first deploy one of them received (seconds)."""
    boxes = {box.device: box for box in fleet.boxes}
    decisions = []
    for wave in waves:
        reported = [boxes[d].shadow_reported_at for d in wave if boxes[d].shadow_reported_at is not None]
        deployed = [boxes[d].deploy_received_at for d in wave if boxes[d].deploy_received_at is not None]
        if reported and deployed:
            decisions.append(min(deployed) - max(reported))
    return decisions


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
        counter.counting = True
        wall_s, operator_peak, report = _operator(context, command, report_path)
        time.sleep(0.5)  # the last acks and status still in flight to the counter
        counter.counting = False
        counts = dict(counter.counts)
        counter.close()
        counter = None
        frame_hz = fleet.frame_hz
        fleet.close()  # the daemons stop before the light fleet starts: its figures are its own
        fleet = None
        light = run_light(context, broker)
        light_gated = run_light(context, broker, gated=True)
    finally:
        if counter is not None:
            counter.close()
        if fleet is not None:
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
        "light": light,
        "light_gated": light_gated,
        "environment": {"boxes_process": "one Python process, %d daemons, one serving thread each" % BOXES,
                        "operator_process": "python -m agent fleet rollout", "broker": "one mosquitto",
                        "backend": "FleetStandinBackend (OpenCV ONNX inference, no faults)",
                        "frame_hz_per_box": frame_hz, "cpus": os.cpu_count()},
    }


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    found = {key: target(section.get(key), op, threshold) for key, (op, threshold) in TARGETS.items()}
    gated = section.get("light_gated") or {}
    found.update({"light_gated.%s" % key: target(gated.get(key), op, threshold)
                  for key, (op, threshold) in GATED_TARGETS.items()})
    return found
