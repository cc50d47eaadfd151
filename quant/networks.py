"""The two built-in MindSpore networks (a small classifier, a small anchor-free detector) and user networks.

Both built-ins are plain Conv2d / BatchNorm2d / ReLU / Dense stacks so Golden Stick's SimQAT layer policies
find every layer to wrap. The detector decodes inside the network to the YOLOv8 layout the box consumes
directly: ``(B, 4 + nc, N)`` with cx, cy, w, h in input pixels, then per-class sigmoid scores (no objectness).
"""

import importlib
import logging
from typing import Any, Dict, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import nn, ops

log = logging.getLogger(__name__)

# Box size in cells is exp(t) with t clipped to this range: 1/20 of a cell up to 55 cells, enough for any
# object that fits the input while keeping exp() finite in float16 on the NPU.
SIZE_LOG_RANGE = (-3.0, 4.0)


class ConvBnReLU(nn.Cell):
    """3x3 convolution, batch norm, ReLU: the one building block, all layers SimQAT knows how to wrap."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride, pad_mode="pad", padding=1, has_bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self.relu(self.bn(self.conv(x)))


conv_bn_relu = ConvBnReLU


class SmallClassifier(nn.Cell):
    """Three conv stages (strides 1, 2, 2), global average pooling, a linear layer; logits (B, nc)."""

    stride = 4

    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.features = nn.SequentialCell(
            [
                conv_bn_relu(3, width),
                conv_bn_relu(width, width * 2, 2),
                conv_bn_relu(width * 2, width * 2),
                conv_bn_relu(width * 2, width * 4, 2),
            ]
        )
        self.classifier = nn.Dense(width * 4, num_classes)
        self.global_pool = ops.ReduceMean(keep_dims=False)

    def construct(self, images: ms.Tensor) -> ms.Tensor:
        features = self.features(images)
        pooled = self.global_pool(features, (2, 3))  # (B, C, H, W) -> (B, C)
        return self.classifier(pooled)


class YoloV8Decode(nn.Cell):
    """Turns the raw head maps of each level into the YOLOv8 output layout.

    Per cell (gx, gy) of a level with stride s: cx = (gx + 2 sigmoid(tx) - 0.5) s, likewise cy; w = s exp(tw);
    class score = sigmoid(tc). Levels are concatenated in the order given, row-major within a level, which the
    training targets (:mod:`quant.detection_loss`) assume as well.
    """

    def __init__(self, strides: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.strides = tuple(int(s) for s in strides)
        self.num_classes = num_classes
        # Primitive instances rather than functional ops: Golden Stick's rewrite pass parses this construct
        # and can only follow primitives held by the cell.
        self.sigmoid = ops.Sigmoid()
        self.exp = ops.Exp()
        self.minimum = ops.Minimum()
        self.maximum = ops.Maximum()
        self.concat_channels = ops.Concat(axis=1)
        self.concat_cells = ops.Concat(axis=2)
        # Copied onto the cell: rewrite regenerates construct() in a new module without this module's globals.
        self.log_size_min, self.log_size_max = SIZE_LOG_RANGE

    def _level(self, raw: ms.Tensor, stride: int) -> ms.Tensor:
        batch, channels, height, width = raw.shape
        grid_y = ops.arange(height, dtype=ms.float32).reshape(1, height, 1)
        grid_x = ops.arange(width, dtype=ms.float32).reshape(1, 1, width)
        cx = (grid_x + self.sigmoid(raw[:, 0]) * 2.0 - 0.5) * stride
        cy = (grid_y + self.sigmoid(raw[:, 1]) * 2.0 - 0.5) * stride
        log_wh = self.maximum(self.minimum(raw[:, 2:4], self.log_size_max), self.log_size_min)
        wh = self.exp(log_wh) * stride
        boxes = self.concat_channels((cx.expand_dims(1), cy.expand_dims(1), wh))  # (B, 4, H, W)
        scores = self.sigmoid(raw[:, 4:])
        return self.concat_channels((boxes, scores)).reshape(batch, channels, height * width)

    def construct(self, raw_fine: ms.Tensor, raw_coarse: ms.Tensor) -> ms.Tensor:
        fine = self._level(raw_fine, self.strides[0])
        coarse = self._level(raw_coarse, self.strides[1])
        return self.concat_cells((fine, coarse))  # (B, 4 + nc, N_fine + N_coarse)


# Initial score of every class: a prior of 1 % keeps the thousands of background cells from swamping the loss
# in the first steps (RetinaNet's prior-probability initialisation).
CLASS_PRIOR = 0.01
# Initial box size exp(1) ~ 2.7 cells: the middle of the object sizes each level is trained on.
INITIAL_LOG_SIZE = 1.0


def _prediction_conv(in_channels: int, num_classes: int) -> nn.Conv2d:
    """1x1 convolution to tx, ty, tw, th and one logit per class, with the biases set to sensible priors."""
    import numpy as np

    bias = np.zeros(4 + num_classes, np.float32)
    bias[2:4] = INITIAL_LOG_SIZE
    bias[4:] = np.log(CLASS_PRIOR / (1 - CLASS_PRIOR))
    return nn.Conv2d(in_channels, 4 + num_classes, 1, has_bias=True, bias_init=ms.Tensor(bias))


class ShapesDetector(nn.Cell):
    """Anchor-free two-level detector (strides 8 and 16), about 0.3 M parameters at the default widths."""

    strides = (8, 16)
    stride = 16

    def __init__(self, num_classes: int, widths: Tuple[int, int, int, int] = (16, 32, 64, 96)) -> None:
        super().__init__()
        self.num_classes = num_classes
        c1, c2, c3, c4 = widths
        self.backbone_fine = nn.SequentialCell(
            [
                conv_bn_relu(3, c1, 2),
                conv_bn_relu(c1, c2, 2),
                conv_bn_relu(c2, c2),
                conv_bn_relu(c2, c3, 2),
                conv_bn_relu(c3, c3),
            ]
        )
        self.backbone_coarse = nn.SequentialCell([conv_bn_relu(c3, c4, 2), conv_bn_relu(c4, c4)])
        self.head_fine = nn.SequentialCell([conv_bn_relu(c3, c3), _prediction_conv(c3, num_classes)])
        self.head_coarse = nn.SequentialCell([conv_bn_relu(c4, c4), _prediction_conv(c4, num_classes)])
        self.decode = YoloV8Decode(self.strides, num_classes)

    def construct(self, images: ms.Tensor) -> ms.Tensor:
        fine = self.backbone_fine(images)
        coarse = self.backbone_coarse(fine)
        return self.decode(self.head_fine(fine), self.head_coarse(coarse))


def anchor_points(input_hw: Tuple[int, int], strides: Sequence[int]) -> Tuple[Any, Any]:
    """Cell centres (N, 2) as x, y in input pixels and each cell's stride (N,), in decoder output order."""
    import numpy as np

    centres, cell_strides = [], []
    for stride in strides:
        rows, cols = input_hw[0] // stride, input_hw[1] // stride
        ys, xs = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        centres.append(np.stack([xs.ravel() + 0.5, ys.ravel() + 0.5], axis=1) * stride)
        cell_strides.append(np.full(rows * cols, stride, dtype=np.float32))
    return np.concatenate(centres).astype(np.float32), np.concatenate(cell_strides)


def network_stride(network: nn.Cell) -> int:
    """The largest stride of the network (input sides must be multiples of it); 1 when it does not say."""
    return int(getattr(network, "stride", 1))


def build_network(kind: str, num_classes: int, options: Optional[Dict[str, Any]] = None) -> nn.Cell:
    """A built-in network by name (``classifier`` | ``detector``) or a user cell by ``package.module:Class``.

    A user cell is constructed as ``Class(num_classes=..., **options)``; it should set a ``stride`` attribute
    (largest downsampling factor) so input tiers can be checked before training starts.
    """
    options = dict(options or {})
    if kind == "classifier":
        return SmallClassifier(num_classes, **options)
    if kind == "detector":
        if "widths" in options:
            options["widths"] = tuple(options["widths"])
        return ShapesDetector(num_classes, **options)
    module_name, _, class_name = kind.partition(":")
    if not class_name:
        raise ValueError("network.kind %r: expected classifier, detector or package.module:Class" % kind)
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError("network.kind %r: cannot import it (%s)" % (kind, exc)) from exc
    network = cls(num_classes=num_classes, **options)
    if not isinstance(network, nn.Cell):
        raise ValueError(
            "network.kind %r: built a %s, not a mindspore.nn.Cell" % (kind, type(network).__name__)
        )
    return network


def parameter_count(network: nn.Cell) -> int:
    """Number of trainable values (weights and biases; batch-norm statistics are not counted)."""
    return int(sum(p.size for p in network.trainable_params()))


def load_checkpoint_strict(network: nn.Cell, path: str) -> None:
    """Load ``path`` into ``network``; any missing, extra or mis-shaped parameter is an error naming it."""
    import os

    if not os.path.isfile(path):
        raise FileNotFoundError("checkpoint %s: no such file" % path)
    try:
        params = ms.load_checkpoint(path)
    except (ValueError, RuntimeError) as exc:
        raise ValueError("checkpoint %s: cannot be read (%s)" % (path, exc)) from exc
    expected = {p.name: p for p in network.get_parameters()}
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    shape_errors = [
        "%s: checkpoint %s, network %s" % (name, tuple(params[name].shape), tuple(expected[name].shape))
        for name in sorted(set(expected) & set(params))
        if tuple(params[name].shape) != tuple(expected[name].shape)
    ]
    problems = []
    if missing:
        problems.append("missing %s" % ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
    if extra:
        problems.append("unexpected %s" % ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else ""))
    if shape_errors:
        problems.append("shape mismatch " + "; ".join(shape_errors[:8]))
    if problems:
        raise ValueError("checkpoint %s does not match the network: %s" % (path, " | ".join(problems)))
    ms.load_param_into_net(network, params, strict_load=True)
    log.info("loaded checkpoint %s (%d parameters)", path, len(params))
