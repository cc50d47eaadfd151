"""Training loops for the float and the quantization-aware phases, with one progress line per epoch.

Batches have a fixed size (the last partial batch of an epoch is dropped in training and padded in inference)
so MindSpore's graph mode compiles each network once per shape instead of once per odd batch.
"""

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn

from agent.pipeline.preprocess import PreprocessSpec
from quant.datasets import ImageSet, network_input
from quant.detection_loss import DetectionLoss, batch_targets
from quant.networks import anchor_points

log = logging.getLogger(__name__)

Batch = Tuple[np.ndarray, ...]


def use_graph_mode_on(target: str = "CPU") -> None:
    """Graph mode on ``target`` for this process. MindSpore fixes the device once anything has run (a MindIR read
    back, a box backend in the same process): asking for that same device again is fine, another one is an error."""
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        ms.set_device(target)
    except RuntimeError:
        if ms.get_context("device_target") != target:
            raise


@dataclass(frozen=True)
class TrainSettings:
    epochs: int
    batch_size: int
    learning_rate: float
    weight_decay: float = 1e-4
    seed: int = 0
    warmup_epochs: float = 0.5  # linear warm-up, then cosine decay to 5 % of the peak


def learning_rates(settings: TrainSettings, steps_per_epoch: int) -> List[float]:
    """Per-step rates: linear warm-up then cosine decay (a list, which MindSpore optimizers accept)."""
    total = max(1, settings.epochs * steps_per_epoch)
    warmup = min(total - 1, int(settings.warmup_epochs * steps_per_epoch))
    floor = settings.learning_rate * 0.05
    rates = []
    for step in range(total):
        if step < warmup:
            rates.append(settings.learning_rate * (step + 1) / (warmup + 1))
        else:
            progress = (step - warmup) / max(1, total - warmup)
            rates.append(floor + (settings.learning_rate - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    return rates


def fit(
    loss_network: nn.Cell,
    trainable: Sequence[ms.Parameter],
    make_batches: Callable[[np.random.Generator], Iterator[Batch]],
    steps_per_epoch: int,
    settings: TrainSettings,
    phase: str,
    on_epoch_end: Optional[Callable[[int], None]] = None,
) -> List[float]:
    """Run ``settings.epochs`` epochs of Adam on ``loss_network``; returns the mean loss of each epoch."""
    if steps_per_epoch < 1:
        raise ValueError("%s: fewer training samples than one batch (%d)" % (phase, settings.batch_size))
    optimizer = nn.Adam(
        list(trainable),
        learning_rate=learning_rates(settings, steps_per_epoch),
        weight_decay=settings.weight_decay,
    )
    step = nn.TrainOneStepCell(loss_network, optimizer)
    step.set_train(True)
    rng = np.random.default_rng(settings.seed)
    history = []
    for epoch in range(1, settings.epochs + 1):
        started = time.monotonic()
        losses = [float(step(*(ms.Tensor(a) for a in batch)).asnumpy()) for batch in make_batches(rng)]
        mean_loss = float(np.mean(losses))
        if not math.isfinite(mean_loss):
            raise RuntimeError(
                "%s: loss became %s in epoch %d; lower the learning rate" % (phase, mean_loss, epoch)
            )
        history.append(mean_loss)
        log.info(
            "%s epoch %d/%d  loss %.4f  (%.1f s)",
            phase,
            epoch,
            settings.epochs,
            mean_loss,
            time.monotonic() - started,
        )
        if on_epoch_end is not None:
            on_epoch_end(epoch)
    step.set_train(False)
    loss_network.set_train(False)
    return history


def _batches(count: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    order = rng.permutation(count)
    for start in range(0, count - batch_size + 1, batch_size):
        yield order[start : start + batch_size]


def train_classifier(
    network: nn.Cell, data: ImageSet, spec: PreprocessSpec, settings: TrainSettings, phase: str
) -> List[float]:
    """Softmax cross-entropy on integer labels."""
    assert data.labels is not None
    loss = nn.WithLossCell(network, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))

    def make_batches(rng: np.random.Generator) -> Iterator[Batch]:
        for idx in _batches(len(data), settings.batch_size, rng):
            yield network_input(data.images[idx], spec), data.labels[idx].astype(np.int32)

    return fit(
        loss, network.trainable_params(), make_batches, len(data) // settings.batch_size, settings, phase
    )


def mirror_boxes(boxes: np.ndarray, width: int) -> np.ndarray:
    """x1, y1, x2, y2 boxes of an image flipped left-right."""
    return (
        np.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], axis=1)
        if len(boxes)
        else boxes
    )


def train_detector(
    network: nn.Cell,
    data: ImageSet,
    spec: PreprocessSpec,
    settings: TrainSettings,
    input_hw: Tuple[int, int],
    strides: Sequence[int],
    num_classes: int,
    phase: str,
) -> List[float]:
    """Detector training with random horizontal flips; targets are assigned per batch after the flip."""
    centres, cell_strides = anchor_points(input_hw, strides)
    loss = DetectionLoss(network, num_classes, cell_strides)

    def make_batches(rng: np.random.Generator) -> Iterator[Batch]:
        for idx in _batches(len(data), settings.batch_size, rng):
            images = data.images[idx].copy()
            boxes = [data.boxes[i] for i in idx]
            classes = [data.classes[i] for i in idx]
            flip = rng.random(len(idx)) < 0.5
            images[flip] = images[flip][:, :, ::-1]  # (B, H, W, 3): reverse W
            boxes = [mirror_boxes(b, input_hw[1]) if f else b for b, f in zip(boxes, flip)]
            target_boxes, target_classes = batch_targets(boxes, classes, centres, cell_strides)
            yield network_input(images, spec), target_boxes, target_classes.astype(np.int32)

    return fit(
        loss, network.trainable_params(), make_batches, len(data) // settings.batch_size, settings, phase
    )


def predict(network: nn.Cell, images_bgr: np.ndarray, spec: PreprocessSpec, batch_size: int) -> np.ndarray:
    """Raw output 0 for every image, in inference mode, in fixed-size batches (the last one padded)."""
    network.set_train(False)
    outputs = []
    for start in range(0, len(images_bgr), batch_size):
        chunk = images_bgr[start : start + batch_size]
        real = len(chunk)
        if real < batch_size:  # pad with copies of the last image; their outputs are dropped
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, axis=0)])
        result = network(ms.Tensor(network_input(chunk, spec)))
        outputs.append(result.asnumpy()[:real])
    return np.concatenate(outputs)
