"""Drift per source: does each camera still show the serving model the kind of scene it was confirmed on?

Per source, over a sliding window of the last ``window_s`` seconds of results, two figures against a reference
(docs/shadow.md, "Drift"):

* ``score_w1``: the Wasserstein-1 distance between the window's reported scores and the reference's (a darker
  scene, a dirty lens: the model is less sure; measured on the demo detector: 0.01-0.03 between two samples of its
  scenes, 0.19 with the pictures at half brightness, 0.38 at 30 %);
* ``detections_change``: the relative change in detections per frame, ``|window - reference| / max(reference,
  1)`` (a camera turned to a wall: 1.0; the demo's scenes from another seed: 0.07).

The reference is the first ``reference_frames`` results of the source after the serving model was confirmed (or
after start, for a model without one); :meth:`DriftWatch.export` and :meth:`DriftWatch.restore` keep it across
a restart, per model. A source drifts when a figure stays above its bound for ``raise_after_s`` (the alert
``drift``, with the figures); it clears when both stay under ``clear_ratio`` times their bounds for
``clear_after_s`` (``drift_cleared``): the gap between the two is the hysteresis that keeps a scene on the edge
from flapping. A window of fewer than ``min_frames`` results is not judged (a stalled camera is the source
health's business, not drift's).

The serving thread calls :meth:`observe` per result (an append) and :meth:`tick` once per turn (judges at most
once a second); the figures are read from any thread (:meth:`report`).
"""

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from agent.config.daemon_config import DriftConfig
from agent.pipeline.agreement import wasserstein1

JUDGE_EVERY_S = 1.0
DRIFT, DRIFT_CLEARED = "drift", "drift_cleared"


@dataclass
class _Reference:
    scores: np.ndarray
    detections_per_frame: float
    frames: int

    def as_dict(self) -> Dict[str, Any]:
        return {"scores": [round(float(s), 5) for s in self.scores],
                "detections_per_frame": self.detections_per_frame, "frames": self.frames}


class _Source:
    """One source's window, reference and state."""

    def __init__(self) -> None:
        self.window: Deque[Tuple[float, np.ndarray]] = deque()  # (time, reported scores of one frame)
        self.learning: List[np.ndarray] = []  # results gathered for the reference
        self.reference: Optional[_Reference] = None
        self.drifting = False
        self.over_since: Optional[float] = None  # a figure above its bound since then
        self.under_since: Optional[float] = None  # both under clear_ratio x bound since then
        self.figures: Dict[str, Any] = {}


class DriftWatch:
    """Every source's drift (see the module doc); ``on_alert(alert)`` gets ``drift`` and ``drift_cleared``."""

    def __init__(self, settings: DriftConfig, on_alert: Callable[[Dict[str, Any]], None],
                 on_learnt: Callable[[Dict[str, Any]], None] = lambda references: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``on_learnt(export())`` runs after a tick that completed a source's reference (the daemon keeps it)."""
        self.settings = settings
        self.on_alert = on_alert
        self.on_learnt = on_learnt
        self._learnt = False
        self.clock = clock
        self.model: Optional[str] = None  # the manifest sha256 the references belong to
        self._sources: Dict[str, _Source] = {}
        self._lock = threading.Lock()
        self._judged_at = float("-inf")

    # --- serving thread ------------------------------------------------------------------------------------

    def observe(self, source: str, scores: np.ndarray) -> None:
        """One result of ``source``: the scores of the detections it reported."""
        now = self.clock()
        with self._lock:
            state = self._sources.setdefault(source, _Source())
            if state.reference is None:
                state.learning.append(np.asarray(scores, np.float64))
                if len(state.learning) >= self.settings.reference_frames:
                    state.reference = _reference(state.learning)
                    state.learning = []
                    self._learnt = True
                return
            state.window.append((now, np.asarray(scores, np.float64)))

    def tick(self) -> None:
        """Judge every source, at most once per :data:`JUDGE_EVERY_S`; alerts go out after the lock."""
        now = self.clock()
        if now - self._judged_at < JUDGE_EVERY_S:
            return
        self._judged_at = now
        alerts = []
        with self._lock:
            for name, state in self._sources.items():
                alert = self._judge(name, state, now)
                if alert is not None:
                    alerts.append(alert)
            learnt, self._learnt = self._learnt, False
        for alert in alerts:
            self.on_alert(alert)
        if learnt:
            self.on_learnt(self.export())

    def relearn(self, model: Optional[str]) -> None:
        """A model was confirmed (or started without a kept reference): every source learns its reference anew."""
        with self._lock:
            self.model = model
            for state in self._sources.values():
                state.reference, state.learning = None, []
                state.window.clear()
                state.over_since = state.under_since = None
                state.figures = {}
                # a drift in progress stays raised until the new reference clears it: no silent reset

    # --- judging -------------------------------------------------------------------------------------------

    def _judge(self, name: str, state: _Source, now: float) -> Optional[Dict[str, Any]]:
        settings = self.settings
        while state.window and state.window[0][0] < now - settings.window_s:
            state.window.popleft()
        if state.reference is None or len(state.window) < settings.min_frames:
            state.figures = {"frames": len(state.window), "judged": False}
            return None
        scores = [s for _t, s in state.window]
        per_frame = float(np.mean([len(s) for s in scores]))
        reference = state.reference
        score_w1 = wasserstein1(reference.scores, np.concatenate(scores))
        change = abs(per_frame - reference.detections_per_frame) / max(reference.detections_per_frame, 1.0)
        state.figures = {"frames": len(scores), "judged": True, "score_w1": round(score_w1, 4),
                         "detections_change": round(change, 4), "detections_per_frame": round(per_frame, 3),
                         "reference_detections_per_frame": round(reference.detections_per_frame, 3)}
        over = score_w1 > settings.score_w1_bound or change > settings.detections_change_bound
        under = (score_w1 <= settings.clear_ratio * settings.score_w1_bound
                 and change <= settings.clear_ratio * settings.detections_change_bound)
        state.over_since = (state.over_since or now) if over else None
        state.under_since = (state.under_since or now) if under else None
        if not state.drifting and state.over_since is not None and now - state.over_since >= settings.raise_after_s:
            state.drifting = True
            return self._alert(DRIFT, name, state)
        if state.drifting and state.under_since is not None and now - state.under_since >= settings.clear_after_s:
            state.drifting = False
            return self._alert(DRIFT_CLEARED, name, state)
        return None

    def _alert(self, kind: str, name: str, state: _Source) -> Dict[str, Any]:
        settings = self.settings
        return dict(state.figures, alert=kind, source=name, score_w1_bound=settings.score_w1_bound,
                    detections_change_bound=settings.detections_change_bound, window_s=settings.window_s)

    # --- views and persistence ---------------------------------------------------------------------------

    def report(self) -> Dict[str, Dict[str, Any]]:
        """Per source: its figures, whether it drifts, and how far its reference is learnt."""
        with self._lock:
            return {name: dict(state.figures, drifting=state.drifting,
                               reference_frames=state.reference.frames if state.reference is not None
                               else len(state.learning))
                    for name, state in self._sources.items()}

    def export(self) -> Dict[str, Any]:
        """The learnt references, for the state directory."""
        with self._lock:
            return {"model": self.model, "sources": {name: state.reference.as_dict()
                                                     for name, state in self._sources.items()
                                                     if state.reference is not None}}

    def restore(self, data: Any, model: Optional[str]) -> bool:
        """Take back references :meth:`export` wrote for ``model``; False (nothing taken) for another model or
        anything unreadable."""
        if not isinstance(data, dict) or data.get("model") != model or not isinstance(data.get("sources"), dict):
            return False
        references = {}
        try:
            for name, entry in data["sources"].items():
                references[str(name)] = _Reference(np.asarray(entry["scores"], np.float64),
                                                   float(entry["detections_per_frame"]), int(entry["frames"]))
        except (KeyError, TypeError, ValueError):
            return False
        with self._lock:
            self.model = model
            for name, reference in references.items():
                self._sources.setdefault(name, _Source()).reference = reference
        return True


def _reference(results: List[np.ndarray]) -> _Reference:
    scores = np.concatenate(results) if results else np.zeros(0)
    return _Reference(scores, float(np.mean([len(r) for r in results])), len(results))
