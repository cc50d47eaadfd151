"""The serving loop's one handover queue: order, results, errors, and a caller's timeout withdrawing its item."""

import threading

import pytest

from agent.pipeline import handover
from agent.pipeline.handover import BetweenBatches, HandoverTimeout
from tests.conftest import wait_for


def _submit_in_thread(queue: BetweenBatches, fn, timeout: float, out: dict, key: str) -> threading.Thread:
    def call() -> None:
        try:
            out[key] = queue.submit(fn, timeout, what=key)
        except BaseException as exc:  # recorded for the assertion
            out[key] = exc

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def _wait_pending(queue: BetweenBatches, n: int) -> None:
    assert wait_for(lambda: queue.pending() >= n, timeout=5, interval=0.001), "items never arrived"


def test_items_run_in_submission_order_and_return_results() -> None:
    queue = BetweenBatches()
    ran, out = [], {}
    threads = []
    for name in ("config", "swap", "rollback"):
        threads.append(_submit_in_thread(queue, lambda n=name: ran.append(n) or n.upper(), 5.0, out, name))
        _wait_pending(queue, len(threads))
    assert ran == []  # nothing runs outside the serving loop
    assert queue.run_pending() == 3
    for thread in threads:
        thread.join(5)
    assert ran == ["config", "swap", "rollback"]
    assert out == {"config": "CONFIG", "swap": "SWAP", "rollback": "ROLLBACK"}


def test_an_error_reaches_the_caller_and_later_items_still_run() -> None:
    queue = BetweenBatches()
    out = {}

    def boom() -> None:
        raise ValueError("bad threshold")

    first = _submit_in_thread(queue, boom, 5.0, out, "bad")
    _wait_pending(queue, 1)
    second = _submit_in_thread(queue, lambda: 42, 5.0, out, "good")
    _wait_pending(queue, 2)
    queue.run_pending()
    first.join(5)
    second.join(5)
    assert isinstance(out["bad"], ValueError) and "bad threshold" in str(out["bad"])
    assert out["good"] == 42


def test_a_timed_out_item_is_withdrawn_and_never_runs() -> None:
    queue = BetweenBatches()
    ran = []
    with pytest.raises(HandoverTimeout, match="within 0.1 s; withdrawn"):
        queue.submit(lambda: ran.append("late"), 0.1, what="config change")
    assert queue.run_pending() == 0
    assert ran == []


def test_an_item_taken_before_the_timeout_completes_and_returns(monkeypatch) -> None:
    caller_timed_out = threading.Event()

    class Done(threading.Event):
        """The item's completion event, telling the test when the caller's timed wait on it ran out."""

        def wait(self, timeout=None):
            done = super().wait(timeout)
            if not done and timeout is not None:
                caller_timed_out.set()
            return done

    make_item = handover._Item.__init__

    def item_with_a_watched_done(item, *args, **kwargs) -> None:
        make_item(item, *args, **kwargs)
        item.done = Done()

    monkeypatch.setattr(handover._Item, "__init__", item_with_a_watched_done)
    queue = BetweenBatches()
    out = {}

    def slow() -> str:  # runs until the caller's timeout has passed while it runs
        return "applied" if caller_timed_out.wait(5) else "the caller's timeout never passed"

    caller = _submit_in_thread(queue, slow, 0.2, out, "swap")
    _wait_pending(queue, 1)
    assert queue.run_pending() == 1
    caller.join(5)
    assert out["swap"] == "applied"


def test_post_runs_without_a_waiting_caller() -> None:
    queue = BetweenBatches()
    ran = []
    queue.post(lambda: ran.append(1), what="reload")
    assert queue.run_pending() == 1 and ran == [1]


def test_a_failed_item_logs_a_warning_with_its_cause(caplog) -> None:
    """A SIGHUP reload that fails to apply has no caller to answer: the warning (with the traceback) is its
    only trace. A submitted item's failure is logged too, besides reaching its caller."""
    queue = BetweenBatches()

    def reload() -> None:
        raise ValueError("sources[0].uri: no such folder")

    queue.post(reload, what="SIGHUP reload")
    with caplog.at_level("WARNING", logger="agent.pipeline.handover"):
        assert queue.run_pending() == 1
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert "SIGHUP reload failed: ValueError: sources[0].uri: no such folder" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is ValueError

    caplog.clear()
    out: dict = {}
    thread = _submit_in_thread(queue, reload, 5.0, out, "config change")
    _wait_pending(queue, 1)
    with caplog.at_level("WARNING", logger="agent.pipeline.handover"):
        queue.run_pending()
    thread.join(5)
    assert isinstance(out["config change"], ValueError)
    [record] = caplog.records
    assert "config change failed: ValueError" in record.getMessage() and not record.exc_info
