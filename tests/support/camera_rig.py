"""The camera rig for tests: :mod:`agent.devtools.camera_rig`, with a skip that names what is missing, and the
daemon the camera tests run in-process (:class:`CameraDaemon`)."""

import threading
import time

import pytest

from agent.devtools import camera_rig
from agent.devtools.camera_rig import Blackhole, Camera, frame_age_ms, frame_capture, frame_intact, free_port

__all__ = ["Blackhole", "Camera", "CameraDaemon", "frame_age_ms", "frame_capture", "frame_intact", "free_port",
           "require_rig"]


def require_rig() -> None:
    try:
        camera_rig.require_rig()
    except camera_rig.RigMissing as exc:
        pytest.skip(str(exc))


class CameraDaemon:
    """The daemon in a thread; ``results`` holds (published at, age read from the pixels, payload, counter);
    with ``check_intact``, ``broken`` lists the counters (None: unreadable) of published frames whose pixels are
    not the picture a ``moving`` camera drew (:func:`frame_intact`)."""

    def __init__(self, tmp_path, broker, sources, check_intact=False, **extra):
        from agent.cli.demo import DEMO_BUNDLE
        from agent.config.daemon_config import parse_daemon_config
        from agent.daemon import Daemon

        self.results = []
        self.broken = []
        self.check_intact = check_intact
        self.lock = threading.Lock()
        config = parse_daemon_config({
            "device_id": "cams", "state_dir": str(tmp_path / "state"),
            "model": {"bundle": DEMO_BUNDLE, "backend": "opencv", "observation_s": 0},
            "sources": sources, "mqtt": {"host": broker.host, "port": broker.port},
            "publish": {"telemetry_interval_s": 1.0}, **extra})
        self.daemon = Daemon(config, on_result=self._on_result)
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self.daemon.run, daemon=True)
        self.thread.start()

    def _on_result(self, frame, payload):
        now = time.time()
        read = frame_capture(frame.image, int(now * 1000))
        if self.check_intact and not frame_intact(frame.image, int(now * 1000)):
            self.broken.append(None if read is None else read[1])
        with self.lock:
            self.results.append((now, None if read is None else now * 1000 - read[0], payload,
                                 None if read is None else read[1]))

    def of(self, source, since=0.0):
        with self.lock:
            return [r for r in self.results if r[2]["source"] == source and r[0] >= since]

    def health(self, source):
        return self.daemon.loop.sources.counters().get(source, {"state": None})  # {} until sources start

    def stop(self):
        self.daemon.request_stop("test")
        self.thread.join(30)
        assert not self.thread.is_alive()
