"""QAT -> int8 ONNX with the QAT scales (quant/int8_onnx.py, quant/int8_artifact.py).

The guards are checked on the numbers (negative batch-norm scale, int32 bias overflow, clipped weights) and on a
small hand-built graph (a non-zero activation zero point keeps its Relu); a reduced shapes run (1 float epoch,
1 QAT epoch, small scenes) checks the artifact end to end: manifest entry, read-back against the MindSpore int8
simulation, size, and loading on onnxruntime. The demo bundle's own figures are checked in test_quant_shapes.
"""

import dataclasses
import json
import os

import numpy as np
import pytest

try:  # first: MindSpore fixes protobuf's implementation before onnx may (as in test_onnx_input)
    import mindspore  # noqa: F401
except ImportError:  # the graph tests need only onnx and onnxruntime
    pass
onnx = pytest.importorskip("onnx")

from quant.int8_onnx import (  # noqa: E402
    ActivationQuant,
    ConvQuant,
    Int8ExportError,
    Int8Stats,
    QatTensors,
    build_int8_model,
    check_activation,
    fold_batch_norm,
    quantize_bias,
    quantize_weight,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MAX_SIZE_RATIO = 0.30  # int8 ONNX bytes / float ONNX bytes
MIN_BEST_CLASS_AGREEMENT = 0.99


def bn_stats(gamma, channels=2):
    return {
        "gamma": np.array(gamma, np.float32),
        "beta": np.full(channels, 0.5, np.float32),
        "moving_mean": np.full(channels, 1.0, np.float32),
        "moving_variance": np.full(channels, 1.0 - 1e-5, np.float32),  # + eps = 1: k = gamma
    }


def test_weights_are_rounded_as_the_simulation_and_the_top_of_the_range_counted():
    weight = np.array([[-1.0, 1.0, 0.26], [0.5, -0.25, 0.0]], np.float32).reshape(2, 3, 1, 1)
    scale = np.array([1.0 / 128, 0.5 / 128], np.float32)  # powers of two: exact quotients
    stats = Int8Stats()
    q = quantize_weight(weight, ConvQuant(ActivationQuant(0.1, 0), scale), stats)
    assert q[:, :, 0, 0].tolist() == [[-128, 127, 33], [127, -64, 0]]
    assert stats.weights_clipped_in_qat == 2  # +1.0 and +0.5 lie beyond 127 s: QAT clips them as well


def test_negative_k_flips_the_int8_values_and_clips_plus_128():
    q = np.array([[-128, 5], [-128, 7]], np.int32).reshape(2, 2, 1, 1)
    stats = Int8Stats()
    values, scale, bias = fold_batch_norm(q, np.array([0.1, 0.2], np.float32), bn_stats([-2.0, 3.0]), 1e-5, stats)
    assert values.dtype == np.int8
    assert values[:, :, 0, 0].tolist() == [[127, -5], [-128, 7]]  # channel 0: sign of k folded in, +128 clipped
    np.testing.assert_allclose(scale, [0.2, 0.6], rtol=1e-6)  # s_w |k|
    np.testing.assert_allclose(bias, [0.5 + 2.0, 0.5 - 3.0], rtol=1e-6)  # beta - k mean
    assert stats.negative_k_channels == 1 and stats.clipped_weights == 1


def test_zero_batch_norm_scale_is_refused():
    q = np.ones((2, 1, 1, 1), np.int32)
    with pytest.raises(Int8ExportError, match="batch norm scale is 0"):
        fold_batch_norm(q, np.ones(2, np.float32), bn_stats([0.0, 1.0]), 1e-5, Int8Stats(), layer="block")


def test_bias_is_int32_at_input_times_weight_scale_and_overflow_names_the_layer():
    got = quantize_bias(np.array([1.0, -0.5]), 0.5, np.array([0.01, 0.1], np.float32), "block")
    assert got.dtype == np.int32 and got.tolist() == [200, -10]
    with pytest.raises(Int8ExportError, match=r"block: bias .* overflows int32 in channel 1"):
        quantize_bias(np.array([1.0, 1e6]), 1e-4, np.array([0.1, 1e-6], np.float32), "block")


def test_activation_quantizers_must_be_uint8():
    check_activation(ActivationQuant(0.02, 7), "block")  # a non-zero zero point is fine (the Relu stays)
    with pytest.raises(Int8ExportError, match="block: input zero point 300 is outside uint8"):
        check_activation(ActivationQuant(0.02, 300), "block")
    with pytest.raises(Int8ExportError, match="not a positive number"):
        check_activation(ActivationQuant(0.0, 0), "block")


def test_two_objects_scored_alike_are_a_tie_and_not_a_disagreement():
    from quant.int8_artifact import BEST_SCORE_TIE, compare_outputs

    sim = np.zeros((2, 4 + 3, 8), np.float32)
    sim[0, 4 + 0, 1], sim[0, 4 + 2, 5] = 0.99970, 0.99969  # two objects: class 0 best by 1e-5 (a full run's case)
    sim[1, 4 + 0, 2], sim[1, 4 + 1, 6] = 0.9, 0.5
    int8 = sim.copy()
    int8[0, 4 + 2, 5] = 0.99971  # rounding orders the two the other way
    check = compare_outputs(int8, sim, "detect-yolov8", 0.25)
    assert check["best_anchor_class_agreement"] == 0.5 and check["best_anchor_ties"] == 1
    int8[1, 4 + 1, 6] = 0.95  # a class the simulation scores 0.4 below its best: a different decision
    with pytest.raises(Int8ExportError, match=r"on 50\.0 %% of 2 images .*ties within %g" % BEST_SCORE_TIE):
        compare_outputs(int8, sim, "detect-yolov8", 0.25)


# --- a hand-built graph: conv-bn-relu -> conv (prediction) --------------------------------------------------


def tiny_float_model():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    params = {
        "c1.weight": rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
        "bn.gamma": np.array([1.0, -0.5, 2.0, 0.8], np.float32),
        "bn.beta": np.array([0.1, 0.2, -0.1, 0.0], np.float32),
        "bn.moving_mean": np.array([0.0, 0.1, -0.2, 0.3], np.float32),
        "bn.moving_variance": np.array([1.0, 0.5, 2.0, 1.5], np.float32),
        "c2.weight": rng.normal(0, 0.3, (5, 4, 1, 1)).astype(np.float32),
        "c2.bias": np.zeros(5, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["images", "c1.weight"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["a", "bn.gamma", "bn.beta", "bn.moving_mean",
                                                "bn.moving_variance"], ["b"], epsilon=1e-5),
        helper.make_node("Relu", ["b"], ["c"]),
        helper.make_node("Conv", ["c", "c2.weight", "c2.bias"], ["output0"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 5, 8, 8])],
        [numpy_helper.from_array(v, k) for k, v in params.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]), params


def tiny_qat(params, second_zero_point):
    def weight_scale(w):
        return (2 * np.abs(w).reshape(len(w), -1).max(1) / 255).astype(np.float32)

    convs = {
        "c1.weight": ConvQuant(ActivationQuant(1 / 255, 0), weight_scale(params["c1.weight"])),
        "c2.weight": ConvQuant(ActivationQuant(0.02, second_zero_point), weight_scale(params["c2.weight"])),
    }
    return QatTensors(dict(params), convs)


def simulate(params, qat, x):
    """The QAT simulation in numpy: fake-quantized input and weights, float batch norm, ReLU, float head."""
    def fake(v, quant):
        return (np.clip(np.round(v / quant.scale) + quant.zero_point, 0, 255) - quant.zero_point) * quant.scale

    def fake_w(name):
        quant = qat.convs[name]
        s = quant.weight_scale.reshape(-1, 1, 1, 1)
        return (np.clip(np.round(params[name] / s), -128, 127) * s).astype(np.float32)

    xq = np.pad(fake(x[0], qat.convs["c1.weight"].input), ((0, 0), (1, 1), (1, 1)))  # (3, 10, 10)
    w = fake_w("c1.weight")
    y = sum(np.einsum("oc,chw->ohw", w[:, :, i, j], xq[:, i : i + 8, j : j + 8]) for i in range(3) for j in range(3))
    k = params["bn.gamma"] / np.sqrt(params["bn.moving_variance"] + 1e-5)
    y = k[:, None, None] * (y - params["bn.moving_mean"][:, None, None]) + params["bn.beta"][:, None, None]
    y = fake(np.maximum(y, 0), qat.convs["c2.weight"].input)
    return np.einsum("oc,chw->ohw", fake_w("c2.weight")[:, :, 0, 0], y)[None]


@pytest.mark.parametrize("zero_point", [0, 3])
def test_tiny_graph_matches_the_simulation_and_keeps_relu_for_a_nonzero_zero_point(zero_point):
    ort = pytest.importorskip("onnxruntime")
    float_model, params = tiny_float_model()
    qat = tiny_qat(params, zero_point)
    model, stats = build_int8_model(float_model, qat)
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ("Relu" in ops) == (zero_point != 0)  # Q(relu(x)) = Q(x) only when uint8 zero point 0 clips at 0
    assert "BatchNormalization" not in ops and ops.count("QuantizeLinear") == 2
    assert model.ir_version <= 8 and [(o.domain, o.version) for o in model.opset_import] == [("", 13)]
    assert stats.quantized_convs == 1 and stats.float_convs == 1 and stats.negative_k_channels == 1
    assert stats.relu_dropped == (1 if zero_point == 0 else 0)
    x = np.random.default_rng(1).uniform(0, 1, (1, 3, 8, 8)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": x})[0]
    expected = simulate(params, qat, x)
    np.testing.assert_allclose(got, expected, atol=1e-4)  # folded int8 arithmetic = the simulation's float


def test_quantizers_that_match_no_conv_are_an_error():
    float_model, params = tiny_float_model()
    qat = tiny_qat(params, 0)
    qat.convs["missing.weight"] = qat.convs["c1.weight"]
    with pytest.raises(Int8ExportError, match="missing.weight match no Conv"):
        build_int8_model(float_model, qat)


# --- a reduced qat run --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("mindspore_gs")
    pytest.importorskip("onnxruntime")
    from quant.config import load_config
    from quant.pipeline import QatRun, RunOptions

    base = tmp_path_factory.mktemp("int8")
    config = load_config(os.path.join(REPO, "quant", "examples", "shapes.yaml"))
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, train_count=64, test_count=24),
        export=dataclasses.replace(config.export, tiers=((96, 96), (64, 96)), extra_batches=()),
    )
    options = RunOptions(out_dir=str(base / "bundle"), epochs=1, qat_epochs=1, work_dir=str(base / "work"))
    report = QatRun(config, options).run()
    return {"report": report, "bundle": str(base / "bundle")}


def test_qat_writes_an_int8_onnx_per_tier_with_uint8_nhwc_bgr_input(run):
    from agent.bundle.verify import verify_bundle

    bundle = verify_bundle(run["bundle"])
    entries = {a.file: a for a in bundle.manifest.artifacts}
    for tier in ("96x96", "64x96"):
        entry = entries["model_%s.int8.onnx" % tier]
        assert (entry.precision, entry.input_dtype, entry.input_layout, entry.input_color, entry.normalize_on) == (
            "int8", "uint8", "NHWC", "bgr", "model")
        model = onnx.load(bundle.path(entry.file))
        assert model.ir_version <= 8 and {o.domain for o in model.opset_import} == {""}
        size = os.path.getsize(bundle.path(entry.file))
        assert size <= MAX_SIZE_RATIO * os.path.getsize(bundle.path("model_%s.onnx" % tier))


def test_int8_onnx_read_back_against_the_simulation_is_in_the_report(run):
    report = run["report"]
    check = report["checks"]["int8_onnx_test_split"]
    assert check["file"] == "model_96x96.int8.onnx" and check["images"] == 24
    assert check["best_anchor_class_agreement"] >= MIN_BEST_CLASS_AGREEMENT
    assert check["quantized_convs"] == 8 and check["float_convs"] == 2 and check["quantizers"] == 22
    assert check["float_stem_convs"] == 1  # the first convolution reads the uint8 pixels (converters/int8_stem.py)
    assert 0 <= check["metrics"]["map50"] <= 1 and check["bytes_ratio_to_float"] <= MAX_SIZE_RATIO
    assert report["checks"]["model_64x96.int8.onnx"]["best_anchor_class_agreement"] >= MIN_BEST_CLASS_AGREEMENT
    with open(os.path.join(run["bundle"], "report.txt"), encoding="utf-8") as handle:
        assert "int8 ONNX model_96x96.int8.onnx on onnxruntime" in handle.read()
    with open(os.path.join(run["bundle"], "report.json"), encoding="utf-8") as handle:
        assert json.load(handle)["checks"]["int8_onnx_test_split"] == check


def test_without_onnxruntime_no_int8_onnx_is_written_and_the_report_says_why(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from quant import int8_artifact

    monkeypatch.setattr(int8_artifact, "onnxruntime_missing", lambda: "onnxruntime is not installed (test)")
    config = SimpleNamespace(export=SimpleNamespace(onnx=True, tiers=((96, 96),)))
    checks, artifacts = int8_artifact.write_int8_artifacts(str(tmp_path), config, None, None, None, None, 1)
    assert checks == {"int8_onnx": {"skipped": "onnxruntime is not installed (test)"}} and artifacts == []
    assert os.listdir(str(tmp_path)) == []


def test_checkpoints_rebuilt_from_the_demo_bundle_resume_its_run(tmp_path):
    """quant.checkpoints_from_bundle: the demo bundle's MindIRs give checkpoints that --resume accepts and that
    hold the bundle's float weights (its float ONNX reads the same initializers)."""
    pytest.importorskip("mindspore_gs")
    import mindspore as ms
    from onnx import numpy_helper

    from quant.checkpoints_from_bundle import rebuild
    from quant.config import load_config
    from quant.pipeline import QatRun, RunOptions

    bundle = os.path.join(REPO, "examples", "demo-bundle")
    config_path = os.path.join(REPO, "quant", "examples", "shapes.yaml")
    float_ckpt, qat_ckpt = rebuild(config_path, bundle, str(tmp_path))
    run = QatRun(load_config(config_path), RunOptions(out_dir=bundle, resume=True, work_dir=str(tmp_path)))
    assert run._resumable("float") and run._resumable("qat")
    weights = ms.load_checkpoint(float_ckpt)
    onnx_model = onnx.load(os.path.join(bundle, "model_256x256.onnx"))
    initializer = next(t for t in onnx_model.graph.initializer if t.name == "backbone_fine.0.conv.weight")
    np.testing.assert_array_equal(weights["backbone_fine.0.conv.weight"].asnumpy(), numpy_helper.to_array(initializer))
    assert any(name.endswith("_input_quantizer._float_max") for name in ms.load_checkpoint(qat_ckpt))
