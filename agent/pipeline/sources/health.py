"""A source's health as operators see it: its state, its rates, how old its frames are, and why it is not up.

States: ``connecting`` (opening), ``up`` (frames go out), ``stalled`` (no new picture for the stall timeout),
``down`` (a failure retrying may fix: refused, timeout, ended, a decoder crash), ``failed`` (one it cannot:
``auth``, ``not_found``, a bad reference; retried only every ``reopen_max_s``), ``degraded`` (frames arrive and
none, or too few, can be served: :data:`DEGRADED_CAUSES`: ``clock``, the stream's timestamps call every frame
stale; ``damaged``, more than :data:`DAMAGED_SHARE` of the frames damaged; the reader stays open). A source
is ``up`` only while frames go out, never merely because they come in. One alert
when a source stops delivering (``source_down``, whatever the state), one when it delivers again
(``source_up``); the error is cleared on recovery. Every text here has passed :func:`agent._util.redact.redact`.

``last_error`` and the alerts say what failed in the project's words (:data:`CAUSE_WORDS`: "connection
refused", "timed out", ...), never FFmpeg's text: that names hosts and ports ("Successfully connected to
127.0.0.1 port 18902"), an oracle for whoever can point a source somewhere. The detail goes to the local log
only, redacted.
"""

import logging
import re
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Optional, Tuple

from agent._util.redact import redact
from agent.pipeline.sources.base import PERMANENT_CAUSES

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0  # fps in and out (and the damaged share) are counted over this trailing window
DAMAGED_SHARE = 0.25  # more than this share of a source's frames damaged: degraded (cause damaged), alerted
AGE_SAMPLES = 256  # frame ages kept for p50/max (a minute at 4 results/s)
Alert = Callable[[Dict[str, Any]], None]
# What status and alerts say for each cause; a cause not listed is said by its name.
CAUSE_WORDS = {"auth": "authentication failed", "not_found": "not found", "refused": "connection refused",
               "timeout": "timed out", "unavailable": "unreachable", "stalled": "no new picture (stalled)",
               "frozen": "the picture froze", "resized": "the stream changed resolution", "ended": "the source ended",
               "decode": "the decoder crashed", "killed": "the reader process was killed",
               "memory": "the reader process used too much memory",
               "clock": "frames arrive but none is served: their timestamps say they are stale (the camera's clock)",
               "damaged": "many frames arrive damaged (decoder errors): they are not served",
               "no_keyframe": "every frame damaged and no clean keyframe since (reopening)",
               "config": "a credential reference cannot be "
               "resolved (see the log)"}
DEGRADED_CAUSES = ("clock", "damaged")  # frames arrive and none is served; the reader stays open (no retry)
_SIGNAL = re.compile(r"\bkilled by (SIG[A-Z0-9]+)")


def public_message(cause: str, detail: str) -> str:
    """What ``last_error`` and alerts say of a failure: the cause's words (and the signal that ended a reader
    process), never ``detail``'s hosts, ports or server text."""
    words = CAUSE_WORDS.get(cause, cause.replace("_", " "))
    signal = _SIGNAL.search(detail)
    return "%s (%s)" % (words, signal.group(1)) if signal else words


class SourceHealth:
    """Counters and state of one source: written by its reader thread, read by status and telemetry."""

    def __init__(self, name: str, uri: str, on_alert: Optional[Alert] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.uri = redact(uri)
        self.on_alert = on_alert
        self.clock = clock
        self.state = "connecting"
        self.since = time.time()
        self.frames = 0  # handed to the frame queue
        self.served = 0  # results handed over (published, rate-limited or refused by the sink): frames served
        self.skipped = 0  # decoded and not handed over: rate limit, backlog at (re)connect, repeated pictures
        self.stale_dropped = 0  # older than the stall timeout when read
        self.decode_errors = 0  # frames the decoder could not decode or reported damaged
        self.damaged_frames = 0  # frames never handed over as damaged: reported, or predicted from such a frame
        self.open_failures = 0
        self.reopens = 0
        self.dropped_queue_full = 0
        self.last_error: Optional[Dict[str, Any]] = None
        self.retry_in_s: Optional[float] = None
        self._down_alerted = False
        self._lock = threading.Lock()
        self._in: Deque[float] = deque()
        self._out: Deque[float] = deque()
        self._ages: Deque[float] = deque(maxlen=AGE_SAMPLES)
        self._damage: Deque[Tuple[float, int, int]] = deque()  # (when, damaged, frames) per handed-over frame
        self._damaged_high = False

    # --- transitions (the reader thread) -------------------------------------------------------------------

    def connecting(self) -> None:
        self._set("connecting")

    def frame_in(self, skipped: int = 0, decode_errors: int = 0, damaged: int = 0) -> None:
        with self._lock:
            now = self.clock()
            self._in.append(now)
            self.skipped += skipped
            self.decode_errors += decode_errors
            self.damaged_frames += damaged
            self._damage.append((now, damaged, damaged + skipped + 1))
            while self._damage and self._damage[0][0] < now - RATE_WINDOW_S:
                self._damage.popleft()
            share = sum(d for _t, d, _n in self._damage) / float(sum(n for _t, _d, n in self._damage))
        if share > DAMAGED_SHARE and self.state != "degraded":
            self.failure("damaged", "%.0f %% of the frames in the last %.0f s damaged (the decoder's word)" % (
                100 * share, RATE_WINDOW_S), 0.0)
        self._damaged_high = share > DAMAGED_SHARE / 2  # hysteresis: up again once under half the bound

    def frame_out(self) -> None:
        """A frame went into the queue: the source is up (and recovered, if it was down)."""
        with self._lock:
            self.frames += 1
            self._out.append(self.clock())
        if self.state != "up" and not (self.state == "degraded" and self._damaged_high):
            self._set("up")
            self.retry_in_s = None
            recovered, self.last_error = self.last_error, None
            log.info("source %s up%s", self.name, " (was: %s)" % recovered["message"] if recovered else "")
            if self._down_alerted:
                self._down_alerted = False
                self._alert("source_up", "source %s is up again" % self.name)

    def failure(self, cause: str, message: str, retry_in_s: float) -> None:
        """An open failed or a session ended: ``stalled`` / ``down`` / ``failed`` by its cause."""
        detail, message = redact(message), public_message(cause, message)
        state = "stalled" if cause in ("stalled", "frozen") else "failed" if cause in PERMANENT_CAUSES else \
            "degraded" if cause in DEGRADED_CAUSES else "down"
        same = self.last_error is not None and self.last_error["detail"] == detail
        if not same:
            self.last_error = {"cause": cause, "message": message, "since": round(time.time(), 3),
                               "detail": detail}  # the log's, never reported
            hint = " (a retry cannot fix this: retrying every %.0f s)" % retry_in_s if state == "failed" else ""
            retry = "reading on" if state == "degraded" else "retrying in %.1f s" % retry_in_s
            log.error("source %s %s: %s [%s]; %s%s", self.name, state, detail, cause, retry, hint)
        self.retry_in_s = None if state == "degraded" else round(retry_in_s, 3)
        self._set(state)
        if not self._down_alerted:
            self._down_alerted = True
            self._alert("source_down", "source %s is %s: %s" % (self.name, state, message), cause=cause)

    def published(self, age_ms: float) -> None:
        """A result of this source was handed over ``age_ms`` after its frame was captured."""
        with self._lock:
            self.served += 1
            self._ages.append(age_ms)

    # --- reading (any thread) ------------------------------------------------------------------------------

    def report(self) -> Dict[str, Any]:
        now = self.clock()
        with self._lock:
            for window in (self._in, self._out):
                while window and window[0] < now - RATE_WINDOW_S:
                    window.popleft()
            ages = sorted(self._ages)
            fps_in, fps_out = len(self._in) / RATE_WINDOW_S, len(self._out) / RATE_WINDOW_S
        return {
            "uri": self.uri, "state": self.state, "since": round(self.since, 3),
            "fps_in": round(fps_in, 2), "fps_out": round(fps_out, 2),
            "frames": self.frames, "served": self.served, "skipped": self.skipped, "stale_dropped": self.stale_dropped,
            "decode_errors": self.decode_errors, "damaged_frames": self.damaged_frames,
            "open_failures": self.open_failures, "reopens": self.reopens,
            "dropped_queue_full": self.dropped_queue_full,
            "frame_age_ms": {"p50": round(ages[len(ages) // 2], 1), "max": round(ages[-1], 1)} if ages else None,
            "last_error": None if self.last_error is None else {
                k: v for k, v in self.last_error.items() if k != "detail"},
            "retry_in_s": self.retry_in_s,
        }

    # --- helpers ---------------------------------------------------------------------------------------------

    def _set(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.since = time.time()

    def _alert(self, kind: str, message: str, cause: Optional[str] = None) -> None:
        if self.on_alert is None:
            return
        alert = {"kind": kind, "message": message, "source": self.name, "state": self.state, "restart": False,
                 "figures": {"scope": "source", "source": self.name, "cause": cause}}
        try:
            self.on_alert(alert)
        except Exception:  # publishing an alert must not stop the reader
            log.exception("publishing the alert of source %s failed", self.name)
