"""Broker security as shipped: systemd/mosquitto-acl.example and the password files made by
systemd/make-mosquitto-passwd.sh, loaded into a real Mosquitto with one listener for boxes and operators (the
ACL's rules; the shipped two-listener config itself is tests/unit/ops/test_broker_example.py's); and MQTT over
TLS with a CA made here."""

import argparse
import io
import json
import os
import queue
import shutil
import subprocess
from typing import Any, Dict

import pytest
from conftest import REPO_ROOT, WAIT_S, MqttProbe, wait_for

from agent.cli import ctl
from agent.commands.dispatcher import CommandDispatcher
from agent.config.mqtt_config import MqttConfig, TlsConfig
from agent.devtools.broker import BrokerTls, EmbeddedBroker, find_mosquitto
from agent.ops.outbox import Outbox
from agent.ops.transport import MqttTransport
from tests.support.tls_support import make_test_pki

ACL_FILE = os.path.join(REPO_ROOT, "systemd", "mosquitto-acl.example")
PASSWD_SCRIPT = os.path.join(REPO_ROOT, "systemd", "make-mosquitto-passwd.sh")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Credentials for two boxes and an operator, and a broker that enforces the shipped ACL."""
    find_mosquitto_or_skip()
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("needs mosquitto_passwd (package mosquitto) to make the password file")
    out = tmp_path_factory.mktemp("fleet")
    subprocess.run([PASSWD_SCRIPT, str(out), "cam-01", "cam-02"], check=True, capture_output=True,
                   timeout=WAIT_S)  # and the default operator, operator-admin
    credentials = str(out / "credentials")
    # one listener here: the boxes' and the operators' password files together
    (out / "all.passwd").write_text((out / "mosquitto.passwd").read_text().rstrip("\n") + "\n"
                                    + (out / "operators.passwd").read_text())
    with EmbeddedBroker(password_file=str(out / "all.passwd"), acl_file=ACL_FILE) as broker:
        yield broker, credentials


def find_mosquitto_or_skip() -> None:
    try:
        find_mosquitto()
    except Exception as exc:
        pytest.skip("needs the mosquitto broker: %s" % exc)


def password(credentials: str, user: str) -> str:
    with open(os.path.join(credentials, user + ".password"), encoding="utf-8") as handle:
        return handle.read()


class Box:
    """cam-01 as deployed: username = device id, password from a systemd credential (cred:NAME)."""

    def __init__(self, broker, credentials, tmp_path, monkeypatch, user: str = "cam-01",
                 secret: str = "cam-01.password") -> None:
        monkeypatch.setenv("CREDENTIALS_DIRECTORY", credentials)
        self.calls = 0

        def status(fields: Dict[str, Any], progress) -> Dict[str, Any]:
            self.calls += 1
            return {"state": "serving"}

        config = MqttConfig(host=broker.host, port=broker.port, username=user, password="cred:" + secret,
                            groups=["line-1"], reconnect_min_s=0.05, reconnect_max_s=0.2)
        self.transport = MqttTransport(config, "cam-01", Outbox(str(tmp_path / "outbox.sqlite"), 1 << 20))
        self.dispatcher = CommandDispatcher(self.transport, {"status": status})
        self.transport.set_message_handler(self.dispatcher.submit)
        self.dispatcher.start()
        self.transport.start()

    def close(self) -> None:
        self.dispatcher.stop(5.0)
        self.transport.stop(5.0)
        self.dispatcher.close()


@pytest.fixture
def box(fleet, tmp_path, monkeypatch):
    broker, credentials = fleet
    made = Box(broker, credentials, tmp_path, monkeypatch)
    assert wait_for(lambda: made.transport.stats()["acked"] >= 1)
    yield made
    made.close()


def client_as(fleet, user: str, topics) -> MqttProbe:
    broker, credentials = fleet
    return MqttProbe(broker, topics, username=user, password=password(credentials, user))


def test_another_devices_credentials_cannot_command_this_box(fleet, box):
    operator = client_as(fleet, "operator-admin", ["atlas-edge/#"])
    intruder = client_as(fleet, "cam-02", [])
    try:
        intruder.publish("atlas-edge/cam-01/cmd/status", json.dumps({"request_id": "evil-1"}).encode())
        intruder.publish("atlas-edge/group/line-1/cmd/status", b'{"request_id": "evil-2"}')
        # The operator's command is a marker: the broker handled the intruder's publishes first (each was
        # acknowledged before this one left), so had they been delivered the box would have seen them first.
        operator.publish("atlas-edge/cam-01/cmd/status", json.dumps({"request_id": "ok-1"}).encode())
        acks = "atlas-edge/cam-01/ack/ok-1"
        assert wait_for(lambda: any(a["state"] == "succeeded" for a in operator.on(acks)))
        assert box.dispatcher.wait_idle(WAIT_S)
        assert box.dispatcher.stats()["received"] == 1 and box.calls == 1
        assert operator.count("atlas-edge/cam-01/ack/evil") == 0
    finally:
        operator.close()
        intruder.close()


def test_a_box_cannot_publish_outside_its_own_topics(fleet, box):
    operator = client_as(fleet, "operator-admin", ["atlas-edge/#"])
    try:
        assert wait_for(lambda: operator.count("atlas-edge/cam-01/status") >= 1)  # the retained one first
        before = operator.count()
        for topic in ("atlas-edge/cam-02/results/front", "atlas-edge/cam-02/status",
                      "atlas-edge/cam-01/cmd/restart", "atlas-edge/group/line-1/cmd/restart",
                      "atlas-edge/cam-01/other"):
            box.transport.publish(topic, {"forged": True})
        # what a box does publish (same connection, so these come after the forged ones)
        allowed = ["atlas-edge/cam-01/" + rest for rest in ("telemetry", "telemetry/alert", "events",
                                                            "snapshot/front", "ack/r-1", "results/front")]
        for topic in allowed:
            box.transport.publish(topic, {"marker": 1})
        assert wait_for(lambda: operator.on("atlas-edge/cam-01/results/front") == [{"marker": 1}])
        assert box.transport.flush(WAIT_S)
        with operator._lock:
            seen = [topic for topic, _, _, _ in operator.messages[before:]]
        assert seen == allowed
        assert box.dispatcher.stats()["received"] == 0  # its own cmd topic is read-only for it
    finally:
        operator.close()


def test_a_box_cannot_read_another_boxs_results(fleet, box):
    intruder = client_as(fleet, "cam-02", ["atlas-edge/cam-01/#"])
    operator = client_as(fleet, "operator-admin", ["atlas-edge/cam-01/results/#"])
    try:
        box.transport.publish_result("front", {"secret": 1})
        assert wait_for(lambda: operator.count() == 1)
        assert box.transport.flush(WAIT_S)
        box.transport.publish_result("front", {"secret": 2})
        assert wait_for(lambda: operator.count() == 2)  # delivered to whoever may read it...
        assert intruder.count() == 0  # ...and never to the other box
    finally:
        operator.close()
        intruder.close()


def test_refused_login_is_never_taken_for_connected(fleet, tmp_path, monkeypatch):
    broker, credentials = fleet
    wrong = tmp_path / "creds"
    wrong.mkdir()
    (wrong / "cam-01.password").write_text("not-the-password")
    impostor = Box(broker, str(wrong), tmp_path, monkeypatch)
    try:
        assert wait_for(lambda: impostor.transport.stats()["refused"] >= 2)  # retried with backoff
        assert not impostor.transport.connected
        assert impostor.transport.publish_result("front", {"seq": 1}) == "outboxed"  # kept, not lost
        assert impostor.transport.stats()["published"] == 0
    finally:
        impostor.close()


def test_anonymous_clients_are_refused(fleet):
    import paho.mqtt.client as mqtt

    broker, _ = fleet
    answers: queue.Queue[Any] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, reconnect_on_failure=False)
    client.on_connect = lambda c, u, flags, reason, props: answers.put(reason)
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        reason = answers.get(timeout=WAIT_S)
        assert reason.is_failure and "authori" in str(reason).lower()
    finally:
        client.disconnect()
        client.loop_stop()


# -- the password script -----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, reason", [
    (["cam-01", "operator"], "device name 'operator' is reserved"),
    (["cam-01", "group"], "device name 'group' is reserved"),
    (["$SYS"], "bad user name '$SYS'"),
    (["cam/01"], "bad user name 'cam/01'"),
    (["cam-01", "operator-x"], "device name 'operator-x' is reserved"),
    (["--operator", "group", "cam-01"], "operator name 'group' must be operator-<name>"),
    (["--operator", "cam-01", "cam-01"], "operator name 'cam-01' must be operator-<name>"),
])
def test_the_passwd_script_refuses_reserved_and_topic_special_names(tmp_path, argv, reason):
    done = subprocess.run([PASSWD_SCRIPT, str(tmp_path / "out"), *argv], capture_output=True, text=True,
                          timeout=WAIT_S)
    assert done.returncode == 2 and reason in done.stderr
    assert not (tmp_path / "out").exists()  # refused before anything is written


# -- TLS ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A throwaway CA and a server certificate for 127.0.0.1 (ca.crt, server.crt/.key, other.crt)."""
    out = tmp_path_factory.mktemp("tls")
    make_test_pki(str(out))
    return out


def test_tls_connects_with_the_right_ca_only(tls_files, tmp_path):
    find_mosquitto_or_skip()
    tls = BrokerTls(str(tls_files / "ca.crt"), str(tls_files / "server.crt"), str(tls_files / "server.key"))
    with EmbeddedBroker(tls=tls) as broker:
        assert broker.url.startswith("mqtts://")

        def transport(name: str, ca: str) -> MqttTransport:
            config = MqttConfig(host=broker.host, port=broker.port, tls=TlsConfig(ca_file=ca),
                                reconnect_min_s=0.05, reconnect_max_s=0.2)
            return MqttTransport(config, name, Outbox(str(tmp_path / (name + ".sqlite")), 1 << 20))

        good = transport("cam-tls", str(tls_files / "ca.crt"))
        bad = transport("cam-mitm", str(tls_files / "other.crt"))
        dispatcher = CommandDispatcher(good, {"status": lambda fields, progress: {"tls": True}})
        good.set_message_handler(dispatcher.submit)
        dispatcher.start()
        good.start()
        bad.start()
        try:
            assert wait_for(lambda: good.stats()["acked"] >= 1)
            parser = argparse.ArgumentParser()
            ctl.add_arguments(parser)
            out, err = io.StringIO(), io.StringIO()
            args = parser.parse_args(["--broker", broker.url, "--tls-ca", str(tls_files / "ca.crt"),
                                      "cam-tls", "status"])
            assert ctl.run(args, out=out, err=err) == ctl.EXIT_OK, err.getvalue()
            assert json.loads(out.getvalue().splitlines()[-1])["result"] == {"tls": True}
            assert wait_for(lambda: bad.stats()["connect_failures"] >= 2)  # handshake refused, retried
            assert not bad.connected and bad.stats()["published"] == 0
        finally:
            dispatcher.stop(5.0)
            good.stop(5.0)
            bad.stop(5.0)
            dispatcher.close()
