"""The serving loop in tests (a helper module, not a test module): the demo bundle on OpenCV behind the paced
stand-ins of the benchmarks (benchmarks/paced_backend.py), a loop around it, and the sink and model source it
serves to. test_serving and test_serving_control import these instead of importing each other."""

import os
import threading
from dataclasses import replace

import numpy as np
import pytest

from agent.config.daemon_config import PublishConfig
from agent.pipeline.handover import BetweenBatches
from agent.pipeline.model import LoadedModel
from agent.pipeline.serving import ServingLoop
from agent.pipeline.sources import SourceSet
from benchmarks.paced_backend import PacedStandinBackend, freeze, paced_factory
from benchmarks.workload import DEMO_BUNDLE, bench_device, load_bundle

needs_demo_bundle = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                       reason="examples/demo-bundle is missing (make demo-bundle)")

HOLD_S = 0.002  # long enough that the serving thread's letterbox lands inside a call
SQUARE_HW = (480, 480)  # -> the demo model's 256x256 tier
WIDE_HW = (480, 800)  # -> its 192x320 tier
MAX_BATCH = 4  # four chunks per batch: the artifacts have batch 1


class Sink:
    def __init__(self):
        self.results = []
        self.lock = threading.Lock()

    def publish_result(self, source, payload):
        with self.lock:
            self.results.append(payload)

    def publish_telemetry(self, telemetry):
        pass


class Progress:
    """The loop's liveness marks; counts its idle turns (a paused loop turning with nothing to serve)."""

    idle_turns = 0

    def begin_inference(self):
        pass

    def end_inference(self):
        pass

    def frame_done(self, count=1):
        pass

    def idle_tick(self):
        self.idle_turns += 1


class Models:
    """A model source whose current model changes only through the handover queue (as the manager's does)."""

    def __init__(self, model, shadow=None):
        self.current = model
        self.recorded = []
        self.shadow = shadow  # a shadow run's tap, when the test opens one

    def between_batches(self):
        pass

    def shadow_tap(self):
        return self.shadow

    def record_batch(self, frames, infer_ms_per_frame, failed):
        self.recorded.append((frames, failed))


def scene(hw, seed):
    from agent.devtools.scenes import generate_scene

    return generate_scene(np.random.default_rng(seed), hw)[0]



def paced_model(images, version=None, hold_s=HOLD_S, backend_cls=PacedStandinBackend):
    """The demo bundle on OpenCV behind paced stand-ins: real outputs for a real frame of each tier."""
    made = []
    factory = paced_factory(hold_s, made)
    if backend_cls is not PacedStandinBackend:
        def factory(name, path, spec, options):
            backend = backend_cls(path, spec, options, hold_s=hold_s)
            made.append(backend)
            return backend
    model = LoadedModel(load_bundle(DEMO_BUNDLE), bench_device(1), "opencv", 1, backend_factory=factory)
    model.load()
    model.infer_frames([images["square"], images["wide"]])
    freeze(made)
    if version is not None:
        model.manifest = replace(model.manifest, version=version)
    return model


def make_loop(models, frames, sink, stop=None, handover=None, on_event=None):
    return ServingLoop(frames, SourceSet([], frames), models, sink, Progress(), handover or BetweenBatches(),
                       stop or threading.Event(), MAX_BATCH, 5.0, PublishConfig(telemetry_interval_s=3600.0),
                       on_event=on_event or (lambda event: None))
