"""One operator connection to the broker: subscribe and wait for the SUBACK, publish commands, read messages.

The paho client is built by the caller (``agent.cli.ctl.make_client``: credentials, TLS, and a client id of this
run's own, ``<username>-fleet-<random>``, so a ``fleet status`` never takes over a running rollout's session)
and handed in, so this group needs no CLI code. Callbacks only enqueue; the rollout or status thread reads
:meth:`FleetLink.get`. The link does not reconnect: a rollout that loses its broker stops with its state saved,
and a re-run continues.
"""

import json
import queue
import time
from typing import Any, List, NamedTuple, Optional, Sequence

from agent.protocol.messages import decode_json

CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_S = 30
SUBSCRIBE_BATCH = 100  # topics per SUBSCRIBE packet: a wave of a few hundred boxes is a few packets


class LinkError(Exception):
    """The broker refused, dropped or never answered; the message says which and where."""


class Message(NamedTuple):
    topic: str
    payload: bytes
    retain: bool

    def json(self) -> Optional[Any]:
        """The payload as JSON, or None when it is empty (a cleared retained topic) or not JSON."""
        if not self.payload:
            return None
        try:
            return decode_json(self.payload)
        except ValueError:  # not UTF-8, not JSON, or nested too deep (a box's message must not crash the tools)
            return None


class FleetLink:
    """A connected paho client whose messages land in a queue; see the module docstring."""

    def __init__(self, client: Any, host: str, port: int, where: str) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.where = where  # the broker URL, for error messages
        self._events: "queue.Queue[Any]" = queue.Queue()
        self.received = 0
        self.sent = 0
        client.on_connect = lambda c, u, flags, rc, props: self._events.put(("connect", rc))
        client.on_subscribe = lambda c, u, mid, codes, props: self._events.put(("subscribe", list(codes)))
        client.on_disconnect = lambda c, u, flags, rc, props: self._events.put(("disconnect", rc))
        client.on_message = lambda c, u, m: self._events.put(
            Message(m.topic, bytes(m.payload), bool(m.retain)))
        self._backlog: List[Message] = []  # messages that arrived while waiting for a connect or SUBACK

    def connect(self) -> "FleetLink":
        try:
            self.client.connect(self.host, self.port, keepalive=KEEPALIVE_S)
        except (OSError, ValueError) as exc:
            raise LinkError("cannot connect to %s: %s" % (self.where, exc)) from None
        self.client.loop_start()
        reason = self._expect("connect", time.monotonic() + CONNECT_TIMEOUT_S)
        if reason is None or reason.is_failure:
            self.close()
            raise LinkError("broker %s refused or dropped the connection: %s" % (self.where, reason))
        return self

    def subscribe(self, topics: Sequence[str]) -> None:
        """Subscribe (QoS 1) and wait until the broker granted every topic; retained messages follow."""
        topics = list(topics)
        for start in range(0, len(topics), SUBSCRIBE_BATCH):
            chunk = topics[start:start + SUBSCRIBE_BATCH]
            self.client.subscribe([(topic, 1) for topic in chunk])
            granted = self._expect("subscribe", time.monotonic() + CONNECT_TIMEOUT_S)
            if granted is None:
                raise LinkError("no SUBACK from %s for %s" % (self.where, chunk[0]))
            refused = [t for t, code in zip(chunk, granted) if code.is_failure]
            if refused:
                raise LinkError("the broker refused %s: check the ACL of this operator account" % refused)

    def publish(self, topic: str, message: Any) -> None:
        """A command (QoS 1, not retained: a retained command would be replayed to the box on reconnect)."""
        self.client.publish(topic, json.dumps(message).encode("utf-8"), qos=1, retain=False)
        self.sent += 1

    def clear_retained(self, topic: str) -> None:
        """Delete ``topic``'s retained message (an empty retained payload), waiting until the broker has it."""
        info = self.client.publish(topic, b"", qos=1, retain=True)
        info.wait_for_publish(CONNECT_TIMEOUT_S)
        if not info.is_published():
            raise LinkError("%s did not acknowledge clearing %s" % (self.where, topic))
        self.sent += 1

    def get(self, timeout: float) -> Optional[Message]:
        """The next message, or None after ``timeout``; LinkError if the connection dropped."""
        if self._backlog:
            return self._backlog.pop(0)
        try:
            item = self._events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if isinstance(item, Message):
            self.received += 1
            return item
        if item[0] == "disconnect":
            raise LinkError("lost the connection to %s (%s)" % (self.where, item[1]))
        return None

    def close(self) -> None:
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    def _expect(self, kind: str, deadline: float) -> Optional[Any]:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                item = self._events.get(timeout=remaining)
            except queue.Empty:
                return None
            if isinstance(item, Message):
                self.received += 1
                self._backlog.append(item)
            elif item[0] == kind:
                return item[1]
            elif item[0] == "disconnect":
                return None
