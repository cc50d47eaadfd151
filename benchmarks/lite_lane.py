"""The MindSpore Lite lane of the serving benchmarks: a section's own ``run`` for backend ``mslite``, executed by
the Lite venv's interpreter on the bundle converted to ``.ms``.

MindSpore Lite 2.0.0 exists only for CPython 3.7 while the benchmark runs on the host's Python, so a section
hands the ``mslite`` lane to :func:`measure` when ``mindspore_lite`` does not import here: the bundle is
converted once per run (``atlas-edge convert --to ms --device cpu-dev``, the converter found as
converters/toolrun.py finds it), then ``python -m benchmarks.lite_lane SECTION ...`` runs that section with
``backends=("mslite",)`` in the Lite interpreter and prints its JSON. The figures land under the section's
``backends.mslite``, beside the host's backends; the lane's Python is recorded with them.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
from typing import Any, Dict, Optional, Sequence

log = logging.getLogger(__name__)

BACKEND = "mslite"
LANE_TIMEOUT_S = 1800.0  # a full profile's start-up and memory runs on a busy 2-core box
LITE_BUNDLE_DIR = "lite-bundle"  # under the run's work directory
_CONVERTED: Dict[str, str] = {}  # source bundle -> converted copy, once per process


def lite_python() -> Optional[str]:
    """The interpreter that runs the lane: ``$ATLAS_EDGE_MSLITE_PYTHON`` or ``.venv-lite``'s, when it imports
    mindspore_lite; None otherwise."""
    from converters import toolrun

    python = os.environ.get(toolrun.MSLITE_PYTHON_ENV) or toolrun.LITE_VENV_PYTHON
    return python if toolrun.probe_mslite_python(python)[0] is not None else None


def delegated(context: Any) -> bool:
    """Whether this process should hand the mslite lane to the Lite interpreter (it cannot run it itself)."""
    from benchmarks.workload import backend_available

    return BACKEND in context.backends and backend_available(BACKEND) is not None


def converted_bundle(bundle_dir: str, work_dir: str, python: str) -> str:
    """A copy of ``bundle_dir`` with a ``.ms`` per tier (unchanged when it already has them)."""
    from agent.bundle.manifest import load_manifest

    if any(a.format == "ms" and a.target == "cpu" for a in load_manifest(bundle_dir).artifacts):
        return bundle_dir
    if bundle_dir in _CONVERTED:
        return _CONVERTED[bundle_dir]
    from agent.bundle.verify import copy_writable
    from converters import cli as convert_cli
    from converters import toolrun

    copy = copy_writable(bundle_dir, os.path.join(work_dir, "%s-%d" % (LITE_BUNDLE_DIR, len(_CONVERTED))))
    parser = argparse.ArgumentParser()
    convert_cli.add_arguments(parser)
    env = dict(os.environ, **{toolrun.MSLITE_PYTHON_ENV: python})
    status = convert_cli.run(parser.parse_args(["--bundle", copy, "--device", "cpu-dev", "--to", "ms"]), env=env)
    if status != convert_cli.EXIT_OK:
        raise RuntimeError("converting %s for the mslite lane failed (exit %d)" % (bundle_dir, status))
    _CONVERTED[bundle_dir] = copy
    return copy


def measure(section: str, context: Any) -> Dict[str, Any]:
    """``backends.mslite`` of ``section``, measured in the Lite interpreter, or ``{"skipped": why}``."""
    python = lite_python()
    if python is None:
        return {"skipped": "no Python with mindspore_lite (make lite, or set ATLAS_EDGE_MSLITE_PYTHON)"}
    bundle = converted_bundle(context.bundle_dir, context.work_dir, python)
    work = os.path.join(context.work_dir, "lite-%s" % section)
    os.makedirs(work, exist_ok=True)
    cmd = [python, "-m", "benchmarks.lite_lane", section, "--bundle", bundle, "--work-dir", work,
           "--threads", str(context.threads), "--profile", context.profile.name, "--device", context.device]
    done = subprocess.run(cmd, cwd=context.root, capture_output=True, text=True, timeout=LANE_TIMEOUT_S,
                          env=dict(os.environ, PYTHONPATH=context.root), check=False)
    if done.returncode != 0:
        raise RuntimeError("the mslite lane of %s failed (exit %d):\n%s" % (
            section, done.returncode, (done.stderr or done.stdout)[-3000:]))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    lane = result["backends"][BACKEND]
    lane["lane"] = {"python": result["python"], "mindspore_lite": result["mindspore_lite"],
                    "onnxruntime": result.get("onnxruntime"),
                    "bundle": "converted from the ONNX artifacts (.ms per tier)"}
    return lane


def main(argv: Optional[Sequence[str]] = None) -> int:
    """In the Lite interpreter: run one section for mslite and print its JSON on the last line."""
    import importlib
    import platform

    import mindspore_lite

    from benchmarks.cli import SECTIONS
    from benchmarks.harness import FULL, QUICK, RunContext

    parser = argparse.ArgumentParser(prog="python -m benchmarks.lite_lane")
    parser.add_argument("section", choices=("pipeline", "memory", "startup", "quant"))
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--profile", choices=("quick", "full"), required=True)
    parser.add_argument("--device", default="cpu-dev")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    profile = QUICK if args.profile == "quick" else FULL
    context = RunContext(profile=profile, threads=args.threads,
                         root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         work_dir=args.work_dir, bundle_dir=args.bundle, backends=(BACKEND,), device=args.device)
    result = importlib.import_module(SECTIONS[args.section]).run(context)
    result.update(python=platform.python_version(), mindspore_lite=mindspore_lite.__version__,
                  onnxruntime=_version("onnxruntime"))
    print(json.dumps(result, default=str))
    return 0


def _version(module: str) -> Optional[str]:
    """``module.__version__``, or None when it does not import in this interpreter."""
    import importlib

    try:
        return str(importlib.import_module(module).__version__)
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
