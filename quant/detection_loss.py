"""Training targets and loss for the anchor-free detector.

Assignment is done on the host in numpy (cheap, and easy to read): a true box is given to the level(s) whose
stride suits its size, and there to the cells whose centre lies inside the box and within one cell of the box
centre (the decoder can move a centre by at most one cell, see :class:`quant.networks.YoloV8Decode`). A cell
claimed by two boxes keeps the smaller one. The loss compares the network's decoded output directly: ``2 (1 -
IoU) + L1 / stride`` on positive cells and binary cross-entropy on every class score, each normalised by the
number of positive cells.
"""

from typing import Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

# A box goes to the fine level (stride 8) when its longer side is below FINE_MAX, to the coarse level (stride
# 16) when above COARSE_MIN; between the two it trains both, which gives medium objects more positive cells.
FINE_MAX = 64.0
COARSE_MIN = 32.0
BOX_IOU_WEIGHT = 2.0
BOX_L1_WEIGHT = 1.0
CLASS_WEIGHT = 1.0
PROB_EPS = 1e-6  # keeps log() finite: the network outputs probabilities (sigmoid inside), not logits


def assign_targets(
    boxes_xyxy: np.ndarray,
    classes: np.ndarray,
    centres: np.ndarray,
    strides: np.ndarray,
) -> Tuple[np.ndarray, np.ndarray]:
    """Targets for one image: (N, 4) cx, cy, w, h of the assigned box and (N,) class id, -1 for background."""
    count = centres.shape[0]
    target_boxes = np.zeros((count, 4), np.float32)
    target_classes = np.full(count, -1, np.int64)
    if len(boxes_xyxy) == 0:
        return target_boxes, target_classes
    best_area = np.full(count, np.inf, np.float32)
    for (x1, y1, x2, y2), cls in zip(boxes_xyxy, classes):
        w, h = x2 - x1, y2 - y1
        if w < 1 or h < 1:
            continue
        size, cx, cy = max(w, h), (x1 + x2) / 2, (y1 + y2) / 2
        level_ok = ((strides == 8) & (size < FINE_MAX)) | ((strides == 16) & (size > COARSE_MIN))
        if not level_ok.any():  # outside both ranges (cannot happen with 8/16, kept for other strides)
            level_ok = strides == strides.max()
        near = (np.abs(centres[:, 0] - cx) < strides) & (np.abs(centres[:, 1] - cy) < strides)
        inside = (centres[:, 0] > x1) & (centres[:, 0] < x2) & (centres[:, 1] > y1) & (centres[:, 1] < y2)
        chosen = level_ok & near & inside
        if not chosen.any():  # tiny box: take the cell holding its centre on its level
            distance = np.where(level_ok, np.abs(centres[:, 0] - cx) + np.abs(centres[:, 1] - cy), np.inf)
            chosen = np.zeros(count, bool)
            chosen[int(np.argmin(distance))] = True
        area = w * h
        chosen &= area < best_area
        target_boxes[chosen] = (cx, cy, w, h)
        target_classes[chosen] = cls
        best_area[chosen] = area
    return target_boxes, target_classes


def batch_targets(
    boxes: Sequence[np.ndarray], classes: Sequence[np.ndarray], centres: np.ndarray, strides: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """Stacked targets for a batch: (B, N, 4) float32 and (B, N) int64."""
    pairs = [assign_targets(b, c, centres, strides) for b, c in zip(boxes, classes)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


class DetectionLoss(nn.Cell):
    """Wraps the detector: ``loss = net_loss(images, target_boxes, target_classes)``.

    ``target_classes`` is (B, N) int32 with -1 for background; ``cell_strides`` (N,) scales the L1 term so
    every level contributes alike.
    """

    def __init__(self, network: nn.Cell, num_classes: int, cell_strides: np.ndarray) -> None:
        super().__init__()
        self.network = network
        self.num_classes = num_classes
        self.inv_stride = ms.Tensor((1.0 / cell_strides).reshape(1, -1, 1).astype(np.float32))
        self.one_hot = ops.OneHot()
        self.on_value = ms.Tensor(1.0, ms.float32)
        self.off_value = ms.Tensor(0.0, ms.float32)

    def construct(self, images: ms.Tensor, target_boxes: ms.Tensor, target_classes: ms.Tensor) -> ms.Tensor:
        output = self.network(images).transpose(0, 2, 1)  # (B, 4 + nc, N) -> (B, N, 4 + nc)
        pred_boxes = output[:, :, :4]
        scores = ops.clip(output[:, :, 4:], PROB_EPS, 1.0 - PROB_EPS)
        positive = (target_classes >= 0).astype(ms.float32)  # (B, N)
        num_positive = ops.maximum(positive.sum(), 1.0)

        one_hot = self.one_hot(
            ops.maximum(target_classes, 0), self.num_classes, self.on_value, self.off_value
        )
        one_hot = one_hot * positive.expand_dims(-1)  # background rows become all zeros
        bce = -(one_hot * ops.log(scores) + (1.0 - one_hot) * ops.log(1.0 - scores))
        class_loss = bce.sum() / num_positive

        iou = box_iou_cxcywh(pred_boxes, target_boxes)
        iou_loss = ((1.0 - iou) * positive).sum() / num_positive
        l1 = (ops.abs(pred_boxes - target_boxes) * self.inv_stride).sum(-1)
        l1_loss = (l1 * positive).sum() / num_positive
        return BOX_IOU_WEIGHT * iou_loss + BOX_L1_WEIGHT * l1_loss + CLASS_WEIGHT * class_loss


def box_iou_cxcywh(a: ms.Tensor, b: ms.Tensor) -> ms.Tensor:
    """Element-wise IoU of (..., 4) cx, cy, w, h boxes (a zero-size target gives 0; callers mask those)."""
    a_x1, a_y1 = a[..., 0] - a[..., 2] / 2, a[..., 1] - a[..., 3] / 2
    a_x2, a_y2 = a[..., 0] + a[..., 2] / 2, a[..., 1] + a[..., 3] / 2
    b_x1, b_y1 = b[..., 0] - b[..., 2] / 2, b[..., 1] - b[..., 3] / 2
    b_x2, b_y2 = b[..., 0] + b[..., 2] / 2, b[..., 1] + b[..., 3] / 2
    inter_w = ops.relu(ops.minimum(a_x2, b_x2) - ops.maximum(a_x1, b_x1))
    inter_h = ops.relu(ops.minimum(a_y2, b_y2) - ops.maximum(a_y1, b_y1))
    inter = inter_w * inter_h
    union = a[..., 2] * a[..., 3] + b[..., 2] * b[..., 3] - inter
    return inter / (union + 1e-7)
