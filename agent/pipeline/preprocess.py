"""The one preprocessing definition: letterbox, colour order, normalisation, box un-mapping.

Calibration, evaluation, golden sets, the converter's AIPP parity check and the daemon all import this
module, so the pixels a model sees on the box are the pixels it was calibrated and evaluated on. The letterbox
follows Ultralytics' ``LetterBox`` (``data/augment.py``) and ``scale_boxes`` (``utils/ops.py``) exactly,
including their rounding rule, because that is what the models we ship were trained with.

What a network wants (letterbox options, colour order, mean and std) is the bundle manifest's
``preprocessing`` (:class:`agent.bundle.manifest.Preprocessing`, here also named :data:`PreprocessSpec`), parsed
and checked once with the manifest or the QAT config; this module applies it and never re-reads it from a dict.

The box fills its preallocated input batches from this definition through
:class:`agent.pipeline.input_batch.BatchPreprocessor`, which plans with :func:`plan_letterbox` and resizes with
:func:`resize_into`.

Orders are named: ``*_hw`` is (height, width); OpenCV's ``dsize`` is (width, height), used only at the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import cv2
import numpy as np

from agent.bundle.manifest import LetterboxSpec, Preprocessing

PAD_VALUE = LetterboxSpec().pad_value  # Ultralytics' grey (114), defined once by the manifest's schema
RESIZE_INTERPOLATION = cv2.INTER_LINEAR  # Ultralytics' choice for inference-time letterbox


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


def check_hw(name: str, value: Any) -> Tuple[int, int]:
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
    src_h, src_w = check_hw("src_hw", src_hw)
    dst_h, dst_w = check_hw("dst_hw", dst_hw)
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


def check_bgr_image(name: str, image: Any) -> np.ndarray:
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


def fill_padding(canvas: np.ndarray, plan: LetterboxPlan, pad_value: int) -> None:
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
    image_bgr = check_bgr_image("image_bgr", image_bgr)
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
    resize_into(image_bgr, _interior(out, plan), plan)
    fill_padding(out, plan, pad_value)
    return out, plan


def resize_into(image: np.ndarray, dst: np.ndarray, plan: LetterboxPlan) -> None:
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


# The spec is the manifest's own type, parsed and checked once by the schema engine (agent/bundle/manifest.py):
# ``spec.letterbox`` (pad_value, center, scaleup), ``spec.color``, ``spec.mean``, ``spec.std``. The pipeline's
# name for it is kept so that calibration, evaluation and the box read alike; there is no second class.
PreprocessSpec = Preprocessing


def letterbox_for(
    image_bgr: np.ndarray, dst_hw: Tuple[int, int], spec: Preprocessing, out: Optional[np.ndarray] = None
) -> Tuple[np.ndarray, LetterboxPlan]:
    """:func:`letterbox` with the options of a manifest's ``preprocessing`` (what every host tool needs)."""
    options = spec.letterbox
    return letterbox(image_bgr, dst_hw, pad_value=options.pad_value, scaleup=options.scaleup,
                     center=options.center, out=out)


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
