"""Start-up: seconds from process start to ``READY=1``, the moment systemd considers the daemon serving.

The daemon runs as systemd would run it: ``python -m agent run --config FILE`` in its own process, with
``NOTIFY_SOCKET`` pointing at an AF_UNIX datagram socket this benchmark binds, and a local Mosquitto. The
clock starts just before the process is spawned and stops when the datagram carrying ``READY=1`` arrives (the
daemon sends it after verifying, loading, warming up and self-testing the model). Each run starts from an
empty state directory, as a first boot after installation does (the bundle is copied into the slot store);
with more than one run, a restart on the existing state is measured too.

For scale, the interpreter's own start and (full runs) ``import mindspore`` are timed the same way.
"""

import importlib.util
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import yaml

from benchmarks import lite_lane
from benchmarks.harness import RunContext, summarize
from benchmarks.workload import DEFAULT_DEVICE, backend_available, bench_device

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # generous: a loaded CI box may take tens of seconds to import MindSpore
STOP_TIMEOUT_S = 30.0  # SIGTERM -> flush -> exit
DATAGRAM_BYTES = 4096
LOG_TAIL_CHARS = 3000
HEADLINE_BACKEND = "mindspore"  # cpu-dev's preferred backend


class StartupError(RuntimeError):
    """The daemon exited or stayed silent before READY=1; the message carries its log tail."""


def _write_configs(
    directory: str,
    bundle_dir: str,
    backend: str,
    broker: Any,
    threads: int,
    device_name: str = DEFAULT_DEVICE,
) -> str:
    """A device config (with pinned threads) and a daemon config; returns the daemon config's path."""
    from agent.config.schema import to_dict

    devices = os.path.join(directory, "devices")
    os.makedirs(devices, exist_ok=True)
    device = bench_device(threads, device_name)
    device_path = os.path.join(devices, device.name + ".yaml")  # the stem must equal the device name
    with open(device_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(to_dict(device), handle, sort_keys=False)
    config = {
        "device_id": "bench-startup",
        "device": device_path,
        "state_dir": os.path.join(directory, "state"),
        "model": {"bundle": bundle_dir, "backend": backend, "observation_s": 0},
        "sources": [],
        "mqtt": {"host": broker.host, "port": broker.port},
        "log_level": "WARNING",
    }
    config_path = os.path.join(directory, "daemon.yaml")
    with open(config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle, sort_keys=False)
    return config_path


def _log_tail(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()[-LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"


def _stop(process: "subprocess.Popen[bytes]") -> Optional[int]:
    from agent._util.process import terminate

    return terminate(process, STOP_TIMEOUT_S, "daemon")


def time_to_ready(config_path: str, root: str, directory: str) -> Dict[str, Any]:
    """Spawn the daemon with our notify socket; seconds until READY=1, and its exit code after SIGTERM."""
    socket_path = os.path.join(directory, "notify.sock")
    if os.path.exists(socket_path):
        os.remove(socket_path)
    log_path = os.path.join(directory, "daemon.log")
    env = dict(
        os.environ,
        NOTIFY_SOCKET=socket_path,
        PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, open(log_path, "ab") as daemon_log:
        sock.bind(socket_path)
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", config_path],
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=daemon_log,
            stderr=subprocess.STDOUT,
        )
        try:
            ready_s = _await_ready(sock, process, started, log_path)
        finally:
            exit_code = _stop(process)
    return {"seconds_to_ready": ready_s, "exit_code_after_sigterm": exit_code}


def _await_ready(
    sock: socket.socket, process: "subprocess.Popen[bytes]", started: float, log_path: str
) -> float:
    messages: List[str] = []
    while True:
        remaining = started + READY_TIMEOUT_S - time.monotonic()
        if remaining <= 0:
            raise StartupError(
                "no READY=1 within %.0f s (got %s):\n%s" % (READY_TIMEOUT_S, messages, _log_tail(log_path))
            )
        if process.poll() is not None:
            raise StartupError(
                "the daemon exited with code %s before READY=1:\n%s"
                % (process.returncode, _log_tail(log_path))
            )
        sock.settimeout(min(remaining, 0.5))  # wake up to notice a daemon that died
        try:
            data = sock.recv(DATAGRAM_BYTES)
        except socket.timeout:
            continue
        arrived = time.monotonic()
        text = data.decode("utf-8", "replace")
        messages.append(text.split("\n", 1)[0])
        if "READY=1" in text.split("\n"):
            return arrived - started


def time_command(code: str, root: str) -> float:
    """Seconds for ``python -c CODE`` to run and exit (the interpreter's share of start-up)."""
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        check=True,
        timeout=READY_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    return time.monotonic() - started


def run(context: RunContext) -> Dict[str, Any]:
    from agent.devtools.broker import EmbeddedBroker

    profile = context.profile
    per_backend: Dict[str, Any] = {}
    broker = EmbeddedBroker()
    broker.start()
    try:
        for backend in context.backends:
            missing = backend_available(backend)
            if missing:
                per_backend[backend] = {"skipped": missing}
                continue
            fresh: List[float] = []
            restart: List[float] = []
            exit_codes = []
            for index in range(profile.startup_runs):
                directory = os.path.join(context.work_dir, "startup-%s-%d" % (backend, index))
                config_path = _write_configs(
                    directory, context.bundle_dir, backend, broker, context.threads, context.device
                )
                first = time_to_ready(config_path, context.root, directory)
                fresh.append(first["seconds_to_ready"])
                exit_codes.append(first["exit_code_after_sigterm"])
                if profile.startup_runs > 1:
                    again = time_to_ready(config_path, context.root, directory)
                    restart.append(again["seconds_to_ready"])
                    exit_codes.append(again["exit_code_after_sigterm"])
            per_backend[backend] = {
                "seconds_to_ready": summarize(fresh)["median"],
                "first_start_s": summarize(fresh),
                "exit_codes_after_sigterm": exit_codes,
            }
            if restart:
                per_backend[backend]["restart_s"] = summarize(restart)
            log.info("startup %s: %.2f s to READY=1", backend, per_backend[backend]["seconds_to_ready"])
    finally:
        broker.close()
    if lite_lane.delegated(context):  # mslite runs in the Lite venv's Python 3.7 (benchmarks/lite_lane.py)
        per_backend[lite_lane.BACKEND] = lite_lane.measure("startup", context)
    scale = {"python_interpreter_s": time_command("pass", context.root)}
    if profile.name != "quick" and importlib.util.find_spec("mindspore") is not None:  # not in the Lite lane
        scale["import_mindspore_s"] = time_command("import mindspore", context.root)
    ran = [b for b, v in per_backend.items() if "seconds_to_ready" in v]
    headline = HEADLINE_BACKEND if HEADLINE_BACKEND in ran else (ran[0] if ran else None)
    return {
        "seconds_to_ready": per_backend[headline]["seconds_to_ready"] if headline else None,
        "headline_backend": headline,
        "backends": per_backend,
        "for_scale": scale,
    }


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {}
