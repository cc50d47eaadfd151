"""What the serving benchmarks run: the bundle, the device config with pinned threads, camera frames, models.

The pipeline, batching, memory and start-up sections all serve the same bundle (the committed demo bundle, or
a stand-in exported here when it is missing, see :mod:`benchmarks.standin_bundle`) on the ``cpu-dev`` device
with ``cpu_threads`` set to the run's pinned thread count, so the backends pin MindSpore's kernel threads and
OpenCV's pool to the same number as the rest of the run.
"""

import logging
import os
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

log = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_BUNDLE = os.path.join(REPO_ROOT, "examples", "demo-bundle")
DEVICE = "cpu-dev"  # the CPU box kind: MindSpore (MindIR) or OpenCV (ONNX)
FRAME_SEED = 2026
CAMERA_HW = (1080, 1920)  # the headline frame: a 1080p camera


def resolve_bundle(requested: Optional[str], work_dir: str) -> Tuple[str, str]:
    """(bundle directory, how it was chosen): ``requested``, else the demo bundle, else a stand-in."""
    if requested:
        return os.path.abspath(requested), "given with --bundle"
    if os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")):
        return DEMO_BUNDLE, "examples/demo-bundle"
    from benchmarks.standin_bundle import build_standin_bundle

    log.warning("examples/demo-bundle is missing: exporting a stand-in detector (not the demo model)")
    return build_standin_bundle(
        os.path.join(work_dir, "standin-bundle")
    ), "stand-in exported by the benchmark"


def bench_device(threads: int) -> Any:
    """The ``cpu-dev`` device config with ``cpu_threads`` pinned (frozen dataclass: replaced, not edited)."""
    from agent.device_config import load_device_config

    return replace(load_device_config(DEVICE), cpu_threads=threads)


def camera_frames(count: int, hw: Tuple[int, int] = CAMERA_HW, seed: int = FRAME_SEED) -> List[np.ndarray]:
    """``count`` distinct synthetic scenes (shapes on textured backgrounds) of size ``hw``."""
    from agent.shapes import generate_scene

    rng = np.random.default_rng(seed)
    return [generate_scene(rng, hw)[0] for _ in range(count)]


def load_bundle(bundle_dir: str) -> Any:
    from agent.bundle import verify_bundle

    return verify_bundle(bundle_dir)


def open_model(bundle: Any, device: Any, backend: str, max_batch: int) -> Any:
    """A loaded and warmed-up :class:`agent.model.LoadedModel` (no golden check: speed is measured here)."""
    from agent.model import LoadedModel

    model = LoadedModel(bundle, device, backend, max_batch=max_batch)
    model.load()
    try:
        model.warm_up()
    except Exception:
        model.close()
        raise
    return model


def artifact_batches(model: Any) -> Dict[str, int]:
    """Fixed batch of the artifact serving each tier, ``{"256x256": 8}``: says what a "batch 8" really ran."""
    return {"%dx%d" % tier: int(art.batch) for tier, art in model.artifacts.items()}


def backend_available(backend: str) -> Optional[str]:
    """None when ``backend`` can run here, else why not (from the backends' own status report)."""
    try:
        from agent.backends import backend_status
    except ImportError as exc:
        return "agent.backends is not importable: %s" % exc
    status = backend_status().get(backend)
    return None if status == "ok" else str(status)
