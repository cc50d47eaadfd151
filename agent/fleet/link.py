"""The operator's one link to the broker (``atlas-edge ctl``, ``fleet``, ``demo``'s console view): connect, subscribe
and wait for the SUBACK, publish commands, read messages.

Its paho clients are made by the caller (``agent.cli.ctl.operator_link`` hands :func:`open_link` a function that
makes one through :mod:`agent.ops.mqtt_client`: credentials, TLS, and a client id of this run's own,
``<username>-<tool>-<random>``, so a ``fleet status`` never takes over a running rollout's session), so this
group needs no CLI or box code. Callbacks only enqueue; the caller's thread reads :meth:`FleetLink.get`, and
:meth:`FleetLink._await` is the one loop that waits on those events.

Connecting is retried within a bound (:func:`open_link`): a broker that took the TCP connection but sent no
CONNACK within :data:`CONNACK_TIMEOUT_S`, or dropped the connection before it, is tried again (a busy broker, or
an operator's machine stalled for a while, is a field case); one that refused (nothing listening, a CONNACK with a
failure code) is not. Once connected the link does not reconnect: a rollout that loses its broker stops with its
state saved, and a re-run continues.
"""

import json
import queue
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from agent.protocol.messages import decode_json

CONNACK_TIMEOUT_S = 10.0  # per attempt, once the broker took the TCP connection; also the SUBACK's bound
CONNECT_TRIES = 3  # rounds over the brokers while one of them took the connection but sent no CONNACK
KEEPALIVE_S = 30
SUBSCRIBE_BATCH = 100  # topics per SUBSCRIBE packet: a wave of a few hundred boxes is a few packets

Address = Tuple[str, int, bool]  # host, port, TLS


class LinkError(Exception):
    """The broker refused, dropped or never answered; the message says which and where. ``transient``: the
    broker was there (it took the TCP connection) but sent no CONNACK in time or dropped the connection before,
    so another try may succeed."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


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
    """A paho client whose events and messages land in a queue; see the module docstring."""

    def __init__(self, client: Any, host: str, port: int, where: str) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.where = where  # the broker, for error messages
        self._events: "queue.Queue[Any]" = queue.Queue()
        self.received = 0
        self.sent = 0
        client.on_connect = lambda c, u, flags, rc, props: self._events.put(("connect", rc))
        client.on_subscribe = lambda c, u, mid, codes, props: self._events.put(("subscribe", list(codes)))
        client.on_disconnect = lambda c, u, flags, rc, props: self._events.put(("disconnect", rc))
        client.on_message = lambda c, u, m: self._events.put(
            Message(m.topic, bytes(m.payload), bool(m.retain)))
        self._backlog: List[Message] = []  # messages that arrived while waiting for a connect or SUBACK

    def connect(self, connack_timeout_s: float = CONNACK_TIMEOUT_S) -> "FleetLink":
        """One attempt: the TCP (+TLS) connection, then the CONNACK; LinkError says which failed (see the class
        docstring of :class:`LinkError` for ``transient``)."""
        try:
            self.client.connect(self.host, self.port, keepalive=KEEPALIVE_S)
        except (OSError, ValueError) as exc:
            raise LinkError("cannot connect to %s: %s" % (self.where, exc)) from None
        self.client.loop_start()
        kind, reason = self._await("connect", time.monotonic() + connack_timeout_s)
        if kind == "connect" and not reason.is_failure:
            return self
        self.close()
        if kind == "connect":
            raise LinkError("broker %s refused the connection: %s" % (self.where, reason))
        if kind == "disconnect":
            raise LinkError("broker %s dropped the connection before its CONNACK (%s)" % (self.where, reason),
                            transient=True)
        raise LinkError("broker %s took the connection but sent no CONNACK within %g s"
                        % (self.where, connack_timeout_s), transient=True)

    def subscribe(self, topics: Sequence[str], qos: int = 1) -> None:
        """Subscribe and wait until the broker granted every topic; retained messages follow.

        QoS 1 (the default) for what must not be missed while connected (acks). A view of thousands of retained
        statuses subscribes at QoS 0: a broker keeps only so many QoS 1 messages queued per subscriber
        (Mosquitto's ``max_queued_messages``, 1000 by default) and drops the rest of a retained burst, where QoS 0
        goes out as the connection takes it."""
        topics = list(topics)
        for start in range(0, len(topics), SUBSCRIBE_BATCH):
            chunk = topics[start:start + SUBSCRIBE_BATCH]
            self.client.subscribe([(topic, qos) for topic in chunk])
            kind, granted = self._await("subscribe", time.monotonic() + CONNACK_TIMEOUT_S)
            if kind == "disconnect":
                raise LinkError("lost the connection to %s (%s)" % (self.where, granted))
            if kind != "subscribe":
                raise LinkError("no SUBACK from %s for %s" % (self.where, chunk[0]))
            refused = [t for t, code in zip(chunk, granted) if code.is_failure]
            if refused:
                raise LinkError("the broker refused %s: check the ACL of this operator account" % refused)

    def publish(self, topic: str, message: Any) -> Any:
        """A command (QoS 1, not retained: a retained command would be replayed to the box on reconnect);
        returns paho's MQTTMessageInfo (``is_published()``: the broker's PUBACK came)."""
        info = self.client.publish(topic, json.dumps(message).encode("utf-8"), qos=1, retain=False)
        self.sent += 1
        return info

    def clear_retained(self, topic: str) -> None:
        """Delete ``topic``'s retained message (an empty retained payload), waiting until the broker has it."""
        info = self.client.publish(topic, b"", qos=1, retain=True)
        info.wait_for_publish(CONNACK_TIMEOUT_S)
        if not info.is_published():
            raise LinkError("%s did not acknowledge clearing %s" % (self.where, topic))
        self.sent += 1

    def get(self, timeout: float) -> Optional[Message]:
        """The next message, or None after ``timeout``; LinkError if the connection dropped."""
        if self._backlog:
            return self._backlog.pop(0)
        kind, value = self._await("message", time.monotonic() + timeout)
        if kind == "disconnect":
            raise LinkError("lost the connection to %s (%s)" % (self.where, value))
        return value if kind == "message" else None

    def close(self) -> None:
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    def _await(self, kind: str, deadline: float) -> Tuple[str, Any]:
        """The next ``kind`` event (``connect``, ``subscribe``, ``message``) as ``(kind, value)``; ``("disconnect",
        reason)`` when the connection dropped first, ``("timeout", None)`` at ``deadline``. Messages that come
        while waiting for another kind wait in the backlog, in order."""
        while True:
            try:  # at the deadline still one look (get(0) takes what is already there)
                item = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return "timeout", None
            if isinstance(item, Message):
                self.received += 1
                if kind == "message":
                    return kind, item
                self._backlog.append(item)
            elif item[0] in (kind, "disconnect"):
                return item


def open_link(addresses: Sequence[Address], new_client: Callable[[bool], Any], tries: int = CONNECT_TRIES,
              connack_timeout_s: float = CONNACK_TIMEOUT_S) -> FleetLink:
    """A link to the first of ``addresses`` that takes the connection (a cluster's nodes, in turn), each attempt
    on a fresh client from ``new_client(tls)``. While a broker took the TCP connection but sent no CONNACK or
    dropped it before, the round is tried again, ``tries`` rounds at most; LinkError names every broker, what it
    did last, and how many times it was tried."""
    failures: Dict[str, Tuple[LinkError, int]] = {}
    for _ in range(max(1, tries)):
        for host, port, use_tls in addresses:
            where = "%s:%d" % (host, port)
            try:
                return FleetLink(new_client(use_tls), host, port, where).connect(connack_timeout_s)
            except LinkError as exc:
                failures[where] = (exc, failures.get(where, (exc, 0))[1] + 1)
        if not any(exc.transient for exc, _ in failures.values()):
            break  # nothing there was busy: only refused, which another round would not change
    raise LinkError("; ".join("%s%s" % (exc, " (tried %d times)" % count if count > 1 else "")
                              for exc, count in failures.values()),
                    transient=any(exc.transient for exc, _ in failures.values()))
