"""A box without a battery-backed clock: NTP steps the wall clock back an hour, then forward a day, mid-serving.

The wall clock is injected (``time.time`` of this process, which the daemon runs in, replaced by real time
plus an offset the test steps); the monotonic clock runs on. Durations, windows and rates must come from the
monotonic clock, so across both steps:

* the observation window of a deployed model neither ends at the forward step nor stretches by an hour;
* the command rate limit (token bucket) and the per-source publish limit (``publish.max_rate_hz``) keep
  letting through what they let through before;
* the watchdog raises no hang and keeps pinging systemd (a real ``NOTIFY_SOCKET`` the test owns);
* results keep wall time for people, and the per-source sequence number keeps increasing.
"""

import json
import os
import threading
import time

import pytest

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from tests.conftest import WAIT_S, wait_for
from tests.support.daemon_rig import new_version
from tests.support.lifecycle_support import NOISE_PROOF_FACTOR
from tests.support.notify_support import NotifyListener

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

HOUR_S = 3600.0
DAY_S = 86400.0
OBSERVATION_S = 6.0  # long enough to step the clock inside the window, short enough for a test
SOURCE_FPS = 20.0
PUBLISH_HZ = 4.0  # well below the source: the limit, not the source, sets the result rate
RATE_SPAN_S = 2.0
RATE_SLACK = 3  # results published just before the span that arrive inside it
WATCHDOG_USEC = 3_000_000  # a ping every 1.5 s
INFERENCE_DEADLINE_S = 5.0  # far above a 320x240 OpenCV inference, even on a loaded test machine
FINAL = ("succeeded", "failed")


class SteppedWallClock:
    """``time.time`` as a box sees it across NTP steps: the real wall clock plus an offset the test changes."""

    def __init__(self) -> None:
        self.real = time.time
        self.offset = 0.0

    def __call__(self) -> float:
        return self.real() + self.offset


def test_wall_clock_steps_change_no_window_rate_deadline_or_order(tmp_path, mosquitto, probe_factory,
                                                                    monkeypatch):
    from agent.config.daemon_config import parse_daemon_config
    from agent.daemon import Daemon

    wall = SteppedWallClock()
    notify = NotifyListener()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.path)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=((240, 320),), seed=3)
    config = parse_daemon_config({
        "device_id": "clock", "device": "cpu-dev", "state_dir": str(tmp_path / "state"),
        # The latency rule is not under test: on two loaded cores a median can double and roll the model back
        # before its window ends, which would read as a window cut short by the clock step.
        "model": {"bundle": DEMO_BUNDLE, "backend": "opencv", "observation_s": OBSERVATION_S,
                  "latency_regression": NOISE_PROOF_FACTOR},
        "sources": [{"name": "cam", "uri": str(frames), "loop": True, "max_fps": SOURCE_FPS}],
        "mqtt": {"host": mosquitto.host, "port": mosquitto.port},
        "publish": {"max_rate_hz": PUBLISH_HZ, "telemetry_interval_s": 0.5},
        "watchdog": {"interval_s": 0.5, "inference_deadline_s": INFERENCE_DEADLINE_S},
    })
    # The probes note each message's arrival on the monotonic clock: rates are judged on it.
    results = probe_factory(mosquitto, ["atlas-edge/clock/results/cam"])
    telemetry = probe_factory(mosquitto, ["atlas-edge/clock/telemetry"])
    probe = probe_factory(mosquitto, ["atlas-edge/clock/ack/#", "atlas-edge/clock/telemetry/alert"])

    def command(verb, request_id, **fields):
        def final():
            return [a for a in probe.on("atlas-edge/clock/ack/%s" % request_id) if a["state"] in FINAL]

        probe.publish("atlas-edge/clock/cmd/%s" % verb, json.dumps(dict(fields, request_id=request_id)).encode())
        assert wait_for(final), "no final ack for %s" % request_id
        return final()[0]

    monkeypatch.setattr(time, "time", wall)  # from here on, every time.time() call sees the stepped clock
    daemon = Daemon(config)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: results.count() >= 4), "no results"
        source, sha = new_version(tmp_path, os.path.join(config.state_dir, "bundles"), "1.1.0")
        before_deploy = time.monotonic()  # the window starts after this
        deployed = command("deploy", "deploy-1", bundle=source, sha256=sha)
        assert deployed["state"] == "succeeded", deployed
        assert daemon.models.status().get("pending") is not None

        # Forward a day inside the window: a wall-clock window would end now, a wall-clock watchdog would
        # see every call in flight as a day overdue.
        wall.offset = DAY_S
        stepped = time.time()
        # The serving loop has judged the window on the stepped clock: two telemetry messages stamped after the
        # step (0.5 s of loop turns apart, each turn between batches judges the pending model's window).
        assert wait_for(lambda: len([t for _topic, t in telemetry.json() if t["ts"] >= stepped]) >= 2), \
            "no telemetry after the forward step"
        still_pending = daemon.models.status().get("pending") is not None
        assert still_pending or time.monotonic() - before_deploy >= OBSERVATION_S, "window ended at the step"
        # The publish limit still holds after the forward step.
        span_from = time.monotonic()
        time.sleep(RATE_SPAN_S)  # the span the rate is measured over, not synchronisation
        published = len(results.json(since=span_from)) - len(results.json(since=span_from + RATE_SPAN_S))
        assert published <= PUBLISH_HZ * RATE_SPAN_S + RATE_SLACK, published

        # Back an hour from there: a wall-clock window would last an hour longer, a wall-clock rate limit or
        # token bucket would let nothing through for an hour, a wall-clock ping interval would stop pings.
        wall.offset = DAY_S - HOUR_S
        back = time.monotonic()
        pings_at_back = len(notify.received("WATCHDOG=1"))
        assert wait_for(lambda: daemon.models.status().get("pending") is None, timeout=WAIT_S + OBSERVATION_S)
        status = daemon.models.status()
        assert time.monotonic() - before_deploy >= OBSERVATION_S, status  # a rollback shows in its slots
        assert status["slots"][status["serving"]]["version"] == "1.1.0"  # confirmed, not rolled back
        assert wait_for(lambda: len(results.json(since=back)) >= 3), "results stopped after the backward step"
        for i in range(5):
            answered = command("status", "status-%d" % i)
            assert answered["state"] == "succeeded", answered
        assert 0 <= answered["result"]["uptime_s"] < HOUR_S  # counted from start, not from the wall clock
        assert wait_for(lambda: len(notify.received("WATCHDOG=1")) >= pings_at_back + 2), "watchdog pings stopped"
        assert not [a for a in probe.on("atlas-edge/clock/telemetry/alert") if a["kind"] == "hang"]
    finally:
        daemon.request_stop("test over")
        thread.join(60)
        notify.close()
    # The per-source sequence number never went backwards across the steps (consumers order results by it).
    numbers = [r["seq"] for _topic, r in results.json()]
    assert len(numbers) > 10 and all(b > a for a, b in zip(numbers, numbers[1:])), numbers
    # The steps were real to the daemon: its telemetry's wall time jumped a day, then went back an hour.
    stamps = [t["ts"] for _topic, t in telemetry.json()]
    assert max(stamps) - min(stamps) > DAY_S - HOUR_S
    assert any(later < earlier - HOUR_S / 2 for earlier, later in zip(stamps, stamps[1:]))
