"""Damaged frames (agent/pipeline/sources/damage.py, health.py): FFmpeg's log lines tied to the frame whose decoding
wrote them, the spell until a clean keyframe, and a source whose damaged share passes the bound. Both
interpreters; no decoder (the rig's test is tests/system/cameras/test_camera_damage.py)."""

from agent.pipeline.sources.damage import DamageTracker

CONCEAL = "[OPENCV:FFMPEG:32] concealing 440 DC, 440 AC, 440 MV errors in P frame\n"


def test_a_reported_frame_and_those_after_it_until_a_clean_keyframe_are_damaged():
    tracker = DamageTracker()
    frames = [("", True), ("", False), (CONCEAL, False), ("", False), ("", False), ("", True), ("", False)]
    assert [tracker.frame(text, key) for text, key in frames] == [
        (False, False), (False, False), (True, True), (False, True), (False, True), (False, False), (False, False)]
    assert tracker.frame("[h264 @ 0x1] error while decoding MB 3 7, bytestream -5\n", True) == (True, True)
    assert tracker.frame("", False) == (False, True)  # a keyframe that itself reported damage ends nothing


def test_a_line_cut_by_the_pipe_counts_once_complete_and_other_lines_are_not_damage():
    tracker = DamageTracker()
    assert tracker.frame("[OPENCV:FFMPEG:32] concealing 44", False) == (False, False)
    assert tracker.frame("0 DC, 440 AC, 440 MV errors in P frame\n", False) == (True, True)
    clean = DamageTracker()
    for line in ("[OPENCV:FFMPEG:40] Reinit context to 640x368, pix_fmt: yuv420p\n",
                 "[OPENCV:FFMPEG:40] setting jitter buffer size to 0\n", ""):
        assert clean.frame(line, False) == (False, False)
    assert DamageTracker().frame("[rtsp @ 0x2] RTP: missed 3 packets\n", False) == (True, True)


def test_a_source_whose_damaged_share_passes_the_bound_is_degraded_then_up_again():
    from agent.pipeline.sources.health import DAMAGED_SHARE, SourceHealth

    now = [0.0]
    alerts = []
    health = SourceHealth("dock", "rtsp://10.0.0.5/s", alerts.append, clock=lambda: now[0])
    for _ in range(10):  # a clean second
        now[0] += 0.1
        health.frame_in()
        health.frame_out()
    assert health.state == "up"
    now[0] += 0.1
    health.frame_in(skipped=0, decode_errors=1, damaged=9)  # 9 of the last 10 frames damaged
    assert health.state == "degraded" and health.last_error["cause"] == "damaged"
    assert 9 / 20 > DAMAGED_SHARE and health.report()["damaged_frames"] == 9
    health.frame_out()
    assert health.state == "degraded"  # a good frame among many damaged: still degraded
    for _ in range(60):  # six clean seconds: the window forgets the damage
        now[0] += 0.1
        health.frame_in()
        health.frame_out()
    assert health.state == "up"
    assert [(a["kind"], a["figures"]["cause"]) for a in alerts] == [("source_down", "damaged"), ("source_up", None)]


def test_damage_notes_are_counted_and_a_spell_past_the_stall_timeout_is_named_no_keyframe():
    import pytest

    from agent.config.daemon_config import SourceConfig
    from agent.pipeline.sources.base import SourceUnavailable
    from agent.pipeline.sources.damage import DAMAGE_NOTE_S
    from agent.pipeline.sources.stream import StreamReader

    reader = StreamReader(SourceConfig(name="dock", uri="rtsp://10.0.0.5/s", stall_timeout_s=5.0))
    assert reader._damage_note({"damaged": 10, "decode_errors": 3, "broken_s": 1.0}) is None
    assert reader._damage_noted == (10, 3)  # added to the next frame's counts
    with pytest.raises(SourceUnavailable) as raised:  # a note before the stall timer would say "stalled"
        reader._damage_note({"damaged": 10, "decode_errors": 0, "broken_s": 5.0 - DAMAGE_NOTE_S})
    assert raised.value.cause == "no_keyframe" and "20 withheld, 3 reported" in str(raised.value)


OPEN_SIZE = "[OPENCV:FFMPEG:40] Reinit context to 640x368, pix_fmt: yuv420p\n"  # the worker's lines, as forwarded
BAD_SPS = "[OPENCV:FFMPEG:40] Reinit context to 240x96, pix_fmt: yuv420p\n"  # the damaged SPS


def _reader_fed(*chunks):
    """A StreamReader whose worker's stderr gave ``chunks`` (each one read), and what it made of them."""
    import os

    from agent.config.daemon_config import SourceConfig
    from agent.pipeline.sources.stream import StreamReader

    reader = StreamReader(SourceConfig(name="dock", uri="rtsp://10.0.0.5/s"))
    for chunk in chunks:
        read, write = os.pipe()
        os.write(write, chunk.encode())
        os.close(write)
        reader._read_stderr(read)
        os.close(read)
    return reader


def test_a_size_below_the_floor_is_damage_counted_by_the_worker_and_never_a_reopen():
    tracker = DamageTracker()
    assert tracker.frame(OPEN_SIZE, True) == (False, False)
    assert tracker.frame(BAD_SPS, False) == (True, True)  # reported: counted and withheld
    assert tracker.frame("", False) == (False, True)
    assert tracker.frame(OPEN_SIZE, True) == (False, False)  # the camera's SPS back on a clean keyframe
    reader = _reader_fed(OPEN_SIZE, BAD_SPS, OPEN_SIZE)
    assert reader._resized is None and reader.sizes.damaged == 1 and reader.sizes.coded == (640, 368)
    assert _reader_fed(OPEN_SIZE, "[OPENCV:FFMPEG:40] Reinit context to 1280x720, pix_fmt: yuv420p\n")._resized \
        == (1280, 720)  # a plausible change, no errors: reopened for, as before


def test_a_new_size_logged_with_decoder_errors_is_damage_if_it_flips_back_within_a_second():
    from agent.pipeline.sources.damage import FLIP_BACK_S, SizeWatch

    errors = "[OPENCV:FFMPEG:16] [h264 @ 0x1] error while decoding MB 3 7, bytestream -5\n"
    big = "[OPENCV:FFMPEG:40] Reinit context to 1920x1088, pix_fmt: yuv420p\n"
    reader = _reader_fed(OPEN_SIZE, big + errors, OPEN_SIZE)  # read with errors, then back: damage
    assert reader._resized is None and reader.sizes.damaged == 1 and reader.sizes.suspect is None
    now = [0.0]
    sizes = SizeWatch(clock=lambda: now[0])
    assert sizes.seen((640, 368), False) is None and sizes.coded == (640, 368)
    assert sizes.seen((1920, 1088), True) is None and sizes.due() is None  # a suspect, not yet believed
    now[0] += FLIP_BACK_S - 0.1
    assert sizes.due() is None
    now[0] += 0.1
    assert sizes.due() == (1920, 1088) and sizes.damaged == 0  # it held: a resolution change after all
    assert sizes.seen((1920, 1088), False) is None  # the size it has: nothing to do


class _WithholdingReader:
    """A live reader whose pictures all arrive damaged: nothing handed over, DAMG notes only (``withholding``)."""

    live = True

    def __init__(self, withholding):
        self.withholding = withholding

    def read(self, timeout):
        import time
        time.sleep(min(timeout, 0.01))
        return None


def test_a_stall_timer_that_runs_out_while_every_picture_is_withheld_names_no_keyframe_not_stalled():
    import queue
    import threading

    import pytest

    from agent.config.daemon_config import SourceConfig
    from agent.pipeline.sources.base import SourceUnavailable
    from agent.pipeline.sources.driver import SourceReader

    causes = []
    for withholding in (True, False):
        config = SourceConfig(name="dock", uri="rtsp://10.0.0.5/s", stall_timeout_s=0.2)
        driver = SourceReader(config, queue.Queue(), threading.Event())
        with pytest.raises(SourceUnavailable) as raised:
            driver._pump(_WithholdingReader(withholding))
        causes.append(raised.value.cause)
    assert causes == ["no_keyframe", "stalled"]
