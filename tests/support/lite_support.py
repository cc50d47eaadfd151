"""The real MindSpore Lite for tests: which interpreter has it, and the demo bundle converted by it.

``mindspore_lite`` 2.0.0 exists only for CPython 3.7 (``make lite`` builds ``.venv-lite``). In the Lite lane
(pytest under that interpreter) the runtime is importable here; in the host lane the converter still runs,
through ``.venv-lite``'s Python as ``atlas-edge convert`` finds it. Tests that need either skip, naming it.
"""

import argparse
import ctypes
import importlib.util
import os
import subprocess
import sys
from typing import Dict, Optional, Tuple

from agent.bundle.verify import copy_writable
from converters import toolrun

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_BUNDLE = os.path.join(REPO, "examples", "demo-bundle")
HAS_MSLITE = importlib.util.find_spec("mindspore_lite") is not None
NO_MSLITE = "needs the real mindspore_lite (the Lite lane: `make test-lite`, Python 3.7 + mindspore-lite 2.0.0)"
NO_LITE_PYTHON = ("needs a Python that imports mindspore_lite ($%s or `make lite`'s .venv-lite)"
                  % toolrun.MSLITE_PYTHON_ENV)
NO_DEMO = "examples/demo-bundle is not built (make demo-bundle)"
FE_DFL_ENV = -1  # glibc <fenv.h>: ((const fenv_t *) -1)
CONVERT_TIMEOUT_S = 600.0  # two tiers of the demo model convert in seconds; a loaded CI box is slower


def restore_ieee_floats() -> None:
    """Undo what importing mindspore_lite 2.0.0 does to this thread: it is built with fast-math, and loading it
    turns on flush-to-zero (subnormals become 0.0), which later tests' float strategies (hypothesis) refuse.
    glibc's ``fesetenv(FE_DFL_ENV)`` restores the default floating-point environment, MXCSR included."""
    if "mindspore_lite" in sys.modules and sys.platform.startswith("linux"):
        ctypes.CDLL("libm.so.6").fesetenv(ctypes.c_void_p(FE_DFL_ENV))


def lite_python() -> Optional[str]:
    """An interpreter that runs converters/lite_pyconvert.py: the setting, this one, or .venv-lite's."""
    explicit = os.environ.get(toolrun.MSLITE_PYTHON_ENV)
    for python in ([explicit] if explicit else [sys.executable if HAS_MSLITE else None, toolrun.LITE_VENV_PYTHON]):
        if python and toolrun.probe_mslite_python(python)[0] is not None:
            return python
    return None


def has_demo() -> bool:
    return os.path.isfile(os.path.join(DEMO_BUNDLE, "manifest.json"))


def convert_args(bundle: str, device: str = "cpu-dev", **options: object) -> argparse.Namespace:
    namespace = argparse.Namespace(bundle=bundle, device=device, to="ms", tiers=None, ptq=False, dry_run=False,
                                   timeout=CONVERT_TIMEOUT_S, input_format=None)
    for key, value in options.items():
        setattr(namespace, key, value)
    return namespace


def lite_env(python: str) -> Dict[str, str]:
    """This process's environment with no converter_lite binary reachable and ``python`` as the Lite one."""
    env = {k: v for k, v in os.environ.items() if k != "MSLITE_HOME"}
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d and not os.path.isfile(os.path.join(d, "converter_lite")))
    env[toolrun.MSLITE_PYTHON_ENV] = python
    return env


def convert_demo(destination: str, python: str) -> Tuple[str, int, str]:
    """A copy of the demo bundle converted for cpu-dev by the real converter: (bundle, exit status, output)."""
    root = copy_demo(destination)
    done = subprocess.run([sys.executable, "-m", "converters.cli", "--bundle", root, "--device", "cpu-dev",
                           "--to", "ms"], cwd=REPO, env=lite_env(python), capture_output=True, text=True,
                          timeout=CONVERT_TIMEOUT_S, check=False)
    return root, done.returncode, done.stdout + done.stderr


def copy_demo(destination: str) -> str:
    return copy_writable(DEMO_BUNDLE, destination)
