"""A shadow run: a candidate model beside the serving one, on a sample of the frames serving took, compared with
it and never published (docs/shadow.md).

Serving comes first, by construction:

* the serving loop hands a frame over with :meth:`ShadowRun.offer`, which never waits: one frame is held for the
  candidate at a time, and a frame offered while that place is taken is dropped and counted (``dropped_busy``);
* the candidate is loaded, warmed up, self-tested and run on a thread of its own at the lowest CPU priority
  (nice 19). A runtime's worker threads, created while it loads on that thread, inherit the priority: on a busy
  CPU the candidate gets what serving leaves;
* the candidate's detections go into the report, nowhere else.

Sampling is a pattern, not chance: ``sample`` 0.25 offers every fourth frame served. The serving model's
detections arrive decoded at the agreement's low threshold (``conf - margin``: what it published and what it
scored just under), and the candidate is decoded at the same low threshold
(:class:`agent.pipeline.agreement.AgreementMeter` says what is compared).
"""

import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from agent.config.daemon_config import SHADOW_NICE
from agent.pipeline.agreement import SCORE_MARGIN, AgreementMeter
from agent.pipeline.model import LoadedModel

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0  # a running report this often (retained: the latest replaces the one before)
POLL_S = 0.1  # how often the candidate's thread looks at its deadline and stop request while no frame waits
MAX_ERRORS = 10  # candidate calls that raised before the run ends as failed (a model that cannot run is a verdict)
ERROR_CHARS = 200

RUNNING, FINISHED, STOPPED, FAILED = "running", "finished", "stopped", "failed"
EMPTY = np.zeros((0, 6), np.float32)


def agreement_margin(conf: float) -> float:
    """The score margin under ``conf`` within which a detection found by one side only is threshold noise."""
    return min(SCORE_MARGIN, conf / 2.0)


def lower_thread_priority(nice: int = SHADOW_NICE) -> Optional[str]:
    """Lower the calling thread's CPU priority (Linux: the nice value is per thread); a problem as text, or None."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # who=0: the calling thread on Linux
        return None
    except (AttributeError, OSError) as exc:
        return str(exc)


class ShadowRun:
    """One candidate against the serving model ``reference``; ``on_report(report)`` gets each report (running
    reports every :data:`PROGRESS_EVERY_S`, then the final one), on the candidate's thread.

    ``load()`` loads, warms up and self-tests the candidate (raises if it cannot); :meth:`start` runs it on the
    run's own thread and returns once it is loaded, raising its error.
    """

    def __init__(self, load: Callable[[], LoadedModel], reference: LoadedModel, candidate: Dict[str, Any],
                 candidate_labels: List[str], sample: float, frames: int, max_s: float,
                 on_report: Callable[[Dict[str, Any]], None], clock: Callable[[], float] = time.monotonic,
                 progress_every_s: float = PROGRESS_EVERY_S, nice: Optional[int] = SHADOW_NICE) -> None:
        """``nice``: the candidate thread's nice value (None: the caller's). A box keeps the default; tests of what
        a run compares pass None so that a loaded machine's other work cannot starve the thread for minutes."""
        self._load = load
        self.nice = nice
        self.reference = reference
        self.candidate_identity = candidate
        self.sample, self.frames_wanted, self.max_s = sample, frames, max_s
        self.on_report = on_report
        self.clock = clock
        self.progress_every_s = progress_every_s
        self.conf = reference.thresholds.conf
        self.low = self.conf - agreement_margin(self.conf)
        self.meter = AgreementMeter(self.conf, agreement_margin(self.conf), reference.manifest.labels,
                                    candidate_labels)
        self.state = RUNNING
        self.reason = ""
        self.offered = 0  # frames served while the run was open (serving thread)
        self.sampled = 0  # of those, the ones the pattern picked
        self.dropped_busy = 0  # picked, but the candidate was still busy: dropped, never queued
        self.errors = 0
        self.last_error: Optional[str] = None
        self.priority_problem: Optional[str] = None
        self._latencies_ms: List[float] = []
        self._credit = 0.0
        self._held: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop_reason: Optional[str] = None
        self._loaded = threading.Event()
        self._load_error: Optional[BaseException] = None
        self._started_at: Optional[float] = None
        self._ended_at: Optional[float] = None
        self._thread: Optional[threading.Thread] = None

    # --- the command side -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the candidate on the run's thread and begin; raises what the load raised (nothing is left)."""
        self._thread = threading.Thread(target=self._main, name="shadow", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def stop(self, reason: str, timeout: Optional[float] = None) -> bool:
        """End the run at the candidate's next frame boundary with ``reason``; waits for its final report (at most
        ``timeout`` s); False when the candidate's thread is still inside a call after that."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    # --- the serving side (seams.ShadowTap) -----------------------------------------------------------------

    def offer(self, image: np.ndarray, detections: np.ndarray, model: LoadedModel) -> None:
        """Serving thread, after a frame's decode: never waits. ``detections`` are the serving model's at
        :attr:`low`; a frame of another serving model (a rollback happened) ends the run."""
        if self.state != RUNNING:
            return
        if model is not self.reference:
            self.stop_soon("the serving model changed during the run")
            return
        self.offered += 1
        self._credit += self.sample
        if self._credit < 1.0 - 1e-9:
            return
        self._credit -= 1.0
        self.sampled += 1
        with self._lock:
            if self._held is not None:
                self.dropped_busy += 1
                return
            self._held = (image, detections)
        self._wake.set()

    def stop_soon(self, reason: str) -> None:
        """As :meth:`stop`, without waiting (the serving thread must not)."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason
        self._wake.set()

    # --- the candidate's thread -----------------------------------------------------------------------------

    def _main(self) -> None:
        self.priority_problem = None if self.nice is None else lower_thread_priority(self.nice)
        if self.priority_problem:
            log.warning("shadow run: could not lower the candidate thread's priority: %s", self.priority_problem)
        try:
            candidate = self._load()
        except BaseException as exc:
            self._load_error = exc
            self.state, self.reason = FAILED, "load: %s" % exc
            self._loaded.set()
            return
        th = candidate.thresholds
        candidate.set_thresholds(conf=self.low, iou=th.iou, max_det=th.max_det, top_k=th.top_k)
        self._started_at = self.clock()
        self._loaded.set()
        try:
            self._compare(candidate)
        except Exception as exc:  # the run's own bug: reported as its end, serving is untouched
            log.exception("shadow run failed")
            self.state, self.reason = FAILED, "%s: %s" % (type(exc).__name__, exc)
        finally:
            candidate.close()
            self._ended_at = self.clock()
            with self._lock:
                self._held = None
            self._send_report()

    def _compare(self, candidate: LoadedModel) -> None:
        last_report = self.clock()
        while True:
            ended = self._end()
            if ended is not None:
                self.state, self.reason = ended
                return
            self._wake.wait(POLL_S)
            with self._lock:
                self._wake.clear()
                held, self._held = self._held, None
            if held is not None:
                self._run_one(candidate, *held)
            if self.clock() - last_report >= self.progress_every_s:
                last_report = self.clock()
                self._send_report()

    def _end(self) -> Optional[Tuple[str, str]]:
        with self._lock:
            stop = self._stop_reason
        if stop is not None:
            return STOPPED, stop
        if self.errors >= MAX_ERRORS:
            return FAILED, "the candidate raised on %d frames (last: %s)" % (self.errors, self.last_error)
        if len(self.meter.frames) >= self.frames_wanted:
            return FINISHED, "compared %d frames" % len(self.meter.frames)
        assert self._started_at is not None
        if self.clock() - self._started_at >= self.max_s:
            return FINISHED, "max_s (%g s) reached after %d frames" % (self.max_s, len(self.meter.frames))
        return None

    def _run_one(self, candidate: LoadedModel, image: np.ndarray, reference: np.ndarray) -> None:
        started = time.perf_counter()
        try:
            found = candidate.infer_frames([image])[0].detections
        except Exception as exc:
            self.errors += 1
            self.last_error = ("%s: %s" % (type(exc).__name__, exc))[:ERROR_CHARS]
            log.warning("shadow run: the candidate failed on a frame: %s", self.last_error)
            return
        self._latencies_ms.append((time.perf_counter() - started) * 1e3)
        self.meter.add(reference, EMPTY if found is None else found)

    # --- reports --------------------------------------------------------------------------------------------

    def report(self) -> Dict[str, Any]:
        """The run as it stands (JSON-ready): state, why it ended, the sample's counts, the candidate's latency
        and errors, and the agreement (:meth:`AgreementMeter.report`)."""
        latencies = np.array(self._latencies_ms, np.float64)
        end = self._ended_at if self._ended_at is not None else self.clock()
        return {
            "state": self.state, "reason": self.reason or None,
            "candidate": self.candidate_identity,
            "reference": {"name": self.reference.manifest.name, "version": self.reference.manifest.version,
                          "manifest_sha256": self.reference.bundle.manifest_sha256},
            "sample": self.sample, "frames_wanted": self.frames_wanted, "max_s": self.max_s,
            "elapsed_s": round(end - self._started_at, 2) if self._started_at is not None else 0.0,
            "frames_offered": self.offered, "frames_sampled": self.sampled, "dropped_busy": self.dropped_busy,
            "frames_compared": len(self.meter.frames),
            "candidate_latency_ms": {
                "p50": round(float(np.percentile(latencies, 50)), 2) if len(latencies) else None,
                "p95": round(float(np.percentile(latencies, 95)), 2) if len(latencies) else None},
            "candidate_errors": self.errors, "last_error": self.last_error,
            "priority_problem": self.priority_problem,
            "agreement": self.meter.report(),
        }

    def _send_report(self) -> None:
        try:
            self.on_report(self.report())
        except Exception:  # a publisher's failure must not end the comparison
            log.exception("shadow run: publishing its report failed")
