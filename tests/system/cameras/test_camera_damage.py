"""Damaged frames (issue 31 item 2), on the rig: the camera cuts one RTP packet out of a frame (a truncated frame
to the decoder, as UDP loss or a broken write leaves it); its frames' body changes grey with the counter, so a
concealed frame, or one predicted from it until the next keyframe, is seen in the pixels of the published frame
(tests/support/camera_rig.py, ``frame_intact``), and a second decoder on the same stream
(tests/support/reference_decoder.py) says which frames the decoder reported damaged: the box must publish none
of them. Every frame is served (``max_fps`` 10 on a 10 fps camera). The same holds over UDP with one predicted
frame in 12 losing its third packet (2.8 % of the packets, by count: drawn at random, 3 % of the packets gave
the witness no damage to name in 1 run of 5). Measured: on a flat picture FFmpeg's
concealment often restores the right grey, so the pixels alone miss most damage; the decoder's word does not.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from agent.cli.demo import DEMO_BUNDLE
from tests.conftest import MqttProbe, wait_for
from tests.support.camera_rig import Camera, CameraDaemon, require_rig

pytestmark = [
    pytest.mark.camera_rig,
    pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                       reason="examples/demo-bundle is missing (make demo-bundle)"),
]
BURSTS = 4
GAP_S = 3.0  # between bursts: three keyframes (one a second)
LOSS_EVERY = 12  # the UDP case: one predicted frame in 12 loses its third packet (2.8 % of the packets)
LOSS_S = 12.0
LOSS_FRAMES = int(LOSS_S * 10 / LOSS_EVERY)  # frames the rig damages while the witness reads (10 fps)


@pytest.fixture(scope="module")
def rig():
    require_rig()


def test_truncated_frames_are_counted_and_never_published(rig, tmp_path, mosquitto):
    with Camera(fps=10, moving=True) as camera:
        box = CameraDaemon(tmp_path, mosquitto, [{"name": "dock", "uri": camera.url(), "max_fps": 10}],
                           check_intact=True)
        try:
            assert wait_for(lambda: len(box.of("dock")) >= 20, timeout=30), "no results from the camera"
            assert box.broken == [], "the clean stream already published frames not as drawn: %s" % box.broken
            witness = subprocess.Popen([sys.executable, "-m", "tests.support.reference_decoder", camera.url(),
                                        str(BURSTS * GAP_S + 3)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert witness.stdout.readline().strip() == b"ready"
            start = time.time()
            for _ in range(BURSTS):
                camera.damage(2)
                time.sleep(GAP_S)  # the span between bursts, not synchronisation
            health = box.health("dock")
            window = box.of("dock", since=start)
            seen = [json.loads(line) for line in witness.communicate(timeout=30)[0].splitlines()]
        finally:
            box.stop()
    reported = {f["counter"] for f in seen if f["reported"] and f["counter"] is not None}
    published = {c for _t, _a, _p, c in window}
    print("witness: %d frames, reported damaged %s, unreadable %d" % (
        len(seen), sorted(reported), sum(f["counter"] is None for f in seen)))
    print("%d results in %.0f s; published not as drawn: %s; decode_errors %d, damaged_frames %d" % (
        len(window), BURSTS * GAP_S, box.broken, health["decode_errors"], health.get("damaged_frames", 0)))
    assert len(reported) >= BURSTS - 1, "the witness saw too little damage to judge: %s" % sorted(reported)
    assert not reported & published, "published frames the decoder reported damaged: %s" % sorted(
        reported & published)
    assert box.broken == [], "published frames whose pixels are not the camera's: counters %s" % box.broken
    # every frame the witness's decoder reported is counted (a burst that FFmpeg logs nothing for is missed by
    # both decoders alike: 2 runs of 4 saw 3 bursts reported, the witness's bound above)
    assert health["decode_errors"] >= max(len(reported), BURSTS - 1), health
    assert health.get("damaged_frames", 0) >= health["decode_errors"], health
    assert len(window) >= 0.5 * 10 * BURSTS * GAP_S, "%d results" % len(window)  # the rest still flows


def test_a_source_mostly_damaged_is_degraded_alerted_and_up_again(rig, tmp_path, mosquitto):
    alerts = MqttProbe(mosquitto, ["atlas-edge/cams/telemetry/alert"])
    with Camera(fps=10, moving=True) as camera:
        box = CameraDaemon(tmp_path, mosquitto, [{"name": "dock", "uri": camera.url(), "max_fps": 10}],
                           check_intact=True)
        try:
            assert wait_for(lambda: len(box.of("dock")) >= 20, timeout=30), "no results from the camera"
            camera.damage(10 * 8)  # packets cut from every frame for 8 s
            assert wait_for(lambda: box.health("dock")["state"] == "degraded", timeout=15), box.health("dock")
            health = box.health("dock")
            assert wait_for(lambda: box.health("dock")["state"] == "up", timeout=30), box.health("dock")
            after = time.time()
            assert wait_for(lambda: box.of("dock", since=after), timeout=10)
            counted = box.health("dock")  # the whole 8 s burst counted (at degrading, a loaded reader may be at 18)
        finally:
            box.stop()
            alerts.close()
    print("while damaged: %s" % {k: health[k] for k in ("state", "decode_errors", "damaged_frames", "fps_out")})
    assert health["last_error"]["cause"] == "damaged", health
    assert counted["damaged_frames"] >= 20, counted
    kinds = [(a["kind"], a["figures"]["cause"]) for a in alerts.on("atlas-edge/cams/telemetry/alert")
             if a.get("source") == "dock"]
    # Under load the driver's stall timer can run out before the damaged share is judged: the same spell is then
    # named no_keyframe first (never stalled: pictures kept arriving), and damaged after the reopen; with both test
    # lanes side by side it was no_keyframe only, once in 3 runs (the health above said damaged all the same).
    spell = [cause for kind, cause in kinds if kind == "source_down"]
    assert spell and set(spell) <= {"damaged", "no_keyframe"}, kinds
    assert kinds[0][0] == "source_down" and kinds[-1] == ("source_up", None), kinds
    assert box.broken == [], "published frames whose pixels are not the camera's: counters %s" % box.broken


def test_udp_loss_is_counted_and_no_frame_the_decoder_reported_is_published(rig, tmp_path, mosquitto):
    """The issue's third case: the box reads over UDP while about 3 % of the RTP packets are lost (the rig drops
    them at the payloader, so the witness, over TCP, misses the same ones), chosen by count so every run has
    damage the decoder reports."""
    with Camera(fps=10, moving=True) as camera:
        box = CameraDaemon(tmp_path, mosquitto, [{"name": "yard", "uri": camera.url(), "max_fps": 10,
                                                  "transport": "udp"}], check_intact=True)
        try:
            assert wait_for(lambda: len(box.of("yard")) >= 20, timeout=30), "no results from the camera over UDP"
            witness = subprocess.Popen([sys.executable, "-m", "tests.support.reference_decoder", camera.url(),
                                        str(LOSS_S + 2)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert witness.stdout.readline().strip() == b"ready"
            start = time.time()
            camera.packet_loss(LOSS_EVERY)
            seen = [json.loads(line) for line in witness.communicate(timeout=LOSS_S + 30)[0].splitlines()]
            camera.packet_loss(0)
            health = box.health("yard")
            window = box.of("yard", since=start)
        finally:
            box.stop()
    reported = {f["counter"] for f in seen if f["reported"] and f["counter"] is not None}
    published = {c for _t, _a, _p, c in window}
    print("UDP, 1 frame in %d lossy: witness %d frames, reported damaged %d, unreadable %d; box: %d results in %.0f s, "
          "decode_errors %d, damaged_frames %d, state %s, published not as drawn %s" % (
              LOSS_EVERY, len(seen), len(reported), sum(f["counter"] is None for f in seen), len(window), LOSS_S,
              health["decode_errors"], health.get("damaged_frames", 0), health["state"], box.broken))
    # the rig damages LOSS_FRAMES frames (10) in LOSS_S: the witness's decoder reported 10 in 2 runs of 2
    assert len(reported) >= LOSS_FRAMES // 2, "the witness saw too little damage to judge: %s" % sorted(reported)
    assert not reported & published, "published frames the decoder reported damaged: %s" % sorted(
        reported & published)
    assert box.broken == [], "published frames whose pixels are not the camera's: counters %s" % box.broken
    assert health["decode_errors"] >= LOSS_FRAMES // 2, health  # over UDP each loss is logged ("RTP: missed")
    assert health.get("damaged_frames", 0) >= health["decode_errors"], health
