"""The lane's comparison itself (compare.py), on made-up results: it passes what its bounds allow and nothing else."""

from tests.system.arm64.compare import compare


def result(*dets):
    return {"detections": [{"label": "c%d" % c, "class_id": c, "score": s, "box": list(b)} for c, s, b in dets]}


BOX = (10.0, 20.0, 110.0, 220.0)


def test_within_the_bounds_matches_and_reports_the_largest_difference():
    report = compare({"f": result((0, 0.9, BOX))}, {"f": result((0, 0.895, (10.0, 20.9, 110.0, 220.0)))}, 0.25)
    assert report["problems"] == [] and report["matched"] == 1 and report["identical"] == 0
    assert abs(report["max_box_px"][0] - 0.9) < 1e-9 and abs(report["max_score"][0] - 0.005) < 1e-9


def test_a_box_or_score_beyond_the_bounds_another_class_or_a_missing_detection_fails():
    for arm in (result((0, 0.9, (10.0, 21.2, 110.0, 220.0))), result((0, 0.88, BOX)), result((1, 0.9, BOX)),
                result()):
        assert compare({"f": result((0, 0.9, BOX))}, {"f": arm}, 0.25)["problems"], arm
    assert compare({"f": result()}, {"f": result((0, 0.9, BOX))}, 0.25)["problems"]  # extra on Arm: fails too
    assert compare({"f": result()}, {}, 0.25)["problems"]  # a frame without a result


def test_marginal_detections_may_differ_and_are_counted():
    report = compare({"f": result((0, 0.9, BOX), (2, 0.27, BOX))}, {"f": result((0, 0.9, BOX))}, 0.25)
    assert report["problems"] == [] and report["marginal"] == 1 and report["marginal_unmatched"] == 1
