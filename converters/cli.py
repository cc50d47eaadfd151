"""``atlas-edge convert``: the command-line face of :mod:`converters.convert`.

``add_arguments(parser)`` and ``run(args) -> int`` are what the ``atlas-edge`` entry point wires in;
``python -m converters.cli`` runs the same command on its own.

Exit status: 0 converted (or planned, with --dry-run), 1 the conversion failed (tool or copy; rolled back),
2 bad input, 3 tool missing.
"""

import argparse
import logging
import os
import re
import sys
from typing import List, Optional, Sequence

from converters import aipp, toolrun
from converters.convert import DEFAULT_TIMEOUT_S, ConvertError, ConvertRequest, Tier, execute, plan_conversion

EXIT_OK = 0
EXIT_TOOL_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_TOOL_MISSING = 3

DESCRIPTION = """\
Convert a bundle's float model for an Ascend box (or a CPU box running MindSpore Lite) and add the result
to the bundle's manifest.

  --to om   CANN ATC: the bundle's ONNX artifact -> .om with static AIPP (Ascend 310/310B/310P boxes).
  --to ms   MindSpore Lite converter_lite: the float MindIR (or ONNX) -> Ascend MindIR (.mindir, with AIPP)
            for an Ascend device config, or .ms (float32 input, CPU) for a CPU device config.

AIPP moves colour order and (x - mean) / std onto the NPU, from the bundle's "preprocessing": the box then
sends letterboxed uint8 pixels. --dry-run prints every generated file and command and changes nothing.
A failed conversion leaves the bundle byte for byte as it was; several tiers succeed or fail together.
"""

EPILOG = """\
tools are looked up on PATH, then:
  atc:            $ASCEND_TOOLKIT_HOME/bin, $ASCEND_HOME/latest/bin, %s
  converter_lite: $MSLITE_HOME/tools/converter/converter (its lib/ is added to LD_LIBRARY_PATH)
exit status: 0 done, 1 the tool failed (log tail printed), 2 bad input, 3 tool not found
see docs/converters.md
""" % toolrun.DEFAULT_TOOLKIT_BIN


def parse_tiers(text: str) -> List[Tier]:
    """``256,320`` (squares) or ``256x256,192x320`` (h x w), mixed freely -> [(h, w), ...]."""
    tiers: List[Tier] = []
    for part in [p.strip() for p in text.split(",")]:
        square = re.fullmatch(r"(\d+)", part)
        pair = re.fullmatch(r"(\d+)[xX](\d+)", part)
        if square:
            tier = (int(square.group(1)),) * 2
        elif pair:
            tier = (int(pair.group(1)), int(pair.group(2)))
        else:
            raise argparse.ArgumentTypeError("%r: expected sizes like 256,320 or 256x256,192x320" % part)
        if min(tier) <= 0:
            raise argparse.ArgumentTypeError("%r: tier sides must be positive" % part)
        tiers.append(tier)  # type: ignore[arg-type]
    return tiers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--bundle", required=True, metavar="DIR", help="the model bundle (updated in place)")
    parser.add_argument("--device", required=True, metavar="NAME",
                        help="device config name (device_configs/NAME.yaml) or path: SoC and precision mode")
    parser.add_argument("--to", required=True, choices=("om", "ms"),
                        help="om: ATC .om with AIPP; ms: converter_lite (.mindir for Ascend, .ms for CPU)")
    parser.add_argument("--tiers", type=parse_tiers, metavar="LIST",
                        help="tiers: 256,320 or 256x256,192x320 (h x w); default: all of the bundle's")
    parser.add_argument("--ptq", action="store_true",
                        help="int8 post-training quantization on the bundle's calibration set (--to ms)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the generated files and exact commands, change nothing")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="seconds per tool run before it is killed (default %(default).0f)")
    parser.add_argument("--input-format", choices=aipp.INPUT_FORMATS, default=None,
                        help="what the box feeds the NPU model: bgr (OpenCV frames, default), rgb, "
                             "or yuv420sp (NV12, converted to the network's colours by AIPP)")


def _request(args: argparse.Namespace) -> ConvertRequest:
    return ConvertRequest(bundle=args.bundle, device=args.device, to=args.to, tiers=args.tiers, ptq=args.ptq,
                          input_format=args.input_format, timeout_s=args.timeout)


def run(args: argparse.Namespace, env: Optional[dict] = None) -> int:
    """Plan, then print (--dry-run) or execute; messages go to stdout/stderr, the status is returned."""
    env = dict(os.environ) if env is None else env
    try:
        plan = plan_conversion(_request(args))
    except ConvertError as exc:
        print("atlas-edge convert: cannot convert:", file=sys.stderr)
        for error in exc.errors:
            print("  " + error, file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.dry_run:
        sys.stdout.write(plan.render())
        return EXIT_OK
    for warning in plan.warnings:
        print("warning: " + warning, file=sys.stderr)
    try:
        added = execute(plan, env, args.timeout)
    except toolrun.ToolNotFound as exc:
        print("atlas-edge convert: %s" % exc, file=sys.stderr)
        print("The bundle is unchanged. To convert elsewhere, this is the plan (--dry-run):\n",
              file=sys.stderr)
        sys.stderr.write(plan.render())
        return EXIT_TOOL_MISSING
    except toolrun.ToolFailed as exc:
        print("atlas-edge convert: %s %s; the bundle is unchanged." % (exc.tool, exc.reason), file=sys.stderr)
        if exc.log_tail:
            print("--- last lines of the %s log ---\n%s" % (exc.tool, exc.log_tail), file=sys.stderr)
        return EXIT_TOOL_FAILED
    except ConvertError as exc:
        print("atlas-edge convert: " + str(exc), file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # staging or copying into the bundle (disk full, permissions): rolled back
        print("atlas-edge convert: %s; the bundle is unchanged." % exc, file=sys.stderr)
        return EXIT_TOOL_FAILED
    for art in added:
        print("added %s: tier %dx%d, %s, %s, %d bytes, sha256 %s" % (
            art["file"], art["tier"][0], art["tier"][1], art["target"], art["precision"], art["size"],
            art["sha256"][:16]))
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-edge convert")
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
