"""The reader thread around each source, and the set of them a daemon runs.

One thread per source opens its reader, moves captured pictures into the shared bounded frame queue
(dropping the oldest when inference falls behind: live video wants fresh frames, not a backlog), and
handles everything that goes wrong the same way for every kind: a failure is classified, shown in the
source's health, alerted once, and retried with exponential backoff (to ``reopen_max_s`` at once for causes
a retry cannot fix). A live source that sends no new picture for ``stall_timeout_s`` is ``stalled`` and
reopened; a frame older than half that when it arrives is dropped, never served as fresh (its age from the
stream's clock model, :mod:`.clock`, which dates a frame by its read time while the stream's timestamps are in
doubt); a live source whose frames arrive but none goes out for the stall timeout is ``degraded``, not ``up``.
A folder or file ends (or loops, without announcing "up" again at each wrap); its ``max_fps`` paces reading,
where a live source's skips frames in its worker (which also reopens a stream that changed resolution in
place, :mod:`.worker`).

Each reader has its own stop event, so a config change stops and starts only the sources it touches
(:meth:`SourceSet.update`), and the memory watchdog can recycle one worker (:meth:`SourceReader.recycle`).
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent.config.daemon_config import SourceConfig
from agent.pipeline.sources.base import (
    PERMANENT_CAUSES,
    Captured,
    EndOfSource,
    Frame,
    Reader,
    SourceUnavailable,
    reader_for,
)
from agent.pipeline.sources.health import Alert, SourceHealth

log = logging.getLogger(__name__)

POLL_S = 0.1  # a reader waits at most this long per read, so stop, pause and stall timers stay prompt
# Causes after which a source reopens at once: the camera itself is fine (an in-stream resolution change).
REOPEN_AT_ONCE = ("frozen", "resized")
# Causes the box itself gave (the memory watchdog recycled the worker): shown and alerted, reopened at once.
RECYCLED = ("memory",)
# A live picture that arrives later than this share of the stall timeout after its capture is dropped, not
# served: it is a backlog or a decoder's flush after a stall, and the result would be stale before inference.
STALE_FRACTION = 0.5


class SourceReader(threading.Thread):
    """Reads one source into the shared frame queue until stopped or (for a finite source) exhausted."""

    def __init__(self, config: SourceConfig, out: "queue.Queue", stop_event: threading.Event,
                 on_alert: Optional[Alert] = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="source-%s" % config.name, daemon=True)
        self.config = config
        self.out = out
        self.stop_event = stop_event
        self.health = SourceHealth(config.name, config.uri, on_alert)
        self.clock = clock
        self.finished = threading.Event()
        self.paused = threading.Event()
        self.reader: Optional[Reader] = None
        self._next_id = 0
        self._delay = config.reopen_min_s
        self._recycle: Optional[SourceUnavailable] = None  # set by another thread: end this session

    def recycle(self, cause: str, message: str) -> None:
        """Any thread: end the current session with ``cause`` (its worker killed) and reopen at once."""
        self._recycle = SourceUnavailable(message, cause)

    def worker_pid(self) -> Optional[int]:
        """The process id of this source's worker (a stream's), or None (a folder, a file, none running)."""
        proc = getattr(self.reader, "proc", None)
        return None if proc is None else proc.pid

    def run(self) -> None:
        try:
            while not self.stop_event.is_set() and self._session():
                pass
        except Exception as exc:  # a bug here must not take the daemon down, and must not vanish
            log.exception("source %s failed", self.config.name)
            self.health.failure("unavailable", "reader failed: %s: %s" % (type(exc).__name__, exc), 0.0)
        finally:
            self.finished.set()

    def _session(self) -> bool:
        """One open-read-close cycle; False when a finite source has ended for good."""
        reader = reader_for(self.config)
        self._recycle = None  # asked of the process that has just ended, not of the one starting now
        self.reader = reader
        if reader.live or self.health.state != "up":  # a looping folder wraps without a new "up"
            self.health.connecting()
        try:
            reader.open(self.stop_event)
            self._pump(reader)
            return True
        except EndOfSource:
            if not reader.live:
                return self.config.loop
            self._retry(SourceUnavailable("the stream ended", "ended"))
        except SourceUnavailable as exc:
            self._retry(exc)
        finally:
            reader.close()
            self.health.reopens += 1
            self._collect_decode_errors(reader)
        return True

    def _retry(self, exc: SourceUnavailable) -> None:
        """Show the failure, then wait the backoff (cut short by stop)."""
        if self.stop_event.is_set():
            return  # stopped while opening or reading: not the source's failure
        if exc.cause in REOPEN_AT_ONCE:
            log.info("source %s: %s", self.config.name, exc)
            return
        if exc.cause in RECYCLED:
            self.health.failure(exc.cause, str(exc), 0.0)
            return
        delay = self.config.reopen_max_s if exc.cause in PERMANENT_CAUSES else self._delay
        if exc.cause not in ("stalled", "ended"):
            self.health.open_failures += 1
        self.health.failure(exc.cause, str(exc), delay)
        self.stop_event.wait(delay)
        self._delay = min(self._delay * 2, self.config.reopen_max_s)

    def _pump(self, reader: Reader) -> None:
        """Move pictures from an open reader to the queue until stopped; raises when the session ends."""
        interval = 1.0 / self.config.max_fps if self.config.max_fps > 0 and not reader.live else 0.0
        stall_s = self.config.stall_timeout_s
        newest = last_emit = served = time.monotonic()  # newest capture (monotonic), last pace slot, last served
        while not self.stop_event.is_set():
            recycle, self._recycle = self._recycle, None
            if recycle is not None:
                raise recycle
            captured = reader.read(POLL_S)
            now = time.monotonic()
            if captured is None:
                if reader.live and now - newest > stall_s:
                    if getattr(reader, "withholding", False):  # the worker's own no_keyframe note came late
                        raise SourceUnavailable("every picture damaged for %.1f s and no clean keyframe since: "
                                                "reopening" % (now - newest), "no_keyframe")
                    raise SourceUnavailable("no new picture for %.1f s" % (now - newest), "stalled")
                continue
            age = max(0.0, self.clock() - captured.capture_ts)
            # The stall timer runs from capture, not arrival: a decoder flushed by a read timeout hands over a
            # picture taken before the stall, and that must not restart the timer.
            newest = max(newest, now - age)
            self.health.frame_in(captured.skipped, captured.decode_errors, captured.damaged)
            self._collect_decode_errors(reader)
            if self.paused.is_set():
                served = now  # paused is not degraded
                continue  # a live source keeps reading, so resume starts fresh
            if reader.live and age > stall_s * STALE_FRACTION:
                self.health.stale_dropped += 1
                if now - served > stall_s and self.health.state != "degraded":
                    self.health.failure("clock", "frames arrive but none served for %.1f s: the last one %.1f s "
                                        "old by the stream's timestamps" % (now - served, age), 0.0)
                continue
            if interval:
                if self.stop_event.wait(max(0.0, last_emit + interval - time.monotonic())):
                    return
                last_emit = time.monotonic()
            self._emit(captured)
            served = time.monotonic()
            self._delay = self.config.reopen_min_s  # a frame went through: the source is healthy

    def _collect_decode_errors(self, reader: Reader) -> None:
        error = getattr(reader, "last_decode_error", "")
        if error:
            log.warning("source %s: %s: skipped", self.config.name, error)
            reader.last_decode_error = ""  # type: ignore[attr-defined]

    def _emit(self, captured: Captured) -> None:
        frame = Frame(source=self.config.name, frame_id=self._next_id, ts=captured.capture_ts,
                      image=captured.image, name=captured.name, enqueued=time.monotonic(),
                      ts_source=captured.ts_source)
        self._next_id += 1
        self.health.frame_out()
        put_dropping_oldest(self.out, frame, self.health)


def probe(config: SourceConfig) -> Dict[str, Any]:
    """Open ``config``'s source once and read one picture (``validate --probe``): what worked, or the cause."""
    reader = reader_for(config)
    started = time.monotonic()
    try:
        reader.open(threading.Event())
        deadline = started + config.open_timeout_s + config.stall_timeout_s
        while time.monotonic() < deadline:
            captured = reader.read(POLL_S)
            if captured is not None:
                height, width = captured.image.shape[:2]
                return {"ok": True, "image_hw": [height, width], "ts_source": captured.ts_source,
                        "seconds": round(time.monotonic() - started, 2)}
        raise SourceUnavailable("opened, but no picture within %.1f s" % config.stall_timeout_s, "stalled")
    except EndOfSource:
        return {"ok": False, "cause": "ended", "message": "no picture: the source ended at once"}
    except SourceUnavailable as exc:
        return {"ok": False, "cause": exc.cause, "message": str(exc)}
    finally:
        reader.close()


def put_dropping_oldest(out: "queue.Queue", frame: Frame, health: Any) -> None:
    """Queue ``frame``; when the queue is full, drop the oldest frame and count it on ``health``."""
    while True:
        try:
            out.put_nowait(frame)
            return
        except queue.Full:
            try:
                out.get_nowait()
                health.dropped_queue_full += 1
            except queue.Empty:
                pass


@dataclass
class SourceSet:
    """All readers of a daemon; a config change stops and starts only the sources it touches (:meth:`update`)."""

    configs: List[SourceConfig]
    out: "queue.Queue"
    on_alert: Optional[Alert] = None
    readers: Dict[str, SourceReader] = field(default_factory=dict)

    def start(self) -> None:
        for config in self.configs:
            self.readers[config.name] = self._started(config)

    def _started(self, config: SourceConfig) -> SourceReader:
        reader = SourceReader(config, self.out, threading.Event(), self.on_alert)
        reader.start()
        return reader

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop every reader (their workers are killed); True when all ended within ``timeout`` together."""
        return self._stop(list(self.readers.values()), timeout)

    @staticmethod
    def _stop(readers: List[SourceReader], timeout: float) -> bool:
        for reader in readers:
            reader.stop_event.set()
        deadline = time.monotonic() + timeout
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        return not any(r.is_alive() for r in readers)

    def update(self, configs: List[SourceConfig], timeout: float = 2.0) -> Tuple[List[str], List[str]]:
        """Stop the sources removed or changed, start the added or changed ones; the rest (and their workers)
        keep running untouched. Returns (names removed, names started)."""
        wanted = {c.name: c for c in configs}
        going = [name for name, r in self.readers.items() if wanted.get(name) != r.config]
        self._stop([self.readers[name] for name in going], timeout)
        kept = {name: r for name, r in self.readers.items() if name not in going}
        started = [c.name for c in configs if c.name not in kept]
        self.readers = {c.name: kept.get(c.name) or self._started(c) for c in configs}
        self.configs = list(configs)
        if going or started:
            log.info("sources changed: stopped %s, started %s, untouched %s", going or "none", started or "none",
                     list(kept) or "none")
        return [name for name in going if name not in wanted], started

    def recycle(self, name: str, cause: str, message: str) -> bool:
        """End one source's session with ``cause`` (its worker killed, reopened at once); False if unknown."""
        reader = self.readers.get(name)
        if reader is None:
            return False
        reader.recycle(cause, message)
        return True

    def worker_pids(self) -> Dict[str, int]:
        """The worker process of each source that has one running now, by name."""
        pids = {name: r.worker_pid() for name, r in self.readers.items()}
        return {name: pid for name, pid in pids.items() if pid is not None}
    def pause(self, paused: bool) -> None:
        for reader in self.readers.values():
            (reader.paused.set if paused else reader.paused.clear)()

    def all_finished(self) -> bool:
        return all(r.finished.is_set() for r in self.readers.values())

    def published(self, frame: Frame, age_ms: float) -> None:
        reader = self.readers.get(frame.source)
        if reader is not None:
            reader.health.published(age_ms)

    def counters(self) -> Dict[str, Dict[str, Any]]:
        """Each source's health (:meth:`SourceHealth.report`), by name."""
        return {name: r.health.report() for name, r in self.readers.items()}

    def summary(self) -> Dict[str, int]:
        """How many sources are in each state (the watchdog's 'no input' versus 'stuck')."""
        states: Dict[str, int] = {}
        for reader in self.readers.values():
            if not reader.finished.is_set():
                states[reader.health.state] = states.get(reader.health.state, 0) + 1
        return states
