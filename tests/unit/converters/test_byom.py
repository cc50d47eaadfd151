"""``atlas-edge bundle create`` (converters/byom/): models exported by real frameworks become bundles that serve what
those frameworks predict, and bad input is refused by name with nothing written.

The fixtures under tests/fixtures/byom/ were made by make_fixture.py (Ultralytics' own export and predictor for
the YOLOv8; torch.onnx for the YOLOv5-layout detector and the classifier). This test needs neither torch nor
Ultralytics: it compares the agent's serving path (bundle create -> verify -> LoadedModel.infer_frames) with the
predictions recorded there.
"""

import json
import os
import shutil
import subprocess
import sys

import cv2
import numpy as np
import pytest

pytest.importorskip("mindspore")
onnx = pytest.importorskip("onnx")

from agent.bundle.verify import verify_bundle  # noqa: E402
from agent.cli.main import main as cli_main  # noqa: E402
from agent.config.device_config import load_device_config  # noqa: E402
from agent.pipeline.model import load_model  # noqa: E402
from converters.byom.decide import read_labels_file  # noqa: E402
from converters.byom.model_file import CreateError  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "fixtures", "byom")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BOX_PX = 1.0  # boxes within 1 pixel of the peer's
SCORE_ATOL = 1e-3  # scores within 1e-3 of the peer's

with open(os.path.join(FIXTURES, "expected.json")) as _handle:
    EXPECTED = json.load(_handle)


def fixture(name):
    return os.path.join(FIXTURES, name)


def images():
    return [cv2.imread(fixture(r["image"])) for r in EXPECTED["yolov5"]["results"]]


def create(tmp_path, *args):
    """Run the CLI as a user would; returns (exit code, out dir)."""
    out = str(tmp_path / "bundle")
    return cli_main(["bundle", "create", "--out", out] + list(args)), out


def serve(out, backend="opencv"):
    bundle = verify_bundle(out)
    model = load_model(bundle, load_device_config("cpu-dev"), backend)  # load, warm-up, golden self-test
    return bundle, model


def match(got, expected):
    """Pair each expected detection with the agent's (same class, nearest box); returns worst box/score diffs."""
    exp_boxes = np.array(expected["boxes"], np.float64).reshape(-1, 4)
    assert len(got) == len(exp_boxes), "count: agent %d, peer %d" % (len(got), len(exp_boxes))
    unused = list(range(len(got)))
    worst_box = worst_score = 0.0
    for box, score, cls in zip(exp_boxes, expected["scores"], expected["classes"]):
        same_class = [i for i in unused if int(got[i, 5]) == cls]
        assert same_class, "class %d at %s: the agent has no detection of that class left" % (cls, box)
        best = min(same_class, key=lambda i: np.abs(got[i, :4] - box).max())
        unused.remove(best)
        worst_box = max(worst_box, float(np.abs(got[best, :4] - box).max()))
        worst_score = max(worst_score, abs(float(got[best, 4]) - score))
    assert worst_box <= BOX_PX, "box off by %.3f px" % worst_box
    assert worst_score <= SCORE_ATOL, "score off by %.2g" % worst_score
    return worst_box, worst_score


def check_detections(model, peer_by_tier, thresholds):
    model.set_thresholds(conf=thresholds["conf"], iou=thresholds["iou"], max_det=thresholds["max_det"])
    frames = images()
    results = model.infer_frames(frames)
    figures = []
    for index, result in enumerate(results):
        peer = peer_by_tier["%dx%d" % result.tier][index]
        figures.append((len(result.detections),) + match(result.detections, peer))
    assert sum(f[0] for f in figures) > 0, "the peer found nothing: the comparison would prove nothing"
    return figures


# --- the peer comparisons -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def yolov8_bundle(tmp_path_factory):
    code, out = create(tmp_path_factory.mktemp("v8"), "--model", fixture("yolov8t.onnx"))
    assert code == 0
    return out


def test_ultralytics_yolov8_serves_what_ultralytics_predicts(yolov8_bundle):
    bundle, model = serve(yolov8_bundle)
    try:
        manifest = bundle.manifest
        assert manifest.task == "detect-yolov8"  # from the export's own metadata and output shape
        assert manifest.labels == ["circle", "square", "triangle"]  # from metadata_props names, no --labels
        pools = [n for n in onnx.load(bundle.path("model_256x256.onnx")).graph.node if n.op_type == "MaxPool"]
        assert pools and not any(a.name == "dilations" for n in pools for a in n.attribute)  # converter_lite refuses
        assert not [n for n in onnx.load(bundle.path("model_256x256.onnx")).graph.node
                    if n.op_type == "Conv" and "dfl" in n.name]  # as a MatMul: converter_lite cannot infer it
        assert manifest.input.tiers == [(256, 256)]
        assert manifest.source.producer.startswith("Ultralytics")
        assert manifest.source.images.startswith("generated")
        assert (manifest.postprocessing.iou, manifest.postprocessing.max_det) == (0.7, 300)  # Ultralytics' own
        p = manifest.preprocessing
        assert (p.color, p.mean, p.std, p.letterbox.pad_value, p.letterbox.center) == (
            "rgb", (0.0, 0.0, 0.0), (255.0, 255.0, 255.0), 114, True)
        figures = check_detections(model, EXPECTED["yolov8"]["predictions"], EXPECTED["yolov8"]["predictor"])
        print("yolov8 opencv (count, max box px, max score):", figures)
    finally:
        model.close()


def test_task_comes_from_the_output_shape_when_the_model_has_no_metadata(tmp_path):
    """The Ultralytics graph without its metadata: (1, 7, 1344) at 256x256 is YOLOv8's layout (1344 anchors)."""
    model = onnx.load(fixture("yolov8t.onnx"))
    del model.metadata_props[:]
    onnx.save(model, str(tmp_path / "bare.onnx"))
    labels = tmp_path / "labels.txt"
    labels.write_text("circle\nsquare\ntriangle\n")
    code, out = create(tmp_path, "--model", str(tmp_path / "bare.onnx"), "--labels", str(labels))
    assert code == 0
    manifest = verify_bundle(out).manifest
    assert manifest.task == "detect-yolov8" and manifest.source.preprocessing.startswith("assumed")
    assert manifest.postprocessing.iou == 0.45  # the manifest default: nothing says it is an Ultralytics model


def test_ultralytics_dynamic_export_is_fixed_per_tier_and_matches_at_each(tmp_path):
    code, out = create(tmp_path, "--model", fixture("yolov8t-dynamic.onnx"), "--tiers", "256x256,192x320")
    assert code == 0
    bundle, model = serve(out)
    try:
        for art in bundle.manifest.artifacts:  # served: the uint8 frame (input folded in); the converters': NCHW
            shape = [d.dim_value for d in onnx.load(bundle.path(art.file)).graph.input[0].type.tensor_type.shape.dim]
            assert shape == ([1] + list(art.tier) + [3] if art.input_layout == "NHWC" else [1, 3] + list(art.tier))
        assert {(a.role, a.input_dtype, a.normalize_on) for a in bundle.manifest.artifacts} == {
            ("serve", "uint8", "model"), ("convert", "float32", "host")}
        figures = check_detections(model, EXPECTED["yolov8"]["predictions"], EXPECTED["yolov8"]["predictor"])
        assert {r.tier for r in model.infer_frames(images())} == {(256, 256), (192, 320)}
        print("yolov8 dynamic opencv (count, max box px, max score):", figures)
    finally:
        model.close()


DFL_OPENCV_ATOL = 1e-5  # the MatMul sums the same 16 products as the Conv; only float rounding may differ


def test_dfl_conv_becomes_a_matmul_that_computes_the_same_outputs():
    """MindSpore Lite 2.0.0's converter cannot infer the shape of Ultralytics' DFL Conv (a 1x1 Conv with weights
    arange(16) on a transposed softmax); the bundle computes it as a MatMul, and OpenCV gets the same outputs."""
    from converters.byom.onnx_graph import dfl_conv_as_matmul

    original = onnx.load(fixture("yolov8t.onnx"))
    rewritten = onnx.load(fixture("yolov8t.onnx"))
    assert dfl_conv_as_matmul(rewritten) == 1
    onnx.checker.check_model(rewritten)
    assert not [n for n in rewritten.graph.node if n.op_type == "Conv" and "dfl" in n.name]
    assert len(rewritten.graph.node) == len(original.graph.node) + 1  # Conv -> MatMul; its Transpose absorbed
    assert dfl_conv_as_matmul(rewritten) == 0  # nothing left to rewrite: the backbone's Convs are not DFLs
    nets = [cv2.dnn.readNetFromONNX(m.SerializeToString()) for m in (original, rewritten)]
    worst = 0.0
    for frame in images():
        blob = cv2.dnn.blobFromImage(frame, 1 / 255.0, (256, 256), swapRB=True)
        outputs = []
        for net in nets:
            net.setInput(blob)
            outputs.append(net.forward())
        assert outputs[0].shape == outputs[1].shape == (1, 7, 1344)
        worst = max(worst, float(np.abs(outputs[0] - outputs[1]).max()))
    assert worst <= DFL_OPENCV_ATOL, "rewritten DFL off by %.3g" % worst
    print("DFL as MatMul, max |opencv output diff|:", worst)


def test_dfl_conv_after_a_softmax_keeps_its_values_and_the_tensors_others_read():
    """Older Ultralytics heads softmax after the Transpose, so the Conv reads no Transpose to absorb; a Transpose
    another node also reads stays. Both graphs are evaluated by onnx's reference implementation."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from converters.byom.onnx_graph import dfl_conv_as_matmul

    bins = numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1), "bins")
    conv = {"kernel_shape": [1, 1], "strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1}
    graph = helper.make_graph([
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Softmax", ["t"], ["s"], axis=1),
        helper.make_node("Conv", ["s", "bins"], ["y"], name="after_softmax", **conv),
        helper.make_node("Transpose", ["x"], ["u"], perm=[0, 2, 1, 3]),
        helper.make_node("Conv", ["u", "bins"], ["z"], name="shared_transpose", **conv),
    ], "dfl", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 8])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in
         (("y", [1, 1, 4, 8]), ("z", [1, 1, 4, 8]), ("u", [1, 16, 4, 8]))], [bins])
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(original)
    assert dfl_conv_as_matmul(rewritten) == 2
    onnx.checker.check_model(rewritten)
    assert [n.op_type for n in rewritten.graph.node].count("Conv") == 0
    assert "bins" not in {t.name for t in rewritten.graph.initializer}  # the MatMuls have their own (16, 1)
    x = np.random.default_rng(0).normal(size=(1, 4, 16, 8)).astype(np.float32)
    expected = ReferenceEvaluator(original).run(None, {"x": x})
    got = ReferenceEvaluator(rewritten).run(None, {"x": x})
    for e, g in zip(expected, got):
        assert e.shape == g.shape
        np.testing.assert_allclose(g, e, rtol=0, atol=DFL_OPENCV_ATOL)


LITE_SERVE = """
import json, sys, cv2
from agent.config.device_config import load_device_config
from agent.bundle.verify import verify_bundle
from agent.pipeline.model import load_model
model = load_model(verify_bundle(sys.argv[1]), load_device_config("cpu-dev"), "mslite")
t = json.loads(sys.argv[2])
model.set_thresholds(conf=t["conf"], iou=t["iou"], max_det=t["max_det"])
results = model.infer_frames([cv2.imread(p) for p in sys.argv[3:]])
print(json.dumps([[list(r.tier), r.detections.tolist()] for r in results]))
"""


def convert_and_serve_on_mslite(source_bundle, tmp_path, thresholds, peers):
    """Convert a copy of the bundle with the real MindSpore Lite converter, serve it with the mslite backend in the
    Lite lane's interpreter (Python 3.7 + mindspore_lite 2.0.0), and match each frame against its peer result."""
    from tests.support import lite_support

    python = lite_support.lite_python()
    if python is None:
        pytest.skip(lite_support.NO_LITE_PYTHON)
    bundle = str(tmp_path / "bundle")
    shutil.copytree(source_bundle, bundle)
    done = subprocess.run([sys.executable, "-m", "converters.cli", "--bundle", bundle, "--device", "cpu-dev",
                           "--to", "ms"], cwd=ROOT, env=lite_support.lite_env(python), capture_output=True,
                          text=True, timeout=lite_support.CONVERT_TIMEOUT_S, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert any(a.format == "ms" for a in verify_bundle(bundle).manifest.artifacts)
    served = subprocess.run([python, "-c", LITE_SERVE, bundle, json.dumps(thresholds)]
                            + [fixture(p["image"]) for p in peers], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                            capture_output=True, text=True, timeout=600, check=False)
    assert served.returncode == 0, served.stderr[-3000:]
    figures = []
    for (tier, dets), peer in zip(json.loads(served.stdout.strip().splitlines()[-1]), peers):
        assert tier == [256, 256]
        figures.append((len(dets),) + match(np.array(dets, np.float32).reshape(-1, 6), peer))
    assert sum(f[0] for f in figures) > 0
    return figures


def test_ultralytics_yolov8_on_mslite(yolov8_bundle, tmp_path):
    figures = convert_and_serve_on_mslite(yolov8_bundle, tmp_path, EXPECTED["yolov8"]["predictor"],
                                          EXPECTED["yolov8"]["predictions"]["256x256"])
    print("yolov8 mslite (count, max box px, max score):", figures)


def test_yolov5_layout_on_mslite(tmp_path):
    v5 = EXPECTED["yolov5"]
    code, out = create(tmp_path, "--model", fixture(v5["model"]), "--labels", fixture(v5["labels"]))
    assert code == 0
    figures = convert_and_serve_on_mslite(out, tmp_path / "lite", v5, v5["results"])
    print("yolov5 mslite (count, max box px, max score):", figures)


def test_yolov5_layout_from_torch_is_detected_and_serves_like_torch(tmp_path):
    v5 = EXPECTED["yolov5"]
    code, out = create(tmp_path, "--model", fixture(v5["model"]), "--labels", fixture(v5["labels"]))
    assert code == 0
    bundle, model = serve(out)
    try:
        assert bundle.manifest.task == "detect-yolov5"  # (1, 4032, 9) at 256x256: 3 anchors per cell
        assert bundle.manifest.labels == ["red", "green", "blue", "grey"]  # one name per line
        assert bundle.manifest.source.preprocessing.startswith("assumed")  # torch names no exporter convention
        figures = check_detections(model, {"256x256": v5["results"]}, v5)
        print("yolov5 opencv (count, max box px, max score):", figures)
    finally:
        model.close()


def test_classifier_from_torch_serves_torch_probabilities(tmp_path):
    cls = EXPECTED["classify"]
    code, out = create(tmp_path, "--model", fixture(cls["model"]), "--labels", fixture(cls["labels"]),
                       "--tiers", "96x96", "--mean", ",".join(map(str, cls["mean"])),
                       "--std", ",".join(map(str, cls["std"])), "--images", fixture("images"))
    assert code == 0
    bundle, model = serve(out)
    try:
        manifest = bundle.manifest
        assert manifest.task == "classify"
        assert manifest.labels == ["alpha", "beta", "gamma", "delta", "epsilon"]  # YAML {id: name}
        assert manifest.preprocessing.mean == tuple(cls["mean"]) and "--mean" in manifest.source.preprocessing
        assert manifest.source.images.startswith("--images images: 3")
        model.set_thresholds(top_k=len(manifest.labels))
        worst = 0.0
        for result, peer in zip(model.infer_frames(images()), cls["results"]):
            got = dict(result.classes)
            assert max(got, key=got.get) == int(np.argmax(peer["probabilities"]))
            worst = max(worst, max(abs(got[i] - p) for i, p in enumerate(peer["probabilities"])))
        assert worst <= SCORE_ATOL
        print("classifier opencv max probability diff:", worst)
    finally:
        model.close()


def test_classifier_ending_in_softmax_reports_its_own_probabilities(tmp_path):
    """Ultralytics' classify exports end in a softmax; the agent applies one too. The artifact must give logits,
    else the box would report the softmax of probabilities (same order, flattened scores)."""
    cls = EXPECTED["classify"]
    model = onnx.load(fixture(cls["model"]))
    logits = model.graph.output[0].name
    model.graph.node.append(onnx.helper.make_node("Softmax", [logits], ["probabilities"], axis=1))
    model.graph.output[0].name = "probabilities"
    onnx.save(model, str(tmp_path / "softmax.onnx"))
    code, out = create(tmp_path, "--model", str(tmp_path / "softmax.onnx"), "--labels", fixture(cls["labels"]),
                       "--tiers", "96x96", "--mean", ",".join(map(str, cls["mean"])),
                       "--std", ",".join(map(str, cls["std"])))
    assert code == 0
    bundle, served = serve(out)
    try:
        assert [n.op_type for n in onnx.load(bundle.path("model_96x96.onnx")).graph.node][-1] != "Softmax"
        served.set_thresholds(top_k=5)
        for result, peer in zip(served.infer_frames(images()), cls["results"]):
            for class_id, probability in result.classes:
                assert abs(probability - peer["probabilities"][class_id]) <= SCORE_ATOL
    finally:
        served.close()


def test_mindspore_mindir_classifier_serves_its_network(tmp_path):
    """MindIR input: what MindSpore itself exports loads through mindspore.load + GraphCell on the box."""
    import mindspore as ms
    from mindspore import nn

    from agent.pipeline.input_batch import BatchPreprocessor
    from agent.pipeline.preprocess import PreprocessSpec

    class Tiny(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, stride=2)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Dense(4, 3)

        def construct(self, x):
            return self.fc(self.pool(self.conv(x)).reshape(x.shape[0], -1))

    ms.set_seed(3)
    network = Tiny()
    network.set_train(False)
    ms.export(network, ms.Tensor(np.zeros((1, 3, 64, 96), np.float32)), file_name=str(tmp_path / "tiny"),
              file_format="MINDIR")
    labels = tmp_path / "labels.yaml"
    labels.write_text("- cat\n- dog\n- bird\n")
    code, out = create(tmp_path, "--model", str(tmp_path / "tiny.mindir"), "--labels", str(labels))
    assert code == 0
    bundle, model = serve(out, backend="mindspore")
    try:
        assert bundle.manifest.input.tiers == [(64, 96)] and bundle.manifest.task == "classify"
        frames = images()
        results = model.infer_frames(frames)
        batcher = BatchPreprocessor(PreprocessSpec(), (64, 96), max_batch=1)
        for frame, result in zip(frames, results):
            batcher.fill(0, frame)
            logits = network(ms.Tensor(batcher.batch)).asnumpy()[0]
            probabilities = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            for class_id, probability in result.classes:
                assert abs(probability - probabilities[class_id]) < 1e-5
    finally:
        model.close()


def test_images_dir_feeds_golden_and_calibration(tmp_path):
    code, out = create(tmp_path, "--model", fixture("yolov8t.onnx"), "--images", fixture("images"),
                       "--calibration", "2", "--golden", "3")
    assert code == 0
    manifest = verify_bundle(out).manifest
    assert manifest.calibration.count == 2 and len(manifest.golden.cases) == 3
    assert "--images images: 3 image(s)" == manifest.source.images
    first = np.load(os.path.join(out, manifest.golden.cases[0].image))
    from agent.pipeline.preprocess import letterbox

    expected, _plan = letterbox(cv2.imread(fixture("images/scene0.png")), (256, 256))
    assert np.array_equal(first, expected)  # the agent's own letterbox of the first supplied image


def test_recreating_over_an_existing_bundle_replaces_it(tmp_path):
    assert create(tmp_path, "--model", fixture("yolov5t.onnx"), "--labels", fixture("yolov5t.labels.txt"))[0] == 0
    code, out = create(tmp_path, "--model", fixture("yolov8t.onnx"), "--name", "second")
    assert code == 0 and verify_bundle(out).manifest.name == "second"
    assert sorted(os.listdir(str(tmp_path))) == ["bundle"]  # no staging directory left behind


# --- refusals: named cause, nothing written -------------------------------------------------------------------

def two_input_model(path):
    helper = onnx.helper
    a = helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1, 3, 32, 32])
    b = helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1, 3, 32, 32])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, 32, 32])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "two", [a, b], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)]), path)


def image_out_model(path):
    """One input, but the output is an image (1, 3, 32, 32): neither a YOLO layout nor class scores."""
    helper = onnx.helper
    x = helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, [1, 3, 32, 32])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, 32, 32])
    graph = helper.make_graph([helper.make_node("Relu", ["images"], ["y"])], "img", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)]), path)


def reshaping_model(path, output_shape, outputs=1, input_shape=(1, 3, 32, 32)):
    """One input; ``outputs`` outputs, each the input reshaped to ``output_shape`` (nothing a YOLO head gives)."""
    helper = onnx.helper
    x = helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, list(input_shape))
    shape = onnx.numpy_helper.from_array(np.array(output_shape, np.int64), "shape")
    nodes, ys = [], []
    for i in range(outputs):
        nodes.append(helper.make_node("Reshape", ["images", "shape"], ["y%d" % i]))
        ys.append(helper.make_tensor_value_info("y%d" % i, onnx.TensorProto.FLOAT, list(output_shape)))
    graph = helper.make_graph(nodes, "reshape", [x], ys, initializer=[shape])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)]), path)


def refused(tmp_path, capsys, args, cause, out=None):
    out = out or str(tmp_path / "out" / "bundle")
    before = sorted(os.listdir(str(tmp_path)))
    code = cli_main(["bundle", "create", "--out", out] + args)
    err = capsys.readouterr().err
    assert code == 1, err
    assert cause in err, err
    assert sorted(os.listdir(str(tmp_path))) == before  # no --out, no parent, no staging directory
    return err


def test_refuses_a_file_that_is_not_a_model(tmp_path, capsys):
    fake = tmp_path / "model.onnx"
    fake.write_text("this is a text file\n" * 20)
    refused(tmp_path, capsys, ["--model", str(fake)], "not an ONNX model")


def test_refuses_a_model_with_two_inputs(tmp_path, capsys):
    two_input_model(str(tmp_path / "two.onnx"))
    refused(tmp_path, capsys, ["--model", str(tmp_path / "two.onnx")], "has 2 inputs (a, b)")


def test_refuses_an_output_layout_it_cannot_decode(tmp_path, capsys):
    image_out_model(str(tmp_path / "img.onnx"))
    err = refused(tmp_path, capsys, ["--model", str(tmp_path / "img.onnx"), "--labels", fixture("yolov5t.labels.txt")],
                  "cannot tell the task from the output shape (1, 3, 32, 32)")
    assert "--task" in err  # the flag that would settle it


def test_refuses_a_detection_layout_that_is_neither_yolov8_nor_yolov5(tmp_path, capsys):
    reshaping_model(str(tmp_path / "odd.onnx"), (1, 12, 256))  # 256 is no anchor count of a 32x32 input
    refused(tmp_path, capsys, ["--model", str(tmp_path / "odd.onnx"), "--labels", fixture("yolov5t.labels.txt")],
            "cannot tell the task from the output shape (1, 12, 256) at input 32x32")


def test_refuses_a_model_with_two_outputs(tmp_path, capsys):
    reshaping_model(str(tmp_path / "two.onnx"), (1, 3072), outputs=2)
    refused(tmp_path, capsys, ["--model", str(tmp_path / "two.onnx")], "has 2 outputs (y0, y1)")


def test_refuses_a_channels_last_input(tmp_path, capsys):
    reshaping_model(str(tmp_path / "nhwc.onnx"), (1, 3072), input_shape=(1, 32, 32, 3))
    refused(tmp_path, capsys, ["--model", str(tmp_path / "nhwc.onnx")], "an NHWC input: export it channels-first")


def test_refuses_an_ultralytics_end_to_end_export(tmp_path, capsys):
    model = onnx.load(fixture("yolov8t.onnx"))
    for prop in model.metadata_props:
        if prop.key == "end2end":
            prop.value = "True"
    onnx.save(model, str(tmp_path / "e2e.onnx"))
    refused(tmp_path, capsys, ["--model", str(tmp_path / "e2e.onnx")], "end-to-end (NMS-free) Ultralytics export")


def test_refuses_a_dynamic_mindir(tmp_path, capsys):
    import mindspore as ms
    from mindspore import nn

    network = nn.Conv2d(3, 4, 3)
    network.set_train(False)
    ms.export(network, ms.Tensor(shape=(None, 3, None, None), dtype=ms.float32), file_name=str(tmp_path / "dyn"),
              file_format="MINDIR")
    refused(tmp_path, capsys, ["--model", str(tmp_path / "dyn.mindir")], "MindIR shapes cannot be fixed here")


def test_refuses_a_task_the_output_does_not_fit(tmp_path, capsys):
    refused(tmp_path, capsys, ["--model", fixture("classifier.onnx"), "--tiers", "96x96", "--task", "detect-yolov8"],
            "--task detect-yolov8: the model's output (1, 5) does not fit (B, 4+nc, N)")


def test_refuses_labels_that_do_not_match_the_class_count(tmp_path, capsys):
    refused(tmp_path, capsys, ["--model", fixture("yolov5t.onnx"), "--labels", fixture("classifier.labels.yaml")],
            "5 names, but the model's output (1, 4032, 9) has 4 classes")


def test_refuses_a_tier_that_is_not_a_multiple_of_the_stride(tmp_path, capsys):
    refused(tmp_path, capsys, ["--model", fixture("yolov8t-dynamic.onnx"), "--tiers", "256x250"],
            "--tiers 256x250: not a multiple of the model stride 32")


def test_refuses_tiers_that_disagree_with_a_fixed_input(tmp_path, capsys):
    refused(tmp_path, capsys, ["--model", fixture("yolov8t.onnx"), "--tiers", "320x320"],
            "--tiers 320x320 does not match the model's fixed input 1x3x256x256")


def test_refuses_an_existing_directory_that_is_not_a_bundle(tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"precious")
    refused(tmp_path, capsys, ["--model", fixture("yolov8t.onnx")], "is not empty and is not a bundle", out=str(out))
    assert os.listdir(str(out)) == ["holiday.jpg"] and (out / "holiday.jpg").read_bytes() == b"precious"


def test_refuses_a_model_without_names_and_no_labels(tmp_path, capsys):
    refused(tmp_path, capsys, ["--model", fixture("yolov5t.onnx")], "carries no class names: give --labels FILE (4")


# --- labels files ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,text", [
    ("l.yaml", "- a\n- b\n- c\n"),
    ("l.yaml", "0: a\n1: b\n2: c\n"),
    ("data.yaml", "path: x\nnames:\n  0: a\n  1: b\n  2: c\n"),
    ("l.txt", "a\n\nb\nc\n"),
])
def test_labels_files(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert read_labels_file(str(path)) == ["a", "b", "c"]


def test_labels_file_with_a_gap_is_refused(tmp_path):
    path = tmp_path / "l.yaml"
    path.write_text("0: a\n2: c\n")
    with pytest.raises(CreateError, match="class ids must be 0..1 without gaps"):
        read_labels_file(str(path))

