"""The serving loop's interface (agent/pipeline/seams.py ServingControl, agent/pipeline/serving.py): pause and
resume go through the handover queue and take effect between batches, on the serving thread; the sources are
replaced between batches and keep the pause; the status view says what the loop did. The command handlers use
that interface and nothing else of the loop.

The loop is the real one, on the demo bundle behind the paced stand-ins of tests/support/serving_support.py.
"""

import queue
import threading
import time

import pytest

from agent.commands.handlers import CommandHandlers
from agent.config.daemon_config import PublishConfig, SourceConfig
from agent.errors import CommandError
from agent.pipeline.handover import BetweenBatches
from agent.pipeline.sources import Frame
from tests.conftest import WAIT_S, wait_for
from tests.support.serving_support import (
    SQUARE_HW,
    WIDE_HW,
    Models,
    Sink,
    make_loop,
    needs_demo_bundle,
    paced_model,
    scene,
)

pytestmark = needs_demo_bundle  # skipped without the demo bundle, as test_serving is

QUEUED = 6  # frames queued while the loop is paused


@pytest.fixture(scope="module")
def pictures():
    return {"square": scene(SQUARE_HW, 1), "wide": scene(WIDE_HW, 2)}  # paced_model warms up on both tiers


class WatchedQueue(queue.Queue):
    """The frame queue, telling when the batcher is waiting in it for a first frame (a blocking get)."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()

    def get(self, block=True, timeout=None):
        if block and (timeout is None or timeout > 0):
            self.waiting.set()
        return super().get(block, timeout)


def frame(pictures, source="cam", frame_id=0):
    return Frame(source=source, frame_id=frame_id, ts=time.time(), image=pictures["square"],
                 enqueued=time.monotonic())


class Running:
    """A loop serving on its own thread; stopped, joined and its model released on exit."""

    def __init__(self, pictures, frames=None, handover=None):
        self.model = paced_model(pictures)
        self.frames = frames if frames is not None else queue.Queue()
        self.sink, self.stop = Sink(), threading.Event()
        self.loop = make_loop(Models(self.model), self.frames, self.sink, stop=self.stop, handover=handover)
        self.thread = threading.Thread(target=self.loop.serve)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)
        self.loop.stop_sources()
        self.model.close()
        assert not self.thread.is_alive()

    def idle_turns_pass(self, count):
        """Wait until the loop has turned idle ``count`` more times (each a full turn after this call)."""
        progress = self.loop.progress
        start = progress.idle_turns
        return wait_for(lambda: progress.idle_turns >= start + count, timeout=WAIT_S)


def test_no_frame_is_taken_once_pause_has_returned_even_while_the_batcher_waits(pictures):
    """The pause must not be answered while the loop can still take a batch: here the batcher is waiting in the
    queue for a first frame when the pause comes. A pause that only flipped a flag from the command thread
    returned at once, and the frames queued right after it were taken by that very wait."""
    frames = WatchedQueue()
    with Running(pictures, frames) as run:
        frames.waiting.clear()
        assert wait_for(frames.waiting.is_set, timeout=WAIT_S), "the batcher never waited for a frame"
        run.loop.pause(timeout=WAIT_S)
        taken = run.loop.taken
        for index in range(QUEUED):
            frames.put(frame(pictures, frame_id=index))
        assert run.idle_turns_pass(5), "the paused loop stopped turning"
        assert run.loop.taken == taken == 0 and frames.qsize() == QUEUED, "a frame was taken after the pause"
        view = run.loop.status()
        assert view["paused"] is True and view["queue_depth"] == QUEUED and view["published"] == 0

        assert run.loop.resume(timeout=WAIT_S) == QUEUED  # queued while paused: stale, dropped
        assert frames.qsize() == 0
        for index in range(QUEUED, QUEUED + 3):
            frames.put(frame(pictures, frame_id=index))
        # counted once the sink took it: when the view says 3, the sink has all three
        assert wait_for(lambda: run.loop.status()["published"] == 3, timeout=WAIT_S), "serving did not resume"
        view = run.loop.status()
        assert view["paused"] is False and view["dropped_on_resume"] == QUEUED and len(run.sink.results) == 3
    assert [r["frame_id"] for r in run.sink.results] == [QUEUED, QUEUED + 1, QUEUED + 2]


def test_pause_and_resume_take_their_turn_in_the_handover_queue(pictures):
    """A pause is a change to what the next batch sees: it is applied in order with the changes queued before
    and after it (a config switch, a swap), on the serving thread. Here the queue holds a change, then the pause
    (its caller waiting), then another change, before the loop starts: the first change still sees the loop
    unpaused, the second sees it paused. A pause applied from the command thread was seen by both."""
    handover = BetweenBatches()
    seen = []
    run = Running(pictures, handover=handover)
    serving_thread = []

    def look():
        seen.append(run.loop.status()["paused"])
        serving_thread.append(threading.current_thread() is run.thread)

    handover.post(look, what="change before")
    pausing = threading.Thread(target=run.loop.pause, args=(WAIT_S,))
    pausing.start()
    assert wait_for(lambda: handover.pending() == 2, timeout=WAIT_S), "the pause did not go to the handover queue"
    assert run.loop.status()["paused"] is False  # queued, not applied: the loop has not passed a batch yet
    handover.post(look, what="change after")
    with run:
        pausing.join(WAIT_S)
        assert not pausing.is_alive(), "the pause was not applied"
        assert seen == [False, True] and serving_thread == [True, True]
        resumed = handover.submit(lambda: run.loop.status()["paused"], timeout=WAIT_S)
        assert resumed is True
        run.loop.resume(timeout=WAIT_S)
        assert run.loop.status()["paused"] is False


def _write_pictures(folder, pictures, count=2):
    import cv2

    folder.mkdir()
    for index in range(count):
        assert cv2.imwrite(str(folder / ("%02d.jpg" % index)), pictures["square"])
    return str(folder)


def test_sources_are_replaced_between_batches_and_keep_the_pause(pictures, tmp_path):
    """The daemon's config switch replaces the sources through the loop: the new readers feed the loop's queue,
    paused when the loop is (a swap done from outside started them unpaused), and only between batches: from
    another thread while the loop serves, the replacement is refused and nothing changes."""
    folder = _write_pictures(tmp_path / "pictures", pictures)
    config = SourceConfig(name="new", uri=folder, loop=True, max_fps=20)
    with Running(pictures) as run:
        before = run.loop.sources
        with pytest.raises(RuntimeError, match="handover"):
            run.loop.replace_sources([config])
        with pytest.raises(RuntimeError, match="handover"):
            run.loop.configure(2, 5.0, PublishConfig())
        assert run.loop.sources is before and not before.readers

        run.loop.pause(timeout=WAIT_S)
        run.loop.handover.submit(lambda: run.loop.replace_sources([config]), timeout=WAIT_S, what="sources")
        readers = run.loop.sources.readers
        assert list(readers) == ["new"] and all(r.paused.is_set() for r in readers.values())
        assert run.idle_turns_pass(3) and run.loop.taken == 0  # paused: the new source's frames wait

        run.loop.resume(timeout=WAIT_S)
        assert wait_for(lambda: len(run.sink.results) >= 3, timeout=WAIT_S), "no result from the new source"
        assert {r["source"] for r in run.sink.results} == {"new"}
        assert run.loop.status()["sources"]["new"]["frames"] > 0


class OnlyTheInterface:
    """A ServingControl and nothing else: a handler reaching for any other attribute of the loop fails."""

    def __init__(self, latest=None):
        self.calls = []
        self._latest = latest

    def pause(self, timeout):
        self.calls.append(("pause", timeout))

    def resume(self, timeout):
        self.calls.append(("resume", timeout))
        return 4

    def status(self):
        raise AssertionError("the handlers' status is the daemon's provider, not the loop's view")

    def latest(self):
        return self._latest


def test_handlers_pause_and_answer_status_through_the_interface_only():
    serving = OnlyTheInterface()
    answer = {"paused": True, "from": "the daemon"}
    handlers = CommandHandlers(serving, None, None, BetweenBatches(), get_config=lambda: None,
                               apply_config=lambda config: None, request_restart=lambda why: None,
                               status=lambda: answer, overrides=None)
    assert handlers.pause(True) == {"paused": True, "stale_frames_dropped": 0}
    assert handlers.pause(False) == {"paused": False, "stale_frames_dropped": 4}
    assert [verb for verb, _timeout in serving.calls] == ["pause", "resume"]
    assert all(timeout > 0 for _verb, timeout in serving.calls)
    assert handlers.status() is answer
    with pytest.raises(CommandError) as error:
        handlers.snapshot(None, lambda text: None)
    assert error.value.code == "no_frame"
