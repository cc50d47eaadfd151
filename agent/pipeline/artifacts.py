"""Which of a bundle's artifacts this box runs: per tier, the one its backend, target, SoC and precision take,
and which tier a source's frames go to. Beside the loaded model (:mod:`agent.pipeline.model`), its one user at
load.
"""

import math
from typing import Dict, List, Optional, Tuple

from agent.bundle.manifest import Artifact, BundleError, Tier
from agent.bundle.verify import Bundle
from agent.config.device_config import BACKEND_FORMATS, INT8_BACKENDS, MODEL_PRECISIONS, DeviceConfig
from agent.config.schema import FieldError

# model.precision -> the artifact precisions it serves, best first. int8-sim (float kernels on fake-quantised
# weights: slower than float, no smaller) is served only when a bundle has nothing else for the tier.
FLOAT = ("float32", "float16")
SIM = ("int8-sim",)


def precision_order(precision: str, backend: str) -> Tuple[str, ...]:
    """Artifact precisions ``model.precision`` accepts on ``backend``, preferred first.

    ``auto`` takes int8 first on a backend that runs it as integer kernels (``INT8_BACKENDS``), float first
    elsewhere; ``int8`` and ``float`` take only their own kind.
    """
    if precision not in MODEL_PRECISIONS:
        raise ValueError("model.precision must be one of %s (got %r)" % (list(MODEL_PRECISIONS), precision))
    if precision == "int8":
        return ("int8",)
    if precision == "float":
        return FLOAT
    return (("int8",) + FLOAT if backend in INT8_BACKENDS else FLOAT + ("int8",)) + SIM


def select_artifacts(bundle: Bundle, device: DeviceConfig, backend: str, batch: Optional[int] = None,
                     precision: str = "auto") -> Dict[Tier, Artifact]:
    """For each tier, the artifact this box runs with ``backend``; raise BundleError naming what is missing.

    An ascend artifact must carry the device's SoC: a model compiled for a 310P does not run on a 310B,
    and finding out at load time on the box is exactly the failure users report. ``precision`` is the daemon
    config's ``model.precision`` (:func:`precision_order`); an explicit one that a tier lacks is an error.
    """
    if backend not in BACKEND_FORMATS:
        raise BundleError([FieldError("backend", "unknown backend %r" % backend)], bundle.root)
    formats = device.backend_formats(backend)
    candidates, rejected = _candidates(bundle, device, formats)
    if not candidates:
        reason = rejected or [FieldError("artifacts", "no %s artifact for backend %s (formats %s)" % (
            "serve", backend, "/".join(formats)))]
        raise BundleError(reason, bundle.root)
    wanted = precision_order(precision, backend)
    chosen: Dict[Tier, Artifact] = {}
    missing: List[str] = []
    for tier, arts in sorted(candidates.items()):
        usable = [a for a in arts if a.precision in wanted]
        if not usable:
            missing.append("%dx%d has %s" % (tier[0], tier[1], "/".join(sorted({a.precision for a in arts}))))
            continue
        # Precision first (int8 runs ~0.6x float where it pays), then the artifact whose fixed batch matches
        # the requested one, else the smallest batch; then the backend's own order of formats (mslite: a
        # converted .ms before a MindIR it may not read).
        chosen[tier] = min(usable, key=lambda a: (wanted.index(a.precision), _batch_rank(a, batch),
                                                   formats.index(a.format)))
    if missing:
        raise BundleError([FieldError("model.precision", "%s: the bundle has no %s serve artifact for backend %s "
                                      "(tier %s); set model.precision to auto or another precision" % (
                                          precision, "/".join(wanted), backend, "; ".join(missing)))],
                          bundle.root)
    return chosen


def _candidates(bundle: Bundle, device: DeviceConfig, formats: Tuple[str, ...]
                ) -> Tuple[Dict[Tier, List[Artifact]], List[FieldError]]:
    """Serve artifacts per tier that this box can run in one of ``formats``, and why others cannot."""
    found: Dict[Tier, List[Artifact]] = {}
    rejected: List[FieldError] = []
    for i, art in enumerate(bundle.manifest.artifacts):
        field = "artifacts[%d]" % i
        if art.role != "serve" or art.format not in formats:
            continue
        if art.target != device.target:
            rejected.append(FieldError(field + ".target", "%s is for %s, device %s is %s" % (
                art.file, art.target, device.name, device.target)))
            continue
        if art.target == "ascend" and art.soc_version != device.soc_version:
            rejected.append(FieldError(field + ".soc_version", "%s was built for %s, device %s is %s" % (
                art.file, art.soc_version, device.name, device.soc_version)))
            continue
        if device.input_tiers and art.tier not in device.input_tiers:
            continue
        found.setdefault(art.tier, []).append(art)
    return found, rejected


def _batch_rank(art: Artifact, batch: Optional[int]) -> Tuple[int, int]:
    return (0 if batch is not None and art.batch == batch else 1, art.batch)


def pick_tier(tiers: List[Tier], src_hw: Tuple[int, int]) -> Tier:
    """The tier whose aspect ratio is closest to the source's (log scale); ties go to the larger tier.

    Matching the aspect ratio minimises padding, so the most pixels go to the picture rather than grey bars.
    """
    h0, w0 = src_hw
    if h0 <= 0 or w0 <= 0:
        raise ValueError("src_hw must be positive (got %s)" % (src_hw,))
    src = math.log(w0 / h0)
    return min(tiers, key=lambda t: (round(abs(math.log(t[1] / t[0]) - src), 6), -(t[0] * t[1])))
