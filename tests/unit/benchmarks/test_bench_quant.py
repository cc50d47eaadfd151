"""The ``quant`` bench section's pieces (benchmarks/quant.py, quant_models.py, yolov8_standin.py): the YOLOv8n-shaped
stand-in is YOLOv8n's graph, runs alike on onnxruntime and cv2.dnn and computes what the trained fixture it widens
computes, the headline takes the int8 lane it says, and a quick run leaves the section out unless asked. The
section itself is timed by ``atlas-edge bench``, never here (tests assert no times)."""

import json

import numpy as np
import pytest

pytest.importorskip("mindspore")  # before onnx (converters/byom/model_file.py)
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from benchmarks import quant  # noqa: E402
from benchmarks.cli import REQUIRED_KEYS, SECTIONS, selected_sections  # noqa: E402
from benchmarks.yolov8_standin import IMGSZ, NUM_CLASSES, build_yolov8n  # noqa: E402
from converters.byom.int8 import decode_nodes  # noqa: E402
from converters.byom.onnx_graph import dfl_conv_as_matmul  # noqa: E402

YOLOV8N_PARAMETERS = 3_151_904  # Ultralytics' yolov8n.pt with BatchNorm folded into its convolutions (fused)


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build_yolov8n(str(tmp_path_factory.mktemp("v8n") / "yolov8n.onnx"))


def test_standin_is_yolov8n_shaped(standin):
    model = onnx.load(standin)
    parameters = sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.name.endswith((".weight", ".bias")))
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 64  # yolov8n's 63 convolutions and the DFL's
    assert abs(parameters - YOLOV8N_PARAMETERS) / YOLOV8N_PARAMETERS < 0.02, parameters
    assert dfl_conv_as_matmul(model) == 1  # as bundle create does first: the decode then holds no Conv
    decode = decode_nodes(model)
    ops = {n.op_type for n in decode}
    assert {"Softmax", "Sigmoid", "Sub", "Div"} <= ops and all(n.name.startswith("/model.22/") for n in decode)


def test_standin_runs_alike_on_onnxruntime_and_opencv(standin):
    """An opset-12 Softmax flattens from its axis on: the DFL's softmax must be over the last axis (as torch
    exports it), or onnxruntime and cv2.dnn disagree by hundreds of pixels on every box."""
    import cv2

    x = np.random.default_rng(0).random((1, 3, IMGSZ, IMGSZ), dtype=np.float32)
    session = ort.InferenceSession(standin, providers=["CPUExecutionProvider"])
    a = session.run(None, {"images": x})[0]
    net = cv2.dnn.readNetFromONNX(standin)
    net.setInput(x)
    b = net.forward()
    assert a.shape == b.shape == (1, 4 + NUM_CLASSES, 8400)
    np.testing.assert_allclose(a, b, atol=1e-2)
    assert a[0, 2:4].min() > 0 and -IMGSZ < a[0, :2].min() and a[0, :2].max() < 2 * IMGSZ


def test_standin_computes_what_the_trained_fixture_computes(tmp_path):
    """Widening by channel copies preserves the function: at the fixture's 256x256 the stand-in's boxes and its
    first 3 class scores are the trained YOLOv8's, its other 77 classes never score, and on a scene it finds the
    fixture's detections (real ones, not noise at the threshold)."""
    from agent.devtools.scenes import generate_scenes
    from agent.pipeline.agreement import match_detections
    from agent.pipeline.postprocess import decode
    from agent.pipeline.preprocess import PreprocessSpec
    from benchmarks.yolov8_standin import TRAINED
    from converters.byom.int8 import host_inputs

    wide = build_yolov8n(str(tmp_path / "wide.onnx"), imgsz=256)
    images = [image for image, _boxes, _classes in generate_scenes(3, 2, (256, 256))]
    x = host_inputs(images, PreprocessSpec(mean=(0.0, 0.0, 0.0), std=(255.0, 255.0, 255.0)), (256, 256), False)
    post = {"conf": 0.25, "iou": 0.7, "max_det": 300}
    for xi in x:
        a = ort.InferenceSession(wide, providers=["CPUExecutionProvider"]).run(None, {"images": xi[None]})[0]
        b = ort.InferenceSession(TRAINED, providers=["CPUExecutionProvider"]).run(None, {"images": xi[None]})[0]
        assert a.shape == (1, 4 + NUM_CLASSES, 1344) and b.shape == (1, 4 + 3, 1344)
        np.testing.assert_allclose(a[:, :7], b, atol=2e-3)
        assert a[:, 7:].max() < 1e-6
        want, got = decode("detect-yolov8", b, post)[0], decode("detect-yolov8", a, post)[0]
        assert len(want) >= 1 and len(match_detections(want, got)) == len(want) == len(got)


def _demo(lanes):
    return {"frame_hw": [1080, 1920], "frame_hw_filled": [1080, 1080],
            "lanes": {name: {"bytes": size, "map50": 0.9, "threads": {"1": {"infer_ratio_to_float": 0.6,
                                                                            "frame_ratio_to_float": 0.65}},
                             quant.FILLED_KEY: {"frame_ratio_to_float": 0.68}}
                      for name, size in lanes.items()}}


def test_headline_takes_the_qat_lane_when_there_is_one(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"qat": {"map50": 0.98}}))
    with_qat = quant.headline(_demo({"ort_float": 1000, "ort_int8_qat": 250, "ort_int8_ptq": 260}), str(tmp_path))
    assert with_qat["int8_lane"] == "ort_int8_qat" and with_qat["size_ratio"] == 0.25
    assert with_qat["map_qat_report"] == 0.98 and with_qat["infer_ratio_to_float"] == 0.6
    # the 1080p frames' ratio has the target; the filled frames' one is reported beside it
    assert with_qat["frame_ratio_to_float"] == 0.65 and with_qat["frame_hw"] == [1080, 1920]
    assert with_qat["frame_ratio_to_float_filled"] == 0.68 and with_qat["frame_hw_filled"] == [1080, 1080]
    assert "frame_ratio_to_float_filled" not in quant.targets(with_qat)
    without = quant.headline(_demo({"ort_float": 1000, "ort_int8_ptq": 260}), str(tmp_path / "none"))
    assert without["int8_lane"] == "ort_int8_ptq" and without["size_ratio"] == 0.26
    assert without["map_qat_report"] is None
    judged = quant.targets(dict(with_qat, standin_infer_ratio_to_float=0.6))
    assert judged["size_ratio"]["met"] and judged["infer_ratio_to_float"]["met"]
    assert not judged["standin_infer_ratio_to_float"]["met"] and not judged["frame_ratio_to_lite"]["met"]


def test_quick_runs_leave_the_quant_section_out_unless_named():
    assert "quant" in SECTIONS and "quant" in selected_sections([], quick=False)
    assert "quant" not in selected_sections([], quick=True)
    assert selected_sections(["quant"], quick=True) == ["quant"]
    assert {"quant.size_ratio", "quant.infer_ratio_to_float", "quant.map_int8"} <= set(REQUIRED_KEYS)
