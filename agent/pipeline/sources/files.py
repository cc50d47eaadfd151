"""Local sources, read in-process: an image folder and a video file (demo, soak runs, replays).

An unreadable image is skipped and counted; a truncated video ends where it breaks. Their capture time is
the read time: a file has no wall clock of its own.
"""

import os
import threading
import time
from typing import List, Optional

import cv2

from agent.config.daemon_config import SourceConfig
from agent.pipeline.sources.base import Captured, EndOfSource, SourceUnavailable, register

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


@register("folder")
class FolderReader:
    """The images of a folder in name order, once per open."""

    live = False

    def __init__(self, config: SourceConfig) -> None:
        self.path = config.uri
        self._names: List[str] = []
        self._errors = 0
        self.last_decode_error = ""

    def open(self, cancel: threading.Event) -> None:
        if not os.path.isdir(self.path):
            raise SourceUnavailable("image folder not found: %s" % self.path, "not_found")
        self._names = sorted(n for n in os.listdir(self.path) if n.lower().endswith(IMAGE_SUFFIXES))
        if not self._names:
            raise SourceUnavailable("no images (%s) in %s" % ("/".join(IMAGE_SUFFIXES), self.path), "not_found")
        self._names.reverse()  # popped from the end

    def read(self, timeout: float) -> Optional[Captured]:
        while self._names:
            name = self._names.pop()
            image = cv2.imread(os.path.join(self.path, name), cv2.IMREAD_COLOR)
            if image is None:
                self._errors += 1
                self.last_decode_error = "cannot decode image %s" % os.path.join(self.path, name)
                continue
            errors, self._errors = self._errors, 0
            return Captured(image, time.time(), "read", name=name, decode_errors=errors)
        raise EndOfSource(self.path)

    def close(self) -> None:
        self._names = []


@register("file")
class FileReader:
    """A video file through OpenCV, frame by frame."""

    live = False

    def __init__(self, config: SourceConfig) -> None:
        self.path = config.uri
        self._capture: Optional[cv2.VideoCapture] = None
        self._got_any = False
        self.last_decode_error = ""

    def open(self, cancel: threading.Event) -> None:
        if not os.path.exists(self.path):
            raise SourceUnavailable("video file not found: %s" % self.path, "not_found")
        capture = cv2.VideoCapture(self.path)
        if not capture.isOpened():
            capture.release()
            raise SourceUnavailable("cannot open video file %s" % self.path, "decode")
        self._capture = capture
        self._got_any = False

    def read(self, timeout: float) -> Optional[Captured]:
        assert self._capture is not None
        ok, image = self._capture.read()
        if not ok or image is None:
            if not self._got_any:
                raise SourceUnavailable("no frame could be read from %s" % self.path, "decode")
            raise EndOfSource(self.path)  # its end, or where a truncated file breaks
        self._got_any = True
        return Captured(image, time.time(), "read")

    def close(self) -> None:
        if self._capture is not None:
            self._capture.release()
            self._capture = None
