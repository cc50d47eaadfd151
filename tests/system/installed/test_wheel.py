"""The box as a user installs it: the wheel in a fresh venv outside the checkout, run from another directory.

``make test-wheel`` (tests/system/installed/lane.sh) builds the wheel from the tree, installs it into a new venv under
/tmp (Python 3.11, and the box's 3.7), copies tests/ next to it and runs this file and some of the box's tests
there, so ``agent`` can only come from site-packages. Collected only when named (tests/conftest.py); outside
that lane every test here skips, saying so.
"""

import csv
import glob
import os
import signal
import subprocess
import sys

import pytest
import yaml
from conftest import WAIT_S, MqttProbe, wait_for

import agent
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames

INSTALLED = "site-packages" in agent.__file__
IN_LANE = os.environ.get("ATLAS_EDGE_WHEEL_LANE") == "1"  # set by lane.sh: there, not installed is a failure
pytestmark = pytest.mark.skipif(not (INSTALLED or IN_LANE), reason="runs against the installed wheel: make test-wheel")
ATLAS_EDGE = os.path.join(os.path.dirname(sys.executable), "atlas-edge")  # the venv's console script
EXIT_CANNOT_START = 78


def atlas_edge(*args: str, cwd: str, timeout: float = 120) -> "subprocess.CompletedProcess[str]":
    return subprocess.run([ATLAS_EDGE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=""))


def test_what_runs_is_the_installed_package_not_a_checkout():
    assert os.path.isfile(ATLAS_EDGE)
    for module in ("agent", "agent.config.device_config", "agent.cli.demo"):
        __import__(module)
        assert "site-packages" in sys.modules[module].__file__, sys.modules[module].__file__
    assert os.path.isfile(os.path.join(DEMO_BUNDLE, "manifest.json")) and "site-packages" in DEMO_BUNDLE
    assert not any(os.path.isfile(os.path.join(p or ".", "pyproject.toml")) for p in sys.path)  # no checkout
    with pytest.raises(ImportError):
        __import__("benchmarks")  # not installed under a generic top-level name


def installed_dist_info() -> str:
    """atlas-edge's dist-info beside the installed ``agent`` (no importlib.metadata on the box's Python 3.7)."""
    site = os.path.dirname(os.path.dirname(agent.__file__))
    found = glob.glob(os.path.join(site, "atlas_edge-*.dist-info"))
    assert len(found) == 1, (site, found)
    return found[0]


def test_the_wheel_installs_agent_quant_and_converters_and_no_other_top_level_name():
    """The design card's layout: nothing else in site-packages under a generic name (byom, benchmarks...)."""
    dist_info = installed_dist_info()
    with open(os.path.join(dist_info, "top_level.txt"), encoding="utf-8") as handle:
        declared = {line.strip() for line in handle if line.strip()}
    with open(os.path.join(dist_info, "RECORD"), encoding="utf-8", newline="") as handle:
        paths = [row[0] for row in csv.reader(handle) if row]
    # console scripts lie outside site-packages (../../../bin/atlas-edge); the dist-info is the metadata itself
    installed = {p.split("/", 1)[0] for p in paths if not p.startswith("..")} - {os.path.basename(dist_info)}
    assert declared == {"agent", "quant", "converters"}, declared
    assert installed == {"agent", "quant", "converters"}, sorted(installed)


def test_demo_shows_three_results(tmp_path):
    done = atlas_edge("demo", "--frames", "3", cwd=str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "3 results published, 3 received over MQTT" in done.stdout
    assert "Traceback" not in done.stderr


def test_onnxruntime_installed_without_its_dependencies_serves_the_demo_bundle():
    """lane.sh installs onnxruntime as a box does (``--no-deps``): numpy is all inference needs, and cpu-dev
    serves the demo bundle on it, golden self-test included."""
    import importlib.util

    from agent.bundle.verify import verify_bundle
    from agent.config.device_config import load_device_config
    from agent.pipeline.backends import backend_for
    from agent.pipeline.model import load_model

    assert importlib.util.find_spec("onnxruntime") is not None, "lane.sh installs onnxruntime"
    assert [m for m in ("google.protobuf", "sympy", "flatbuffers", "coloredlogs")
            if importlib.util.find_spec(m.split(".")[0]) is not None] == []  # installed with --no-deps
    bundle = verify_bundle(DEMO_BUNDLE)
    device = load_device_config("cpu-dev")
    assert backend_for(device, bundle.manifest) == "onnxruntime"
    model = load_model(bundle, device, "onnxruntime")
    try:
        assert model.golden_check().passed and model.describe()["backend"] == "onnxruntime"
    finally:
        model.close()


def write_config(site, broker=None, device="cpu-dev") -> str:
    config = {"device_id": "wheel", "device": device, "state_dir": "state",
              "model": {"bundle": DEMO_BUNDLE, "backend": "opencv"},
              "sources": [{"name": "cam", "uri": "frames"}],  # relative: to this file, not the working dir
              "mqtt": {"host": broker.host if broker else "127.0.0.1", "port": broker.port if broker else 1}}
    if device != "cpu-dev":
        del config["model"]["backend"]  # the device's own backend
    path = os.path.join(site, "daemon.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle)
    return path


def test_run_serves_every_frame_of_a_relative_folder_from_another_directory(tmp_path, mosquitto):
    site = tmp_path / "site"
    truth = write_sample_frames(str(site / "frames"), sizes_hw=((480, 640), (256, 256), (640, 480), (300, 500)))
    config = write_config(str(site), mosquitto)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = MqttProbe(mosquitto, ["atlas-edge/wheel/results/#"])
    daemon = subprocess.Popen([ATLAS_EDGE, "run", "--config", config], cwd=str(elsewhere), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=""))
    try:
        assert wait_for(lambda: probe.count("atlas-edge/wheel/results/") >= len(truth), timeout=4 * WAIT_S)
        names = sorted(r["name"] for r in probe.on("atlas-edge/wheel/results/cam"))
        assert names == sorted(t["name"] for t in truth)
    finally:
        daemon.send_signal(signal.SIGTERM)
        output = daemon.communicate(timeout=60)[0]
        probe.close()
    assert daemon.returncode == 0, output[-3000:]
    assert os.path.isdir(str(site / "state")) and not os.listdir(str(elsewhere))  # state by the config file


def test_an_unknown_device_exits_78_naming_the_known_ones(tmp_path):
    done = atlas_edge("run", "--config", write_config(str(tmp_path), device="no-such-box"), cwd="/")
    assert done.returncode == EXIT_CANNOT_START, done.stderr
    assert "no device config 'no-such-box' (known: atlas-200dk, " in done.stderr and "cpu-dev" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_atlas_200dk_config_here_fails_saying_the_runtime_is_missing(tmp_path):
    done = atlas_edge("run", "--config", write_config(str(tmp_path), device="atlas-200dk"), cwd="/")
    assert done.returncode == EXIT_CANNOT_START, done.stderr
    assert "cannot start" in done.stderr and "Traceback" not in done.stderr
    reason = done.stderr.split("cannot start", 1)[1]  # the one line systemd's status and the journal show
    assert "backend acl (device atlas-200dk) cannot run on this machine: module 'acl' not found" in reason, reason
    assert "Ascend CANN toolkit" in reason


def test_validate_bundle_verify_ctl_and_fleet_run_from_the_wheel(tmp_path):
    device_file = os.path.join(os.path.dirname(agent.__file__), "config", "device_configs", "atlas-200dk.yaml")
    validate = atlas_edge("validate", device_file, cwd=str(tmp_path))
    assert validate.returncode == 0 and "Ascend310" in validate.stdout, validate.stderr
    verify = atlas_edge("bundle", "verify", DEMO_BUNDLE, "--device", "cpu-dev", "--backend", "opencv",
                        "--run-golden", cwd=str(tmp_path), timeout=300)
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
    for command in ("ctl", "fleet"):
        helped = atlas_edge(command, "--help", cwd=str(tmp_path))
        assert helped.returncode == 0 and "usage: atlas-edge" in helped.stdout, helped.stderr
    bench = atlas_edge("bench", "--quick", cwd=str(tmp_path))
    assert bench.returncode == 2 and "runs from a source checkout" in bench.stderr


def test_wheelhouse_from_the_wheel_names_the_options_for_the_pins_and_creates_nothing(tmp_path):
    """Installed, there is no checkout to read constraints/ from: a clear error, not a guess in site-packages."""
    out = tmp_path / "wheelhouse"
    done = atlas_edge("wheelhouse", "--python", "3.9", "--platform", "aarch64", "--out", str(out), cwd=str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "wheelhouse: no checkout here: pass --constraints (and --wheel or --source)" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not out.exists()
