"""The A/B slot table: transitions, validation of what is read back, and atomic, durable writes."""

import json
import os
import stat
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent._util import atomic
from agent.lifecycle import slots
from agent.lifecycle.slots import (
    CONFIRMED,
    EMPTY,
    PENDING,
    STANDBY,
    Slot,
    SlotStateError,
    filled_slot,
    first_table,
    load_slots,
    other_slot,
    save_slots,
    with_confirmed,
    with_pending,
    with_rolled_back,
    with_swapped,
)


def bundle_slot(tag: str) -> Slot:
    return filled_slot(CONFIRMED, "slots/%s" % tag, tag * 64 if len(tag) == 1 else tag, "det", tag)


def states(table):
    return {name: table.slots[name].state for name in ("a", "b")}


def test_first_table_serves_a_confirmed_and_b_empty():
    table = first_table(bundle_slot("1"))
    assert table.serving == "a"
    assert states(table) == {"a": CONFIRMED, "b": EMPTY}
    assert table.confirmed == "a" and table.pending is None
    assert table.bundles() == ["slots/1"]


def test_deploy_confirm_then_operator_swap_then_redeploy():
    table = with_pending(first_table(bundle_slot("1")), "b", bundle_slot("2"))
    assert table.serving == "b" and states(table) == {"a": CONFIRMED, "b": PENDING}
    table = with_confirmed(table)
    assert table.serving == "b" and states(table) == {"a": STANDBY, "b": CONFIRMED}
    table = with_swapped(table)  # operator rollback with nothing pending: back to version 1
    assert table.serving == "a" and states(table) == {"a": CONFIRMED, "b": STANDBY}
    assert table.slots["a"].version == "1" and table.slots["b"].version == "2"
    table = with_pending(table, "b", bundle_slot("3"))  # the standby slot takes the next deploy
    assert states(table) == {"a": CONFIRMED, "b": PENDING}
    assert sorted(table.bundles()) == ["slots/1", "slots/3"]


def test_rollback_empties_the_pending_slot_and_remembers_why():
    table = with_pending(first_table(bundle_slot("1")), "b", bundle_slot("2"))
    table = with_rolled_back(table, "latency: 9 ms vs 2 ms")
    assert table.serving == "a" and states(table) == {"a": CONFIRMED, "b": EMPTY}
    assert table.slots["b"].bundle is None
    assert table.last_rollback is not None
    assert (table.last_rollback.version, table.last_rollback.reason) == ("2", "latency: 9 ms vs 2 ms")
    assert table.public()["last_rollback"]["reason"] == "latency: 9 ms vs 2 ms"


def test_transitions_that_make_no_sense_are_refused():
    table = first_table(bundle_slot("1"))
    with pytest.raises(ValueError, match="confirmed slot"):
        with_pending(table, "a", bundle_slot("2"))
    with pytest.raises(ValueError, match="no slot is pending"):
        with_confirmed(table)
    with pytest.raises(ValueError, match="no slot is pending"):
        with_rolled_back(table, "x")
    with pytest.raises(ValueError, match="no standby"):
        with_swapped(table)
    pending = with_pending(table, "b", bundle_slot("2"))
    with pytest.raises(ValueError, match="already pending"):
        with_pending(pending, "b", bundle_slot("3"))
    with pytest.raises(ValueError, match="pending"):
        with_swapped(pending)


def test_other_slot():
    assert other_slot("a") == "b" and other_slot("b") == "a"


def test_public_form_hides_store_paths():
    public = first_table(bundle_slot("1")).public()
    assert public["serving"] == "a"
    assert set(public["slots"]["a"]) == {"state", "name", "version", "manifest_sha256", "since"}
    assert public["slots"]["b"]["state"] == EMPTY


def test_save_then_load_round_trips_and_leaves_no_temp_file(tmp_path):
    path = str(tmp_path / "slots.json")
    assert load_slots(path) is None
    table = with_confirmed(with_pending(first_table(bundle_slot("1")), "b", bundle_slot("2")))
    save_slots(path, table)
    assert load_slots(path) == table
    assert os.listdir(str(tmp_path)) == ["slots.json"]
    assert json.loads(open(path).read())["serving"] == "b"


def test_a_failed_replace_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = str(tmp_path / "slots.json")
    old = first_table(bundle_slot("1"))
    save_slots(path, old)
    before = open(path, "rb").read()

    def power_cut(src, dst):
        raise OSError("simulated failure at rename")

    monkeypatch.setattr(atomic.os, "replace", power_cut)
    with pytest.raises(OSError, match="simulated"):
        save_slots(path, with_pending(old, "b", bundle_slot("2")))
    assert open(path, "rb").read() == before
    assert os.listdir(str(tmp_path)) == ["slots.json"]


@pytest.mark.parametrize("content, field", [
    ("{not json", "not valid JSON"),
    (json.dumps({"serving": "c", "slots": {}}), "serving"),
    (json.dumps({"serving": "a", "slots": {"a": {"state": "confirmed"}, "b": {}}}), "slots.a.bundle"),
    (json.dumps({"serving": "a", "slots": {"a": {"state": "weird"}, "b": {}}}), "slots.a.state"),
    (json.dumps({"serving": "a", "slots": {"a": {}, "b": {}}, "extra": 1}), "extra"),
])
def test_corrupt_files_are_refused_naming_file_and_field(tmp_path, content, field):
    path = tmp_path / "slots.json"
    path.write_text(content)
    with pytest.raises(SlotStateError) as info:
        load_slots(str(path))
    assert str(path) in str(info.value)
    assert field in str(info.value)


def test_two_confirmed_slots_are_refused(tmp_path):
    one = bundle_slot("1")
    data = {"serving": "a", "slots": {"a": slots.to_dict(one), "b": slots.to_dict(one)}}
    path = tmp_path / "slots.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SlotStateError, match="exactly one slot must be confirmed"):
        load_slots(str(path))


STEPS = st.lists(st.sampled_from(["deploy", "confirm", "rollback", "swap"]), max_size=30)


@settings(max_examples=60, deadline=None)
@given(STEPS)
def test_any_sequence_of_legal_steps_keeps_a_valid_table_that_round_trips(tmp_path_factory, steps):
    path = str(tmp_path_factory.mktemp("slots") / "slots.json")
    table = first_table(bundle_slot("v0"))
    version = 0
    for step in steps:
        try:
            if step == "deploy":
                version += 1
                table = with_pending(table, other_slot(table.serving), bundle_slot("v%d" % version))
            elif step == "confirm":
                table = with_confirmed(table)
            elif step == "rollback":
                table = with_rolled_back(table, "test")
            else:
                table = with_swapped(table)
        except ValueError:
            continue  # not legal from this state: the table is unchanged
        save_slots(path, table)
        assert load_slots(path) == table
        assert list(states(table).values()).count(CONFIRMED) == 1
        assert table.slots[table.serving].state in (CONFIRMED, PENDING)
        assert len(table.bundles()) <= 2


def test_atomic_writes_follow_the_umask_like_open(tmp_path):
    """Under the unit's UMask=0027 a written file (an overrides file may hold a stream's password) is 0640,
    not world-readable; under the usual 022 it is 0644 like open() makes it."""
    script = ("import os, sys; os.umask(int(sys.argv[1], 8)); from agent._util.atomic import atomic_write; "
              "atomic_write(sys.argv[2], 'x')")
    for umask, expected in (("027", 0o640), ("022", 0o644)):
        path = str(tmp_path / ("f" + umask))
        subprocess.run([sys.executable, "-c", script, umask, path], check=True, timeout=60)
        assert stat.S_IMODE(os.stat(path).st_mode) == expected
