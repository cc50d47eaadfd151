"""A bundle loaded for serving: one backend and one preallocated preprocessor per fixed-shape tier.

Everything heavy (runtime contexts, models, buffers) is built in :meth:`LoadedModel.load`, once; a frame only
costs a letterbox into a reused buffer, the backend call and a vectorised decode. The golden-set self-test
runs the box's own preprocessing and backend on the host's reference images, so a model whose numbers drift
on this box (wrong SoC build, double normalisation, colour swap) never serves.
"""

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from agent._util.npy import load_npy
from agent.bundle.manifest import Artifact, BundleError, Tier
from agent.bundle.verify import Bundle
from agent.config.device_config import DeviceConfig
from agent.config.schema import FieldError
from agent.pipeline.artifacts import pick_tier, select_artifacts
from agent.pipeline.backends import create_backend
from agent.pipeline.backends.base import Backend, BackendOptions, TensorSpec
from agent.pipeline.golden import FLOAT_PRECISIONS, QUANTIZED_PRECISIONS, judge_quantized, judge_strict
from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.postprocess import decode
from agent.pipeline.preprocess import LetterboxPlan, PreprocessSpec, scale_boxes

log = logging.getLogger(__name__)

# (backend name, artifact path, input spec, options) -> a backend not loaded yet
BackendFactory = Callable[[str, str, TensorSpec, BackendOptions], Backend]


@dataclass(frozen=True)
class Thresholds:
    conf: float
    iou: float
    max_det: int
    top_k: int


@dataclass
class FrameResult:
    """What one frame produced: detections in original-image pixels (or top-k classes), and where time went."""

    tier: Tier
    detections: Optional[np.ndarray] = None  # (k, 6): x1, y1, x2, y2, score, class_id in source pixels
    classes: Optional[List[Tuple[int, float]]] = None
    timings_ms: Dict[str, float] = field(default_factory=dict)


@dataclass
class GoldenReport:
    passed: bool
    cases: int
    max_abs_diff: float
    failures: List[str]
    quantized_cases: int = 0  # judged by the quantized rule (agent/pipeline/golden.py)
    rms_ratio: float = 0.0  # the worst of those: RMS difference over the case's int8-vs-float error

    def summary(self) -> str:
        """``4 case(s), max abs diff 1.06; 4 judged as quantized, worst RMS ratio 0.0555``: for logs and the CLI."""
        text = "%d case(s), max abs diff %.3g" % (self.cases, self.max_abs_diff)
        if self.quantized_cases:
            text += "; %d judged as quantized, worst RMS ratio %.3g" % (self.quantized_cases, self.rms_ratio)
        return text


# Input buffers per tier: the serving loop fills one while the backend reads the other (agent/pipeline/serving.py).
BUFFERS_PER_TIER = 2


@dataclass
class _TierRunner:
    artifact: Artifact
    backend: Backend
    buffers: List[BatchPreprocessor]  # preallocated input batches, used in turn
    turn: int = 0

    @property
    def preprocessor(self) -> BatchPreprocessor:
        """The first buffer: warm-up and the golden check use it (never while serving overlaps)."""
        return self.buffers[0]

    def next_buffer(self) -> BatchPreprocessor:
        buffer = self.buffers[self.turn]
        self.turn = (self.turn + 1) % len(self.buffers)
        return buffer


@dataclass
class PreparedChunk:
    """Up to one artifact batch of frames, letterboxed into one of its tier's input buffers, ready to run.

    The buffer is reused :data:`BUFFERS_PER_TIER` chunks of the same tier later, so a chunk must have run
    before that many more of its tier are prepared.
    """

    runner: _TierRunner
    buffer: BatchPreprocessor
    plans: List[LetterboxPlan]
    preprocess_ms: float

    @property
    def tier(self) -> Tier:
        return self.runner.artifact.tier


class LoadedModel:
    """Serve one verified bundle on this box with one backend."""

    def __init__(self, bundle: Bundle, device: DeviceConfig, backend: str, max_batch: int = 1,
                 backend_factory: Optional[BackendFactory] = None, precision: str = "auto") -> None:
        """``backend_factory`` builds each tier's backend (default ``create_backend``; benchmarks pass stand-ins);
        ``precision`` is the daemon config's ``model.precision`` (auto, int8, float)."""
        self.bundle = bundle
        self.backend_factory = backend_factory
        self.device = device
        self.backend_name = backend
        self.max_batch = max_batch
        self.manifest = bundle.manifest
        self.spec: PreprocessSpec = self.manifest.preprocessing  # parsed and checked once, with the manifest
        self.artifacts = select_artifacts(bundle, device, backend, batch=max_batch, precision=precision)
        self.tiers: List[Tier] = sorted(self.artifacts)
        self._runners: Dict[Tier, _TierRunner] = {}
        self._tier_of_size: Dict[Tuple[int, int], Tier] = {}
        post = self.manifest.postprocessing
        self.thresholds = Thresholds(conf=post.conf, iou=post.iou, max_det=post.max_det, top_k=post.top_k)

    @property
    def label(self) -> str:
        return self.bundle.label

    @property
    def precision(self) -> str:
        """The precision that runs: ``int8``, ``float32``, ... (tiers that differ: joined with ``+``)."""
        return "+".join(sorted({art.precision for art in self.artifacts.values()}))

    def identity(self) -> Dict[str, str]:
        """The model block of every result: which model ran, on which backend, at which precision."""
        return {"name": self.manifest.name, "version": self.manifest.version, "backend": self.backend_name,
                "precision": self.precision}

    def load(self) -> None:
        """Build every backend and buffer now; on failure release what was built and raise."""
        try:
            for tier, art in self.artifacts.items():
                options = BackendOptions.for_device(self.device, target=art.target)
                h, w = tier
                shape = (art.batch, 3, h, w) if art.input_layout == "NCHW" else (art.batch, h, w, 3)
                spec = TensorSpec(name=self.manifest.input.name, shape=shape, dtype=art.input_dtype)
                factory = self.backend_factory or create_backend  # looked up now: tests patch the module's name
                backend = factory(self.backend_name, self.bundle.path(art.file), spec, options)
                backend.load()
                buffers = [BatchPreprocessor(
                    self.spec, tier, art.batch, input_dtype=art.input_dtype, input_layout=art.input_layout,
                    input_color=art.input_color, normalize=art.normalize_on == "host")
                    for _ in range(BUFFERS_PER_TIER)]
                self._runners[tier] = _TierRunner(art, backend, buffers)
                log.info("loaded %s tier %dx%d with %s (%s, batch %d)", self.label, h, w, self.backend_name,
                         art.file, art.batch)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        for runner in self._runners.values():
            try:
                runner.backend.close()
            except Exception:  # closing must go on for the other tiers
                log.exception("closing %s failed", runner.artifact.file)
        self._runners.clear()

    def set_thresholds(self, conf: Optional[float] = None, iou: Optional[float] = None,
                       max_det: Optional[int] = None, top_k: Optional[int] = None) -> None:
        """Config overrides; None keeps the bundle's default."""
        post = self.manifest.postprocessing
        self.thresholds = Thresholds(
            conf=post.conf if conf is None else conf, iou=post.iou if iou is None else iou,
            max_det=post.max_det if max_det is None else max_det, top_k=post.top_k if top_k is None else top_k)

    def tier_for(self, src_hw: Tuple[int, int]) -> Tier:
        tier = self._tier_of_size.get(src_hw)
        if tier is None:
            tier = self._tier_of_size[src_hw] = pick_tier(self.tiers, src_hw)
        return tier

    def infer_frames(self, images: List[np.ndarray]) -> List[FrameResult]:
        """Run frames (BGR, any sizes) one chunk after another and return one result per frame, in order.

        The serving loop overlaps the same steps (:meth:`chunks`, :meth:`prepare`, :meth:`run`, :meth:`decode`)
        across chunks; this is the plain sequence, for benchmarks and tools.
        """
        results: List[Optional[FrameResult]] = [None] * len(images)
        for tier, indices in self.chunks(images):
            chunk = self.prepare(tier, [images[i] for i in indices])
            t1 = time.perf_counter()
            outputs = self.run(chunk)
            t2 = time.perf_counter()
            decoded = self.decode(chunk, outputs)
            t3 = time.perf_counter()
            n = len(indices)
            timings = {"preprocess": chunk.preprocess_ms / n, "infer": (t2 - t1) * 1e3 / n,
                       "postprocess": (t3 - t2) * 1e3 / n}
            for slot, result in zip(indices, decoded):
                result.timings_ms.update(timings)
                results[slot] = result
        return [r for r in results if r is not None]

    def chunks(self, images: List[np.ndarray]) -> List[Tuple[Tier, List[int]]]:
        """Frames grouped by tier, each group cut into runs of the tier's fixed artifact batch (indices)."""
        groups: Dict[Tier, List[int]] = {}
        for index, image in enumerate(images):
            groups.setdefault(self.tier_for(image.shape[:2]), []).append(index)
        out = []
        for tier, indices in groups.items():
            step = self._runners[tier].artifact.batch
            out.extend((tier, indices[start:start + step]) for start in range(0, len(indices), step))
        return out

    def prepare(self, tier: Tier, images: List[np.ndarray]) -> PreparedChunk:
        """Letterbox up to one artifact batch of frames into the tier's next input buffer.

        A short chunk leaves the buffer's last slots stale; their outputs are discarded by :meth:`decode`.
        """
        runner = self._runners[tier]
        buffer = runner.next_buffer()
        started = time.perf_counter()
        plans = [buffer.fill(i, image) for i, image in enumerate(images)]
        return PreparedChunk(runner, buffer, plans, (time.perf_counter() - started) * 1e3)

    def run(self, chunk: PreparedChunk) -> List[np.ndarray]:
        """The backend call alone (the serving loop makes it on its backend thread)."""
        return chunk.runner.backend.infer(chunk.buffer.batch)

    def decode(self, chunk: PreparedChunk, outputs: List[np.ndarray], floor: Optional[float] = None
               ) -> List[FrameResult]:
        """Detections (or classes) per frame of the chunk, boxes in source pixels; timings are the caller's.

        ``floor``: decode down to this confidence instead (a shadow run's low threshold). The detections at or
        above ``conf`` are the same either way: non-maximum suppression keeps a box only against higher-scored
        ones, so the extra low-scored boxes come after them and suppress none of them."""
        return self._decode(chunk.tier, outputs[0][:len(chunk.plans)], chunk.plans, floor)

    def _decode(self, tier: Tier, output: np.ndarray, plans: List[LetterboxPlan], floor: Optional[float] = None
                ) -> List[FrameResult]:
        """The task's decoder (one dispatch: :func:`agent.pipeline.postprocess.decode`), then boxes to source pixels."""
        thresholds = self.thresholds
        if floor is not None and floor < thresholds.conf:
            thresholds = replace(thresholds, conf=floor)
        decoded = decode(self.manifest.task, output, thresholds)
        if self.manifest.task == "classify":
            return [FrameResult(tier=tier, classes=top) for top in decoded]
        results = []
        for dets, plan in zip(decoded, plans):  # detection tasks: one (k, 6) array per image
            if len(dets):
                dets = dets.copy()
                dets[:, :4] = scale_boxes(dets[:, :4], plan)
            results.append(FrameResult(tier=tier, detections=dets))
        return results

    def warm_up(self, rounds: int = 2) -> None:
        """First calls pay for lazy initialisation (graph compile, allocator growth): pay it before serving."""
        for runner in self._runners.values():
            for _ in range(rounds):
                runner.backend.infer(runner.preprocessor.batch)

    def golden_check(self) -> GoldenReport:
        """Run the manifest's golden cases through this box's preprocessing and backend; compare raw outputs:
        strictly (``golden.atol``/``rtol``) for float artifacts, by the quantized rule for int8 and int8-sim
        ones (:mod:`agent.pipeline.golden`: their rounding may differ by a step from one CPU to another)."""
        golden = self.manifest.golden
        if golden is None:
            return GoldenReport(passed=False, cases=0, max_abs_diff=0.0, failures=["the bundle has no golden set"])
        report = GoldenReport(passed=False, cases=0, max_abs_diff=0.0, failures=[])
        for index, case in enumerate(golden.cases):
            runner = self._runners.get(case.tier)
            if runner is None or runner.artifact.file not in case.expected:
                continue
            art = runner.artifact
            image = load_npy(self.bundle.path(case.image))
            expected = load_npy(self.bundle.path(case.expected[art.file]))
            runner.preprocessor.fill_letterboxed(0, image)
            got = runner.backend.infer(runner.preprocessor.batch)[0][:1]
            report.cases += 1
            if got.shape != expected.shape:
                report.failures.append("case %d: output shape %s, expected %s" % (index, got.shape, expected.shape))
                continue
            reference = self._float_reference(case.expected, art) if art.precision in QUANTIZED_PRECISIONS else None
            if reference is not None and reference.shape == expected.shape:
                tolerance = golden.quantized
                verdict = judge_quantized(got, expected, reference, self.manifest.task, tolerance.rms_ratio,
                                          tolerance.max_ratio, floor=golden.atol)
                report.quantized_cases += 1
                report.rms_ratio = max(report.rms_ratio, verdict.rms_ratio or 0.0)
                where = "case %d (%s, %s, judged against its int8-vs-float error)" % (index, art.file, art.precision)
            else:
                verdict = judge_strict(got, expected, golden.atol, golden.rtol)
                where = "case %d" % index
            report.max_abs_diff = max(report.max_abs_diff, verdict.max_abs_diff)
            if verdict.failure:
                report.failures.append("%s: %s" % (where, verdict.failure))
        if report.cases == 0:
            report.failures.append("no golden case covers the artifacts this box serves (%s)" % ", ".join(
                r.artifact.file for r in self._runners.values()))
        report.passed = not report.failures
        return report

    def _float_reference(self, expected: Dict[str, str], art: Artifact) -> Optional[np.ndarray]:
        """The host's output of a float artifact on the same golden case (same format first), or None."""
        floats = [a for a in self.manifest.artifacts
                  if a.file in expected and a.tier == art.tier and a.precision in FLOAT_PRECISIONS]
        floats.sort(key=lambda a: a.format != art.format)  # stable: manifest order within each group
        return load_npy(self.bundle.path(expected[floats[0].file])) if floats else None

    def describe(self) -> Dict[str, Any]:
        return {"name": self.manifest.name, "version": self.manifest.version, "task": self.manifest.task,
                "backend": self.backend_name, "precision": self.precision,
                "manifest_sha256": self.bundle.manifest_sha256, "tiers": [list(t) for t in self.tiers],
                "artifacts": {"%dx%d" % t: r.artifact.file for t, r in self._runners.items()}}


def load_model(bundle: Bundle, device: DeviceConfig, backend: str, max_batch: int = 1,
               require_golden: bool = True, on_phase: Optional[Callable[[str], None]] = None,
               precision: str = "auto", warm_up: bool = True) -> LoadedModel:
    """Load, warm up and self-test; raises BundleError (naming the golden cases) if the self-test fails.

    ``warm_up=False`` leaves out the warm-up calls: the self-test's outputs are the same (onnxruntime's kernels
    keep nothing from one call to the next); only the first inferences' latency differs. For judging a bundle,
    never for serving one.

    ``on_phase(name)`` is called as each step begins (``load``, ``warm-up``, ``golden check``): at start-up the
    daemon turns it into systemd's EXTEND_TIMEOUT_USEC, so a slow box gets time per step, and a step that hangs
    does not get more.
    """
    phase = on_phase or (lambda name: None)
    phase("load")
    model = LoadedModel(bundle, device, backend, max_batch, precision=precision)
    model.load()
    try:
        if warm_up:
            phase("warm-up")
            model.warm_up()
        phase("golden check")
        report = model.golden_check()
        if require_golden and not report.passed:
            raise BundleError([FieldError("golden", f) for f in report.failures], bundle.root)
        log.info("golden set: %s", report.summary())
    except Exception:
        model.close()
        raise
    return model
