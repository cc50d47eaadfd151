"""Turn raw network outputs into results: YOLO box decoding with class-aware NMS, and classification top-k.

Detections per image are a float32 array of shape (k, 6): x1, y1, x2, y2, score, class_id, in network-input
pixels (``agent.pipeline.preprocess.scale_boxes`` maps them to the source image), rows in descending score. The output
layouts are the ones docs/bundle.md fixes per task. Thresholds follow Ultralytics' ``non_max_suppression``:
a candidate needs ``score > conf`` and a box is suppressed by a higher-scored box of its class when
``IoU > iou``. Every step works on whole arrays; the only Python loop is over the images of a batch.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Tuple, Union

import cv2
import numpy as np

from agent.bundle.manifest import TASKS  # the manifest's task values: one decoder each here
from agent.pipeline.preprocess import is_int

DETECTION_COLUMNS = 6  # x1, y1, x2, y2, score, class_id
YOLOV8_BOX_CHANNELS = 4  # cx, cy, w, h, then one score per class
YOLOV5_LEADING_CHANNELS = 5  # cx, cy, w, h, objectness, then one probability per class
# Ultralytics' max_nms: only the best-scored candidates enter NMS, which bounds its cost on noisy frames.
MAX_NMS_CANDIDATES = 30000

Classification = List[Tuple[int, float]]


def _check_thresholds(conf: Any, iou: Any, max_det: Any) -> Tuple[float, float, int]:
    for name, value in (("conf", conf), ("iou", iou)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    if not (is_int(max_det) and max_det >= 1):
        raise ValueError(f"max_det must be a positive integer, got {max_det!r}")
    return float(conf), float(iou), int(max_det)


def empty_detections() -> np.ndarray:
    """The (0, 6) float32 result of an image with nothing detected."""
    return np.zeros((0, DETECTION_COLUMNS), np.float32)


def nms(
    boxes_xyxy: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, iou: float, max_det: int
) -> np.ndarray:
    """Class-aware greedy NMS; returns the kept indices (int64) by descending score, ties by lower index.

    Boxes of different classes never suppress each other: each class is moved to its own region of the
    plane (offset ``class_id * extent`` after shifting every box to non-negative coordinates), then OpenCV's
    greedy ``cv2.dnn.NMSBoxes`` runs once over all of them. The shift matters: ``cv2.dnn.NMSBoxesBatched``
    derives its offset from the largest coordinate only, so boxes reaching below zero can cross classes.
    Scores must be positive (OpenCV drops the others); the decoders only pass scores above ``conf``.
    """
    boxes = np.asarray(boxes_xyxy)
    scores = np.asarray(scores)
    class_ids = np.asarray(class_ids)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ValueError(f"boxes_xyxy must have shape (n, 4), got {boxes.shape}")
    count = boxes.shape[0]
    if scores.shape != (count,):
        raise ValueError(f"scores must have shape ({count},), got {scores.shape}")
    if class_ids.shape != (count,):
        raise ValueError(f"class_ids must have shape ({count},), got {class_ids.shape}")
    _, iou, max_det = _check_thresholds(0.0, iou, max_det)
    return _nms_checked(boxes, scores, class_ids, iou, max_det)


def _nms_checked(
    boxes_xyxy: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, iou: float, max_det: int
) -> np.ndarray:
    """:func:`nms` on arrays and thresholds already checked (the decoders' per-frame path: no re-checks)."""
    if boxes_xyxy.shape[0] == 0:
        return np.zeros(0, np.int64)
    # OpenCV's Rect2d wants float64; float32 would lose pixels at large class offsets.
    rects_xywh = boxes_xyxy.astype(np.float64)  # (n, 4): x1, y1, x2, y2, turned into x, y, w, h in place
    origin = rects_xywh.min()
    extent = rects_xywh.max() - origin + 1.0
    rects_xywh[:, 2:] -= rects_xywh[:, :2]
    offsets = class_ids.astype(np.float64) * extent - origin  # (n,): each class its own region of the plane
    rects_xywh[:, :2] += offsets[:, None]
    # The caller has thresholded already; OpenCV's threshold (it must be >= 0) keeps every positive score.
    # Lists convert into OpenCV's vectors faster than arrays do, to the same doubles and floats.
    kept = cv2.dnn.NMSBoxes(rects_xywh.tolist(), scores.tolist(), 0.0, iou)
    return np.asarray(kept, np.int64).reshape(-1)[:max_det]


def _xywh_to_xyxy(xywh: np.ndarray) -> np.ndarray:
    """(k, 4) centre x, centre y, width, height -> (k, 4) x1, y1, x2, y2, float32."""
    xywh = xywh.astype(np.float32, copy=False)  # float16 NPU outputs are widened before the arithmetic
    xyxy = np.empty(xywh.shape, np.float32)
    half_size = xywh[:, 2:] / 2
    xyxy[:, :2] = xywh[:, :2] - half_size
    xyxy[:, 2:] = xywh[:, :2] + half_size
    return xyxy


def _best_candidates(candidates: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """At most MAX_NMS_CANDIDATES of ``candidates`` (indices into ``scores``), the best-scored ones."""
    if candidates.size <= MAX_NMS_CANDIDATES:
        return candidates
    best = np.argpartition(-scores[candidates], MAX_NMS_CANDIDATES - 1)[:MAX_NMS_CANDIDATES]
    return np.sort(candidates[best])


def _suppress(
    boxes_xyxy: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, iou: float, max_det: int
) -> np.ndarray:
    """Run NMS over one image's candidates and pack the survivors as (k, 6) detections."""
    kept = _nms_checked(boxes_xyxy, scores, class_ids, iou, max_det)
    detections = np.empty((kept.size, DETECTION_COLUMNS), np.float32)
    detections[:, :4] = boxes_xyxy[kept]
    detections[:, 4] = scores[kept]
    detections[:, 5] = class_ids[kept]
    return detections


def _check_output(output: Any, task: str, axis: int, leading: int) -> np.ndarray:
    """The raw output as an array of rank 3 with at least one class along ``axis``."""
    output = np.asarray(output)
    if output.ndim != 3 or output.shape[axis] <= leading or output.dtype.kind != "f":
        layout = "(B, 4+nc, N)" if task == "detect-yolov8" else "(B, N, 5+nc)"
        raise ValueError(
            f"output for {task} must be a float array of shape {layout}, got {output.dtype} {output.shape}"
        )
    return output


def decode_yolov8(output: np.ndarray, conf: float, iou: float, max_det: int) -> List[np.ndarray]:
    """Decode a YOLOv8/11 output (B, 4+nc, N): cx, cy, w, h, then per-class scores (sigmoid already applied).

    Each anchor keeps its best class only (Ultralytics' single-label mode). Anchors are thresholded before
    anything is transposed, so only the few candidates are gathered into (k, 4+nc).
    """
    output = _check_output(output, "detect-yolov8", axis=1, leading=YOLOV8_BOX_CHANNELS)
    conf, iou, max_det = _check_thresholds(conf, iou, max_det)
    results = []
    for image in output:  # (4+nc, N)
        class_scores = image[YOLOV8_BOX_CHANNELS:]  # (nc, N)
        best_scores = class_scores.max(axis=0)  # (N,): a reduction across rows, fast on this layout
        candidates = _best_candidates(np.nonzero(best_scores > conf)[0], best_scores)
        if candidates.size == 0:
            results.append(empty_detections())
            continue
        picked = image[:, candidates]  # (4+nc, k)
        class_ids = picked[YOLOV8_BOX_CHANNELS:].argmax(axis=0)  # (k,)
        scores = best_scores[candidates].astype(np.float32)
        boxes = _xywh_to_xyxy(picked[:YOLOV8_BOX_CHANNELS].T)  # (4, k) -> (k, 4)
        results.append(_suppress(boxes, scores, class_ids, iou, max_det))
    return results


def decode_yolov5(output: np.ndarray, conf: float, iou: float, max_det: int) -> List[np.ndarray]:
    """Decode a YOLOv5 output (B, N, 5+nc): cx, cy, w, h, objectness, then per-class probabilities.

    As YOLOv5 does: anchors with ``objectness > conf`` are candidates, their score is objectness times the
    class probability, and each keeps its best class (single label per box) if that score is ``> conf``.
    """
    output = _check_output(output, "detect-yolov5", axis=2, leading=YOLOV5_LEADING_CHANNELS)
    conf, iou, max_det = _check_thresholds(conf, iou, max_det)
    objectness_column = YOLOV5_LEADING_CHANNELS - 1
    results = []
    for image in output:  # (N, 5+nc)
        objectness = image[:, objectness_column]  # (N,)
        candidates = _best_candidates(np.nonzero(objectness > conf)[0], objectness)
        picked = image[candidates]  # (k, 5+nc)
        class_scores = (
            picked[:, YOLOV5_LEADING_CHANNELS:] * picked[:, objectness_column : objectness_column + 1]
        )
        class_ids = class_scores.argmax(axis=1)  # (k,)
        scores = class_scores[np.arange(class_ids.size), class_ids].astype(np.float32)
        confident = scores > conf
        if not confident.any():
            results.append(empty_detections())
            continue
        boxes = _xywh_to_xyxy(picked[confident, :4])
        results.append(_suppress(boxes, scores[confident], class_ids[confident], iou, max_det))
    return results


def classify_topk(logits: np.ndarray, k: int, softmax: bool = True) -> List[Classification]:
    """Per image, the ``k`` best (class_id, probability) pairs in descending order (``k`` is capped at nc).

    With ``softmax=False`` the values are returned as given (for networks that end in a softmax already).
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] < 1 or not np.issubdtype(logits.dtype, np.number):
        raise ValueError(
            f"logits must be a numeric array of shape (B, nc), got {logits.dtype} {logits.shape}"
        )
    if not (is_int(k) and k >= 1):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    k = min(int(k), logits.shape[1])
    values = logits.astype(np.float64)
    if softmax:
        values -= values.max(axis=1, keepdims=True)  # stable: the largest exponent is exp(0)
        np.exp(values, out=values)
        values /= values.sum(axis=1, keepdims=True)
    top = np.argpartition(-values, k - 1, axis=1)[:, :k]  # (B, k), unordered
    top_values = np.take_along_axis(values, top, axis=1)
    order = np.argsort(-top_values, axis=1, kind="stable")
    top = np.take_along_axis(top, order, axis=1)
    top_values = np.take_along_axis(top_values, order, axis=1)
    return [
        [(int(class_id), float(value)) for class_id, value in zip(ids, row)]
        for ids, row in zip(top.tolist(), top_values.tolist())
    ]


def _post_value(post: Any, name: str) -> Any:
    """Read ``name`` from a mapping (manifest ``postprocessing``) or an object with that attribute."""
    if isinstance(post, Mapping):
        if name not in post:
            raise ValueError(f"post.{name} is missing")
        return post[name]
    if not hasattr(post, name):
        raise ValueError(f"post.{name} is missing")
    return getattr(post, name)


def decode(task: str, output: np.ndarray, post: Any) -> Union[List[np.ndarray], List[Classification]]:
    """Decode output 0 of a network by the manifest's ``task``; ``post`` holds conf, iou, max_det, top_k.

    Detection tasks give one (k, 6) array per image; ``classify`` gives one list of (class_id, probability).
    """
    if task == "classify":
        return classify_topk(output, _post_value(post, "top_k"))
    if task in ("detect-yolov5", "detect-yolov8"):
        decoder = decode_yolov8 if task == "detect-yolov8" else decode_yolov5
        return decoder(
            output, _post_value(post, "conf"), _post_value(post, "iou"), _post_value(post, "max_det")
        )
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
