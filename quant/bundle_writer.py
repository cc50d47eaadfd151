"""Writes the bundle's non-model files and its manifest (contract: docs/bundle.md).

* Calibration set: NHWC float32 ``.bin`` files at the main tier, normalised exactly as the bundle's
  ``preprocessing`` says (converter_lite's ``[data_preprocess_param] input_type=BIN`` input).
* Golden set: held-out images letterboxed (uint8 BGR, never normalised) to each tier, and the raw output 0 of
  every runnable batch-1 artifact of that tier, produced by the runtime that consumes the artifact (cv2.dnn
  for ONNX, ``mindspore.load`` + ``nn.GraphCell`` for MindIR) after the box's own preprocessing. A box replays
  these to prove its preprocessing and runtime give the same numbers.
* The manifest, through :func:`agent.bundle.verify.write_manifest`, which hashes every file; it must come last.
"""

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.pipeline.preprocess import BatchPreprocessor, PreprocessSpec, letterbox

CALIBRATION_DIR = "calibration"
GOLDEN_DIR = "golden"
INPUT_NAME = "images"


@dataclasses.dataclass
class ArtifactPlan:
    """One exported model file and how the box must feed it (float32 NCHW, normalised on the host)."""

    file: str
    tier: Tuple[int, int]
    batch: int
    format: str  # mindir | onnx
    precision: str  # float32 | int8-sim | int8
    role: str  # serve | convert

    def manifest_entry(self, input_color: str) -> Dict[str, Any]:
        return {
            "file": self.file,
            "format": self.format,
            "target": "cpu",
            "soc_version": None,
            "tier": list(self.tier),
            "batch": self.batch,
            "precision": self.precision,
            "role": self.role,
            "input_dtype": "float32",
            "input_layout": "NCHW",
            "normalize_on": "host",
            "input_color": input_color,
            "config_files": [],
            "toolchain": {},
        }


def write_calibration(
    out_dir: str, images_bgr: np.ndarray, spec: PreprocessSpec, count: int, seed: int
) -> Dict[str, Any]:
    """``count`` images picked with ``seed`` from letterboxed uint8 BGR (N, H, W, 3) -> calibration/*.bin."""
    from quant.datasets import network_input

    count = min(count, len(images_bgr))
    directory = os.path.join(out_dir, CALIBRATION_DIR)
    os.makedirs(directory, exist_ok=True)
    picks = np.sort(np.random.default_rng(seed).choice(len(images_bgr), size=count, replace=False))
    tensors = network_input(images_bgr[picks], spec, layout="NHWC")  # (count, H, W, 3) float32
    for i, tensor in enumerate(tensors):
        tensor.astype(np.float32).tofile(os.path.join(directory, "calib_%04d.bin" % i))
    height, width = images_bgr.shape[1:3]
    return {
        "dir": CALIBRATION_DIR,
        "layout": "NHWC",
        "dtype": "float32",
        "tier": [height, width],
        "count": count,
    }


def write_golden(
    out_dir: str,
    originals_bgr: Sequence[np.ndarray],
    artifacts: Sequence[ArtifactPlan],
    spec: PreprocessSpec,
    tiers: Sequence[Tuple[int, int]],
    cases_per_tier: int,
    atol: float,
    rtol: float,
) -> Dict[str, Any]:
    """Golden cases for every tier from the first ``cases_per_tier`` held-out originals."""
    from quant.export import run_mindir, run_onnx_opencv

    os.makedirs(os.path.join(out_dir, GOLDEN_DIR), exist_ok=True)
    cases: List[Dict[str, Any]] = []
    for tier in tiers:
        runnable = [a for a in artifacts if a.tier == tier and a.batch == 1 and a.role == "serve"]
        for original in originals_bgr[:cases_per_tier]:
            index = len(cases)
            image, _ = letterbox(
                original, tier, pad_value=spec.pad_value, scaleup=spec.scaleup, center=spec.center
            )
            image_file = "%s/case%d.npy" % (GOLDEN_DIR, index)
            np.save(os.path.join(out_dir, image_file), image)
            batcher = BatchPreprocessor(spec, tier, max_batch=1)  # the box's path for these artifacts
            batcher.fill_letterboxed(0, image)
            expected = {}
            for art in runnable:
                runner = run_onnx_opencv if art.format == "onnx" else run_mindir
                output = runner(os.path.join(out_dir, art.file), batcher.batch)
                out_file = "%s/case%d.%s.npy" % (GOLDEN_DIR, index, art.file)
                np.save(os.path.join(out_dir, out_file), output.astype(np.float32))
                expected[art.file] = out_file
            cases.append({"image": image_file, "tier": list(tier), "expected": expected})
    return {"atol": atol, "rtol": rtol, "cases": cases}


def write_bundle_manifest(
    out_dir: str,
    config: Any,
    labels: List[str],
    artifacts: Sequence[ArtifactPlan],
    calibration: Dict[str, Any],
    golden: Dict[str, Any],
    toolchain: Dict[str, Any],
) -> Dict[str, Any]:
    """Fill in and write manifest.json for a :class:`quant.config.RunConfig` run; returns what was written."""
    from agent.config.schema import to_dict

    return write_manifest_for(
        out_dir, config.name, config.version, config.task, labels, config.export.tiers,
        to_dict(config.preprocessing), to_dict(config.postprocessing), artifacts, calibration, golden, toolchain)


def write_manifest_for(
    out_dir: str,
    name: str,
    version: str,
    task: str,
    labels: List[str],
    tiers: Sequence[Sequence[int]],
    preprocessing: Dict[str, Any],
    postprocessing: Dict[str, Any],
    artifacts: Sequence[ArtifactPlan],
    calibration: Optional[Dict[str, Any]],
    golden: Dict[str, Any],
    toolchain: Dict[str, Any],
    source: Optional[Dict[str, Any]] = None,
    input_name: str = INPUT_NAME,
) -> Dict[str, Any]:
    """The one manifest assembly of every bundle the host makes (``qat`` and ``bundle create``).

    ``source`` records where an imported model came from (``bundle create``); trained bundles have none.
    """
    from agent.bundle.verify import write_manifest

    manifest = {
        "schema": 1,
        "name": name,
        "version": version,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "task": task,
        "labels": labels,
        "input": {
            "name": input_name,
            "layout": "NCHW",
            "dtype": "float32",
            "tiers": [list(t) for t in tiers],
        },
        "preprocessing": preprocessing,
        "postprocessing": postprocessing,
        "artifacts": [a.manifest_entry(preprocessing["color"]) for a in artifacts],
        "toolchain": toolchain,
        "golden": golden,
        "calibration": calibration,
    }
    if source is not None:
        manifest["source"] = source
    return write_manifest(out_dir, manifest)
