"""The command protocol end to end through a real Mosquitto: acks, idempotent retries, structured errors,
counted drops, group topics, a bounded persistent record, and a fuzz run of thousands of bad payloads."""

import itertools
import json
import os
import sqlite3
from typing import Any, Dict, List, Optional

import pytest
from conftest import wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent._util import quarantine
from agent.commands.dispatcher import CommandDispatcher
from agent.commands.record import RequestRecord
from agent.protocol.messages import REQUEST_ID_RE
from agent.protocol.verbs import verb_names
from tests.support import commands_support as rig
from tests.support.commands_support import SHA, CommandSystem
from tests.support.outbox_support import read_only_fs

system_factory, system = rig.system_factory, rig.system  # fixtures: a dispatcher and transport on the broker

def states(acks: List[Dict[str, Any]]) -> List[str]:
    return [a["state"] for a in acks]


# -- the happy path ------------------------------------------------------------------------------------------


def test_acks_move_accepted_in_progress_succeeded(system):
    system.send("status", {"request_id": "s-1"})
    final = system.final("s-1")
    acks = system.acks("s-1")
    assert states(acks) == ["accepted", "in_progress", "succeeded"]
    assert all(a["request_id"] == "s-1" and a["verb"] == "status" for a in acks)
    assert all(isinstance(a["ts"], float) for a in acks)
    assert final["result"] == {"state": "serving", "calls": 1}
    assert "error" not in final


def test_progress_reports_and_verb_fields_reach_the_handler(system):
    system.send("deploy", {"request_id": "d-1", "bundle": "incoming/m-2", "sha256": SHA})
    final = system.final("d-1")
    acks = system.acks("d-1")
    assert states(acks) == ["accepted", "in_progress", "in_progress", "in_progress", "succeeded"]
    assert [a.get("message") for a in acks[2:4]] == ["downloading", "verifying"]
    assert final["result"] == {"bundle": "incoming/m-2", "sha256": SHA}


def test_a_retry_is_answered_from_the_record_and_never_runs_twice(system):
    system.send("deploy", {"request_id": "retry-1", "bundle": "incoming/m-3", "sha256": SHA})
    first = system.final("retry-1")
    system.send("deploy", {"request_id": "retry-1", "bundle": "incoming/m-3", "sha256": SHA})
    again = system.final("retry-1", count=2)
    assert system.handlers.calls["deploy"] == 1
    assert again == dict(first, replayed=True)
    assert states(system.acks("retry-1")) == ["accepted", "in_progress", "in_progress", "in_progress",
                                              "succeeded", "succeeded"]
    assert system.dispatcher.stats()["duplicates"] == 1


def test_a_request_id_reused_for_another_verb_is_refused(system):
    system.send("pause", {"request_id": "same"})
    system.final("same")
    system.send("resume", {"request_id": "same"})
    refused = system.final("same", count=2)
    assert refused["verb"] == "resume" and refused["error"]["code"] == "duplicate_request_id"
    assert refused["error"]["field"] == "request_id"
    assert (system.handlers.calls["pause"], system.handlers.calls["resume"]) == (1, 0)


def test_group_commands_reach_members_only(system_factory):
    system = system_factory(groups=("line-1",))
    system.send("status", {"request_id": "g-1"}, group="line-1")
    assert system.final("g-1")["state"] == "succeeded"
    received = system.dispatcher.stats()["received"]
    system.send("status", {"request_id": "g-2"}, group="line-2")  # not a member: not even delivered
    system.send("status", {"request_id": "g-3"})  # a marker: delivered after g-2 would have been
    assert system.final("g-3")["state"] == "succeeded"
    assert system.dispatcher.stats()["received"] == received + 1
    assert system.acks("g-2") == [] and system.handlers.calls["status"] == 2


def test_announce_is_answered_at_once_without_ack_even_behind_a_running_command(system_factory):
    announced = []
    system = system_factory(groups=("line-1",), on_announce=lambda: announced.append(True))
    system.send("restart", {"request_id": "long-1"})  # the worker is held inside this handler
    assert wait_for(lambda: system.dispatcher.stats()["busy"])
    system.operator.publish("atlas-edge/announce", b'{"ts": 1}')  # every box: no request id needed
    assert wait_for(lambda: len(announced) == 1)
    assert system.dispatcher.stats()["busy"]  # answered while the long command still runs
    system.send("announce", b"", group="line-1")  # a group's announce; any payload
    system.send("announce", b"not json")  # the box's own topic
    assert wait_for(lambda: len(announced) == 3)
    system.handlers.release.set()
    assert system.final("long-1")["state"] == "succeeded"
    stats = system.dispatcher.stats()
    assert stats["announced"] == 3 and not stats.get("dropped")
    assert [t for t, _, _, _ in system.operator.messages if "/ack/" in t and "long-1" not in t] == []  # no ack


# -- structured failures -------------------------------------------------------------------------------------


def test_config_error_lists_every_bad_field(system):
    system.send("deploy", {"request_id": "v-1", "bundle": 7, "sha256": "yes", "colour": "red"})
    final = system.final("v-1")
    assert states(system.acks("v-1")) == ["failed"]  # refused at intake: never accepted, never run
    error = final["error"]
    assert error["code"] == "invalid" and error["field"] is None  # several fields: none singled out
    assert sorted(e["field"] for e in error["errors"]) == ["bundle", "colour"]  # sha256's check needs types
    assert "result" not in final and system.handlers.calls["deploy"] == 0


def test_single_bad_field_is_named(system):
    system.send("validate", {"request_id": "v-2"})
    error = system.final("v-2")["error"]
    assert (error["code"], error["field"], error["errors"]) == ("invalid", "config",
                                                                [{"field": "config", "message": "required"}])


def test_command_error_carries_code_and_field(system):
    system.send("set-config", {"request_id": "c-1", "config": {"mqtt": {"port": 1}}})
    error = system.final("c-1")["error"]
    assert error == {"code": "not_live", "field": "mqtt", "message": "mqtt settings need a restart"}


def test_handler_crash_is_internal_logged_and_the_dispatcher_goes_on(system, caplog):
    system.send("snapshot", {"request_id": "x-1"})
    error = system.final("x-1")["error"]
    assert error["code"] == "internal" and "RuntimeError: camera went away" in error["message"]
    assert "Traceback" in caplog.text and "camera went away" in caplog.text
    system.send("status", {"request_id": "x-2"})
    assert system.final("x-2")["state"] == "succeeded"


def test_unknown_verb_fails_naming_the_verb(system):
    system.send("self-destruct", {"request_id": "u-1"})
    final = system.final("u-1")
    assert states(system.acks("u-1")) == ["failed"]
    assert (final["verb"], final["error"]["code"]) == ("self-destruct", "unknown_verb")
    assert final["error"]["field"] == "verb"


def test_unparseable_input_fails_when_an_id_is_recoverable_else_is_dropped_and_counted(system_factory):
    system = system_factory(max_payload_bytes=1024)
    system.send("status", b'{"request_id": "j-1", "broken": ')
    system.send("status", b'{"request_id": "j-2", "pad": "%s"}' % (b"x" * 2000))
    assert system.final("j-1")["error"]["code"] == "bad_json"
    assert system.final("j-2")["error"]["code"] == "too_large"
    for payload in (b"\xff\xfe not utf-8", b"{broken", b'{"pad": "%s"}' % (b"y" * 2000),
                    b"[1, 2]", b'"text"', b"{}", b'{"request_id": 5}', b'{"request_id": "a/b"}',
                    b'{"request_id": "%s"}' % (b"r" * 65), b'{"request_id": ""}', b'{"request_id": null}'):
        system.send("status", payload)
    system.settle(received=13)
    stats = system.dispatcher.stats()
    assert stats["dropped"] == {"bad_json": 2, "too_large": 1, "not_object": 2, "no_request_id": 1,
                                "bad_request_id": 5}
    assert stats["failed"] == {"bad_json": 1, "too_large": 1}
    assert stats["accepted"] == 0 and system.handlers.calls["status"] == 0


def test_rate_limit_fails_the_excess(system_factory):
    system = system_factory(rate_per_s=0.001, burst=2)  # two now, the next in ~17 minutes
    for i in range(5):
        system.send("pause", {"request_id": "rl-%d" % i})
    codes = [system.final("rl-%d" % i).get("error", {}).get("code") for i in range(5)]
    assert codes == [None, None, "rate_limited", "rate_limited", "rate_limited"]
    assert system.handlers.calls["pause"] == 2


def test_a_full_queue_answers_busy_and_runs_nothing_extra(system_factory):
    system = system_factory(queue_size=1)
    system.send("restart", {"request_id": "b-1"})  # runs, blocked in its handler
    assert wait_for(lambda: system.dispatcher.stats()["busy"])
    system.send("restart", {"request_id": "b-2"})  # waits in the queue
    system.send("restart", {"request_id": "b-3"})  # no room
    assert system.final("b-3")["error"]["code"] == "busy"
    system.handlers.release.set()
    assert system.final("b-1")["state"] == system.final("b-2")["state"] == "succeeded"
    assert system.handlers.calls["restart"] == 2


# -- the record ----------------------------------------------------------------------------------------------


def test_the_record_survives_a_restart_and_closes_interrupted_commands(tmp_path, mosquitto, probe_factory):
    record = str(tmp_path / "commands.sqlite")
    first = CommandSystem(mosquitto, tmp_path, probe_factory, record_path=record)
    try:
        first.send("pause", {"request_id": "p-1"})
        done = first.final("p-1")
    finally:
        first.close()
    # What a crash in the middle of a command leaves behind: an entry that never reached a final state.
    crashed = RequestRecord(record, 16)
    crashed.save({"request_id": "p-2", "verb": "restart", "state": "in_progress", "ts": 1.0})
    crashed.close()

    second = CommandSystem(mosquitto, tmp_path, probe_factory, device=first.device, record_path=record)
    try:  # the same box after its restart
        second.send("pause", {"request_id": "p-1"})
        second.send("restart", {"request_id": "p-2"})
        assert second.final("p-1") == dict(done, replayed=True)
        interrupted = second.final("p-2")
        assert interrupted["error"]["code"] == "interrupted"
        assert second.handlers.calls["pause"] == second.handlers.calls["restart"] == 0
    finally:
        second.close()


def test_the_record_keeps_only_the_newest_entries(tmp_path):
    record = RequestRecord(str(tmp_path / "r.sqlite"), size=3)
    for i in range(5):
        record.save({"request_id": "r-%d" % i, "verb": "status", "state": "succeeded", "ts": 0.0})
    assert len(record) == 3
    assert record.get("r-1") is None and record.get("r-4")["state"] == "succeeded"


def _truncated(path) -> None:
    record = RequestRecord(str(path), size=4096)
    for i in range(300):
        record.save({"request_id": "r-%d" % i, "verb": "status", "state": "succeeded", "ts": 0.0,
                     "result": {"pad": "x" * 200}})
    record.close()
    with open(str(path), "r+b") as handle:
        handle.truncate(path.stat().st_size // 2 + 100)


def _random_bytes(path) -> None:
    path.write_bytes(os.urandom(100))


def _wrong_schema(path) -> None:
    with sqlite3.connect(str(path)) as conn:
        conn.execute("CREATE TABLE requests (id INTEGER PRIMARY KEY, note TEXT)")


@pytest.mark.parametrize("damage", [_truncated, _random_bytes, _wrong_schema])
def test_a_damaged_record_is_moved_aside_reported_and_commands_still_run(tmp_path, mosquitto, probe_factory,
                                                                        damage):
    path = tmp_path / "requests.sqlite"
    damage(path)
    before = path.read_bytes()
    alerts: List[Dict[str, Any]] = []
    system = CommandSystem(mosquitto, tmp_path, probe_factory, record_path=str(path), on_alert=alerts.append)
    try:
        assert [a["kind"] for a in alerts] == ["state_file_damaged"]
        aside = alerts[0]["figures"]["moved_to"]
        assert open(aside, "rb").read() == before and "forgotten" in alerts[0]["message"]
        system.send("pause", {"request_id": "after-damage"})
        assert system.final("after-damage")["state"] == "succeeded"
        assert not system.dispatcher.stats()["record_in_memory"]
    finally:
        system.close()


def test_a_full_disk_while_closing_interrupted_commands_is_an_alert_not_an_exit(tmp_path, monkeypatch):
    """Start-up after a stop mid-command with the disk full: the daemon must start (no crash loop)."""
    path = str(tmp_path / "requests.sqlite")
    first = RequestRecord(path, size=100)
    first.save({"request_id": "mid-deploy", "verb": "deploy", "state": "in_progress", "ts": 0})
    first.close()

    def disk_full(self, ack):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(RequestRecord, "save", disk_full)
    record = RequestRecord(path, size=100)
    assert [a["kind"] for a in record.alerts] == ["record_not_written"]
    assert "1 interrupted command(s)" in record.alerts[0]["message"] and "disk is full" in record.alerts[0]["message"]
    assert record.get("mid-deploy")["state"] == "in_progress"  # still open, closed at a later start
    record.close()


def test_a_record_that_cannot_be_moved_aside_lives_in_memory(tmp_path, mosquitto, probe_factory, monkeypatch):
    path = tmp_path / "requests.sqlite"
    path.write_bytes(os.urandom(100))

    monkeypatch.setattr(quarantine.os, "replace", read_only_fs)
    alerts: List[Dict[str, Any]] = []
    system = CommandSystem(mosquitto, tmp_path, probe_factory, record_path=str(path), on_alert=alerts.append)
    try:
        assert [a["kind"] for a in alerts] == ["record_in_memory"]
        system.send("pause", {"request_id": "in-memory"})
        assert system.final("in-memory")["state"] == "succeeded"
        system.send("pause", {"request_id": "in-memory"})  # retries are still answered from the record
        assert system.final("in-memory", count=2)["replayed"] is True
        assert system.handlers.calls["pause"] == 1 and system.dispatcher.stats()["record_in_memory"]
    finally:
        system.close()


def test_unknown_handler_names_are_rejected(system):
    with pytest.raises(ValueError, match="unknown verbs"):
        CommandDispatcher(system.transport, {"status": lambda f, p: {}, "explode": lambda f, p: {}})


# -- fuzzing through the broker ------------------------------------------------------------------------------

FUZZ_MAX_PAYLOAD = 2048
# Batches of 40 to 80 fuzzed commands. The aarch64 lane's emulated box tests run a fifth of them
# (ATLAS_EDGE_FUZZ_BATCHES, printed in its summary): 60 took 147 s there, in a parser that is the same Python on
# both architectures
FUZZ_BATCHES = int(os.environ.get("ATLAS_EDGE_FUZZ_BATCHES", "60"))
_fuzz_ids = itertools.count()
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4)), max_leaves=8)
VERB_TEXT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=24)
ID_SUFFIX = st.from_regex(r"[A-Za-z0-9_.:-]{0,40}", fullmatch=True)


def _rid(suffix: str) -> str:
    return ("f%d-%s" % (next(_fuzz_ids), suffix))[:64]


@st.composite
def fuzz_message(draw) -> Dict[str, Any]:
    """One bad command: its verb, its bytes, and what must come of it (a failed ack code, or a drop)."""
    verb = draw(st.one_of(st.sampled_from(verb_names()), VERB_TEXT))
    kind = draw(st.sampled_from(["binary", "text", "non_object", "no_id", "bad_id", "bad_fields",
                                 "unknown_verb", "oversize", "oversize_no_id", "broken_json"]))
    expect: Optional[str] = None  # a failed ack with this code; None = dropped and counted
    rid = None
    if kind == "binary":
        data = draw(st.binary(max_size=300))
    elif kind == "text":
        data = draw(st.text(max_size=200)).encode("utf-8")
    elif kind == "non_object":
        data = json.dumps(draw(st.one_of(JSON_SCALARS, st.lists(JSON_VALUES, max_size=5)))).encode()
    elif kind == "no_id":
        fields = draw(st.dictionaries(st.text(max_size=10).filter(lambda k: k != "request_id"), JSON_VALUES,
                                      max_size=5))
        data = json.dumps(fields).encode()
    elif kind == "bad_id":
        bad = draw(st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=3),
                             st.text(alphabet="abc/+# \n\u00e9", min_size=1, max_size=10),
                             st.text(alphabet="abc", min_size=65, max_size=90)))
        if isinstance(bad, str) and REQUEST_ID_RE.match(bad):
            bad = bad + "/"
        data = json.dumps({"request_id": bad, "x": 1}).encode()
    elif kind == "bad_fields":
        verb = draw(st.sampled_from(verb_names()))
        # no key any request type knows, so every one of these fails its verb's schema at intake
        known = ("request_id", "config", "bundle", "sha256", "reason")
        keys = st.text(min_size=1, max_size=10).filter(lambda k: k not in known)
        fields = draw(st.dictionaries(keys, JSON_VALUES, min_size=1, max_size=5))
        rid = _rid(draw(ID_SUFFIX))
        data = json.dumps(dict({"request_id": rid}, **fields)).encode()
        expect = "invalid"
    elif kind == "unknown_verb":
        verb = draw(VERB_TEXT.filter(lambda v: v not in verb_names()))
        rid = _rid(draw(ID_SUFFIX))
        data = json.dumps({"request_id": rid}).encode()
        expect = "unknown_verb"
    elif kind == "oversize":
        rid = _rid(draw(ID_SUFFIX))
        pad = "x" * draw(st.integers(FUZZ_MAX_PAYLOAD, 20000))
        data = json.dumps({"request_id": rid, "pad": pad}).encode()
        expect = "too_large"
    elif kind == "oversize_no_id":
        # one drawn character repeated: a huge string without asking hypothesis for thousands of draws
        pad = draw(st.characters()) * draw(st.integers(FUZZ_MAX_PAYLOAD, 3 * FUZZ_MAX_PAYLOAD))
        data = json.dumps({"pad": pad}).encode()
    else:
        rid = _rid(draw(ID_SUFFIX))
        tail = draw(st.binary(max_size=20)).replace(b"}", b"")
        data = b'{"request_id": "%s", "broken": ' % rid.encode() + tail
        expect = "bad_json"
    return {"verb": verb, "data": data, "rid": rid, "expect": expect}


def test_fuzzed_commands_each_fail_or_are_dropped_and_status_still_works(system_factory):
    system = system_factory(max_payload_bytes=FUZZ_MAX_PAYLOAD, rate_per_s=1e9, burst=10**9)
    totals = {"messages": 0}

    @settings(max_examples=FUZZ_BATCHES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(fuzz_message(), min_size=40, max_size=80))
    def run(batch: List[Dict[str, Any]]) -> None:
        before = system.dispatcher.stats()
        calls_before = sum(system.handlers.calls.values())
        for message in batch:
            topic = "%s/%s/cmd/%s" % (system.prefix, system.device, message["verb"])
            system.operator.client.publish(topic, message["data"], qos=1)
        system.settle(received=before["received"] + len(batch))
        answered = [m for m in batch if m["expect"]]
        for message in answered:
            final = system.final(message["rid"])
            assert (final["state"], final["error"]["code"]) == ("failed", message["expect"]), message
        after = system.dispatcher.stats()
        dropped = sum(after["dropped"].values()) - sum(before["dropped"].values())
        assert dropped == len(batch) - len(answered)
        failed = sum(after["failed"].values()) - sum(before["failed"].values())
        assert failed == len(answered)
        assert after["succeeded"] == before["succeeded"]
        assert sum(system.handlers.calls.values()) == calls_before  # none reached a handler
        totals["messages"] += len(batch)

    run()
    assert totals["messages"] >= 40 * FUZZ_BATCHES
    system.send("status", {"request_id": "after-fuzz"})
    assert system.final("after-fuzz")["state"] == "succeeded"


def test_a_refusal_with_thousands_of_errors_is_bounded_in_the_ack_and_the_record(system, tmp_path):
    """An archive of 200,000 unlisted files once made a 3.45 MB ack, stored whole in the request record."""
    from agent.config.schema import ConfigError, FieldError

    def refuse(request, progress):
        raise ConfigError([FieldError("files", "unlisted file in bundle: f/%06d " % i + "x" * 500)
                           for i in range(5000)])

    system.dispatcher.handlers["deploy"] = refuse
    system.send("deploy", {"request_id": "many-1", "bundle": "b", "sha256": SHA})
    final = system.final("many-1")
    errors = final["error"]["errors"]
    assert len(errors) == 11 and errors[-1] == {"field": "files", "message": "and 4990 more"}
    assert all(len(e["message"]) <= 300 for e in errors)
    assert len(json.dumps(final)) < 8192
    system.settle(1)
    assert system.dispatcher._record.get("many-1")["error"]["errors"] == errors
