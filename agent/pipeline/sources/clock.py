"""When a live stream's frame was captured, on the box's clock: a model of the camera's clock, not a minimum.

A frame's presentation time (PTS) is on the camera's clock; the box reads the frame ``offset = read - pts``
seconds later on its own. The smallest offset seen is the frame that came fastest, and
``capture = pts + that offset - latency``. Cameras' clocks misbehave, so the model is robust to them:

* the offset is the minimum over a trailing window of the stream's time (:data:`WINDOW_S` of PTS), not over
  the whole session: a clock that runs slow (the offset grows) or fast (it shrinks) is followed, with an error
  of at most ``WINDOW_S x drift`` (0.1 s for a clock 5 % slow; 0.1 ms for a real camera's 50 ppm);
* a PTS jump forward (the offset falls) is taken at once: it only makes frames look younger, by no more than
  the frame's own latency;
* an offset above the window's by more than :data:`JUMP_S` is either a frame that arrived late (a decoder's
  flush after a stall, a backlog: its lateness is real and it keeps the stream's date, so it is seen as
  stale) or the camera's PTS jumping back (the frame is on time; its PTS is wrong). Arrival tells them
  apart: a late frame waited (the gap since the previous frame explains its lateness) or is part of a burst
  (offsets falling frame after frame); a jumped one came at the usual pace. While a jump is unconfirmed its
  frames are dated by their read time (``ts_source`` ``read``); when the new offset has held for
  :data:`CONFIRM_S` (within :data:`SPREAD_S`), the model re-anchors on it;
* a clock that keeps jumping (:data:`MAX_JUMPS` re-anchors in :data:`DISTRUST_S`) is not trusted: frames are
  dated by their read time for :data:`DISTRUST_S`, as are frames without a PTS or with one that does not
  advance.

Either way the date is corrected by :data:`CAPTURE_LATENCY_S`, the camera's own capture-to-send time, which no
timestamp shows (the fastest frame still took that long): calibrated on the rig (docs/sources.md).

Pure Python, no OpenCV: the worker calls :meth:`StreamClock.capture_time` for every frame it decodes.
"""

from collections import deque
from typing import Deque, List, Optional, Tuple

# The fastest frame's capture-to-read time: encoding, RTP, the box's decode. Measured on the rig (x264
# zerolatency, one decoder thread): the PTS-based age read 93-104 ms below the age in the frames' pixels.
CAPTURE_LATENCY_S = 0.1
WINDOW_S = 2.0  # the offset is the minimum over this trailing window of PTS
MIN_SAMPLES = 8  # ... and over at least this many trusted frames
JUMP_S = 0.5  # an offset this far above the window's is a jump (or a late frame), not jitter
CONFIRM_S = 0.5  # a jumped offset that holds this long (read time) is the clock's new offset
SPREAD_S = 0.15  # ... holding: within this spread over the confirmation span
BURST_S = 0.03  # an offset this much below the previous one's: frames arriving faster than their PTS (a burst)
MAX_JUMPS = 3  # this many re-anchors within DISTRUST_S: the stream's clock is not trusted...
DISTRUST_S = 60.0  # ... and frames are dated by their read time for this long


class StreamClock:
    """One stream's PTS-to-wall mapping; :meth:`capture_time` gives each frame's capture time and its basis."""

    def __init__(self, latency_s: float = CAPTURE_LATENCY_S) -> None:
        self.latency_s = latency_s
        self._window: Deque[Tuple[float, float]] = deque()  # (pts, offset), the trusted offsets
        self._pending: List[Tuple[float, float, float]] = []  # (read_ts, offset, pts), above by > JUMP_S
        self._late = False  # the pending spell began with a late frame (not a jump)
        self._last: Optional[Tuple[float, float]] = None  # the previous frame's (read_ts, offset)
        self._last_pts = -1.0
        self._anchors: Deque[float] = deque()  # read times of recent re-anchors
        self.jumps = 0  # re-anchors after a PTS jump, this session
        self.distrust_until = 0.0

    def capture_time(self, pts_ms: float, read_ts: float) -> Tuple[float, str]:
        """(capture time on the box's clock, ``"stream"`` or ``"read"``) of a frame read at ``read_ts``."""
        if pts_ms <= 0 or pts_ms == self._last_pts:  # no timestamps, or ones that do not advance
            return read_ts - self.latency_s, "read"
        self._last_pts = pts_ms
        pts = pts_ms / 1000.0
        offset = read_ts - pts
        previous, self._last = self._last, (read_ts, offset)
        base = self._estimate()
        if base is None or offset <= base + JUMP_S:
            self._pending = []
            self._window.append((pts, offset))
            base = min(offset, base) if base is not None else offset
            return self._dated(pts + base, read_ts)
        return self._above(pts, offset, read_ts, base, previous)

    def _above(self, pts: float, offset: float, read_ts: float, base: float,
               previous: Optional[Tuple[float, float]]) -> Tuple[float, str]:
        """A frame whose offset is more than JUMP_S above the window's: late (stream date) or jumped (read date)."""
        gap = read_ts - previous[0] if previous is not None else 0.0
        if not self._pending:
            self._late = gap >= (offset - base) / 2  # it waited: the lateness is real
        burst = previous is not None and offset < previous[1] - BURST_S
        self._pending.append((read_ts, offset, pts))
        if self._confirmed():
            return self._dated(pts + self._reanchor(read_ts), read_ts)
        if self._late or burst:
            return pts + base - self.latency_s, "stream"
        return read_ts - self.latency_s, "read"

    def _confirmed(self) -> bool:
        """The pending offset has held for CONFIRM_S: the camera's clock moved (or a stalled PTS resumed)."""
        first_ts = self._pending[0][0]
        last_ts = self._pending[-1][0]
        if last_ts - first_ts < CONFIRM_S:
            return False
        recent = [o for t, o, _p in self._pending if t >= last_ts - CONFIRM_S]
        return max(recent) - min(recent) <= SPREAD_S

    def _reanchor(self, read_ts: float) -> float:
        recent = [(p, o) for t, o, p in self._pending if t >= read_ts - CONFIRM_S]
        self._window = deque(recent)
        self._pending = []
        self.jumps += 1
        self._anchors.append(read_ts)
        while self._anchors and self._anchors[0] < read_ts - DISTRUST_S:
            self._anchors.popleft()
        if len(self._anchors) >= MAX_JUMPS:
            self.distrust_until = read_ts + DISTRUST_S
        return min(o for _t, o in recent)

    def _estimate(self) -> Optional[float]:
        """The smallest offset over the last WINDOW_S of the stream's own time, and at least the last
        MIN_SAMPLES trusted frames (after a stall, the frames that came on time before it)."""
        window = self._window
        while len(window) > MIN_SAMPLES and window[0][0] < window[-1][0] - WINDOW_S:
            window.popleft()
        return min(o for _t, o in window) if window else None

    def _dated(self, capture_ts: float, read_ts: float) -> Tuple[float, str]:
        if read_ts < self.distrust_until:
            return read_ts - self.latency_s, "read"
        return capture_ts - self.latency_s, "stream"
