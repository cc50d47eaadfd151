"""FakeAclMedia: a stand-in for pyACL's media API (``acl.media``, DVPP's video decoder VDEC). It is NOT pyACL
and it does NOT decode video.

It extends :class:`tests.fakes.fake_acl.FakeAcl` (contexts per thread, device memory, checked memcpy) with the
VDEC calls agent/pipeline/sources/dvpp.py makes, held to the documented rules (CANN pyACL reference, "VDEC"):

* the channel description needs its thread id, callback and entype before ``vdec_create_channel``; channel ids
  are 0-31 and one per open channel; creating a channel, DVPP memory and copies need a context on the thread;
* ``vdec_send_frame`` takes one whole access unit in memory from ``dvpp_malloc`` (not ``rt.malloc``), never an
  empty one unless ``eos``; the first must carry the parameter sets (an H.264 SPS, NAL type 7) and each must
  begin with an Annex-B start code; the output picture is ``dvpp_malloc`` memory of at least
  ``align16(w) * align2(h) * 3 / 2`` bytes, else the callback sees ret code 1;
* decoding is asynchronous: the callback runs only inside ``acl.rt.process_report`` called on the thread
  given as the channel's thread id (started by ``acl.util.start_thread``), which needs a context too;
  ``process_report`` returns a non-zero code when it waited and nothing came;
* ``vdec_destroy_channel`` waits until every sent access unit's callback has run.

The "picture" is synthetic: NV12 of ``frame_size`` (what the real VDEC reads from the SPS) whose luma is the
access unit's ordinal (16 + ordinal mod 220) and whose chroma is neutral, so a test can tell which access unit a frame
came from. ``access_units`` keeps (size, first bytes) of each one sent.
"""

import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from tests.fakes.fake_acl import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_CONTEXT_NULL,
    ACL_SUCCESS,
    FakeAcl,
    _Namespace,
)

ACL_ERROR_RT_REPORT_TIMEOUT = 107031  # the docs say only "non-zero" for a wait with nothing due: the fake's choice
ENTYPES = (0, 1, 2, 3)  # H265 main, H264 baseline/main/high
OUT_FORMATS = (1, 2)  # NV12, NV21
START_CODES = (b"\x00\x00\x00\x01", b"\x00\x00\x01")
WAIT_S = 10.0  # bound on destroy_channel / eos waiting for callbacks


def _aligned(value: int, step: int) -> int:
    return (value + step - 1) // step * step


class FakeAclMedia(FakeAcl):
    """``acl`` with ``media`` (VDEC and DVPP memory) and ``util.start_thread`` / ``stop_thread``."""

    def __init__(self, frame_size: Tuple[int, int] = (640, 360), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frame_size = frame_size
        self.dvpp_memory: set = set()
        self.threads: Dict[int, threading.Thread] = {}
        self.channel_descs: Dict[int, Dict[str, Any]] = {}
        self.open_channels: Dict[int, int] = {}  # desc -> channel id
        self.stream_descs: Dict[int, Dict[str, Any]] = {}
        self.pic_descs: Dict[int, Dict[str, Any]] = {}
        self.access_units: List[Tuple[int, bytes]] = []
        self._reports: Dict[int, "queue.Queue[Callable[[], None]]"] = {}  # thread id -> callbacks due
        self._pending = 0
        self._pending_lock = threading.Condition()
        self.util.start_thread = self._api("acl.util.start_thread", self._start_thread, value=True)
        self.util.stop_thread = self._api("acl.util.stop_thread", self._stop_thread)
        self.rt.process_report = self._api("acl.rt.process_report", self._process_report)
        api, streams = self._api, self.stream_descs
        self.media = _Namespace(
            dvpp_malloc=api("acl.media.dvpp_malloc", self._dvpp_malloc, value=True),
            dvpp_free=api("acl.media.dvpp_free", self._dvpp_free),
            vdec_create_channel_desc=api("acl.media.vdec_create_channel_desc", self._new_channel_desc),
            vdec_destroy_channel_desc=api("acl.media.vdec_destroy_channel_desc", self._drop_channel_desc),
            vdec_set_channel_desc_channel_id=api("acl.media.vdec_set_channel_desc_channel_id",
                                                 self._setter("channel_id", range(32))),
            vdec_set_channel_desc_thread_id=api("acl.media.vdec_set_channel_desc_thread_id",
                                                self._setter("thread_id", None)),
            vdec_set_channel_desc_callback=api("acl.media.vdec_set_channel_desc_callback",
                                               self._setter("callback", None)),
            vdec_set_channel_desc_entype=api("acl.media.vdec_set_channel_desc_entype",
                                             self._setter("entype", ENTYPES)),
            vdec_set_channel_desc_out_pic_format=api("acl.media.vdec_set_channel_desc_out_pic_format",
                                                     self._setter("out_format", OUT_FORMATS)),
            vdec_create_channel=api("acl.media.vdec_create_channel", self._create_channel),
            vdec_destroy_channel=api("acl.media.vdec_destroy_channel", self._destroy_channel),
            vdec_send_frame=api("acl.media.vdec_send_frame", self._send_frame),
            dvpp_create_stream_desc=api("acl.media.dvpp_create_stream_desc", lambda: self._new(self.stream_descs)),
            dvpp_destroy_stream_desc=api("acl.media.dvpp_destroy_stream_desc",
                                         lambda d: self._drop(self.stream_descs, d)),
            dvpp_set_stream_desc_data=api("acl.media.dvpp_set_stream_desc_data", self._field(streams, "data")),
            dvpp_set_stream_desc_size=api("acl.media.dvpp_set_stream_desc_size", self._field(streams, "size")),
            dvpp_set_stream_desc_eos=api("acl.media.dvpp_set_stream_desc_eos", self._field(streams, "eos")),
            dvpp_get_stream_desc_data=api("acl.media.dvpp_get_stream_desc_data",
                                          lambda d: self.stream_descs[d].get("data", 0)),
            dvpp_create_pic_desc=api("acl.media.dvpp_create_pic_desc", lambda: self._new(self.pic_descs)),
            dvpp_destroy_pic_desc=api("acl.media.dvpp_destroy_pic_desc", lambda d: self._drop(self.pic_descs, d)),
            dvpp_set_pic_desc_data=api("acl.media.dvpp_set_pic_desc_data", self._field(self.pic_descs, "data")),
            dvpp_set_pic_desc_size=api("acl.media.dvpp_set_pic_desc_size", self._field(self.pic_descs, "size")),
            dvpp_set_pic_desc_format=api("acl.media.dvpp_set_pic_desc_format", self._field(self.pic_descs, "format")),
        )
        for name in ("data", "size", "width", "height", "width_stride", "height_stride", "ret_code"):
            setattr(self.media, "dvpp_get_pic_desc_" + name,
                    api("acl.media.dvpp_get_pic_desc_" + name, lambda d, n=name: self.pic_descs[d].get(n, 0)))

    def live_media(self) -> Dict[str, int]:
        """What is still allocated or open on the media side (all zero after a clean release)."""
        return {"dvpp_memory": len(self.dvpp_memory), "channel_descs": len(self.channel_descs),
                "channels": len(self.open_channels), "stream_descs": len(self.stream_descs),
                "pic_descs": len(self.pic_descs), "threads": sum(t.is_alive() for t in self.threads.values()),
                "contexts": len(self.contexts), "device_refs": sum(self.device_refs.values())}

    # -- threads and reports ----------------------------------------------------------------------------------
    def _start_thread(self, fn: Callable[[List[Any]], None], args: List[Any]) -> Tuple[int, int]:
        registered = threading.Event()

        def run() -> None:
            registered.wait(WAIT_S)  # pyACL returns the id before the thread's function runs
            fn(args)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads[thread.ident] = thread
        self._reports[thread.ident] = queue.Queue()
        registered.set()
        return thread.ident, ACL_SUCCESS

    def _stop_thread(self, thread_id: int) -> int:
        thread = self.threads.get(thread_id)
        if thread is None:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "stop_thread of unknown thread %r" % thread_id)
        thread.join(WAIT_S)
        return ACL_SUCCESS if not thread.is_alive() else ACL_ERROR_INVALID_PARAM

    def _process_report(self, timeout_ms: int) -> int:
        me = threading.get_ident()
        if me not in self._reports:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "process_report on a thread not from start_thread")
        if self._current_context() is None:
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "process_report without a context on this thread")
        try:
            callback = self._reports[me].get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            return ACL_ERROR_RT_REPORT_TIMEOUT
        try:
            callback()
        finally:
            with self._pending_lock:
                self._pending -= 1
                self._pending_lock.notify_all()
        return ACL_SUCCESS

    # -- descriptions and memory ---------------------------------------------------------------------------
    def _new(self, table: Dict[int, Dict[str, Any]]) -> int:
        handle = self._handle()
        table[handle] = {}
        return handle

    def _drop(self, table: Dict[int, Dict[str, Any]], handle: int) -> int:
        if table.pop(handle, None) is None:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "destroy of unknown description %r" % handle)
        return ACL_SUCCESS

    def _field(self, table: Dict[int, Dict[str, Any]], name: str) -> Callable[[int, Any], int]:
        def set_field(handle: int, value: Any) -> int:
            if handle not in table:
                return self._refuse(ACL_ERROR_INVALID_PARAM, "set %s on unknown description %r" % (name, handle))
            table[handle][name] = value
            return ACL_SUCCESS
        return set_field

    def _new_channel_desc(self) -> int:
        return self._new(self.channel_descs)

    def _drop_channel_desc(self, desc: int) -> int:
        if desc in self.open_channels:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "channel description destroyed before its channel")
        return self._drop(self.channel_descs, desc)

    def _setter(self, name: str, allowed: Optional[Any]) -> Callable[[int, Any], int]:
        def set_value(desc: int, value: Any) -> int:
            if desc not in self.channel_descs:
                return self._refuse(ACL_ERROR_INVALID_PARAM, "set %s on unknown channel description" % name)
            if allowed is not None and value not in allowed:
                return self._refuse(ACL_ERROR_INVALID_PARAM, "%s %r out of range" % (name, value))
            self.channel_descs[desc][name] = value
            return ACL_SUCCESS
        return set_value

    def _dvpp_malloc(self, size: int) -> Tuple[Optional[int], int]:
        ptr, ret = self._malloc(size, 0)
        if ret == ACL_SUCCESS:
            self.dvpp_memory.add(ptr)
        return ptr, ret

    def _dvpp_free(self, ptr: int) -> int:
        if ptr not in self.dvpp_memory:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "dvpp_free of memory not from dvpp_malloc")
        self.dvpp_memory.discard(ptr)
        return self._free(ptr)

    # -- the channel ---------------------------------------------------------------------------------------
    def _create_channel(self, desc: int) -> int:
        if self._current_context() is None:
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "vdec_create_channel without a context")
        fields = self.channel_descs.get(desc)
        if fields is None or not {"thread_id", "callback", "entype"} <= set(fields):
            return self._refuse(ACL_ERROR_INVALID_PARAM, "channel description lacks thread id, callback or entype")
        if fields["thread_id"] not in self._reports:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "thread id not from acl.util.start_thread")
        channel_id = fields.get("channel_id", 0)
        if channel_id in self.open_channels.values():
            return self._refuse(ACL_ERROR_INVALID_PARAM, "channel id %d already open" % channel_id)
        self.open_channels[desc] = channel_id
        return ACL_SUCCESS

    def _destroy_channel(self, desc: int) -> int:
        if desc not in self.open_channels:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "destroy of a channel not open")
        if not self._wait_callbacks():
            return self._refuse(ACL_ERROR_INVALID_PARAM, "callbacks never ran (is process_report called?)")
        del self.open_channels[desc]
        return ACL_SUCCESS

    def _wait_callbacks(self) -> bool:
        with self._pending_lock:
            return self._pending_lock.wait_for(lambda: self._pending == 0, WAIT_S)

    def _send_frame(self, desc: int, stream: int, picture: int, config: Any, user_data: Any) -> int:
        if self._current_context() is None:
            return self._refuse(ACL_ERROR_RT_CONTEXT_NULL, "vdec_send_frame without a context")
        if desc not in self.open_channels or stream not in self.stream_descs or picture not in self.pic_descs:
            return self._refuse(ACL_ERROR_INVALID_PARAM, "vdec_send_frame with an unknown channel or description")
        unit = self.stream_descs[stream]
        if unit.get("eos"):
            return ACL_SUCCESS if self._wait_callbacks() else ACL_ERROR_INVALID_PARAM
        data_ptr, size = unit.get("data"), unit.get("size", 0)
        if data_ptr not in self.dvpp_memory or size <= 0 or size > len(self.device_memory[data_ptr]):
            return self._refuse(ACL_ERROR_INVALID_PARAM, "access unit not in dvpp_malloc memory, or empty")
        data = bytes(self.device_memory[data_ptr][:size])
        if not data.startswith(START_CODES):
            return self._refuse(ACL_ERROR_INVALID_PARAM, "access unit without an Annex-B start code")
        if not self.access_units and not self._has_parameter_sets(data):
            return self._refuse(ACL_ERROR_INVALID_PARAM, "first access unit without SPS/PPS")
        self.access_units.append((size, data[:8]))
        ordinal = len(self.access_units)
        callback = self.channel_descs[desc]["callback"]
        self._reports[self.channel_descs[desc]["thread_id"]].put(
            lambda: self._decode(callback, stream, picture, ordinal, user_data))
        with self._pending_lock:
            self._pending += 1
        return ACL_SUCCESS

    @staticmethod
    def _has_parameter_sets(data: bytes) -> bool:
        """An H.264 SPS (NAL type 7) after some start code."""
        return any((data[i + 3] & 0x1F) == 7 for i in range(len(data) - 3) if data[i:i + 3] == b"\x00\x00\x01")

    def _decode(self, callback: Callable[..., None], stream: int, picture: int, ordinal: int, user_data: Any,
                ) -> None:
        """The synthetic picture written into the output buffer, then the user's callback (on this thread)."""
        out = self.pic_descs[picture]
        width, height = self.frame_size
        stride_w, stride_h = _aligned(width, 16), _aligned(height, 2)
        needed = stride_w * stride_h * 3 // 2
        ptr = out.get("data")
        if ptr not in self.dvpp_memory or out.get("size", 0) < needed or len(self.device_memory[ptr]) < needed:
            out["ret_code"] = 1
        else:
            luma = bytes([16 + ordinal % 220]) * (stride_w * stride_h)
            self.device_memory[ptr][:needed] = luma + b"\x80" * (needed - len(luma))
            out.update(ret_code=0, width=width, height=height, width_stride=stride_w, height_stride=stride_h)
        callback(stream, picture, user_data)
