"""A real daemon for the tests that run one: its config, its process, ctl against it, a new bundle version in
its store (what it publishes is read with ``conftest.MqttProbe``). A helper module (not a test module): the
daemon tests import it instead of importing each other.
"""

import json
import os
import shutil
import sqlite3
import subprocess
import sys

import yaml

from agent.cli.demo import DEMO_BUNDLE
from tests.conftest import wait_for

SIZES = ((1080, 1920), (720, 1280), (480, 640), (640, 480), (800, 800), (540, 960), (1080, 1920), (600, 600))


def write_config(tmp_path, broker, frames_dir, loop=False, bundle=DEMO_BUNDLE, device="cpu-dev", **extra):
    config = {
        "device_id": "e2e",
        "device": device,
        "state_dir": str(tmp_path / "state"),
        "model": {"bundle": str(bundle), "observation_s": 0},
        "sources": [{"name": "cam", "uri": str(frames_dir), "loop": loop}],
        "mqtt": {"host": broker.host, "port": broker.port, "reconnect_min_s": 0.1, "reconnect_max_s": 1.0},
        "batching": {"max_batch": 2, "max_wait_ms": 5},
        "publish": {"telemetry_interval_s": 1.0},
        **extra,
    }
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def start_daemon(config_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", config_path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def stop_daemons(procs, timeout=30):
    """SIGTERM every daemon, then wait for each; one that does not stop in ``timeout`` is killed, the others
    still stop (a fixture's teardown: each test module that starts several daemons ends them so)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def iou(a, b):
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def ctl(broker, *args, timeout=60):
    cmd = [sys.executable, "-m", "agent", "ctl", "--broker", "mqtt://%s:%d" % (broker.host, broker.port), "e2e",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)


def wait_status(broker, deadline_s=90):
    """Ask for status until the daemon answers (it may still be starting, or its token bucket refilling)."""
    answers = []

    def answered():
        answers.append(ctl(broker, "status", "--timeout", "5", timeout=5))
        return answers[-1].returncode == 0

    if not wait_for(answered, timeout=deadline_s, interval=0.5):
        raise AssertionError("daemon never answered status: %s" % (answers[-1].stdout + answers[-1].stderr)[-500:])
    return answers[-1]


def new_version(tmp_path, store, version):
    """A copy of the demo bundle with another version, placed in the store's incoming/ area."""
    from agent.bundle.verify import sha256_file, write_manifest

    target = os.path.join(store, "incoming", "shapes-%s" % version)
    shutil.copytree(DEMO_BUNDLE, target)
    manifest = json.load(open(os.path.join(target, "manifest.json")))
    manifest["version"] = version
    write_manifest(target, manifest)
    return "incoming/shapes-%s" % version, sha256_file(os.path.join(target, "manifest.json"))


def outbox_rows(path, topic_like="%"):
    """Messages in the daemon's outbox whose topic matches ``topic_like`` (SQL LIKE); 0 before it exists."""
    if not os.path.exists(path):
        return 0
    conn = sqlite3.connect(path, timeout=5)
    try:
        return conn.execute("SELECT COUNT(*) FROM messages WHERE topic LIKE ?", (topic_like,)).fetchone()[0]
    except sqlite3.OperationalError:  # the daemon has not created the table yet
        return 0
    finally:
        conn.close()
