"""The bundle's manifest: its schema (contract: docs/bundle.md), the task names, and the one reader of
``manifest.json``. A failure raises :class:`BundleError` naming the field.
"""

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.config.device_config import ARTIFACT_FORMATS
from agent.config.schema import ConfigError, FieldError, parse, setting

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
SCHEMA_VERSION = 1
TASKS = ("classify", "detect-yolov5", "detect-yolov8")  # the manifest's task values; pipeline has one decoder each

Tier = Tuple[int, int]  # (h, w)
COLOR_ORDERS = ("rgb", "bgr")  # a network's input colour order; frames arrive from OpenCV as bgr


class BundleError(ConfigError):
    """A bundle that must not be served; ``errors`` name the manifest field or file."""


def _positive_tier(tier: Tier, name: str) -> List[Tuple[str, str]]:
    return [] if tier[0] > 0 and tier[1] > 0 else [(name, "tier sides must be positive (got %s)" % (tier,))]


@dataclass(frozen=True)
class LetterboxSpec:
    pad_value: int = setting(114, ge=0, le=255, doc="grey of the padding (Ultralytics: 114)")
    center: bool = setting(True, doc="pad both sides equally")
    scaleup: bool = setting(True, doc="enlarge frames smaller than the tier")


@dataclass(frozen=True)
class Preprocessing:
    letterbox: LetterboxSpec = setting(factory=LetterboxSpec)
    color: str = setting("rgb", choices=COLOR_ORDERS, doc="colour order the network was trained on")
    mean: Tuple[float, float, float] = setting((0.0, 0.0, 0.0), doc="on 0..255 pixels, network colour order")
    std: Tuple[float, float, float] = setting((255.0, 255.0, 255.0), doc="out = (pixel - mean) / std")

    def check(self) -> List[Tuple[str, str]]:
        return [("std", "must be > 0 (got %s)" % (self.std,))] if min(self.std) <= 0 else []


@dataclass(frozen=True)
class Postprocessing:
    conf: float = setting(0.25, ge=0, le=1)
    iou: float = setting(0.45, ge=0, le=1)
    top_k: int = setting(5, ge=1)
    max_det: int = setting(100, ge=1)


@dataclass(frozen=True)
class InputSpec:
    name: str = setting(doc="the network's input tensor name")
    tiers: List[Tier] = setting(min_len=1, doc="fixed input shapes [h, w]")
    layout: str = setting("NCHW", choices=("NCHW", "NHWC"))
    dtype: str = setting("float32", choices=("float32", "float16", "uint8"))

    def check(self) -> List[Tuple[str, str]]:
        problems = [p for i, t in enumerate(self.tiers) for p in _positive_tier(t, "tiers[%d]" % i)]
        if len(set(self.tiers)) != len(self.tiers):
            problems.append(("tiers", "duplicate tier"))
        return problems


# Where an artifact's input is normalised (docs/bundle.md): the host's float fill, or uint8 straight in with the
# NPU's AIPP or the model's own first ops doing (x - mean) / std, the layout and colour order.
NORMALIZE_ON = ("host", "aipp", "model")
UINT8_NORMALIZE_ON = ("aipp", "model")
PRECISIONS = ("float32", "float16", "int8", "int8-sim")  # int8-sim: float kernels on fake-quantised weights


@dataclass(frozen=True)
class Artifact:
    file: str = setting(doc="path inside the bundle")
    format: str = setting(choices=ARTIFACT_FORMATS)
    target: str = setting(choices=("cpu", "ascend"))
    tier: Tier = setting(doc="[h, w]")
    sha256: str = setting(doc="hex digest of the file")
    size: int = setting(ge=0)
    soc_version: Optional[str] = setting(None, doc="required for ascend artifacts")
    batch: int = setting(1, ge=1, le=256)
    precision: str = setting("float32", choices=PRECISIONS)
    role: str = setting("serve", choices=("serve", "convert"), doc="convert: converter input only")
    input_dtype: str = setting("float32", choices=("float32", "float16", "uint8"))
    input_layout: str = setting("NCHW", choices=("NCHW", "NHWC"))
    normalize_on: str = setting("host", choices=NORMALIZE_ON, doc="host: the box normalises; aipp: uint8 in, "
                                "the NPU normalises; model: uint8 in, the model's own first ops normalise")
    input_color: str = setting("rgb", choices=COLOR_ORDERS)
    config_files: List[str] = setting(factory=list)
    toolchain: Dict[str, Optional[str]] = setting(factory=dict)

    def check(self) -> List[Tuple[str, str]]:
        problems = _positive_tier(self.tier, "tier")
        if self.target == "ascend" and not self.soc_version:
            problems.append(("soc_version", "required when target is ascend"))
        if self.normalize_on in UINT8_NORMALIZE_ON and self.input_dtype != "uint8":
            problems.append(("input_dtype", "must be uint8 when normalize_on is %s" % self.normalize_on))
        return problems

    def key(self) -> str:
        return self.file


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int = setting(ge=0)


@dataclass(frozen=True)
class GoldenCase:
    image: str = setting(doc="letterboxed uint8 BGR (h, w, 3) .npy")
    tier: Tier = setting()
    expected: Dict[str, str] = setting(doc="artifact file -> .npy of its raw output 0 at batch 1")


@dataclass(frozen=True)
class QuantizedTolerance:
    """How far a quantized artifact (int8, int8-sim) may move from the host's output, in units of its own
    int8-minus-float error on the same case (agent/pipeline/golden.py says why; docs/bundle.md)."""

    rms_ratio: float = setting(0.2, gt=0, doc="per channel: RMS of the difference / RMS of int8 - float")
    max_ratio: float = setting(1.0, gt=0, doc="per channel: largest difference / largest |int8 - float|")


@dataclass(frozen=True)
class GoldenSet:
    cases: List[GoldenCase] = setting(min_len=1)
    atol: float = setting(1e-3, ge=0)
    rtol: float = setting(1e-3, ge=0)
    quantized: QuantizedTolerance = setting(factory=QuantizedTolerance)


@dataclass(frozen=True)
class Calibration:
    dir: str
    tier: Tier
    count: int = setting(ge=1)
    layout: str = setting("NHWC", choices=("NHWC", "NCHW"))
    dtype: str = setting("float32", choices=("float32", "uint8"))


@dataclass(frozen=True)
class Source:
    """Where an imported model came from (``atlas-edge bundle create``); bundles trained by ``qat`` have none."""

    model: str = setting(doc="the model file given, by name")
    sha256: str = setting(doc="of that file as given (artifacts may be copies with fixed input shapes)")
    producer: str = setting(doc="the exporter the model's metadata names, or 'unknown'")
    preprocessing: str = setting(doc="where preprocessing came from: the producer's convention, assumed, flags")
    images: str = setting(doc="what the golden and calibration sets were made from: --images DIR or generated")


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    created: str
    task: str = setting(choices=TASKS)
    labels: List[str] = setting(min_len=1)
    input: InputSpec = setting()
    artifacts: List[Artifact] = setting(min_len=1)
    schema: int = setting(SCHEMA_VERSION, choices=(SCHEMA_VERSION,))
    preprocessing: Preprocessing = setting(factory=Preprocessing)
    postprocessing: Postprocessing = setting(factory=Postprocessing)
    files: Dict[str, FileEntry] = setting(factory=dict)
    toolchain: Dict[str, Optional[str]] = setting(factory=dict)
    golden: Optional[GoldenSet] = None
    calibration: Optional[Calibration] = None
    source: Optional[Source] = None

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        seen = set()
        for i, art in enumerate(self.artifacts):
            if art.tier not in self.input.tiers:
                problems.append(("artifacts[%d].tier" % i, "%s is not one of input.tiers %s" % (
                    list(art.tier), [list(t) for t in self.input.tiers])))
            if art.file in seen or art.file in self.files:
                problems.append(("artifacts[%d].file" % i, "%s is listed twice" % art.file))
            seen.add(art.file)
        if self.golden is not None:
            for i, case in enumerate(self.golden.cases):
                for art_file, expected in case.expected.items():
                    if art_file not in seen:
                        problems.append(("golden.cases[%d].expected" % i, "no artifact %s" % art_file))
                    if expected not in self.files:
                        problems.append(("golden.cases[%d].expected" % i, "%s is not in files" % expected))
                if case.image not in self.files:
                    problems.append(("golden.cases[%d].image" % i, "%s is not in files" % case.image))
        return problems

    def artifact(self, file: str) -> Artifact:
        for art in self.artifacts:
            if art.file == file:
                return art
        raise KeyError(file)


def parse_manifest(data: Mapping[str, Any], source: str = MANIFEST) -> Manifest:
    try:
        return parse(Manifest, data, source)
    except ConfigError as exc:
        raise BundleError(exc.errors, source) from None


def load_manifest(root: str) -> Manifest:
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise BundleError([FieldError("bundle", "not a directory: %s" % root)], root)
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except FileNotFoundError:
        raise BundleError([FieldError("manifest.json", "missing")], root) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError([FieldError("manifest.json", "not valid JSON: %s" % exc)], root) from None
    return parse_manifest(data, path)
