"""The QAT run's YAML config: a schema (unknown keys and bad values fail loudly, naming the field).

Built on :mod:`agent.config.schema`, the same typed-config layer the daemon's configs use. Example files live in
``quant/examples/`` (``digits.yaml``: classifier on scikit-learn digits; ``shapes.yaml``: the demo detector).
"""

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from agent.bundle.manifest import Postprocessing, Preprocessing  # the manifest's own schema: one definition
from agent.config.schema import load_yaml, setting
from converters.bundle_writer import CalibrationConfig, GoldenConfig  # the writer's own settings: one definition

TASKS = ("classify", "detect-yolov8")
DATA_KINDS = ("digits", "shapes", "imagefolder", "yolo")
DEVICES = ("cpu", "gpu", "ascend")


@dataclass(frozen=True)
class DataConfig:
    kind: str = setting(choices=DATA_KINDS, doc="digits and shapes are built in (no download)")
    root: Optional[str] = setting(
        None, doc="directory of an imagefolder or yolo data set (relative: to the config)"
    )
    labels: List[str] = setting(factory=list, doc="class names of a yolo data set (index = class id)")
    test_fraction: float = setting(0.25, gt=0, le=0.9, doc="held-out share when the data has no split")
    seed: int = setting(0, doc="fixes the split and generated scenes")
    train_count: int = setting(1200, ge=1, doc="shapes: generated training scenes")
    test_count: int = setting(300, ge=1, doc="shapes: generated held-out scenes (another seed)")

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if self.kind in ("imagefolder", "yolo") and not self.root:
            problems.append(("root", "required for a %s data set" % self.kind))
        if self.kind == "yolo" and not self.labels:
            problems.append(("labels", "required for a yolo data set (class names, index = class id)"))
        return problems


@dataclass(frozen=True)
class NetworkConfig:
    kind: str = setting(doc="classifier | detector | package.module:Class (a mindspore.nn.Cell)")
    options: Dict[str, Any] = setting(factory=dict, doc="keyword arguments of the network's constructor")
    checkpoint: Optional[str] = setting(None, doc="float weights to start from (relative: to the config)")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = setting(10, ge=0, doc="0: no training (use network.checkpoint as is)")
    batch_size: int = setting(32, ge=1)
    learning_rate: float = setting(3e-3, gt=0)
    weight_decay: float = setting(1e-4, ge=0)


@dataclass(frozen=True)
class QatConfig:
    enabled: bool = setting(True)
    epochs: int = setting(2, ge=1)
    batch_size: int = setting(32, ge=1)
    learning_rate: float = setting(3e-4, gt=0)
    weight_decay: float = setting(0.0, ge=0)
    per_channel: bool = setting(True, doc="per-output-channel weight ranges")
    symmetric_weights: bool = setting(True)
    quant_delay: int = setting(
        0, ge=0, doc="steps before quantization starts (ranges are observed meanwhile)"
    )


@dataclass(frozen=True)
class ExportConfig:
    tiers: List[Tuple[int, int]] = setting(
        min_len=1, doc="fixed input shapes [h, w]; the first is the main tier"
    )
    extra_batches: List[int] = setting(factory=list, doc="more batch sizes exported for the main tier")
    extra_batch_formats: List[str] = setting(
        factory=lambda: ["onnx", "mindir"], doc="formats of the extra-batch float exports (onnx, mindir)"
    )
    onnx: bool = setting(True, doc="float ONNX per tier (ATC input, OpenCV backend)")
    float_mindir: bool = setting(True)

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if len(set(map(tuple, self.tiers))) != len(self.tiers):
            problems.append(("tiers", "duplicate tier"))
        for i, tier in enumerate(self.tiers):
            if min(tier) < 16:
                problems.append(("tiers[%d]" % i, "sides must be >= 16 (got %s)" % (list(tier),)))
        for i, fmt in enumerate(self.extra_batch_formats):
            if fmt not in ("onnx", "mindir"):
                problems.append(("extra_batch_formats[%d]" % i, "must be onnx or mindir (got %r)" % fmt))
        for i, batch in enumerate(self.extra_batches):
            if not 2 <= batch <= 64:
                problems.append(("extra_batches[%d]" % i, "must be in 2..64 (got %d)" % batch))
        return problems


@dataclass(frozen=True)
class RunConfig:
    name: str = setting(doc="bundle name")
    task: str = setting(choices=TASKS)
    data: DataConfig = setting()
    network: NetworkConfig = setting()
    export: ExportConfig = setting()
    version: str = setting("1.0.0")
    labels: List[str] = setting(factory=list, doc="override the data set's class names in the bundle")
    preprocessing: Preprocessing = setting(factory=Preprocessing)
    postprocessing: Postprocessing = setting(factory=Postprocessing)
    train: TrainConfig = setting(factory=TrainConfig)
    qat: QatConfig = setting(factory=QatConfig)
    golden: GoldenConfig = setting(factory=GoldenConfig)
    calibration: CalibrationConfig = setting(factory=CalibrationConfig)
    seed: int = setting(0, doc="weight initialisation and batch order")

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if self.task == "detect-yolov8" and self.data.kind in ("digits", "imagefolder"):
            problems.append(
                ("data.kind", "%s is a classification data set, task is %s" % (self.data.kind, self.task))
            )
        if self.task == "classify" and self.data.kind in ("shapes", "yolo"):
            problems.append(
                ("data.kind", "%s is a detection data set, task is %s" % (self.data.kind, self.task))
            )
        if self.train.epochs == 0 and not self.network.checkpoint:
            problems.append(("train.epochs", "0 needs network.checkpoint (nothing to start from)"))
        return problems


def load_config(path: str) -> RunConfig:
    """Read and validate a QAT config; relative paths in it are resolved against the config's directory."""
    if not os.path.isfile(path):
        raise FileNotFoundError("config %s: no such file" % path)
    config = load_yaml(RunConfig, path)
    base = os.path.dirname(os.path.abspath(path))

    def resolve(value: Optional[str]) -> Optional[str]:
        return value if value is None or os.path.isabs(value) else os.path.normpath(os.path.join(base, value))

    import dataclasses

    data = dataclasses.replace(config.data, root=resolve(config.data.root))
    network = dataclasses.replace(config.network, checkpoint=resolve(config.network.checkpoint))
    return dataclasses.replace(config, data=data, network=network)
