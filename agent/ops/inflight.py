"""Messages handed to paho that await a PUBACK, the back-pressure on live publishing, and the counters.

Each message gets a sequence number in publish order (paho's mids wrap at 65535), so what was in flight when a
connection died can be moved to the outbox in the order it was published. Replayed outbox rows are tracked
apart from live messages: their PUBACK marks the row delivered (:meth:`InFlight.take_replay_acked`) instead of
freeing a live slot.

One lock (``lock``) guards everything here; it is never held while calling into paho or SQLite.
"""

import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Set

MAX_PENDING = 10000  # live messages awaiting PUBACK (bounded memory); a publisher waits for room, then...
BACKPRESSURE_WAIT_S = 1.0  # ...after this long stores to the outbox instead (a broker that slow is "away")
RESUME_PENDING = MAX_PENDING // 2  # a waiting publisher resumes here: one wake-up per half window

COUNTER_NAMES = ("published", "acked", "outboxed", "replayed", "requeued", "discarded", "lost", "reconnects",
                 "connect_failures", "refused", "subscribe_refused")


class Pending(NamedTuple):
    seq: int  # publish order, for requeueing in order
    topic: str
    payload: bytes
    qos: int
    retain: bool
    durable: bool
    outbox_id: Optional[int]  # set for replayed rows: they stay in the outbox until acknowledged


class InFlight:
    """Pending PUBACKs of one connection at a time, live and replayed, plus the transport's counters."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._drained = threading.Condition(self.lock)  # live_pending reached 0
        self._room = threading.Condition(self.lock)  # live_pending fell to RESUME_PENDING
        self._seq = 0
        self._pending: Dict[int, Pending] = {}
        self._early_acks: Set[int] = set()  # PUBACKs that beat the bookkeeping after client.publish
        self.live_pending = 0
        self.replay_pending = 0
        self._replay_acked: List[int] = []
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    # -- publisher side -----------------------------------------------------------------------------------

    def wait_for_room(self, still_connected: Callable[[], bool]) -> None:
        """Back-pressure: when the live window is full, wait (bounded) for it to drain to half."""
        if self.live_pending < MAX_PENDING:
            return
        with self._room:
            self._room.wait_for(lambda: self.live_pending <= RESUME_PENDING or not still_connected(),
                                BACKPRESSURE_WAIT_S)

    def has_room(self) -> bool:
        return self.live_pending < MAX_PENDING

    def track(self, mid: int, topic: str, data: bytes, qos: int, retain: bool, durable: bool,
              outbox_id: Optional[int]) -> None:
        """Record a message paho accepted (called right after ``client.publish``, under the state lock)."""
        replay = outbox_id is not None
        with self.lock:
            if not replay:
                self.counters["published"] += 1
            if mid in self._early_acks:
                self._early_acks.discard(mid)
                self._count_ack(replay, outbox_id)
                return
            self._seq += 1
            self._pending[mid] = Pending(self._seq, topic, data, qos, retain, durable, outbox_id)
            if replay:
                self.replay_pending += 1
            else:
                self.live_pending += 1

    # -- paho's thread ------------------------------------------------------------------------------------

    def acknowledge(self, mid: int) -> None:
        """A PUBACK for ``mid`` on the current connection."""
        with self.lock:
            pending = self._pending.pop(mid, None)
            if pending is None:
                self._early_acks.add(mid)
                return
            replay = pending.outbox_id is not None
            self._count_ack(replay, pending.outbox_id)
            if replay:
                self.replay_pending -= 1
                if self.replay_pending == 0:
                    self._drained.notify_all()  # stop() waits for both windows
            else:
                self.live_pending -= 1
                if self.live_pending == 0:
                    self._drained.notify_all()
                if self.live_pending == RESUME_PENDING:
                    self._room.notify_all()

    def _count_ack(self, replay: bool, outbox_id: Optional[int]) -> None:
        if replay:
            self.counters["replayed"] += 1
            self._replay_acked.append(outbox_id)  # type: ignore[arg-type]
        else:
            self.counters["acked"] += 1

    def new_connection(self) -> None:
        """A new paho client: mids start over, so early acks of the old one mean nothing."""
        with self.lock:
            self._early_acks.clear()

    # -- the connection ended -----------------------------------------------------------------------------

    def take_all(self) -> List[Pending]:
        """Everything still awaiting a PUBACK, in publish order; the window is emptied and waiters woken."""
        with self.lock:
            pending = sorted(self._pending.values(), key=lambda p: p.seq)
            self._pending = {}
            self._early_acks.clear()
            self.live_pending = 0
            self.replay_pending = 0  # replayed rows are still in the outbox
            self._drained.notify_all()
            self._room.notify_all()
        return pending

    def take_replay_acked(self) -> List[int]:
        """Outbox ids the broker acknowledged since the last call."""
        with self.lock:
            acked, self._replay_acked = self._replay_acked, []
        return acked

    def wait_live_drained(self, timeout: float) -> bool:
        with self._drained:
            return self._drained.wait_for(lambda: self.live_pending == 0, timeout)

    def wait_all_drained(self, timeout: float) -> bool:
        with self._drained:
            return self._drained.wait_for(lambda: self.live_pending == 0 and self.replay_pending == 0, timeout)

    def snapshot(self) -> Dict[str, int]:
        with self.lock:
            result = dict(self.counters)
            result["pending"] = self.live_pending
        return result
