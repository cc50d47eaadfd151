"""Frame sources: image folders, video files, RTSP streams and USB cameras, each read on its own thread.

A source never crashes the daemon: an unreadable image is skipped and counted, a missing folder or a lost
stream is reopened with exponential backoff and counted, a truncated video ends (or loops) where it breaks.
Frames go into one bounded queue; when inference falls behind, the oldest frame is dropped and counted
(live video wants fresh frames, not a growing backlog).
"""

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import cv2
import numpy as np

from agent.config.daemon_config import SourceConfig

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


@dataclass
class Frame:
    source: str
    frame_id: int
    ts: float  # capture time, seconds since the epoch
    image: np.ndarray  # BGR uint8 (h, w, 3)
    name: str = ""  # file name for folder sources
    enqueued: float = 0.0  # time.monotonic() when queued, for the queue-wait stage timing


@dataclass
class SourceCounters:
    frames: int = 0
    decode_errors: int = 0
    reopens: int = 0
    open_failures: int = 0
    dropped_queue_full: int = 0
    last_error: str = ""


class SourceUnavailable(Exception):
    """The source cannot be opened now (missing path, stream down); the reader retries with backoff."""


class _FolderReader:
    def __init__(self, path: str, counters: SourceCounters) -> None:
        self.path = path
        self.counters = counters
        self.current_name = ""

    def frames(self) -> Iterator[Optional[np.ndarray]]:
        if not os.path.isdir(self.path):
            raise SourceUnavailable("image folder not found: %s" % self.path)
        names = sorted(n for n in os.listdir(self.path) if n.lower().endswith(IMAGE_SUFFIXES))
        if not names:
            raise SourceUnavailable("no images (%s) in %s" % ("/".join(IMAGE_SUFFIXES), self.path))
        for name in names:
            image = cv2.imread(os.path.join(self.path, name), cv2.IMREAD_COLOR)
            if image is None:
                self.counters.decode_errors += 1
                self.counters.last_error = "cannot decode image %s" % os.path.join(self.path, name)
                log.warning("%s: skipped", self.counters.last_error)
                continue
            self.current_name = name
            yield image


class _CaptureReader:
    """Video file, RTSP URL or ``camera:N`` through cv2.VideoCapture."""

    def __init__(self, uri: str, counters: SourceCounters) -> None:
        self.uri = uri
        self.counters = counters
        self.current_name = ""

    def _open(self) -> "cv2.VideoCapture":
        if self.uri.startswith("camera:"):
            capture = cv2.VideoCapture(int(self.uri.split(":", 1)[1]))
        else:
            if "://" not in self.uri and not os.path.exists(self.uri):
                raise SourceUnavailable("video file not found: %s" % self.uri)
            capture = cv2.VideoCapture(self.uri)
        if not capture.isOpened():
            capture.release()
            raise SourceUnavailable("cannot open %s" % self.uri)
        return capture

    def frames(self) -> Iterator[Optional[np.ndarray]]:
        capture = self._open()
        try:
            got_any = False
            while True:
                ok, image = capture.read()
                if not ok or image is None:
                    if not got_any:
                        raise SourceUnavailable("no frame could be read from %s" % self.uri)
                    return  # end of file, a truncated file's break, or a dropped stream: the reader decides
                got_any = True
                yield image
        finally:
            capture.release()


def _is_live(uri: str) -> bool:
    return uri.startswith("camera:") or "://" in uri


class SourceReader(threading.Thread):
    """Reads one source into the shared frame queue until stopped or (for a finite source) exhausted."""

    def __init__(self, config: SourceConfig, out: "queue.Queue", stop_event: threading.Event,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="source-%s" % config.name, daemon=True)
        self.config = config
        self.out = out
        self.stop_event = stop_event
        self.counters = SourceCounters()
        self.clock = clock
        self.finished = threading.Event()
        self.paused = threading.Event()
        self._next_id = 0

    def _reader(self):
        if os.path.isdir(self.config.uri) or (not _is_live(self.config.uri)
                                              and not os.path.splitext(self.config.uri)[1]):
            return _FolderReader(self.config.uri, self.counters)
        return _CaptureReader(self.config.uri, self.counters)

    def run(self) -> None:
        delay = self.config.reopen_min_s
        min_interval = 1.0 / self.config.max_fps if self.config.max_fps > 0 else 0.0
        last_emit = 0.0
        live = _is_live(self.config.uri)
        try:
            while not self.stop_event.is_set():
                reader = self._reader()
                try:
                    for image in reader.frames():
                        if self.stop_event.is_set():
                            return
                        while self.paused.is_set() and not self.stop_event.wait(0.05):
                            pass
                        if min_interval:
                            wait = last_emit + min_interval - time.monotonic()
                            if wait > 0 and self.stop_event.wait(wait):
                                return
                            last_emit = time.monotonic()
                        self._emit(image, getattr(reader, "current_name", ""))
                        delay = self.config.reopen_min_s  # a frame went through: the stream is healthy
                except SourceUnavailable as exc:
                    self.counters.open_failures += 1
                    if self.counters.last_error != str(exc):
                        log.error("source %s: %s (retrying with backoff)", self.config.name, exc)
                    self.counters.last_error = str(exc)
                    if self.stop_event.wait(delay):
                        return
                    delay = min(delay * 2, self.config.reopen_max_s)
                    continue
                if not (live or self.config.loop):
                    return  # a folder or file read to its end
                self.counters.reopens += 1
                if live:
                    log.warning("source %s: stream ended, reopening in %.1fs", self.config.name, delay)
                    if self.stop_event.wait(delay):
                        return
                    delay = min(delay * 2, self.config.reopen_max_s)
        except Exception:  # a bug here must not take the daemon down, and must not vanish
            log.exception("source %s failed", self.config.name)
        finally:
            self.finished.set()

    def _emit(self, image: np.ndarray, name: str) -> None:
        frame = Frame(source=self.config.name, frame_id=self._next_id, ts=self.clock(), image=image, name=name,
                      enqueued=time.monotonic())
        self._next_id += 1
        self.counters.frames += 1
        put_dropping_oldest(self.out, frame, self.counters)


def put_dropping_oldest(out: "queue.Queue", frame: Frame, counters: SourceCounters) -> None:
    while True:
        try:
            out.put_nowait(frame)
            return
        except queue.Full:
            try:
                out.get_nowait()
                counters.dropped_queue_full += 1
            except queue.Empty:
                pass


@dataclass
class SourceSet:
    """All readers of a daemon, started and stopped together; replaced whole on a source change."""

    configs: List[SourceConfig]
    out: "queue.Queue"
    readers: Dict[str, SourceReader] = field(default_factory=dict)
    stop_event: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        for config in self.configs:
            reader = SourceReader(config, self.out, self.stop_event)
            self.readers[config.name] = reader
            reader.start()

    def stop(self, timeout: float = 2.0) -> None:
        self.stop_event.set()
        for reader in self.readers.values():
            reader.join(timeout)

    def pause(self, paused: bool) -> None:
        for reader in self.readers.values():
            (reader.paused.set if paused else reader.paused.clear)()

    def all_finished(self) -> bool:
        return all(r.finished.is_set() for r in self.readers.values())

    def counters(self) -> Dict[str, Dict[str, object]]:
        return {name: vars(r.counters).copy() for name, r in self.readers.items()}
