"""What the serving benchmarks run: the bundle, the device config with pinned threads, camera frames, models.

The pipeline, batching, memory and start-up sections all serve the same bundle (the committed demo bundle, or
a stand-in exported here when it is missing, see :mod:`benchmarks.standin_bundle`) on the ``cpu-dev`` device
(or ``--device``) with ``cpu_threads`` set to the run's pinned thread count, so the backends pin MindSpore's
kernel threads and OpenCV's pool to the same number as the rest of the run.
"""

import logging
import os
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

log = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_BUNDLE = os.path.join(REPO_ROOT, "examples", "demo-bundle")
DEFAULT_DEVICE = "cpu-dev"  # the CPU box kind: MindSpore (MindIR) or OpenCV (ONNX)
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


def bench_device(threads: int, name: str = DEFAULT_DEVICE) -> Any:
    """The device config ``name`` with ``cpu_threads`` pinned (frozen dataclass: replaced, not edited)."""
    from agent.config.device_config import load_device_config

    return replace(load_device_config(name), cpu_threads=threads)


def camera_frames(count: int, hw: Tuple[int, int] = CAMERA_HW, seed: int = FRAME_SEED) -> List[np.ndarray]:
    """``count`` distinct synthetic scenes (shapes on textured backgrounds) of size ``hw``."""
    from agent.devtools.scenes import generate_scene

    rng = np.random.default_rng(seed)
    return [generate_scene(rng, hw)[0] for _ in range(count)]


def load_bundle(bundle_dir: str) -> Any:
    from agent.bundle.verify import verify_bundle

    return verify_bundle(bundle_dir)


def open_model(bundle: Any, device: Any, backend: str, max_batch: int) -> Any:
    """A loaded and warmed-up :class:`agent.pipeline.model.LoadedModel` (no golden check: speed is measured here)."""
    from agent.pipeline.model import LoadedModel

    model = LoadedModel(bundle, device, backend, max_batch=max_batch)
    model.load()
    try:
        model.warm_up()
    except Exception:
        model.close()
        raise
    return model


def serve_batch_at_most(bundle: Any, backend: str, limit: int) -> int:
    """The largest fixed batch among the bundle's serve artifacts for ``backend`` that is at most ``limit``.

    ``LoadedModel(max_batch=n)`` picks the artifact whose batch is exactly ``n`` (else the smallest), so
    opening it with this number gets the biggest batch the bundle offers; ``infer_frames`` then runs ``limit``
    frames in chunks of that size. Tiers without such an artifact run their smallest batch, as in the daemon.
    """
    from agent.config.device_config import BACKEND_FORMATS

    formats = BACKEND_FORMATS[backend]
    batches = [
        a.batch
        for a in bundle.manifest.artifacts
        if a.role == "serve" and a.format in formats and a.batch <= limit
    ]
    return max(batches) if batches else 1


def frame_hw_for_tier(tier: Tuple[int, int], height: int = CAMERA_HW[0]) -> Tuple[int, int]:
    """A camera-like frame size, ``height`` pixels tall, with the tier's aspect ratio: it maps to the tier."""
    return height, int(round(height * tier[1] / tier[0]))


def largest_batch_tier(bundle: Any, backend: str) -> Tuple[int, int]:
    """The tier whose serve artifact for ``backend`` has the largest fixed batch (ties: the larger tier)."""
    from agent.config.device_config import BACKEND_FORMATS

    formats = BACKEND_FORMATS[backend]
    candidates = [
        (a.batch, a.tier[0] * a.tier[1], a.tier)
        for a in bundle.manifest.artifacts
        if a.role == "serve" and a.format in formats
    ]
    if not candidates:
        raise ValueError("bundle %s has no serve artifact for backend %s" % (bundle.label, backend))
    return tuple(max(candidates)[2])  # type: ignore[return-value]


def artifact_batches(model: Any) -> Dict[str, int]:
    """Fixed batch of the artifact serving each tier, ``{"256x256": 8}``: says what a "batch 8" really ran."""
    return {"%dx%d" % tier: int(art.batch) for tier, art in model.artifacts.items()}


def backend_available(backend: str) -> Optional[str]:
    """None when ``backend`` can run here, else why not (from the backends' own status report)."""
    try:
        from agent.pipeline.backends import backend_status
    except ImportError as exc:
        return "agent.pipeline.backends is not importable: %s" % exc
    status = backend_status().get(backend)
    return None if status == "ok" else str(status)
