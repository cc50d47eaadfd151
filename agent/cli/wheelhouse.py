"""``atlas-edge wheelhouse``: everything a box without internet installs, downloaded on the workstation.

The box's pins (``constraints/box-py<XY>.txt`` of the checkout: every package the box side needs, onnxruntime for
the CPU int8 path, prometheus_client for the metrics endpoint, and a pip new enough for today's wheel tags) are
downloaded for the box's CPython and CPU with ``pip download --no-deps --only-binary=:all:``, next to the
atlas-edge wheel built from the checkout. The set is then checked without pip's resolver (which evaluates
dependency markers for the Python it runs on, not the box's): every requirement of ``atlas-edge[edge,metrics]``
and of each downloaded wheel, markers evaluated for the box, is met by exactly one wheel of the folder, and
every wheel's tags install on the box (its CPython, its glibc). ``install.sh`` and ``README.txt`` in the folder
say how the box installs it with ``pip install --no-index``. Runs on the workstation, with network.
"""

import argparse
import email.parser
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple

EXTRAS = ("edge", "metrics")
# Installed without their dependencies: onnxruntime needs only numpy to infer (its protobuf, sympy, flatbuffers
# and coloredlogs are for its tools: docs/backends.md); pip is the installer itself.
NO_DEPS = ("onnxruntime", "pip")
# Each box Python: (the micro version Requires-Python is judged against, the oldest glibc of its boxes, the boxes).
BOX_PYTHONS = {
    "3.7": ("3.7.5", "2.27", "Atlas 200 DK (Ubuntu 18.04, CANN's Python 3.7)"),
    "3.9": ("3.9.2", "2.31", "Atlas 200I DK A2 (openEuler 22.03: 3.9, glibc 2.34), Atlas 500 A2; Debian 11"),
    "3.10": ("3.10.12", "2.35", "Atlas 200I DK A2 (Ubuntu 22.04)"),
    "3.11": ("3.11.2", "2.36", "Debian 12"),
}
PLATFORMS = ("aarch64", "x86_64")
MANYLINUX_FLOOR = 17  # manylinux2014 is manylinux_2_17; PyPI's older tags do not exist for aarch64

DESCRIPTION = (
    "On a workstation with internet, fill a folder with everything a box without internet installs: atlas-edge's "
    "wheel built from this checkout and exactly the pinned wheels of constraints/box-py<XY>.txt (the box's "
    "dependencies, onnxruntime, prometheus_client, pip) for the box's CPython, CPU and glibc. The folder is checked "
    "complete as the box's Python will resolve it, and gets install.sh (pip install --no-index into a venv) and "
    "README.txt.")
EPILOG = """examples:
  atlas-edge wheelhouse --python 3.9 --platform aarch64 --out wheels-a2      200I DK A2 / Atlas 500 A2 (openEuler)
  atlas-edge wheelhouse --python 3.7 --platform aarch64 --out wheels-200dk   Atlas 200 DK (Ubuntu 18.04)
then copy the folder to the box and run its install.sh (offline: pip install --no-index). docs/install-boxes.md
says which Python each box has. Pins: constraints/box-py<XY>.txt (--constraints to use another file).
"""


class WheelhouseError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = textwrap.fill(DESCRIPTION, 100, break_on_hyphens=False)
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--python", required=True, metavar="X.Y[.Z]",
                        help="the box's CPython (%s); X.Y takes the box OS's micro version for Requires-Python"
                        % ", ".join(BOX_PYTHONS))
    parser.add_argument("--platform", required=True, choices=PLATFORMS, help="the box's CPU")
    parser.add_argument("--out", required=True, help="the folder to fill (created; wheels already there are kept)")
    parser.add_argument("--glibc", help="the box's glibc (default: the oldest of the boxes with that Python, "
                        "e.g. 2.27 for 3.7, 2.31 for 3.9); wheels needing a newer one are refused")
    parser.add_argument("--constraints", help="the pins (default: the checkout's constraints/box-py<XY>.txt)")
    parser.add_argument("--source", help="the atlas-edge checkout to build the wheel from (default: this one)")
    parser.add_argument("--wheel", help="an atlas-edge wheel already built (instead of building one)")


def run(args: argparse.Namespace) -> int:
    try:
        found = build_wheelhouse(args.python, args.platform, args.out, glibc=args.glibc,
                                 constraints=args.constraints, source=args.source, wheel=args.wheel)
    except WheelhouseError as exc:
        print("wheelhouse: %s" % exc, file=sys.stderr)
        return 1
    print("wheelhouse %s: %d wheels for CPython %s on %s (glibc >= %s):" % (
        args.out, len(found), found_python(args.python)[0], args.platform, found_glibc(args.python, args.glibc)))
    for name in sorted(found):
        print("  %s" % os.path.basename(found[name]))
    print("on the box: sh %s/install.sh [VENV]   (offline; see %s/README.txt)" % (args.out, args.out))
    return 0


def found_python(python: str) -> Tuple[str, str]:
    """(full version, X.Y) of ``--python``."""
    if not re.match(r"^3\.\d+(\.\d+)?$", python):
        raise WheelhouseError("--python %s: give the box's CPython as X.Y or X.Y.Z" % python)
    short = ".".join(python.split(".")[:2])
    if python.count(".") == 2:
        return python, short
    if short not in BOX_PYTHONS:
        raise WheelhouseError("--python %s: no box with it is known (%s); give X.Y.Z" % (
            python, ", ".join(BOX_PYTHONS)))
    return BOX_PYTHONS[short][0], short


def found_glibc(python: str, glibc: Optional[str]) -> str:
    if glibc:
        return glibc
    short = ".".join(python.split(".")[:2])
    if short not in BOX_PYTHONS:
        raise WheelhouseError("--glibc is needed for a Python no known box has (%s)" % python)
    return BOX_PYTHONS[short][1]


def platform_tags(platform: str, glibc: str) -> List[str]:
    """The manylinux tags a box with this glibc installs, newest first (pip does not expand manylinux_2_N)."""
    major, minor = (int(p) for p in glibc.split(".")[:2])
    if major != 2 or minor < MANYLINUX_FLOOR:
        raise WheelhouseError("glibc %s: boxes have 2.%d or newer" % (glibc, MANYLINUX_FLOOR))
    return ["manylinux_2_%d_%s" % (n, platform) for n in range(minor, MANYLINUX_FLOOR - 1, -1)] + [
        "manylinux2014_%s" % platform]


def checkout() -> Optional[str]:
    """The source checkout this module runs from, if it runs from one; None from an installed wheel (site-packages
    has no pyproject.toml), where ``--source`` or ``--constraints`` with ``--wheel`` say where the pins are."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return top if os.path.isfile(os.path.join(top, "pyproject.toml")) else None


def read_pins(path: str) -> Dict[str, str]:
    """normalised name -> exact version, from a constraints file of ``name==version`` lines."""
    pins: Dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)$", line)
            if not match:
                raise WheelhouseError("%s:%d: %r is not an exact pin (name==version)" % (path, number, line))
            pins[normalise(match.group(1))] = match.group(2)
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def build_wheelhouse(python: str, platform: str, out: str, glibc: Optional[str] = None,
                     constraints: Optional[str] = None, source: Optional[str] = None,
                     wheel: Optional[str] = None) -> Dict[str, str]:
    """Fill ``out``; normalised name -> wheel path of every wheel the box installs."""
    full, short = found_python(python)
    glibc = found_glibc(python, glibc)
    if platform not in PLATFORMS:
        raise WheelhouseError("--platform %s: one of %s" % (platform, ", ".join(PLATFORMS)))
    source = source or checkout()
    if constraints is None:
        if source is None:
            raise WheelhouseError("no checkout here: pass --constraints (and --wheel or --source)")
        constraints = os.path.join(source, "constraints", "box-py%s.txt" % short.replace(".", ""))
    if not os.path.isfile(constraints):
        raise WheelhouseError("no pins for Python %s: %s is missing" % (short, constraints))
    pins = read_pins(constraints)
    os.makedirs(out, exist_ok=True)
    if wheel is None:
        if source is None:
            raise WheelhouseError("no checkout to build atlas-edge from: pass --source or --wheel")
        wheel = build_project_wheel(source, out)
    elif os.path.dirname(os.path.abspath(wheel)) != os.path.abspath(out):
        shutil.copy(wheel, out)
        wheel = os.path.join(out, os.path.basename(wheel))
    for stale in glob.glob(os.path.join(out, "atlas_edge-*.whl")):
        if os.path.abspath(stale) != os.path.abspath(wheel):
            os.remove(stale)
    download(pins, out, full, platform, glibc)
    found = check_wheelhouse(out, pins, full, platform, glibc)
    write_instructions(out, pins, constraints, full, platform, glibc)
    return found


def download(pins: Dict[str, str], out: str, full: str, platform: str, glibc: str) -> None:
    """Exactly the pinned wheels, for the box's CPython, CPU and glibc (no resolution: the pins are the set)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", out,
               "--python-version", full, "--implementation", "cp"]
    for tag in platform_tags(platform, glibc):
        command += ["--platform", tag]
    command += ["%s==%s" % (name, version) for name, version in sorted(pins.items())]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise WheelhouseError("pip download failed (exit %d):\n%s" % (done.returncode, done.stdout[-4000:]))


def build_project_wheel(source: str, out: str) -> str:
    """atlas-edge's wheel from a copy of ``source`` (what git tracks, or the folder less its venvs and caches):
    the build writes nothing into the checkout."""
    work = tempfile.mkdtemp(prefix="atlas-edge-wheel-")
    try:
        tree = os.path.join(work, "src")
        listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=source,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if listed.returncode == 0 and listed.stdout:
            for name in listed.stdout.decode().split("\0"):
                path = os.path.join(source, name)
                if name and (os.path.isfile(path) or os.path.islink(path)):
                    os.makedirs(os.path.join(tree, os.path.dirname(name)), exist_ok=True)
                    shutil.copy2(path, os.path.join(tree, name), follow_symlinks=False)
        else:
            shutil.copytree(source, tree, symlinks=True, ignore=shutil.ignore_patterns(
                ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache"))
        built = os.path.join(work, "dist")
        command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", built, tree]
        # this Python's setuptools when it can build pyproject.toml (>= 61); else pip fetches one to build with
        done = subprocess.run(command[:5] + ["--no-build-isolation"] + command[5:], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = glob.glob(os.path.join(built, "atlas_edge-*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise WheelhouseError("building atlas-edge's wheel failed:\n%s" % done.stdout[-3000:])
        target = os.path.join(out, os.path.basename(wheels[0]))
        shutil.copy(wheels[0], target)
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _packaging():
    """(Requirement, Version, default_environment): the packaging library, or pip's own copy of it."""
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pip carries it
        from pip._vendor.packaging.markers import default_environment  # type: ignore
        from pip._vendor.packaging.requirements import Requirement  # type: ignore
        from pip._vendor.packaging.version import Version  # type: ignore
    return Requirement, Version, default_environment


def box_environment(full: str, platform: str) -> Dict[str, str]:
    """PEP 508 marker values of the box: its CPython, Linux, its CPU."""
    _req, _ver, default_environment = _packaging()
    env = dict(default_environment())
    env.update({"python_version": ".".join(full.split(".")[:2]), "python_full_version": full,
                "implementation_version": full, "implementation_name": "cpython",
                "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
                "platform_system": "Linux", "platform_machine": platform, "platform_release": "",
                "platform_version": ""})
    return env


def wheel_metadata(path: str) -> "email.message.Message":
    with zipfile.ZipFile(path) as archive:
        name = [n for n in archive.namelist() if re.match(r"^[^/]+\.dist-info/METADATA$", n)]
        if len(name) != 1:
            raise WheelhouseError("%s: no METADATA" % path)
        return email.parser.Parser().parsestr(archive.read(name[0]).decode("utf-8"))


def wheel_installs(filename: str, full: str, platform: str, glibc: str) -> bool:
    """Whether a wheel's file name tags install on CPython ``full`` with this CPU and glibc."""
    parts = filename[:-len(".whl")].split("-")
    pythons, abis, platforms = parts[-3].split("."), parts[-2].split("."), parts[-1].split(".")
    major, minor = (int(p) for p in full.split(".")[:2])
    cp = "cp%d%d" % (major, minor)
    python_ok = any(p in ("py3", "py%d%d" % (major, minor), cp) or (
        p.startswith("cp3") and "abi3" in abis and int(p[3:]) <= minor) for p in pythons)
    abi_ok = any(a in ("none", "abi3", cp, cp + "m") for a in abis)
    allowed = set(platform_tags(platform, glibc)) | {"any"}
    return python_ok and abi_ok and any(p in allowed for p in platforms)


def check_wheelhouse(out: str, pins: Dict[str, str], full: str, platform: str, glibc: str,
                     roots: Sequence[Tuple[str, str]] = tuple(("atlas-edge", e) for e in EXTRAS)) -> Dict[str, str]:
    """Every pin present once at its version and installable on the box; every requirement of ``roots`` ((name,
    extra) pairs) and of every wheel met by the folder, markers evaluated for the box."""
    Requirement, Version, _env = _packaging()
    wheels: Dict[str, List[str]] = {}
    for path in sorted(glob.glob(os.path.join(out, "*.whl"))):
        wheels.setdefault(normalise(os.path.basename(path).split("-")[0]), []).append(path)
    problems = []
    found: Dict[str, str] = {}
    for name, paths in sorted(wheels.items()):
        if len(paths) > 1:
            problems.append("%s: %d wheels (%s); remove the stale ones" % (
                name, len(paths), ", ".join(os.path.basename(p) for p in paths)))
        if name != "atlas-edge" and name not in pins:
            problems.append("%s is in the folder but not pinned" % os.path.basename(paths[0]))
        found[name] = paths[-1]
    for name, version in sorted(pins.items()):
        if name not in found:
            problems.append("%s==%s was not downloaded" % (name, version))
            continue
        filename = os.path.basename(found[name])
        if Version(filename.split("-")[1]) != Version(version):
            problems.append("%s: pinned %s" % (filename, version))
        if not wheel_installs(filename, full, platform, glibc):
            problems.append("%s does not install on CPython %s, %s, glibc %s" % (filename, full, platform, glibc))
    for name, _extra in roots:
        if normalise(name) not in found:
            problems.append("no %s wheel" % name)
    environment = box_environment(full, platform)
    needed = [(normalise(n), e) for n, e in roots] + [(name, "") for name in found if name != "atlas-edge"]
    for name, extra in needed:
        if name not in found or name in NO_DEPS:
            continue
        metadata = wheel_metadata(found[name])
        for text in metadata.get_all("Requires-Dist") or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate(dict(environment, extra=extra)):
                continue
            wanted = normalise(requirement.name)
            if wanted not in found:
                problems.append("%s%s needs %s: not in the folder" % (
                    name, "[%s]" % extra if extra else "", requirement))
            elif not requirement.specifier.contains(os.path.basename(found[wanted]).split("-")[1],
                                                    prereleases=True):
                problems.append("%s needs %s: the folder has %s" % (name, requirement,
                                                                    os.path.basename(found[wanted])))
    if problems:
        raise WheelhouseError("the wheelhouse in %s is not what the box needs:\n  %s" % (out, "\n  ".join(
            sorted(set(problems)))))
    return found


INSTALL_SH = """#!/bin/sh
# Install atlas-edge from this folder only (no index, no network): %(python)s on %(platform)s, glibc >= %(glibc)s.
# Usage: sh install.sh [VENV]   (default /opt/atlas-edge/venv; PYTHON=python%(short)s by default)
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${1:-/opt/atlas-edge/venv}
PYTHON=${PYTHON:-python%(short)s}
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (%(tuple)s), sys.version' || {
    echo "install.sh: this wheelhouse is for CPython %(short)s; set PYTHON=" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# the venv's own pip may predate the manylinux_2_x tags of these wheels: the folder's pip first
"$VENV/bin/python" -m pip install -q --no-index --find-links "$HERE" --upgrade pip
"$VENV/bin/python" -m pip install -q --no-index --find-links "$HERE" -c "$HERE/constraints.txt" \\
    "atlas-edge[%(extras)s]"
# onnxruntime's own dependencies serve its tools, not inference: without them (docs/backends.md)
"$VENV/bin/python" -m pip install -q --no-index --find-links "$HERE" --no-deps "onnxruntime==%(ort)s"
"$VENV/bin/atlas-edge" bundle verify "$("$VENV/bin/python" -c 'from agent.cli.demo import DEMO_BUNDLE; \\
print(DEMO_BUNDLE)')" >/dev/null
echo "atlas-edge installed in $VENV (offline, from $HERE)"
"""

README = """atlas-edge wheelhouse for CPython %(python)s on %(platform)s (glibc %(glibc)s or newer)
Made by: atlas-edge wheelhouse --python %(python)s --platform %(platform)s --out DIR
Pins: %(constraints)s (copied here as constraints.txt)

On the box (no network needed):
  sh install.sh /opt/atlas-edge/venv        a venv with atlas-edge[%(extras)s] and onnxruntime %(ort)s
or, for the systemd service (user, venv, units):  sudo systemd/install.sh --wheels THIS_FOLDER
   (from a copy of the checkout), then: pip install --no-index --find-links THIS_FOLDER --no-deps onnxruntime==%(ort)s
Which box has which Python: docs/install-boxes.md.
"""


def write_instructions(out: str, pins: Dict[str, str], constraints: str, full: str, platform: str,
                       glibc: str) -> None:
    short = ".".join(full.split(".")[:2])
    values = {"python": full, "short": short, "tuple": short.replace(".", ", "), "platform": platform,
              "glibc": glibc, "extras": ",".join(EXTRAS), "ort": pins.get("onnxruntime", "?"),
              "constraints": os.path.relpath(constraints, checkout() or os.getcwd())}
    shutil.copy(constraints, os.path.join(out, "constraints.txt"))
    with open(os.path.join(out, "install.sh"), "w") as handle:
        handle.write(INSTALL_SH % values)
    os.chmod(os.path.join(out, "install.sh"), 0o755)
    with open(os.path.join(out, "README.txt"), "w") as handle:
        handle.write(README % values)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-edge wheelhouse")
    add_arguments(parser)
    return run(parser.parse_args(argv))
