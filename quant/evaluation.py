"""Accuracy measures: classification top-1 and detection mAP@0.5.

mAP follows the VOC 2010+ / COCO convention at one IoU threshold: per class, detections of all images are
ranked by score; each is a true positive when it overlaps a not-yet-matched true box of its class by IoU >=
0.5 (greedy, best score first, best-IoU box within an image), else a false positive. AP is the area under the
precision-recall curve after making precision monotonically non-increasing (all-point interpolation); classes
without true boxes are left out of the mean.
"""

from typing import List, Sequence

import numpy as np

IOU_THRESHOLD = 0.5
# Detection evaluation keeps nearly every candidate: mAP is a ranking measure, and the deployed conf threshold
# (manifest postprocessing.conf) would cut the low-recall tail that AP integrates over.
EVAL_CONF = 0.001
EVAL_MAX_DET = 100


def top1_accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of rows whose arg-max equals the label."""
    if len(labels) == 0:
        raise ValueError("top-1 of an empty set")
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def box_iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` (n, 4) with every box in ``b`` (m, 4), x1, y1, x2, y2 -> (n, m)."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    top_left = np.maximum(a[:, None, :2], b[None, :, :2])  # (n, m, 2)
    bottom_right = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(bottom_right - top_left, 0, None), axis=2)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0, None), axis=1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0, None), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def average_precision(recall: np.ndarray, precision: np.ndarray) -> float:
    """Area under a precision-recall curve with all-point interpolation (recall ascending)."""
    r = np.concatenate([[0.0], recall, [1.0]])
    p = np.concatenate([[1.0], precision, [0.0]])
    p = np.maximum.accumulate(p[::-1])[::-1]  # precision envelope: best precision at any higher recall
    steps = np.nonzero(r[1:] != r[:-1])[0]
    return float(np.sum((r[steps + 1] - r[steps]) * p[steps + 1]))


def _match_image(det_boxes: np.ndarray, det_scores: np.ndarray, gt_boxes: np.ndarray) -> np.ndarray:
    """True-positive flags for one image and class; detections are taken in score order."""
    flags = np.zeros(len(det_boxes), bool)
    if len(det_boxes) == 0 or len(gt_boxes) == 0:
        return flags
    iou = box_iou_matrix(det_boxes, gt_boxes)  # (d, g)
    taken = np.zeros(len(gt_boxes), bool)
    for d in np.argsort(-det_scores, kind="stable"):
        candidates = np.where(taken, -1.0, iou[d])
        best = int(np.argmax(candidates))
        if candidates[best] >= IOU_THRESHOLD:
            taken[best] = True
            flags[d] = True
    return flags


def mean_average_precision(
    detections: Sequence[np.ndarray],
    gt_boxes: Sequence[np.ndarray],
    gt_classes: Sequence[np.ndarray],
    num_classes: int,
) -> dict:
    """mAP@0.5 over images; ``detections[i]`` is (k, 6) x1, y1, x2, y2, score, class (agent.pipeline.postprocess
    layout).

    Returns ``{"map50": float, "per_class": [AP or None], "images": n}``.
    """
    if not len(detections) == len(gt_boxes) == len(gt_classes):
        raise ValueError("detections, gt_boxes and gt_classes must have one entry per image")
    per_class: List[object] = []
    for cls in range(num_classes):
        scores, flags = [], []
        n_true = 0
        for dets, boxes, classes in zip(detections, gt_boxes, gt_classes):
            dets = np.asarray(dets, np.float64).reshape(-1, 6)
            mine = dets[dets[:, 5].astype(np.int64) == cls]
            truth = np.asarray(boxes).reshape(-1, 4)[np.asarray(classes) == cls]
            n_true += len(truth)
            scores.append(mine[:, 4])
            flags.append(_match_image(mine[:, :4], mine[:, 4], truth))
        if n_true == 0:
            per_class.append(None)
            continue
        all_scores = np.concatenate(scores)
        order = np.argsort(-all_scores, kind="stable")
        tp = np.concatenate(flags)[order].astype(np.float64)
        cum_tp = np.cumsum(tp)
        cum_fp = np.cumsum(1.0 - tp)
        recall = cum_tp / n_true
        precision = cum_tp / np.maximum(cum_tp + cum_fp, np.finfo(np.float64).eps)
        per_class.append(average_precision(recall, precision))
    valid = [ap for ap in per_class if ap is not None]
    return {
        "map50": float(np.mean(valid)) if valid else 0.0,
        "per_class": per_class,
        "images": len(detections),
    }


def detections_from_outputs(outputs: np.ndarray, iou: float, conf: float = EVAL_CONF) -> List[np.ndarray]:
    """Raw YOLOv8 outputs (B, 4 + nc, N) -> per-image (k, 6) detections via the box's own decoder."""
    from agent.pipeline.postprocess import decode_yolov8

    return decode_yolov8(outputs, conf, iou, EVAL_MAX_DET)
