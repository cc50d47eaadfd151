"""Skip markers for tests that need what a box-only install lacks (the suite must pass on one).

A box has numpy, OpenCV, paho-mqtt and PyYAML; ``cryptography`` is the ``edge`` extra and MindSpore is
workstation-only. A test that needs either skips, naming the package, instead of erroring at import.
"""

import importlib.util

import pytest


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


needs_cryptography = pytest.mark.skipif(
    _missing("cryptography"), reason="needs the 'cryptography' package for signatures (pip install atlas-edge[edge])")
needs_mindspore = pytest.mark.skipif(
    _missing("mindspore"), reason="needs MindSpore (workstation only: pip install atlas-edge[host])")
