"""converters/onnx_input.py: a model with its input convention folded in (uint8 BGR NHWC in) gives the outputs the
float model gives on the host-normalised frame, for float and QDQ int8 graphs, whichever way each fold is made;
and the float stem that follows the fold on both int8 paths (converters/int8_stem.py)."""

import numpy as np
import pytest

try:  # first: MindSpore fixes protobuf's implementation before onnx may (converters/byom/model_file.py)
    import mindspore  # noqa: F401
except ImportError:  # the Lite lane (Python 3.7, onnxruntime 1.14.1): folded models must load there too
    pass
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from agent.pipeline.preprocess import PreprocessSpec  # noqa: E402
from converters.onnx_input import MODEL_INPUT, InputFoldError, fold_input, normalised_input  # noqa: E402

HW = (32, 48)
ATOL = 1e-4
ULTRALYTICS = PreprocessSpec()  # rgb, x/255
IMAGENET = PreprocessSpec(color="rgb", mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
BGR_MEAN = PreprocessSpec(color="bgr", mean=(104.0, 117.0, 123.0), std=(1.0, 1.0, 1.0))
OPSET = 13
IR_VERSION = 7  # what onnxruntime 1.14.1 (the box's Python 3.7) loads


def _model(first: str, pads: int) -> onnx.ModelProto:
    """A small float net on a (1, 3, H, W) input. ``first``: "conv" (Conv reads the input), "two-convs" (two
    Convs read it), "mixed" (a Conv and a ReduceMean read it)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["images", "w1", "b1"], ["c1"], pads=[pads] * 4, kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["out"])]
    if first == "two-convs":
        inits.append(numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32), "w3"))
        nodes[-1].output[0] = "a"
        nodes += [helper.make_node("Conv", ["images", "w3"], ["side"], strides=[1, 1]),
                  helper.make_node("Slice", ["side", "starts", "ends", "axes"], ["side_cut"]),
                  helper.make_node("Add", ["a", "side_cut"], ["out"])]
        crop = pads - 1  # the 3x3 Conv's output is smaller by 2 - 2*pads
        inits += [numpy_helper.from_array(np.array([-crop, -crop], np.int64), "starts"),
                  numpy_helper.from_array(np.array([HW[0] + crop, HW[1] + crop], np.int64), "ends"),
                  numpy_helper.from_array(np.array([2, 3], np.int64), "axes")]
    elif first == "mixed":
        nodes[-1].output[0] = "a"
        nodes += [helper.make_node("ReduceMean", ["images"], ["m"], axes=[1, 2, 3], keepdims=1),
                  helper.make_node("Add", ["a", "m"], ["out"])]
    graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                                           [1, 3, HW[0], HW[1]])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, None, None])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _frames(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, HW[0], HW[1], 3), dtype=np.uint8)


def _run(model: onnx.ModelProto, inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: inputs})[0]


def _check_folded(model: onnx.ModelProto, spec: PreprocessSpec) -> str:
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    fold_input(folded, spec)
    onnx.checker.check_model(folded)
    value = folded.graph.input[0]
    assert value.name == model.graph.input[0].name
    assert value.type.tensor_type.elem_type == TensorProto.UINT8
    assert [d.dim_value for d in value.type.tensor_type.shape.dim] == [1, HW[0], HW[1], 3]
    assert folded.ir_version == model.ir_version and list(folded.opset_import) == list(model.opset_import)
    for frame in _frames(3):
        frame = frame[None]
        expected = _run(model, normalised_input(frame, spec))
        got = _run(folded, frame)
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    return " ".join(n.op_type for n in folded.graph.node)


@pytest.mark.parametrize("spec", [ULTRALYTICS, IMAGENET, BGR_MEAN], ids=["rgb-255", "rgb-imagenet", "bgr-mean"])
@pytest.mark.parametrize("pads", [0, 1], ids=["unpadded", "padded"])
def test_float_conv_input_folds_into_weights(spec, pads):
    ops = _check_folded(_model("conv", pads), spec)
    assert "Gather" not in ops and "Mul" not in ops  # the colour order and 1/std went into the weights
    has_mean = any(spec.mean)
    assert ("Add" in ops) == (has_mean and pads > 0)  # a padded Conv gets the mean as an Add, else in its bias


@pytest.mark.parametrize("spec", [ULTRALYTICS, IMAGENET], ids=["rgb-255", "rgb-imagenet"])
def test_two_convs_reading_the_input_both_fold(spec):
    ops = _check_folded(_model("two-convs", 1), spec)
    assert "Gather" not in ops


@pytest.mark.parametrize("spec", [ULTRALYTICS, IMAGENET, BGR_MEAN], ids=["rgb-255", "rgb-imagenet", "bgr-mean"])
def test_other_readers_get_the_generic_nodes(spec):
    ops = _check_folded(_model("mixed", 1), spec)
    assert ("Gather" in ops) == (spec.color == "rgb")


def _quantized(model: onnx.ModelProto, spec: PreprocessSpec, tmp_path) -> onnx.ModelProto:
    quantization = pytest.importorskip("onnxruntime.quantization")

    class Reader(quantization.CalibrationDataReader):
        def __init__(self):
            self.frames = iter(normalised_input(f[None], spec) for f in _frames(8, seed=1))

        def get_next(self):
            frame = next(self.frames, None)
            return None if frame is None else {"images": frame}

    src, dst = str(tmp_path / "float.onnx"), str(tmp_path / "int8.onnx")
    onnx.save(model, src)
    quantization.quantize_static(src, dst, Reader(), quant_format=quantization.QuantFormat.QDQ,
                                 activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8, per_channel=True)
    return onnx.load(dst)


def _unit_input_scale(model: onnx.ModelProto) -> None:
    """Set the input QuantizeLinear to x/255 exactly (what QAT's input FakeQuant learns on 0..1 pixels)."""
    quantize = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "images")
    for tensor in model.graph.initializer:
        if tensor.name == quantize.input[1]:
            tensor.CopyFrom(numpy_helper.from_array(np.array(1 / 255, np.float32), tensor.name))
        elif tensor.name == quantize.input[2]:
            tensor.CopyFrom(numpy_helper.from_array(np.array(0, np.uint8), tensor.name))


def test_qdq_unit_input_quantize_disappears(tmp_path):
    int8 = _quantized(_model("conv", 1), ULTRALYTICS, tmp_path)
    _unit_input_scale(int8)
    ops = _check_folded(int8, ULTRALYTICS)
    assert "Cast" not in ops and "Gather" not in ops  # the uint8 pixels are the quantized input; weights permuted
    assert ops.count("QuantizeLinear") == sum(n.op_type == "QuantizeLinear" for n in int8.graph.node) - 1


@pytest.mark.parametrize("spec", [ULTRALYTICS, IMAGENET], ids=["rgb-255", "rgb-imagenet"])
def test_qdq_calibrated_input_keeps_its_quantize(tmp_path, spec):
    int8 = _quantized(_model("conv", 1), spec, tmp_path)
    ops = _check_folded(int8, spec)
    assert "Gather" not in ops  # the colour order went into the int8 weights


def test_model_input_names_the_manifest_fields():
    assert MODEL_INPUT == {"input_dtype": "uint8", "input_layout": "NHWC", "input_color": "bgr",
                           "normalize_on": "model"}


def test_refuses_a_non_image_input():
    model = _model("conv", 1)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.UINT8
    with pytest.raises(InputFoldError, match="images"):
        fold_input(model, ULTRALYTICS)


# --- the float stem (converters/int8_stem.py): run after fold_input on both int8 paths ---------------------


def _stemmed(int8: onnx.ModelProto, spec: PreprocessSpec):
    """(the folded int8 model, the same with its float stem, the number of stem convolutions)."""
    from converters.int8_stem import float_stem

    folded = onnx.ModelProto()
    folded.CopyFrom(int8)
    fold_input(folded, spec)
    stemmed = onnx.ModelProto()
    stemmed.CopyFrom(folded)
    count = float_stem(stemmed)
    onnx.checker.check_model(stemmed)
    return folded, stemmed, count


def _stem_quantizers(model: onnx.ModelProto):
    """The stem Conv nodes (reading the Cast of the pixels) and the QuantizeLinear reading each."""
    cast = next(n for n in model.graph.node if n.op_type == "Cast")
    stem = [n for n in model.graph.node if n.op_type == "Conv" and n.input[0] == cast.output[0]]
    return stem, [next(q for q in model.graph.node if q.op_type == "QuantizeLinear" and q.input[0] == n.output[0])
                  for n in stem]


def _with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.UINT8, None) for n in names)
    return out


def _run_all(model: onnx.ModelProto, inputs: np.ndarray, level) -> list:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: inputs})


def _exact_reference(model: onnx.ModelProto, conv, quantize, frame: np.ndarray) -> np.ndarray:
    """The stem's quantized output computed in int64 (no float sums at all): what every CPU must give."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weight, bias = values[conv.input[1]].astype(np.int64), values[conv.input[2]].astype(np.int64)
    pads = next(a.ints for a in conv.attribute if a.name == "pads")
    pixels = np.pad(frame.transpose(2, 0, 1).astype(np.int64),  # BGR as it comes: the fold permuted the weights
                    ((0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    k = weight.shape[2]
    rows, cols = pixels.shape[1] - k + 1, pixels.shape[2] - k + 1
    windows = np.stack([pixels[:, i:i + rows, j:j + cols] for i in range(k) for j in range(k)], axis=1)
    acc = np.einsum("ckhw,ock->ohw", windows, weight.reshape(weight.shape[0], 3, k * k)) + bias[:, None, None]
    scale, zero = values[quantize.input[1]].astype(np.float32), values[quantize.input[2]]
    ratio = (acc.astype(np.float32) / scale.reshape(-1, 1, 1)).astype(np.float32)
    return np.clip(np.rint(ratio) + zero.reshape(-1, 1, 1).astype(np.int64), 0, 255).astype(np.uint8)[None]


@pytest.mark.parametrize("first", ["conv", "two-convs"])
def test_float_stem_runs_the_input_convs_in_float_on_their_int8_values(tmp_path, first):
    int8 = _quantized(_model(first, 1), ULTRALYTICS, tmp_path)
    _unit_input_scale(int8)
    folded, stemmed, count = _stemmed(int8, ULTRALYTICS)
    assert count == (2 if first == "two-convs" else 1)
    values = {t.name: numpy_helper.to_array(t) for t in stemmed.graph.initializer}
    stem, quantizers = _stem_quantizers(stemmed)
    assert len(stem) == count
    for conv, quantize in zip(stem, quantizers):
        weight = values[conv.input[1]]  # the int8 values themselves, as float: products and sums stay integers
        assert weight.dtype == np.float32 and weight.ndim == 4 and np.array_equal(weight, np.rint(weight))
        assert np.abs(weight).max() <= 127 and np.abs(weight).max() >= 64  # per-channel int8: the range is used
        if len(conv.input) > 2:
            assert np.array_equal(values[conv.input[2]], np.rint(values[conv.input[2]]))
        assert values[quantize.input[1]].shape == (weight.shape[0],)  # the scales moved to the quantizer
    others = [n for n in stemmed.graph.node if n.op_type == "Conv" and n not in stem]
    dequantized = {n.output[0] for n in stemmed.graph.node if n.op_type == "DequantizeLinear"}
    assert others and all(n.input[0] in dequantized and n.input[1] in dequantized for n in others)
    # the same int8 model: its outputs are the integer kernel's but where a rounding tie divides differently
    frames = _frames(8, seed=4)
    want = np.concatenate([_run(folded, f[None]) for f in frames])
    got = np.concatenate([_run(stemmed, f[None]) for f in frames])
    differing = np.mean(np.abs(got - want) > ATOL)
    assert differing < 0.01, "%.2f %% of the outputs moved" % (100 * differing)


def test_float_stem_gives_the_exact_integer_result_whatever_the_kernel(tmp_path):
    """Issue 38: the stem's quantized output equals an int64 computation on every frame, under onnxruntime's
    fused (NCHWc) kernels and its plain ones alike: no float sum ever rounds, so no CPU's summation order can
    move a value to the next step."""
    int8 = _quantized(_model("conv", 1), ULTRALYTICS, tmp_path)
    _unit_input_scale(int8)
    _folded, stemmed, _count = _stemmed(int8, ULTRALYTICS)
    (conv,), (quantize,) = _stem_quantizers(stemmed)
    probed = _with_outputs(stemmed, [quantize.output[0]])
    for frame in _frames(16, seed=9):
        want = _exact_reference(stemmed, conv, quantize, frame)
        for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
            got = _run_all(probed, frame[None], level)[1]
            assert np.array_equal(got, want), "%d of %d stem values differ at %s" % (
                np.count_nonzero(got != want), want.size, level)


def test_float_stem_stays_int8_where_float_sums_could_round(tmp_path):
    """A bias so large that accumulator + bias could pass 2**24 (float32's last exact integer): the stem is left
    to the integer kernels, not run in float."""
    int8 = _quantized(_model("conv", 1), ULTRALYTICS, tmp_path)
    _unit_input_scale(int8)
    conv = next(n for n in int8.graph.node if n.op_type == "Conv")
    bias_dq = next(n for n in int8.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == conv.input[2])
    for tensor in int8.graph.initializer:
        if tensor.name == bias_dq.input[0]:
            tensor.CopyFrom(numpy_helper.from_array(np.full(tensor.dims, 2 ** 24 - 1000, np.int32), tensor.name))
    folded, stemmed, count = _stemmed(int8, ULTRALYTICS)
    assert count == 0 and stemmed.SerializeToString() == folded.SerializeToString()


def test_float_stem_leaves_a_calibrated_input_quantizer_alone(tmp_path):
    int8 = _quantized(_model("conv", 1), IMAGENET, tmp_path)  # a normalised input: its QuantizeLinear stays
    folded, stemmed, count = _stemmed(int8, IMAGENET)
    assert count == 0 and stemmed.SerializeToString() == folded.SerializeToString()
