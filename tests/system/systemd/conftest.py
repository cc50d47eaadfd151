"""The session's box: a booted Debian 12 container with Mosquitto, atlas-edge installed by install.sh.

What a box without internet does: a wheelhouse built on the host (the atlas-edge wheel from this tree and the
box's dependencies for CPython 3.11, Debian 12's python3), copied in, then ``install.sh --wheels DIR
--instance 1 --instance 2``. The broker requires passwords (``allow_anonymous false``): a daemon that serves
got its password through LoadCredential=. ``make test-systemd`` runs this; it skips, saying why, where it
cannot (not root, no systemd-nspawn/debootstrap/nsenter).
"""

import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List

import pytest

from tests.system.systemd.container import Container, ContainerError, rootfs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CACHE_DIR = os.environ.get("ATLAS_EDGE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "atlas-edge"))
PREFIX = "atlas-edge"
OPERATOR_PASSWORD = "operator-secret"
# device_id -> (config dir, unit): the single unit and two instances of the per-NPU template
BOXES = {"box-main": ("/etc/atlas-edge", "atlas-edge.service"),
         "box-npu1": ("/etc/atlas-edge/1", "atlas-edge@1.service"),
         "box-npu2": ("/etc/atlas-edge/2", "atlas-edge@2.service")}
STATE = {"box-main": "/var/lib/atlas-edge", "box-npu1": "/var/lib/atlas-edge/1", "box-npu2": "/var/lib/atlas-edge/2"}


def missing_tools() -> List[str]:
    reasons = []
    if os.geteuid() != 0:
        reasons.append("root (systemd-nspawn boots containers as root only)")
    for tool in ("systemd-nspawn", "debootstrap", "nsenter"):
        if shutil.which(tool) is None:
            reasons.append(tool)
    return reasons


def source_copy(target: str) -> str:
    """The tree as git sees it (tracked and new files, not ignored ones): what a fresh clone would hold."""
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True, timeout=60).stdout
    os.makedirs(target)
    subprocess.run(["tar", "--null", "-T", "-", "-cf", "-"], cwd=REPO_ROOT, input=listed,
                   stdout=open(os.path.join(target, ".src.tar"), "wb"), check=True, timeout=120)
    subprocess.run(["tar", "-xf", ".src.tar"], cwd=target, check=True, timeout=120)
    os.remove(os.path.join(target, ".src.tar"))
    return target


def wheelhouse(src: str, target: str) -> str:
    """The atlas-edge wheel built from ``src`` and the wheels of its box dependencies (cached in CACHE_DIR)."""
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(pip + ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", target, src], check=True,
                   capture_output=True, timeout=600)
    [wheel] = glob.glob(os.path.join(target, "atlas_edge-*.whl"))
    deps = os.path.join(CACHE_DIR, "wheelhouse-cp%d%d" % sys.version_info[:2])
    offline = pip + ["download", "-q", "--dest", deps, "--no-index", "--find-links", deps, wheel + "[edge]"]
    if subprocess.run(offline, capture_output=True, timeout=600).returncode != 0:  # first run: fill the cache
        subprocess.run(pip + ["download", "-q", "--dest", deps, wheel + "[edge]"], check=True, capture_output=True,
                       timeout=900)
    for path in glob.glob(os.path.join(deps, "*.whl")):
        if not os.path.basename(path).startswith("atlas_edge-"):
            shutil.copy(path, target)
    return target


def daemon_config(device_id: str, conf: float = 0.3) -> str:
    return json.dumps({
        "device_id": device_id, "device": "cpu-dev", "state_dir": STATE[device_id],
        "model": {"bundle": "/srv/demo-bundle", "backend": "opencv"},
        "sources": [{"name": "cam", "uri": "/srv/frames", "max_fps": 4, "loop": True}],
        "mqtt": {"host": "127.0.0.1", "port": 1883, "username": device_id, "password": "cred:mqtt-password"},
        "thresholds": {"conf": conf},
    }, indent=1) + "\n"


class Box:
    """The container with the helpers the tests share: results from the broker, commands through ctl."""

    def __init__(self, container: Container, src: str, wheels: str) -> None:
        self.c = container
        self.src = src
        self.wheels = wheels

    def results(self, device_id: str, count: int, timeout: int = 60) -> List[Dict]:
        """The next ``count`` results ``device_id`` publishes, as the broker delivers them."""
        out = self.c.run("mosquitto_sub -h 127.0.0.1 -u operator -P %s -t %s -C %d -W %d" % (
            OPERATOR_PASSWORD, shlex.quote("%s/%s/results/#" % (PREFIX, device_id)), count, timeout),
            timeout=timeout + 30)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def retained_status(self, device_id: str) -> Dict:
        out = self.c.run("mosquitto_sub -h 127.0.0.1 -u operator -P %s -t %s -C 1 -W 10" % (
            OPERATOR_PASSWORD, shlex.quote("%s/%s/status" % (PREFIX, device_id))), timeout=40)
        return json.loads(out)

    def ctl(self, device_id: str, verb: str, payload: Dict) -> Dict:
        out = self.c.run("OPERATOR=%s /opt/atlas-edge/venv/bin/atlas-edge ctl --broker mqtt://127.0.0.1:1883 "
                         "--username operator --password env:OPERATOR %s %s --json %s" % (
                             OPERATOR_PASSWORD, device_id, verb, shlex.quote(json.dumps(payload))), timeout=90)
        return json.loads(out.strip().splitlines()[-1])

    def install(self) -> str:
        """install.sh as a box without internet runs it: from the wheelhouse, both instances prepared."""
        return self.c.run("/root/atlas-edge-src/systemd/install.sh --wheels /root/wheelhouse --instance 1 "
                          "--instance 2 2>&1", timeout=600)


@pytest.fixture(scope="session")
def box() -> Iterator[Box]:
    missing = missing_tools()
    if missing:
        pytest.skip("the real-systemd lane needs %s (make test-systemd installs the tools as root)"
                    % ", ".join(missing))
    work = tempfile.mkdtemp(prefix="atlas-edge-systemd-", dir="/var/tmp")
    container = None
    try:
        src = source_copy(os.path.join(work, "src"))
        wheels = wheelhouse(src, os.path.join(work, "wheelhouse"))
        container = Container(rootfs(CACHE_DIR), work)
        os.remove(container.root + BROKER_AT_BOOT)  # _broker starts it, once its config and passwords are written
        shutil.copytree(src, container.root + "/root/atlas-edge-src", symlinks=True)
        shutil.copytree(wheels, container.root + "/root/wheelhouse")
        shutil.copytree(os.path.join(src, "examples", "demo-bundle"), container.root + "/srv/demo-bundle")
        from agent.cli.demo import write_sample_frames

        write_sample_frames(container.root + "/srv/frames", sizes_hw=((480, 640), (256, 256), (640, 480)))
        container.boot()
        _broker(container)
        box = Box(container, src, wheels)
        box.install()
        for device_id, (etc, _unit) in BOXES.items():
            container.write(etc + "/config.yaml", daemon_config(device_id))
            container.write(etc + "/mqtt-password", device_id + "-secret\n", mode=0o600)
        yield box
    except ContainerError as exc:
        pytest.fail(str(exc))
    finally:
        if container is not None:
            container.poweroff()
        shutil.rmtree(work, ignore_errors=True)


# The whole config, not a drop-in beside Debian's: no pid file (systemd tracks the PID of a Type=notify unit) and
# no log file, only what the box's broker needs; the broker is started once, after its passwords are written.
BROKER_CONF = ("listener 1883 127.0.0.1\nallow_anonymous false\npassword_file /etc/mosquitto/passwd\n"
               "persistence false\nlog_dest stderr\n")
BROKER_AT_BOOT = "/etc/systemd/system/multi-user.target.wants/mosquitto.service"


def _broker(container: Container) -> None:
    """The container's Mosquitto with passwords required: one account per box and the operator."""
    container.write("/etc/mosquitto/mosquitto.conf", BROKER_CONF)
    commands = ["mosquitto_passwd -b -c /etc/mosquitto/passwd operator %s" % OPERATOR_PASSWORD]
    commands += ["mosquitto_passwd -b /etc/mosquitto/passwd %s %s-secret" % (d, d) for d in BOXES]
    commands += ["chown mosquitto:mosquitto /etc/mosquitto/passwd", "chmod 0600 /etc/mosquitto/passwd"]
    container.run(" && ".join(commands))
    container.run_status("systemctl start mosquitto.service")
    container.wait_active("mosquitto.service")
