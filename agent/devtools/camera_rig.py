"""The camera rig: real RTSP cameras on loopback (:mod:`agent.devtools.rtsp_camera`) and the faults cameras have.

:class:`Camera` runs one GStreamer RTSP server process on a free 127.0.0.1 port under the system Python;
a test kills and restarts it, stalls it (SIGSTOP) and resumes it, changes its resolution mid-session, or makes its
clock misbehave (timestamps that jump or run slow).
:class:`Blackhole` is a port that accepts connections and never answers. :func:`free_port` gives a port where
nothing listens. Frames carry their capture time; :func:`frame_age_ms` reads it back from a decoded image.
Used by the tests (``tests/support/camera_rig.py`` skips where :func:`rig_missing` says why) and by the ``sources``
section of ``atlas-edge bench``; never by the daemon.
"""

import os
import signal
import socket
import subprocess
import threading
import time
from typing import List, Optional, Tuple

import numpy as np

from agent.devtools import framecode
from agent.devtools.broker import free_port

SYSTEM_PYTHON = "/usr/bin/python3"
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rtsp_camera.py")
BODY_TOLERANCE = 12  # grey levels: the body levels are 48 apart
READY_S = 20.0  # bound on a server's start (GStreamer's registry scan on a cold, loaded CI box)
PROBE = ("import gi; gi.require_version('GstRtspServer', '1.0'); from gi.repository import Gst; Gst.init(None); "
         "assert Gst.ElementFactory.find('x264enc')")
_available: Optional[str] = None


def rig_missing() -> str:
    """Why the rig cannot run here ('' when it can); checked once per test session."""
    global _available
    if _available is None:
        try:
            done = subprocess.run([SYSTEM_PYTHON, "-c", PROBE], capture_output=True, timeout=60)
            _available = "" if done.returncode == 0 else done.stderr.decode(errors="replace").strip()[-200:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            _available = str(exc)
    return _available


class RigMissing(RuntimeError):
    """The system Python cannot run the rig; the message names the packages and ``make camera-rig``."""


def require_rig() -> None:
    missing = rig_missing()
    if missing:
        raise RigMissing("needs the camera rig (GStreamer RTSP server, x264 and PyGObject for %s; `make camera-rig` "
                         "installs them): %s" % (SYSTEM_PYTHON, missing))


class Camera:
    """One RTSP camera: ``url()`` is its open stream, ``url(user=..., password=...)`` with credentials."""

    def __init__(self, size: Tuple[int, int] = (640, 360), fps: int = 10, password: str = "",
                 kbps: int = 2000, moving: bool = False, clip: Optional[str] = None) -> None:
        """``clip``: a file of raw BGR frames of ``size`` (:func:`write_clip`) the camera loops instead of its
        drawn frames (those carry the time code; a clip's pictures do not)."""
        require_rig()
        self.size, self.fps, self.password, self.kbps, self.moving = size, fps, password, kbps, moving
        self.clip = clip
        self.port = free_port("127.0.0.1")
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        cmd = [SYSTEM_PYTHON, SERVER, "--port", str(self.port), "--size", "%dx%d" % self.size,
               "--fps", str(self.fps), "--kbps", str(self.kbps)]
        if self.password:
            cmd += ["--password", self.password]
        if self.moving:
            cmd += ["--moving"]
        if self.clip:
            cmd += ["--play", self.clip]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line: List[bytes] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(READY_S)
        if not line or line[0].strip() != b"ready":
            self.kill()
            raise RuntimeError("camera rig did not start on port %d: %s" % (self.port, line))

    def url(self, path: str = "/cam", user: str = "", password: str = "") -> str:
        auth = "%s:%s@" % (user, password) if user else ""
        return "rtsp://%s127.0.0.1:%d%s" % (auth, self.port, path)

    def stall(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def resize(self, width: int, height: int) -> None:
        self.proc.stdin.write(b"size %d %d\n" % (width, height))
        self.proc.stdin.flush()

    def play(self, clip: str) -> None:
        """Loop the raw BGR frames of ``clip`` from the next frame on (the scene in front of the camera changes);
        ``-``: its drawn frames again."""
        self.clip = None if clip == "-" else clip
        self._command(b"play %s\n" % clip.encode())

    def jump_pts(self, seconds: float) -> None:
        """The camera's timestamps (PTS, RTP time) jump by ``seconds`` (negative: back); its pixels do not."""
        self._command(b"jump %f\n" % seconds)

    def clock_rate(self, rate: float) -> None:
        """The camera's timestamps run at ``rate`` times real time from now on (0.95: a clock 5% slow)."""
        self._command(b"rate %f\n" % rate)

    def damage(self, frames: int) -> None:
        """One RTP packet cut out of each of the next ``frames`` frames: truncated frames to the decoder."""
        self._command(b"damage %d\n" % frames)

    def packet_loss(self, every: int) -> None:
        """From now on one predicted frame in every ``every`` loses packets as :meth:`damage` cuts them (0: none):
        a lossy UDP link, by count, so every run loses the same share and the decoder reports each loss."""
        self._command(b"loss %d\n" % every)

    def drop_keyframes(self, seconds: float) -> None:
        """No keyframe reaches a viewer for ``seconds``: each is dropped whole (a lost IDR, a camera's broken GOP)."""
        self._command(b"nokey %f\n" % seconds)

    def _command(self, line: bytes) -> None:
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()

    def __enter__(self) -> "Camera":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Blackhole:
    """A TCP port that accepts every connection and never sends a byte (a camera whose firmware hung)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: List[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def url(self) -> str:
        return "rtsp://127.0.0.1:%d/cam" % self.port

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        for conn in self.held:
            conn.close()


def write_clip(path: str, frames: List[np.ndarray]) -> str:
    """Frames (BGR uint8, all of one size) as the raw file :class:`Camera` plays; returns ``path``."""
    with open(path, "wb") as handle:
        for frame in frames:
            handle.write(np.ascontiguousarray(frame, np.uint8).tobytes())
    return path


def frame_capture(image: np.ndarray, now_ms: Optional[int] = None) -> Optional[Tuple[int, int]]:
    """(capture time ms, counter) drawn by the rig into ``image``; None when the pixels do not carry them."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if image.shape[1] < framecode.BITS * framecode.BLOCK or image.shape[0] < 3 * framecode.BLOCK:
        return None
    return framecode.read(image, now_ms)


def frame_intact(image: np.ndarray, now_ms: Optional[int] = None) -> bool:
    """Whether a decoded frame of a ``moving`` camera is the picture the rig drew: its code rows read, and every
    block of its body has the grey its counter says (concealment, or prediction from a damaged frame, leaves
    another frame's grey behind). x264 at the rig's bitrate keeps flat grey within a few levels."""
    read = frame_capture(image, now_ms)
    if read is None:
        return False
    body = image[3 * framecode.BLOCK:, :, :].astype(np.int16)
    h, w = (body.shape[0] // 16) * 16, (body.shape[1] // 16) * 16
    blocks = body[:h, :w].reshape(h // 16, 16, w // 16, 16, 3).mean(axis=(1, 3, 4))  # (rows, cols) of 16x16
    return bool(np.abs(blocks - framecode.body_level(read[1])).max() <= BODY_TOLERANCE)


def frame_age_ms(image: np.ndarray, at: Optional[float] = None) -> Optional[float]:
    """How old the frame is at wall time ``at`` (now by default), read from its pixels."""
    at = time.time() if at is None else at
    read = frame_capture(image, int(at * 1000))
    return None if read is None else at * 1000 - read[0]
