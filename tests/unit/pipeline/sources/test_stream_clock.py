"""The stream clock model (agent/pipeline/sources/clock.py): a camera's PTS mapped onto the box's clock through
jumps, drift, late frames and bursts, on synthetic arrivals (no decoder, no camera). Both interpreters."""

import time

from agent.pipeline.sources.clock import CAPTURE_LATENCY_S, CONFIRM_S, DISTRUST_S, WINDOW_S, StreamClock

FPS = 10


def feed(clock, start_s, seconds, pts_at, delay=lambda t: 0.02):
    """Frames captured every 1/FPS s from ``start_s`` on the box's clock; PTS by ``pts_at(capture time)`` (s);
    each read ``delay(t)`` s after capture. Returns [(true capture, dated capture, ts_source)]."""
    out = []
    for i in range(int(seconds * FPS)):
        t = start_s + i / FPS
        dated, source = clock.capture_time(pts_at(t) * 1000.0, t + delay(t))
        out.append((t, dated, source))
    return out


def errors(frames):
    return [dated - (t - CAPTURE_LATENCY_S) for t, dated, _s in frames]


def test_a_clean_stream_is_dated_by_its_fastest_arrival_less_the_capture_latency():
    clock = StreamClock()
    frames = feed(clock, 100.0, 10, lambda t: t - 99.0, delay=lambda t: 0.02 + 0.03 * ((t * FPS) % 3 == 0))
    assert {s for _t, _d, s in frames} == {"stream"}
    assert max(abs(e - 0.02) for e in errors(frames[5:])) < 1e-6  # the fastest read, 20 ms after capture
    assert clock.capture_time(0.0, 42.0) == (42.0 - CAPTURE_LATENCY_S, "read")  # no PTS: read time, said so
    last_pts = (frames[-1][0] - 99.0) * 1000.0
    assert clock.capture_time(last_pts, 43.0)[1] == "read"  # a PTS that does not advance


def test_a_pts_jump_back_is_read_dated_then_reanchored_never_dated_old():
    for jump in (2.0, 4.0, 10.0):
        clock = StreamClock()
        before = feed(clock, 100.0, 5, lambda t: t - 50.0)
        after = feed(clock, 105.0, 10, lambda t, jump=jump: t - 50.0 - jump)
        assert max(abs(e) for e in errors(before + after)) < 0.05, jump  # never the jump's seconds old
        assert {s for _t, _d, s in after[:3]} == {"read"}  # unconfirmed: the read time, said so
        assert {s for _t, _d, s in after[int(CONFIRM_S * FPS) + 2:]} == {"stream"}, jump
        assert clock.jumps == 1


def test_a_pts_jump_forward_is_taken_at_once():
    clock = StreamClock()
    feed(clock, 100.0, 5, lambda t: t - 99.0)
    after = feed(clock, 105.0, 5, lambda t: t - 99.0 + 3.0)
    assert {s for _t, _d, s in after} == {"stream"} and max(abs(e) for e in errors(after)) < 0.05


def test_a_slow_or_fast_clock_is_followed_within_the_window_s_drift():
    for rate in (0.95, 1.05, 1.0 - 50e-6):
        clock = StreamClock()
        frames = feed(clock, 100.0, 120, lambda t, rate=rate: (t - 99.0) * rate)
        worst = max(abs(e) for e in errors(frames[FPS:]))
        assert worst <= WINDOW_S * abs(1 - rate) + 0.03, (rate, worst)  # 0.1 s at 5 %, not 6 s after 120 s
        assert {s for _t, _d, s in frames} == {"stream"}


def test_a_late_frame_after_a_stall_and_its_burst_keep_their_true_age():
    clock = StreamClock()
    feed(clock, 100.0, 5, lambda t: t - 99.0)
    # The camera stalls 3 s; the frames captured meanwhile come in a burst 10 ms apart when it resumes.
    burst = [(105.0 + i / FPS, 108.0 + i * 0.01) for i in range(30)]
    dated = [clock.capture_time((t - 99.0) * 1000.0, read) for t, read in burst]
    assert all(s == "stream" for _d, s in dated)
    assert all(abs(d - (t - CAPTURE_LATENCY_S) - 0.02) < 1e-6 for (t, _r), (d, _s) in zip(burst, dated))
    assert clock.jumps == 0


def test_a_clock_that_keeps_jumping_is_not_trusted_for_a_while():
    clock = StreamClock()
    pts_base = [99.0]
    frames = feed(clock, 100.0, 3, lambda t: t - pts_base[0])
    for k in range(3):
        pts_base[0] += 2.0  # back 2 s every 3 s
        frames = feed(clock, 103.0 + 3 * k, 3, lambda t: t - pts_base[0])
    assert clock.jumps == 3 and {s for _t, _d, s in frames[-5:]} == {"read"}
    assert max(abs(e) for e in errors(frames)) < 0.05
    later = feed(clock, 112.0 + DISTRUST_S, 2, lambda t: t - pts_base[0])
    assert {s for _t, _d, s in later} == {"stream"}


class StaleCamera:
    """A live reader whose frames all say they are 10 s old until the source is degraded, then fresh ones."""

    live = True

    def __init__(self, health, stop, fresh_wanted):
        self.health, self.stop, self.fresh_wanted = health, stop, fresh_wanted
        self.fresh = 0
        self.states = []

    def read(self, timeout):
        import numpy as np

        from agent.pipeline.sources.base import Captured

        self.stop.wait(0.01)  # the fake camera's 100 fps frame clock
        self.states.append(self.health.state)
        if len(self.states) > 1000:  # 10 s of frames (20 stall timeouts): never degraded
            self.stop.set()
        if self.health.state != "degraded" and not self.fresh:
            return Captured(np.zeros((4, 4, 3), np.uint8), time.time() - 10.0, "stream")
        self.fresh += 1
        if self.fresh >= self.fresh_wanted:
            self.stop.set()
        return Captured(np.zeros((4, 4, 3), np.uint8), time.time(), "stream")


def test_a_source_that_reads_but_serves_nothing_is_degraded_clock_never_up():
    import queue
    import threading

    from agent.config.daemon_config import SourceConfig
    from agent.pipeline.sources.driver import SourceReader

    alerts, stop = [], threading.Event()
    config = SourceConfig(name="cam", uri="rtsp://10.0.0.5/s", stall_timeout_s=0.5)
    source = SourceReader(config, queue.Queue(maxsize=100), stop, alerts.append)
    camera = StaleCamera(source.health, stop, fresh_wanted=5)
    source._pump(camera)
    assert "degraded" in camera.states, "frames came in for 10 s, none went out, and the state stayed %s" % (
        sorted(set(camera.states)))
    degraded_after = camera.states.index("degraded")
    assert "up" not in camera.states[:degraded_after]  # frames came in, none went out: never up
    assert source.health.state == "up" and source.health.stale_dropped >= 10
    assert [(a["kind"], a["figures"]["cause"]) for a in alerts] == [("source_down", "clock"), ("source_up", None)]
    assert "degraded" in alerts[0]["message"]
