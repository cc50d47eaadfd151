"""The aarch64 lane's session: a Debian 11 arm64 root under qemu-user with the box installed from its wheelhouse.

Built once per run (``make test-arm64``): the cached root (rootfs.py), the CPython 3.9 aarch64 wheelhouse made by
``atlas-edge wheelhouse`` from this tree, the box installed from it inside the root with ``pip install --no-index``
and no network, the frames (the demo's sizes, 1080p included, two seeds), the committed demo bundle and the
YOLOv8-shaped stand-in's int8 bundle (made here as the bench makes it), and the x86 daemon's results on them.
Skips, saying why, where it cannot run (not root, no binfmt_misc, no qemu-user-static or debootstrap).
"""

import glob
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from tests.system.arm64 import compare as comparing
from tests.system.arm64.compare import REPORTS, TIMINGS
from tests.system.arm64.rootfs import CACHE_DIR, BoxRoot, Unavailable, ensure_binfmt, rootfs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HERE = os.path.dirname(os.path.abspath(__file__))
CPUS = ("cortex-a53", "cortex-a76")  # ARMv8.0 without dot product (Atlas 500's cores); ARMv8.2 with it (A55-like)
BOX_PYTHON = "3.9"
CONF = 0.25
FRAME_SEEDS = (2026, 2027)
VENV = "/opt/atlas-edge/venv"
TOOLS = "/opt/lane-tests"
# The box's tests run as two pytest processes side by side (about 8.5 min as one under emulation): these folders,
# and every other box folder (so a new one joins the second). Balanced by the lane's timing lines: with unit/protocol
# (mostly waiting for brokers and daemons) here and unit/bundle and unit/config there, they ended 9 s apart in a
# quiet run (402 and 411 s, twice)
FIRST_SHARD = ("unit/pipeline", "unit/_util", "unit/devtools", "unit/protocol")
# Where the box tests do less emulated work here, each module saying why: (variable, here, on the host, what); in the
# lane's summary
EMULATED_SIZES = (("ATLAS_EDGE_FUZZ_BATCHES", 12, 60, "fuzzed-command batches (tests/unit/commands/test_commands.py)"),
                  ("ATLAS_EDGE_DRIFT_PRECISION", "int8", "float", "the model whose scores the drift tests watch "
                   "(tests/unit/pipeline/test_drift.py)"),
                  ("ATLAS_EDGE_SHADOW_SCENES", 8, 16, "shadow scenes per tier (tests/unit/pipeline/test_shadow.py)"))
# (name, bundle folder under the share, precision): what each CPU model serves, and x86 serves for the comparison
RUNS = (("demo", "demo-bundle", "int8"), ("demo", "demo-bundle", "float"), ("standin", "standin-bundle", "int8"))
# The frames a run serves, under the share: all of them, but the stand-in serves, per seed, the last frame of each
# aspect ratio. Its one 640x640 tier letterboxes the frames of one aspect ratio alike (the same resized size and
# padding; only the scale differs): 1280x720 adds nothing a 1920x1080 frame does not, nor does a second 1920x1080.
# 8 frames, 42 confident detections of 50; a frame costs it 4.5 s of an emulated cortex-a53 core (the demo's two
# tiers, which serve all 12 frames, 0.2 s at int8 and 0.9 s at float)
FRAMES = {"standin": "frames-standin"}
# (name, bundle folder): its int8 models damaged (tests/support/golden_damage.py), judged on x86 and on the CPU models
# of DAMAGE_JUDGED: the stand-in's 640x640 models on the NEON-only one (on the other they cost the lane 108 s that it
# did not have within its 10 minutes), the demo's on the dot-product one (on cortex-a53 the box's own tests judge
# the same damaged copies of the same bundle on both kernel paths: tests/unit/pipeline/test_golden.py). On Arm the
# intact bundle is not judged again (the daemon that served it on that CPU model passed its golden self-test), and
# the damaged ones without the warm-up calls (golden_damage.golden_report: the same outputs, half the emulated time)
DAMAGED = (("demo", "demo-bundle"), ("standin", "standin-bundle"))
DAMAGE_JUDGED = {"demo": ("x86", CPUS[1]), "standin": ("x86", CPUS[0])}
# An x86 CPU without VNNI or AVX-512 (qemu-x86_64's Haswell: AVX2), where onnxruntime's u8s8 kernels add two
# products in 16 bits: a workstation of that kind must compute the integers this one and the Arm cores do
X86_NO_VNNI = "Haswell-noTSX"
QEMU_X86 = shutil.which("qemu-x86_64-static") or shutil.which("qemu-x86_64")
KEPT = os.path.join(CACHE_DIR, "arm64", "last-run")  # each run's results (JSON), for a look after the run


def log(line: str) -> None:
    print("arm64 lane: %s" % line, file=sys.__stderr__, flush=True)


class Lane:
    def __init__(self, share: str, root: BoxRoot) -> None:
        self.share, self.root = share, root
        self.x86: Dict[Tuple[str, str], Dict[str, Any]] = {}
        self.arm: Dict[Tuple[str, str, str], Dict[str, Any]] = {}
        self.install_output = ""
        self.box_tests: Dict[int, Any] = {}
        self.damage: Dict[Tuple[str, str], Tuple[int, str]] = {}  # (cpu or "x86", name) -> (exit, report)
        self.no_vnni: Dict[str, Tuple[int, str, str]] = {}  # bundle folder -> (exit, output, outputs folder)

    def serve_x86(self, name: str, bundle: str, precision: str) -> Dict[str, Any]:
        out = os.path.join(self.share, "x86-%s-%s.json" % (name, precision))
        subprocess.run([sys.executable, os.path.join(HERE, "serve_frames.py"), "--bundle",
                        os.path.join(self.share, bundle), "--precision", precision, "--frames",
                        os.path.join(self.share, FRAMES.get(name, "frames")), "--work",
                        tempfile.mkdtemp(dir=self.share), "--out", out, "--conf", str(CONF)], cwd=REPO_ROOT,
                       timeout=900, capture_output=True)
        with open(out) as handle:
            return json.load(handle)

    def judge_damaged(self, cpu: str, name: str) -> Tuple[int, str]:
        """The golden self-test of every damaged copy of ``name``'s bundle, on x86 or in the root, and of the intact
        one on x86: exit 0 when every damaged one was refused and the intact one passed."""
        check = "-m tests.support.golden_damage check %s" % os.path.join("damaged-" + name)
        if cpu == "x86":
            done = subprocess.run([sys.executable] + check.split(), cwd=self.share, timeout=900,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, PYTHONPATH=REPO_ROOT))
        else:
            done = self.root.run(["sh", "-c", "cd /srv/lane && PYTHONPATH=/srv/lane/src exec %s/bin/python %s "
                                  "--damaged-only --no-warm-up" % (VENV, check)], cpu=cpu, timeout=1200)
        return done.returncode, done.stdout

    def int8_outputs_without_vnni(self, bundle: str) -> Tuple[int, str, str]:
        """(exit, output, folder): the bundle's int8 outputs on its golden cases under an emulated x86 without
        VNNI (int8_outputs.py)."""
        out = os.path.join(self.share, "no-vnni-" + bundle)
        done = subprocess.run([QEMU_X86, "-cpu", X86_NO_VNNI, sys.executable, os.path.join(HERE, "int8_outputs.py"),
                               os.path.join(self.share, bundle), out], timeout=900, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        return done.returncode, done.stdout[-3000:], out

    def serve_arm(self, cpu: str, name: str, bundle: str, precision: str) -> Dict[str, Any]:
        out = "arm-%s-%s-%s.json" % (cpu, name, precision)
        done = self.root.run([VENV + "/bin/python", "/srv/lane/serve_frames.py", "--bundle", "/srv/lane/" + bundle,
                              "--precision", precision, "--frames", "/srv/lane/" + FRAMES.get(name, "frames"), "--work",
                              "/tmp/work", "--out", "/srv/lane/" + out, "--conf", str(CONF)], cpu=cpu,
                             timeout=1200)
        path = os.path.join(self.share, out)
        if not os.path.exists(path):
            return {"served": False, "exit": done.returncode, "golden": [], "output_tail": done.stdout[-4000:],
                    "results": {}, "cpu": {"qemu_cpu": cpu}}
        with open(path) as handle:
            return json.load(handle)


def _timed(name: str, function, *args, **kwargs):
    start = time.monotonic()
    try:
        return function(*args, **kwargs)
    finally:
        TIMINGS[name] = time.monotonic() - start
        log("%s: %.0f s" % (name, TIMINGS[name]))


def _wheels(share: str) -> None:
    """What the install needs, first: the box's wheelhouse, the test runner's wheels, and the scripts and tests the
    root sees at /srv/lane."""
    from agent.cli.wheelhouse import build_wheelhouse, check_wheelhouse, download, read_pins

    wheels = os.path.join(share, "wheels")
    found = build_wheelhouse(BOX_PYTHON, "aarch64", wheels, source=REPO_ROOT)
    log("wheelhouse for CPython %s aarch64: %d wheels (%s)" % (BOX_PYTHON, len(found), ", ".join(
        sorted(os.path.basename(p) for n, p in found.items() if n in ("onnxruntime", "numpy", "atlas-edge")))))
    tools = os.path.join(share, "test-wheels")
    os.makedirs(tools)
    for path in glob.glob(os.path.join(wheels, "*.whl")):
        shutil.copy(path, tools)
    box_pins = read_pins(os.path.join(REPO_ROOT, "constraints", "box-py39.txt"))
    tool_pins = read_pins(os.path.join(HERE, "test-tools-py39.txt"))
    download(tool_pins, tools, "3.9.2", "aarch64", "2.31")
    check_wheelhouse(tools, dict(box_pins, **tool_pins), "3.9.2", "aarch64", "2.31",
                     roots=[("atlas-edge", "edge"), ("pytest", ""), ("hypothesis", ""), ("onnx", "")])
    for path in glob.glob(os.path.join(tools, "*.whl")):
        if os.path.basename(path).split("-")[0].lower().replace("_", "-") not in tool_pins:
            os.remove(path)
    shutil.copy(os.path.join(HERE, "serve_frames.py"), share)
    _source_copy(os.path.join(share, "src"))


def _inputs(share: str) -> None:
    """What the runs serve and judge, made while the root installs: the frames, the demo bundle, the stand-in's int8
    bundle and the damaged copies of both."""
    from agent.cli.demo import DEMO_BUNDLE, SAMPLE_SIZES_HW, write_sample_frames

    frames = os.path.join(share, "frames")
    for seed in FRAME_SEEDS:
        written = os.path.join(share, "frames-%d" % seed)
        write_sample_frames(written, SAMPLE_SIZES_HW, seed=seed)
        os.makedirs(frames, exist_ok=True)
        for name in sorted(os.listdir(written)):
            if name.endswith(".png"):
                shutil.move(os.path.join(written, name), os.path.join(frames, "s%d_%s" % (seed, name)))
        shutil.rmtree(written)
    _one_per_aspect_ratio(frames, os.path.join(share, FRAMES["standin"]))
    shutil.copytree(DEMO_BUNDLE, os.path.join(share, "demo-bundle"))
    from benchmarks.quant_models import standin_model

    standin = standin_model(tempfile.mkdtemp(dir=share), 16)
    shutil.move(standin.bundle_dir, os.path.join(share, "standin-bundle"))
    from tests.support.golden_damage import make

    for name, bundle in DAMAGED:
        make(os.path.join(share, bundle), os.path.join(share, "damaged-" + name))


def _one_per_aspect_ratio(frames: str, out: str) -> None:
    """Links in ``out`` to the last frame of each aspect ratio and seed in ``frames`` (s<seed>_..._<w>x<h>.png)."""
    chosen = {}
    for name in sorted(os.listdir(frames)):
        width, height = (int(v) for v in os.path.splitext(name)[0].rsplit("_", 1)[1].split("x"))
        divisor = math.gcd(width, height)
        chosen[(name.split("_", 1)[0], width // divisor, height // divisor)] = name
    os.makedirs(out)
    for name in chosen.values():
        os.link(os.path.join(frames, name), os.path.join(out, name))
    log("stand-in frames: %s" % ", ".join(sorted(chosen.values())))


def _source_copy(target: str) -> None:
    """The tree as git sees it (tracked and new files), less agent/: the box's tests import the installed wheel's
    agent, and read the checkout's examples/, docs/ and deploy/ as they do on the host."""
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True, timeout=60).stdout.decode()
    for name in listed.split("\0"):
        path = os.path.join(REPO_ROOT, name)
        if not name or name.startswith(("agent/", "tests/system/")) or not os.path.lexists(path):
            continue
        os.makedirs(os.path.join(target, os.path.dirname(name)), exist_ok=True)
        shutil.copy2(path, os.path.join(target, name), follow_symlinks=False)


def _install(lane: Lane) -> None:
    """The box from the wheelhouse only (install.sh: --no-index), in a root whose network is the loopback alone."""
    probe = ("import urllib.request\ntry:\n    urllib.request.urlopen('https://pypi.org/simple/', timeout=10)\n"
             "    print('NETWORK REACHABLE')\nexcept Exception as exc:\n    print('no network: %s' % exc)\n")
    done = lane.root.run(["sh", "-c", "python3 -c \"$0\" && sh /srv/lane/wheels/install.sh %s && "
                          "%s/bin/python -m pip list --format=freeze" % (VENV, VENV), probe], keep="install")
    lane.install_output = done.stdout
    if done.returncode != 0:
        raise AssertionError("the box did not install from the wheelhouse (exit %d):\n%s" % (
            done.returncode, done.stdout[-4000:]))
    _test_tools(lane)


def _test_tools(lane: Lane) -> None:
    """The test runner at TOOLS (pip install --target, never into the box's venv), a layer of its own kept in the
    cache under its wheels' digest: the same pinned wheels install the same files, and installing them costs an
    emulated pip 20 s. Not part of what the lane proves of the box's install."""
    digest = hashlib.sha256(lane.root.tree.encode())
    for path in sorted(glob.glob(os.path.join(lane.share, "test-wheels", "*.whl"))):
        with open(path, "rb") as handle:
            digest.update(os.path.basename(path).encode() + hashlib.sha256(handle.read()).digest())
    kept = os.path.join(CACHE_DIR, "arm64", "test-tools-" + digest.hexdigest()[:12])
    if os.path.isdir(os.path.join(kept, "data")):
        lane.root.add_layer(kept)
        log("test runner: the layer kept at %s" % kept)
        return
    tools = lane.root.run(["sh", "-c", "%s/bin/python -m pip install -q --no-index --no-deps --target %s "
                           "/srv/lane/test-wheels/*.whl" % (VENV, TOOLS)], keep="tools")
    if tools.returncode != 0:
        raise AssertionError("the test runner did not install: %s" % tools.stdout[-3000:])
    for old in glob.glob(os.path.join(CACHE_DIR, "arm64", "test-tools-*")):  # other pins' layers
        shutil.rmtree(old, ignore_errors=True)
    building = tempfile.mkdtemp(prefix="building-", dir=os.path.dirname(kept))
    try:
        relative = os.path.join("data", TOOLS.lstrip("/"))
        shutil.copytree(os.path.join(lane.root.layers[-1], relative), os.path.join(building, relative), symlinks=True)
        os.rename(building, kept)
    except OSError as exc:  # another lane kept the same layer meanwhile: this run has its own
        log("test runner: not kept (%s)" % exc)
    finally:
        shutil.rmtree(building, ignore_errors=True)


@pytest.fixture(scope="session")
def lane() -> Iterator[Lane]:
    try:
        ensure_binfmt()
        share_root = tempfile.mkdtemp(prefix="atlas-edge-arm64-")
        tree = _timed("arm64 root (debootstrap or cache)", rootfs, log=log)
    except Unavailable as exc:
        pytest.skip("aarch64 lane skipped: %s" % exc)
    share = os.path.join(share_root, "share")
    os.makedirs(share)
    os.chmod(share_root, 0o755)
    try:
        lane = Lane(share, BoxRoot(tree, os.path.join(share_root, "layers"), share))
        # The wheelhouse, then the install, are one core's work: the frames and bundles, then x86's runs, take the
        # other; the emulated runs start once the inputs are there too (the box tests need the install only)
        with ThreadPoolExecutor(1) as pool:
            inputs = pool.submit(_timed, "frames, bundles", _inputs, share)
            x86 = pool.submit(_timed, "x86 runs (native, and emulated without VNNI)", _x86_side, lane)
            _timed("wheelhouse", _wheels, share)
            _timed("offline install in the root", _install, lane)
            _timed("emulated runs and box tests side by side", _serve_all, lane, inputs)
            x86.result()
        yield lane
    finally:
        shutil.rmtree(KEPT, ignore_errors=True)
        os.makedirs(KEPT)
        for path in glob.glob(os.path.join(share, "*.json")):
            shutil.copy(path, KEPT)
        shutil.rmtree(share_root, ignore_errors=True)


def _x86_side(lane: Lane) -> None:
    """What x86 computes: the runs to compare with (native, seconds), the damaged models judged, and the int8
    outputs of an x86 without VNNI (emulated)."""
    for name, bundle, precision in RUNS:
        lane.x86[(name, precision)] = lane.serve_x86(name, bundle, precision)
    for name, _bundle in DAMAGED:
        lane.damage[("x86", name)] = lane.judge_damaged("x86", name)
    if not QEMU_X86:
        return
    for _name, bundle in DAMAGED:
        start = time.monotonic()
        lane.no_vnni[bundle] = lane.int8_outputs_without_vnni(bundle)
        log("x86 without VNNI (%s): %s int8 golden outputs: %.0f s" % (X86_NO_VNNI, bundle, time.monotonic() - start))


def _serve_all(lane: Lane, inputs: "Optional[Future[None]]" = None) -> None:
    """Side by side: each CPU model's runs (once ``inputs`` are made), and the box's tests under the first."""

    def one_cpu(cpu: str) -> None:
        if inputs is not None:
            inputs.result()
        for name, bundle, precision in RUNS:
            start = time.monotonic()
            lane.arm[(cpu, name, precision)] = lane.serve_arm(cpu, name, bundle, precision)
            log("%s %s %s: %.0f s" % (cpu, name, precision, time.monotonic() - start))
        for name, _bundle in DAMAGED:
            if cpu not in DAMAGE_JUDGED[name]:
                continue
            start = time.monotonic()
            lane.damage[(cpu, name)] = lane.judge_damaged(cpu, name)
            log("%s %s damaged int8 models judged: %.0f s" % (cpu, name, time.monotonic() - start))

    from tests.conftest import BOX_TEST_FOLDERS

    shards = [[f for f in BOX_TEST_FOLDERS if f in FIRST_SHARD], [f for f in BOX_TEST_FOLDERS if f not in FIRST_SHARD]]

    def box_tests_run(index: int) -> None:
        start = time.monotonic()
        lane.box_tests[index] = box_tests(lane, CPUS[0], shards[index])
        log("box tests (%s) on %s: %.0f s" % (", ".join(shards[index]), CPUS[0], time.monotonic() - start))

    with ThreadPoolExecutor(len(CPUS) + len(shards)) as pool:
        done = [pool.submit(box_tests_run, i) for i in range(len(shards))] + [pool.submit(one_cpu, c) for c in CPUS]
        for future in done:
            future.result()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORTS and not TIMINGS:
        return
    write = terminalreporter.write_line
    write("")
    write("aarch64 lane (Debian 11 arm64, CPython 3.9, qemu-user; conf %.2f; confident: score >= conf + %.2f, box <= "
          "%.0f px, score <= %.2f):" % (CONF, comparing.MARGIN, comparing.BOX_PX, comparing.SCORE))
    for cpu in CPUS:
        parts = []
        for (c, name, precision), report in sorted(REPORTS.items()):
            if c == cpu:
                parts.append("%s %s: %s" % (name, precision, report["line"]))
        features = next((r.get("features", "") for (c, _n, _p), r in REPORTS.items() if c == cpu and
                         r.get("features")), "")
        write("  %s [%s]: %s" % (cpu, features, "; ".join(parts) or "not run"))
    write("  box tests, less work under emulation: %s" % "; ".join(
        "%s %s (the host's %s: %s)" % (variable, here, host, what) for variable, here, host, what in EMULATED_SIZES))
    for name, seconds in TIMINGS.items():
        write("  time %s: %.0f s" % (name, seconds))


def box_tests(lane: Lane, cpu: str, folders: List[str]) -> "subprocess.CompletedProcess[str]":
    """pytest ``-m box`` in the root over some of the box's test folders (tests/conftest.py BOX_TEST_FOLDERS)."""
    env = dict({variable: str(here) for variable, here, _host, _what in EMULATED_SIZES}, PYTHONPATH=TOOLS)
    return lane.root.run(["sh", "-c", "cd /srv/lane/src && exec %s/bin/python -m pytest -m box -q -p no:cacheprovider "
                          "-rfE --durations=10 %s" % (VENV, " ".join("tests/" + f for f in folders))],
                         cpu=cpu, env=env, timeout=1800)
