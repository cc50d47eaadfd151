"""MQTT: result messages per second through the agent's publisher against raw paho-mqtt, and outbox replay.

Both publishers talk to the same local Mosquitto (``agent.devtools.broker.EmbeddedBroker``) with the same settings
(MQTT 3.1.1, clean session, QoS 1, 20 messages in flight, which is paho's default and the transport's), encode
the same result dicts to compact JSON inside the timed loop, and are timed until the broker has acknowledged
every message (all PUBACKs). Rounds alternate between the two so a busy neighbour slows both alike.

The outbox figure: with the broker stopped, results go to the on-disk outbox; the broker is restarted and the
time from the reconnect to an empty outbox gives the replay rate. The transport paces replay at
``outbox.replay_rate_hz`` (200/s by default, so a backlog does not swamp a shared broker); to measure what the
box can do, the limit is lifted here and the configured default is reported beside it.
"""

import json
import logging
import os
import threading
import time
from typing import Any, Dict, List

from benchmarks.harness import RunContext, ratio_summary, summarize, target

log = logging.getLogger(__name__)

DEVICE_ID = "bench"
SOURCE = "cam"
DETECTIONS_PER_RESULT = 5
TARGET_RATIO_TO_PAHO = 0.8  # the target: the agent's publisher keeps 80% of raw paho's rate
MAX_INFLIGHT = 20  # paho's default; the transport uses the same window
UNLIMITED_REPLAY_HZ = 1e6  # lifts the replay pacing to measure capacity
ACK_TIMEOUT_S = 60.0  # bounded waits: a broken broker fails the section instead of hanging the run
CONNECT_TIMEOUT_S = 10.0
POLL_S = 0.002  # polling step when waiting for a connection state or an empty outbox

TARGETS = {"ratio_to_paho": (">=", TARGET_RATIO_TO_PAHO)}


def result_payloads(count: int) -> List[Dict[str, Any]]:
    """``count`` result messages shaped like the daemon's (agent.pipeline.results.result_payload), about 700 bytes."""
    payloads = []
    for index in range(count):
        detections = [
            {
                "label": "square",
                "class_id": 1,
                "score": round(0.5 + 0.01 * k, 4),
                "box": [100.0 + k, 200.5, 340.25, 420.0 + index % 7],
            }
            for k in range(DETECTIONS_PER_RESULT)
        ]
        payloads.append(
            {
                "frame_id": index,
                "source": SOURCE,
                "ts": 1764432000.0 + index / 25.0,
                "image_hw": [1080, 1920],
                "model": {"name": "shapes-det", "version": "1.0.0"},
                "tier": [256, 256],
                "timings_ms": {
                    "preprocess": 0.812,
                    "infer": 4.31,
                    "postprocess": 0.204,
                    "queue": 1.02,
                    "total": 6.5,
                },
                "detections": detections,
            }
        )
    return payloads


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out after %.0f s waiting for %s" % (timeout, what))
        time.sleep(POLL_S)


class RawPahoPublisher:
    """The baseline: one paho client, publish in a loop, count PUBACKs in ``on_publish`` (it only counts)."""

    def __init__(self, host: str, port: int) -> None:
        import paho.mqtt.client as mqtt

        self.topic = "bench/raw/%s/results/%s" % (DEVICE_ID, SOURCE)
        self._acked = 0
        self._expected = 0
        self._lock = threading.Lock()
        self._all_acked = threading.Event()
        self._connected = threading.Event()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id="bench-raw-%d" % os.getpid(),
            clean_session=True,
            protocol=mqtt.MQTTv311,
        )
        self.client.max_inflight_messages_set(MAX_INFLIGHT)
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()
        if not self._connected.wait(CONNECT_TIMEOUT_S):
            self.close()
            raise RuntimeError("raw paho client did not connect to %s:%d" % (host, port))

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if not reason_code.is_failure:
            self._connected.set()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        with self._lock:
            self._acked += 1
            if self._acked >= self._expected:
                self._all_acked.set()

    def publish_all(self, payloads: List[Dict[str, Any]]) -> float:
        """Seconds from the first publish to the last PUBACK."""
        with self._lock:
            self._acked = 0
            self._expected = len(payloads)
            self._all_acked.clear()
        started = time.perf_counter()
        for payload in payloads:
            self.client.publish(self.topic, json.dumps(payload, separators=(",", ":")).encode("utf-8"), qos=1)
        if not self._all_acked.wait(ACK_TIMEOUT_S):
            raise RuntimeError(
                "raw paho: %d of %d PUBACKs after %.0f s" % (self._acked, len(payloads), ACK_TIMEOUT_S)
            )
        return time.perf_counter() - started

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _transport(host: str, port: int, outbox_path: str, device_id: str, replay_rate_hz: float) -> Any:
    from agent.config.mqtt_config import MqttConfig
    from agent.ops.outbox import Outbox
    from agent.ops.transport import MqttTransport

    config = MqttConfig(host=host, port=port, qos=1, reconnect_min_s=0.1, reconnect_max_s=0.5)
    outbox = Outbox(outbox_path, 256 * 1024 * 1024)
    return MqttTransport(config, device_id, outbox, replay_rate_hz=replay_rate_hz), outbox


def agent_publish_all(transport: Any, payloads: List[Dict[str, Any]]) -> float:
    started = time.perf_counter()
    for payload in payloads:
        transport.publish_result(SOURCE, payload)
    if not transport.flush(ACK_TIMEOUT_S):
        raise RuntimeError(
            "agent transport: PUBACKs missing after %.0f s: %s" % (ACK_TIMEOUT_S, transport.stats())
        )
    return time.perf_counter() - started


def measure_throughput(host: str, port: int, work_dir: str, count: int, rounds: int) -> Dict[str, Any]:
    payloads = result_payloads(count)
    transport, outbox = _transport(
        host, port, os.path.join(work_dir, "outbox-live.sqlite"), DEVICE_ID, UNLIMITED_REPLAY_HZ
    )
    raw = RawPahoPublisher(host, port)
    transport.start()
    try:
        _wait(lambda: transport.connected, CONNECT_TIMEOUT_S, "the agent transport to connect")
        agent_publish_all(transport, payloads[: count // 10])  # warm-up: JSON, sockets, broker queues
        raw.publish_all(payloads[: count // 10])
        publishers = {
            "agent": lambda: agent_publish_all(transport, payloads),
            "paho": lambda: raw.publish_all(payloads),
        }
        seconds: Dict[str, List[float]] = {"agent": [], "paho": []}
        for round_index in range(rounds):
            for name in ("agent", "paho") if round_index % 2 == 0 else ("paho", "agent"):
                seconds[name].append(publishers[name]())
        stats = transport.stats()
    finally:
        raw.close()
        transport.stop(timeout=10.0)
        outbox.close()
    agent_rate = [count / s for s in seconds["agent"]]
    raw_rate = [count / s for s in seconds["paho"]]
    return {
        "messages_per_round": count,
        "payload_bytes": len(json.dumps(payloads[0], separators=(",", ":"))),
        "agent_msgs_per_s": summarize(agent_rate),
        "paho_msgs_per_s": summarize(raw_rate),
        "ratio_to_paho": ratio_summary(agent_rate, raw_rate),
        "agent_outboxed_while_connected": stats.get("outboxed", 0),
    }


def measure_replay(broker: Any, work_dir: str, count: int) -> Dict[str, Any]:
    """Park ``count`` results in the outbox with the broker down, restart it, time the drain."""
    from agent.ops.transport import DEFAULT_REPLAY_RATE_HZ

    payloads = result_payloads(count)
    transport, outbox = _transport(
        broker.host,
        broker.port,
        os.path.join(work_dir, "outbox-replay.sqlite"),
        DEVICE_ID + "-replay",
        UNLIMITED_REPLAY_HZ,
    )
    transport.start()
    try:
        _wait(lambda: transport.connected, CONNECT_TIMEOUT_S, "the agent transport to connect")
        broker.stop()
        _wait(lambda: not transport.connected, CONNECT_TIMEOUT_S, "the transport to see the broker go")
        started = time.perf_counter()
        for payload in payloads:
            transport.publish_result(SOURCE, payload)
        store_s = time.perf_counter() - started
        parked = len(outbox)
        broker.start()
        _wait(lambda: transport.connected, CONNECT_TIMEOUT_S, "the transport to reconnect")
        reconnected = time.perf_counter()
        _wait(lambda: len(outbox) == 0, ACK_TIMEOUT_S, "the outbox to drain")
        replay_s = time.perf_counter() - reconnected
        stats = transport.stats()
    finally:
        transport.stop(timeout=10.0)
        outbox.close()
    return {
        "messages": count,
        "parked_in_outbox": parked,
        "offline_store_msgs_per_s": count / store_s,
        "replay_msgs_per_s": parked / replay_s if replay_s > 0 else None,
        "replayed": stats.get("replayed"),
        "configured_default_replay_hz": DEFAULT_REPLAY_RATE_HZ,
        "replay_limit_used_hz": UNLIMITED_REPLAY_HZ,
    }


def run(context: RunContext) -> Dict[str, Any]:
    from agent.devtools.broker import EmbeddedBroker

    profile = context.profile
    broker = EmbeddedBroker()
    broker.start()
    try:
        live = measure_throughput(
            broker.host, broker.port, context.work_dir, profile.mqtt_messages, profile.mqtt_rounds
        )
        replay = measure_replay(broker, context.work_dir, profile.replay_messages)
    finally:
        broker.close()
    log.info(
        "mqtt: agent %.0f msg/s, paho %.0f msg/s (ratio %.2f); replay %.0f msg/s",
        live["agent_msgs_per_s"]["median"],
        live["paho_msgs_per_s"]["median"],
        live["ratio_to_paho"]["median"],
        replay["replay_msgs_per_s"] or 0,
    )
    return {
        "ratio_to_paho": live["ratio_to_paho"]["median"],
        "agent_msgs_per_s": live["agent_msgs_per_s"]["median"],
        "paho_msgs_per_s": live["paho_msgs_per_s"]["median"],
        "replay_msgs_per_s": replay["replay_msgs_per_s"],
        "live": live,
        "outbox_replay": replay,
    }


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {key: target(section.get(key), op, threshold) for key, (op, threshold) in TARGETS.items()}
