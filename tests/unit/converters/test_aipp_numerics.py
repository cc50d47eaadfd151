"""AIPP parity: the generated AIPP file, applied by a NumPy model of the NPU's formula to the box's uint8
pixels, gives the tensor the agent's float preprocessing gives for the same frame.

The model reads the *file text* (through converters.grammar's parser), so a wrong key, a wrong swap or a wrong
number in the file shows up here. It follows the documented AIPP order: rbuv swap, colour-space conversion
(``sum_k matrix[c][k] * (in_k - input_bias_k) / 256``, clipped to 0..255), then
``(x - mean_chn - min_chn) * var_reci_chn`` per output channel. The NPU's rounding inside the CSC step is not
documented; the YUV tolerance below covers it. No NPU ran this: it checks our numbers against the formula.
"""

import cv2
import numpy as np
import pytest

from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.preprocess import PreprocessSpec
from converters import aipp, grammar

IMAGENET_RGB = PreprocessSpec(color="rgb", mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
IMAGENET_BGR = PreprocessSpec(color="bgr", mean=(103.53, 116.28, 123.675), std=(57.375, 57.12, 58.395))
SCALE_RGB = PreprocessSpec(color="rgb", mean=(0.0, 0.0, 0.0), std=(255.0, 255.0, 255.0))
SCALE_BGR = PreprocessSpec(color="bgr", mean=(0.0, 0.0, 0.0), std=(255.0, 255.0, 255.0))
SPECS = {"imagenet-rgb": IMAGENET_RGB, "imagenet-bgr": IMAGENET_BGR, "x255-rgb": SCALE_RGB,
         "x255-bgr": SCALE_BGR}

RGB_TOLERANCE = 1e-3  # float32 rounding only: both paths compute (x - mean) / std on the same uint8 pixels
# YUV, bounds in 0..255 pixel levels. Against OpenCV's own NV12 decode only the rounding of the 8.8
# fixed-point matrix differs: 1 level. Against the float path on the original BGR frame, 4:2:0 chroma sharing
# (four pixels, one U/V pair; B takes 2.02 x U) and 8-bit Y/U/V add up: measured max 9.0, mean 0.98 on the
# smooth frame.
CSC_MAX_LEVELS = 1.0 + 1e-4
YUV_MAX_LEVELS = 10.0
YUV_MEAN_LEVELS = 1.5


def _aipp_file(spec, tier_hw, input_format):
    params = aipp.aipp_params(spec.color, spec.mean, spec.std, tier_hw, input_format)
    return aipp.render_aipp(params, aipp.describe(spec.color, spec.mean, spec.std, input_format))


def _flag(value):
    return value in ("true", "1")


def apply_aipp(cfg_text, pixels):
    """NumPy model of static AIPP: uint8 input (HWC RGB888, or an NV12 buffer) -> float32 CHW."""
    (params,) = grammar.check_aipp(cfg_text)
    width, height = int(params["src_image_size_w"]), int(params["src_image_size_h"])
    yuv = params["input_format"] == "YUV420SP_U8"
    if yuv:
        assert pixels.shape == (height * 3 // 2, width)
        y = pixels[:height].astype(np.float64)
        uv = pixels[height:].reshape(height // 2, width // 2, 2).astype(np.float64)
        u = np.repeat(np.repeat(uv[..., 0], 2, axis=0), 2, axis=1)
        v = np.repeat(np.repeat(uv[..., 1], 2, axis=0), 2, axis=1)
        channels = np.stack([y, u, v])  # (3, H, W)
    else:
        assert params["input_format"] == "RGB888_U8" and pixels.shape == (height, width, 3)
        channels = pixels.transpose(2, 0, 1).astype(np.float64)  # (H, W, 3) -> (3, H, W)
    if _flag(params.get("rbuv_swap_switch", "false")):
        channels = channels[[0, 2, 1] if yuv else [2, 1, 0]]  # U <-> V, or R <-> B
    if _flag(params.get("csc_switch", "false")):
        matrix = np.array([[int(params["matrix_r%dc%d" % (r, c)]) for c in range(3)] for r in range(3)])
        bias = np.array([int(params.get("input_bias_%d" % k, 0)) for k in range(3)], np.float64)
        centred = channels - bias[:, None, None]
        channels = np.clip(np.round(np.einsum("rk,khw->rhw", matrix, centred) / aipp.CSC_SCALE), 0, 255)
    out = np.empty(channels.shape, np.float32)
    for c in range(3):
        offset = int(params["mean_chn_%d" % c]) + float(params["min_chn_%d" % c])
        out[c] = (channels[c] - offset) * float(params["var_reci_chn_%d" % c])
    return out


def _frame(seed, hw=(360, 480)):
    return np.random.default_rng(seed).integers(0, 256, size=hw + (3,), dtype=np.uint8)


def _float_reference(spec, tier_hw, frame):
    ref = BatchPreprocessor(spec, tier_hw, 1, input_dtype="float32", input_layout="NCHW")
    ref.fill(0, frame)
    return ref.batch[0]


def _uint8_input(spec, tier_hw, frame, input_color):
    box = BatchPreprocessor(spec, tier_hw, 1, input_dtype="uint8", input_layout="NHWC",
                            input_color=input_color, normalize=False)
    box.fill(0, frame)
    return box.batch[0]


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("input_format", ["bgr", "rgb"])
@pytest.mark.parametrize("tier_hw", [(64, 64), (48, 80)])
def test_rgb888_aipp_equals_float_preprocessing(spec_name, input_format, tier_hw):
    spec = SPECS[spec_name]
    frame = _frame(seed=sum(map(ord, spec_name + input_format)) + tier_hw[1])
    expected = _float_reference(spec, tier_hw, frame)
    pixels = _uint8_input(spec, tier_hw, frame, input_format)
    got = apply_aipp(_aipp_file(spec, tier_hw, input_format), pixels)
    assert got.shape == expected.shape == (3,) + tier_hw
    np.testing.assert_allclose(got, expected, rtol=0, atol=RGB_TOLERANCE)


def test_parity_check_catches_a_wrong_swap():
    """The same comparison fails when the file's rbuv swap is flipped: the test can fail."""
    frame = _frame(seed=7)
    text = _aipp_file(IMAGENET_RGB, (64, 64), "bgr")
    assert "rbuv_swap_switch : true" in text
    broken = text.replace("rbuv_swap_switch : true", "rbuv_swap_switch : false")
    got = apply_aipp(broken, _uint8_input(IMAGENET_RGB, (64, 64), frame, "bgr"))
    assert np.abs(got - _float_reference(IMAGENET_RGB, (64, 64), frame)).max() > 1.0


def test_parity_check_catches_mean_in_the_wrong_channel():
    frame = _frame(seed=8)
    text = _aipp_file(IMAGENET_RGB, (64, 64), "bgr")
    broken = text.replace("min_chn_0 : 123.675", "min_chn_0 : 103.53")
    got = apply_aipp(broken, _uint8_input(IMAGENET_RGB, (64, 64), frame, "bgr"))
    assert np.abs(got - _float_reference(IMAGENET_RGB, (64, 64), frame)).max() > 0.3


def _bgr_to_nv12(bgr):
    """OpenCV's BGR -> I420 (planar Y, U, V), re-packed as NV12 (Y plane, then interleaved U, V rows)."""
    height, width = bgr.shape[:2]
    flat = cv2.cvtColor(bgr, cv2.COLOR_BGR2YUV_I420).ravel()  # Y (h*w), U (h*w/4), V (h*w/4)
    luma, quarter = height * width, height * width // 4
    y = flat[:luma].reshape(height, width)
    u = flat[luma:luma + quarter].reshape(height // 2, width // 2)
    v = flat[luma + quarter:].reshape(height // 2, width // 2)
    uv = np.stack([u, v], axis=-1).reshape(height // 2, width)
    return np.vstack([y, uv])


def test_opencv_i420_is_bt601_limited_range():
    """The premise of the YUV tests: OpenCV writes video levels (Y 16..235), as the matrix expects."""
    white, black = np.full((4, 4, 3), 255, np.uint8), np.zeros((4, 4, 3), np.uint8)
    assert int(_bgr_to_nv12(white)[0, 0]) == 235
    assert int(_bgr_to_nv12(black)[0, 0]) == 16


def _smooth_frame(hw=(480, 640)):
    """Low-frequency colour gradients: realistic camera content on which 4:2:0 chroma sharing costs little."""
    height, width = hw
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    b = 128 + 100 * np.sin(xs / 70.0)
    g = 128 + 100 * np.cos(ys / 55.0)
    r = 128 + 90 * np.sin((xs + ys) / 90.0)
    return np.clip(np.stack([b, g, r], axis=-1), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("frame_kind", ["smooth", "noise"])
def test_yuv420sp_csc_equals_opencv_nv12_decode(spec_name, frame_kind):
    """Matrix, biases, row order: AIPP on NV12 == float preprocessing of OpenCV's decode of that NV12."""
    spec = SPECS[spec_name]
    frame = _smooth_frame() if frame_kind == "smooth" else _frame(seed=3, hw=(480, 640))
    nv12 = _bgr_to_nv12(_uint8_input(spec, (256, 256), frame, "bgr"))
    decoded = BatchPreprocessor(spec, (256, 256), 1)
    decoded.fill_letterboxed(0, cv2.cvtColor(nv12, cv2.COLOR_YUV2BGR_NV12))
    got = apply_aipp(_aipp_file(spec, (256, 256), "yuv420sp"), nv12)
    levels = np.abs(got - decoded.batch[0]) * np.array(spec.std, np.float32)[:, None, None]
    assert levels.max() <= CSC_MAX_LEVELS, levels.max()


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_yuv420sp_aipp_matches_float_preprocessing_within_stated_levels(spec_name):
    spec = SPECS[spec_name]
    tier_hw = (256, 256)  # a 480x640 frame lands at 192x256 with 32-pixel bars: even, so chroma blocks align
    frame = _smooth_frame()
    expected = _float_reference(spec, tier_hw, frame)
    letterboxed_bgr = _uint8_input(spec, tier_hw, frame, "bgr")
    got = apply_aipp(_aipp_file(spec, tier_hw, "yuv420sp"), _bgr_to_nv12(letterboxed_bgr))
    std = np.array(spec.std, np.float32)[:, None, None]
    levels = np.abs(got - expected) * std  # back to 0..255 pixel levels
    assert levels.max() <= YUV_MAX_LEVELS, levels.max()
    assert levels.mean() <= YUV_MEAN_LEVELS, levels.mean()


def test_yuv_parity_catches_unswapped_rows_for_a_bgr_network():
    frame = _smooth_frame()
    text = _aipp_file(IMAGENET_BGR, (256, 256), "yuv420sp")
    rgb_rows = _aipp_file(IMAGENET_RGB, (256, 256), "yuv420sp")
    matrix_lines = [line for line in rgb_rows.splitlines() if "matrix_" in line]
    broken_lines = [line for line in text.splitlines() if "matrix_" not in line]
    broken = "\n".join(broken_lines[:-1] + matrix_lines + broken_lines[-1:]) + "\n"
    got = apply_aipp(broken, _bgr_to_nv12(_uint8_input(IMAGENET_BGR, (256, 256), frame, "bgr")))
    levels = np.abs(got - _float_reference(IMAGENET_BGR, (256, 256), frame)) * 57.0
    assert levels.max() > 50
