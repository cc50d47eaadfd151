"""Fresh commands against a real broker: expiry and replay whatever the record's size, a clock that never runs
back, signed commands, group verbs, retained commands, and the operator answered (and able to cancel) while a
long command runs."""

import json
import time

import pytest

from agent.commands.freshness import ForwardClock, Freshness
from agent.errors import CommandError
from agent.protocol.envelope import sign_command
from tests.conftest import WAIT_S, wait_for
from tests.support.commands_support import SHA, system_factory  # noqa: F401 - fixture
from tests.support.needs import needs_cryptography

factory = system_factory


class SteppedClock:
    """A wall clock the test steps, and a monotonic one it advances."""

    def __init__(self, wall=1_800_000_000.0):
        self.wall_now, self.mono_now = wall, 100.0

    def wall(self):
        return self.wall_now

    def mono(self):
        return self.mono_now


def dated(request_id, issued_at, ttl_s=60.0, **fields):
    return dict(fields, request_id=request_id, issued_at=issued_at, ttl_s=ttl_s)


def test_the_clock_follows_forward_steps_and_never_runs_back():
    steps = SteppedClock()
    clock = ForwardClock(steps.wall, steps.mono)
    assert clock.now() == steps.wall_now
    steps.wall_now -= 3600  # NTP steps the wall clock back an hour
    steps.mono_now += 5
    assert clock.now() == 1_800_000_005.0  # the last reading plus the monotonic time since
    steps.wall_now += 7200  # and forward again: followed
    assert clock.now() == steps.wall_now


def test_an_expired_a_future_and_a_replayed_command_are_refused():
    steps = SteppedClock()
    judge = Freshness(max_skew_s=30, clock=ForwardClock(steps.wall, steps.mono))
    now = steps.wall_now
    judge.check("cam-01", "pause", dated("a", now - 10))
    for message, code in [(dated("b", now - 200), "stale"),  # expired: issued 200 s ago, valid 60 + 30 s
                          (dated("c", now + 120), "stale"),  # two minutes in the future: beyond the skew
                          (dated("a", now - 10), "replayed"),  # the same id within its validity
                          (dated("d", now, ttl_s=1e9), "invalid"),
                          (dated("e", float("nan")), "invalid")]:
        with pytest.raises(CommandError) as info:
            judge.check("cam-01", "pause", message)
        assert info.value.code == code, message
    # a wall-clock step back does not make the expired command fresh again
    steps.wall_now -= 3600
    with pytest.raises(CommandError, match="expired"):
        judge.check("cam-01", "pause", dated("b2", now - 200))


def test_a_replay_is_refused_within_its_validity_even_after_the_record_forgot_it(factory):
    system = factory(record_size=2)  # the record keeps two ids: a 1,024-id flood is the same with more
    now = time.time()
    system.send("pause", dated("p-1", now))
    assert system.final("p-1")["state"] == "succeeded"
    for i in range(4):
        system.send("status", dated("s-%d" % i, now))
        assert system.final("s-%d" % i)["state"] == "succeeded"
    assert system.dispatcher._record.get("p-1") is None  # forgotten by the record...
    system.send("pause", dated("p-1", now))
    assert system.final("p-1", count=2)["error"]["code"] == "replayed"  # ...but not by the freshness window
    assert system.handlers.calls["pause"] == 1


def test_group_topics_carry_only_the_configured_verbs(factory):
    system = factory(groups=("line-1",))
    system.send("deploy", {"request_id": "gd-1", "bundle": "b", "sha256": SHA}, group="line-1")
    refused = system.final("gd-1")
    assert refused["error"]["code"] == "not_for_group" and refused["error"]["field"] == "verb"
    system.send("status", {"request_id": "gs-1"}, group="line-1")
    assert system.final("gs-1")["state"] == "succeeded"
    assert system.handlers.calls["deploy"] == 0


def test_a_retained_command_is_refused(factory, mosquitto, probe_factory):
    device = "retained-box"
    topic = "atlas-edge/%s/cmd/pause" % device
    publisher = probe_factory(mosquitto, [])
    publisher.client.publish(topic, json.dumps({"request_id": "r-1"}).encode(), 1, retain=True).wait_for_publish(
        WAIT_S)
    try:
        system = factory(device=device)  # subscribes after: the broker hands it the retained message
        assert system.final("r-1")["error"]["code"] == "retained"
        assert system.handlers.calls["pause"] == 0
    finally:
        publisher.client.publish(topic, b"", 1, retain=True).wait_for_publish(WAIT_S)  # clear it


@needs_cryptography
def test_with_a_command_key_only_signed_fresh_commands_for_this_target_run(factory):
    from agent.cli.bundle import make_key_pair

    private_pem, _public_pem, public_hex = make_key_pair()
    other_pem = make_key_pair()[0]
    system = factory(groups=("line-1",), freshness=Freshness(bytes.fromhex(public_hex)))
    now = time.time()

    def signed(request_id, key=private_pem, target=None, **fields):
        message = dated(request_id, now, **fields)
        message["signature"] = sign_command(key, target or system.device, "pause", message)
        return message

    cases = [({"request_id": "u-1"}, "unsigned"),
             (dict(dated("u-2", now), signature="00" * 64), "bad_signature"),
             (signed("u-3", key=other_pem), "bad_signature"),
             (signed("u-4", target="other-box"), "bad_signature"),  # signed for another box
             (dict(signed("u-5"), extra_field=1), "bad_signature")]  # a field added after signing
    for message, code in cases:
        system.send("pause", message)
        assert system.final(message["request_id"])["error"]["code"] == code, message
    system.send("pause", signed("ok-1"))
    assert system.final("ok-1")["state"] == "succeeded"
    group_message = signed("ok-2", target="group/line-1")
    system.send("pause", group_message, group="line-1")
    assert system.final("ok-2")["state"] == "succeeded"
    assert system.handlers.calls["pause"] == 2


def test_status_pause_rollback_and_cancel_are_answered_while_a_long_command_runs(factory):
    system = factory()
    system.send("restart", {"request_id": "long-1"})  # blocks in its handler until released
    assert wait_for(lambda: system.dispatcher.stats()["busy"])
    for verb in ("status", "pause", "rollback", "cancel", "resume"):
        system.send(verb, {"request_id": "c-" + verb})
        assert system.final("c-" + verb)["state"] == "succeeded", verb
    assert system.dispatcher.stats()["busy"]  # the long command still runs meanwhile
    system.handlers.release.set()
    assert system.final("long-1")["state"] == "succeeded"


def test_a_command_dated_in_the_past_is_refused_through_the_broker(factory):
    system = factory()
    system.send("pause", dated("old-1", time.time() - 3600, ttl_s=60))  # captured an hour ago, valid a minute
    assert system.final("old-1")["error"]["code"] == "stale"
    assert system.handlers.calls["pause"] == 0


@needs_cryptography
def test_ctl_dates_and_signs_what_a_box_with_the_key_accepts(tmp_path):
    import argparse

    from agent.cli import ctl
    from agent.cli.bundle import make_key_pair

    private_pem, _public_pem, public_hex = make_key_pair()
    key_file = tmp_path / "operator.pem"
    key_file.write_bytes(private_pem)
    parser = argparse.ArgumentParser()
    ctl.add_arguments(parser)
    judge = Freshness(bytes.fromhex(public_hex))
    for extra, target in ([], "cam-01"), (["--group", "line-1"], "group/line-1"):
        args = parser.parse_args(["cam-01", "pause", "--command-key", str(key_file)] + extra)
        _request_id, _topic, _ack, body = ctl._command(args)
        message = json.loads(json.dumps(body))  # what the link publishes, read back as the box reads it
        assert message["ttl_s"] == ctl.DEFAULT_SIGNED_TTL_S
        judge.check(target, "pause", message)  # accepted as signed and fresh
        with pytest.raises(CommandError):
            judge.check(target, "resume", message)  # the signature covers the verb
    undated = ctl._command(parser.parse_args(["cam-01", "pause"]))[3]
    assert "issued_at" not in undated and "signature" not in undated


def test_json_nested_too_deep_is_answered_bad_json_when_the_request_id_is_readable(factory):
    system = factory()
    depth = 5000  # deeper than the JSON parser's recursion limit, well under the 64 KiB payload cap
    system.send("status", ('{"request_id": "deep-1", "x": ' + "[" * depth + "]" * depth + "}").encode())
    assert system.final("deep-1")["error"]["code"] == "bad_json"
