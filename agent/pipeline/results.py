"""Result messages and annotated pictures: the one place a frame's result becomes JSON or pixels.

Each result carries ``ts``, when its frame was captured (wall time; ``ts_source`` says whether from the stream's
own timestamps or from when the frame was read), ``frame_age_ms`` (how old the frame was when its result was
handed over for publishing), and ``seq``, a per-source sequence number that never goes
backwards, also across restarts and wall-clock steps, so consumers can order results when the clock jumps
(:class:`SequenceCounter`).
"""

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import cv2
import numpy as np

from agent._util.atomic import atomic_write
from agent._util.quarantine import move_aside, state_alert
from agent._util.ratelog import LogLimiter
from agent.pipeline.model import FrameResult
from agent.pipeline.sources import Frame

logger = logging.getLogger(__name__)

# Numbers reserved per write of the sequence file: one small atomic write per 10 000 results of a source
# (every ~3 min at 50 fps) instead of one per result. A restart continues at the reserved end (a gap, never a
# number used twice).
SEQ_BLOCK = 10000
# A damaged sequence file restarts each source at the wall clock in milliseconds: above any number a source
# reached before, unless it published more than 1000 results a second on average since its first start or
# the clock is set far back. The best that can be done without the file; an alert says so.
SEQ_SEED_PER_S = 1000
SEQ_RETRY_S = 1.0  # an unwritable reservation is retried at most this often (monotonic), not once per frame

_PALETTE = ((56, 56, 255), (151, 157, 255), (31, 112, 255), (29, 178, 255), (49, 210, 207), (10, 249, 72))


def result_payload(frame: Frame, result: FrameResult, model: Dict[str, str], labels: Sequence[str],
                   timings_ms: Dict[str, float], seq: Optional[int] = None,
                   frame_age_ms: Optional[float] = None) -> Dict[str, Any]:
    """One frame's JSON result: boxes are in the original image's pixels (x1, y1, x2, y2)."""
    payload: Dict[str, Any] = {
        "frame_id": frame.frame_id,
        "source": frame.source,
        "ts": round(frame.ts, 6),
        "ts_source": frame.ts_source,
        "image_hw": [int(frame.image.shape[0]), int(frame.image.shape[1])],
        "model": model,
        "tier": list(result.tier),
        "timings_ms": {k: round(v, 3) for k, v in timings_ms.items()},
    }
    if seq is not None:
        payload["seq"] = seq
    if frame_age_ms is not None:
        payload["frame_age_ms"] = round(frame_age_ms, 1)
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


class SequenceCounter:
    """Per-source numbers 1, 2, 3, ... that never go backwards; blocks of :data:`SEQ_BLOCK` are reserved in a
    small JSON file (``{"reserved": {"<source>": <first number not yet reserved>}}``) before they are used.

    Without a path the numbers live in memory (tests, demos). A file that cannot be read is moved aside and
    each source restarts at the wall clock in milliseconds (:data:`SEQ_SEED_PER_S`), with an entry in
    :attr:`alerts`. When a reservation cannot be written (a full disk), numbering goes on in memory and the
    write is retried at the next number; only a restart before it succeeds could repeat numbers.
    """

    def __init__(self, path: Optional[str] = None, block: int = SEQ_BLOCK,
                 clock: Callable[[], float] = time.time) -> None:
        if block < 1:
            raise ValueError("sequence block must be >= 1 (got %r)" % (block,))
        self.path = path
        self.block = block
        self.alerts: List[Dict[str, Any]] = []
        self._clock = clock  # wall time, only to seed after a damaged file
        self._lock = threading.Lock()
        self._next: Dict[str, int] = {}
        self._reserved: Dict[str, int] = {}  # persisted: numbers below this may have been used
        self._seed: Optional[int] = None  # set after a damaged file
        self._unsaved = False
        self._last_try = 0.0  # monotonic
        self._log = LogLimiter(logger)
        if path:
            self._load(path)

    def _load(self, path: str) -> None:
        if not os.path.exists(path):
            return
        try:
            with open(path, encoding="utf-8") as handle:
                reserved = json.load(handle)["reserved"]
            if not isinstance(reserved, dict) or not all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
                    for k, v in reserved.items()):
                raise ValueError("'reserved' must map source names to integers >= 1")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            reason = "%s: %s" % (type(exc).__name__, exc)
            aside = move_aside(path, reason)
            self._seed = int(self._clock() * SEQ_SEED_PER_S)
            self.alerts.append(state_alert(
                "state_file_damaged", "sequence file %s was unusable (%s)%s; result numbers restart at %d (wall "
                "clock in ms)" % (path, reason, " and was moved to %s" % aside if aside else "", self._seed),
                file=path, moved_to=aside, reason=reason, lost="the last reserved result numbers", seed=self._seed))
            return
        self._reserved = dict(reserved)
        self._next = dict(reserved)

    def next(self, source: str) -> int:
        """The next number of ``source`` (serving thread; thread-safe anyway)."""
        with self._lock:
            number = self._next.get(source)
            if number is None:
                number = self._seed if self._seed is not None else 1
            self._next[source] = number + 1
            if number >= self._reserved.get(source, 1):
                self._reserve(source, number)
            elif self._unsaved and time.monotonic() - self._last_try >= SEQ_RETRY_S:
                self._reserve(source, number)
            return number

    def _reserve(self, source: str, number: int) -> None:
        self._reserved[source] = max(self._reserved.get(source, 1), number + self.block)
        if not self.path:
            return
        text = json.dumps({"reserved": self._reserved}, sort_keys=True)
        self._last_try = time.monotonic()
        try:
            atomic_write(self.path, text)
        except OSError as exc:
            self._unsaved = True
            self._log.log(logging.WARNING, "write", "sequence file %s: cannot reserve numbers (%s); counting on "
                          "in memory and retrying", self.path, exc)
            return
        self._unsaved = False
