"""agent/pipeline/agreement.py: one candidate's detections against a reference's, strict and score-aware, with
labels compared by name, the score distance, the box offset and a bootstrap interval over frames."""

import numpy as np
import pytest

from agent.pipeline.agreement import (
    MIN_FRAMES,
    AgreementMeter,
    iou_matrix,
    match_detections,
    wasserstein1,
)

CONF = 0.25
LABELS = ["circle", "square", "triangle"]


def dets(*rows):
    return np.array(rows, np.float32).reshape(-1, 6)


def box(x, y, score, cls, size=40.0):
    return [x, y, x + size, y + size, score, cls]


def test_identical_detections_agree_fully():
    meter = AgreementMeter(CONF, reference_labels=LABELS, candidate_labels=LABELS)
    frame = dets(box(10, 10, 0.9, 0), box(100, 50, 0.6, 2))
    meter.add(frame, frame.copy())
    report = meter.report()
    for reading in ("strict", "score_aware"):
        assert report[reading]["f1"] == 1.0 and report[reading]["tp"] == 2, report
    assert report["mean_box_offset_px"] == 0.0 and report["score_wasserstein1"] == 0.0
    assert report["detections_per_frame_change"] == 0.0


def test_a_detection_scored_just_under_conf_is_threshold_noise_not_a_disagreement():
    """Reported on one side (0.27), scored 0.23 on the other: strict counts it lost, score-aware does not; the
    same the other way round."""
    meter = AgreementMeter(CONF, reference_labels=LABELS, candidate_labels=LABELS)
    meter.add(dets(box(10, 10, 0.27, 0), box(100, 10, 0.9, 1)), dets(box(11, 10, 0.23, 0), box(100, 10, 0.9, 1)))
    meter.add(dets(box(10, 10, 0.22, 0)), dets(box(10, 10, 0.26, 0)))
    report = meter.report()
    assert (report["strict"]["tp"], report["strict"]["fn"], report["strict"]["fp"]) == (1, 1, 1)
    assert report["strict"]["f1"] == pytest.approx(0.5)
    assert (report["score_aware"]["tp"], report["score_aware"]["fn"], report["score_aware"]["fp"]) == (3, 0, 0)
    assert report["score_aware"]["f1"] == 1.0


@pytest.mark.parametrize("candidate", [
    dets(),  # lost
    dets(box(10, 10, 0.1, 0)),  # scored far under conf: below the low threshold
    dets(box(60, 10, 0.9, 0)),  # moved: IoU 0
    dets(box(10, 10, 0.9, 1)),  # another class
], ids=["lost", "scored-far-under", "moved", "class-changed"])
def test_a_lost_moved_or_relabelled_detection_is_a_disagreement_both_ways(candidate):
    meter = AgreementMeter(CONF, reference_labels=LABELS, candidate_labels=LABELS)
    meter.add(dets(box(10, 10, 0.9, 0)), candidate)
    report = meter.report()
    assert report["strict"]["fn"] == report["score_aware"]["fn"] == 1
    assert report["score_aware"]["f1"] < 1.0 and report["strict"]["recall"] == 0.0


def test_labels_are_compared_by_name_so_a_shifted_label_file_disagrees():
    """The same class ids with the candidate's labels off by one: every detection is a disagreement, named."""
    shifted = LABELS[1:] + LABELS[:1]
    frame = dets(box(10, 10, 0.9, 0), box(100, 10, 0.8, 1))
    meter = AgreementMeter(CONF, reference_labels=LABELS, candidate_labels=shifted)
    meter.add(frame, frame.copy())
    report = meter.report()
    assert report["score_aware"]["f1"] == 0.0 and report["strict"]["f1"] == 0.0
    assert report["per_label"]["circle"]["fn"] == 1 and report["per_label"]["square"]["fp"] == 1
    same = AgreementMeter(CONF)  # without labels the ids are compared: the shift is invisible
    same.add(frame, frame.copy())
    assert same.report()["strict"]["f1"] == 1.0


def test_detections_below_the_low_threshold_are_ignored_and_the_margin_is_checked():
    meter = AgreementMeter(CONF)
    assert meter.low == pytest.approx(0.2)
    meter.add(dets(box(10, 10, 0.1, 0)), dets())
    assert meter.report()["strict"]["tp"] == meter.report()["strict"]["fn"] == 0
    for margin in (0.0, CONF, -0.1):
        with pytest.raises(ValueError, match="margin"):
            AgreementMeter(CONF, margin=margin)


def test_box_offset_score_distance_and_detection_change():
    meter = AgreementMeter(CONF)
    meter.add(dets(box(10, 10, 0.9, 0), box(100, 10, 0.5, 1)), dets(box(12, 10, 0.8, 0), box(100, 12, 0.4, 1),
                                                                      box(200, 10, 0.7, 2)))
    report = meter.report()
    # pairs offset by 2 px on x1 and x2 (mean of 4 corners: 1.0), and on y1, y2 (1.0)
    assert report["mean_box_offset_px"] == pytest.approx(1.0)
    assert report["score_wasserstein1"] == pytest.approx(wasserstein1(np.array([0.9, 0.5]),
                                                                      np.array([0.8, 0.4, 0.7])), abs=1e-6)
    assert report["detections_per_frame_change"] == 1.0 and report["strict"]["fp"] == 1


def test_wasserstein1_is_the_mean_gap_of_sorted_equal_samples_and_zero_when_one_side_is_empty():
    rng = np.random.RandomState(0)
    a, b = rng.rand(50), rng.rand(50) * 0.5 + 0.3
    assert wasserstein1(a, b) == pytest.approx(np.mean(np.abs(np.sort(a) - np.sort(b))))
    assert wasserstein1(a, a + 0.1) == pytest.approx(0.1)
    assert wasserstein1(np.array([0.0]), np.array([1.0])) == pytest.approx(1.0)
    assert wasserstein1(a, np.zeros(0)) == 0.0


def test_the_interval_holds_the_estimate_and_narrows_with_more_frames():
    rng = np.random.RandomState(3)

    def run(frames):
        meter = AgreementMeter(CONF)
        for _ in range(frames):
            reference = dets(box(10, 10, 0.9, 0), box(100, 10, 0.8, 1))
            candidate = reference.copy() if rng.rand() < 0.8 else reference[:1].copy()
            meter.add(reference, candidate)
        return meter.report()["strict"]

    small, large = run(20), run(400)
    for reading in (small, large):
        low, high = reading["f1_interval"]
        assert low <= reading["f1"] <= high and low < high, reading
    assert large["f1_interval"][1] - large["f1_interval"][0] < 0.5 * (small["f1_interval"][1] -
                                                                     small["f1_interval"][0])


def test_a_small_sample_says_so_plainly():
    meter = AgreementMeter(CONF)
    for _ in range(MIN_FRAMES - 1):
        meter.add(dets(box(10, 10, 0.9, 0)), dets(box(10, 10, 0.9, 0)))
    assert "a small sample: %d frame(s)" % (MIN_FRAMES - 1) in meter.report()["warning"]


def test_match_detections_pairs_same_label_overlaps_only_best_score_first():
    want = dets(box(0, 0, 0.9, 0, 10), box(0, 0, 0.8, 1, 10))
    got = dets(box(0, 0, 0.7, 1, 10), box(1, 0, 0.6, 0, 10))
    assert match_detections(want, got) == [(0, 1), (1, 0)]
    assert match_detections(want[:1], got[:1]) == []  # overlaps exactly, another class
    assert match_detections(want, dets()) == [] and match_detections(dets(), got) == []
    assert iou_matrix(want[:1], got[1:])[0, 0] == pytest.approx(90 / 110)
