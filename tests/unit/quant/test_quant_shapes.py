"""The committed demo bundle (examples/demo-bundle, the shapes detector): contract, accuracy, golden set.

Reads what ``make demo-bundle`` (``atlas-edge qat --config quant/examples/shapes.yaml --out
examples/demo-bundle``) wrote; the full training run itself is the ``slow`` test at the end.
"""

import json
import os

import numpy as np
import pytest

from agent.bundle.verify import verify_bundle
from agent.pipeline.input_batch import BatchPreprocessor
from agent.pipeline.postprocess import decode_yolov8
from agent.pipeline.preprocess import scale_boxes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BUNDLE = os.path.join(REPO, "examples", "demo-bundle")
MIN_FLOAT_MAP50 = 0.90
MAX_QAT_DROP = 0.02  # mAP@0.5 points / 100
MAX_INT8_SIZE_RATIO = 0.30  # int8 ONNX bytes / float ONNX bytes
MAX_INT8_MAP_DROP = 0.002  # int8 ONNX on onnxruntime against the QAT report's mAP@0.5
MIN_INT8_AGREEMENT = 0.99  # best-anchor class agreement with the MindSpore int8 simulation


@pytest.fixture(scope="module")
def bundle():
    return verify_bundle(BUNDLE)


@pytest.fixture(scope="module")
def report():
    with open(os.path.join(BUNDLE, "report.json"), encoding="utf-8") as handle:
        return json.load(handle)


def spec_of(manifest):
    return manifest.preprocessing  # the manifest's type is the spec the letterbox takes


def run_artifact(bundle, artifact, image):
    """Preprocess a letterboxed golden image as the box does for this artifact, then run its runtime."""
    if artifact.input_dtype == "uint8":  # the int8 ONNX takes the letterboxed frame and normalises itself
        pytest.importorskip("onnxruntime")
        from converters.runtimes import run_on_host

        return run_on_host(bundle.path(artifact.file), "onnx", image[None], artifact.precision)
    batcher = BatchPreprocessor(
        spec_of(bundle.manifest),
        tuple(artifact.tier),
        artifact.batch,
        input_layout=artifact.input_layout,
        input_color=artifact.input_color,
    )
    batcher.fill_letterboxed(0, image)
    if artifact.format == "onnx":
        import cv2

        net = cv2.dnn.readNetFromONNX(bundle.path(artifact.file))
        net.setInput(batcher.batch)
        return net.forward()
    ms = pytest.importorskip("mindspore")
    graph = ms.nn.GraphCell(ms.load(bundle.path(artifact.file)))
    return graph(ms.Tensor(batcher.batch)).asnumpy()


def test_manifest_describes_a_yolov8_detector_with_two_tiers(bundle):
    manifest = bundle.manifest
    assert manifest.task == "detect-yolov8"
    assert manifest.labels == ["circle", "square", "triangle"]
    assert [tuple(t) for t in manifest.input.tiers] == [(256, 256), (192, 320)]
    kinds = {(a.format, tuple(a.tier), a.batch, a.precision, a.role) for a in manifest.artifacts}
    for tier in [(256, 256), (192, 320)]:
        assert ("onnx", tier, 1, "float32", "serve") in kinds
        assert ("mindir", tier, 1, "float32", "serve") in kinds
        assert ("mindir", tier, 1, "int8-sim", "serve") in kinds
        assert ("mindir", tier, 1, "int8", "convert") in kinds
    assert ("onnx", (256, 256), 4, "float32", "serve") in kinds
    assert manifest.calibration.layout == "NHWC" and manifest.calibration.dtype == "float32"


def test_accuracy_from_the_report(report):
    assert report["float"]["map50"] >= MIN_FLOAT_MAP50
    assert report["qat"]["map50"] >= report["float"]["map50"] - MAX_QAT_DROP
    assert report["float"]["images"] >= 300
    assert report["tiers"]["256x256"]["output0"] == [1, 7, 1280]
    assert report["tiers"]["192x320"]["output0"] == [1, 7, 1200]


def test_golden_set_reproduced_by_onnx_and_mindir(bundle):
    manifest = bundle.manifest
    runtimes = set()
    for case in manifest.golden.cases:
        image = np.load(bundle.path(case.image))
        assert image.dtype == np.uint8 and image.shape == tuple(case.tier) + (3,)
        for file, expected_file in case.expected.items():
            artifact = manifest.artifact(file)
            got = run_artifact(bundle, artifact, image)
            expected = np.load(bundle.path(expected_file))
            assert got.shape == expected.shape == (1, 7, 1280 if tuple(case.tier) == (256, 256) else 1200)
            np.testing.assert_allclose(got, expected, atol=manifest.golden.atol, rtol=manifest.golden.rtol)
            runtimes.add(artifact.format + ":" + artifact.precision)
    assert runtimes == {"onnx:float32", "mindir:float32", "mindir:int8-sim", "onnx:int8"}


def test_int8_onnx_meets_the_acceptance_thresholds(bundle, report):
    """The QAT scales as an int8 ONNX (docs/quant.md, "The int8 ONNX"): small, as accurate as QAT, and taking
    the same decisions as the MindSpore int8 simulation on the held-out split."""
    check = report["checks"]["int8_onnx_test_split"]
    assert check["file"] == "model_256x256.int8.onnx" and check["images"] == report["data"]["test_images"]
    for tier in ("256x256", "192x320"):
        entry = bundle.manifest.artifact("model_%s.int8.onnx" % tier)
        assert (entry.precision, entry.input_dtype, entry.input_layout, entry.normalize_on) == (
            "int8", "uint8", "NHWC", "model")
        size = os.path.getsize(bundle.path(entry.file))
        assert size <= MAX_INT8_SIZE_RATIO * os.path.getsize(bundle.path("model_%s.onnx" % tier))
    assert check["metrics"]["map50"] >= report["qat"]["map50"] - MAX_INT8_MAP_DROP
    assert check["best_anchor_class_agreement"] >= MIN_INT8_AGREEMENT
    assert report["checks"]["model_192x320.int8.onnx"]["best_anchor_class_agreement"] >= MIN_INT8_AGREEMENT


def test_onnx_finds_the_shapes_of_held_out_scenes_in_original_pixels(bundle):
    """The box's path end to end: frame -> letterbox -> ONNX (cv2.dnn) -> decode -> scale back -> truth."""
    import cv2

    from agent.devtools.scenes import generate_scene
    from quant.datasets import SHAPES_TEST_SEED_OFFSET, shapes_scene_hw
    from quant.evaluation import box_iou_matrix

    manifest = bundle.manifest
    artifact = next(
        a for a in manifest.artifacts if a.format == "onnx" and a.batch == 1 and tuple(a.tier) == (192, 320)
    )
    net = cv2.dnn.readNetFromONNX(bundle.path(artifact.file))
    batcher = BatchPreprocessor(spec_of(manifest), (192, 320), 1)
    rng = np.random.default_rng(1 + SHAPES_TEST_SEED_OFFSET + 1000)  # scenes the detector never saw
    found = total = 0
    for _ in range(8):
        frame, boxes, classes = generate_scene(rng, shapes_scene_hw(rng))
        plan = batcher.fill(0, frame)
        net.setInput(batcher.batch)
        detections = decode_yolov8(
            net.forward(),
            manifest.postprocessing.conf,
            manifest.postprocessing.iou,
            manifest.postprocessing.max_det,
        )[0]
        mapped = scale_boxes(detections[:, :4], plan)
        iou = box_iou_matrix(boxes, mapped)
        for i, cls in enumerate(classes):
            total += 1
            hits = (iou[i] >= 0.5) & (detections[:, 5].astype(int) == cls)
            found += bool(hits.any())
    assert found / total >= 0.85


def test_deploy_mindir_carries_fake_quant_params(bundle):
    pytest.importorskip("mindspore")
    from quant.export import read_fake_quant_params

    params = read_fake_quant_params(bundle.path("model_256x256.deploy.mindir"))
    weights = [p for p in params if p["is_per_channel"]]
    activations = [p for p in params if not p["is_per_channel"]]
    assert len(weights) == 11  # 9 conv-bn-relu blocks and 2 prediction convolutions
    assert activations and all(p["max"][0] > p["min"][0] for p in activations)
    assert all(p["symmetric"] and p["linear_quant_zero_point"] == [0.0] * len(p["min"]) for p in weights)
    assert not any(p["min"] == [-6.0] and p["max"] == [6.0] for p in activations)  # trained, not initial


@pytest.mark.slow
def test_full_shapes_run_meets_the_acceptance_thresholds(tmp_path):
    """What ``make demo-bundle`` does, into a temporary directory (about 15 minutes on 2 cores)."""
    pytest.importorskip("mindspore_gs")
    from quant.config import load_config
    from quant.pipeline import QatRun, RunOptions

    config = load_config(os.path.join(REPO, "quant", "examples", "shapes.yaml"))
    result = QatRun(
        config, RunOptions(out_dir=str(tmp_path / "bundle"), work_dir=str(tmp_path / "work"))
    ).run()
    assert result["float"]["map50"] >= MIN_FLOAT_MAP50
    assert result["qat"]["map50"] >= result["float"]["map50"] - MAX_QAT_DROP
    int8 = result["checks"]["int8_onnx_test_split"]
    assert int8["metrics"]["map50"] >= result["qat"]["map50"] - MAX_INT8_MAP_DROP
    assert int8["best_anchor_class_agreement"] >= MIN_INT8_AGREEMENT
    assert int8["bytes_ratio_to_float"] <= MAX_INT8_SIZE_RATIO
    verify_bundle(str(tmp_path / "bundle"))
