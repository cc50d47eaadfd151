"""The DVPP decoder seam at its boundary: access units of a real RTSP camera (the rig), read by OpenCV without
decoding, go to a VDEC channel of FakeAclMedia (tests/fakes/fake_acl_media.py: a stand-in for pyACL's media
API, NOT pyACL, decoding nothing), and its pictures come back through the worker. Nothing here ran on Ascend
hardware."""

import json
import sys

import pytest

from agent.pipeline.sources import dvpp, worker
from agent.pipeline.sources.base import WORKER_HEADER, DecoderError
from tests.fakes.fake_acl_media import FakeAclMedia
from tests.support.camera_rig import Camera, require_rig

SIZE = (640, 360)


@pytest.fixture(scope="module")
def rig():
    require_rig()


@pytest.fixture
def fake(monkeypatch):
    acl = FakeAclMedia(frame_size=SIZE)
    monkeypatch.setitem(sys.modules, "acl", acl)
    return acl


def spec(uri):
    return {"uri": uri, "kind": "stream", "decoder": "dvpp", "open_timeout_s": 5.0, "read_timeout_s": 5.0,
            "max_fps": 0.0}


def brightness(image):
    return int(image.mean().round())


def test_access_units_go_to_vdec_and_its_pictures_come_back_in_order(rig, fake):
    with Camera(fps=25, size=SIZE) as camera:
        capture = dvpp.open_dvpp(spec(camera.url()))
        try:
            assert capture.isOpened()
            frames = []
            for _ in range(20):
                assert capture.grab()
                ok, image = capture.retrieve()
                assert ok
                frames.append((image, capture.get(0)))  # CAP_PROP_POS_MSEC: the access unit's timestamp
        finally:
            capture.release()
    assert fake.violations == []
    assert all(image.shape == (SIZE[1], SIZE[0], 3) for image, _ in frames)
    levels = [brightness(image) for image, _ in frames]
    assert levels == sorted(levels) and len(set(levels)) == 20, levels  # one picture per access unit, in order
    stamps = [pts for _, pts in frames]
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0], stamps
    first = fake.access_units[0][1]
    assert first.startswith(b"\x00\x00\x00\x01") and first[4] & 0x1F == 7, first  # SPS (extradata) leads
    assert len(fake.access_units) >= 20 and fake.count("acl.media.vdec_send_frame") == len(fake.access_units)
    assert fake.count("acl.rt.process_report") > 0  # the callbacks ran on our report thread
    assert fake.live_media() == {"dvpp_memory": 0, "channel_descs": 0, "channels": 0, "stream_descs": 0,
                                 "pic_descs": 0, "threads": 0, "contexts": 0, "device_refs": 0}


def test_the_worker_serves_vdec_pictures_through_its_wire_format(rig, fake, monkeypatch):
    opened = []
    original = dvpp.open_dvpp
    monkeypatch.setattr(dvpp, "open_dvpp", lambda s: opened.append(original(s)) or opened[-1])
    messages = []

    class Channel:
        """The pipe to the daemon; it breaks after five frames, as a daemon that went away does."""

        def __init__(self):
            self.buffer = b""

        def write(self, data):
            self.buffer += bytes(data)

        def flush(self):
            while len(self.buffer) >= WORKER_HEADER.size:
                kind, meta_len, payload_len = WORKER_HEADER.unpack_from(self.buffer)
                end = WORKER_HEADER.size + meta_len + payload_len
                meta = json.loads(self.buffer[WORKER_HEADER.size:WORKER_HEADER.size + meta_len])
                messages.append((kind, meta, payload_len))
                self.buffer = self.buffer[end:]
            if sum(kind == b"FRAM" for kind, _, _ in messages) >= 5:
                raise BrokenPipeError

    monkeypatch.setattr(worker, "_channel", Channel())
    with Camera(fps=25, size=SIZE) as camera:
        try:
            with pytest.raises(BrokenPipeError):
                worker.serve(spec(camera.url()))
        finally:
            for capture in opened:
                capture.release()
    assert messages[0][0] == b"OPEN" and messages[0][1]["fps"] == 25
    frames = [(meta, size) for kind, meta, size in messages if kind == b"FRAM"]
    assert len(frames) == 5 and all(m["h"] == SIZE[1] and m["w"] == SIZE[0] and n == SIZE[0] * SIZE[1] * 3
                                    for m, n in frames)
    # the capture time comes from the access unit's timestamp (the first ones of a session can be <= 0)
    assert frames[-1][0]["ts_source"] == "stream"
    assert fake.violations == [] and fake.live_media()["channels"] == 0


def test_a_refused_channel_is_a_config_error_naming_the_call_and_nothing_is_left(rig, fake):
    fake.fail_on("acl.media.vdec_create_channel", 100000)
    with Camera(fps=25, size=SIZE) as camera:
        with pytest.raises(DecoderError) as caught:
            dvpp.open_dvpp(spec(camera.url()))
    assert "vdec_create_channel" in str(caught.value) and "100000" in str(caught.value)
    live = fake.live_media()
    assert live == dict.fromkeys(live, 0), live
