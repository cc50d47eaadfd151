"""The hardware-decoder seam of a camera's worker: Ascend DVPP's video decoder (VDEC), ``decoder: dvpp``.

Written to pyACL's media API as documented (CANN's pyACL reference, "VDEC"); NOT run on Ascend hardware:
pyACL exists only on Ascend hosts, so it is tested against a stand-in (tests/fakes/fake_acl_media.py).

OpenCV opens the stream without decoding (``CAP_PROP_FORMAT = -1``: demuxed H.264/H.265 access units in
Annex-B form); each access unit goes to a VDEC channel in DVPP memory; VDEC's callback (run by
``acl.rt.process_report`` on a thread of ours, as the API requires) hands back a YUV420SP (NV12) picture,
copied to the host and turned into BGR there. :class:`DvppCapture` offers what the worker uses of
``cv2.VideoCapture`` (``isOpened``, ``get``, ``grab``, ``retrieve``, ``release``), so skipping for
``max_fps``, backlog, stall and freeze checks stay the worker's own. Resizing on the device (VPC) is not
wired: the colour conversion runs on the host.
"""

import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from agent.pipeline.backends.acl_backend import (
    ACL_ERROR_REPEAT_INITIALIZE,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    ACL_SUCCESS,
    acl_error_text,
)
from agent.pipeline.sources.base import DecoderError

# acldvppStreamFormat, by the codec OpenCV names (its FourCC in lower case)
ENTYPES = {"h264": 3, "avc1": 3, "hevc": 0, "hev1": 0, "hvc1": 0, "h265": 0}  # H264 high, H265 main
PIXEL_FORMAT_NV12 = 1  # PIXEL_FORMAT_YUV_SEMIPLANAR_420, VDEC's default output
VDEC_CHANNEL_ID = 0  # one camera per worker process; several DVPP cameras on one chip need distinct ids
REPORT_TIMEOUT_MS = 100  # how long the callback thread waits in process_report before checking for a stop
MAX_IN_FLIGHT = 4  # access units sent but not yet come back: beyond this, grab waits for a picture


def open_dvpp(spec: Dict[str, Any]) -> "DvppCapture":
    """A capture whose frames DVPP decodes; ImportError naming pyACL where it is not installed."""
    try:
        import acl  # pyACL, from CANN
    except ImportError:
        raise ImportError("decoder 'dvpp' needs pyACL's media API (the acl module of Ascend CANN), which is not "
                          "installed here; use decoder 'opencv'") from None
    import cv2

    timeouts = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(spec["open_timeout_s"] * 1000),
                cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(spec["read_timeout_s"] * 1000), cv2.CAP_PROP_FORMAT, -1]
    packets = cv2.VideoCapture(spec["uri"], cv2.CAP_FFMPEG, timeouts)
    return DvppCapture(acl, packets, spec["read_timeout_s"])


def _aligned(value: int, step: int) -> int:
    return (value + step - 1) // step * step


class DvppCapture:
    """Access units from ``packets`` (an OpenCV capture in raw mode) through one VDEC channel."""

    def __init__(self, acl: Any, packets: Any, wait_s: float) -> None:
        import cv2

        self.acl = acl
        self.packets = packets
        self.wait_s = wait_s
        self.frames: "queue.Queue[Tuple[np.ndarray, float]]" = queue.Queue()
        self.in_flight = 0
        self._lock = threading.Lock()  # in_flight moves on this thread (send) and the callback thread
        self.decode_errors = 0
        self._frame: Optional[Tuple[np.ndarray, float]] = None
        self._pts: Dict[int, float] = {}
        self._sent = 0
        self._undo: List[Tuple[str, Callable[[], Any]]] = []
        self._stopping = threading.Event()
        self._context: Any = None
        self._channel: Any = None
        self.opened = False
        if not packets.isOpened():
            return
        fourcc = int(packets.get(cv2.CAP_PROP_FOURCC)).to_bytes(4, "little").decode("ascii", "replace").lower()
        if fourcc not in ENTYPES:
            packets.release()
            raise DecoderError("decoder 'dvpp': VDEC decodes H.264 and H.265, the stream is %r" % fourcc)
        self.width = int(packets.get(cv2.CAP_PROP_FRAME_WIDTH))
        self.height = int(packets.get(cv2.CAP_PROP_FRAME_HEIGHT))
        ok, extradata = packets.retrieve(flag=int(packets.get(cv2.CAP_PROP_CODEC_EXTRADATA_INDEX)))
        self._extradata = bytes(extradata.reshape(-1)) if ok and extradata is not None else b""
        try:
            self._open_channel(ENTYPES[fourcc])
        except BaseException:
            self.release()
            raise
        self.opened = True

    # -- the channel ---------------------------------------------------------------------------------------
    def _call(self, ret: Any, call: str) -> None:
        if ret != ACL_SUCCESS:
            raise DecoderError("decoder 'dvpp': %s failed: %s" % (call, acl_error_text(ret)))

    def _value(self, result: Any, call: str) -> Any:
        value, ret = result
        self._call(ret, call)
        return value

    def _open_channel(self, entype: int) -> None:
        acl, media = self.acl, self.acl.media
        ret = acl.init()
        if ret != ACL_ERROR_REPEAT_INITIALIZE:
            self._call(ret, "acl.init")
        self._call(acl.rt.set_device(0), "acl.rt.set_device(0)")
        self._undo.append(("acl.rt.reset_device", lambda: acl.rt.reset_device(0)))
        self._context = self._value(acl.rt.create_context(0), "acl.rt.create_context")
        self._undo.append(("acl.rt.destroy_context", lambda: acl.rt.destroy_context(self._context)))
        thread_id = self._value(acl.util.start_thread(self._report_loop, []), "acl.util.start_thread")
        self._undo.append(("acl.util.stop_thread", lambda: self._stop_thread(thread_id)))
        desc = media.vdec_create_channel_desc()
        if not desc:
            raise DecoderError("decoder 'dvpp': acl.media.vdec_create_channel_desc returned no description")
        self._undo.append(("vdec_destroy_channel_desc", lambda: media.vdec_destroy_channel_desc(desc)))
        self._call(media.vdec_set_channel_desc_channel_id(desc, VDEC_CHANNEL_ID), "vdec_set_channel_desc_channel_id")
        self._call(media.vdec_set_channel_desc_thread_id(desc, thread_id), "vdec_set_channel_desc_thread_id")
        self._call(media.vdec_set_channel_desc_callback(desc, self._on_picture), "vdec_set_channel_desc_callback")
        self._call(media.vdec_set_channel_desc_entype(desc, entype), "vdec_set_channel_desc_entype")
        self._call(media.vdec_set_channel_desc_out_pic_format(desc, PIXEL_FORMAT_NV12),
                   "vdec_set_channel_desc_out_pic_format")
        self._call(media.vdec_create_channel(desc), "acl.media.vdec_create_channel")
        self._channel = desc
        self._undo.append(("vdec_destroy_channel", lambda: media.vdec_destroy_channel(desc)))

    def _report_loop(self, args: List[Any]) -> None:
        """VDEC's callbacks run here, inside process_report; the thread needs our context bound."""
        self.acl.rt.set_context(self._context)
        while not self._stopping.is_set():
            started = time.monotonic()
            # The docs give a timeout only as "non-zero": an error that comes back at once (not after waiting)
            # must not make this loop spin.
            if self.acl.rt.process_report(REPORT_TIMEOUT_MS) != ACL_SUCCESS and \
                    time.monotonic() - started < REPORT_TIMEOUT_MS / 2000.0:
                self._stopping.wait(REPORT_TIMEOUT_MS / 1000.0)

    def _stop_thread(self, thread_id: int) -> Any:
        self._stopping.set()
        return self.acl.util.stop_thread(thread_id)

    def _send(self, data: bytes, pts: float) -> None:
        acl, media = self.acl, self.acl.media
        size = len(data)
        device_in = self._value(media.dvpp_malloc(size), "acl.media.dvpp_malloc(%d)" % size)
        host = data  # referenced until the copy is done
        self._call(acl.rt.memcpy(device_in, size, acl.util.bytes_to_ptr(host), size, ACL_MEMCPY_HOST_TO_DEVICE),
                   "acl.rt.memcpy (access unit)")
        stream = media.dvpp_create_stream_desc()
        self._call(media.dvpp_set_stream_desc_data(stream, device_in), "dvpp_set_stream_desc_data")
        self._call(media.dvpp_set_stream_desc_size(stream, size), "dvpp_set_stream_desc_size")
        out_size = _aligned(self.width, 16) * _aligned(self.height, 2) * 3 // 2
        device_out = self._value(media.dvpp_malloc(out_size), "acl.media.dvpp_malloc(%d)" % out_size)
        picture = media.dvpp_create_pic_desc()
        self._call(media.dvpp_set_pic_desc_data(picture, device_out), "dvpp_set_pic_desc_data")
        self._call(media.dvpp_set_pic_desc_size(picture, out_size), "dvpp_set_pic_desc_size")
        self._call(media.dvpp_set_pic_desc_format(picture, PIXEL_FORMAT_NV12), "dvpp_set_pic_desc_format")
        self._sent += 1
        self._pts[self._sent] = pts
        with self._lock:
            self.in_flight += 1
        self._call(media.vdec_send_frame(self._channel, stream, picture, 0, self._sent), "acl.media.vdec_send_frame")

    def _on_picture(self, stream: Any, picture: Any, user_data: Any) -> None:
        """VDEC's callback: free the access unit, copy a good picture to the host as BGR, free the picture."""
        import cv2

        media = self.acl.media
        media.dvpp_free(media.dvpp_get_stream_desc_data(stream))
        media.dvpp_destroy_stream_desc(stream)
        device_out = media.dvpp_get_pic_desc_data(picture)
        try:
            if media.dvpp_get_pic_desc_ret_code(picture) != 0:
                self.decode_errors += 1
                return
            width, height = media.dvpp_get_pic_desc_width(picture), media.dvpp_get_pic_desc_height(picture)
            stride_w = media.dvpp_get_pic_desc_width_stride(picture)
            stride_h = media.dvpp_get_pic_desc_height_stride(picture)
            size = stride_w * stride_h * 3 // 2
            host = bytes(size)
            self._call(self.acl.rt.memcpy(self.acl.util.bytes_to_ptr(host), size, device_out, size,
                                          ACL_MEMCPY_DEVICE_TO_HOST), "acl.rt.memcpy (picture)")
            nv12 = np.frombuffer(host, np.uint8).reshape(stride_h * 3 // 2, stride_w)
            bgr = cv2.cvtColor(nv12, cv2.COLOR_YUV2BGR_NV12)[:height, :width]
            self.frames.put((np.ascontiguousarray(bgr), self._pts.pop(user_data, 0.0)))
        finally:
            media.dvpp_free(device_out)
            media.dvpp_destroy_pic_desc(picture)
            with self._lock:
                self.in_flight -= 1

    # -- what the worker calls -----------------------------------------------------------------------------
    def isOpened(self) -> bool:  # noqa: N802 - cv2.VideoCapture's name
        return self.opened

    def get(self, prop: int) -> float:
        if prop == 0 and self._frame is not None:  # CAP_PROP_POS_MSEC: the picture's own timestamp
            return self._frame[1]
        return float(self.packets.get(prop))

    def grab(self) -> bool:
        """Send access units until a picture is back; False when the stream ends or a read times out."""
        while True:
            try:
                wait = self.wait_s if self.in_flight >= MAX_IN_FLIGHT else 0
                self._frame = self.frames.get(timeout=wait) if wait else self.frames.get_nowait()
                return True
            except queue.Empty:
                if self.in_flight >= MAX_IN_FLIGHT:
                    return False  # VDEC gave nothing back for wait_s: a stall, as a read timeout is
            if not self.packets.grab():
                return False
            ok, unit = self.packets.retrieve()
            if not ok or unit is None:
                continue
            data = bytes(unit.reshape(-1))
            if self._sent == 0:
                data = self._extradata + data  # SPS/PPS (or VPS/SPS/PPS) ahead of the first access unit
            self._send(data, float(self.packets.get(0)))  # CAP_PROP_POS_MSEC of this access unit

    def retrieve(self) -> Tuple[bool, Optional[np.ndarray]]:
        return (True, self._frame[0]) if self._frame is not None else (False, None)

    def release(self) -> None:
        """Undo in reverse order whatever was set up; a failed step is said once and the rest still runs."""
        failures = []
        if self._context is not None:
            self.acl.rt.set_context(self._context)
        while self._undo:
            what, undo = self._undo.pop()
            ret = undo()
            if isinstance(ret, int) and ret != ACL_SUCCESS:
                failures.append("%s: %s" % (what, acl_error_text(ret)))
        self.packets.release()
        self.opened = False
        if failures:
            raise DecoderError("decoder 'dvpp': release: " + "; ".join(failures))
