"""Which of a bundle's artifacts this box runs: per tier, the one its backend, target and SoC take, and which
tier a source's frames go to. Beside the loaded model (:mod:`agent.pipeline.model`), its one user at load.
"""

import math
from typing import Dict, List, Optional, Tuple

from agent.bundle.manifest import Artifact, BundleError, Tier
from agent.bundle.verify import Bundle
from agent.config.device_config import BACKEND_FORMATS, DeviceConfig
from agent.config.schema import FieldError


def select_artifacts(bundle: Bundle, device: DeviceConfig, backend: str, batch: Optional[int] = None
                     ) -> Dict[Tier, Artifact]:
    """For each tier, the artifact this box runs with ``backend``; raise BundleError naming what is missing.

    An ascend artifact must carry the device's SoC: a model compiled for a 310P does not run on a 310B,
    and finding out at load time on the box is exactly the failure users report.
    """
    formats = BACKEND_FORMATS.get(backend)
    if formats is None:
        raise BundleError([FieldError("backend", "unknown backend %r" % backend)], bundle.root)
    chosen: Dict[Tier, Artifact] = {}
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
        current = chosen.get(art.tier)
        # Prefer the artifact whose fixed batch matches the requested one, else the smallest batch; then the
        # backend's own order of formats (mslite: a converted .ms before a MindIR it may not read).
        if current is None or (_batch_rank(art, batch), formats.index(art.format)) < (
                _batch_rank(current, batch), formats.index(current.format)):
            chosen[art.tier] = art
    if not chosen:
        reason = rejected or [FieldError("artifacts", "no %s artifact for backend %s (formats %s)" % (
            "serve", backend, "/".join(formats)))]
        raise BundleError(reason, bundle.root)
    return chosen


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
