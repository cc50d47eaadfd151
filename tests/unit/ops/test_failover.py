"""``mqtt.hosts``: the box tries its brokers in turn, says which one it is on, and loses nothing moving between them.

Real Mosquittos and real sockets: a closed port (refused at once), a listener that accepts and never answers (a
hung or booting node: only the per-attempt timeout gets past it), and brokers stopped mid-stream. The same
behaviour on a RabbitMQ cluster is in tests/system/cluster/test_cluster.py.
"""

import json
import socket
import threading
from typing import List

import pytest
from conftest import WAIT_S, wait_for

from agent.config.daemon_config import parse_daemon_config
from agent.config.mqtt_config import MqttConfig
from agent.config.schema import ConfigError
from agent.devtools.broker import EmbeddedBroker, free_port
from agent.ops.outbox import Outbox
from agent.ops.transport import MqttTransport

FAST = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.2, "connect_timeout_s": 0.5}


def make_transport(tmp_path, hosts: List[str], device: str = "cam-fo") -> MqttTransport:
    outbox = Outbox(str(tmp_path / ("%s.sqlite" % device)), max_bytes=10 * 1024 * 1024)
    return MqttTransport(MqttConfig(hosts=hosts, **FAST), device, outbox, replay_rate_hz=5000.0)


@pytest.fixture
def silent_listener():
    """A TCP port that accepts connections and never says a word (no CONNACK ever comes)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield "127.0.0.1:%d" % listener.getsockname()[1]
    listener.close()


def test_hosts_are_validated_naming_the_entry():
    good = parse_daemon_config({"device_id": "cam-1", "model": {"bundle": "b"},
                                "mqtt": {"hosts": ["10.0.0.1:1883", "node-b", "[::1]:8883"]}})
    assert good.mqtt.brokers() == [("10.0.0.1", 1883), ("node-b", 1883), ("::1", 8883)]
    assert MqttConfig(host="h", port=1884).brokers() == [("h", 1884)]
    with pytest.raises(ConfigError) as caught:
        parse_daemon_config({"device_id": "cam-1", "model": {"bundle": "b"},
                             "mqtt": {"hosts": ["a:1883", "b:0", ":1883", "c:x"]}})
    fields = {e.path: e.message for e in caught.value.errors}
    assert set(fields) == {"mqtt.hosts[1]", "mqtt.hosts[2]", "mqtt.hosts[3]"}, fields
    assert "1-65535" in fields["mqtt.hosts[1]"] and "HOST:PORT" in fields["mqtt.hosts[2]"]


def test_a_refusing_and_a_silent_broker_are_skipped_and_the_status_names_the_one_in_use(
        mosquitto, tmp_path, probe_factory, silent_listener):
    probe = probe_factory(mosquitto, ["atlas-edge/cam-fo/status"])
    closed = "127.0.0.1:%d" % free_port()
    live = "%s:%d" % (mosquitto.host, mosquitto.port)
    transport = make_transport(tmp_path, [closed, silent_listener, live])
    transport.start()
    try:
        assert wait_for(lambda: transport.connected)
        assert wait_for(lambda: probe.on("atlas-edge/cam-fo/status"))
        status = probe.on("atlas-edge/cam-fo/status")[-1]
        assert status["state"] == "online" and status["broker"] == live
        stats = transport.stats()
        assert stats["broker"] == live
        assert stats["connect_failures"] == 2  # one refused, one without a CONNACK in connect_timeout_s
    finally:
        transport.stop(5.0)


def test_a_stopped_broker_moves_the_box_to_the_next_one_and_no_result_is_lost(tmp_path, probe_factory):
    with EmbeddedBroker(persistence=True) as first, EmbeddedBroker() as second:
        # Persistent sessions: what `first` queued for its subscriber at the stop reaches it after a restart.
        probes = [probe_factory(broker, ["atlas-edge/cam-fo/#"], client_id="fo-probe-%d" % i, clean_session=False)
                  for i, broker in enumerate((first, second))]
        addresses = ["%s:%d" % (b.host, b.port) for b in (first, second)]
        transport = make_transport(tmp_path, addresses)
        transport.start()
        sent: List[int] = []
        stop = threading.Event()

        def stream() -> None:
            while not stop.is_set():
                transport.publish_result("front", {"seq": len(sent)})
                sent.append(len(sent))
                stop.wait(0.005)

        publisher = threading.Thread(target=stream)
        try:
            assert wait_for(lambda: transport.connected and transport.stats()["broker"] == addresses[0])
            publisher.start()
            assert wait_for(lambda: len(sent) >= 50)
            first.stop()
            assert wait_for(lambda: transport.stats()["broker"] == addresses[1] and transport.connected)
            count = len(sent)
            assert wait_for(lambda: len(sent) >= count + 50)
        finally:
            stop.set()
            if publisher.is_alive():
                publisher.join(WAIT_S)
        assert transport.flush(WAIT_S) and wait_for(lambda: transport.stats()["outbox_messages"] == 0)
        first.start()  # the first probe's session gets what the broker held for it

        def seqs() -> set:
            return {json.loads(p)["seq"] for probe in probes for t, p, _, _ in list(probe.messages)
                    if t.endswith("/results/front")}

        wait_for(lambda: len(seqs()) >= len(sent))
        missing = sorted(set(sent) - seqs())
        assert not missing, "missing %s of %d; stats %s" % (missing, len(sent), transport.stats())
        on_second = [m for m in probes[1].on("atlas-edge/cam-fo/status") if m["state"] == "online"]
        assert on_second and on_second[-1]["broker"] == addresses[1]
        transport.stop(5.0)



def test_the_status_after_a_move_means_commands_reach_the_box_and_none_from_its_absence_runs_later(
        tmp_path, probe_factory):
    """Clean sessions (docs/architecture.md, "Broker sessions"): the box re-subscribes on every connect, before it
    publishes the status that says it is back, so a command sent the moment an operator sees that status is
    delivered; a command published while it was away is not kept for it (the operator re-sends it)."""
    commands: List[bytes] = []
    with EmbeddedBroker() as first, EmbeddedBroker() as second:
        addresses = ["%s:%d" % (b.host, b.port) for b in (first, second)]
        operators = [probe_factory(broker, ["atlas-edge/cam-fo/status"]) for broker in (first, second)]
        outbox = Outbox(str(tmp_path / "cam-fo.sqlite"), max_bytes=10 * 1024 * 1024)
        transport = MqttTransport(MqttConfig(hosts=addresses, **FAST), "cam-fo", outbox,
                                  on_message=lambda topic, payload: commands.append(payload))
        transport.start()
        try:
            assert wait_for(lambda: transport.connected and transport.stats()["broker"] == addresses[0])
            first.stop()
            second_status = lambda: operators[1].on("atlas-edge/cam-fo/status")  # noqa: E731 - read twice
            assert wait_for(lambda: any(s["state"] == "online" for s in second_status()))
            operators[1].publish("atlas-edge/cam-fo/cmd/status", b"at-once")  # no wait after seeing the status
            assert wait_for(lambda: commands == [b"at-once"]), commands
        finally:
            transport.stop(5.0)
        assert second_status()[-1]["state"] == "offline"  # a clean stop says so (retained), no will needed

        operators[1].publish("atlas-edge/cam-fo/cmd/status", b"while-away")
        onlines = len([s for s in second_status() if s["state"] == "online"])
        again = MqttTransport(MqttConfig(hosts=[addresses[1]], **FAST), "cam-fo", outbox,
                              on_message=lambda topic, payload: commands.append(payload))
        again.start()
        try:
            assert wait_for(lambda: len([s for s in second_status() if s["state"] == "online"]) > onlines)
            operators[1].publish("atlas-edge/cam-fo/cmd/status", b"after")
            assert wait_for(lambda: b"after" in commands)
            assert commands == [b"at-once", b"after"]  # nothing kept for it while it was away
        finally:
            again.stop(5.0)


def test_an_unexpected_error_building_a_session_is_a_failed_attempt_not_the_end_of_the_supervisor(
        mosquitto, tmp_path, monkeypatch, caplog):
    """The first two attempts raise (a bug in building the session: here the last will's status); the supervisor
    logs each, counts it as a failed connect and backs off, and the third connects."""
    from agent.ops import connection

    real, calls = connection.status_message, []

    def broken_twice(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            raise ValueError("planted: status_message failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(connection, "status_message", broken_twice)
    transport = make_transport(tmp_path, ["%s:%d" % (mosquitto.host, mosquitto.port)])
    transport.start()
    try:
        assert wait_for(lambda: transport.connected), "the supervisor stopped after the planted errors"
        assert len(calls) >= 3 and transport.stats()["connect_failures"] == 2
        assert caplog.text.count("failed unexpectedly; trying again") == 2, caplog.text
    finally:
        transport.stop(5.0)
