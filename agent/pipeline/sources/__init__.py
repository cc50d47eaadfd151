"""Frame sources behind one reader interface, one reader kind per URI scheme (docs/sources.md).

* :mod:`.base`: the :class:`Reader` interface, the registry (:func:`register`, :func:`reader_for`), the frame;
* :mod:`.files`: image folders and video files, read in-process;
* :mod:`.stream`: RTSP/HTTP streams and ``camera:N``, each read by a worker process of its own (:mod:`.worker`);
* :mod:`.driver`: the thread around each reader (retries, stalls, rate limits) and the :class:`SourceSet`;
* :mod:`.health`: state, rates, frame age and the last error of each source, and its alerts.
"""

from agent.pipeline.sources import files, stream  # noqa: F401  (register their readers)
from agent.pipeline.sources.base import Captured, EndOfSource, Frame, Reader, SourceUnavailable, reader_for, register
from agent.pipeline.sources.driver import SourceReader, SourceSet, probe, put_dropping_oldest
from agent.pipeline.sources.health import SourceHealth

__all__ = ["Captured", "EndOfSource", "Frame", "Reader", "SourceHealth", "SourceReader", "SourceSet",
           "SourceUnavailable", "probe", "put_dropping_oldest", "reader_for", "register"]
