"""The box's one MQTT connection: results, telemetry, acks and status out; commands in.

Topics (``docs/mqtt.md``): ``<prefix>/<device>/status`` (retained; the broker's last will sets it offline),
``.../results/<source>``, ``.../telemetry``, ``.../ack/<request_id>``; commands arrive on
``<prefix>/<device>/cmd/<verb>`` and ``<prefix>/group/<group>/cmd/<verb>``.

This module is the façade; the parts live beside it:

* :mod:`agent.ops.connection` - the supervisor thread, the one owner of reconnecting (a fresh paho client per
  connection, backoff, CONNACK before "connected").
* :mod:`agent.ops.inflight` - messages awaiting a PUBACK, back-pressure, counters.
* :mod:`agent.ops.replay` - the outbox replay thread (paced, at least once, never a loop).
* :mod:`agent.ops.outbox` - the durable queue (byte and disk budget, damaged-file recovery).

What the façade decides, and why:

* **The connected fast path touches no SQLite**: a publish is ``client.publish`` plus a dict insert under a
  short lock; the PUBACK removes it. A durable message goes to the outbox when not connected, when
  :data:`~agent.ops.inflight.MAX_PENDING` messages already await a PUBACK, or **when the outbox still holds
  a message on the same topic**: it then joins the back of the queue, so a source's results reach the broker
  in frame order even while an outage's backlog is being replayed (the check is an in-memory count).
* **Messages in flight when the connection drops** (handed to paho, no PUBACK yet) are moved, in publish
  order, into the outbox and the dead client is thrown away, so paho does not also resend them. Delivery is at
  least once: a message the broker had taken just before the drop, whose PUBACK was lost, arrives twice, the
  second copy marked historical (``requeued`` counts the moved ones). Sessions are clean
  (``clean_session=True``, commands subscribed at QoS 0: :data:`agent.ops.connection.SUBSCRIPTION_QOS`):
  commands sent while the box is offline are not queued by the broker to run hours later, and no broker node
  holds a queue for the box that could refuse it once that node crashed; the operator re-sends what it missed.
"""

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from paho.mqtt.enums import MQTTErrorCode

from agent._util.ratelog import LogLimiter
from agent.config.mqtt_config import MqttConfig
from agent.config.schema import ConfigError, FieldError
from agent.ops.connection import CLOSE_TIMEOUT_S, ConnectionSupervisor, MessageHandler, Payload, encode_payload
from agent.ops.inflight import InFlight
from agent.ops.outbox import Outbox
from agent.ops.replay import Replayer
from agent.protocol.messages import OFFLINE, ONLINE
from agent.protocol.status import status_message
from agent.protocol.topics import (
    ack_topic,
    alert_topic,
    command_subscriptions,
    device_topic,
    events_topic,
    name_problem,
    result_topic,
    shadow_topic,
    snapshot_topic,
    status_topic,
    telemetry_topic,
)

logger = logging.getLogger(__name__)

DEFAULT_REPLAY_RATE_HZ = 200.0  # OutboxConfig.replay_rate_hz's default

SENT = "sent"  # handed to paho on a live connection
OUTBOXED = "outboxed"  # stored in the outbox for replay
DISCARDED = "discarded"  # not durable and not connected: not sent (counted)
LOST = "lost"  # the outbox could not store it (disk full, I/O error): logged rate-limited and counted

AlertHook = Callable[[Dict[str, Any]], None]


class MqttTransport:
    """Publishes the box's messages with a durable outbox behind them and delivers its commands.

    ``on_message(topic, payload)`` is called on paho's network thread for every command message and must
    only enqueue (:meth:`agent.commands.dispatcher.CommandDispatcher.submit` does). ``on_alert(alert)`` gets the
    outbox's alerts (damaged file, disk pressure started/ended) on the replay thread. Call :meth:`start` once,
    then :meth:`stop` at shutdown; publishing works before start and after stop (messages go to the outbox).
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
        on_alert: Optional[AlertHook] = None,
        device_kind: Optional[str] = None,
    ) -> None:
        """``device_kind`` (the box's device_configs/ name) goes into the broker's last will: an offline box
        still says what it is."""
        problem = name_problem(device_id)
        if problem is not None:
            raise ConfigError([FieldError("device_id", problem)])
        if not replay_rate_hz > 0:
            raise ConfigError([FieldError("outbox.replay_rate_hz", "must be > 0 (got %r)"
                                          % (replay_rate_hz,))])
        self.config = config
        self.device_id = device_id
        self.prefix = config.prefix
        self.groups = tuple(config.groups)
        self.client_id = config.client_id or "atlas-edge-%s" % device_id
        self.status_topic = status_topic(self.prefix, device_id)
        self._outbox = outbox
        self._on_message = on_message
        self._on_connected = on_connected  # runs on the supervisor thread after each successful CONNACK
        self._extra_subscriptions = list(extra_subscriptions)  # e.g. Home Assistant's birth topic
        self._status_fields: Dict[str, Any] = {}
        self._outbox_drops_at_start = outbox.drops()
        self._log = LogLimiter(logger)

        self._inflight = InFlight()
        self._link = ConnectionSupervisor(
            config, self.client_id, self.status_topic, device_id, self._inflight,
            subscriptions=lambda: self.command_topics() + self._extra_subscriptions,
            on_session_start=self._session_started, on_session_end=self._session_ended,
            on_message=self._deliver_message, device_kind=device_kind)
        self._replay = Replayer(
            outbox, replay_rate_hz, current_generation=lambda: self._link.generation,
            is_live=lambda generation: self._link.connected and self._link.generation == generation,
            send=self._send_replay, replay_pending=lambda: self._inflight.replay_pending,
            take_acked=self._inflight.take_replay_acked, on_alert=on_alert)
        self._threads: List[threading.Thread] = []

    # -- topics -------------------------------------------------------------------------------------------

    def topic(self, *parts: str) -> str:
        """``<prefix>/<device>/<parts...>`` (the named topics below are how this box's code builds one)."""
        return device_topic(self.prefix, self.device_id, *parts)

    def events_topic(self) -> str:
        return events_topic(self.prefix, self.device_id)

    def alert_topic(self) -> str:
        return alert_topic(self.prefix, self.device_id)

    def snapshot_topic(self, source: str) -> str:
        return snapshot_topic(self.prefix, self.device_id, source)

    def shadow_topic(self) -> str:
        return shadow_topic(self.prefix, self.device_id)

    def command_topics(self) -> List[str]:
        """Subscriptions: this device's commands and those of each configured group."""
        return command_subscriptions(self.prefix, self.device_id, self.groups)

    @property
    def connected(self) -> bool:
        return self._link.connected

    def set_message_handler(self, on_message: Optional[MessageHandler]) -> None:
        """Set the command handler after construction (the dispatcher needs the transport first)."""
        self._on_message = on_message

    def _deliver_message(self, topic: str, payload: bytes, retained: bool = False) -> None:
        handler = self._on_message
        if handler is None:
            logger.warning("MQTT message on %s with no handler set: ignored", topic)
            return
        if retained:
            handler(topic, payload, True)
        else:
            handler(topic, payload)

    # -- publishing ---------------------------------------------------------------------------------------

    def publish(self, topic: str, payload: Payload, qos: Optional[int] = None, retain: bool = False,
                durable: bool = True) -> str:
        """Send now when connected; otherwise store in the outbox (``durable``) or count it as discarded.

        Returns :data:`SENT`, :data:`OUTBOXED`, :data:`DISCARDED` or :data:`LOST`; never raises for a
        broker or disk fault.
        """
        data = encode_payload(payload)
        return self._send(topic, data, self.config.qos if qos is None else qos, retain, durable)

    def publish_result(self, source: str, payload: Payload) -> str:
        return self.publish(result_topic(self.prefix, self.device_id, source), payload)

    def publish_telemetry(self, payload: Payload) -> str:
        return self.publish(telemetry_topic(self.prefix, self.device_id), payload)

    def publish_ack(self, request_id: str, payload: Payload) -> str:
        # QoS 1 whatever the results' QoS: an operator waits on these.
        return self.publish(ack_topic(self.prefix, self.device_id, request_id), payload, qos=1)

    def set_status(self, fields: Dict[str, Any]) -> None:
        """Replace the daemon's fields of the retained status (device kind, model, slots, ...: names of
        :class:`agent.protocol.status.BoxStatus`) and republish it; state, device id, time and broker are added
        here, by :func:`agent.protocol.status.status_message`."""
        status_message(ONLINE, self.device_id, **fields)  # a field BoxStatus lacks fails here, in the caller
        self._status_fields = dict(fields)
        if self._link.connected:
            self._publish_status(ONLINE)

    def _status_payload(self, state: str, **extra: Any) -> bytes:
        fields = dict(self._status_fields, ts=None, broker=self._link.broker)
        fields.update(extra)
        return encode_payload(status_message(state, self.device_id, **fields))

    def _publish_status(self, state: str, **extra: Any) -> str:
        # Not durable: a stale status replayed later would be wrong, and each connect publishes a fresh one.
        return self._send(self.status_topic, self._status_payload(state, **extra), 1, True, False)

    def _send(self, topic: str, data: bytes, qos: int, retain: bool, durable: bool) -> str:
        link = self._link
        if link.connected:  # back-pressure, waited for without the state lock so a drop is not held up
            self._inflight.wait_for_room(lambda: link.connected)
        with link.state_lock:
            client = link.client if link.connected else None
            queued_behind = durable and self._outbox.pending_for(topic) > 0  # keep the topic's order
            if client is not None and not queued_behind and self._inflight.has_room():
                info = client.publish(topic, data, qos, retain)
                # With QoS>0 paho keeps a message it could not write (NO_CONN) and it is tracked, so the drop
                # handling moves it to the outbox with the rest; a QoS 0 one is gone and is stored below.
                if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN
                                                                 and qos > 0):
                    self._inflight.track(info.mid, topic, data, qos, retain, durable, None)
                    return SENT
            return self._store_offline(topic, data, qos, retain, durable)

    def _store_offline(self, topic: str, data: bytes, qos: int, retain: bool, durable: bool) -> str:
        """Called with the state lock held, so outbox order matches publish order across a drop."""
        if not durable:
            self._inflight.count("discarded")
            return DISCARDED
        try:
            stored = self._outbox.put(topic, data, qos, retain)
        except Exception as exc:  # an I/O error: count and log (rate-limited), never raise into the pipeline
            self._inflight.count("lost")
            self._log.log(logging.ERROR, type(exc).__name__, "outbox: could not store a message on %s (%s: %s): "
                          "lost", topic, type(exc).__name__, exc)
            return LOST
        self._inflight.count("outboxed" if stored is not None else "lost")
        if self._link.connected:
            self._replay.wake.set()  # stored while connected (queued behind, or back-pressure): replay it
        return OUTBOXED if stored is not None else LOST

    def _send_replay(self, outbox_id: int, topic: str, data: bytes, qos: int, retain: bool,
                     generation: int) -> bool:
        with self._link.state_lock:
            client = self._link.client_of(generation)
            if client is None:
                return False
            info = client.publish(topic, data, qos, retain)
            if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN
                                                             and qos > 0):
                self._inflight.track(info.mid, topic, data, qos, retain, True, outbox_id)
                return True
            return False

    def flush(self, timeout: float) -> bool:
        """Wait until every message given to :meth:`publish` is acked by the broker or in the outbox."""
        return self._inflight.wait_live_drained(timeout)

    # -- sessions (called by the supervisor thread) ---------------------------------------------------------

    def _session_started(self) -> None:
        self._publish_status(ONLINE)
        self._replay.wake.set()
        if self._on_connected is not None:
            try:
                self._on_connected()
            except Exception:  # a hook's bug must not end the session, nor vanish
                logger.exception("on_connected hook failed")

    def _session_ended(self) -> None:
        self._requeue_pending()
        self._replay.settle()

    def _requeue_pending(self) -> None:
        """Move what the dead client had not delivered to the outbox, in publish order, before anything newer.

        Holding the state lock keeps producers out until the connection is marked down and the move is done,
        so a message published after the drop can never be stored ahead of an older one.
        """
        with self._link.state_lock:
            self._link.mark_down()
            pending = self._inflight.take_all()
            live = [p for p in pending if p.outbox_id is None]
            keep = [(p.topic, p.payload, p.qos, p.retain) for p in live if p.durable]
            stored = 0
            if keep:
                try:
                    stored = len(self._outbox.put_many(keep))
                except Exception as exc:
                    logger.error("outbox: could not store %d in-flight message(s) (%s): lost", len(keep), exc)
            self._inflight.count("requeued", stored)
            self._inflight.count("outboxed", stored)
            self._inflight.count("lost", len(keep) - stored)
            self._inflight.count("discarded", len(live) - len(keep))
        if keep:
            logger.info("MQTT: %d message(s) in flight at the drop moved to the outbox", stored)

    # -- start, stop and stats ------------------------------------------------------------------------------

    def start(self) -> "MqttTransport":
        """Start connecting (in the background) and replaying; returns at once."""
        if self._threads:
            return self
        self._link.stopping.clear()
        self._replay.stop_event.clear()
        for name, target in (("mqtt-supervisor", self._link.run), ("mqtt-replay", self._replay.run)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Publish ``offline`` (retained), drain, disconnect cleanly; True when nothing was left unacked.

        A clean disconnect does not fire the last will, hence the explicit offline status. What is still
        unacknowledged at the deadline is moved to the outbox, so it is replayed by the next run.
        """
        if not self._threads:
            return True
        deadline = time.monotonic() + timeout
        self._replay.stop_event.set()
        self._replay.wake.set()
        self._join(self._threads[1], deadline)
        if self._link.connected:
            self._publish_status(OFFLINE, reason="stopped")
        drained = self._inflight.wait_all_drained(max(0.0, deadline - time.monotonic()))
        self._link.stopping.set()
        self._join(self._threads[0], deadline + CLOSE_TIMEOUT_S)
        self._threads = []
        self._replay.deliver_alerts()  # a last disk-pressure change still reaches the hook (and the outbox)
        return drained

    @staticmethod
    def _join(thread: threading.Thread, deadline: float) -> None:
        thread.join(max(0.1, deadline - time.monotonic()))
        if thread.is_alive():
            logger.warning("thread %s did not stop in time", thread.name)

    def stats(self) -> Dict[str, Any]:
        """Counters for telemetry, status and tests (this process's totals; the outbox's depth and drops)."""
        result: Dict[str, Any] = self._inflight.snapshot()
        outbox = self._outbox
        drops = {reason: count - self._outbox_drops_at_start[reason] for reason, count in outbox.drops().items()}
        result["dropped"] = sum(drops.values())
        result["dropped_by_reason"] = drops
        result["outbox_messages"] = len(outbox)
        result["outbox_bytes"] = outbox.bytes
        result["outbox_oldest_age_s"] = round(outbox.oldest_age_s(), 3)  # 0 when empty
        result["disk_pressure"] = outbox.disk_pressure
        result["outbox_in_memory"] = outbox.in_memory
        result["connected"] = self._link.connected
        result["broker"] = self._link.broker  # which of mqtt.hosts the box is (or was last) on
        return result
