"""A model manager on the committed tiny bundle, played by a test serving loop (a helper module, not a test
module): the lifecycle tests and the fetch tests share these fixtures instead of importing each other."""

import functools
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

from agent.bundle.manifest import MANIFEST
from agent.bundle.verify import sha256_file, write_manifest
from agent.config.daemon_config import parse_daemon_config
from agent.config.device_config import load_device_config
from agent.lifecycle.model_manager import ModelManager
from agent.lifecycle.slots import EMPTY
from agent.lifecycle.store import STAGING_DIR
from agent.pipeline.handover import BetweenBatches
from agent.protocol.verbs import parse_request
from tests.conftest import wait_for

deploy_request = functools.partial(parse_request, "deploy")  # a deploy command's payload, as the dispatcher parses it

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_BUNDLE = os.path.join(REPO, "tests", "data", "tiny-classify")
TIER = 32
LONG_WINDOW_S = 600.0  # an observation window no test outlives: the model stays pending
WAIT_S = 30.0  # bound on anything that should take a few batches
BATCH = 2  # frames per batch fed by the test's serving loop
# The tiny model infers in well under a millisecond, where scheduling noise on two shared cores can double a
# median: tests that do not test the latency rule set a factor no noise reaches.
NOISE_PROOF_FACTOR = 1000.0


# --- fixtures: a real tiny model, its versions, a manager ---------------------------------------------------

def _writable(root):
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            os.chmod(os.path.join(dirpath, name), 0o644)  # MindSpore writes its exports read-only


@pytest.fixture(scope="session")
def base_bundle(tmp_path_factory):
    """A copy of the committed tiny bundle (tests/data/build_tiny_bundle.py made it), so tests cannot alter it."""
    root = str(tmp_path_factory.mktemp("tiny") / "tiny-1.0.0")
    shutil.copytree(TINY_BUNDLE, root)
    _writable(root)
    return root


def new_version(src, dst, version, mutate=None):
    """Copy ``src`` to ``dst`` as ``version``, changed by ``mutate(data, dst)`` if given; returns its sha."""
    shutil.copytree(src, dst)
    _writable(dst)
    for extra in ("manifest.sig",):
        if os.path.exists(os.path.join(dst, extra)):
            os.remove(os.path.join(dst, extra))
    with open(os.path.join(dst, MANIFEST)) as handle:
        data = json.load(handle)
    data["version"] = version
    if mutate is not None:
        mutate(data, dst)
    write_manifest(dst, data)
    return sha256_file(os.path.join(dst, MANIFEST))


class Harness:
    """A manager on a fresh state dir, with its events recorded."""

    def __init__(self, tmp_path, bundle, device="cpu-dev", backend="opencv", switch_timeout_s=WAIT_S,
                 clock=time.monotonic, fetch=None, **model):
        settings = {"bundle": bundle, "backend": backend, "observation_s": LONG_WINDOW_S,
                    "latency_regression": NOISE_PROOF_FACTOR}
        settings.update(model)
        self.config = parse_daemon_config({"device_id": "t1", "state_dir": str(tmp_path / "state"),
                                           "model": settings, "fetch": fetch or {}})
        self.device = load_device_config(device) if isinstance(device, str) else device
        self.events = []
        self.handover = BetweenBatches()
        # The daemon's part: it owns the live config and the manager reads it through this callable.
        self.manager = ModelManager(lambda: self.config, self.device, backend, on_event=self.events.append,
                                    handover=self.handover, switch_timeout_s=switch_timeout_s, clock=clock)
        self.store = os.path.join(str(tmp_path / "state"), "bundles")
        self.state_file = os.path.join(str(tmp_path / "state"), "slots.json")

    def incoming(self, name):
        path = os.path.join(self.store, "incoming", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def slot_dirs(self):
        return sorted(os.listdir(os.path.join(self.store, "slots")))

    def events_named(self, name):
        return [e for e in self.events if e["event"] == name]

    def wait_for_event(self, name, timeout=WAIT_S):
        assert wait_for(lambda: bool(self.events_named(name)), timeout), \
            "no %r event within %.0f s; events: %s" % (name, timeout, self.events)
        return self.events_named(name)[0]


@pytest.fixture
def harness(tmp_path, base_bundle):
    made = []

    def make(**kwargs):
        h = Harness(tmp_path, base_bundle, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.manager.close()


class ServingLoop(threading.Thread):
    """Plays the daemon's serving thread; logs (model label, frames fed, results got) per batch."""

    def __init__(self, manager):
        super().__init__(name="test-serving-loop", daemon=True)
        self.manager = manager
        self.stop_event = threading.Event()
        self.inference = threading.Event()  # cleared: the loop only calls between_batches
        self.inference.set()
        self.log = []
        self.errors = 0
        rng = np.random.default_rng(11)
        self.frames = [rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8) for _ in range(BATCH)]

    def run(self):
        while not self.stop_event.is_set():
            self.manager.handover.run_pending()
            self.manager.between_batches()
            if not self.inference.is_set():
                self.stop_event.wait(0.001)
                continue
            model = self.manager.current
            try:
                results = model.infer_frames(self.frames)
            except Exception:  # like the daemon: count it, report it to the manager, go on
                self.errors += 1
                self.manager.record_batch(BATCH, 0.0, failed=True)
                self.log.append((model.label, BATCH, 0))
                self.stop_event.wait(0.001)
                continue
            self.manager.record_batch(BATCH, results[0].timings_ms["infer"], failed=False)
            self.log.append((model.label, BATCH, len(results)))
            self.stop_event.wait(0.001)  # two shared cores: leave the command thread some room

    def wait_batches(self, count, timeout=WAIT_S):
        target = len(self.log) + count
        assert wait_for(lambda: len(self.log) >= target, timeout, interval=0.005), "serving loop made no progress"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.join(timeout=WAIT_S)
        assert not self.is_alive()


def snapshot(h):
    return (h.manager.current, open(h.state_file, "rb").read(), h.slot_dirs())


def assert_unchanged(h, before):
    model, state, dirs = before
    assert h.manager.current is model
    assert h.manager.current.manifest.version == "1.0.0"
    assert open(h.state_file, "rb").read() == state
    assert h.slot_dirs() == dirs
    assert os.listdir(os.path.join(h.store, STAGING_DIR)) == []
    assert h.manager.status()["slots"]["b"]["state"] == EMPTY


def no_progress(_message):
    return None
