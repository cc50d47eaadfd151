"""The model bundle: the one reader, writer and verifier of ``manifest.json`` (contract: docs/bundle.md).

The host writes bundles with :func:`write_manifest`; the box trusts one only after :func:`verify_bundle`
(schema, every file's sha256, no unlisted files, optional Ed25519 signature) and :func:`select_artifacts`
(an artifact this box's backend and SoC can run, for every tier it serves). A failure raises
:class:`BundleError` naming the field or file, before anything is loaded.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent._util.atomic import atomic_write
from agent.config.device_config import ARTIFACT_FORMATS, BACKEND_FORMATS, DeviceConfig
from agent.config.schema import ConfigError, FieldError, parse, setting
from agent.pipeline.postprocess import TASKS

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
SCHEMA_VERSION = 1
HASH_CHUNK = 1 << 20

Tier = Tuple[int, int]  # (h, w)


class BundleError(ConfigError):
    """A bundle that must not be served; ``errors`` name the manifest field or file."""


def _positive_tier(tier: Tier, name: str) -> List[Tuple[str, str]]:
    return [] if tier[0] > 0 and tier[1] > 0 else [(name, "tier sides must be positive (got %s)" % (tier,))]


@dataclass(frozen=True)
class LetterboxSpec:
    pad_value: int = setting(114, ge=0, le=255, doc="grey of the padding (Ultralytics: 114)")
    center: bool = setting(True, doc="pad both sides equally")
    scaleup: bool = setting(True, doc="enlarge frames smaller than the tier")


@dataclass(frozen=True)
class Preprocessing:
    letterbox: LetterboxSpec = setting(factory=LetterboxSpec)
    color: str = setting("rgb", choices=("rgb", "bgr"), doc="colour order the network was trained on")
    mean: Tuple[float, float, float] = setting((0.0, 0.0, 0.0), doc="on 0..255 pixels, network colour order")
    std: Tuple[float, float, float] = setting((255.0, 255.0, 255.0), doc="out = (pixel - mean) / std")

    def check(self) -> List[Tuple[str, str]]:
        return [("std", "must be > 0 (got %s)" % (self.std,))] if min(self.std) <= 0 else []


@dataclass(frozen=True)
class Postprocessing:
    conf: float = setting(0.25, ge=0, le=1)
    iou: float = setting(0.45, ge=0, le=1)
    top_k: int = setting(5, ge=1)
    max_det: int = setting(100, ge=1)


@dataclass(frozen=True)
class InputSpec:
    name: str = setting(doc="the network's input tensor name")
    tiers: List[Tier] = setting(min_len=1, doc="fixed input shapes [h, w]")
    layout: str = setting("NCHW", choices=("NCHW", "NHWC"))
    dtype: str = setting("float32", choices=("float32", "float16", "uint8"))

    def check(self) -> List[Tuple[str, str]]:
        problems = [p for i, t in enumerate(self.tiers) for p in _positive_tier(t, "tiers[%d]" % i)]
        if len(set(self.tiers)) != len(self.tiers):
            problems.append(("tiers", "duplicate tier"))
        return problems


@dataclass(frozen=True)
class Artifact:
    file: str = setting(doc="path inside the bundle")
    format: str = setting(choices=ARTIFACT_FORMATS)
    target: str = setting(choices=("cpu", "ascend"))
    tier: Tier = setting(doc="[h, w]")
    sha256: str = setting(doc="hex digest of the file")
    size: int = setting(ge=0)
    soc_version: Optional[str] = setting(None, doc="required for ascend artifacts")
    batch: int = setting(1, ge=1, le=256)
    precision: str = setting("float32", choices=("float32", "float16", "int8", "int8-sim"))
    role: str = setting("serve", choices=("serve", "convert"), doc="convert: converter input only")
    input_dtype: str = setting("float32", choices=("float32", "float16", "uint8"))
    input_layout: str = setting("NCHW", choices=("NCHW", "NHWC"))
    normalize_on: str = setting("host", choices=("host", "aipp"), doc="aipp: uint8 in, the NPU normalises")
    input_color: str = setting("rgb", choices=("rgb", "bgr"))
    config_files: List[str] = setting(factory=list)
    toolchain: Dict[str, Optional[str]] = setting(factory=dict)

    def check(self) -> List[Tuple[str, str]]:
        problems = _positive_tier(self.tier, "tier")
        if self.target == "ascend" and not self.soc_version:
            problems.append(("soc_version", "required when target is ascend"))
        if self.normalize_on == "aipp" and self.input_dtype != "uint8":
            problems.append(("input_dtype", "must be uint8 when normalize_on is aipp"))
        return problems

    def key(self) -> str:
        return self.file


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int = setting(ge=0)


@dataclass(frozen=True)
class GoldenCase:
    image: str = setting(doc="letterboxed uint8 BGR (h, w, 3) .npy")
    tier: Tier = setting()
    expected: Dict[str, str] = setting(doc="artifact file -> .npy of its raw output 0 at batch 1")


@dataclass(frozen=True)
class GoldenSet:
    cases: List[GoldenCase] = setting(min_len=1)
    atol: float = setting(1e-3, ge=0)
    rtol: float = setting(1e-3, ge=0)


@dataclass(frozen=True)
class Calibration:
    dir: str
    tier: Tier
    count: int = setting(ge=1)
    layout: str = setting("NHWC", choices=("NHWC", "NCHW"))
    dtype: str = setting("float32", choices=("float32", "uint8"))


@dataclass(frozen=True)
class Source:
    """Where an imported model came from (``atlas-edge bundle create``); bundles trained by ``qat`` have none."""

    model: str = setting(doc="the model file given, by name")
    sha256: str = setting(doc="of that file as given (artifacts may be copies with fixed input shapes)")
    producer: str = setting(doc="the exporter the model's metadata names, or 'unknown'")
    preprocessing: str = setting(doc="where preprocessing came from: the producer's convention, assumed, flags")
    images: str = setting(doc="what the golden and calibration sets were made from: --images DIR or generated")


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    created: str
    task: str = setting(choices=TASKS)
    labels: List[str] = setting(min_len=1)
    input: InputSpec = setting()
    artifacts: List[Artifact] = setting(min_len=1)
    schema: int = setting(SCHEMA_VERSION, choices=(SCHEMA_VERSION,))
    preprocessing: Preprocessing = setting(factory=Preprocessing)
    postprocessing: Postprocessing = setting(factory=Postprocessing)
    files: Dict[str, FileEntry] = setting(factory=dict)
    toolchain: Dict[str, Optional[str]] = setting(factory=dict)
    golden: Optional[GoldenSet] = None
    calibration: Optional[Calibration] = None
    source: Optional[Source] = None

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        seen = set()
        for i, art in enumerate(self.artifacts):
            if art.tier not in self.input.tiers:
                problems.append(("artifacts[%d].tier" % i, "%s is not one of input.tiers %s" % (
                    list(art.tier), [list(t) for t in self.input.tiers])))
            if art.file in seen or art.file in self.files:
                problems.append(("artifacts[%d].file" % i, "%s is listed twice" % art.file))
            seen.add(art.file)
        if self.golden is not None:
            for i, case in enumerate(self.golden.cases):
                for art_file, expected in case.expected.items():
                    if art_file not in seen:
                        problems.append(("golden.cases[%d].expected" % i, "no artifact %s" % art_file))
                    if expected not in self.files:
                        problems.append(("golden.cases[%d].expected" % i, "%s is not in files" % expected))
                if case.image not in self.files:
                    problems.append(("golden.cases[%d].image" % i, "%s is not in files" % case.image))
        return problems

    def artifact(self, file: str) -> Artifact:
        for art in self.artifacts:
            if art.file == file:
                return art
        raise KeyError(file)


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


def _listed_files(root: str) -> List[str]:
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel not in (MANIFEST, SIGNATURE):
                found.append(rel)
    return sorted(found)


def parse_manifest(data: Mapping[str, Any], source: str = MANIFEST) -> Manifest:
    try:
        return parse(Manifest, data, source)
    except ConfigError as exc:
        raise BundleError(exc.errors, source) from None


def load_manifest(root: str) -> Manifest:
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise BundleError([FieldError("bundle", "not a directory: %s" % root)], root)
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except FileNotFoundError:
        raise BundleError([FieldError("manifest.json", "missing")], root) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError([FieldError("manifest.json", "not valid JSON: %s" % exc)], root) from None
    return parse_manifest(data, path)


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
    for name in _listed_files(root):
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
        for name in _listed_files(root) if name not in artifact_files
    }
    parse_manifest(data, os.path.join(root, MANIFEST))
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    atomic_write(os.path.join(root, MANIFEST), text)  # readers see the old or the new manifest, never half
    stale_signature = os.path.join(root, SIGNATURE)
    if os.path.exists(stale_signature):
        os.remove(stale_signature)  # a signature of the old manifest would now be a lie
    return data


# --- compatibility with a box -------------------------------------------------------------------------------

def select_artifacts(bundle: Bundle, device: DeviceConfig, backend: str, batch: Optional[int] = None
                     ) -> Dict[Tier, Artifact]:
    """For each tier, the artifact this box runs with ``backend``; raise BundleError naming what is missing.

    An ascend artifact must carry the device's SoC: a model compiled for a 310P does not run on a 310B,
    and finding out at load time on the box is exactly the failure users report.
    """
    formats = BACKEND_FORMATS.get(backend)
    if formats is None:
        raise BundleError([FieldError("backend", "unknown backend %r" % backend)], bundle.root)
    chosen: Dict[Tier, Artifact] = {}
    rejected: List[FieldError] = []
    for i, art in enumerate(bundle.manifest.artifacts):
        field = "artifacts[%d]" % i
        if art.role != "serve" or art.format not in formats:
            continue
        if art.target != device.target:
            rejected.append(FieldError(field + ".target", "%s is for %s, device %s is %s" % (
                art.file, art.target, device.name, device.target)))
            continue
        if art.target == "ascend" and art.soc_version != device.soc_version:
            rejected.append(FieldError(field + ".soc_version", "%s was built for %s, device %s is %s" % (
                art.file, art.soc_version, device.name, device.soc_version)))
            continue
        if device.input_tiers and art.tier not in device.input_tiers:
            continue
        current = chosen.get(art.tier)
        # Prefer the artifact whose fixed batch matches the requested one, else the smallest batch; then the
        # backend's own order of formats (mslite: a converted .ms before a MindIR it may not read).
        if current is None or (_batch_rank(art, batch), formats.index(art.format)) < (
                _batch_rank(current, batch), formats.index(current.format)):
            chosen[art.tier] = art
    if not chosen:
        reason = rejected or [FieldError("artifacts", "no %s artifact for backend %s (formats %s)" % (
            "serve", backend, "/".join(formats)))]
        raise BundleError(reason, bundle.root)
    return chosen


def _batch_rank(art: Artifact, batch: Optional[int]) -> Tuple[int, int]:
    return (0 if batch is not None and art.batch == batch else 1, art.batch)


def pick_tier(tiers: List[Tier], src_hw: Tuple[int, int]) -> Tier:
    """The tier whose aspect ratio is closest to the source's (log scale); ties go to the larger tier.

    Matching the aspect ratio minimises padding, so the most pixels go to the picture rather than grey bars.
    """
    import math

    h0, w0 = src_hw
    if h0 <= 0 or w0 <= 0:
        raise ValueError("src_hw must be positive (got %s)" % (src_hw,))
    src = math.log(w0 / h0)
    return min(tiers, key=lambda t: (round(abs(math.log(t[1] / t[0]) - src), 6), -(t[0] * t[1])))


# --- signatures -------------------------------------------------------------------------------------------

def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise BundleError([FieldError("manifest.sig", "signature checks need the 'cryptography' package "
                                      "(pip install atlas-edge[edge])")]) from None
    return ed25519, serialization


def load_public_key(text: str) -> bytes:
    """A raw 32-byte Ed25519 public key from hex, or from a PEM file path."""
    if os.path.isfile(text):
        _ed, serialization = _crypto()
        with open(text, "rb") as handle:
            key = serialization.load_pem_public_key(handle.read())
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    raw = bytes.fromhex(text)
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes (got %d)" % len(raw))
    return raw


def verify_signature(root: str, public_key: bytes) -> bool:
    with open(os.path.join(root, MANIFEST), "rb") as handle:
        body = handle.read()
    with open(os.path.join(root, SIGNATURE), "rb") as handle:
        signature = handle.read()
    return signature_matches(body, signature, public_key)


def signature_matches(body: bytes, signature: bytes, public_key: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s Ed25519 signature of the manifest bytes ``body``."""
    ed25519, _ser = _crypto()
    from cryptography.exceptions import InvalidSignature

    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_key).verify(signature, body)
    except InvalidSignature:
        return False
    return True


def sign_bundle(root: str, private_key_pem: bytes) -> str:
    """Write ``manifest.sig``; returns the public key as hex (what the box's config names)."""
    ed25519, serialization = _crypto()
    key = serialization.load_pem_private_key(private_key_pem, password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError("the signing key must be Ed25519")
    with open(os.path.join(root, MANIFEST), "rb") as handle:
        signature = key.sign(handle.read())
    with open(os.path.join(root, SIGNATURE), "wb") as handle:
        handle.write(signature)
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return public.hex()
