"""The documented grammar of what the converters write, and a validator that rejects anything else.

Key sets and value domains come from the public documentation: Huawei's ATC parameter pages (e.g.
``atlasatcparam_16_0015``, ``atlasatcparam_16_0029``) and AIPP template (``atlasatc_16_0025``), the AIPP protobuf
(mindspore-ai/graphengine ``ge/proto/insert_op.proto``: key names and types) and the MindSpore Lite converter
pages. Generated files and argument lists are run through these checks before a
tool sees them, and the test stand-ins of ``atc`` and ``converter_lite`` use the same checks, so a typo in a
key, flag or value fails here instead of on an Ascend host. Bounds marked "project" below are this
project's own conservative limits where the documentation gives none.

Standard library only (the stand-ins import this module with whatever ``python3`` is on PATH).
"""

import os
import re
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from converters.atc import FRAMEWORK_ONNX, ONNX_INPUT_FORMATS


class GrammarError(ValueError):
    """Every problem found in one file or argument list, each naming its key or flag."""

    def __init__(self, what: str, errors: Sequence[str]) -> None:
        self.what = what
        self.errors = list(errors)
        count = len(self.errors)
        super().__init__("%s: %d problem%s\n  %s" % (what, count, "" if count == 1 else "s",
                                                     "\n  ".join(self.errors)))


class Domain(NamedTuple):
    """A value domain: ``text`` says what is allowed (used in error messages), ``accepts`` tests a value."""

    text: str
    accepts: Callable[[str], bool]


def choice(*values: str) -> Domain:
    return Domain("one of " + "|".join(values), lambda v: v in values)


def _int_in(lo: int, hi: int) -> Callable[[str], bool]:
    def accepts(value: str) -> bool:
        return re.fullmatch(r"-?\d+", value) is not None and lo <= int(value) <= hi
    return accepts


def integer(lo: int, hi: int) -> Domain:
    return Domain("an integer in [%d, %d]" % (lo, hi), _int_in(lo, hi))


_FLOAT = r"-?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?"


def number(lo: float, hi: float) -> Domain:
    def accepts(value: str) -> bool:
        return re.fullmatch(_FLOAT, value) is not None and lo <= float(value) <= hi
    return Domain("a number in [%g, %g]" % (lo, hi), accepts)


def pattern(regex: str, text: str) -> Domain:
    compiled = re.compile(regex)
    return Domain(text, lambda v: compiled.fullmatch(v) is not None)


PATH = pattern(r"[^\s;]+", "a path without spaces")
NAME = r"[A-Za-z0-9_./:-]+?"

# --- AIPP (static config file for ATC --insert_op_conf / converter_lite insert_op_config_file_path) ---------

AIPP_INPUT_FORMATS = (
    "YUV420SP_U8", "XRGB8888_U8", "RGB888_U8", "YUV400_U8", "ARGB8888_U8", "YUYV_U8", "YUV422SP_U8",
    "AYUV444_U8", "RAW10", "RAW12", "RAW16", "RAW24", "RGB16", "RGB20", "RGB24", "RGB8_IR", "RGB16_IR",
    "RGB24_IR",
)
# protobuf text format spells bools true/false or 1/0; samples use both.
AIPP_BOOL = choice("true", "false", "1", "0")
AIPP_SIZE = integer(0, 4096)  # project: 0 = take the model's size; 4096 is the largest documented image side
AIPP_PADDING = integer(0, 32)  # project: padding is a few pixels per side

AIPP_STATIC_KEYS: Dict[str, Domain] = {
    "input_format": choice(*AIPP_INPUT_FORMATS),
    "csc_switch": AIPP_BOOL,
    "cpadding_value": number(-65504.0, 65504.0),
    "rbuv_swap_switch": AIPP_BOOL,
    "ax_swap_switch": AIPP_BOOL,
    "single_line_mode": AIPP_BOOL,
    "src_image_size_w": AIPP_SIZE,
    "src_image_size_h": AIPP_SIZE,
    "crop": AIPP_BOOL,
    "load_start_pos_w": AIPP_SIZE,
    "load_start_pos_h": AIPP_SIZE,
    "crop_size_w": AIPP_SIZE,
    "crop_size_h": AIPP_SIZE,
    "resize": AIPP_BOOL,
    "resize_output_w": AIPP_SIZE,
    "resize_output_h": AIPP_SIZE,
    "padding": AIPP_BOOL,
    "left_padding_size": AIPP_PADDING,
    "right_padding_size": AIPP_PADDING,
    "top_padding_size": AIPP_PADDING,
    "bottom_padding_size": AIPP_PADDING,
    "raw_rgbir_to_f16_n": integer(0, 31),
}
for _i in range(4):
    AIPP_STATIC_KEYS["mean_chn_%d" % _i] = integer(0, 255)  # int32 in the proto: whole pixel values only
    AIPP_STATIC_KEYS["min_chn_%d" % _i] = number(0.0, 255.0)  # float: where a fractional mean goes
    AIPP_STATIC_KEYS["var_reci_chn_%d" % _i] = number(-65504.0, 65504.0)  # float16 range on the NPU
for _r in range(3):
    for _c in range(3):
        AIPP_STATIC_KEYS["matrix_r%dc%d" % (_r, _c)] = integer(-32768, 32767)
    AIPP_STATIC_KEYS["output_bias_%d" % _r] = integer(0, 255)
    AIPP_STATIC_KEYS["input_bias_%d" % _r] = integer(0, 255)

AIPP_COMMON_KEYS: Dict[str, Domain] = {
    "aipp_mode": choice("static", "dynamic"),
    "related_input_rank": integer(0, 1024),
    "input_edge_idx": integer(0, 1024),
}
AIPP_DYNAMIC_KEYS: Dict[str, Domain] = {
    "max_src_image_size": integer(1, 4096 * 4096 * 4),
    "support_rotation": AIPP_BOOL,
}
AIPP_MATRIX_KEYS = tuple("matrix_r%dc%d" % (r, c) for r in range(3) for c in range(3))
AIPP_REQUIRED_STATIC = ("input_format", "src_image_size_w", "src_image_size_h")

_AIPP_TOKEN = re.compile(r"\s*(?:(?P<comment>#[^\n]*)|(?P<word>[A-Za-z_][A-Za-z0-9_]*)"
                         r"|(?P<number>" + _FLOAT + r")|(?P<mark>[{}:]))")


def _aipp_tokens(text: str) -> List[str]:
    tokens = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        match = _AIPP_TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            line = text.count("\n", 0, pos) + 1
            raise GrammarError("aipp", ["line %d: unexpected text %r" % (line, text[pos:pos + 20].strip())])
        pos = match.end()
        if match.group("comment") is None:
            tokens.append(match.group("word") or match.group("number") or match.group("mark"))
    return tokens


def parse_aipp(text: str) -> List[Dict[str, str]]:
    """``aipp_op { key : value ... }`` blocks (protobuf text format) -> one dict per block, values as text.

    A key given twice in one block is an error (ATC rejects repeated scalar keys too).
    """
    tokens = _aipp_tokens(text)
    blocks: List[Dict[str, str]] = []
    errors: List[str] = []
    i = 0
    while i < len(tokens):
        if tokens[i] != "aipp_op":
            raise GrammarError("aipp", ["expected 'aipp_op {', got %r" % tokens[i]])
        i += 1
        if i < len(tokens) and tokens[i] == ":":
            i += 1
        if i >= len(tokens) or tokens[i] != "{":
            raise GrammarError("aipp", ["expected '{' after aipp_op"])
        i += 1
        block: Dict[str, str] = {}
        while i < len(tokens) and tokens[i] != "}":
            if i + 2 >= len(tokens) or tokens[i + 1] != ":":
                raise GrammarError("aipp", ["expected 'key : value' at %r" % tokens[i]])
            key, value = tokens[i], tokens[i + 2]
            if key in block:
                errors.append("aipp_op.%s: given twice" % key)
            block[key] = value
            i += 3
        if i >= len(tokens):
            raise GrammarError("aipp", ["missing '}' to close aipp_op"])
        i += 1
        blocks.append(block)
    if not blocks:
        errors.append("no aipp_op block")
    if errors:
        raise GrammarError("aipp", errors)
    return blocks


def _check_keys(prefix: str, values: Dict[str, str], domains: Dict[str, Domain], errors: List[str]) -> None:
    for key, value in values.items():
        domain = domains.get(key)
        if domain is None:
            errors.append("%s%s: unknown key" % (prefix, key))
        elif not domain.accepts(value):
            errors.append("%s%s: %r is not %s" % (prefix, key, value, domain.text))


def check_aipp(text: str) -> List[Dict[str, str]]:
    """Parse and validate an AIPP config; raises :class:`GrammarError` listing every problem."""
    blocks = parse_aipp(text)
    errors: List[str] = []
    for block in blocks:
        mode = block.get("aipp_mode")
        if mode is None:
            errors.append("aipp_op.aipp_mode: required")
        domains = dict(AIPP_COMMON_KEYS)
        domains.update(AIPP_DYNAMIC_KEYS if mode == "dynamic" else AIPP_STATIC_KEYS)
        _check_keys("aipp_op.", block, domains, errors)
        if mode != "static":
            continue
        for key in AIPP_REQUIRED_STATIC:
            if key not in block:
                errors.append("aipp_op.%s: required in static mode" % key)
        if block.get("csc_switch") in ("true", "1"):
            for key in AIPP_MATRIX_KEYS:
                if key not in block:
                    errors.append("aipp_op.%s: required when csc_switch is true" % key)
        if block.get("input_format") == "YUV420SP_U8":
            for key in ("src_image_size_w", "src_image_size_h"):
                if re.fullmatch(r"\d+", block.get(key, "0")) and int(block.get(key, "0")) % 2:
                    errors.append("aipp_op.%s: must be even for YUV420SP_U8 (got %s)" % (key, block[key]))
    if errors:
        raise GrammarError("aipp", errors)
    return blocks


# --- converter_lite config file (INI) -----------------------------------------------------------------------

LITE_PRECISION_MODES = (
    "enforce_fp32", "preferred_fp32", "enforce_fp16", "enforce_origin", "preferred_optimal")
INI_BOOL = choice("true", "false")
SHAPE_LIST = pattern(NAME + r":\[\d+(,\d+)*\](;" + NAME + r":\[\d+(,\d+)*\])*", "name:[d,d,...][;...]")
FLOAT_LIST = pattern(r"\[" + _FLOAT + r"(," + _FLOAT + r")*\]", "[x,y,...]")

LITE_SECTIONS: Dict[str, Dict[str, Domain]] = {
    "ascend_context": {
        "input_format": choice("NCHW", "NHWC", "ND"),
        "input_shape": SHAPE_LIST,
        "dynamic_dims": pattern(r"[\[\]\d,;-]+", "dynamic dims such as [1],[2]"),
        "precision_mode": choice(*LITE_PRECISION_MODES),
        "op_select_impl_mode": choice("high_performance", "high_precision"),
        "output_type": choice("FP16", "FP32", "UINT8"),
        "insert_op_config_file_path": PATH,
        "fusion_switch_config_file_path": PATH,
        "provider": choice("ge"),
    },
    "common_quant_param": {
        "quant_type": choice("WEIGHT_QUANT", "FULL_QUANT", "DYNAMIC_QUANT"),
        "bit_num": integer(0, 16),
        "min_quant_weight_size": integer(0, 65535),
        "min_quant_weight_channel": integer(0, 65535),
        "skip_quant_node": pattern(r"[^\s,]+(,[^\s,]+)*", "node names separated by ','"),
        "debug_info_save_path": PATH,
    },
    "full_quant_param": {
        "activation_quant_method": choice("MAX_MIN", "KL", "REMOVAL_OUTLIER"),
        "bias_correction": INI_BOOL,
        "per_channel": INI_BOOL,
        "target_device": choice("NVGPU", "DSP", "ASCEND"),
    },
    "data_preprocess_param": {
        "calibrate_path": pattern(NAME + r":[^\s,;]+(," + NAME + r":[^\s,;]+)*", "input_name:dir[,...]"),
        "calibrate_size": integer(1, 65535),
        "input_type": choice("IMAGE", "BIN"),
        "image_to_format": choice("RGB", "BGR", "GRAY"),
        "normalize_mean": FLOAT_LIST,
        "normalize_std": FLOAT_LIST,
        "resize_width": integer(1, 65535),
        "resize_height": integer(1, 65535),
        "resize_method": choice("LINEAR", "NEAREST", "CUBIC"),
        "center_crop_width": integer(1, 65535),
        "center_crop_height": integer(1, 65535),
    },
}
FULL_QUANT_BITS = "8"  # the documented value for FULL_QUANT
FULL_QUANT_NEEDS = ("calibrate_path", "calibrate_size", "input_type")


def parse_ini(text: str, what: str = "converter config") -> Dict[str, Dict[str, str]]:
    """``[section]`` / ``key=value`` lines (``#`` comments) -> {section: {key: value}}; repeats are errors."""
    sections: Dict[str, Dict[str, str]] = {}
    current: Optional[Dict[str, str]] = None
    errors: List[str] = []
    for number_, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        header = re.fullmatch(r"\[([A-Za-z_]+)\]", line)
        if header:
            name = header.group(1)
            if name in sections:
                errors.append("line %d: section [%s] given twice" % (number_, name))
            current = sections.setdefault(name, {})
            continue
        pair = re.fullmatch(r"([A-Za-z_]+)\s*=\s*(\S.*?)", line)
        if pair is None:
            errors.append("line %d: expected key=value, got %r" % (number_, line[:40]))
        elif current is None:
            errors.append("line %d: %s is outside any [section]" % (number_, pair.group(1)))
        elif pair.group(1) in current:
            errors.append("line %d: %s given twice" % (number_, pair.group(1)))
        else:
            current[pair.group(1)] = pair.group(2)
    if errors:
        raise GrammarError(what, errors)
    return sections


def check_lite_config(text: str) -> Dict[str, Dict[str, str]]:
    """Parse and validate a converter_lite ``--configFile``; raises :class:`GrammarError`."""
    sections = parse_ini(text)
    errors: List[str] = []
    for name, values in sections.items():
        domains = LITE_SECTIONS.get(name)
        if domains is None:
            errors.append("[%s]: unknown section (known: %s)" % (name, ", ".join(LITE_SECTIONS)))
            continue
        _check_keys("[%s] " % name, values, domains, errors)
    quant = sections.get("common_quant_param", {})
    if quant.get("quant_type") == "FULL_QUANT":
        if quant.get("bit_num", FULL_QUANT_BITS) != FULL_QUANT_BITS:
            errors.append("[common_quant_param] bit_num: must be 8 for FULL_QUANT")
        data = sections.get("data_preprocess_param", {})
        for key in FULL_QUANT_NEEDS:
            if key not in data:
                errors.append("[data_preprocess_param] %s: required for FULL_QUANT" % key)
    elif "full_quant_param" in sections:
        errors.append("[full_quant_param]: only valid with quant_type=FULL_QUANT")
    if errors:
        raise GrammarError("converter config", errors)
    return sections


# --- command-line flags -------------------------------------------------------------------------------------

FIXED_SHAPES = pattern(NAME + r":\d+(,\d+)*(;" + NAME + r":\d+(,\d+)*)*", "name:d,d,...[;...] (fixed dims)")

CONVERTER_FLAGS: Dict[str, Domain] = {
    "fmk": choice("MINDIR", "ONNX", "TF", "TFLITE", "CAFFE"),
    "modelFile": PATH,
    "outputFile": pattern(r"[^\s;]+(?<!\.ms)(?<!\.mindir)", "a path without the .ms/.mindir suffix"),
    "weightFile": PATH,
    "configFile": PATH,
    "inputShape": FIXED_SHAPES,
    "saveType": choice("MINDIR", "MINDIR_LITE"),
    "optimize": choice("none", "general", "gpu_oriented", "ascend_oriented"),
    "inputDataFormat": choice("NHWC", "NCHW"),
    "fp16": choice("on", "off"),
    "inputDataType": choice("FLOAT32", "INT8", "UINT8", "DEFAULT"),
    "outputDataType": choice("FLOAT32", "INT8", "UINT8", "DEFAULT"),
}
CONVERTER_REQUIRED = ("fmk", "modelFile", "outputFile")

ATC_FLAGS: Dict[str, Domain] = {
    "model": PATH,
    "framework": choice("0", "1", "3", "5"),  # Caffe, MindSpore .air, TensorFlow, ONNX
    "output": pattern(r"[^\s;]+(?<!\.om)", "a path without the .om suffix"),
    "soc_version": pattern(r"Ascend(310|310B[1-4]|310P[1-7]|910[A-Za-z0-9_]*)", "an Ascend SoC such as "
                           "Ascend310, Ascend310B4, Ascend310P3"),
    "input_shape": pattern(NAME + r":-?\d+(,-?\d+)*(;" + NAME + r":-?\d+(,-?\d+)*)*", "name:n,c,h,w[;...]"),
    "input_format": choice("NCHW", "NCDHW", "NHWC", "ND"),  # NHWC not for ONNX: see check_atc_args
    "insert_op_conf": PATH,
    "host_env_os": choice("linux"),
    "host_env_cpu": choice("x86_64", "aarch64"),
    "output_type": choice("FP32", "FP16", "UINT8", "INT8"),
    "out_nodes": pattern(r"[^\s;:]+:\d+(;[^\s;:]+:\d+)*", "node:index[;...]"),
    "log": choice("debug", "info", "warning", "error", "null"),
    "mode": choice("0", "1", "6"),
    "precision_mode": choice("force_fp16", "force_fp32", "allow_fp32_to_fp16", "must_keep_origin_dtype",
                             "allow_mix_precision"),
    "dynamic_batch_size": pattern(r"\d+(,\d+)+", "batch sizes such as 1,2,4,8"),
    "dynamic_image_size": pattern(r"\d+,\d+(;\d+,\d+)+", "h1,w1;h2,w2[;...]"),
}
ATC_REQUIRED_BUILD = ("model", "framework", "output", "soc_version")


def parse_flags(args: Sequence[str], what: str) -> Dict[str, str]:
    """``--name=value`` arguments -> {name: value}; anything else, an empty value or a repeat is an error."""
    flags: Dict[str, str] = {}
    errors: List[str] = []
    for arg in args:
        match = re.fullmatch(r"--([A-Za-z_][A-Za-z0-9_]*)=(.+)", arg, flags=re.DOTALL)
        if match is None:
            errors.append("%r: expected --name=value" % arg)
        elif match.group(1) in flags:
            errors.append("--%s: given twice" % match.group(1))
        else:
            flags[match.group(1)] = match.group(2)
    if errors:
        raise GrammarError(what, errors)
    return flags


def _check_flags(flags: Dict[str, str], domains: Dict[str, Domain], required: Sequence[str],
                 errors: List[str]) -> None:
    for name, value in flags.items():
        domain = domains.get(name)
        if domain is None:
            errors.append("--%s: unknown flag" % name)
        elif not domain.accepts(value):
            errors.append("--%s: %r is not %s" % (name, value, domain.text))
    for name in required:
        if name not in flags:
            errors.append("--%s: required" % name)


def check_converter_args(args: Sequence[str]) -> Dict[str, str]:
    """Validate converter_lite's arguments (without the program name); raises :class:`GrammarError`."""
    flags = parse_flags(args, "converter_lite arguments")
    errors: List[str] = []
    _check_flags(flags, CONVERTER_FLAGS, CONVERTER_REQUIRED, errors)
    if errors:
        raise GrammarError("converter_lite arguments", errors)
    return flags


def check_atc_args(args: Sequence[str]) -> Dict[str, str]:
    """Validate ATC's arguments (without the program name); raises :class:`GrammarError`."""
    flags = parse_flags(args, "atc arguments")
    errors: List[str] = []
    building = flags.get("mode", "0") == "0"
    _check_flags(flags, ATC_FLAGS, ATC_REQUIRED_BUILD if building else ("model",), errors)
    dynamic = [name for name in ("dynamic_batch_size", "dynamic_image_size") if name in flags]
    has_minus_one = "-1" in re.split(r"[:,;]", flags.get("input_shape", ""))
    if len(dynamic) > 1:
        errors.append("--dynamic_batch_size and --dynamic_image_size exclude each other")
    if dynamic and not has_minus_one:
        errors.append("--%s: needs -1 in --input_shape" % dynamic[0])
    if has_minus_one and not dynamic:
        errors.append("--input_shape: -1 needs --dynamic_batch_size or --dynamic_image_size")
    if flags.get("framework") == FRAMEWORK_ONNX and flags.get("input_format", "NCHW") not in ONNX_INPUT_FORMATS:
        errors.append("--input_format=%s: for an ONNX model (--framework=5) ATC takes %s" % (
            flags["input_format"], ", ".join(ONNX_INPUT_FORMATS)))
    if ("host_env_os" in flags) != ("host_env_cpu" in flags):
        errors.append("--host_env_os and --host_env_cpu go together")
    if errors:
        raise GrammarError("atc arguments", errors)
    return flags


# --- whole invocations (arguments plus the files they name), as a tool would see them -----------------------

def _read(path: str, flag: str, errors: List[str]) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        errors.append("%s: cannot read %s (%s)" % (flag, path, exc.strerror))
        return None


def _collect(check: Callable[[str], object], text: Optional[str], errors: List[str]) -> None:
    if text is None:
        return
    try:
        check(text)
    except GrammarError as exc:
        errors.extend("%s: %s" % (exc.what, e) for e in exc.errors)


def check_converter_call(args: Sequence[str], cwd: str = "."
                         ) -> Tuple[Dict[str, str], Dict[str, Dict[str, str]]]:
    """Arguments, the config file and the AIPP file it names, and the cross rules between them.

    Relative paths resolve against ``cwd`` (the converter's working directory). Returns (flags, config).
    """
    flags = check_converter_args(args)
    errors: List[str] = []
    config: Dict[str, Dict[str, str]] = {}
    if not os.path.isfile(os.path.join(cwd, flags["modelFile"])):
        errors.append("--modelFile: no such file %s" % flags["modelFile"])
    if "configFile" in flags:
        text = _read(os.path.join(cwd, flags["configFile"]), "--configFile", errors)
        if text is not None:
            try:
                config = check_lite_config(text)
            except GrammarError as exc:
                errors.extend(exc.errors)
    ascend = config.get("ascend_context", {})
    if "insert_op_config_file_path" in ascend:
        _collect(check_aipp, _read(os.path.join(cwd, ascend["insert_op_config_file_path"]),
                                   "insert_op_config_file_path", errors), errors)
    if config.get("full_quant_param", {}).get("target_device") == "ASCEND" and \
            flags.get("optimize") != "ascend_oriented":
        errors.append("[full_quant_param] target_device=ASCEND needs --optimize=ascend_oriented")
    if ascend and flags.get("optimize") != "ascend_oriented":
        errors.append("[ascend_context] only applies with --optimize=ascend_oriented")
    calibrate = config.get("data_preprocess_param", {}).get("calibrate_path")
    if calibrate:
        for item in calibrate.split(","):
            directory = item.split(":", 1)[1]
            if not os.path.isdir(os.path.join(cwd, directory)):
                errors.append("calibrate_path: no such directory %s" % directory)
    if errors:
        raise GrammarError("converter_lite call", errors)
    return flags, config


def check_atc_call(args: Sequence[str], cwd: str = ".") -> Dict[str, str]:
    """Arguments and the AIPP file named by ``--insert_op_conf``; relative paths resolve against ``cwd``."""
    flags = check_atc_args(args)
    errors: List[str] = []
    if not os.path.isfile(os.path.join(cwd, flags["model"])):
        errors.append("--model: no such file %s" % flags["model"])
    if "insert_op_conf" in flags:
        _collect(check_aipp, _read(os.path.join(cwd, flags["insert_op_conf"]), "--insert_op_conf", errors),
                 errors)
    if errors:
        raise GrammarError("atc call", errors)
    return flags
