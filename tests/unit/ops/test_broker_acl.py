"""Broker security as shipped: systemd/mosquitto-acl.example and the password file made by
systemd/make-mosquitto-passwd.sh, loaded into a real Mosquitto; and MQTT over TLS with a CA made here."""

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
from agent.config.daemon_config import MqttConfig, TlsConfig
from agent.devtools.broker import BrokerTls, EmbeddedBroker, find_mosquitto
from agent.ops.outbox import Outbox
from agent.ops.transport import MqttTransport

ACL_FILE = os.path.join(REPO_ROOT, "systemd", "mosquitto-acl.example")
BROKER_CONF = os.path.join(REPO_ROOT, "systemd", "mosquitto.conf.example")
# Lines of the shipped broker config that name this host's files and ports: the test broker has its own.
LOCAL_KEYS = ("listener", "cafile", "certfile", "keyfile", "password_file", "acl_file", "allow_anonymous")
TAKEOVERS = 10
PASSWD_SCRIPT = os.path.join(REPO_ROOT, "systemd", "make-mosquitto-passwd.sh")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Credentials for two boxes and an operator, and a broker that enforces the shipped ACL."""
    find_mosquitto_or_skip()
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("needs mosquitto_passwd (package mosquitto) to make the password file")
    out = tmp_path_factory.mktemp("fleet")
    subprocess.run([PASSWD_SCRIPT, str(out), "cam-01", "cam-02"], check=True, capture_output=True,
                   timeout=WAIT_S)
    credentials = str(out / "credentials")
    with EmbeddedBroker(password_file=str(out / "mosquitto.passwd"), acl_file=ACL_FILE) as broker:
        yield broker, credentials


def shipped_settings():
    """The shipped mosquitto.conf.example's settings, less those naming files and ports of the broker host."""
    with open(BROKER_CONF, encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip() and not line.lstrip().startswith("#")]
    return [line for line in lines if line.split()[0] not in LOCAL_KEYS]


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
    operator = client_as(fleet, "operator", ["atlas-edge/#"])
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
    operator = client_as(fleet, "operator", ["atlas-edge/#"])
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
    operator = client_as(fleet, "operator", ["atlas-edge/cam-01/results/#"])
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


# -- one box cannot knock another offline --------------------------------------------------------------------

def _takeover_count(fleet_dir, settings):
    """How often cam-01 is disconnected while cam-02 logs in 10 times with cam-01's client id."""
    import paho.mqtt.client as mqtt

    credentials = os.path.join(fleet_dir, "credentials")
    with EmbeddedBroker(password_file=os.path.join(fleet_dir, "mosquitto.passwd"), acl_file=ACL_FILE,
                        extra_config=settings) as broker:
        drops: "queue.Queue[Any]" = queue.Queue()
        connected: "queue.Queue[Any]" = queue.Queue()
        victim = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="atlas-edge-cam-01",
                             reconnect_on_failure=False)
        victim.username_pw_set("cam-01", password(credentials, "cam-01"))
        victim.will_set("atlas-edge/cam-01/status", b'{"state": "offline"}', qos=1, retain=True)
        victim.on_connect = lambda c, u, f, reason, p: connected.put(reason)
        victim.on_disconnect = lambda c, u, f, reason, p: drops.put(reason)
        victim.connect(broker.host, broker.port, keepalive=10)
        victim.loop_start()
        assert not connected.get(timeout=WAIT_S).is_failure
        operator = MqttProbe(broker, ["atlas-edge/cam-01/status"], username="operator",
                             password=password(credentials, "operator"))
        try:
            for _ in range(TAKEOVERS):
                answers: "queue.Queue[Any]" = queue.Queue()
                thief = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="atlas-edge-cam-01",
                                    reconnect_on_failure=False)
                thief.username_pw_set("cam-02", password(credentials, "cam-02"))
                thief.on_connect = lambda c, u, f, reason, p, answers=answers: answers.put(reason)
                thief.connect(broker.host, broker.port, keepalive=10)
                thief.loop_start()
                assert not answers.get(timeout=WAIT_S).is_failure  # cam-02 is let in, as itself
                thief.disconnect()
                thief.loop_stop()
            if drops.empty():
                # a marker through the victim's own connection: anything the takeovers caused arrived before it
                victim.publish("atlas-edge/cam-01/status", b'{"state": "marker"}', qos=1).wait_for_publish(WAIT_S)
                assert wait_for(lambda: {"state": "marker"} in operator.on("atlas-edge/cam-01/status"))
            else:  # kicked: its will follows
                assert wait_for(lambda: {"state": "offline"} in operator.on("atlas-edge/cam-01/status"))
            offline = sum(1 for m in operator.on("atlas-edge/cam-01/status") if m == {"state": "offline"})
            return drops.qsize(), offline
        finally:
            operator.close()
            victim.disconnect()
            victim.loop_stop()


def test_with_the_shipped_broker_config_a_box_cannot_disconnect_another(tmp_path):
    find_mosquitto_or_skip()
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("needs mosquitto_passwd (package mosquitto) to make the password file")
    subprocess.run([PASSWD_SCRIPT, str(tmp_path), "cam-01", "cam-02"], check=True, capture_output=True,
                   timeout=WAIT_S)
    settings = shipped_settings()
    assert "use_username_as_clientid true" in settings and any(s.startswith("max_packet_size") for s in settings)
    assert _takeover_count(str(tmp_path), settings) == (0, 0)
    # the same broker without the shipped settings: the first takeover kicks cam-01 and fires its will
    drops, offline = _takeover_count(str(tmp_path), [])
    assert drops >= 1 and offline >= 1


@pytest.mark.parametrize("argv, reason", [
    (["cam-01", "operator"], "device name 'operator' is reserved"),
    (["cam-01", "group"], "device name 'group' is reserved"),
    (["$SYS"], "bad user name '$SYS'"),
    (["cam/01"], "bad user name 'cam/01'"),
    (["--operator", "group", "cam-01"], "operator name 'group' is reserved"),
    (["--operator", "cam-01", "cam-01"], "'cam-01' is named both as an operator and as a device"),
])
def test_the_passwd_script_refuses_reserved_and_topic_special_names(tmp_path, argv, reason):
    done = subprocess.run([PASSWD_SCRIPT, str(tmp_path / "out"), *argv], capture_output=True, text=True,
                          timeout=WAIT_S)
    assert done.returncode == 2 and reason in done.stderr
    assert not (tmp_path / "out").exists()  # refused before anything is written


# -- TLS ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command line tool to make a test CA")
    out = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]  # fast to generate

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=str(out), timeout=WAIT_S)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=atlas-edge test CA")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (out / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.cnf")
    # a second CA that signed nothing here: trusting it must not be enough
    run("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.crt", "-days", "2",
        "-subj", "/CN=other CA")
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
