"""A stand-in model bundle for when ``examples/demo-bundle`` is absent: a small detector exported here.

This is not the demo model. It is a few strided convolutions ending in the YOLOv8 output layout the demo
detector has (``(B, 4 + nc, N)``, boxes in input pixels, sigmoid scores), exported with ``mindspore.export``
to MindIR and ONNX at batch 1 and batch 8, with a golden set made by running the exported MindIR, so the
agent's loader, self-test and both CPU backends treat it like any bundle. Figures measured on it are labelled
with the bundle's name (``benchmark-standin-detector``) in the JSON, never passed off as the demo model's.

MindSpore parses ``construct`` from source, so the network lives in this file, not in a string.
"""

import datetime
import logging
import os
from typing import Any, Dict, List, Tuple

import numpy as np

log = logging.getLogger(__name__)

STANDIN_NAME = "benchmark-standin-detector"
STANDIN_TIER: Tuple[int, int] = (256, 256)  # the demo detector's square tier
STANDIN_LABELS = ("circle", "square", "triangle")
STANDIN_BATCHES = (1, 8)
STANDIN_WIDTH = 32  # channels of the first stage; doubled twice
GOLDEN_SEED = 3


def _network(num_classes: int, width: int) -> Any:
    """The stand-in detector as a MindSpore cell (MindSpore is imported here, on the host side only)."""
    import mindspore as ms
    from mindspore import nn, ops

    class StandinDetector(nn.Cell):
        """Four stride-2 conv stages (input / 16 grid), a 1x1 head, sigmoid boxes and scores."""

        def __init__(self) -> None:
            super().__init__()
            channels = [3, width, width * 2, width * 4, width * 4]
            layers = []
            for cin, cout in zip(channels[:-1], channels[1:]):
                layers += [nn.Conv2d(cin, cout, 3, 2, pad_mode="pad", padding=1, has_bias=True), nn.ReLU()]
            self.features = nn.SequentialCell(layers)
            self.head = nn.Conv2d(channels[-1], 4 + num_classes, 1, has_bias=True)
            self.sigmoid = ops.Sigmoid()
            self.concat = ops.Concat(axis=1)
            self.size = float(STANDIN_TIER[0])

        def construct(self, images: ms.Tensor) -> ms.Tensor:
            raw = self.head(self.features(images))  # (B, 4+nc, H/16, W/16)
            batch, channels, height, width_cells = raw.shape
            boxes = self.sigmoid(raw[:, :4]) * self.size
            scores = self.sigmoid(raw[:, 4:])
            return self.concat([boxes, scores]).reshape(batch, channels, height * width_cells)

    return StandinDetector()


def build_standin_bundle(root: str) -> str:
    """Export the stand-in detector into a new bundle directory ``root`` and return it."""
    import mindspore as ms

    from agent.bundle.verify import write_manifest
    from agent.devtools.scenes import generate_scene
    from agent.pipeline.input_batch import BatchPreprocessor
    from agent.pipeline.preprocess import PreprocessSpec, letterbox

    os.makedirs(os.path.join(root, "golden"), exist_ok=True)
    ms.set_seed(GOLDEN_SEED)
    net = _network(len(STANDIN_LABELS), STANDIN_WIDTH)
    net.set_train(False)
    height, width = STANDIN_TIER
    artifacts: List[Dict[str, Any]] = []
    for batch in STANDIN_BATCHES:
        dummy = ms.Tensor(np.zeros((batch, 3, height, width), np.float32))
        for fmt, suffix in (("mindir", "MINDIR"), ("onnx", "ONNX")):
            stem = "standin_%dx%d_b%d" % (height, width, batch)
            ms.export(net, dummy, file_name=os.path.join(root, stem), file_format=suffix)
            artifacts.append(
                {
                    "file": "%s.%s" % (stem, fmt),
                    "format": fmt,
                    "target": "cpu",
                    "tier": [height, width],
                    "batch": batch,
                    "sha256": "",
                    "size": 0,
                }
            )

    scene, _boxes, _classes = generate_scene(np.random.default_rng(GOLDEN_SEED), (480, 640))
    golden_image, _plan = letterbox(scene, STANDIN_TIER)
    np.save(os.path.join(root, "golden", "case0.npy"), golden_image)
    filler = BatchPreprocessor(PreprocessSpec(), STANDIN_TIER, 1)
    filler.fill_letterboxed(0, golden_image)
    expected = net(ms.Tensor(filler.batch)).asnumpy()
    expected_files = {}
    for art in artifacts:
        if art["batch"] == 1:
            name = "golden/case0.%s.npy" % art["file"]
            np.save(os.path.join(root, name), expected)
            expected_files[art["file"]] = name
    manifest = {
        "schema": 1,
        "name": STANDIN_NAME,
        "version": "0.0.1",
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "task": "detect-yolov8",
        "labels": list(STANDIN_LABELS),
        "input": {"name": "images", "tiers": [[height, width]]},
        "postprocessing": {"conf": 0.25, "iou": 0.45, "top_k": 5, "max_det": 100},
        "artifacts": artifacts,
        "toolchain": {"mindspore": ms.__version__},
        "golden": {
            "atol": 1e-3,
            "rtol": 1e-3,
            "cases": [{"image": "golden/case0.npy", "tier": [height, width], "expected": expected_files}],
        },
    }
    write_manifest(root, manifest)
    log.info("stand-in bundle %s written to %s", STANDIN_NAME, root)
    return root
