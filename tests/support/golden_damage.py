"""Genuinely wrong int8 models for the golden self-test (issue 38): a bundle's int8 ONNX with its activation
scales off or its int8 weights damaged, rehashed into a bundle of its own, and the check that the box refuses
every one of them while it accepts the intact bundle.

Host side (``make``, needs the ``onnx`` package) writes the bundles; box side (``check``, needs only the agent and
onnxruntime) judges them, so the same bundles can be judged inside an arm64 root under qemu-user:

    .venv/bin/python -m tests.support.golden_damage make examples/demo-bundle /tmp/damaged    # on the host
    python -m tests.support.golden_damage check /tmp/damaged                                 # on the box
    python -m tests.support.golden_damage check /tmp/damaged --graph-optimization disable    # other kernels

``check`` prints each bundle's golden report and exits 0 only if ``intact`` passes and every damaged one is
refused; ``--damaged-only`` leaves ``intact`` to a check made elsewhere (the aarch64 lane: the daemon that served
that bundle on the same CPU passed its golden self-test), ``--no-warm-up`` the warm-up calls (see golden_report).
``--graph-optimization disable`` runs onnxruntime's unfused QDQ path: on x86 that path's float sums differ from the
fused kernels' like Arm's do (the demo's int8 golden set: 0.47-1.06 px, the same as on Arm).
"""

import argparse
import json
import os
import shutil
import sys
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

INTACT = "intact"


def _arrays(model: Any) -> Tuple[Dict[str, Any], Callable[[Any], np.ndarray]]:
    from onnx import numpy_helper

    return {init.name: init for init in model.graph.initializer}, numpy_helper.to_array


def _set(init: Any, array: np.ndarray) -> None:
    from onnx import numpy_helper

    init.CopyFrom(numpy_helper.from_array(array, init.name))


def _activation_scales(model: Any) -> List[str]:
    """The scale initializer of every QuantizeLinear (shared with its DequantizeLinear), in graph order."""
    inits, _ = _arrays(model)
    return [node.input[1] for node in model.graph.node if node.op_type == "QuantizeLinear" and node.input[1] in inits]


def _int8_weights(model: Any) -> List[str]:
    """The int8 initializers a DequantizeLinear reads: the quantized weights."""
    inits, to_array = _arrays(model)
    return [node.input[0] for node in model.graph.node if node.op_type == "DequantizeLinear"
            and node.input[0] in inits and to_array(inits[node.input[0]]).dtype == np.int8]


def scales_x4(model: Any) -> None:
    """Every activation scale four times too large (a calibration that saw 4x the range)."""
    inits, to_array = _arrays(model)
    for name in _activation_scales(model):
        _set(inits[name], (to_array(inits[name]) * 4).astype(np.float32))


def last_scale_x4(model: Any) -> None:
    """One activation scale (the last one) four times too large."""
    inits, to_array = _arrays(model)
    name = _activation_scales(model)[-1]
    _set(inits[name], (to_array(inits[name]) * 4).astype(np.float32))


def weights_pm2(model: Any) -> None:
    """Every int8 weight moved by a random -2..2 steps (seeded): bit rot, a bad rounding mode."""
    inits, to_array = _arrays(model)
    rng = np.random.default_rng(38)
    for name in _int8_weights(model):
        weights = to_array(inits[name]).astype(np.int32)
        _set(inits[name], np.clip(weights + rng.integers(-2, 3, weights.shape), -127, 127).astype(np.int8))


def weights_flipped(model: Any) -> None:
    """1% of the int8 weights with their sign flipped (seeded)."""
    inits, to_array = _arrays(model)
    rng = np.random.default_rng(38)
    for name in _int8_weights(model):
        weights = to_array(inits[name])
        _set(inits[name], np.where(rng.random(weights.shape) < 0.01, -weights, weights).astype(np.int8))


DAMAGES: Dict[str, Callable[[Any], None]] = {
    "scales-x4": scales_x4, "last-scale-x4": last_scale_x4, "weights-pm2": weights_pm2,
    "weights-flipped": weights_flipped,
}


def damaged_bundle(src: str, dst: str, damage: Callable[[Any], None]) -> List[str]:
    """``src`` copied to ``dst`` with every int8 ONNX artifact damaged and the manifest rehashed; returns the
    files damaged."""
    import onnx

    from agent.bundle.verify import write_manifest

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "manifest.json"), encoding="utf-8") as handle:
        manifest = json.load(handle)
    damaged = []
    for art in manifest["artifacts"]:
        if art["format"] == "onnx" and art["precision"] == "int8":
            path = os.path.join(dst, art["file"])
            model = onnx.load(path)
            damage(model)
            onnx.save(model, path)
            damaged.append(art["file"])
    if os.path.exists(os.path.join(dst, "manifest.sig")):
        os.remove(os.path.join(dst, "manifest.sig"))  # the signature was of the intact manifest
    write_manifest(dst, manifest)
    return damaged


def make(src: str, out: str) -> List[str]:
    """``out/intact`` (a copy) and ``out/<damage>`` for every damage; returns their names."""
    os.makedirs(out, exist_ok=True)
    shutil.copytree(src, os.path.join(out, INTACT))
    for name, damage in DAMAGES.items():
        damaged_bundle(src, os.path.join(out, name), damage)
    return [INTACT] + list(DAMAGES)


def golden_report(root: str, precision: str = "int8", graph_optimization: str = "all",
                  warm_up: bool = True) -> Tuple[bool, str]:
    """Load ``root`` on onnxruntime as a box would (verify, load, warm-up, golden self-test): (passed, report).

    ``warm_up=False`` leaves out the warm-up's two calls per tier before the self-test: onnxruntime's kernels keep
    nothing from one call to the next, so the self-test's outputs are the same, and on an emulated Arm core the
    warm-up of the stand-in's 640x640 model costs twice its golden case (the aarch64 lane judges damaged copies
    so)."""
    import dataclasses

    from agent.bundle.manifest import BundleError
    from agent.bundle.verify import verify_bundle
    from agent.config.device_config import load_device_config
    from agent.pipeline.model import load_model

    device = load_device_config("cpu-dev")
    device = dataclasses.replace(device, onnxruntime=dataclasses.replace(
        device.onnxruntime, graph_optimization=graph_optimization))
    try:
        model = load_model(verify_bundle(root), device, "onnxruntime", precision=precision, warm_up=warm_up)
    except BundleError as exc:
        return False, str(exc)
    try:
        return True, model.golden_check().summary()
    finally:
        model.close()


def check(out: str, precision: str = "int8", graph_optimization: str = "all", intact: bool = True,
          warm_up: bool = True) -> bool:
    ok = True
    for name in [INTACT] * intact + sorted(n for n in os.listdir(out) if n != INTACT):
        passed, text = golden_report(os.path.join(out, name), precision, graph_optimization, warm_up)
        right = passed == (name == INTACT)
        ok = ok and right
        print("%-16s %-8s %s: %s" % (name, "passed" if passed else "refused", "ok" if right else "WRONG", text))
    return ok


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.golden_damage", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make", help="write OUT/intact and OUT/<damage> from the bundle SRC (host: needs onnx)")
    made.add_argument("src")
    made.add_argument("out")
    judged = sub.add_parser("check", help="run the golden self-test of every bundle under OUT on onnxruntime")
    judged.add_argument("out")
    judged.add_argument("--precision", default="int8", choices=("int8", "float", "auto"))
    judged.add_argument("--graph-optimization", default="all", choices=("disable", "basic", "extended", "all"))
    judged.add_argument("--damaged-only", action="store_true", help="leave out OUT/intact (passed elsewhere)")
    judged.add_argument("--no-warm-up", action="store_true", help="the golden self-test without the warm-up calls")
    args = parser.parse_args(argv)
    if args.command == "make":
        print("\n".join(make(args.src, args.out)))
        return 0
    return 0 if check(args.out, args.precision, args.graph_optimization, intact=not args.damaged_only,
                      warm_up=not args.no_warm_up) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
