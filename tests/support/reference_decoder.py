"""A second decoder on a rig camera's stream, as a witness: which frames (by the counter in their pixels) the
decoder itself reported damaged. Run as ``python -m tests.support.reference_decoder URL SECONDS``; prints one
JSON line per decoded frame: ``{"counter": n or null, "reported": bool, "damaged": bool, "key": bool}``.

The rig's mount is shared, so this reader sees the same packets (and the same cut ones) as the box. It reads
FFmpeg's log the way the box's worker does (agent/pipeline/sources/damage.py): the witness says what the decoder
reported; the tests check the box published none of those frames.
"""

import json
import os
import sys
import time


def main() -> int:
    url, seconds = sys.argv[1], float(sys.argv[2])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.environ["OPENCV_FFMPEG_LOGLEVEL"] = "40"
    os.environ["OPENCV_FFMPEG_CAPTURE_OPTIONS"] = "rtsp_transport;tcp"
    from agent.pipeline.sources.damage import DamageTracker, StderrTap

    tap, tracker = StderrTap(), DamageTracker()
    import cv2

    from agent.devtools.camera_rig import frame_capture

    capture = cv2.VideoCapture(url, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
    tap.poll()
    print("ready", file=out)
    end = time.monotonic() + seconds
    while time.monotonic() < end and capture.grab():
        reported, damaged = tracker.frame(tap.poll(), bool(capture.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME)))
        ok, image = capture.retrieve()
        read = frame_capture(image) if ok else None
        print(json.dumps({"counter": read and read[1], "reported": reported, "damaged": damaged}), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
