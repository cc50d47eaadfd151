"""The camera rig for tests: :mod:`agent.devtools.camera_rig`, with a skip that names what is missing."""

import pytest

from agent.devtools import camera_rig
from agent.devtools.camera_rig import Blackhole, Camera, frame_age_ms, frame_capture, free_port

__all__ = ["Blackhole", "Camera", "frame_age_ms", "frame_capture", "free_port", "require_rig"]


def require_rig() -> None:
    try:
        camera_rig.require_rig()
    except camera_rig.RigMissing as exc:
        pytest.skip(str(exc))
