"""Synthetic "shapes" scenes with known ground truth: the demo detector's data and the box's sample frames.

One generator serves both halves: the host trains and evaluates the demo detector on these scenes, and the
box's ``atlas-edge demo`` feeds them as sample frames whose true boxes are known, so a result can be checked
by eye or by test. Objects are sized relative to the scene's shorter side, so a 1920x1080 scene letterboxed
down to a 256x256 model tier still shows objects of 10-40 pixels. numpy and OpenCV only (runs on the box,
Python 3.8).
"""

import math
from typing import List, Tuple

import cv2
import numpy as np

SHAPE_LABELS: Tuple[str, ...] = ("circle", "square", "triangle")

# Object size as a fraction of the scene's shorter side (side of the square / diameter of the circle).
MIN_REL_SIZE = 0.09
MAX_REL_SIZE = 0.28
# Placement retries per object before giving up on it; keeps crowded scenes bounded in time.
PLACEMENT_TRIES = 20
# Objects may touch but not hide each other: overlap is limited by intersection over the smaller box.
MAX_OVERLAP = 0.15
# Minimum mean absolute BGR difference between an object and the background under it.
MIN_CONTRAST = 60.0


def _background(rng: np.random.Generator, hw: Tuple[int, int]) -> np.ndarray:
    """Textured, noisy background: a colour gradient, coarse blotches, a few thin lines and pixel noise."""
    h, w = hw
    base = rng.uniform(40, 215, size=3)
    tilt = rng.uniform(-50, 50, size=(2, 3))
    ys = np.linspace(-0.5, 0.5, h, dtype=np.float32)[:, None, None]
    xs = np.linspace(-0.5, 0.5, w, dtype=np.float32)[None, :, None]
    image = base[None, None, :] + ys * tilt[0][None, None, :] + xs * tilt[1][None, None, :]
    coarse = rng.normal(0.0, 18.0, size=(max(2, h // 32), max(2, w // 32), 3)).astype(np.float32)
    image = image + cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC)
    image = np.clip(image, 0, 255).astype(np.uint8)
    for _ in range(int(rng.integers(2, 7))):
        p1 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        p2 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        cv2.line(image, p1, p2, colour, thickness=max(1, min(h, w) // 200), lineType=cv2.LINE_AA)
    noise = rng.normal(0.0, 8.0, size=image.shape).astype(np.float32)
    return np.clip(image.astype(np.float32) + noise, 0, 255).astype(np.uint8)


def _polygon(class_id: int, cx: float, cy: float, size: float, angle: float) -> np.ndarray:
    """Vertices (k, 2) of a square or triangle of the given size, rotated by ``angle`` radians."""
    if SHAPE_LABELS[class_id] == "square":
        corners = np.array([[-0.5, -0.5], [0.5, -0.5], [0.5, 0.5], [-0.5, 0.5]], dtype=np.float64)
    else:  # an equilateral-ish triangle pointing up before rotation
        corners = np.array([[0.0, -0.55], [0.5, 0.4], [-0.5, 0.4]], dtype=np.float64)
    rot = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    return corners @ rot.T * size + np.array([cx, cy])


def _overlaps(box: np.ndarray, placed: List[np.ndarray]) -> bool:
    for other in placed:
        ix = min(box[2], other[2]) - max(box[0], other[0])
        iy = min(box[3], other[3]) - max(box[1], other[1])
        if ix <= 0 or iy <= 0:
            continue
        smaller = min((box[2] - box[0]) * (box[3] - box[1]), (other[2] - other[0]) * (other[3] - other[1]))
        if ix * iy / smaller > MAX_OVERLAP:
            return True
    return False


def _contrasting_colour(rng: np.random.Generator, under: np.ndarray) -> Tuple[int, int, int]:
    mean = under.reshape(-1, 3).mean(axis=0)
    colour = rng.integers(0, 256, size=3)
    for _ in range(20):
        if np.abs(colour - mean).mean() >= MIN_CONTRAST:
            break
        colour = rng.integers(0, 256, size=3)
    else:  # fall back to the inverse of the background, always far enough away
        colour = 255 - mean.astype(np.int64)
    return int(colour[0]), int(colour[1]), int(colour[2])


def generate_scene(
    rng: np.random.Generator,
    hw: Tuple[int, int],
    max_objects: int = 6,
    min_objects: int = 1,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw one scene of shape ``hw`` = (height, width).

    Returns the image (uint8 BGR, (h, w, 3)), the true boxes (float32 (k, 4) x1, y1, x2, y2 in pixels, tight
    around the drawn shape) and their class ids (int64 (k,), indices into :data:`SHAPE_LABELS`). The same
    ``rng`` state always gives the same scene.
    """
    h, w = int(hw[0]), int(hw[1])
    if h < 32 or w < 32:
        raise ValueError("scene shape %s is too small (need at least 32x32)" % (hw,))
    if not 0 <= min_objects <= max_objects:
        raise ValueError("need 0 <= min_objects <= max_objects, got %d and %d" % (min_objects, max_objects))
    image = _background(rng, (h, w))
    short = min(h, w)
    boxes: List[np.ndarray] = []
    classes: List[int] = []
    for _ in range(int(rng.integers(min_objects, max_objects + 1))):
        class_id = int(rng.integers(0, len(SHAPE_LABELS)))
        for _ in range(PLACEMENT_TRIES):
            size = float(rng.uniform(MIN_REL_SIZE, MAX_REL_SIZE)) * short
            margin = size * 0.75
            cx = float(rng.uniform(margin, w - margin))
            cy = float(rng.uniform(margin, h - margin))
            angle = float(rng.uniform(-0.5, 0.5))
            if SHAPE_LABELS[class_id] == "circle":
                r = size / 2.0
                box = np.array([cx - r, cy - r, cx + r, cy + r])
                points = None
            else:
                points = _polygon(class_id, cx, cy, size, angle)
                box = np.concatenate([points.min(axis=0), points.max(axis=0)])
            box = np.clip(box, 0, [w, h, w, h])
            if _overlaps(box, boxes):
                continue
            x1, y1, x2, y2 = (int(v) for v in box)
            colour = _contrasting_colour(rng, image[y1 : max(y2, y1 + 1), x1 : max(x2, x1 + 1)])
            if points is None:
                cv2.circle(
                    image, (int(round(cx)), int(round(cy))), int(round(size / 2.0)), colour, -1, cv2.LINE_AA
                )
            else:
                cv2.fillPoly(image, [np.round(points).astype(np.int32)], colour, cv2.LINE_AA)
            boxes.append(box)
            classes.append(class_id)
            break
    box_array = np.array(boxes, dtype=np.float32).reshape(-1, 4)
    return image, box_array, np.array(classes, dtype=np.int64)


def generate_scenes(
    seed: int, count: int, hw: Tuple[int, int], max_objects: int = 6
) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``count`` scenes from one seed: the fixed, reproducible sample set the demo and tests use."""
    rng = np.random.default_rng(seed)
    return [generate_scene(rng, hw, max_objects=max_objects) for _ in range(count)]
