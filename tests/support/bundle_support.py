"""Bundles in tests (a helper module, not a test module): writing a small valid one with stand-in artifact bytes,
reading a bundle folder's manifest and its files' digests to prove a conversion changed nothing it should not,
and the fields a refusal names."""

import hashlib
import json
import os
from typing import Any, Dict

import numpy as np

from agent.bundle.verify import write_manifest


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


def artifact(file, **extra):
    entry = {"file": file, "format": "onnx", "target": "cpu", "tier": [32, 32], "sha256": "", "size": 0}
    entry.update(extra)
    return entry


def make_bundle(root, artifacts=None, tiers=((32, 32),)):
    """A small valid bundle with stand-in artifact bytes and a golden case; returns the written manifest."""
    root = str(root)
    os.makedirs(os.path.join(root, "golden"), exist_ok=True)
    artifacts = artifacts or [artifact("model.onnx")]
    for art in artifacts:
        with open(os.path.join(root, art["file"]), "wb") as handle:
            handle.write(b"stand-in model bytes for " + art["file"].encode())
    np.save(os.path.join(root, "golden", "case0.npy"), np.zeros((32, 32, 3), np.uint8))
    np.save(os.path.join(root, "golden", "case0.out.npy"), np.zeros((1, 7), np.float32))
    manifest = {
        "name": "unit", "version": "1.0.0", "created": "2026-01-01T00:00:00Z", "task": "classify",
        "labels": ["a", "b"],
        "input": {"name": "x", "tiers": [list(t) for t in tiers]},
        "artifacts": artifacts,
        "golden": {"cases": [{"image": "golden/case0.npy", "tier": [32, 32],
                              "expected": {artifacts[0]["file"]: "golden/case0.out.npy"}}]},
    }
    return write_manifest(root, manifest)


def fields(exc):
    return [e.path for e in exc.errors]
