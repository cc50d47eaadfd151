"""The box's one MQTT connection: results, telemetry, acks and status out; commands in.

Topics (``docs/mqtt.md``): ``<prefix>/<device>/status`` (retained; the broker's last will sets it offline),
``.../results/<source>``, ``.../telemetry``, ``.../ack/<request_id>``; commands arrive on
``<prefix>/<device>/cmd/<verb>`` and ``<prefix>/group/<group>/cmd/<verb>``.

Who does what, and why:

* **One owner of reconnecting: the supervisor thread here.** Each connection is a fresh paho client created
  with ``reconnect_on_failure=False``: paho runs the network loop (``loop_start``) for that one connection and
  its thread ends when the connection does; the supervisor then waits ``reconnect_min_s`` doubling up to
  ``reconnect_max_s`` and makes a new client. Nothing is marked connected until a CONNACK with a success
  reason code has been seen (a refused connect is logged and retried, never treated as connected).
* **Messages in flight when the connection drops** (handed to paho, no PUBACK yet) are moved, in publish
  order, into the durable outbox and the dead client is thrown away, so paho does not also resend them. They
  are replayed like everything else that waited, marked ``"historical": true``. Delivery is at least once: a
  message the broker had taken just before the drop, whose PUBACK was lost, arrives twice, the second copy
  marked historical (the ``requeued`` counter says how many were moved). Sessions are clean
  (``clean_session=True``): commands sent while the box is offline are not queued by the broker to run
  hours later.
* **The connected fast path touches no SQLite**: a publish is ``client.publish`` plus a dict insert under a
  short lock; the PUBACK (``on_publish``) removes it. Only when not connected (or when
  :data:`MAX_PENDING` messages already await a PUBACK) does a durable message go to the outbox.
* **Replay** runs on its own thread after each connect, oldest first, at most ``replay_rate_hz`` messages a
  second and :data:`REPLAY_WINDOW` awaiting PUBACK; a replayed row leaves the outbox only once the broker
  acknowledged it, so a drop during replay loses nothing. Live messages are not held back by the replay.
* paho callbacks only record and enqueue, inside a catch-and-log wrapper: an exception on paho's thread is
  logged with its traceback and never kills the network loop.
"""

import functools
import json
import logging
import queue
import ssl
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from agent.config.daemon_config import MqttConfig, TlsConfig
from agent.config.schema import ConfigError, FieldError
from agent.config.secrets import credential_path, resolve_secret
from agent.ops.outbox import Outbox

logger = logging.getLogger(__name__)

DEFAULT_REPLAY_RATE_HZ = 200.0  # OutboxConfig.replay_rate_hz's default
REPLAY_BATCH = 100  # outbox rows read per query during replay
REPLAY_WINDOW = 100  # replayed messages awaiting PUBACK at once; bounds duplicates after a drop mid-replay
MAX_PENDING = 10000  # live messages awaiting PUBACK (bounded memory); a publisher waits for room, then...
BACKPRESSURE_WAIT_S = 1.0  # ...after this long stores to the outbox instead (a broker that slow is "away")
RESUME_PENDING = MAX_PENDING // 2  # a waiting publisher resumes here: one wake-up per half window
MAX_INFLIGHT = 20  # paho's (and mosquitto's) default in-flight window for QoS>0
SESSION_POLL_S = 0.25  # how often the supervisor looks at the stop flag while a connection is up
CLOSE_TIMEOUT_S = 3.0  # wait for paho to confirm a disconnect before abandoning its (daemon) thread
REPLAY_IDLE_S = 1.0  # replay thread's idle wake-up, a safety net for a missed wake event
CONNECT_TIMEOUT_S = 10.0  # TCP + TLS handshake bound for one attempt

SENT = "sent"  # handed to paho on a live connection
OUTBOXED = "outboxed"  # stored in the outbox for replay
DISCARDED = "discarded"  # not durable and not connected: not sent (counted)
LOST = "lost"  # the outbox could not store it (disk full, I/O error): logged and counted

Payload = Union[Dict[str, Any], bytes]
MessageHandler = Callable[[str, bytes], None]


class _Pending(NamedTuple):
    seq: int  # publish order, for requeueing in order (paho's mids wrap at 65535)
    topic: str
    payload: bytes
    qos: int
    retain: bool
    durable: bool
    outbox_id: Optional[int]  # set for replayed rows: they stay in the outbox until acknowledged


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


def _catch_and_log(callback: Callable[..., None]) -> Callable[..., None]:
    """An exception on paho's thread must neither kill the loop nor vanish: log it with its traceback."""

    @functools.wraps(callback)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            callback(*args, **kwargs)
        except Exception:
            logger.exception("MQTT callback %s failed", callback.__name__)

    return guarded


def build_tls_context(tls: TlsConfig) -> ssl.SSLContext:
    """TLS client context from the config; bad or missing files fail here, naming the field."""
    ca_file = credential_path(tls.ca_file, "mqtt.tls.ca_file")
    cert_file = credential_path(tls.cert_file, "mqtt.tls.cert_file")
    key_file = credential_path(tls.key_file, "mqtt.tls.key_file")
    if key_file and not cert_file:
        raise ConfigError([FieldError("mqtt.tls.cert_file", "required when key_file is set")])
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([FieldError("mqtt.tls.ca_file", "cannot load %s: %s" % (ca_file, exc))]) from exc
    if cert_file:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError([FieldError("mqtt.tls.cert_file", "cannot load %s / %s: %s"
                                          % (cert_file, key_file, exc))]) from exc
    if tls.insecure:
        context.check_hostname = False  # the certificate chain is still verified
    return context


class MqttTransport:
    """Publishes the box's messages with a durable outbox behind them and delivers its commands.

    ``on_message(topic, payload)`` is called on paho's network thread for every command message and must
    only enqueue (:meth:`agent.ops.commands.CommandDispatcher.submit` does). Call :meth:`start` once, then
    :meth:`stop` at shutdown; publishing works before start and after stop (messages go to the outbox).
    """

    def __init__(
        self,
        config: MqttConfig,
        device_id: str,
        outbox: Outbox,
        on_message: Optional[MessageHandler] = None,
        replay_rate_hz: float = DEFAULT_REPLAY_RATE_HZ,
        extra_subscriptions: Sequence[str] = (),
        on_connected: Optional[Callable[[], None]] = None,
    ) -> None:
        if not device_id or any(c in device_id for c in "/+#"):
            raise ConfigError([FieldError("device_id", "must be non-empty without '/', '+' or '#'")])
        if not replay_rate_hz > 0:
            raise ConfigError([FieldError("outbox.replay_rate_hz", "must be > 0 (got %r)"
                                          % (replay_rate_hz,))])
        self.config = config
        self.device_id = device_id
        self.prefix = config.prefix
        self.groups = tuple(config.groups)
        self.client_id = config.client_id or "atlas-edge-%s" % device_id
        self._outbox = outbox
        self._on_message = on_message
        self._replay_interval = 1.0 / replay_rate_hz
        # Resolved now so that a missing secret or TLS file fails at start-up, naming the field.
        self._password = resolve_secret(config.password)
        self._tls_context = build_tls_context(config.tls) if config.tls else None
        self.status_topic = self.topic("status")

        self._state_lock = threading.Lock()  # connected/client; held across client.publish on the fast path
        self._track_lock = threading.Lock()  # pending PUBACKs; never held while calling into paho
        self._drained = threading.Condition(self._track_lock)  # live_pending reached 0
        self._room = threading.Condition(self._track_lock)  # live_pending fell to RESUME_PENDING
        self._client: Optional[mqtt.Client] = None
        self._connected = False
        self._generation = 0  # one per paho client; callbacks from older clients are ignored
        self._seq = 0
        self._pending: Dict[int, _Pending] = {}
        self._early_acks: Set[int] = set()  # PUBACKs that beat the bookkeeping after client.publish
        self._live_pending = 0
        self._replay_pending = 0
        self._replay_acked: List[int] = []
        self._counters = dict.fromkeys(
            ("published", "acked", "outboxed", "replayed", "requeued", "discarded", "lost", "reconnects",
             "connect_failures", "refused", "subscribe_refused"), 0)
        self._outbox_drops_at_start = outbox.dropped_oldest + outbox.rejected_too_large
        self._status_fields: Dict[str, Any] = {}
        self._extra_subscriptions = list(extra_subscriptions)  # e.g. Home Assistant's birth topic
        self._on_connected = on_connected  # runs on the supervisor thread after each successful CONNACK

        self._events: "queue.Queue[Tuple[str, int, str]]" = queue.Queue()
        self._stopping = threading.Event()
        self._replay_stop = threading.Event()
        self._replay_wake = threading.Event()
        self._ever_connected = False
        self._threads: List[threading.Thread] = []

    # -- topics -------------------------------------------------------------------------------------------

    def topic(self, *parts: str) -> str:
        """``<prefix>/<device>/<parts...>``."""
        return "/".join((self.prefix, self.device_id) + tuple(parts))

    def command_topics(self) -> List[str]:
        """Subscriptions: this device's commands and those of each configured group."""
        groups = ["%s/group/%s/cmd/#" % (self.prefix, group) for group in self.groups]
        return [self.topic("cmd", "#")] + groups

    @property
    def connected(self) -> bool:
        return self._connected

    def set_message_handler(self, on_message: Optional[MessageHandler]) -> None:
        """Set the command handler after construction (the dispatcher needs the transport first)."""
        self._on_message = on_message

    # -- publishing ---------------------------------------------------------------------------------------

    def publish(self, topic: str, payload: Payload, qos: Optional[int] = None, retain: bool = False,
                durable: bool = True) -> str:
        """Send now when connected; otherwise store in the outbox (``durable``) or count it as discarded.

        Returns :data:`SENT`, :data:`OUTBOXED`, :data:`DISCARDED` or :data:`LOST`.
        """
        data = encode_payload(payload)
        return self._send(topic, data, self.config.qos if qos is None else qos, retain, durable)

    def publish_result(self, source: str, payload: Payload) -> str:
        return self.publish(self.topic("results", source), payload)

    def publish_telemetry(self, payload: Payload) -> str:
        return self.publish(self.topic("telemetry"), payload)

    def publish_ack(self, request_id: str, payload: Payload) -> str:
        # QoS 1 whatever the results' QoS: an operator waits on these.
        return self.publish(self.topic("ack", request_id), payload, qos=1)

    def set_status(self, fields: Dict[str, Any]) -> None:
        """Replace the extra fields of the retained status (model version, paused, ...) and republish it."""
        self._status_fields = dict(fields)
        if self._connected:
            self._publish_status("online")

    def _status_payload(self, state: str, **extra: Any) -> bytes:
        message = dict(self._status_fields)
        message.update(extra)
        message.update(state=state, device=self.device_id, ts=time.time())
        return encode_payload(message)

    def _publish_status(self, state: str, **extra: Any) -> str:
        # Not durable: a stale status replayed later would be wrong, and each connect publishes a fresh one.
        return self._send(self.status_topic, self._status_payload(state, **extra), 1, True, False)

    def _send(self, topic: str, data: bytes, qos: int, retain: bool, durable: bool) -> str:
        if self._live_pending >= MAX_PENDING and self._connected:
            with self._room:  # backpressure, waited for without the state lock so a drop is not held up
                self._room.wait_for(lambda: self._live_pending <= RESUME_PENDING or not self._connected,
                                    BACKPRESSURE_WAIT_S)
        with self._state_lock:
            client = self._client if self._connected else None
            if client is not None and self._live_pending < MAX_PENDING:
                info = client.publish(topic, data, qos, retain)
                # With QoS>0 paho keeps a message it could not write (NO_CONN) and it is in `_pending`, so the
                # drop handling moves it to the outbox with the rest; a QoS 0 one is gone and is stored below.
                if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN
                                                                 and qos > 0):
                    self._track(info.mid, topic, data, qos, retain, durable, None)
                    return SENT
            return self._store_offline(topic, data, qos, retain, durable)

    def _track(self, mid: int, topic: str, data: bytes, qos: int, retain: bool, durable: bool,
               outbox_id: Optional[int]) -> None:
        replay = outbox_id is not None
        with self._track_lock:
            if not replay:
                self._counters["published"] += 1
            if mid in self._early_acks:
                self._early_acks.discard(mid)
                self._count_ack(replay, outbox_id)
                return
            self._seq += 1
            self._pending[mid] = _Pending(self._seq, topic, data, qos, retain, durable, outbox_id)
            if replay:
                self._replay_pending += 1
            else:
                self._live_pending += 1

    def _count_ack(self, replay: bool, outbox_id: Optional[int]) -> None:
        if replay:
            self._counters["replayed"] += 1
            self._replay_acked.append(outbox_id)  # type: ignore[arg-type]
        else:
            self._counters["acked"] += 1

    def _store_offline(self, topic: str, data: bytes, qos: int, retain: bool, durable: bool) -> str:
        """Called with the state lock held, so outbox order matches publish order across a drop."""
        if not durable:
            with self._track_lock:
                self._counters["discarded"] += 1
            return DISCARDED
        try:
            stored = self._outbox.put(topic, data, qos, retain)
        except Exception as exc:  # disk full, I/O error: count and log, never raise into the pipeline
            with self._track_lock:
                self._counters["lost"] += 1
            logger.error("outbox: could not store a message on %s (%s): lost", topic, exc)
            return LOST
        with self._track_lock:
            self._counters["outboxed" if stored is not None else "lost"] += 1
        if self._connected:
            self._replay_wake.set()  # stored while connected (MAX_PENDING reached): replay it soon
        return OUTBOXED if stored is not None else LOST

    def flush(self, timeout: float) -> bool:
        """Wait until every message given to :meth:`publish` is acked by the broker or in the outbox."""
        with self._drained:
            return self._drained.wait_for(lambda: self._live_pending == 0, timeout)

    # -- paho callbacks (paho's thread: record and enqueue only) --------------------------------------------

    def _on_connect(self, client: mqtt.Client, generation: int, flags: Any, reason_code: Any,
                    properties: Any) -> None:
        if reason_code.is_failure:
            logger.error("MQTT broker %s:%d refused the connection: %s", self.config.host, self.config.port,
                         reason_code)
            self._events.put(("refused", generation, str(reason_code)))
            return
        client.subscribe([(topic, 1) for topic in self.command_topics() + self._extra_subscriptions])
        self._events.put(("connected", generation, ""))

    def _on_disconnect(self, client: mqtt.Client, generation: int, flags: Any, reason_code: Any,
                       properties: Any) -> None:
        self._events.put(("disconnected", generation, str(reason_code)))

    def _on_publish(self, client: mqtt.Client, generation: int, mid: int, reason_code: Any,
                    properties: Any) -> None:
        if generation != self._generation:
            return
        if reason_code.is_failure:  # MQTT 5 brokers can refuse a publish; 3.1.1 ones drop it silently
            logger.warning("MQTT broker refused message %d: %s", mid, reason_code)
        with self._track_lock:
            pending = self._pending.pop(mid, None)
            if pending is None:
                self._early_acks.add(mid)
                return
            replay = pending.outbox_id is not None
            self._count_ack(replay, pending.outbox_id)
            if replay:
                self._replay_pending -= 1
            else:
                self._live_pending -= 1
                if self._live_pending == 0:
                    self._drained.notify_all()
                if self._live_pending == RESUME_PENDING:
                    self._room.notify_all()

    def _on_subscribe(self, client: mqtt.Client, generation: int, mid: int, reason_codes: Any,
                      properties: Any) -> None:
        topics = self.command_topics()
        for index, code in enumerate(reason_codes):
            if code.is_failure:
                with self._track_lock:
                    self._counters["subscribe_refused"] += 1
                logger.error("MQTT broker refused the subscription to %s: %s (check the broker ACL)",
                             topics[index] if index < len(topics) else "?", code)

    def _on_mqtt_message(self, client: mqtt.Client, generation: int, message: mqtt.MQTTMessage) -> None:
        handler = self._on_message
        if handler is None:
            logger.warning("MQTT message on %s with no handler set: ignored", message.topic)
            return
        handler(message.topic, message.payload)

    # -- connection supervisor (the one owner of reconnecting) ----------------------------------------------

    def start(self) -> "MqttTransport":
        """Start connecting (in the background) and replaying; returns at once."""
        if self._threads:
            return self
        self._stopping.clear()
        self._replay_stop.clear()
        for name, target in (("mqtt-supervisor", self._supervise), ("mqtt-replay", self._replay_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _new_client(self, generation: int, attempt_ts: float) -> mqtt.Client:
        client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             clean_session=True, userdata=generation, protocol=mqtt.MQTTv311,
                             reconnect_on_failure=False)
        if logger.isEnabledFor(logging.DEBUG):
            # Only when debugging: paho 2.x logs a spurious error after every clean disconnect.
            client.enable_logger(logging.getLogger(__name__ + ".paho"))
        client.max_inflight_messages_set(MAX_INFLIGHT)
        client.connect_timeout = CONNECT_TIMEOUT_S
        if self.config.username is not None:
            client.username_pw_set(self.config.username, self._password)
        if self._tls_context is not None:
            client.tls_set_context(self._tls_context)
        # The broker publishes this, retained, when the connection dies without a DISCONNECT.
        will = {"state": "offline", "device": self.device_id, "reason": "connection lost",
                "connected_at": attempt_ts}
        client.will_set(self.status_topic, encode_payload(will), qos=1, retain=True)
        client.on_connect = _catch_and_log(self._on_connect)
        client.on_disconnect = _catch_and_log(self._on_disconnect)
        client.on_publish = _catch_and_log(self._on_publish)
        client.on_subscribe = _catch_and_log(self._on_subscribe)
        client.on_message = _catch_and_log(self._on_mqtt_message)
        return client

    def _supervise(self) -> None:
        delay = self.config.reconnect_min_s
        while not self._stopping.is_set():
            with self._track_lock:
                self._generation += 1  # from here on, callbacks of the previous client are ignored
                self._early_acks.clear()
            generation = self._generation
            client = self._new_client(generation, time.time())
            try:
                client.connect(self.config.host, self.config.port, self.config.keepalive_s)
            except (OSError, ValueError) as exc:  # refused, unreachable, DNS, TLS handshake
                with self._track_lock:
                    self._counters["connect_failures"] += 1
                logger.warning("MQTT connect to %s:%d failed (%s); retrying in %.1f s", self.config.host,
                               self.config.port, exc, delay)
                if self._stopping.wait(delay):
                    break
                delay = min(delay * 2, self.config.reconnect_max_s)
                continue
            client.loop_start()
            was_connected, ended = self._run_session(client, generation)
            self._close_session(client, generation, ended)
            if was_connected:
                delay = self.config.reconnect_min_s
            if self._stopping.is_set() or self._stopping.wait(delay):
                break
            if not was_connected:
                delay = min(delay * 2, self.config.reconnect_max_s)

    def _run_session(self, client: mqtt.Client, generation: int) -> Tuple[bool, bool]:
        """Follow one connection until it ends or stop() asks; returns (was_connected, ended)."""
        was_connected = False
        while not self._stopping.is_set():
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
                with self._track_lock:
                    self._counters["refused"] += 1
            elif kind == "disconnected":
                if was_connected:
                    logger.warning("MQTT connection to %s:%d lost (%s)", self.config.host, self.config.port,
                                   detail)
                return was_connected, True
        return was_connected, False

    def _begin_session(self, client: mqtt.Client) -> None:
        with self._state_lock:
            self._client = client
            self._connected = True
        with self._track_lock:
            if self._ever_connected:
                self._counters["reconnects"] += 1
        self._ever_connected = True
        logger.info("MQTT connected to %s:%d as %s", self.config.host, self.config.port, self.client_id)
        self._publish_status("online")
        self._replay_wake.set()
        if self._on_connected is not None:
            try:
                self._on_connected()
            except Exception:  # a hook's bug must not end the session, nor vanish
                logger.exception("on_connected hook failed")

    def _close_session(self, client: mqtt.Client, generation: int, ended: bool) -> None:
        """Disconnect (when asked to stop), let paho's thread end, and keep what it had not delivered."""
        if not ended:
            client.disconnect()  # a clean DISCONNECT: the broker does not publish the last will
            ended = self._await_disconnected(generation, CLOSE_TIMEOUT_S)
        if ended:
            client.loop_stop()  # its thread is ending (connection gone); this only joins it
        else:
            logger.warning("MQTT client did not confirm the disconnect within %.0f s; abandoning it",
                           CLOSE_TIMEOUT_S)
        self._requeue_pending()
        self._settle_replay()

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

    def _requeue_pending(self) -> None:
        """Move what the dead client had not delivered to the outbox, in publish order, before anything newer.

        Holding the state lock keeps producers out until the connection is marked down and the move is done,
        so a message published after the drop can never be stored ahead of an older one.
        """
        with self._state_lock:
            self._connected = False
            self._client = None
            with self._track_lock:
                pending = sorted(self._pending.values(), key=lambda p: p.seq)
                self._pending = {}
                self._early_acks.clear()
                self._live_pending = 0
                self._replay_pending = 0  # replayed rows are still in the outbox
                self._drained.notify_all()
                self._room.notify_all()
            live = [p for p in pending if p.outbox_id is None]
            keep = [(p.topic, p.payload, p.qos, p.retain) for p in live if p.durable]
            stored = 0
            if keep:
                try:
                    stored = len(self._outbox.put_many(keep))
                except Exception as exc:
                    logger.error("outbox: could not store %d in-flight message(s) (%s): lost", len(keep), exc)
            with self._track_lock:
                self._counters["requeued"] += stored
                self._counters["outboxed"] += stored
                self._counters["lost"] += len(keep) - stored
                self._counters["discarded"] += len(live) - len(keep)
        if keep:
            logger.info("MQTT: %d message(s) in flight at the drop moved to the outbox", stored)

    # -- replay -------------------------------------------------------------------------------------------

    def _replay_loop(self) -> None:
        while not self._replay_stop.is_set():
            try:
                self._settle_replay()
                generation = self._generation
                if self._connected and len(self._outbox):
                    self._replay_session(generation)
                    continue
                self._replay_wake.wait(REPLAY_IDLE_S)
                self._replay_wake.clear()
            except Exception:
                logger.exception("outbox replay failed; retrying")
                self._replay_stop.wait(REPLAY_IDLE_S)

    def _replay_session(self, generation: int) -> None:
        """Replay the outbox on one connection, oldest first, until it is empty or the connection ends."""
        cursor = 0
        next_at = time.monotonic()
        while self._is_live(generation):
            rows = self._outbox.peek(REPLAY_BATCH, after_id=cursor)
            if not rows:
                self._settle_replay()
                if self._replay_pending == 0:
                    return
                self._replay_stop.wait(self._replay_interval)
                continue
            for row in rows:
                now = time.monotonic()
                if next_at > now and self._replay_stop.wait(next_at - now):
                    return
                next_at = max(next_at, now) + self._replay_interval
                while self._replay_pending >= REPLAY_WINDOW:
                    if self._replay_stop.wait(self._replay_interval) or not self._is_live(generation):
                        return
                    self._settle_replay()
                if not self._send_replay(row.id, row.topic, mark_historical(row.payload), row.qos, row.retain,
                                         generation):
                    return
                cursor = row.id
            self._settle_replay()

    def _is_live(self, generation: int) -> bool:
        return self._connected and self._generation == generation and not self._replay_stop.is_set()

    def _send_replay(self, outbox_id: int, topic: str, data: bytes, qos: int, retain: bool,
                     generation: int) -> bool:
        with self._state_lock:
            client = self._client if (self._connected and self._generation == generation) else None
            if client is None:
                return False
            info = client.publish(topic, data, qos, retain)
            if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN
                                                             and qos > 0):
                self._track(info.mid, topic, data, qos, retain, True, outbox_id)
                return True
            return False

    def _settle_replay(self) -> None:
        """Remove acknowledged replayed rows from the outbox (batched: one transaction for many acks)."""
        with self._track_lock:
            acked, self._replay_acked = self._replay_acked, []
        if acked:
            self._outbox.remove(acked)

    # -- shutdown and stats -------------------------------------------------------------------------------

    def stop(self, timeout: float = 10.0) -> bool:
        """Publish ``offline`` (retained), drain, disconnect cleanly; True when nothing was left unacked.

        A clean disconnect does not fire the last will, hence the explicit offline status. What is still
        unacknowledged at the deadline is moved to the outbox, so it is replayed by the next run.
        """
        if not self._threads:
            return True
        deadline = time.monotonic() + timeout
        self._replay_stop.set()
        self._replay_wake.set()
        self._join(self._threads[1], deadline)
        if self._connected:
            self._publish_status("offline", reason="stopped")
        with self._drained:
            drained = self._drained.wait_for(lambda: self._live_pending == 0 and self._replay_pending == 0,
                                             max(0.0, deadline - time.monotonic()))
        self._stopping.set()
        self._join(self._threads[0], deadline + CLOSE_TIMEOUT_S)
        self._threads = []
        return drained

    @staticmethod
    def _join(thread: threading.Thread, deadline: float) -> None:
        thread.join(max(0.1, deadline - time.monotonic()))
        if thread.is_alive():
            logger.warning("thread %s did not stop in time", thread.name)

    def stats(self) -> Dict[str, Any]:
        """Counters for telemetry and tests (this process's totals; the outbox's depth and drops)."""
        with self._track_lock:
            result: Dict[str, Any] = dict(self._counters)
            result["pending"] = self._live_pending
        outbox = self._outbox
        result["dropped"] = outbox.dropped_oldest + outbox.rejected_too_large - self._outbox_drops_at_start
        result["outbox_messages"] = len(outbox)
        result["outbox_bytes"] = outbox.bytes
        result["connected"] = self._connected
        return result
