"""Per-source result sequence numbers: never backwards, across restarts, damaged files and wall-clock steps."""

import json
import os

import pytest

from agent.pipeline.results import SEQ_SEED_PER_S, SequenceCounter
from tests.support.clock_support import ManualClock


def test_numbers_count_per_source_from_one(tmp_path):
    counter = SequenceCounter(str(tmp_path / "sequence.json"), block=5)
    assert [counter.next("front") for _ in range(3)] == [1, 2, 3]
    assert [counter.next("back") for _ in range(2)] == [1, 2]
    assert counter.next("front") == 4


def test_a_restart_continues_above_every_number_used(tmp_path):
    path = str(tmp_path / "sequence.json")
    first = SequenceCounter(path, block=5)
    used = [first.next("front") for _ in range(12)]  # crosses two block boundaries
    # A restart at any point (here: no clean shutdown, nothing flushed) must not reuse a number.
    second = SequenceCounter(path, block=5)
    after = [second.next("front") for _ in range(3)]
    assert min(after) > max(used) and after == sorted(after)
    third = SequenceCounter(path, block=5)
    assert third.next("front") > max(after)
    assert third.next("new-source") == 1


def test_wall_clock_steps_do_not_touch_the_numbers(tmp_path):
    clock = ManualClock(1_700_000_000.0)
    counter = SequenceCounter(str(tmp_path / "sequence.json"), block=4, clock=clock)
    numbers = []
    for step in (0.0, -3600.0, 86400.0, -86400.0):  # back an hour, forward a day, back again
        clock.now += step
        numbers += [counter.next("front") for _ in range(5)]
    assert numbers == list(range(1, 21))


@pytest.mark.parametrize("content", [b"", b"{not json", os.urandom(64), b'{"reserved": {"front": "x"}}',
                                     b'{"something": 1}'])
def test_a_damaged_file_is_moved_aside_and_numbers_restart_above_the_old_ones(tmp_path, content):
    path = tmp_path / "sequence.json"
    SequenceCounter(str(path), block=5).next("front")
    path.write_bytes(content)
    clock = ManualClock(1_700_000_000.0 - 3600)  # even with the clock an hour behind
    counter = SequenceCounter(str(path), clock=clock)
    assert counter.next("front") == int(clock.now * SEQ_SEED_PER_S)
    assert [a["kind"] for a in counter.alerts] == ["state_file_damaged"]
    aside = counter.alerts[0]["figures"]["moved_to"]
    assert aside and open(aside, "rb").read() == content
    assert json.loads(path.read_text())["reserved"]["front"] > int(clock.now * SEQ_SEED_PER_S)


def test_an_unwritable_reservation_keeps_counting_and_is_retried(tmp_path):
    state = tmp_path / "state"
    counter = SequenceCounter(str(state / "sequence.json"), block=3)
    state.write_bytes(b"")  # a file where the directory should be: every write fails
    numbers = [counter.next("front") for _ in range(7)]
    assert numbers == list(range(1, 8))  # serving numbers on in memory
    state.unlink()
    state.mkdir()
    counter.next("front")  # the block boundary at 10 (3 per block) writes again
    counter.next("front")
    counter.next("front")
    assert json.loads((state / "sequence.json").read_text())["reserved"]["front"] > 10
