"""Detector training pieces: target assignment (numpy), the decoded output layout, a loss that learns."""

import numpy as np
import pytest

from quant.detection_loss import assign_targets

ms = pytest.importorskip("mindspore")

from quant.networks import ShapesDetector, anchor_points  # noqa: E402
from quant.training import use_graph_mode_on  # noqa: E402

HW = (128, 128)


@pytest.fixture(scope="module")
def grid():
    return anchor_points(HW, (8, 16))


def positives(boxes, classes, grid):
    centres, strides = grid
    target_boxes, target_classes = assign_targets(
        np.array(boxes, np.float32), np.array(classes), centres, strides
    )
    return target_boxes, target_classes, centres, strides


def test_anchor_points_follow_the_decoder_order(grid):
    centres, strides = grid
    assert len(centres) == 16 * 16 + 8 * 8
    np.testing.assert_array_equal(centres[0], [4, 4])  # first fine cell
    np.testing.assert_array_equal(centres[1], [12, 4])  # row-major: x moves first
    np.testing.assert_array_equal(centres[256], [8, 8])  # first coarse cell
    assert set(strides[:256]) == {8} and set(strides[256:]) == {16}


def test_small_box_trains_the_fine_level_near_its_centre(grid):
    target_boxes, target_classes, centres, strides = positives([[50, 50, 70, 70]], [2], grid)
    chosen = np.flatnonzero(target_classes >= 0)
    assert len(chosen) >= 1 and set(strides[chosen]) == {8}
    assert np.all(np.abs(centres[chosen] - 60) < 8)  # within one cell of the box centre
    np.testing.assert_allclose(target_boxes[chosen], [[60, 60, 20, 20]] * len(chosen))
    assert set(target_classes[chosen]) == {2}


def test_large_box_trains_the_coarse_level_and_medium_boxes_both(grid):
    _, large, _, strides = positives([[10, 10, 90, 90]], [0], grid)
    assert set(strides[large >= 0]) == {16}
    _, medium, _, strides = positives([[40, 40, 88, 88]], [1], grid)
    assert set(strides[medium >= 0]) == {8, 16}


def test_a_cell_claimed_twice_keeps_the_smaller_box(grid):
    target_boxes, target_classes, _, _ = positives([[30, 30, 80, 80], [44, 44, 66, 66]], [0, 1], grid)
    small = np.flatnonzero(target_classes == 1)
    assert len(small) >= 1
    np.testing.assert_allclose(target_boxes[small, 2:], [[22, 22]] * len(small))


def test_no_boxes_means_all_background(grid):
    _, target_classes, _, _ = positives(np.zeros((0, 4)), np.zeros(0, np.int64), grid)
    assert np.all(target_classes == -1)


def test_detector_output_layout_and_loss_decreases(grid):
    """A tiny detector on four generated scenes: YOLOv8 layout, sigmoid scores, and learning happens."""
    from agent.pipeline.preprocess import PreprocessSpec
    from quant.datasets import generate_shapes, network_input
    from quant.detection_loss import DetectionLoss, batch_targets

    use_graph_mode_on("CPU")
    ms.set_seed(0)
    spec = PreprocessSpec()
    data, _ = generate_shapes(4, 3, HW, spec)
    net = ShapesDetector(3, widths=(8, 8, 16, 16))
    centres, strides = grid
    out = net(ms.Tensor(network_input(data.images, spec))).asnumpy()
    assert out.shape == (4, 7, 320)
    assert np.all((out[:, 4:] > 0) & (out[:, 4:] < 1))  # class scores are probabilities
    assert np.all(out[:, 2:4] > 0)  # widths and heights in pixels
    target_boxes, target_classes = batch_targets(data.boxes, data.classes, centres, strides)
    step = ms.nn.TrainOneStepCell(DetectionLoss(net, 3, strides), ms.nn.Adam(net.trainable_params(), 3e-3))
    step.set_train(True)
    inputs = [
        ms.Tensor(network_input(data.images, spec)),
        ms.Tensor(target_boxes),
        ms.Tensor(target_classes.astype(np.int32)),
    ]
    losses = [float(step(*inputs).asnumpy()) for _ in range(25)]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0]
