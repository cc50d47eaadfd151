"""agent.devtools.scenes: the scene generator behind the demo detector's data and the box's sample frames."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.devtools.scenes import MAX_REL_SIZE, MIN_REL_SIZE, SHAPE_LABELS, generate_scene, generate_scenes


def test_same_seed_same_scene():
    a = generate_scene(np.random.default_rng(5), (120, 160))
    b = generate_scene(np.random.default_rng(5), (120, 160))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    c = generate_scene(np.random.default_rng(6), (120, 160))
    assert not np.array_equal(a[0], c[0])


@settings(max_examples=25, deadline=None)
@given(
    height=st.integers(min_value=32, max_value=400),
    width=st.integers(min_value=32, max_value=400),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_boxes_are_inside_the_image_and_sized_relative_to_it(height, width, seed):
    image, boxes, classes = generate_scene(np.random.default_rng(seed), (height, width), max_objects=5)
    assert image.shape == (height, width, 3) and image.dtype == np.uint8
    assert boxes.dtype == np.float32 and boxes.shape == (len(classes), 4)
    assert classes.dtype == np.int64 and set(classes.tolist()) <= set(range(len(SHAPE_LABELS)))
    assert np.all(boxes[:, 0] >= 0) and np.all(boxes[:, 2] <= width)
    assert np.all(boxes[:, 1] >= 0) and np.all(boxes[:, 3] <= height)
    longer = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    short = min(height, width)
    # A rotated square's box is up to sqrt(2) wider than its side; clipping can only shrink it.
    assert np.all(longer <= MAX_REL_SIZE * short * 1.5 + 2)
    assert np.all(longer >= MIN_REL_SIZE * short * 0.6 - 2)


def test_full_hd_scene_objects_stay_detectable_after_letterboxing_to_256():
    """A 1920x1080 frame letterboxed to 256x256 scales by 256/1920: objects must keep >= 10 pixels."""
    _, boxes, _ = generate_scene(np.random.default_rng(0), (1080, 1920), max_objects=6, min_objects=6)
    assert len(boxes) >= 4
    longer = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]) * 256 / 1920
    assert longer.min() >= 10


def test_objects_are_drawn_where_the_boxes_say():
    """The centre of each circle and square has the object's colour, not the background's."""
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(10):
        image, boxes, classes = generate_scene(rng, (240, 320))
        for (x1, y1, x2, y2), cls in zip(boxes, classes):
            if SHAPE_LABELS[cls] == "triangle":
                continue  # a triangle's box centre can sit near an edge
            cx, cy = int((x1 + x2) / 2), int((y1 + y2) / 2)
            inner = image[cy - 1 : cy + 2, cx - 1 : cx + 2].reshape(-1, 3).astype(int)
            assert np.ptp(inner, axis=0).max() <= 4, (
                "flat fill expected at the centre of a %s" % SHAPE_LABELS[cls]
            )
            checked += 1
    assert checked >= 10


def test_generate_scenes_is_reproducible_and_rejects_bad_sizes():
    first = generate_scenes(3, 4, (64, 96))
    again = generate_scenes(3, 4, (64, 96))
    assert len(first) == 4
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(first, again))
    with pytest.raises(ValueError, match="too small"):
        generate_scene(np.random.default_rng(0), (16, 64))
