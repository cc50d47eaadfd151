"""Hashing, verifying and writing a bundle on disk: what the box trusts and what the host produces.

The host writes bundles with :func:`write_manifest`; the box trusts one only after :func:`verify_bundle`
(schema, every file's sha256, no unlisted files, optional Ed25519 signature). Whether a box can run it is
:func:`agent.pipeline.artifacts.select_artifacts`. A failure raises :class:`BundleError` naming the field or
file, before anything is loaded.
"""

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent._util.atomic import atomic_write
from agent.bundle.manifest import MANIFEST, SIGNATURE, BundleError, Manifest, load_manifest, parse_manifest
from agent.bundle.signing import verify_signature
from agent.config.schema import FieldError

HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Bundle:
    """A verified bundle on disk."""

    root: str
    manifest: Manifest
    manifest_sha256: str  # what an operator pins in a deploy command
    signed: bool

    def path(self, relative: str) -> str:
        return os.path.join(self.root, relative)

    @property
    def label(self) -> str:
        return "%s %s" % (self.manifest.name, self.manifest.version)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def listed_files(root: str) -> List[str]:
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel not in (MANIFEST, SIGNATURE):
                found.append(rel)
    return sorted(found)


def verify_bundle(root: str, public_key: Optional[bytes] = None, check_hashes: bool = True) -> Bundle:
    """Schema, hashes, completeness and (when a key is given) the manifest signature; raises BundleError."""
    manifest = load_manifest(root)
    errors: List[FieldError] = []
    expected: Dict[str, Tuple[str, int, str]] = {}
    for i, art in enumerate(manifest.artifacts):
        expected[art.file] = (art.sha256, art.size, "artifacts[%d]" % i)
    for name, entry in manifest.files.items():
        expected[name] = (entry.sha256, entry.size, "files[%s]" % name)
    for name, (sha, size, field) in sorted(expected.items()):
        path = os.path.join(root, name)
        if os.path.isabs(name) or ".." in name.split("/"):
            errors.append(FieldError(field, "path escapes the bundle: %s" % name))
        elif not os.path.isfile(path):
            errors.append(FieldError(field, "file missing: %s" % name))
        elif os.path.getsize(path) != size:
            errors.append(FieldError(field + ".size", "%s is %d bytes, manifest says %d" % (
                name, os.path.getsize(path), size)))
        elif check_hashes and sha256_file(path) != sha:
            errors.append(FieldError(field + ".sha256", "hash mismatch for %s" % name))
    for name in listed_files(root):
        if name not in expected:
            errors.append(FieldError("files", "unlisted file in bundle: %s" % name))
    signed = os.path.exists(os.path.join(root, SIGNATURE))
    if public_key is not None:
        if not signed:
            errors.append(FieldError("manifest.sig", "missing: this box requires signed bundles"))
        elif not verify_signature(root, public_key):
            errors.append(FieldError("manifest.sig", "signature does not match the manifest and key"))
    if errors:
        raise BundleError(errors, root)
    return Bundle(root=os.path.abspath(root), manifest=manifest,
                  manifest_sha256=sha256_file(os.path.join(root, MANIFEST)), signed=signed)


def write_manifest(root: str, manifest: Mapping[str, Any]) -> Dict[str, Any]:
    """Fill sha256/size of every artifact and of every other file on disk, validate, write atomically.

    Files under the bundle that are not artifacts are added to ``files`` so that nothing goes unhashed.
    Returns the written manifest as a dict.
    """
    data = json.loads(json.dumps(manifest))  # a deep copy, and proof it is JSON-serialisable
    artifact_files = set()
    for art in data.get("artifacts", []):
        path = os.path.join(root, art["file"])
        art["sha256"], art["size"] = sha256_file(path), os.path.getsize(path)
        artifact_files.add(art["file"])
    data["files"] = {
        name: {"sha256": sha256_file(os.path.join(root, name)), "size": os.path.getsize(os.path.join(root, name))}
        for name in listed_files(root) if name not in artifact_files
    }
    parse_manifest(data, os.path.join(root, MANIFEST))
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    atomic_write(os.path.join(root, MANIFEST), text)  # readers see the old or the new manifest, never half
    stale_signature = os.path.join(root, SIGNATURE)
    if os.path.exists(stale_signature):
        os.remove(stale_signature)  # a signature of the old manifest would now be a lie
    return data


def copy_writable(source: str, destination: str) -> str:
    """A copy of a bundle folder whose files can be replaced (MindSpore writes its exports read-only)."""
    shutil.copytree(source, destination)
    for dirpath, _dirs, names in os.walk(destination):
        for name in names:
            os.chmod(os.path.join(dirpath, name), 0o644)
    return destination
