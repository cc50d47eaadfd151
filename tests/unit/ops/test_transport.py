"""MqttTransport against a real Mosquitto: status and last will, outbox replay across broker restarts and
killed processes, and messages in flight when the connection drops."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List

import numpy as np
import pytest
from conftest import REPO_ROOT, WAIT_S, wait_for

from agent.config.mqtt_config import MqttConfig, TlsConfig
from agent.config.schema import ConfigError
from agent.ops.outbox import Outbox
from agent.ops.replay import mark_historical
from agent.ops.transport import (
    DISCARDED,
    OUTBOXED,
    SENT,
    MqttTransport,
    encode_payload,
)
from tests.support.outbox_support import RefusingCommit, distinct_deliveries

FAST_RECONNECT = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.2}


def make_transport(tmp_path, host: str, port: int, device: str = "cam-01", replay_rate_hz: float = 5000.0,
                   on_message=None, outbox_name: str = "outbox.sqlite", **mqtt: Any) -> MqttTransport:
    config = MqttConfig(host=host, port=port, **dict(FAST_RECONNECT, **mqtt))
    outbox = Outbox(str(tmp_path / outbox_name), max_bytes=10 * 1024 * 1024)
    return MqttTransport(config, device, outbox, on_message, replay_rate_hz=replay_rate_hz)


@pytest.fixture
def transports():
    made: List[MqttTransport] = []
    yield made
    for transport in made:
        transport.stop(5.0)


def results(probe, device: str = "cam-01", source: str = "front") -> List[Dict[str, Any]]:
    return probe.on("atlas-edge/%s/results/%s" % (device, source))


# -- no broker needed --------------------------------------------------------------------------------------


def test_topics_and_subscriptions(tmp_path):
    transport = make_transport(tmp_path, "127.0.0.1", 1, groups=["line-1", "all"], prefix="plant/ae")
    assert transport.topic("results", "front") == "plant/ae/cam-01/results/front"
    assert transport.status_topic == "plant/ae/cam-01/status"
    assert transport.command_topics() == ["plant/ae/cam-01/cmd/#", "plant/ae/group/line-1/cmd/#",
                                          "plant/ae/group/all/cmd/#", "plant/ae/announce"]
    assert transport.client_id == "atlas-edge-cam-01"


def test_payload_encoding_and_historical_marking():
    assert encode_payload({"box": np.array([1.5, 2.0]), "n": np.int64(3)}) == b'{"box":[1.5,2.0],"n":3}'
    assert encode_payload(b"\x00raw") == b"\x00raw"
    with pytest.raises(TypeError, match="dict or bytes"):
        encode_payload([1, 2])  # type: ignore[arg-type]
    assert json.loads(mark_historical(b'{"seq": 1}')) == {"seq": 1, "historical": True}
    for unchanged in (b"\x89PNG...", b"[1, 2]", b"{not json", b""):
        assert mark_historical(unchanged) == unchanged


def test_missing_secret_or_tls_file_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_MQTT_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="mqtt.password"):
        make_transport(tmp_path, "127.0.0.1", 1, username="u", password="env:NO_SUCH_MQTT_PASSWORD")
    with pytest.raises(ConfigError, match="mqtt.tls.ca_file"):
        make_transport(tmp_path, "127.0.0.1", 1, tls=TlsConfig(ca_file=str(tmp_path / "missing-ca.pem")))
    with pytest.raises(ConfigError, match="device_id"):
        MqttTransport(MqttConfig(), "a/b", Outbox(str(tmp_path / "o.sqlite"), 1024))


def test_before_start_durable_messages_wait_in_the_outbox(tmp_path):
    transport = make_transport(tmp_path, "127.0.0.1", 1)
    assert transport.publish_result("front", {"seq": 0}) == OUTBOXED
    assert transport.publish(transport.topic("telemetry"), {"fps": 1}, durable=False) == DISCARDED
    stats = transport.stats()
    assert (stats["outboxed"], stats["discarded"], stats["outbox_messages"]) == (1, 1, 1)
    assert not stats["connected"]
    assert transport.flush(0.1)  # nothing handed to the broker is outstanding


# -- live broker -------------------------------------------------------------------------------------------


def test_online_status_results_and_exact_counts(mosquitto, tmp_path, probe_factory, transports):
    probe = probe_factory(mosquitto, ["atlas-edge/cam-live/#"])
    transport = make_transport(tmp_path, mosquitto.host, mosquitto.port, device="cam-live")
    transports.append(transport)
    transport.set_status({"model": "demo-1.0"})
    transport.start()
    assert wait_for(lambda: transport.connected)
    sent = [transport.publish_result("front", {"seq": i}) for i in range(20)]
    assert sent == [SENT] * 20
    assert transport.publish_telemetry({"fps": 12.5}) == SENT
    assert transport.publish_ack("r-1", {"state": "accepted"}) == SENT
    assert transport.flush(WAIT_S)
    assert wait_for(lambda: probe.count("atlas-edge/cam-live/") >= 23)

    status = probe.on("atlas-edge/cam-live/status")
    assert status[0]["state"] == "online" and status[0]["model"] == "demo-1.0"
    assert [m["seq"] for m in results(probe, "cam-live")] == list(range(20))
    assert not any("historical" in m for m in results(probe, "cam-live"))
    assert probe.on("atlas-edge/cam-live/telemetry") == [{"fps": 12.5}]
    assert probe.on("atlas-edge/cam-live/ack/r-1") == [{"state": "accepted"}]
    stats = transport.stats()
    # 20 results + telemetry + ack + online status, all acknowledged; nothing went through the outbox
    assert (stats["published"], stats["acked"], stats["outboxed"], stats["replayed"]) == (23, 23, 0, 0)


def test_clean_stop_sets_retained_status_offline(mosquitto, tmp_path, probe_factory):
    transport = make_transport(tmp_path, mosquitto.host, mosquitto.port, device="cam-stop")
    transport.start()
    assert wait_for(lambda: transport.connected)
    assert transport.stop(WAIT_S) is True
    assert not transport.connected
    late = probe_factory(mosquitto, ["atlas-edge/cam-stop/status"])  # a new subscriber: the retained one
    assert wait_for(lambda: late.count() == 1)
    topic, payload, retained, _ = late.messages[0]
    assert retained and json.loads(payload)["state"] == "offline"
    assert json.loads(payload)["reason"] == "stopped"


def test_a_raising_message_handler_does_not_kill_the_loop(mosquitto, tmp_path, probe_factory, transports,
                                                          caplog):
    seen: List[bytes] = []

    def handler(topic: str, payload: bytes) -> None:
        seen.append(payload)
        if payload == b"boom":
            raise RuntimeError("handler bug")

    transport = make_transport(tmp_path, mosquitto.host, mosquitto.port, device="cam-raise",
                               on_message=handler)
    transports.append(transport)
    transport.start()
    assert wait_for(lambda: transport.connected)
    operator = probe_factory(mosquitto, [])
    assert wait_for(lambda: transport.stats()["published"] >= 1)  # online status out: subscribed by now
    operator.publish("atlas-edge/cam-raise/cmd/status", b"boom")
    operator.publish("atlas-edge/cam-raise/cmd/status", b"after")
    assert wait_for(lambda: len(seen) == 2)
    assert seen == [b"boom", b"after"]
    assert "handler bug" in caplog.text  # logged with its traceback, not swallowed
    assert transport.connected and transport.stats()["reconnects"] == 0


def test_broker_restart_mid_stream_loses_nothing(fresh_broker, tmp_path, probe_factory, transports):
    """A stream keeps publishing while the broker stops and comes back on the same port.

    Every message arrives; those published during the outage arrive after the reconnect, in order, marked
    historical; the counts on both sides match exactly. The subscriber has a persistent session so that it
    misses nothing itself (the broker saves it across the restart, as a production broker would).
    """
    probe = probe_factory(fresh_broker, ["atlas-edge/cam-01/results/#"], client_id="restart-probe",
                          clean_session=False)
    transport = make_transport(tmp_path, fresh_broker.host, fresh_broker.port)
    transports.append(transport)
    transport.start()
    assert wait_for(lambda: transport.connected)

    outcomes: List[str] = []
    stop = threading.Event()

    def stream() -> None:
        seq = 0
        while not stop.is_set():
            outcomes.append(transport.publish_result("front", {"seq": seq}))
            seq += 1
            stop.wait(0.002)

    publisher = threading.Thread(target=stream)
    publisher.start()
    try:
        assert wait_for(lambda: len(outcomes) >= 50)
        fresh_broker.stop()
        assert wait_for(lambda: not transport.connected)
        assert wait_for(lambda: outcomes.count(OUTBOXED) >= 30)
        fresh_broker.start()
        assert wait_for(lambda: transport.connected)
        count = len(outcomes)
        assert wait_for(lambda: len(outcomes) >= count + 50)
    finally:
        stop.set()
        publisher.join(WAIT_S)
    total = len(outcomes)
    assert transport.flush(WAIT_S)
    assert wait_for(lambda: transport.stats()["outbox_messages"] == 0)
    stats = transport.stats()

    def arrived() -> List[Dict[str, Any]]:
        # The broker redelivers to the probe, with MQTT's DUP flag, what it had in flight to the probe at the
        # restart: a DUP copy of a payload the probe already has is that leg repeating itself, not the
        # transport, so it is set aside (a DUP copy of something not yet seen is the only copy: kept).
        with probe._lock:
            copies = list(probe.messages)
        seen, kept = set(), []
        for _, payload, _, dup in copies:
            if not (dup and payload in seen):
                kept.append(json.loads(payload))
            seen.add(payload)
        return kept

    wait_for(lambda: len({m["seq"] for m in arrived()}) >= total
             and sum(1 for m in arrived() if m.get("historical")) >= stats["replayed"])
    messages = arrived()
    missing = sorted(set(range(total)) - {m["seq"] for m in messages})
    assert not missing, "missing %s; stats %s; %d arrived" % (missing, stats, len(messages))
    live = [m["seq"] for m in messages if not m.get("historical")]
    historical = [m["seq"] for m in messages if m.get("historical")]
    outboxed_seqs = [i for i, outcome in enumerate(outcomes) if outcome == OUTBOXED]

    assert sorted(set(live) | set(historical)) == list(range(total))  # nothing lost
    assert live == sorted(set(live))  # live ones in order, none twice
    assert historical == sorted(historical) and len(set(historical)) == len(historical)
    assert set(outboxed_seqs) <= set(historical)  # everything published during the outage: historical
    assert len(historical) == stats["replayed"] == stats["outboxed"] == len(outboxed_seqs) + stats["requeued"]
    # A copy arrives twice only if it was in flight at the drop (moved to the outbox, replayed as historical).
    assert len(set(live) & set(historical)) <= stats["requeued"]
    assert stats["reconnects"] == 1 and stats["dropped"] == 0


def test_unacknowledged_at_drop_are_requeued_in_order(mosquitto, tmp_path, probe_factory, transports,
                                                      tcp_proxy_factory):
    """Messages written but never seen by the broker when the link dies arrive once, historical, in order."""
    proxy = tcp_proxy_factory(mosquitto)
    probe = probe_factory(mosquitto, ["atlas-edge/cam-up/results/#"])
    transport = make_transport(tmp_path, proxy.host, proxy.port, device="cam-up")
    transports.append(transport)
    transport.start()
    assert wait_for(lambda: transport.connected)

    assert [transport.publish_result("front", {"seq": i}) for i in range(10)] == [SENT] * 10
    assert transport.flush(WAIT_S)
    proxy.hold("up")  # the broker stops seeing what the box writes
    assert [transport.publish_result("front", {"seq": i}) for i in range(10, 20)] == [SENT] * 10
    assert not transport.flush(0.3) and transport.stats()["pending"] == 10
    proxy.cut()
    assert wait_for(lambda: transport.stats()["requeued"] == 10)
    assert transport.flush(0.1)  # nothing outstanding: in the outbox now
    assert [transport.publish_result("front", {"seq": i}) for i in range(20, 30)] == [OUTBOXED] * 10
    proxy.resume()

    assert wait_for(lambda: len(results(probe, "cam-up")) >= 30)
    assert wait_for(lambda: transport.stats()["outbox_messages"] == 0)
    got = results(probe, "cam-up")
    assert [(m["seq"], m.get("historical", False)) for m in got] == (
        [(i, False) for i in range(10)] + [(i, True) for i in range(10, 30)])
    stats = transport.stats()
    assert (stats["requeued"], stats["outboxed"], stats["replayed"], stats["reconnects"]) == (10, 20, 20, 1)


def test_lost_pubacks_give_marked_duplicates_not_silent_ones(mosquitto, tmp_path, probe_factory, transports,
                                                             tcp_proxy_factory):
    """The broker took the messages but its PUBACKs died with the link: at least once, second copy marked."""
    proxy = tcp_proxy_factory(mosquitto)
    probe = probe_factory(mosquitto, ["atlas-edge/cam-down/results/#"])
    transport = make_transport(tmp_path, proxy.host, proxy.port, device="cam-down")
    transports.append(transport)
    transport.start()
    assert wait_for(lambda: transport.connected)

    assert transport.flush(WAIT_S)  # the online status is acknowledged before the link goes bad
    proxy.hold("down")  # PUBACKs from the broker never reach the box
    assert [transport.publish_result("front", {"seq": i}) for i in range(10)] == [SENT] * 10
    assert wait_for(lambda: len(results(probe, "cam-down")) == 10)  # delivered live already
    assert transport.stats()["pending"] == 10
    proxy.cut()
    assert wait_for(lambda: transport.stats()["requeued"] == 10)
    proxy.resume()
    assert wait_for(lambda: len(results(probe, "cam-down")) >= 20)
    assert wait_for(lambda: transport.stats()["outbox_messages"] == 0)
    got = results(probe, "cam-down")
    assert [(m["seq"], m.get("historical", False)) for m in got] == (
        [(i, False) for i in range(10)] + [(i, True) for i in range(10)])
    assert transport.stats()["replayed"] == transport.stats()["requeued"] == 10


CHILD_PUBLISHER = """
import json, sys, time
from agent.config.mqtt_config import MqttConfig
from agent.ops.outbox import Outbox
from agent.ops.transport import MqttTransport
port, path, device, count = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
config = MqttConfig(host="127.0.0.1", port=port, reconnect_min_s=0.05, reconnect_max_s=0.1)
transport = MqttTransport(config, device, Outbox(path, 10**6), device_kind="atlas-200dk").start()
if count == 0:
    deadline = time.monotonic() + 20
    while not transport.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    print("connected" if transport.connected else "not connected within 20 s", flush=True)
else:
    print(json.dumps([transport.publish_result("front", {"seq": i}) for i in range(count)]), flush=True)
time.sleep(120)  # stays up (connected, or with its queue) until the test kills it
"""


def run_child(port: int, outbox_path: str, device: str, count: int) -> "subprocess.Popen[bytes]":
    command = [sys.executable, "-c", CHILD_PUBLISHER, str(port), outbox_path, device, str(count)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=REPO_ROOT))


def kill(child: "subprocess.Popen[bytes]") -> None:
    child.send_signal(signal.SIGKILL)
    assert child.wait(WAIT_S) == -signal.SIGKILL


def test_killed_while_broker_down_then_restarted_delivers_the_queue(fresh_broker, tmp_path, probe_factory,
                                                                    transports):
    outbox_path = str(tmp_path / "outbox.sqlite")
    fresh_broker.stop()
    child = run_child(fresh_broker.port, outbox_path, "cam-01", 40)
    try:
        assert json.loads(child.stdout.readline()) == [OUTBOXED] * 40
        kill(child)  # no stop(), no atexit: as if the OOM killer or a power-cut-free crash hit it
    finally:
        if child.poll() is None:
            child.kill()
    fresh_broker.start()
    probe = probe_factory(fresh_broker, ["atlas-edge/cam-01/results/#"])
    transport = make_transport(tmp_path, fresh_broker.host, fresh_broker.port)  # same outbox file
    transports.append(transport)
    transport.start()
    assert wait_for(lambda: len(results(probe)) >= 40)
    assert [(m["seq"], m["historical"]) for m in results(probe)] == [(i, True) for i in range(40)]
    assert wait_for(lambda: transport.stats()["outbox_messages"] == 0)
    assert transport.stats()["replayed"] == 40


def test_last_will_sets_status_offline_when_the_process_dies(mosquitto, tmp_path, probe_factory):
    probe = probe_factory(mosquitto, ["atlas-edge/cam-lwt/status"])
    child = run_child(mosquitto.port, str(tmp_path / "o.sqlite"), "cam-lwt", 0)
    try:
        assert child.stdout.readline().strip() == b"connected"
        assert wait_for(lambda: any(m["state"] == "online" for m in probe.on("atlas-edge/cam-lwt/status")))
        kill(child)
    finally:
        if child.poll() is None:
            child.kill()
    assert wait_for(lambda: probe.on("atlas-edge/cam-lwt/status")[-1]["state"] == "offline")
    will = probe.on("atlas-edge/cam-lwt/status")[-1]
    assert (will["reason"], will["device_kind"]) == ("connection lost", "atlas-200dk")  # an away box says its kind
    late = probe_factory(mosquitto, ["atlas-edge/cam-lwt/status"])
    assert wait_for(lambda: late.count() == 1)
    _, payload, retained, _ = late.messages[0]
    assert retained and json.loads(payload)["state"] == "offline"


def test_replay_rate_is_bounded(mosquitto, tmp_path, probe_factory, transports):
    """30 queued messages at 100 Hz cannot all be replayed in less than 29 intervals (a lower bound only)."""
    transport = make_transport(tmp_path, mosquitto.host, mosquitto.port, device="cam-rate",
                               replay_rate_hz=100.0)
    transports.append(transport)
    for i in range(30):
        transport.publish_result("front", {"seq": i})
    probe = probe_factory(mosquitto, ["atlas-edge/cam-rate/results/#"])
    began = time.monotonic()  # before start(): replay may begin before a poll sees `connected`
    transport.start()
    assert wait_for(lambda: transport.stats()["replayed"] == 30)
    assert time.monotonic() - began >= 29 / 100.0
    assert wait_for(lambda: len(results(probe, "cam-rate")) == 30)
    assert [m["seq"] for m in results(probe, "cam-rate")] == list(range(30))


# -- order after an outage (issue 12): a source's results reach the broker in frame order ----------------------


def test_a_result_joins_the_back_of_its_sources_backlog(mosquitto, tmp_path, probe_factory, transports):
    """While the outbox holds results of a source, a new result of that source queues behind them; another
    source with nothing waiting goes out at once."""
    transport = make_transport(tmp_path, mosquitto.host, mosquitto.port, device="cam-order", replay_rate_hz=20.0)
    transports.append(transport)
    for i in range(10):
        assert transport.publish_result("front", {"seq": i}) == OUTBOXED  # not started: the broker is "away"
    probe = probe_factory(mosquitto, ["atlas-edge/cam-order/results/#"])
    transport.start()
    assert wait_for(lambda: transport.connected)
    assert transport.publish_result("front", {"seq": 10}) == OUTBOXED  # 9 or so still wait: queued behind
    assert transport.publish_result("back", {"seq": 0}) == SENT  # nothing waits for "back"
    assert wait_for(lambda: len(results(probe, "cam-order")) == 11)
    assert [m["seq"] for m in results(probe, "cam-order")] == list(range(11))
    assert wait_for(lambda: transport.stats()["outbox_messages"] == 0)
    assert transport.publish_result("front", {"seq": 11}) == SENT  # backlog gone: the fast path again
    assert wait_for(lambda: len(results(probe, "cam-order")) == 12)
    assert [m["seq"] for m in results(probe, "cam-order", "back")] == [0]


@pytest.mark.parametrize("round_", range(2))
def test_broker_restart_keeps_frame_order_per_source(fresh_broker, tmp_path, probe_factory, transports, round_):
    """Issue 12: frames flow from two sources while the broker stops and restarts; an independent
    persistent-session subscriber sees every result, per source in frame order, and once, but for the copy of a
    message whose PUBACK the stop lost (historical, counted in ``requeued``)."""
    probe = probe_factory(fresh_broker, ["atlas-edge/cam-01/results/#"], client_id="order-probe-%d" % round_,
                          clean_session=False)
    transport = make_transport(tmp_path, fresh_broker.host, fresh_broker.port, replay_rate_hz=500.0)
    transports.append(transport)
    transport.start()
    assert wait_for(lambda: transport.connected)
    sources = ("front", "back")
    sent = dict.fromkeys(sources, 0)
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            for source in sources:
                transport.publish_result(source, {"source": source, "frame": sent[source]})
                sent[source] += 1
            stop.wait(0.004)

    # The replay reads no backlog until live frames flow on the new connection: the case that reordered, forced
    # (an unheld replay at 500 Hz may drain 100 rows before a loaded machine gets back to this thread).
    replay_may_read = threading.Event()
    replay_may_read.set()
    peek = transport._outbox.peek

    def held_peek(*args, **kwargs):
        replay_may_read.wait(WAIT_S)
        return peek(*args, **kwargs)

    transport._outbox.peek = held_peek
    publisher = threading.Thread(target=stream)
    publisher.start()
    try:
        assert wait_for(lambda: sent["front"] >= 50)
        fresh_broker.stop()
        assert wait_for(lambda: not transport.connected)
        assert wait_for(lambda: transport.stats()["outboxed"] >= 100)
        replay_may_read.clear()
        fresh_broker.start()
        assert wait_for(lambda: transport.connected)
        mark = sent["front"]
        assert wait_for(lambda: sent["front"] >= mark + 20)
        during = transport.stats()["outbox_messages"]
        replay_may_read.set()
        assert during > 0  # the backlog is still there while live frames arrive
        mark = sent["front"]
        assert wait_for(lambda: sent["front"] >= mark + 100)
    finally:
        replay_may_read.set()
        stop.set()
        publisher.join(WAIT_S)
    assert transport.flush(WAIT_S)
    assert wait_for(lambda: transport.stats()["outbox_messages"] == 0)
    total = sum(sent.values())
    assert wait_for(lambda: len(distinct_deliveries(probe)) >= total)
    time.sleep(0.5)  # a duplicate would arrive after the last original: give it the chance to show
    got = distinct_deliveries(probe)
    stats = transport.stats()
    repeated = 0
    for source in sources:
        firsts, again = [], []
        for topic, m in got:
            if topic.endswith("/" + source):
                (again if m["frame"] in {f["frame"] for f in firsts} else firsts).append(m)
        frames = [m["frame"] for m in firsts]
        assert frames == list(range(sent[source])), "%s: %d received, first out of order at %s" % (
            source, len(frames), next((i for i, f in enumerate(frames) if f != i), None))
        # at least once (docs/mqtt.md): a message the broker took just before it stopped, whose PUBACK was lost,
        # comes again from the outbox, marked historical; seen once in a run of the aarch64 lane (frame 50)
        assert all(m.get("historical") for m in again), again
        repeated += len(again)
    assert stats["reconnects"] == 1 and stats["dropped"] == 0 and repeated <= stats["requeued"]


# -- replay is at least once, never a loop (issue 16) --------------------------------------------------------


def queued_before_start(tmp_path, broker, transports, device: str, count: int) -> MqttTransport:
    """A transport (not started: the broker is "away") with ``count`` results waiting in its outbox."""
    transport = make_transport(tmp_path, broker.host, broker.port, device=device)
    transports.append(transport)
    for i in range(count):
        transport.publish_result("front", {"seq": i})
    return transport


def test_acknowledged_rows_are_not_resent_when_their_delete_fails(mosquitto, tmp_path, probe_factory,
                                                                  transports):
    transport = queued_before_start(tmp_path, mosquitto, transports, "cam-nodel", 300)
    outbox = transport._outbox
    real = outbox._conn
    outbox._conn = refusing = RefusingCommit(real)  # from here on no delete can commit
    probe = probe_factory(mosquitto, ["atlas-edge/cam-nodel/results/#"])
    transport.start()
    assert wait_for(lambda: transport.stats()["replayed"] == 300)
    assert wait_for(lambda: len(outbox) == 0)  # all marked delivered...
    time.sleep(1.5)  # ...and the replay thread idles over them: an observation window (a loop would resend now)
    assert refusing.refused > 0 and outbox.bytes > 0  # ...while the rows are still on disk
    assert [m["seq"] for m in results(probe, "cam-nodel")] == list(range(300))  # each exactly once
    outbox._conn = real  # the disk has room again
    assert wait_for(lambda: outbox.bytes == 0)  # the retried delete went through
    assert transport.stats()["replayed"] == 300 and outbox.replayed == 300


def test_replay_resumes_after_an_error_without_resending(mosquitto, tmp_path, probe_factory, transports,
                                                        monkeypatch):
    transport = queued_before_start(tmp_path, mosquitto, transports, "cam-err", 250)
    outbox = transport._outbox
    real_peek = outbox.peek
    calls = []

    def failing_peek(n: int, after_id: int = 0):
        calls.append(after_id)
        if len(calls) in (2, 3):  # the second and third reads fail (an I/O error)
            raise sqlite3.OperationalError("disk I/O error")
        return real_peek(n, after_id)

    monkeypatch.setattr(outbox, "peek", failing_peek)
    probe = probe_factory(mosquitto, ["atlas-edge/cam-err/results/#"])
    transport.start()
    assert wait_for(lambda: len(outbox) == 0)
    assert wait_for(lambda: len(results(probe, "cam-err")) >= 250)
    time.sleep(0.5)  # an observation window, not synchronisation: a resent duplicate would arrive now
    assert [m["seq"] for m in results(probe, "cam-err")] == list(range(250))
    assert calls[2] == calls[1] > 0  # resumed after the last row sent, not from the top
