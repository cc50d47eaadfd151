"""Finding a conversion tool, recording its version, running it, and judging the result; and the versions of
the host's own toolchain (MindSpore, NumPy, OpenCV) that a bundle producer records in the manifest.

Tools run as argument lists (no shell) in a temporary working directory, because ATC drops ``kernel_meta/``
and fusion dumps into its current directory. A run counts only when the process exits 0, prints the tool's
success line, *and* leaves a non-empty output file: both tools have been seen to exit 0 after an error.
"""

import logging
import os
import platform
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

DEFAULT_TOOLKIT_BIN = "/usr/local/Ascend/ascend-toolkit/latest/bin"  # the CANN installer's default
LOG_TAIL_LINES = 40  # enough for ATC's error block (error code, op name, suggestion)
# version.cfg keys in order of preference; the value is [internal:public], e.g. [7.6.0.1.220:8.0.0].
CANN_VERSION_KEYS = ("compiler_running_version", "toolkit_running_version", "runtime_running_version")
UNKNOWN_VERSION = "unknown"


def join_command(cmd: Sequence[str]) -> str:
    """``shlex.join`` (Python 3.8+) for the Lite lane's Python 3.7."""
    return " ".join(shlex.quote(part) for part in cmd)


@dataclass(frozen=True)
class ToolInfo:
    """A conversion tool: its program name, the package that ships it, the line it prints on success."""

    name: str
    package: str
    success_line: str


ATC = ToolInfo(
    name="atc",
    package="the CANN toolkit (Ascend-cann-toolkit_<version>_linux-<arch>.run from Huawei's Ascend site; "
            "then `source <install dir>/ascend-toolkit/set_env.sh`)",
    success_line="ATC run success",
)
CONVERTER_LITE = ToolInfo(
    name="converter_lite",
    package="the MindSpore Lite release tarball (mindspore-lite-<version>-linux-<arch>.tar.gz from "
            "mindspore.cn; it holds tools/converter/converter/converter_lite; set MSLITE_HOME to its root)",
    success_line="CONVERT RESULT SUCCESS:0",
)


class ToolNotFound(RuntimeError):
    """The tool is in none of the places looked at; the message lists them and the package to install."""

    def __init__(self, tool: ToolInfo, places: Sequence[str]) -> None:
        self.tool = tool
        self.places = list(places)
        super().__init__("%s not found. Looked in:\n%s\n%s comes with %s." % (
            tool.name, "\n".join("  - " + p for p in self.places), tool.name, tool.package))


class ToolFailed(RuntimeError):
    """A run that did not produce a usable output; ``log_tail`` holds the end of what the tool printed."""

    def __init__(self, tool: str, reason: str, log_tail: str = "") -> None:
        self.tool = tool
        self.reason = reason
        self.log_tail = log_tail
        super().__init__("%s: %s" % (tool, reason))


def search_places(tool: ToolInfo, env: Mapping[str, str]) -> List[Tuple[str, Optional[str]]]:
    """Where to look, in order: (description, directory or None when its variable is unset)."""
    places: List[Tuple[str, Optional[str]]] = []
    for directory in [d for d in env.get("PATH", "").split(os.pathsep) if d]:
        places.append(("PATH entry %s" % directory, directory))

    def from_env(variable: str, *parts: str) -> None:
        suffix = "/".join(parts)
        root = env.get(variable)
        if root:
            directory = os.path.join(root, *parts)
            places.append(("$%s/%s (%s)" % (variable, suffix, directory), directory))
        else:
            places.append(("$%s/%s (%s is not set)" % (variable, suffix, variable), None))

    if tool.name == ATC.name:
        from_env("ASCEND_TOOLKIT_HOME", "bin")
        from_env("ASCEND_HOME", "latest", "bin")
        places.append((DEFAULT_TOOLKIT_BIN, DEFAULT_TOOLKIT_BIN))
    else:
        from_env("MSLITE_HOME", "tools", "converter", "converter")
    if not any(desc.startswith("PATH entry") for desc, _ in places):
        places.insert(0, ("PATH (empty)", None))
    return places


def find_tool(tool: ToolInfo, env: Mapping[str, str]) -> str:
    """The absolute path of the first executable ``tool.name`` in :func:`search_places`; else ToolNotFound."""
    places = search_places(tool, env)
    for _description, directory in places:
        if directory is None:
            continue
        candidate = os.path.join(directory, tool.name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    raise ToolNotFound(tool, [description for description, _ in places])


def child_env(tool: ToolInfo, tool_path: str, env: Mapping[str, str]) -> dict:
    """The tool's environment. converter_lite needs its own shared libraries: ``tools/converter/lib`` beside
    its directory (and under ``$MSLITE_HOME``) go first on LD_LIBRARY_PATH, for the child only."""
    result = dict(env)
    if tool.name != CONVERTER_LITE.name:
        return result
    libs = [os.path.join(os.path.dirname(os.path.dirname(tool_path)), "lib")]
    if env.get("MSLITE_HOME"):
        libs.append(os.path.join(env["MSLITE_HOME"], "tools", "converter", "lib"))
    libs = [d for i, d in enumerate(libs) if os.path.isdir(d) and d not in libs[:i]]
    if libs:
        result["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    return result


def _cann_from_cfg(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    for key in CANN_VERSION_KEYS:
        match = re.search(r"^%s=\[([^\]]*)\]" % key, text, flags=re.MULTILINE)
        if match:
            value = match.group(1)
            return value.split(":", 1)[1] if ":" in value else value  # the public name after the colon
    match = re.search(r"^Version=(\S+)", text, flags=re.MULTILINE)
    return match.group(1) if match else None


def cann_version(atc_path: str) -> str:
    """The CANN version in ``<toolkit>/version.cfg`` or ``<toolkit>/../version.cfg`` (toolkit: bin's parent).

    Older layouts put atc under ``latest/atc/bin``, where the file is one level higher.
    """
    toolkit = os.path.dirname(os.path.dirname(os.path.abspath(atc_path)))
    for folder in (toolkit, os.path.dirname(toolkit)):
        version = _cann_from_cfg(os.path.join(folder, "version.cfg"))
        if version:
            return version
    return UNKNOWN_VERSION


# The version of a converter_lite tarball: its version.txt's first token, else the folder name. Anchored to the
# whole token, so a log timestamp (2026-11-30-23:55:37) can never pass for a version.
VERSION_TOKEN = re.compile(r"^\s*(\d+\.\d+\.\d+(?:[.-]?(?:rc|RC|post|dev)\d*)?)\s*$")
TARBALL_DIR = re.compile(r"^mindspore-lite-(\d+\.\d+\.\d+(?:rc\d+)?)(?:-linux-\w+)?$")
TARBALL_DEPTH = 4  # <root>/tools/converter/converter/converter_lite


def converter_version(tool_path: str) -> str:
    """The release of a ``converter_lite`` binary: ``version.txt`` or ``mindspore-lite-<v>-...`` above it.

    ``converter_lite`` documents ``--help`` but no ``--version``, so the binary is never asked.
    """
    for path in dict.fromkeys([os.path.abspath(tool_path), os.path.realpath(tool_path)]):
        folder = os.path.dirname(path)
        for _ in range(TARBALL_DEPTH):
            try:
                with open(os.path.join(folder, "version.txt"), encoding="utf-8", errors="replace") as handle:
                    match = VERSION_TOKEN.match(handle.readline())
                if match:
                    return match.group(1)
            except OSError:
                pass
            match = TARBALL_DIR.match(os.path.basename(folder))
            if match:
                return match.group(1)
            folder = os.path.dirname(folder)
    return UNKNOWN_VERSION


def toolchain_versions() -> Dict[str, Optional[str]]:
    """The host's own toolchain that made a bundle (``qat``, ``bundle create``): the manifest's ``toolchain``,
    as :func:`locate` gives a converted artifact's. MindSpore is imported here, never at module import."""
    import cv2
    import mindspore
    import numpy as np

    try:
        from mindspore_gs.version import __version__ as gs_version
    except ImportError:
        gs_version = None
    return {
        "mindspore": mindspore.__version__,
        "mindspore_gs": gs_version,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "opencv": cv2.__version__,
    }


# --- the converter as MindSpore Lite's Python API, in another interpreter -----------------------------------

MSLITE_PYTHON_ENV = "ATLAS_EDGE_MSLITE_PYTHON"  # an interpreter that imports mindspore_lite; the only one tried
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LITE_VENV_PYTHON = os.path.join(REPO_ROOT, ".venv-lite", "bin", "python")  # what `make lite` builds
PYCONVERT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lite_pyconvert.py")
PY_PROBE_TIMEOUT_S = 120.0  # importing mindspore_lite loads ~400 MB of libraries; a cold disk is slow


@dataclass(frozen=True)
class LocatedTool:
    """A tool ready to run: ``argv`` goes before the tool's own flags."""

    tool: ToolInfo
    argv: List[str]
    path: str  # the binary, or the interpreter driving lite_pyconvert.py
    toolchain: Dict[str, str]  # what the manifest records: which converter ran, and its version


def probe_mslite_python(python: str) -> Tuple[Optional[str], str]:
    """(mindspore_lite version, "") when ``python`` runs lite_pyconvert.py, else (None, why not)."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return None, "no such executable"
    try:
        done = subprocess.run([python, PYCONVERT, "--version"], capture_output=True, text=True,
                              errors="replace", timeout=PY_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    match = re.match(r"mindspore_lite (\S+)$", done.stdout.strip())
    if done.returncode != 0 or not match:
        return None, tail(done.stderr or done.stdout, 2) or "exit status %d" % done.returncode
    return match.group(1), ""


def _python_version(python: str) -> str:
    done = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True, timeout=PY_PROBE_TIMEOUT_S, check=False)
    return done.stdout.strip() or UNKNOWN_VERSION


def locate(tool: ToolInfo, env: Mapping[str, str]) -> LocatedTool:
    """ATC: the binary. converter_lite: the binary (:func:`find_tool`), else MindSpore Lite's Python API
    through lite_pyconvert.py, run by ``$ATLAS_EDGE_MSLITE_PYTHON`` when set, else by ``.venv-lite``'s."""
    if tool.name == ATC.name:
        path = find_tool(tool, env)
        return LocatedTool(tool, [path], path, {"converter": ATC.name, "cann": cann_version(path)})
    try:
        path = find_tool(tool, env)
        return LocatedTool(tool, [path], path, {"converter": tool.name, "converter_lite": converter_version(path)})
    except ToolNotFound as missing:
        places = missing.places
    explicit = env.get(MSLITE_PYTHON_ENV)
    python = explicit or LITE_VENV_PYTHON
    version, why = probe_mslite_python(python)
    if version is None:
        where = "$%s (%s)" % (MSLITE_PYTHON_ENV, python) if explicit else \
            "%s (`make lite`; $%s is not set)" % (python, MSLITE_PYTHON_ENV)
        raise ToolNotFound(tool, places + ["a Python with mindspore_lite: %s: %s" % (where, why)])
    return LocatedTool(tool, [python, PYCONVERT], python, {
        "converter": "mindspore_lite.Converter", "mindspore_lite": version, "python": _python_version(python)})


@dataclass(frozen=True)
class ToolRun:
    returncode: Optional[int]  # None when killed for the timeout
    timed_out: bool
    output: str  # stdout and stderr, interleaved as written


def run_tool(cmd: Sequence[str], cwd: str, env: Mapping[str, str], timeout_s: float,
             log_path: str) -> ToolRun:
    """Run ``cmd`` (no shell) in ``cwd``; stdout+stderr go to ``log_path`` (first line: the command).

    The tool gets its own process group so a timeout kills it and any compiler children it started.
    """
    log.debug("running %s (in %s, timeout %.0f s)", join_command(cmd), cwd, timeout_s)
    with open(log_path, "w", encoding="utf-8") as sink:
        sink.write("$ %s\n" % join_command(cmd))
        sink.flush()
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            returncode: Optional[int] = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
            returncode = None
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        output = handle.read()
    return ToolRun(returncode=returncode, timed_out=timed_out, output=output)


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "signal %d" % number


def check_run(tool: ToolInfo, run: ToolRun, output_path: str, timeout_s: float) -> None:
    """Raise ToolFailed unless the run exited 0, printed the success line and wrote a non-empty output."""
    name = os.path.basename(output_path)
    if run.timed_out:
        reason = "did not finish within %.0f s and was killed" % timeout_s
    elif run.returncode is not None and run.returncode < 0:  # MindSpore Lite 2.0's FULL_QUANT ends in SIGSEGV
        reason = "was killed by %s (status %d)" % (_signal_name(-run.returncode), run.returncode)
    elif run.returncode != 0:
        reason = "exited with status %s" % run.returncode
    elif tool.success_line not in run.output:
        reason = "exited 0 but never printed %r" % tool.success_line
    elif not os.path.isfile(output_path):
        reason = "printed %r but wrote no %s" % (tool.success_line, name)
    elif os.path.getsize(output_path) == 0:
        reason = "printed %r but %s is empty" % (tool.success_line, name)
    else:
        return
    raise ToolFailed(tool.name, reason, tail(run.output))
