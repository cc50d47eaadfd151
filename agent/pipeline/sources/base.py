"""The reader interface every source kind implements, the registry that picks one by URI kind, and the frame.

A reader opens, hands over captured pictures one at a time and closes; the driver
(:mod:`agent.pipeline.sources.driver`) owns everything around it: retries and backoff, stall timers, rate
limits for files, health and alerts. A new kind of source is one module that registers its reader here
(``@register("kind")``) and one entry in :data:`agent.config.source_uri.SCHEMES`.
"""

import struct
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

from agent._util.compat import Protocol
from agent.config.daemon_config import SourceConfig
from agent.config.source_uri import source_kind

# A stream worker's messages (:mod:`.worker`): kind, JSON length, payload length; then the JSON and the payload.
WORKER_HEADER = struct.Struct("<4sII")
# Why a source is not delivering, as status and alerts name it.
CAUSES = ("auth", "not_found", "refused", "timeout", "decode", "stalled", "frozen", "resized", "ended", "config",
          "unavailable", "killed", "memory", "clock", "damaged", "no_keyframe")
# Causes a retry cannot fix: the source is `failed` and retried only every reopen_max_s.
PERMANENT_CAUSES = ("auth", "not_found", "config")
# FFmpeg input options of the reopen that follows a resolution change: the stream is known to work, so the
# open does not probe 20 frames for the frame rate (2 s at 10 fps; the SDP states it) or analyse 5 s of input.
QUICK_REOPEN_OPTIONS = {"analyzeduration": "100000", "fpsprobesize": "1"}


class DecoderError(RuntimeError):
    """A hardware decoder cannot serve this stream (its runtime refused, or the codec is not one it decodes):
    the source's error with cause ``config``, since a retry does not change it."""


@dataclass
class Frame:
    """One picture on its way to the model. ``ts`` is when it was captured: the stream's own timestamps
    mapped to the box's clock where the stream has them (``ts_source`` "stream"), else when it was read
    ("read")."""

    source: str
    frame_id: int
    ts: float  # capture time, seconds since the epoch
    image: np.ndarray  # BGR uint8 (h, w, 3)
    name: str = ""  # file name for folder sources
    enqueued: float = 0.0  # time.monotonic() when queued, for the queue-wait stage timing
    ts_source: str = "read"


@dataclass
class Captured:
    """What a reader hands the driver: the picture, its capture time and how many frames it skipped before it."""

    image: np.ndarray
    capture_ts: float
    ts_source: str = "read"
    name: str = ""
    skipped: int = 0  # frames the reader decoded but did not hand over (rate limit, backlog) since the last one
    decode_errors: int = 0  # frames it could not decode, or the decoder reported damaged, since the last one
    damaged: int = 0  # frames not handed over as damaged (reported, or after a reported one) since the last one


class SourceUnavailable(Exception):
    """The source cannot deliver now; ``cause`` is one of :data:`CAUSES`. The driver retries with backoff."""

    def __init__(self, message: str, cause: str = "unavailable") -> None:
        super().__init__(message)
        self.cause = cause


class EndOfSource(Exception):
    """A folder or file read to its end, or a stream its server ended."""


class Reader(Protocol):
    """One session with a source: ``open``, then ``read`` until it raises, then ``close`` (always)."""

    live: bool  # a camera or stream: frames are skipped, never waited for; stalls are watched
    # Pictures arrive but every one is withheld as damaged (a stream reader's DAMG notes): a stall timer that
    # runs out then is a spell without a clean keyframe, not a silent camera. Readers without it: False.
    withholding: bool

    def open(self, cancel: threading.Event) -> None: ...

    def read(self, timeout: float) -> Optional[Captured]: ...

    def close(self) -> None: ...


ReaderFactory = Callable[[SourceConfig], Reader]
READERS: Dict[str, ReaderFactory] = {}


def register(kind: str) -> Callable[[ReaderFactory], ReaderFactory]:
    """Class decorator: the reader of one URI kind (:data:`agent.config.source_uri.KINDS`)."""

    def add(factory: ReaderFactory) -> ReaderFactory:
        READERS[kind] = factory
        return factory

    return add


def reader_for(config: SourceConfig) -> Reader:
    """A new reader for ``config`` (validation has already refused URIs no reader takes)."""
    return READERS[source_kind(config.uri)](config)
