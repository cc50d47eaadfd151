"""A simulated fleet: many real daemons in one process, each a box with its own state directory, on a real broker.

Each box is :class:`agent.daemon.Daemon` itself: its MQTT transport and outbox, its command dispatcher with the
request record, its model manager (A/B slots, fetch, verify, golden self-test, observation window, rollback)
and its serving loop. What is simulated:

- **Frames**: no camera; one feeder thread puts a small synthetic frame into every box's queue at ``frame_hz``.
- **The backend**: :class:`FleetStandinBackend`, a STAND-IN registered under the name ``opencv`` while the
  fleet runs. It is OpenCV's real ONNX inference plus faults injected per box, for one bundle: ``golden``
  (outputs shifted, so that bundle's golden self-test fails at deploy) or ``slow`` (every call sleeps
  :data:`SLOW_S`, so the observation window rolls it back for latency). Boxes without a fault are untouched.
- **The bundles**: :func:`build_bundles` writes a tiny real ONNX classifier (Flatten, Gemm) with a golden case
  computed by numpy, as version 1 (served at first start) and version 2 (served over HTTP as a .tar.gz by
  :class:`BundleServer`, the way a fleet fetches a rollout's bundle).

Used by ``tests/system/fleet/test_fleet.py`` (about 20 boxes) and the ``fleet`` benchmark section (100 boxes).
"""

import functools
import http.server
import logging
import os
import queue
import resource
import tarfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.bundle.manifest import MANIFEST
from agent.bundle.verify import sha256_file, write_manifest
from agent.config.daemon_config import parse_daemon_config
from agent.daemon import Daemon
from agent.pipeline import backends
from agent.pipeline.backends.opencv_backend import OpenCvBackend
from agent.pipeline.sources import Frame

log = logging.getLogger(__name__)

TIER = 16  # input side: the smallest model that still goes through letterbox, backend and golden check
CLASSES = ("a", "b", "c")
BUNDLE_NAME = "fleet-standin-classifier"
# Every stand-in inference takes at least this long (an accelerator's order for a small model). Bare, the tiny
# network infers in ~0.02 ms, where one millisecond of scheduling noise on shared cores is a 50x "regression";
# with a floor the baseline is stable and the latency rule judges the model, not the machine.
INFER_FLOOR_S = 0.003
LATENCY_FACTOR = 20.0  # the boxes' model.latency_regression: noise stays well below it (about 60 ms)
SLOW_S = 0.25  # a 'slow' box's extra time per inference: above the floor x LATENCY_FACTOR by four times
FRAME_SHAPE = (24, 32, 3)  # a small BGR frame: letterboxed to TIER like any camera frame
DEFAULT_FRAME_HZ = 10.0  # per box: the window judges latency on 10 batches, so a 1 s window sees them
GOLDEN_SHIFT = 1.0  # added to a 'golden' box's outputs: far beyond the bundle's tolerance
QUEUE_SIZE = 4  # frames per box queue: a box that falls behind drops old frames, as a camera would
SOURCE = "sim"
GOLDEN, SLOW = "golden", "slow"


# --- bundles ---------------------------------------------------------------------------------------------

def _onnx_model(path: str, weights: np.ndarray, bias: np.ndarray) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Flatten", ["x"], ["flat"], axis=1),
         helper.make_node("Gemm", ["flat", "w", "b"], ["logits"], transB=1)],
        "fleet_standin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, TIER, TIER])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, len(CLASSES)])],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # readable by the OpenCV builds in use (newer IRs are refused by some)
    onnx.save(model, path)


def build_bundle(root: str, version: str, seed: int = 5) -> str:
    """A real bundle: ONNX classifier, manifest with hashes, a golden case whose expected output numpy made."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(0, 0.05, size=(len(CLASSES), 3 * TIER * TIER)).astype(np.float32)
    bias = rng.normal(0, 0.1, size=(len(CLASSES),)).astype(np.float32)
    os.makedirs(os.path.join(root, "golden"), exist_ok=True)
    name = "model_%dx%d.onnx" % (TIER, TIER)
    _onnx_model(os.path.join(root, name), weights, bias)
    image = rng.integers(0, 256, size=(TIER, TIER, 3), dtype=np.uint8)
    # The manifest's default preprocessing written out independently: BGR->RGB, /255, HWC->CHW.
    x = (image[:, :, ::-1].astype(np.float32) / 255.0).transpose(2, 0, 1)[None]
    expected = (x.reshape(1, -1) @ weights.T + bias).astype(np.float32)
    np.save(os.path.join(root, "golden", "case0.npy"), image)
    np.save(os.path.join(root, "golden", "case0.%s.npy" % name), expected)
    write_manifest(root, {
        "name": BUNDLE_NAME, "version": version, "created": "2026-01-01T00:00:00Z", "task": "classify",
        "labels": list(CLASSES), "input": {"name": "x", "tiers": [[TIER, TIER]]},
        "artifacts": [{"file": name, "format": "onnx", "target": "cpu", "tier": [TIER, TIER], "sha256": "",
                       "size": 0}],
        "golden": {"atol": 1e-4, "rtol": 1e-4, "cases": [
            {"image": "golden/case0.npy", "tier": [TIER, TIER], "expected": {name: "golden/case0.%s.npy" % name}}]},
    })
    return root


def manifest_sha(root: str) -> str:
    return sha256_file(os.path.join(root, MANIFEST))


def build_bundles(root: str) -> Tuple[str, str, str]:
    """(version 1 directory, version 2 .tar.gz, version 2 manifest sha256) under ``root``."""
    v1 = build_bundle(os.path.join(root, "fleet-1.0.0"), "1.0.0")
    v2 = build_bundle(os.path.join(root, "fleet-2.0.0"), "2.0.0")
    archive = os.path.join(root, "fleet-2.0.0.tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(v2, arcname="fleet-2.0.0")
    return v1, archive, manifest_sha(v2)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("bundle server: " + format, *args)


class BundleServer:
    """Serves a directory over HTTP on 127.0.0.1 (a stand-in for the fleet's artifact server).

    ``PORTS``: the ports of every bundle server this process started; a simulated box's fetch policy allows
    exactly those (``fetch.ports``), so start the server before the fleet.
    """

    PORTS: List[int] = []

    def __init__(self, directory: str) -> None:
        handler = functools.partial(_QuietHandler, directory=directory)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        BundleServer.PORTS.append(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, name="bundle-server", daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return "http://127.0.0.1:%d/%s" % (self.server.server_address[1], name)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the stand-in backend --------------------------------------------------------------------------------

class FleetStandinBackend(OpenCvBackend):
    """STAND-IN for the simulation, not a runtime: OpenCV inference plus faults injected per box and bundle.

    ``FAULTS`` maps a box's state directory to (fault, manifest sha256): an artifact loaded under that
    directory from the bundle with that manifest gets the fault; everything else is plain OpenCV.
    """

    FAULTS: Dict[str, Tuple[str, str]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault: Optional[str] = None
        for root, (fault, sha) in self.FAULTS.items():
            if self.artifact_path.startswith(root + os.sep):
                manifest = os.path.join(os.path.dirname(self.artifact_path), MANIFEST)
                if os.path.isfile(manifest) and sha256_file(manifest) == sha:
                    self.fault = fault

    def _infer(self, batch: np.ndarray) -> List[np.ndarray]:
        started = time.perf_counter()
        outputs = super()._infer(batch)
        if self.fault == GOLDEN:
            outputs = [out + GOLDEN_SHIFT for out in outputs]
        time.sleep(max(0.0, INFER_FLOOR_S - (time.perf_counter() - started)) + (SLOW_S if self.fault == SLOW else 0.0))
        return outputs


# --- boxes and the fleet ---------------------------------------------------------------------------------

class SimBox:
    """One box: a real Daemon on its own state dir, served by a thread; deploys counted on the box side."""

    def __init__(self, root: str, device_id: str, host: str, port: int, bundle: str, groups: Sequence[str],
                 observation_s: float, prefix: str, hosts: Sequence[str] = (), result_hz: float = 0.2,
                 commands: Optional[Dict[str, Any]] = None) -> None:
        self.device_id = device_id
        self.state_dir = os.path.join(root, device_id)
        self.config = parse_daemon_config({
            "device_id": device_id, "state_dir": self.state_dir, "device": "cpu-dev",
            "model": {"bundle": bundle, "backend": "opencv", "observation_s": observation_s,
                      "latency_regression": LATENCY_FACTOR},
            # the BundleServers on loopback
            "fetch": {"schemes": ["http"], "hosts": ["127.0.0.1"], "ports": sorted(set(BundleServer.PORTS)) or [80]},
            "mqtt": {"host": host, "port": port, "hosts": list(hosts), "prefix": prefix, "groups": list(groups),
                     "reconnect_min_s": 0.2, "reconnect_max_s": 2.0},
            "batching": {"max_batch": 1, "max_wait_ms": 0, "queue_size": QUEUE_SIZE},
            "publish": {"max_rate_hz": result_hz, "telemetry_interval_s": 30.0},
            # A hundred boxes share one process: its RSS is not one box's, so the memory rules are off here.
            "watchdog": {"interval_s": 60.0, "soft_limit_mb": 1.0e6, "restart_on_leak": False,
                         "inference_deadline_s": 60.0},
            "commands": dict(commands or {}),  # e.g. a command key: only signed, dated commands run
        })
        self.deploys = 0
        self.rollbacks = 0
        self.daemon = self._daemon()
        self._thread: Optional[threading.Thread] = None

    def _daemon(self) -> Daemon:
        """A new Daemon on this box's state dir (a restart is a new process: new objects, same disk)."""
        daemon = Daemon(self.config)
        handlers = daemon.dispatcher.handlers
        handlers["deploy"] = self._counted(handlers["deploy"], "deploys")
        handlers["rollback"] = self._counted(handlers["rollback"], "rollbacks")
        return daemon

    def _counted(self, handler: Callable[..., Any], counter: str) -> Callable[..., Any]:
        def run(fields: Dict[str, Any], progress: Callable[[str], None]) -> Any:
            setattr(self, counter, getattr(self, counter) + 1)  # the command worker is one thread
            return handler(fields, progress)

        return run

    def start(self) -> "SimBox":
        if self.daemon.stop_event.is_set():  # stopped before: come back like a restarted process
            self.daemon = self._daemon()
        self.daemon.start()
        self._thread = threading.Thread(target=self.daemon.loop.serve, name="serve-%s" % self.device_id, daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """A clean stop: the box publishes its retained ``offline`` and stays in the fleet's view."""
        if self._thread is None:
            return
        self.daemon.request_stop("simulation")
        self._thread.join(10.0)
        self.daemon.shutdown()
        self._thread = None

    def serving(self) -> Dict[str, Any]:
        """The box's own slot table (not what it published): the ground truth a test compares to."""
        return self.daemon.models.status()


class SimulatedFleet:
    """``count`` boxes named ``<name>-NNN`` on one broker; see the module docstring."""

    def __init__(self, root: str, host: str, port: int, bundle: str, count: int, groups: Sequence[str] = ("sim",),
                 observation_s: float = 1.0, prefix: str = "atlas-edge", frame_hz: float = DEFAULT_FRAME_HZ,
                 faults: Optional[Dict[int, Tuple[str, str]]] = None, name: str = "box", hosts: Sequence[str] = (),
                 result_hz: float = 0.2, commands: Optional[Dict[str, Any]] = None) -> None:
        self.root = root
        self.frame_hz = frame_hz
        # ``hosts`` (mqtt.hosts, a cluster's nodes in the order each box tries them) replaces host/port when given;
        # ``result_hz`` is each box's publish.max_rate_hz (0: every frame's result, numbered without a gap).
        self.boxes = [SimBox(root, "%s-%03d" % (name, index), host, port, bundle, groups, observation_s, prefix,
                             hosts, result_hz, commands) for index in range(count)]
        self._faults = {self.boxes[i].state_dir: fault for i, fault in (faults or {}).items()}
        self._saved_backend: Optional[type] = None
        self._stop = threading.Event()
        self._feeder: Optional[threading.Thread] = None

    def start(self) -> "SimulatedFleet":
        self._saved_backend = backends.BACKENDS.get("opencv")
        FleetStandinBackend.FAULTS = dict(self._faults)
        backends.BACKENDS["opencv"] = FleetStandinBackend
        for box in self.boxes:
            box.start()
        self._feeder = threading.Thread(target=self._feed, name="fleet-feeder", daemon=True)
        self._feeder.start()
        return self

    def _feed(self) -> None:
        image = np.random.default_rng(1).integers(0, 256, size=FRAME_SHAPE, dtype=np.uint8)
        frame_id = 0
        period = 1.0 / self.frame_hz
        while not self._stop.wait(period):
            frame_id += 1
            now, mono = time.time(), time.monotonic()
            for box in self.boxes:
                if box.running and not box.daemon.loop.paused:
                    try:
                        box.daemon.loop.frames.put_nowait(Frame(SOURCE, frame_id, now, image, enqueued=mono))
                    except queue.Full:
                        pass  # that box is behind: the next frame will do

    def box(self, device_id: str) -> SimBox:
        return next(b for b in self.boxes if b.device_id == device_id)

    def deploys(self) -> Dict[str, int]:
        return {b.device_id: b.deploys for b in self.boxes}

    def close(self) -> None:
        self._stop.set()
        if self._feeder is not None:
            self._feeder.join(5.0)
        # Each box drains and disconnects on its own: stopped side by side, a hundred take seconds, not minutes.
        stoppers = [threading.Thread(target=box.stop, name="stop-%s" % box.device_id) for box in self.boxes]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join(30.0)
        if self._saved_backend is not None:
            backends.BACKENDS["opencv"] = self._saved_backend
        FleetStandinBackend.FAULTS = {}

    def __enter__(self) -> "SimulatedFleet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def max_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    """Peak RSS in MiB of this process (or of its waited-for children); Linux reports KiB."""
    return resource.getrusage(who).ru_maxrss / 1024.0


def slot_summary(status: Dict[str, Any]) -> Dict[str, Any]:
    """(serving version, its state) from a box's slot table, for compact assertions and reports."""
    serving = (status.get("slots") or {}).get(status.get("serving") or "", {})
    return {"version": serving.get("version"), "state": serving.get("state")}
