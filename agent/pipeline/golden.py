"""How a golden case's output is judged: strictly for float artifacts, against the model's own quantization error
for quantized ones (docs/bundle.md, "The golden set").

A float artifact must give the host's numbers within ``golden.atol``/``rtol``: float kernels on another CPU differ
in the last bits only (measured: 3e-4 at most on the demo detector under emulated Cortex-A53/A76).

A quantized artifact (``int8``, ``int8-sim``) cannot always be held to that. Wherever float arithmetic sits in
front of a QuantizeLinear (every fake-quant node of an int8-sim model; onnxruntime's unfused QDQ path; the float
stem of int8 ONNX written before the exact stem, converters/int8_stem.py) another CPU's kernels sum in another
order, and a value that lands within one ulp of a rounding boundary rounds to the next step; that one step then
spreads through the receptive field. Measured on the committed demo bundle's 192x320 int8 model: on Arm, 1 of
the stem's 245,760 quantized activations came out one step away from x86's, 69-113 elements four layers on, and
the decoded output moved by up to 1.06 px in a box width (``exp`` amplifies it) while every detection stayed the
same. Such a flip is one of the model's hundreds of thousands of roundings, so in a shallow network it stays a
small part of the error all of them make together: the int8 model's own distance from the float model. (In a
deep one it does not, which is why the int8 ONNX the project writes now has an exact stem and nothing but integer
kernels up to the decode: docs/bundle.md, "The golden self-test".)
A wrong model (activation scales off, damaged weights, a wrong input) moves every output by as much as that
error or more. So a quantized case passes when, per output channel, the RMS of its difference from the host's
int8 output is at most ``golden.quantized.rms_ratio`` times the RMS of the host's int8-minus-float difference
in that channel, and no element moves further than ``max_ratio`` times the largest int8-minus-float difference
of its channel (a guard against a local error the RMS would average away). The float output comes from the same
case (every bundle the project makes stores one); a case without one is judged strictly.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np

QUANTIZED_PRECISIONS = ("int8", "int8-sim")
FLOAT_PRECISIONS = ("float32", "float16")
# The axis along which a task's raw output holds one kind of value (docs/bundle.md): yolov8 (B, 4+nc, N) has a
# channel per row, yolov5 (B, N, 5+nc) per column; a classifier's (B, nc) logits move together, one group.
TINY = float(np.finfo(np.float32).tiny)  # the least floor: a 0/0 ratio would be NaN, and NaN passes every limit
CHANNEL_AXIS = {"detect-yolov8": 1, "detect-yolov5": -1, "classify": None}


@dataclass
class CaseVerdict:
    """One golden case of one artifact: ``failure`` is None when it passed."""

    max_abs_diff: float
    rms_ratio: Optional[float] = None  # quantized rule only: the worst channel's RMS ratio
    failure: Optional[str] = None


def judge_strict(got: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> CaseVerdict:
    """Every element within ``atol + rtol * |expected|`` (numpy's ``allclose``)."""
    diff = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
    if np.allclose(got, expected, atol=atol, rtol=rtol):
        return CaseVerdict(diff)
    return CaseVerdict(diff, failure="max abs diff %.3g beyond atol %g / rtol %g" % (diff, atol, rtol))


def _per_channel(values: np.ndarray, axis: Optional[int]) -> np.ndarray:
    """(C, M): one row per channel of the task's output (one row for all of it when ``axis`` is None)."""
    if axis is None:
        return values.reshape(1, -1)
    return np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1)


def judge_quantized(got: np.ndarray, expected: np.ndarray, reference: np.ndarray, task: str,
                    rms_ratio: float, max_ratio: float, floor: float) -> CaseVerdict:
    """The quantized rule (module docstring): ``expected`` is the host's output of this artifact, ``reference``
    the host's output of a float artifact on the same case; ``floor`` (the strict ``atol``) keeps a channel where
    int8 and float agree exactly from demanding more than a float artifact would get."""
    floor = max(floor, TINY)  # atol 0 is allowed: a channel where int8 equals float then demands exactly that
    got64, expected64 = got.astype(np.float64), expected.astype(np.float64)
    axis = CHANNEL_AXIS.get(task)
    moved = _per_channel(got64 - expected64, axis)  # (C, M)
    quant = _per_channel(expected64 - reference.astype(np.float64), axis)
    diff = float(np.max(np.abs(moved))) if moved.size else 0.0
    rms = np.sqrt(np.mean(np.square(moved), axis=1))
    quant_rms = np.maximum(np.sqrt(np.mean(np.square(quant), axis=1)), floor)
    quant_max = np.maximum(np.max(np.abs(quant), axis=1), floor)
    ratios = rms / quant_rms
    worst = int(np.argmax(ratios))
    verdict = CaseVerdict(diff, rms_ratio=float(ratios[worst]))
    if ratios[worst] > rms_ratio:
        verdict.failure = ("channel %d moved by %.3g RMS, %.2fx the int8-vs-float error %.3g there (limit %gx); "
                           "max abs diff %.3g" % (worst, rms[worst], ratios[worst], quant_rms[worst], rms_ratio,
                                                  diff))
        return verdict
    peaks = np.max(np.abs(moved), axis=1) / quant_max
    peak = int(np.argmax(peaks))
    if peaks[peak] > max_ratio:
        verdict.failure = ("channel %d has an element %.3g away, %.2fx the largest int8-vs-float difference %.3g "
                           "there (limit %gx)" % (peak, np.max(np.abs(moved[peak])), peaks[peak], quant_max[peak],
                                                  max_ratio))
    return verdict
