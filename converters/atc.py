"""The CANN ATC command that compiles the bundle's ONNX artifact into an offline model (.om) with AIPP.

ONNX is the portable ATC input: MindSpore exports it on a CPU host, while AIR export needs an Ascend backend.
One command per tier: NPU models have fixed shapes (no --dynamic_* flags; AMCT-quantized models could not
use them anyway, and recompilation spikes are what fixed tiers avoid).
"""

import glob
import os
from typing import List, Optional, Tuple

TOOL = "atc"
SUCCESS_LINE = "ATC run success"
FRAMEWORK_ONNX = "5"
# Outputs stay float32 so the host's post-processing (NMS, box mapping) is the same for every backend.
OUTPUT_TYPE = "FP32"
# What --input_format may say for an ONNX model (ATC parameter page atlasatcparam_16_0015): NHWC is for
# TensorFlow/Caffe inputs, and ONNX models with AIPP must be NCHW.
ONNX_INPUT_FORMATS = ("NCHW", "NCDHW", "ND")
# Our boxes run Linux; with --host_env_os/--host_env_cpu ATC builds for the box, not for the host it runs on
# (parameter page atlasatcparam_16_0029), and names the output <stem>.om.
HOST_ENV_OS = "linux"


def atc_args(model_file: str, output_stem: str, input_name: str, shape_nchw: Tuple[int, int, int, int],
             soc_version: str, aipp_file: str, precision_mode: str, arch: Optional[str] = None) -> List[str]:
    """The atc command (program name first); relative paths resolve in ATC's working directory.

    ``arch`` (the device config's) targets the box's OS/CPU; without it ATC builds for the host it runs on.
    """
    cmd = [
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
    if arch:
        cmd += ["--host_env_os=%s" % HOST_ENV_OS, "--host_env_cpu=%s" % arch]
    return cmd


def adopt_output(work: str, output: str) -> Optional[str]:
    """Rename ATC's ``<stem>_<os>_<arch>.om`` to ``output`` (``<stem>.om``) when only the former was written.

    ATC names its output that way when the model only runs on that OS/arch; returns the name it had, or None
    when ``output`` itself was written (or nothing was: the run's check reports that).
    """
    if os.path.isfile(os.path.join(work, output)):
        return None
    stem = output[:-len(".om")]
    found = sorted(glob.glob(os.path.join(work, glob.escape(stem) + "_*_*.om")))
    if len(found) != 1:
        return None
    os.rename(found[0], os.path.join(work, output))
    return os.path.basename(found[0])
