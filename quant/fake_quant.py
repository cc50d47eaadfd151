"""Golden Stick SimQAT with fake quantizers that run on CPU.

Golden Stick's fake-quant primitives (``MinMaxUpdatePerLayer``, ``FakeQuantPerLayer``,
``FakeQuantPerChannel``) have no CPU kernels in MindSpore 2.7. The quantizers here do the same job with
ordinary ops: they track min/max the way Golden Stick does, quantize with the very scale and zero point that
Golden Stick's ``convert()`` later writes into ``FakeQuantParam`` (``quant_utils.cal_quantization_params``),
and pass gradients straight through inside the representable range (``ops.stop_gradient``). They plug into
SimQAT through its own extension points: a net policy (``_init_net_policy``) whose layer policies hand out
these quantizers, so ``apply()``, training, ``convert()`` and export are Golden Stick's unchanged. On
GPU/Ascend, :func:`build_algorithm` keeps Golden Stick's own quantizers (native kernels) with the same
placement (see ``_PlacementMixin``).

Range tracking: weights use the current tensor's min/max (per output channel when configured), activations an
exponential moving average seeded by the first batch (Golden Stick seeds with -6/6, which a slow average needs
thousands of steps to forget).
"""

import contextlib
import logging
import os
from typing import Dict, Iterator, List, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import QuantDtype, nn, ops
from mindspore.common.parameter import Parameter

log = logging.getLogger(__name__)

# Activation ranges: moving average weight of the old value per training step.
ACT_EMA_DECAY = 0.99
# Smallest quantization step; keeps x / scale finite for a channel whose weights are all equal.
MIN_SCALE = 1e-8


def quant_range(num_bits: int, signed: bool, narrow_range: bool) -> Tuple[int, int]:
    """Integer range of the quantized values (Golden Stick ``get_quant_min_max``)."""
    from mindspore_gs.quantization.quant_utils import get_quant_min_max

    return get_quant_min_max(num_bits=num_bits, signed=signed, narrow_range=narrow_range)


def _golden_stick_classes():
    """Imported lazily: the box and ``--help`` must work without Golden Stick installed."""
    from mindspore_gs.quantization.fake_quantizer import LinearFakeQuantizer
    from mindspore_gs.quantization.simulated_quantization import (
        simulated_quantization_layer_policy as policies,
    )
    from mindspore_gs.quantization.simulated_quantization.simulated_quantization_aware_training import (
        SimulatedQuantizationAwareTraining,
    )
    from mindspore_gs.quantization.simulated_quantization.simulated_quantization_net_policy import (
        SimulatedNetPolicy,
    )

    return LinearFakeQuantizer, policies, SimulatedQuantizationAwareTraining, SimulatedNetPolicy


def _make_quantizer_class():
    LinearFakeQuantizer, _, _, _ = _golden_stick_classes()

    class CpuFakeQuantizer(LinearFakeQuantizer):
        """Fake quantizer from ordinary ops with a straight-through estimator; per layer or per channel.

        Parameters ``float_min`` / ``float_max`` (shape (1,) or (channels,)) hold the range, exactly as in
        Golden Stick's ``SimulatedFakeQuantizerPerLayer``/``PerChannel``, so ``convert()`` reads them
        unchanged.
        """

        def __init__(
            self,
            num_channels: int = 1,
            channel_axis: int = -1,
            symmetric: bool = False,
            narrow_range: bool = False,
            quant_dtype: QuantDtype = QuantDtype.INT8,
            quant_delay: int = 0,
            tracks_weight: bool = False,
        ) -> None:
            super().__init__()
            from mindspore_gs.quantization.quant_utils import get_quant_dtype_num_bits

            if quant_dtype != QuantDtype.INT8:
                raise ValueError("only int8 simulated quantization is supported, got %s" % quant_dtype)
            self._per_channel = channel_axis >= 0
            self._channel_axis = channel_axis if self._per_channel else -1
            self._num_channels = num_channels if self._per_channel else 1
            self._symmetric = symmetric
            self._narrow_range = narrow_range
            self._quant_dtype = quant_dtype
            self._quant_delay = quant_delay
            self._num_bits = get_quant_dtype_num_bits(quant_dtype)
            self._tracks_weight = tracks_weight
            qmin, qmax = quant_range(self._num_bits, self.signed(), narrow_range)
            self._qmin, self._qmax = float(qmin), float(qmax)
            size = self._num_channels
            self._float_min = Parameter(
                ms.Tensor(np.full(size, -6.0, np.float32)), name="float_min", requires_grad=False
            )
            self._float_max = Parameter(
                ms.Tensor(np.full(size, 6.0, np.float32)), name="float_max", requires_grad=False
            )
            self._steps = Parameter(
                ms.Tensor(np.zeros(1, np.float32)), name="quant_steps", requires_grad=False
            )

        # --- what Golden Stick's convert() asks for (LinearFakeQuantizer interface) -------------------------
        def mins(self) -> List[float]:
            return self._float_min.asnumpy().tolist()

        def maxs(self) -> List[float]:
            return self._float_max.asnumpy().tolist()

        def num_bits(self) -> int:
            return self._num_bits

        def narrow_range(self) -> bool:
            return self._narrow_range

        def symmetric(self) -> bool:
            return self._symmetric

        def quant_dtype(self) -> QuantDtype:
            return self._quant_dtype

        def is_per_channel(self) -> bool:
            return self._per_channel

        def channel_axis(self) -> int:
            return self._channel_axis

        def foo_init(self) -> None:
            """Golden Stick's abstract hook; nothing to initialise lazily here."""

        def extend_repr(self) -> str:
            return "bit_num=%d, symmetric=%s, narrow_range=%s, per_channel=%s(%d, %d), quant_delay=%d" % (
                self._num_bits,
                self._symmetric,
                self._narrow_range,
                self._per_channel,
                self._channel_axis,
                self._num_channels,
                self._quant_delay,
            )

        # --- the simulation ---------------------------------------------------------------------------------
        def _observed_range(self, x: ms.Tensor) -> Tuple[ms.Tensor, ms.Tensor]:
            """Min and max of ``x`` (per channel along axis 0 for (C_out, ...) weights), widened to hold zero.

            Widening happens here, before the range is stored, as MindSpore's MinMaxUpdate kernels do: the
            stored range is then exactly what ``convert()`` turns into scale and zero point.
            """
            if self._per_channel:
                flat = x.reshape(self._num_channels, -1)
                low, high = flat.min(axis=1), flat.max(axis=1)
            else:
                low, high = x.min().reshape(1), x.max().reshape(1)
            return ops.minimum(low, 0.0), ops.maximum(high, 0.0)

        def _scale_zero_point(
            self, range_min: ms.Tensor, range_max: ms.Tensor
        ) -> Tuple[ms.Tensor, ms.Tensor]:
            """Golden Stick's ``cal_quantization_params`` in ops: the numbers ``convert()`` will store."""
            if self._symmetric:
                range_max = ops.maximum(ops.abs(range_min), range_max)
                range_min = -range_max
            scale = ops.maximum((range_max - range_min) / (self._qmax - self._qmin), MIN_SCALE)
            if self._symmetric:
                zero_point = ops.zeros_like(scale)
            else:
                zero_point = ops.round(self._qmin - range_min / scale)
            return scale, zero_point

        def _fake_quant(self, x: ms.Tensor, range_min: ms.Tensor, range_max: ms.Tensor) -> ms.Tensor:
            scale, zero_point = self._scale_zero_point(range_min, range_max)
            if self._per_channel:
                shape = (self._num_channels,) + (1,) * (x.ndim - 1)
                scale = scale.reshape(shape)
                zero_point = zero_point.reshape(shape)
            low = (self._qmin - zero_point) * scale
            high = (self._qmax - zero_point) * scale
            clipped = ops.minimum(ops.maximum(x, low), high)
            # (clip(round(x / s) + zp, qmin, qmax) - zp) * s, shortened: zp is an integer, so clipping to the
            # integer range commutes with rounding. Seven passes over the tensor instead of eleven.
            dequantized = ops.round(clipped / scale) * scale
            # Straight-through: forward gives the dequantized value, backward the gradient of the clip.
            return clipped + ops.stop_gradient(dequantized - clipped)

        def construct(self, x: ms.Tensor) -> ms.Tensor:
            if not self.training:
                return self._fake_quant(x, self._float_min, self._float_max)
            batch_min, batch_max = self._observed_range(ops.stop_gradient(x))
            if self._tracks_weight:
                new_min, new_max = batch_min, batch_max
            else:
                seen = (self._steps > 0).astype(ms.float32)  # 0 on the first step: take the batch's range
                keep = seen * ACT_EMA_DECAY
                new_min = keep * self._float_min + (1.0 - keep) * batch_min
                new_max = keep * self._float_max + (1.0 - keep) * batch_max
            ops.assign(self._float_min, new_min)
            ops.assign(self._float_max, new_max)
            ops.assign_add(self._steps, ops.ones_like(self._steps))
            if self._quant_delay > 0:
                active = (self._steps > self._quant_delay).astype(ms.float32)
                return x + active * (self._fake_quant(x, new_min, new_max) - x)
            return self._fake_quant(x, new_min, new_max)

    return CpuFakeQuantizer


_QUANTIZER_CLASS = None


def cpu_fake_quantizer_class():
    """The CPU quantizer class (built on first use so importing this module needs no Golden Stick)."""
    global _QUANTIZER_CLASS
    if _QUANTIZER_CLASS is None:
        _QUANTIZER_CLASS = _make_quantizer_class()
    return _QUANTIZER_CLASS


class _PlacementMixin:
    """Where activations are quantized, for both quantizer kinds.

    Activations are quantized where an int8 tensor exists once the converter has fused convolution, batch norm
    and activation: at the input of every convolution and dense layer (the network input, or the previous
    fused block's activated output) and at the output of dense layers, not between a convolution and its batch
    norm nor on both sides of every activation (Golden Stick's default). ``quantize_input`` /
    ``quantize_output`` say which ends of a layer kind get one; activation layers get no policy at all.
    """

    quantize_input = True
    quantize_output = True

    def __init__(self, weight_names, act_names, config):
        super().__init__(weight_names, act_names, config)
        if not self.quantize_input:
            self.set_input_not_insert_fq()
        if not self.quantize_output:
            self.set_output_not_insert_fq()


# Which ends of each layer kind carry an activation quantizer (see _PlacementMixin).
_LAYER_ENDS = {
    "ConvLayerPolicy": {"quantize_output": False},
    "ConvBnLayerPolicy": {"quantize_output": False},
    "DenseLayerPolicy": {},
}


class _CpuQuantizerMixin:
    """Golden Stick's three quantizer factories, returning :func:`cpu_fake_quantizer_class` instances."""

    def get_weight_quantizer(self, weight_name="", perchannel_args=None, **kwargs):
        config = self._config
        quantizer = cpu_fake_quantizer_class()
        if config.weight_per_channel:
            if perchannel_args is None or -1 in (perchannel_args.channel_axis, perchannel_args.num_channels):
                raise RuntimeError(
                    "per-channel weight quantization of %s needs its channel axis and count" % weight_name
                )
            return quantizer(
                num_channels=perchannel_args.num_channels,
                channel_axis=perchannel_args.channel_axis,
                symmetric=config.weight_symmetric,
                narrow_range=config.weight_narrow_range,
                quant_dtype=config.weight_quant_dtype,
                quant_delay=config.weight_quant_delay,
                tracks_weight=True,
            )
        return quantizer(
            symmetric=config.weight_symmetric,
            narrow_range=config.weight_narrow_range,
            quant_dtype=config.weight_quant_dtype,
            quant_delay=config.weight_quant_delay,
            tracks_weight=True,
        )

    def _activation_quantizer(self):
        config = self._config
        return cpu_fake_quantizer_class()(
            symmetric=config.act_symmetric,
            narrow_range=config.act_narrow_range,
            quant_dtype=config.act_quant_dtype,
            quant_delay=config.act_quant_delay,
        )

    def _get_input_quantizer(self, input_index=-1, perchannel_args=None, **kwargs):
        return self._activation_quantizer()

    def _get_output_quantizer(self, perchannel_args=None, **kwargs):
        return self._activation_quantizer()


def _make_algorithm_class(cpu_quantizers: bool):
    """SimQAT with atlas-edge's quantizer placement; CPU fake quantizers or Golden Stick's native ones."""
    _, policies, SimulatedQuantizationAwareTraining, SimulatedNetPolicy = _golden_stick_classes()
    mixins = (_CpuQuantizerMixin, _PlacementMixin) if cpu_quantizers else (_PlacementMixin,)
    prefix = "Cpu" if cpu_quantizers else "Placed"
    twins = {
        name: type(prefix + name, mixins + (getattr(policies, name),), attrs)
        for name, attrs in _LAYER_ENDS.items()
    }

    class PlacedSimulatedNetPolicy(SimulatedNetPolicy):
        """Golden Stick's SimQAT net policy with its layer policies swapped for the twins above."""

        def build(self):
            if self._build:
                return
            super().build()
            for layer_type, policy in list(self._layer_policy_map.items()):
                twin = twins.get(type(policy).__name__)
                if twin is None:  # activation layers: their output is the next layer's quantized input
                    del self._layer_policy_map[layer_type]
                else:
                    self._layer_policy_map[layer_type] = twin([], [], self._config)

    class AtlasSimulatedQuantizationAwareTraining(SimulatedQuantizationAwareTraining):
        """Golden Stick's SimQAT (``apply``/``convert`` unchanged) with the net policy above."""

        def _init_net_policy(self, config):
            return PlacedSimulatedNetPolicy(config)

    return AtlasSimulatedQuantizationAwareTraining


def build_algorithm(
    device: str,
    per_channel: bool = True,
    symmetric_weights: bool = True,
    quant_delay: int = 0,
):
    """A configured SimQAT: CPU fake quantizers on ``cpu``, Golden Stick's native ones on ``gpu``/``ascend``.

    The quantizer placement is the same on every device, so the deploy graphs hold the same FakeQuantParam
    nodes whichever device trained them.
    """
    if device not in ("cpu", "gpu", "ascend"):
        raise ValueError("device must be cpu, gpu or ascend, got %r" % device)
    config = {
        "per_channel": [False, per_channel],
        "symmetric": [False, symmetric_weights],
        "narrow_range": [False, False],
        "quant_delay": [quant_delay, quant_delay],
        # Fusion would rebuild Conv2d + BatchNorm2d as a fresh Conv2dBn and drop the trained float weights.
        "enable_fusion": False,
        "bn_fold": False,
    }
    return _make_algorithm_class(cpu_quantizers=device == "cpu")(config)


@contextlib.contextmanager
def _working_directory(path: str) -> Iterator[None]:
    previous = os.getcwd()
    os.makedirs(path, exist_ok=True)
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def apply_quantization(algorithm, network: nn.Cell, scratch_dir: str) -> nn.Cell:
    """``algorithm.apply(network)``, keeping the sources MindSpore rewrite generates in ``scratch_dir``.

    The rewrite pass writes the source of every rewritten class to ``./rewritten_network`` and graph
    compilation reads it back later; running it inside ``scratch_dir`` keeps those files out of the user's
    working directory (and alive for as long as the run needs them).
    """
    with _working_directory(scratch_dir):
        return algorithm.apply(network)


def fake_quantizers(network: nn.Cell) -> Iterator[Tuple[str, nn.Cell]]:
    """(name, quantizer) of every fake quantizer still in ``network`` (before ``convert()``)."""
    LinearFakeQuantizer, _, _, _ = _golden_stick_classes()
    for name, cell in network.cells_and_names():
        if isinstance(cell, LinearFakeQuantizer):
            yield name, cell


def refresh_weight_ranges(network: nn.Cell) -> int:
    """Set every weight quantizer's min/max from its weight as it is now.

    Training updates a weight after the forward pass that measured it, so the stored range lags one step
    behind; this makes the simulated-quant export and ``convert()`` agree with the final weights. Returns the
    number of quantizers refreshed.
    """
    from mindspore_gs.quantization.quant_cell import QuantCell

    refreshed = 0
    for _, cell in network.cells_and_names():
        if not isinstance(cell, QuantCell) or not hasattr(cell, "weight"):
            continue
        quantizer = cell.weight_quantizer()
        if quantizer is None or not hasattr(quantizer, "_float_min"):
            continue
        weight = cell.weight.asnumpy()
        if quantizer.is_per_channel():
            flat = weight.reshape(weight.shape[0], -1)
            low, high = flat.min(axis=1), flat.max(axis=1)
        else:
            low, high = np.array([weight.min()]), np.array([weight.max()])
        low, high = np.minimum(low, 0.0), np.maximum(high, 0.0)  # as the quantizers widen it
        quantizer._float_min.set_data(ms.Tensor(low.astype(np.float32)))
        quantizer._float_max.set_data(ms.Tensor(high.astype(np.float32)))
        refreshed += 1
    return refreshed


def quantizer_ranges(network: nn.Cell) -> Dict[str, Dict[str, Union[List[float], bool]]]:
    """Name -> {min, max, scale, zero_point, per_channel} of every fake quantizer (tests, report)."""
    ranges = {}
    for name, quantizer in fake_quantizers(network):
        scale, zero_point = quantizer.get_scale_zp()
        ranges[name] = {
            "min": quantizer.mins(),
            "max": quantizer.maxs(),
            "scale": scale,
            "zero_point": zero_point,
            "per_channel": quantizer.is_per_channel(),
        }
    return ranges
