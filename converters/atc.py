"""The CANN ATC command that compiles the bundle's ONNX artifact into an offline model (.om) with AIPP.

ONNX is the portable ATC input: MindSpore exports it on a CPU host, while AIR export needs an Ascend backend.
One command per tier: NPU models have fixed shapes (no --dynamic_* flags; AMCT-quantized models could not
use them anyway, and recompilation spikes are what fixed tiers avoid).
"""

from typing import List, Tuple

TOOL = "atc"
SUCCESS_LINE = "ATC run success"
FRAMEWORK_ONNX = "5"
# Outputs stay float32 so the host's post-processing (NMS, box mapping) is the same for every backend.
OUTPUT_TYPE = "FP32"


def atc_args(model_file: str, output_stem: str, input_name: str, shape_nchw: Tuple[int, int, int, int],
             soc_version: str, aipp_file: str, precision_mode: str) -> List[str]:
    """The atc command (program name first); relative paths resolve in ATC's working directory."""
    return [
        TOOL,
        "--model=%s" % model_file,  # the bundle's float ONNX artifact of this tier
        "--framework=%s" % FRAMEWORK_ONNX,  # 5 = ONNX
        "--output=%s" % output_stem,  # ATC appends .om
        "--input_shape=%s:%s" % (input_name, ",".join(str(d) for d in shape_nchw)),  # fixed n,c,h,w
        "--input_format=NCHW",  # of the ONNX graph; with AIPP the .om's own input becomes uint8 NHWC
        "--soc_version=%s" % soc_version,  # a model built for one SoC does not load on another
        "--insert_op_conf=%s" % aipp_file,  # static AIPP: colour order and (x - mean) / std on the NPU
        "--precision_mode=%s" % precision_mode,  # the device config's choice (force_fp16 by default)
        "--output_type=%s" % OUTPUT_TYPE,  # float32 outputs, whatever the internal precision
        "--log=error",  # keep the captured log to what explains a failure
    ]
