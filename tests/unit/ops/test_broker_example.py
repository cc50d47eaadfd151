"""The shipped broker example as shipped (issue 29, issue 30 item 10): Mosquitto started with the exact
systemd/mosquitto.conf.example, installed the way docs/operations.md says (its /etc/mosquitto/ paths pointed at
a test directory, its ports at free ones, certificates from a test CA), with the password files of
systemd/make-mosquitto-passwd.sh and systemd/mosquitto-acl.example. Checked: no port open but the configured
ones, no box can take another's client id, and operators' runs side by side never disconnect each other."""

import argparse
import os
import pwd
import queue
import re
import shutil
import subprocess
import types
import uuid
from typing import Any, List, Set

import pytest

from agent.cli import ctl
from agent.devtools.broker import find_mosquitto, free_port, port_accepts
from tests.conftest import REPO_ROOT, WAIT_S, MqttProbe, wait_for
from tests.support.tls_support import make_test_pki

BROKER_CONF = os.path.join(REPO_ROOT, "systemd", "mosquitto.conf.example")
ACL_FILE = os.path.join(REPO_ROOT, "systemd", "mosquitto-acl.example")
PASSWD_SCRIPT = os.path.join(REPO_ROOT, "systemd", "make-mosquitto-passwd.sh")
INSTALLED = "/etc/mosquitto/"  # where docs/operations.md installs the files the config names
BOX_PORT, OPERATOR_PORT = 8883, 8884  # the shipped listeners
TAKEOVERS = 5


def _operator_block(acl: str, name: str) -> str:
    """The shipped ACL's operator block, copied for another operator as its comment says."""
    block = re.search(r"^user operator-admin\n(?:topic .*\n)+", acl, re.M)
    assert block, "the shipped ACL has no 'user operator-admin' block"
    return block.group(0).replace("user operator-admin", "user " + name)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    try:
        mosquitto = find_mosquitto()
    except Exception as exc:
        pytest.skip("needs the mosquitto broker: %s" % exc)
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("needs mosquitto_passwd (package mosquitto) to make the password files")
    etc = tmp_path_factory.mktemp("etc-mosquitto")  # stands for /etc/mosquitto
    pki = make_test_pki(str(etc / "pki"))
    for source, target in ((pki.ca, "ca_certificates/ca.crt"), (pki.cert, "certs/broker.crt"),
                           (pki.key, "certs/broker.key")):
        os.makedirs(os.path.dirname(str(etc / target)), exist_ok=True)
        shutil.copy(source, str(etc / target))
    made = etc / "made"
    subprocess.run([PASSWD_SCRIPT, str(made), "--operator", "operator-admin", "--operator", "operator-bob",
                    "cam-01", "cam-02"], check=True, capture_output=True, timeout=WAIT_S)
    shutil.copy(str(made / "mosquitto.passwd"), str(etc / "atlas-edge.passwd"))
    shutil.copy(str(made / "operators.passwd"), str(etc / "atlas-edge-operators.passwd"))
    acl = open(ACL_FILE, encoding="utf-8").read()
    (etc / "atlas-edge.acl").write_text(acl + "\n" + _operator_block(acl, "operator-bob"))
    shipped = open(BROKER_CONF, encoding="utf-8").read()
    listeners = re.findall(r"^listener .*$", shipped, re.M)
    assert listeners == ["listener %d" % BOX_PORT, "listener %d" % OPERATOR_PORT], listeners
    ports = types.SimpleNamespace(box=free_port(), operator=free_port())
    conf = (shipped.replace(INSTALLED, str(etc) + "/")
            .replace("listener %d\n" % BOX_PORT, "listener %d\n" % ports.box)
            .replace("listener %d\n" % OPERATOR_PORT, "listener %d\n" % ports.operator))
    (etc / "conf.d").mkdir()
    (etc / "conf.d" / "atlas-edge.conf").write_text(conf)
    # the distribution's main file, as Debian's includes conf.d/ (with no listener of its own); started as
    # root, Mosquitto would switch to the user "mosquitto", who cannot read the test's files
    main = ["user %s" % pwd.getpwuid(os.geteuid()).pw_name] if os.geteuid() == 0 else []
    (etc / "mosquitto.conf").write_text("\n".join(main + ["include_dir %s" % (etc / "conf.d")]) + "\n")
    log = open(str(etc / "mosquitto.log"), "w")
    proc = subprocess.Popen([mosquitto, "-c", str(etc / "mosquitto.conf")], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: proc.poll() is not None or (port_accepts("127.0.0.1", ports.box)
                                                           and port_accepts("127.0.0.1", ports.operator))), \
            "mosquitto did not listen"
        assert proc.poll() is None, open(str(etc / "mosquitto.log")).read()[-2000:]
        yield types.SimpleNamespace(proc=proc, ports=ports, ca=str(etc / "ca_certificates/ca.crt"),
                                    credentials=str(made / "credentials"), log=str(etc / "mosquitto.log"))
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT_S)
        log.close()


def password(broker, user: str) -> str:
    with open(os.path.join(broker.credentials, user + ".password"), encoding="utf-8") as handle:
        return handle.read()


def listening_ports(pid: int) -> Set[int]:
    """The TCP ports process ``pid`` listens on (its sockets, found in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as handle:
            for line in list(handle)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def paho_client(broker, port: int, user: str, client_id: str) -> Any:
    """A TLS client of ``user`` with this exact client id, its connect and disconnect reasons queued."""
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, reconnect_on_failure=False)
    client.username_pw_set(user, password(broker, user))
    client.tls_set(ca_certs=broker.ca)
    client.events = queue.Queue()
    client.on_connect = lambda c, u, f, reason, p: client.events.put(("connect", reason))
    client.on_disconnect = lambda c, u, f, reason, p: client.events.put(("disconnect", reason))
    client.connect("127.0.0.1", port, keepalive=10)
    client.loop_start()
    kind, reason = client.events.get(timeout=WAIT_S)
    assert kind in ("connect", "disconnect")
    client.refused = kind == "disconnect" or reason.is_failure
    return client


def close(*clients: Any) -> None:
    for client in clients:
        client.disconnect()
        client.loop_stop()


def operator_probe(broker, user: str, topics: List[str]) -> MqttProbe:
    return MqttProbe(types.SimpleNamespace(host="127.0.0.1", port=broker.ports.operator), topics, username=user,
                     password=password(broker, user), tls_ca=broker.ca)


def test_only_the_configured_listeners_are_open(broker):
    open_ports = listening_ports(broker.proc.pid)
    assert open_ports == {broker.ports.box, broker.ports.operator}, open_ports  # no default 1883 listener


def test_no_box_can_take_another_boxs_client_id(broker):
    watcher = operator_probe(broker, "operator-admin", ["atlas-edge/cam-01/status"])
    victim = paho_client(broker, broker.ports.box, "cam-01", "atlas-edge-cam-01")
    assert not victim.refused
    victim.will_set("atlas-edge/cam-01/status", b'{"state": "offline"}', qos=1, retain=True)  # for the next
    thieves = []
    try:
        for _ in range(TAKEOVERS):
            for client_id in ("atlas-edge-cam-01", "cam-01"):  # the id it sent, and the one the broker gave it
                thief = paho_client(broker, broker.ports.box, "cam-02", client_id)
                assert not thief.refused  # let in, as cam-02 (its own id: the username)
                thieves.append(thief)
            elsewhere = paho_client(broker, broker.ports.operator, "cam-02", "cam-01")  # a box's password there
            assert elsewhere.refused
            thieves.append(elsewhere)
        # a marker through the victim's own connection: anything the takeovers caused arrived before it
        victim.publish("atlas-edge/cam-01/status", b'{"state": "marker"}', qos=1).wait_for_publish(WAIT_S)
        assert wait_for(lambda: {"state": "marker"} in watcher.on("atlas-edge/cam-01/status"))
        assert victim.events.empty(), victim.events.get()  # never disconnected
        assert {"state": "offline"} not in watcher.on("atlas-edge/cam-01/status")
    finally:
        close(victim, *thieves)
        watcher.close()


def _run_client(broker, user: str, tool: str) -> Any:
    """A client as ``atlas-edge ctl``/``fleet`` makes it (ctl.make_client), connected to the operators' port."""
    parser = argparse.ArgumentParser()
    ctl.add_arguments(parser)
    args = parser.parse_args(["--broker", "mqtts://127.0.0.1:%d" % broker.ports.operator, "--username", user,
                              "--tls-ca", broker.ca, "cam-01", "status"])
    client = ctl.make_client(args, tool, True, password(broker, user))
    client.events = queue.Queue()
    client.on_connect = lambda c, u, f, reason, p: client.events.put(("connect", reason))
    client.on_disconnect = lambda c, u, f, reason, p: client.events.put(("disconnect", reason))
    client.on_message = lambda c, u, m: client.events.put(("message", bytes(m.payload)))
    client.connect("127.0.0.1", broker.ports.operator, keepalive=10)
    client.loop_start()
    kind, reason = client.events.get(timeout=WAIT_S)
    assert kind == "connect" and not reason.is_failure, reason
    return client


def test_operators_runs_side_by_side_never_disconnect_each_other(broker):
    rollout = _run_client(broker, "operator-admin", "fleet")  # a long `fleet rollout`
    assert rollout._client_id.decode().startswith("operator-admin-fleet-")
    marker = uuid.uuid4().hex
    subscribed = queue.Queue()
    rollout.on_subscribe = lambda c, u, mid, codes, p: subscribed.put(codes)
    rollout.subscribe("atlas-edge/announce", qos=1)
    assert not subscribed.get(timeout=WAIT_S)[0].is_failure
    others = []
    try:
        # the same operator's `fleet status`, another operator's, and ctl runs: each with an id of its own
        for user, tool in (("operator-admin", "fleet"), ("operator-bob", "fleet"), ("operator-admin", "ctl"),
                           ("operator-bob", "ctl")):
            other = _run_client(broker, user, tool)
            assert other._client_id != rollout._client_id
            others.append(other)
        others[-1].publish("atlas-edge/announce", marker.encode(), qos=1).wait_for_publish(WAIT_S)
        kind, value = rollout.events.get(timeout=WAIT_S)
        assert (kind, value) == ("message", marker.encode())  # still connected, and nothing came before
    finally:
        close(rollout, *others)
