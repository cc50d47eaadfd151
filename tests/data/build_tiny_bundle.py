"""Rebuild ``tests/data/tiny-classify/``: the tiny classify bundle the model-manager tests serve.

Needs MindSpore (a workstation, not a box). The bundle is committed so that the tests run on a box-only
install (numpy, OpenCV, paho-mqtt, PyYAML): OpenCV serves its ONNX artifact, MindSpore (when present) its
MindIR, and the golden outputs were computed by MindSpore, an implementation independent of the box's
preprocessing and of OpenCV. Run: ``python tests/data/build_tiny_bundle.py`` from the repository root.
"""

import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for agent.*

from agent.bundle.verify import write_manifest  # noqa: E402

BUNDLE_DIR = os.path.join(HERE, "tiny-classify")
TIER = 32


def build(root: str) -> None:
    """A classify bundle: conv -> pool -> dense exported by MindSpore to ONNX and MindIR, one golden case."""
    import mindspore as ms
    from mindspore import nn

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(7)

    class Tiny(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, stride=2, has_bias=True, weight_init="normal")
            self.relu = nn.ReLU()
            self.pool = nn.AvgPool2d(15, 15)  # 15x15 feature map -> 1x1 (AdaptiveAvgPool has no ONNX export)
            self.flat = nn.Flatten()
            self.fc = nn.Dense(4, 3)

        def construct(self, x):
            return self.fc(self.flat(self.pool(self.relu(self.conv(x)))))

    net = Tiny()
    net.set_train(False)
    os.makedirs(os.path.join(root, "golden"))
    dummy = ms.Tensor(np.zeros((1, 3, TIER, TIER), np.float32))
    stem = os.path.join(root, "model_%dx%d" % (TIER, TIER))
    ms.export(net, dummy, file_name=stem, file_format="ONNX")
    ms.export(net, dummy, file_name=stem, file_format="MINDIR")
    image = np.random.default_rng(3).integers(0, 256, size=(TIER, TIER, 3), dtype=np.uint8)
    # The reference preprocessing written out independently of agent.pipeline.preprocess: BGR->RGB, /255, HWC->CHW.
    x = (image[:, :, ::-1].astype(np.float32) / 255.0).transpose(2, 0, 1)[None]
    expected = net(ms.Tensor(x)).asnumpy()
    np.save(os.path.join(root, "golden", "case0.npy"), image)
    files = ("model_32x32.onnx", "model_32x32.mindir")
    for name in files:
        np.save(os.path.join(root, "golden", "case0.%s.npy" % name), expected)
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            os.chmod(os.path.join(dirpath, name), 0o644)  # MindSpore writes its exports read-only
    arts = [{"file": f, "format": f.rsplit(".", 1)[1], "target": "cpu", "tier": [TIER, TIER], "sha256": "",
             "size": 0} for f in files]
    write_manifest(root, {
        "name": "tiny", "version": "1.0.0", "created": "2026-01-01T00:00:00Z", "task": "classify",
        "labels": ["a", "b", "c"], "input": {"name": "x", "tiers": [[TIER, TIER]]}, "artifacts": arts,
        "golden": {"atol": 1e-4, "rtol": 1e-4, "cases": [
            {"image": "golden/case0.npy", "tier": [TIER, TIER],
             "expected": {f: "golden/case0.%s.npy" % f for f in files}}]},
    })


if __name__ == "__main__":
    shutil.rmtree(BUNDLE_DIR, ignore_errors=True)
    build(BUNDLE_DIR)
    print("wrote", BUNDLE_DIR)
