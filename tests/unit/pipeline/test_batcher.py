"""Dynamic batcher: full batches without waiting, short batches after max_wait_ms, never more than max_batch."""

import queue
import threading

import pytest

from agent.pipeline.batcher import Batcher


def filled(n):
    q = queue.Queue()
    for i in range(n):
        q.put(i)
    return q


def test_full_batches_in_order_then_remainder():
    b = Batcher(filled(10), max_batch=4, max_wait_ms=1000)
    stop = threading.Event()
    assert [b.next_batch(stop) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_short_batch_is_flushed_after_the_wait_and_empty_when_idle():
    q = filled(3)
    b = Batcher(q, max_batch=8, max_wait_ms=20)
    stop = threading.Event()
    assert b.next_batch(stop) == [0, 1, 2]
    assert b.next_batch(stop, idle_timeout_s=0.01) == []


def test_late_frame_within_the_wait_joins_the_batch():
    q = filled(1)
    threading.Timer(0.02, q.put, args=(1,)).start()
    b = Batcher(q, max_batch=2, max_wait_ms=2000)
    assert b.next_batch(threading.Event()) == [0, 1]


def test_configure_applies_to_next_batch():
    b = Batcher(filled(6), max_batch=1, max_wait_ms=0)
    stop = threading.Event()
    assert b.next_batch(stop) == [0]
    b.configure(max_batch=5, max_wait_ms=0)
    assert b.next_batch(stop) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("kwargs", [{"max_batch": 0, "max_wait_ms": 1}, {"max_batch": 1, "max_wait_ms": -1}])
def test_bad_arguments_are_named(kwargs):
    with pytest.raises(ValueError, match=next(iter(k for k, v in kwargs.items() if v in (0, -1)))):
        Batcher(queue.Queue(), **kwargs)
