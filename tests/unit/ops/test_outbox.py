"""The durable outbox: order, byte budget with counted drop-oldest, survival of a killed process."""

import os
import signal
import sqlite3
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, WAIT_S

from agent._util import quarantine
from agent._util import sqlite as sqlite_util
from agent.ops.outbox import MEMORY_MAX_BYTES, Outbox
from agent.ops.outbox_budget import message_size
from tests.support.outbox_support import RefusingCommit, read_only_fs

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
    assert again.counters() == {"stored": 5, "replayed": 1, "dropped_oldest": 2, "disk_full": 0,
                                "rejected_too_large": 0, "messages": 2, "bytes": 200, "max_bytes": 300,
                                "disk_pressure": False, "in_memory": False}


def test_oldest_age_follows_the_oldest_undelivered_message_and_survives_reopen(tmp_path):
    path = str(tmp_path / "o.sqlite")
    box = Outbox(path, max_bytes=10000)
    assert box.oldest_age_s() == 0.0  # nothing waits
    first = box.put(TOPIC, payload(0))
    box.put(TOPIC, payload(1))
    with sqlite3.connect(path) as conn:  # as if put an hour and a minute ago
        conn.execute("UPDATE messages SET created = created - 3600 WHERE id = ?", (first,))
        conn.execute("UPDATE messages SET created = created - 60 WHERE id != ?", (first,))
    assert 3600 <= box.oldest_age_s() < 3600 + WAIT_S
    box.remove([first])  # delivered: the next one is the oldest
    assert 60 <= box.oldest_age_s() < 60 + WAIT_S
    box.close()
    assert box.oldest_age_s() == 0.0 and len(box) == 1  # a transport's stats read after its stop: no error
    again = Outbox(path, max_bytes=10000)
    assert 60 <= again.oldest_age_s() < 60 + WAIT_S
    assert again.oldest_age_s(now=0.0) == 0.0  # the clock went back: not a negative age
    again.remove([m.id for m in again.peek(10)])
    assert again.oldest_age_s() == 0.0
    again.close()


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


# -- damaged files at start: moved aside, never fatal ---------------------------------------------------------


def _populated(path: str, n: int = 200) -> None:
    with Outbox(path, 10**6) as box:
        for i in range(n):
            box.put(TOPIC, payload(i, 300))


def _truncate(path) -> None:
    _populated(str(path))
    size = path.stat().st_size
    with open(str(path), "r+b") as handle:
        handle.truncate(size // 2 + 100)  # mid-page, as a power cut during a copy leaves it


def _random_bytes(path) -> None:
    path.write_bytes(os.urandom(100))


def _wrong_schema(path) -> None:
    with sqlite3.connect(str(path)) as conn:
        conn.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT)")
        conn.execute("INSERT INTO messages (body) VALUES ('someone else''s data')")


@pytest.mark.parametrize("damage", [_truncate, _random_bytes, _wrong_schema])
def test_a_damaged_file_is_moved_aside_and_the_outbox_starts_empty(tmp_path, damage):
    path = tmp_path / "o.sqlite"
    damage(path)
    before = path.read_bytes()
    box = Outbox(str(path), max_bytes=10_000)
    assert len(box) == 0 and not box.in_memory
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("o.sqlite.corrupt-") and not p.name.endswith(
        ("-wal", "-shm"))]
    assert len(aside) == 1 and aside[0].read_bytes() == before  # the evidence is kept, unchanged
    alerts = box.take_alerts()
    assert [a["kind"] for a in alerts] == ["state_file_damaged"]
    assert alerts[0]["figures"]["moved_to"] == str(aside[0]) and "not sent" in alerts[0]["message"]
    assert box.take_alerts() == []  # taken once
    assert box.put(TOPIC, payload(1)) is not None and len(box) == 1  # and it works


def test_a_file_that_cannot_be_moved_aside_degrades_to_memory(tmp_path, monkeypatch):
    path = tmp_path / "o.sqlite"
    path.write_bytes(os.urandom(100))

    monkeypatch.setattr(quarantine.os, "replace", read_only_fs)
    box = Outbox(str(path), max_bytes=64 * 1024 * 1024)
    assert box.in_memory and box.max_bytes == MEMORY_MAX_BYTES
    alerts = box.take_alerts()
    assert [a["kind"] for a in alerts] == ["outbox_in_memory"] and "memory" in alerts[0]["message"]
    assert box.put(TOPIC, payload(1)) is not None and len(box) == 1


@pytest.mark.parametrize("error", ["database or disk is full", "database is locked", "disk I/O error"])
def test_a_healthy_file_that_cannot_be_opened_now_is_kept_not_moved_aside(tmp_path, monkeypatch, error):
    """A full disk or a lock says nothing about the file: its unsent results stay for a later start."""
    path = tmp_path / "o.sqlite"
    first = Outbox(str(path), max_bytes=10_000)
    first.put(TOPIC, payload(1))
    first.close()

    def refuse(*args, **kwargs):
        raise sqlite3.OperationalError(error)

    monkeypatch.setattr(sqlite_util, "open_wal", refuse)
    box = Outbox(str(path), max_bytes=10_000)
    assert box.in_memory
    assert [a["kind"] for a in box.take_alerts()] == ["outbox_in_memory"]
    assert sorted(p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name) == []
    monkeypatch.undo()
    again = Outbox(str(path), max_bytes=10_000)  # space or the lock is back: nothing was lost
    assert not again.in_memory and len(again) == 1 and again.take_alerts() == []


def test_an_unusable_place_degrades_to_memory(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")  # a file where the state directory should be: nothing can be created in it
    box = Outbox(str(blocker / "o.sqlite"), max_bytes=1000)
    assert box.in_memory
    assert [a["kind"] for a in box.take_alerts()] == ["outbox_in_memory"]
    ids = [box.put(TOPIC, payload(i)) for i in range(12)]  # the budget still applies
    assert None not in ids and len(box) == 10 and box.dropped_oldest == 2


# -- delivered marks, per-topic depth ---------------------------------------------------------------------


def test_delivered_rows_are_never_peeked_again_even_when_the_delete_fails(tmp_path):
    box = Outbox(str(tmp_path / "o.sqlite"), max_bytes=10_000)
    ids = [box.put(TOPIC if i % 2 else "t/other", payload(i)) for i in range(6)]
    assert box.pending_for(TOPIC) == 3 and box.pending_for("t/other") == 3
    real = box._conn
    box._conn = RefusingCommit(real)  # the disk refuses the delete's COMMIT
    assert box.remove(ids[:3]) == 0
    assert [m.id for m in box.peek(10)] == ids[3:]  # marked delivered: not replayed again
    assert len(box) == 3 and box.pending_for(TOPIC) == 2 and box.pending_for("t/other") == 1
    box._conn = real
    assert box.retry_deletes() == 3
    assert len(box) == 3 and box.replayed == 3
    assert box.bytes == sum(message_size(m.topic, m.payload) for m in box.peek(10))


