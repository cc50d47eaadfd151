"""Replay of the outbox after each connect: oldest first, paced, at least once, and never a loop.

* At most ``replay_rate_hz`` messages a second and :data:`REPLAY_WINDOW` awaiting a PUBACK, so a backlog does
  not swamp a shared broker and a drop mid-replay duplicates at most a window.
* A row is marked delivered in the outbox when the broker acknowledged it (:meth:`Outbox.remove`): from then
  on it is never peeked or sent again, even while its delete keeps failing (a full disk); deletes are retried.
* After any error the replay resumes where it was on the same connection (the last row handed to paho), so
  rows in flight or acknowledged are not sent twice; a new connection starts again from the first
  undelivered row (what was in flight on the old one has no PUBACK and must go again).
* JSON-object payloads are sent with ``"historical": true``.
* This thread also takes the outbox's alerts (damaged file, disk pressure) and hands them to ``on_alert``,
  outside any transport lock, and re-checks disk pressure about once a second.
"""

import json
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from agent._util.ratelog import LogLimiter
from agent.ops.outbox import Outbox

logger = logging.getLogger(__name__)

REPLAY_BATCH = 100  # outbox rows read per query during replay
REPLAY_WINDOW = 100  # replayed messages awaiting PUBACK at once; bounds duplicates after a drop mid-replay
REPLAY_IDLE_S = 1.0  # the thread's idle wake-up: a safety net for a missed wake, and the disk-pressure check
ERROR_PAUSE_S = 1.0  # after an unexpected error, before resuming

Alert = Dict[str, Any]
# send(outbox_id, topic, data, qos, retain, generation) -> handed to paho on that connection?
Sender = Callable[[int, str, bytes, int, bool, int], bool]


def mark_historical(payload: bytes) -> bytes:
    """Add ``"historical": true`` to a JSON-object payload; other payloads are returned unchanged."""
    if payload.lstrip()[:1] != b"{":
        return payload
    try:
        message = json.loads(payload)
    except ValueError:
        return payload
    if not isinstance(message, dict):
        return payload
    message["historical"] = True
    return json.dumps(message, separators=(",", ":")).encode("utf-8")


class Replayer:
    """The replay thread. ``is_live(generation)`` says whether that connection is still the live one;
    ``replay_pending()`` is the number of replayed messages awaiting a PUBACK; ``take_acked()`` returns the
    outbox ids acknowledged since the last call."""

    def __init__(self, outbox: Outbox, rate_hz: float, current_generation: Callable[[], int],
                 is_live: Callable[[int], bool], send: Sender, replay_pending: Callable[[], int],
                 take_acked: Callable[[], List[int]], on_alert: Optional[Callable[[Alert], None]] = None) -> None:
        self._outbox = outbox
        self._interval = 1.0 / rate_hz
        self._current_generation = current_generation
        self._is_live = is_live
        self._send = send
        self._replay_pending = replay_pending
        self._take_acked = take_acked
        self._on_alert = on_alert
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self._cursor = 0  # the last outbox id handed to paho on connection `_cursor_generation`
        self._cursor_generation = -1
        self._settle_lock = threading.Lock()
        self._unsettled: List[int] = []  # acknowledged ids not yet marked in the outbox (an error came first)
        self._log = LogLimiter(logger)
        self._last_space_check = 0.0

    def run(self) -> None:
        """The thread's body, until :attr:`stop_event`."""
        while not self.stop_event.is_set():
            try:
                self.settle()
                self._housekeeping()
                generation = self._current_generation()
                if self._is_live(generation) and len(self._outbox):
                    self._session(generation)
                    continue
                self.wake.wait(REPLAY_IDLE_S)
                self.wake.clear()
            except Exception as exc:  # resume, never restart from the top: see the module docstring
                self._log.log(logging.ERROR, type(exc).__name__, "outbox replay: %s: %s; resuming after the "
                              "last row sent", type(exc).__name__, exc)
                logger.debug("outbox replay error", exc_info=True)
                self.stop_event.wait(ERROR_PAUSE_S)

    def _session(self, generation: int) -> None:
        """Replay on one connection, oldest first, until the outbox is empty or the connection ends."""
        if self._cursor_generation != generation:
            self._cursor_generation, self._cursor = generation, 0
        next_at = time.monotonic()
        while self._live(generation):
            rows = self._outbox.peek(REPLAY_BATCH, after_id=self._cursor)
            if not rows:
                self.settle()
                if self._replay_pending() == 0:
                    return
                self.stop_event.wait(self._interval)
                continue
            for row in rows:
                now = time.monotonic()
                if next_at > now and self.stop_event.wait(next_at - now):
                    return
                next_at = max(next_at, now) + self._interval
                while self._replay_pending() >= REPLAY_WINDOW:
                    if self.stop_event.wait(self._interval) or not self._live(generation):
                        return
                    self.settle()
                if not self._send(row.id, row.topic, mark_historical(row.payload), row.qos, row.retain,
                                  generation):
                    return
                self._cursor = row.id
            self.settle()
            self._housekeeping()

    def _live(self, generation: int) -> bool:
        return self._is_live(generation) and not self.stop_event.is_set()

    def settle(self) -> None:
        """Mark acknowledged rows delivered (one transaction for many acks); retry deletes that failed."""
        with self._settle_lock:  # the supervisor thread settles too, when a connection ends
            self._unsettled.extend(self._take_acked())
            if not self._unsettled:
                self._outbox.retry_deletes()
                return
            acked, self._unsettled = self._unsettled, []
            try:
                self._outbox.remove(acked)  # a full disk does not raise: the mark holds, the delete is retried
            except BaseException:
                self._unsettled = acked  # kept: marked on the next try, never re-sent
                raise

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_space_check >= REPLAY_IDLE_S:
            self._last_space_check = now
            self._outbox.check_space()
        self.deliver_alerts()

    def deliver_alerts(self) -> None:
        for alert in self._outbox.take_alerts():
            if self._on_alert is None:
                continue
            try:
                self._on_alert(alert)
            except Exception:  # a hook's bug must not stop the replay, nor vanish
                logger.exception("outbox alert hook failed for %s", alert.get("kind"))
