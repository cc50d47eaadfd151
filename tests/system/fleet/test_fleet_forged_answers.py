"""An attacker on the broker answers for the fleet (issue 30 follow-up): fleet request ids are predictable, and a box
with a command key answers anyone's unsigned command under such an id ``failed`` (``unsigned``) on that id's ack
topic, without recording it, so the operator's signed command with the same id still runs. A rollout that signs
its commands must not take that refusal as its box's answer. Real in-process daemons with a command key
(``benchmarks/fleet_sim.py``) on a real Mosquitto; the attacker is a plain paho client without the key.
"""
# ruff: noqa: F811 - the fixtures bundles and make_fleet come from tests.support.fleet_support

import json
import os
import threading

import paho.mqtt.client as mqtt

from agent.cli import fleet as fleet_cli
from agent.fleet.plan import request_id
from agent.fleet.report import EXIT_COMPLETED
from tests.conftest import MqttProbe, wait_for
from tests.support.fleet_support import bundles, make_fleet, rollout_args, truth  # noqa: F401 - fixtures
from tests.support.needs import needs_cryptography

ANSWER_S = 60.0  # a bound for a loaded machine; never asserted as a duration


class Attacker:
    """Reads the box's deploy topic and, the moment the operator's signed deploy passes, publishes an unsigned copy
    under the same request id: the box refuses it at once, while the operator's deploy still runs."""

    def __init__(self, broker, topic):
        self.topic = topic
        self.copied = []  # request ids it answered for
        subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="attacker-%s" % os.urandom(3).hex())
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, 1)
        self.client.on_subscribe = lambda c, u, mid, codes, p: subscribed.set()
        self.client.on_message = self._copy
        self.client.connect(broker.host, broker.port, keepalive=10)
        self.client.loop_start()
        assert subscribed.wait(ANSWER_S), "the attacker could not subscribe to %s" % topic

    def send_unsigned(self, fields):
        self.client.publish(self.topic, json.dumps(fields), 1).wait_for_publish(10)

    def _copy(self, client, userdata, message):
        body = json.loads(message.payload)
        if "signature" in body and body["request_id"] not in self.copied:
            self.copied.append(body["request_id"])
            client.publish(self.topic, json.dumps({k: v for k, v in body.items() if k != "signature"}), 1)

    def close(self):
        self.client.loop_stop()
        self.client.disconnect()


@needs_cryptography
def test_an_unsigned_refusal_under_the_rollouts_request_id_is_not_taken_as_the_boxs_answer(
        make_fleet, mosquitto, bundles, tmp_path, capsys):
    from agent.cli.bundle import make_key_pair

    private_pem, _public_pem, public_hex = make_key_pair()
    key_file = tmp_path / "operator.pem"
    key_file.write_bytes(private_pem)
    fleet = make_fleet(1, commands={"public_key": public_hex})
    device = fleet.boxes[0].device_id
    rid = request_id("ro-forged", device, "deploy")  # what anyone can compute from the rollout's inputs
    ack_topic = "%s/%s/ack/%s" % (fleet.prefix, device, rid)
    acks = MqttProbe(mosquitto, [ack_topic])
    attacker = Attacker(mosquitto, "%s/%s/cmd/deploy" % (fleet.prefix, device))
    try:
        # Sent first: the box refuses it without recording it.
        # Sent again until answered: a box still subscribing (a loaded machine) never saw the first copy, and a
        # refusal is not recorded, so each copy is refused alike.
        for _ in range(int(ANSWER_S // 5)):
            attacker.send_unsigned({"request_id": rid, "bundle": bundles["url"], "sha256": bundles["sha"]})
            if wait_for(lambda: acks.on(ack_topic), timeout=5):
                break
        assert acks.on(ack_topic), "the box never refused the unsigned deploy"
        refusals = len(acks.on(ack_topic))
        assert [(a["state"], a["error"]["code"]) for a in acks.on(ack_topic)] == [("failed", "unsigned")] * refusals
        code = fleet_cli.main(rollout_args(mosquitto, fleet, bundles, tmp_path, "--rollout-id", "ro-forged",
                                           "--canary", "0", "--waves", "1", "--command-key", str(key_file)))
        captured = capsys.readouterr()
        report = json.loads(captured.out)
    finally:
        attacker.close()
        answers = [(a["state"], (a.get("error") or {}).get("code")) for a in acks.on(ack_topic)]
        acks.close()
    # The race happened: the copy's refusal reached the operator (subscribed since before its deploy) ahead of
    # the box's real final answer.
    assert attacker.copied == [rid]
    assert answers.index(("failed", "unsigned"), refusals) < answers.index(("succeeded", None)), answers
    assert code == EXIT_COMPLETED and report["counts"] == {"confirmed": 1}, captured.err
    assert fleet.deploys() == {device: 1}
    assert truth(fleet)[device]["version"] == "2.0.0" and truth(fleet)[device]["state"] == "confirmed"
    [box] = report["boxes"]
    assert any("forged answer" in a and "unsigned" in a for a in box["anomalies"]), box
    assert captured.err.count("ignored a forged answer") == 1, captured.err
