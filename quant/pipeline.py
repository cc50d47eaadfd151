"""The host pipeline behind ``atlas-edge qat``: float training, SimQAT, exports, calibration, golden set,
bundle.

Order matters in three places:

* Every check of the inputs (config, tiers against the network stride, checkpoint against the network, data
  set files and labels) runs before the first training step, so a bad input fails in seconds.
* The simulated-quant MindIR is exported from the trained QAT network *before* anything is converted: Golden
  Stick's ``convert()`` replaces the fake quantizers in place. The deploy MindIR is then made from a fresh
  ``apply()`` of the same network loaded from the QAT checkpoint (``convert(net, ckpt_path)``), because
  MindSpore caches the compiled export graph per network object and would otherwise export the stale graph
  (the "Parameter that wasn't created in nn.Cell" error, naming a quantizer's min/max).
* The manifest is written last, by :func:`agent.bundle.write_manifest`, which hashes every file on disk.
"""

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from agent.preprocess import BatchPreprocessor, PreprocessSpec, letterbox
from quant.config import RunConfig
from quant.datasets import DatasetError, SplitData

log = logging.getLogger(__name__)

CALIBRATION_DIR = "calibration"
GOLDEN_DIR = "golden"
REPORT_JSON = "report.json"
REPORT_TEXT = "report.txt"
INFERENCE_BATCH = 32


class PipelineError(RuntimeError):
    """A step failed in a way the user can act on; the message says which step and why."""


class BadInput(PipelineError):
    """The config, data, network or checkpoint is wrong; raised before any training starts."""


@dataclasses.dataclass
class RunOptions:
    out_dir: str
    device: str = "cpu"
    epochs: Optional[int] = None  # overrides train.epochs
    qat_epochs: Optional[int] = None  # overrides qat.epochs
    resume: bool = False
    work_dir: Optional[str] = None  # checkpoints; default: a cache directory keyed by the output path


@dataclasses.dataclass
class ArtifactPlan:
    file: str
    tier: Tuple[int, int]
    batch: int
    format: str
    precision: str
    role: str

    def manifest_entry(self) -> Dict[str, Any]:
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
            "config_files": [],
            "toolchain": {},
        }


def preprocess_spec(config: RunConfig) -> PreprocessSpec:
    p = config.preprocessing
    return PreprocessSpec(
        pad_value=p.pad_value,
        center=p.center,
        scaleup=p.scaleup,
        color=p.color,
        mean=tuple(p.mean),
        std=tuple(p.std),
    )


def tier_name(tier: Tuple[int, int]) -> str:
    return "%dx%d" % (tier[0], tier[1])


def default_work_dir(out_dir: str) -> str:
    """Checkpoints live outside the bundle (every file in a bundle is hashed and shipped)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha256(os.path.abspath(out_dir).encode("utf-8")).hexdigest()[:12]
    return os.path.join(
        cache, "atlas-edge", "qat", "%s-%s" % (os.path.basename(os.path.abspath(out_dir)), key)
    )


# --- checks before any long work ---------------------------------------------------------------------------


def check_inputs(config: RunConfig, network: Any) -> None:
    """Tiers against the network's stride and the starting checkpoint against the network."""
    from quant.networks import load_checkpoint_strict, network_stride

    stride = network_stride(network)
    for i, tier in enumerate(config.export.tiers):
        if tier[0] % stride or tier[1] % stride:
            raise BadInput(
                "export.tiers[%d]: %s is not divisible by the network stride %d" % (i, list(tier), stride)
            )
    if config.network.checkpoint:
        try:
            load_checkpoint_strict(network, config.network.checkpoint)
        except (ValueError, FileNotFoundError) as exc:
            raise BadInput("network.checkpoint: %s" % exc) from None


def dataset_labels(config: RunConfig) -> List[str]:
    """Class names without loading the data (the network is built, and checked, from their count first)."""
    from quant import datasets

    d = config.data
    if d.kind == "digits":
        return [str(i) for i in range(10)]
    if d.kind == "shapes":
        return list(datasets.SHAPE_LABELS)
    if d.kind == "yolo":
        return list(d.labels)
    return datasets.image_folder_labels(d.root)


def load_data(config: RunConfig, spec: PreprocessSpec) -> SplitData:
    """The configured data set, letterboxed to the main tier; raises DatasetError naming the bad input."""
    from quant import datasets

    tier = tuple(config.export.tiers[0])
    d = config.data
    if d.kind == "digits":
        return datasets.load_digits(tier, spec, d.test_fraction, d.seed)
    if d.kind == "shapes":
        return datasets.load_shapes(tier, spec, d.train_count, d.test_count, d.seed)
    if d.kind == "imagefolder":
        return datasets.load_image_folder(d.root, tier, spec, d.test_fraction, d.seed)
    return datasets.load_yolo(d.root, d.labels, tier, spec, d.test_fraction, d.seed)


# --- training and evaluation --------------------------------------------------------------------------------


def _train(
    network: Any, config: RunConfig, data: SplitData, spec: PreprocessSpec, settings: Any, phase: str
) -> List[float]:
    from quant.training import train_classifier, train_detector

    if config.task == "classify":
        return train_classifier(network, data.train, spec, settings, phase)
    strides = getattr(network, "strides", (8, 16))
    return train_detector(
        network, data.train, spec, settings, tuple(config.export.tiers[0]), strides, len(data.labels), phase
    )


def evaluate(network: Any, config: RunConfig, data: SplitData, spec: PreprocessSpec) -> Dict[str, Any]:
    """top1 (classify) or map50 (detect) on the held-out split at the main tier."""
    from quant.training import predict

    outputs = predict(network, data.test.images, spec, INFERENCE_BATCH)
    return score_outputs(outputs, config, data)


def score_outputs(outputs: np.ndarray, config: RunConfig, data: SplitData) -> Dict[str, Any]:
    from quant.evaluation import detections_from_outputs, mean_average_precision, top1_accuracy

    if config.task == "classify":
        return {"top1": top1_accuracy(outputs, data.test.labels), "images": len(data.test)}
    detections = detections_from_outputs(outputs, config.postprocessing.iou)
    result = mean_average_precision(detections, data.test.boxes, data.test.classes, len(data.labels))
    return {"map50": result["map50"], "per_class_ap50": result["per_class"], "images": len(data.test)}


# --- the run ------------------------------------------------------------------------------------------------


class QatRun:
    """One ``atlas-edge qat`` run; :meth:`run` returns the report dict (also written to the bundle)."""

    def __init__(self, config: RunConfig, options: RunOptions) -> None:
        self.config = config
        self.options = options
        self.spec = preprocess_spec(config)
        self.final_out = os.path.abspath(options.out_dir)
        self.out = self.final_out  # the staging directory once the checks have passed (see run)
        self.train_images = 0
        self.work = options.work_dir or default_work_dir(options.out_dir)
        self.seconds: Dict[str, float] = {}
        self.artifacts: List[ArtifactPlan] = []
        self.checks: Dict[str, Any] = {}
        self.labels: List[str] = []

    # Each phase is timed under its name in report["seconds"].
    def _timed(self, name: str, started: float) -> None:
        self.seconds[name] = round(time.monotonic() - started, 2)

    def _fingerprint(self, phase: str) -> str:
        """Identifies what a checkpoint was trained from, so --resume never reuses a stale one."""
        from agent.schema import to_dict

        relevant = {
            "data": to_dict(self.config.data),
            "network": to_dict(self.config.network),
            "tier": list(self.config.export.tiers[0]),
            "preprocessing": to_dict(self.config.preprocessing),
            "train": to_dict(self.config.train),
            "epochs": self.options.epochs,
            "seed": self.config.seed,
        }
        if phase == "qat":
            relevant.update(qat=to_dict(self.config.qat), qat_epochs=self.options.qat_epochs)
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode("utf-8")).hexdigest()

    def _checkpoint(self, phase: str) -> str:
        return os.path.join(self.work, "%s.ckpt" % phase)

    def _resumable(self, phase: str) -> bool:
        stamp = self._checkpoint(phase) + ".json"
        if not (self.options.resume and os.path.isfile(self._checkpoint(phase)) and os.path.isfile(stamp)):
            return False
        with open(stamp, encoding="utf-8") as handle:
            return json.load(handle).get("fingerprint") == self._fingerprint(phase)

    def _save_checkpoint(self, network: Any, phase: str, metrics: Dict[str, Any]) -> None:
        import mindspore as ms

        os.makedirs(self.work, exist_ok=True)
        ms.save_checkpoint(network, self._checkpoint(phase))
        with open(self._checkpoint(phase) + ".json", "w", encoding="utf-8") as handle:
            json.dump({"fingerprint": self._fingerprint(phase), "metrics": metrics}, handle)

    def _saved_metrics(self, phase: str) -> Dict[str, Any]:
        with open(self._checkpoint(phase) + ".json", encoding="utf-8") as handle:
            return json.load(handle)["metrics"]

    def build_network(self) -> Any:
        from quant.networks import build_network

        kind = self.config.network.kind
        if kind == "classifier" and self.config.task != "classify":
            raise BadInput("network.kind classifier needs task classify")
        if kind == "detector" and self.config.task != "detect-yolov8":
            raise BadInput("network.kind detector needs task detect-yolov8")
        try:
            return build_network(kind, len(self.labels), self.config.network.options)
        except (TypeError, ValueError) as exc:
            raise BadInput("network: %s" % exc) from None

    def run(self) -> Dict[str, Any]:
        import mindspore as ms

        started_all = time.monotonic()
        config = self.config
        ms.set_context(mode=ms.GRAPH_MODE)
        ms.set_device({"cpu": "CPU", "gpu": "GPU", "ascend": "Ascend"}[self.options.device])
        ms.set_seed(config.seed)

        # 1. Everything that can be wrong with the input, cheapest first, before any training.
        started = time.monotonic()
        self._check_out_dir()
        self.labels = list(config.labels) or dataset_labels(config)
        network = self.build_network()
        check_inputs(config, network)
        data = load_data(config, self.spec)
        if len(self.labels) != len(data.labels):
            raise BadInput(
                "labels: %d names given, the data set has %d classes" % (len(self.labels), len(data.labels))
            )
        self._timed("load_and_check", started)
        self.train_images = len(data.train)
        log.info(
            "data: %d training and %d held-out images, %d classes; network %s, %d parameters",
            len(data.train),
            len(data.test),
            len(self.labels),
            type(network).__name__,
            _parameter_count(network),
        )
        # The bundle is assembled in a staging directory next to --out and moved into place at the end, so a
        # failed run leaves an earlier bundle untouched.
        self.out = self.final_out + ".partial"
        if os.path.isdir(self.out):
            shutil.rmtree(self.out)
        os.makedirs(self.out)

        # 2. Float network.
        float_metrics = self._float_phase(network, data)
        # 3. Quantization-aware fine-tuning (Golden Stick SimQAT).
        qat_network, qat_metrics = self._qat_phase(network, data)
        # 4. Exports, each read back by its runtime.
        started = time.monotonic()
        self._export_all(qat_network, data)
        self._timed("export", started)
        # 5. Calibration set and golden set.
        started = time.monotonic()
        calibration = self._write_calibration(data)
        golden = self._write_golden(data)
        self._timed("calibration_and_golden", started)
        # 6. Report and manifest (last: it hashes everything written above).
        self.seconds["total"] = round(time.monotonic() - started_all, 2)
        report = self._report(network, float_metrics, qat_metrics)
        self._write_report(report)
        self._write_manifest(calibration, golden)
        self._publish()
        log.info("bundle written to %s", self.final_out)
        return report

    def _check_out_dir(self) -> None:
        """An existing output directory must be a bundle (or empty): never replace an unrelated directory."""
        out = self.final_out
        if os.path.exists(out) and not os.path.isdir(out):
            raise BadInput("--out %s exists and is not a directory" % out)
        if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "manifest.json")):
            raise BadInput("--out %s exists, is not empty and is not a bundle; refusing to replace it" % out)

    def _publish(self) -> None:
        """Swap the finished staging directory in for --out."""
        if os.path.isdir(self.final_out):
            shutil.rmtree(self.final_out)
        os.replace(self.out, self.final_out)
        self.out = self.final_out

    def _float_phase(self, network: Any, data: SplitData) -> Dict[str, Any]:
        import mindspore as ms

        from quant.training import TrainSettings

        config = self.config
        started = time.monotonic()
        epochs = config.train.epochs if self.options.epochs is None else self.options.epochs
        if self._resumable("float"):
            ms.load_param_into_net(network, ms.load_checkpoint(self._checkpoint("float")))
            log.info("float: resumed from %s", self._checkpoint("float"))
            history = self._saved_metrics("float").get("loss_history", [])
        elif epochs > 0:
            t = config.train
            settings = TrainSettings(epochs, t.batch_size, t.learning_rate, t.weight_decay, config.seed)
            history = _train(network, config, data, self.spec, settings, "float")
        else:
            history = []
        self._timed("float_train", started)
        started = time.monotonic()
        metrics = evaluate(network, config, data, self.spec)
        metrics["epochs"] = epochs
        metrics["loss_history"] = [round(v, 5) for v in history]
        self._timed("float_eval", started)
        self._save_checkpoint(network, "float", metrics)
        log.info("float: %s", _metric_line(metrics))
        return metrics

    def _qat_phase(self, network: Any, data: SplitData) -> Tuple[Any, Optional[Dict[str, Any]]]:
        import mindspore as ms

        from quant.fake_quant import apply_quantization, build_algorithm, refresh_weight_ranges
        from quant.training import TrainSettings

        config = self.config
        if not config.qat.enabled:
            return None, None
        started = time.monotonic()
        q = config.qat
        algorithm = build_algorithm(self.options.device, q.per_channel, q.symmetric_weights, q.quant_delay)
        # apply() wraps the float network's own layers: the QAT network shares (and trains) its parameters, so
        # the float exports are made first from the saved float checkpoint (see _export_all).
        qat_network = apply_quantization(algorithm, network, self.work)
        epochs = q.epochs if self.options.qat_epochs is None else self.options.qat_epochs
        if self._resumable("qat"):
            ms.load_param_into_net(qat_network, ms.load_checkpoint(self._checkpoint("qat")))
            history = self._saved_metrics("qat").get("loss_history", [])
            log.info("qat: resumed from %s", self._checkpoint("qat"))
        else:
            settings = TrainSettings(
                epochs, q.batch_size, q.learning_rate, q.weight_decay, config.seed + 1, warmup_epochs=0.0
            )
            history = _train(qat_network, config, data, self.spec, settings, "qat")
        refresh_weight_ranges(qat_network)
        self._timed("qat_train", started)
        started = time.monotonic()
        metrics = evaluate(qat_network, config, data, self.spec)
        metrics["epochs"] = epochs
        metrics["loss_history"] = [round(v, 5) for v in history]
        self._timed("qat_eval", started)
        self._save_checkpoint(qat_network, "qat", metrics)
        log.info("qat (simulated int8): %s", _metric_line(metrics))
        return qat_network, metrics

    # --- exports --------------------------------------------------------------------------------------------

    def _export_all(self, qat_network: Any, data: SplitData) -> None:
        import mindspore as ms

        from quant.export import check_export, export_mindir, export_onnx, mindir_operators

        config = self.config
        tiers = [tuple(t) for t in config.export.tiers]
        main = tiers[0]
        # The float network object now carries QAT-trained weights (apply() shares parameters): rebuild the
        # float network from its checkpoint for the float exports.
        float_network = self.build_network()
        ms.load_param_into_net(float_network, ms.load_checkpoint(self._checkpoint("float")))
        float_network.set_train(False)
        rng = np.random.default_rng(config.seed)
        for tier in tiers:
            batches = [1] + (list(config.export.extra_batches) if tier == main else [])
            for batch in batches:
                suffix = tier_name(tier) + ("" if batch == 1 else "_b%d" % batch)
                sample = self._sample_input(data, tier, batch, rng)
                expected = float_network(ms.Tensor(sample)).asnumpy()
                if config.export.float_mindir:
                    path = export_mindir(
                        float_network, sample.shape, os.path.join(self.out, "model_%s.mindir" % suffix)
                    )
                    self.checks[os.path.basename(path)] = check_export(path, sample, expected)
                    self.artifacts.append(
                        ArtifactPlan(os.path.basename(path), tier, batch, "mindir", "float32", "serve")
                    )
                if config.export.onnx:
                    path = export_onnx(
                        float_network, sample.shape, os.path.join(self.out, "model_%s.onnx" % suffix)
                    )
                    self.checks[os.path.basename(path)] = check_export(path, sample, expected)
                    self.artifacts.append(
                        ArtifactPlan(os.path.basename(path), tier, batch, "onnx", "float32", "serve")
                    )
        if qat_network is None:
            return
        # Simulated-quant MindIRs: from the trained QAT network, before any convert().
        qat_network.set_train(False)
        for tier in tiers:
            sample = self._sample_input(data, tier, 1, rng)
            expected = qat_network(ms.Tensor(sample)).asnumpy()
            path = export_mindir(
                qat_network, sample.shape, os.path.join(self.out, "model_%s.int8sim.mindir" % tier_name(tier))
            )
            self.checks[os.path.basename(path)] = check_export(path, sample, expected)
            self.artifacts.append(
                ArtifactPlan(os.path.basename(path), tier, 1, "mindir", "int8-sim", "serve")
            )
        self.checks["int8sim_test_split"] = self._sim_mindir_agreement(qat_network, data)
        # Deploy MindIRs: convert() a fresh apply() loaded from the QAT checkpoint (see the module docstring).
        from quant.fake_quant import apply_quantization, build_algorithm

        q = config.qat
        fresh_algorithm = build_algorithm(
            self.options.device, q.per_channel, q.symmetric_weights, q.quant_delay
        )
        fresh = apply_quantization(fresh_algorithm, self.build_network(), self.work)
        deploy = fresh_algorithm.convert(fresh, ckpt_path=self._checkpoint("qat"))
        deploy.set_train(False)
        for tier in tiers:
            path = export_mindir(
                deploy, (1, 3) + tier, os.path.join(self.out, "model_%s.deploy.mindir" % tier_name(tier))
            )
            ops = mindir_operators(path)
            if not ops.get("FakeQuantParam"):
                raise PipelineError("%s: no FakeQuantParam nodes after convert()" % path)
            self.checks[os.path.basename(path)] = {"FakeQuantParam": ops["FakeQuantParam"]}
            self.artifacts.append(ArtifactPlan(os.path.basename(path), tier, 1, "mindir", "int8", "convert"))

    def _sample_input(
        self, data: SplitData, tier: Tuple[int, int], batch: int, rng: np.random.Generator
    ) -> np.ndarray:
        """Held-out images letterboxed to ``tier`` and normalised: realistic inputs for read-back checks."""
        picks = rng.choice(len(data.originals), size=batch, replace=len(data.originals) < batch)
        batcher = BatchPreprocessor(self.spec, tier, max_batch=batch)
        for slot, index in enumerate(picks):
            batcher.fill(slot, data.originals[int(index)])
        return batcher.batch.copy()

    def _sim_mindir_agreement(self, qat_network: Any, data: SplitData) -> Dict[str, Any]:
        """The main tier's simulated-quant MindIR on the whole held-out split, against the QAT network."""
        import mindspore as ms
        from mindspore import nn

        from quant.datasets import network_input
        from quant.training import predict

        main = tuple(self.config.export.tiers[0])
        graph = nn.GraphCell(ms.load(os.path.join(self.out, "model_%s.int8sim.mindir" % tier_name(main))))
        network_out = predict(qat_network, data.test.images, self.spec, INFERENCE_BATCH)
        mindir_out = np.concatenate(
            [
                graph(ms.Tensor(network_input(data.test.images[i : i + 1], self.spec))).asnumpy()
                for i in range(len(data.test))
            ]
        )
        result: Dict[str, Any] = {
            "images": len(data.test),
            "max_abs_diff": float(np.max(np.abs(mindir_out - network_out))),
        }
        if self.config.task == "classify":
            result["top1_agreement"] = float(np.mean(mindir_out.argmax(1) == network_out.argmax(1)))
        result["metrics"] = score_outputs(mindir_out, self.config, data)
        log.info(
            "int8-sim MindIR vs QAT network on %d held-out images: %s",
            len(data.test),
            {k: v for k, v in result.items() if k != "metrics"},
        )
        return result

    # --- calibration and golden set -------------------------------------------------------------------------

    def _write_calibration(self, data: SplitData) -> Dict[str, Any]:
        """NHWC float32 .bin files at the main tier, normalised as the bundle says (converter_lite input)."""
        from quant.datasets import network_input

        count = min(self.config.calibration.count, len(data.train))
        directory = os.path.join(self.out, CALIBRATION_DIR)
        os.makedirs(directory, exist_ok=True)
        picks = np.random.default_rng(self.config.seed + 2).choice(len(data.train), size=count, replace=False)
        tensors = network_input(data.train.images[np.sort(picks)], self.spec, layout="NHWC")
        for i, tensor in enumerate(tensors):
            tensor.astype(np.float32).tofile(os.path.join(directory, "calib_%04d.bin" % i))
        return {
            "dir": CALIBRATION_DIR,
            "layout": "NHWC",
            "dtype": "float32",
            "tier": list(self.config.export.tiers[0]),
            "count": count,
        }

    def _write_golden(self, data: SplitData) -> Dict[str, Any]:
        """Per tier: letterboxed uint8 BGR held-out images and each runnable batch-1 artifact output 0."""
        from quant.export import run_mindir, run_onnx_opencv

        g = self.config.golden
        directory = os.path.join(self.out, GOLDEN_DIR)
        os.makedirs(directory, exist_ok=True)
        cases = []
        index = 0
        for tier in [tuple(t) for t in self.config.export.tiers]:
            runnable = [a for a in self.artifacts if a.tier == tier and a.batch == 1 and a.role == "serve"]
            for original in data.originals[: g.cases_per_tier]:
                image, _ = letterbox(
                    original,
                    tier,
                    pad_value=self.spec.pad_value,
                    scaleup=self.spec.scaleup,
                    center=self.spec.center,
                )
                image_file = "%s/case%d.npy" % (GOLDEN_DIR, index)
                np.save(os.path.join(self.out, image_file), image)
                batcher = BatchPreprocessor(self.spec, tier, max_batch=1)
                batcher.fill_letterboxed(0, image)
                expected = {}
                for art in runnable:
                    runner = run_onnx_opencv if art.format == "onnx" else run_mindir
                    output = runner(os.path.join(self.out, art.file), batcher.batch)
                    out_file = "%s/case%d.%s.npy" % (GOLDEN_DIR, index, art.file)
                    np.save(os.path.join(self.out, out_file), output.astype(np.float32))
                    expected[art.file] = out_file
                cases.append({"image": image_file, "tier": list(tier), "expected": expected})
                index += 1
        return {"atol": g.atol, "rtol": g.rtol, "cases": cases}

    # --- report and manifest --------------------------------------------------------------------------------

    def _report(
        self, network: Any, float_metrics: Dict[str, Any], qat_metrics: Optional[Dict[str, Any]]
    ) -> Dict[str, Any]:
        from quant.networks import anchor_points

        config = self.config
        main = tuple(config.export.tiers[0])
        main_float = "model_%s.mindir" % tier_name(main)
        shapes = {}
        for tier in config.export.tiers:
            if config.task == "classify":
                output = [1, len(self.labels)]
            else:
                cells = len(anchor_points(tuple(tier), getattr(network, "strides", (8, 16)))[1])
                output = [1, 4 + len(self.labels), cells]
            shapes[tier_name(tier)] = {"input": [1, 3] + list(tier), "output0": output}
        return {
            "name": config.name,
            "version": config.version,
            "task": config.task,
            "labels": self.labels,
            "device": self.options.device,
            "network": {
                "kind": config.network.kind,
                "class": type(network).__name__,
                "parameters": _parameter_count(network),
                "float_mindir_bytes": _size(os.path.join(self.out, main_float)),
            },
            "data": {
                "kind": config.data.kind,
                "train_images": self.train_images,
                "test_images": float_metrics.get("images"),
            },
            "float": float_metrics,
            "qat": qat_metrics,
            "delta": _delta(float_metrics, qat_metrics),
            "tiers": shapes,
            "artifacts": {a.file: _size(os.path.join(self.out, a.file)) for a in self.artifacts},
            "checks": self.checks,
            "seconds": self.seconds,
            "toolchain": toolchain_versions(),
        }

    def _write_report(self, report: Dict[str, Any]) -> None:
        with open(os.path.join(self.out, REPORT_JSON), "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
        text = summary_text(report)
        with open(os.path.join(self.out, REPORT_TEXT), "w", encoding="utf-8") as handle:
            handle.write(text)
        print(text, end="")

    def _write_manifest(self, calibration: Dict[str, Any], golden: Dict[str, Any]) -> None:
        from agent.bundle import write_manifest

        config = self.config
        p = config.preprocessing
        manifest = {
            "schema": 1,
            "name": config.name,
            "version": config.version,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "task": config.task,
            "labels": self.labels,
            "input": {
                "name": "images",
                "layout": "NCHW",
                "dtype": "float32",
                "tiers": [list(t) for t in config.export.tiers],
            },
            "preprocessing": {
                "letterbox": {"pad_value": p.pad_value, "center": p.center, "scaleup": p.scaleup},
                "color": p.color,
                "mean": list(p.mean),
                "std": list(p.std),
            },
            "postprocessing": dataclasses.asdict(config.postprocessing),
            "artifacts": [dict(a.manifest_entry(), input_color=p.color) for a in self.artifacts],
            "toolchain": toolchain_versions(),
            "golden": golden,
            "calibration": calibration,
        }
        write_manifest(self.out, manifest)


def _parameter_count(network: Any) -> int:
    from quant.networks import parameter_count

    return parameter_count(network)


def _size(path: str) -> Optional[int]:
    return os.path.getsize(path) if os.path.isfile(path) else None


def _metric_line(metrics: Dict[str, Any]) -> str:
    if "top1" in metrics:
        return "top-1 %.2f %% on %d held-out images" % (100 * metrics["top1"], metrics["images"])
    return "mAP@0.5 %.4f on %d held-out images" % (metrics["map50"], metrics["images"])


def _delta(
    float_metrics: Dict[str, Any], qat_metrics: Optional[Dict[str, Any]]
) -> Optional[Dict[str, float]]:
    if not qat_metrics:
        return None
    key = "top1" if "top1" in float_metrics else "map50"
    return {key + "_points": round(100 * (qat_metrics[key] - float_metrics[key]), 3)}


def toolchain_versions() -> Dict[str, Optional[str]]:
    import cv2
    import mindspore

    try:
        from mindspore_gs.version import __version__ as gs_version
    except ImportError:
        gs_version = None
    return {
        "mindspore": mindspore.__version__,
        "mindspore_gs": gs_version,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "opencv": cv2.__version__,
    }


def summary_text(report: Dict[str, Any]) -> str:
    """The readable summary printed at the end of a run and saved as report.txt."""
    lines = ["atlas-edge qat: %s %s (%s)" % (report["name"], report["version"], report["task"])]
    net = report["network"]
    lines.append(
        "network   %s (%s), %d parameters, float MindIR %s bytes"
        % (net["class"], net["kind"], net["parameters"], net["float_mindir_bytes"])
    )
    lines.append("float     " + _metric_line(report["float"]))
    if report["qat"]:
        lines.append("qat int8  " + _metric_line(report["qat"]) + "  (%s)" % report["delta"])
    sim = report["checks"].get("int8sim_test_split")
    if sim:
        agreement = sim.get("top1_agreement")
        lines.append(
            "int8-sim MindIR vs QAT network: max |diff| %.3g%s"
            % (
                sim["max_abs_diff"],
                "" if agreement is None else ", top-1 agreement %.2f %%" % (100 * agreement),
            )
        )
    for tier, shape in report["tiers"].items():
        lines.append("tier %-9s input %s -> output0 %s" % (tier, shape["input"], shape["output0"]))
    lines.append("artifacts:")
    for name, size in report["artifacts"].items():
        lines.append("  %-40s %10s bytes" % (name, size))
    lines.append("seconds   " + ", ".join("%s %.1f" % kv for kv in report["seconds"].items()))
    lines.append("toolchain " + ", ".join("%s %s" % kv for kv in report["toolchain"].items()))
    return "\n".join(lines) + "\n"


__all__ = ["BadInput", "DatasetError", "PipelineError", "QatRun", "RunOptions", "summary_text"]
