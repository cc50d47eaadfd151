"""The connection supervisor: the one owner of reconnecting, and of which paho client is the live one.

Each connection is a fresh paho client (:func:`agent.ops.mqtt_client.new_client`, the one place clients and their
TLS contexts are made, ``reconnect_on_failure=False``): paho runs the network loop
(``loop_start``) for that one connection and its thread ends when the connection does; the supervisor then
makes a new client. Nothing is marked connected until a CONNACK with a success reason code has been seen (a
refused connect is logged and retried, never treated as connected). Callbacks of an older client (an older
*generation*) are ignored.

Brokers (``mqtt.hosts``, a cluster's nodes; else ``host``:``port``) are tried in turn: after a lost connection
the same broker first, then each next one at once, every attempt bounded by ``connect_timeout_s`` (TCP, TLS and
the CONNACK). Only when a whole round failed does the supervisor wait, ``reconnect_min_s`` doubling up to
``reconnect_max_s``: a stopped node costs a box one refused connect, not a backoff.

Sessions are clean and commands are subscribed at QoS 0 (:data:`SUBSCRIPTION_QOS`): the broker keeps nothing for
the box between connections, so no broker node, alive or crashed, holds state that could refuse it elsewhere. The
box's durable state is its own: the outbox (what it publishes) and the request record (what it ran).

paho callbacks only record and enqueue, inside a catch-and-log wrapper: an exception on paho's thread is
logged with its traceback and never kills the network loop.
"""

import functools
import json
import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import paho.mqtt.client as mqtt

from agent.config.mqtt_config import MqttConfig
from agent.config.secrets import resolve_secret
from agent.ops.inflight import InFlight
from agent.ops.mqtt_client import new_client, tls_context
from agent.protocol.messages import OFFLINE
from agent.protocol.status import status_message

logger = logging.getLogger(__name__)

MAX_INFLIGHT = 20  # paho's (and mosquitto's) default in-flight window for QoS>0
SESSION_POLL_S = 0.25  # how often the supervisor looks at the stop flag while a connection is up
CLOSE_TIMEOUT_S = 3.0  # wait for paho to confirm a disconnect before abandoning its (daemon) thread
# Commands are subscribed at QoS 0. In a clean session the subscription's QoS only matters within one connection,
# which TCP already delivers in order: what QoS 1 adds (redelivery on the session's next connection) a clean session
# throws away. On RabbitMQ a QoS 1 subscription is a durable classic queue homed on the node the box is on (quorum
# queues serve only non-clean sessions), which the surviving nodes refuse to redeclare once that node crashed; a
# QoS 0 one is a transient queue they drop with the node. See docs/architecture.md, "Broker sessions".
SUBSCRIPTION_QOS = 0

Payload = Union[Dict[str, Any], bytes]
MessageHandler = Callable[..., None]  # (topic, payload[, retained])


def _json_default(value: Any) -> Any:
    # numpy arrays and scalars (boxes, scores) become plain lists and numbers.
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError("%s is not JSON serialisable" % type(value).__name__)


def encode_payload(payload: Payload) -> bytes:
    """Bytes on the wire: dicts as compact JSON (numpy values converted), bytes unchanged."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    if isinstance(payload, dict):
        return json.dumps(payload, separators=(",", ":"), default=_json_default).encode("utf-8")
    raise TypeError("MQTT payload must be a dict or bytes, got %s" % type(payload).__name__)


def _catch_and_log(callback: Callable[..., None]) -> Callable[..., None]:
    """An exception on paho's thread must neither kill the loop nor vanish: log it with its traceback."""

    @functools.wraps(callback)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            callback(*args, **kwargs)
        except Exception:
            logger.exception("MQTT callback %s failed", callback.__name__)

    return guarded


class ConnectionSupervisor:
    """Connects, reconnects with backoff, and tells its owner when a session begins and ends.

    ``on_session_start()`` runs on the supervisor thread after a successful CONNACK (``client`` and
    ``connected`` are already set); ``on_session_end()`` runs after ``connected`` went false and paho's thread
    ended, so that what was in flight can be kept. Publishers hold :attr:`state_lock` around
    ``client.publish`` so that a message is either on the live client or stored, never lost between the two.
    """

    def __init__(self, config: MqttConfig, client_id: str, status_topic: str, device_id: str,
                 inflight: InFlight, subscriptions: Callable[[], List[str]],
                 on_session_start: Callable[[], None], on_session_end: Callable[[], None],
                 on_message: Callable[[str, bytes], None], device_kind: Optional[str] = None) -> None:
        self.config = config
        self.client_id = client_id
        self.status_topic = status_topic
        self.device_id = device_id
        self.device_kind = device_kind  # named in the last will too: the fleet judges an offline box's bundles
        self._inflight = inflight
        self._subscriptions = subscriptions
        self._on_session_start = on_session_start
        self._on_session_end = on_session_end
        self._on_message = on_message
        # Resolved now so that a missing secret or TLS file fails at start-up, naming the field.
        self._password = resolve_secret(config.password)
        self._tls_context = tls_context(config.tls) if config.tls else None

        self.state_lock = threading.Lock()  # connected/client; held across client.publish on the fast path
        self.client: Optional[mqtt.Client] = None
        self.connected = False
        self.generation = 0  # one per paho client; callbacks from older clients are ignored
        self._events: "queue.Queue[Tuple[str, int, str]]" = queue.Queue()
        self.stopping = threading.Event()
        self._ever_connected = False
        self._brokers = config.brokers()
        self._broker_index = 0
        self.broker: Optional[str] = None  # "host:port" of the last broker that accepted this box

    @property
    def _address(self) -> str:
        """The broker being tried or used, for logs."""
        return "%s:%d" % self._brokers[self._broker_index]

    def client_of(self, generation: int) -> Optional[mqtt.Client]:
        """The live client if it is still ``generation`` (call with :attr:`state_lock` held)."""
        return self.client if (self.connected and self.generation == generation) else None

    # -- one paho client per connection ---------------------------------------------------------------------

    def _new_client(self, generation: int, attempt_ts: float) -> mqtt.Client:
        client = new_client(self.client_id, self.config.username, self._password, self._tls_context,
                            self.config.connect_timeout_s, userdata=generation)
        if logger.isEnabledFor(logging.DEBUG):
            # Only when debugging: paho 2.x logs a spurious error after every clean disconnect.
            client.enable_logger(logging.getLogger(__name__ + ".paho"))
        client.max_inflight_messages_set(MAX_INFLIGHT)
        # The broker publishes this, retained, when the connection dies without a DISCONNECT. It names the
        # groups so that a fleet view filtered by group still lists the box while it is away, and its kind.
        will = status_message(OFFLINE, self.device_id, reason="connection lost", connected_at=attempt_ts,
                              ts=attempt_ts, groups=list(self.config.groups), device_kind=self.device_kind)
        client.will_set(self.status_topic, encode_payload(will), qos=1, retain=True)
        client.on_connect = _catch_and_log(self._on_connect)
        client.on_disconnect = _catch_and_log(self._on_disconnect)
        client.on_publish = _catch_and_log(self._on_publish)
        client.on_subscribe = _catch_and_log(self._on_subscribe)
        client.on_message = _catch_and_log(self._on_mqtt_message)
        return client

    # -- paho callbacks (paho's thread: record and enqueue only) --------------------------------------------

    def _on_connect(self, client: mqtt.Client, generation: int, flags: Any, reason_code: Any,
                    properties: Any) -> None:
        if reason_code.is_failure:
            logger.error("MQTT broker %s refused the connection: %s", self._address, reason_code)
            self._events.put(("refused", generation, str(reason_code)))
            return
        # Sent before the status that announces the box (the supervisor publishes it after this event): a broker
        # handles one connection's packets in order, so an operator that sees the status can command the box.
        client.subscribe([(topic, SUBSCRIPTION_QOS) for topic in self._subscriptions()])
        self._events.put(("connected", generation, ""))

    def _on_disconnect(self, client: mqtt.Client, generation: int, flags: Any, reason_code: Any,
                       properties: Any) -> None:
        self._events.put(("disconnected", generation, str(reason_code)))

    def _on_publish(self, client: mqtt.Client, generation: int, mid: int, reason_code: Any,
                    properties: Any) -> None:
        if generation != self.generation:
            return
        if reason_code.is_failure:  # MQTT 5 brokers can refuse a publish; 3.1.1 ones drop it silently
            logger.warning("MQTT broker refused message %d: %s", mid, reason_code)
        self._inflight.acknowledge(mid)

    def _on_subscribe(self, client: mqtt.Client, generation: int, mid: int, reason_codes: Any,
                      properties: Any) -> None:
        topics = self._subscriptions()
        for index, code in enumerate(reason_codes):
            if code.is_failure:
                self._inflight.count("subscribe_refused")
                logger.error("MQTT broker refused the subscription to %s: %s (check the broker ACL)",
                             topics[index] if index < len(topics) else "?", code)

    def _on_mqtt_message(self, client: mqtt.Client, generation: int, message: mqtt.MQTTMessage) -> None:
        if message.retain:  # the dispatcher refuses it: a retained command would run at every reconnect
            self._on_message(message.topic, message.payload, True)
        else:
            self._on_message(message.topic, message.payload)

    # -- the supervisor thread ------------------------------------------------------------------------------

    def run(self) -> None:
        """The supervisor thread's body: connect, follow the session, fail over, back off, until :attr:`stopping`."""
        delay = self.config.reconnect_min_s
        failed = 0  # attempts in a row that never reached CONNACK: a whole round of them means back off
        while not self.stopping.is_set():
            if self._attempt_guarded():
                delay, failed = self.config.reconnect_min_s, 0
                wait = delay  # a lost connection: the same broker again after the shortest delay
            else:
                failed += 1
                self._broker_index = (self._broker_index + 1) % len(self._brokers)
                wait = 0.0 if failed % len(self._brokers) else delay
                if wait:
                    delay = min(delay * 2, self.config.reconnect_max_s)
            if self.stopping.is_set() or (wait and self.stopping.wait(wait)):
                break

    def _attempt_guarded(self) -> bool:
        """:meth:`_attempt`, where an unexpected error counts as a failed attempt: the supervisor is the box's one
        way back to its operator, so it logs the error and backs off rather than ending (and the box with it
        serving results to an outbox nobody drains)."""
        try:
            return self._attempt()
        except Exception:  # noqa: BLE001 - any bug in building a session must not end the reconnect loop
            self._inflight.count("connect_failures")
            logger.exception("MQTT connection attempt to %s failed unexpectedly; trying again", self._address)
            return False

    def _attempt(self) -> bool:
        """One connection to the current broker, followed until it ends; True when it reached CONNACK."""
        self._inflight.new_connection()
        self.generation += 1  # from here on, callbacks of the previous client are ignored
        generation = self.generation
        host, port = self._brokers[self._broker_index]
        client = self._new_client(generation, time.time())
        try:
            client.connect(host, port, self.config.keepalive_s)
        except (OSError, ValueError) as exc:  # refused, unreachable, DNS, TLS handshake, connect timeout
            self._inflight.count("connect_failures")
            logger.warning("MQTT connect to %s failed (%s)", self._address, exc)
            return False
        client.loop_start()
        was_connected, ended = self._run_session(client, generation)
        self._close_session(client, generation, ended)
        return was_connected

    def _run_session(self, client: mqtt.Client, generation: int) -> Tuple[bool, bool]:
        """Follow one connection until it ends or stop() asks; returns (was_connected, ended).

        A broker that took the TCP connection but sent no CONNACK within ``connect_timeout_s`` (a node still
        booting, a hung one) is given up, so that the next one is tried.
        """
        was_connected = False
        connack_deadline = time.monotonic() + self.config.connect_timeout_s
        while not self.stopping.is_set():
            if not was_connected and time.monotonic() > connack_deadline:
                self._inflight.count("connect_failures")
                logger.warning("MQTT broker %s sent no CONNACK within %.1f s", self._address,
                               self.config.connect_timeout_s)
                return False, False
            try:
                kind, event_generation, detail = self._events.get(timeout=SESSION_POLL_S)
            except queue.Empty:
                continue
            if event_generation != generation:
                continue
            if kind == "connected":
                self._begin_session(client)
                was_connected = True
            elif kind == "refused":
                self._inflight.count("refused")
            elif kind == "disconnected":
                if was_connected:
                    logger.warning("MQTT connection to %s lost (%s)", self._address, detail)
                return was_connected, True
        return was_connected, False

    def _begin_session(self, client: mqtt.Client) -> None:
        with self.state_lock:
            self.client = client
            self.connected = True
        if self._ever_connected:
            self._inflight.count("reconnects")
        self._ever_connected = True
        self.broker = self._address
        logger.info("MQTT connected to %s as %s", self.broker, self.client_id)
        self._on_session_start()

    def _close_session(self, client: mqtt.Client, generation: int, ended: bool) -> None:
        """Disconnect (when asked to stop), let paho's thread end, and hand over what it had not delivered."""
        if not ended:
            client.disconnect()  # a clean DISCONNECT: the broker does not publish the last will
            ended = self._await_disconnected(generation, CLOSE_TIMEOUT_S)
        if ended:
            client.loop_stop()  # its thread is ending (connection gone); this only joins it
        else:
            logger.warning("MQTT client did not confirm the disconnect within %.0f s; abandoning it",
                           CLOSE_TIMEOUT_S)
        self._on_session_end()

    def _await_disconnected(self, generation: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                kind, event_generation, _ = self._events.get(timeout=remaining)
            except queue.Empty:
                return False
            if event_generation == generation and kind == "disconnected":
                return True

    def mark_down(self) -> None:
        """Connection gone (call with :attr:`state_lock` held): publishers store from now on."""
        self.connected = False
        self.client = None
