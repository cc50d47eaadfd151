"""The durable outbox: order, byte budget with counted drop-oldest, survival of a killed process."""

import os
import signal
import sqlite3
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, WAIT_S

from agent.ops.outbox import Outbox, OutboxError, message_size

TOPIC = "atlas-edge/cam-01/results/front"  # 31 bytes


def payload(i: int, size: int = 69) -> bytes:
    """A payload of exactly ``size`` bytes that names its index (so a message is 100 bytes with TOPIC)."""
    head = b"%05d:" % i
    return head + b"x" * (size - len(head))


def test_message_size_counts_topic_and_payload():
    assert len(TOPIC) == 31
    assert message_size(TOPIC, payload(0)) == 100
    assert message_size("é", b"ab") == 4  # topic counted in UTF-8 bytes


def test_put_peek_remove_keep_order(tmp_path):
    box = Outbox(str(tmp_path / "o.sqlite"), max_bytes=10_000)
    ids = [box.put(TOPIC, payload(i), qos=1, retain=(i == 3)) for i in range(10)]
    assert ids == sorted(ids) and len(set(ids)) == 10
    assert len(box) == 10 and box.bytes == 1000

    first = box.peek(4)
    assert [m.payload for m in first] == [payload(i) for i in range(4)]
    assert [m.retain for m in first] == [False, False, False, True]
    assert [m.qos for m in first] == [1, 1, 1, 1]
    # peek removes nothing; after_id pages through
    assert [m.payload for m in box.peek(3, after_id=first[-1].id)] == [payload(i) for i in (4, 5, 6)]
    assert len(box) == 10

    assert box.remove([first[0].id, first[2].id, 999_999]) == 2  # an unknown id is ignored
    assert [m.payload for m in box.peek(100)] == [payload(i) for i in (1, 3, 4, 5, 6, 7, 8, 9)]
    assert len(box) == 8 and box.bytes == 800
    assert (box.stored, box.replayed, box.dropped_oldest) == (10, 2, 0)


def test_ids_are_never_reused_after_emptying(tmp_path):
    box = Outbox(str(tmp_path / "o.sqlite"), max_bytes=10_000)
    old = [box.put(TOPIC, payload(i)) for i in range(3)]
    box.remove(old)
    assert len(box) == 0
    new = box.put(TOPIC, payload(3))
    assert new > max(old)


def test_byte_budget_drops_oldest_and_counts_exactly(tmp_path):
    box = Outbox(str(tmp_path / "o.sqlite"), max_bytes=1000)  # room for exactly 10 messages of 100 bytes
    for i in range(10):
        box.put(TOPIC, payload(i))
    assert (len(box), box.bytes, box.dropped_oldest) == (10, 1000, 0)

    box.put(TOPIC, payload(10))  # one over: exactly the oldest goes
    assert [m.payload[:5] for m in box.peek(100)] == [b"%05d" % i for i in range(1, 11)]
    assert (len(box), box.bytes, box.dropped_oldest) == (10, 1000, 1)

    box.put(TOPIC, payload(11, size=269))  # 300 bytes: the three oldest go
    assert [m.payload[:5] for m in box.peek(100)] == [b"%05d" % i for i in range(4, 12)]
    assert (len(box), box.bytes, box.dropped_oldest) == (8, 1000, 4)
    assert box.stored == 12


def test_message_larger_than_budget_is_refused_and_counted(tmp_path):
    box = Outbox(str(tmp_path / "o.sqlite"), max_bytes=1000)
    box.put(TOPIC, payload(0))
    assert box.put(TOPIC, payload(1, size=1000)) is None
    assert (len(box), box.rejected_too_large, box.dropped_oldest) == (1, 1, 0)  # nothing else was dropped


def test_put_many_is_one_ordered_batch(tmp_path):
    box = Outbox(str(tmp_path / "o.sqlite"), max_bytes=500)
    ids = box.put_many([(TOPIC, payload(i), 1, False) for i in range(7)])
    assert len(ids) == 7
    assert [m.payload[:5] for m in box.peek(10)] == [b"%05d" % i for i in range(2, 7)]
    assert box.dropped_oldest == 2 and box.bytes == 500


def test_contents_and_counters_survive_reopen(tmp_path):
    path = str(tmp_path / "o.sqlite")
    box = Outbox(path, max_bytes=300)
    for i in range(5):
        box.put(TOPIC, payload(i))
    box.remove([box.peek(1)[0].id])
    box.close()

    again = Outbox(path, max_bytes=300)
    assert [m.payload[:5] for m in again.peek(10)] == [b"00003", b"00004"]
    assert (len(again), again.bytes) == (2, 200)
    assert again.counters() == {"stored": 5, "replayed": 1, "dropped_oldest": 2, "rejected_too_large": 0,
                                "messages": 2, "bytes": 200, "max_bytes": 300}


def test_a_killed_writer_loses_nothing_it_committed(tmp_path):
    """SIGKILL right after the puts (no close, no atexit): a new process finds every message, in order."""
    path = str(tmp_path / "o.sqlite")
    script = (
        "import sys, time\n"
        "from agent.ops.outbox import Outbox\n"
        "box = Outbox(sys.argv[1], 10**6)\n"
        "for i in range(200):\n"
        "    box.put('t/%d' % i, b'payload-%d' % i)\n"
        "print('stored', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, path], stdout=subprocess.PIPE,
                             env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    try:
        assert child.stdout.readline().strip() == b"stored"
        child.send_signal(signal.SIGKILL)
        assert child.wait(WAIT_S) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    box = Outbox(path, 10**6)
    rows = box.peek(1000)
    assert [(m.topic, m.payload) for m in rows] == [("t/%d" % i, b"payload-%d" % i) for i in range(200)]
    assert box.stored == 200


def test_bad_file_is_reported_by_name_and_left_alone(tmp_path):
    path = tmp_path / "o.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(OutboxError, match="o.sqlite"):
        Outbox(str(path), max_bytes=1000)
    assert path.read_bytes() == b"this is not a database" * 100


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_budget_is_rejected(tmp_path, bad):
    with pytest.raises(ValueError, match="max_bytes"):
        Outbox(str(tmp_path / "o.sqlite"), max_bytes=bad)
    assert not (tmp_path / "o.sqlite").exists()


def test_file_is_in_wal_mode(tmp_path):
    path = str(tmp_path / "o.sqlite")
    Outbox(path, 1000).close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
