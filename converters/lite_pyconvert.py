"""``converter_lite``'s command line on ``mindspore_lite.Converter``: the converter where only the wheel exists.

PyPI's only MindSpore Lite wheel (2.0.0) is built for CPython 3.7, while the host trains on the newest
MindSpore and Python. ``atlas-edge convert`` therefore runs this file *as a script* under an interpreter that
imports ``mindspore_lite`` (``ATLAS_EDGE_MSLITE_PYTHON`` or ``.venv-lite``; see converters/toolrun.py), with
exactly the ``--name=value`` flags it would pass the ``converter_lite`` binary. It imports nothing from this
project (the interpreter need not have it installed) and keeps to Python 3.7.

``--version`` prints ``mindspore_lite <version>``; the binary documents no such flag, this script does.
Exit status: 0 converted (the wheel itself prints ``CONVERT RESULT SUCCESS:0``), 1 the converter failed,
2 a flag it cannot map.
"""

import sys
from typing import Dict, List

# converter_lite flag -> what it sets on the Converter; anything else is refused, never ignored
FLAGS = ("fmk", "modelFile", "outputFile", "weightFile", "configFile", "inputShape", "optimize", "saveType",
         "inputDataFormat", "fp16", "inputDataType", "outputDataType")
REQUIRED = ("fmk", "modelFile", "outputFile")
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(ValueError):
    """A flag this script cannot map onto mindspore_lite.Converter."""


def parse_flags(argv: List[str]) -> Dict[str, str]:
    """``["--fmk=ONNX", ...]`` -> ``{"fmk": "ONNX", ...}``; unknown, repeated or valueless flags are errors."""
    flags: Dict[str, str] = {}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise UsageError("expected --name=value, got %r" % arg)
        name, value = arg[2:].split("=", 1)
        if name not in FLAGS:
            raise UsageError("--%s is not a converter_lite flag this script maps (known: %s)" % (
                name, ", ".join("--" + f for f in FLAGS)))
        if name in flags:
            raise UsageError("--%s given twice" % name)
        flags[name] = value
    missing = [name for name in REQUIRED if name not in flags]
    if missing:
        raise UsageError("missing %s" % ", ".join("--" + m for m in missing))
    return flags


def parse_shapes(text: str) -> Dict[str, List[int]]:
    """``images:1,3,256,256;mask:1,1,8,8`` -> ``{"images": [1, 3, 256, 256], "mask": [1, 1, 8, 8]}``."""
    shapes: Dict[str, List[int]] = {}
    for part in [p for p in text.split(";") if p]:
        name, sep, dims = part.rpartition(":")
        try:
            shapes[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            raise UsageError("--inputShape: %r is not name:d1,d2,..." % part) from None
        if not sep or not name:
            raise UsageError("--inputShape: %r is not name:d1,d2,..." % part)
    return shapes


def _member(enum: object, flag: str, value: str) -> object:
    try:
        return getattr(enum, value)
    except AttributeError:
        raise UsageError("--%s=%s: mindspore_lite has no %s.%s" % (
            flag, value, getattr(enum, "__name__", enum), value)) from None


def build(mslite: object, flags: Dict[str, str]) -> object:
    """A Converter with every flag applied (the attribute names of the MindSpore Lite 2.x Python API)."""
    converter = mslite.Converter()  # type: ignore[attr-defined]
    if "inputShape" in flags:
        converter.input_shape = parse_shapes(flags["inputShape"])
    if "optimize" in flags:
        converter.optimize = flags["optimize"]
    if "saveType" in flags:
        converter.save_type = _member(mslite.ModelType, "saveType", flags["saveType"])  # type: ignore
    if "inputDataFormat" in flags:
        converter.input_format = _member(mslite.Format, "inputDataFormat", flags["inputDataFormat"])  # type: ignore
    if "fp16" in flags:
        if flags["fp16"] not in ("on", "off"):
            raise UsageError("--fp16 must be on or off (got %r)" % flags["fp16"])
        converter.weight_fp16 = flags["fp16"] == "on"
    for flag, attribute in (("inputDataType", "input_data_type"), ("outputDataType", "output_data_type")):
        if flag in flags:
            setattr(converter, attribute, _member(mslite.DataType, flag, flags[flag]))  # type: ignore
    return converter


def main(argv: List[str]) -> int:
    try:
        import mindspore_lite as mslite
    except ImportError as err:
        print("lite_pyconvert: this interpreter (%s) cannot import mindspore_lite: %s" % (sys.executable, err),
              file=sys.stderr)
        return EXIT_FAILED
    if argv == ["--version"]:
        print("mindspore_lite %s" % mslite.__version__)
        return 0
    try:
        flags = parse_flags(argv)
        converter = build(mslite, flags)
        fmk = _member(mslite.FmkType, "fmk", flags["fmk"])
    except (UsageError, ValueError, TypeError) as err:
        print("lite_pyconvert: %s" % err, file=sys.stderr)
        return EXIT_USAGE
    print("lite_pyconvert: mindspore_lite %s Converter on Python %s" % (
        mslite.__version__, sys.version.split()[0]), flush=True)
    try:
        converter.convert(fmk, flags["modelFile"], flags["outputFile"], flags.get("weightFile", ""),
                          flags.get("configFile", ""))
    except (RuntimeError, ValueError, TypeError) as err:
        print("lite_pyconvert: conversion failed: %s" % err, file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
