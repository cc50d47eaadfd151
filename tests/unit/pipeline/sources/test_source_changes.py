"""Issue 31 items 3, 5 and 7 at the source set: a change touches only the sources it changes, one source can be
recycled by the memory watchdog with its own cause, and a looping folder does not announce "up" at each wrap."""

import logging
import os
import queue

import cv2
import numpy as np

from agent.config.daemon_config import SourceConfig
from agent.ops.discovery import discovery_messages, removal_messages
from agent.pipeline.sources import SourceSet
from tests.conftest import wait_for


def folder(tmp_path, name, n=2):
    path = str(tmp_path / name)
    os.makedirs(path)
    for i in range(n):
        cv2.imwrite(os.path.join(path, "img_%02d.png" % i), np.full((32, 48, 3), i * 40, np.uint8))
    return path


def drain(frames):
    while True:
        try:
            frames.get_nowait()
        except queue.Empty:
            return


def test_update_stops_and_starts_only_what_changed(tmp_path):
    a = SourceConfig(name="a", uri=folder(tmp_path, "a"), loop=True, max_fps=20)
    b = SourceConfig(name="b", uri=folder(tmp_path, "b"), loop=True, max_fps=20)
    frames = queue.Queue(maxsize=4)
    sources = SourceSet([a, b], frames)
    sources.start()
    try:
        first_a, first_b = sources.readers["a"], sources.readers["b"]
        assert sources.update([a, b]) == ([], [])  # nothing changed: nothing touched
        assert sources.update([a, SourceConfig(name="b", uri=b.uri, loop=True, max_fps=5)]) == ([], ["b"])
        assert sources.readers["a"] is first_a and first_a.is_alive()
        assert sources.readers["b"] is not first_b and not first_b.is_alive()
        c = SourceConfig(name="c", uri=folder(tmp_path, "c"), loop=True, max_fps=20)
        assert sources.update([a, c]) == (["b"], ["c"])
        assert list(sources.readers) == ["a", "c"] and sources.readers["a"] is first_a
        drain(frames)
        assert wait_for(lambda: not frames.empty() and frames.get().source in ("a", "c"))
    finally:
        assert sources.stop(5.0)


def test_recycle_ends_one_session_with_its_own_cause_and_reopens_at_once(tmp_path):
    alerts = []
    config = SourceConfig(name="a", uri=folder(tmp_path, "a"), loop=True, max_fps=20, reopen_min_s=30)
    frames = queue.Queue(maxsize=4)
    sources = SourceSet([config], frames, alerts.append)
    sources.start()
    try:
        reader = sources.readers["a"]
        assert wait_for(lambda: reader.health.state == "up")
        assert sources.recycle("a", "memory", "worker RSS over its bound") and not sources.recycle("x", "memory", "")
        assert wait_for(lambda: len(alerts) == 2, timeout=5)  # reopened at once, not after reopen_min_s
    finally:
        assert sources.stop(5.0)
    assert [(a["kind"], a["figures"]["cause"]) for a in alerts] == [("source_down", "memory"), ("source_up", None)]


def test_a_looping_folder_announces_up_once_not_at_every_wrap(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="agent.pipeline.sources")
    config = SourceConfig(name="loop", uri=folder(tmp_path, "loop", n=1), loop=True)
    frames = queue.Queue(maxsize=2)
    sources = SourceSet([config], frames)
    sources.start()
    try:
        reader = sources.readers["loop"]
        assert wait_for(lambda: (drain(frames), reader.health.reopens >= 20)[1])
    finally:
        assert sources.stop(5.0)
    ups = [r for r in caplog.records if r.getMessage().startswith("source loop up")]
    assert len(ups) == 1, len(ups)


def test_removal_clears_exactly_the_removed_sources_discovery_config():
    configs = dict(discovery_messages("atlas-edge", "box", "cpu", "m", ["keep", "drop"]))
    removals = removal_messages("box", ["drop"])
    assert [payload for _topic, payload in removals] == [b""]
    assert removals[0][0] in configs and "source_drop" in removals[0][0]
