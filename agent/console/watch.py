"""The console's one operator link: the fleet as ``fleet status`` reads it, kept current, and commands with acks.

One thread reads the link (:class:`agent.fleet.link.FleetLink` has one reader by design): statuses, telemetry,
alerts and shadow reports fold into a :class:`agent.fleet.status.FleetView`; each change bumps :attr:`version`
and wakes whoever waits in :meth:`changes_after` (the pages' event streams). A box page asks for a box's results
and snapshots (:meth:`watch_box`): those are subscribed per box, on demand, by the reader thread itself, so ten
thousand boxes' results never flow through the console. A command (:meth:`command`) subscribes its ack topic
first, then publishes the request the box's own parse accepted, and waits for the final ack.
"""

import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from agent.fleet.link import FleetLink, LinkError, Message
from agent.fleet.status import FleetView
from agent.protocol.envelope import CommandEnvelope
from agent.protocol.messages import Ack, ProtocolError, parse_ack
from agent.protocol.topics import (
    ACK,
    RESULTS,
    SNAPSHOT,
    ack_topic,
    announce_topic,
    command_topic,
    fleet_subscriptions,
    result_topic,
    snapshot_topic,
    split_device_topic,
)
from agent.protocol.verbs import command_payload, parse_request

READ_S = 0.2  # the reader's longest wait for a message: also how soon it takes a subscription request
CHANGES_KEPT = 20000  # (version, device) pairs kept for event streams that fell behind; older: a full refresh
RESULTS_KEPT = 50  # per watched box
WATCHED_BOXES = 64  # boxes whose results and snapshots are subscribed; the least recently viewed is dropped
SNAPSHOT_MAX_BYTES = 4 * 1024 * 1024  # a bigger "JPEG" from a box is not kept, and the page says why
COMMAND_TIMEOUT_S = 30.0
STALE_CHECK_S = 5.0  # how often online boxes not heard for 3 telemetry intervals are marked stale
COMMANDS_KEPT = 20  # per box, in the box page's command log
COMMAND_LOGS = 1000  # boxes whose command log is kept; the longest unused goes first


@dataclass
class BoxFeed:
    """What a box page shows beyond the status: its last results and the latest snapshot per source."""

    results: Deque[Dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RESULTS_KEPT))
    snapshots: Dict[str, Tuple[float, bytes]] = field(default_factory=dict)
    refused_snapshot: Optional[str] = None


class CommandError(Exception):
    """The command was not sent (bad fields, no link): the message says why."""


class FleetWatch:
    def __init__(self, link: FleetLink, prefix: str, envelope: Optional[CommandEnvelope] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.link = link
        self.prefix = prefix
        self.view = FleetView(prefix)
        self.envelope = envelope or CommandEnvelope(None, None)
        self.clock = clock
        self.version = 0
        self.error: Optional[str] = None  # why the link is gone; the pages say so
        self._changes: Deque[Tuple[int, str]] = deque(maxlen=CHANGES_KEPT)
        self._changed = threading.Condition()
        self._lock = threading.RLock()  # the view and feeds: read by request threads, written by the reader
        self._feeds: "OrderedDict[str, BoxFeed]" = OrderedDict()
        self._subscribe: "Deque[Tuple[List[str], threading.Event]]" = deque()
        self._acks: Dict[str, Deque[Ack]] = {}
        self._ack_devices: Set[str] = set()
        self._command_logs: "OrderedDict[str, Deque[Dict[str, Any]]]" = OrderedDict()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="console-link", daemon=True)

    def start(self, listen_s: float = 0.0) -> "FleetWatch":
        """Subscribe to the fleet's topics and start reading; ``listen_s``: wait that long for the retained
        statuses before returning (the first page then lists every box)."""
        # QoS 0: a QoS 1 burst of 10,000 retained statuses overflows Mosquitto's default per-client queue (1000):
        # the console listed 1,020 of 10,000 boxes (bench section console)
        self.link.subscribe(fleet_subscriptions(self.prefix), qos=0)
        # after the SUBACK, so no answer is missed: the boxes' live statuses (a broker that sends no retained
        # messages to a wildcard, like RabbitMQ, has only these), as `fleet status` asks for them
        self.link.publish(announce_topic(self.prefix), {"ts": time.time()})
        self._thread.start()
        if listen_s > 0:
            time.sleep(listen_s)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.link.close()

    # --- read side ----------------------------------------------------------------------------------------

    def read(self, reader: Callable[[FleetView], Any]) -> Any:
        """``reader(view)``'s answer, computed while the reader thread changes nothing (a page's rows are of one
        moment)."""
        with self._lock:
            return reader(self.view)

    def changes_after(self, version: int, timeout: float) -> Tuple[int, Optional[List[str]]]:
        """``(now, devices changed after version)``, waiting up to ``timeout`` for one; devices None: more
        changed than are kept (the page reloads its rows)."""
        with self._changed:
            if self.version == version and timeout > 0:
                self._changed.wait(timeout)
            now = self.version
            if now == version:
                return now, []
            if not self._changes or self._changes[0][0] > version + 1:
                return now, None
            return now, sorted({device for v, device in self._changes if v > version})

    def feed(self, device: str) -> BoxFeed:
        with self._lock:
            return self._feeds.get(device) or BoxFeed()

    def command_log(self, device: str) -> List[Dict[str, Any]]:
        """The commands this console sent ``device`` and how each ended, oldest first."""
        with self._lock:
            return list(self._command_logs.get(device, ()))

    def watch_box(self, device: str, timeout: float = 10.0) -> None:
        """Subscribe to ``device``'s results and snapshots (once; at most :data:`WATCHED_BOXES` boxes)."""
        with self._lock:
            if device in self._feeds:
                self._feeds.move_to_end(device)
                return
            self._feeds[device] = BoxFeed()
            while len(self._feeds) > WATCHED_BOXES:
                self._feeds.popitem(last=False)  # its messages are ignored from now on
        self._subscribe_now([result_topic(self.prefix, device, "+"), snapshot_topic(self.prefix, device, "+")],
                            timeout)

    # --- commands -----------------------------------------------------------------------------------------

    def command(self, device: str, verb: str, fields: Dict[str, Any], user: Optional[str] = None,
                timeout: float = COMMAND_TIMEOUT_S) -> Optional[Ack]:
        """Send ``verb`` to ``device`` and return its final ack (None: none within ``timeout``), kept in the
        box's :meth:`command_log` with ``user``. The fields go through the parse the box runs first: CommandError
        (a ConfigError's text) names a bad one, and nothing is sent."""
        try:
            request = parse_request(verb, fields)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        started = self.clock()
        ack = self._converse(device, verb, request, timeout)
        entry = {"ts": started, "user": user, "verb": verb, "state": "no final ack" if ack is None else ack.state,
                 "error": ack.error_text() or None if ack is not None else None}
        with self._lock:
            log = self._command_logs.setdefault(device, deque(maxlen=COMMANDS_KEPT))
            self._command_logs.move_to_end(device)
            log.append(entry)
            while len(self._command_logs) > COMMAND_LOGS:
                self._command_logs.popitem(last=False)
        self._bump(device)
        return ack

    def _converse(self, device: str, verb: str, request: Any, timeout: float = COMMAND_TIMEOUT_S) -> Optional[Ack]:
        """Subscribe the ack topic, publish, and wait for the final ack."""
        request_id = "console-" + uuid.uuid4().hex[:16]
        with self._changed:
            self._acks[request_id] = deque()
        try:
            if device not in self._ack_devices:  # once per box: its acks of every request this console sends
                self._subscribe_now([ack_topic(self.prefix, device, "+")], timeout)
                self._ack_devices.add(device)
            body = self.envelope.wrap(device, verb, command_payload(verb, request, request_id))
            self.link.publish(command_topic(self.prefix, verb, device=device), body)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with self._changed:
                    acks = self._acks[request_id]
                    while acks:
                        ack = acks.popleft()
                        if ack.final:
                            return ack
                    self._changed.wait(min(READ_S, max(0.0, deadline - time.monotonic())))
            return None
        finally:
            with self._changed:
                self._acks.pop(request_id, None)

    # --- the reader thread --------------------------------------------------------------------------------

    def _subscribe_now(self, topics: Sequence[str], timeout: float) -> None:
        done = threading.Event()
        request = (list(topics), done)
        self._subscribe.append(request)
        if not done.wait(timeout):
            raise CommandError("the broker did not grant %s within %.0f s" % (topics[0], timeout))
        if self.error:
            raise CommandError(self.error)

    def _read(self) -> None:
        judged = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - judged >= STALE_CHECK_S:  # a box whose broker node died left no will
                judged = time.monotonic()
                with self._lock:
                    stale = self.view.judge_stale(self.clock())
                if stale:
                    self._bump("")
            try:
                while self._subscribe:
                    topics, done = self._subscribe.popleft()
                    try:
                        self.link.subscribe(topics)
                    finally:
                        done.set()
                message = self.link.get(READ_S)
            except LinkError as exc:
                self.error = "the console lost its broker: %s (restart it to reconnect)" % exc
                for _topics, done in self._subscribe:
                    done.set()
                self._bump("")
                return
            if message is not None:
                self._take(message)

    def _take(self, message: Message) -> None:
        parts = split_device_topic(self.prefix, message.topic)
        if parts is None:
            return
        device, kind = parts
        if kind[0] == ACK:
            self._take_ack(message)
        elif kind[0] in (RESULTS, SNAPSHOT) and len(kind) == 2:
            self._take_feed(device, kind, message)
        else:
            with self._lock:
                changed = self.view.apply(message)
            if changed is not None:
                self._bump(changed)

    def _take_ack(self, message: Message) -> None:
        try:
            ack = parse_ack(message.json())
        except ProtocolError:
            return
        with self._changed:
            waiting = self._acks.get(ack.request_id)
            if waiting is not None:
                waiting.append(ack)
                self._changed.notify_all()

    def _take_feed(self, device: str, kind: Tuple[str, ...], message: Message) -> None:
        with self._lock:
            feed = self._feeds.get(device)
            if feed is None:
                return
            if kind[0] == RESULTS:
                body = message.json()
                if isinstance(body, dict):
                    feed.results.append(dict(body, source=kind[1]))
            elif len(message.payload) > SNAPSHOT_MAX_BYTES:
                feed.refused_snapshot = "the snapshot of %s had %d bytes (at most %d are kept)" % (
                    kind[1], len(message.payload), SNAPSHOT_MAX_BYTES)
            else:
                feed.snapshots[kind[1]] = (self.clock(), message.payload)
        self._bump(device)

    def _bump(self, device: str) -> None:
        with self._changed:
            self.version += 1
            self._changes.append((self.version, device))
            self._changed.notify_all()
