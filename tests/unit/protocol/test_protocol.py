"""The protocol module: one request type per verb refused as ``invalid`` naming the field, through the real
dispatcher and the daemon's real handlers; non-finite numbers refused schema-wide; topics built and read in one
place; the operator's typed readers for statuses and acks."""

import dataclasses
import json
import math
import sys
import threading
import typing
from typing import Any, Dict, List, Optional

import pytest
from conftest import WAIT_S

from agent._util.compat import get_args, get_origin
from agent.commands.dispatcher import CommandDispatcher
from agent.commands.handlers import CommandHandlers
from agent.config.daemon_config import LIVE_SECTIONS, DaemonConfig, parse_daemon_config
from agent.config.overrides import Overrides
from agent.config.schema import ConfigError, describe, parse, setting
from agent.fleet.link import Message
from agent.pipeline.handover import BetweenBatches
from agent.protocol import topics
from agent.protocol.envelope import group_target
from agent.protocol.events import SLOT_EVENTS, Event, event_message, event_of
from agent.protocol.messages import JSON_DEPTH_MAX, ProtocolError, decode_json, parse_ack
from agent.protocol.status import parse_status
from agent.protocol.verbs import parse_request, request_types, verb_names

VERBS = verb_names()
REQUESTS = request_types()

DEVICE = "proto-box"
SHA = "ab" * 32
# The smallest valid payload of each verb: every bad case below changes exactly one thing in it.
VALID = {
    "status": {}, "pause": {}, "resume": {}, "snapshot": {}, "restart": {}, "cancel": {},
    "validate": {"config": {"thresholds": {"conf": 0.5}}},
    "set-config": {"config": {"thresholds": {"conf": 0.5}}},
    "deploy": {"bundle": "incoming/m-2", "sha256": SHA},
    "rollback": {"reason": "canary too slow"},
    "shadow": {"bundle": "incoming/m-2", "sha256": SHA, "sample": 0.5, "frames": 50, "max_s": 30.0},
    "shadow-stop": {"discard": True},
}
WRONG_TYPE = {str: 7, dict: [1, 2], float: "fast", int: "many", bool: "yes"}


class AckRecorder:
    """The dispatcher's transport side (an :class:`AckPublisher`), keeping every ack in order."""

    prefix = "atlas-edge"
    device_id = DEVICE
    groups = ()

    def __init__(self) -> None:
        self.acks: List[Dict[str, Any]] = []
        self.done = threading.Condition()

    def publish_ack(self, request_id: str, payload: Dict[str, Any]) -> str:
        json.dumps(payload, allow_nan=False)  # every ack is strict JSON: NaN never travels back
        with self.done:
            self.acks.append(payload)
            self.done.notify_all()
        return "sent"

    def final(self, request_id: str) -> Dict[str, Any]:
        with self.done:
            assert self.done.wait_for(lambda: any(a["request_id"] == request_id and a["state"] in (
                "succeeded", "failed") for a in self.acks), WAIT_S), "no final ack for %s" % request_id
            return [a for a in self.acks if a["request_id"] == request_id][-1]


class MustNotRun:
    """The model manager's place: no refused command may reach a deploy or a rollback."""

    def deploy(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a refused deploy reached the model manager")

    def rollback(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a refused rollback reached the model manager")


@pytest.fixture
def box(tmp_path):
    """The real dispatcher over the daemon's real handlers (serving parts absent: no valid command runs)."""
    config = parse_daemon_config({"device_id": DEVICE, "state_dir": str(tmp_path / "state"),
                                  "model": {"bundle": "examples/demo-bundle"}})
    applied: List[DaemonConfig] = []
    handlers = CommandHandlers(None, MustNotRun(), None, BetweenBatches(), get_config=lambda: config,
                               apply_config=applied.append, request_restart=lambda why: None,
                               status=dict,
                               overrides=Overrides(str(tmp_path / "overrides.json")))
    recorder = AckRecorder()
    dispatcher = CommandDispatcher(recorder, handlers.table()).start()
    yield dispatcher, recorder, applied
    dispatcher.stop(5.0)
    dispatcher.close()


def _send(dispatcher: CommandDispatcher, recorder: AckRecorder, verb: str, payload: Dict[str, Any],
          request_id: str) -> Dict[str, Any]:
    data = json.dumps(dict(payload, request_id=request_id)).encode()  # NaN goes out as the JSON token NaN
    dispatcher.submit(topics.command_topic(recorder.prefix, verb, device=DEVICE), data)
    return recorder.final(request_id)


def _fields(verb: str) -> List[dataclasses.Field]:
    return list(dataclasses.fields(REQUESTS[verb]))


def _bad_cases() -> List[Any]:
    """(verb, what, payload, field the ack must name) for each verb: an unknown key, each field's wrong type,
    NaN/Infinity in each number the verb takes: the envelope's issued_at and ttl_s (every verb), and for
    set-config and validate every number of the live sections."""
    cases = []
    for verb in VERBS:
        cases.append(pytest.param(verb, dict(VALID[verb], colour="red"), "colour", id="%s-unknown-key" % verb))
        for name in ("issued_at", "ttl_s"):
            for value, label in ((math.nan, "nan"), (math.inf, "inf")):
                dated = dict(VALID[verb], issued_at=1.7e9, ttl_s=60.0)
                dated[name] = value
                cases.append(pytest.param(verb, dated, name, id="%s-%s-%s" % (verb, name, label)))
        for f in _fields(verb):
            hint = typing.get_type_hints(REQUESTS[verb])[f.name]
            base = next(t for t in (str, dict, float, int, bool) if t in (hint, get_origin(hint))
                        or t in get_args(hint))
            bad = dict(VALID[verb], **{f.name: WRONG_TYPE[base]})
            cases.append(pytest.param(verb, bad, f.name, id="%s-%s-wrong-type" % (verb, f.name)))
    config_types = typing.get_type_hints(DaemonConfig)
    for verb in ("validate", "set-config"):
        for section in LIVE_SECTIONS:
            hints = typing.get_type_hints(config_types[section]) if dataclasses.is_dataclass(
                config_types[section]) else {}
            for name, hint in hints.items():
                if float in (hint,) + get_args(hint):
                    for value, label in ((math.nan, "nan"), (math.inf, "inf")):
                        payload = {"config": {section: {name: value}}}
                        cases.append(pytest.param(verb, payload, "%s.%s" % (section, name),
                                                  id="%s-%s.%s-%s" % (verb, section, name, label)))
    return cases


@pytest.mark.parametrize("verb, payload, field", _bad_cases())
def test_a_bad_payload_fails_invalid_naming_the_field_and_changes_nothing(box, verb, payload, field):
    dispatcher, recorder, applied = box
    final = _send(dispatcher, recorder, verb, payload, "bad-1")
    error = final["error"]
    assert (final["state"], error["code"]) == ("failed", "invalid"), final
    assert field == error["field"] or field in [e["field"] for e in error.get("errors") or []], error
    assert applied == [] and dispatcher.stats()["failed"] == {"invalid": 1}


@pytest.mark.parametrize("field, value", [("sample", 0.0), ("sample", 1.5), ("sample", -0.1), ("frames", 0),
                                          ("max_s", 0.0), ("max_s", 1e9), ("sha256", "abc")])
def test_a_shadow_request_out_of_range_fails_invalid_naming_the_field(box, field, value):
    dispatcher, recorder, applied = box
    final = _send(dispatcher, recorder, "shadow", dict(VALID["shadow"], **{field: value}), "sh-1")
    error = final["error"]
    assert (final["state"], error["code"]) == ("failed", "invalid"), final
    assert field == error["field"] or field in [e["field"] for e in error.get("errors") or []], error


def test_every_verb_has_a_request_type_and_bad_cases():
    assert tuple(REQUESTS) == VERBS and len(set(VERBS)) == len(VERBS)
    covered = {case.values[0] for case in _bad_cases()}
    assert covered == set(VERBS)
    nan_fields = {case.values[2] for case in _bad_cases() if case.id.endswith("-nan")}
    assert {"thresholds.conf", "thresholds.iou", "batching.max_wait_ms", "publish.max_rate_hz"} <= nan_fields
    for verb in VERBS:  # every verb takes numbers: the envelope's issued_at and ttl_s
        assert {"issued_at", "ttl_s"} <= {c.values[2] for c in _bad_cases() if c.values[0] == verb
                                          and c.id.endswith("-nan")}, verb


def test_set_config_without_its_config_key_is_refused_naming_the_key(box):
    """The old bug: ``{"thresholds": {...}}`` beside no ``config`` acked succeeded with ``applied: []``."""
    dispatcher, recorder, applied = box
    final = _send(dispatcher, recorder, "set-config", {"thresholds": {"conf": 0.5}}, "sc-1")
    assert final["state"] == "failed" and final["error"]["code"] == "invalid"
    assert {e["field"] for e in final["error"]["errors"]} == {"thresholds", "config"}
    assert applied == [] and "accepted" not in [a["state"] for a in recorder.acks]


def test_a_valid_validate_runs_the_real_handler(box):
    dispatcher, recorder, _ = box
    final = _send(dispatcher, recorder, "validate", VALID["validate"], "ok-1")
    assert final["state"] == "succeeded" and final["result"]["config"]["thresholds"]["conf"] == 0.5


@dataclasses.dataclass(frozen=True)
class Numbers:
    ratio: float = setting(0.5, ge=0, le=1)
    optional: Optional[float] = None
    many: List[float] = setting(factory=list)


@pytest.mark.parametrize("data, field", [
    ({"ratio": math.nan}, "ratio"), ({"ratio": math.inf}, "ratio"), ({"ratio": -math.inf}, "ratio"),
    ({"optional": math.nan}, "optional"), ({"many": [1.0, math.nan]}, "many[1]"), ({"ratio": 10**400}, "ratio"),
])
def test_the_schema_engine_refuses_non_finite_numbers_everywhere(data, field):
    with pytest.raises(ConfigError) as info:
        parse(Numbers, data)
    assert [e["field"] for e in info.value.as_list()] == [field]
    assert "finite" in str(info.value)


def test_every_float_setting_of_the_daemon_config_refuses_nan():
    """Schema-wide: each float field in the daemon config, set to NaN alone, is refused naming it."""
    floats = [path for path, _, _ in describe(DaemonConfig)
              if _is_float(DaemonConfig, path)]
    assert len(floats) >= 10
    for path in floats:
        data: Dict[str, Any] = {"device_id": "x", "model": {"bundle": "b"}}
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = math.nan
        with pytest.raises(ConfigError) as info:
            parse_daemon_config(data)
        assert path in [e["field"] for e in info.value.as_list()], path


def _is_float(cls: Any, path: str) -> bool:
    hint: Any = cls
    for part in path.split("."):
        hint = typing.get_type_hints(hint)[part]
        args = [a for a in get_args(hint) if a is not type(None)]
        hint = args[0] if get_origin(hint) is typing.Union and len(args) == 1 else hint
    return hint is float


def test_request_types_parse_what_handlers_need():
    assert parse_request("deploy", {"request_id": "r", "bundle": "b", "sha256": SHA}).bundle == "b"
    assert parse_request("rollback", {}).reason is None
    with pytest.raises(ConfigError, match="reason: must have at least 1"):
        parse_request("rollback", {"reason": ""})
    with pytest.raises(ConfigError, match=r"colour: unknown key \(known: none\)"):
        parse_request("pause", {"colour": "red"})


# -- topics ---------------------------------------------------------------------------------------------------

def test_topics_are_built_and_read_back_in_one_place():
    assert topics.command_topic("p/q", "deploy", device="cam-1") == "p/q/cam-1/cmd/deploy"
    assert topics.command_topic("p", "pause", group="line-1") == "p/group/line-1/cmd/pause"
    assert topics.ack_topic("p", "cam-1", "r-1") == "p/cam-1/ack/r-1"
    assert topics.command_subscriptions("p", "cam-1", ["g"]) == ["p/cam-1/cmd/#", "p/group/g/cmd/#", "p/announce"]
    assert topics.fleet_subscriptions("p", status_only=True) == ["p/+/status"]
    assert topics.split_device_topic("p/q", "p/q/cam-1/telemetry/alert") == ("cam-1", ("telemetry", "alert"))
    assert topics.split_device_topic("p", "p/group/g/cmd/x") is None
    assert topics.split_device_topic("p", "other/cam-1/status") is None
    assert topics.command_verb("p", "cam-1", ["g"], "p/group/g/cmd/status") == "status"
    assert topics.command_verb("p", "cam-1", ["g"], "p/group/h/cmd/status") is None
    assert topics.command_verb("p", "cam-1", [], "p/cam-1/cmd/a/b") is None
    with pytest.raises(ValueError, match="names a device or a group"):
        topics.command_topic("p", "status")


def test_every_topic_the_box_publishes_has_its_builder():
    assert topics.status_topic("p/q", "cam-1") == "p/q/cam-1/status"
    assert topics.result_topic("p/q", "cam-1", "front") == "p/q/cam-1/results/front"
    assert topics.telemetry_topic("p", "cam-1") == "p/cam-1/telemetry"
    assert topics.alert_topic("p", "cam-1") == "p/cam-1/telemetry/alert"
    assert topics.events_topic("p", "cam-1") == "p/cam-1/events"
    assert topics.snapshot_topic("p", "cam-1", "front") == "p/cam-1/snapshot/front"
    assert topics.fleet_subscriptions("p") == ["p/+/status", "p/+/telemetry", "p/+/telemetry/alert", "p/+/shadow"]
    assert topics.HA_STATUS_TOPIC == "homeassistant/status"
    assert topics.ha_config_topic("cam-1", "fps") == "homeassistant/sensor/atlas-edge-cam-1/fps/config"


@pytest.mark.parametrize("topic, command", [
    ("p/q/cam-1/cmd/deploy", topics.CommandTopic("deploy")),
    ("p/q/group/g/cmd/pause", topics.CommandTopic("pause", "g")),
    ("p/q/group/g/cmd/announce", topics.CommandTopic("announce", "g")),
    ("p/q/announce", topics.CommandTopic("announce")),
    ("p/q/group/h/cmd/pause", None),  # a group this box is not in
    ("p/q/cam-2/cmd/pause", None),  # another box
    ("p/q/cam-1/cmd/", None), ("p/q/cam-1/cmd/a/b", None), ("p/q/cam-1/cmd", None),
    ("p/q/group/g/cmd/a/b", None), ("p/q/group/g/pause", None), ("x/q/cam-1/cmd/pause", None),
    ("p/cam-1/cmd/pause", None),  # another prefix
])
def test_a_command_topic_is_read_back_in_one_place(topic, command):
    assert topics.read_command_topic("p/q", "cam-1", ["g"], topic) == command
    assert topics.command_verb("p/q", "cam-1", ["g"], topic) == (command.verb if command else None)


def test_a_command_names_the_target_its_signature_covers():
    assert topics.CommandTopic("pause").target("cam-1") == "cam-1"
    assert topics.CommandTopic("pause", "line-1").target("cam-1") == group_target("line-1") == "group/line-1"


def test_event_names_are_one_enum_and_the_wire_keeps_plain_strings():
    message = event_message(Event.SWITCHED, slot="b")
    assert json.dumps(message) == '{"event": "switched", "slot": "b"}' and type(message["event"]) is str
    assert message["event"] == Event.SWITCHED and "%s" % Event.ROLLBACK == "rollback" == str(Event.ROLLBACK)
    assert event_of({"event": "confirmed"}) is Event.CONFIRMED and event_of({"event": "new-kind"}) is None
    assert set(SLOT_EVENTS) == {Event.SWITCHED, Event.CONFIRMED, Event.ROLLBACK}
    with pytest.raises(TypeError):
        event_message("switched")  # type: ignore[arg-type]


@pytest.mark.parametrize("value, levels, ok", [
    ("cam-1", False, True), ("a/b", False, False), ("a/b", True, True), ("/a", True, False), ("a//b", True, False),
    ("a+b", False, False), ("a#", True, False), ("", False, False), ("a\x00", False, False), (7, False, False),
])
def test_the_one_topic_name_rule(value, levels, ok):
    assert (topics.name_problem(value, levels=levels) is None) == ok


# -- what the operator reads ----------------------------------------------------------------------------------

def test_status_and_ack_parse_into_types_and_ignore_newer_fields():
    status = parse_status({"state": "online", "device": "cam-1", "ts": 1, "groups": ["g"], "model": "m 1",
                           "slots": {"serving": "a", "slots": {"a": {"state": "confirmed", "new": 1}, "b": None}},
                           "added_by_a_newer_box": True})
    assert status.online and status.ts == 1.0 and status.slots.slots["a"].state == "confirmed"
    ack = parse_ack({"request_id": "r-1", "verb": "deploy", "state": "failed", "ts": 2.0,
                     "error": {"code": "invalid", "field": "bundle", "message": "m",
                               "errors": [{"field": "bundle", "message": "m"}]}})
    assert ack.final and ack.error.code == "invalid" and ack.error_text() == "invalid: m"


@pytest.mark.parametrize("reader, body, field", [
    (parse_status, {"state": "online", "groups": "g"}, "groups"),
    (parse_status, {"state": "online", "slots": {"slots": {"a": "confirmed"}}}, "slots.slots.a"),
    (parse_status, {"device": "cam-1"}, "state"),
    (parse_status, ["online"], ""),
    (parse_ack, {"request_id": "r", "verb": "deploy", "state": "done"}, "state"),
    (parse_ack, {"request_id": "r/x", "verb": "deploy", "state": "accepted"}, "request_id"),
    (parse_ack, {"request_id": "r", "verb": "deploy", "state": "failed"}, "error"),
    (parse_ack, {"request_id": "r", "verb": "deploy", "state": "failed", "error": "boom"}, "error"),
    (parse_ack, {"request_id": "r", "verb": "deploy", "state": "accepted", "ts": math.nan}, "ts"),
])
def test_a_malformed_status_or_ack_is_a_typed_error_naming_the_field(reader, body, field):
    with pytest.raises(ProtocolError) as info:
        reader(body)
    assert info.value.field == field


def _nested(depth: int) -> bytes:
    return ('{"request_id": "d", "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}").encode()


def test_json_nesting_is_bounded_before_parsing_whatever_the_recursion_limit():
    # MindSpore raises the interpreter's recursion limit to 10000 on import: the bound must not follow it.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10000)
    try:
        with pytest.raises(ValueError, match="nested 5000 levels deep"):
            decode_json(_nested(5000))
    finally:
        sys.setrecursionlimit(limit)
    assert decode_json(_nested(JSON_DEPTH_MAX))["request_id"] == "d"
    with pytest.raises(ValueError, match="nested %d levels deep" % (JSON_DEPTH_MAX + 1)):
        decode_json(_nested(JSON_DEPTH_MAX + 1))
    # Brackets inside strings, escaped quotes included, are text, not nesting.
    text = json.dumps({"s": "[" * 100 + '\\" {' * 50})
    assert decode_json(text.encode()) == json.loads(text)
    with pytest.raises(ValueError):
        decode_json(b"\xff{}")


def test_a_box_message_nested_too_deep_reads_as_not_json_not_a_crash():
    deep = ("[" * 5000 + "]" * 5000).encode()
    assert Message("atlas-edge/cam-01/status", deep, True).json() is None
