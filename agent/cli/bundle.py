"""``atlas-edge bundle create|verify|sign|keygen``: make a bundle from your own model, check it as a box would,
and sign it for boxes that ask.

``create`` is a host command (its logic is :mod:`converters.byom.create`, which needs the ``host`` extra: MindSpore,
onnx); it is imported only when ``create`` runs, so the box's ``verify`` never loads host code.

``verify`` runs exactly the box's checks (:func:`agent.bundle.verify.verify_bundle`, then, with ``--device``,
:func:`agent.pipeline.artifacts.select_artifacts`, and with ``--run-golden`` the load + warm-up + golden self-test of
:func:`agent.pipeline.model.load_model`), so a bundle that passes here is refused on a box only for a reason the box
alone can see (its runtime, its memory). ``keygen`` and ``sign`` need the ``cryptography`` package (the
``edge`` extra); ``verify`` needs it only for a signed bundle with ``--public-key``.

Exit codes: 0 valid / done, 1 the bundle (or key) was refused, 2 bad usage.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Optional, Tuple

from agent.bundle.manifest import COLOR_ORDERS, TASKS, BundleError, Preprocessing
from agent.bundle.signing import load_public_key, sign_bundle
from agent.bundle.verify import Bundle, verify_bundle
from agent.config.schema import ConfigError
from agent.lifecycle.fetch import ARCHIVE_SUFFIXES, unpack_archive
from agent.pipeline.artifacts import select_artifacts

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
PRIVATE_KEY_MODE = 0o600  # a signing key readable by others is a signing key for others


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bundle_command", metavar="ACTION")
    _add_create_arguments(sub)
    verify = sub.add_parser("verify", help="check manifest, hashes, signature, box compatibility, golden set",
                            description="Check a bundle directory (or .tar/.tar.gz) the way a box does.")
    verify.add_argument("bundle", metavar="DIR", help="bundle directory or archive")
    verify.add_argument("--public-key", metavar="K",
                        help="Ed25519 public key (hex or PEM file): require a valid manifest.sig")
    verify.add_argument("--device", metavar="NAME",
                        help="device config (name or path): check that the box can run it")
    verify.add_argument("--backend", metavar="B",
                        help="backend to check with --device (default: the device's)")
    verify.add_argument("--run-golden", action="store_true",
                        help="load the model on this machine with --backend and run the golden set")
    verify.set_defaults(bundle_handler=_verify)

    sign = sub.add_parser("sign", help="write manifest.sig with an Ed25519 private key",
                          description="Verify the bundle, then sign its manifest.json (writes manifest.sig).")
    sign.add_argument("bundle", metavar="DIR", help="bundle directory")
    sign.add_argument("--key", required=True, metavar="PRIVATE.pem", help="Ed25519 private key (PEM, PKCS#8)")
    sign.set_defaults(bundle_handler=_sign)

    keygen = sub.add_parser("keygen", help="make an Ed25519 key pair: OUT_PREFIX.key and OUT_PREFIX.pub",
                            description="Write OUT_PREFIX.key (private, mode 600) and OUT_PREFIX.pub "
                                        "(public); print the public key in hex for model.public_key.")
    keygen.add_argument("prefix", metavar="OUT_PREFIX", help="path prefix of the two key files")
    keygen.set_defaults(bundle_handler=_keygen)


def run(args: argparse.Namespace) -> int:
    handler = getattr(args, "bundle_handler", None)
    if handler is None:
        print("atlas-edge bundle: choose an action: create, verify, sign or keygen", file=sys.stderr)
        return EXIT_USAGE
    return int(handler(args))


# --- create -------------------------------------------------------------------------------------------

def _add_create_arguments(sub: Any) -> None:
    create = sub.add_parser(
        "create", help="make a bundle from an ONNX or MindIR model trained elsewhere (workstation)",
        description="Make a bundle (artifacts per tier, golden and calibration sets, manifest) from an ONNX or "
                    "MindIR file: Ultralytics YOLOv5u/v8/11 exports, MindYOLO/MindCV exports, any classifier. "
                    "Nothing is written to --out unless every check passes. See docs/bundle.md.")
    create.add_argument("--model", required=True, metavar="FILE", help="the .onnx or .mindir file")
    create.add_argument("--out", required=True, metavar="DIR", help="bundle directory (empty, new, or a bundle)")
    create.add_argument("--name", help="bundle name (default: the model file's stem)")
    create.add_argument("--version", default="1.0.0", help="bundle version (default: 1.0.0)")
    create.add_argument("--task", default="auto", choices=("auto",) + TASKS,
                        help="auto: from the model's metadata and output shape")
    create.add_argument("--labels", metavar="FILE",
                        help="class names: YAML list, YAML {id: name}, or one per line (default: the model's)")
    create.add_argument("--tiers", metavar="HxW[,HxW]",
                        help="input shapes to serve (default: the model's fixed input, or its imgsz metadata)")
    create.add_argument("--color", choices=COLOR_ORDERS, help="colour order the network was trained on")
    defaults = Preprocessing()
    create.add_argument("--mean", metavar="R,G,B", help="per-channel mean on 0..255 pixels (default %s)" % ",".join(
        "%g" % v for v in defaults.mean))
    create.add_argument("--std", metavar="R,G,B", help="per-channel std on 0..255 pixels (default %s)" % ",".join(
        "%g" % v for v in defaults.std))
    create.add_argument("--conf", type=float,
                        help="score threshold (default: Ultralytics' predictor's for its exports, else the manifest's)")
    create.add_argument("--iou", type=float, help="NMS IoU threshold (default: as --conf)")
    create.add_argument("--images", metavar="DIR",
                        help="images for the golden and calibration sets (default: generated scenes)")
    create.add_argument("--calibration", type=int, metavar="N", help="calibration images (default: as qat's)")
    create.add_argument("--golden", type=int, metavar="N", help="golden cases per tier (default: as qat's)")
    create.add_argument("--int8", action="store_true",
                        help="also an int8 ONNX for onnxruntime, calibrated on --images (every op but the decode); "
                             "refused when it keeps under 95%% of the float model's detections on held-out images "
                             "(kept: an int8 detection at the same conf, of the same class, overlapping it with IoU "
                             ">= 0.5), or the float model finds none there to check")
    create.add_argument("--force", action="store_true",
                        help="with --int8: write the int8 ONNX even when its check fails (too few detections "
                             "kept, or none on the held-out images to check)")
    create.set_defaults(bundle_handler=_create)


def _create(args: argparse.Namespace) -> int:
    try:
        from converters.byom.create import CreateError, CreateOptions, create_bundle
        from converters.byom.decide import parse_tiers
    except ImportError as exc:
        print("atlas-edge bundle create needs the host extra (%s): pip install 'atlas-edge[host]'" % exc,
              file=sys.stderr)
        return EXIT_USAGE
    try:
        options = CreateOptions(
            model=args.model, out=args.out, name=args.name, version=args.version, task=args.task,
            labels=args.labels, tiers=parse_tiers(args.tiers) if args.tiers else None, color=args.color,
            mean=_triple("--mean", args.mean), std=_triple("--std", args.std), conf=args.conf, iou=args.iou,
            images=args.images, calibration=args.calibration, golden=args.golden, int8=args.int8,
            force=args.force)
        if args.force and not args.int8:
            raise CreateError("--force only overrides --int8's check: give --int8 too")
        manifest = create_bundle(options)
    except CreateError as exc:
        print("bundle create refused: %s" % exc, file=sys.stderr)
        print("nothing was written to %s" % args.out, file=sys.stderr)
        return EXIT_REFUSED
    tiers = ", ".join("%dx%d" % tuple(t) for t in manifest["input"]["tiers"])
    print("created %s: %s %s (%s), %d label(s), tiers %s, %d golden case(s)\n  source: %s\n  images: %s" % (
        args.out, manifest["name"], manifest["version"], manifest["task"], len(manifest["labels"]), tiers,
        len(manifest["golden"]["cases"]), manifest["source"]["producer"], manifest["source"]["images"]))
    _print_int8_checks(args.out)
    return EXIT_OK


def _print_int8_checks(out: str) -> None:
    """--int8: each int8 artifact's check against the float model (int8_check.json, written by create)."""
    from converters.byom.create import INT8_CHECK_FILE
    from converters.byom.int8 import Int8Check

    path = os.path.join(out, INT8_CHECK_FILE)
    if not os.path.isfile(path):
        return
    with open(path) as handle:
        report = json.load(handle)
    for file, check in sorted(report["checks"].items()):
        summary = Int8Check(check["images"], check["float_detections"], check["kept"], check["int8_extra"],
                            check.get("agreement") or {}).summary()
        print("  int8: %s %s%s" % (file, summary, "; WRITTEN WITH --force ALTHOUGH BELOW THE THRESHOLD"
                                   if check["forced"] else ""))


def _triple(flag: str, text: Optional[str]) -> Optional[Tuple[float, float, float]]:
    if text is None:
        return None
    from converters.byom.model_file import CreateError

    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise CreateError("%s: %r is not three comma-separated numbers" % (flag, text)) from None
    if len(values) != 3:
        raise CreateError("%s: %r is not three comma-separated numbers" % (flag, text))
    return values  # type: ignore[return-value]


# --- verify -------------------------------------------------------------------------------------------

def _verify(args: argparse.Namespace) -> int:
    if args.run_golden and not args.device:
        print("--run-golden needs --device (the golden set runs with that device's backend)", file=sys.stderr)
        return EXIT_USAGE
    try:
        key = load_public_key(args.public_key) if args.public_key else None
    except (ValueError, OSError) as exc:
        print("--public-key: %s" % exc, file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_REFUSED
    with _opened(args.bundle) as root:
        if root is None:
            return EXIT_REFUSED
        try:
            bundle = verify_bundle(root, key)
            _print_bundle(bundle, args.bundle)
            if args.device:
                _check_device(bundle, args.device, args.backend, args.run_golden)
        except ConfigError as exc:  # BundleError included: every refused field, named
            print(exc, file=sys.stderr)
            return EXIT_REFUSED
    print("OK")
    return EXIT_OK


def _print_bundle(bundle: Bundle, shown: str) -> None:
    manifest = bundle.manifest
    print("%s: %s %s (%s), %d label(s)" % (shown, manifest.name, manifest.version, manifest.task,
                                           len(manifest.labels)))
    print("  manifest sha256  %s" % bundle.manifest_sha256)
    print("  signature        %s" % ("present" if bundle.signed else "none"))
    for art in manifest.artifacts:
        soc = " %s" % art.soc_version if art.soc_version else ""
        print("  artifact         %-32s %-6s %s%s tier %dx%d batch %d %s (%s)" % (
            art.file, art.format, art.target, soc, art.tier[0], art.tier[1], art.batch, art.precision,
            art.role))
    golden = manifest.golden
    cases = "%d case(s), atol %g rtol %g; int8: RMS <= %gx, max <= %gx the int8-vs-float error" % (
        len(golden.cases), golden.atol, golden.rtol, golden.quantized.rms_ratio,
        golden.quantized.max_ratio) if golden else "-"
    print("  golden set       %s" % cases)


def _check_device(bundle: Bundle, device_name: str, backend: Optional[str], run_golden: bool) -> None:
    from agent.config.device_config import load_device_config

    device = load_device_config(device_name)
    if not backend:
        from agent.pipeline.backends import backend_for

        backend = backend_for(device, bundle.manifest)
    chosen = select_artifacts(bundle, device, backend, batch=device.max_batch)
    for tier, art in sorted(chosen.items()):
        print("  %s/%s serves      tier %dx%d with %s" % (device.name, backend, tier[0], tier[1], art.file))
    if not run_golden:
        return
    from agent.pipeline.model import load_model  # imports the backend's runtime: only when asked

    model = load_model(bundle, device, backend, max_batch=device.max_batch)
    try:
        report = model.golden_check()
        print("  golden set       passed: %s" % report.summary())  # load_model raised if it failed
    finally:
        model.close()


class _opened:
    """A bundle directory as it is, or an archive unpacked (safely) into a temporary directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tmp: Optional[str] = None

    def __enter__(self) -> Optional[str]:
        if os.path.isdir(self.path):
            return self.path
        if not (os.path.isfile(self.path) and self.path.endswith(ARCHIVE_SUFFIXES)):
            print("%s: not a bundle directory or %s archive" % (self.path, "/".join(ARCHIVE_SUFFIXES)),
                  file=sys.stderr)
            return None
        self.tmp = tempfile.mkdtemp(prefix="atlas-edge-verify-")
        try:
            return unpack_archive(self.path, self.tmp)
        except BundleError as exc:
            print(exc, file=sys.stderr)
            return None

    def __exit__(self, *exc_info: Any) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


# --- sign and keygen ----------------------------------------------------------------------------------

def _sign(args: argparse.Namespace) -> int:
    try:
        with open(args.key, "rb") as handle:
            pem = handle.read()
    except OSError as exc:
        print("--key: %s" % exc, file=sys.stderr)
        return EXIT_USAGE
    try:
        # Never sign what a box would refuse anyway: a signature vouches for these exact, complete contents.
        verify_bundle(args.bundle)
        public_hex = sign_bundle(args.bundle, pem)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_REFUSED
    except (ValueError, TypeError) as exc:  # not a PEM key, or not an Ed25519 one
        print("--key %s: %s" % (args.key, exc), file=sys.stderr)
        return EXIT_REFUSED
    print("signed %s (manifest.sig); public key %s" % (args.bundle, public_hex))
    return EXIT_OK


def _keygen(args: argparse.Namespace) -> int:
    private_path, public_path = args.prefix + ".key", args.prefix + ".pub"
    existing = [p for p in (private_path, public_path) if os.path.exists(p)]
    if existing:
        print("refusing to overwrite %s" % ", ".join(existing), file=sys.stderr)
        return EXIT_USAGE
    try:
        private_pem, public_pem, public_hex = make_key_pair()
    except ConfigError as exc:  # cryptography missing: the message says which extra to install
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    for path, data, mode in ((private_path, private_pem, PRIVATE_KEY_MODE), (public_path, public_pem, 0o644)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
    print("private key %s (keep it on the workstation)\npublic key  %s\npublic hex  %s" % (
        private_path, public_path, public_hex))
    return EXIT_OK


def make_key_pair() -> Tuple[bytes, bytes, str]:
    """(private PEM, public PEM, public hex) of a fresh Ed25519 key."""
    from agent.bundle.signing import crypto

    ed25519, serialization = crypto()
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public = key.public_key()
    public_pem = public.public_bytes(serialization.Encoding.PEM,
                                     serialization.PublicFormat.SubjectPublicKeyInfo)
    public_hex = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    return private_pem, public_pem, public_hex

