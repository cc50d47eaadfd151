"""The onnxruntime backend on real ONNX files, in both lanes (onnxruntime 1.14.1 on Python 3.7, the newest on
3.11): the demo detector against cv2.dnn, its session options, a uint8 NHWC-input model (normalisation folded
into the model, ``normalize_on: model``), refusals that name the file, and the demo bundle's golden self-test
and batching through :class:`agent.pipeline.model.LoadedModel`.
"""

import os

import numpy as np
import pytest

from agent.bundle.manifest import load_manifest
from agent.bundle.verify import verify_bundle
from agent.config.device_config import OnnxRuntimeSettings, load_device_config
from agent.pipeline.backends import BackendError, BackendOptions, TensorSpec, create_backend
from tests.conftest import REPO_ROOT

ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install 'atlas-edge[ort]')")

DEMO_BUNDLE = os.path.join(REPO_ROOT, "examples", "demo-bundle")
PARITY_ATOL = 1e-3  # onnxruntime vs cv2.dnn on the float demo detector; measured ~5e-5
DEMO_SPEC = TensorSpec("images", (1, 3, 256, 256), "float32")

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")


def demo_batch(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).rand(batch, 3, 256, 256).astype(np.float32)


@pytest.mark.parametrize("file,batch", [("model_256x256.onnx", 1), ("model_256x256_b4.onnx", 4)])
def test_onnxruntime_matches_opencv_on_the_demo_detector(file: str, batch: int) -> None:
    path = os.path.join(DEMO_BUNDLE, file)
    spec = TensorSpec("images", (batch, 3, 256, 256), "float32")
    x = demo_batch(batch)
    with create_backend("onnxruntime", path, spec) as ours, create_backend("opencv", path, spec) as reference:
        got, want = ours.infer(x), reference.infer(x)
    assert [o.shape for o in got] == [(batch, 7, 1280)]
    np.testing.assert_allclose(got[0], want[0], atol=PARITY_ATOL)


def session_of(backend):  # noqa: ANN001, ANN201 - reads the backend's private session to check its options
    return backend._session.get_session_options()


def test_session_options_default_to_the_device_config_and_follow_it() -> None:
    device = load_device_config("cpu-dev")
    path = os.path.join(DEMO_BUNDLE, "model_256x256.onnx")
    with create_backend("onnxruntime", path, DEMO_SPEC, BackendOptions.for_device(device)) as backend:
        opts = session_of(backend)
        assert opts.intra_op_num_threads == device.cpu_threads and opts.inter_op_num_threads == 1
        assert opts.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
        assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    changed = OnnxRuntimeSettings(inter_op_threads=2, execution_mode="parallel", graph_optimization="basic",
                                  allow_spinning=True)
    options = BackendOptions(cpu_threads=1, onnxruntime=changed)
    with create_backend("onnxruntime", path, DEMO_SPEC, options) as backend:
        opts = session_of(backend)
        assert (opts.intra_op_num_threads, opts.inter_op_num_threads) == (1, 2)
        assert opts.execution_mode == ort.ExecutionMode.ORT_PARALLEL
        assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "1"
        assert backend.infer(demo_batch(1))[0].shape == (1, 7, 1280)


def write_uint8_nhwc_model(path: str, hw: int = 8) -> None:
    """(1, hw, hw, 3) uint8 BGR -> per-channel RGB means in 0..1, (1, 3): cast, BGR->RGB, NHWC->NCHW and 1/255
    inside the graph, as a ``normalize_on: model`` artifact takes its input. Opset 11, IR 7: 1.14.1 reads it."""
    onnx = pytest.importorskip("onnx", reason="needs onnx to write the test model")
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Cast", ["images"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Gather", ["f", "rgb"], ["rgb_nhwc"], axis=3),  # BGR -> RGB
        helper.make_node("Transpose", ["rgb_nhwc"], ["nchw"], perm=[0, 3, 1, 2]),  # (1, h, w, 3) -> (1, 3, h, w)
        helper.make_node("Mul", ["nchw", "scale"], ["x"]),
        helper.make_node("ReduceMean", ["x"], ["means"], axes=[2, 3], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "uint8_nhwc",
        [helper.make_tensor_value_info("images", TensorProto.UINT8, [1, hw, hw, 3])],
        [helper.make_tensor_value_info("means", TensorProto.FLOAT, [1, 3])],
        initializer=[helper.make_tensor("rgb", TensorProto.INT64, [3], [2, 1, 0]),
                     helper.make_tensor("scale", TensorProto.FLOAT, [], [1.0 / 255])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    onnx.save(model, path)


def test_a_uint8_nhwc_model_takes_the_frame_as_it_is(tmp_path) -> None:
    path = str(tmp_path / "u8.onnx")
    write_uint8_nhwc_model(path)
    frame = np.random.RandomState(3).randint(0, 256, size=(1, 8, 8, 3)).astype(np.uint8)
    with create_backend("onnxruntime", path, TensorSpec("images", (1, 8, 8, 3), "uint8")) as backend:
        (means,) = backend.infer(frame)
    expected = frame[..., ::-1].astype(np.float64).mean(axis=(1, 2)) / 255  # RGB order
    np.testing.assert_allclose(means, expected, rtol=1e-5)


@pytest.mark.parametrize("spec,words", [
    (TensorSpec("images", (1, 8, 8, 3), "float32"), "input dtype mismatch for 'images': expected float32, got uint8"),
    (TensorSpec("images", (1, 3, 8, 8), "uint8"), "input shape mismatch for 'images': expected (1, 3, 8, 8), got"),
])
def test_a_spec_the_model_cannot_take_is_refused_at_load_naming_both(tmp_path, spec: TensorSpec,
                                                                      words: str) -> None:
    path = str(tmp_path / "u8.onnx")
    write_uint8_nhwc_model(path)
    backend = create_backend("onnxruntime", path, spec)
    with pytest.raises(BackendError) as err:
        backend.load()
    assert str(err.value).startswith(path) and words in str(err.value)
    assert not backend.loaded


def test_a_corrupt_file_is_refused_naming_it(tmp_path) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"not a protobuf at all")
    backend = create_backend("onnxruntime", str(path), DEMO_SPEC)
    with pytest.raises(BackendError, match="broken.onnx: onnxruntime could not load the model"):
        backend.load()


def test_an_input_named_otherwise_is_fed_by_position() -> None:
    path = os.path.join(DEMO_BUNDLE, "model_256x256.onnx")
    with create_backend("onnxruntime", path, TensorSpec("other", (1, 3, 256, 256), "float32")) as backend:
        assert backend.infer(demo_batch(1))[0].shape == (1, 7, 1280)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_demo_bundle_passes_its_golden_self_test_and_serves_batches_on_onnxruntime(max_batch: int) -> None:
    from agent.devtools.scenes import generate_scene
    from agent.pipeline.model import load_model

    bundle = verify_bundle(DEMO_BUNDLE)
    model = load_model(bundle, load_device_config("cpu-dev"), "onnxruntime", max_batch=max_batch)
    try:
        report = model.golden_check()
        assert report.passed and report.cases > 0, report.failures
        float_files = {a.file for a in load_manifest(DEMO_BUNDLE).artifacts if a.precision == "float32"}
        int8 = any(a.precision == "int8" and a.format == "onnx" and a.role == "serve"
                   for a in bundle.manifest.artifacts)
        described = model.describe()
        assert described["backend"] == "onnxruntime"
        assert described["precision"] == ("int8" if int8 else "float32")
        if not int8:
            assert set(described["artifacts"].values()) <= float_files
            if max_batch == 4:  # the batch-4 artifact serves its tier
                assert described["artifacts"]["256x256"] == "model_256x256_b4.onnx"
        rng = np.random.default_rng(5)
        scenes = [generate_scene(rng, (256, 256)) for _ in range(5)]
        results = model.infer_frames([image for image, _boxes, _labels in scenes])
        assert len(results) == 5
        found = sum(len(r.detections) for r in results)
        drawn = sum(len(boxes) for _image, boxes, _labels in scenes)
        assert drawn > 0 and found >= drawn // 2, "found %d detections for %d drawn objects" % (found, drawn)
    finally:
        model.close()


def fold_uint8_input(src: str, dst: str) -> None:
    """The demo detector taking the letterbox's uint8 BGR NHWC frame: Cast, BGR->RGB, NHWC->NCHW and x/255 put in
    front of its graph with onnx.helper (what ``normalize_on: model`` means; the project's exporters fold it more
    cleverly, this is the plain form)."""
    onnx = pytest.importorskip("onnx", reason="needs onnx to rewrite the test model")
    from onnx import TensorProto, helper

    model = onnx.load(src)
    graph = model.graph
    image = graph.input[0]
    n, c, h, w = [d.dim_value for d in image.type.tensor_type.shape.dim]
    for node in graph.node:
        node.input[:] = ["normalised" if name == image.name else name for name in node.input]
    prefix = [
        helper.make_node("Cast", [image.name], ["as_float"], to=TensorProto.FLOAT),
        helper.make_node("Gather", ["as_float", "bgr_to_rgb"], ["rgb"], axis=3),
        helper.make_node("Transpose", ["rgb"], ["nchw"], perm=[0, 3, 1, 2]),  # (n, h, w, 3) -> (n, 3, h, w)
        helper.make_node("Mul", ["nchw", "inv_255"], ["normalised"]),
    ]
    for node in reversed(prefix):
        graph.node.insert(0, node)
    graph.initializer.extend([helper.make_tensor("bgr_to_rgb", TensorProto.INT64, [3], [2, 1, 0]),
                              helper.make_tensor("inv_255", TensorProto.FLOAT, [], [1.0 / 255])])
    graph.input.remove(image)
    graph.input.insert(0, helper.make_tensor_value_info(image.name, TensorProto.UINT8, [n, h, w, c]))
    onnx.save(model, dst)


def test_a_normalize_on_model_bundle_serves_uint8_frames_with_the_float_models_results(tmp_path) -> None:
    """The box feeds a ``normalize_on: model`` artifact the letterboxed uint8 frame (no host normalisation): its
    golden self-test (expected outputs of the float model) passes and its detections are the float model's."""
    import json
    import shutil

    from agent.bundle.verify import write_manifest
    from agent.devtools.scenes import generate_scenes
    from agent.pipeline.model import load_model

    root = str(tmp_path / "bundle")
    shutil.copytree(DEMO_BUNDLE, root)
    with open(os.path.join(root, "manifest.json")) as handle:
        manifest = json.load(handle)
    folded = []
    for art in manifest["artifacts"]:
        if art["format"] == "onnx" and art["batch"] == 1 and art["precision"] == "float32":
            path = os.path.join(root, art["file"])
            fold_uint8_input(path, path)
            art.update(input_dtype="uint8", input_layout="NHWC", input_color="bgr", normalize_on="model")
            folded.append(art["file"])
    assert folded, "the demo bundle has float batch-1 ONNX artifacts"
    write_manifest(root, manifest)
    device = load_device_config("cpu-dev")
    frames = [image for image, _boxes, _labels in generate_scenes(9, 4, (480, 640))]
    float_model = load_model(verify_bundle(DEMO_BUNDLE), device, "onnxruntime", precision="float")
    uint8_model = load_model(verify_bundle(root), device, "onnxruntime", precision="float")
    try:
        assert {a.normalize_on for a in uint8_model.artifacts.values()} == {"model"}
        assert uint8_model.golden_check().passed
        for ours, reference in zip(uint8_model.infer_frames(frames), float_model.infer_frames(frames)):
            assert len(ours.detections) == len(reference.detections) > 0
            np.testing.assert_allclose(ours.detections, reference.detections, atol=0.05)  # px and scores
    finally:
        uint8_model.close()
        float_model.close()
