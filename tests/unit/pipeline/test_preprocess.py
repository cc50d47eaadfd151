"""Tests for agent/pipeline/preprocess.py and input_batch.py against an independent Ultralytics-rule letterbox
written here."""

import tracemalloc
import zlib

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.bundle.manifest import BundleError, LetterboxSpec, Preprocessing, parse_manifest
from agent.config.schema import parse
from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.preprocess import (
    PAD_VALUE,
    LetterboxPlan,
    PreprocessSpec,
    letterbox,
    letterbox_for,
    plan_letterbox,
    scale_boxes,
)

TARGETS_HW = [(320, 192), (192, 320), (256, 256)]
RANDOM_SIZES = 50
IMAGENET = PreprocessSpec(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))


def reference_letterbox(image, new_hw, scaleup=True, center=True, stride=None, pad=114):
    """Ultralytics' LetterBox written out step by step: resize, then cv2.copyMakeBorder with its rounding."""
    h0, w0 = image.shape[:2]
    r = min(new_hw[0] / h0, new_hw[1] / w0)
    if not scaleup:
        r = min(r, 1.0)
    new_unpad_wh = (int(round(w0 * r)), int(round(h0 * r)))
    dw, dh = new_hw[1] - new_unpad_wh[0], new_hw[0] - new_unpad_wh[1]
    if stride:
        dw, dh = np.mod(dw, stride), np.mod(dh, stride)
    if center:
        dw, dh = dw / 2, dh / 2
    if (w0, h0) != new_unpad_wh:
        image = cv2.resize(image, new_unpad_wh, interpolation=cv2.INTER_LINEAR)
    top, bottom = (int(round(dh - 0.1)) if center else 0), int(round(dh + 0.1))
    left, right = (int(round(dw - 0.1)) if center else 0), int(round(dw + 0.1))
    out = cv2.copyMakeBorder(image, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(pad, pad, pad))
    return out, r, (left, top)


def reference_network_input(letterboxed_bgr, spec, input_color, layout, normalize=True):
    """(H, W, 3) BGR uint8 -> the tensor slot a network with ``spec`` expects, computed in float64."""
    network = letterboxed_bgr[..., ::-1] if spec.color == "rgb" else letterboxed_bgr
    values = network.astype(np.float64)
    if normalize:
        values = (values - np.array(spec.mean)) / np.array(spec.std)
    if input_color != spec.color:
        values = values[..., ::-1]
    return values.transpose(2, 0, 1) if layout == "NCHW" else values


@pytest.fixture(scope="module")
def noise():
    return np.random.default_rng(7).integers(0, 256, (720, 720, 3), dtype=np.uint8)


def random_sizes(seed, count=RANDOM_SIZES):
    rng = np.random.default_rng(seed)
    return [(int(h), int(w)) for h, w in rng.integers(8, 720, (count, 2))]


# --- plan: golden numbers ---


@pytest.mark.parametrize(
    "src_hw, dst_hw, kwargs, expected",
    [
        # 1080p into a square: gain 1/3, 360 rows, 140 rows of padding each side
        (
            (1080, 1920),
            (640, 640),
            {},
            LetterboxPlan((1080, 1920), (640, 640), 1 / 3, (360, 640), 140, 140, 0, 0),
        ),
        # 720p into a landscape tier: gain 1/4, 6 rows each side
        ((720, 1280), (192, 320), {}, LetterboxPlan((720, 1280), (192, 320), 0.25, (180, 320), 6, 6, 0, 0)),
        # odd padding: the extra pixel goes right (round(0.4)=0, round(0.6)=1)
        ((100, 99), (64, 64), {}, LetterboxPlan((100, 99), (64, 64), 0.64, (64, 63), 0, 0, 0, 1)),
        # half-to-even: round(2.5) == 2, as in Ultralytics (Python's round)
        ((4, 5), (2, 3), {}, LetterboxPlan((4, 5), (2, 3), 0.5, (2, 2), 0, 0, 0, 1)),
        # no scale-up: a small image is centred unscaled
        (
            (100, 150),
            (640, 640),
            {"scaleup": False},
            LetterboxPlan((100, 150), (640, 640), 1.0, (100, 150), 270, 270, 245, 245),
        ),
        # not centred: all padding bottom/right
        (
            (1080, 1920),
            (640, 640),
            {"center": False},
            LetterboxPlan((1080, 1920), (640, 640), 1 / 3, (360, 640), 0, 280, 0, 0),
        ),
        # minimal rectangle: 280 % 32 = 24 rows of padding, 12 each side, the input becomes 384x640
        (
            (1080, 1920),
            (640, 640),
            {"stride": 32},
            LetterboxPlan((1080, 1920), (384, 640), 1 / 3, (360, 640), 12, 12, 0, 0),
        ),
    ],
)
def test_plan_golden_numbers(src_hw, dst_hw, kwargs, expected):
    assert plan_letterbox(src_hw, dst_hw, **kwargs) == expected


@settings(max_examples=200, deadline=None)
@given(
    src_hw=st.tuples(st.integers(1, 5000), st.integers(1, 5000)),
    dst_hw=st.tuples(st.integers(32, 1280), st.integers(32, 1280)),
    center=st.booleans(),
    scaleup=st.booleans(),
)
def test_plan_invariants(src_hw, dst_hw, center, scaleup):
    gain = min(dst_hw[0] / src_hw[0], dst_hw[1] / src_hw[1], 1.0 if not scaleup else float("inf"))
    if round(min(src_hw) * gain) < 1:
        with pytest.raises(ValueError, match="src_hw"):
            plan_letterbox(src_hw, dst_hw, scaleup=scaleup, center=center)
        return
    plan = plan_letterbox(src_hw, dst_hw, scaleup=scaleup, center=center)
    assert plan.dst_hw == dst_hw and plan.gain == gain
    assert plan.top + plan.resized_hw[0] + plan.bottom == dst_hw[0]
    assert plan.left + plan.resized_hw[1] + plan.right == dst_hw[1]
    assert min(plan.top, plan.bottom, plan.left, plan.right) >= 0
    if center:
        assert 0 <= plan.bottom - plan.top <= 1 and 0 <= plan.right - plan.left <= 1
    else:
        assert plan.top == plan.left == 0


# --- letterbox: pixel for pixel against the reference ---


@pytest.mark.parametrize("dst_hw", TARGETS_HW)
@pytest.mark.parametrize(
    "options",
    [{}, {"scaleup": False}, {"center": False}, {"stride": 32}],
    ids=["default", "no-scaleup", "top-left", "stride32"],
)
def test_letterbox_matches_reference(noise, dst_hw, options):
    for h0, w0 in random_sizes(seed=zlib.crc32(repr((dst_hw, sorted(options.items()))).encode())):
        crop = noise[:h0, :w0]  # a row-strided view, as a camera crop would be
        expected, gain, (left, top) = reference_letterbox(crop, dst_hw, **options)
        actual, plan = letterbox(crop, dst_hw, **options)
        assert actual.dtype == np.uint8
        assert actual.shape == expected.shape == plan.dst_hw + (3,), (h0, w0)
        assert np.array_equal(actual, expected), (h0, w0)
        assert (plan.gain, plan.left, plan.top) == (gain, left, top)


def test_letterbox_writes_into_out(noise):
    out = np.zeros((256, 256, 3), np.uint8)
    pointer = out.ctypes.data
    for h0, w0 in random_sizes(seed=3, count=10):
        out[...] = 7  # stale content from an earlier frame must not survive
        result, _ = letterbox(noise[:h0, :w0], (256, 256), out=out, pad_value=0)
        assert result is out and out.ctypes.data == pointer
        assert np.array_equal(out, reference_letterbox(noise[:h0, :w0], (256, 256), pad=0)[0]), (h0, w0)


def test_letterbox_same_size_copies_without_resizing(noise):
    image = np.ascontiguousarray(noise[:256, :256])
    result, plan = letterbox(image, (256, 256))
    assert plan.resized_hw == (256, 256) and np.array_equal(result, image) and result is not image


# --- box mapping ---


def test_scale_boxes_inverts_the_forward_rule():
    rng = np.random.default_rng(11)
    for (h0, w0), dst_hw in zip(random_sizes(seed=5), TARGETS_HW * RANDOM_SIZES):
        plan = plan_letterbox((h0, w0), dst_hw)
        x = np.sort(rng.uniform(0, w0, (20, 2)), axis=1)
        y = np.sort(rng.uniform(0, h0, (20, 2)), axis=1)
        original = np.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], axis=1)
        # forward: scale by the gain, then shift by where the reference letterbox put the image. (Ultralytics'
        # own scale_boxes re-derives the pad from unrounded sizes, which can be one input pixel off.)
        _, gain, (left, top) = reference_letterbox(np.zeros((h0, w0, 3), np.uint8), dst_hw)
        forward = original * gain + np.array([left, top, left, top])
        mapped = scale_boxes(forward, plan)
        assert mapped.dtype == np.float32 and mapped.shape == (20, 4)
        np.testing.assert_allclose(mapped, original, atol=1e-2, rtol=1e-5)


def test_scale_boxes_finds_a_drawn_rectangle_within_one_input_pixel():
    image = np.zeros((1080, 1920, 3), np.uint8)
    x1, y1, x2, y2 = 500, 300, 1400, 900
    image[y1:y2, x1:x2] = 255  # pixels x1..x2-1: the box's edges are at x1 and x2
    letterboxed, plan = letterbox(image, (384, 640), pad_value=0)
    rows, cols = np.nonzero(letterboxed[..., 0] > 127)
    found = np.array([[cols.min(), rows.min(), cols.max() + 1, rows.max() + 1]], np.float32)
    mapped = scale_boxes(found, plan)
    one_input_pixel = 1 / plan.gain
    np.testing.assert_allclose(mapped[0], [x1, y1, x2, y2], atol=one_input_pixel)


def test_scale_boxes_clips_and_returns_a_new_array():
    plan = plan_letterbox((1080, 1920), (640, 640))
    boxes = np.array([[-10.0, 0.0, 700.0, 639.0], [10.0, 150.0, 20.0, 160.0]], np.float32)
    mapped = scale_boxes(boxes, plan)
    np.testing.assert_allclose(mapped, [[0, 0, 1920, 1080], [30, 30, 60, 60]], atol=1e-4)
    assert boxes[0, 0] == -10.0  # input untouched
    unclipped = scale_boxes(boxes, plan, clip=False)
    np.testing.assert_allclose(unclipped[0], [-30, -420, 2100, 1497], atol=1e-3)


def test_scale_boxes_rejects_bad_shapes():
    plan = plan_letterbox((100, 100), (64, 64))
    with pytest.raises(ValueError, match="boxes_xyxy"):
        scale_boxes(np.zeros((3, 5)), plan)
    with pytest.raises(ValueError, match="plan"):
        scale_boxes(np.zeros((3, 4)), None)
    assert scale_boxes(np.zeros((0, 4)), plan).shape == (0, 4)


# --- the spec: the manifest's Preprocessing, parsed once by the schema ---


def test_spec_is_the_manifests_type():
    spec = parse(
        Preprocessing,
        {
            "letterbox": {"pad_value": 0, "center": False, "scaleup": False},
            "color": "bgr",
            "mean": [1, 2, 3],
            "std": [4.0, 5.0, 6.0],
        },
        "preprocessing",
    )
    assert PreprocessSpec is Preprocessing
    assert spec == PreprocessSpec(
        letterbox=LetterboxSpec(pad_value=0, center=False, scaleup=False), color="bgr", mean=(1.0, 2.0, 3.0),
        std=(4.0, 5.0, 6.0),
    )
    boxed, plan = letterbox_for(np.full((10, 40, 3), 7, np.uint8), (20, 20), spec)
    assert (plan.resized_hw, plan.top, plan.left) == ((5, 20), 0, 0)  # no centring, no scale-up past 0.5
    assert (boxed[5:] == 0).all() and (boxed[:5] == 7).all()


@pytest.mark.parametrize(
    "preprocessing, path",
    [
        ({"colour": "rgb"}, "preprocessing.colour"),
        ({"letterbox": {"pad": 1}}, "preprocessing.letterbox.pad"),
        ({"letterbox": {"pad_value": 300}}, "preprocessing.letterbox.pad_value"),
        ({"letterbox": {"center": "yes"}}, "preprocessing.letterbox.center"),
        ({"color": "rgba"}, "preprocessing.color"),
        ({"std": [255, 0, 255]}, "preprocessing.std"),
        ({"mean": [0, 0]}, "preprocessing.mean"),
        ({"mean": [0, float("nan"), 0]}, "preprocessing.mean[1]"),
    ],
)
def test_manifest_names_the_bad_preprocessing_field(preprocessing, path):
    manifest = {"name": "n", "version": "1", "created": "now", "task": "classify", "labels": ["a"],
                "input": {"name": "images", "tiers": [[32, 32]]},
                "artifacts": [{"file": "m.onnx", "format": "onnx", "target": "cpu", "tier": [32, 32],
                               "sha256": "0" * 64, "size": 1}],
                "preprocessing": preprocessing}
    with pytest.raises(BundleError) as raised:
        parse_manifest(manifest)
    assert [e.path for e in raised.value.errors] == [path]


# --- BatchPreprocessor ---


@pytest.mark.parametrize("spec", [PreprocessSpec(), IMAGENET, PreprocessSpec(color="bgr", mean=(10, 20, 30))])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("input_color", ["rgb", "bgr"])
def test_batch_float_matches_reference(noise, spec, layout, input_color):
    dst_hw = (192, 320)
    pre = BatchPreprocessor(spec, dst_hw, max_batch=3, input_layout=layout, input_color=input_color)
    batch, pointer = pre.batch, pre.batch.ctypes.data
    expected_shape = (3, 3) + dst_hw if layout == "NCHW" else (3,) + dst_hw + (3,)
    assert batch.shape == expected_shape and batch.dtype == np.float32
    # slot 1 changes geometry (wide -> tall -> the size of the input itself) so its padding is rewritten
    for index, (h0, w0) in [(0, (300, 500)), (1, (720, 400)), (2, (192, 320)), (1, (90, 700)), (1, (50, 60))]:
        frame = np.ascontiguousarray(noise[:h0, :w0])
        plan = pre.fill(index, frame)
        assert plan == plan_letterbox((h0, w0), dst_hw)
        letterboxed = reference_letterbox(frame, dst_hw)[0]
        expected = reference_network_input(letterboxed, spec, input_color, layout)
        np.testing.assert_allclose(pre.batch[index], expected, rtol=1e-5, atol=1e-5)
    assert pre.batch is batch and pre.batch.ctypes.data == pointer


def test_batch_fill_keeps_other_slots(noise):
    pre = BatchPreprocessor(PreprocessSpec(), (128, 128), max_batch=2)
    pre.fill(0, noise[:100, :300])
    slot0 = pre.batch[0].copy()
    pre.fill(1, noise[:300, :100])
    assert np.array_equal(pre.batch[0], slot0)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("input_color", ["rgb", "bgr"])
def test_batch_uint8_aipp_passes_letterboxed_pixels(noise, layout, input_color):
    dst_hw = (256, 256)
    pre = BatchPreprocessor(
        IMAGENET,
        dst_hw,
        max_batch=2,
        input_dtype="uint8",
        input_layout=layout,
        input_color=input_color,
        normalize=False,
    )
    assert pre.batch.dtype == np.uint8
    pointer = pre.batch.ctypes.data
    for index, (h0, w0) in [(0, (300, 500)), (1, (600, 200)), (0, (100, 90))]:
        frame = noise[:h0, :w0]
        pre.fill(index, frame)
        letterboxed = reference_letterbox(frame, dst_hw, pad=IMAGENET.letterbox.pad_value)[0]
        pixels = letterboxed[..., ::-1] if input_color == "rgb" else letterboxed
        expected = pixels.transpose(2, 0, 1) if layout == "NCHW" else pixels
        assert np.array_equal(pre.batch[index], expected), (index, h0, w0)
    assert pre.batch.ctypes.data == pointer


@pytest.mark.parametrize("input_color", ["bgr", "rgb"])
def test_uint8_nhwc_one_copy_is_byte_identical_to_the_letterbox(noise, input_color):
    """normalize_on model/aipp with NHWC uint8: the resize lands in the slot; only the pad strips are written,
    and only when the slot's geometry changes. Every fill must equal the one letterbox, byte for byte."""
    dst_hw = (256, 256)
    pre = BatchPreprocessor(PreprocessSpec(), dst_hw, max_batch=2, input_dtype="uint8", input_layout="NHWC",
                            input_color=input_color, normalize=False)
    pre.batch[...] = 7  # stale bytes: whatever the pad strips do not cover would show
    pointer = pre.batch.ctypes.data
    big = np.ascontiguousarray(np.tile(noise, (2, 3, 1))[:1080, :1920])
    # wide -> tall (interior shrinks and moves) -> the tier's own size (a copy) -> upscaled -> wide again
    for index, frame in [(0, big), (0, noise[:600, :200]), (0, noise[:256, :256]), (1, noise[:50, :60]),
                         (0, big), (1, big[:1000, :1700])]:
        frame = np.ascontiguousarray(frame)
        plan = pre.fill(index, frame)
        expected, expected_plan = letterbox(frame, dst_hw)
        assert plan == expected_plan
        assert np.array_equal(pre.batch[index], expected[..., ::-1] if input_color == "rgb" else expected)
    assert pre.batch.ctypes.data == pointer


def test_uint8_nhwc_one_copy_golden_numbers():
    """A flat 1080p frame (B, G, R) = (10, 20, 30) into 256x256: gain 256/1920, 144 rows of picture between
    56 rows of grey 114 above and below (Ultralytics' rounding puts no odd row anywhere: 112 = 56 + 56)."""
    pre = BatchPreprocessor(PreprocessSpec(), (256, 256), max_batch=1, input_dtype="uint8", input_layout="NHWC",
                            input_color="rgb", normalize=False)
    frame = np.empty((1080, 1920, 3), np.uint8)
    frame[...] = (10, 20, 30)
    plan = pre.fill(0, frame)
    assert (plan.resized_hw, plan.top, plan.bottom, plan.left, plan.right) == ((144, 256), 56, 56, 0, 0)
    slot = pre.batch[0]
    assert (slot[:56] == 114).all() and (slot[200:] == 114).all()
    assert (slot[56:200] == np.array([30, 20, 10], np.uint8)).all()  # RGB order, as input_color says
    assert zlib.crc32(slot.tobytes()) == zlib.crc32(letterbox(frame, (256, 256))[0][..., ::-1].tobytes())


def test_batch_float_without_normalisation_passes_raw_values(noise):
    pre = BatchPreprocessor(PreprocessSpec(), (128, 160), max_batch=1, normalize=False)
    pre.fill(0, noise[:400, :300])
    letterboxed = reference_letterbox(noise[:400, :300], (128, 160))[0]
    assert np.array_equal(pre.batch[0], letterboxed[..., ::-1].transpose(2, 0, 1).astype(np.float32))


@pytest.mark.parametrize("dtype, normalize", [("float32", True), ("uint8", False)])
def test_fill_letterboxed_applies_only_colour_and_normalisation(noise, dtype, normalize):
    image = np.ascontiguousarray(noise[:192, :320])
    pre = BatchPreprocessor(IMAGENET, (192, 320), max_batch=2, input_dtype=dtype, normalize=normalize)
    pre.fill(1, noise[:50, :500])  # a letterboxed fill must also overwrite this slot's padding
    pre.fill_letterboxed(1, image)
    expected = reference_network_input(image, IMAGENET, "rgb", "NCHW", normalize=normalize)
    np.testing.assert_allclose(pre.batch[1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, layout", [("float32", "NCHW"), ("uint8", "NHWC")])
def test_fill_does_not_allocate_per_frame(noise, dtype, layout):
    pre = BatchPreprocessor(IMAGENET, (640, 640), max_batch=2, input_dtype=dtype, input_layout=layout,
                            normalize=dtype == "float32")
    frame = np.ascontiguousarray(np.tile(noise, (2, 3, 1))[:1080, :1920])
    pre.fill(0, frame)  # first fill of a size plans it and pads the slot
    tracemalloc.start()
    try:
        pre.fill(0, frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    plane_bytes = 640 * 640  # any per-frame temporary of the image would be at least this big
    assert peak < plane_bytes // 10, f"fill allocated {peak} bytes"


def test_view_returns_leading_slots_or_the_fixed_batch():
    pre = BatchPreprocessor(PreprocessSpec(), (64, 64), max_batch=4)
    view = pre.view(2)
    assert view.shape == (2, 3, 64, 64) and np.shares_memory(view, pre.batch)
    fixed = BatchPreprocessor(PreprocessSpec(), (64, 64), max_batch=4, fixed_batch=True)
    assert fixed.view(1) is fixed.batch


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"spec": {"color": "rgb"}}, "spec"),
        ({"input_hw": (0, 64)}, "input_hw"),
        ({"input_hw": 64}, "input_hw"),
        ({"max_batch": 0}, "max_batch"),
        ({"max_batch": True}, "max_batch"),
        ({"input_dtype": "float16"}, "input_dtype"),
        ({"input_layout": "CHW"}, "input_layout"),
        ({"input_color": "rgba"}, "input_color"),
        ({"input_dtype": "uint8"}, "normalize"),
    ],
)
def test_batch_rejects_bad_arguments(kwargs, name):
    arguments = {"spec": PreprocessSpec(), "input_hw": (64, 64), "max_batch": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        BatchPreprocessor(**arguments)


def test_fill_rejects_bad_frames_and_indices(noise):
    pre = BatchPreprocessor(PreprocessSpec(), (64, 64), max_batch=2)
    before = pre.batch.copy()
    with pytest.raises(ValueError, match="index"):
        pre.fill(2, noise)
    with pytest.raises(ValueError, match="index"):
        pre.fill(-1, noise)
    with pytest.raises(ValueError, match="frame_bgr"):
        pre.fill(0, noise[..., 0])
    with pytest.raises(ValueError, match="frame_bgr"):
        pre.fill(0, noise.astype(np.float32))
    with pytest.raises(ValueError, match="letterboxed_bgr"):
        pre.fill_letterboxed(0, noise[:64, :32])
    with pytest.raises(ValueError, match="n must"):
        pre.view(3)
    assert np.array_equal(pre.batch, before, equal_nan=True)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda img: letterbox(img, (64, 0)), "dst_hw"),
        (lambda img: letterbox(img, (64, 64), pad_value=256), "pad_value"),
        (lambda img: letterbox(img, (64, 64), stride=0), "stride"),
        (lambda img: letterbox(img, (64, 64), out=np.zeros((64, 63, 3), np.uint8)), "out"),
        (lambda img: letterbox(img.astype(np.float32), (64, 64)), "image_bgr"),
        (lambda img: plan_letterbox((1, 5000), (64, 64)), "src_hw"),
    ],
)
def test_letterbox_rejects_bad_arguments(noise, call, name):
    with pytest.raises(ValueError, match=name):
        call(noise[:100, :100])


def test_pad_value_constant_is_ultralytics_grey():
    assert PAD_VALUE == 114 and PreprocessSpec().letterbox.pad_value == 114
