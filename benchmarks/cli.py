"""``atlas-edge bench``: run the measurements side by side, write one JSON (and plots, and the README table).

Every section is a module with ``run(context) -> dict`` and ``targets(section) -> {key: target}``; they are
imported only when selected (the serving sections import MindSpore through the backends). A section that fails
is recorded under ``errors`` with its reason and the others still run; the exit code is then 1.
"""

import argparse
import importlib
import logging
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Sequence

from agent.config.device_config import BACKEND_FORMATS
from agent.config.schema import ConfigError
from benchmarks.harness import DEFAULT_THREADS, FULL, QUICK, RunContext, environment, pin_threads
from benchmarks.report import get_path, headline_table, update_readme, write_json
from benchmarks.workload import DEFAULT_DEVICE, bench_device

log = logging.getLogger(__name__)

SCHEMA = 1
# Section name -> module; the order is the run order (cheap, in-process figures first).
SECTIONS = {
    "preprocess": "benchmarks.preprocessing",
    "postprocess": "benchmarks.postprocessing",
    "pipeline": "benchmarks.pipeline",
    "metrics": "benchmarks.metrics_cost",
    "shadow": "benchmarks.shadow",
    "batching": "benchmarks.batching",
    "mqtt": "benchmarks.mqtt_publish",
    "memory": "benchmarks.memory",
    "startup": "benchmarks.startup",
    "fleet": "benchmarks.fleet",
    "fleet_metrics": "benchmarks.fleet_metrics",
    "sources": "benchmarks.sources",
    "drift": "benchmarks.drift",
    "console": "benchmarks.console",
    "quant": "benchmarks.quant",
}
NEEDS_MODEL = ("pipeline", "metrics", "shadow", "batching", "memory", "startup", "sources", "drift", "quant")
# Not in a --quick run unless named with --only: the quant section builds, quantizes, converts and times a
# 640x640 YOLOv8n-shaped model besides the demo (minutes on 2 cores), more than the quick budget allows.
NOT_QUICK = ("quant",)
BACKENDS = tuple(BACKEND_FORMATS)  # every backend the agent has
# the three that run on a CPU box; mslite through the Lite venv (benchmarks/lite_lane.py) when this Python
# cannot import it, and recorded as skipped when no Lite venv exists
DEFAULT_BACKENDS = ("mindspore", "opencv", "mslite")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The figures the issue asks for by name: the JSON of a full selection must carry each of them.
REQUIRED_KEYS = (
    "preprocess.ratio_to_resize",
    "postprocess.speedup_vs_naive",
    "pipeline.overhead_fraction_b1",
    "pipeline.throughput_ratio_to_backend",
    "pipeline.backend_busy_fraction",
    "metrics.cost",
    "shadow.serving_p95_ratio",
    "shadow.frames_compared_per_s",
    "mqtt.ratio_to_paho",
    "memory.rss_mb_per_10k_frames",
    "startup.seconds_to_ready",
    "sources.latency_p50_ratio_to_bare",
    "drift.alerts",
    "console.fleet_first_paint_s",
    "console.box_first_paint_s",
    "console.rss_mib",
    "quant.size_ratio",
    "quant.infer_ratio_to_float",
    "quant.frame_ratio_to_float",
    "quant.map_int8",
)


def _csv(choices: Sequence[str], what: str):
    """An argparse type: comma-separated names, each one of ``choices``; unknown names fail naming them."""

    def parse(text: str) -> List[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                "unknown %s %s (choose from %s)"
                % (what, ", ".join(unknown) or "(none given)", ", ".join(choices))
            )
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repeats and frames: every section but quant in about 3-4 minutes on 2 cores "
        "(--only quant --quick runs it with fewer repeats)",
    )
    parser.add_argument("--json", metavar="OUT", help="write the results here (JSON)")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots here (needs matplotlib)")
    parser.add_argument(
        "--only",
        metavar="SECTION,...",
        type=_csv(tuple(SECTIONS), "section"),
        help="run only these sections: %s" % ", ".join(SECTIONS),
    )
    parser.add_argument(
        "--backends",
        metavar="NAME,...",
        type=_csv(BACKENDS, "backend"),
        default=list(DEFAULT_BACKENDS),
        help="serving backends to measure (default: %s)" % ",".join(DEFAULT_BACKENDS),
    )
    parser.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        help="device config the serving sections use (device_configs/NAME.yaml; default %s)" % DEFAULT_DEVICE,
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help="threads for OpenCV, MindSpore kernels and OpenMP/BLAS (default %d)" % DEFAULT_THREADS,
    )
    parser.add_argument(
        "--bundle",
        metavar="DIR",
        help="model bundle to serve (default: examples/demo-bundle, else a stand-in exported here)",
    )
    parser.add_argument(
        "--update-readme",
        action="store_true",
        help="rewrite the results table in benchmarks/README.md from this run",
    )


def command_line(args: argparse.Namespace) -> str:
    """The run's options as an ``atlas-edge bench`` command (recorded in the JSON and the README)."""
    parts = ["atlas-edge bench"]
    if args.quick:
        parts.append("--quick")
    if args.only:
        parts.append("--only " + ",".join(args.only))
    if list(args.backends) != list(DEFAULT_BACKENDS):
        parts.append("--backends " + ",".join(args.backends))
    if args.device != DEFAULT_DEVICE:
        parts.append("--device " + args.device)
    if args.threads != DEFAULT_THREADS:
        parts.append("--threads %d" % args.threads)
    for flag, value in (("--bundle", args.bundle), ("--json", args.json), ("--plots", args.plots)):
        if value:
            parts.append("%s %s" % (flag, value))
    if args.update_readme:
        parts.append("--update-readme")
    return " ".join(parts)


def run_suite(sections: Sequence[str], context: RunContext) -> Dict[str, Any]:
    """Run ``sections`` in order; returns their results, targets, errors and seconds."""
    data: Dict[str, Any] = {"targets": {}, "errors": {}, "section_seconds": {}}
    for name in sections:
        started = time.monotonic()
        log.info("bench: %s ...", name)
        try:
            module = importlib.import_module(SECTIONS[name])
            section = module.run(context)
        except Exception as exc:  # one broken section must not cost the figures of the others
            log.exception("bench: section %s failed", name)
            data["errors"][name] = "%s: %s" % (type(exc).__name__, str(exc)[:500])
        else:
            data[name] = section
            for key, goal in module.targets(section).items():
                data["targets"]["%s.%s" % (name, key)] = goal
        data["section_seconds"][name] = round(time.monotonic() - started, 2)
    return data


def selected_sections(only: Sequence[str], quick: bool) -> List[str]:
    """``--only``'s sections as given, else every section (but :data:`NOT_QUICK` in a quick run), in run order."""
    return list(only or [s for s in SECTIONS if not (quick and s in NOT_QUICK)])


def missing_required(data: Dict[str, Any], sections: Sequence[str]) -> List[str]:
    """Required figures of the selected sections that this run did not produce."""
    return [key for key in REQUIRED_KEYS if key.split(".")[0] in sections and get_path(data, key) is None]


def run(args: argparse.Namespace) -> int:
    if args.threads < 1:
        print("atlas-edge bench: --threads must be >= 1 (got %d)" % args.threads, file=sys.stderr)
        return 2
    try:
        device = bench_device(args.threads, args.device)
    except ConfigError as exc:  # names the file and field; nothing has run yet
        print("atlas-edge bench: --device %s: %s" % (args.device, exc), file=sys.stderr)
        return 2
    if args.plots:
        from benchmarks.plots import MissingMatplotlib, require_matplotlib

        try:
            require_matplotlib()
        except MissingMatplotlib as exc:  # say so before minutes of measuring, not after
            print("atlas-edge bench: %s" % exc, file=sys.stderr)
            return 2
    started = time.monotonic()
    sections = selected_sections(args.only, args.quick)
    profile = QUICK if args.quick else FULL
    pinned = pin_threads(args.threads)
    env = environment(REPO_ROOT)
    env["threads"] = pinned
    env["device"] = {"name": device.name, "target": device.target, "cpu_threads": device.cpu_threads}
    with tempfile.TemporaryDirectory(prefix="atlas-edge-bench-") as work_dir:
        bundle_dir = ""
        if any(s in NEEDS_MODEL for s in sections):
            from benchmarks.workload import load_bundle, resolve_bundle

            try:
                bundle_dir, how = resolve_bundle(args.bundle, work_dir)
                label = load_bundle(bundle_dir).label
            except ConfigError as exc:  # BundleError: names the manifest field or file
                print("atlas-edge bench: --bundle %s: %s" % (args.bundle, exc), file=sys.stderr)
                return 2
            temporary = bundle_dir.startswith(work_dir)
            env["bundle"] = {
                "path": "(temporary)" if temporary else os.path.relpath(bundle_dir, REPO_ROOT),
                "chosen": how,
                "label": label,
            }
        context = RunContext(
            profile=profile,
            threads=args.threads,
            root=REPO_ROOT,
            work_dir=work_dir,
            bundle_dir=bundle_dir,
            backends=tuple(args.backends),
            device=args.device,
        )
        results = run_suite(sections, context)
    data: Dict[str, Any] = {
        "schema": SCHEMA,
        "command": command_line(args),
        "profile": profile.name,
        "sections": sections,
        "environment": env,
    }
    data.update(results)
    data["missing_figures"] = missing_required(data, sections)
    data["total_seconds"] = round(time.monotonic() - started, 2)

    if args.json:
        write_json(data, args.json)
        print("results: %s" % args.json)
    if args.plots:
        from benchmarks.plots import write_plots

        for path in write_plots(data, args.plots):
            print("plot: %s" % path)
    if args.update_readme:
        update_readme(data)
        print("results table updated in benchmarks/README.md")
    print(headline_table(data))
    for name, error in data["errors"].items():
        print("section %s FAILED: %s" % (name, error), file=sys.stderr)
    print(
        "total %.1f s (%s)"
        % (data["total_seconds"], ", ".join("%s %.1f s" % kv for kv in data["section_seconds"].items()))
    )
    return 1 if data["errors"] or data["missing_figures"] else 0
