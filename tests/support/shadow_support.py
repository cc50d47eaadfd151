"""Candidates for shadow runs (a helper module, not a test module): the demo bundle's int8 as a bundle of its own,
and broken copies of it (labels shifted by one). The pipeline, lifecycle, daemon and fleet tests of shadow runs
share these."""

import json
import os
import shutil

from agent.bundle.manifest import MANIFEST
from agent.bundle.verify import sha256_file, write_manifest


def candidate_bundle(src, dst, version, serve="int8", shift_labels=False):
    """A copy of ``src`` as release ``version`` serving only its ``serve`` artifacts (``int8`` or ``float``; the
    others stay in the bundle with role ``convert``: the float ones are the quantized golden rule's reference),
    its labels rotated by one when ``shift_labels`` (the same network, a label file from another version).
    Returns its manifest sha."""
    shutil.copytree(src, dst)
    for extra in ("manifest.sig",):
        if os.path.exists(os.path.join(dst, extra)):
            os.remove(os.path.join(dst, extra))
    with open(os.path.join(dst, MANIFEST)) as handle:
        data = json.load(handle)
    data["version"] = version
    for art in data["artifacts"]:
        if (art["precision"] == "int8") != (serve == "int8"):
            art["role"] = "convert"
    if shift_labels:
        data["labels"] = data["labels"][1:] + data["labels"][:1]
    write_manifest(dst, data)
    return sha256_file(os.path.join(dst, MANIFEST))

