"""``atlas-edge demo``: the whole box on embedded defaults, in one command.

Sample frames of several sizes (one is 1920x1080) are generated from the shapes scene generator with known
ground truth, the committed demo bundle is served by the real daemon, results go to a real Mosquitto
(started as a child process unless ``--broker`` is given), and a console view subscribed to that broker
prints what arrives: detections, fps and per-stage latency.
"""

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Tuple

import cv2
import numpy as np

from agent.config.device_config import BACKEND_FORMATS

# Package data: a link to examples/demo-bundle in a checkout, a copy of it in the wheel (read next to this
# module: importlib.resources.files() needs Python 3.9, the box has 3.7).
DEMO_BUNDLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_bundle")
# Sizes a box meets: 1080p and 720p cameras, VGA in both orientations, a square crop.
SAMPLE_SIZES_HW: Tuple[Tuple[int, int], ...] = ((1080, 1920), (720, 1280), (480, 640), (640, 480), (800, 800),
                                                 (1080, 1920))
SAMPLE_SEED = 2026
DEMO_FPS = 5.0
READ_POLL_S = 0.2  # how often the console view's reader looks whether it should stop

log = logging.getLogger(__name__)


def write_sample_frames(directory: str, sizes_hw=SAMPLE_SIZES_HW, seed: int = SAMPLE_SEED) -> List[Dict[str, Any]]:
    """PNG frames plus ``ground_truth.json`` (boxes in pixels, labels) for each; returns the ground truth."""
    from agent.devtools.scenes import SHAPE_LABELS, generate_scene

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    truth = []
    for index, hw in enumerate(sizes_hw):
        image, boxes, classes = generate_scene(rng, hw)
        name = "frame_%03d_%dx%d.png" % (index, hw[1], hw[0])
        cv2.imwrite(os.path.join(directory, name), image)
        truth.append({"name": name, "hw": list(hw), "boxes": np.asarray(boxes).round(2).tolist(),
                      "labels": [SHAPE_LABELS[int(c)] for c in classes]})
    with open(os.path.join(directory, "ground_truth.json"), "w", encoding="utf-8") as handle:
        json.dump(truth, handle, indent=1)
    return truth


class ConsoleView:
    """Subscribes to the device's results through the operator's link (:mod:`agent.fleet.link`) and prints them
    as they come, on a thread of its own: proof that they really went out. LinkError when the broker does not
    take the connection or the subscription."""

    def __init__(self, host: str, port: int, prefix: str, device_id: str) -> None:
        from agent.fleet.link import open_link
        from agent.ops.mqtt_client import new_client
        from agent.protocol.topics import result_topic

        self.received = 0
        self.model: Dict[str, Any] = {}  # the last result's model block (name, version, backend, precision)
        self.lock = threading.Lock()
        client_id = "atlas-edge-demo-view-%d" % os.getpid()
        self.link = open_link([(host, port, False)], lambda tls: new_client(client_id))
        try:
            self.link.subscribe([result_topic(prefix, device_id, "#")])
        except Exception:
            self.link.close()
            raise
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, name="console-view", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        from agent.fleet.link import LinkError

        while not self._stop.is_set():
            try:
                message = self.link.get(READ_POLL_S)
            except LinkError as exc:
                print("console view: %s" % exc, flush=True)
                return
            if message is not None:
                self._show(message.json())

    def _show(self, result: Any) -> None:
        if not isinstance(result, dict):
            return
        with self.lock:
            self.received += 1
            count = self.received
            self.model = result.get("model") or {}
        dets = result.get("detections", [])
        shown = ", ".join("%s %.2f [%d,%d,%d,%d]" % ((d["label"], d["score"]) + tuple(int(v) for v in d["box"]))
                          for d in dets[:4])
        more = " +%d" % (len(dets) - 4) if len(dets) > 4 else ""
        t = result.get("timings_ms", {})
        print("#%-4d %-28s %4dx%-4d -> %d det: %s%s | pre %.1f infer %.1f post %.1f total %.1f ms" % (
            count, result.get("name", result.get("source")), result["image_hw"][1], result["image_hw"][0],
            len(dets), shown, more, t.get("preprocess", 0), t.get("infer", 0), t.get("postprocess", 0),
            t.get("total", 0)), flush=True)

    def wait_for(self, count: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.received >= count:
                    break
            time.sleep(0.02)
        return self.received

    def close(self) -> None:
        self._stop.set()
        self._reader.join(READ_POLL_S * 10)
        self.link.close()


def _parse_broker(url: str) -> Tuple[str, int]:
    from urllib.parse import urlparse

    parsed = urlparse(url if "://" in url else "mqtt://" + url)
    if parsed.scheme not in ("mqtt", "tcp") or not parsed.hostname:
        raise SystemExit("--broker must look like mqtt://HOST:PORT (got %r)" % url)
    return parsed.hostname, parsed.port or 1883


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", metavar="mqtt://HOST:PORT",
                        help="use this broker instead of starting an embedded Mosquitto")
    parser.add_argument("--frames", type=int, default=None, metavar="N",
                        help="stop after N frames (default: run until Ctrl-C)")
    parser.add_argument("--device-id", default="demo", help="device id in topics (default: demo)")
    parser.add_argument("--backend", default=None, choices=tuple(BACKEND_FORMATS),
                        help="inference backend (default: cpu-dev's order: onnxruntime when it imports, int8 "
                             "when the bundle has it; else mslite for a .ms, else mindspore, else opencv); mslite "
                             "converts the bundle first when it has no .ms")
    parser.add_argument("--bundle", default=DEMO_BUNDLE,
                        help="model bundle (default: examples/demo-bundle, shipped in the package)")
    parser.add_argument("--frames-dir", default=None,
                        help="folder of images to serve (default: generated sample frames)")
    parser.add_argument("--max-batch", type=int, default=1, help="dynamic batching: largest batch")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (sample frames, outbox, bundle store) instead of removing it")


def run(args: argparse.Namespace) -> int:
    """Serve in a fresh work directory (sample frames, state: about 22 MB), removed on every way out (the
    end, Ctrl-C, an error) unless ``--keep``."""
    if args.frames is not None and args.frames < 1:
        raise SystemExit("--frames must be >= 1")
    work = tempfile.mkdtemp(prefix="atlas-edge-demo-")
    try:
        return _serve(args, work)
    finally:
        if args.keep:
            print("kept the work directory: %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _with_lite_artifacts(bundle: str, work: str) -> str:
    """``bundle`` when it has a CPU ``.ms``, else a copy in ``work`` converted by ``atlas-edge convert --to ms``
    (MindSpore Lite's converter in this interpreter, or as converters/toolrun.py finds it)."""
    from agent.bundle.manifest import load_manifest
    from agent.bundle.verify import copy_writable

    if any(a.format == "ms" and a.target == "cpu" for a in load_manifest(bundle).artifacts):
        return bundle
    from converters import cli as convert_cli  # host tooling, imported only for this
    from converters import toolrun

    copy = copy_writable(bundle, os.path.join(work, "bundle"))
    env = dict(os.environ)
    if importlib.util.find_spec("mindspore_lite") is not None:
        env.setdefault(toolrun.MSLITE_PYTHON_ENV, sys.executable)
    print("converting %s for MindSpore Lite (atlas-edge convert --to ms --device cpu-dev)" % bundle)
    parser = argparse.ArgumentParser(prog="atlas-edge convert")
    convert_cli.add_arguments(parser)
    status = convert_cli.run(parser.parse_args(["--bundle", copy, "--device", "cpu-dev", "--to", "ms"]), env=env)
    if status != convert_cli.EXIT_OK:
        raise SystemExit("demo --backend mslite: converting the bundle failed (exit %d, above)" % status)
    return copy


def _serve(args: argparse.Namespace, work: str) -> int:
    from agent.config.daemon_config import parse_daemon_config
    from agent.daemon import Daemon
    from agent.devtools.broker import EmbeddedBroker

    bundle = os.path.abspath(args.bundle)
    if args.backend == "mslite":
        bundle = _with_lite_artifacts(bundle, work)
    frames_dir = args.frames_dir or os.path.join(work, "frames")
    if args.frames_dir is None:
        write_sample_frames(frames_dir)
        print("sample frames: %s (%s)" % (frames_dir, ", ".join("%dx%d" % (w, h) for h, w in SAMPLE_SIZES_HW)))
    with contextlib.ExitStack() as cleanup:  # whatever started is stopped, on every way out
        if args.broker:
            host, port = _parse_broker(args.broker)
        else:
            broker = EmbeddedBroker()
            broker.start()
            cleanup.callback(broker.stop)
            host, port = broker.host, broker.port
            print("embedded broker: mosquitto on %s:%d" % (host, port))
        config = parse_daemon_config({
            "device_id": args.device_id,
            "device": "cpu-dev",
            "state_dir": os.path.join(work, "state"),
            "model": {"bundle": bundle, "backend": args.backend, "store": "bundles"},
            # Paced like a camera: a looping folder read flat out would only fill the queue and drop frames.
            "sources": [{"name": "samples", "uri": frames_dir, "loop": True, "max_fps": DEMO_FPS}],
            "mqtt": {"host": host, "port": port},
            "batching": {"max_batch": args.max_batch, "max_wait_ms": 10.0},
            "publish": {"telemetry_interval_s": 5.0},
        }, source="demo defaults")
        from agent.fleet.link import LinkError

        try:
            view = ConsoleView(host, port, config.mqtt.prefix, config.device_id)  # subscribed once it returns
        except LinkError as exc:
            raise SystemExit("demo: the console view cannot follow %s:%d: %s" % (host, port, exc)) from None
        cleanup.callback(view.close)
        daemon = Daemon(config)
        daemon.install_signal_handlers()
        started = time.monotonic()
        code = daemon.run(max_frames=args.frames)
        received = view.wait_for(daemon.loop.published, timeout=10.0)
    elapsed = time.monotonic() - started
    served = daemon.loop
    latency = served.stats.percentiles()
    print("\n%d frames served in %.1fs (%.1f fps); %d results published, %d received over MQTT" % (
        served.stats.frames, elapsed, served.stats.frames / max(elapsed, 1e-6), served.published, received))
    if view.model:  # the results' own model block: what ran, as a subscriber sees it
        print("  served on %s at precision %s" % (view.model.get("backend"), view.model.get("precision")))
    for stage in ("queue", "preprocess", "wait_backend", "infer", "postprocess", "publish", "total"):
        if stage in latency:
            p = latency[stage]
            print("  %-12s p50 %7.2f ms   p90 %7.2f ms   p99 %7.2f ms" % (stage, p["p50"], p["p90"], p["p99"]))
    if received < daemon.loop.published:
        print("WARNING: %d results were not seen by the console view" % (daemon.loop.published - received))
        return 1
    return code
