"""Writes the bundle's non-model files and its manifest: what every bundle producer shares (docs/bundle.md).

``atlas-edge qat`` (:mod:`quant.pipeline`) and ``atlas-edge bundle create`` (:mod:`converters.byom.create`) make
bundles through this module; ``atlas-edge convert`` adds artifacts to one later. Every manifest is written by
:func:`agent.bundle.verify.write_manifest`, which hashes every file and must come last.

* Calibration set: NHWC float32 ``.bin`` files at the main tier, normalised exactly as the bundle's
  ``preprocessing`` says (converter_lite's ``[data_preprocess_param] input_type=BIN`` input).
* Golden set: held-out images letterboxed (uint8 BGR, never normalised) to each tier, and the raw output 0 of
  every runnable batch-1 artifact of that tier, produced by the runtime that consumes the artifact
  (:mod:`converters.runtimes`) after the box's own preprocessing. A box replays these to prove its
  preprocessing and runtime give the same numbers.
* The settings of both sets (:class:`CalibrationConfig`, :class:`GoldenConfig`): sections of ``qat``'s config
  and the defaults of ``bundle create``.
"""

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.config.schema import setting, to_dict
from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.preprocess import PreprocessSpec, letterbox_for
from converters.runtimes import run_on_host

CALIBRATION_DIR = "calibration"
GOLDEN_DIR = "golden"
INPUT_NAME = "images"


@dataclasses.dataclass(frozen=True)
class GoldenConfig:
    cases_per_tier: int = setting(2, ge=1, le=16)
    atol: float = setting(1e-3, ge=0)
    rtol: float = setting(1e-3, ge=0)


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    count: int = setting(8, ge=1, le=1000, doc="NHWC float32 .bin files at the main tier")


def tier_name(tier: Tuple[int, int]) -> str:
    """A tier in file names and reports: ``640x384`` (height x width)."""
    return "%dx%d" % (tier[0], tier[1])


@dataclasses.dataclass
class ArtifactPlan:
    """One exported model file and how the box must feed it: float32 NCHW normalised on the host, unless
    ``model_input`` says otherwise (:data:`converters.onnx_input.MODEL_INPUT` for a model that takes uint8 BGR
    NHWC and normalises itself)."""

    file: str
    tier: Tuple[int, int]
    batch: int
    format: str  # mindir | onnx
    precision: str  # float32 | int8-sim | int8
    role: str  # serve | convert
    model_input: Optional[Dict[str, str]] = None  # input_dtype/input_layout/input_color/normalize_on overrides

    def manifest_entry(self, input_color: str) -> Dict[str, Any]:
        entry = {
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
        entry.update(self.model_input or {})
        return entry

    def preprocessor(self, spec: PreprocessSpec) -> BatchPreprocessor:
        """The box's preprocessing for this artifact at batch 1 (agent.pipeline.model builds the same)."""
        entry = self.manifest_entry(spec.color)
        return BatchPreprocessor(spec, self.tier, max_batch=1, input_dtype=entry["input_dtype"],
                                 input_layout=entry["input_layout"], input_color=entry["input_color"],
                                 normalize=entry["normalize_on"] == "host")


def write_calibration(
    out_dir: str, images_bgr: np.ndarray, spec: PreprocessSpec, count: int, seed: int
) -> Dict[str, Any]:
    """``count`` images picked with ``seed`` from letterboxed uint8 BGR (N, H, W, 3) -> calibration/*.bin."""
    count = min(count, len(images_bgr))
    directory = os.path.join(out_dir, CALIBRATION_DIR)
    os.makedirs(directory, exist_ok=True)
    picks = np.sort(np.random.default_rng(seed).choice(len(images_bgr), size=count, replace=False))
    height, width = images_bgr.shape[1:3]
    batcher = BatchPreprocessor(spec, (height, width), max_batch=count, input_layout="NHWC")  # the box's path
    for i, pick in enumerate(picks):
        batcher.fill_letterboxed(i, images_bgr[pick])
    for i, tensor in enumerate(batcher.batch):  # (H, W, 3) float32 each
        tensor.astype(np.float32).tofile(os.path.join(directory, "calib_%04d.bin" % i))
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
    roles: Sequence[str] = ("serve",),
) -> Dict[str, Any]:
    """Golden cases for every tier from the first ``cases_per_tier`` held-out originals, with the outputs of
    each batch-1 artifact whose role is in ``roles`` (a float ONNX kept for ``convert`` gets them too, so the
    artifacts converted from it inherit them)."""
    os.makedirs(os.path.join(out_dir, GOLDEN_DIR), exist_ok=True)
    cases: List[Dict[str, Any]] = []
    for tier in tiers:
        runnable = [a for a in artifacts if a.tier == tier and a.batch == 1 and a.role in roles]
        for original in originals_bgr[:cases_per_tier]:
            index = len(cases)
            image, _ = letterbox_for(original, tier, spec)
            image_file = "%s/case%d.npy" % (GOLDEN_DIR, index)
            np.save(os.path.join(out_dir, image_file), image)
            expected = {}
            for art in runnable:
                batcher = art.preprocessor(spec)  # the box's path for this artifact
                batcher.fill_letterboxed(0, image)
                output = run_on_host(os.path.join(out_dir, art.file), art.format, batcher.batch, art.precision)
                out_file = "%s/case%d.%s.npy" % (GOLDEN_DIR, index, art.file)
                np.save(os.path.join(out_dir, out_file), output.astype(np.float32))
                expected[art.file] = out_file
            cases.append({"image": image_file, "tier": list(tier), "expected": expected})
    return {"atol": atol, "rtol": rtol, "cases": cases}


def write_manifest_for(
    out_dir: str,
    name: str,
    version: str,
    task: str,
    labels: List[str],
    tiers: Sequence[Sequence[int]],
    preprocessing: PreprocessSpec,
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
        "preprocessing": to_dict(preprocessing),
        "postprocessing": postprocessing,
        "artifacts": [a.manifest_entry(preprocessing.color) for a in artifacts],
        "toolchain": toolchain,
        "golden": golden,
        "calibration": calibration,
    }
    if source is not None:
        manifest["source"] = source
    return write_manifest(out_dir, manifest)
