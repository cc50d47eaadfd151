"""Reading ``.npy`` files from more than one thread of a process.

``np.load`` parses each file's header with ``ast.literal_eval``. On CPython 3.11 the AST constructor keeps its
recursion depth in interpreter-wide state, so two threads parsing at once can fail with
``SystemError: AST constructor recursion depth mismatch`` (CPython gh-106905); seen when several daemons in one
process (the fleet tests) ran their golden self-tests together. One lock serialises the reads; they are small.
"""

import threading
from typing import Any

import numpy as np

_HEADER_PARSE = threading.Lock()


def load_npy(path: str) -> Any:
    """``np.load(path)`` (no pickles), safe to call from any thread."""
    with _HEADER_PARSE:
        return np.load(path, allow_pickle=False)
