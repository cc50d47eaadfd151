"""One daemon run of the aarch64 lane, the same on both sides: x86 (the host venv) and aarch64 (the root's venv).

A Mosquitto of the machine's own (Debian's arm64 package inside the root), the real daemon (``python -m agent run``)
serving a folder of frames once with a bundle at one precision on onnxruntime, and every result read back over
MQTT. Writes a JSON report: the results by frame name, the daemon's output (its golden self-test's numbers when it
refuses the bundle), and what the CPU offered onnxruntime. Runs on the box's Python (3.9 in the lane) with the box's
dependencies only; a script, not a test module.
"""

import argparse
import json
import os
import platform
import signal
import struct
import subprocess
import sys
import threading
import time

import yaml

EMULATED_INFERENCE_DEADLINE_S = 300.0

AT_HWCAP, AT_HWCAP2 = 16, 26
# Linux's arm64 hwcap bits (arch/arm64/include/uapi/asm/hwcap.h) that decide onnxruntime's int8 kernels (MLAS):
# asimddp (UDOT/SDOT), i8mm (SMMLA/UMMLA), sve; the rest for the record.
HWCAP = {0: "fp", 1: "asimd", 3: "aes", 4: "pmull", 5: "sha1", 6: "sha2", 7: "crc32", 8: "atomics", 9: "fphp",
         10: "asimdhp", 12: "asimdrdm", 15: "lrcpc", 16: "dcpop", 20: "asimddp", 22: "sve", 23: "asimdfhm"}
HWCAP2 = {1: "sve2", 9: "svei8mm", 13: "i8mm", 14: "bf16"}


def cpu_features() -> dict:
    """The CPU features a process sees (the auxiliary vector qemu-user gives it; /proc/cpuinfo is the host's)."""
    if platform.machine() != "aarch64":
        return {"machine": platform.machine()}
    with open("/proc/self/auxv", "rb") as handle:
        data = handle.read()
    values = dict(struct.unpack("<QQ", data[i:i + 16]) for i in range(0, len(data) - 15, 16))
    features = [name for bit, name in sorted(HWCAP.items()) if values.get(AT_HWCAP, 0) >> bit & 1]
    features += [name for bit, name in sorted(HWCAP2.items()) if values.get(AT_HWCAP2, 0) >> bit & 1]
    if "i8mm" in features:
        kernels = "I8MM (SMMLA/UMMLA)"
    elif "asimddp" in features:
        kernels = "dot product (UDOT/SDOT)"
    else:
        kernels = "NEON only (no dot product)"
    return {"machine": "aarch64", "features": features, "int8_kernels": kernels,
            "qemu_cpu": os.environ.get("QEMU_CPU", "")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--precision", required=True, choices=("int8", "float"))
    parser.add_argument("--frames", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--conf", type=float, default=0.25)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()

    from importlib.metadata import version  # not onnxruntime itself: the daemon imports it, a second costs 1 s emulated

    import paho.mqtt.client as mqtt

    from agent.devtools.broker import EmbeddedBroker

    frames = sorted(n for n in os.listdir(args.frames) if n.endswith(".png"))
    os.makedirs(args.work, exist_ok=True)
    report = {"cpu": cpu_features(), "onnxruntime": version("onnxruntime"), "python": platform.python_version(),
              "precision": args.precision, "frames": len(frames), "results": {}}
    started = time.monotonic()
    with EmbeddedBroker() as broker:
        config = {
            "device_id": "lane", "device": "cpu-dev", "state_dir": os.path.join(args.work, "state"),
            "model": {"bundle": os.path.abspath(args.bundle), "backend": "onnxruntime",
                      "precision": args.precision, "observation_s": 0},
            "sources": [{"name": "cam", "uri": os.path.abspath(args.frames), "loop": False}],
            "mqtt": {"host": broker.host, "port": broker.port, "reconnect_min_s": 0.1, "reconnect_max_s": 1.0},
            "batching": {"max_batch": 1, "max_wait_ms": 5},
            "thresholds": {"conf": args.conf},
            # An emulated Arm core is many times slower than a real one: one 640x640 int8 call took 11-14 s under
            # qemu-user on a loaded 2-core machine (a clean-clone run under stress-ng), past the default 10 s
            # hang deadline, and the watchdog restarted the daemon. The lane judges outputs, not speed.
            "watchdog": {"inference_deadline_s": EMULATED_INFERENCE_DEADLINE_S},
        }
        config_path = os.path.join(args.work, "daemon.yaml")
        with open(config_path, "w") as handle:
            yaml.safe_dump(config, handle)
        results = {}
        arrived = threading.Event()
        subscribed = threading.Event()

        def on_message(client, userdata, message):
            payload = json.loads(message.payload)
            results[payload.get("name") or str(payload["frame_id"])] = payload
            if len(results) >= len(frames):
                arrived.set()

        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="lane-probe")
        client.on_message = on_message
        client.on_connect = lambda c, u, f, rc, p: (c.subscribe("atlas-edge/lane/results/#", qos=1),
                                                    subscribed.set())
        client.connect(broker.host, broker.port)
        client.loop_start()
        subscribed.wait(30)
        log_path = os.path.join(args.work, "daemon.log")
        with open(log_path, "w") as log:
            daemon = subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", config_path],
                                      stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            deadline = time.monotonic() + args.timeout
            while not arrived.is_set() and daemon.poll() is None and time.monotonic() < deadline:
                arrived.wait(0.5)
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(60)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        client.loop_stop()
        client.disconnect()
    with open(log_path) as handle:
        output = handle.read()
    report.update(results=results, exit=daemon.returncode, seconds=round(time.monotonic() - started, 1),
                  output_tail=output[-6000:], golden=[ln for ln in output.splitlines() if "golden" in ln][-8:],
                  served=len(results) == len(frames))
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    return 0 if report["served"] else 1


if __name__ == "__main__":
    sys.exit(main())
