"""The systemd unit, its environment example and install.sh.

``systemd-analyze verify`` checks the unit as systemd itself reads it. verify also checks that ExecStart's
binary exists and is executable, and /opt/atlas-edge/venv/bin/atlas-edge does not exist on a test machine, so
the test verifies a copy of the unit whose ExecStart points to a stand-in script in a temporary directory;
every other line is verified as shipped. verify exits 0 even for unknown keys or bad values (it warns and
ignores them), so the test also requires it to print nothing, and a control case proves a typo is seen.
"""

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from typing import Dict

import pytest
import yaml

from agent.config.daemon_config import WatchdogConfig
from agent.config.device_config import load_device_config
from tests.support.unit_support import ROOT, UNIT, directives, one

TEMPLATE = os.path.join(ROOT, "systemd", "atlas-edge@.service")
ENV_EXAMPLE = os.path.join(ROOT, "systemd", "atlas-edge.env.example")
INSTALL = os.path.join(ROOT, "systemd", "install.sh")
EXEC_START = "/opt/atlas-edge/venv/bin/atlas-edge"


def unit_text() -> str:
    with open(UNIT, encoding="utf-8") as handle:
        return handle.read()


def mib(value: str) -> int:
    match = re.fullmatch(r"(\d+)([MG])", value)
    assert match, value
    return int(match.group(1)) * (1024 if match.group(2) == "G" else 1)


def test_service_directives():
    service = directives(unit_text())["Service"]
    expected = {
        "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30", "Restart": "on-failure",
        "RestartSec": "5", "User": "atlas-edge", "SupplementaryGroups": "HwHiAiUser",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "ReadWritePaths": "/var/lib/atlas-edge", "StateDirectory": "atlas-edge",
        "EnvironmentFile": "-/etc/atlas-edge/atlas-edge.env",
        "LoadCredential": "mqtt-password:/etc/atlas-edge/mqtt-password",
        "ExecReload": "/bin/sh -c 'kill -HUP $MAINPID'",
        "ExecStart": EXEC_START + " run --config /etc/atlas-edge/config.yaml",
        "DevicePolicy": "closed",
    }
    assert {key: one(service, key) for key in expected} == expected
    assert "DynamicUser" not in service
    devices = service["DeviceAllow"]
    for node in ("/dev/davinci0", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"):
        assert node + " rw" in devices
    assert mib(one(service, "MemoryHigh")) < mib(one(service, "MemoryMax"))


def test_unit_agrees_with_the_watchdog_defaults():
    """The daemon's own bounds must fit inside systemd's, or systemd acts first and less gracefully."""
    service = directives(unit_text())["Service"]
    defaults = WatchdogConfig()
    watchdog_sec = float(one(service, "WatchdogSec"))
    assert defaults.inference_deadline_s < watchdog_sec / 2  # a hang is reported before systemd kills
    assert defaults.shutdown_timeout_s < float(one(service, "TimeoutStopSec"))  # drain + flush fits the stop
    # The shipped limits are sized for an Atlas 200 DK: the watchdog's soft limit (the device budget, or 90%
    # of MemoryMax if lower) must come before MemoryHigh's reclaim pressure, which comes before the OOM kill.
    budget = load_device_config("atlas-200dk").memory_budget_mb
    soft = min(budget, 0.9 * mib(one(service, "MemoryMax")))
    assert soft < mib(one(service, "MemoryHigh")) < mib(one(service, "MemoryMax"))


def verify_copy(tmp_path, text: str) -> subprocess.CompletedProcess:
    stand_in = tmp_path / "atlas-edge"
    stand_in.write_text("#!/bin/sh\n# stand-in for the venv's atlas-edge entry point (for verify)\n")
    stand_in.chmod(0o755)
    unit = tmp_path / "atlas-edge.service"
    unit.write_text(text.replace(EXEC_START, str(stand_in)))
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True,
                          text=True, timeout=60)


needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="needs systemd-analyze (apt-get install -y systemd)")


@needs_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    done = verify_copy(tmp_path, unit_text())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "" and done.stderr.strip() == "", done.stdout + done.stderr


@needs_analyze
@pytest.mark.parametrize("broken, complaint", [
    (("WatchdogSec=30", "WatchdogSecs=30"), "Unknown key"),
    (("Type=notify", "Type=notify-me"), "Failed to parse service type"),
])
def test_systemd_analyze_verify_sees_a_typo(tmp_path, broken, complaint):
    done = verify_copy(tmp_path, unit_text().replace(*broken))
    assert complaint in done.stdout + done.stderr


def env_lines() -> Dict[str, str]:
    values = {}
    with open(ENV_EXAMPLE, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", line), "line %d: not KEY=value: %r" % (
                number, line)
            key, _, value = line.partition("=")
            values[key] = value
    return values


# what differs between atlas-edge@N and atlas-edge: the instance's config, state, logs, credential and NPU
PER_INSTANCE = {"Description", "ExecStart", "WorkingDirectory", "LoadCredential", "StateDirectory",
                "LogsDirectory", "ReadWritePaths", "DeviceAllow", "Environment"}


def test_the_per_npu_template_is_the_unit_with_its_own_config_state_credential_and_device():
    with open(TEMPLATE, encoding="utf-8") as handle:
        template = directives(handle.read())
    single = directives(unit_text())
    assert template.keys() == single.keys()
    for section in single:
        assert template[section].keys() == single[section].keys(), section
        for key, values in single[section].items():
            if key not in PER_INSTANCE:
                assert template[section][key] == values, key
    service = template["Service"]
    assert one(service, "ExecStart").endswith("run --config /etc/atlas-edge/%i/config.yaml")
    assert one(service, "StateDirectory") == "atlas-edge/%i" and one(service, "LoadCredential") == (
        "mqtt-password:/etc/atlas-edge/%i/mqtt-password")
    assert "/dev/davinci%i rw" in service["DeviceAllow"] and "/dev/davinci0 rw" not in service["DeviceAllow"]
    assert "ASCEND_RT_VISIBLE_DEVICES=%i" in service["Environment"]


def exposure(unit: str) -> float:
    """``systemd-analyze security --offline=yes``'s overall exposure (0 = locked down, 10 = none)."""
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", unit], capture_output=True, text=True,
                          timeout=60)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert found, done.stdout[-2000:] + done.stderr[-2000:]
    return float(found.group(1))


def _analyze_offline() -> bool:
    if shutil.which("systemd-analyze") is None:
        return False
    version = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True, timeout=30).stdout
    found = re.match(r"systemd (\d+)", version)
    return bool(found) and int(found.group(1)) >= 250  # --offline= arrived in systemd 250


@pytest.mark.skipif(not _analyze_offline(), reason="needs systemd-analyze >= 250 (security --offline=yes)")
@pytest.mark.parametrize("unit", [UNIT, TEMPLATE], ids=["unit", "template"])
def test_unit_exposure_is_at_most_2(unit):
    assert exposure(unit) <= 2.0
    service = directives(open(unit, encoding="utf-8").read())["Service"]
    assert not [d for d in service["DeviceAllow"] if d.startswith("/dev/upgrade")]  # firmware writes: not ours


@pytest.mark.skipif(not _analyze_offline(), reason="needs systemd-analyze >= 250 (security --offline=yes)")
def test_exposure_sees_a_weaker_unit(tmp_path):
    weaker = tmp_path / "atlas-edge.service"
    weaker.write_text(re.sub(r"^(CapabilityBoundingSet|SystemCallFilter|RestrictAddressFamilies)=.*$", "",
                             unit_text(), flags=re.M))
    assert exposure(str(weaker)) > exposure(UNIT) + 1.0


def test_the_ip_allow_example_denies_by_default():
    with open(os.path.join(ROOT, "systemd", "ip-allow.conf.example"), encoding="utf-8") as handle:
        service = directives(handle.read())["Service"]
    assert service["IPAddressDeny"] == ["any"] and "localhost" in service["IPAddressAllow"]


def test_env_example_has_the_cann_variables_spelled_out():
    env = env_lines()
    for key in ("ASCEND_HOME", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "LD_LIBRARY_PATH", "PYTHONPATH"):
        assert env.get(key), key
    # EnvironmentFile= does no expansion: a "$" would reach the process literally
    assert not [k for k, v in env.items() if "$" in v]
    libs = env["LD_LIBRARY_PATH"].split(":")
    assert "/usr/local/Ascend/driver/lib64" in libs
    assert env["ASCEND_TOOLKIT_HOME"] + "/lib64" in libs
    assert libs.index("/usr/local/Ascend/driver/lib64") < libs.index(env["ASCEND_TOOLKIT_HOME"] + "/lib64")
    assert env["ASCEND_TOOLKIT_HOME"] + "/python/site-packages" in env["PYTHONPATH"].split(":")
    assert env["ASCEND_OPP_PATH"] == env["ASCEND_TOOLKIT_HOME"] + "/opp"
    assert env["ASCEND_PROCESS_LOG_PATH"].startswith("/var/log/atlas-edge/")  # the unit's LogsDirectory=


def run_install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", INSTALL, *args], capture_output=True, text=True, timeout=120)


def test_install_script_parses():
    assert subprocess.run(["bash", "-n", INSTALL], capture_output=True, timeout=30).returncode == 0


def test_install_dry_run_prints_every_step_and_changes_nothing():
    watched = ["/etc/atlas-edge", "/opt/atlas-edge", "/etc/systemd/system/atlas-edge.service"]
    before = {path: os.path.exists(path) for path in watched}
    done = run_install("--dry-run", "--device", "atlas-200dk")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "dry run: nothing is changed" in out
    assert re.search(r"^(\+ useradd --system .* atlas-edge|= user atlas-edge exists)$", out, re.M)
    assert "+ python3 -m venv /opt/atlas-edge/venv" in out or "= venv /opt/atlas-edge/venv exists" in out
    shipped = os.path.join(ROOT, "systemd", "atlas-edge.service")
    assert "+ install -m 0644 %s /etc/systemd/system/atlas-edge.service" % shipped in out
    assert "MemoryHigh=1920M" in out and "MemoryMax=2304M" in out  # atlas-200dk: budget 1536 x 1.25, x 1.5
    assert "4. systemctl start atlas-edge" in out.split("== done. Next:")[1]
    assert "+ systemctl daemon-reload" in out
    assert {path: os.path.exists(path) for path in watched} == before


def test_install_into_a_root_twice_is_idempotent_and_keeps_operator_files(tmp_path):
    target = tmp_path / "image"
    first = run_install("--root", str(target), "--no-venv", "--device", "atlas-200i-dk-a2", "--instance", "1")
    assert first.returncode == 0, first.stderr

    def tree() -> Dict[str, bytes]:
        found = {}
        for folder, _, files in os.walk(target):
            for name in files:
                path = os.path.join(folder, name)
                with open(path, "rb") as handle:
                    mode = os.stat(path).st_mode & 0o777
                    found["%s %o" % (os.path.relpath(path, target), mode)] = handle.read()
        return found

    installed = tree()
    assert installed["etc/atlas-edge/mqtt-password 600"] == b""  # empty and root-only
    assert "etc/atlas-edge/atlas-edge.env 600" in installed
    with open(UNIT, "rb") as handle:
        assert installed["etc/systemd/system/atlas-edge.service 644"] == handle.read()
    with open(TEMPLATE, "rb") as handle:
        assert installed["etc/systemd/system/atlas-edge@.service 644"] == handle.read()
    for unit in ("atlas-edge.service", "atlas-edge@.service"):
        memory = installed["etc/systemd/system/%s.d/memory.conf 644" % unit].decode()
        assert "MemoryHigh=1280M" in memory and "MemoryMax=1536M" in memory  # budget 1024
    assert installed["etc/atlas-edge/1/mqtt-password 600"] == b""
    assert stat.S_IMODE(os.stat(str(target / "etc/atlas-edge")).st_mode) == 0o750  # configs may hold secrets
    assert stat.S_IMODE(os.stat(str(target / "etc/atlas-edge/1")).st_mode) == 0o750

    (target / "etc/atlas-edge/atlas-edge.env").write_text("ASCEND_HOME=/opt/ascend\n")
    (target / "etc/atlas-edge/mqtt-password").write_text("s3cret\n")
    second = run_install("--root", str(target), "--no-venv", "--device", "atlas-200i-dk-a2", "--instance", "1")
    assert second.returncode == 0, second.stderr
    again = tree()
    assert again["etc/atlas-edge/atlas-edge.env 600"] == b"ASCEND_HOME=/opt/ascend\n"
    assert again["etc/atlas-edge/mqtt-password 600"] == b"s3cret\n"
    unchanged = {k: v for k, v in again.items() if "atlas-edge.env " not in k and "mqtt-password" not in k}
    assert unchanged == {k: v for k, v in installed.items() if k in unchanged} and len(unchanged) == len(
        [k for k in installed if "atlas-edge.env " not in k and "mqtt-password" not in k])


@pytest.mark.parametrize("args, message", [
    (["--device", "atlas-9000"], "no device config"),
    (["--wheels", "/nonexistent-wheels"], "is not a directory"),
    (["--frobnicate"], "unknown option --frobnicate"),
    (["--instance", "first"], "--instance needs an NPU number"),
])
def test_install_rejects_bad_options_before_doing_anything(args, message):
    done = run_install("--dry-run", *args)
    assert done.returncode == 2 and message in done.stderr
    assert "+ " not in done.stdout


# --- start-up failures that no restart can fix -------------------------------------------------------------

def run_daemon_cli(config_path, notify_path):
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(config_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["bad-config", "missing-bundle", "unknown-device"])
def test_unfixable_start_failures_exit_with_a_status_the_unit_does_not_restart(tmp_path, case):
    from agent.cli.main import EXIT_CANNOT_START
    from agent.daemon import EXIT_RESTART

    service = directives(unit_text())["Service"]
    prevented = one(service, "RestartPreventExitStatus").split()
    assert str(EXIT_CANNOT_START) in prevented and one(service, "Restart") == "on-failure"
    assert str(EXIT_RESTART) not in prevented  # a watchdog-requested restart must still come back

    config = {"device_id": "cam-01", "state_dir": "state", "model": {"bundle": "no-such-bundle",
                                                                     "backend": "opencv"},
              "mqtt": {"host": "127.0.0.1", "port": 1}}
    if case == "bad-config":
        config["batching"] = {"max_batch": 0}
    if case == "unknown-device":
        config["device"] = "no-such-box"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    directory = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")  # AF_UNIX paths are limited to 108 bytes
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        notify.bind(os.path.join(directory, "notify"))
        notify.settimeout(5.0)
        result = run_daemon_cli(path, os.path.join(directory, "notify"))
        status = notify.recv(4096).decode()
    finally:
        notify.close()
        shutil.rmtree(directory)
    assert result.returncode == EXIT_CANNOT_START, result.stderr[-2000:]
    why = {"bad-config": "batching.max_batch", "missing-bundle": "no-such-bundle",
           "unknown-device": "no device config 'no-such-box' (known: atlas-200dk, "}[case]
    assert result.stderr.count("cannot start") == 1 and why in result.stderr
    assert "Traceback" not in result.stderr
    assert status.startswith("STATUS=cannot start: ") and why in status
