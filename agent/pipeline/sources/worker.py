"""One camera's reader process: opens the stream, decodes every frame, hands over only the frames wanted.

Run as ``python -m agent.pipeline.sources.worker`` by :class:`agent.pipeline.sources.stream.StreamReader`, one
process per camera, so that OpenCV's FFmpeg open lock, a blocked read or a decoder crash stays with that
camera, and ``OPENCV_FFMPEG_CAPTURE_OPTIONS`` (process-wide in OpenCV) is this camera's own.

Freshness rules, all here, next to the decoder:

* every frame is grabbed (decoded) as it arrives: rate limiting skips frames, it never sleeps, so the reader
  never falls behind the camera;
* the backlog FFmpeg buffers while it opens (about 3 s with GStreamer's server) is grabbed and dropped: a
  frame is handed over only once a grab had to wait for the camera;
* a picture identical to the previous one for :data:`FROZEN_AFTER_S` is not handed over; the worker ends
  with cause ``frozen`` and is reopened at once (OpenCV keeps returning the old picture after an in-stream
  resolution change);
* a frame the decoder reported damaged (FFmpeg's log, read after each grab), and every frame after it until
  a clean keyframe, is never handed over, only counted (:mod:`.damage`);
* a resolution change is reopened in place: the daemon, which reads FFmpeg's "Reinit context" line on our
  stderr, writes ``reopen`` on our stdin; the capture is released and opened again in this process (no new
  Python, no new OpenCV import) without FFmpeg's stream probing (:data:`QUICK_REOPEN_OPTIONS`), and ``OPEN``
  is sent again;
* the capture time comes from the stream's timestamps (PTS) mapped onto the box's clock by a model of the
  camera's clock that follows drift and jumps (:mod:`.clock`), else the read time; every grabbed frame, handed
  over or not, feeds the model.

Wire format on stdout: a header ``<4sII`` (kind, JSON length, payload length), the JSON, the payload. Kinds:
``OPEN`` (opened; fps), ``FRAM`` (a frame: shape, capture time, counters; payload = BGR pixels), ``FAIL``
(open failed; message), ``ENDS`` (no more frames; how long the last read waited), ``FROZ`` (the picture
froze), ``DAMG`` (once a second while frames are withheld as damaged: counts, how long since the damage
began with no clean keyframe). The spec comes as one JSON line on stdin, then ``reopen`` lines; stdin
closing (the daemon stopped or died) ends the worker at once.
"""

import json
import os
import sys
import threading
import time
from typing import Any, Dict, Optional

from agent.pipeline.sources.base import QUICK_REOPEN_OPTIONS, WORKER_HEADER, DecoderError
from agent.pipeline.sources.clock import StreamClock
from agent.pipeline.sources.damage import DAMAGE_NOTE_S, DamageTracker, StderrTap

# A grab that returns faster than this (or half a frame interval, if smaller) came from FFmpeg's buffer, not
# from the camera: the backlog of an open. Draining stops after MAX_DRAIN_S whatever happens.
BACKLOG_GRAB_S = 0.02
MAX_DRAIN_S = 5.0
FROZEN_AFTER_S = 0.5
SIGNATURE_STEP = 8  # every 8th pixel of every 8th row tells a frozen picture from a moving one


_channel: Any = None  # the pipe to the daemon: the original stdout (OpenCV's FFmpeg log prints to stdout)
_tap: Optional[StderrTap] = None  # our stdout and stderr (FFmpeg's log), read after each grab, then forwarded
_reopen = threading.Event()  # the daemon asked for a reopen in place (a resolution change)


def send(kind: bytes, meta: Dict[str, Any], payload: Any = b"") -> None:
    if _tap is not None:
        _tap.poll()  # the log lines before this message reach the daemon before it
    data = json.dumps(meta).encode()
    out = _channel
    out.write(WORKER_HEADER.pack(kind, len(data), len(payload)))
    out.write(data)
    if payload:
        out.write(payload)
    out.flush()


class Pacer:
    """max_fps by skipping: a frame is due when the next slot has come; slots do not pile up."""

    def __init__(self, max_fps: float) -> None:
        self.interval = 1.0 / max_fps if max_fps > 0 else 0.0
        self.next_due = 0.0

    def due(self, now: float) -> bool:
        if now < self.next_due:
            return False
        late = now - self.next_due
        self.next_due = (self.next_due if late < self.interval else now) + self.interval
        return True


def open_capture(spec: Dict[str, Any]) -> Any:
    import cv2

    if spec["decoder"] != "opencv":
        from agent.pipeline.sources.dvpp import open_dvpp  # raises ImportError without pyACL

        return open_dvpp(spec)
    # One decoder thread: FFmpeg's frame threading holds back (threads - 1) frames, 200 ms at 10 fps on two
    # cores, and a live stream is decoded one frame per arrival anyway.
    timeouts = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(spec["open_timeout_s"] * 1000),
                cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(spec["read_timeout_s"] * 1000), cv2.CAP_PROP_N_THREADS, 1]
    if spec["kind"] == "camera":
        return cv2.VideoCapture(int(spec["uri"].split(":", 1)[1]), cv2.CAP_ANY, timeouts)
    return cv2.VideoCapture(spec["uri"], cv2.CAP_FFMPEG, timeouts)


def quick_options() -> None:
    """Add :data:`QUICK_REOPEN_OPTIONS` to this process's FFmpeg options (the operator's own keep their values).
    OpenCV reads the variable at each open; 4.11.0 discards it (excluded by pyproject.toml; docs/sources.md)."""
    given = [kv for kv in os.environ.get("OPENCV_FFMPEG_CAPTURE_OPTIONS", "").split("|") if kv]
    keys = {kv.split(";", 1)[0] for kv in given}
    given += ["%s;%s" % kv for kv in QUICK_REOPEN_OPTIONS.items() if kv[0] not in keys]
    os.environ["OPENCV_FFMPEG_CAPTURE_OPTIONS"] = "|".join(given)


def serve(spec: Dict[str, Any]) -> int:
    while True:
        capture = open_capture(spec)
        if not capture.isOpened():
            send(b"FAIL", {"message": "cannot open the stream"})
            return 3
        status = read_frames(spec, capture)
        if status is not None:
            return status
        capture.release()  # a reopen in place was asked for
        _reopen.clear()
        quick_options()


def read_frames(spec: Dict[str, Any], capture: Any) -> Optional[int]:
    """Send OPEN, then frames until the stream ends (the exit status) or a reopen is asked for (None)."""
    fps = capture.get(5) or 0.0  # cv2.CAP_PROP_FPS
    send(b"OPEN", {"fps": fps})
    backlog_s = min(BACKLOG_GRAB_S, 0.5 / fps) if fps > 0 else BACKLOG_GRAB_S
    clock, pacer, damage = StreamClock(), Pacer(spec["max_fps"]), DamageTracker()
    started = time.monotonic()
    live = False
    skipped = errors = damaged = 0
    signature, same_since = b"", 0.0
    broken_since = noted = 0.0
    while not _reopen.is_set():
        before = time.monotonic()
        if not capture.grab():
            send(b"ENDS", {"waited_s": time.monotonic() - before})  # a read timeout is a stall, not an end
            return 0
        now = time.monotonic()
        read_ts = time.time()
        capture_ts, ts_source = clock.capture_time(capture.get(0), read_ts)  # cv2.CAP_PROP_POS_MSEC
        reported, broken = damage.frame(_tap.poll() if _tap is not None else "",
                                        bool(capture.get(67)))  # cv2.CAP_PROP_LRF_HAS_KEY_FRAME
        errors += reported
        if broken:  # never handed over: damaged by the decoder's own word, or predicted from such a frame
            damaged += 1
            broken_since = broken_since or now
            if now - max(noted, broken_since) >= DAMAGE_NOTE_S:  # no frame goes out: say why, with the counts
                send(b"DAMG", {"damaged": damaged, "decode_errors": errors, "broken_s": now - broken_since})
                damaged = errors = 0
                noted = now
            continue
        broken_since = 0.0
        if not live:
            live = now - before >= backlog_s or now - started >= MAX_DRAIN_S
            if not live:
                skipped += 1
                continue
        if not pacer.due(now):
            skipped += 1
            continue
        ok, image = capture.retrieve()
        if not ok or image is None:
            errors += 1
            continue
        sample = image[::SIGNATURE_STEP, ::SIGNATURE_STEP].tobytes()
        if sample == signature:
            if now - same_since >= FROZEN_AFTER_S:
                send(b"FROZ", {"shape": list(image.shape)})
                return 0
            skipped += 1
            continue
        signature, same_since = sample, now
        height, width = image.shape[:2]
        send(b"FRAM", {"h": height, "w": width, "capture_ts": capture_ts, "ts_source": ts_source,
                       "read_ts": read_ts, "skipped": skipped, "decode_errors": errors, "damaged": damaged},
             memoryview(image.reshape(-1)) if image.flags["C_CONTIGUOUS"] else image.tobytes())
        skipped = errors = damaged = 0
    return None


def _exit_with_parent() -> None:
    for line in sys.stdin:  # ends when the daemon closes our stdin, or dies
        if line.strip() == "reopen":
            _reopen.set()
    os._exit(0)


def main() -> int:
    global _channel, _tap
    _channel = os.fdopen(os.dup(1), "wb")
    _tap = StderrTap()  # whatever a library prints is read here, then goes on to stderr (the daemon's causes)
    spec = json.loads(sys.stdin.readline())
    threading.Thread(target=_exit_with_parent, name="parent-watch", daemon=True).start()
    try:
        return serve(spec)
    except BrokenPipeError:  # the daemon went away mid-frame
        return 0
    except (ImportError, DecoderError) as exc:  # a decoder whose runtime is not installed, or refuses the stream
        send(b"FAIL", {"message": str(exc), "cause": "config"})
        return 3


if __name__ == "__main__":
    sys.exit(main())
