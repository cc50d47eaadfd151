"""Detections of the same frames on two machines, compared as the aarch64 lane states its bounds.

Confident detections (score at least ``conf + MARGIN``) on either side must be on the other with the same class,
every box coordinate within ``BOX_PX`` and the score within ``SCORE``. Marginal ones (within ``MARGIN`` of conf) may
differ: a detection a hair above conf on one machine may be a hair below on the other, or keep another box after
NMS. They are counted, and the unmatched ones listed.
"""

from typing import Any, Dict, List, Optional, Tuple

MARGIN = 0.05
BOX_PX = 1.0
SCORE = 0.01
# The lane's record, shared by its conftest and test module (pytest imports a conftest under a name of its own)
TIMINGS: Dict[str, float] = {}
REPORTS: Dict[Tuple[str, str, str], Dict[str, Any]] = {}  # (cpu, name, precision) -> {"line", "features"}


def record(cpu: str, name: str, precision: str, line: str, features: str = "") -> None:
    REPORTS[(cpu, name, precision)] = {"line": line, "features": features}


def _box_diff(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _iou(a: List[float], b: List[float]) -> float:
    x1, y1, x2, y2 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _closest(det: Dict[str, Any], others: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    same = [o for o in others if o["class_id"] == det["class_id"]]
    return min(same, key=lambda o: _box_diff(det["box"], o["box"])) if same else None


def compare(reference: Dict[str, Dict[str, Any]], other: Dict[str, Dict[str, Any]], conf: float) -> Dict[str, Any]:
    """``reference`` and ``other``: frame name -> result message. The report; ``problems`` empty when it holds."""
    problems: List[str] = []
    confident = marginal = marginal_unmatched = matched = identical = 0
    worst_box = (0.0, "")
    worst_score = (0.0, "")
    marginal_notes: List[str] = []
    for name in sorted(set(reference) | set(other)):
        if name not in reference or name not in other:
            problems.append("%s: a result on one side only" % name)
            continue
        sides = (("x86", reference[name].get("detections", [])), ("arm", other[name].get("detections", [])))
        for (side, dets), (_other_side, others) in (sides, sides[::-1]):
            for det in dets:
                close = _closest(det, others)
                is_confident = det["score"] >= conf + MARGIN
                if not is_confident:
                    marginal += 1
                    if close is None or _iou(det["box"], close["box"]) < 0.5:
                        marginal_unmatched += 1
                        marginal_notes.append("%s %s only on %s: %s %.4f %s" % (
                            name, det["label"], side, det["label"], det["score"], det["box"]))
                    continue
                confident += 1
                if close is None:
                    problems.append("%s: confident %s %.4f %s on %s, none of its class on the other" % (
                        name, det["label"], det["score"], det["box"], side))
                    continue
                box, score = _box_diff(det["box"], close["box"]), abs(det["score"] - close["score"])
                if side == "x86":
                    matched += 1
                    identical += box == 0 and score == 0
                where = "%s %s (%s)" % (name, det["label"], side)
                worst_box = max(worst_box, (box, where))
                worst_score = max(worst_score, (score, where))
                if box > BOX_PX or score > SCORE:
                    problems.append("%s: confident %s %.4f %s on %s, closest %.4f %s: box %.2f px, score %.4f" % (
                        name, det["label"], det["score"], det["box"], side, close["score"], close["box"], box,
                        score))
    return {"confident": confident, "matched": matched, "identical": identical, "marginal": marginal,
            "marginal_unmatched": marginal_unmatched, "marginal_notes": marginal_notes[:10],
            "max_box_px": worst_box, "max_score": worst_score, "problems": problems}


def summary(report: Dict[str, Any]) -> str:
    return ("%d confident matched, %d identical (largest box difference %.2f px at %s; score %.4f at %s), %d "
            "marginal, %d of them on one side only" % (
                report["matched"], report["identical"], report["max_box_px"][0], report["max_box_px"][1] or "-",
                      report["max_score"][0], report["max_score"][1] or "-", report["marginal"],
                      report["marginal_unmatched"]))


def counts(results: Dict[str, Dict[str, Any]]) -> Tuple[int, int]:
    """(frames, detections) of one side."""
    return len(results), sum(len(r.get("detections", [])) for r in results.values())
