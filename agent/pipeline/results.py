"""Result messages and annotated pictures: the one place a frame's result becomes JSON or pixels."""

from typing import Any, Dict, List, Sequence

import cv2
import numpy as np

from agent.pipeline.model import FrameResult
from agent.pipeline.sources import Frame

_PALETTE = ((56, 56, 255), (151, 157, 255), (31, 112, 255), (29, 178, 255), (49, 210, 207), (10, 249, 72))


def result_payload(frame: Frame, result: FrameResult, model: Dict[str, str], labels: Sequence[str],
                   timings_ms: Dict[str, float]) -> Dict[str, Any]:
    """One frame's JSON result: boxes are in the original image's pixels (x1, y1, x2, y2)."""
    payload: Dict[str, Any] = {
        "frame_id": frame.frame_id,
        "source": frame.source,
        "ts": round(frame.ts, 6),
        "image_hw": [int(frame.image.shape[0]), int(frame.image.shape[1])],
        "model": model,
        "tier": list(result.tier),
        "timings_ms": {k: round(v, 3) for k, v in timings_ms.items()},
    }
    if frame.name:
        payload["name"] = frame.name
    if result.detections is not None:
        payload["detections"] = detections_json(result.detections, labels)
    if result.classes is not None:
        payload["classes"] = [{"class_id": int(c), "label": _label(labels, c), "score": round(float(s), 5)}
                              for c, s in result.classes]
    return payload


def detections_json(detections: np.ndarray, labels: Sequence[str]) -> List[Dict[str, Any]]:
    out = []
    for x1, y1, x2, y2, score, cls in detections.tolist():
        out.append({"label": _label(labels, int(cls)), "class_id": int(cls), "score": round(score, 4),
                    "box": [round(x1, 1), round(y1, 1), round(x2, 1), round(y2, 1)]})
    return out


def _label(labels: Sequence[str], index: int) -> str:
    return labels[index] if 0 <= index < len(labels) else str(index)


def annotate(image: np.ndarray, detections: List[Dict[str, Any]]) -> np.ndarray:
    """A copy of ``image`` with boxes and labels drawn (for snapshots; never on the hot path)."""
    canvas = image.copy()
    thickness = max(1, round(sum(canvas.shape[:2]) / 600))
    for det in detections:
        x1, y1, x2, y2 = (int(round(v)) for v in det["box"])
        colour = _PALETTE[det["class_id"] % len(_PALETTE)]
        cv2.rectangle(canvas, (x1, y1), (x2, y2), colour, thickness)
        cv2.putText(canvas, "%s %.2f" % (det["label"], det["score"]), (x1, max(0, y1 - 4)),
                    cv2.FONT_HERSHEY_SIMPLEX, 0.4 * thickness, colour, thickness)
    return canvas
