"""The host pipeline behind ``atlas-edge qat``: float training, SimQAT, exports, golden set, bundle.

Order matters in three places:

* Every check of the inputs (config, tiers against the network stride, checkpoint against the network, data
  set files and labels) runs before the first training step, so a bad input fails in seconds.
* The simulated-quant MindIR is exported from the trained QAT network *before* anything is converted: Golden
  Stick's ``convert()`` replaces the fake quantizers in place. The deploy MindIR is then made from a fresh
  ``apply()`` of the same network loaded from the QAT checkpoint (``convert(net, ckpt_path)``), because
  MindSpore caches the compiled export graph per network object and would otherwise export the stale graph
  (the "Parameter that wasn't created in nn.Cell" error, naming a quantizer's min/max).
* The manifest is written last, by :func:`agent.bundle.verify.write_manifest`, which hashes every file on disk.
"""

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from agent.config.schema import to_dict
from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.preprocess import PreprocessSpec
from converters.bundle_writer import ArtifactPlan, tier_name, write_calibration, write_golden, write_manifest_for
from converters.toolrun import toolchain_versions
from quant.config import RunConfig
from quant.datasets import DatasetError, SplitData
from quant.report import metric_delta, metric_line, write_report

log = logging.getLogger(__name__)

INFERENCE_BATCH = 32  # images per inference call in evaluation (fixed, so each network compiles once)


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


def preprocess_spec(config: RunConfig) -> PreprocessSpec:
    return config.preprocessing  # the manifest's type, checked when the run config was parsed


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
        self.resumed: List[str] = []  # phases loaded from checkpoints (--resume)

    # Each phase is timed under its name in report["seconds"].
    def _timed(self, name: str, started: float) -> None:
        self.seconds[name] = round(time.monotonic() - started, 2)

    def _fingerprint(self, phase: str) -> str:
        """Identifies what a checkpoint was trained from, so --resume never reuses a stale one."""
        from agent.config.schema import to_dict

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

        from quant.training import use_graph_mode_on

        started_all = time.monotonic()
        config = self.config
        use_graph_mode_on({"cpu": "CPU", "gpu": "GPU", "ascend": "Ascend"}[self.options.device])
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

        try:
            report = self._produce(network, data, started_all)
            self._publish()
        except BaseException:
            shutil.rmtree(self.out, ignore_errors=True)  # a failed run leaves no half-written bundle behind
            raise
        log.info("bundle written to %s", self.final_out)
        return report

    def _produce(self, network: Any, data: SplitData, started_all: float) -> Dict[str, Any]:
        """Steps 2-6, into the staging directory: train, quantize, export, calibrate, golden set, report."""
        config = self.config
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
        calibration = write_calibration(
            self.out, data.train.images, self.spec, config.calibration.count, config.seed + 2
        )
        tiers = [tuple(t) for t in config.export.tiers]
        g = config.golden
        golden = write_golden(
            self.out, data.originals, self.artifacts, self.spec, tiers, g.cases_per_tier, g.atol, g.rtol
        )
        self._timed("calibration_and_golden", started)
        # 6. Report and manifest (last: it hashes everything written above).
        self.seconds["total"] = round(time.monotonic() - started_all, 2)
        report = self._report(network, float_metrics, qat_metrics)
        print(write_report(self.out, report), end="")
        write_manifest_for(
            self.out, config.name, config.version, config.task, self.labels, config.export.tiers,
            config.preprocessing, to_dict(config.postprocessing), self.artifacts, calibration, golden,
            report["toolchain"])
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

    def _train_or_resume(self, phase: str, network: Any, train: Any) -> List[float]:
        """Run ``train()``; or, with --resume and a checkpoint of the same settings, load it instead and take
        the loss history and training time recorded with it (so the report still shows what training cost)."""
        import mindspore as ms

        started = time.monotonic()
        if self._resumable(phase):
            ms.load_param_into_net(network, ms.load_checkpoint(self._checkpoint(phase)))
            saved = self._saved_metrics(phase)
            log.info("%s: resumed from %s", phase, self._checkpoint(phase))
            self.seconds[phase + "_train"] = saved.get("train_seconds", 0.0)
            self.resumed.append(phase)
            return list(saved.get("loss_history", []))
        history = train()
        self._timed(phase + "_train", started)
        return history

    def _float_phase(self, network: Any, data: SplitData) -> Dict[str, Any]:
        from quant.training import TrainSettings

        config = self.config
        epochs = config.train.epochs if self.options.epochs is None else self.options.epochs
        t = config.train
        settings = TrainSettings(epochs, t.batch_size, t.learning_rate, t.weight_decay, config.seed)

        def train() -> List[float]:
            return _train(network, config, data, self.spec, settings, "float") if epochs > 0 else []

        history = self._train_or_resume("float", network, train)
        return self._evaluate_phase("float", network, data, epochs, history, "float")

    def _evaluate_phase(self, phase: str, network: Any, data: SplitData, epochs: int, history: List[float],
                        label: str) -> Dict[str, Any]:
        """Evaluate a trained phase, record its metrics and time, and checkpoint it with them."""
        started = time.monotonic()
        metrics = evaluate(network, self.config, data, self.spec)
        metrics.update(epochs=epochs, loss_history=[round(v, 5) for v in history])
        metrics["train_seconds"] = self.seconds["%s_train" % phase]
        self._timed("%s_eval" % phase, started)
        self._save_checkpoint(network, phase, metrics)
        log.info("%s: %s", label, metric_line(metrics))
        return metrics

    def _qat_phase(self, network: Any, data: SplitData) -> Tuple[Any, Optional[Dict[str, Any]]]:
        from quant.fake_quant import apply_quantization, build_algorithm, refresh_weight_ranges
        from quant.training import TrainSettings

        config = self.config
        if not config.qat.enabled:
            return None, None
        q = config.qat
        algorithm = build_algorithm(self.options.device, q.per_channel, q.symmetric_weights, q.quant_delay)
        # apply() wraps the float network's own layers: the QAT network shares (and trains) its parameters, so
        # the float exports rebuild the float network from its checkpoint (see _export_all).
        qat_network = apply_quantization(algorithm, network, self.work)
        epochs = q.epochs if self.options.qat_epochs is None else self.options.qat_epochs
        settings = TrainSettings(
            epochs, q.batch_size, q.learning_rate, q.weight_decay, config.seed + 1, warmup_epochs=0.0
        )

        def train() -> List[float]:
            return _train(qat_network, config, data, self.spec, settings, "qat")

        history = self._train_or_resume("qat", qat_network, train)
        refresh_weight_ranges(qat_network)
        return qat_network, self._evaluate_phase("qat", qat_network, data, epochs, history,
                                                 "qat (simulated int8)")

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
                formats = ("onnx", "mindir") if batch == 1 else tuple(config.export.extra_batch_formats)
                if config.export.float_mindir and "mindir" in formats:
                    path = export_mindir(
                        float_network, sample.shape, os.path.join(self.out, "model_%s.mindir" % suffix)
                    )
                    self.checks[os.path.basename(path)] = check_export(path, sample, expected)
                    self.artifacts.append(
                        ArtifactPlan(os.path.basename(path), tier, batch, "mindir", "float32", "serve")
                    )
                if config.export.onnx and "onnx" in formats:
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
        self._export_int8_onnx(qat_network, data)

    def _export_int8_onnx(self, qat_network: Any, data: SplitData) -> None:
        """``model_<tier>.int8.onnx`` per tier with the QAT scales, read back against the int8 simulation
        (:func:`quant.int8_artifact.write_int8_artifacts`)."""
        from quant.int8_artifact import write_int8_artifacts
        from quant.int8_onnx import Int8ExportError

        try:
            checks, artifacts = write_int8_artifacts(
                self.out, self.config, qat_network, data, self.spec,
                lambda outputs: score_outputs(outputs, self.config, data), INFERENCE_BATCH)
        except Int8ExportError as exc:
            raise PipelineError(str(exc)) from None
        self.checks.update(checks)
        self.artifacts.extend(artifacts)

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
            "delta": metric_delta(float_metrics, qat_metrics),
            "tiers": shapes,
            "artifacts": {a.file: _size(os.path.join(self.out, a.file)) for a in self.artifacts},
            "checks": self.checks,
            "seconds": self.seconds,
            "resumed_phases": self.resumed,
            "toolchain": toolchain_versions(),
        }


def _parameter_count(network: Any) -> int:
    from quant.networks import parameter_count

    return parameter_count(network)


def _size(path: str) -> Optional[int]:
    return os.path.getsize(path) if os.path.isfile(path) else None


__all__ = ["BadInput", "DatasetError", "PipelineError", "QatRun", "RunOptions"]
