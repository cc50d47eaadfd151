"""``atlas-edge ctl`` against a running dispatcher on a real Mosquitto: exit codes, printed acks, retries."""

import argparse
import io
import json
import os
import subprocess
import sys
import uuid
from typing import Any, Dict, List, Tuple

import pytest
from conftest import REPO_ROOT, WAIT_S, MqttProbe, wait_for

from agent.cli import ctl
from agent.commands.dispatcher import CommandDispatcher
from agent.config.mqtt_config import MqttConfig
from agent.devtools.broker import free_port
from agent.errors import CommandError
from agent.ops.outbox import Outbox
from agent.ops.transport import MqttTransport
from agent.protocol.verbs import command_payload, parse_request

DEVICE = "ctl-box"
SHA = "ab" * 32


@pytest.fixture(scope="module")
def box(mosquitto, tmp_path_factory):
    """A device serving three verbs, in group ``line-1``; ``calls`` counts handler runs."""
    calls: Dict[str, int] = {"status": 0, "pause": 0, "deploy": 0}

    def status(request: Any, progress) -> Dict[str, Any]:
        calls["status"] += 1
        return {"state": "serving"}

    def pause(request: Any, progress) -> Dict[str, Any]:
        calls["pause"] += 1
        raise CommandError("not_allowed", "cannot pause during a deploy", field="state")

    def deploy(request: Any, progress) -> Dict[str, Any]:
        calls["deploy"] += 1
        return {"slot": "b"}

    config = MqttConfig(host=mosquitto.host, port=mosquitto.port, groups=["line-1"])
    outbox = Outbox(str(tmp_path_factory.mktemp("ctl") / "outbox.sqlite"), 1 << 20)
    transport = MqttTransport(config, DEVICE, outbox)
    dispatcher = CommandDispatcher(transport, {"status": status, "pause": pause, "deploy": deploy})
    transport.set_message_handler(dispatcher.submit)
    dispatcher.start()
    transport.start()
    assert wait_for(lambda: transport.stats()["acked"] >= 1)  # subscribed (see test_commands)
    yield calls
    dispatcher.stop(5.0)
    transport.stop(5.0)
    dispatcher.close()


def run_ctl(argv: List[str]) -> Tuple[int, List[Dict[str, Any]], str]:
    parser = argparse.ArgumentParser()
    ctl.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = ctl.run(parser.parse_args(argv), out=out, err=err)
    acks = [json.loads(line) for line in out.getvalue().splitlines()]
    return code, acks, err.getvalue()


def test_success_exits_zero_and_prints_every_ack(mosquitto, box):
    code, acks, err = run_ctl(["--broker", mosquitto.url, DEVICE, "status"])
    assert code == ctl.EXIT_OK, err
    assert [a["state"] for a in acks] == ["accepted", "in_progress", "succeeded"]
    assert acks[-1]["result"] == {"state": "serving"}
    assert acks[0]["request_id"].startswith("ctl-")


def test_failure_exits_one_and_prints_the_structured_error(mosquitto, box):
    code, acks, err = run_ctl(["--broker", mosquitto.url, DEVICE, "pause"])
    assert code == ctl.EXIT_FAILED
    assert acks[-1]["state"] == "failed"
    assert "failed: not_allowed (field state): cannot pause during a deploy" in err


@pytest.mark.parametrize("payload, named", [
    ('{"bundel": "x", "sha256": "%s"}' % SHA, ["bundel: unknown key", "bundle: required"]),
    ('{"bundle": 1}', ["bundle: expected a string, got 1", "sha256: required"]),
])
def test_fields_the_verb_refuses_fail_here_and_nothing_is_sent(mosquitto, box, payload, named):
    # the parse the box runs (agent.protocol.verbs.parse_request), on the operator's machine: exit 2, every bad
    # field named, and nothing reaches the broker (a subscriber on every command topic of every prefix records what
    # the broker passed on; not '#', whose retained backlog of the session's other tests can fill the broker's queue
    # for this client and drop the marker, as a clean-clone run showed)
    probe = MqttProbe(mosquitto, ["+/+/cmd/#", "+/group/+/cmd/#", "ctl-test/marker/#"])
    try:
        deploys = box["deploy"]
        code, acks, err = run_ctl(["--broker", mosquitto.url, DEVICE, "deploy", "--json", payload])
        assert code == ctl.EXIT_USAGE and acks == [], err
        assert all(text in err for text in named), err
        marker = "ctl-test/marker/%s" % uuid.uuid4().hex  # published after ctl returned: it arrives after
        probe.publish(marker, b"after ctl")               # anything ctl could have sent
        assert wait_for(lambda: any(topic == marker for topic, *_ in probe.messages))
        assert [topic for topic, *_ in probe.messages if "cmd" in topic.split("/")] == []
        assert box["deploy"] == deploys
    finally:
        probe.close()


def test_a_command_is_sent_as_the_protocol_builds_it(mosquitto, box):
    probe = MqttProbe(mosquitto, ["atlas-edge/%s/cmd/#" % DEVICE])
    try:
        code, acks, err = run_ctl(["--broker", mosquitto.url, DEVICE, "deploy", "--json",
                                   '{"bundle": "m-1.2", "sha256": "%s", "request_id": "ignored"}' % SHA])
        assert code == ctl.EXIT_OK, err
        request_id = acks[0]["request_id"]
        # the box's ack can reach ctl before the broker's copy of the command reaches this probe
        assert wait_for(lambda: probe.on("atlas-edge/%s/cmd/deploy" % DEVICE))
        sent = probe.on("atlas-edge/%s/cmd/deploy" % DEVICE)
        request = parse_request("deploy", {"bundle": "m-1.2", "sha256": SHA})
        assert sent == [command_payload("deploy", request, request_id)]
    finally:
        probe.close()


def test_unknown_to_the_device_fails_fast(mosquitto, box):
    code, acks, err = run_ctl(["--broker", mosquitto.url, DEVICE, "snapshot"])
    assert code == ctl.EXIT_FAILED and acks[-1]["error"]["code"] == "unknown_verb"


def test_retry_with_the_same_request_id_does_not_run_twice(mosquitto, box):
    before = box["status"]
    first = run_ctl(["--broker", mosquitto.url, DEVICE, "status", "--request-id", "ctl-retry-1"])
    second = run_ctl(["--broker", mosquitto.url, DEVICE, "status", "--request-id", "ctl-retry-1"])
    assert first[0] == second[0] == ctl.EXIT_OK
    assert second[1] == [dict(first[1][-1], replayed=True)]
    assert box["status"] == before + 1


def test_group_command_waits_for_the_named_device(mosquitto, box):
    code, acks, err = run_ctl(["--broker", mosquitto.url, "--group", "line-1", DEVICE, "status"])
    assert code == ctl.EXIT_OK, err
    assert acks[-1]["state"] == "succeeded"


def test_no_answer_times_out(mosquitto, box):
    code, acks, err = run_ctl(["--broker", mosquitto.url, "no-such-box", "status", "--timeout", "0.5"])
    assert code == ctl.EXIT_TIMEOUT and acks == []
    assert "no final ack from no-such-box" in err and "is the device online?" in err


@pytest.mark.parametrize("argv, message", [
    (["--json", "{bad"], "--json is not valid JSON"),
    (["--json", "[1, 2]"], "--json must be a JSON object"),
    (["--broker", "http://x:1"], "--broker must look like"),
    (["--request-id", "a/b"], "--request-id must be"),
    (["--group", "a+b"], "--group must not contain '+': an MQTT wildcard"),
    (["--group", "site.b"], "--group must not contain '.': RabbitMQ's topic-level separator"),
    (["--broker", "mqtt://x:99999"], "--broker must look like"),
])
def test_bad_arguments_exit_two_before_connecting(argv, message):
    code, acks, err = run_ctl(argv + [DEVICE, "status"])
    assert code == ctl.EXIT_USAGE and message in err and acks == []


def test_unreachable_broker_exits_four():
    dead = ["127.0.0.1:%d" % free_port() for _ in range(2)]
    code, acks, err = run_ctl(["--broker", "mqtt://" + dead[0], "--broker", "mqtt://" + dead[1], DEVICE, "status"])
    assert code == ctl.EXIT_BROKER and "cannot connect" in err
    assert dead[0] in err and dead[1] in err  # each broker tried, each named


def test_brokers_are_tried_in_turn(mosquitto, box):
    dead = "mqtt://127.0.0.1:%d" % free_port()
    code, acks, err = run_ctl(["--broker", dead, "--broker", mosquitto.url, DEVICE, "status"])
    assert code == ctl.EXIT_OK, err
    assert acks[-1]["state"] == "succeeded"


def test_a_device_id_with_a_dot_is_refused_naming_the_character():
    code, acks, err = run_ctl(["cam.04", "status"])
    assert code == ctl.EXIT_USAGE and "DEVICE must not contain '.'" in err and acks == []


def test_module_entry_point(mosquitto, box):
    done = subprocess.run([sys.executable, "-m", "agent.cli.ctl", "--broker", mosquitto.url, DEVICE, "status"],
                          capture_output=True, text=True, timeout=WAIT_S, cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["state"] == "succeeded"
