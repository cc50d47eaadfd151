"""How far a candidate model's detections are from a reference model's on the same frames: the one measure behind
``bundle create --int8``'s check (int8 against float on held-out images) and, next, the box's shadow runs
(a candidate bundle against the serving one on live frames). docs/shadow.md says what it compares and why.

A pair is the same object when both detections carry the same **label** (the name in each model's labels, so a
label file off by one is a disagreement even where the class ids agree) and their boxes overlap with IoU >=
:data:`MATCH_IOU` (PASCAL VOC's rule, mAP@0.5's). Both models are decoded at ``conf - margin`` (the *low*
threshold) and a detection is *reported* when it scores at least ``conf``, as the box publishes it. Two
readings, each with precision, recall and F1 of the candidate against the reference:

* **strict**: the reported detections only. A reported detection the other side scores a hair under ``conf``
  counts as lost, so threshold noise (a marginal detection flipping across ``conf``) lowers it.
* **score-aware**: a reported detection whose partner on the other side scored within ``margin`` under ``conf``
  is not a disagreement; a lost detection (no partner even at the low threshold), a class change or a moved box
  (IoU below :data:`MATCH_IOU`) still is.

Beside them: the change in detections per frame, the Wasserstein-1 distance between the two sides' reported
scores, the mean corner offset of reported pairs, per-label counts, and a 95 % interval for each F1 from a
bootstrap over frames (the frame is the unit that was sampled; a fixed seed makes it reproducible).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

MATCH_IOU = 0.5
SCORE_MARGIN = 0.05  # how far under conf a partner may score and still count as the same finding
INTERVAL = 0.95
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 39
# Below this many frames, or reported reference detections, the figures mean little: the report says so plainly
MIN_FRAMES = 16
MIN_DETECTIONS = 30


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) IoU of xyxy boxes (the first four columns of each row)."""
    a, b = np.asarray(a, np.float64)[:, :4], np.asarray(b, np.float64)[:, :4]
    width = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    height = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = width * height
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def match_detections(want: np.ndarray, got: np.ndarray, want_labels: Optional[Sequence[str]] = None,
                     got_labels: Optional[Sequence[str]] = None) -> List[Tuple[int, int]]:
    """Greedy pairs (i, j): each of ``want``'s rows (x1, y1, x2, y2, score, class), best score first, with the
    unused row of ``got`` of its label that overlaps it most, if that IoU reaches MATCH_IOU. Without labels the
    class ids are compared."""
    if not len(want) or not len(got):
        return []
    same = _labels_of(want, want_labels)[:, None] == _labels_of(got, got_labels)[None, :]
    overlaps = np.where(same, iou_matrix(want, got), -1.0)
    used = np.zeros(len(got), bool)
    pairs = []
    for i in np.argsort(-want[:, 4], kind="stable"):
        row = np.where(used, -1.0, overlaps[i])
        j = int(np.argmax(row))
        if row[j] >= MATCH_IOU:
            used[j] = True
            pairs.append((int(i), j))
    return pairs


def _labels_of(detections: np.ndarray, labels: Optional[Sequence[str]]) -> np.ndarray:
    ids = detections[:, 5].astype(np.int64)
    if labels is None:
        return ids.astype(str)
    return np.array([labels[c] if 0 <= c < len(labels) else "class %d" % c for c in ids], dtype=object)


@dataclass
class Counts:
    """True positives (pairs), false positives (candidate only), false negatives (reference only)."""

    tp: int = 0
    fp: int = 0
    fn: int = 0

    def add(self, other: "Counts") -> None:
        self.tp, self.fp, self.fn = self.tp + other.tp, self.fp + other.fp, self.fn + other.fn

    def as_dict(self) -> Dict[str, Any]:
        return {"tp": self.tp, "fp": self.fp, "fn": self.fn, "precision": _ratio(self.tp, self.tp + self.fp),
                "recall": _ratio(self.tp, self.tp + self.fn),
                "f1": _ratio(2 * self.tp, 2 * self.tp + self.fp + self.fn)}


def _ratio(part: float, whole: float) -> float:
    return round(float(part) / whole, 6) if whole else 1.0  # nothing to find and nothing found: full agreement


@dataclass
class FrameAgreement:
    """One frame's comparison (what :meth:`AgreementMeter.add` returns)."""

    strict: Counts
    aware: Counts
    reference_reported: int
    candidate_reported: int
    offsets_px: List[float] = field(default_factory=list)  # mean |corner difference| of each reported pair
    by_label: Dict[str, Counts] = field(default_factory=dict)  # strict counts per label


class AgreementMeter:
    """Accumulates :class:`FrameAgreement` over frames; :meth:`report` gives the run's figures."""

    def __init__(self, conf: float, margin: float = SCORE_MARGIN, reference_labels: Optional[Sequence[str]] = None,
                 candidate_labels: Optional[Sequence[str]] = None) -> None:
        if not 0.0 < margin < conf:
            raise ValueError("margin must be in (0, conf=%g), got %r" % (conf, margin))
        self.conf, self.margin = float(conf), float(margin)
        self.reference_labels, self.candidate_labels = reference_labels, candidate_labels
        self.frames: List[FrameAgreement] = []
        self._reference_scores: List[np.ndarray] = []
        self._candidate_scores: List[np.ndarray] = []

    @property
    def low(self) -> float:
        """The threshold both models are decoded at."""
        return self.conf - self.margin

    def add(self, reference: np.ndarray, candidate: np.ndarray) -> FrameAgreement:
        """One frame: both models' detections (k, 6) decoded at :attr:`low` or lower (rows below it are ignored)."""
        reference = reference[reference[:, 4] >= self.low]
        candidate = candidate[candidate[:, 4] >= self.low]
        ref_labels = _labels_of(reference, self.reference_labels)
        cand_labels = _labels_of(candidate, self.candidate_labels)
        pairs = match_detections(reference, candidate, self.reference_labels, self.candidate_labels)
        ref_reported = reference[:, 4] >= self.conf
        cand_reported = candidate[:, 4] >= self.conf
        partner_of_ref = dict(pairs)
        partner_of_cand = {j: i for i, j in pairs}
        frame = FrameAgreement(Counts(), Counts(), int(ref_reported.sum()), int(cand_reported.sum()))
        for i in np.flatnonzero(ref_reported):
            j = partner_of_ref.get(int(i))
            label = str(ref_labels[i])
            counts = frame.by_label.setdefault(label, Counts())
            if j is not None and cand_reported[j]:
                frame.strict.tp += 1
                frame.aware.tp += 1
                counts.tp += 1
                frame.offsets_px.append(float(np.abs(reference[i, :4] - candidate[j, :4]).mean()))
                continue
            frame.strict.fn += 1
            counts.fn += 1
            if j is None:
                frame.aware.fn += 1  # lost, moved or relabelled: no partner even just under conf
            else:
                frame.aware.tp += 1  # the candidate scored it within the margin under conf
        for j in np.flatnonzero(cand_reported):
            i = partner_of_cand.get(int(j))
            if i is not None and ref_reported[i]:
                continue  # counted above
            frame.strict.fp += 1
            frame.by_label.setdefault(str(cand_labels[j]), Counts()).fp += 1
            if i is None:
                frame.aware.fp += 1
            else:
                frame.aware.tp += 1  # the reference scored it within the margin under conf
        self.frames.append(frame)
        self._reference_scores.append(reference[ref_reported, 4].astype(np.float64))
        self._candidate_scores.append(candidate[cand_reported, 4].astype(np.float64))
        return frame

    def report(self) -> Dict[str, Any]:
        """The run's figures (JSON-ready): frames, detections, strict and score-aware precision/recall/F1 with
        their intervals, per label, detections per frame, score distance, box offset, and a warning when the
        sample is too small to mean anything."""
        strict, aware = Counts(), Counts()
        by_label: Dict[str, Counts] = {}
        offsets: List[float] = []
        for frame in self.frames:
            strict.add(frame.strict)
            aware.add(frame.aware)
            offsets += frame.offsets_px
            for label, counts in frame.by_label.items():
                by_label.setdefault(label, Counts()).add(counts)
        reference_reported = sum(f.reference_reported for f in self.frames)
        candidate_reported = sum(f.candidate_reported for f in self.frames)
        report = {
            "frames": len(self.frames), "conf": self.conf, "margin": self.margin, "match_iou": MATCH_IOU,
            "reference_detections": reference_reported, "candidate_detections": candidate_reported,
            "strict": dict(strict.as_dict(), f1_interval=self._f1_interval("strict")),
            "score_aware": dict(aware.as_dict(), f1_interval=self._f1_interval("aware")),
            "per_label": {label: counts.as_dict() for label, counts in sorted(by_label.items())},
            "detections_per_frame_change": round((candidate_reported - reference_reported) / len(self.frames), 4)
            if self.frames else 0.0,
            "score_wasserstein1": round(wasserstein1(np.concatenate(self._reference_scores or [np.zeros(0)]),
                                                     np.concatenate(self._candidate_scores or [np.zeros(0)])), 6),
            "mean_box_offset_px": round(float(np.mean(offsets)), 4) if offsets else 0.0,
        }
        warning = self.sample_warning(reference_reported)
        if warning:
            report["warning"] = warning
        return report

    def sample_warning(self, reference_reported: int) -> Optional[str]:
        if len(self.frames) < MIN_FRAMES or reference_reported < MIN_DETECTIONS:
            return ("a small sample: %d frame(s) and %d reference detection(s) (at least %d and %d to mean much); "
                    "the interval says how little it proves" % (len(self.frames), reference_reported, MIN_FRAMES,
                                                                 MIN_DETECTIONS))
        return None

    def _f1_interval(self, reading: str) -> List[float]:
        """The 95 % percentile-bootstrap interval of F1, resampling whole frames."""
        if not self.frames:
            return [1.0, 1.0]
        counts = np.array([[getattr(getattr(f, reading), k) for k in ("tp", "fp", "fn")] for f in self.frames],
                          np.float64)
        rng = np.random.RandomState(BOOTSTRAP_SEED)
        picks = rng.randint(0, len(self.frames), (BOOTSTRAP_RESAMPLES, len(self.frames)))
        tp, fp, fn = (counts[:, k][picks].sum(axis=1) for k in range(3))
        whole = 2 * tp + fp + fn
        f1 = np.where(whole > 0, 2 * tp / np.where(whole > 0, whole, 1), 1.0)
        tail = (1 - INTERVAL) / 2 * 100
        return [round(float(np.percentile(f1, tail)), 4), round(float(np.percentile(f1, 100 - tail)), 4)]


def wasserstein1(a: np.ndarray, b: np.ndarray) -> float:
    """The Wasserstein-1 (earth mover's) distance between two samples' empirical distributions: the area between
    their cumulative distribution functions. 0 when either sample is empty (nothing to compare)."""
    if not len(a) or not len(b):
        return 0.0
    a, b = np.sort(np.asarray(a, np.float64)), np.sort(np.asarray(b, np.float64))
    points = np.concatenate([a, b])
    points.sort(kind="mergesort")
    widths = np.diff(points)
    cdf_a = np.searchsorted(a, points[:-1], side="right") / len(a)
    cdf_b = np.searchsorted(b, points[:-1], side="right") / len(b)
    return float(np.sum(np.abs(cdf_a - cdf_b) * widths))
