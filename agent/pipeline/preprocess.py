"""The one preprocessing definition: letterbox, colour order, normalisation, box un-mapping.

Calibration, evaluation, golden sets, the converter's AIPP parity check and the daemon all import this
module, so the pixels a model sees on the box are the pixels it was calibrated and evaluated on. The letterbox
follows Ultralytics' ``LetterBox`` (``data/augment.py``) and ``scale_boxes`` (``utils/ops.py``) exactly,
including their rounding rule, because that is what the models we ship were trained with.

Orders are named: ``*_hw`` is (height, width); OpenCV's ``dsize`` is (width, height), used only at the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import cv2
import numpy as np

PAD_VALUE = 114  # Ultralytics' grey: the value YOLO models were trained to see in padding
COLOR_ORDERS = ("rgb", "bgr")
INPUT_DTYPES = ("float32", "uint8")
INPUT_LAYOUTS = ("NCHW", "NHWC")
RESIZE_INTERPOLATION = cv2.INTER_LINEAR  # Ultralytics' choice for inference-time letterbox
# A box serves a handful of camera resolutions; the cache holds plans (a few hundred bytes each), not pixels.
MAX_CACHED_PLANS = 32

_SOURCE_ORDER = "bgr"  # frames arrive from OpenCV in BGR order


@dataclass(frozen=True)
class LetterboxPlan:
    """Where a source image lands inside the network input.

    ``gain`` scales source pixels to input pixels; the resized image occupies rows ``top:top+resized_h`` and
    columns ``left:left+resized_w`` of a ``dst_hw`` canvas, the rest is padding.
    """

    src_hw: Tuple[int, int]
    dst_hw: Tuple[int, int]
    gain: float
    resized_hw: Tuple[int, int]
    top: int
    bottom: int
    left: int
    right: int


def is_int(value: Any) -> bool:
    """True for Python and numpy integers, but not for bools (a ``True`` batch size is a bug, not a 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_hw(name: str, value: Any) -> Tuple[int, int]:
    """Return ``value`` as a (height, width) tuple of positive ints, or raise ValueError naming ``name``."""
    try:
        height, width = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (height, width) pair, got {value!r}") from None
    for part in (height, width):
        if not (is_int(part) and part >= 1):
            raise ValueError(f"{name} must hold two positive integers (height, width), got {value!r}")
    return int(height), int(width)


def plan_letterbox(
    src_hw: Tuple[int, int],
    dst_hw: Tuple[int, int],
    scaleup: bool = True,
    center: bool = True,
    stride: Optional[int] = None,
) -> LetterboxPlan:
    """Plan Ultralytics' letterbox of a ``src_hw`` image into ``dst_hw``.

    With ``stride`` the padding is reduced modulo ``stride`` ("minimal rectangle", Ultralytics ``auto=True``),
    so ``plan.dst_hw`` can be smaller than ``dst_hw``. Fixed-shape NPU models never use it; it exists to
    reproduce what a PyTorch predictor did when a model was validated upstream.
    """
    src_h, src_w = _check_hw("src_hw", src_hw)
    dst_h, dst_w = _check_hw("dst_hw", dst_hw)
    if stride is not None and not (is_int(stride) and stride >= 1):
        raise ValueError(f"stride must be a positive integer or None, got {stride!r}")

    gain = min(dst_h / src_h, dst_w / src_w)
    if not scaleup:
        gain = min(gain, 1.0)
    # Python's round (half to even) on purpose: it is Ultralytics' rule.
    resized_w, resized_h = int(round(src_w * gain)), int(round(src_h * gain))
    if resized_w < 1 or resized_h < 1:
        raise ValueError(f"src_hw {src_hw!r} is too elongated to letterbox into {dst_hw!r}: a side is 0")

    pad_w, pad_h = dst_w - resized_w, dst_h - resized_h
    if stride is not None:
        pad_w, pad_h = pad_w % stride, pad_h % stride
    if center:
        half_w, half_h = pad_w / 2, pad_h / 2
        # The -0.1/+0.1 puts the odd pixel at the bottom/right, as Ultralytics does.
        top, bottom = int(round(half_h - 0.1)), int(round(half_h + 0.1))
        left, right = int(round(half_w - 0.1)), int(round(half_w + 0.1))
    else:
        top, bottom, left, right = 0, pad_h, 0, pad_w
    return LetterboxPlan(
        src_hw=(src_h, src_w),
        dst_hw=(resized_h + pad_h, resized_w + pad_w),
        gain=gain,
        resized_hw=(resized_h, resized_w),
        top=top,
        bottom=bottom,
        left=left,
        right=right,
    )


def _check_bgr_image(name: str, image: Any) -> np.ndarray:
    """Return ``image`` as an OpenCV-compatible uint8 (H, W, 3) array, or raise ValueError naming ``name``."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        described = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
        raise ValueError(f"{name} must be a uint8 (H, W, 3) BGR image, got {described}")
    if image.strides[1:] != (3, 1):  # OpenCV needs contiguous pixels; row strides (crops) are fine
        image = np.ascontiguousarray(image)
    return image


def _interior(canvas: np.ndarray, plan: LetterboxPlan) -> np.ndarray:
    """The (resized_h, resized_w, ...) view of ``canvas`` that holds the resized image."""
    resized_h, resized_w = plan.resized_hw
    return canvas[plan.top : plan.top + resized_h, plan.left : plan.left + resized_w]


def _fill_padding(canvas: np.ndarray, plan: LetterboxPlan, pad_value: int) -> None:
    """Write ``pad_value`` into the four strips around the interior of an (H, W, 3) canvas."""
    height, width = plan.dst_hw
    inner_bottom = height - plan.bottom
    canvas[: plan.top] = pad_value
    canvas[inner_bottom:] = pad_value
    canvas[plan.top : inner_bottom, : plan.left] = pad_value
    canvas[plan.top : inner_bottom, width - plan.right :] = pad_value


def letterbox(
    image_bgr: np.ndarray,
    dst_hw: Tuple[int, int],
    pad_value: int = PAD_VALUE,
    scaleup: bool = True,
    center: bool = True,
    stride: Optional[int] = None,
    out: Optional[np.ndarray] = None,
) -> Tuple[np.ndarray, LetterboxPlan]:
    """Letterbox a uint8 BGR image; returns the uint8 (H, W, 3) result and its plan.

    When ``out`` is given (a uint8 array of shape ``plan.dst_hw + (3,)``) the result is written into it and
    ``out`` itself is returned: the resize lands straight in its interior, then the pad strips are filled.
    """
    image_bgr = _check_bgr_image("image_bgr", image_bgr)
    _check_pad_value(pad_value)
    plan = plan_letterbox(image_bgr.shape[:2], dst_hw, scaleup=scaleup, center=center, stride=stride)
    expected_shape = plan.dst_hw + (3,)
    if out is None:
        out = np.empty(expected_shape, np.uint8)
    elif (
        not isinstance(out, np.ndarray)
        or out.dtype != np.uint8
        or out.shape != expected_shape
        or out.strides[1:] != (3, 1)
        or not out.flags.writeable
    ):
        described = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(
            f"out must be a writeable uint8 {expected_shape} array with contiguous pixels, got {described}"
        )
    _resize_into(image_bgr, _interior(out, plan), plan)
    _fill_padding(out, plan, pad_value)
    return out, plan


def _resize_into(image: np.ndarray, dst: np.ndarray, plan: LetterboxPlan) -> None:
    """Resize ``image`` into the preallocated ``dst``; a plain copy when the size is unchanged."""
    if plan.resized_hw == plan.src_hw:
        np.copyto(dst, image)
        return
    resized_h, resized_w = plan.resized_hw
    written = cv2.resize(image, (resized_w, resized_h), dst=dst, interpolation=RESIZE_INTERPOLATION)
    if written is not dst:  # OpenCV silently allocates when dst does not fit; that would lose the result
        raise RuntimeError("cv2.resize did not write into the preallocated buffer")


def _check_pad_value(pad_value: Any) -> int:
    if not (is_int(pad_value) and 0 <= pad_value <= 255):
        raise ValueError(f"pad_value must be an integer in 0..255, got {pad_value!r}")
    return int(pad_value)


def _check_triple(name: str, value: Any) -> Tuple[float, float, float]:
    try:
        values = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be three numbers, got {value!r}") from None
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be three finite numbers, got {value!r}")
    return values  # type: ignore[return-value]


@dataclass(frozen=True)
class PreprocessSpec:
    """How a network wants its input: letterbox options, colour order, and ``out = (pixel - mean) / std``.

    ``mean`` and ``std`` apply to 0..255 pixels and are listed in the network's colour order ``color``;
    ``x / 255`` is mean 0, std 255.
    """

    pad_value: int = PAD_VALUE
    center: bool = True
    scaleup: bool = True
    color: str = "rgb"
    mean: Tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: Tuple[float, float, float] = (255.0, 255.0, 255.0)

    def __post_init__(self) -> None:
        _check_pad_value(self.pad_value)
        for name in ("center", "scaleup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.color not in COLOR_ORDERS:
            raise ValueError(f"color must be one of {COLOR_ORDERS}, got {self.color!r}")
        mean = _check_triple("mean", self.mean)
        std = _check_triple("std", self.std)
        if not all(s > 0 for s in std):
            raise ValueError(f"std must be positive, got {self.std!r}")
        object.__setattr__(self, "pad_value", int(self.pad_value))
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    @classmethod
    def from_manifest(cls, preprocessing: Mapping[str, Any]) -> PreprocessSpec:
        """Build from a bundle manifest's ``preprocessing`` object (docs/bundle.md); errors name the field."""
        if not isinstance(preprocessing, Mapping):
            raise ValueError(f"preprocessing must be an object, got {type(preprocessing).__name__}")
        _reject_unknown("preprocessing", preprocessing, ("letterbox", "color", "mean", "std"))
        letterbox_options = preprocessing.get("letterbox", {})
        if not isinstance(letterbox_options, Mapping):
            raise ValueError("preprocessing.letterbox must be an object")
        _reject_unknown("preprocessing.letterbox", letterbox_options, ("pad_value", "center", "scaleup"))
        defaults = cls()
        try:
            return cls(
                pad_value=letterbox_options.get("pad_value", defaults.pad_value),
                center=letterbox_options.get("center", defaults.center),
                scaleup=letterbox_options.get("scaleup", defaults.scaleup),
                color=preprocessing.get("color", defaults.color),
                mean=preprocessing.get("mean", defaults.mean),
                std=preprocessing.get("std", defaults.std),
            )
        except ValueError as error:
            # Every validation message starts with the field name; turn it into the manifest path.
            field_name = str(error).split(" ", 1)[0]
            raise ValueError(_MANIFEST_PREFIX.get(field_name, "preprocessing.") + str(error)) from None


_MANIFEST_PREFIX = {
    "pad_value": "preprocessing.letterbox.",
    "center": "preprocessing.letterbox.",
    "scaleup": "preprocessing.letterbox.",
}


def _reject_unknown(path: str, mapping: Mapping[str, Any], known: Sequence[str]) -> None:
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise ValueError(f"{path}.{unknown[0]} is not a known key (known: {', '.join(known)})")


@dataclass
class _SourcePlan:
    """A cached plan with contiguous scratch views sized for it (views into buffers allocated once)."""

    plan: LetterboxPlan
    resized: np.ndarray  # (resized_h, resized_w, 3) uint8, BGR
    planes: List[np.ndarray] = field(default_factory=list)  # 3 x (resized_h, resized_w) uint8, B, G, R


class BatchPreprocessor:
    """Preallocates every buffer once; fills slot i of the batch from a BGR frame with no per-frame allocation
    of the batch.

    The float path per frame: resize straight into a scratch of the resized size, split it into B/G/R planes
    in place, then one ``multiply`` (and an ``add`` when a mean is set) per channel into the slot's interior,
    which fuses the colour swap, the normalisation and HWC -> CHW. A slot's padding is written only when its
    geometry changes, since padding never depends on the frame. One instance belongs to one thread.

    ``normalize=False`` with ``input_dtype="uint8"`` is AIPP mode: letterboxed uint8 pixels pass through in
    ``input_color`` order and ``input_layout``, and the NPU normalises. ``normalize=False`` with float32
    passes raw 0..255 values (for networks that normalise inside).
    """

    def __init__(
        self,
        spec: PreprocessSpec,
        input_hw: Tuple[int, int],
        max_batch: int,
        input_dtype: str = "float32",
        input_layout: str = "NCHW",
        input_color: Optional[str] = None,
        normalize: bool = True,
        fixed_batch: bool = False,
    ) -> None:
        """``input_color`` defaults to ``spec.color``. ``fixed_batch``: the artifact was compiled for exactly
        ``max_batch`` inputs, so ``view`` always returns the whole batch (see ``view``)."""
        if not isinstance(spec, PreprocessSpec):
            raise ValueError(f"spec must be a PreprocessSpec, got {type(spec).__name__}")
        self.input_hw = _check_hw("input_hw", input_hw)
        if not (is_int(max_batch) and max_batch >= 1):
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        if input_dtype not in INPUT_DTYPES:
            raise ValueError(f"input_dtype must be one of {INPUT_DTYPES}, got {input_dtype!r}")
        if input_layout not in INPUT_LAYOUTS:
            raise ValueError(f"input_layout must be one of {INPUT_LAYOUTS}, got {input_layout!r}")
        input_color = spec.color if input_color is None else input_color
        if input_color not in COLOR_ORDERS:
            raise ValueError(f"input_color must be one of {COLOR_ORDERS}, got {input_color!r}")
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize must be a bool, got {normalize!r}")
        if normalize and input_dtype == "uint8":
            raise ValueError("normalize must be False when input_dtype is uint8 (AIPP normalises then)")

        self.spec = spec
        self.max_batch = int(max_batch)
        self.input_dtype = input_dtype
        self.input_layout = input_layout
        self.input_color = input_color
        self.normalize = normalize
        self.fixed_batch = bool(fixed_batch)

        height, width = self.input_hw
        channels_last = input_layout == "NHWC"
        shape = (self.max_batch, height, width, 3) if channels_last else (self.max_batch, 3, height, width)
        self.batch = np.empty(shape, np.dtype(input_dtype))

        # source_channel[c]: which BGR plane feeds output channel c (the output is in input_color order).
        self._source_channel = [_SOURCE_ORDER.index(colour) for colour in input_color]
        scale, shift = self._channel_affine(spec, input_color, normalize)
        self._scale = scale  # (3,) float32, per output channel: out = pixel * scale + shift
        self._shift = shift
        self._pad_pixel = np.float32(spec.pad_value) * scale + shift if input_dtype == "float32" else None

        # Scratch sized for the largest interior; each plan carves contiguous views from the front.
        self._resized_flat = np.empty(height * width * 3, np.uint8)
        self._planes_flat = np.empty((3, height * width), np.uint8)
        self._plans: Dict[Tuple[int, int], _SourcePlan] = {}
        self._slot_geometry: List[Optional[Tuple[int, int, int, int, int, int]]] = [None] * self.max_batch
        self._identity = _SourcePlan(plan=self._identity_plan(), resized=np.empty((0, 0, 3), np.uint8))
        self._identity.planes = self._plane_views(self.input_hw)

    @staticmethod
    def _channel_affine(
        spec: PreprocessSpec, input_color: str, normalize: bool
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Per output channel, ``scale = 1/std`` and ``shift = -mean/std`` of that channel's colour."""
        if not normalize:
            return np.ones(3, np.float32), np.zeros(3, np.float32)
        network_index = [spec.color.index(colour) for colour in input_color]
        mean = np.array([spec.mean[i] for i in network_index], np.float64)
        std = np.array([spec.std[i] for i in network_index], np.float64)
        return (1.0 / std).astype(np.float32), (-mean / std).astype(np.float32)

    def _identity_plan(self) -> LetterboxPlan:
        return LetterboxPlan(self.input_hw, self.input_hw, 1.0, self.input_hw, 0, 0, 0, 0)

    def _plane_views(self, hw: Tuple[int, int]) -> List[np.ndarray]:
        count = hw[0] * hw[1]
        return [self._planes_flat[c, :count].reshape(hw) for c in range(3)]

    def _source_plan(self, src_hw: Tuple[int, int]) -> _SourcePlan:
        cached = self._plans.get(src_hw)
        if cached is not None:
            return cached
        spec = self.spec
        plan = plan_letterbox(src_hw, self.input_hw, scaleup=spec.scaleup, center=spec.center)
        resized_h, resized_w = plan.resized_hw
        resized = self._resized_flat[: resized_h * resized_w * 3].reshape(resized_h, resized_w, 3)
        cached = _SourcePlan(plan=plan, resized=resized, planes=self._plane_views(plan.resized_hw))
        if len(self._plans) >= MAX_CACHED_PLANS:
            self._plans.clear()
        self._plans[src_hw] = cached
        return cached

    def _check_index(self, index: Any) -> int:
        if not (is_int(index) and 0 <= index < self.max_batch):
            raise ValueError(f"index must be an integer in 0..{self.max_batch - 1}, got {index!r}")
        return int(index)

    def fill(self, index: int, frame_bgr: np.ndarray) -> LetterboxPlan:
        """Letterbox ``frame_bgr`` (uint8 BGR, any size) into slot ``index``; returns the plan (for boxes)."""
        index = self._check_index(index)
        frame_bgr = _check_bgr_image("frame_bgr", frame_bgr)
        source = self._source_plan(frame_bgr.shape[:2])
        pixels = frame_bgr
        if source.plan.resized_hw != source.plan.src_hw:
            _resize_into(frame_bgr, source.resized, source.plan)
            pixels = source.resized
        self._write_slot(index, pixels, source)
        return source.plan

    def fill_letterboxed(self, index: int, letterboxed_bgr: np.ndarray) -> None:
        """Fill slot ``index`` from an image already letterboxed to ``input_hw`` (golden-set cases)."""
        index = self._check_index(index)
        letterboxed_bgr = _check_bgr_image("letterboxed_bgr", letterboxed_bgr)
        if letterboxed_bgr.shape[:2] != self.input_hw:
            expected = self.input_hw + (3,)
            raise ValueError(f"letterboxed_bgr must have shape {expected}, got {letterboxed_bgr.shape}")
        self._write_slot(index, letterboxed_bgr, self._identity)

    def _write_slot(self, index: int, pixels: np.ndarray, source: _SourcePlan) -> None:
        """Write padding (only if the slot's geometry changed), then the (h, w, 3) BGR ``pixels`` inside."""
        plan = source.plan
        geometry = (plan.top, plan.bottom, plan.left, plan.right) + plan.resized_hw
        slot = self.batch[index]
        if self._slot_geometry[index] != geometry:
            self._pad_slot(slot)
            self._slot_geometry[index] = geometry
        top, left = plan.top, plan.left
        bottom, right = top + plan.resized_hw[0], left + plan.resized_hw[1]

        if self.input_dtype == "uint8":
            if self.input_layout == "NHWC":
                interior = slot[top:bottom, left:right]
                if self.input_color == _SOURCE_ORDER:
                    np.copyto(interior, pixels)
                else:
                    cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB, dst=interior)
            else:
                # (h, w, 3) BGR -> 3 x (h, w) straight into the slot's channel planes, in input_color order.
                targets = [slot[self._source_channel.index(b), top:bottom, left:right] for b in range(3)]
                cv2.split(pixels, targets)
            return

        planes = source.planes
        cv2.split(pixels, planes)  # (h, w, 3) BGR -> 3 x (h, w) contiguous uint8 planes
        if self.input_layout == "NCHW":
            # OpenCV's accumulateWeighted (dst = (1 - a) * dst + a * src) converts uint8 to float32 with SIMD;
            # on a zeroed interior it is src * a, bit for bit np.multiply's result, at about half the cost of
            # NumPy's buffered uint8 -> float32 cast (benchmarks/README.md, preprocessing profile).
            interior = slot[:, top:bottom, left:right]
            interior.fill(0.0)
            for out_channel in range(3):
                target = interior[out_channel]
                cv2.accumulateWeighted(planes[self._source_channel[out_channel]], target,
                                       float(self._scale[out_channel]))
                if self._shift[out_channel] != 0:
                    np.add(target, self._shift[out_channel], out=target)
            return
        for out_channel in range(3):  # NHWC float: a channel is a strided view, which OpenCV cannot write
            target = slot[top:bottom, left:right, out_channel]
            np.multiply(planes[self._source_channel[out_channel]], self._scale[out_channel], out=target)
            if self._shift[out_channel] != 0:
                np.add(target, self._shift[out_channel], out=target)

    def _pad_slot(self, slot: np.ndarray) -> None:
        """Fill a whole slot with the padding value as the network sees it; the interior is written next."""
        if self._pad_pixel is None:
            slot[...] = self.spec.pad_value
        elif self.input_layout == "NCHW":
            slot[...] = self._pad_pixel[:, None, None]
        else:
            slot[...] = self._pad_pixel

    def view(self, n: int) -> np.ndarray:
        """The first ``n`` slots, ready for the runtime.

        With ``fixed_batch`` the whole batch is returned whatever ``n`` is, because the artifact's input shape
        is fixed; slots ``n..`` then hold earlier frames and the caller must ignore their outputs.
        """
        if not (is_int(n) and 1 <= n <= self.max_batch):
            raise ValueError(f"n must be an integer in 1..{self.max_batch}, got {n!r}")
        return self.batch if self.fixed_batch else self.batch[:n]


def scale_boxes(boxes_xyxy: np.ndarray, plan: LetterboxPlan, clip: bool = True) -> np.ndarray:
    """Map (..., 4) x1, y1, x2, y2 boxes from network-input pixels to source pixels (a new float32 array).

    Order matters: remove the padding offset first, then undo the gain, then clip to the source image.
    """
    if not isinstance(plan, LetterboxPlan):
        raise ValueError(f"plan must be a LetterboxPlan, got {type(plan).__name__}")
    boxes = np.array(boxes_xyxy, dtype=np.float32, copy=True)
    if boxes.ndim < 1 or boxes.shape[-1] != 4:
        raise ValueError(f"boxes_xyxy must have shape (..., 4), got {boxes.shape}")
    xs, ys = boxes[..., 0::2], boxes[..., 1::2]  # views: (x1, x2) and (y1, y2)
    xs -= plan.left
    ys -= plan.top
    boxes /= np.float32(plan.gain)
    if clip:
        src_h, src_w = plan.src_hw
        np.clip(xs, 0, src_w, out=xs)
        np.clip(ys, 0, src_h, out=ys)
    return boxes
