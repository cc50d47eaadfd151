"""Tests for agent/pipeline/postprocess.py against a greedy per-class NMS and a YOLO decoder written here."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agent.pipeline.postprocess import classify_topk, decode, decode_yolov5, decode_yolov8, nms

SEEDS = range(20)
IOU_THRESHOLDS = (0.3, 0.45, 0.7)


def reference_iou(a, b):
    """IoU of two x1, y1, x2, y2 boxes in float64."""
    inter_w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    inter_h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = inter_w * inter_h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


def reference_nms(boxes, scores, class_ids, iou_threshold):
    """Greedy NMS one class at a time, then merged by descending score (ties: lower index first)."""
    boxes = boxes.astype(np.float64)
    kept = []
    for class_id in np.unique(class_ids):
        members = [i for i in np.argsort(-scores, kind="stable") if class_ids[i] == class_id]
        survivors = []
        for i in members:
            if all(reference_iou(boxes[i], boxes[j]) <= iou_threshold for j in survivors):
                survivors.append(i)
        kept.extend(survivors)
    return sorted(kept, key=lambda i: (-scores[i], i))


def clustered_candidates(seed, clusters=8, per_cluster=12, classes=4):
    """Overlapping boxes around a few centres (some reaching below zero), several classes per cluster."""
    rng = np.random.default_rng(seed)
    centres = rng.uniform(-60, 700, (clusters, 2))
    sizes = rng.uniform(10, 150, (clusters, 2))
    centre = np.repeat(centres, per_cluster, axis=0) + rng.normal(0, 8, (clusters * per_cluster, 2))
    size = np.repeat(sizes, per_cluster, axis=0) * rng.uniform(0.8, 1.2, (clusters * per_cluster, 2))
    boxes = np.concatenate([centre - size / 2, centre + size / 2], axis=1).astype(np.float32)
    scores = rng.uniform(0.05, 1.0, clusters * per_cluster).astype(np.float32)
    class_ids = rng.integers(0, classes, clusters * per_cluster)
    return boxes, scores, class_ids


# --- nms ---


@pytest.mark.parametrize("iou", IOU_THRESHOLDS)
def test_nms_equals_reference_greedy_per_class(iou):
    total_kept = total_suppressed = 0
    for seed in SEEDS:
        boxes, scores, class_ids = clustered_candidates(seed)
        expected = reference_nms(boxes, scores, class_ids, iou)
        kept = nms(boxes, scores, class_ids, iou, max_det=1000)
        assert kept.dtype == np.int64
        assert kept.tolist() == expected, seed
        total_kept += len(expected)
        total_suppressed += len(boxes) - len(expected)
    assert total_kept > 100 and total_suppressed > 100  # the sets really overlap, and not completely


def test_nms_cuts_at_max_det_keeping_the_best():
    boxes, scores, class_ids = clustered_candidates(seed=1)
    everything = nms(boxes, scores, class_ids, 0.45, max_det=1000)
    assert len(everything) > 5
    assert nms(boxes, scores, class_ids, 0.45, max_det=5).tolist() == everything[:5].tolist()


def test_nms_keeps_classes_apart_below_zero():
    # cv2.dnn.NMSBoxesBatched offsets class c by c * (largest coordinate + 1) = c * 101 here: the class-1 box
    # would land on [91, 91, 101, 101] and be suppressed by the class-0 box (IoU 0.68)
    boxes = np.array([[90, 90, 100, 100], [-10, -10, 0, 0]], np.float32)
    kept = nms(boxes, np.array([0.9, 0.8], np.float32), np.array([0, 1]), 0.5, max_det=10)
    assert kept.tolist() == [0, 1]
    # all coordinates negative: the largest coordinate is no measure of the extent at all
    boxes = np.array([[-50, -50, -40, -40], [-50, -50, -40, -40], [-49, -50, -40, -40]], np.float32)
    kept = nms(boxes, np.array([0.9, 0.8, 0.7], np.float32), np.array([0, 1, 0]), 0.5, max_det=10)
    assert kept.tolist() == [0, 1]


def test_nms_golden_threshold_edges():
    # IoU of the first two is exactly 0.5: kept at iou=0.5 (suppression needs IoU > iou), not at 0.49
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 5], [20, 20, 30, 30]], np.float32)
    scores = np.array([0.9, 0.8, 0.5], np.float32)
    classes = np.zeros(3, np.int64)
    assert nms(boxes, scores, classes, 0.5, 10).tolist() == [0, 1, 2]
    assert nms(boxes, scores, classes, 0.49, 10).tolist() == [0, 2]


def test_nms_empty_and_bad_shapes():
    assert nms(np.zeros((0, 4)), np.zeros(0), np.zeros(0), 0.5, 10).shape == (0,)
    with pytest.raises(ValueError, match="boxes_xyxy"):
        nms(np.zeros((3, 5)), np.zeros(3), np.zeros(3), 0.5, 10)
    with pytest.raises(ValueError, match="scores"):
        nms(np.zeros((3, 4)), np.zeros(2), np.zeros(3), 0.5, 10)
    with pytest.raises(ValueError, match="class_ids"):
        nms(np.zeros((3, 4)), np.zeros(3), np.zeros((3, 1)), 0.5, 10)
    with pytest.raises(ValueError, match="iou"):
        nms(np.zeros((3, 4)), np.zeros(3), np.zeros(3), 1.5, 10)
    with pytest.raises(ValueError, match="max_det"):
        nms(np.zeros((3, 4)), np.zeros(3), np.zeros(3), 0.5, 0)


box_corners = hnp.arrays(
    np.float32, st.tuples(st.integers(0, 40), st.just(4)), elements=st.floats(-100, 700, width=32)
)


@settings(max_examples=100, deadline=None)
@given(
    corners=box_corners,
    sizes=hnp.arrays(np.float32, 40, elements=st.floats(1, 200, width=32)),
    score_seed=st.integers(0, 2**32 - 1),
    classes=st.integers(1, 3),
    iou=st.floats(0.1, 0.9),
)
def test_nms_invariants(corners, sizes, score_seed, classes, iou):
    count = len(corners)
    boxes = corners.copy()
    boxes[:, 2:] = boxes[:, :2] + sizes[:count, None]  # positive width and height
    rng = np.random.default_rng(score_seed)
    scores = rng.uniform(0.01, 1.0, count).astype(np.float32)
    class_ids = rng.integers(0, classes, count)
    kept = nms(boxes, scores, class_ids, iou, max_det=1000).tolist()
    assert len(set(kept)) == len(kept)
    assert all(scores[a] >= scores[b] for a, b in zip(kept, kept[1:]))
    for position, i in enumerate(kept):  # no two kept boxes of one class overlap above iou
        for j in kept[position + 1 :]:
            if class_ids[i] == class_ids[j]:
                assert reference_iou(boxes[i], boxes[j]) <= iou + 1e-6
    for i in set(range(count)) - set(kept):  # every dropped box was suppressed by a kept box of its class
        assert any(
            class_ids[j] == class_ids[i]
            and scores[j] >= scores[i]
            and reference_iou(boxes[i], boxes[j]) > iou - 1e-6
            for j in kept
        )


# --- YOLO decoding ---


def yolov8_output(seed, batch=2, classes=5, anchors=600, objects=10):
    """(B, 4+nc, N) with tiny background scores and clusters of confident anchors per object."""
    rng = np.random.default_rng(seed)
    output = np.empty((batch, 4 + classes, anchors), np.float32)
    output[:, 4:] = rng.uniform(0, 0.05, (batch, classes, anchors))
    output[:, :2] = rng.uniform(-20, 660, (batch, 2, anchors))
    output[:, 2:4] = rng.uniform(5, 120, (batch, 2, anchors))
    for image in output:
        for members in rng.choice(anchors, (objects, 12), replace=False):
            image[:2, members] = rng.uniform(0, 640, (2, 1)) + rng.normal(0, 5, (2, members.size))
            image[2:4, members] = rng.uniform(20, 150, (2, 1)) * rng.uniform(0.85, 1.15, (2, members.size))
            image[4 + rng.integers(0, classes), members] = rng.uniform(0.1, 1.0, members.size)
    return output


def reference_decode_yolov8(output, conf, iou, max_det):
    results = []
    for image in output:
        rows = image.T.astype(np.float64)  # (N, 4+nc)
        class_ids = rows[:, 4:].argmax(axis=1)
        scores = rows[:, 4:].max(axis=1)
        keep = scores > conf
        cx, cy, w, h = rows[keep, :4].T
        boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
        kept = reference_nms(boxes, scores[keep], class_ids[keep], iou)[:max_det]
        detections = np.zeros((len(kept), 6))
        detections[:, :4] = boxes[kept]
        detections[:, 4] = scores[keep][kept]
        detections[:, 5] = class_ids[keep][kept]
        results.append(detections)
    return results


@pytest.mark.parametrize("seed", range(8))
def test_decode_yolov8_equals_reference(seed):
    output = yolov8_output(seed)
    conf, iou, max_det = 0.25, IOU_THRESHOLDS[seed % 3], 300
    results = decode_yolov8(output, conf, iou, max_det)
    expected = reference_decode_yolov8(output, conf, iou, max_det)
    assert len(results) == 2
    for actual, wanted in zip(results, expected):
        assert actual.dtype == np.float32 and actual.shape == wanted.shape and len(wanted) > 3
        np.testing.assert_array_equal(actual[:, 5], wanted[:, 5])
        np.testing.assert_allclose(actual[:, :5], wanted[:, :5], rtol=1e-6, atol=1e-4)


def test_decode_yolov8_golden():
    output = np.zeros((1, 6, 4), np.float32)  # 2 classes, 4 anchors
    output[0, :4] = np.array([[50, 50, 20, 20], [52, 50, 20, 20], [52, 50, 20, 20], [200, 200, 10, 10]]).T
    output[0, 4] = [0.9, 0.8, 0.1, 0.2]  # anchor 1 overlaps anchor 0 (IoU 0.82) in class 0: suppressed
    output[0, 5] = [0.1, 0.1, 0.7, 0.25]  # anchor 3 is not above conf=0.25; anchor 2 is class 1
    (detections,) = decode_yolov8(output, conf=0.25, iou=0.45, max_det=10)
    np.testing.assert_allclose(detections, [[40, 40, 60, 60, 0.9, 0], [42, 40, 62, 60, 0.7, 1]], rtol=1e-6)


def v5_from_v8(v8_output, objectness):
    """(B, 4+nc, N) plus (B, N) objectness -> (B, N, 5+nc) carrying the same class scores."""
    boxes_scores = v8_output.transpose(0, 2, 1)  # (B, N, 4+nc)
    return np.concatenate([boxes_scores[..., :4], objectness[..., None], boxes_scores[..., 4:]], axis=2)


def test_yolov5_with_unit_objectness_equals_yolov8():
    v8 = yolov8_output(seed=3)
    v5 = v5_from_v8(v8, np.ones(v8.shape[::2], np.float32))
    for a, b in zip(decode_yolov5(v5, 0.25, 0.45, 300), decode_yolov8(v8, 0.25, 0.45, 300)):
        assert len(a) > 3
        np.testing.assert_array_equal(a, b)


def test_yolov5_objectness_times_class_equals_yolov8_scores():
    rng = np.random.default_rng(4)
    class_probabilities = yolov8_output(seed=4)
    objectness = rng.uniform(0.2, 1.0, class_probabilities.shape[::2]).astype(np.float32)  # (B, N)
    v5 = v5_from_v8(class_probabilities, objectness)
    v8 = class_probabilities.copy()
    v8[:, 4:] *= objectness[:, None, :]
    for a, b in zip(decode_yolov5(v5, 0.25, 0.45, 300), decode_yolov8(v8, 0.25, 0.45, 300)):
        assert len(a) > 3
        np.testing.assert_array_equal(a, b)


def test_yolov5_objectness_gates_candidates():
    v5 = np.zeros((1, 2, 7), np.float32)  # 2 anchors, 2 classes
    v5[0, 0] = [10, 10, 4, 4, 0.9, 0.5, 0.8]  # score 0.72, class 1
    v5[0, 1] = [50, 50, 4, 4, 0.2, 1.0, 1.0]  # objectness below conf: never a candidate
    (detections,) = decode_yolov5(v5, conf=0.25, iou=0.45, max_det=10)
    np.testing.assert_allclose(detections, [[8, 8, 12, 12, 0.72, 1]], rtol=1e-6)


@pytest.mark.parametrize("decoder, layout", [(decode_yolov8, "v8"), (decode_yolov5, "v5")])
def test_nothing_above_conf_gives_empty_arrays(decoder, layout):
    v8 = yolov8_output(seed=5)
    v8[:, 4:] = np.minimum(v8[:, 4:], 0.25)  # equal to conf is not above it
    output = v8 if layout == "v8" else v5_from_v8(v8, np.ones(v8.shape[::2], np.float32))
    results = decoder(output, 0.25, 0.45, 300)
    assert len(results) == 2
    for detections in results:
        assert detections.shape == (0, 6) and detections.dtype == np.float32
    empty_batch = output[:0]
    assert decoder(empty_batch, 0.25, 0.45, 300) == []
    no_anchors = output[:, :, :0] if layout == "v8" else output[:, :0]
    assert [d.shape for d in decoder(no_anchors, 0.25, 0.45, 300)] == [(0, 6), (0, 6)]


def test_decode_respects_max_det_on_separate_boxes():
    anchors = 400
    output = np.zeros((1, 5, anchors), np.float32)  # one class, boxes on a grid: none overlap
    grid = np.arange(anchors)
    output[0, 0], output[0, 1] = (grid % 20) * 32 + 16, (grid // 20) * 32 + 16
    output[0, 2:4] = 20
    output[0, 4] = np.random.default_rng(6).permutation(anchors) / anchors * 0.5 + 0.3
    (detections,) = decode_yolov8(output, 0.25, 0.45, max_det=100)
    assert detections.shape == (100, 6)
    np.testing.assert_allclose(detections[:, 4], np.sort(output[0, 4])[::-1][:100])
    (everything,) = decode_yolov8(output, 0.25, 0.45, max_det=1000)
    assert everything.shape == (anchors, 6)


def test_decode_yolov8_reads_float16_outputs():
    v8 = yolov8_output(seed=7)
    half = v8.astype(np.float16)
    for a, b in zip(
        decode_yolov8(half, 0.25, 0.45, 300), decode_yolov8(half.astype(np.float32), 0.25, 0.45, 300)
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: decode_yolov8(np.zeros((1, 84)), 0.25, 0.45, 300), "output"),
        (lambda: decode_yolov8(np.zeros((1, 4, 10)), 0.25, 0.45, 300), "output"),
        (lambda: decode_yolov5(np.zeros((1, 10, 5)), 0.25, 0.45, 300), "output"),
        (lambda: decode_yolov8(np.zeros((1, 84, 10), np.int32), 0.25, 0.45, 300), "output"),
        (lambda: decode_yolov8(np.zeros((1, 84, 10)), 1.25, 0.45, 300), "conf"),
        (lambda: decode_yolov8(np.zeros((1, 84, 10)), "0.25", 0.45, 300), "conf"),
        (lambda: decode_yolov5(np.zeros((1, 10, 85)), 0.25, -0.1, 300), "iou"),
        (lambda: decode_yolov5(np.zeros((1, 10, 85)), 0.25, 0.45, 2.5), "max_det"),
    ],
)
def test_decode_rejects_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# --- classification ---


def test_classify_topk_equals_argsort_reference():
    rng = np.random.default_rng(8)
    logits = rng.normal(0, 3, (4, 1000)).astype(np.float32)
    results = classify_topk(logits, k=5)
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    for row, result in zip(probabilities, results):
        expected_ids = np.argsort(-row, kind="stable")[:5]
        assert [class_id for class_id, _ in result] == expected_ids.tolist()
        np.testing.assert_allclose([p for _, p in result], row[expected_ids], rtol=1e-12)
        assert all(isinstance(class_id, int) and isinstance(p, float) for class_id, p in result)


def test_softmax_sums_to_one_and_is_stable_for_large_logits():
    logits = np.array([[1000.0, 999.0, 998.0], [-1000.0, -1001.0, -1000.5]])
    results = classify_topk(logits, k=10)  # k above nc is capped at nc
    for result in results:
        assert len(result) == 3
        assert abs(sum(p for _, p in result) - 1.0) < 1e-12
    assert [c for c, _ in results[0]] == [0, 1, 2] and [c for c, _ in results[1]] == [0, 2, 1]
    np.testing.assert_allclose([p for _, p in results[0]], np.exp([0, -1, -2]) / np.exp([0, -1, -2]).sum())


def test_classify_without_softmax_returns_raw_values():
    assert classify_topk(np.array([[0.1, 0.7, 0.2]]), k=2, softmax=False) == [[(1, 0.7), (2, 0.2)]]


@pytest.mark.parametrize(
    "logits, k, name",
    [(np.zeros(5), 1, "logits"), (np.zeros((1, 0)), 1, "logits"), (np.zeros((1, 5)), 0, "k")],
)
def test_classify_rejects_bad_arguments(logits, k, name):
    with pytest.raises(ValueError, match=name):
        classify_topk(logits, k)


# --- dispatch ---


def test_decode_dispatches_by_task():
    post = {"conf": 0.25, "iou": 0.45, "top_k": 2, "max_det": 50}
    v8 = yolov8_output(seed=9)
    for a, b in zip(decode("detect-yolov8", v8, post), decode_yolov8(v8, 0.25, 0.45, 50)):
        np.testing.assert_array_equal(a, b)
    v5 = v5_from_v8(v8, np.ones(v8.shape[::2], np.float32))
    for a, b in zip(decode("detect-yolov5", v5, SimpleNamespace(**post)), decode_yolov8(v8, 0.25, 0.45, 50)):
        np.testing.assert_array_equal(a, b)
    assert decode("classify", np.array([[0.0, 2.0, 1.0]]), post)[0][0][0] == 1


def test_decode_names_bad_task_and_missing_settings():
    with pytest.raises(ValueError, match="task"):
        decode("segment", np.zeros((1, 3)), {})
    with pytest.raises(ValueError, match="post.top_k"):
        decode("classify", np.zeros((1, 3)), {"conf": 0.25})
    with pytest.raises(ValueError, match="post.conf"):
        decode("detect-yolov8", np.zeros((1, 6, 3)), SimpleNamespace(iou=0.5))
