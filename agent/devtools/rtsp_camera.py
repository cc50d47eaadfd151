"""A test camera: GStreamer's RTSP server on loopback, H.264 (x264, zerolatency) from frames drawn here.

Run by the system Python (``/usr/bin/python3``, which has PyGObject and the GStreamer typelibs that
``make camera-rig`` installs from Debian's packages); the test process drives it through
``agent/devtools/camera_rig.py``. Each frame carries its capture time (wall clock, milliseconds) and a counter as rows
of black and white blocks (:mod:`agent.devtools.framecode` decodes them), so a test measures how old the frame
behind a published result is from the pixels alone.

Commands on stdin, one per line: ``size W H`` changes the resolution in the running session (the encoder
sends a new SPS); ``jump S`` moves the stream's timestamps (PTS, hence RTP time) by S seconds from now on
(negative: back), ``rate R`` lets them run at R times real time from now on (0.95: a clock 5% slow), as cameras'
clocks do (:class:`PtsFault`, applied to the encoded frames, so the encoder and the pixels' capture time are
untouched); ``damage N`` cuts one RTP packet out of each of the next N frames (:class:`PacketLoss`); ``loss K``
cuts packets the same way out of one predicted frame in every K from now on (0 stops it: a lossy UDP link,
by count, not by chance); with
``nokey S`` drops every keyframe for S seconds; with ``--moving`` the frames' body changes grey with the
counter, so a concealed or mispredicted frame shows.
SIGSTOP/SIGCONT stall and resume the whole server; SIGTERM ends it.
One mount, ``/cam``; with ``--password`` it needs ``--user``/``--password`` (RTSP basic auth, 401 otherwise);
any other path is answered 404 by the server itself.
"""

import argparse
import os
import sys
import threading
import time

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from framecode import draw  # noqa: E402

PIPELINE = ("( appsrc name=src is-live=true format=time do-timestamp=true ! videoconvert ! video/x-raw,format=I420"
            " ! x264enc tune=zerolatency speed-preset=ultrafast key-int-max={gop} bitrate={kbps}"
            " ! rtph264pay name=pay0 pt=96 config-interval=1 )")


class PtsFault:
    """What a misbehaving camera clock does to the stream's timestamps: ``pts' = out0 + (pts - in0) * rate``.

    A jump moves ``out0``; a rate change re-anchors at the current frame so the timestamps stay continuous.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.in0 = self.out0 = None
        self.rate = 1.0
        self.pending_jump = 0.0
        self.pending_rate = None
        self.no_keyframes_until = 0.0  # time.monotonic() until which keyframes are not sent

    def jump(self, seconds):
        with self.lock:
            self.pending_jump += seconds * Gst.SECOND

    def set_rate(self, rate):
        with self.lock:
            self.pending_rate = rate

    def attach(self, pay):
        pay.get_static_pad("sink").add_probe(Gst.PadProbeType.BUFFER, self._probe)

    def drop_keyframes(self, seconds):
        with self.lock:
            self.no_keyframes_until = time.monotonic() + seconds

    def _probe(self, pad, info):
        buffer = info.get_buffer()
        if not buffer.has_flags(Gst.BufferFlags.DELTA_UNIT) and time.monotonic() < self.no_keyframes_until:
            return Gst.PadProbeReturn.DROP  # a keyframe lost: the frames after it predict from what is not there
        pts = buffer.pts
        if pts == Gst.CLOCK_TIME_NONE:
            return Gst.PadProbeReturn.OK
        with self.lock:
            if self.in0 is None:
                self.in0 = self.out0 = pts
            if self.pending_rate is not None:  # re-anchor here, continuous
                self.out0 = int(self.out0 + (pts - self.in0) * self.rate)
                self.in0, self.rate, self.pending_rate = pts, self.pending_rate, None
            self.out0 += int(self.pending_jump)
            self.pending_jump = 0.0
            out = max(0, int(self.out0 + (pts - self.in0) * self.rate))
        buffer.pts = buffer.dts = out
        return Gst.PadProbeReturn.OK


class PacketLoss:
    """Damaged frames, by count and pattern, never by chance: RTP packets cut out of each of the next N frames
    that have a third packet (:meth:`damage`: the third, then every third: a truncated frame to the decoder, as
    UDP loss or a camera's broken write leaves it; a frame of fewer packets passes whole and is not one of the
    N), and, as a lossy UDP link does, out of one predicted frame in every K from now on (:meth:`set_loss`:
    after each K frames the next delta frame with a third packet loses its packets the same way). Applied to the
    payloader's output, so the encoder and the frames' pixels are untouched and every viewer of the shared mount
    (the box over UDP, a witness over TCP) misses the same packets; the packets lost are counted (``lost``).

    Why these packets (measured on the rig's 640x360 stream): a frame is an AUD packet, then its slice in one or
    two packets (a keyframe: AUD, SPS, PPS, slice). The third packet is a predicted frame's lower picture: its
    loss is reported by the decoder and leaves the code rows readable. Drawn at random (3 % of the packets),
    4 of one run's 5 losses hit an AUD, a parameter set or the code rows instead, and a run in five gave the
    witness no damage it could name (issue 37)."""

    CUT_AT = 2  # from the third packet of a frame on (inside its first slice, after any SPS/PPS) ...
    CUT_EVERY = 3  # ... every third: a keyframe's many packets lose several, a small frame its third

    def __init__(self):
        self.lock = threading.Lock()
        self.frames = 0  # frames still to damage (``damage``)
        self.index = 0  # of the packet in its frame
        self.lost = 0
        self.key = False  # the current frame is a keyframe
        self.damaged_in_frame = False  # a packet of the current frame was cut for ``damage`` (one of the N)
        self.every = 0  # ``loss``: one predicted frame in every ``every`` (0: none)
        self.since = 0  # frames since the last ``loss`` frame was chosen
        self.loss_due = False  # the next predicted frame with a third packet loses its packets
        self.lost_in_frame = False

    def set_loss(self, every):
        with self.lock:
            self.every, self.since, self.loss_due = every, 0, False

    def damage(self, frames):
        with self.lock:
            self.frames += frames

    def attach(self, pay):
        pay.get_static_pad("src").add_probe(Gst.PadProbeType.BUFFER, self._probe)

    def _probe(self, pad, info):
        buffer = info.get_buffer()
        with self.lock:
            last = buffer.has_flags(Gst.BufferFlags.MARKER)  # the frame's last packet: the next starts a frame
            index, self.index = self.index, 0 if last else self.index + 1
            if index == 0:
                self.key = not buffer.has_flags(Gst.BufferFlags.DELTA_UNIT)
            at = index >= self.CUT_AT and (index - self.CUT_AT) % self.CUT_EVERY == 0
            damage = at and self.frames > 0
            loss = at and self.loss_due and not self.key
            self.damaged_in_frame = self.damaged_in_frame or damage
            self.lost_in_frame = self.lost_in_frame or loss
            if last:
                if self.damaged_in_frame:  # a frame too short to lose its third packet is not counted down
                    self.frames -= 1
                if self.lost_in_frame:
                    self.loss_due = False
                self.damaged_in_frame = self.lost_in_frame = False
                if self.every:
                    self.since += 1
                    if self.since >= self.every:
                        self.since, self.loss_due = 0, True
            if damage or loss:
                self.lost += 1
                return Gst.PadProbeReturn.DROP
        return Gst.PadProbeReturn.OK


class Feed:
    """Frames for every session of one mount: drawn at ``fps`` on a thread of their own, pushed to appsrc."""

    def __init__(self, size, fps, moving=False, clip=None):
        self.size = size  # (w, h)
        self.moving = moving
        self.fps = fps
        self.counter = 0
        self.clip = []  # frames played in a loop instead of drawn (play): raw BGR pictures of this size
        if clip:
            self.play(clip)
        self.sources = []
        self.lock = threading.Lock()
        self.pts_fault = PtsFault()
        self.loss = PacketLoss()
        threading.Thread(target=self._run, daemon=True).start()

    def caps(self):
        w, h = self.size
        return Gst.Caps.from_string("video/x-raw,format=BGR,width=%d,height=%d,framerate=%d/1" % (w, h, self.fps))

    def attach(self, factory, media):
        src = media.get_element().get_by_name_recurse_up("src")
        src.set_property("caps", self.caps())
        self.pts_fault.attach(media.get_element().get_by_name_recurse_up("pay0"))
        self.loss.attach(media.get_element().get_by_name_recurse_up("pay0"))
        with self.lock:
            self.sources.append(src)

    def play(self, path):
        """Loop the raw BGR frames of ``path`` (w*h*3 bytes each, end to end) from the next frame on; '-': draw."""
        if path == "-":
            self.clip = []
            return
        w, h = self.size
        with open(path, "rb") as handle:
            data = handle.read()
        size = w * h * 3
        if not data or len(data) % size:
            raise ValueError("%s: %d bytes is not a whole number of %dx%d BGR frames" % (path, len(data), w, h))
        self.clip = [data[i:i + size] for i in range(0, len(data), size)]

    def resize(self, w, h):
        with self.lock:
            self.size = (w, h)
            for src in self.sources:
                src.set_property("caps", self.caps())

    def _run(self):
        period = 1.0 / self.fps
        next_at = time.monotonic()
        while True:
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the camera's own frame clock, not test synchronisation
            else:
                next_at = time.monotonic()  # resumed after SIGSTOP: no burst of catch-up frames
            w, h = self.size
            self.counter += 1
            clip = self.clip
            data = clip[self.counter % len(clip)] if clip else draw(w, h, int(time.time() * 1000), self.counter,
                                                                     self.moving)
            with self.lock:
                for src in list(self.sources):
                    if src.emit("push-buffer", Gst.Buffer.new_wrapped(data)) != Gst.FlowReturn.OK:
                        self.sources.remove(src)  # that session ended


RECORD = ("appsrc name=src format=time ! videoconvert ! video/x-raw,format=I420 ! x264enc tune=zerolatency "
          "speed-preset=ultrafast key-int-max={gop} bitrate={kbps} ! matroskamux ! filesink location={path}")


def record(path, w, h, fps, kbps, frames):
    """The same H.264 into a Matroska file (decode benchmarks time a decoder on it, without a network)."""
    pipeline = Gst.parse_launch(RECORD.format(gop=fps, kbps=kbps, path=path))
    src = pipeline.get_by_name("src")
    src.set_property("caps", Gst.Caps.from_string(
        "video/x-raw,format=BGR,width=%d,height=%d,framerate=%d/1" % (w, h, fps)))
    pipeline.set_state(Gst.State.PLAYING)
    for index in range(frames):
        buffer = Gst.Buffer.new_wrapped(draw(w, h, int(time.time() * 1000), index + 1))
        buffer.pts = index * Gst.SECOND // fps
        buffer.duration = Gst.SECOND // fps
        src.emit("push-buffer", buffer)
    src.emit("end-of-stream")
    message = pipeline.get_bus().timed_pop_filtered(60 * Gst.SECOND, Gst.MessageType.EOS | Gst.MessageType.ERROR)
    pipeline.set_state(Gst.State.NULL)
    if message is None or message.type != Gst.MessageType.EOS:
        sys.exit("recording %s failed: %s" % (path, message and message.parse_error()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0, help="where to serve (not with --record)")
    parser.add_argument("--size", default="640x360")
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--kbps", type=int, default=2000)
    parser.add_argument("--user", default="viewer")
    parser.add_argument("--password", default="")
    parser.add_argument("--record", metavar="FILE", help="write --frames frames to FILE (Matroska) and exit")
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--moving", action="store_true", help="the body's grey follows the counter (framecode)")
    parser.add_argument("--play", default=None, metavar="FILE",
                        help="loop these raw BGR frames (of --size, end to end) instead of drawn ones")
    args = parser.parse_args()
    Gst.init(None)
    w, h = (int(v) for v in args.size.split("x"))
    if args.record:
        record(args.record, w, h, args.fps, args.kbps, args.frames)
        return
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    feed = Feed((w, h), args.fps, args.moving, args.play)
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(PIPELINE.format(gop=args.fps, kbps=args.kbps))
    factory.set_latency(0)
    factory.set_shared(True)  # every viewer sees the same frames (the box, a bare reader, several readers)
    factory.connect("media-configure", feed.attach)
    if args.password:  # the whole server asks for credentials (basic auth), as an IP camera does
        auth = GstRtspServer.RTSPAuth()
        token = GstRtspServer.RTSPToken()
        token.set_string("media.factory.role", "user")
        auth.add_basic(GstRtspServer.RTSPAuth.make_basic(args.user, args.password), token)
        server.set_auth(auth)
        permissions = GstRtspServer.RTSPPermissions()
        for permission in ("media.factory.access", "media.factory.construct"):
            permissions.add_permission_for_role("user", permission, True)
        factory.set_permissions(permissions)
    server.get_mount_points().add_factory("/cam", factory)
    if server.attach(None) == 0:
        sys.exit("cannot listen on 127.0.0.1:%d" % args.port)

    def commands():
        for line in sys.stdin:
            parts = line.split()
            if parts[:1] == ["size"]:
                feed.resize(int(parts[1]), int(parts[2]))
            elif parts[:1] == ["jump"]:
                feed.pts_fault.jump(float(parts[1]))
            elif parts[:1] == ["rate"]:
                feed.pts_fault.set_rate(float(parts[1]))
            elif parts[:1] == ["nokey"]:
                feed.pts_fault.drop_keyframes(float(parts[1]))
            elif parts[:1] == ["damage"]:
                feed.loss.damage(int(parts[1]))
            elif parts[:1] == ["loss"]:
                feed.loss.set_loss(int(parts[1]))
            elif parts[:1] == ["play"]:
                try:
                    feed.play(parts[1])
                except (OSError, ValueError) as exc:  # said, and the camera goes on with what it showed
                    print("play: %s" % exc, file=sys.stderr, flush=True)
        GLib.idle_add(loop.quit)  # stdin closed: the test process is gone

    loop = GLib.MainLoop()
    threading.Thread(target=commands, daemon=True).start()
    print("ready", flush=True)
    loop.run()


if __name__ == "__main__":
    main()
