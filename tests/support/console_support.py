"""The web console's test rig (a helper module, not a test module): a users file with one account per role, the
console on a real Mosquitto (its FleetWatch on a real link), boxes that publish statuses and answer commands.

``tests/unit/console`` drives the app through Starlette's TestClient; ``tests/system/console`` serves it with
uvicorn to Debian's Chromium.
"""

import json
import threading
from typing import Any, Dict, List, Optional

from agent.console.accounts import Accounts
from agent.fleet.link import open_link
from agent.ops.mqtt_client import new_client
from agent.protocol.messages import ack_message
from agent.protocol.status import status_message
from agent.protocol.topics import (
    ack_topic,
    alert_topic,
    command_subscriptions,
    read_command_topic,
    snapshot_topic,
    status_topic,
    telemetry_topic,
)
from tests.conftest import MqttProbe

PASSWORD = "correct horse battery"
PREFIX = "console-test"


def users_file(folder: str) -> str:
    """``olga`` operator of every group, ``lim`` operator of ``site-b`` only, ``vic`` viewer."""
    path = "%s/users.json" % folder
    accounts = Accounts.load(path, missing_ok=True)
    accounts.add("olga", "operator", PASSWORD)
    accounts.add("lim", "operator", PASSWORD, ["site-b"])
    accounts.add("vic", "viewer", PASSWORD)
    accounts.save()
    return path


def watch_on(broker: Any, prefix: str = PREFIX):
    """A started FleetWatch on its own link to ``broker``."""
    from agent.console.watch import FleetWatch

    link = open_link([(broker.host, broker.port, False)], lambda tls: new_client("console-test-link"))
    return FleetWatch(link, prefix).start()


class AnsweringBox:
    """A box's MQTT face for console tests: its retained status, alerts, snapshots; it answers every command
    with a final ``succeeded`` ack carrying ``answers[verb]`` (default ``{}``) and records what it received."""

    def __init__(self, broker: Any, device: str, groups: List[str], prefix: str = PREFIX,
                 answers: Optional[Dict[str, Dict[str, Any]]] = None, **status: Any) -> None:
        self.device, self.groups, self.prefix = device, groups, prefix
        self.answers = answers or {}
        self.received: List[Dict[str, Any]] = []
        self.lock = threading.Lock()
        self.probe = MqttProbe(broker, command_subscriptions(prefix, device, groups))
        self.probe.client.on_message = self._on_message
        self.publish_status("online", **status)

    def publish_status(self, state: str, **fields: Any) -> None:
        body = status_message(state, self.device, groups=self.groups, **fields)
        info = self.probe.client.publish(status_topic(self.prefix, self.device), json.dumps(body), qos=1, retain=True)
        info.wait_for_publish(10)

    def alert(self, body: Dict[str, Any]) -> None:
        self.probe.publish(alert_topic(self.prefix, self.device), json.dumps(body).encode())

    def telemetry(self, body: Dict[str, Any]) -> None:
        self.probe.publish(telemetry_topic(self.prefix, self.device), json.dumps(body).encode())

    def snapshot(self, source: str, payload: bytes) -> None:
        self.probe.publish(snapshot_topic(self.prefix, self.device, source), payload)

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        command = read_command_topic(self.prefix, self.device, self.groups, message.topic)
        if command is None:
            return
        body = json.loads(message.payload)
        if "request_id" not in body:  # the fleet's announce (no request, no ack): this box's status is retained
            return
        with self.lock:
            self.received.append(dict(body, verb=command.verb))
        ack = ack_message(body["request_id"], command.verb, "succeeded", self.answers.get(command.verb, {}))
        client.publish(ack_topic(self.prefix, self.device, body["request_id"]), json.dumps(ack), qos=1)

    def close(self) -> None:
        self.probe.client.publish(status_topic(self.prefix, self.device), b"", qos=1, retain=True).wait_for_publish(10)
        self.probe.close()
