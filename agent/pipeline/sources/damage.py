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
"""

import fcntl
import os
import re
from typing import Tuple

# FFmpeg's lines that mean the picture just decoded is not the camera's: libavcodec's h264/hevc error
# resilience and slice decoding, and rtpdec's packet loss.
DAMAGE_PATTERNS = re.compile(
    r"concealing \d+ DC|error while decoding MB|decode_slice_header error|Invalid NAL unit|"
    r"Error splitting the input into NAL units|[Mm]issing reference picture|reference picture missing|"
    r"RTP: missed \d+ packets|no frame!|mmco: unref short failure|non-existing [PS]PS|block unavailable|"
    r"cbp too large|out of range intra chroma pred mode|dquant out of range|Invalid level prefix|"
    r"negative number of zero coeffs|corrupted macroblock|illegal short term buffer state")
DAMAGE_NOTE_S = 1.0  # while every frame is withheld as damaged, the worker tells the daemon this often
PIPE_SIZE = 1 << 20  # room for an open's verbose lines while the main thread is inside open()
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named there only from Python 3.10


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
        reported = bool(DAMAGE_PATTERNS.search(text))
        if reported:
            self.broken = True
        elif keyframe:
            self.broken = False
        return reported, self.broken
