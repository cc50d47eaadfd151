"""One object per conversion tool: what ATC (``--to om``) and converter_lite (``--to ms``) each need, so
:func:`converters.convert.plan_conversion` asks the tool instead of branching on ``--to``.

A tool says which requests it refuses, the artifact format it writes, which source formats it reads (in order
of preference), the command and config files for one tier, the toolchain facts an artifact records, the
grammar its arguments are checked against, and how its output file is found after a run.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

from converters import atc, grammar, lite_config, toolrun

Tier = Tuple[int, int]
Shape = Tuple[int, int, int, int]
# (output file, command, generated files as (bundle-relative path, text)) for one tier; None: refused (errors)
TierCommand = Optional[Tuple[str, List[str], List[Tuple[str, str]]]]


class AtcTool:
    """ATC: ONNX (with an optional AIPP config) to an Ascend .om for one SoC."""

    to = "om"
    info = toolrun.ATC
    source_formats: Sequence[str] = ("onnx",)
    records_host_cann = False  # ATC is CANN: its own version is the toolchain's

    def refusals(self, device: Any, ptq: bool) -> List[str]:
        errors = []
        if device.target != "ascend":
            errors.append("--to om: ATC builds for an Ascend NPU; device %s is a %s box (use --to ms)" % (
                device.name, device.target))
        if ptq:
            errors.append("--ptq: ATC does not quantize (int8 .om needs CANN AMCT); use --to ms --ptq")
        return errors

    def out_format(self, device: Any) -> str:
        return "om"

    def command(self, manifest: Any, device: Any, source: Any, stem: str, shape: Shape, aipp_path: Optional[str],
                calibration: Optional[lite_config.Calibration], config_dir: str, errors: List[str]) -> TierCommand:
        if manifest.input.layout not in atc.ONNX_INPUT_FORMATS:
            errors.append("--to om: the bundle's input.layout is %s, but ATC reads an ONNX model's input as %s "
                          "only (and AIPP needs NCHW): export the ONNX with an NCHW input" % (
                              manifest.input.layout, "/".join(atc.ONNX_INPUT_FORMATS)))
            return None
        cmd = atc.atc_args(source.file, stem, manifest.input.name, shape, device.soc_version, aipp_path or "",
                           device.precision_mode, device.arch)
        return stem + ".om", cmd, []

    def toolchain(self, device: Any) -> Dict[str, Any]:
        return {"arch": device.arch} if device.arch else {}

    def adopt_output(self, work: str, output: str) -> Optional[str]:
        """ATC appends its own suffix to ``--output``: the file it wrote, renamed to ``output`` (None: as is)."""
        return atc.adopt_output(work, output)

    def check_args(self, args: List[str]) -> None:
        grammar.check_atc_args(args)


class LiteTool:
    """converter_lite: MindIR or ONNX to a MindSpore Lite .ms, for the CPU or an Ascend target (config file)."""

    to = "ms"
    info = toolrun.CONVERTER_LITE
    source_formats: Sequence[str] = ("mindir", "onnx")
    records_host_cann = True  # for an Ascend target it runs on the host's CANN, whose version the artifact records

    def refusals(self, device: Any, ptq: bool) -> List[str]:
        return []

    def out_format(self, device: Any) -> str:
        return lite_config.lite_target(device.target).format

    def command(self, manifest: Any, device: Any, source: Any, stem: str, shape: Shape, aipp_path: Optional[str],
                calibration: Optional[lite_config.Calibration], config_dir: str, errors: List[str]) -> TierCommand:
        target = lite_config.lite_target(device.target)
        output = stem + target.suffix
        sections = lite_config.config_sections(target, device.precision_mode, aipp_path, calibration)
        config_path = None
        files = []
        if sections:
            config_path = "%s/converter_%s.ini" % (config_dir, stem)
            files.append((config_path, lite_config.render_ini(
                sections, ["converter_lite config written by atlas-edge convert for %s" % output,
                           "paths are relative to the bundle root (the converter's working directory)"])))
        cmd = lite_config.converter_args(source.format, source.file, stem, config_path, manifest.input.name, shape,
                                         target, manifest.input.layout)
        return output, cmd, files

    def toolchain(self, device: Any) -> Dict[str, Any]:
        return {}

    def adopt_output(self, work: str, output: str) -> Optional[str]:
        return None  # converter_lite writes the name it was given

    def check_args(self, args: List[str]) -> None:
        grammar.check_converter_args(args)


TOOLS = {tool.to: tool for tool in (AtcTool(), LiteTool())}
