"""Reading a bundle folder in tests (a helper module, not a test module): its manifest, and its files' digests to
prove a conversion changed nothing it should not."""

import hashlib
import json
import os
from typing import Any, Dict


def tree(root: str) -> Dict[str, str]:
    """Every path under ``root`` with its bytes' sha256 (or 'dir'): equal trees are byte-for-byte equal."""
    result = {}
    for dirpath, dirs, names in os.walk(root):
        for name in dirs:
            result[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as handle:
                result[os.path.relpath(path, root)] = hashlib.sha256(handle.read()).hexdigest()
    return result


def manifest_of(root: str) -> Dict[str, Any]:
    with open(os.path.join(root, "manifest.json"), encoding="utf-8") as handle:
        return json.load(handle)
