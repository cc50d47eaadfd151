"""The MindSpore Lite ``converter_lite`` config file and argument list.

Which output a box gets (docs/converters.md has the device matrix):

- an Ascend box (``target: ascend``): ``--optimize=ascend_oriented --saveType=MINDIR``, the cloud-side
  converter's Ascend MindIR (``.mindir``), which MindSpore Lite on the 310B/310P reads with
  ``ModelType.MINDIR``. ``[ascend_context]`` carries the precision mode and the AIPP file, so the box sends
  uint8 pixels as with an ATC model. The converter compiles for the NPU of the host it runs on: run it on a
  host with the box's SoC (or on the box);
- a CPU box: ``--optimize=general --saveType=MINDIR_LITE``, a ``.ms`` file for MindSpore Lite on the ARM/x86
  CPU, fed float32 NCHW by the agent (no AIPP off the NPU).

Shapes are fixed with ``--inputShape`` (``[ascend_context] input_shape`` is for dynamic dims only).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from agent.config.device_config import lite_precision_mode

TOOL = "converter_lite"
SUCCESS_LINE = "CONVERT RESULT SUCCESS:0"
FMK = {"mindir": "MINDIR", "onnx": "ONNX"}  # bundle artifact format -> --fmk

# MAX_MIN is the documented choice for small models and simple data; KL needs more calibration images.
ACTIVATION_QUANT_METHOD = "MAX_MIN"
FULL_QUANT_BITS = 8
RECOMMENDED_CALIBRATION = (100, 500)  # the documented calibrate_size range; fewer works but is noisier


@dataclass(frozen=True)
class LiteTarget:
    """What converter_lite produces for one kind of box."""

    ascend: bool
    optimize: str  # --optimize
    save_type: str  # --saveType
    suffix: str  # what the converter appends to --outputFile
    format: str  # the bundle artifact format


ASCEND_TARGET = LiteTarget(ascend=True, optimize="ascend_oriented", save_type="MINDIR", suffix=".mindir",
                           format="mindir")
CPU_TARGET = LiteTarget(ascend=False, optimize="general", save_type="MINDIR_LITE", suffix=".ms", format="ms")


def lite_target(device_target: str) -> LiteTarget:
    return ASCEND_TARGET if device_target == "ascend" else CPU_TARGET


@dataclass(frozen=True)
class Calibration:
    """Post-training quantization input: the bundle's calibration set as the network's input tensors."""

    input_name: str
    directory: str  # relative to the converter's working directory (the bundle root)
    count: int


def config_sections(target: LiteTarget, precision_mode: str, aipp_file: Optional[str],
                    calibration: Optional[Calibration]) -> Dict[str, Dict[str, str]]:
    """The INI sections for one conversion; empty when the defaults suffice (CPU float)."""
    sections: Dict[str, Dict[str, str]] = {}
    if target.ascend:
        ascend = {"precision_mode": lite_precision_mode(precision_mode),
                  "output_type": "FP32"}  # float32 outputs: the host's post-processing stays the same
        if aipp_file:
            ascend["insert_op_config_file_path"] = aipp_file
        sections["ascend_context"] = ascend
    if calibration is not None:
        sections["common_quant_param"] = {"quant_type": "FULL_QUANT", "bit_num": str(FULL_QUANT_BITS)}
        full = {"activation_quant_method": ACTIVATION_QUANT_METHOD, "bias_correction": "true",
                "per_channel": "true"}
        if target.ascend:
            full["target_device"] = "ASCEND"  # int8 kernels for the NPU; needs --optimize=ascend_oriented
        sections["full_quant_param"] = full
        sections["data_preprocess_param"] = {
            "calibrate_path": calibrate_path([(calibration.input_name, calibration.directory)]),
            "calibrate_size": str(calibration.count),
            "input_type": "BIN",  # tensors preprocessed by quant/, not images for the converter to resize
        }
    return sections


def calibrate_path(inputs: Sequence[Tuple[str, str]]) -> str:
    """``[("images", "calibration")]`` -> ``images:calibration``; several inputs are joined with ``,``."""
    return ",".join("%s:%s" % pair for pair in inputs)


def render_ini(sections: Dict[str, Dict[str, str]], header: Sequence[str] = ()) -> str:
    lines = ["# " + line for line in header]
    for name, values in sections.items():
        lines.append("[%s]" % name)
        lines += ["%s=%s" % (key, value) for key, value in values.items()]
    return "\n".join(lines) + "\n"


def converter_args(source_format: str, model_file: str, output_stem: str, config_file: Optional[str],
                   input_name: str, shape_nchw: Tuple[int, int, int, int], target: LiteTarget,
                   input_layout: str = "NCHW") -> List[str]:
    """The converter_lite command (program name first); relative paths resolve in the working directory.

    A ``.ms`` model's input format defaults to NHWC in the device-side converter: say the bundle's layout
    explicitly, since the agent feeds exactly that.
    """
    cmd = [
        TOOL,
        "--fmk=%s" % FMK[source_format],  # the float MindIR from MindSpore, or its ONNX twin
        "--modelFile=%s" % model_file,
        "--outputFile=%s" % output_stem,  # no suffix: the converter adds .ms or .mindir
    ]
    if config_file:
        cmd.append("--configFile=%s" % config_file)  # [ascend_context] / quantization sections
    cmd += [
        "--inputShape=%s:%s" % (input_name, ",".join(str(d) for d in shape_nchw)),  # fixed, never dynamic
        "--optimize=%s" % target.optimize,  # ascend_oriented runs on Ascend only, general on CPU/GPU only
        "--saveType=%s" % target.save_type,  # MINDIR: Ascend MindIR (cloud-side); MINDIR_LITE: .ms
    ]
    if not target.ascend:
        cmd.append("--inputDataFormat=%s" % input_layout)
    return cmd
