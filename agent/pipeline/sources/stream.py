"""Cameras and network streams: each read by a worker process of its own (:mod:`.worker`).

Why a process per camera, not a thread: OpenCV's FFmpeg ``open()`` holds a process-wide lock, so one camera
that accepts and never answers holds up every other camera's open and reopen by its whole timeout (on the
rig: 11.2 s behind a 10 s blackhole; 1.4 s with ``OPENCV_FFMPEG_IS_THREAD_SAFE=1``, which lifts the lock but
not the rest); a decoder crash would take the daemon with it; a read blocked in C cannot be interrupted, and
the process aborted at exit when a stalled camera resumed while it stopped (SIGABRT, issue #21). A worker is
killed instead, and its death is one camera's error. The price: a Python process with OpenCV per camera and
one copy of each handed-over frame through a pipe (docs/sources.md).

The cause of a failed open is read from FFmpeg's and OpenCV's own error lines on the worker's stderr
(401 → ``auth``, 404 → ``not_found``, refused, timeout); every such line is redacted before it is kept.
"""

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, Optional, Tuple

import numpy as np

from agent._util.redact import redact
from agent.config.daemon_config import SourceConfig
from agent.config.schema import ConfigError
from agent.config.source_uri import resolve_source_uri, source_kind
from agent.pipeline.sources.base import WORKER_HEADER as HEADER
from agent.pipeline.sources.base import Captured, EndOfSource, SourceUnavailable, register
from agent.pipeline.sources.damage import DAMAGE_NOTE_S, DAMAGE_PATTERNS, SizeWatch, reinit_size

log = logging.getLogger(__name__)

WORKER_START_S = 30.0  # a worker's Python start (import of OpenCV) on a slow board, on top of the open timeout
STOP_GRACE_S = 0.5  # a worker given its stdin's end gets this long before SIGKILL
STDERR_LINES = 20
READ_TIMEOUT_SLACK_S = 0.5  # a read that ended this close to the read timeout was cut by it: the camera stalled
# (a pattern in FFmpeg's or OpenCV's error lines, cause); first match wins. A status code is a whole number
# ("401 Unauthorized"), never digits inside another: a camera on port 40337 refused is "refused", not "auth".
CAUSE_PATTERNS = tuple((re.compile(pattern), cause) for pattern, cause in (
    (r"\b401\b", "auth"), (r"Unauthorized", "auth"), (r"\b403\b", "auth"), (r"\b404\b", "not_found"),
    (r"Not Found", "not_found"), (r"Connection refused", "refused"), (r"timeout", "timeout"),
    (r"timed out", "timeout"), (r"No such file", "not_found"), (r"can't open camera", "not_found")))


# OpenCV's prefixes ("[OPENCV:FFMPEG:16] ", "[ WARN:0@3.3] global cap.cpp:215 open ") and a line it adds to
# every failed open, which says nothing about the cause.
_PREFIX = re.compile(r"^\[[^\]]*\]\s*(global \S+ \S+ )?")
_NOISE = "can't be used to capture by name"
# Signals a process raises on itself when it faults: the decoder crashed. Any other signal killed it from outside.
CRASH_SIGNALS = tuple(int(getattr(signal, n)) for n in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
                      if hasattr(signal, n))


def classify(text: str) -> str:
    for pattern, cause in CAUSE_PATTERNS:
        if pattern.search(text):
            return cause
    return "unavailable"


@register("stream")
@register("camera")
class StreamReader:
    live = True

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        self.kind = source_kind(config.uri)
        self.proc: Optional[subprocess.Popen] = None
        self.stderr: Deque[str] = deque(maxlen=STDERR_LINES)
        self._buffer = bytearray()
        self._err_buffer = b""
        self.fps = 0.0
        self.sizes = SizeWatch()  # the decoder's frame size: a resolution change, or a damaged SPS
        self._resized: Optional[Tuple[int, int]] = None
        self._reopening = False  # a reopen in place was asked for (a resize) and its OPEN has not come yet
        self._damage_noted = (0, 0)  # (damaged, decode_errors) from DAMG notes, added to the next frame's
        self.withholding = False  # DAMG notes since the last frame: pictures arrive, all withheld as damaged

    # --- the worker process ---------------------------------------------------------------------------

    def _spec(self) -> Dict[str, Any]:
        try:
            uri = resolve_source_uri(self.config.uri, "sources[%s].uri" % self.config.name)
        except ConfigError as exc:
            raise SourceUnavailable(str(exc), "config") from None
        c = self.config
        return {"uri": uri, "kind": self.kind, "open_timeout_s": c.open_timeout_s,
                "read_timeout_s": c.read_timeout_s, "max_fps": c.max_fps, "decoder": c.decoder}

    def _environment(self) -> Dict[str, str]:
        options = dict(self.config.input_options)
        if self.kind == "stream" and self.config.uri.lower().startswith("rtsp"):
            options.setdefault("rtsp_transport", self.config.transport)
        env = dict(os.environ)
        env["OPENCV_FFMPEG_CAPTURE_OPTIONS"] = "|".join("%s;%s" % kv for kv in options.items())
        # AV_LOG_VERBOSE: errors name a failed open's cause; the decoder's "Reinit context to WxH" tells a
        # resolution change in the stream, which OpenCV hides (it returns frozen or garbled pictures at the old
        # size). Verbose lines come at open and at such changes only.
        env["OPENCV_FFMPEG_LOGLEVEL"] = "40"
        env.pop("OPENCV_FFMPEG_IS_THREAD_SAFE", None)  # one camera per process: no lock to lift
        return env

    def open(self, cancel: threading.Event) -> None:
        spec = self._spec()
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.pipeline.sources.worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=self._environment(), start_new_session=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec).encode() + b"\n")  # the password goes here, never in argv
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.config.open_timeout_s + WORKER_START_S
        while not cancel.is_set():
            message = self._next_message(min(0.1, max(0.0, deadline - time.monotonic())))
            if message is not None:
                kind, meta, _ = message
                if kind == b"OPEN":
                    self.fps = float(meta.get("fps") or 0.0)
                    self.stderr.clear()  # the open's lines say nothing about a later death
                    return
                raise self._failure(meta)
            if time.monotonic() >= deadline:
                raise SourceUnavailable("no answer within %.0f s" % (deadline - time.monotonic()), "timeout")
        raise SourceUnavailable("stopped while opening", "unavailable")

    def _failure(self, meta: Dict[str, Any]) -> SourceUnavailable:
        """Why the worker could not open: its own message, the cause read from its error lines."""
        self._drain_stderr(0.2)
        said = "; ".join(self.stderr)
        cause = meta.get("cause") or classify(said)
        text = "cannot open %s: %s%s" % (redact(self.config.uri), meta.get("message", "failed"),
                                         " (%s)" % said[-300:] if said else "")
        return SourceUnavailable(redact(text), cause)

    def read(self, timeout: float) -> Optional[Captured]:
        message = self._next_message(timeout)
        self._resized = self._resized or self.sizes.due()
        if self._resized is not None:
            self._reopen_in_place()
        if message is None:
            return None
        kind, meta, payload = message
        if kind == b"OPEN":  # the reopen in place is done: pictures at the new size follow
            self._reopening = False
            self.stderr.clear()
            return None
        if kind == b"FRAM" and self._reopening:
            return None  # decoded before the reopen: the old size, frozen or garbled
        if kind == b"FRAM":
            image = np.frombuffer(payload, np.uint8).reshape(meta["h"], meta["w"], -1)
            (damaged, errors), self._damage_noted = self._damage_noted, (0, 0)
            self.withholding = False
            return Captured(image, meta["capture_ts"], meta["ts_source"], skipped=meta["skipped"],
                            decode_errors=meta["decode_errors"] + errors, damaged=meta.get("damaged", 0) + damaged)
        if kind == b"DAMG":
            return self._damage_note(meta)
        if kind == b"FROZ":
            raise SourceUnavailable("the picture froze (%s): reopening" % "x".join(map(str, meta["shape"])),
                                    "frozen")
        if kind == b"ENDS":
            waited = float(meta.get("waited_s", 0.0))
            if waited >= min(self.config.read_timeout_s, self.config.stall_timeout_s) - READ_TIMEOUT_SLACK_S:
                raise SourceUnavailable("no data for %.1f s (read timeout)" % waited, "stalled")
            raise EndOfSource(redact(self.config.uri))
        raise self._failure(meta)

    def _damage_note(self, meta: Dict[str, Any]) -> None:
        """Every frame withheld as damaged for a while (:mod:`.damage`): counted; past the stall timeout with no
        clean keyframe, the session ends with cause ``no_keyframe`` (a new open starts at a keyframe): a note
        before the driver's stall timer would call it ``stalled``."""
        damaged, errors = self._damage_noted
        self._damage_noted = (damaged + int(meta["damaged"]), errors + int(meta["decode_errors"]))
        self.withholding = True
        broken_s = float(meta["broken_s"])
        if broken_s + DAMAGE_NOTE_S >= self.config.stall_timeout_s:
            raise SourceUnavailable("every frame damaged for %.1f s (%d withheld, %d reported by the decoder) and "
                                    "no clean keyframe since: reopening" % (broken_s, *self._damage_noted),
                                    "no_keyframe")
        return None

    def _reopen_in_place(self) -> None:
        """A resolution change: the worker releases its capture and opens it again in its own process (about
        0.5 s; a new worker would first spend a second importing OpenCV)."""
        log.info("source %s: the stream changed resolution to about %dx%d: reopening in place", self.config.name,
                 *self._resized)
        self._resized = None
        self.sizes.reset()  # the reopened decoder says its size again
        self._reopening = True
        try:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(b"reopen\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # the worker is gone: its pipe's end says so at the next read

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()  # the worker exits on its own when it can
        except OSError:
            pass
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # blocked in C (an open, a read): nothing else ends it
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        self._buffer = bytearray()

    # --- the pipe ----------------------------------------------------------------------------------------

    def _next_message(self, timeout: float) -> Optional[Tuple[bytes, Dict[str, Any], bytes]]:
        """The next whole message from the worker, or None when none came within ``timeout``."""
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stderr is not None
        out, err = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        deadline = time.monotonic() + timeout
        while True:
            message = self._parse()
            if message is not None:
                return message
            remaining = deadline - time.monotonic()
            if remaining < 0:
                return None
            ready, _, _ = select.select([out, err], [], [], remaining)
            if err in ready:
                self._read_stderr(err)
            if out in ready:
                chunk = os.read(out, 1 << 20)
                if not chunk:
                    raise self._died()
                self._buffer += chunk

    def _parse(self) -> Optional[Tuple[bytes, Dict[str, Any], bytes]]:
        if len(self._buffer) < HEADER.size:
            return None
        kind, meta_len, payload_len = HEADER.unpack_from(self._buffer)
        end = HEADER.size + meta_len + payload_len
        if len(self._buffer) < end:
            return None
        meta = json.loads(bytes(self._buffer[HEADER.size:HEADER.size + meta_len]))
        payload = bytes(self._buffer[HEADER.size + meta_len:end])
        del self._buffer[:end]
        return kind, meta, payload

    def _read_stderr(self, fd: int) -> None:
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        lines = (self._err_buffer + chunk).split(b"\n")
        self._err_buffer = lines.pop()
        batch = b"\n".join(lines).decode("utf-8", "replace")  # the lines read together: errors beside a Reinit
        for line in lines:
            text = redact(_PREFIX.sub("", line.decode("utf-8", "replace").strip()))
            self._size_line(text, batch)
            if text and _NOISE not in text:
                self.stderr.append(text)
                log.debug("source %s worker: %s", self.config.name, text)

    def _size_line(self, text: str, batch: str) -> None:
        """A "Reinit context to WxH" line: a new size asks for a reopen, a damaged SPS does not
        (:class:`.damage.SizeWatch`; errors are looked for among the lines read with it)."""
        size = reinit_size(text)
        if size is None:
            return
        before, suspect = self.sizes.damaged, self.sizes.suspect
        self._resized = self.sizes.seen(size, bool(DAMAGE_PATTERNS.search(batch))) or self._resized
        if before == 0 and self.sizes.damaged:  # once a session: a camera that keeps doing it must not flood
            log.info("source %s: the decoder's size %dx%d was a damaged parameter set, not a resolution change: "
                     "counted as damage, not reopened", self.config.name, *(suspect[0] if suspect else size))

    def _drain_stderr(self, timeout: float) -> None:
        if self.proc is None or self.proc.stderr is None:
            return
        fd = self.proc.stderr.fileno()
        while select.select([fd], [], [], timeout)[0]:
            before = len(self.stderr)
            self._read_stderr(fd)
            if len(self.stderr) == before and not self._err_buffer:
                break

    def _died(self) -> SourceUnavailable:
        """The worker's pipe closed without a word: it crashed (a decoder fault) or was killed."""
        assert self.proc is not None
        self._drain_stderr(0.2)
        code = self.proc.wait()
        what = ("killed by %s (signal %d)" % (signal.Signals(-code).name, -code)) if code < 0 else \
            "exited with status %d" % code
        said = "; ".join(self.stderr)
        # SIGKILL, SIGTERM and the like come from outside (the OOM killer, an operator); a fault signal is the
        # decoder's own crash.
        cause = "killed" if code < 0 and -code not in CRASH_SIGNALS else "decode"
        return SourceUnavailable(redact("reader process %s%s" % (what, " (%s)" % said[-300:] if said else "")),
                                 cause)
