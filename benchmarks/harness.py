"""How every benchmark measures: warm-up, interleaved repeats, median and spread, pinned threads, environment.

Absolute times on a shared 2-core machine are noise, so every headline figure is a ratio of two things timed
in the same run. :func:`compare` times the candidates round-robin (A, B, C, A, B, C, ...), so a burst of load
from a neighbour hits every side of a ratio alike, and :func:`ratio_summary` reports the median of the
per-round ratios with their interquartile range.
"""

import datetime
import logging
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

# One thread per measured call: both sides of a ratio then compete for the same single core, and neighbours
# on the shared machine disturb them less. The box may run OpenCV with more threads; the ratios still hold.
DEFAULT_THREADS = 1
# Read by OpenMP / OpenBLAS / MKL at their start-up: set here so subprocesses (daemon start-up) inherit them.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
SUBPROCESS_TIMEOUT_S = 10.0  # version probes (mosquitto -h, git) answer in milliseconds


@dataclass(frozen=True)
class Profile:
    """How much of everything one run measures; ``QUICK`` fits the 2-minute budget on a 2-core machine."""

    name: str
    warmup: int  # untimed rounds before timing (allocators, caches, lazy initialisation)
    repeat: int  # timed rounds per measurement
    postprocess_repeat: int
    pipeline_repeat: int
    batching_frames: int  # frames fed per (backend, max_batch, max_wait_ms) cell
    batching_rounds: int  # interleaved rounds those frames are split into
    mqtt_messages: int  # results per publishing round
    mqtt_rounds: int  # interleaved agent/paho rounds
    replay_messages: int  # results parked in the outbox while the broker is down
    memory_frames: int  # frames through infer_frames for the RSS slope
    memory_swaps: int  # load/close cycles
    startup_runs: int  # daemon start-ups to READY=1


QUICK = Profile(
    name="quick",
    warmup=3,
    repeat=40,
    postprocess_repeat=30,
    pipeline_repeat=15,
    batching_frames=16,
    batching_rounds=2,
    mqtt_messages=1000,
    mqtt_rounds=4,
    replay_messages=500,
    memory_frames=2000,
    memory_swaps=10,
    startup_runs=1,
)
FULL = Profile(
    name="full",
    warmup=10,
    repeat=150,
    postprocess_repeat=100,
    pipeline_repeat=60,
    batching_frames=120,
    batching_rounds=4,
    mqtt_messages=5000,
    mqtt_rounds=6,
    replay_messages=3000,
    memory_frames=20000,
    memory_swaps=50,
    startup_runs=3,
)


def summarize(values: Sequence[float]) -> Dict[str, float]:
    """Median, quartiles, extremes and count of ``values`` (the spread a reader needs to trust a median)."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("summarize: no values")
    q1, median, q3 = np.percentile(data, [25, 50, 75])
    return {
        "median": float(median),
        "q1": float(q1),
        "q3": float(q3),
        "min": float(data.min()),
        "max": float(data.max()),
        "n": int(data.size),
    }


def scaled(summary: Mapping[str, float], factor: float) -> Dict[str, float]:
    """``summary`` with every statistic multiplied by ``factor`` (seconds -> milliseconds); n unchanged."""
    return {k: (v if k == "n" else v * factor) for k, v in summary.items()}


def compare(
    candidates: Mapping[str, Callable[[], Any]], warmup: int, repeat: int, number: int = 1
) -> Dict[str, List[float]]:
    """Seconds per call of each candidate, timed round-robin: ``repeat`` rounds of ``number`` calls each.

    The order within a round rotates, so no candidate always runs right after another (caches, turbo).
    """
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_index in range(repeat):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            call = candidates[name]
            started = time.perf_counter()
            for _ in range(number):
                call()
            times[name].append((time.perf_counter() - started) / number)
    return times


def ratio_summary(numerator: Sequence[float], denominator: Sequence[float]) -> Dict[str, float]:
    """The per-round ratios ``numerator[i] / denominator[i]`` summarised; rounds were timed side by side."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("ratio_summary needs two equally long, non-empty series")
    ratios = [n / d for n, d in zip(numerator, denominator)]
    return summarize(ratios)


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> Dict[str, float]:
    """Least-squares line through (x, y): slope, intercept and r^2 (how straight the growth is)."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("linear_slope needs at least two distinct x values")
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residual**2)) / total if total > 0 else 1.0
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2, "points": int(x.size)}


def target(value: Optional[float], op: str, threshold: float) -> Dict[str, Any]:
    """A figure's target and whether this run met it; a missing value never counts as met."""
    if op not in ("<=", ">=", "<", ">"):
        raise ValueError("target op must be one of <=, >=, <, > (got %r)" % op)
    met = False
    if value is not None and np.isfinite(value):
        met = {
            "<=": value <= threshold,
            ">=": value >= threshold,
            "<": value < threshold,
            ">": value > threshold,
        }[op]
    return {"value": value, "target": "%s %g" % (op, threshold), "met": bool(met)}


# --- threads ------------------------------------------------------------------------------------------


def pin_threads(threads: int) -> Dict[str, Any]:
    """Pin what can be pinned from here: OpenCV now, OpenMP/BLAS for subprocesses through the environment.

    MindSpore's kernel threads are fixed once per process by the MindSpore backend from the device config's
    ``cpu_threads``; the serving sections pass this same number there (see ``workload.bench_device``).
    """
    import cv2

    if threads < 1:
        raise ValueError("threads must be >= 1 (got %r)" % threads)
    cv2.setNumThreads(threads)
    for name in THREAD_ENV_VARS:
        os.environ[name] = str(threads)
    return {
        "threads": threads,
        "cv2_num_threads": cv2.getNumThreads(),
        "env": {name: os.environ[name] for name in THREAD_ENV_VARS},
    }


# --- environment --------------------------------------------------------------------------------------


def _package_version(name: str) -> Optional[str]:
    """Installed version without importing the package (importing MindSpore alone takes seconds)."""
    try:
        from importlib import metadata
    except ImportError:  # Python 3.7
        return None
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith(("model name", "cpu model", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mosquitto_version() -> Optional[str]:
    """``mosquitto -h`` prints ``mosquitto version X.Y.Z`` on its first line (and exits non-zero)."""
    try:
        from agent.devtools.broker import BrokerError, find_mosquitto

        executable = find_mosquitto()
    except (ImportError, BrokerError):
        return None
    try:
        done = subprocess.run(
            [executable, "-h"], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"version\s+(\S+)", done.stdout + done.stderr)
    return found.group(1) if found else None


def _git_commit(root: str) -> Optional[str]:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def environment(root: str) -> Dict[str, Any]:
    """What the figures were measured on: CPU, cores, load, versions of everything that is timed."""
    import cv2

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_average_at_start": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "opencv": cv2.__version__,
        "mindspore": _package_version("mindspore"),
        "onnxruntime": _package_version("onnxruntime"),
        "paho_mqtt": _package_version("paho-mqtt"),
        "mosquitto": mosquitto_version(),
        "git_commit": _git_commit(root),
        "executable": sys.executable,
    }


@dataclass
class RunContext:
    """What every section gets: the profile, pinned thread count, repository root and a scratch directory."""

    profile: Profile
    threads: int
    root: str
    work_dir: str
    bundle_dir: str  # the model bundle the pipeline, batching, memory and start-up sections serve
    backends: Sequence[str] = ("mindspore", "opencv")
    device: str = "cpu-dev"  # device config name (device_configs/<name>.yaml) the serving sections use
