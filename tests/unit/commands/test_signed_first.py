"""Signed means first (issue 29 items 5-7), on a real dispatcher and Mosquitto: with a command key, an unsigned
sender can neither take the operator's request id first nor push the record's entries out, junk has a rate
bucket of its own, a dated id is kept across a restart, and a command refused ``busy`` can be retried."""

import time

import pytest

from agent.commands.freshness import Freshness
from agent.protocol.envelope import sign_command
from tests.conftest import wait_for
from tests.support import commands_support as rig
from tests.support.commands_support import CommandSystem
from tests.support.needs import needs_cryptography

system_factory = rig.system_factory  # fixture: a dispatcher and transport on the broker

pytestmark = needs_cryptography


@pytest.fixture(scope="module")
def keys():
    from agent.cli.bundle import make_key_pair

    private_pem, _public_pem, public_hex = make_key_pair()
    return private_pem, bytes.fromhex(public_hex)


def signed(keys, device, verb, request_id, **fields):
    message = dict(fields, request_id=request_id, issued_at=time.time(), ttl_s=600.0)
    message["signature"] = sign_command(keys[0], device, verb, message)
    return message


def test_an_unsigned_command_sent_first_with_the_operators_id_does_not_stop_the_signed_one(system_factory, keys):
    system = system_factory(freshness=Freshness(keys[1]))
    request_id = "ro-0123abcd.%s.pause" % system.device  # predictable, like a fleet's ids
    system.send("pause", {"request_id": request_id})  # the attacker's, first
    assert system.final(request_id)["error"]["code"] == "unsigned"
    system.send("pause", signed(keys, system.device, "pause", request_id))
    answer = system.final(request_id, count=2)
    assert answer["state"] == "succeeded" and "replayed" not in answer, answer
    assert system.handlers.calls["pause"] == 1
    assert system.dispatcher.stats()["failed"] == {"unsigned": 1}


def test_junk_is_never_recorded_and_cannot_take_the_signed_commands_tokens(system_factory, keys):
    system = system_factory(freshness=Freshness(keys[1]), rate_per_s=0.001, burst=2)  # no refill in a test
    junk = 30
    for i in range(junk):  # unsigned, and signed with garbage: both are the 'other' class
        system.send("status", {"request_id": "j-%d" % i} if i % 2 else dict(
            signed(keys, system.device, "status", "j-%d" % i), signature="00" * 64))
    system.settle(received=junk)
    assert len(system.dispatcher._record) == 0  # nothing was written under any junk id
    for i in range(2):  # the signed bucket is untouched: both of its burst are there
        system.send("status", signed(keys, system.device, "status", "op-%d" % i))
        assert system.final("op-%d" % i)["state"] == "succeeded"
    system.send("status", signed(keys, system.device, "status", "op-2"))
    assert system.final("op-2")["error"]["code"] == "rate_limited"  # the signed class is limited too
    failed = system.dispatcher.stats()["failed"]
    assert failed == {"unsigned": junk // 2, "bad_signature": junk // 2, "rate_limited": 1}, failed


def test_without_a_key_every_command_shares_one_bucket(system_factory):
    system = system_factory(rate_per_s=0.001, burst=2)
    for i in range(3):
        system.send("status", {"request_id": "n-%d" % i})
    assert [system.final("n-%d" % i).get("error", {}).get("code") for i in range(3)] == [None, None,
                                                                                        "rate_limited"]


def test_a_signed_command_is_not_replayed_after_a_restart_when_the_record_forgot_it(tmp_path, mosquitto,
                                                                                     probe_factory, keys):
    record = str(tmp_path / "requests.sqlite")
    first = CommandSystem(mosquitto, tmp_path, probe_factory, record_path=record, record_size=2,
                          freshness=Freshness(keys[1]))
    captured = signed(keys, first.device, "pause", "p-1")
    try:
        first.send("pause", captured)
        assert first.final("p-1")["state"] == "succeeded"
        for i in range(3):  # signed commands push p-1 out of the two-entry record
            first.send("status", signed(keys, first.device, "status", "s-%d" % i))
            assert first.final("s-%d" % i)["state"] == "succeeded"
        assert first.dispatcher._record.get("p-1") is None
    finally:
        first.close()
    second = CommandSystem(mosquitto, tmp_path, probe_factory, device=first.device, record_path=record,
                           record_size=2, freshness=Freshness(keys[1]))  # a new process: nothing in memory
    try:
        second.send("pause", captured)
        assert second.final("p-1")["error"]["code"] == "replayed"
        assert second.handlers.calls["pause"] == 0
    finally:
        second.close()


def test_a_signed_command_refused_busy_runs_when_sent_again(system_factory, keys):
    system = system_factory(freshness=Freshness(keys[1]), queue_size=1)
    system.send("restart", signed(keys, system.device, "restart", "b-1"))  # runs, held in its handler
    assert wait_for(lambda: system.dispatcher.stats()["busy"])
    system.send("restart", signed(keys, system.device, "restart", "b-2"))  # waits in the queue
    retried = signed(keys, system.device, "restart", "b-3")
    system.send("restart", retried)  # no room
    assert system.final("b-3")["error"]["code"] == "busy"
    system.handlers.release.set()
    assert system.final("b-1")["state"] == system.final("b-2")["state"] == "succeeded"
    system.send("restart", retried)  # the same signed message: its id was not kept by the refusal
    assert system.final("b-3", count=2)["state"] == "succeeded"
    assert system.handlers.calls["restart"] == 3
