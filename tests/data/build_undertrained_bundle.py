"""Rebuild ``tests/data/shapes-undertrained/``: the demo detector trained for 2 epochs instead of 18 (and 1 QAT epoch
instead of 2), a measurably worse model (float mAP@0.5 0.17 on the 300 held-out scenes where the demo's is 0.98)
with the same name, labels and input: the candidate a gated rollout must refuse (docs/shadow.md).

Needs MindSpore (a workstation, not a box): ``python tests/data/build_undertrained_bundle.py`` from the repository
root runs ``atlas-edge qat`` (several minutes) and keeps the float ONNX artifacts and their golden outputs only, so
that the committed copy stays small (2.3 MB); its golden outputs were computed by the tool from MindSpore's export.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)  # the repository root, for agent.*

from agent.bundle.verify import write_manifest  # noqa: E402

BUNDLE_DIR = os.path.join(HERE, "shapes-undertrained")
KEEP = ("model_256x256.onnx", "model_192x320.onnx")
VERSION = "0.2.0"


def prune(src: str, dst: str) -> None:
    """``src``'s manifest with the :data:`KEEP` artifacts, their golden outputs and nothing else, into ``dst``."""
    with open(os.path.join(src, "manifest.json"), encoding="utf-8") as handle:
        manifest = json.load(handle)
    os.makedirs(os.path.join(dst, "golden"))
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["file"] in KEEP]
    manifest["version"] = VERSION
    manifest.pop("calibration", None)
    for name in KEEP:
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    for case in manifest["golden"]["cases"]:
        case["expected"] = {f: path for f, path in case["expected"].items() if f in KEEP}
        for path in [case["image"]] + list(case["expected"].values()):
            shutil.copy(os.path.join(src, path), os.path.join(dst, path))
    write_manifest(dst, manifest)


def main() -> int:
    with tempfile.TemporaryDirectory() as work:
        built = os.path.join(work, "bundle")
        subprocess.run([sys.executable, "-m", "agent", "qat", "--config", "quant/examples/shapes.yaml", "--out",
                        built, "--epochs", "2", "--qat-epochs", "1"], cwd=ROOT, check=True)
        shutil.rmtree(BUNDLE_DIR, ignore_errors=True)
        prune(built, BUNDLE_DIR)
    print("wrote %s" % BUNDLE_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
