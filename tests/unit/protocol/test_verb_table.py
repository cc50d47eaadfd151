"""The verb table (agent/protocol/verbs.py) is the one home of a verb: adding one is an entry there plus its
handler method, and the dispatcher, the handlers' registration, `validate` (commands.group_verbs) and
`ctl --help` all know it. A misspelt group verb fails `validate` naming the field, and `run` exits 78."""

import json
import subprocess
import sys

import pytest
import yaml

from agent.cli.main import EXIT_CANNOT_START
from agent.cli.main import main as atlas_edge
from agent.commands.dispatcher import CommandDispatcher, handlers_of
from agent.commands.handlers import CommandHandlers
from agent.config.mqtt_config import MqttConfig
from agent.config.schema import ConfigError
from agent.ops.outbox import Outbox
from agent.ops.transport import MqttTransport
from agent.protocol.requests import NoFields
from agent.protocol.verbs import VERB_TABLE, Verb, check_group_verbs, control_verbs, default_group_verbs, verb_names
from tests.conftest import wait_for
from tests.support.daemon_rig import write_config

PING = Verb("ping", NoFields, "ping", "answer pong (a verb a test adds)", control=True, group_safe=True)
DEVICE = "verb-box"


class PingHandlers(CommandHandlers):
    """The daemon's handlers plus the dummy verb's method: the only code a new verb needs beside its entry."""

    def ping(self, request: NoFields, progress) -> dict:
        progress("ponging")
        return {"pong": True}


@pytest.fixture
def ping_verb(monkeypatch):
    monkeypatch.setitem(VERB_TABLE, PING.name, PING)
    return PING


def _handlers(cls=PingHandlers) -> CommandHandlers:
    """The daemon's handler class without its parts (serving loop, model manager...): only ``ping`` runs here,
    and registration reads nothing but the class's methods."""
    return cls.__new__(cls)


def test_a_verb_added_to_the_table_is_routed_by_the_dispatcher(ping_verb, tmp_path, mosquitto, probe_factory):
    handlers = _handlers()
    table = handlers.table()
    assert list(table) == list(verb_names()) and table["ping"] == handlers.ping
    assert "ping" in control_verbs() and "ping" in default_group_verbs()
    transport = MqttTransport(MqttConfig(host=mosquitto.host, port=mosquitto.port, groups=["site"]), DEVICE,
                              Outbox(str(tmp_path / "outbox.sqlite"), 1 << 20))
    dispatcher = CommandDispatcher(transport, table)  # group_verbs unset: the table's group-safe verbs
    transport.set_message_handler(dispatcher.submit)
    operator = probe_factory(mosquitto, ["atlas-edge/%s/ack/#" % DEVICE])
    dispatcher.start()
    transport.start()
    try:
        assert wait_for(lambda: transport.stats()["acked"] >= 1)  # subscribed: its online status was acked

        def final(request_id):
            assert wait_for(lambda: any(a["state"] in ("succeeded", "failed") for a in operator.on(
                "atlas-edge/%s/ack/%s" % (DEVICE, request_id))))
            return operator.on("atlas-edge/%s/ack/%s" % (DEVICE, request_id))

        operator.publish("atlas-edge/%s/cmd/ping" % DEVICE, json.dumps({"request_id": "p-1"}).encode())
        operator.publish("atlas-edge/group/site/cmd/ping", json.dumps({"request_id": "p-2"}).encode())
        operator.publish("atlas-edge/%s/cmd/pong" % DEVICE, json.dumps({"request_id": "p-3"}).encode())
        for request_id in ("p-1", "p-2"):
            acks = final(request_id)
            assert [a["state"] for a in acks] == ["accepted", "in_progress", "in_progress", "succeeded"], acks
            assert acks[2]["message"] == "ponging" and acks[-1]["result"] == {"pong": True}
        [unknown] = [a for a in final("p-3") if a["state"] == "failed"]
        assert unknown["error"]["code"] == "unknown_verb" and "ping" in unknown["error"]["message"]
    finally:
        dispatcher.stop(5.0)
        transport.stop(5.0)
        dispatcher.close()


def test_a_handler_object_without_a_verbs_method_is_refused_naming_it(ping_verb):
    with pytest.raises(TypeError, match="no handler for ping .*names ping"):
        handlers_of(_handlers(CommandHandlers))


def _config(tmp_path, mosquitto, group_verbs):
    frames = tmp_path / "frames"
    frames.mkdir(exist_ok=True)
    return write_config(tmp_path, mosquitto, frames, commands={"group_verbs": group_verbs})


def test_validate_takes_a_verb_of_the_table_in_group_verbs(ping_verb, tmp_path, mosquitto, capsys):
    assert atlas_edge(["validate", _config(tmp_path, mosquitto, ["status", "ping"])]) == 0
    assert "valid daemon config" in capsys.readouterr().out


def test_validate_refuses_a_misspelt_group_verb_naming_the_field(tmp_path, mosquitto, capsys):
    assert atlas_edge(["validate", _config(tmp_path, mosquitto, ["status", "stauts"])]) == 1
    captured = capsys.readouterr()
    assert "valid" not in captured.out
    assert "commands.group_verbs[1]: unknown verb 'stauts'" in captured.err
    assert check_group_verbs(None) == ("status", "pause", "resume", "cancel")  # unset: the table's default
    with pytest.raises(ConfigError):
        check_group_verbs(["ping"])  # not in the table (this test does not add it)


def test_run_with_a_misspelt_group_verb_exits_78_naming_the_field(tmp_path, mosquitto):
    """systemd's RestartPreventExitStatus=78: a config error is not restarted in a loop (it was exit 1 and a
    ValueError traceback)."""
    path = _config(tmp_path, mosquitto, ["stauts"])
    assert yaml.safe_load(open(path))["commands"] == {"group_verbs": ["stauts"]}
    proc = subprocess.run([sys.executable, "-m", "agent", "run", "--config", path], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == EXIT_CANNOT_START, proc.stderr[-2000:]
    assert "commands.group_verbs[0]: unknown verb 'stauts'" in proc.stderr and "Traceback" not in proc.stderr


def test_ctl_help_lists_every_verb_of_the_table(ping_verb, capsys):
    with pytest.raises(SystemExit) as exit_:
        atlas_edge(["ctl", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for verb in VERB_TABLE.values():
        assert any(line.split()[:1] == [verb.name] and verb.help in line for line in out.splitlines()), verb.name
