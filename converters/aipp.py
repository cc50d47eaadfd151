"""The static AIPP config that moves colour order and normalisation onto the NPU.

With static AIPP the compiled model takes the box's letterboxed uint8 pixels as they come from OpenCV and does
``(x - mean) / std`` itself, so the host skips the float conversion (the seeds measured 46 ms -> 7 ms end to
end with AIPP plus vectorised post-processing). The numbers come from the bundle's preprocessing contract, the
same one the agent's float path uses, so both paths compute the same tensor
(tests/unit/converters/test_aipp_numerics.py).

The NPU's order of operations (CANN AIPP docs), which decides every value below:

1. ``rbuv_swap_switch`` swaps channels 0 and 2 of the input (R/B, or U/V for YUV);
2. ``csc_switch``: ``out_c = (sum_k matrix[c][k] * (in_k - input_bias_k)) / 256`` (YUV -> RGB);
3. per output channel c: ``out_c = (x_c - mean_chn_c - min_chn_c) * var_reci_chn_c``.

``mean_chn`` is an integer in the protobuf, so a fractional mean (ImageNet's 123.675) goes into the float
``min_chn`` and ``mean_chn`` stays 0: ``min_chn_c = mean_c``, ``var_reci_chn_c = 1 / std_c``.
"""

from typing import Dict, List, Sequence, Tuple, Union

Value = Union[str, int, float, bool]

INPUT_FORMATS = ("bgr", "rgb", "yuv420sp")
DEFAULT_INPUT_FORMAT = "bgr"  # the agent letterboxes OpenCV frames, which are BGR
AIPP_FORMAT = {"bgr": "RGB888_U8", "rgb": "RGB888_U8", "yuv420sp": "YUV420SP_U8"}

# BT.601 limited range ("video levels") YUV -> RGB in 8.8 fixed point: 298/256 = 1.164, 409/256 = 1.598, ...
# Rows give R, G, B from (Y, U, V); NV12 (U before V) is YUV420SP_U8's order without rbuv swap.
BT601_YUV_TO_RGB: Tuple[Tuple[int, int, int], ...] = ((298, 0, 409), (298, -100, -208), (298, 516, 0))
BT601_INPUT_BIAS = (16, 128, 128)  # Y offset and the UV midpoint of limited-range video
CSC_SCALE = 256  # the matrix is fixed point with 8 fractional bits

# The NPU computes in float16 after AIPP; 1/std must stay inside float16's range.
FLOAT16_MAX = 65504.0


class AippError(ValueError):
    """Preprocessing that static AIPP cannot express; the message names the manifest field."""


def aipp_params(color: str, mean: Sequence[float], std: Sequence[float], tier_hw: Tuple[int, int],
                input_format: str = DEFAULT_INPUT_FORMAT) -> Dict[str, Value]:
    """The ``aipp_op`` keys, in file order, for a network trained on ``color`` with ``(x - mean) / std``.

    ``mean`` and ``std`` are on 0..255 pixels in the network's colour order (bundle ``preprocessing``);
    ``input_format`` is what the box sends: ``bgr``/``rgb`` uint8 HWC, or ``yuv420sp`` (NV12).
    """
    if color not in ("rgb", "bgr"):
        raise AippError("preprocessing.color: must be rgb or bgr (got %r)" % (color,))
    if input_format not in INPUT_FORMATS:
        raise AippError("--input-format: must be one of %s (got %r)" % ("|".join(INPUT_FORMATS),
                                                                      input_format))
    mean, std = [float(m) for m in mean], [float(s) for s in std]
    if len(mean) != 3 or len(std) != 3:
        raise AippError("preprocessing.mean/std: need three values each")
    for i, m in enumerate(mean):
        if not 0.0 <= m <= 255.0:
            raise AippError("preprocessing.mean[%d]: AIPP's min_chn takes 0..255 (got %s)" % (i, m))
    for i, s in enumerate(std):
        if s <= 0 or 1.0 / s > FLOAT16_MAX:
            raise AippError("preprocessing.std[%d]: 1/std must fit float16 (got std %s)" % (i, s))
    height, width = tier_hw
    if input_format == "yuv420sp" and (height % 2 or width % 2):
        raise AippError("--tiers: YUV420SP needs even sides (got %dx%d)" % (height, width))

    params: Dict[str, Value] = {
        "aipp_mode": "static",
        "input_format": AIPP_FORMAT[input_format],
        "src_image_size_w": width,
        "src_image_size_h": height,
    }
    if input_format == "yuv420sp":
        rows: List[Tuple[int, int, int]] = list(BT601_YUV_TO_RGB)
        if color == "bgr":
            rows.reverse()  # rows 0 and 2 swap: the matrix then yields B, G, R
        params["csc_switch"] = True
        params["rbuv_swap_switch"] = False
        for r, row in enumerate(rows):
            for c, value in enumerate(row):
                params["matrix_r%dc%d" % (r, c)] = value
        for i, bias in enumerate(BT601_INPUT_BIAS):
            params["input_bias_%d" % i] = bias
    else:
        params["csc_switch"] = False
        params["rbuv_swap_switch"] = input_format != color  # BGR in, RGB network: swap R and B
    for i in range(3):
        params["mean_chn_%d" % i] = 0
        params["min_chn_%d" % i] = mean[i]
        params["var_reci_chn_%d" % i] = 1.0 / std[i]
    return params


def _format(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "%.9g" % value  # float32 holds ~7.2 digits; 9 round-trip it
    return str(value)


def render_aipp(params: Dict[str, Value], header: Sequence[str] = ()) -> str:
    """The config file text: ``#`` header lines, then one ``aipp_op { key : value }`` block."""
    lines = ["# " + line for line in header]
    lines.append("aipp_op {")
    lines += ["  %s : %s" % (key, _format(value)) for key, value in params.items()]
    lines.append("}")
    return "\n".join(lines) + "\n"


def describe(color: str, mean: Sequence[float], std: Sequence[float], input_format: str) -> List[str]:
    """Header lines saying where the numbers came from (kept in the file, so the bundle explains itself)."""
    return [
        "static AIPP written by atlas-edge convert from the bundle's preprocessing contract",
        "input: letterboxed uint8 %s from the host; network colour order: %s" % (
            "NV12 (YUV420SP)" if input_format == "yuv420sp" else input_format.upper() + " HWC", color),
        "out_c = (x_c - mean_chn_c - min_chn_c) * var_reci_chn_c with min_chn = mean %s, var_reci = 1/std %s"
        % (list(mean), list(std)),
    ]
