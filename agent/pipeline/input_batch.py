"""The box's fast path into a network's input: a batch preallocated once, filled slot by slot from camera frames.

:mod:`agent.pipeline.preprocess` is the definition (the letterbox geometry, the spec, box un-mapping) that
calibration, evaluation, golden sets and the box share; this module is the mechanism that applies it per frame
on the hot path: every buffer built once, letterbox plans cached per source size, and OpenCV calls that fuse
the resize, the colour order, the normalisation and the layout change into the slot. It is separate because it
is about buffers and speed, not about what the pixels are: it plans through the one letterbox
(:func:`~agent.pipeline.preprocess.plan_letterbox`) and never defines its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import cv2
import numpy as np

from agent.bundle.manifest import COLOR_ORDERS
from agent.pipeline.preprocess import (
    LetterboxPlan,
    PreprocessSpec,
    check_bgr_image,
    check_hw,
    fill_padding,
    is_int,
    plan_letterbox,
    resize_into,
)

INPUT_DTYPES = ("float32", "uint8")
INPUT_LAYOUTS = ("NCHW", "NHWC")
# A box serves a handful of camera resolutions; the cache holds plans (a few hundred bytes each), not pixels.
MAX_CACHED_PLANS = 32

_SOURCE_ORDER = "bgr"  # frames arrive from OpenCV in BGR order


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

    ``normalize=False`` with ``input_dtype="uint8"`` is for artifacts that normalise themselves (the manifest's
    ``normalize_on`` ``aipp``: the NPU, ``model``: folded into the network): letterboxed uint8 pixels pass
    through in ``input_color`` order and ``input_layout``. In NHWC the resize writes straight into the slot.
    ``normalize=False`` with float32 passes raw 0..255 values (for networks that normalise inside).
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
        self.input_hw = check_hw("input_hw", input_hw)
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
        # uint8 NHWC is the artifact's own input layout for pixels: frames go straight into the slot (one copy).
        self._one_copy = input_dtype == "uint8" and input_layout == "NHWC"

        height, width = self.input_hw
        channels_last = input_layout == "NHWC"
        shape = (self.max_batch, height, width, 3) if channels_last else (self.max_batch, 3, height, width)
        self.batch = np.empty(shape, np.dtype(input_dtype))

        # source_channel[c]: which BGR plane feeds output channel c (the output is in input_color order).
        self._source_channel = [_SOURCE_ORDER.index(colour) for colour in input_color]
        scale, shift = self._channel_affine(spec, input_color, normalize)
        self._scale = scale  # (3,) float32, per output channel: out = pixel * scale + shift
        self._shift = shift
        self._pad_pixel = np.float32(spec.letterbox.pad_value) * scale + shift if input_dtype == "float32" else None

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
        options = self.spec.letterbox
        plan = plan_letterbox(src_hw, self.input_hw, scaleup=options.scaleup, center=options.center)
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
        frame_bgr = check_bgr_image("frame_bgr", frame_bgr)
        source = self._source_plan(frame_bgr.shape[:2])
        if self._one_copy:
            self._fill_one_copy(index, frame_bgr, source.plan)
            return source.plan
        pixels = frame_bgr
        if source.plan.resized_hw != source.plan.src_hw:
            resize_into(frame_bgr, source.resized, source.plan)
            pixels = source.resized
        self._write_slot(index, pixels, source)
        return source.plan

    def fill_letterboxed(self, index: int, letterboxed_bgr: np.ndarray) -> None:
        """Fill slot ``index`` from an image already letterboxed to ``input_hw`` (golden-set cases)."""
        index = self._check_index(index)
        letterboxed_bgr = check_bgr_image("letterboxed_bgr", letterboxed_bgr)
        if letterboxed_bgr.shape[:2] != self.input_hw:
            expected = self.input_hw + (3,)
            raise ValueError(f"letterboxed_bgr must have shape {expected}, got {letterboxed_bgr.shape}")
        self._write_slot(index, letterboxed_bgr, self._identity)

    def _fill_one_copy(self, index: int, frame_bgr: np.ndarray, plan: LetterboxPlan) -> None:
        """uint8 NHWC (normalisation in the model or on the NPU): the frame is resized straight into the
        slot's interior, the one pass over its pixels; a bare ``cv2.resize`` is the floor this is measured
        against (benchmarks/preprocessing.py, ``preprocess.uint8.ratio_to_resize``). Only the pad strips
        around the interior are written, and only when the slot's geometry changes."""
        slot = self.batch[index]  # (H, W, 3) uint8
        if self._moved(index, plan):
            fill_padding(slot, plan, self.spec.letterbox.pad_value)
        resized_h, resized_w = plan.resized_hw
        interior = slot[plan.top : plan.top + resized_h, plan.left : plan.left + resized_w]
        resize_into(frame_bgr, interior, plan)
        if self.input_color != _SOURCE_ORDER:
            cv2.cvtColor(interior, cv2.COLOR_BGR2RGB, dst=interior)  # in place: RGB swaps B and R

    def _moved(self, index: int, plan: LetterboxPlan) -> bool:
        """True (and remembered) when slot ``index``'s interior is not where ``plan`` puts it."""
        geometry = (plan.top, plan.bottom, plan.left, plan.right) + plan.resized_hw
        if self._slot_geometry[index] == geometry:
            return False
        self._slot_geometry[index] = geometry
        return True

    def _write_slot(self, index: int, pixels: np.ndarray, source: _SourcePlan) -> None:
        """Write padding (only if the slot's geometry changed), then the (h, w, 3) BGR ``pixels`` inside."""
        plan = source.plan
        slot = self.batch[index]
        if self._moved(index, plan):
            self._pad_slot(slot)
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
            slot[...] = self.spec.letterbox.pad_value
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
