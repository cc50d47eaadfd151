"""Which decoded frames are damaged, from what the decoder itself says, frame by frame (the worker's side).

OpenCV's FFmpeg backend hands back a picture whatever the decoder went through: a frame missing a slice comes
back concealed (grey or smeared blocks), and the frames that reference it carry the damage on until the next
keyframe. What the worker can observe is FFmpeg's own log: the worker's stdout and stderr go through a pipe it
reads itself (:class:`StderrTap`) after every grab, so each line is tied to the frame whose decoding wrote it
(the log is written synchronously inside ``grab()``, one decoder thread), and forwarded unchanged to the daemon.

A frame is **reported** damaged when its decoding logged one of :data:`DAMAGE_PATTERNS` (concealment, a broken
macroblock or slice, a missing reference, lost RTP packets); every later frame is **damaged** too, until a
keyframe that decodes clean (OpenCV's ``CAP_PROP_LRF_HAS_KEY_FRAME``: the last packet's key flag), since it
predicts from damaged pictures. Limits: what FFmpeg does not log is not seen (a bit flip inside a residual that
decodes to valid syntax gives a wrong picture with no error); a frame whose damage FFmpeg reports while
decoding a later one is attributed to that later one (and the spell covers both from there on).

A change of the decoder's picture size ("Reinit context to WxH") is a resolution change, which the reader
reopens for, unless it is a damaged SPS (the issue's ~240x96): a size below :data:`SIZE_FLOOR` is damage at
once (:func:`implausible_size`; that frame is reported damaged, so it and the frames until a clean keyframe are
withheld and counted, and nothing reopens); a size logged together with decoder errors is a suspect: if the
decoder goes back to its size within :data:`FLIP_BACK_S` it was damage, else a resolution change after all.
"""

import fcntl
import os
import re
import time
from typing import Callable, Optional, Tuple

# FFmpeg's lines that mean the picture just decoded is not the camera's: libavcodec's h264/hevc error
# resilience and slice decoding, and rtpdec's packet loss.
DAMAGE_PATTERNS = re.compile(
    r"concealing \d+ DC|error while decoding MB|decode_slice_header error|Invalid NAL unit|"
    r"Error splitting the input into NAL units|[Mm]issing reference picture|reference picture missing|"
    r"RTP: missed \d+ packets|no frame!|mmco: unref short failure|non-existing [PS]PS|block unavailable|"
    r"cbp too large|out of range intra chroma pred mode|dquant out of range|Invalid level prefix|"
    r"negative number of zero coeffs|corrupted macroblock|illegal short term buffer state")
REINIT = re.compile(r"Reinit context to (\d+)x(\d+)")  # libavcodec's h264/hevc: the coded size changed
SIZE_FLOOR = (160, 120)  # (w, h): QQVGA, the smallest stream a camera serves; below it is a damaged SPS
FLIP_BACK_S = 1.0  # a new size logged with decoder errors that the decoder leaves again this soon was damage
DAMAGE_NOTE_S = 1.0  # while every frame is withheld as damaged, the worker tells the daemon this often
PIPE_SIZE = 1 << 20  # room for an open's verbose lines while the main thread is inside open()
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named there only from Python 3.10


def reinit_size(log_text: str) -> Optional[Tuple[int, int]]:
    """The size of the first "Reinit context to WxH" line in ``log_text``, if any."""
    reinit = REINIT.search(log_text)
    return (int(reinit.group(1)), int(reinit.group(2))) if reinit else None


def implausible_size(size: Tuple[int, int]) -> bool:
    """A picture size no camera serves: a damaged SPS, not a resolution change."""
    return size[0] < SIZE_FLOOR[0] or size[1] < SIZE_FLOOR[1]


class SizeWatch:
    """The reader's side of the decoder's size: which "Reinit context" lines are a resolution change (reopen
    for it) and which a damaged SPS (count it, change nothing)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.coded: Optional[Tuple[int, int]] = None  # the decoder's size (multiples of 16), once it said it
        self.suspect: Optional[Tuple[Tuple[int, int], float]] = None  # (size, since): logged with errors
        self.damaged = 0  # size changes named damage
        self._clock = clock

    def reset(self) -> None:
        """A reopened decoder says its size again."""
        self.coded = self.suspect = None

    def seen(self, size: Tuple[int, int], errors: bool) -> Optional[Tuple[int, int]]:
        """A "Reinit context" line (``errors``: decoder errors were logged with it): the size to reopen for,
        or None (the same size, a damaged SPS, or a suspect that :meth:`due` may still believe)."""
        if implausible_size(size):
            self.damaged += 1
            return None
        if self.coded is None or size == self.coded:
            if self.coded is not None and self.suspect is not None:
                self.damaged += 1  # back to its size within FLIP_BACK_S: the suspect was damage
            self.coded, self.suspect = size, None
            return None
        if errors:
            self.suspect = self.suspect or (size, self._clock())
            return None
        self.coded, self.suspect = size, None
        return size

    def due(self) -> Optional[Tuple[int, int]]:
        """A suspect size the decoder kept for :data:`FLIP_BACK_S`: a resolution change after all."""
        if self.suspect is None or self._clock() - self.suspect[1] < FLIP_BACK_S:
            return None
        self.coded, self.suspect = self.suspect[0], None
        return self.coded


class StderrTap:
    """This process's stdout and stderr into a pipe that :meth:`poll` drains: the text is returned (to look
    at) and written on to the original stderr (the daemon reads causes from it)."""

    def __init__(self) -> None:
        self.forward = os.dup(2)
        self._read, write = os.pipe()
        try:
            fcntl.fcntl(write, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # a kernel that refuses: the default 64 KiB
        fcntl.fcntl(self._read, fcntl.F_SETFL, fcntl.fcntl(self._read, fcntl.F_GETFL) | os.O_NONBLOCK)
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)

    def poll(self) -> str:
        """Everything written since the last poll (forwarded), as text."""
        chunks = []
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.forward, view):]
        return b"".join(chunks).decode("utf-8", "replace")


class DamageTracker:
    """Per grabbed frame: was it reported damaged by the decoder, and is it damaged (reported, or after a
    reported one before the next clean keyframe)?"""

    def __init__(self) -> None:
        self.broken = False  # a damaged frame was decoded and no clean keyframe has come since
        self._partial = ""  # a log line cut by the pipe, completed by the next poll

    def frame(self, log_text: str, keyframe: bool) -> Tuple[bool, bool]:
        """(reported, damaged) for the frame whose grab wrote ``log_text``."""
        text, _newline, partial = (self._partial + log_text).rpartition("\n")
        self._partial = partial[-4096:]
        size = reinit_size(text)
        reported = bool(DAMAGE_PATTERNS.search(text)) or (size is not None and implausible_size(size))
        if reported:
            self.broken = True
        elif keyframe:
            self.broken = False
        return reported, self.broken
