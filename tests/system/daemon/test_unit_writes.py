"""The daemon writes only where its systemd unit lets it.

``ProtectSystem=strict`` makes the whole filesystem read-only except the directories the unit names; a write
anywhere else fails on a box (and only there). This test lays the box's paths out under a temporary root
(/etc/atlas-edge/config.yaml, a bundle under /opt, the state directory under /var/lib), runs the daemon as a
process through a full run (start, results, the outbox while the broker is away, deploy, rollback, set-config,
snapshot, SIGHUP, stop) and checks two records against the writable directories parsed from
``systemd/atlas-edge.service``:

* every file created or changed under the temporary root (catches writes from native code: SQLite, OpenCV);
* every write-like operation Python itself performed anywhere (an audit hook in the daemon's process: ``open``
  for writing, rename, remove, mkdir, rmtree, ``sqlite3.connect``), so a write outside the root is seen too.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import Dict, List, Set, Tuple

import pytest
import yaml

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from tests.conftest import MqttProbe, wait_for
from tests.support.daemon_rig import new_version, outbox_rows
from tests.support.lifecycle_support import NOISE_PROOF_FACTOR
from tests.support.unit_support import ROOT, UNIT, directives, one

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

# systemd.exec(5): where each *Directory= name lives for a system service.
DIRECTORY_ROOTS = {"StateDirectory": "/var/lib", "RuntimeDirectory": "/run", "CacheDirectory": "/var/cache",
                   "LogsDirectory": "/var/log"}
PRIVATE_TMP = ("/tmp", "/var/tmp")  # PrivateTmp=yes: writable, private, emptied at every start
DEVICE = "cam-01"
WAIT_S = 120.0


def writable_dirs(unit_text: str) -> List[str]:
    """The absolute directories the unit makes writable under ProtectSystem=strict."""
    service = directives(unit_text)["Service"]
    assert one(service, "ProtectSystem") == "strict", "the test assumes a read-only file system elsewhere"
    found: List[str] = []
    for value in service.get("ReadWritePaths", []):
        found += [path.lstrip("-+") for path in value.split()]
    for key, base in DIRECTORY_ROOTS.items():
        for value in service.get(key, []):
            found += [os.path.join(base, name) for name in value.split()]
    if service.get("PrivateTmp", ["no"])[-1] in ("yes", "true", "1"):
        found += list(PRIVATE_TMP)
    return sorted(set(found))


def inside(path: str, directories: List[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in directories)


def test_writable_dirs_are_read_from_the_unit():
    with open(UNIT, encoding="utf-8") as handle:
        dirs = writable_dirs(handle.read())
    assert "/var/lib/atlas-edge" in dirs and "/var/log/atlas-edge" in dirs
    assert not inside("/etc/atlas-edge/config.yaml", dirs) and not inside("/opt/atlas-edge/x", dirs)
    service = directives(open(UNIT, encoding="utf-8").read())["Service"]
    assert inside(one(service, "WorkingDirectory"), dirs)  # kernel_meta/ and relative paths land there


# The daemon's process: record write-like operations, then run the CLI. Written with os.write on a raw fd so
# that recording does not itself raise audit events.
LAUNCHER = textwrap.dedent("""
    import os, sys
    log_fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    PATH_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate", "os.symlink",
                   "os.link", "os.utime", "os.chmod", "os.chown", "shutil.copyfile", "shutil.move"}

    def record(path):
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        if isinstance(path, str) and path and path != ":memory:":
            os.write(log_fd, (os.path.abspath(path) + "\\n").encode())

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            if writing:
                record(path)
        elif event in ("os.rename", "os.replace"):
            record(args[0]); record(args[1])
        elif event in PATH_EVENTS:
            record(args[0])
        elif event == "sqlite3.connect":
            record(args[0])

    if hasattr(sys, "addaudithook"):  # Python 3.8+; on 3.7 the file-tree diff alone judges
        sys.addaudithook(hook)
    from agent.cli.main import main
    sys.exit(main(["run", "--config", sys.argv[2]]))
""")


def snapshot_tree(root: str) -> Dict[str, Tuple[int, int, int]]:
    """path -> (inode, size, mtime_ns) of every file and directory under root."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            found[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return found


def changed(before: Dict[str, Tuple[int, int, int]], after: Dict[str, Tuple[int, int, int]]) -> Set[str]:
    """Created or changed paths (a directory changes when an entry is added or removed)."""
    return {path for path, stat in after.items() if before.get(path) != stat} | (set(before) - set(after))


def ctl(broker, *args, timeout=60):
    cmd = [sys.executable, "-m", "agent", "ctl", "--broker", broker.url, DEVICE, *args, "--timeout",
           str(timeout)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30, cwd=ROOT)
    assert result.returncode == 0, "ctl %s: %s%s" % (" ".join(args), result.stdout, result.stderr)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_full_run_writes_only_where_the_unit_lets_it(tmp_path, fresh_broker):
    with open(UNIT, encoding="utf-8") as handle:
        unit = handle.read()
    box = str(tmp_path / "box")
    allowed = [box + d for d in writable_dirs(unit)]
    service = directives(unit)["Service"]
    state = box + "/var/lib/atlas-edge"
    os.makedirs(state)  # systemd creates StateDirectory= before ExecStart
    for directory in writable_dirs(unit):
        os.makedirs(box + directory, exist_ok=True)
    bundle = box + "/opt/atlas-edge/share/demo-bundle"
    shutil.copytree(DEMO_BUNDLE, bundle)
    frames = box + "/opt/atlas-edge/share/frames"
    write_sample_frames(frames, sizes_hw=((240, 320), (480, 640)), seed=5)
    config_path = box + "/etc/atlas-edge/config.yaml"
    os.makedirs(os.path.dirname(config_path))
    with open(config_path, "w", encoding="utf-8") as handle:
        handle.write("# the operator's file: never rewritten by the daemon\n" + yaml.safe_dump({
            "device_id": DEVICE, "device": "cpu-dev", "state_dir": state,
            "model": {"bundle": bundle, "backend": "opencv", "observation_s": 0,
                      "latency_regression": NOISE_PROOF_FACTOR},  # not under test: load must not roll back
            "sources": [{"name": "cam", "uri": frames, "loop": True, "max_fps": 10}],
            "mqtt": {"host": fresh_broker.host, "port": fresh_broker.port, "reconnect_min_s": 0.1,
                     "reconnect_max_s": 0.5},
            "publish": {"telemetry_interval_s": 1.0},
        }))
    # A second version in the store's incoming area, put there the way an operator would (not the daemon).
    source, sha = new_version(tmp_path, os.path.join(state, "bundles"), "1.1.0")
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    audit_log = str(tmp_path / "writes.log")  # outside the box root: the test's, not the daemon's
    before = snapshot_tree(box)

    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", HOME=state, TMPDIR=box + "/tmp")
    env.pop("NOTIFY_SOCKET", None)
    results = MqttProbe(fresh_broker, ["atlas-edge/%s/results/#" % DEVICE])
    log_file = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, str(launcher), audit_log, config_path],
                            cwd=box + one(service, "WorkingDirectory"), env=env, stdout=log_file,
                            stderr=subprocess.STDOUT)
    try:
        assert results.wait(lambda m: len(m) >= 3, timeout=WAIT_S), "no results"
        ctl(fresh_broker, "set-config", "--json", '{"config": {"thresholds": {"conf": 0.3}}}')
        shot = ctl(fresh_broker, "snapshot")
        assert shot["state"] == "succeeded"
        # The broker goes away: results go to the outbox, then are replayed.
        results.close()
        fresh_broker.stop()
        outbox = os.path.join(state, "outbox.sqlite")
        results_like = "atlas-edge/%s/results/%%" % DEVICE  # results only: telemetry is queued too
        assert wait_for(lambda: outbox_rows(outbox, results_like) >= 3, timeout=60), "results did not reach the outbox"
        fresh_broker.start()
        results = MqttProbe(fresh_broker, ["atlas-edge/%s/results/#" % DEVICE])
        assert results.wait(lambda m: any(r.get("historical") for _t, r in m), timeout=WAIT_S)
        deployed = ctl(fresh_broker, "deploy", "--json", json.dumps({"bundle": source, "sha256": sha}), timeout=120)
        assert deployed["state"] == "succeeded"
        assert results.wait(lambda m: m[-1][1]["model"]["version"] == "1.1.0", timeout=WAIT_S)
        rolled = ctl(fresh_broker, "rollback", "--json", '{"reason": "test"}')
        assert rolled["state"] == "succeeded"
        proc.send_signal(signal.SIGHUP)  # re-reads the file, keeps the overrides
        status = ctl(fresh_broker, "status")
        assert status["state"] == "succeeded"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        log_file.close()
        results.close()
    daemon_log = open(tmp_path / "daemon.log").read()
    assert code == 0, daemon_log[-3000:]

    outside_tree = sorted(p for p in changed(before, snapshot_tree(box))
                          if not inside(p, allowed) and p not in _parents(allowed))
    assert outside_tree == [], "files changed outside the unit's writable directories: %s" % outside_tree
    assert "set-config" not in open(config_path).read() and "conf: 0.3" not in open(config_path).read()
    if sys.version_info < (3, 8):
        return  # no audit hooks before Python 3.8: the file-tree diff above is the whole check there
    with open(audit_log, encoding="utf-8") as handle:
        writes = sorted({line.strip() for line in handle if line.strip()})
    assert any(w.startswith(state) for w in writes), "the audit hook saw no write at all"
    outside_audit = [w for w in writes if not inside(os.path.realpath(w), [os.path.realpath(a) for a in allowed])]
    assert outside_audit == [], "writes outside the unit's writable directories: %s" % outside_audit


def _parents(directories: List[str]) -> Set[str]:
    """The directories above the writable ones: the test created them, so their mtime may change."""
    parents = set()
    for directory in directories:
        while True:
            directory = os.path.dirname(directory)
            if not directory or directory == "/":
                break
            parents.add(directory)
    return parents
