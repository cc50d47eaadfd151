"""The pipelined serving loop (agent/pipeline/serving.py) keeps its guarantees while stages overlap.

Functional, not timed: the backend is the paced stand-in of the benchmarks (benchmarks/paced_backend.py: the
demo model's real outputs, each call held for a few milliseconds without using the CPU), so that the serving
thread really letterboxes and decodes while a call is in flight. The tests that claim overlap force it rather
than hope for it (:class:`OverlapProbe` holds the first backend call until the next letterbox has begun, which
a loop that waited for each call first would never do), then check the guarantee: order per source, one model
per frame across a swap, nothing lost at shutdown, and a failed batch that costs only its own frames.
"""

import queue
import sqlite3
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from agent.pipeline.handover import BetweenBatches
from agent.pipeline.sources import Frame
from benchmarks.paced_backend import PacedStandinBackend
from tests.conftest import WAIT_S, wait_for
from tests.support.serving_support import (
    MAX_BATCH,
    SQUARE_HW,
    WIDE_HW,
    Models,
    Sink,
    make_loop,
    needs_demo_bundle,
    paced_model,
    scene,
)

pytestmark = needs_demo_bundle

QUEUED_AT_START = 2 * MAX_BATCH  # frames started_loop queues before its loop starts


class OverlapProbe:
    """Forces the stages to overlap, and says whether they did.

    The first backend call is held until the serving thread has begun letterboxing a later chunk. A pipelined
    loop does that while the call is in flight, on any machine however loaded; a loop that waited for each call
    before the next letterbox never would, so the hold ends unanswered after WAIT_S and ``forced`` is False.
    The test must give that first call a successor the loop can letterbox without new frames (a first batch of
    several chunks: queue the frames before the loop starts).
    """

    NOT_FORCED = "the serving thread began no letterbox while the first backend call was held: no overlap"

    def __init__(self):
        self.begun = 0  # letterboxes begun
        self.ordinal = {}  # id(prepared chunk) -> (the ordinal of its letterbox, the chunk: keeps the id unique)
        self.forced = None  # set by the first call: whether a later letterbox began while it was held
        self.inputs = {}  # tier -> ids of the input arrays the backend was given
        self.cond = threading.Condition()

    def wrap(self, model):
        prepare, run = model.prepare, model.run

        def probed_prepare(tier, images):
            with self.cond:
                ordinal = self.begun
                self.begun += 1
                self.cond.notify_all()
            prepared = prepare(tier, images)
            with self.cond:
                self.ordinal[id(prepared)] = (ordinal, prepared)
            return prepared

        def probed_run(chunk):
            with self.cond:
                ordinal = self.ordinal[id(chunk)][0]
                self.inputs.setdefault(chunk.tier, set()).add(id(chunk.buffer.batch))
                if self.forced is None:
                    self.forced = self.cond.wait_for(lambda: self.begun > ordinal + 1, timeout=WAIT_S)
            return run(chunk)

        model.prepare, model.run = probed_prepare, probed_run
        return model


@pytest.fixture(scope="module")
def images():
    return {"square": scene(SQUARE_HW, 1), "wide": scene(WIDE_HW, 2)}


def queued(images, sources=("cam-a", "cam-b"), per_source=24):
    """Frames of two sources interleaved; each source alternates the two tiers, so a batch spans both."""
    frames = queue.Queue()
    for index in range(per_source):
        for number, source in enumerate(sources):
            image = images["square"] if (index + number) % 2 else images["wide"]
            frames.put(Frame(source=source, frame_id=index, ts=time.time(), image=image,
                             enqueued=time.monotonic()))
    return frames


def wide_frame(images, frame_id, source="cam"):
    return Frame(source=source, frame_id=frame_id, ts=time.time(), image=images["wide"], enqueued=time.monotonic())


def started_loop(images):
    """A paced, probed model behind a loop serving on its own thread from a small queue, which holds frames 0 to
    QUEUED_AT_START - 1 when the loop starts (its first batch has several chunks); the test feeds the rest."""
    probe = OverlapProbe()
    model = probe.wrap(paced_model(images))
    frames = queue.Queue(maxsize=QUEUED_AT_START)
    for frame_id in range(QUEUED_AT_START):
        frames.put(wide_frame(images, frame_id))
    sink, stop = Sink(), threading.Event()
    loop = make_loop(Models(model), frames, sink, stop=stop)
    thread = threading.Thread(target=loop.serve)
    thread.start()
    return probe, model, frames, sink, stop, loop, thread


def test_each_source_keeps_its_order_while_stages_overlap(images):
    probe = OverlapProbe()
    model = probe.wrap(paced_model(images))
    allocated = {tier: {id(buffer.batch) for buffer in runner.buffers} for tier, runner in model._runners.items()}
    try:
        sink = Sink()
        loop = make_loop(Models(model), queued(images), sink)
        loop.serve(until_sources_end=True)
    finally:
        model.close()
    assert probe.forced, probe.NOT_FORCED
    assert loop.taken == len(sink.results) == 48
    for tier, used in probe.inputs.items():  # 24 calls per tier, on the two buffers allocated at load
        assert used == allocated[tier] and len(used) == 2, tier
    for source in ("cam-a", "cam-b"):
        ids = [r["frame_id"] for r in sink.results if r["source"] == source]
        assert ids == list(range(24)), source
    assert set(sink.results[-1]["timings_ms"]) == {"queue", "preprocess", "wait_backend", "infer", "postprocess",
                                                   "total"}
    assert "publish" in loop.stats.percentiles()  # measured after the payload left, so only in the statistics
    assert 0.0 < loop.backend.busy_fraction() <= 1.0
    assert 0.0 < loop.telemetry()["backend_busy_fraction"] <= 1.0  # and so in `status`, built on telemetry


def test_a_swap_with_batches_in_flight_serves_each_frame_on_one_model(images):
    old, new = paced_model(images, version="1.0.0"), paced_model(images, version="2.0.0")
    expected = {}  # version -> (source size -> detections count), from each model alone
    for model in (old, new):
        expected[model.manifest.version] = {
            hw: len(model.infer_frames([images[key]])[0].detections)
            for key, hw in (("square", SQUARE_HW), ("wide", WIDE_HW))}
    for backend in new._runners[(256, 256)].backend, new._runners[(192, 320)].backend:
        backend.frozen = [np.zeros_like(out) for out in backend.frozen]  # the new model finds nothing
    expected["2.0.0"] = {SQUARE_HW: 0, WIDE_HW: 0}
    assert expected["1.0.0"][SQUARE_HW] > 0 and expected["1.0.0"][WIDE_HW] > 0
    probe = OverlapProbe()
    probe.wrap(old)
    probe.wrap(new)
    models = Models(old)
    handover = BetweenBatches()
    frames = queue.Queue(maxsize=8)
    sink, stop = Sink(), threading.Event()
    loop = make_loop(models, frames, sink, stop=stop, handover=handover)
    thread = threading.Thread(target=loop.serve)

    def swap():
        models.current = new
        old.close()  # the old model's backends refuse calls from here on: a late one would be an error

    try:
        for index in range(120):
            if index == frames.maxsize:  # the queue is full: the loop's first batch has several chunks
                thread.start()
            image = images["square"] if index % 2 else images["wide"]
            frames.put(Frame(source="cam", frame_id=index, ts=time.time(), image=image, enqueued=time.monotonic()))
            if index == 60:
                handover.submit(swap, timeout=30.0, what="swap")
    finally:
        drained = wait_for(frames.empty, timeout=WAIT_S)
        stop.set()
        thread.join(30)
        new.close()
    assert drained, "the loop left %d frames in the queue" % frames.qsize()
    assert probe.forced, probe.NOT_FORCED
    assert loop.inference_errors == 0
    assert [r["frame_id"] for r in sink.results] == list(range(120))
    versions = [r["model"]["version"] for r in sink.results]
    assert versions.count("1.0.0") > 0 and versions.count("2.0.0") > 0
    switched = versions.index("2.0.0")
    assert set(versions[switched:]) == {"2.0.0"}, "a frame went back to the old model after the swap"
    for result in sink.results:
        hw = tuple(result["image_hw"])
        assert len(result["detections"]) == expected[result["model"]["version"]][hw], result["frame_id"]


def test_shutdown_under_load_serves_every_frame_it_took(images):
    probe, model, frames, sink, stop, loop, thread = started_loop(images)
    fed = QUEUED_AT_START
    deadline = time.monotonic() + WAIT_S
    try:
        while len(sink.results) < 40:
            assert time.monotonic() < deadline, "only %d results after feeding %d frames" % (len(sink.results), fed)
            frames.put(wide_frame(images, fed), timeout=WAIT_S)
            fed += 1
        stop.set()  # frames are queued and chunks are in flight right now
        thread.join(30)
    finally:
        model.close()
    assert not thread.is_alive()
    assert probe.forced, probe.NOT_FORCED
    left = frames.qsize()
    assert loop.taken + left == fed
    assert loop.taken == loop.published == len(sink.results)  # nothing taken was lost
    assert [r["frame_id"] for r in sink.results] == list(range(loop.taken))


@pytest.mark.parametrize("max_frames", [1, 6, 9])
def test_max_frames_takes_and_publishes_exactly_that_many_while_stages_overlap(images, max_frames):
    """`demo --frames N`: the pipelined loop prepares the next batch while one runs; it must not take more than
    N from the queue (a batch of MAX_BATCH frames would overshoot), and it stops once those N are published."""
    model = paced_model(images)
    frames = queued(images)
    try:
        sink = Sink()
        loop = make_loop(Models(model), frames, sink)
        reason = loop.serve(max_frames=max_frames)
    finally:
        model.close()
    assert reason == "%d frames done" % max_frames
    assert loop.taken == loop.published == len(sink.results) == max_frames
    assert frames.qsize() == 48 - max_frames  # the rest stays queued, untouched


class FailsOnceBackend(PacedStandinBackend):
    """STAND-IN: paced, and its 5th paced call raises, as a runtime's failing call would."""

    calls = 0

    def _infer(self, batch):
        if self.frozen is not None:
            type(self).calls += 1
            if type(self).calls == 5:
                raise RuntimeError("device lost for one call")
        return super()._infer(batch)


def test_a_backend_error_in_one_batch_does_not_lose_the_next_batch(images):
    FailsOnceBackend.calls = 0
    model = paced_model(images, backend_cls=FailsOnceBackend)
    events = []
    sink = Sink()
    models = Models(model)
    loop = make_loop(models, queued(images, sources=("cam",), per_source=16), sink, on_event=events.append)
    try:
        loop.serve(until_sources_end=True)
    finally:
        model.close()
    # Batches of 4 frames, one backend call each: the 5th call is the 1st chunk of the 2nd batch (frames 4-7).
    assert loop.inference_errors == 1 and [e["event"] for e in events] == ["inference_error"]
    assert "device lost" in events[0]["error"]
    assert [r["frame_id"] for r in sink.results] == [0, 1, 2, 3] + list(range(8, 16))
    assert loop.failed_frames == 4 and loop.taken == 16
    assert models.recorded == [(4, False), (4, True), (4, False), (4, False)]


def test_pause_with_chunks_in_flight_finishes_what_was_taken_then_serves_nothing(images):
    probe, model, frames, sink, stop, loop, thread = started_loop(images)
    feeding = threading.Event()
    fed = [1] * QUEUED_AT_START

    def feed():
        while not stop.is_set():
            if feeding.is_set():
                try:
                    frames.put(wide_frame(images, len(fed)), timeout=0.05)
                    fed.append(1)
                except queue.Full:
                    pass
            else:
                feeding.wait(0.05)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        feeding.set()
        assert wait_for(lambda: len(sink.results) >= 20, timeout=WAIT_S), "only %d results" % len(sink.results)
        loop.pause(timeout=WAIT_S)  # chunks are on the backend and letterboxed right now
        # The second idle turn from here began after the pause was seen: everything taken has been served.
        turns = loop.progress.idle_turns
        assert wait_for(lambda: loop.progress.idle_turns >= turns + 2, timeout=WAIT_S), "the paused loop never idled"
        assert loop.published == loop.taken, "taken before the pause, not finished: %d taken, %d published" % (
            loop.taken, loop.published)
        settled, turns = len(sink.results), loop.progress.idle_turns
        # The loop turns idle five times while frames wait in the queue: unpaused, it would have taken them.
        assert wait_for(lambda: loop.progress.idle_turns >= turns + 5 and frames.qsize() > 0, timeout=WAIT_S), \
            "the paused loop did not turn with frames waiting"
        assert len(sink.results) == settled == loop.taken, "results kept coming while paused"
        feeding.clear()
        stale = loop.resume(timeout=WAIT_S)
        assert stale > 0 and loop.dropped_on_resume == stale
        feeding.set()
        assert wait_for(lambda: len(sink.results) >= settled + 10, timeout=WAIT_S), \
            "serving did not resume: %d results" % len(sink.results)
    finally:
        stop.set()
        feeder.join(10)
        thread.join(30)
        model.close()
    assert probe.forced, probe.NOT_FORCED
    assert loop.taken == loop.published == len(sink.results)
    assert [r["frame_id"] for r in sink.results] == sorted(r["frame_id"] for r in sink.results)


def test_a_rollback_decided_between_batches_serves_each_frame_on_one_model(images):
    """The model source swaps (and releases the model it leaves) inside between_batches, as the manager's
    automatic rollback does; frames keep coming and none runs on a released model."""
    pending, confirmed = paced_model(images, version="2.0.0"), paced_model(images, version="1.0.0")
    probe = OverlapProbe()
    probe.wrap(pending)
    probe.wrap(confirmed)

    class RollingBack(Models):
        def between_batches(self):
            if self.current is pending and len(self.recorded) >= 5:  # the window's verdict: roll back
                self.current = confirmed
                pending.close()

    models = RollingBack(pending)
    sink = Sink()
    loop = make_loop(models, queued(images, sources=("cam",), per_source=48), sink)
    try:
        loop.serve(until_sources_end=True)
    finally:
        pending.close()
        confirmed.close()
    assert probe.forced, probe.NOT_FORCED
    assert loop.inference_errors == 0 and loop.taken == len(sink.results) == 48
    versions = [r["model"]["version"] for r in sink.results]
    first_confirmed = versions.index("1.0.0")
    assert first_confirmed >= 5 * MAX_BATCH
    assert set(versions[:first_confirmed]) == {"2.0.0"} and set(versions[first_confirmed:]) == {"1.0.0"}
    assert [r["frame_id"] for r in sink.results] == list(range(48))


def fails_on_call(model, method, number, error):
    """Make the model's ``number``-th call of ``method`` (counted from now) raise ``error``; the others run."""
    real = getattr(model, method)
    calls = []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise error
        return real(*args, **kwargs)

    setattr(model, method, once)


def test_a_frame_the_model_cannot_take_fails_its_batch_not_the_loop(images):
    """A zero-size frame makes planning the batch raise (no tier fits it): that batch fails, the others are served."""
    model = paced_model(images)
    frames = queued(images, sources=("cam",), per_source=16)
    items = [frames.get_nowait() for _ in range(16)]
    items[5] = replace(items[5], image=np.zeros((0, 0, 3), np.uint8))
    for item in items:
        frames.put(item)
    events, sink, models = [], Sink(), Models(model)
    loop = make_loop(models, frames, sink, on_event=events.append)
    try:
        loop.serve(until_sources_end=True)
    finally:
        model.close()
    assert [r["frame_id"] for r in sink.results] == [0, 1, 2, 3] + list(range(8, 16))  # frames 4-7: one batch
    assert loop.inference_errors == 1 and loop.failed_frames == 4 and loop.taken == 16
    assert [e["event"] for e in events] == ["inference_error"] and "positive" in events[0]["error"]
    assert sorted(models.recorded) == [(4, False)] * 3 + [(4, True)]  # its probation window saw the failure


def test_a_batch_the_new_model_cannot_letterbox_fails_alone_after_a_swap(images):
    """The model changes between batches and letterboxing the prepared batch again, for the new model, raises:
    that batch fails, the frames before it were served on the old model and those after it on the new one, and
    each model's observation window is told only of its own batches."""
    old, new = paced_model(images, version="1.0.0"), paced_model(images, version="2.0.0")
    old_prepares = []
    prepare = old.prepare

    def counted(*args):
        old_prepares.append(1)
        return prepare(*args)

    old.prepare = counted
    fails_on_call(new, "prepare", 1, RuntimeError("letterbox failed once"))
    sink = Sink()

    class Swapping(Models):
        def between_batches(self):
            if self.current is old and len(sink.results) >= MAX_BATCH:
                self.current = new

        def record_batch(self, frames, infer_ms_per_frame, failed):
            self.recorded.append((self.current.manifest.version, failed))

    events, models = [], Swapping(old)
    loop = make_loop(models, queued(images, sources=("cam",), per_source=24), sink, on_event=events.append)
    try:
        loop.serve(until_sources_end=True)
    finally:
        old.close()
        new.close()
    versions = [r["model"]["version"] for r in sink.results]
    on_old = versions.count("1.0.0")
    assert on_old >= MAX_BATCH and versions == ["1.0.0"] * on_old + ["2.0.0"] * (20 - on_old)
    assert len(old_prepares) == on_old + 1  # the failed batch's first chunk was letterboxed for the old model first
    ids = [r["frame_id"] for r in sink.results]
    assert ids == list(range(on_old)) + list(range(on_old + MAX_BATCH, 24))
    assert loop.inference_errors == 1 and loop.failed_frames == MAX_BATCH and loop.taken == 24
    assert [e["event"] for e in events] == ["inference_error"] and "letterbox failed" in events[0]["error"]
    # Each window sees its own batches: the old model's last batch, decoded after the swap, counts for neither.
    assert models.recorded == ([("1.0.0", False)] * (on_old // MAX_BATCH - 1) + [("2.0.0", True)]
                               + [("2.0.0", False)] * ((20 - on_old) // MAX_BATCH))


def test_a_failed_decode_of_a_batch_counts_as_a_failed_batch_for_probation(images):
    """The decode of a batch's last chunk raises: the batch is recorded as failed, once, not as served."""
    model = paced_model(images)
    fails_on_call(model, "decode", 2 * MAX_BATCH, ValueError("outputs unreadable once"))  # batch 2's last chunk
    events, sink, models = [], Sink(), Models(model)
    loop = make_loop(models, queued(images, sources=("cam",), per_source=16), sink, on_event=events.append)
    try:
        loop.serve(until_sources_end=True)
    finally:
        model.close()
    assert [r["frame_id"] for r in sink.results] == [0, 1, 2, 3] + list(range(8, 16))
    assert loop.inference_errors == 1 and loop.failed_frames == 4
    assert [e["event"] for e in events] == ["inference_error"] and "unreadable" in events[0]["error"]
    assert models.recorded == [(4, False), (4, True), (4, False), (4, False)]


class FlakySink(Sink):
    """A sink whose state database refuses one result (a fault other than a full disk raises through it)."""

    def __init__(self, fail_frame_id):
        super().__init__()
        self.fail_frame_id = fail_frame_id

    def publish_result(self, source, payload):
        if payload["frame_id"] == self.fail_frame_id:
            raise sqlite3.OperationalError("disk I/O error")
        super().publish_result(source, payload)


def test_a_sink_that_raises_costs_that_result_counted_not_the_loop(images):
    model = paced_model(images)
    sink, models = FlakySink(fail_frame_id=5), Models(model)
    seen = []
    loop = make_loop(models, queued(images, sources=("cam",), per_source=12), sink)
    loop.on_result = lambda frame, payload: seen.append(payload["frame_id"])
    try:
        loop.serve(until_sources_end=True)
    finally:
        model.close()
    assert [r["frame_id"] for r in sink.results] == [i for i in range(12) if i != 5]
    assert seen == list(range(12))  # the callback still sees every frame, the lost one included
    assert loop.publish_errors == 1 and loop.published == 11 and loop.telemetry()["publish_errors"] == 1
    assert loop.inference_errors == 0
