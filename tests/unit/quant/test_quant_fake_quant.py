"""The CPU fake quantizers: Golden Stick's numbers, a straight-through gradient, and SimQAT plumbing."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytest.importorskip("mindspore_gs")

from mindspore import nn, ops  # noqa: E402
from mindspore_gs.quantization.quant_utils import cal_quantization_params, get_quant_min_max  # noqa: E402

from quant.fake_quant import build_algorithm, cpu_fake_quantizer_class, fake_quantizers  # noqa: E402
from quant.training import use_graph_mode_on  # noqa: E402


@pytest.fixture(autouse=True)
def graph_mode():
    use_graph_mode_on("CPU")


def reference_fake_quant(x, low, high, signed, symmetric, axis_shape=None):
    """numpy fake quantization with Golden Stick's scale and zero point (quant_utils)."""
    qmin, qmax = get_quant_min_max(8, signed, False)
    scale, zp = cal_quantization_params(np.asarray(low), np.asarray(high), qmin, qmax, symmetric=symmetric)
    if axis_shape is not None:
        scale, zp = scale.reshape(axis_shape), zp.reshape(axis_shape)
    q = np.clip(np.round(x / scale) + zp, qmin, qmax)
    return ((q - zp) * scale).astype(np.float32)


def test_activation_quantizer_matches_golden_stick_parameters():
    quantizer = cpu_fake_quantizer_class()(symmetric=False)
    quantizer.set_train(True)
    x = np.random.default_rng(0).uniform(-1.0, 3.0, (2, 4, 5, 5)).astype(np.float32)
    out = quantizer(ms.Tensor(x)).asnumpy()
    assert quantizer.mins() == pytest.approx([x.min()]) and quantizer.maxs() == pytest.approx([x.max()])
    expected = reference_fake_quant(x, [x.min()], [x.max()], signed=False, symmetric=False)
    np.testing.assert_allclose(out, expected, atol=1e-6)
    assert len(np.unique(out)) <= 256
    # What convert() will write (Golden Stick's own code path) is the scale the simulation used.
    scale, zero_point = quantizer.get_scale_zp()
    assert scale[0] == pytest.approx((x.max() - x.min()) / 255, rel=1e-6)
    assert zero_point[0] == round(-x.min() / scale[0])


def test_activation_range_is_a_moving_average_after_the_first_batch():
    quantizer = cpu_fake_quantizer_class()(symmetric=False)
    quantizer.set_train(True)
    quantizer(ms.Tensor(np.array([0.0, 2.0], np.float32)))
    quantizer(ms.Tensor(np.array([0.0, 4.0], np.float32)))
    assert quantizer.maxs()[0] == pytest.approx(0.99 * 2.0 + 0.01 * 4.0, rel=1e-6)
    assert quantizer.mins()[0] == 0.0  # the range always holds zero


def test_per_channel_symmetric_weight_quantizer():
    quantizer = cpu_fake_quantizer_class()(num_channels=4, channel_axis=0, symmetric=True, tracks_weight=True)
    quantizer.set_train(True)
    w = np.random.default_rng(1).normal(0, 0.1, (4, 3, 3, 3)).astype(np.float32)
    w[2] *= 10  # one channel with a much wider range keeps its own scale
    out = quantizer(ms.Tensor(w)).asnumpy()
    flat = w.reshape(4, -1)
    np.testing.assert_allclose(quantizer.mins(), np.minimum(flat.min(1), 0), rtol=1e-6)
    np.testing.assert_allclose(quantizer.maxs(), np.maximum(flat.max(1), 0), rtol=1e-6)
    expected = reference_fake_quant(
        w, flat.min(1), flat.max(1), signed=True, symmetric=True, axis_shape=(4, 1, 1, 1)
    )
    np.testing.assert_allclose(out, expected, atol=1e-6)
    scale, zero_point = quantizer.get_scale_zp()
    np.testing.assert_allclose(scale, np.abs(flat).max(1) * 2 / 255, rtol=1e-5)
    assert zero_point == [0.0] * 4


def test_inference_uses_the_stored_range_and_gradient_is_straight_through_inside_it():
    quantizer = cpu_fake_quantizer_class()(symmetric=False)
    quantizer.set_train(True)
    quantizer(ms.Tensor(np.array([0.0, 1.0], np.float32)))  # range [0, 1]
    quantizer.set_train(False)
    x = ms.Tensor(np.array([-0.5, 0.1, 0.5, 0.9, 2.0], np.float32))
    out = quantizer(x).asnumpy()
    assert out[0] == 0.0 and out[-1] == pytest.approx(1.0)  # clipped to the trained range
    grad = ms.grad(SumOf(quantizer))(x).asnumpy()
    np.testing.assert_array_equal(grad, [0, 1, 1, 1, 0])


class SumOf(nn.Cell):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def construct(self, x):
        return self.inner(x).sum()


class TinyNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, pad_mode="pad", padding=1, has_bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.dense = nn.Dense(4, 2)
        self.pool = ops.ReduceMean(keep_dims=False)

    def construct(self, x):
        return self.dense(self.pool(self.relu(self.bn(self.conv(x))), (2, 3)))


def test_simqat_apply_inserts_cpu_quantizers_and_trains_on_cpu(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # rewrite writes generated sources to ./rewritten_network
    net = build_algorithm("cpu").apply(TinyNet())
    quantizers = dict(fake_quantizers(net))
    kinds = {type(q).__name__ for q in quantizers.values()}
    assert kinds == {"CpuFakeQuantizer"}
    per_channel = [q for q in quantizers.values() if q.is_per_channel()]
    assert len(per_channel) == 2  # the conv and dense weights
    loss = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
    step = nn.TrainOneStepCell(loss, nn.Adam(net.trainable_params(), 1e-2))
    step.set_train(True)
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.normal(size=(8, 3, 8, 8)).astype(np.float32))
    y = ms.Tensor((rng.random(8) > 0.5).astype(np.int32))
    losses = [float(step(x, y).asnumpy()) for _ in range(15)]
    assert losses[-1] < losses[0]
    assert all(np.isfinite(losses))


def test_native_golden_stick_quantizers_get_the_same_placement(tmp_path, monkeypatch):
    """--device gpu/ascend: Golden Stick's own quantizers (no CPU kernels, so not run here), same places."""
    monkeypatch.chdir(tmp_path)
    cpu = dict(fake_quantizers(build_algorithm("cpu").apply(TinyNet())))
    native = dict(fake_quantizers(build_algorithm("gpu").apply(TinyNet())))
    assert sorted(cpu) == sorted(native)
    assert {type(q).__name__ for q in native.values()} == {
        "SimulatedFakeQuantizerPerLayer",
        "SimulatedFakeQuantizerPerChannel",
    }
    with pytest.raises(ValueError, match="device must be cpu, gpu or ascend"):
        build_algorithm("tpu")
