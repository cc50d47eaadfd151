"""``atlas-edge qat``: train, quantize (Golden Stick SimQAT), export and write a model bundle with a report.

Wired into the ``atlas-edge`` console script by the agent's CLI through :func:`add_arguments` and :func:`run`.
MindSpore and Golden Stick are imported only inside :func:`run`, so ``--help`` works on a box without them.
"""

import argparse
import logging
import os
import sys
from typing import List, Optional

log = logging.getLogger(__name__)

DESCRIPTION = """Train (or load) a float network, fine-tune it with Golden Stick SimQAT (simulated int8),
export float, simulated-quant and deploy MindIR and float ONNX for every fixed-shape tier, and write a model
bundle (manifest, calibration set, golden set, report.json, report.txt) to --out."""

EXAMPLES = """examples:
  atlas-edge qat --config quant/examples/shapes.yaml --out examples/demo-bundle
  atlas-edge qat --config quant/examples/digits.yaml --out /tmp/digits-bundle --epochs 3 --qat-epochs 1"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``atlas-edge qat`` on ``parser``."""
    parser.description = DESCRIPTION
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", required=True, help="QAT config (YAML), e.g. quant/examples/shapes.yaml")
    parser.add_argument(
        "--out", required=True, help="bundle directory to write (replaced if it holds a bundle)"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="float training epochs (overrides train.epochs)"
    )
    parser.add_argument("--qat-epochs", type=int, default=None, help="QAT epochs (overrides qat.epochs)")
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu", "ascend"),
        default="cpu",
        help="cpu uses atlas-edge's CPU fake quantizers; gpu/ascend Golden Stick's own kernels",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse the float/QAT checkpoints of an earlier run with the same settings",
    )
    parser.add_argument(
        "--work-dir",
        default=None,
        help="where checkpoints go (default: ~/.cache/atlas-edge/qat/<out name>-<hash>)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the pipeline; returns the process exit status (0 success, 2 bad input, 1 failure)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (("--epochs", args.epochs), ("--qat-epochs", args.qat_epochs)):
        if value is not None and value < (0 if name == "--epochs" else 1):
            print(
                "atlas-edge qat: %s must be >= %d, got %d" % (name, 0 if name == "--epochs" else 1, value),
                file=sys.stderr,
            )
            return 2
    from agent.config.schema import ConfigError
    from quant.config import load_config

    try:
        config = load_config(args.config)
    except (ConfigError, FileNotFoundError) as exc:
        print("atlas-edge qat: %s" % exc, file=sys.stderr)
        return 2
    try:
        import mindspore  # noqa: F401  (the host extra)
        import mindspore_gs  # noqa: F401
    except ImportError as exc:
        print(
            "atlas-edge qat needs the host extra (MindSpore, Golden Stick): %s\n"
            "  pip install -e '.[host]' && pip install --no-deps mindspore-gs==1.3.0" % exc,
            file=sys.stderr,
        )
        return 2

    from quant.datasets import DatasetError
    from quant.pipeline import BadInput, PipelineError, QatRun, RunOptions

    options = RunOptions(
        out_dir=os.path.abspath(args.out),
        device=args.device,
        epochs=args.epochs,
        qat_epochs=args.qat_epochs,
        resume=args.resume,
        work_dir=args.work_dir,
    )
    try:
        QatRun(config, options).run()
    except (BadInput, DatasetError) as exc:
        print("atlas-edge qat: bad input: %s" % exc, file=sys.stderr)
        return 2
    except PipelineError as exc:
        print("atlas-edge qat: failed: %s" % exc, file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Stand-alone entry (``python -m quant.cli``) for use before the console script wires it in."""
    parser = argparse.ArgumentParser(prog="atlas-edge qat")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
