"""quant.evaluation: top-1 and mAP@0.5 against hand-computed cases."""

import numpy as np
import pytest

from quant.evaluation import average_precision, box_iou_matrix, mean_average_precision, top1_accuracy


def det(x1, y1, x2, y2, score, cls):
    return [x1, y1, x2, y2, score, cls]


def test_box_iou_matrix_golden_values():
    a = np.array([[0, 0, 10, 10], [5, 5, 15, 15]], np.float32)
    b = np.array([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]], np.float32)
    iou = box_iou_matrix(a, b)
    assert iou.shape == (2, 3)
    np.testing.assert_allclose(iou[0], [1.0, 0.81, 0.0])
    np.testing.assert_allclose(iou[1, 0], 25 / 175)
    assert box_iou_matrix(np.zeros((0, 4)), b).shape == (0, 3)


def test_map50_hand_computed():
    """Class 0: ranked TP, FP (duplicate of a matched box), FP (nothing there), TP over 3 true boxes.

    recall 1/3, 1/3, 1/3, 2/3; precision 1, 1/2, 1/3, 1/2; all-point AP = 1/3 * 1 + 1/3 * 1/2 = 0.5.
    Class 1: one true box found exactly, AP 1. Class 2 has no true boxes and is left out: mAP = 0.75.
    """
    detections = [
        np.array([det(0, 0, 10, 10, 0.9, 0), det(1, 1, 10, 10, 0.8, 0), det(20, 20, 30, 30, 0.6, 0)]),
        np.array([det(50, 50, 60, 60, 0.7, 0), det(0, 0, 5, 5, 0.5, 1), det(70, 70, 80, 80, 0.95, 2)]),
    ]
    gt_boxes = [
        np.array([[0, 0, 10, 10], [20, 20, 30, 30]], np.float32),
        np.array([[0, 0, 10, 10], [0, 0, 5, 5]], np.float32),
    ]
    gt_classes = [np.array([0, 0]), np.array([0, 1])]
    result = mean_average_precision(detections, gt_boxes, gt_classes, num_classes=3)
    assert result["per_class"][0] == pytest.approx(0.5)
    assert result["per_class"][1] == pytest.approx(1.0)
    assert result["per_class"][2] is None
    assert result["map50"] == pytest.approx(0.75)


def test_map50_needs_iou_of_one_half_and_the_right_class():
    gt_boxes = [np.array([[0, 0, 10, 10]], np.float32)]
    gt_classes = [np.array([0])]
    just_over = [np.array([det(0, 0, 10, 5.1, 0.9, 0)])]  # IoU 0.51
    just_under = [np.array([det(0, 0, 10, 4.9, 0.9, 0)])]  # IoU 0.49
    wrong_class = [np.array([det(0, 0, 10, 10, 0.9, 1)])]
    assert mean_average_precision(just_over, gt_boxes, gt_classes, 2)["map50"] == pytest.approx(1.0)
    assert mean_average_precision(just_under, gt_boxes, gt_classes, 2)["map50"] == 0.0
    assert mean_average_precision(wrong_class, gt_boxes, gt_classes, 2)["map50"] == 0.0


def test_map50_empty_detections_and_ranking_matters():
    gt_boxes = [np.array([[0, 0, 10, 10]], np.float32), np.array([[0, 0, 10, 10]], np.float32)]
    gt_classes = [np.array([0]), np.array([0])]
    none = [np.zeros((0, 6)), np.zeros((0, 6))]
    assert mean_average_precision(none, gt_boxes, gt_classes, 1)["map50"] == 0.0
    # A false positive ranked above both true positives lowers the precision at every recall.
    fp_first = [
        np.array([det(0, 0, 10, 10, 0.5, 0), det(40, 40, 50, 50, 0.9, 0)]),
        np.array([det(0, 0, 10, 10, 0.4, 0)]),
    ]
    fp_last = [
        np.array([det(0, 0, 10, 10, 0.5, 0), det(40, 40, 50, 50, 0.1, 0)]),
        np.array([det(0, 0, 10, 10, 0.4, 0)]),
    ]
    # fp first: precision 0, 1/2, 2/3 at recall 0, 1/2, 1 -> AP = 1/2 * 2/3 + 1/2 * 2/3 = 2/3
    assert mean_average_precision(fp_first, gt_boxes, gt_classes, 1)["map50"] == pytest.approx(2 / 3)
    assert mean_average_precision(fp_last, gt_boxes, gt_classes, 1)["map50"] == pytest.approx(1.0)


def test_average_precision_uses_the_precision_envelope():
    recall = np.array([0.25, 0.5, 0.5, 0.75])
    precision = np.array([0.5, 0.4, 0.6, 0.3])  # the dip at 0.4 is lifted to 0.6 by the envelope
    assert average_precision(recall, precision) == pytest.approx(0.25 * 0.6 + 0.25 * 0.6 + 0.25 * 0.3)


def test_top1():
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert top1_accuracy(logits, np.array([1, 0, 0])) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        top1_accuracy(np.zeros((0, 2)), np.zeros(0, np.int64))
